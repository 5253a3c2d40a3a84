#!/usr/bin/env python3
"""Soak: mixed traffic for a long while against Envoy and nginx (both with the Diana
filter) + diana-quota + Redis, with the configuration reloaded every few seconds through
a config center; reports the memory slope of every long-lived process and every error.

    scripts/soak --seconds 90 --warmup 30      # the CI setting (< 2 minutes in all)
    scripts/soak --seconds 600 --warmup 60     # the 10-minute setting (RELIABILITY.md "Soak")

What runs (all on 127.0.0.1, ports chosen at run time, every process stopped by its PID):
- redis-server, diana-quota --redis (defaults otherwise);
- a config center (a thread of this process) that serves one of three documents, a new
  one every --reload-seconds; the gateways poll it every second;
- Envoy (2 worker threads) and nginx + ngx_wasm_module (2 worker processes), each
  answering by itself (a direct response: the soak measures the gateway, the filter and
  the quota service, not a demo upstream);
- one `wrk` per gateway, paced by its Lua `delay()` to about --rate requests per second:
  45 % `/` (a local rule on everything, a global per-account token bucket with lease 5),
  45 % `/api/...` (a local per-device sliding window, a global per-device fixed window),
  10 % `/login` (a local rule per client address: always hot); 100,000 devices and
  20,000 accounts, plus 20 hot devices and 10 hot accounts that carry 10 % of the
  requests each and get rejected (429).

Measured: the resident memory of Envoy, nginx (master + workers), diana-quota (and Redis,
reported only) every 2 s; after --warmup, a least-squares slope in MiB/min, which must
stay under --max-slope. Errors, each of which fails the run: an answer other than 200 or
429, a socket error or timeout of wrk, a process that died (or an nginx worker replaced),
an error or crash line in a log (Envoy `[error]`/`[critical]`, nginx `[error]` and worse
or a trap/panic, diana-quota `ERROR` or a panic), a refused or unfetchable document.
Reported too: callouts that failed (the gateway then enforces locally, by design) and
diana-quota's failure counters, configuration reloads applied, requests and answers per
second, p50/p99 latency.

Limits (--max-slope, --max-slope-nginx): 2 MiB/min for Envoy and diana-quota and 12 for
nginx when at most 3 minutes are measured; 0.5 and 4 beyond. nginx's workers keep a C
heap whose high-water mark climbs for minutes under callouts and falls back now and then
(measured: +26 MiB at most over 950,000 callouts in 10 minutes, not growing with them),
which a short least-squares window reads as a slope.

The result is printed and written to <out>/result.json; the exit status is 0 when every
check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Union

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import harness  # noqa: E402
from harness import Envoy, ManagedProcess, Nginx, Quota, Redis  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import render_nginx  # noqa: E402

MIB = 1 << 20
Gateway = Union[Envoy, Nginx]

# Three documents the config center cycles through: limits change (a changed rpu is a new
# counter) and a rule comes and goes. The per-identity rules keep their parameters (their
# counters survive the reloads) and have 1,024 slots: far fewer than the identities sent,
# so their tables are full within the warm-up (memory is bounded by the slots, and the
# soak then looks for growth beyond that bound; a table still filling would look like a
# leak).
VARIANTS = [
    {"root_rpu": 100_000, "login_rpu": 20, "extra": False},
    {"root_rpu": 90_000, "login_rpu": 15, "extra": True},
    {"root_rpu": 110_000, "login_rpu": 25, "extra": False},
]
SLOTS = 1024


def document(v: dict, remote_path: Optional[str]) -> str:
    """One Diana document: local and global rules on three resources; with `remote_path`,
    the local document that points at the config center."""
    extra = (
        f"\n      - {{name: api_burst, actor: account, rpu: 50, unit: second, algo: TB, slots: {SLOTS}}}"
        if v["extra"]
        else ""
    )
    remote = (
        f"\nremote: {{cluster: diana_config, authority: config, path: {remote_path}, poll_seconds: 1}}"
        if remote_path
        else ""
    )
    return f"""resources:
  - Url: /
    rules:
      - {{name: all_local, rpu: {v["root_rpu"]}, unit: second, algo: TB}}
      - {{name: account_global, actor: account, rpu: 120, unit: minute, algo: TB, scope: global, lease: 5,
          slots: {SLOTS}}}
  - Url: /api
    rules:
      - {{name: device_local, actor: device, rpu: 5, unit: second, algo: SW, slots: {SLOTS}}}
      - {{name: device_global, actor: device, rpu: 200, unit: minute, algo: W, scope: global, slots: {SLOTS}}}{extra}
  - Url: /login
    rules:
      - {{name: login_ip, actor: ip, rpu: {v["login_rpu"]}, unit: second, algo: W}}
