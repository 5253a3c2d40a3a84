"""What reading an LLM answer's usage costs Envoy per streamed answer (issue 42).

Issue 42 asks for the cost per streamed answer of reading usage from the body (Diana's
`response_cost: {usage: openai}`), with and without. Counted as `bench/instructions.py`
counts the bars: Envoy runs under `valgrind --tool=callgrind` (V8's generated code
included), and after a warm-up the instructions it executes (all its threads) are counted
over N requests sent one after the other on one keep-alive connection
(`instructions.control`: `callgrind_control -z`, then `-d`). Here every request is a
streamed OpenAI chat completion from the fake LLM upstream (`tests/e2e/llm_upstream.py`,
started by this script and stopped by its PID): 100 content events, 104 server-sent
events with the role's, the stop's, the usage's and `[DONE]` (25,012 bytes), the usage in
the last one and, for every variant alike, the total in a header too
(`x-fake-usage-header`). The answer is the same bytes for every variant; only Diana's
rule, and the module, differ:

- `wasm_plain`: one local TB rule that is never reached and charges nothing after the
  answer, on `diana-envoy.wasm` (the trimmed module: no body callback);
- `wasm_header`: the same rule charged from the answer's header,
  `response_cost: {header: x-llm-tokens, max: 100000}` (`diana-envoy.wasm`);
- `wasm_usage`: the same rule charged from the usage in the body,
  `response_cost: {usage: openai}`, on `diana-envoy-bodies.wasm` (the module `diana
  render-envoy` picks for such a document: every body chunk enters the VM and is read);
- `wasm_plain_bodies`: the plain rule on `diana-envoy-bodies.wasm`: what the bodies module
  costs a request whose rules read nothing (its chunks enter the VM, which returns);
- `native_plain`, `native_header`, `native_usage`: the three documents on the native module
  (`libdiana_envoy_native.so`).

Each variant is counted twice: without pauses (`x-fake-delay-ms: 0`, N answers), when the
104 events reach Envoy in a few reads, and paced (a pause before each event, N/4
answers), when each event is a body chunk of its own as a model's tokens are (tens of ms
apart in production): the first shows the reading of the bytes, the second adds the cost
of each chunk's trip into the filter.

The variants of one module share one Envoy, each on a listener of its own (V8 takes
minutes to compile a module under valgrind; once per module keeps the run near 10
minutes): the counters are zeroed before a pass and dumped after it, while the other
listeners are idle (their plugins' 1 s ticks are all they add). Every answer must arrive
whole and unchanged (the bytes the fake sends when asked directly), and every answer of
a usage variant must have settled its charge from the usage (`diana_usage_settled` = N,
`diana_usage_unread` = 0), else the run fails. For the native module the body chunks
Envoy handed the filter are counted too (calls of its exported
`envoy_dynamic_module_on_http_filter_response_body` in the dump); the proxy-wasm
callbacks are V8's generated code, which callgrind cannot name, so the wasm rows have no
such count (the same upstream sends the same bytes, so theirs is of the same order).

The reader alone, natively, without Envoy: `diana simulate` (`$DIANA_CLI`, default
`target/<profile>/diana`) settles a JSON log line's `response_body` through the same
worker (the whole body as one chunk). Two replays of one log of M lines, each with the
answer's bytes, are counted under callgrind, through the usage rule and through the plain
rule; the difference ÷ M is what reading and settling one answer costs (reading the log
and the rest are the same in both). A replay of three lines on a small budget first
checks that this `diana` reads the body (else that figure is left out: a build from
before `response_body`).

    DIANA_BUILD_PROFILE=quick python3 bench/usage_cost.py [N=200] [VARIANT ...]

N/4 paced answers unless $USAGE_COST_PACED_N says (0: no paced pass); the pause
$USAGE_COST_DELAY_MS (3: enough under valgrind for each event to be read alone); M = 200
($USAGE_COST_MICRO_N; 0: no figure of the reader alone). Binaries: `$DIANA_WASM`
(`diana-envoy.wasm`, or the directory holding it and `diana-envoy-bodies.wasm`; default
`target/wasm32-wasip1/<profile>/`), `$DIANA_NATIVE_MODULE` (default
`target/<profile>/libdiana_envoy_native.so`; its variants are left out when it is
missing), `<profile>` being `$DIANA_BUILD_PROFILE` (`release` unless set). Prints a
Markdown page (how, the counts, the differences), also into `$USAGE_COST_OUT` when set
(the recorded one is docs/bench/usage-cost.md, which BENCHMARKS.md shows), and writes
.tmp/bench/usage-cost/results.json.

Every process it starts (Envoy under valgrind, the fake upstream, `diana simulate`) is
stopped by its PID at the end, also on failure.
"""

