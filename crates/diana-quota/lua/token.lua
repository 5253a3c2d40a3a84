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
--
-- gcra (arguments, clock, stored TAT, exact rational time) comes from common.lua, which
-- is put in front of this file.

local g, bad = gcra('token.lua')
if not g then return bad end
local le, add, sub, ceil_us = g.le, g.add, g.sub, g.ceil_us
local d_us, d_f, b_us, b_rem = g.d_us, g.d_f, g.b_us, g.b_rem

local granted = 0
if le(d_us, d_f, b_us, b_rem) then
  local x_us, x_f = sub(b_us, b_rem, d_us, d_f)
  granted = g.fit(x_us, x_f, g.want)
end

if granted < 1 then
  -- one token is there when d + T <= B, i.e. after d + T - B
  local w_us, w_f = add(d_us, d_f, g.t_us, g.t_rem)
  local r_us, r_f = sub(w_us, w_f, b_us, b_rem)
  return {0, 0, ceil_us(d_us, d_f), ceil_us(r_us, r_f), 0}
end

local e_us, e_f, reset = g.take(granted)
local x_us, x_f = sub(b_us, b_rem, e_us, e_f)
local remaining = g.fit_all(x_us, x_f)
return {granted, remaining, reset, 0, 0}
