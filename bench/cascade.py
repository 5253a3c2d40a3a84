"""Section 7: the cascade — a dependency slows down, and a healthy route suffers with it
unless a breaker fails the dependency fast (issue 40 item 7; DESIGN §4b).

One gateway: Envoy (`--concurrency 2`) with `diana-envoy.wasm` ($DIANA_WASM; the release build
unless it names another, which $DIANA_BUILD_PROFILE then says, e.g. `quick`), in front of
the demo upstream (demo/upstream.py). Clients: requests arrive open-loop at a steady rate,
alternately for `/dep/slow` (a dependency) and `/healthy` (a route that never slows), and
are served in arrival order by one pool of 64 keep-alive connections (bench/poolgen.py).
At t = 10 s the dependency's answers go from 20 ms to 2 s (`/__dep?ms=2000` on the demo
upstream), at t = 30 s back to 20 ms.

What makes it cascade: the clients' concurrency is shared between the routes, as a
service's HTTP client pool is. At 2 s an answer, the dependency's requests alone would
need 100 req/s × 2 s = 200 connections; the pool has 64, so they hold every connection and
`/healthy` requests queue behind them though `/healthy` itself answers in a millisecond.
Nothing in Envoy limits anything (its cluster's own circuit breakers are set out of
reach): the damage is done by time held, as in the avalanche the design notes describe.

Run twice on the same load, with the same document but for the breaker:

    resources:
      - Url: /dep
        breaker: {name: dep, slow_ms: 200, slow_ratio: 0.5, min_calls: 20, window_seconds: 5, open_seconds: 5}
        rules: [{name: dep_rate, rpu: 1000000, unit: second}]   # never reached: both runs run Diana

Per second of arrival: `/healthy`'s p50/p99 latency as clients see it (the wait for a
connection included) and its success rate (2xx within the clients' 1 s deadline), and
`/dep/slow`'s answers (2xx, failed fast by the breaker, other); the breaker's transitions
from the lines Envoy logs for them (their timestamps), its counters from Envoy's admin at
the end. (Not from the `diana_breaker_state` gauge: each worker sets it when its own write
makes a transition, so two transitions by two workers within one tick can leave it showing
the earlier one.) Results: a table per phase
(before, during, after the slowdown) in BENCHMARKS.md section 7 and the chart
docs/bench/cascade.svg.

    python3 bench/cascade.py [--quick]      # alone, after scripts/build; prints the section
    BENCH_SECTIONS=cascade scripts/bench    # the same through the driver (report under .tmp/bench/)

Every process it starts (the demo upstream, Envoy, the client pool) listens on or talks to
127.0.0.1 on ports chosen at run time and is stopped by its PID at the end, also on failure.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import urllib.parse
from datetime import datetime
from pathlib import Path
from typing import Any, Optional
from xml.sax.saxutils import escape

from chart import nice_max
from common import (BENCH, BUILD_PROFILE, ROOT, Envoy, Procs, build_note, free_port, http_get, percentile, say, tail, wait_http,
                    wasm_filter)
from variants import with_breaker

DEP, HEALTHY = "/dep/slow", "/healthy"
BREAKER_NAME = "dep"
BREAKER_FIELDS = "slow_ms: 200, slow_ratio: 0.5, min_calls: 20, window_seconds: 5, open_seconds: 5"
DOC = """resources:
  - Url: /dep
    rules:
      - {name: dep_rate, rpu: 1000000, unit: second}