response: {{status: 429}}
global: {{timeout_ms: 100, retry_seconds: 2}}{remote}
"""


class Documents:
    """What the config center serves: per path, a document rendered from the current
    variant; `advance()` moves every path to the next variant."""

    def __init__(self, renders: dict[str, Callable[[dict], str]]) -> None:
        self.renders = renders  # path -> function(variant) -> document text
        self.variant = 0

    def serve(self, path: str) -> Optional[str]:
        make = self.renders.get(path)
        return None if make is None else make(VARIANTS[self.variant % len(VARIANTS)])

    def advance(self) -> None:
        self.variant += 1


WRK_LUA = r"""
-- Diana soak traffic (scripts/soak.py). args: <seed> <delay ms> <devices> <accounts>
threads = {}
function setup(thread)
  table.insert(threads, thread)
end

counts = {}
local delay_ms = 10
local devices = 100000
local accounts = 20000

function init(args)
  math.randomseed(tonumber(args[1]) or 1)
  delay_ms = tonumber(args[2]) or 10
  devices = tonumber(args[3]) or devices
  accounts = tonumber(args[4]) or accounts
  counts = {}
end

function request()
  local dev, acc, path
  if math.random() < 0.1 then dev = "hot-" .. math.random(1, 20) else dev = "d-" .. math.random(1, devices) end
  if math.random() < 0.1 then acc = "hotacc-" .. math.random(1, 10) else acc = "a-" .. math.random(1, accounts) end
  local r = math.random()
  if r < 0.45 then
    path = "/"
  elseif r < 0.9 then
    path = "/api/v1/items/" .. math.random(1, 1000)
  else
    path = "/login"
  end
  return wrk.format("GET", path, { ["x-device-id"] = dev, ["x-account-id"] = acc })
end

function delay()
  return delay_ms
end

function response(status, headers, body)
  counts[status] = (counts[status] or 0) + 1
end

