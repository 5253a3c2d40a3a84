"""Section 2: accuracy, admitted ÷ expected, with 4 worker threads per gateway and two
gateways (two Envoys sharing one diana-quota + Redis for global scope).

Unit second, a load window of D seconds that starts 50 ms after a whole second (Envoy and
Redis read the same clock as the load generator, so fixed windows line up with the load)
and ends 50 ms before a whole second, so the load touches exactly D fixed windows. The
expectation uses the span and the windows the requests were actually sent in (first to
last send): a generator that falls behind on this busy machine stretches the load.
Each gateway gets 1000 req/s, open loop, spread over as many connections as needed (so
all 4 workers see traffic). Local scope: the limit is per gateway (rpu 100/s), so each
gateway is offered 10×; global scope: one limit shared by both (rpu 200/s), offered 10×
in total. What a correct limiter admits, with L = the span of the load (D − 0.1 s):

  W   rpu × windows                (each window touched is filled)
  SW  rpu × windows                (at most rpu in any one-second window of slices)
  TB  burst + rpu × L              (starts full, refills continuously; burst = rpu)
  LB  1 + burst + rpu × L          (one passes at once, `burst` wait, then one per 1/rpu;
                                    burst = rpu × 1 s by default; the queue drains after)
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import BENCH, Envoy, Procs, redis_cmd, say, start_quota, start_redis, wasm_filter

RATE_PER_GATEWAY = 1000
LOCAL_RPU = 100
GLOBAL_RPU = 200
MARGIN = 0.05


def expected(algo: str, rpu: int, d: int, span: float, burst: int) -> float:
    if algo in ("W", "SW"):
        return rpu * d
    if algo == "TB":
        return burst + rpu * span
    if algo == "LB":
        return 1 + burst + rpu * span
    raise ValueError(algo)


def run(procs: Procs, cfg: dict[str, Any], diana_wasm: Path, quota_bin: Path | None) -> dict[str, Any]:
    d = int(cfg["accuracy_duration"])
    out: dict[str, Any] = {"duration_s": d, "rate_per_gateway": RATE_PER_GATEWAY, "cases": [], "notes": []}
    quota_port = redis_port = None
    if quota_bin is not None:
        try:
            _r, redis_port = start_redis(procs, "accuracy-redis", cpus=None)
            _q, quota_port = start_quota(procs, quota_bin, redis_port, "accuracy-quota", cpus=None)
        except RuntimeError as e:
            out["notes"].append(f"global cases skipped: {e}")
    else:
        out["notes"].append("global cases skipped: diana-quota was not built")

    cases = [("local", a, 1) for a in ("W", "SW", "LB", "TB")]
    if quota_port is not None:
        cases += [("global", a, 1) for a in ("W", "SW", "LB", "TB")]
        cases += [("global", "TB", 20)]
    only = cfg.get("accuracy_only")
    if only:
        cases = [c for c in cases if f"{c[0]}-{c[1]}-{c[2]}" in only.split(",")]
    for scope, algo, lease in cases:
        rpu = LOCAL_RPU if scope == "local" else GLOBAL_RPU
        burst = rpu  # TB default; LB default = what leaves in one second = rpu for unit second
        rule = f"{{name: acc, rpu: {rpu}, unit: second, algo: {algo}, scope: {scope}"
        rule += f", lease: {lease}}}" if scope == "global" else "}"
        doc = (f"resources:\n  - Url: /\n    rules:\n      - {rule}\n"
               "global: {cluster: diana_quota, authority: diana-quota, path: /v1/acquire, timeout_ms: 1000}\n")
        if redis_port is not None:
            redis_cmd(redis_port, "FLUSHALL")
        tag = f"acc-{scope}-{algo}-l{lease}"
        gws = []
        try:
            for g in ("a", "b"):
                gws.append(Envoy(procs, f"{tag}-{g}", [wasm_filter("diana", str(diana_wasm), doc)], concurrency=4,
                                 quota=quota_port if scope == "global" else None).start())
            time.sleep(1.0)  # every bucket idle long enough to be full
            t0 = math.floor(time.time()) + 2
            lgs = []
            for i, gw in enumerate(gws):
                outf = procs.logdir / f"{tag}-load-{i}.json"
                argv = [sys.executable, str(BENCH / "loadgen.py"), "--target", f"127.0.0.1:{gw.port}",
                        "--path", "/acc", "--phase", f"{MARGIN}:{d - MARGIN}:{RATE_PER_GATEWAY}",
                        "--start-at", str(t0), "--timeout", "5", "--seed", str(i + 1), "--out", str(outf)]
                lgs.append((subprocess.Popen(argv, cwd=BENCH), outf))
            for p, _ in lgs:
                p.wait(timeout=d + 60)
            loads = [json.loads(f.read_text()) for _, f in lgs]
            stats = [gw.stats() for gw in gws]
        finally:
            for gw in gws:
                gw.stop()
        # The span and windows the requests were actually *sent* in (a generator that falls
        # behind stretches the load; the expectation follows what was really offered).
        per_gw = [ld["totals"].get("ok", 0) for ld in loads]

        def actual(lds: list) -> tuple[float, int]:
            first = min(ld["first_send"] for ld in lds)
            last = max(ld["last_send"] for ld in lds)
            return last - first, int(math.floor(last) - math.floor(first)) + 1

        if scope == "local":
            exps = [expected(algo, rpu, w, sp, burst) for sp, w in (actual([ld]) for ld in loads)]
            exp_one = sum(exps) / 2
        else:
            sp, w = actual(loads)
            exp_one = expected(algo, rpu, w, sp, burst)
        span, windows = actual(loads)
        row = {
            "scope": scope, "algo": algo, "lease": lease, "rpu": rpu, "unit": "second", "duration_s": d,
            "gateways": 2, "workers": 4, "send_span_s": round(span, 3), "windows": windows,
            "offered": [ld["sent"] for ld in loads],
            "admitted": per_gw,
            "rejected_by_diana": [ld["totals"].get("diana", 0) for ld in loads],
            "other": [{k: v for k, v in ld["totals"].items() if k not in ("ok", "diana")} for ld in loads],
            "max_schedule_lag_ms": max(ld["max_schedule_lag_ms"] for ld in loads),
            "callouts": sum(s.get("wasmcustom.diana_global_callouts", 0) for s in stats),
            "global_errors": sum(s.get("wasmcustom.diana_global_errors", 0) for s in stats),
            "degraded_requests": sum(s.get("wasmcustom.diana_global_degraded_requests", 0) for s in stats),
            "store_errors": sum(s.get("wasmcustom.diana_store_errors", 0) for s in stats),
            "wasmcustom": {k: sum(s.get(k, 0) for s in stats) for k in sorted(set().union(*stats))
                           if k.startswith("wasmcustom.") and any(s.get(k, 0) for s in stats)},
        }
        if scope == "local":
            row["expected_per_gateway"] = exp_one
            row["expected"] = exp_one * 2
        else:
            row["expected"] = exp_one
        row["total"] = sum(per_gw)
        row["ratio"] = row["total"] / row["expected"]
        out["cases"].append(row)
        say(f"accuracy: {scope:<6} {algo:<2} lease {lease:<3} admitted {per_gw} = {row['total']}"
            f"  expected {row['expected']:.0f}  ratio {row['ratio']:.3f}"
            + (f"  callouts {row['callouts']}" if scope == "global" else "")
            + (f"  global errors {row['global_errors']}" if row["global_errors"] else "")
            + (f"  other {row['other']}" if any(row["other"]) else ""))
    return out
