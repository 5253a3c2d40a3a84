-- diana-quota: token bucket (TB) as GCRA (crates/diana-core/src/algo/token.rs).
--
-- Capacity `burst`, refilled continuously at rpu per unit, fractional tokens kept.
-- Equivalent GCRA form: emission interval T = unit/rpu, tolerance B = burst*T, state TAT
-- (theoretical arrival time; the bucket is full when TAT <= now). With d = max(TAT, now) -
-- now (the debt), the bucket holds floor((B - d)/T) tokens; a request that needs `need`
-- and wants `want` gets min(want, that) if that >= need, and TAT becomes max(TAT, now) +
-- granted*T. A denial writes nothing.
--
-- Debts (a response cost charged past the limit): TAT moves on by tokens*T, but never
-- beyond now + 2*B (an empty bucket owing one more bucket); requests are denied until the
-- refill has paid the debt back. A release moves TAT back by what of the grant has not
-- refilled yet: the grant's span of TAT ends at its mark, tokens*T long, and only the part
-- still ahead of now comes back (the rest has refilled already); never before now (never
-- fuller than full).
--
-- Clock going backwards: the bucket looks emptier until the clock catches up; a TAT more
-- than 2*B plus one unit ahead of now cannot come from a clock step and reads as a full
-- bucket (garbage).
--
-- No drift: time is kept exactly as a rational number of microseconds, us + f/rpu, so
-- T = unit/rpu is exact. Every number stays an integer < 2^53: now ~ 2^51 us, B is clamped
-- to 2^50 us by the service, k*T is only computed exactly for k <= 2^20.
--
-- KEYS[i]  state: hash `diana:{<key>}:TB:<rpu>:<unit>:<burst>:<slices>`
--          (the counter is bound to its parameters), fields
--            u = integer microseconds of TAT, f = its fraction in 1/rpu microseconds
--          expires when the bucket is full again (TAT) + 1 s; a debt pushes TAT, and so
--          the expiry, further
-- ARGV (the rule's parameters, after its code "TB"; see decide.lua for the rest):
--   rpu            the denominator of every fraction (integer >= 1)
--   T us           floor(unit_us / rpu)
--   T fraction     unit_us mod rpu (T = T us + T fraction/rpu)
--   B us           floor(burst*unit_us / rpu), at most 2^50
--   B fraction     (burst*unit_us) mod rpu (B = burst*T)
-- Verdict: remaining = whole tokens left; reset = until the bucket is full; retry = until
-- `need` tokens are there; delay = 0; marks: the TAT after a grant (us, fraction), else 0.
--
-- The bucket helpers (bucket_*, q_*: exact rational time) come from common.lua.

-- 2*B, the deepest debt
local function tb_ahead(P)
  return q_add(P.den, P.b_us, P.b_rem, P.b_us, P.b_rem)
end

-- tokens left at debt (d_us, d_f): floor((B - d)/T), 0 when d > B
local function tb_available(P, d_us, d_f)
  if not q_le(d_us, d_f, P.b_us, P.b_rem) then return 0 end
  local x_us, x_f = q_sub(P.den, P.b_us, P.b_rem, d_us, d_f)
  return bucket_fit_all(P, x_us, x_f)
end

ALGOS.TB = {
  nparams = 5,
  parse = bucket_parse,
  load = bucket_load,
  store = bucket_store,
  waits = false,

  check = function(P, S, now, need, want)
    local den = P.den
    local a_us, a_f = tb_ahead(P)
    local base_us, base_f = bucket_start(P, S, now, a_us, a_f)
    local d_us, d_f = q_sub(den, base_us, base_f, now, 0)
    -- min(want, available)
    local fits = 0
    if want > 0 and q_le(d_us, d_f, P.b_us, P.b_rem) then
      local x_us, x_f = q_sub(den, P.b_us, P.b_rem, d_us, d_f)
      fits = bucket_fit(P, x_us, x_f, want)
    end
    local granted = 0
    if want > 0 and fits >= need then granted = fits end
    local g_us, g_f = bucket_times(P, granted)
    local n_us, n_f = q_add(den, base_us, base_f, g_us, g_f)
    local e_us, e_f = q_sub(den, n_us, n_f, now, 0)
    local V = {
      granted = granted, remaining = tb_available(P, e_us, e_f), reset = q_ceil(e_us, e_f),
      retry = 0, delay = 0, m1 = 0, m2 = 0,
    }
    if granted >= 1 then V.m1, V.m2 = n_us, n_f end
    if granted < 1 then
      if want > 0 then
        -- `need` tokens are there once the debt is down to B - need*T
        local k_us, k_f = bucket_times(P, need)
        local c_us, c_f = q_sub(den, P.b_us, P.b_rem, k_us, k_f)
        local r_us, r_f = q_sub(den, d_us, d_f, c_us, c_f)
        V.retry = math.max(q_ceil(r_us, r_f), 1)
      end
      return V, S
    end
    return V, { u = n_us, f = n_f }
  end,

  release = function(P, S, now, tokens, m1, m2)
    -- the grant's span ends at its mark: nothing of it is ahead of now, all has refilled
    if q_le(m1, m2, now, 0) then return nil end
    local a_us, a_f = tb_ahead(P)
    local base_us, base_f = bucket_start(P, S, now, a_us, a_f)
    local k_us, k_f = bucket_times(P, tokens)
    local o_us, o_f = q_sub(P.den, m1, m2, now, 0)
    if q_le(o_us, o_f, k_us, k_f) then k_us, k_f = o_us, o_f end
    local back_us, back_f = q_sub(P.den, base_us, base_f, k_us, k_f)
    if q_le(back_us, back_f, now, 0) then back_us, back_f = now, 0 end
    if back_us == base_us and back_f == base_f then return nil end
    return { u = back_us, f = back_f }
  end,

  debt = function(P, S, now, tokens)
    local den = P.den
    local a_us, a_f = tb_ahead(P)
    local base_us, base_f = bucket_start(P, S, now, a_us, a_f)
    local k_us, k_f = bucket_times(P, tokens)
    local n_us, n_f = q_add(den, base_us, base_f, k_us, k_f)
    local cap_us, cap_f = q_add(den, now, 0, a_us, a_f)
    if not q_le(n_us, n_f, cap_us, cap_f) then n_us, n_f = cap_us, cap_f end
    -- never below the stored TAT (a clock that stepped back puts the cap before it)
    if not q_le(base_us, base_f, n_us, n_f) then n_us, n_f = base_us, base_f end
    local d_us, d_f = q_sub(den, n_us, n_f, now, 0)
    local available = tb_available(P, d_us, d_f)
    local V = {
      granted = 0, remaining = available, reset = q_ceil(d_us, d_f), retry = 0, delay = 0,
      m1 = 0, m2 = 0,
    }
    if available < 1 then
      -- one token is there once the debt is down to B - T
      local c_us, c_f = q_sub(den, P.b_us, P.b_rem, P.t_us, P.t_rem)
      local r_us, r_f = q_sub(den, d_us, d_f, c_us, c_f)
      V.retry = math.max(q_ceil(r_us, r_f), 1)
    end
    return V, { u = n_us, f = n_f }
  end,
}
