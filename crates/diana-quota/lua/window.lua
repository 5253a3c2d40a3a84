-- diana-quota: fixed window (W) (crates/diana-core/src/algo/window.rs).
--
-- Windows are aligned to the unit from the Unix epoch (UTC): window n covers
-- [n*unit, (n+1)*unit). At most `rpu` tokens are granted per window: a request that needs
-- `need` and wants `want` gets min(want, rpu - count) if that is >= need. A denial writes
-- nothing.
--
-- Clock going backwards: a request is counted in the stored, later window, never in an
-- earlier one; a stored window more than one window ahead of the clock reads as fresh
-- (garbage). Debts leave the count above rpu until the window ends. A release takes the
-- tokens off the count if their window (the mark) is still the stored one.
--
-- KEYS[i]  state: hash `diana:{<key>}:W:<rpu>:<unit>:<burst>:<slices>`
--          (the counter is bound to its parameters), fields
--            w = index of the window the count belongs to (floor(now / unit))
--            c = tokens counted in window w (above rpu only after a debt)
--          expires at the end of window w + 1 s
-- ARGV (the rule's parameters, after its code "W"; see decide.lua for the rest):
--   rpu            tokens per window, integer >= 1
--   unit           window length in microseconds (1e6 second, 6e7 minute, 3.6e9 hour,
--                  8.64e10 day; a calendar period's length)
--   origin         where window 0 starts, microseconds since the epoch: 0 for a fixed
--                  unit; for a calendar period a gateway named (unit: week | month), the
--                  start of the period before it, so that the period is window 1 and
--                  its key (which carries the period's start) expires at its end + 1 s.
--                  Now before the origin counts as at the origin.
-- Verdict: remaining = tokens left in the window; reset = until the window ends; retry =
-- until the window ends; delay = 0; marks = the window, 0.
--
-- Arithmetic: integers < 2^53 only (now ~ 2^51 microseconds).

local function w_view(P, S, now)
  local since = now - P.origin
  if since < 0 then since = 0 end
  local current = divmod(since, P.unit)
  if not S.w or S.w < current or S.w > current + 1 then
    return { w = current, c = 0 }
  end
  return { w = S.w, c = S.c }
end

local function w_until_end(P, L, now)
  return math.max((L.w + 1) * P.unit + P.origin - now, 0)
end

ALGOS.W = {
  nparams = 3,
  waits = false,

  parse = function(argv, p)
    local P = { rpu = whole(argv[p]), unit = whole(argv[p + 1]), origin = whole(argv[p + 2]) }
    if not P.rpu or P.rpu < 1 or not P.unit or P.unit < 1 or not P.origin or P.origin < 0 then
      return nil
    end
    return P
  end,

  load = function(key)
    local raw = redis.call('HMGET', key, 'w', 'c')
    return { w = whole(raw[1]), c = whole(raw[2]) or 0 }
  end,

  store = function(key, P, S, now)
    redis.call('HSET', key, 'w', int(S.w), 'c', int(S.c))
    expire(key, w_until_end(P, S, now))
  end,

  check = function(P, S, now, need, want)
    local L = w_view(P, S, now)
    local available = math.max(P.rpu - L.c, 0)
    local granted = 0
    if want > 0 and available >= need then granted = math.min(want, available) end
    local reset = w_until_end(P, L, now)
    local V = {
      granted = granted, remaining = available - granted, reset = reset, retry = 0,
      delay = 0, m1 = L.w, m2 = 0,
    }
    if granted < 1 then
      if want > 0 then V.retry = math.max(reset, 1) end
      return V, S
    end
    return V, { w = L.w, c = L.c + granted }
  end,

  release = function(P, S, now, tokens, m1, m2)
    local L = w_view(P, S, now)
    if L.w ~= m1 then return nil end
    return { w = L.w, c = math.max(L.c - tokens, 0) }
  end,

  debt = function(P, S, now, tokens)
    local L = w_view(P, S, now)
    local c = L.c + tokens
    local remaining = math.max(P.rpu - c, 0)
    local reset = w_until_end(P, L, now)
    local V = {
      granted = 0, remaining = remaining, reset = reset, retry = 0, delay = 0, m1 = L.w,
      m2 = 0,
    }
    if remaining < 1 then V.retry = math.max(reset, 1) end
    return V, { w = L.w, c = c }
  end,
}
