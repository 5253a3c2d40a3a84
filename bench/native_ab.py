"""Two builds of the native module, one global document, interleaved rounds: A/B for a change.

A change to the native module's glue (how it wakes the main thread, what it locks) moves
Envoy's CPU time per request by a few per cent, less than the drift between two separate
runs on this machine. So both builds run at once, each in its own Envoy (`--concurrency 1`,
pinned to CPU 0, as `bench/paired.py` runs them) against one diana-quota and Redis (CPU 1),
and wrk loads them in turn, round after round, alternating which goes first. Per build it
prints the median Envoy CPU µs per request, the median req/s, the median of the per-round
req/s ratios to the first build, and the context switches per 1,000 requests of each of
Envoy's threads (`/proc/<pid>/task/*/status`: the main thread's count is the wake-ups the
callouts and ticks cost).

    python3 bench/native_ab.py BEFORE.so AFTER.so [LEASE=100] [ROUNDS=8] [SECONDS=4]

Build the "before" module from an older commit in a worktree, e.g.
`git worktree add /tmp/before <commit> && (cd /tmp/before && CARGO_TARGET_DIR=/tmp/before-target
cargo build --release -p diana-envoy-native)`, then pass
`/tmp/before-target/release/libdiana_envoy_native.so target/release/libdiana_envoy_native.so`.
Every process it starts is stopped by its PID at the end, also on failure.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from common import ROOT, Envoy, Procs, median, native_module_filter, say, start_quota, start_redis, wrk
from overhead import global_doc
from variants import QUOTA


def switches(pid: int) -> dict[str, int]:
    """Context switches (voluntary and not) so far, per thread name."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended
        n = sum(int(m) for m in re.findall(r"^(?:non)?voluntary_ctxt_switches:\s+(\d+)", status, re.M))
        out[name] = out.get(name, 0) + n
    return out


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    builds = {"A": Path(sys.argv[1]).resolve(), "B": Path(sys.argv[2]).resolve()}
    lease: int | str = sys.argv[3] if len(sys.argv) > 3 else "100"
    lease = lease if lease == "auto" else int(lease)
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    seconds = float(sys.argv[5]) if len(sys.argv) > 5 else 4
    for so in builds.values():
        if not so.is_file():
            sys.exit(f"native_ab: no module at {so}")
    if not QUOTA.is_file():
        sys.exit(f"native_ab: {QUOTA} missing (scripts/build)")
    procs = Procs(ROOT / ".tmp/bench/native_ab")
    try:
        _redis, redis_port = start_redis(procs, "ab-redis", cpus="1")
        _quota, quota_port = start_quota(procs, QUOTA, redis_port, "ab-quota", cpus="1")
        envoys = {k: Envoy(procs, f"ab-{k}", [native_module_filter(global_doc("W", lease), so)],
                           concurrency=1, cpus="0", quota=quota_port).start()
                  for k, so in builds.items()}
        for e in envoys.values():
            wrk(e.url + "/", duration=2)
        cpu: dict[str, list[float]] = {k: [] for k in envoys}
        rps: dict[str, list[float]] = {k: [] for k in envoys}
        switched: dict[str, dict[str, float]] = {k: {} for k in envoys}
        requests: dict[str, int] = {k: 0 for k in envoys}
        for r in range(rounds):
            say(f"native_ab: round {r + 1}/{rounds}")
            order = list(envoys.items())
            for k, e in order if r % 2 == 0 else order[::-1]:
                assert e.proc is not None
                s0, c0 = switches(e.proc.pid), e.proc.cpu_seconds()
                res = wrk(e.url + "/", duration=seconds)
                c1, s1 = e.proc.cpu_seconds(), switches(e.proc.pid)
                cpu[k].append((c1 - c0) * 1e6 / res["requests"])
                rps[k].append(res["rps"])
                requests[k] += res["requests"]
                for name, n in s1.items():
                    switched[k][name] = switched[k].get(name, 0) + n - s0.get(name, 0)
        print(f"| build (lease {lease}, {rounds} rounds × {seconds:g} s) | Envoy CPU µs/req | req/s "
              "| × A (req/s, median of rounds) | context switches per 1,000 requests, by thread |")
        print("| --- | ---: | ---: | ---: | --- |")
        for k, so in builds.items():
            ratio = median([b / a for b, a in zip(rps[k], rps["A"]) if a])
            per = ", ".join(f"{name} {n * 1000 / requests[k]:.1f}"
                            for name, n in sorted(switched[k].items(), key=lambda kv: -kv[1])
                            if n * 1000 / requests[k] >= 0.5)
            print(f"| {k}: `{so}` | {median(cpu[k]):.2f} | {median(rps[k]):,.0f} | {ratio:.3f} | {per} |")
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
