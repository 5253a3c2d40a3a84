-- The release ledger of calls with an id (diana_core::quota::ledger): one key per call,
-- `diana:{call:<id>}`, that expires with the ledger's memory. Two scripts, each atomic on
-- its one key, so that an acquire and its release meet in either order.
--
-- NOTE (ARGV[1] = 'note'): the acquire of this call granted ARGV[2] (encoded grants).
--   Returns 1 when the release came first (the caller gives the grant back), else 0.
-- TAKE (ARGV[1] = 'take'): the release of this call. Returns the grants to give back, or
--   false when none is known yet (the release is then noted for the acquire to come).
-- ARGV[3] is the memory in milliseconds.
local held = redis.call('GET', KEYS[1])
if ARGV[1] == 'note' then
  if held == 'released' then
    redis.call('DEL', KEYS[1])
    return 1
  end
  if not held then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  end
  return 0
end
if not held then
  redis.call('SET', KEYS[1], 'released', 'PX', ARGV[3])
  return false
end
if held == 'released' then
  return false
end
redis.call('DEL', KEYS[1])
return held
