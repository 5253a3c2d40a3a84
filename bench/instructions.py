"""Envoy's instructions per request, counted by valgrind: DESIGN §6's bars without the noise.

On a shared 2-vCPU machine the CPU time Envoy spends per request moves by ±20 % from one
run to the next (other tenants' processes, steal time, cache pollution), more than the
few µs the bars are about. The number of instructions Envoy executes per request does
not move: it is what the code does, whatever else runs. So each variant's Envoy runs
under `valgrind --tool=callgrind` (V8's generated code included: `--smc-check=all-non-file`),
one at a time; after a warm-up the counters are zeroed (`callgrind_control -z`), N
requests are sent one after the other on one keep-alive connection, and the counters are
dumped (`callgrind_control -d`): Ir ÷ N is the variant's instructions per request, all
threads of Envoy included (the worker, the main thread, the callouts to diana-quota of
the global variants, amortised over the requests that shared them).

An instruction count is not a time (a cache miss costs more than an add), but the
variants differ by the code Envoy and the filter run, not by memory behaviour, and the
ranking by instructions agrees with the least contended CPU-time runs (BENCHMARKS.md).
Repeat runs of one variant agree within ±0.3 %.

    python3 bench/instructions.py [N=2000] [VARIANT ...]   # after scripts/bench or scripts/build

Prints a Markdown table (instructions per request, ratio to the empty stock-SDK filter as
a throughput ratio, the bar's verdict), also into $INSTRUCTIONS_OUT when set (the recorded
one is docs/bench/instructions.md, which BENCHMARKS.md includes), and writes
.tmp/bench/instructions/results.json. Variants that add a closed breaker to another
(`*_breaker*`, bench/variants.py) get a second table: the breaker's own instructions per
request (the difference) and their share of the request's total; each of their requests
must have been one call of the breaker (its `diana_breaker_calls` counter), else the run
fails. The breaker's figures alone are recorded in docs/bench/breaker-instructions.md, for
direct-response requests and for requests proxied to an upstream (`*_proxied`: a plain
Envoy answering 200, not measured):

    INSTRUCTIONS_OUT=docs/bench/breaker-instructions.md python3 bench/instructions.py 2000 \
        local_TB_breaker local_TB_breaker_failures native_TB_breaker native_TB_breaker_failures \
        local_TB_breaker_proxied local_TB_breaker_failures_proxied \
        native_TB_breaker_proxied native_TB_breaker_failures_proxied
Binaries: $DIANA_WASM, $DIANA_NATIVE_MODULE, $DIANA_QUOTA_BIN (the release builds by
default); $DIANA_BUILD_PROFILE names the profile they were built with when not `release`
(the page says it). Without bench/empty-filter built, the empty filter is left out: the
counts and the breaker's table, no ratios or verdicts.

Every process it starts (Envoy under valgrind, redis-server, diana-quota) is stopped by
its PID at the end, also on failure.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from common import NATIVE_MODULE, ROOT, Envoy, Procs, build_note, envoy_bin, say, start_quota, start_redis, wait_http
from variants import EMPTY, QUOTA, RELEASE, Variant, chosen, variants

WARM_UP = 300
# How long Envoy may take to be ready under valgrind: ~1 min on an idle machine, several
# when other builds share its 2 vCPUs ($DIANA_IR_START_S).
START_TIMEOUT_S = float(os.environ.get("DIANA_IR_START_S", "900"))
# Issue 40 item 7: a closed breaker's own instructions at most this share of the request's.
BREAKER_SHARE = 0.01
# How long the process is left without requests after its measured ones, to count what it
# does per second anyway ("net of idle work" in the breaker table).
IDLE_S = 5.0
DIANA_WASM = Path(os.environ.get("DIANA_WASM", RELEASE / "diana-envoy.wasm"))


def send(port: int, n: int) -> dict[int, int]:
    """`n` GETs of / on one keep-alive connection; status -> count."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    codes: dict[int, int] = {}
    try:
        for _ in range(n):
            conn.request("GET", "/")
            resp = conn.getresponse()
            resp.read()
            codes[resp.status] = codes.get(resp.status, 0) + 1
    finally:
        conn.close()
    return codes


def last_dump(logdir: Path, key: str, pid: int) -> int:
    """The instructions of the newest callgrind dump of `pid`."""
    dumps = sorted(logdir.glob(f"{key}.cg.{pid}.*"), key=lambda p: p.stat().st_mtime)
    if not dumps:
        raise RuntimeError(f"no callgrind dump for {key}")
    summary = next(line for line in dumps[-1].read_text().splitlines() if line.startswith("summary:"))
    return int(summary.split()[1])


def control(command: str, pid: int) -> None:
    subprocess.run(["callgrind_control", command, str(pid)], check=True, capture_output=True, timeout=120)


