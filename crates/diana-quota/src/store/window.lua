-- diana-quota: the lean script, an `acquire` whose rules are all fixed windows (W).
--
-- Why a second script: the general one (lua/common.lua … lua/decide.lua) decides every
-- algorithm and operation, and on each call Redis runs its whole top level again, which
-- builds every algorithm's functions and tables before deciding anything, then goes
-- through the generic scratch/commit machinery. Measured with redis-benchmark on one
-- W rule (docs/rls.md, "Performance against Limitador"): ~14.5 µs of Redis time per
-- EVALSHA, of which the 4 Redis commands are ~1 µs; this script ~4.7 µs, a script
-- that only returns 1 ~1.7 µs. Most calls are one or a few fixed windows
-- (envoyproxy/ratelimit's only algorithm, the RLS default), so they come here.
--
-- It decides exactly as decide.lua's acquire with window.lua (tests/lean_window.rs runs
-- both on the same random calls and compares every answer and every stored state):
--   - the same state, on the same key `diana:{<key>}:W:<rpu>:<unit>:<burst>:<slices>`:
--     hash fields w (window index, floor(now / unit)) and c (the count), so both scripts
--     (and the general script's charge and release) share the counters;
--   - the same view: a stored window behind the current one, more than one ahead, or not
--     a whole number reads as fresh; a stored window one ahead is kept (a clock that
--     stepped back counts in the later window); a count that is not a whole number is 0;
--   - all or nothing: every rule is checked on a scratch copy (two rules on one key see
--     each other's tentative charge), then either every rule had its need (or is a dry
--     run) and every charged key is written, or nothing is written at all;
--   - the same reply: 8 integers per rule (decide.lua's header).
-- One difference, in the commands only: the expiry. Every writer of a W key (this script,
-- window.lua's store) sets it to the end of the window it writes plus 1 s (rounded up to
-- the ms), and HSET keeps a key's expiry, so while the stored window stays the same the
-- key already expires then: PEXPIRE runs only when a key enters a new window (a fresh
-- key included), not on every call. Every key still has its expiry.
--
-- KEYS[i]  the state of rule i (window.lua's header)
-- ARGV[1]  "now" in microseconds since the epoch (tests only); empty -> the server clock
--          (redis TIME), so every gateway and replica uses the same clock
-- ARGV[2..] five per rule, in KEYS order: rpu (>= 1), unit in µs (>= 1), need (the cost,
--          >= 1), want (>= need), dry_run (1: the rule's denial stops nobody)
--
-- Arithmetic: integers < 2^53 only (now ~ 2^51 µs); written with %.0f, as window.lua.

local floor = math.floor
local n = #KEYS
if n < 1 or #ARGV ~= 1 + 5 * n then return redis.error_reply('ERR diana: bad arguments') end

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
  if not now then return redis.error_reply('ERR diana: bad clock') end
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- rule i's parameters, checked as window.lua's parse and decide.lua do
local function params(i)
  local p = 2 + 5 * (i - 1)
  local rpu, unit = tonumber(ARGV[p]), tonumber(ARGV[p + 1])
  local need, want = tonumber(ARGV[p + 2]), tonumber(ARGV[p + 3])
  if not rpu or rpu < 1 or rpu ~= floor(rpu) or not unit or unit < 1 or unit ~= floor(unit) then
    return nil, redis.error_reply('ERR diana: rules[' .. (i - 1) .. ']: bad parameters')
  end
  if not need or not want or need < 1 or want < need or need ~= floor(need)
      or want ~= floor(want) then
    return nil, redis.error_reply('ERR diana: rules[' .. (i - 1) .. ']: bad need or want')
  end
  return rpu, unit, need, want, ARGV[p + 4] == '1'
end

-- The stored window (nil when missing or not whole), its count (0 when missing or not
-- whole), and the window and count the call works on (window.lua's w_view).
local function load(key, unit)
  local raw = redis.call('HMGET', key, 'w', 'c')
  local sw, c = tonumber(raw[1]), tonumber(raw[2])
  if sw and sw ~= floor(sw) then sw = nil end
  if not c or c ~= floor(c) then c = 0 end
  -- floor(now / unit), exactly (the division may round across a boundary)
  local w = floor(now / unit)
  local r = now - w * unit
  while r < 0 do w = w - 1; r = r + unit end
  while r >= unit do w = w + 1; r = r - unit end
  if not sw or sw < w or sw > w + 1 then return sw, w, 0 end
  return sw, sw, c
end

-- Writes count c in window w; the expiry only when the stored window was another one.
local function store(key, sw, w, c, unit)
  if sw == w then
    redis.call('HSET', key, 'c', string.format('%.0f', c))
    return
  end
  redis.call('HSET', key, 'w', string.format('%.0f', w), 'c', string.format('%.0f', c))
  local ttl = (w + 1) * unit - now
  if ttl < 0 then ttl = 0 end
  local ms = floor(ttl / 1000)
  if ms * 1000 < ttl then ms = ms + 1 end
  redis.call('PEXPIRE', key, string.format('%.0f', ms + 1000))
end

-- microseconds from now to the end of window w
local function until_end(w, unit)
  local reset = (w + 1) * unit - now
  if reset < 0 then return 0 end
  return reset
end

if n == 1 then
  -- One rule, the common case: no scratch tables.
  local rpu, unit, need, want, dry = params(1)
  if not rpu then return unit end
  local key = KEYS[1]
  local sw, w, c = load(key, unit)
  local reset = until_end(w, unit)
  local available = rpu - c
  if available < 0 then available = 0 end
  if available >= need then
    local granted = want
    if granted > available then granted = available end
    store(key, sw, w, c + granted, unit)
    return { 1, granted, available - granted, reset, 0, 0, w, 0 }
  end
  -- a denial writes nothing; a dry run's too (decide.lua: put(0, 0, V, V.retry, …))
  local retry = reset
  if retry < 1 then retry = 1 end
  return { 0, 0, available, reset, retry, 0, 0, 0 }
end

-- Several rules. Per key: {sw, w, c0 (the count as stored, viewed), c (scratch), unit,
-- dirty}; per rule: its verdict.
local states, keys = {}, {}
local rule_w, rule_granted, rule_available, rule_rpu = {}, {}, {}, {}
local all = true
for i = 1, n do
  local rpu, unit, need, want, dry = params(i)
  if not rpu then return unit end
  local key = KEYS[i]
  local S = states[key]
  if not S then
    local sw, w, c = load(key, unit)
    S = { sw = sw, w = w, c0 = c, c = c, unit = unit, dirty = false }
    states[key] = S
    keys[#keys + 1] = key
  end
  local available = rpu - S.c
  if available < 0 then available = 0 end
  rule_w[i], rule_available[i], rule_rpu[i] = S.w, available, rpu
  if available >= need then
    local granted = want
    if granted > available then granted = available end
    rule_granted[i] = granted
    S.c = S.c + granted
    S.dirty = true
  else
    rule_granted[i] = 0
    if not dry then all = false end
  end
end

if all then
  for _, key in ipairs(keys) do
    local S = states[key]
    if S.dirty then store(key, S.sw, S.w, S.c, S.unit) end
  end
end

local reply = {}
for i = 1, n do
  local S = states[KEYS[i]]
  local reset = until_end(rule_w[i], S.unit)
  local granted, j = rule_granted[i], 8 * (i - 1)
  if all and granted > 0 then
    reply[j + 1], reply[j + 2], reply[j + 3], reply[j + 4] = 1, granted, rule_available[i] - granted, reset
    reply[j + 5], reply[j + 6], reply[j + 7], reply[j + 8] = 0, 0, rule_w[i], 0
  elseif granted > 0 then
    -- had enough, but another rule did not: not charged; what the stored count offers
    local left = rule_rpu[i] - S.c0
    if left < 0 then left = 0 end
    reply[j + 1], reply[j + 2], reply[j + 3], reply[j + 4] = 1, 0, left, until_end(S.w, S.unit)
    reply[j + 5], reply[j + 6], reply[j + 7], reply[j + 8] = 0, 0, 0, 0
  else
    local retry = reset
    if retry < 1 then retry = 1 end
    reply[j + 1], reply[j + 2], reply[j + 3], reply[j + 4] = 0, 0, rule_available[i], reset
    reply[j + 5], reply[j + 6], reply[j + 7], reply[j + 8] = retry, 0, 0, 0
  end
end
return reply
