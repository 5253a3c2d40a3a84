"""Section rls (opt-in: `BENCH_SECTIONS=rls scripts/bench`): Envoy's `ratelimit` filter
calling diana-quota's RLS (`--rls-listen`) against calling Limitador, the same protocol, the
same Envoy, filter and descriptor, on the same Redis — the comparison of docs/rls.md
("Performance against Limitador"), alone and with more detail than the overhead section's
peer rows:

- req/s, p50, p99 per RLS (wrk through Envoy), Envoy's, the RLS process's and Redis's CPU µs
  per request;
- Redis `INFO commandstats` deltas per request, command by command (a script's own
  commands count too), and Redis's time per request by its own account (`usec`);
- exactness: each RLS gets a second limit, 1000 an hour on `generic_key: exact`, and an
  Envoy that sends it is driven past it with 32 concurrent connections; admitted (Envoy's
  `ratelimit.ok`) should be exactly 1000.

With `DIANA_QUOTA_BASELINE_BIN` (another diana-quota binary, e.g. built from an earlier
commit), that one runs too as its own RLS on the same Redis, so a change to diana-quota is
measured before/after in the same interleaved rounds.

Layout as in the overhead section: every Envoy `taskset -c 0 --concurrency 1`; Redis, both
RLS processes and wrk on CPU 1; rounds visit the variants in turn (A B C … A B C …) and each
figure is the median of the rounds.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from common import (LIMITADOR_DOMAIN, LIMITADOR_LIMIT, NO_UPSTREAM, Envoy, Procs, free_port, generic_key_rate_limits,
                    grpc_cluster, local_reply_filter, median, ratelimit_filter, say, start_limitador, start_redis,
                    tail, wait_http, wait_tcp, wrk)

# The exactness probe: this descriptor value, this limit per hour.
EXACT_VALUE = "exact"
EXACT_LIMIT = 1000
EXACT_LIMITADOR = f"{LIMITADOR_DOMAIN}:{EXACT_LIMIT}:3600:generic_key={EXACT_VALUE}"

# diana-quota's --rls-config: the peer's limits in envoyproxy/ratelimit's format (fixed
# windows, as Limitador counts).
DIANA_RLS_CONFIG = f"""domain: {LIMITADOR_DOMAIN}
descriptors:
  - key: generic_key
    value: {LIMITADOR_DOMAIN}
    rate_limit: {{unit: second, requests_per_unit: 1000000}}
  - key: generic_key
    value: {EXACT_VALUE}
    rate_limit: {{unit: hour, requests_per_unit: {EXACT_LIMIT}}}
