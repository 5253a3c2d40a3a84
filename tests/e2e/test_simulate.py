"""`diana simulate` against a real Envoy: the same requests sent through Envoy with the
Diana filter and replayed by `diana simulate` from their log must be counted the same.

Two scenarios, each replayed from two logs — the client's own request log (JSON lines,
send times in microseconds) and Envoy's access log (default format plus the device id,
start times in milliseconds):

1. Scripted bursts on one worker (`concurrency=1`) through local W, SW, TB rules, a
   dry-run rule and a user-agent actor. The bursts are placed in the middle of 100 ms
   slices and the token buckets are left k + ½ tokens between bursts, so that no
   decision depends on the few milliseconds between the client's clock, Envoy's
   START_TIME and the filter's own clock: the per-rule totals and the per-second counts
   must agree **exactly** (a run whose requests strayed outside their slice — a stalled
   machine — is detected from the access log and run again, at most three times).

2. A short Weitter hot event (bench/weitter.py's policy, bench/loadgen.py's open-loop
   traffic: a flood on /hot/trending from 2,000 devices over normal timeline reads). The
   token bucket on /hot is empty all through the flood, so which request finds the next
   token depends on when each was evaluated, to the microsecond; the client's send time
   and Envoy's START_TIME are earlier than the filter's clock by a varying amount (the
   request's way through the kernel and Envoy's event loop). Over the flood the totals
   still agree to within the tokens that accrue in that jitter — a tolerance of 3
   requests plus 1 % per rule, and 3 requests plus 5 % per second (a token can move
   across a second's boundary). The per-device bucket never fills: exact.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

import harness
from harness import KeepAlive, REPO, record, rule_metric

BENCH = REPO / "bench"

# Envoy's default access-log format (docs: "Default Format String"), as written out for
# a second log that appends the device id.
DEFAULT_FORMAT = (
    '[%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%" '
    "%RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION% "
    '%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% "%REQ(X-FORWARDED-FOR)%" "%REQ(USER-AGENT)%" '
    '"%REQ(X-REQUEST-ID)%" "%REQ(:AUTHORITY)%" "%UPSTREAM_HOST%"'
)
WITH_DEVICE = DEFAULT_FORMAT + ' "%REQ(X-DEVICE-ID)%"\n'
# Envoy buffers access logs and flushes them every 10 s by default.
FLUSH = ["--file-flush-interval-msec", "50"]

ENVOY_LINE = re.compile(r'^\[([^\]]+)\] "(\S+) (\S+) ')

_DIANA: list[Path] = []
# The renderer the harness uses, before any test wraps it.
_RENDER = harness.render_envoy_json


def diana_binary() -> Path:
    """The `diana` executable, built once per session; its path as cargo reports it."""
    if not _DIANA:
        built = subprocess.run(
            ["cargo", "build", "-p", "diana-cli", "--message-format=json-render-diagnostics"],
            capture_output=True, text=True, timeout=900, cwd=REPO,
        )  # fmt: skip
        assert built.returncode == 0, f"cargo build -p diana-cli failed:\n{built.stderr[-4000:]}"
        for line in built.stdout.splitlines():
            message = json.loads(line)
            if message.get("reason") == "compiler-artifact" and message.get("executable") \
                    and message["target"]["name"] == "diana":
                _DIANA.append(Path(message["executable"]))
        assert _DIANA, "cargo built no `diana` executable"
    return _DIANA[0]


def simulate(policy: str, log: Path, *args: str) -> dict[str, Any]:
    policy_path = log.with_suffix(".policy.yaml")
    policy_path.write_text(policy)
    run = subprocess.run([str(diana_binary()), "simulate", str(policy_path), str(log), "--json", *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"diana simulate failed ({run.returncode}): {run.stderr}"
    return json.loads(run.stdout)


def with_access_logs(monkeypatch: pytest.MonkeyPatch, default_log: Path, device_log: Path) -> None:
    """The next Envoy the harness renders writes both access logs."""
    def render_with_logs(**kwargs: Any) -> str:
        kwargs["access_logs"] = [(str(default_log), None), (str(device_log), WITH_DEVICE)]
        return _RENDER(**kwargs)

    monkeypatch.setattr(harness, "render_envoy_json", render_with_logs)


def wait_for_lines(path: Path, count: int, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"{path}: {len(lines)} lines after {timeout}s, expected {count}")


def envoy_rules(envoy: harness.Envoy, names: list[str]) -> dict[str, tuple[int, int, int]]:
    """(allowed, limited, dry-run limited) per rule, from Envoy's own metrics."""
    metrics = envoy.diana_metrics()
    return {name: tuple(rule_metric(metrics, kind, name) or 0 for kind in ("allowed", "limited", "dry_run_limited"))
            for name in names}  # type: ignore[misc]


