-- diana-quota: leaky bucket (LB), as a queue with a departure schedule. One atomic
-- decision for one counter.
--
-- Requests leave at one per T = unit/rpu. A request arriving while the bucket is busy
-- waits for its turn: its delay d = max(TAT, now) - now, where TAT (theoretical arrival
-- time) is the departure time of the next free slot. At most `burst` requests wait: a
-- request is admitted when d <= B = burst*T, and the next one is rejected at once.
-- A request for `want` tokens gets the next granted = min(want, floor((B - d)/T) + 1)
-- slots; the i-th granted token (from 0) leaves at now + d + i*T, and TAT becomes
-- max(TAT, now) + granted*T. A denied request writes nothing.
--
-- Time is kept exactly as a rational number of microseconds, us + f/rpu (no drift).
-- Every number stays an integer < 2^53 (Lua numbers are doubles): now ~ 2^51 us, B is
-- clamped to 2^50 us by the caller, k*T is only computed exactly for k <= 2^20.
--
-- KEYS[1]  state: hash `diana:{<key>}:LB` with fields
--            u = integer microseconds of TAT, f = fraction of TAT in 1/rpu microseconds
--          expires when the queue is empty again (TAT) + 1 s (PEXPIRE on every write)
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
--   remaining      requests that could still be queued right now after this decision
--   reset_us       microseconds until the queue is empty again (TAT - now)
--   retry_after_us when denied: microseconds until a place in the queue frees (d - B); else 0
--   delay_us       when granted: microseconds the first granted request must wait (d); else 0
--
-- gcra (arguments, clock, stored TAT, exact rational time) comes from common.lua, which
-- is put in front of this file.

local g, bad = gcra('leaky.lua')
if not g then return bad end
local le, sub, ceil_us = g.le, g.sub, g.ceil_us
local d_us, d_f, b_us, b_rem = g.d_us, g.d_f, g.b_us, g.b_rem

local granted = 0
if le(d_us, d_f, b_us, b_rem) then
  local x_us, x_f = sub(b_us, b_rem, d_us, d_f)
  granted = g.fit(x_us, x_f, g.want - 1) + 1
end

if granted < 1 then
  local r_us, r_f = sub(d_us, d_f, b_us, b_rem)
  return {0, 0, ceil_us(d_us, d_f), ceil_us(r_us, r_f), 0}
end

local e_us, e_f, reset = g.take(granted)
local remaining = 0
if le(e_us, e_f, b_us, b_rem) then
  local x_us, x_f = sub(b_us, b_rem, e_us, e_f)
  remaining = g.fit_all(x_us, x_f) + 1
end
return {granted, remaining, reset, 0, ceil_us(d_us, d_f)}