"""


def start_diana_rls(procs: Procs, binary: Path, redis_port: int, name: str) -> tuple[Any, int]:
    """diana-quota serving the RLS on the Redis at `redis_port` (as overhead.start_diana_rls,
    with the exactness limit too)."""
    config = procs.logdir / f"{name}.yaml"
    config.write_text(DIANA_RLS_CONFIG)
    http_port, rls_port = free_port(), free_port()
    p = procs.spawn(name, [str(binary), "--listen", f"127.0.0.1:{http_port}", "--redis",
                           f"redis://127.0.0.1:{redis_port}", "--log", "warn", "--insecure-no-auth",
                           "--deadline-ms", "900", "--redis-timeout-ms", "800", "--redis-connect-timeout-ms", "100",
                           "--rls-listen", f"127.0.0.1:{rls_port}", "--rls-config", str(config)], cpus="1")
    if not wait_http(f"http://127.0.0.1:{http_port}/healthz", p, 20) or not wait_tcp(rls_port, p, 10):
        raise RuntimeError(f"diana-quota --rls-listen did not start: {tail(p.log)}")
    return p, rls_port


def redis_info(port: int, section: str) -> str:
    """`INFO <section>` as text (reads the whole bulk reply)."""
    payload = f"*2\r\n$4\r\nINFO\r\n${len(section)}\r\n{section}\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(payload)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n")
        size = int(head[1:])
        while len(body) < size:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    return body[:size].decode(errors="replace")


def commandstats(port: int) -> dict[str, tuple[int, int]]:
    """command → (calls, usec) from `INFO commandstats`."""
    out: dict[str, tuple[int, int]] = {}
    for line in redis_info(port, "commandstats").splitlines():
        if not line.startswith("cmdstat_"):
            continue
        name, _, fields = line[len("cmdstat_"):].partition(":")
        kv = dict(f.split("=", 1) for f in fields.split(",") if "=" in f)
        out[name] = (int(kv.get("calls", 0)), int(kv.get("usec", 0)))
    return out


def stats_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    # INFO itself (our probes) is not the RLS's.
    return {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1])
            for k, v in after.items() if k != "info" and v[0] - before.get(k, (0, 0))[0] > 0}


def peer(key: str, label: str, port: int, cluster: str, rls: str, value: str = LIMITADOR_DOMAIN) -> dict[str, Any]:
    return {"key": key, "label": label, "rls": rls, "rls_cluster": cluster, "rls_port": port,
            "filters": [ratelimit_filter(LIMITADOR_DOMAIN, cluster), local_reply_filter()],
            "rate_limits": generic_key_rate_limits(value),
            "extra_clusters": [grpc_cluster(cluster, port, connect_timeout="0.25s")]}


def run(procs: Procs, cfg: dict[str, Any], quota_bin: Path | None, limitador_bin: Path | None) -> dict[str, Any]:
    rounds, duration, warmup = cfg["rounds"], cfg["duration"], cfg["warmup"]
    out: dict[str, Any] = {"rounds": rounds, "duration_s": duration, "variants": [], "exact": [], "notes": []}
    redis_proc, redis_port = start_redis(procs, "rls-redis", cpus="1")
    rls_procs: dict[str, Any] = {}
    vs: list[dict[str, Any]] = [{"key": "peer_route", "label": "baseline: routed, fault-filter reply 200, no ratelimit filter",
                                 "filters": [local_reply_filter()]}]
    if limitador_bin is not None:
        p, port = start_limitador(procs, limitador_bin, redis_port, "rls-limitador", cpus="1",
                                  limits=[LIMITADOR_LIMIT, EXACT_LIMITADOR])
        rls_procs["limitador"] = p
        vs.append(peer("peer_limitador", "Envoy ratelimit → Limitador (Redis)", port, "limitador_rls", "limitador"))
    else:
        out["notes"].append("Limitador skipped: bench/limitador-rls was not built")
    if quota_bin is not None:
        p, port = start_diana_rls(procs, quota_bin, redis_port, "rls-diana")
        rls_procs["diana"] = p
        vs.append(peer("peer_diana", "Envoy ratelimit → diana-quota RLS (Redis)", port, "diana_rls", "diana"))
    baseline = os.environ.get("DIANA_QUOTA_BASELINE_BIN", "").strip()
    if baseline:
        p, port = start_diana_rls(procs, Path(baseline).resolve(), redis_port, "rls-diana-baseline")
        rls_procs["diana_baseline"] = p
        vs.append(peer("peer_diana_baseline", f"Envoy ratelimit → diana-quota RLS, baseline ({Path(baseline).name})",
                       port, "diana_rls_baseline", "diana_baseline"))
        out["baseline_bin"] = baseline
        out["notes"].append(
            "the baseline diana-quota has the same configuration on the same Redis as diana-quota, so both count "
            "on the same counters: its exactness probe runs after diana-quota's and admits what is left of the "
            "1000 (0 when diana-quota's admitted them all), whichever script each binary uses.")

    envoys: dict[str, Envoy] = {}
    for v in vs:
        e = Envoy(procs, f"rls-{v['key']}", v["filters"], concurrency=1, cpus="0",
                  extra_clusters=v.get("extra_clusters"), rate_limits=v.get("rate_limits"), route_action=True)
        e.start()
        envoys[v["key"]] = e
        v["runs"] = []
    say(f"rls: warming up {len(envoys)} Envoys ({warmup}s each)")
    for v in vs:
        wrk(envoys[v["key"]].url + "/", duration=warmup)

    for r in range(rounds):
        say(f"rls: round {r + 1}/{rounds}")
        for v in vs:
            e = envoys[v["key"]]
            rls_proc = rls_procs.get(v.get("rls", ""))
            before = e.stats()
            cpu0, rls0, redis_cpu0 = e.proc.cpu_seconds(), rls_proc.cpu_seconds() if rls_proc else None, \
                redis_proc.cpu_seconds()
            cmd0 = commandstats(redis_port)
            res = wrk(e.url + "/", duration=duration)
            cmd1 = commandstats(redis_port)
            cpu1, rls1, redis_cpu1 = e.proc.cpu_seconds(), rls_proc.cpu_seconds() if rls_proc else None, \
                redis_proc.cpu_seconds()
            after = e.stats()
            n = max(1, res["requests"])
            delta = stats_delta(cmd0, cmd1)
            res["redis_cmds"] = {k: c / n for k, (c, _) in delta.items()}
            res["redis_cmds_per_req"] = sum(res["redis_cmds"].values())
            # Redis's own account of its time in commands (a script's includes its commands').
            res["redis_usec_per_req"] = sum(u for k, (_, u) in delta.items()
                                            if k not in ("time", "hmget", "hset", "pexpire", "get", "pttl", "incrby",
                                                         "expire", "sadd", "exists", "set")) / n
            res["redis_cpu_us_per_req"] = (redis_cpu1 - redis_cpu0) * 1e6 / n
            res["envoy_cpu_us_per_req"] = (cpu1 - cpu0) * 1e6 / n
            if rls0 is not None and rls1 is not None:
                res["rls_cpu_us_per_req"] = (rls1 - rls0) * 1e6 / n
            for k in ("ok", "over_limit", "error", "failure_mode_allowed"):
                stat = f"cluster.{NO_UPSTREAM}.ratelimit.{k}"
                res[f"ratelimit_{k}"] = after.get(stat, 0) - before.get(stat, 0)
            v["runs"].append(res)
            say(f"  {v['label']:<58} {res['rps']:>8.0f} req/s p99 {res['lat_us']['p99'] / 1000:>6.2f} ms "
                f"envoy {res['envoy_cpu_us_per_req']:.1f} rls {res.get('rls_cpu_us_per_req', float('nan')):.1f} "
                f"redis {res['redis_cpu_us_per_req']:.1f} µs/req (usec {res['redis_usec_per_req']:.1f}) "
                f"cmds/req {res['redis_cmds_per_req']:.2f} "
                + " ".join(f"{k}={x:.2f}" for k, x in sorted(res["redis_cmds"].items()))
                + f" ok {res['ratelimit_ok']} over {res['ratelimit_over_limit']} error {res['ratelimit_error']}"
                + (f" non-2xx {res['errors']['status']}" if res["errors"]["status"] else ""))
    for v in vs:
        envoys[v["key"]].stop()
        runs = v["runs"]
        m: dict[str, Any] = {"rps": median([x["rps"] for x in runs]),
                             "p50": median([x["lat_us"]["p50"] for x in runs]),
                             "p99": median([x["lat_us"]["p99"] for x in runs]),
                             "envoy_cpu_us_per_req": median([x["envoy_cpu_us_per_req"] for x in runs]),
                             "redis_cpu_us_per_req": median([x["redis_cpu_us_per_req"] for x in runs]),
                             "redis_usec_per_req": median([x["redis_usec_per_req"] for x in runs]),
                             "redis_cmds_per_req": median([x["redis_cmds_per_req"] for x in runs]),
                             "non2xx": sum(x["errors"]["status"] for x in runs)}
        if any("rls_cpu_us_per_req" in x for x in runs):
            m["rls_cpu_us_per_req"] = median([x["rls_cpu_us_per_req"] for x in runs if "rls_cpu_us_per_req" in x])
        names = sorted({k for x in runs for k in x["redis_cmds"]})
        m["redis_cmds"] = {k: median([x["redis_cmds"].get(k, 0.0) for x in runs]) for k in names}
        for k in ("ok", "over_limit", "error", "failure_mode_allowed"):
            m[f"ratelimit_{k}"] = sum(x[f"ratelimit_{k}"] for x in runs)
        # the per-round ratio to Limitador's req/s (the same round: the same contention)
        lim = next((w for w in vs if w["key"] == "peer_limitador"), None)
        if lim is not None and v is not lim:
            m["rps_x_limitador"] = median([x["rps"] / y["rps"] for x, y in zip(runs, lim["runs"]) if y["rps"] > 0])
        v["median"] = m
        v.pop("filters", None)
        v.pop("extra_clusters", None)

    # Exactness: 1000 an hour, driven past it by 32 connections (Limitador's window starts
    # at its first hit, Diana's at the hour: a probe that straddles an hour is noted).
    for v in vs:
        if "rls_port" not in v:
            continue
        e = Envoy(procs, f"rls-exact-{v['key']}",
                  [ratelimit_filter(LIMITADOR_DOMAIN, v["rls_cluster"]), local_reply_filter()],
                  concurrency=1, cpus="0", rate_limits=generic_key_rate_limits(EXACT_VALUE), route_action=True,
                  extra_clusters=[grpc_cluster(v["rls_cluster"], v["rls_port"], connect_timeout="0.25s")])
        e.start()
        hour0 = int(time.time()) // 3600
        res = wrk(e.url + "/", duration=3)
        hour1 = int(time.time()) // 3600
        st = e.stats()
        e.stop()
        row = {"key": v["key"], "label": v["label"], "limit": EXACT_LIMIT, "requests": res["requests"],
               "admitted": st.get(f"cluster.{NO_UPSTREAM}.ratelimit.ok", 0),
               "over_limit": st.get(f"cluster.{NO_UPSTREAM}.ratelimit.over_limit", 0),
               "errors": st.get(f"cluster.{NO_UPSTREAM}.ratelimit.error", 0),
               "straddled_hour": hour0 != hour1}
        out["exact"].append(row)
        say(f"rls: exactness {v['label']}: admitted {row['admitted']} of {row['requests']} for a limit of "
            f"{EXACT_LIMIT} (over_limit {row['over_limit']}, errors {row['errors']})"
            + (" — straddled an hour boundary" if row["straddled_hour"] else ""))
    out["variants"] = vs
    return out
