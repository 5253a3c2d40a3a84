"""Section 4: what degrading costs. Diana global (the overhead section's global variant, W,
lease 1: one callout per request when healthy) in one Envoy pinned to CPU 0; diana-quota and Redis pinned to CPU 1 with wrk.
Three states in a row: healthy; Redis killed by its PID (diana-quota answers 503 fast, the
filter's circuit breaker opens for retry_seconds = 5 and the rule is enforced locally,
one probe per 5 s); diana-quota killed too (the callout cannot connect).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from common import Envoy, Procs, say, start_quota, start_redis, wasm_filter, wrk
from overhead import global_doc


def run(procs: Procs, cfg: dict[str, Any], diana_wasm: Path, quota_bin: Path) -> dict[str, Any]:
    duration = cfg["duration"]
    redis, redis_port = start_redis(procs, "degrade-redis", cpus="1")
    quota, quota_port = start_quota(procs, quota_bin, redis_port, "degrade-quota", cpus="1")
    doc = global_doc("W", 1)
    e = Envoy(procs, "degrade-envoy", [wasm_filter("diana", str(diana_wasm), doc)], concurrency=1, cpus="0",
              quota=quota_port).start()
    wrk(e.url + "/", duration=cfg["warmup"])
    states = []

    def measure(state: str) -> None:
        before = e.stats()
        res = wrk(e.url + "/", duration=duration)
        after = e.stats()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("wasmcustom.")}
        res["state"] = state
        res["callouts_per_req"] = delta.get("wasmcustom.diana_global_callouts", 0) / max(1, res["requests"])
        res["global_errors"] = delta.get("wasmcustom.diana_global_errors", 0)
        res["degraded_requests"] = delta.get("wasmcustom.diana_global_degraded_requests", 0)
        res["degraded_gauge"] = after.get("wasmcustom.diana_global_degraded", 0)
        states.append(res)
        say(f"degrade: {state:<28} {res['rps']:>8.0f} req/s  p50 {res['lat_us']['p50']} µs  "
            f"p99 {res['lat_us']['p99']} µs  p99.9 {res['lat_us']['p99.9']} µs  "
            f"callouts/req {res['callouts_per_req']:.4f}  errors {res['global_errors']}  "
            f"degraded requests {res['degraded_requests']}"
            + (f"  non-2xx {res['errors']['status']}" if res["errors"]["status"] else ""))

    measure("healthy")
    t = time.monotonic()
    procs.kill(redis)
    say(f"degrade: redis-server (pid {redis.pid}) killed")
    time.sleep(1.0)
    measure("Redis down")
    procs.kill(quota)
    say(f"degrade: diana-quota (pid {quota.pid}) killed")
    time.sleep(1.0)
    measure("Redis and diana-quota down")
    e.stop()
    return {"duration_s": duration, "states": states, "since_kill_s": round(time.monotonic() - t, 1)}
