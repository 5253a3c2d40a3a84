-- diana-quota: the entry point. The script Redis runs is common.lua, the four algorithm
-- files, then this file; it decides every rule of one request at once, atomically.
--
-- acquire: all or nothing (a rule in dry run aside). Every rule is checked in order on a scratch copy of its state
--   (two rules on the same counter see each other's tentative charge), then either every
--   rule had at least its `need` available and every touched state is written, or
--   nothing is written at all. A waiting algorithm's (LB) admitted request whose delay is
--   longer than its max_delay is denied too (retry = delay - max_delay).
-- charge: every rule is charged `tokens` past its limit (a debt); every state is written.
-- release: gives back grants of earlier acquires (the Redis Cluster compensation, and a
--   decision whose answer came too late), rules taken in reverse order so that leaky-
--   bucket turns reserved by one request come back one after the other.
-- renew: concurrency places still held (IF) move from the bucket they were counted in to
--   the current one: released at their mark, then charged now; the reply's mark1 is the
--   bucket to send next time.
-- spend: one call of Envoy's rate limit protocol (RLS), each rule a take (all or nothing,
--   as acquire), a check (charges nothing; refused once nothing is left) or a count
--   (charged `tokens` whatever is left, even when the call is refused; refused when they
--   did not fit), in order, each on the state the rules before it left. The call is
--   admitted when every enforced rule passed and, if it has quota rules, one of them
--   did. Refused: the takes are undone (the stored states, the counts alone applied
--   again in order). diana_core::quota::decide::spend, step for step.
--
-- KEYS[i]  the state of rule i: `diana:{<key>}:<ALGO>:<rpu>:<unit>:<burst>:<slices>` (the
--          algorithm's file documents it). The service names the key after every
--          parameter of the rule, so a state is only ever read with the parameters it was
--          written with: a rule with other parameters has another key. The braces are a
--          Redis Cluster hash tag; in a cluster the service sends one call per rule key
--          (so all KEYS of a call live in one slot).
-- ARGV[1]  the operation: acquire, charge or release
-- ARGV[2]  "now" in microseconds since the epoch (tests only); empty -> the server clock
--          (redis TIME), so every gateway uses the same clock
-- ARGV[3..] one group per rule, in KEYS order:
--          the algorithm's code (W, SW, LB, TB), its parameters (its file's header), then
--            acquire: need (the cost, >= 1), want (>= need), max_delay_us (empty: none),
--                     dry_run (1: the rule's denial stops nobody; charged only with the
--                     others)
--            charge:  tokens (>= 1)
--            release: tokens (>= 1), mark1, mark2 (what the acquire returned)
--            renew:   places (>= 1), mark1, mark2 (what the acquire or last renewal
--                     returned)
--            spend:   how (take, check or count), tokens (>= 1; a check's are not
--                     charged), enforcement (0 enforced, 1 shadow: never refuses,
--                     2 quota: refuses only with every quota rule of the call)
--
-- Returns 8 integers per rule, in order:
--   allowed      1 if the rule had its need available (acquire), 1 for charge and release;
--                spend, 1 if the rule passed (its own verdict)
--   granted      tokens charged: acquire, min(want, available) for every rule or 0 for
--                all; charge, the tokens; release, 0; spend, a count's tokens, an
--                admitted take's tokens, else 0
--   remaining    what would still be granted right now, after this call
--   reset_us     microseconds until the limit has fully recovered
--   retry_us     acquire, for a rule without its need: microseconds until it has it;
--                charge: until the debt is paid back; else 0
--   delay_us     LB: microseconds the first granted turn waits; else 0
--   mark1, mark2 where an acquire's grant was counted (for a release); else 0

local op = ARGV[1]
local now = clock(ARGV[2])
if not now then return redis.error_reply('ERR diana: bad clock') end

