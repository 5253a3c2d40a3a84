-- diana-quota: fixed window (W). One atomic decision for one counter.
--
-- Windows are aligned to the unit from the Unix epoch (UTC): window n covers
-- [n*unit, (n+1)*unit). At most `rpu` tokens are granted per window;
-- granted = min(want, rpu - count). A denied request writes nothing.
--
-- KEYS[1]  state: hash `diana:{<key>}:W` with fields
--            w = index of the window the count belongs to (floor(now / unit))
--            c = tokens granted in window w
--          expires at the end of window w + 1 s (PEXPIRE on every write)
-- ARGV[1]  rpu: tokens per window, integer >= 1
-- ARGV[2]  unit: window length in microseconds (1e6 second, 6e7 minute, 3.6e9 hour, 8.64e10 day)
-- ARGV[3]  want: tokens asked for, integer >= 1
-- ARGV[4]  optional, tests only: "now" in microseconds since the epoch; absent or empty ->
--          the server clock (redis TIME), so every gateway uses the same clock
--
-- Returns {granted, remaining, reset_us, retry_after_us, delay_us}:
--   granted        tokens granted, 0..want (0 = denied)
--   remaining      tokens still available in this window after this decision
--   reset_us       microseconds until the window ends (the count starts again at 0)
--   retry_after_us when denied: microseconds until a token is available (the window end); else 0
--   delay_us       always 0
--
-- Arithmetic: Lua numbers are doubles; every value here is an integer < 2^53
-- (now ~ 2^51 microseconds), and divisions are corrected to exact floor division.
--
-- divmod, int, clock and expire come from common.lua, which is put in front of this file.

local rpu = tonumber(ARGV[1])
local unit = tonumber(ARGV[2])
local want = tonumber(ARGV[3])
if not rpu or rpu < 1 or not unit or unit < 1 or not want or want < 1 then
  return redis.error_reply('ERR diana window.lua: bad arguments')
end

local now = clock(ARGV[4])

local window, into = divmod(now, unit)
local reset = unit - into

local state = redis.call('HMGET', KEYS[1], 'w', 'c')
local count = 0
if tonumber(state[1]) == window then
  count = tonumber(state[2]) or 0
end

local available = rpu - count
if available < 0 then available = 0 end
local granted = math.min(want, available)
if granted < 1 then
  return {0, 0, reset, reset, 0}
end

redis.call('HSET', KEYS[1], 'w', int(window), 'c', int(count + granted))
expire(reset)
return {granted, available - granted, reset, 0, 0}
