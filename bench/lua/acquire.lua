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

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"lat_us":{"mean":%.1f,"p50":%d,"p75":%d,"p90":%d,"p99":%d,"p99.9":%d,"max":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(75), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.max))
end
