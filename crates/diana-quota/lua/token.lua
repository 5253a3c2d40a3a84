-- diana-quota: token bucket (TB) as GCRA. One atomic decision for one counter.
--
-- Capacity `burst`, refilled continuously at rpu per unit, fractional tokens kept.
-- Equivalent GCRA form: emission interval T = unit/rpu, tolerance B = burst*T,
-- state TAT (theoretical arrival time; the bucket is full when TAT <= now).
-- With d = max(TAT, now) - now, the bucket holds (B - d)/T tokens; a request for `want`
-- gets granted = min(want, floor((B - d)/T)) and TAT becomes max(TAT, now) + granted*T.
-- A denied request writes nothing.
--
-- No drift: time is kept exactly as a rational number of microseconds, us + f/rpu,
-- so T = unit/rpu is exact and refills never lose fractions. Every number stays an
-- integer < 2^53 (Lua numbers are doubles): now ~ 2^51 us, B is clamped to 2^50 us by
-- the caller, k*T is only computed exactly for k <= 2^20.
--
-- KEYS[1]  state: hash `diana:{<key>}:TB` with fields
--            u = integer microseconds of TAT, f = fraction of TAT in 1/rpu microseconds
--          expires when the bucket is full again (TAT) + 1 s (PEXPIRE on every write)
-- ARGV[1]  rpu: the denominator of every fraction (integer >= 1)
-- ARGV[2]  T microseconds: floor(unit_us / rpu)
-- ARGV[3]  T fraction: unit_us mod rpu (T = ARGV[2] + ARGV[3]/rpu)
-- ARGV[4]  B microseconds: floor(burst*unit_us / rpu), at most 2^50
-- ARGV[5]  B fraction: (burst*unit_us) mod rpu (B = burst*T = ARGV[4] + ARGV[5]/rpu)
-- ARGV[6]  want: tokens asked for, integer >= 1
-- ARGV[7]  optional, tests only: "now" in microseconds since the epoch; absent or empty ->
--          the server clock (redis TIME), so every gateway uses the same clock
--
-- Returns {granted, remaining, reset_us, retry_after_us, delay_us}:
--   granted        tokens granted, 0..want (0 = denied)
--   remaining      whole tokens left in the bucket after this decision
--   reset_us       microseconds until the bucket is full again
--   retry_after_us when denied: microseconds until one token is available; else 0
--   delay_us       always 0
local function divmod(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  while r < 0 do q = q - 1; r = r + b end
  while r >= b do q = q + 1; r = r - b end
  return q, r
end

local function int(x)
  return string.format('%.0f', x)
end

local function ceil_ms(us)
  local q, r = divmod(us, 1000)
  if r > 0 then q = q + 1 end
  return q
end

local den = tonumber(ARGV[1])
local t_us = tonumber(ARGV[2])
local t_rem = tonumber(ARGV[3])
local b_us = tonumber(ARGV[4])
local b_rem = tonumber(ARGV[5])
local want = tonumber(ARGV[6])
if not den or den < 1 or not t_us or t_us < 0 or not t_rem or t_rem < 0 or t_rem >= den
    or (t_us == 0 and t_rem == 0) or not b_us or b_us < 0 or not b_rem or b_rem < 0
    or b_rem >= den or not want or want < 1 then
  return redis.error_reply('ERR diana token.lua: bad arguments')
end

local now
if ARGV[7] and ARGV[7] ~= '' then
  now = tonumber(ARGV[7])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Exact rational time: (us, f) means us + f/den microseconds, 0 <= f < den.
local function le(a_us, a_f, b_us, b_f)
  return a_us < b_us or (a_us == b_us and a_f <= b_f)
end
local function add(a_us, a_f, b_us, b_f)
  local carry, f = divmod(a_f + b_f, den)
  return a_us + b_us + carry, f
end
local function sub(a_us, a_f, b_us, b_f) -- a - b, with a >= b
  local us, f = a_us - b_us, a_f - b_f
  if f < 0 then f = f + den; us = us - 1 end
  return us, f
end
local function ceil_us(us, f)
  if f > 0 then return us + 1 end
  return us
end
-- k*T, exact for k <= 2^20 (k*t_rem < 2^52)
local function times_t(k)
  local carry, f = divmod(k * t_rem, den)
  return k * t_us + carry, f
end
local EXACT = 1048576
-- the largest k in [0, cap] with k*T <= x (cap <= 2^20): estimate, then correct exactly
local function fit(x_us, x_f, cap)
  local k = math.floor((x_us + x_f / den) / (t_us + t_rem / den))
  if k > cap then k = cap end
  if k < 0 then k = 0 end
  while k > 0 do
    local m_us, m_f = times_t(k)
    if le(m_us, m_f, x_us, x_f) then break end
    k = k - 1
  end
  while k < cap do
    local m_us, m_f = times_t(k + 1)
    if not le(m_us, m_f, x_us, x_f) then break end
    k = k + 1
  end
  return k
end
-- the largest k with k*T <= x; exact below 2^20, estimated above (only reported, never granted)
local function fit_all(x_us, x_f)
  local k = fit(x_us, x_f, EXACT)
  if k == EXACT then
    k = math.floor((x_us + x_f / den) / (t_us + t_rem / den))
  end
  return k
end

local state = redis.call('HMGET', KEYS[1], 'u', 'f')
local tat_us = tonumber(state[1]) or 0
local tat_f = tonumber(state[2]) or 0
if tat_us < 0 or tat_f < 0 or tat_f >= den then
  tat_us, tat_f = 0, 0
end
-- base = max(TAT, now); d = base - now >= 0
local base_us, base_f = tat_us, tat_f
if le(tat_us, tat_f, now, 0) then
  base_us, base_f = now, 0
end
local d_us, d_f = sub(base_us, base_f, now, 0)

local granted = 0
if le(d_us, d_f, b_us, b_rem) then
  local x_us, x_f = sub(b_us, b_rem, d_us, d_f)
  granted = fit(x_us, x_f, want)
end

if granted < 1 then
  -- one token is there when d + T <= B, i.e. after d + T - B
  local w_us, w_f = add(d_us, d_f, t_us, t_rem)
  local r_us, r_f = sub(w_us, w_f, b_us, b_rem)
  return {0, 0, ceil_us(d_us, d_f), ceil_us(r_us, r_f), 0}
end

local g_us, g_f = times_t(granted)
local n_us, n_f = add(base_us, base_f, g_us, g_f)
local e_us, e_f = sub(n_us, n_f, now, 0)
local x_us, x_f = sub(b_us, b_rem, e_us, e_f)
local remaining = fit_all(x_us, x_f)
local reset = ceil_us(e_us, e_f)
redis.call('HSET', KEYS[1], 'u', int(n_us), 'f', int(n_f))
redis.call('PEXPIRE', KEYS[1], int(ceil_ms(reset) + 1000))
return {granted, remaining, reset, 0, 0}
