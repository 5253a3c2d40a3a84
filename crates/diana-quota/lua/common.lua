-- diana-quota: the helpers every script shares. Not a script itself: it is put in front
-- of window.lua, sliding.lua, leaky.lua and token.lua when the service is built
-- (src/store/redis.rs), and the text sent to Redis (and hashed for EVALSHA) is this file
-- followed by the algorithm's. Each algorithm's own header documents its KEYS, ARGV and
-- reply.
--
-- Arithmetic: Lua numbers are doubles; every value stays an integer < 2^53 and divisions
-- are corrected to exact floor division.

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

-- "now" in microseconds since the epoch: `arg` (the tests' clock) when given and not
-- empty, else the server clock (redis TIME), so every gateway uses the same clock
local function clock(arg)
  if arg and arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- KEYS[1] expires `reset_us` from now, plus 1 s
local function expire(reset_us)
  redis.call('PEXPIRE', KEYS[1], int(ceil_ms(reset_us) + 1000))
end

-- token.lua and leaky.lua: GCRA on the hash KEYS[1] {u, f} (TAT), ARGV[1..7] as their
-- headers document them. Reads and checks the arguments, then the clock and the stored
-- TAT. Returns nil and an error reply naming `script` for bad arguments, else a table:
--   t_us, t_rem, b_us, b_rem, want   the arguments: T, B and want
--   d_us, d_f             d = max(TAT, now) - now >= 0
--   le, add, sub, ceil_us, fit, fit_all   exact rational time (below)
--   take(granted)         writes TAT = max(TAT, now) + granted*T and its expiry; returns
--                         e_us, e_f, reset_us: e = the new TAT - now, reset_us = ceil(e)
local function gcra(script)
  local den = tonumber(ARGV[1])
  local t_us = tonumber(ARGV[2])
  local t_rem = tonumber(ARGV[3])
  local b_us = tonumber(ARGV[4])
  local b_rem = tonumber(ARGV[5])
  local want = tonumber(ARGV[6])
  if not den or den < 1 or not t_us or t_us < 0 or not t_rem or t_rem < 0 or t_rem >= den
      or (t_us == 0 and t_rem == 0) or not b_us or b_us < 0 or not b_rem or b_rem < 0
      or b_rem >= den or not want or want < 1 then
    return nil, redis.error_reply('ERR diana ' .. script .. ': bad arguments')
  end

  local now = clock(ARGV[7])

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

  local function take(granted)
    local g_us, g_f = times_t(granted)
    local n_us, n_f = add(base_us, base_f, g_us, g_f)
    local e_us, e_f = sub(n_us, n_f, now, 0)
    local reset = ceil_us(e_us, e_f)
    redis.call('HSET', KEYS[1], 'u', int(n_us), 'f', int(n_f))
    expire(reset)
    return e_us, e_f, reset
  end

  return {
    t_us = t_us, t_rem = t_rem, b_us = b_us, b_rem = b_rem, want = want, d_us = d_us,
    d_f = d_f, le = le, add = add, sub = sub, ceil_us = ceil_us, fit = fit,
    fit_all = fit_all, take = take,
  }
end