local rules = {}
local p = 3
for i = 1, #KEYS do
  local A = ALGOS[ARGV[p]]
  if not A then return redis.error_reply('ERR diana: rules[' .. (i - 1) .. ']: unknown algorithm') end
  local P = A.parse(ARGV, p + 1)
  if not P then return redis.error_reply('ERR diana: rules[' .. (i - 1) .. ']: bad parameters') end
  p = p + 1 + A.nparams
  local r = { A = A, P = P, key = KEYS[i] }
  local a, b = whole(ARGV[p]), whole(ARGV[p + 1])
  if op == 'acquire' then
    if not a or not b or a < 1 or b < a then
      return redis.error_reply('ERR diana: rules[' .. (i - 1) .. ']: bad need or want')
    end
    r.need, r.want = a, b
    if ARGV[p + 2] ~= '' then r.max_delay = whole(ARGV[p + 2]) end
    r.dry = ARGV[p + 3] == '1'
    p = p + 4
  elseif op == 'charge' then
    if not a or a < 1 or not A.debt then
      return redis.error_reply('ERR diana: rules[' .. (i - 1) .. ']: cannot be charged')
    end
    r.tokens = a
    p = p + 1
  elseif op == 'release' then
    if not a or a < 0 or not b then
      return redis.error_reply('ERR diana: rules[' .. (i - 1) .. ']: bad release')
    end
    r.tokens, r.m1, r.m2 = a, b, whole(ARGV[p + 2]) or 0
    p = p + 3
  elseif op == 'renew' then
    if not a or a < 1 or not b or not A.debt then
      return redis.error_reply('ERR diana: rules[' .. (i - 1) .. ']: bad renewal')
    end
    r.tokens, r.m1, r.m2 = a, b, whole(ARGV[p + 2]) or 0
    p = p + 3
  elseif op == 'spend' then
    local how, tokens, mode = ARGV[p], whole(ARGV[p + 1]), whole(ARGV[p + 2])
    if (how ~= 'take' and how ~= 'check' and how ~= 'count') or not tokens or tokens < 1
      or not mode or mode < 0 or mode > 2 or (how == 'count' and not A.debt) then
      return redis.error_reply('ERR diana: rules[' .. (i - 1) .. ']: bad spend')
    end
    r.how, r.tokens, r.mode = how, tokens, mode
    p = p + 3
  else
    return redis.error_reply('ERR diana: unknown operation')
  end
  rules[i] = r
end

-- States by key: as stored, and as changed so far by this call.
local stored, scratch, touched, order = {}, {}, {}, {}
local function state_of(r)
  if scratch[r.key] == nil then
    local S = r.A.load(r.key)
    stored[r.key], scratch[r.key] = S, S
  end
  return scratch[r.key]
