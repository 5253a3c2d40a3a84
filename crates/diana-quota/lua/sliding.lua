-- diana-quota: sliding window (SW). One atomic decision for one counter.
--
-- The unit is split into `slices` slices, aligned to the unit from the Unix epoch:
-- slice i covers [start(i), start(i+1)) with start(i) = q*unit + ceil(s*unit/slices)
-- where i = q*slices + s. A request at `now` falls in slice cur = floor(now*slices/unit).
-- It is allowed while the sum of the last `slices` slices (cur included) is < rpu;
-- granted = min(want, rpu - sum), so no window of one unit aligned to slice boundaries
-- ever holds more than rpu tokens. A denied request writes nothing.
--
-- KEYS[1]  state: hash `diana:{<key>}:SW`, field = absolute slice index (decimal),
--          value = tokens granted in that slice. Fields that left the window are deleted
--          on the next write; the key expires when its newest slice leaves the window + 1 s.
-- ARGV[1]  rpu: tokens per unit, integer >= 1
-- ARGV[2]  unit in microseconds (1e6 second, 6e7 minute, 3.6e9 hour, 8.64e10 day)
-- ARGV[3]  slices per unit, integer 1..60
-- ARGV[4]  want: tokens asked for, integer >= 1
-- ARGV[5]  optional, tests only: "now" in microseconds since the epoch; absent or empty ->
--          the server clock (redis TIME)
--
-- Returns {granted, remaining, reset_us, retry_after_us, delay_us}:
--   granted        tokens granted, 0..want (0 = denied)
--   remaining      rpu - sum after this decision
--   reset_us       microseconds until every counted slice has left the window
--   retry_after_us when denied: microseconds until enough old slices have left for the sum
--                  to drop below rpu; else 0
--   delay_us       always 0
--
-- Arithmetic: integers < 2^53 only (now ~ 2^51 us, (now mod unit)*slices < 2^43),
-- divisions corrected to exact floor division.
--
-- divmod, int, clock and expire come from common.lua, which is put in front of this file.

local rpu = tonumber(ARGV[1])
local unit = tonumber(ARGV[2])
local slices = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
if not rpu or rpu < 1 or not unit or unit < 1 or not slices or slices < 1 or not want or want < 1 then
  return redis.error_reply('ERR diana sliding.lua: bad arguments')
end

local now = clock(ARGV[5])

-- start time (us) of absolute slice i
local function slice_start(i)
  local q, s = divmod(i, slices)
  local offset, rest = divmod(s * unit, slices)
  if rest > 0 then offset = offset + 1 end
  return q * unit + offset
end

local q, into = divmod(now, unit)
local s = divmod(into * slices, unit)
local cur = q * slices + s
local oldest = cur - slices + 1

local flat = redis.call('HGETALL', KEYS[1])
local counts = {}
local indices = {}
local stale = {}
local sum = 0
for n = 1, #flat, 2 do
  local index = tonumber(flat[n])
  local count = tonumber(flat[n + 1]) or 0
  if index and index >= oldest and count > 0 then
    counts[index] = count
    indices[#indices + 1] = index
    sum = sum + count
  else
    stale[#stale + 1] = flat[n]
  end
end
table.sort(indices)

local available = rpu - sum
if available < 0 then available = 0 end
local granted = math.min(want, available)

if granted < 1 then
  local newest = indices[#indices]
  local reset = slice_start(newest + slices) - now
  local retry = reset
  local running = sum
  for _, index in ipairs(indices) do
    running = running - counts[index]
    if running < rpu then
      retry = slice_start(index + slices) - now
      break
    end
  end
  return {0, 0, reset, retry, 0}
end

redis.call('HINCRBY', KEYS[1], int(cur), int(granted))
if #stale > 0 then
  redis.call('HDEL', KEYS[1], unpack(stale))
end
local newest = cur
if #indices > 0 and indices[#indices] > newest then
  newest = indices[#indices]
end
local reset = slice_start(newest + slices) - now
expire(reset)
return {granted, available - granted, reset, 0, 0}
