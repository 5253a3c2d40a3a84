-- The fleet's breaker states (POST /v1/report): one key per state,
-- `diana:{breaker:<key>}:B:<parameters>`, holding the state machine's record as the Rust
-- code encodes it (diana_core::breaker::Record). The machine runs in the service, in
-- Rust (src/store/breakers.rs); this script only reads and swaps, atomically on its one
-- key, so that a state changes only from the value the machine started from (optimistic
-- concurrency: the caller reads again and retries when another replica wrote first).
--
-- READ (ARGV[1] = 'read'): returns {value or '', 1 if the key exists else 0, TIME seconds,
--   TIME microseconds}: the state and the instant the machine runs at.
-- SWAP (ARGV[1] = 'swap'): ARGV[2] 1 when the key existed at the read, ARGV[3] the value
--   read, ARGV[4] the new value, ARGV[5] its time to live in milliseconds. Writes only
--   when the key still holds what was read (or still does not exist). Returns 1 when
--   written, 0 when the key changed since the read.
local held = redis.call('GET', KEYS[1])
if ARGV[1] == 'read' then
  local now = redis.call('TIME')
  if held then
    return {held, 1, tonumber(now[1]), tonumber(now[2])}
  end
  return {'', 0, tonumber(now[1]), tonumber(now[2])}
end
local unchanged
if ARGV[2] == '1' then
  unchanged = (held == ARGV[3])
else
  unchanged = (not held)
end
if not unchanged then
  return 0
end
redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
return 1
