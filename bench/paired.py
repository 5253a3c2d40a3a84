"""Focused overhead comparison: few variants, many short interleaved rounds.

The full overhead section (bench/overhead.py) runs 17 variants for 10 s each per round, so
one round takes minutes and the machine drifts within it. This runs only the variants that
decide the targets, for ROUNDS rounds of SECONDS each, and reports per variant the median
Envoy CPU µs per request and the median of the per-round ratios to the empty stock-SDK
filter. Same processes, pinning and stopping as the full section (bench/common.py).

    python3 bench/paired.py [ROUNDS=10] [SECONDS=4]      # after scripts/bench built everything

Prints a Markdown table.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import ROOT, Envoy, Procs, median, say, start_quota, start_redis, wasm_filter, wrk
from overhead import diana_doc, global_doc, local_rule

RELEASE = ROOT / "target/wasm32-wasip1/release"
EMPTY = ROOT / "bench/empty-filter/target/wasm32-wasip1/release"
QUOTA = ROOT / "target/release/diana-quota"
# The variants that call diana-quota (started once, with Redis, on the other CPU).
GLOBAL = ("global_l100", "global_auto")


def variants() -> dict[str, tuple[str, list[dict]]]:
    envoy_wasm, untrimmed = str(RELEASE / "diana-envoy.wasm"), str(RELEASE / "diana.wasm")
    tb = diana_doc([local_rule("TB")])
    return {
        "nofilter": ("no filter", []),
        "empty": ("empty wasm filter (stock SDK)", [wasm_filter("empty", str(EMPTY / "empty_filter.wasm"))]),
        "empty_trim": ("empty wasm filter, trimmed like Diana",
                       [wasm_filter("empty", str(EMPTY / "empty_filter_trimmed.wasm"))]),
        "nomatch": ("Diana, no rule matches (reads :path and the clock)",
                    [wasm_filter("diana", envoy_wasm, diana_doc([local_rule("TB")], url="/nomatch"))]),
        **{f"local_{a}": (f"Diana local {a}", [wasm_filter("diana", envoy_wasm, diana_doc([local_rule(a)]))])
           for a in ("W", "SW", "LB", "TB")},
        "untrimmed_TB": ("Diana local TB, untrimmed diana.wasm", [wasm_filter("diana", untrimmed, tb)]),
        "global_l100": ("Diana global W, lease 100", [wasm_filter("diana", envoy_wasm, global_doc("W", 100))]),
        "global_auto": ("Diana global W, lease auto", [wasm_filter("diana", envoy_wasm, global_doc("W", "auto"))]),
    }


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4
    vs = variants()
    # PAIRED_VARIANTS=empty,local_TB,... measures only those (the empty filter is always in).
    only = [k for k in os.environ.get("PAIRED_VARIANTS", "").split(",") if k]
    if only:
        vs = {k: v for k, v in vs.items() if k == "empty" or k in only}
    procs = Procs(ROOT / ".tmp/bench/paired")
    cpu: dict[str, list[float]] = {k: [] for k in vs}
    try:
        quota_port = None
        if QUOTA.is_file() and any(k in vs for k in GLOBAL):
            _redis, redis_port = start_redis(procs, "paired-redis", cpus="1")
            _quota, quota_port = start_quota(procs, QUOTA, redis_port, "paired-quota", cpus="1")
        else:
            say(f"paired: {QUOTA} missing, global variants left out")
            for k in GLOBAL:
                vs.pop(k, None)
                cpu.pop(k, None)
        envoys = {k: Envoy(procs, f"paired-{k}", filters, concurrency=1, cpus="0",
                           quota=quota_port if k in GLOBAL else None).start()
                  for k, (_, filters) in vs.items()}
        for e in envoys.values():
            wrk(e.url + "/", duration=2)
        for r in range(rounds):
            say(f"paired: round {r + 1}/{rounds}")
            for k, e in envoys.items():
                c0 = e.proc.cpu_seconds()
                res = wrk(e.url + "/", duration=seconds)
                cpu[k].append((e.proc.cpu_seconds() - c0) * 1e6 / max(1, res["requests"]))
    finally:
        procs.stop_all()
    print(f"| variant ({rounds} rounds × {seconds:g} s) | Envoy CPU µs/req (median) | × empty (CPU, median of rounds) |")
    print("| --- | ---: | ---: |")
    for k, (label, _) in vs.items():
        ratios = [e / x for e, x in zip(cpu["empty"], cpu[k]) if x]
        print(f"| {label} | {median(cpu[k]):.1f} | {median(ratios):.2f} |")


if __name__ == "__main__":
    main()