response: {status: 503, body: "dependency unavailable\\n", headers: all}
"""
BREAKER = f"    breaker: {{name: {BREAKER_NAME}, {BREAKER_FIELDS}}}\n"
# Envoy's breaker counters (wasmcustom.diana_breaker_<family>.dep), read at the end.
FAMILIES = ("calls", "slow", "failed", "fast_failed", "transitions")
# The line Diana logs for each transition (engine/breakers.rs), as Envoy writes it:
# `[2026-12-02 01:15:10.194][20751][warning][wasm] ... breaker dep: closed -> open (slow share reached): ...`
TRANSITION = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\].*diana: breaker "
                        + BREAKER_NAME + r": (closed|open|half-open) -> (closed|open|half-open) \(([^)]*)\)")


def params(cfg: dict[str, Any]) -> dict[str, Any]:
    total, slow_from, slow_to = (20, 5, 13) if cfg["quick"] else (40, 10, 30)
    return {
        "conns": 64, "rate": 200, "fast_ms": 20, "slow_ms": 2000, "deadline_ms": 1000, "timeout_s": 12,
        "drain_s": 60, "concurrency": 2, "total_s": total, "slow_from": slow_from, "slow_to": slow_to,
        "paths": [DEP, HEALTHY], "breaker": BREAKER_FIELDS,
    }


def switch(up_port: int, ms: int) -> None:
    """Sets the latency of the demo upstream's /dep/slow for every later request."""
    answer = json.loads(http_get(f"http://127.0.0.1:{up_port}/__dep?{urllib.parse.urlencode({'ms': ms})}"))
    if answer.get("ms") != ms:
        raise RuntimeError(f"the demo upstream did not take ms={ms}: {answer}")


def breaker_stats(e: Envoy) -> dict[str, int]:
    text = http_get(f"http://127.0.0.1:{e.admin}/stats?filter=diana_breaker_", timeout=2)
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        for family in FAMILIES:
            if name == f"wasmcustom.diana_breaker_{family}.{BREAKER_NAME}" and value.strip().isdigit():
                out[family] = int(value)
    return out


