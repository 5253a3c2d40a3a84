-- diana-quota: sliding window (SW) (crates/diana-core/src/algo/sliding.rs).
--
-- The unit is split into `slices` slices, aligned to the unit from the Unix epoch: slice
-- g covers [start(g), start(g+1)) with start(g) = q*unit + ceil(s*unit/slices) where
-- g = q*slices + s; `now` falls in slice floor(now*slices/unit). The head h is the latest
-- slice written; requests are counted in the effective slice max(h, current), so a clock
-- that went backwards counts in the head, never in an earlier slice. A request is
-- admitted while the counts of the last `slices` slices up to the effective one leave
-- room: it gets min(want, rpu - sum) if that is >= need. A denial writes nothing. A head
-- more than one unit ahead of the clock reads as fresh (garbage).
--
-- Debts are counted in the effective slice like any request: the window stays over its
-- limit until that slice has left it. A release takes tokens off the slice its grant was
-- counted in (the mark), if that slice is still in the window.
--
-- KEYS[i]  state: hash `diana:{<key>}:SW:<rpu>:<unit>:<burst>:<slices>`
--          (the counter is bound to its parameters), fields
--            h = the head slice (absolute index, decimal)
--            <g> = tokens counted in slice g, for the slices h-slices+1 .. h that hold any
--          expires when the head slice leaves the window + 1 s
-- ARGV (the rule's parameters, after its code "SW"; see decide.lua for the rest):
--   rpu            tokens per unit, integer >= 1
--   unit           the unit in microseconds (1e6 second, 6e7 minute, 3.6e9 hour, 8.64e10 day)
--   slices         slices per unit, integer 1..60
-- Verdict: remaining = rpu - sum after the decision; reset = until every counted slice has
-- left the window; retry = until enough old slices have left for `need` to fit; delay = 0;
-- marks = the effective slice, 0.
--
-- Arithmetic: integers < 2^53 only (now ~ 2^51 us, (now mod unit)*slices < 2^43).

-- first microsecond of slice g
local function sw_start(P, g)
  local q, s = divmod(g, P.slices)
  local offset, rest = divmod(s * P.unit, P.slices)
  if rest > 0 then offset = offset + 1 end
  return q * P.unit + offset
end

-- microseconds from now until slice g has left the window
local function sw_until_expired(P, g, now)
  return math.max(sw_start(P, g + P.slices) - now, 0)
end

-- the state as seen at `now`: head, effective slice, whether the stored ring is usable,
-- and `counted`, the slices in the window up to the head with their counts, oldest first
local function sw_view(P, S, now)
  local n = P.slices
  local q, into = divmod(now, P.unit)
  local current = q * n + divmod(into * n, P.unit)
  local L = { head = current, effective = current, usable = false, counted = {}, sum = 0 }
  if S.h and S.h <= current + n then
    L.head, L.effective, L.usable = S.h, math.max(S.h, current), true
  end
  L.oldest = math.max(L.effective - (n - 1), 0)
  if L.usable then
    for g, count in pairs(S.counts) do
      if g >= L.oldest and g <= L.head then
        L.counted[#L.counted + 1] = g
        L.sum = L.sum + count
      end
    end
    table.sort(L.counted)
  end
  return L
end

-- microseconds until enough of the oldest counted slices have left the window to free
-- `must_free` tokens (`fallback` when they never do)
local function sw_freed_after(P, L, S, now, must_free, fallback)
  local freed = 0
  for _, g in ipairs(L.counted) do
    freed = freed + S.counts[g]
    if freed >= must_free then return sw_until_expired(P, g, now) end
  end
  return fallback
end

-- the state after counting `tokens` in the effective slice: the slices that left the
-- window are dropped (all of them for a garbage head or a gap of a unit or more)
local function sw_record(P, L, S, tokens)
  local counts = {}
  if L.usable and L.effective - L.head < P.slices then
    local keep = L.effective - P.slices + 1
    for g, count in pairs(S.counts) do
      if g >= keep and g <= L.head then counts[g] = count end
    end
  end
  counts[L.effective] = (counts[L.effective] or 0) + tokens
  return { h = L.effective, counts = counts }
end

ALGOS.SW = {
  nparams = 3,
  waits = false,

  parse = function(argv, p)
    local P = { rpu = whole(argv[p]), unit = whole(argv[p + 1]), slices = whole(argv[p + 2]) }
    if not P.rpu or P.rpu < 1 or not P.unit or P.unit < 1 or not P.slices or P.slices < 1 then
      return nil
    end
    return P
  end,

  load = function(key)
    local flat = redis.call('HGETALL', key)
    local S = { h = nil, counts = {} }
    for n = 1, #flat, 2 do
      local field, value = flat[n], whole(flat[n + 1])
      if field == 'h' then
        S.h = value
      else
        local g = whole(field)
        if g and value and value > 0 then S.counts[g] = value end
      end
    end
    return S
  end,

  store = function(key, P, S, now)
    local fields = { 'h', int(S.h) }
    for g, count in pairs(S.counts) do
      if count > 0 then
        fields[#fields + 1] = int(g)
        fields[#fields + 1] = int(count)
      end
    end
    redis.call('DEL', key)
    redis.call('HSET', key, unpack(fields))
    expire(key, sw_until_expired(P, S.h, now))
  end,

  check = function(P, S, now, need, want)
    local L = sw_view(P, S, now)
    local available = math.max(P.rpu - L.sum, 0)
    local granted = 0
    if want > 0 and available >= need then granted = math.min(want, available) end
    local newest = nil
    if granted > 0 then
      newest = L.effective
    else
      for _, g in ipairs(L.counted) do
        if S.counts[g] > 0 then newest = g end
      end
    end
    local reset = 0
    if newest then reset = sw_until_expired(P, newest, now) end
    local V = {
      granted = granted, remaining = available - granted, reset = reset, retry = 0,
      delay = 0, m1 = L.effective, m2 = 0,
    }
    if granted < 1 then
      if want > 0 then
        local must_free = math.max(L.sum + need - P.rpu, 0)
        V.retry = math.max(sw_freed_after(P, L, S, now, must_free, reset), 1)
      end
      return V, S
    end
    return V, sw_record(P, L, S, granted)
  end,

  release = function(P, S, now, tokens, m1, m2)
    local L = sw_view(P, S, now)
    if not L.usable or m1 < L.oldest or m1 > L.head then return nil end
    local counts = {}
    for g, count in pairs(S.counts) do counts[g] = count end
    counts[m1] = math.max((counts[m1] or 0) - tokens, 0)
    return { h = S.h, counts = counts }
  end,

  debt = function(P, S, now, tokens)
    local L = sw_view(P, S, now)
    local sum = L.sum + tokens
    local reset = sw_until_expired(P, L.effective, now)
    local S2 = sw_record(P, L, S, tokens)
    local V = {
      granted = 0, remaining = math.max(P.rpu - sum, 0), reset = reset, retry = 0,
      delay = 0, m1 = L.effective, m2 = 0,
    }
    if sum >= P.rpu then
      local after = sw_view(P, S2, now)
      V.retry = math.max(sw_freed_after(P, after, S2, now, sum + 1 - P.rpu, reset), 1)
    end
    return V, S2
  end,
}