def measure(procs: Procs, key: str, filters: list[dict], n: int, quota: Optional[int],
            breaker: Optional[str] = None, upstream: Optional[int] = None) -> dict:
    logdir = procs.logdir
    for old in logdir.glob(f"{key}.cg.*"):
        old.unlink()
    envoy = Envoy(procs, f"ir-{key}", filters, concurrency=1, quota=quota, upstream=upstream)
    envoy.argv = ["valgrind", "--tool=callgrind", "--smc-check=all-non-file",
                  f"--callgrind-out-file={logdir}/{key}.cg.%p"] + envoy.argv
    proc = procs.spawn(envoy.name, envoy.argv)
    try:
        if not wait_http(f"http://127.0.0.1:{envoy.admin}/ready", proc, START_TIMEOUT_S):
            raise RuntimeError(f"Envoy {key} did not start under valgrind:\n{proc.log.read_text()[-3000:]}")
        send(envoy.port, WARM_UP)
        if quota is not None:
            # The first callouts under valgrind can outlast the callout timeout: the
            # gateway then enforces locally for a while, which is not what is measured.
            deadline = time.monotonic() + 60
            while envoy.stats().get("wasmcustom.diana_global_degraded", 0) != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{key}: the gateway stayed degraded")
                send(envoy.port, 20)
            send(envoy.port, 100)
        time.sleep(2.5)  # Diana's counters reach Envoy from the worker's tick
        before = envoy.stats()
        control("-z", proc.pid)
        sent_at = time.monotonic()
        codes = send(envoy.port, n)
        # Requests a second while counted: work done per unit of time (ticks, a breaker's
        # flush) falls on fewer requests the slower this is.
        seconds = time.monotonic() - sent_at
        rate = n / seconds
        control("-d", proc.pid)
        ir = last_dump(logdir, key, proc.pid)
        time.sleep(2.5)
        after = envoy.stats()
        stats = {k: v - before.get(k, 0) for k, v in after.items()}
        # The same process with no request for IDLE_S: what it does per second anyway
        # (Envoy's timers, Diana's tick), to take out of the requests' count.
        control("-z", proc.pid)
        idle_at = time.monotonic()
        time.sleep(IDLE_S)
        control("-d", proc.pid)
        idle_per_second = last_dump(logdir, key, proc.pid) / (time.monotonic() - idle_at)
    finally:
        procs.stop(proc, grace=30)
    if codes.get(200, 0) != n:
        raise RuntimeError(f"{key}: answers {codes}, expected {n} × 200")
    if stats.get("wasmcustom.diana_global_degraded_requests", 0):
        raise RuntimeError(f"{key}: {stats['wasmcustom.diana_global_degraded_requests']} requests were "
                           "decided locally (degraded) while measured")
    callouts = stats.get("wasmcustom.diana_global_callouts")
    breaker_calls = None
    if breaker is not None:
        # The closed breaker's path ran for every request counted, not some other one.
        breaker_calls = stats.get(f"wasmcustom.diana_breaker_calls.{breaker}", 0)
        if breaker_calls != n:
            raise RuntimeError(f"{key}: breaker {breaker} judged {breaker_calls} calls while measured, "
                               f"expected {n}")
    return {"ir": ir, "requests": n, "ir_per_request": ir / n,
            "idle_ir_per_second": round(idle_per_second), "seconds": round(seconds, 2),
            "net_ir_per_request": (ir - idle_per_second * seconds) / n,
            "callouts_per_request": None if callouts is None else callouts / n,
            "breaker_calls": breaker_calls, "requests_per_second": round(rate, 1)}