def transitions(log: Path, t0: float) -> list[dict[str, Any]]:
    """The breaker's transitions in Envoy's log, in order: seconds since `t0` (Envoy writes
    local time, as `datetime.timestamp` reads it), from, to, why."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = TRANSITION.match(line)
        if m:
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            out.append({"t": round(at - t0, 3), "from": m.group(2), "to": m.group(3), "why": m.group(4)})
    return out


def one_run(procs: Procs, p: dict[str, Any], with_breaker_: bool, diana_wasm: Path) -> dict[str, Any]:
    tag = "breaker" if with_breaker_ else "none"
    up_port = free_port()
    up = procs.spawn(f"cascade-{tag}-upstream", [sys.executable, str(ROOT / "demo/upstream.py"), "--port", str(up_port)])
    if not wait_http(f"http://127.0.0.1:{up_port}/healthz", up, 15):
        raise RuntimeError(f"demo/upstream.py did not start:\n{tail(up.log)}")
    switch(up_port, p["fast_ms"])
    doc = with_breaker(DOC, BREAKER) if with_breaker_ else DOC
    e = Envoy(procs, f"cascade-{tag}-envoy", [wasm_filter("diana", str(diana_wasm), doc)],
              concurrency=p["concurrency"], upstream=up_port).start()
    for path in (DEP, HEALTHY):
        http_get(e.url + path)
    http_get(f"http://127.0.0.1:{up_port}/__inflight?reset=1")
    t0 = math.floor(time.time()) + 3
    out = procs.logdir / f"cascade-{tag}-clients.json"
    argv = [sys.executable, str(BENCH / "poolgen.py"), "--target", f"127.0.0.1:{e.port}", "--conns", str(p["conns"]),
            "--rate", str(p["rate"]), "--duration", str(p["total_s"]), "--start-at", str(t0),
            "--timeout", str(p["timeout_s"]), "--drain", str(p["drain_s"]), "--out", str(out)]
    for path in p["paths"]:
        argv += ["--path", path]
    gen = procs.spawn(f"cascade-{tag}-clients", argv)
    # The switches at their times, until the clients are done.
    switches: list[tuple[float, int]] = []
    plan = [(p["slow_from"], p["slow_ms"]), (p["slow_to"], p["fast_ms"])]
    deadline = t0 + p["total_s"] + p["drain_s"] + 30
    while gen.alive():
        now = time.time()
        if now > deadline:
            raise RuntimeError(f"the client pool did not finish:\n{tail(gen.log)}")
        if plan and now >= t0 + plan[0][0]:
            at, ms = plan.pop(0)
            switch(up_port, ms)
            switches.append((round(time.time() - t0, 3), ms))
        time.sleep(0.02)
    if gen.popen.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the client pool failed (exit {gen.popen.returncode}):\n{tail(gen.log)}")
    clients = json.loads(out.read_text())
    most = json.loads(http_get(f"http://127.0.0.1:{up_port}/__inflight"))["most"]
    time.sleep(2.5)  # Diana's counters reach Envoy from the worker's tick
    final = breaker_stats(e) if with_breaker_ else {}
    envoy_log = e.proc.log if e.proc is not None else e.config_path.with_suffix(".log")
    e.stop()
    procs.stop(up)
    if len(switches) != 2:
        raise RuntimeError(f"the dependency was switched {len(switches)} times, not 2 (the run was too short?)")
    return summarise(p, with_breaker_, doc, clients, switches, transitions(envoy_log, t0),
                     final, most)


def summarise(p: dict[str, Any], with_breaker_: bool, doc: str, clients: dict[str, Any],
              switches: list[tuple[float, int]], moves: list[dict[str, Any]], final: dict[str, int],
              most: int) -> dict[str, Any]:
    dep_i, healthy_i = p["paths"].index(DEP), p["paths"].index(HEALTHY)
    rows = clients["rows"]
    deadline = p["deadline_ms"]

    def healthy_figures(rs: list[list]) -> dict[str, Any]:
        lat = sorted(r[3] for r in rs if r[3] is not None)
        good = sum(1 for r in rs if r[5] == "ok" and r[3] <= deadline)
        return {"requests": len(rs), "success": good / len(rs) if rs else None,
                "p50_ms": percentile(lat, 50) if lat else None, "p99_ms": percentile(lat, 99) if lat else None,
                "max_ms": lat[-1] if lat else None,
                "not_2xx": sum(1 for r in rs if r[5] != "ok")}

    def dep_figures(rs: list[list]) -> dict[str, Any]:
        lat = sorted(r[3] for r in rs if r[3] is not None and r[5] == "ok")
        return {"requests": len(rs), "ok": sum(1 for r in rs if r[5] == "ok"),
                "fast_failed": sum(1 for r in rs if r[5] == "diana"),
                "other": sum(1 for r in rs if r[5] not in ("ok", "diana")),
                "ok_p50_ms": percentile(lat, 50) if lat else None}

    def between(lo: float, hi: float, path_i: int) -> list[list]:
        return [r for r in rows if lo <= r[0] < hi and r[1] == path_i]

    def state_at(t: float) -> Optional[str]:
        if not with_breaker_:
            return None
        seen = [m["to"] for m in moves if m["t"] <= t]
        return seen[-1] if seen else "closed"

    # The dependency's answers by the second they came (what it and the breaker did then):
    # 2xx, failed fast.
    answered: dict[int, dict[str, int]] = {}
    for r in rows:
        if r[1] == dep_i and r[3] is not None and r[5] in ("ok", "diana"):
            at = answered.setdefault(int(r[0] + r[3] / 1000), {"ok": 0, "diana": 0})
            at[r[5]] += 1
    series = []
    for s in range(p["total_s"]):
        h, d = healthy_figures(between(s, s + 1, healthy_i)), dep_figures(between(s, s + 1, dep_i))
        came = answered.get(s, {})
        series.append({"t": s, "healthy": h, "dep": d, "state": state_at(s + 1),
                       "dep_answered": {"ok": came.get("ok", 0), "fast_failed": came.get("diana", 0)}})
    bounds = {"before": (0, p["slow_from"]), "during": (p["slow_from"], p["slow_to"]),
              "after": (p["slow_to"], p["total_s"])}
    phases = {name: {"from": lo, "to": hi, "healthy": healthy_figures(between(lo, hi, healthy_i)),
                     "dep": dep_figures(between(lo, hi, dep_i))} for name, (lo, hi) in bounds.items()}
    # When it opened (the first transition to open after the slowdown), when the clients
    # got the first fast-fail (its answer's time), and when it closed for good after the
    # recovery (the last transition, to closed).
    slow_at = switches[0][0]
    opened = next((m["t"] for m in moves if m["to"] == "open" and m["t"] >= slow_at), None)
    first_ff = min((r[0] + r[3] / 1000 for r in rows if r[1] == dep_i and r[5] == "diana"), default=None)
    closed = moves[-1]["t"] if moves and moves[-1]["to"] == "closed" and moves[-1]["t"] >= switches[1][0] else None
    bad_seconds = [x["t"] for x in series
                   if x["t"] >= p["slow_from"] and x["healthy"]["success"] is not None and x["healthy"]["success"] < 0.99]
    result = {
        "with_breaker": with_breaker_, "diana_config": doc, "switches": switches, "series": series, "phases": phases,
        "timings": {
            "opened_after_s": None if opened is None else round(opened - slow_at, 2),
            "first_fast_fail_after_s": None if first_ff is None else round(first_ff - slow_at, 2),
            "closed_after_recovery_s": None if closed is None else round(closed - switches[1][0], 2),
            "healthy_seconds_below_99": len(bad_seconds),
            "healthy_last_second_below_99": bad_seconds[-1] if bad_seconds else None,
        },
        "counters": final, "transitions": moves, "upstream_most_inside": most,
        "clients": {k: clients[k] for k in ("totals", "max_schedule_lag_ms", "connections_reopened")},
    }
    ph = phases["during"]
    say(f"cascade ({'with' if with_breaker_ else 'without'} the breaker): during the slowdown /healthy "
        f"{ph['healthy']['success']:.1%} within {deadline} ms, p99 {ph['healthy']['p99_ms']:.0f} ms; /dep/slow "
        f"{ph['dep']['ok']} answered 2xx, {ph['dep']['fast_failed']} failed fast; timings {result['timings']}; "
        f"at most {most} requests inside the upstream; counters {final}")
    return result


def run(procs: Procs, cfg: dict[str, Any], diana_wasm: Path) -> dict[str, Any]:
    p = params(cfg)
    loadavg = open("/proc/loadavg").read().split()[:3]
    runs = [one_run(procs, p, False, diana_wasm), one_run(procs, p, True, diana_wasm)]
    return {"params": p, "runs": runs, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "loadavg": loadavg, "loadavg_end": open("/proc/loadavg").read().split()[:3],
            "wasm": {"name": diana_wasm.name, "bytes": diana_wasm.stat().st_size, "build": build_note()}}


# --------------------------------------------------------------------------------------
# the chart: three panels over time, both runs in each


SVG_W, PANEL_W, PANEL_H, LEFT, TOP, GAP = 980, 800, 170, 80, 84, 64
RUN_COLOURS = {False: "#d62728", True: "#1f77b4"}
STATE_COLOURS = {"closed": "#cfe8cf", "open": "#f4a3a3", "half-open": "#f7d08a"}


class Panel:
    """One panel's frame and scales: x in seconds, y linear or log10."""

    def __init__(self, y0: float, xmax: float, ymin: float, ymax: float, log: bool):
        self.y0, self.xmax, self.ymin, self.ymax, self.log = y0, xmax, ymin, ymax, log

    def x(self, t: float) -> float:
        return LEFT + PANEL_W * t / self.xmax

    def y(self, v: float) -> float:
        v = min(max(v, self.ymin), self.ymax)
        if self.log:
            share = (math.log10(v) - math.log10(self.ymin)) / (math.log10(self.ymax) - math.log10(self.ymin))
        else:
            share = (v - self.ymin) / (self.ymax - self.ymin)
        return self.y0 + PANEL_H * (1 - share)

    def frame(self, title: str, ticks: list[float], p: dict[str, Any]) -> list[str]:
        out = [f'<rect x="{self.x(p["slow_from"]):.1f}" y="{self.y0}" width="'
               f'{self.x(p["slow_to"]) - self.x(p["slow_from"]):.1f}" height="{PANEL_H}" fill="#fdecec"/>',
               f'<text x="{self.x(p["slow_from"]) + 4:.1f}" y="{self.y0 + 13}" font-size="11" fill="#b44">'
               f'/dep/slow answers in {p["slow_ms"] / 1000:g} s</text>']
        for v in ticks:
            out.append(f'<line x1="{LEFT}" x2="{LEFT + PANEL_W}" y1="{self.y(v):.1f}" y2="{self.y(v):.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{LEFT - 6}" y="{self.y(v) + 4:.1f}" font-size="11" text-anchor="end">{v:g}</text>')
        for t in range(0, int(self.xmax) + 1, 5):
            out.append(f'<text x="{self.x(t):.1f}" y="{self.y0 + PANEL_H + 14}" font-size="11" '
                       f'text-anchor="middle">{t}</text>')
        out.append(f'<rect x="{LEFT}" y="{self.y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#444"/>')
        out.append(f'<text x="{LEFT}" y="{self.y0 - 8}" font-size="13" font-weight="bold">{escape(title)}</text>')
        return out

    def line(self, values: list[Optional[float]], colour: str, dash: str = "") -> list[str]:
        """A polyline through each second's middle; None breaks it."""
        out, pts = [], []
        for t, v in enumerate(values + [None]):
            if v is None:
                if pts:
                    out.append(f'<polyline points="{" ".join(pts)}" fill="none" stroke="{colour}" '
                               f'stroke-width="2" stroke-dasharray="{dash}"/>')
                pts = []
                continue
            pts.append(f"{self.x(t + 0.5):.1f},{self.y(v):.1f}")
        return out


