"""What reading an LLM answer's usage costs Envoy per streamed answer (issue 42).

Issue 42 asks for the cost per streamed answer of reading usage from the body (Diana's
`response_cost: {usage: openai}`), with and without. Counted as `bench/instructions.py`
counts the bars: each variant's Envoy runs alone under `valgrind --tool=callgrind`, and
after a warm-up the instructions it executes (all its threads) are counted over N
requests sent one after the other on one keep-alive connection (`instructions.control`:
`callgrind_control -z`, then `-d`). Here every request is a streamed OpenAI chat
completion from the fake LLM upstream (`tests/e2e/llm_upstream.py`, started by this
script and stopped by its PID): 100 content events (104 server-sent events with the
role's, the stop's, the usage's and `[DONE]`), `x-fake-delay-ms: 0`, the usage in the
last event and, for every variant alike, the total in a header too (`x-fake-usage-header`).
The answer is the same bytes for every variant; only Diana's rule differs:

- plain: one local TB rule that is never reached, charging nothing after the answer
  (`diana-envoy.wasm`, the trimmed module: no body callback);
- header: the same rule charged from the answer's header,
  `response_cost: {header: x-llm-tokens, max: 100000}` (`diana-envoy.wasm`);
- usage: the same rule charged from the usage in the body, `response_cost: {usage: openai}`
  (`diana-envoy-bodies.wasm`, the module `diana render-envoy` picks for such a document:
  every body chunk enters the VM and is read);
- plain on `diana-envoy-bodies.wasm`: what the bodies module costs a request whose rules
  read nothing (its chunks enter the VM, which returns at once);
- the native module (`libdiana_envoy_native.so`) with the plain, header and usage
  documents.

Every answer must arrive whole and unchanged (the bytes the fake sends when asked
directly), and every answer of a usage variant must have settled its charge from the
usage (`diana_usage_settled` = N, `diana_usage_unread` = 0), else the run fails. For the
native module the body chunks Envoy handed the filter are counted too (calls of its
exported `envoy_dynamic_module_on_http_filter_response_body` in the callgrind dump): how
many pieces the 104 events came in. The proxy-wasm module's callbacks are V8's generated
code, which callgrind cannot name, so the wasm rows have no such count; the same upstream
sends the same bytes, so theirs is of the same order.

No micro-figure of `UsageReader` alone: the `diana` command has no path that reads a body
(and the filter's binaries are stripped, so the profile cannot name it either).

    DIANA_BUILD_PROFILE=quick python3 bench/usage_cost.py [N=200] [VARIANT ...]

Binaries: `$DIANA_WASM` (`diana-envoy.wasm`, or the directory holding it and
`diana-envoy-bodies.wasm`; default `target/wasm32-wasip1/<profile>/`),
`$DIANA_NATIVE_MODULE` (default `target/<profile>/libdiana_envoy_native.so`; its variants
are left out when it is missing), `<profile>` being `$DIANA_BUILD_PROFILE` (`release`
unless set). Prints a Markdown page (how, the counts, the differences), also into
`$USAGE_COST_OUT` when set (the recorded one: docs/bench/usage-cost.md, shown in
BENCHMARKS.md), and writes .tmp/bench/usage-cost/results.json. ~1–2 min per variant on a
quiet 2-vCPU machine with N = 200, most of it Envoy starting under valgrind.

Every process it starts (Envoy under valgrind, the fake upstream) is stopped by its PID at
the end, also on failure.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common import (BUILD_PROFILE, ROOT, Envoy, Procs, build_note, envoy_bin, free_port, native_module_filter, say,
                    wait_http, wasm_filter)
from instructions import START_TIMEOUT_S, control
from overhead import diana_doc, local_rule

EVENTS = 100
SSE_EVENTS = EVENTS + 4  # the role's, the stop's, the usage's and [DONE]
WARM_UP = 30
PATH = "/v1/chat/completions"
BODY = json.dumps({"model": "gpt-4o-mini", "stream": True, "stream_options": {"include_usage": True},
                   "messages": [{"role": "user", "content": "Say a hundred words."}]}).encode()
HEADERS = {"content-type": "application/json", "x-fake-events": str(EVENTS), "x-fake-delay-ms": "0",
           "x-fake-input": "1000", "x-fake-output": "200", "x-fake-usage-header": "x-llm-tokens"}
# The paced pass: a pause before each event, so that each reaches Envoy as a chunk of its
# own, as a model's tokens do (tens of ms apart); 3 ms is enough under valgrind.
PACED_DELAY_MS = int(os.environ.get("USAGE_COST_DELAY_MS", "3"))

_wasm = Path(os.environ.get("DIANA_WASM", ROOT / f"target/wasm32-wasip1/{BUILD_PROFILE}"))
WASM_DIR = (_wasm if _wasm.is_dir() else _wasm.parent).resolve()
TRIMMED = WASM_DIR / "diana-envoy.wasm"
BODIES = WASM_DIR / "diana-envoy-bodies.wasm"
NATIVE = Path(os.environ.get("DIANA_NATIVE_MODULE",
                             ROOT / f"target/{BUILD_PROFILE}/libdiana_envoy_native.so")).resolve()
NATIVE_BODY_HOOK = "envoy_dynamic_module_on_http_filter_response_body"

# One resource, one local TB rule never reached (rpu 10⁹ a second), as in section 6.
DOCS = {
    "plain": diana_doc([local_rule("TB")], url=PATH),
    "header": diana_doc([local_rule("TB", extra=", response_cost: {header: x-llm-tokens, max: 100000}")], url=PATH),
    "usage": diana_doc([local_rule("TB", extra=", response_cost: {usage: openai}")], url=PATH),
}


@dataclass(frozen=True)
class Variant:
    label: str
    filters: list[dict]
    reads_usage: bool
    native: bool


def variants() -> dict[str, Variant]:
    out = {
        "wasm_plain": Variant("wasm, plain rule (`diana-envoy.wasm`)",
                              [wasm_filter("diana", str(TRIMMED), DOCS["plain"])], False, False),
        "wasm_header": Variant("wasm, charged from a header (`diana-envoy.wasm`)",
                               [wasm_filter("diana", str(TRIMMED), DOCS["header"])], False, False),
        "wasm_usage": Variant("wasm, usage from the body (`diana-envoy-bodies.wasm`)",
                              [wasm_filter("diana", str(BODIES), DOCS["usage"])], True, False),
        "wasm_plain_bodies": Variant("wasm, plain rule on `diana-envoy-bodies.wasm`",
                                     [wasm_filter("diana", str(BODIES), DOCS["plain"])], False, False),
    }
    if NATIVE.is_file():
        out["native_plain"] = Variant("native module, plain rule", [native_module_filter(DOCS["plain"], NATIVE)],
                                      False, True)
        out["native_header"] = Variant("native module, charged from a header",
                                       [native_module_filter(DOCS["header"], NATIVE)], False, True)
        out["native_usage"] = Variant("native module, usage from the body",
                                      [native_module_filter(DOCS["usage"], NATIVE)], True, True)
    return out


# Measured unless variants are named (native_header: name it).
DEFAULT = ("wasm_plain", "wasm_header", "wasm_usage", "wasm_plain_bodies", "native_plain", "native_usage")

# The differences reported: (key, minus, what it is).
DIFFERENCES = [
    ("wasm_usage", "wasm_plain", "wasm: reading usage (bodies module) − plain rule (trimmed module)"),
    ("wasm_usage", "wasm_header", "wasm: reading usage (bodies module) − charging from a header (trimmed module)"),
    ("wasm_header", "wasm_plain", "wasm: charging from a header − plain rule"),
    ("wasm_plain_bodies", "wasm_plain", "wasm: the bodies module on a request that reads nothing − trimmed module"),
    ("wasm_usage", "wasm_plain_bodies", "wasm: reading usage − plain rule, both on the bodies module"),
    ("native_usage", "native_plain", "native: reading usage − plain rule"),
    ("native_usage", "native_header", "native: reading usage − charging from a header"),
    ("native_header", "native_plain", "native: charging from a header − plain rule"),
]


def expected_answer(upstream: int) -> bytes:
    """The answer's bytes as the fake sends them (every answer through Envoy must be these)."""
    conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=30)
    try:
        conn.request("POST", PATH, body=BODY, headers=HEADERS)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200 or resp.getheader("x-llm-tokens") != "1200" or body.count(b"data: ") != SSE_EVENTS:
            raise RuntimeError(f"the fake upstream answered {resp.status}: {body[:300]!r}")
        return body
    finally:
        conn.close()


