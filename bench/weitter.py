"""Section 5: the Weitter hot-event scenario (seeds/weitter-and-diana.txt).

A timeline service of fixed capacity (bench/timeline.py: 4 workers × 20 ms = 200 req/s,
queue of 100, then 503) behind Envoy (--concurrency 2). Normal traffic reads
/timeline/<user> at a moderate rate the whole time; in the middle a celebrity post goes
viral and /hot/trending is flooded at 10× the service's capacity from thousands of
devices. Run twice, same load: Envoy without a filter, then Envoy with Diana:

  /      per device, token bucket 10/s (burst 20)   — a single client cannot hog the service
  /hot   all clients, token bucket 120/s (burst 24) — 60 % of capacity for the hot post

Per second we record what was offered, what reached the service, what it served, its own
latency (queue + work), the latency of the normal timeline reads as clients see them, and
what the flood got (200, 503 from Diana, 503 from the service).

In the run with Diana the load generators also write the exact request log they send
(`--log`); it is merged into `weitter-diana-requests.jsonl` (JSON lines: send time, path,
headers, and the answer), Envoy's per-second admitted/rejected counts (from those answers,
by send time) go to `weitter-diana-envoy-per-second.json`, and the log is replayed by
`diana simulate` (target/release/diana, or $DIANA_CLI) through the same policy to compare
per rule and per second (`simulate` in the results; chart `weitter-simulate.svg`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import BENCH, ROOT, Envoy, Procs, free_port, http_get, percentile, say, wait_http, wasm_filter

DIANA_DOC = """resources:
  - Url: /
    rules:
      - {name: per_device, actor: device, algo: TB, unit: second, rpu: 10, burst: 20}
  - Url: /hot
    rules:
      - {name: hot_all, actor: all, algo: TB, unit: second, rpu: HOT_RPU, burst: HOT_BURST}
actors:
  device: {header: x-device-id, fallback: ip}
