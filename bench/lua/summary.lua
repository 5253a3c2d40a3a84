-- wrk summary for scripts/bench: one machine-readable line with the request count, the
-- errors and the latency percentiles wrk --latency prints (50/75/90/99) plus p99.9.
-- No request()/response() callbacks, so wrk stays on its fast path.
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