end
local function change(r, S2)
  if not touched[r.key] then
    touched[r.key] = true
    order[#order + 1] = r
  end
  scratch[r.key] = S2
end
local function commit()
  for _, r in ipairs(order) do
    r.A.store(r.key, r.P, scratch[r.key], now)
  end
end
local function probe(r, S)
  return r.A.check(r.P, S, now, 1, 0)
end

local reply = {}
local function put(allowed, granted, V, retry, delay, m1, m2)
  local n = #reply
  reply[n + 1], reply[n + 2], reply[n + 3], reply[n + 4] = allowed, granted, V.remaining, V.reset
  reply[n + 5], reply[n + 6], reply[n + 7], reply[n + 8] = retry, delay, m1, m2
end

if op == 'acquire' then
  local verdicts, all = {}, true
  for i, r in ipairs(rules) do
    local S = state_of(r)
    local V, S2 = r.A.check(r.P, S, now, r.need, r.want)
    if V.granted > 0 and r.A.waits and r.max_delay and V.delay > r.max_delay then
      -- its turn is further away than the gateway accepts: denied, nothing reserved
      local free = probe(r, S)
      free.retry = math.max(V.delay - r.max_delay, 1)
      V, S2 = free, S
    end
    verdicts[i] = V
    if V.granted > 0 then change(r, S2) elseif not r.dry then all = false end
  end
  if all then commit() end
  for i, r in ipairs(rules) do
    local V = verdicts[i]
    if all and V.granted > 0 then
      put(1, V.granted, V, 0, V.delay, V.m1, V.m2)
    elseif all then
      -- a rule in dry run without its need: denied, nothing charged
      put(0, 0, V, V.retry, 0, 0, 0)
    elseif V.granted > 0 then
      -- had enough, but another rule did not: not charged
      put(1, 0, probe(r, stored[r.key]), 0, 0, 0, 0)
    else
      put(0, 0, V, V.retry, 0, 0, 0)
    end
  end
elseif op == 'charge' then
  for _, r in ipairs(rules) do
    local V, S2 = r.A.debt(r.P, state_of(r), now, r.tokens)
    change(r, S2)
    put(1, r.tokens, V, V.retry, 0, V.m1, V.m2)
  end
  commit()
elseif op == 'spend' then
  local passed, taken, took = {}, {}, false
  for i, r in ipairs(rules) do
    local S = state_of(r)
    if r.how == 'check' then
      passed[i] = probe(r, S).remaining >= 1
    elseif r.how == 'count' then
      passed[i] = probe(r, S).remaining >= r.tokens
      local _, S2 = r.A.debt(r.P, S, now, r.tokens)
      change(r, S2)
    else
      local V, S2 = r.A.check(r.P, S, now, r.tokens, r.tokens)
      passed[i], taken[i] = V.granted > 0, V
      if V.granted > 0 then
        took = true
        change(r, S2)
      end
    end
  end
  local enforced, quotas, quota_passed = true, 0, false
  for i, r in ipairs(rules) do
    if r.mode == 0 and not passed[i] then enforced = false end
    if r.mode == 2 then
      quotas = quotas + 1
      if passed[i] then quota_passed = true end
    end
  end
  local admitted = enforced and (quotas == 0 or quota_passed)
  if not admitted and took then
    -- the takes are undone: the stored states, the counts alone charged again in order
    touched, order = {}, {}
    for key, S in pairs(stored) do scratch[key] = S end
    for _, r in ipairs(rules) do
      if r.how == 'count' then
        local _, S2 = r.A.debt(r.P, scratch[r.key], now, r.tokens)
        change(r, S2)
      end
    end
  end
  commit()
  for i, r in ipairs(rules) do
    local S = scratch[r.key]
    local now_V = probe(r, S)
    local granted, m1, m2 = 0, 0, 0
    if r.how == 'count' then
      granted = r.tokens
    elseif r.how == 'take' and admitted then
      granted, m1, m2 = taken[i].granted, taken[i].m1, taken[i].m2
    end
    local retry = 0
    if not passed[i] then
      -- when the rule's cost is there again (a take's of `tokens`, on a copy)
      retry = math.max(r.A.check(r.P, S, now, r.tokens, r.tokens).retry, 1)
    end
    put(passed[i] and 1 or 0, granted, now_V, retry, 0, m1, m2)
  end
elseif op == 'renew' then
  for _, r in ipairs(rules) do
    local S = state_of(r)
    local V, S2 = r.A.debt(r.P, r.A.release(r.P, S, now, r.tokens, r.m1, r.m2) or S, now, r.tokens)
    change(r, S2)
    put(1, r.tokens, V, 0, 0, V.m1, V.m2)
  end
  commit()
else
  for i = #rules, 1, -1 do
    local r = rules[i]
    if r.tokens > 0 then
      local S2 = r.A.release(r.P, state_of(r), now, r.tokens, r.m1, r.m2)
      if S2 then change(r, S2) end
    end
  end
  commit()
  for _, r in ipairs(rules) do
    -- state_of, not scratch: a rule with nothing to give back (a dry run's denial) was
    -- never loaded above
    put(1, 0, probe(r, state_of(r)), 0, 0, 0, 0)
  end
end
return reply
