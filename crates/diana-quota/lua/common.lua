-- diana-quota: what every algorithm shares, and the registry they join. Not a script by
-- itself: the service sends Redis ONE script, made of this file, then window.lua,
-- sliding.lua, leaky.lua and token.lua (each adds its algorithm to ALGOS), then decide.lua
-- (the entry point: it documents KEYS and ARGV as a whole and runs the operation over
-- every rule of one request). Each algorithm's header documents its KEYS[i], its part of
-- ARGV, its state and its marks.
--
-- Every algorithm is a table of pure functions over a state table (nothing is written
-- until decide.lua commits):
--   nparams                 how many ARGV values its parameters take
--   parse(argv, p)          its parameters from ARGV[p ..], or nil when they are bad
--   load(key)               the state as stored (a missing key reads as fresh)
--   check(P, S, now, need, want) -> V, S2
--                           grants min(want, available) when at least `need` are
--                           available, else nothing: V is the verdict (below), S2 the
--                           state after it (S itself when nothing is granted). want = 0
--                           is a read-only probe.
--   release(P, S, now, tokens, m1, m2) -> S2 or nil
--                           gives back `tokens` of a grant whose verdict had marks m1, m2
--                           (nil: nothing to change)
--   debt(P, S, now, tokens) -> V, S2   (nil for an algorithm without debts)
--                           charges `tokens` whatever is left
--   store(key, P, S, now)   writes S and its expiry (when S is idle again, plus 1 s)
--   waits                   true when an admitted request may have to wait (delay)
-- A verdict V: granted, remaining, reset, retry, delay (microseconds, rounded up), m1, m2
-- (the marks: where the grant was counted, for a later release).
--
-- The math is the Rust algorithms' (crates/diana-core/src/algo), step for step, clock
-- steps back and garbage included; tests/lua_matches_rust.rs checks that they agree.
--
-- Arithmetic: Lua numbers are doubles; every value stays an integer < 2^53 and divisions
-- are corrected to exact floor division.

local ALGOS = {}

-- floor(a / b) and a - floor(a / b)*b, exactly
local function divmod(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  while r < 0 do q = q - 1; r = r + b end
  while r >= b do q = q + 1; r = r - b end
  return q, r
end

-- an integer as a decimal string, for a Redis argument
local function int(x)
  return string.format('%.0f', x)
end

local function ceil_ms(us)
  local q, r = divmod(us, 1000)
  if r > 0 then q = q + 1 end
  return q
end

-- an integer argument (a whole number), or nil
local function whole(s)
  local x = tonumber(s)
  if x and x == math.floor(x) then return x end
  return nil
end

-- "now" in microseconds since the epoch: `arg` (the tests' clock) when given and not
-- empty, else the server clock (redis TIME), so every gateway uses the same clock
local function clock(arg)
  if arg and arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- `key` expires `ttl_us` from now, plus 1 s
local function expire(key, ttl_us)
  if ttl_us < 0 then ttl_us = 0 end
  redis.call('PEXPIRE', key, int(ceil_ms(ttl_us) + 1000))
end

-- ---------------------------------------------------------------------------------------
-- Exact rational time for the buckets (token.lua, leaky.lua): (us, f) means us + f/den
-- microseconds, 0 <= f < den, where den = rpu.

local function q_le(a_us, a_f, b_us, b_f)
  return a_us < b_us or (a_us == b_us and a_f <= b_f)
end

local function q_add(den, a_us, a_f, b_us, b_f)
  local carry, f = divmod(a_f + b_f, den)
  return a_us + b_us + carry, f
end

-- a - b, or 0 when b >= a
local function q_sub(den, a_us, a_f, b_us, b_f)
  if q_le(a_us, a_f, b_us, b_f) then return 0, 0 end
  local us, f = a_us - b_us, a_f - b_f
  if f < 0 then f = f + den; us = us - 1 end
  return us, f
end

local function q_ceil(us, f)
  if f > 0 then return us + 1 end
  return us
end

-- The buckets' parameters, ARGV[p .. p+4]: den = rpu, T = t_us + t_rem/den (the interval),
-- B = b_us + b_rem/den (burst*T). unit = T*den, the unit in microseconds.
local function bucket_parse(argv, p)
  local P = {
    den = whole(argv[p]), t_us = whole(argv[p + 1]), t_rem = whole(argv[p + 2]),
    b_us = whole(argv[p + 3]), b_rem = whole(argv[p + 4]),
  }
  if not P.den or P.den < 1 or not P.t_us or P.t_us < 0 or not P.t_rem or P.t_rem < 0
      or P.t_rem >= P.den or (P.t_us == 0 and P.t_rem == 0) or not P.b_us or P.b_us < 0
      or not P.b_rem or P.b_rem < 0 or P.b_rem >= P.den then
    return nil
  end
  P.unit = P.t_us * P.den + P.t_rem
  return P
end

-- k*T, exact for k <= 2^20 (k*t_rem < 2^52)
local function bucket_times(P, k)
  local carry, f = divmod(k * P.t_rem, P.den)
  return k * P.t_us + carry, f
end

local EXACT = 1048576

-- the largest k in [0, cap] with k*T <= x (cap <= 2^20): estimate, then correct exactly
local function bucket_fit(P, x_us, x_f, cap)
  local k = math.floor((x_us + x_f / P.den) / (P.t_us + P.t_rem / P.den))
  if k > cap then k = cap end
  if k < 0 then k = 0 end
  while k > 0 do
    local m_us, m_f = bucket_times(P, k)
    if q_le(m_us, m_f, x_us, x_f) then break end
    k = k - 1
  end
  while k < cap do
    local m_us, m_f = bucket_times(P, k + 1)
    if not q_le(m_us, m_f, x_us, x_f) then break end
    k = k + 1
  end
  return k
end

-- the largest k with k*T <= x; exact below 2^20, estimated above (only reported, never granted)
local function bucket_fit_all(P, x_us, x_f)
  local k = bucket_fit(P, x_us, x_f, EXACT)
  if k == EXACT then
    k = math.floor((x_us + x_f / P.den) / (P.t_us + P.t_rem / P.den))
  end
  return k
end

-- the stored instant {u, f}; missing or malformed reads as the epoch (0, 0)
local function bucket_load(key)
  local raw = redis.call('HMGET', key, 'u', 'f')
  local S = { u = whole(raw[1]) or 0, f = whole(raw[2]) or 0 }
  if S.u < 0 or S.f < 0 then S.u, S.f = 0, 0 end
  return S
end

-- max(stored, now), except that a stored instant more than `ahead` plus one unit beyond
-- now cannot come from a clock step and reads as now (garbage)
local function bucket_start(P, S, now, ahead_us, ahead_f)
  local f = S.f
  if f >= P.den then return now, 0 end
  local lim_us, lim_f = q_add(P.den, now, 0, ahead_us + P.unit, ahead_f)
  if not q_le(S.u, f, lim_us, lim_f) then return now, 0 end
  if q_le(S.u, f, now, 0) then return now, 0 end
  return S.u, f
end

local function bucket_store(key, P, S, now)
  redis.call('HSET', key, 'u', int(S.u), 'f', int(S.f))
  expire(key, q_ceil(q_sub(P.den, S.u, S.f, now, 0)))
end