def simulated_rules(report: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    out = {}
    for rule in report["rules"]:
        t = rule["totals"]
        out[rule["name"]] = (t["admitted"] + t["delayed"], t["rejected"], t["dry_run"])
    return out


def simulated_seconds(report: dict[str, Any]) -> dict[int, tuple[int, int]]:
    return {s["t"]: (s["all"]["admitted"] + s["all"]["delayed"], s["all"]["rejected"]) for s in report["seconds"]}


def client_seconds(entries: list[dict[str, Any]], limited: Any) -> dict[int, tuple[int, int]]:
    """What Envoy did per second (of the send time), from the answers the client got."""
    out: dict[int, list[int]] = {}
    for e in entries:
        row = out.setdefault(int(e["ts"]), [0, 0])
        row[1 if limited(e) else 0] += 1
    return {t: (a, r) for t, (a, r) in out.items()}


def write_jsonl(path: Path, entries: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in sorted(entries, key=lambda e: e["ts"])))


# --------------------------------------------------------------------------- 1. exact

EXACT_POLICY = """\
resources:
  - Url: /
    rules:
      - {name: per_device, actor: device, algo: TB, rpu: 4, unit: second, burst: 6}
  - Url: /w
    rules:
      - {name: w_all, actor: all, algo: W, rpu: 7, unit: second}
  - Url: /sw
    rules:
      - {name: sw_all, actor: all, algo: SW, rpu: 9, unit: second, slices: 10}
  - Url: /tb
    rules:
      - {name: tb_agent, actor: agent, algo: TB, rpu: 3, unit: second, burst: 5}
      - {name: dry_w, actor: all, algo: W, rpu: 4, unit: second, dry_run: true}
actors:
  agent: {header: user-agent, fallback: shared}
"""


def device(prefix: str, n: int, agent: Optional[str] = None) -> list[dict[str, str]]:
    return [{"x-device-id": f"{prefix}{i}", **({"user-agent": agent} if agent else {})} for i in range(n)]


# (offset from a whole second, path, the headers of each request). Every burst starts 30
# ms into a 100 ms slice and has ~50 ms to finish. Expected counts in the comments.
BURSTS: list[tuple[float, str, list[dict[str, str]]]] = [
    (0.130, "/w", device("w", 10)),  # w_all 7 of 10
    (0.430, "/sw", device("s", 6)),  # sw_all 6
    (0.730, "/sw", device("s", 6)),  # sw_all 3 (9 in the last second), 3 rejected
    (1.230, "/sw", device("s", 6)),  # slices 0.3..1.2 hold 9: 6 rejected
    (1.530, "/sw", device("s", 6)),  # slices 0.6..1.5 hold 3: 6 admitted
    (1.630, "/w", [{"x-device-id": "greedy"}] * 10),  # per_device: 6 of 10; w_all 6
    (2.130, "/tb", device("t", 8, "ua-1")),  # tb_agent ua-1: 5 of 8; dry_w: 4 + 1 would reject
    (2.130, "/tb", device("u", 3, "ua-2")),  # tb_agent ua-2: 3; dry_w would reject 3
    (2.630, "/tb", device("t", 4, "ua-1")),  # ua-1 has ~1.5 tokens: 1 of 4; dry_w would reject 1
    (3.380, "/tb", device("t", 4, "ua-1")),  # ~2.75 tokens: 2 of 4; dry_w 2 (new window)
    (3.630, "/w", [{"x-device-id": "greedy"}] * 4),  # the bucket is full again: 4; w_all 4
]
# (allowed, limited, dry-run limited), as the filter's metrics count.
EXPECTED = {
    # 67 requests: 4 stopped by per_device, 20 by the rules after it (its charge given back).
    "per_device": (43, 4, 0),
    "w_all": (17, 3, 0),
    "sw_all": (15, 9, 0),
    "tb_agent": (11, 8, 0),
    "dry_w": (6, 0, 5),
}