def legend(x: float, y: float, items: list[tuple[str, str, str]]) -> list[str]:
    out = []
    for i, (name, colour, dash) in enumerate(items):
        lx = x + i * 250
        out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{y}" y2="{y}" stroke="{colour}" stroke-width="2" '
                   f'stroke-dasharray="{dash}"/>')
        out.append(f'<text x="{lx + 30}" y="{y + 4}" font-size="11">{escape(name)}</text>')
    return out


def cascade_svg(result: dict[str, Any]) -> str:
    p = result["params"]
    runs = {r["with_breaker"]: r for r in result["runs"]}
    xmax = p["total_s"]
    name = {False: "without a breaker", True: "with the breaker"}
    p99s = [x["healthy"]["p99_ms"] for r in runs.values() for x in r["series"] if x["healthy"]["p99_ms"]]
    # The top: 1, 2 or 5 × a power of ten above the largest p99 (a whole decade more would
    # leave most of the panel empty when the largest is just past one).
    top = max(p99s + [p["deadline_ms"] * 2])
    decade = 10 ** math.floor(math.log10(top))
    lat = Panel(TOP, xmax, 1, next(m * decade for m in (1, 2, 5, 10) if top <= m * decade), True)
    ok = Panel(TOP + PANEL_H + GAP, xmax, 0, 100, False)
    # Twice the dependency's arrival rate: the drain after the recovery goes higher for a
    # second, and is clipped (its figure written at the top) rather than flatten the rest.
    dep_max = nice_max(p["rate"])
    dep = Panel(TOP + 2 * (PANEL_H + GAP), xmax, 0, dep_max, False)
    height = dep.y0 + PANEL_H + 86
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{SVG_W}" height="{height}" font-family="sans-serif">',
             f'<rect width="{SVG_W}" height="{height}" fill="white"/>',
             f'<text x="{SVG_W / 2}" y="20" font-size="15" font-weight="bold" text-anchor="middle">'
             f'A slow dependency, without and with a breaker (one Envoy, Diana)</text>',
             f'<text x="{SVG_W / 2}" y="36" font-size="12" text-anchor="middle">{p["rate"]} req/s arriving, '
             f'alternately {DEP} and {HEALTHY}, served in turn by one pool of {p["conns"]} client connections;</text>',
             f'<text x="{SVG_W / 2}" y="51" font-size="12" text-anchor="middle">{DEP} answers in '
             f'{p["slow_ms"] / 1000:g} s instead of {p["fast_ms"]} ms from t = {p["slow_from"]} s to '
             f'{p["slow_to"]} s (x: seconds since the start)</text>']
    decades = [10 ** k for k in range(0, int(math.log10(lat.ymax) + 1e-9) + 1)]
    if decades[-1] < lat.ymax:
        decades.append(lat.ymax)
    parts += lat.frame(f"{HEALTHY}: p99 latency as clients see it (ms, log scale)", decades, p)
    parts.append(f'<line x1="{LEFT}" x2="{LEFT + PANEL_W}" y1="{lat.y(p["deadline_ms"]):.1f}" '
                 f'y2="{lat.y(p["deadline_ms"]):.1f}" stroke="#555" stroke-dasharray="2,3"/>')
    parts.append(f'<text x="{LEFT + PANEL_W - 4}" y="{lat.y(p["deadline_ms"]) - 4:.1f}" font-size="11" '
                 f'text-anchor="end">client deadline {p["deadline_ms"]} ms</text>')
    parts += ok.frame(f"{HEALTHY}: answered 2xx within {p['deadline_ms']} ms (% of the second's arrivals)",
                      [0, 20, 40, 60, 80, 100], p)
    parts += dep.frame(f"{DEP}: 2xx answers (solid) and fast-fails (dashed) per second, by the second they came",
                       [dep_max * i / 5 for i in range(6)], p)
    for wb, r in runs.items():
        s = r["series"]
        c = RUN_COLOURS[wb]
        parts += lat.line([x["healthy"]["p99_ms"] for x in s], c)
        parts += ok.line([None if x["healthy"]["success"] is None else 100 * x["healthy"]["success"] for x in s], c)
        kinds = ["ok", "fast_failed"] if wb else ["ok"]
        for kind in kinds:
            values = [x["dep_answered"][kind] for x in s]
            parts += dep.line(values, c, "6,3" if kind == "fast_failed" else "")
            parts += [f'<text x="{dep.x(t + 0.5):.1f}" y="{dep.y0 + 24 + 12 * kinds.index(kind)}" font-size="10" '
                      f'fill="{c}" text-anchor="middle">↑{v}</text>' for t, v in enumerate(values) if v > dep_max]
    # The breaker's state under the last panel, from its transitions in Envoy's log.
    strip_y = dep.y0 + PANEL_H + 22
    moves = [{"t": 0.0, "to": "closed"}] + (runs[True]["transitions"] if True in runs else [])
    for a, b in zip(moves, moves[1:] + [{"t": xmax}]):
        lo, hi = max(0.0, a["t"]), min(float(xmax), b["t"])
        if hi > lo:
            parts.append(f'<rect x="{dep.x(lo):.1f}" y="{strip_y}" width="{max(0.5, dep.x(hi) - dep.x(lo)):.1f}" '
                         f'height="10" fill="{STATE_COLOURS[a["to"]]}"/>')
    parts.append(f'<text x="{LEFT - 6}" y="{strip_y + 9}" font-size="10" text-anchor="end">breaker</text>')
    parts += [f'<rect x="{LEFT + PANEL_W - 250 + i * 85}" y="{strip_y + 16}" width="10" height="10" fill="{c}"/>'
              f'<text x="{LEFT + PANEL_W - 236 + i * 85}" y="{strip_y + 25}" font-size="10">{k}</text>'
              for i, (k, c) in enumerate(STATE_COLOURS.items())]
    parts += legend(LEFT, height - 14, [(name[False], RUN_COLOURS[False], ""), (name[True], RUN_COLOURS[True], ""),
                                        (f"{name[True]}: {DEP} failed fast", RUN_COLOURS[True], "6,3")])
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------
# the section of BENCHMARKS.md