function done(summary, latency, requests)
  local agg = {}
  for _, t in ipairs(threads) do
    local c = t:get("counts")
    if c then
      for k, v in pairs(c) do agg[k] = (agg[k] or 0) + v end
    end
  end
  for k, v in pairs(agg) do io.write(string.format("SOAK_STATUS %d %d\n", k, v)) end
  local e = summary.errors
  io.write(string.format("SOAK_SUMMARY requests=%d duration_us=%d connect=%d read=%d write=%d timeout=%d status=%d\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.timeout, e.status))
  io.write(string.format("SOAK_LATENCY p50_us=%d p99_us=%d max_us=%d\n",
    latency:percentile(50), latency:percentile(99), latency.max))
end
"""


def mem(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of a process, bytes."""
    rss = anon = 0
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    return rss, anon


def quota_failures(port: int) -> dict[str, int]:
    """diana-quota's failure counters (non-zero ones): store errors by kind, deadlines
    expired, requests shed, late releases."""
    status, body, _ = harness.http_get(port, "/metrics", timeout=5.0)
    out: dict[str, int] = {}
    for line in body.decode().splitlines() if status == 200 else []:
        name, _, value = line.rpartition(" ")
        if not line.startswith("#") and re.search(r"store_errors|deadline_expired|shed_total|late_releases", name):
            if float(value):
                out[name.replace("diana_quota_", "")] = int(float(value))
    return out


def slope_mib_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of (seconds, bytes) samples, in MiB per minute."""
    n = len(samples)
    if n < 3:
        return float("nan")
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    den = sum((t - mt) ** 2 for t, _ in samples)
    if den == 0:
        return float("nan")
    num = sum((t - mt) * (v - mv) for t, v in samples)
    return num / den * 60 / MIB


# Log lines that are errors, per process kind.
ERROR_LINES = {
    "envoy": re.compile(r"\]\[(error|critical)\]\[|panicked at|wasm trap|Wasm VM failed"),
    "nginx": re.compile(r"\[(error|crit|alert|emerg)\]|" + harness.NGINX_CRASH.pattern),
    "diana-quota": re.compile(r"\bERROR\b|panicked at"),
}
WARN_LINES = {
    "envoy": re.compile(r"\]\[warning\]\[(wasm|dynamic_modules)\]"),
    "nginx": re.compile(r"\[warn\]"),
    "diana-quota": re.compile(r"\bWARN\b"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=90.0, help="traffic duration (default 90)")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds left out of the slope (default 30)")
    p.add_argument("--rate", type=float, default=300.0, help="requests per second and gateway (default 300)")
    p.add_argument("--connections", type=int, default=8, help="wrk connections per gateway (default 8)")
    p.add_argument("--devices", type=int, default=100_000, help="distinct devices (default 100000)")
    p.add_argument("--accounts", type=int, default=20_000, help="distinct accounts (default 20000)")
    p.add_argument("--reload-seconds", type=float, default=5.0, help="a new document every … s (default 5)")
    p.add_argument("--max-slope", type=float, default=None,
                   help="RSS MiB/min allowed to Envoy and diana-quota after warm-up "
                        "(default 2.0 when at most 3 min are measured, else 0.5)")
    p.add_argument("--max-slope-nginx", type=float, default=None,
                   help="the same for nginx, master + workers (default 12 / 4: see RELIABILITY.md, Soak)")
    p.add_argument("--hosts", default="envoy,nginx", help="gateways to run: envoy, nginx, envoy-native (default envoy,nginx)")
    p.add_argument("--out", type=Path, default=REPO / ".tmp" / "soak")
    a = p.parse_args()
    measured_min = (a.seconds - a.warmup) / 60
    short = measured_min <= 3
    max_slope = a.max_slope if a.max_slope is not None else (2.0 if short else 0.5)
    max_slope_nginx = a.max_slope_nginx if a.max_slope_nginx is not None else (12.0 if short else 4.0)
    limits = {"envoy": max_slope, "envoy-native": max_slope, "diana-quota": max_slope, "nginx": max_slope_nginx}
    hosts = [h.strip() for h in a.hosts.split(",") if h.strip()]
    wrk = shutil.which("wrk")
    if not wrk:
        print("soak: wrk not found: run scripts/install-deps", file=sys.stderr)
        return 2
    out = a.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    procs: list[ManagedProcess] = []
    problems: list[str] = []
    result: dict = {"settings": vars(a) | {"out": str(out), "limits_mib_per_min": limits}}

    def say(msg: str) -> None:
        print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def start(proc: ManagedProcess) -> ManagedProcess:
        procs.append(proc)
        proc.start()
        return proc

    try:
        redis = start(Redis(out))
        quota = start(Quota(out, redis.url))
        renders = {
            "/envoy.yaml": lambda v: document(v, None),
            "/envoy-native.yaml": lambda v: document(v, None),
            "/nginx.yaml": lambda v: render_nginx.nginx_document(document(v, None), quota_port=quota.port),
        }
        documents = Documents(renders)
        with harness.ConfigCenter(serve=documents.serve) as center:
            gateways: dict[str, Gateway] = {}
            for host in hosts:
                local = document(VARIANTS[0], f"/{host}.yaml")
                if host in ("envoy", "envoy-native"):
                    # envoy-native: Diana as Envoy's dynamic module (crates/diana-envoy-native).
                    gw = Envoy(out, diana_config=local, upstream_port=None, concurrency=2, quota_port=quota.port,
                               config_port=center.port, direct_response=(200, "ok\n"),
                               name=host, native=host == "envoy-native")  # fmt: skip
                else:
                    # Without Wasmtime's compilation cache, as nginx/README.md advises: with it,
                    # ngx_wasm_module 0.6.0's workers ran out of connection slots under this
                    # traffic (README "Testing"). The end-to-end tests' short-lived nginx use it.
                    gw = Nginx(out, diana_config=local, upstream_port=None, workers=2, quota_port=quota.port,
                               config_port=center.port, direct_response=(200, "ok\n"), wasmtime_cache=False)  # fmt: skip
                gateways[host] = start(gw)
            nginx = gateways.get("nginx")
            nginx_workers = sorted(nginx.worker_pids()) if isinstance(nginx, Nginx) else []
            ports = ", ".join(f"{h} :{g.port}" for h, g in gateways.items())
            say(f"up: {ports}, diana-quota :{quota.port}, redis :{redis.port}, config center :{center.port}")
            say(f"logs: {out}")

            script = out / "soak.lua"
            script.write_text(WRK_LUA)
            delay_ms = max(0, int(a.connections * 1000 / a.rate))
            loads = {}
            for i, (host, gw) in enumerate(gateways.items()):
                argv = [
                    wrk, "-t1", f"-c{a.connections}", f"-d{int(a.seconds)}s", "--timeout", "5s", "-s", str(script),
                    f"http://{harness.HOST}:{gw.port}/", "--",
                    str(1000 + i), str(delay_ms), str(a.devices), str(a.accounts),
                ]  # fmt: skip
                log = open(out / f"wrk-{host}.log", "w")
                loads[host] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log)
            say(
                f"traffic: {len(loads)} x wrk, {a.connections} connections, ~{a.rate:.0f} req/s per gateway, "
                f"{a.seconds:.0f}s (warm-up {a.warmup:.0f}s); a new document every {a.reload_seconds:.0f}s"
            )

            watched: dict[str, list[int]] = {"diana-quota": [quota.pid], "redis": [redis.pid]}
            names = [*gateways, "diana-quota", "redis"]
            samples: dict[str, list[tuple[float, int, int]]] = {name: [] for name in names}
            t0 = time.monotonic()
            next_reload = t0 + a.reload_seconds
            reloads_served = 0
            while any(pr.poll() is None for pr, _ in loads.values()):
                now = time.monotonic()
                if now > t0 + a.seconds + 60:
                    problems.append("wrk did not finish within 60 s of its duration")
                    break
                if now >= next_reload and now < t0 + a.seconds - 1:
                    documents.advance()
                    reloads_served += 1
                    next_reload += a.reload_seconds
                for name in samples:
                    if name in gateways:
                        gw = gateways[name]
                        pids = [gw.pid] + (gw.worker_pids() if isinstance(gw, Nginx) else [])
                    else:
                        pids = watched[name]
                    try:
                        ms = [mem(pid) for pid in pids]
                    except (FileNotFoundError, ProcessLookupError):
                        problems.append(f"{name}: a process is gone (pids {pids})")
                        continue
                    samples[name].append((now - t0, sum(m[0] for m in ms), sum(m[1] for m in ms)))
                time.sleep(2.0)
            for pr, log in loads.values():
                if pr.poll() is None:
                    pr.kill()
                pr.wait(timeout=30)
                log.close()
            elapsed = time.monotonic() - t0

            # -- traffic
            traffic = {}
            for host, gw in gateways.items():
                text = (out / f"wrk-{host}.log").read_text()
                st = {int(c): int(n) for c, n in re.findall(r"SOAK_STATUS (\d+) (\d+)", text)}
                m = re.search(
                    r"SOAK_SUMMARY requests=(\d+) duration_us=(\d+) connect=(\d+) read=(\d+) write=(\d+) timeout=(\d+)",
                    text,
                )
                lat = re.search(r"SOAK_LATENCY p50_us=(\d+) p99_us=(\d+) max_us=(\d+)", text)
                if not m or not lat:
                    problems.append(f"{host}: wrk printed no summary:\n{text[-2000:]}")
                    continue
                reqs, dur, c, r, w, to = (int(x) for x in m.groups())
                socket_errors = {"connect": c, "read": r, "write": w, "timeout": to}
                other = {code: n for code, n in st.items() if code not in (200, 429)}
                metrics = gw.diana_metrics()
                traffic[host] = {
                    "requests": reqs,
                    "per_second": round(reqs / (dur / 1e6), 1),
                    "statuses": dict(sorted(st.items())),
                    "socket_errors": socket_errors,
                    "p50_ms": round(int(lat.group(1)) / 1000, 2),
                    "p99_ms": round(int(lat.group(2)) / 1000, 2),
                    "max_ms": round(int(lat.group(3)) / 1000, 2),
                    "callouts": metrics.get("diana_global_callouts", 0),
                    "callout_failures": metrics.get("diana_global_errors", 0),
                    "degraded_requests": metrics.get("diana_global_degraded_requests", 0),
                    "config_reloads": metrics.get("diana_config_reloads", 0),
                    "config_rejected": metrics.get("diana_config_rejected", 0),
                    "config_fetch_errors": metrics.get("diana_config_fetch_errors", 0),
                    "store_errors": metrics.get("diana_store_errors", 0),
                }
                if other:
                    problems.append(f"{host}: answers other than 200/429: {other}")
                if any(socket_errors.values()):
                    problems.append(f"{host}: socket errors {socket_errors}")
                if not st.get(200) or not st.get(429):
                    problems.append(f"{host}: the traffic was not mixed (200 and 429 expected): {st}")
                if traffic[host]["config_rejected"] or traffic[host]["config_fetch_errors"]:
                    problems.append(f"{host}: documents refused or unfetchable: {traffic[host]}")
                # Each root context applies each new document once.
                if traffic[host]["config_reloads"] < reloads_served:
                    applied = traffic[host]["config_reloads"]
                    problems.append(f"{host}: {applied} reloads applied for {reloads_served} documents")
                if traffic[host]["store_errors"]:
                    problems.append(f"{host}: {traffic[host]['store_errors']} shared-store errors")
            result["traffic"] = traffic
            result["diana-quota"] = quota_failures(quota.port)
            result["documents_served"] = reloads_served
            result["config_center_fetches"] = len(center.requests)
            if center.errors:
                problems.append(f"config center: {center.errors[:5]}")
            if isinstance(nginx, Nginx):
                now_workers = sorted(nginx.worker_pids())
                if now_workers != nginx_workers:
                    problems.append(f"nginx: workers replaced ({nginx_workers} -> {now_workers})")
            for proc in procs:
                if not proc.alive():
                    problems.append(f"{proc.name}: exited with {proc.returncode()}")
            for proc in reversed(procs):  # before the config center goes: no failed poll at the end
                proc.stop()

        # -- memory
        memory = {}
        for name, ss in samples.items():
            steady = [s for s in ss if s[0] >= a.warmup]
            rss = slope_mib_per_min([(t, v) for t, v, _ in steady])
            anon = slope_mib_per_min([(t, v) for t, _, v in steady])
            memory[name] = {
                "samples": len(ss),
                "rss_start_mib": round(ss[0][1] / MIB, 1) if ss else None,
                "rss_after_warmup_mib": round(steady[0][1] / MIB, 1) if steady else None,
                "rss_end_mib": round(ss[-1][1] / MIB, 1) if ss else None,
                "rss_slope_mib_per_min": round(rss, 3),
                "anon_slope_mib_per_min": round(anon, 3),
                "limit_mib_per_min": limits.get(name),
                "timeline_s_rss_anon_mib": [(round(t), round(r / MIB, 1), round(n / MIB, 1)) for t, r, n in ss],
            }
            if name in limits and not (rss <= limits[name]):
                problems.append(f"{name}: RSS grows {rss:.2f} MiB/min after warm-up (limit {limits[name]})")
        result["memory"] = memory
        result["seconds"] = round(elapsed, 1)
    finally:
        for proc in reversed(procs):
            proc.stop()

    # -- logs (after the stop: every line is written)
    logs = {}
    for proc in procs:
        kind = "nginx" if isinstance(proc, Nginx) else "envoy" if isinstance(proc, Envoy) else proc.name
        if kind not in ERROR_LINES:
            continue
        lines = proc.log_text().splitlines()
        errs = [ln for ln in lines if ERROR_LINES[kind].search(ln)]
        warns = [ln for ln in lines if WARN_LINES[kind].search(ln)]
        logs[proc.name] = {"error_lines": len(errs), "warning_lines": len(warns), "first_errors": errs[:5],
                           "first_warnings": warns[:3]}  # fmt: skip
        if errs:
            problems.append(f"{proc.name}: {len(errs)} error lines in {proc.log_path}, e.g. {errs[:2]}")
    result["logs"] = logs
    result["problems"] = problems
    result["ok"] = not problems
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    say("traffic:")
    for host, t in result.get("traffic", {}).items():
        say(f"  {host}: {t['requests']} requests ({t['per_second']}/s), statuses {t['statuses']}, socket errors "
            f"{sum(t['socket_errors'].values())}, p50 {t['p50_ms']} ms, p99 {t['p99_ms']} ms, max {t['max_ms']} ms; "
            f"callouts {t['callouts']} ({t['callout_failures']} failed, {t['degraded_requests']} requests degraded); "
            f"{t['config_reloads']} reloads applied")  # fmt: skip
    say(f"diana-quota failures (the gateway degrades, by design): {result.get('diana-quota')}")
    say(f"documents: {result.get('documents_served')} new ones served, {result.get('config_center_fetches')} fetches")
    say(f"memory (least-squares slope after {a.warmup:.0f}s of warm-up; limits {limits} MiB/min; redis reported only):")
    for name, m in result.get("memory", {}).items():
        say(
            f"  {name}: RSS {m['rss_start_mib']} -> {m['rss_after_warmup_mib']} -> {m['rss_end_mib']} MiB, "
            f"slope {m['rss_slope_mib_per_min']:+.3f} MiB/min (anonymous {m['anon_slope_mib_per_min']:+.3f})"
        )
    for name, lg in logs.items():
        say(f"  log {name}: {lg['error_lines']} error lines, {lg['warning_lines']} warnings")
    if problems:
        say(f"FAILED ({len(problems)} problems):")
        for pr in problems:
            say(f"  - {pr}")
    else:
        say("ok: no error, memory flat")
    say(f"result: {out / 'result.json'}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