def slice_ms(ts_ms: float) -> float:
    return ts_ms % 100


def send_bursts(port: int, t0: float) -> list[dict[str, Any]]:
    entries = []
    with KeepAlive(port) as ka:
        for offset, path, headers_list in BURSTS:
            delay = t0 + offset - time.time()
            if delay > 0:
                time.sleep(delay)
            for headers in headers_list:
                ts = time.time()
                r = ka.send(path, headers)
                assert r.error is None, r.error
                entries.append({"ts": round(ts, 6), "method": "GET", "path": path, "headers": dict(headers),
                                "status": r.status})
    return entries


def strays(device_lines: list[str]) -> list[str]:
    """Requests Envoy started outside the 30-90 ms part of their slice (a stalled run)."""
    out = []
    for line in device_lines:
        m = ENVOY_LINE.match(line)
        assert m, line
        ms = int(m.group(1)[-4:-1])  # ...:SS.mmmZ
        if not 25 <= ms % 100 <= 95:
            out.append(line[:60])
    return out


def test_replay_agrees_exactly_with_envoy_on_one_worker(start_envoy, log_dir, monkeypatch):
    names = list(EXPECTED)
    for attempt in range(1, 4):
        default_log, device_log = log_dir / f"access-default-{attempt}.log", log_dir / f"access-device-{attempt}.log"
        with_access_logs(monkeypatch, default_log, device_log)
        envoy = start_envoy(EXACT_POLICY, concurrency=1, name=f"envoy-exact-{attempt}", extra_args=FLUSH)
        t0 = float(int(time.time()) + 2)
        entries = send_bursts(envoy.port, t0)
        device_lines = wait_for_lines(device_log, len(entries))
        wait_for_lines(default_log, len(entries))
        stray = strays(device_lines)
        if stray and attempt < 3:
            print(f"attempt {attempt}: {len(stray)} requests strayed from their slice, run again: {stray[:3]}")
            envoy.stop()
            continue
        assert not stray, f"three runs in a row had requests outside their slice: {stray[:5]}"
        break

    assert {e["status"] for e in entries} <= {200, 503}, {e["status"] for e in entries}
    in_envoy = envoy_rules(envoy, names)
    client_log = log_dir / "requests.jsonl"
    write_jsonl(client_log, entries)
    from_client = simulate(EXACT_POLICY, client_log)
    from_envoy = simulate(EXACT_POLICY, device_log, "--envoy-field", "x-device-id")
    default_only = simulate(EXACT_POLICY, default_log)
    record("simulate exact: Envoy (allowed, limited, dry-run) per rule", in_envoy)
    print(f"Envoy {in_envoy}\nclient log {simulated_rules(from_client)}\naccess log {simulated_rules(from_envoy)}")

    assert from_client["input"]["malformed"] == 0 and from_client["input"]["requests"] == len(entries)
    assert from_envoy["input"]["envoy"] == len(entries) and from_envoy["input"]["malformed"] == 0
    # Envoy's own default format parses line for line (it has no device id, so the
    # per-device counts of that replay are not comparable).
    assert default_only["input"]["envoy"] == len(entries), default_only["input"]
    assert default_only["input"]["malformed"] == 0, default_only["input"]["malformed_examples"]

    assert in_envoy == EXPECTED, "the scenario did not go as designed in Envoy"
    assert simulated_rules(from_client) == in_envoy
    assert simulated_rules(from_envoy) == in_envoy
    # Per second: what the client got back, against the replay.
    per_second = client_seconds(entries, lambda e: e["status"] == 503)
    assert simulated_seconds(from_client) == per_second
    assert simulated_seconds(from_envoy) == per_second


# --------------------------------------------------------------------------- 2. hot event


def weitter_policy(hot_rpu: int, hot_burst: int) -> str:
    sys.path.insert(0, str(BENCH))
    try:
        import weitter  # bench/weitter.py: the benchmark's own policy
    finally:
        sys.path.remove(str(BENCH))
    return weitter.DIANA_DOC.replace("HOT_RPU", str(hot_rpu)).replace("HOT_BURST", str(hot_burst))