from __future__ import annotations

import copy
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
DIANA_CLI = Path(os.environ.get("DIANA_CLI", ROOT / f"target/{BUILD_PROFILE}/diana")).resolve()
MICRO_N = int(os.environ.get("USAGE_COST_MICRO_N", "200"))

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
    # The module it runs: the variants of one module share an Envoy (`measure`).
    module: str


def variants() -> dict[str, Variant]:
    out = {
        "wasm_plain": Variant("wasm, plain rule (`diana-envoy.wasm`)",
                              [wasm_filter("diana", str(TRIMMED), DOCS["plain"])], False, False, "trimmed"),
        "wasm_header": Variant("wasm, charged from a header (`diana-envoy.wasm`)",
                               [wasm_filter("diana", str(TRIMMED), DOCS["header"])], False, False, "trimmed"),
        "wasm_usage": Variant("wasm, usage from the body (`diana-envoy-bodies.wasm`)",
                              [wasm_filter("diana", str(BODIES), DOCS["usage"])], True, False, "bodies"),
        "wasm_plain_bodies": Variant("wasm, plain rule on `diana-envoy-bodies.wasm`",
                                     [wasm_filter("diana", str(BODIES), DOCS["plain"])], False, False, "bodies"),
    }
    if NATIVE.is_file():
        out["native_plain"] = Variant("native module, plain rule", [native_module_filter(DOCS["plain"], NATIVE)],
                                      False, True, "native")
        out["native_header"] = Variant("native module, charged from a header",
                                       [native_module_filter(DOCS["header"], NATIVE)], False, True, "native")
        out["native_usage"] = Variant("native module, usage from the body",
                                      [native_module_filter(DOCS["usage"], NATIVE)], True, True, "native")
    return out


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


def pass_(procs: Procs, envoy: Envoy, pid: int, group: str, port: int, key: str, v: Variant, n: int,
          delay_ms: int, expected: bytes) -> dict:
    """One counted pass of `n` answers through the listener at `port` of a running Envoy:
    zero, send, dump."""
    logdir = procs.logdir
    known = set(logdir.glob(f"{group}.cg.{pid}.*"))
    time.sleep(2.5)  # Diana's counters reach Envoy from the worker's tick
    before = envoy.stats()
    control("-z", pid)
    sent_at = time.monotonic()
    answers = send(port, n, expected, delay_ms)
    rate = n / (time.monotonic() - sent_at)
    control("-d", pid)
    time.sleep(2.5)
    after = envoy.stats()
    stats = {k: after[k] - before.get(k, 0) for k in after}
    dumps = sorted(set(logdir.glob(f"{group}.cg.{pid}.*")) - known, key=lambda p: p.stat().st_mtime)
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


