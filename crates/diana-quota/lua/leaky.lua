-- diana-quota: leaky bucket (LB), a queue with a departure schedule
-- (crates/diana-core/src/algo/leaky.rs).
--
-- Requests leave at one per T = unit/rpu. The state is next_free, the departure time of
-- the next free turn. A request at `now` waits d = max(next_free, now) - now; its place in
-- the queue is ceil(d/T) (0 leaves at once), and the turns free right now are places
-- place..burst: free = burst + 1 - place. A request that needs `need` turns and wants
-- `want` gets min(want, free) consecutive turns if free >= need; the first leaves after
-- d (its delay), the i-th (from 0) at d + i*T, and next_free moves on by granted*T.
-- A denial writes nothing. decide.lua also denies an admitted request whose delay is
-- longer than the gateway accepts (max_delay), before anything is written.
--
-- A release gives the turns back only while they are the last ones reserved (next_free
-- is still the mark the grant returned): moving next_free back past a later request's
-- turn would let two leave in one interval, so such a turn passes unused. No debts.
--
-- Clock going backwards: the queue looks longer until the clock catches up; a next_free
-- more than (burst + 1)*T plus one unit ahead of now reads as an empty queue (garbage).
--
-- Time is kept exactly as a rational number of microseconds, us + f/rpu (no drift).
-- Every number stays an integer < 2^53: now ~ 2^51 us, B is clamped to 2^50 us by the
-- service, k*T is only computed exactly for k <= 2^20.
--
-- KEYS[i]  state: hash `diana:{<key>}:LB:<rpu>:<unit>:<burst>:<slices>`
--          (the counter is bound to its parameters), fields
--            u = integer microseconds of next_free, f = its fraction in 1/rpu microseconds
--          expires when the queue is empty again (next_free) + 1 s
-- ARGV (the rule's parameters, after its code "LB"; see decide.lua for the rest):
--   rpu            the denominator of every fraction (integer >= 1)
--   T us           floor(unit_us / rpu)
--   T fraction     unit_us mod rpu (T = T us + T fraction/rpu)
--   B us           floor(burst*unit_us / rpu), at most 2^50
--   B fraction     (burst*unit_us) mod rpu (B = burst*T)
-- Verdict: remaining = turns still free after this decision; reset = until the queue is
-- empty; retry = until `need` turns are free; delay = d for an admitted request; marks =
-- next_free after the decision (u, f), what a release must find to give turns back.
--
-- The bucket helpers (bucket_*, q_*: exact rational time) come from common.lua.

-- the longest possible queue, (burst + 1)*T
local function lb_ahead(P)
  return q_add(P.den, P.b_us, P.b_rem, P.t_us, P.t_rem)
end

-- turns free when the wait is (w_us, w_f): floor((B - w)/T) + 1, 0 when w > B
local function lb_free(P, w_us, w_f)
  if not q_le(w_us, w_f, P.b_us, P.b_rem) then return 0 end
  local x_us, x_f = q_sub(P.den, P.b_us, P.b_rem, w_us, w_f)
  return bucket_fit_all(P, x_us, x_f) + 1
end

ALGOS.LB = {
  nparams = 5,
  parse = bucket_parse,
  load = bucket_load,
  store = bucket_store,
  waits = true,

  check = function(P, S, now, need, want)
    local den = P.den
    local a_us, a_f = lb_ahead(P)
    local base_us, base_f = bucket_start(P, S, now, a_us, a_f)
    local d_us, d_f = q_sub(den, base_us, base_f, now, 0)
    -- min(want, free)
    local fits = 0
    if want > 0 and q_le(d_us, d_f, P.b_us, P.b_rem) then
      local x_us, x_f = q_sub(den, P.b_us, P.b_rem, d_us, d_f)
      fits = bucket_fit(P, x_us, x_f, want - 1) + 1
    end
    local granted = 0
    if want > 0 and fits >= need then granted = fits end
    local g_us, g_f = bucket_times(P, granted)
    local n_us, n_f = q_add(den, base_us, base_f, g_us, g_f)
    local e_us, e_f = q_sub(den, n_us, n_f, now, 0)
    local V = {
      granted = granted, remaining = lb_free(P, e_us, e_f), reset = q_ceil(e_us, e_f),
      retry = 0, delay = 0, m1 = n_us, m2 = n_f,
    }
    if granted < 1 then
      if want > 0 then
        -- `need` turns are free once the wait is down to (burst + 1 - need)*T
        local k_us, k_f = bucket_times(P, need)
        local c_us, c_f = q_sub(den, a_us, a_f, k_us, k_f)
        local r_us, r_f = q_sub(den, d_us, d_f, c_us, c_f)
        V.retry = math.max(q_ceil(r_us, r_f), 1)
      end
      return V, S
    end
    V.delay = q_ceil(d_us, d_f)
    return V, { u = n_us, f = n_f }
  end,

  release = function(P, S, now, tokens, m1, m2)
    if S.u ~= m1 or S.f ~= m2 then return nil end
    local k_us, k_f = bucket_times(P, tokens)
    local back_us, back_f = q_sub(P.den, m1, m2, k_us, k_f)
    return { u = back_us, f = back_f }
  end,

  debt = nil,
}