def send(port: int, n: int, expected: bytes, delay_ms: int = 0) -> dict[str, int]:
    """`n` streamed answers on one keep-alive connection (`delay_ms` before each event
    after the first); each read to its end and compared with `expected`. Counts of `ok`
    and of each kind of failure."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {**HEADERS, "x-fake-delay-ms": str(delay_ms)}
    out: dict[str, int] = {}
    try:
        for _ in range(n):
            conn.request("POST", PATH, body=BODY, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                kind = f"status {resp.status}"
            elif body != expected:
                kind = "body changed"
            elif resp.getheader("x-llm-tokens") != "1200":
                kind = "no x-llm-tokens"
            else:
                kind = "ok"
            out[kind] = out.get(kind, 0) + 1
    finally:
        conn.close()
    return out


def calls_to(dump: Path, function: str) -> int:
    """Calls of `function` recorded in a callgrind dump (its `cfn=` entries, names
    compressed to `(id)` after their first use, each followed by a `calls=` line)."""
    names: dict[str, str] = {}
    total = 0
    pending = False
    with dump.open(errors="replace") as f:
        for line in f:
            if pending and line.startswith("calls="):
                total += int(line[6:].split()[0])
                pending = False
                continue
            pending = False
            if line.startswith(("fn=", "cfn=")):
                m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if not m:
                    continue
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                pending = line.startswith("cfn=") and names.get(m.group(1)) == function
    return total


def pass_(procs: Procs, envoy: Envoy, pid: int, key: str, v: Variant, n: int, delay_ms: int,
          expected: bytes) -> dict:
    """One counted pass of `n` answers through a running Envoy: zero, send, dump."""
    logdir = procs.logdir
    known = set(logdir.glob(f"{key}.cg.{pid}.*"))
    time.sleep(2.5)  # Diana's counters reach Envoy from the worker's tick
    before = envoy.stats()
    control("-z", pid)
    sent_at = time.monotonic()
    answers = send(envoy.port, n, expected, delay_ms)
    rate = n / (time.monotonic() - sent_at)
    control("-d", pid)
    time.sleep(2.5)
    after = envoy.stats()
    stats = {k: after[k] - before.get(k, 0) for k in after}
    dumps = sorted(set(logdir.glob(f"{key}.cg.{pid}.*")) - known, key=lambda p: p.stat().st_mtime)
    if not dumps:
        raise RuntimeError(f"no callgrind dump for {key}")
    summary = next(line for line in dumps[-1].read_text(errors="replace").splitlines() if line.startswith("summary:"))
    ir = int(summary.split()[1])
    chunks = calls_to(dumps[-1], NATIVE_BODY_HOOK) if v.native else None
    if answers.get("ok", 0) != n:
        raise RuntimeError(f"{key}: answers {answers}, expected {n} whole and unchanged")
    settled = stats.get("wasmcustom.diana_usage_settled", 0)
    unread = stats.get("wasmcustom.diana_usage_unread", 0)
    if v.reads_usage and (settled != n or unread):
        raise RuntimeError(f"{key}: usage settled {settled}, unread {unread} of {n} answers")
    if not v.reads_usage and settled + unread:
        raise RuntimeError(f"{key}: reads no usage, yet settled {settled}, unread {unread}")
    return {"ir": ir, "requests": n, "delay_ms": delay_ms, "ir_per_request": ir / n, "usage_settled": settled,
            "body_chunks_per_answer": None if chunks is None else chunks / n,
            "requests_per_second": round(rate, 2)}


def measure(procs: Procs, key: str, v: Variant, n: int, n_paced: int, upstream: int, expected: bytes) -> dict:
    """One Envoy under callgrind for variant `v`: a warm-up, then the pass without pauses
    (`burst`, `n` answers) and the paced one (`paced`, `n_paced`), each counted alone."""
    for old in procs.logdir.glob(f"{key}.cg.*"):
        old.unlink()
    envoy = Envoy(procs, f"uc-{key}", v.filters, concurrency=1, upstream=upstream)
    envoy.argv = ["valgrind", "--tool=callgrind", "--smc-check=all-non-file",
                  f"--callgrind-out-file={procs.logdir}/{key}.cg.%p"] + envoy.argv
    proc = procs.spawn(envoy.name, envoy.argv)
    try:
        if not wait_http(f"http://127.0.0.1:{envoy.admin}/ready", proc, START_TIMEOUT_S):
            raise RuntimeError(f"Envoy {key} did not start under valgrind:\n{proc.log.read_text()[-3000:]}")
        warm = send(envoy.port, WARM_UP, expected)
        if warm.get("ok", 0) != WARM_UP:
            raise RuntimeError(f"{key}: warm-up answers {warm}")
        out = {"burst": pass_(procs, envoy, proc.pid, key, v, n, 0, expected)}
        if n_paced:
            out["paced"] = pass_(procs, envoy, proc.pid, key, v, n_paced, PACED_DELAY_MS, expected)
        return out
    finally:
        procs.stop(proc, grace=30)


def render(vs: dict[str, Variant], results: dict[str, dict], n: int, n_paced: int, command: str,
           loadavg: list[str]) -> str:
    envoy = subprocess.run([envoy_bin(), "--version"], capture_output=True, text=True).stdout.strip()
    sizes = [f"`{p.name}` {p.stat().st_size:,} bytes" for p in (TRIMMED, BODIES) if p.is_file()]
    if any(v.native for v in vs.values()):
        sizes.append(f"`{NATIVE.name}` {NATIVE.stat().st_size:,} bytes")
    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
    passes = [("burst", f"without pauses ({n} answers)")]
    if n_paced:
        passes.append(("paced", f"{PACED_DELAY_MS} ms between events ({n_paced} answers)"))
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` "
        f"({envoy.split('version: ')[-1]}; {'; '.join(sizes)}; {build_note()}; {valgrind}); load average "
        f"{' / '.join(loadavg)} at the start. Each answer: {EVENTS} content events, {SSE_EVENTS} "
        "server-sent events in all (about 24 KB), from the fake upstream without pauses "
        "(`x-fake-delay-ms: 0`) and paced; both passes counted in the same Envoy, one after the other.",
        "",
        "| variant | " + " | ".join(f"{label}: instructions per answer | body chunks" for _, label in passes)
        + " | usage settled |",
        "| --- |" + " ---: | ---: |" * len(passes) + " ---: |",
    ]
    for key, v in vs.items():
        cells = []
        settled = 0
        for pacing, _ in passes:
            r = results[key][pacing]
            cells.append(f"{r['ir_per_request']:,.0f}")
            cells.append("—" if r["body_chunks_per_answer"] is None else f"{r['body_chunks_per_answer']:.1f}")
            settled += r["usage_settled"]
        total = n + (n_paced if len(passes) > 1 else 0)
        lines.append(f"| {v.label} | {' | '.join(cells)} | {f'{settled:,} of {total:,}' if v.reads_usage else '—'} |")
    lines += [
        "",
        "| difference | " + " | ".join(f"{label}: per answer | per event (÷ {SSE_EVENTS}) | share of the first's total"
                                      for _, label in passes) + " |",
        "| --- |" + " ---: | ---: | ---: |" * len(passes),
    ]
    for a, b, what in DIFFERENCES:
        if a not in results or b not in results:
            continue
        cells = []
        for pacing, _ in passes:
            ia, ib = results[a][pacing]["ir_per_request"], results[b][pacing]["ir_per_request"]
            cells += [f"{ia - ib:+,.0f}", f"{(ia - ib) / SSE_EVENTS:+,.0f}", f"{(ia - ib) / ia:+.1%}"]
        lines.append(f"| {what} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> int:
    args = sys.argv[1:]
    n = int(args.pop(0)) if args and args[0].isdigit() else 200
    n_paced = int(os.environ.get("USAGE_COST_PACED_N", str(n // 2)))
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        say("usage_cost: valgrind is not installed (apt-get install valgrind)")
        return 1
    for module in (TRIMMED, BODIES):
        if not module.is_file():
            say(f"usage_cost: {module} is missing (scripts/build [--profile quick])")
            return 1
    vs = variants()
    if args:
        unknown = [k for k in args if k not in vs]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {', '.join(vs)}")
        vs = {k: v for k, v in vs.items() if k in args}
    else:
        vs = {k: v for k, v in vs.items() if k in DEFAULT}
    if not NATIVE.is_file():
        say(f"usage_cost: {NATIVE} not built: the native module's variants are left out")
    procs = Procs(ROOT / ".tmp/bench/usage-cost")
    loadavg = open("/proc/loadavg").read().split()[:3]
    results: dict[str, dict] = {}
    started = time.monotonic()
    try:
        upstream = free_port()
        fake = procs.spawn("llm-upstream", [sys.executable, str(ROOT / "tests/e2e/llm_upstream.py"),
                                            "--port", str(upstream)])
        if not wait_http(f"http://127.0.0.1:{upstream}/healthz", fake, 20):
            raise RuntimeError(f"the fake LLM upstream did not start: {fake.log.read_text()[-2000:]}")
        expected = expected_answer(upstream)
        for key, v in vs.items():
            t0 = time.monotonic()
            results[key] = measure(procs, key, v, n, n_paced, upstream, expected)
            say(f"usage_cost: {v.label}: " + ", ".join(
                f"{pacing} {r['ir_per_request']:,.0f} per answer at {r['requests_per_second']:,.1f} answers/s"
                for pacing, r in results[key].items()) + f" ({time.monotonic() - t0:.0f} s)")
    finally:
        procs.stop_all()
    (procs.logdir / "results.json").write_text(json.dumps(
        {**results, "_loadavg_start": loadavg, "_loadavg_end": open("/proc/loadavg").read().split()[:3],
         "_seconds": round(time.monotonic() - started)}, indent=1))
    command = " ".join(([f"DIANA_BUILD_PROFILE={BUILD_PROFILE}"] if BUILD_PROFILE != "release" else [])
                       + ["python3 bench/usage_cost.py", str(n)] + args)
    page = render(vs, results, n, n_paced, command, loadavg)
    print(page)
    if os.environ.get("USAGE_COST_OUT"):
        Path(os.environ["USAGE_COST_OUT"]).write_text(page + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