def measure(procs: Procs, group: str, members: dict[str, Variant], n: int, n_paced: int, upstream: int,
            expected: bytes) -> dict[str, dict]:
    """One Envoy under callgrind for the variants of one module, each on a listener of its
    own (a wasm module is compiled once for them all: V8 takes minutes to start under
    valgrind). For each in turn: a warm-up, then the pass without pauses (`burst`, `n`
    answers) and the paced one (`paced`, `n_paced`), each counted alone while the other
    listeners are idle (their plugins' 1 s ticks are all they add, a few instructions per
    answer)."""
    for old in procs.logdir.glob(f"{group}.cg.*"):
        old.unlink()
    keys = list(members)
    envoy = Envoy(procs, f"uc-{group}", members[keys[0]].filters, concurrency=1, upstream=upstream)
    config = json.loads(envoy.config_path.read_text())
    listeners = config["static_resources"]["listeners"]
    ports = {keys[0]: envoy.port}
    for i, key in enumerate(keys[1:], 1):
        listener = copy.deepcopy(listeners[0])
        ports[key] = free_port()
        listener["name"] = f"ingress_{key}"
        listener["address"]["socket_address"]["port_value"] = ports[key]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["stat_prefix"] = f"ingress_{key}"
        hcm["http_filters"] = members[key].filters + hcm["http_filters"][-1:]  # and the router
        listeners.append(listener)
    envoy.config_path.write_text(json.dumps(config, indent=1))
    envoy.argv = ["valgrind", "--tool=callgrind", "--smc-check=all-non-file",
                  f"--callgrind-out-file={procs.logdir}/{group}.cg.%p"] + envoy.argv
    proc = procs.spawn(envoy.name, envoy.argv)
    out: dict[str, dict] = {}
    try:
        t0 = time.monotonic()
        if not wait_http(f"http://127.0.0.1:{envoy.admin}/ready", proc, START_TIMEOUT_S):
            raise RuntimeError(f"Envoy {group} did not start under valgrind:\n{proc.log.read_text()[-3000:]}")
        say(f"usage_cost: Envoy {group} ready under valgrind in {time.monotonic() - t0:.0f} s")
        for key, v in members.items():
            t0 = time.monotonic()
            warm = send(ports[key], WARM_UP, expected)
            if warm.get("ok", 0) != WARM_UP:
                raise RuntimeError(f"{key}: warm-up answers {warm}")
            out[key] = {"burst": pass_(procs, envoy, proc.pid, group, ports[key], key, v, n, 0, expected)}
            if n_paced:
                out[key]["paced"] = pass_(procs, envoy, proc.pid, group, ports[key], key, v, n_paced,
                                          PACED_DELAY_MS, expected)
            say(f"usage_cost: {v.label}: " + ", ".join(
                f"{pacing} {r['ir_per_request']:,.0f} per answer at {r['requests_per_second']:,.1f} answers/s"
                for pacing, r in out[key].items()) + f" ({time.monotonic() - t0:.0f} s)")
        return out
    finally:
        procs.stop(proc, grace=30)


def callgrind_total(dump: Path) -> int:
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no total in {dump}")


