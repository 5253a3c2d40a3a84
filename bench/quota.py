"""Section 3: diana-quota alone, decisions per second against Redis.

diana-quota pinned to CPU 0, redis-server and wrk pinned to CPU 1; wrk POSTs the same JSON
body to /v1/acquire over 32 keep-alive connections (bench/lua/acquire.lua, BATCH rules per
request, each rule its own key, a token bucket that is never empty). Rounds alternate
batch 1 / batch 8 (and, for reference, the embedded in-memory store). Decisions per second
= requests per second × rules per request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import LUA, Procs, median, say, start_quota, start_redis, wait_http, free_port, wrk


def run(procs: Procs, cfg: dict[str, Any], quota_bin: Path) -> dict[str, Any]:
    rounds, duration = cfg["quota_rounds"], cfg["duration"]
    redis, redis_port = start_redis(procs, "quota-redis", cpus="1")
    quota, quota_port = start_quota(procs, quota_bin, redis_port, "quota-redis-backed", cpus="0")
    mem_port = free_port()
    mem = procs.spawn("quota-memory", [str(quota_bin), "--listen", f"127.0.0.1:{mem_port}", "--log", "warn", "--insecure-no-auth"],
                      cpus="0")
    if not wait_http(f"http://127.0.0.1:{mem_port}/healthz", mem, 20):
        mem = None
    cases = [("redis", 1, quota, quota_port), ("redis", 8, quota, quota_port)]
    if mem is not None:
        cases += [("memory", 1, mem, mem_port), ("memory", 8, mem, mem_port)]
    results: dict[tuple, list] = {(s, b): [] for s, b, _, _ in cases}
    for s, b, p, port in cases:  # warm-up
        wrk(f"http://127.0.0.1:{port}/v1/acquire", duration=cfg["warmup"], script=LUA / "acquire.lua",
            env={"BATCH": str(b)})
    command = ""
    for r in range(rounds):
        say(f"quota: round {r + 1}/{rounds}")
        for s, b, p, port in cases:
            c0, r0 = p.cpu_seconds(), redis.cpu_seconds()
            res = wrk(f"http://127.0.0.1:{port}/v1/acquire", duration=duration, script=LUA / "acquire.lua",
                      env={"BATCH": str(b)})
            c1, r1 = p.cpu_seconds(), redis.cpu_seconds()
            secs = res["duration_us"] / 1e6
            res["service_cpu_util"] = (c1 - c0) / secs
            res["redis_cpu_util"] = (r1 - r0) / secs if s == "redis" else 0.0
            res["service_cpu_us_per_req"] = (c1 - c0) * 1e6 / max(1, res["requests"])
            results[(s, b)].append(res)
            if s == "redis" and b == 1:
                command = f"BATCH=1 {res['command']}"
            say(f"  {s:<6} batch {b}: {res['rps']:>8.0f} req/s = {res['rps'] * b:>8.0f} decisions/s  "
                f"p50 {res['lat_us']['p50']} µs  p99 {res['lat_us']['p99']} µs  "
                f"service cpu {res['service_cpu_util']:.2f}  redis cpu {res['redis_cpu_util']:.2f}"
                + (f"  non-2xx {res['errors']['status']}" if res["errors"]["status"] else ""))
    rows = []
    for (s, b), runs in results.items():
        rows.append({
            "store": s, "batch": b, "runs": runs,
            "rps": median([x["rps"] for x in runs]),
            "decisions_per_s": median([x["rps"] * b for x in runs]),
            "p50_us": median([x["lat_us"]["p50"] for x in runs]),
            "p99_us": median([x["lat_us"]["p99"] for x in runs]),
            "p999_us": median([x["lat_us"]["p99.9"] for x in runs]),
            "service_cpu_util": median([x["service_cpu_util"] for x in runs]),
            "redis_cpu_util": median([x["redis_cpu_util"] for x in runs]),
            "service_cpu_us_per_req": median([x["service_cpu_us_per_req"] for x in runs]),
            "non2xx": sum(x["errors"]["status"] for x in runs),
        })
    for p in (quota, mem, redis):
        if p is not None:
            procs.stop(p)
    return {"rounds": rounds, "duration_s": duration, "rows": rows, "command": command,
            "service_argv": "taskset -c 0 diana-quota --listen 127.0.0.1:PORT --redis redis://127.0.0.1:PORT"}