def run_loadgen(port: int, t0: float, out_dir: Path) -> list[dict[str, Any]]:
    """bench/loadgen.py as the benchmark runs it: a flood of 300 req/s on /hot/trending
    from 2,000 devices (seconds 1-5) over 30 req/s of timeline reads (0-6)."""
    common = [sys.executable, str(BENCH / "loadgen.py"), "--target", f"127.0.0.1:{port}", "--start-at", str(t0),
              "--timeout", "10", "--max-conns", "512"]
    runs = {
        "flood": ["--path", "/hot/trending", "--devices", "2000", "--seed", "10", "--phase", "1:5:300"],
        "normal": ["--path", "/timeline/{user}", "--users", "5000", "--devices", "5000", "--seed", "99",
                   "--phase", "0:6:30"],
    }  # fmt: skip
    procs = []
    for name, args in runs.items():
        argv = common + args + ["--out", str(out_dir / f"{name}.json"), "--log", str(out_dir / f"{name}.jsonl"),
                                "--label", name]
        procs.append(subprocess.Popen(argv, cwd=BENCH))
    for p in procs:
        assert p.wait(timeout=60) == 0, "loadgen failed"
    entries = []
    for name in runs:
        entries += [json.loads(line) for line in (out_dir / f"{name}.jsonl").read_text().splitlines()]
    return entries


def within(a: int, b: int, absolute: int, relative: float) -> bool:
    return abs(a - b) <= absolute + relative * max(a, b)


def test_replay_of_a_hot_event_agrees_with_envoy_within_the_timing_jitter(start_envoy, log_dir, monkeypatch):
    hot_rpu, hot_burst = 60, 12
    policy = weitter_policy(hot_rpu, hot_burst)
    default_log, device_log = log_dir / "access-default.log", log_dir / "access-device.log"
    with_access_logs(monkeypatch, default_log, device_log)
    envoy = start_envoy(policy, concurrency=1, extra_args=FLUSH)
    t0 = float(int(time.time()) + 2)
    entries = run_loadgen(envoy.port, t0, log_dir)
    classes: dict[str, int] = {}
    for e in entries:
        classes[e["class"]] = classes.get(e["class"], 0) + 1
    assert set(classes) <= {"ok", "diana"}, f"errors or timeouts make the comparison meaningless: {classes}"
    wait_for_lines(device_log, len(entries))

    in_envoy = envoy_rules(envoy, ["per_device", "hot_all"])
    client_log = log_dir / "requests.jsonl"
    write_jsonl(client_log, entries)
    from_client = simulate(policy, client_log)
    from_envoy = simulate(policy, device_log, "--envoy-field", "x-device-id")
    per_second = client_seconds(entries, lambda e: e["class"] == "diana")
    sim_client, sim_envoy = simulated_rules(from_client), simulated_rules(from_envoy)
    seconds_client = simulated_seconds(from_client)
    figures = {
        "requests": len(entries),
        "envoy (allowed, limited)": {k: v[:2] for k, v in in_envoy.items()},
        "simulate, client log": {k: v[:2] for k, v in sim_client.items()},
        "simulate, Envoy access log": {k: v[:2] for k, v in sim_envoy.items()},
        "per second admitted envoy/simulate": {t - int(t0): (per_second[t][0], seconds_client.get(t, (0, 0))[0])
                                               for t in sorted(per_second)},
    }
    record("simulate hot event (Weitter policy, hot 60/s burst 12, flood 300/s for 4 s)", figures)
    print(json.dumps(figures, indent=1))

    # The flood is 10 x the hot limit: the bucket is empty all along, as in the benchmark.
    hot_allowed, hot_limited, _ = in_envoy["hot_all"]
    assert hot_limited > 3 * hot_allowed, in_envoy
    # The per-device buckets never empty: exact.
    assert sim_client["per_device"][1] == sim_envoy["per_device"][1] == in_envoy["per_device"][1] == 0
    for name in ("per_device", "hot_all"):
        for sim in (sim_client, sim_envoy):
            assert within(sim[name][0], in_envoy[name][0], 3, 0.01), (name, sim[name], in_envoy[name])
            assert within(sim[name][1], in_envoy[name][1], 3, 0.01), (name, sim[name], in_envoy[name])
    for t, (admitted, rejected) in per_second.items():
        sim_admitted, sim_rejected = seconds_client.get(t, (0, 0))
        assert within(sim_admitted, admitted, 3, 0.05), (t - t0, seconds_client.get(t), (admitted, rejected))
        assert within(sim_rejected, rejected, 3, 0.05), (t - t0, seconds_client.get(t), (admitted, rejected))
