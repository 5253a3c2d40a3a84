-- POST /v1/acquire to diana-quota with a batch of BATCH rules (environment variable,
-- default 1), each on its own key, every request the same body:
--   {"rules":[{"key":"k1:1","algo":"TB","rpu":1000000000,"unit":"second",
--              "burst":1000000000,"slices":10,"want":1}, ...]}
-- The limit is never reached: this measures decisions per second, not rejections.
local batch = tonumber(os.getenv("BATCH") or "1")
local rules = {}
for i = 1, batch do
  rules[i] = string.format('{"key":"k%d:1","algo":"TB","rpu":1000000000,"unit":"second",' ..
    '"burst":1000000000,"slices":10,"want":1}', i)
end
wrk.method = "POST"
wrk.path = "/v1/acquire"
wrk.body = '{"rules":[' .. table.concat(rules, ",") .. ']}'
wrk.headers["Content-Type"] = "application/json"

-- The BENCH_JSON summary line, shared with the other wrk runs.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "summary.lua")
