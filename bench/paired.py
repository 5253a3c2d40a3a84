"""Focused overhead comparison: few variants, many short interleaved rounds.

The full overhead section (bench/overhead.py) runs 17 variants for 10 s each per round, so
one round takes minutes and the machine drifts within it. This runs only the variants that
decide the targets, for ROUNDS rounds of SECONDS each, and reports per variant the median
Envoy CPU µs per request and the median of the per-round ratios to the empty stock-SDK
filter; also the median req/s (wrk), its median ratio to Envoy's `local_ratelimit` when that
is measured (`lrl`, issue #23's bar for the native module), and for variants that call
diana-quota the requests parked behind a callout in flight (a refill ahead or another
request's own call) per 1,000 (`diana_global_coalesced`), the callouts per request and the share of them that were refills ahead (made by the tick,
before the lease ran out). Same processes, pinning and stopping as the full section
(bench/common.py).

    python3 bench/paired.py [ROUNDS=10] [SECONDS=4]      # after scripts/bench built everything

Prints a Markdown table.
"""

from __future__ import annotations

import os
import sys

from common import ROOT, Envoy, Procs, median, say, start_quota, start_redis, wrk
from variants import QUOTA, RELEASE, chosen, variants

# What it measures unless PAIRED_VARIANTS names others (bench/variants.py has them all).
DEFAULT = ["nofilter", "empty", "empty_trim", "nomatch", "local_W", "local_SW", "local_LB", "local_TB",
           "untrimmed_TB", "global_100", "global_auto"]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4
    # PAIRED_VARIANTS=empty,local_TB,... measures only those (the empty filter is always in).
    only = [k for k in os.environ.get("PAIRED_VARIANTS", "").split(",") if k]
    vs = chosen(variants(RELEASE / "diana-envoy.wasm", RELEASE / "diana.wasm"), only or DEFAULT)
    procs = Procs(ROOT / ".tmp/bench/paired")
    cpu: dict[str, list[float]] = {k: [] for k in vs}
    rps: dict[str, list[float]] = {k: [] for k in vs}
    waited: dict[str, list[float]] = {k: [] for k in vs}
    calls: dict[str, list[float]] = {k: [] for k in vs}
    ahead: dict[str, list[float]] = {k: [] for k in vs}
    try:
        quota_port = None
        if any(v.calls_out for v in vs.values()):
            if QUOTA.is_file():
                _redis, redis_port = start_redis(procs, "paired-redis", cpus="1")
                _quota, quota_port = start_quota(procs, QUOTA, redis_port, "paired-quota", cpus="1")
            else:
                say(f"paired: {QUOTA} missing, global variants left out")
                vs = {k: v for k, v in vs.items() if not v.calls_out}
                cpu, rps = {k: cpu[k] for k in vs}, {k: rps[k] for k in vs}
        envoys = {k: Envoy(procs, f"paired-{k}", v.filters, concurrency=1, cpus="0",
                           quota=quota_port if v.calls_out else None).start()
                  for k, v in vs.items()}
        for e in envoys.values():
            wrk(e.url + "/", duration=2)
        for r in range(rounds):
            say(f"paired: round {r + 1}/{rounds}")
            for k, e in envoys.items():
                c0 = e.proc.cpu_seconds()
                s0 = e.stats() if vs[k].calls_out else {}
                res = wrk(e.url + "/", duration=seconds)
                n = max(1, res["requests"])
                cpu[k].append((e.proc.cpu_seconds() - c0) * 1e6 / n)
                rps[k].append(res["rps"])
                if vs[k].calls_out:
                    s1 = e.stats()
                    delta = lambda name: s1.get(name, 0) - s0.get(name, 0)  # noqa: E731
                    waited[k].append(delta("wasmcustom.diana_global_coalesced") * 1000 / n)
                    calls[k].append(delta("wasmcustom.diana_global_callouts") / n)
                    ahead[k].append(delta("wasmcustom.diana_global_refills_ahead")
                                    / max(1, delta("wasmcustom.diana_global_callouts")))
    finally:
        procs.stop_all()
    print(f"| variant ({rounds} rounds × {seconds:g} s) | Envoy CPU µs/req (median) | × empty (CPU, median of rounds)"
          " | req/s (median) | × local_ratelimit (req/s, median of rounds) | parked behind a callout ‰ | callouts/req | of them ahead |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k, v in vs.items():
        ratios = [e / x for e, x in zip(cpu["empty"], cpu[k]) if x]
        vs_lrl = f"{median([r / b for r, b in zip(rps[k], rps['lrl']) if b]):.2f}" if "lrl" in rps else "—"
        wait = f"{median(waited[k]):.1f}" if waited[k] else "—"
        call = f"{median(calls[k]):.4f}" if calls[k] else "—"
        ahd = f"{median(ahead[k]):.2f}" if ahead[k] else "—"
        print(f"| {v.label} | {median(cpu[k]):.1f} | {median(ratios):.2f} | {median(rps[k]):,.0f} | {vs_lrl}"
              f" | {wait} | {call} | {ahd} |")


if __name__ == "__main__":
    main()