def micro(procs: Procs, expected: bytes) -> Optional[dict]:
    """The reader alone (`diana simulate`, see the module's doc): instructions to read and
    settle one answer, or None when this `diana` does not read `response_body`."""
    if MICRO_N <= 0:
        return None
    if not DIANA_CLI.is_file():
        say(f"usage_cost: {DIANA_CLI} not built: no figure of the reader alone")
        return None
    answer = expected.decode()  # the events, as the client read them (no chunked framing)

    def log(path: Path, lines: int) -> Path:
        with path.open("w") as f:
            for i in range(lines):
                f.write(json.dumps({"ts": 1_700_000_000 + i / 100, "path": PATH, "method": "POST", "status": 200,
                                    "response_headers": {"content-type": "text/event-stream; charset=utf-8"},
                                    "response_body": answer}) + "\n")
        return path

    logdir = procs.logdir
    # Does it read the body? 1,200 tokens an answer on a budget of 2,000 a second: the
    # third answer is refused when it does, none when it does not.
    check_doc = logdir / "micro-check.yaml"
    check_doc.write_text(diana_doc(["{name: bench, rpu: 2000, unit: second, algo: TB, response_cost: {usage: openai}}"],
                                   url=PATH))
    out = subprocess.run([str(DIANA_CLI), "simulate", "--json", str(check_doc), str(log(logdir / "micro-3.jsonl", 3))],
                         capture_output=True, text=True, timeout=60)
    try:
        reads = out.returncode == 0 and json.loads(out.stdout)["all"]["rejected"] == 1
    except (ValueError, KeyError, TypeError):
        reads = False
    if not reads:
        say(f"usage_cost: {DIANA_CLI} does not read response_body (a build before it?): no figure of the reader alone")
        return None
    lines = log(logdir / "micro.jsonl", MICRO_N)
    totals = {}
    for doc in ("plain", "usage"):
        policy = logdir / f"micro-{doc}.yaml"
        policy.write_text(DOCS[doc])
        dump = logdir / f"micro-{doc}.cg"
        proc = procs.spawn(f"micro-{doc}", ["valgrind", "--tool=callgrind", f"--callgrind-out-file={dump}",
                                            str(DIANA_CLI), "simulate", "--totals", str(policy), str(lines)])
        if proc.popen.wait(timeout=1200) != 0:
            raise RuntimeError(f"diana simulate under callgrind failed: {proc.log.read_text()[-2000:]}")
        totals[doc] = callgrind_total(dump)
    per_answer = (totals["usage"] - totals["plain"]) / MICRO_N
    return {"lines": MICRO_N, "totals": totals, "per_answer": per_answer, "per_event": per_answer / SSE_EVENTS,
            "per_byte": per_answer / len(expected), "bytes": len(expected)}


def render(vs: dict[str, Variant], results: dict[str, dict], n: int, n_paced: int, command: str,
           loadavg: list[str], alone: Optional[dict], len_answer: int) -> str:
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
        f"server-sent events in all ({len_answer:,} bytes) from the fake upstream, without pauses "
        "(`x-fake-delay-ms: 0`) and paced; the variants of one module in one Envoy, a listener each, "
        "counted one pass at a time. *Share*: of the first variant's total.",
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
        "| difference | " + " | ".join(f"{label}: per answer | per event (÷ {SSE_EVENTS}) | share"
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
    if alone is not None:
        lines += [
            "",
            f"The reader alone, natively (`diana simulate`, {alone['lines']} log lines each carrying the answer's "
            f"{alone['bytes']:,} bytes, fed as one chunk): {alone['per_answer']:+,.0f} instructions per answer, "
            f"{alone['per_event']:+,.0f} per event, {alone['per_byte']:+.1f} per byte (usage rule − plain rule: "
            f"{alone['totals']['usage']:,} − {alone['totals']['plain']:,} for the replays).",
        ]
    return "\n".join(lines)


def main() -> int:
    args = sys.argv[1:]
    n = int(args.pop(0)) if args and args[0].isdigit() else 200
    n_paced = int(os.environ.get("USAGE_COST_PACED_N", str(n // 4)))
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
        groups: dict[str, dict[str, Variant]] = {}
        for key, v in vs.items():
            groups.setdefault(v.module, {})[key] = v
        for group, members in groups.items():
            results.update(measure(procs, group, members, n, n_paced, upstream, expected))
        alone = micro(procs, expected)
        if alone is not None:
            say(f"usage_cost: the reader alone: {alone['per_answer']:,.0f} per answer")
    finally:
        procs.stop_all()
    (procs.logdir / "results.json").write_text(json.dumps(
        {**results, "_reader_alone": alone, "_loadavg_start": loadavg, "_loadavg_end": open("/proc/loadavg").read().split()[:3],
         "_seconds": round(time.monotonic() - started)}, indent=1))
    command = " ".join(([f"DIANA_BUILD_PROFILE={BUILD_PROFILE}"] if BUILD_PROFILE != "release" else [])
                       + ["python3 bench/usage_cost.py", str(n)] + args)
    page = render(vs, results, n, n_paced, command, loadavg, alone, len(expected))
    print(page)
    if os.environ.get("USAGE_COST_OUT"):
        Path(os.environ["USAGE_COST_OUT"]).write_text(page + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
