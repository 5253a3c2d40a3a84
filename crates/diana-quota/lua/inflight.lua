-- diana-quota: concurrency (IF, `max_in_flight`) (crates/diana-core/src/algo/inflight.rs).
--
-- At most `rpu` places are held at once. A place is counted in the 20 s bucket it was
-- taken or last renewed in (bucket = floor(now / 20 s) + 1); the state keeps the counts of
-- the newest bucket and the three before it, as a ring (slot = bucket mod 4). A bucket
-- that falls out of the ring is forgotten with its places: a place nobody renews (its
-- gateway died, its end was never reported) is reclaimed 60–80 s after its last renewal.
-- A gateway renews the places of its requests still inside every 20 s (decide.lua's
-- `renew`: released from their bucket, charged to the current one) and gives them back
-- when the request ends (`release` at the bucket, the mark).
--
-- Clock going backwards: the newest bucket never moves back, a place is counted in it; a
-- newest bucket more than 4 ahead of the clock reads as fresh (garbage).
--
-- KEYS[i]  state: hash `diana:{<key>}:IF` (not bound to N: see the
--   wire format's "Counters are bound to their parameters"), fields
--            t = the newest bucket (0 or absent: never used)
--            c0 .. c3 = places counted in the bucket of that ring slot
--          expires 100 s after the last write (every place in it is reclaimed by then)
-- ARGV (the rule's parameters, after its code "IF"):
--   rpu            places, integer >= 1
-- Verdict: remaining = places free; reset = 1 s while any is held (a place may free at
-- any moment), else 0; retry = 1 s when denied; delay = 0; marks = the bucket, 0.

local IF_SPAN = 20000000
local IF_BUCKETS = 4

local function if_read(S, now)
  local current = divmod(now, IF_SPAN) + 1
  local L = { t = current, c = { 0, 0, 0, 0 } }
  local top = S.t
  if not top or top == 0 or top > current + IF_BUCKETS then return L end
  L.t = math.max(top, current)
  for slot = 0, IF_BUCKETS - 1 do
    local _, offset = divmod(top + IF_BUCKETS - slot, IF_BUCKETS)
    local bucket = math.max(top - offset, 0)
    if L.t - bucket < IF_BUCKETS then L.c[slot + 1] = S.c[slot + 1] or 0 end
  end
  return L
end

local function if_total(L)
  return L.c[1] + L.c[2] + L.c[3] + L.c[4]
end

-- the ring index (1-based) of `bucket`, or nil when it is not in the ring
local function if_slot(L, bucket)
  if not bucket or bucket < 1 or bucket > L.t or L.t - bucket >= IF_BUCKETS then return nil end
  local _, slot = divmod(bucket, IF_BUCKETS)
  return slot + 1
end

local function if_verdict(P, L, granted)
  local inside = if_total(L)
  local V = {
    granted = granted, remaining = math.max(P.rpu - inside, 0), reset = 0, retry = 0,
    delay = 0, m1 = L.t, m2 = 0,
  }
  if inside > 0 then V.reset = 1000000 end
  if granted < 1 then V.retry = 1000000 end
  return V
end

ALGOS.IF = {
  nparams = 1,
  waits = false,

  parse = function(argv, p)
    local P = { rpu = whole(argv[p]) }
    if not P.rpu or P.rpu < 1 then return nil end
    return P
  end,

  load = function(key)
    local raw = redis.call('HMGET', key, 't', 'c0', 'c1', 'c2', 'c3')
    return {
      t = whole(raw[1]),
      c = { whole(raw[2]) or 0, whole(raw[3]) or 0, whole(raw[4]) or 0, whole(raw[5]) or 0 },
    }
  end,

  store = function(key, P, S, now)
    redis.call('HSET', key, 't', int(S.t), 'c0', int(S.c[1]), 'c1', int(S.c[2]),
      'c2', int(S.c[3]), 'c3', int(S.c[4]))
    expire(key, (IF_BUCKETS + 1) * IF_SPAN)
  end,

  check = function(P, S, now, need, want)
    local L = if_read(S, now)
    local available = math.max(P.rpu - if_total(L), 0)
    if want < 1 or available < need then return if_verdict(P, L, 0), S end
    local granted = math.min(want, available)
    local slot = if_slot(L, L.t)
    L.c[slot] = L.c[slot] + granted
    return if_verdict(P, L, granted), L
  end,

  release = function(P, S, now, tokens, m1, m2)
    local L = if_read(S, now)
    local slot = if_slot(L, m1)
    if not slot then return nil end
    L.c[slot] = math.max(L.c[slot] - tokens, 0)
    return L
  end,

  debt = function(P, S, now, tokens)
    local L = if_read(S, now)
    local slot = if_slot(L, L.t)
    L.c[slot] = L.c[slot] + tokens
    return if_verdict(P, L, 0), L
  end,
}