response: {status: 503, body: "rate limited\\n", headers: limited}
"""


def params(cfg: dict[str, Any]) -> dict[str, Any]:
    workers, service_ms, queue = 4, 20.0, 100
    capacity = workers * 1000 / service_ms
    total, f0, f1 = (12, 3, 9) if cfg["quick"] else (40, 10, 30)
    return {
        "workers": workers, "service_ms": service_ms, "queue": queue, "capacity": capacity,
        "flood_rate": 10 * capacity, "flood_procs": 2, "normal_rate": 50, "total_s": total,
        "flood_from": f0, "flood_to": f1, "hot_rpu": int(0.6 * capacity), "hot_burst": int(0.12 * capacity),
        "flood_devices": 2000, "normal_users": 5000, "normal_devices": 5000,
    }


def one_run(procs: Procs, p: dict[str, Any], with_diana: bool, diana_wasm: Path) -> dict[str, Any]:
    tag = "diana" if with_diana else "none"
    up_port = free_port()
    up = procs.spawn(f"weitter-{tag}-timeline", [sys.executable, str(BENCH / "timeline.py"), "--port", str(up_port),
                                                 "--workers", str(p["workers"]), "--service-ms", str(p["service_ms"]),
                                                 "--queue", str(p["queue"])])
    if not wait_http(f"http://127.0.0.1:{up_port}/__health", up, 15):
        raise RuntimeError("timeline.py did not start")
    filters = []
    doc = None
    if with_diana:
        doc = DIANA_DOC.replace("HOT_RPU", str(p["hot_rpu"])).replace("HOT_BURST", str(p["hot_burst"]))
        filters = [wasm_filter("diana", str(diana_wasm), doc)]
    e = Envoy(procs, f"weitter-{tag}-envoy", filters, concurrency=2, upstream=up_port).start()
    t0 = math.floor(time.time()) + 2
    gens = []
    common = [sys.executable, str(BENCH / "loadgen.py"), "--target", f"127.0.0.1:{e.port}", "--start-at", str(t0),
              "--timeout", "10", "--max-conns", "2048"]
    request_logs = []

    def log_args(name: str) -> list[str]:
        if not with_diana:
            return []
        request_logs.append(procs.logdir / f"weitter-{tag}-{name}.jsonl")
        return ["--log", str(request_logs[-1])]

    for i in range(p["flood_procs"]):
        out = procs.logdir / f"weitter-{tag}-flood{i}.json"
        argv = common + ["--path", "/hot/trending", "--devices", str(p["flood_devices"]), "--seed", str(10 + i),
                         "--phase", f"{p['flood_from']}:{p['flood_to']}:{p['flood_rate'] / p['flood_procs']}",
                         "--out", str(out), "--label", "flood"] + log_args(f"flood{i}")
        gens.append((subprocess.Popen(argv, cwd=BENCH), out))
    out = procs.logdir / f"weitter-{tag}-normal.json"
    argv = common + ["--path", "/timeline/{user}", "--users", str(p["normal_users"]), "--devices",
                     str(p["normal_devices"]), "--seed", "99", "--phase", f"0:{p['total_s']}:{p['normal_rate']}",
                     "--out", str(out), "--label", "normal"] + log_args("normal")
    gens.append((subprocess.Popen(argv, cwd=BENCH), out))
    for g, _ in gens:
        g.wait(timeout=p["total_s"] + 60)
    flood = [json.loads(f.read_text()) for _, f in gens[:-1]]
    normal = json.loads(gens[-1][1].read_text())
    upstats = json.loads(http_get(f"http://127.0.0.1:{up_port}/__stats"))["bins"]
    stats = e.stats()
    e.stop()
    procs.stop(up)

    series = []
    for s in range(p["total_s"]):
        key = str(s)
        fb = [f["bins"].get(key) or f["bins"].get(s) or {} for f in flood]
        nb = normal["bins"].get(key) or {}
        ub = upstats.get(str(t0 + s), {})
        fcls: dict[str, int] = {}
        for b in fb:
            for k, v in (b.get("classes") or {}).items():
                fcls[k] = fcls.get(k, 0) + v
        nlat = sorted((nb.get("lat_ms") or {}).get("ok", []))
        ncls = nb.get("classes") or {}
        received = ub.get("received", 0)
        series.append({
            "t": s,
            "offered_flood": sum(b.get("sent", 0) for b in fb),
            "offered_normal": nb.get("sent", 0),
            "upstream_received": received,
            "upstream_served": ub.get("served", 0),
            "upstream_rejected": ub.get("rejected", 0),
            "upstream_p50_ms": ub.get("p50_ms"),
            "upstream_p99_ms": ub.get("p99_ms"),
            "normal_ok": ncls.get("ok", 0),
            "normal_failed": sum(v for k, v in ncls.items() if k != "ok"),
            "normal_p50_ms": percentile(nlat, 50) if nlat else None,
            "normal_p99_ms": percentile(nlat, 99) if nlat else None,
            "flood": fcls,
        })
    for row in series:
        row["offered"] = row["offered_flood"] + row["offered_normal"]
        row["success_rate"] = (row["upstream_served"] / row["upstream_received"]) if row["upstream_received"] else None

    # Summary over the flood, its first second left out (the queue filling / the burst).
    lo, hi = p["flood_from"] + 1, p["flood_to"]
    fl = [r for r in series if lo <= r["t"] < hi]
    calm = [r for r in series if r["t"] < p["flood_from"]]
    n = max(1, len(fl))

    def lat_all(rows: list, cls: str = "ok") -> list:
        out: list[float] = []
        for r in rows:
            out += (normal["bins"].get(str(r["t"]), {}).get("lat_ms") or {}).get(cls, [])
        return sorted(out)

    nl_flood, nl_calm = lat_all(fl), lat_all(calm)
    ftot: dict[str, int] = {}
    for f in flood:
        for k, v in f["totals"].items():
            ftot[k] = ftot.get(k, 0) + v
    n_normal = sum(r["offered_normal"] for r in fl)
    summary = {
        "offered_rps": sum(r["offered"] for r in fl) / n,
        "upstream_received_rps": sum(r["upstream_received"] for r in fl) / n,
        "upstream_served_rps": sum(r["upstream_served"] for r in fl) / n,
        "upstream_success_rate": (sum(r["upstream_served"] for r in fl) / max(1, sum(r["upstream_received"] for r in fl))),
        "normal_ok_rate": sum(r["normal_ok"] for r in fl) / max(1, n_normal),
        "normal_p50_ms": percentile(nl_flood, 50), "normal_p99_ms": percentile(nl_flood, 99),
        "normal_p50_ms_calm": percentile(nl_calm, 50), "normal_p99_ms_calm": percentile(nl_calm, 99),
        "upstream_p99_ms_max": max((r["upstream_p99_ms"] or 0) for r in fl) if fl else None,
        "flood_totals": ftot,
        "flood_sent": sum(f["sent"] for f in flood),
        "loadgen_max_lag_ms": max([f["max_schedule_lag_ms"] for f in flood] + [normal["max_schedule_lag_ms"]]),
    }
    say(f"weitter ({'with Diana' if with_diana else 'without Diana'}): during the flood offered "
        f"{summary['offered_rps']:.0f}/s, reached the service {summary['upstream_received_rps']:.0f}/s, served "
        f"{summary['upstream_served_rps']:.0f}/s (success {summary['upstream_success_rate']:.1%}); normal reads "
        f"ok {summary['normal_ok_rate']:.1%}, p50 {summary['normal_p50_ms']:.0f} ms p99 {summary['normal_p99_ms']:.0f} ms; "
        f"flood answers {ftot}")
    wasmcustom = {k: v for k, v in stats.items() if k.startswith("wasmcustom.") and v}
    result = {"with_diana": with_diana, "diana_config": doc, "series": series, "summary": summary,
              "wasmcustom": wasmcustom}
    if with_diana and doc is not None:
        result["simulate"] = replay(procs, doc, request_logs, wasmcustom, t0)
    return result


def diana_cli() -> Path:
    return Path(os.environ.get("DIANA_CLI") or ROOT / "target/release/diana")


def replay(procs: Procs, doc: str, request_logs: list[Path], wasmcustom: dict[str, int], t0: int) -> dict[str, Any]:
    """Merges the run's request logs, writes Envoy's per-second answers, and replays the log
    through the same policy with `diana simulate`: per rule (Envoy's metrics against the
    replay) and per second (the answers the clients got against the replay)."""
    entries = []
    for path in request_logs:
        entries += [json.loads(line) for line in path.read_text().splitlines()]
    entries.sort(key=lambda e: e["ts"])
    log = procs.logdir / "weitter-diana-requests.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    envoy: dict[int, dict[str, int]] = {}
    for e in entries:
        row = envoy.setdefault(int(e["ts"]) - t0, {"admitted": 0, "rejected": 0, "other": 0})
        kind = {"diana": "rejected", "ok": "admitted", "upstream": "admitted"}.get(e["class"], "other")
        row[kind] += 1
    per_second = procs.logdir / "weitter-diana-envoy-per-second.json"
    per_second.write_text(json.dumps({str(t): v for t, v in sorted(envoy.items())}, indent=1))
    out: dict[str, Any] = {"log": str(log), "requests": len(entries), "envoy_per_second": str(per_second)}
    cli = diana_cli()
    if not cli.is_file():
        out["error"] = f"{cli} not built (cargo build --release -p diana-cli)"
        return out
    policy = procs.logdir / "weitter-diana-policy.yaml"
    policy.write_text(doc)
    svg = procs.logdir / "weitter-simulate.svg"
    run = subprocess.run([str(cli), "simulate", str(policy), str(log), "--json", "--svg", str(svg)],
                         capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        out["error"] = f"diana simulate exited {run.returncode}: {run.stderr.strip()[:300]}"
        return out
    report = json.loads(run.stdout)
    rules = []
    for rule in report["rules"]:
        name, totals = rule["name"], rule["totals"]
        rules.append({
            "rule": name,
            "envoy_allowed": wasmcustom.get(f"wasmcustom.diana_rule_allowed.{name}", 0),
            "envoy_limited": wasmcustom.get(f"wasmcustom.diana_rule_limited.{name}", 0),
            "simulate_allowed": totals["admitted"] + totals["delayed"],
            "simulate_limited": totals["rejected"],
        })
    simulated = {s["t"] - t0: s["all"] for s in report["seconds"]}
    seconds = []
    for t in sorted(set(envoy) | set(simulated)):
        e, s = envoy.get(t, {}), simulated.get(t, {})
        seconds.append({"t": t, "envoy_admitted": e.get("admitted", 0), "envoy_rejected": e.get("rejected", 0),
                        "envoy_other": e.get("other", 0), "simulate_admitted": s.get("admitted", 0) + s.get("delayed", 0),
                        "simulate_rejected": s.get("rejected", 0)})
    differences = [abs(x["envoy_admitted"] - x["simulate_admitted"]) for x in seconds]
    worst = max(differences, default=0)
    out.update({"rules": rules, "seconds": seconds, "max_per_second_difference": worst,
                "seconds_within_3": sum(1 for d in differences if d <= 3),
                "worst_second": seconds[differences.index(worst)]["t"] if seconds else None,
                "malformed": report["input"]["malformed"], "svg": str(svg)})
    say("weitter replay by diana simulate: " + "; ".join(
        f"{r['rule']} allowed {r['envoy_allowed']} in Envoy, {r['simulate_allowed']} replayed" for r in rules)
        + f"; per second, admitted requests differ by at most {worst} "
        f"({out['seconds_within_3']} of {len(seconds)} seconds within 3)")
    return out


def run(procs: Procs, cfg: dict[str, Any], diana_wasm: Path) -> dict[str, Any]:
    p = params(cfg)
    runs = [one_run(procs, p, False, diana_wasm), one_run(procs, p, True, diana_wasm)]
    return {"params": p, "runs": runs}