def _ms(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:,.0f}"


def _pct(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.1%}"


def _s(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.1f} s"


def render(result: dict[str, Any], chart_rel: Optional[str], command: str) -> list[str]:
    """BENCHMARKS.md's section 7, from `run`'s result."""
    p = result["params"]
    L: list[str] = []
    A = L.append
    A("## 7. Cascade: a slow dependency, without and with a breaker")
    A("")
    w = result.get("wasm", {"name": "diana-envoy.wasm", "build": "release build"})
    A(f"Measured {result['measured']} by `{command}`: a **contended run** (load average "
      f"{' / '.join(result['loadavg'])} at its start, {' / '.join(result.get('loadavg_end', ['?']))} at its end:")
    A("other work was running on the 2 vCPUs, so read the shape and the ratios between the two runs, not")
    size = f" {w['bytes']:,} bytes" if w.get("bytes") else ""
    A(f"the milliseconds), with the {w['build']}. One Envoy (`--concurrency 2`, `{w['name']}`{size}) in")
    A(f"front of `demo/upstream.py`. Requests arrive at {p['rate']} req/s, open-loop, alternately for `{DEP}`")
    A(f"(a dependency) and `{HEALTHY}` (a route that never slows), and are served in arrival order by one")
    A(f"pool of {p['conns']} keep-alive client connections (`bench/poolgen.py`; a request's latency runs")
    A(f"from its arrival, its wait for a connection included). At t = {p['slow_from']} s the dependency's")
    A(f"answers go from {p['fast_ms']} ms to {p['slow_ms'] / 1000:g} s, at t = {p['slow_to']} s back. Success: "
      f"a 2xx within the clients' {p['deadline_ms']} ms")
    A("deadline. Both runs run Diana with the same document, one without the breaker:")
    A("")
    A("```yaml")
    A(next(r for r in result["runs"] if r["with_breaker"])["diana_config"].rstrip())
    A("```")
    A("")
    A("**What makes it cascade**: the clients' connections are shared between the routes, as a")
    A(f"service's HTTP client pool is. At {p['slow_ms'] / 1000:g} s an answer the dependency's "
      f"{p['rate'] // 2} req/s would need {p['rate'] // 2 * p['slow_ms'] // 1000} connections;")
    A(f"the pool has {p['conns']}, so they hold them all and `{HEALTHY}` requests queue behind them, though")
    A(f"`{HEALTHY}` itself answers in about a millisecond. Nothing in Envoy limits anything (its cluster's")
    A("circuit breakers are set out of reach). The breaker learns a call is slow when its answer")
    A("comes (a call ends at the response headers), so it opens once the window's slow calls reach")
    A("half of its calls, the 20 ms calls of the seconds before the slowdown included.")
    A("")
    if chart_rel:
        A(f"[![/healthy's p99 and success rate, /dep/slow's answers, without and with the breaker]({chart_rel})]"
          f"({chart_rel})")
        A("")
    rows = []
    for r in result["runs"]:
        for phase, ph in r["phases"].items():
            h, d = ph["healthy"], ph["dep"]
            rows.append([("with the breaker" if r["with_breaker"] else "without") if phase == "before" else "",
                         f"{phase} ({ph['from']}–{ph['to']} s)", f"{h['requests']:,}", _pct(h["success"]),
                         _ms(h["p50_ms"]), _ms(h["p99_ms"]), _ms(h["max_ms"]), f"{d['requests']:,}", f"{d['ok']:,}",
                         f"{d['fast_failed']:,}", f"{d['other']:,}"])
    A(f"By phase (by arrival time; `{HEALTHY}` success = 2xx within {p['deadline_ms']} ms):")
    A("")
    A("| run | phase | /healthy requests | /healthy success | p50 ms | p99 ms | max ms "
      "| /dep/slow requests | 2xx | failed fast | other |")
    A("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    L += ["| " + " | ".join(row) + " |" for row in rows]
    A("")
    runs = {r["with_breaker"]: r for r in result["runs"]}
    A("| | without | with the breaker |")
    A("| --- | ---: | ---: |")
    timing = [("seconds of arrivals from the slowdown on with /healthy below 99 % success",
               lambda r: str(r["timings"]["healthy_seconds_below_99"])),
              ("the last such second", lambda r: _s(r["timings"]["healthy_last_second_below_99"])),
              ("requests inside the upstream at once, at most", lambda r: f"{r['upstream_most_inside']:,}"),
              ("the breaker opened, after the slowdown (its transition in Envoy's log)",
               lambda r: _s(r["timings"]["opened_after_s"])),
              ("the first request failed fast was answered, after the slowdown",
               lambda r: _s(r["timings"]["first_fast_fail_after_s"])),
              ("transitions (Envoy's log)", lambda r: "; ".join(f"{m['t']:.1f} s → {m['to']}"
                                                              for m in r["transitions"]) or "—"),
              ("closed for good, after the recovery", lambda r: _s(r["timings"]["closed_after_recovery_s"])),
              ("Envoy's counters: calls / slow / failed fast / transitions",
               lambda r: " / ".join(f"{r['counters'].get(k, 0):,}" for k in ("calls", "slow", "fast_failed",
                                                                              "transitions")) if r["counters"] else "—"),
              ("clients: largest lag of the arrival schedule, connections reopened",
               lambda r: f"{r['clients']['max_schedule_lag_ms']:.0f} ms, {r['clients']['connections_reopened']}")]
    for label, f in timing:
        A(f"| {label} | {f(runs[False]) if False in runs else '—'} | {f(runs[True]) if True in runs else '—'} |")
    A("")
    A("How to read the breaker's timings: a call is judged when its answer comes, so no slow call")
    A(f"is known until {p['slow_ms'] / 1000:g} s after the slowdown, and then the pool's {p['conns']} "
      f"connections' answers come")
    A(f"together, every {p['slow_ms'] / 1000:g} s, into a window that still holds the fast calls of the "
      "seconds before: it")
    A("opens when a batch takes the slow share past the ratio. Requests that arrived before it opened")
    A("and waited for a connection are failed fast once they are sent (by arrival time they count in")
    A("the seconds before the opening). Every `open_seconds` it lets `half_open_calls` probes (3 by")
    A("default) through; a probe may take `probe_timeout_ms` (twice `slow_ms`, at least 1 s), which a")
    A(f"{p['slow_ms'] / 1000:g} s answer outlasts, so it opens again (\"a probe's outcome never came\") "
      "until the")
    A("dependency has recovered, and closes at the first probe round after the recovery: the")
    A("fast-fails in the phase after are requests of that last opening.")
    A("")
    A("Per second (by arrival: /healthy success and p99; /dep/slow 2xx, failed fast; the breaker's")
    A("state at the second's end):")
    A("")
    for r in result["runs"]:
        A(f"<details><summary>{'with the breaker' if r['with_breaker'] else 'without a breaker'}</summary>")
        A("")
        A("| t (s) | /healthy success | p99 ms | /dep/slow 2xx | failed fast | other | breaker |")
        A("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for x in r["series"]:
            h, d = x["healthy"], x["dep"]
            A(f"| {x['t']} | {_pct(h['success'])} | {_ms(h['p99_ms'])} | {d['ok']} | {d['fast_failed']} | "
              f"{d['other']} | {x['state'] or '—'} |")
        A("")
        A("</details>")
        A("")
    return L


def main() -> int:
    quick = "--quick" in sys.argv[1:]
    diana_wasm = Path(os.environ.get("DIANA_WASM", ROOT / "target/wasm32-wasip1/release/diana-envoy.wasm")).resolve()
    if not diana_wasm.is_file():
        say(f"{diana_wasm} not found: scripts/build first")
        return 1
    procs = Procs(ROOT / ".tmp/bench/cascade")
    try:
        result = run(procs, {"quick": quick}, diana_wasm)
    finally:
        procs.stop_all()
    (procs.logdir / "results.json").write_text(json.dumps(result, indent=1))
    chart = Path(os.environ.get("CASCADE_CHART", procs.logdir / "cascade.svg"))
    chart.write_text(cascade_svg(result))
    command = "python3 bench/cascade.py" + (" --quick" if quick else "")
    if BUILD_PROFILE != "release":
        command = f"DIANA_BUILD_PROFILE={BUILD_PROFILE} DIANA_WASM=<that build's diana-envoy.wasm> {command}"
    print("\n".join(render(result, os.path.relpath(chart, ROOT), command)))
    say(f"chart {chart}; results {procs.logdir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