def render(vs: dict[str, Variant], results: dict[str, dict], n: int, command: str,
           loadavg: Optional[list[str]] = None, measured: Optional[str] = None) -> str:
    """The Markdown page: how it was measured, then the table with the bars' verdicts."""
    envoy = subprocess.run([envoy_bin(), "--version"], capture_output=True, text=True).stdout.strip()
    diana = DIANA_WASM
    native = (f"; `{NATIVE_MODULE.name}` {NATIVE_MODULE.stat().st_size:,} bytes"
              if any(k.startswith("native") for k in vs) and NATIVE_MODULE.is_file() else "")
    lines = [
        f"Measured {measured or time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` "
        f"({envoy.split('version: ')[-1]}; `{diana.name}` {diana.stat().st_size:,} bytes{native}, {build_note()}; "
        f"{subprocess.run(['valgrind', '--version'], capture_output=True, text=True).stdout.strip()})"
        + (f"; load average {' / '.join(loadavg)} at the start (other work on the machine's 2 vCPUs "
           "changes the counts only through the work done per unit of time, Diana's tick and Envoy's "
           "timers, which falls on fewer requests when the run is slower)" if loadavg else "") + ".",
        "",
    ]
    # The empty filter is left out when it was not built (see `main`): then no ratios to
    # it, no verdicts, only the counts.
    empty = results["empty"]["ir_per_request"] if "empty" in results else None
    base = results.get("nofilter", {}).get("ir_per_request")
    if empty is None:
        lines += [f"| variant ({n} requests each) | instructions per request |", "| --- | ---: |"]
        lines += [f"| {v.label} | {results[key]['ir_per_request']:,.0f} |" for key, v in vs.items()]
        lines += ["", "(The empty filter was not built, so not measured: no ratios to it, no bars' verdicts.)"]
    else:
        lines += [f"| variant ({n} requests each) | instructions per request | over no filter "
                  "| × empty (throughput) | bar | callouts per request |",
                  "| --- | ---: | ---: | ---: | --- | ---: |"]
    for key, v in vs.items():
        if empty is None:
            break
        ir = results[key]["ir_per_request"]
        over = f"{ir - base:+,.0f}" if base else "—"
        ratio = empty / ir
        if v.at_least is not None:
            verdict = f"≥ {v.at_least}×: {'**met**' if ratio >= v.at_least else '**not met**'}"
        elif v.cost_at_most is not None:
            met = ir <= v.cost_at_most * empty
            verdict = f"cost ≤ {v.cost_at_most}×: {'**met**' if met else '**not met**'} ({ir / empty:.3f}×)"
        else:
            verdict = "—"
        calls = results[key]["callouts_per_request"]
        calls_text = f"{calls:.4f}" if v.calls_out and calls is not None else "—"
        lines.append(f"| {v.label} | {ir:,.0f} | {over} | {ratio:.3f} | {verdict} | {calls_text} |")
    added = [(key, v) for key, v in vs.items() if v.adds_to is not None and v.adds_to in results]
    if added:
        lines += [
            "",
            "| a closed breaker's cost | instructions per request | without the breaker | the breaker's own "
            "| its share of the request | net of idle work: own (share) "
            f"| target ≤ {BREAKER_SHARE:.0%} (net) | breaker calls counted | requests/s with, without |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
        ]
        for key, v in added:
            ir = results[key]["ir_per_request"]
            base_ir = results[v.adds_to]["ir_per_request"]
            net = results[key]["net_ir_per_request"] - results[v.adds_to]["net_ir_per_request"]
            lines.append(f"| {v.label} | {ir:,.0f} | {base_ir:,.0f} | {ir - base_ir:+,.0f} "
                         f"| {(ir - base_ir) / ir:+.2%} | {net:+,.0f} ({net / ir:+.2%}) "
                         f"| {'**met**' if net / ir <= BREAKER_SHARE else '**not met**'} "
                         f"| {results[key]['breaker_calls']:,} of {n:,} "
                         f"| {results[key]['requests_per_second']:,.0f}, "
                         f"{results[v.adds_to]['requests_per_second']:,.0f} |")
        lines += [
            "",
            "*Net of idle work*: each count less what the same process does per second with no "
            "request (Envoy's timers, Diana's tick; measured right after, for "
            f"{IDLE_S:.0f} s) times the seconds its requests took. Under valgrind a run's rate "
            "varies several-fold from run to run, and that per-second work falls on fewer "
            "requests the slower a run is: the plain difference moves by hundreds of "
            "instructions between runs of the same build, the net one much less.",
        ]
    return "\n".join(lines)


def main() -> int:
    args = sys.argv[1:]
    n = int(args.pop(0)) if args and args[0].isdigit() else 2000
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        say("instructions: valgrind is not installed (apt-get install valgrind)")
        return 1
    vs = chosen(variants(DIANA_WASM), args)
    if not (EMPTY / "empty_filter.wasm").is_file():
        # The bars are ratios to it; a breaker's cost is a difference to its own base and
        # does not need it.
        say(f"instructions: {EMPTY / 'empty_filter.wasm'} not built (bench/empty-filter): left out, "
            "so the table has no ratios to it and no verdicts")
        vs = {k: v for k, v in vs.items() if k != "empty"}
    procs = Procs(ROOT / ".tmp/bench/instructions")
    loadavg = open("/proc/loadavg").read().split()[:3]
    results: dict[str, dict] = {}
    try:
        quota = None
        if any(v.calls_out for v in vs.values()):
            _redis, redis_port = start_redis(procs, "ir-redis", cpus=None)
            _quota, quota = start_quota(procs, QUOTA, redis_port, "ir-quota", cpus=None)
        upstream = None
        if any(v.proxied for v in vs.values()):
            # The proxied variants' upstream: a plain Envoy answering 200 on keep-alive
            # connections, not under valgrind (its instructions are not the gateway's).
            upstream = Envoy(procs, "ir-upstream", [], concurrency=1).start().port
        for key, v in vs.items():
            t0 = time.monotonic()
            results[key] = measure(procs, key, v.filters, n, quota if v.calls_out else None, v.breaker,
                                   upstream if v.proxied else None)
            say(f"instructions: {v.label}: {results[key]['ir_per_request']:,.0f} per request "
                f"at {results[key]['requests_per_second']:,.0f} requests/s ({time.monotonic() - t0:.0f} s)")
    finally:
        procs.stop_all()
    (procs.logdir / "results.json").write_text(json.dumps({**results, "_loadavg_start": loadavg}, indent=1))
    table = render(vs, results, n, " ".join(["python3 bench/instructions.py", str(n)] + args), loadavg)
    print(table)
    if os.environ.get("INSTRUCTIONS_OUT"):
        Path(os.environ["INSTRUCTIONS_OUT"]).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
