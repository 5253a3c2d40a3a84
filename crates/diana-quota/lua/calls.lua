-- The release ledger of calls with an id (diana_core::quota::ledger): one key per call,
-- `diana:{call:<id>}`, that expires with the ledger's memory. Three operations, each atomic
-- on its one key, so that an acquire and its release meet in either order.
--
-- NOTE (ARGV[1] = 'note'): the acquire of this call granted ARGV[2] (encoded grants).
--   Returns 1 when the release came first (the caller gives the grant back), else 0.
-- TAKE (ARGV[1] = 'take'): the release of this call. Returns the grants to give back, or
--   false when none is known yet (the release is then noted for the acquire to come).
-- ARGV[3] is the memory in milliseconds.
-- PART (ARGV[1] = 'part'): a release of part of one rule's grant. ARGV[2] is the rule's
--   place in the call (from 0), ARGV[3] the tokens to give back, ARGV[4] the counter
--   digest (32 hex digits) of the rule the release names, ARGV[5] the memory in
--   milliseconds (the expiry of an entry that somehow has none). Takes up to that many tokens
--   of that rule's grant, keeping the rest and the key's expiry, and returns them as one
--   grant (`<granted>:<mark hex>:<counter hex>`); returns `rules:<n>` when the call had
--   n rules and none at that place, `counter` when that rule was granted by another
--   counter, and false when nothing is known or left (never noting a release: the
--   acquire, if it is still to come, keeps its grant). diana_core::quota::ledger::Part.
local held = redis.call('GET', KEYS[1])
if ARGV[1] == 'part' then
  if not held or held == 'released' then
    return false
  end
  local parts = {}
  for part in string.gmatch(held, '[^,]+') do
    parts[#parts + 1] = part
  end
  local at = tonumber(ARGV[2]) + 1
  local part = parts[at]
  if not part then
    return 'rules:' .. #parts
  end
  local granted, mark, counter = string.match(part, '^(%d+):(%x+):(%x+)$')
  if not granted then
    return false
  end
  if counter ~= ARGV[4] then
    return 'counter'
  end
  local taken = math.min(tonumber(granted), tonumber(ARGV[3]))
  if taken <= 0 then
    return false
  end
  parts[at] = (tonumber(granted) - taken) .. ':' .. mark .. ':' .. counter
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl <= 0 then
    ttl = ARGV[5]
  end
  redis.call('SET', KEYS[1], table.concat(parts, ','), 'PX', ttl)
  return taken .. ':' .. mark .. ':' .. counter
end
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
