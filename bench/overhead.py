"""Section 1: the per-request cost of Diana in Envoy, against no filter, Envoy's native
local_ratelimit and an empty stock-SDK wasm filter.

Every variant is its own Envoy process (`taskset -c 0 envoy --concurrency 1`, a
direct_response route), all started up front and kept running; rounds then visit them in
turn (A B C … A B C …) with `taskset -c 1 wrk -t1 -c32 -d<D>s --latency`, so slow drifts of
the machine (other builds on these 2 cores) spread over every variant instead of biasing
one. Per variant we keep the median of the rounds. Besides wrk's figures we read Envoy's
own CPU time (utime+stime from /proc) around each run: CPU µs per request is the cost
measure least disturbed by other processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import (EMPTY_MODULE, LIMITADOR_DOMAIN, NATIVE_MODULE, NO_UPSTREAM, V8, Envoy, Proc, Procs, free_port, generic_key_rate_limits,
                    grpc_cluster, local_reply_filter, median, native_local_ratelimit, native_module_filter, ratelimit_filter,
                    redis_cmd, say,
                    start_limitador, start_quota, start_redis, tail, wait_http, wait_tcp, wasm_filter, wrk)

HUGE = 1_000_000_000  # rpu that is never reached


def diana_doc(rules: list[str], url: str = "/", extra: str = "") -> str:
    body = "\n".join(f"      - {r}" for r in rules)
    return f"resources:\n  - Url: {url}\n    rules:\n{body}\n{extra}"


# timeout_ms 1000, not the default 50: on this shared 2-core machine a callout now and then
# waits > 50 ms, and one timeout keeps the gateway local for retry_seconds (5 s), which would
# measure the degraded path instead of the callout path (section 4 measures that on purpose).
GLOBAL_SECTION = "global: {cluster: diana_quota, authority: diana-quota, path: /v1/acquire, timeout_ms: 1000}\n"


def global_doc(algo: str, lease: int | str, big: bool = False, with_local: bool = False) -> str:
    """The global variants: one global rule (rpu 10⁶/s: never reached at this machine's
    rates); `with_local` puts a local TB that is never reached before it, as in the
    design's example."""
    rpu = HUGE if big else 1_000_000
    rules = ["{name: bench_l, rpu: 100000000, unit: second, algo: TB}"] if with_local else []
    rules.append(f"{{name: bench_g, rpu: {rpu}, unit: second, algo: {algo}, scope: global, lease: {lease}}}")
    return diana_doc(rules, extra=GLOBAL_SECTION)


def local_rule(algo: str, name: str = "bench", extra: str = "") -> str:
    return f"{{name: {name}, rpu: {HUGE}, unit: second, algo: {algo}{extra}}}"


# The peer's RLS cluster in Envoy (bench/limitador-rls, gRPC over HTTP/2).
RLS_CLUSTER = "limitador_rls"
# diana-quota's RLS (--rls-listen) in Envoy: the same filter and descriptor as the peer.
DIANA_RLS_CLUSTER = "diana_rls"
# diana-quota's --rls-config for that: envoyproxy/ratelimit's format, the peer's limit
# (10⁶ per second on generic_key=bench, a fixed window as Limitador counts it).
DIANA_RLS_CONFIG = f"""domain: {LIMITADOR_DOMAIN}
descriptors:
  - key: generic_key
    value: {LIMITADOR_DOMAIN}
    rate_limit: {{unit: second, requests_per_unit: 1000000}}
"""


def start_diana_rls(procs: Procs, binary: Path, redis_port: int, name: str = "diana-quota-rls",
                    cpus: str | None = "1") -> tuple[Proc, int]:
    """diana-quota serving Envoy's RLS (`--rls-listen`) on the Redis at `redis_port`, with
    DIANA_RLS_CONFIG; its own process, so that its CPU time is the RLS's alone. Its deadline
    sits under the filter's 1 s timeout as docs/rls.md advises (the production defaults,
    40 ms, are for the 20–50 ms timeouts gateways use): like Limitador, which has none, it
    then answers every call on these shared cores instead of failing the slow ones fast."""
    config = procs.logdir / "diana-rls.yaml"
    config.write_text(DIANA_RLS_CONFIG)
    http_port, rls_port = free_port(), free_port()
    p = procs.spawn(name, [str(binary), "--listen", f"127.0.0.1:{http_port}", "--redis",
                           f"redis://127.0.0.1:{redis_port}", "--log", "warn", "--insecure-no-auth",
                           "--deadline-ms", "900", "--redis-timeout-ms", "800", "--redis-connect-timeout-ms", "100",
                           "--rls-listen", f"127.0.0.1:{rls_port}", "--rls-config", str(config)], cpus=cpus)
    if not wait_http(f"http://127.0.0.1:{http_port}/healthz", p, 20) or not wait_tcp(rls_port, p, 10):
        raise RuntimeError(f"diana-quota --rls-listen did not start: {tail(p.log)}")
    return p, rls_port


def redis_commands(port: int | None) -> int | None:
    """Commands Redis has processed so far (INFO stats), None without Redis."""
    if port is None:
        return None
    try:
        for line in redis_cmd(port, "INFO", "stats").decode(errors="replace").splitlines():
            if line.startswith("total_commands_processed:"):
                return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def variants(diana_wasm: Path, empty_wasm: Path, with_global: bool, extra: bool,
             untrimmed_wasm: Path | None = None, empty_trimmed_wasm: Path | None = None,
             limitador_port: int | None = None, diana_rls_port: int | None = None) -> list[dict[str, Any]]:
    """(key, label, filters, needs_quota). Labels are what the report prints.
    `diana_wasm` is the module deployed on Envoy (diana-envoy.wasm, trimmed by diana-trim);
    `untrimmed_wasm` is cargo's output with every SDK callback, `empty_trimmed_wasm` the
    empty filter trimmed the same way. With `limitador_port` (bench/limitador-rls running
    there), the peer: Envoy's own global rate limiting, `envoy.filters.http.ratelimit`
    calling Limitador over gRPC on every request. That filter skips direct_response routes
    (no route entry), so its Envoy routes to a cluster without endpoints and ends each
    request with the fault filter's local reply 200; `peer_route` is that same Envoy
    without the ratelimit filter, so peer_limitador − peer_route is the filter's cost.
    With `diana_rls_port` (diana-quota's --rls-listen), the same Envoy, filter and
    descriptor calling diana-quota instead: peer_diana."""
    d = str(diana_wasm)

    def diana(doc: str, wasm: str = d, **kw: Any) -> list[dict]:
        return [wasm_filter("diana", wasm, doc, **kw)]

    vs: list[dict[str, Any]] = [
        {"key": "none", "label": "no filter", "filters": []},
        {"key": "native", "label": "native local_ratelimit", "filters": [native_local_ratelimit()]},
        {"key": "empty", "label": "empty wasm filter (stock SDK)",
         "filters": [wasm_filter("empty", str(empty_wasm))]},
    ]
    if empty_trimmed_wasm is not None and empty_trimmed_wasm.is_file():
        vs.append({"key": "empty_trim", "label": "empty wasm filter, trimmed like Diana",
                   "filters": [wasm_filter("empty", str(empty_trimmed_wasm))]})
    for algo in ("W", "SW", "LB", "TB"):
        vs.append({"key": f"local_{algo}", "label": f"Diana local {algo}", "group": "local",
                   "filters": diana(diana_doc([local_rule(algo)]))})
    if EMPTY_MODULE.is_file():
        # What any dynamic module costs: Envoy's machinery around a filter that does nothing.
        vs.append({"key": "native_empty", "label": "empty native module (does nothing)",
                   "filters": [native_module_filter("", EMPTY_MODULE)]})
    if NATIVE_MODULE.is_file():
        # Diana as Envoy's dynamic module: no wasm VM between Envoy and the worker.
        vs.append({"key": "native_TB", "label": "Diana native module local TB", "group": "local",
                   "filters": [native_module_filter(diana_doc([local_rule("TB")]))]})
    if with_global:
        for lease in (1, 100):
            vs.append({"key": f"global_l{lease}", "label": f"Diana global W, lease {lease}", "group": "global",
                       "filters": diana(global_doc("W", lease)), "quota": True})
        vs.append({"key": "global_auto", "label": "Diana global W, lease auto", "group": "global",
                   "filters": diana(global_doc("W", "auto")), "quota": True})
        if NATIVE_MODULE.is_file():
            vs.append({"key": "native_global_l100", "label": "Diana native module global W, lease 100",
                       "group": "global", "filters": [native_module_filter(global_doc("W", 100))], "quota": True})
            vs.append({"key": "native_global_auto", "label": "Diana native module global W, lease auto",
                       "group": "global", "filters": [native_module_filter(global_doc("W", "auto"))], "quota": True})
    if limitador_port is not None or diana_rls_port is not None:
        vs.append({"key": "peer_route", "label": "peer baseline: routed, fault-filter reply 200",
                   "group": "global", "filters": [local_reply_filter()], "route_action": True})
    if limitador_port is not None:
        vs.append({"key": "peer_limitador", "label": "Envoy ratelimit filter → Limitador (Redis)", "group": "global",
                   "filters": [ratelimit_filter(LIMITADOR_DOMAIN, RLS_CLUSTER), local_reply_filter()],
                   "rate_limits": generic_key_rate_limits(LIMITADOR_DOMAIN),
                   "extra_clusters": [grpc_cluster(RLS_CLUSTER, limitador_port, connect_timeout="0.25s")],
                   "peer": True, "rls": "limitador", "rls_cluster": RLS_CLUSTER})
    if diana_rls_port is not None:
        vs.append({"key": "peer_diana", "label": "Envoy ratelimit filter → diana-quota RLS (Redis)",
                   "group": "global",
                   "filters": [ratelimit_filter(LIMITADOR_DOMAIN, DIANA_RLS_CLUSTER), local_reply_filter()],
                   "rate_limits": generic_key_rate_limits(LIMITADOR_DOMAIN),
                   "extra_clusters": [grpc_cluster(DIANA_RLS_CLUSTER, diana_rls_port, connect_timeout="0.25s")],
                   "peer": True, "rls": "diana", "rls_cluster": DIANA_RLS_CLUSTER})
    if extra:
        # "Where the time goes": the fixed cost of the filter (a policy that matches nothing),
        # the cost per rule (8 rules), an identity lookup (actor ip), and V8's allow_precompiled.
        vs += [
            {"key": "x_nomatch", "label": "Diana, no rule matches (/nomatch)", "group": "extra",
             "filters": diana(diana_doc([local_rule("TB")], url="/nomatch"))},
            {"key": "x_tb8", "label": "Diana local TB × 8 rules", "group": "extra",
             "filters": diana(diana_doc([local_rule("TB", name=f"bench{i}") for i in range(8)]))},
            {"key": "x_ip", "label": "Diana local TB, actor ip", "group": "extra",
             "filters": diana(diana_doc([local_rule("TB", extra=", actor: ip")]))},
            {"key": "x_precompiled", "label": "Diana local TB, allow_precompiled", "group": "extra",
             "filters": diana(diana_doc([local_rule("TB")]), allow_precompiled=True)},
        ]
        if untrimmed_wasm is not None and untrimmed_wasm.is_file():
            vs.append({"key": "x_untrimmed", "label": "Diana local TB, untrimmed module (every SDK callback)",
                       "group": "extra", "filters": diana(diana_doc([local_rule("TB")]), wasm=str(untrimmed_wasm))})
        if with_global:
            vs.append({"key": "x_global_tb_l100", "label": "Diana global TB (10⁹/s), lease 100", "group": "extra",
                       "filters": diana(global_doc("TB", 100, big=True)), "quota": True})
            vs.append({"key": "x_mixed_l100", "label": "Diana local TB + global W, lease 100 (design example)",
                       "group": "extra", "filters": diana(global_doc("W", 100, with_local=True)), "quota": True})
    return vs


def run(procs: Procs, cfg: dict[str, Any], diana_wasm: Path, empty_wasm: Path,
        quota_bin: Path | None, untrimmed_wasm: Path | None = None,
        empty_trimmed_wasm: Path | None = None, limitador_bin: Path | None = None) -> dict[str, Any]:
    rounds, duration, warmup = cfg["rounds"], cfg["duration"], cfg["warmup"]
    out: dict[str, Any] = {"rounds": rounds, "duration_s": duration, "variants": [], "notes": []}
    quota_port = None
    redis_port = None
    redis_proc = None
    if quota_bin is not None or limitador_bin is not None:
        try:
            redis_proc, redis_port = start_redis(procs, "overhead-redis", cpus="1")
        except RuntimeError as e:
            out["notes"].append(f"global variants and the Limitador peer skipped: {e}")
    if quota_bin is None:
        out["notes"].append("global variants skipped: diana-quota was not built")
    elif redis_port is not None:
        try:
            _quota, quota_port = start_quota(procs, quota_bin, redis_port, "overhead-quota", cpus="1")
        except RuntimeError as e:
            out["notes"].append(f"global variants skipped: {e}")
            quota_port = None
    # The peer: bench/limitador-rls on the same Redis as diana-quota, pinned like it.
    limitador = None
    limitador_port = None
    if limitador_bin is None:
        out["notes"].append("Limitador peer skipped: bench/limitador-rls was not built")
    elif redis_port is not None:
        try:
            limitador, limitador_port = start_limitador(procs, limitador_bin, redis_port, "overhead-limitador",
                                                        cpus="1")
            out["notes"].append(
                "peer_limitador: Envoy's ratelimit filter acts only on routed requests (not on a direct_response "
                f"route), so the peer's Envoy routes to `{NO_UPSTREAM}` (a cluster without endpoints) and the fault "
                "filter ends each request with a local reply 200; peer_route is that Envoy without the ratelimit "
                "filter. limitador-rls: Limitador's AsyncRedisStorage (limitador-server's `redis` storage), one "
                "limit of 10⁶/s on generic_key=bench, pinned to CPU 1 with redis-server and diana-quota.")
        except RuntimeError as e:
            out["notes"].append(f"Limitador peer skipped: {e}")
    # diana-quota's own RLS, the same filter and descriptor as the peer, on the same Redis.
    diana_rls = None
    diana_rls_port = None
    if quota_bin is not None and redis_port is not None:
        try:
            diana_rls, diana_rls_port = start_diana_rls(procs, quota_bin, redis_port, "overhead-diana-rls", cpus="1")
            out["notes"].append(
                "peer_diana: the peer's Envoy, filter and descriptor (domain bench, generic_key=bench, 10⁶/s) "
                "calling diana-quota's RLS (--rls-listen, a fixed window as in envoyproxy/ratelimit's format) on the "
                "same Redis, its own diana-quota process pinned to CPU 1 like Limitador.")
        except RuntimeError as e:
            out["notes"].append(f"diana-quota RLS peer skipped: {e}")
    rls_procs = {"limitador": limitador, "diana": diana_rls}
    vs = variants(diana_wasm, empty_wasm, with_global=quota_port is not None, extra=cfg["extra"],
                  untrimmed_wasm=untrimmed_wasm, empty_trimmed_wasm=empty_trimmed_wasm,
                  limitador_port=limitador_port, diana_rls_port=diana_rls_port)

    envoys: dict[str, Envoy] = {}
    for v in vs:
        e = Envoy(procs, f"overhead-{v['key']}", v["filters"], concurrency=1, cpus="0",
                  quota=quota_port if v.get("quota") else None, extra_clusters=v.get("extra_clusters"),
                  rate_limits=v.get("rate_limits"), route_action=v.get("route_action", False))
        try:
            e.start()
        except RuntimeError as err:
            say(f"overhead: {v['label']} did not start: {err}")
            v["error"] = str(err).splitlines()[0] + " " + " | ".join(str(err).splitlines()[1:])[-400:]
            continue
        envoys[v["key"]] = e
        v["startup_s"] = e.startup_s
        v["runs"] = []
    out["envoy_argv"] = "taskset -c 0 envoy -c <variant>.json --concurrency 1 --disable-hot-restart --log-level warn"

    say(f"overhead: warming up {len(envoys)} Envoys ({warmup}s each)")
    for v in vs:
        if v["key"] in envoys:
            wrk(envoys[v["key"]].url + "/", duration=warmup)

    for r in range(rounds):
        say(f"overhead: round {r + 1}/{rounds}")
        for v in vs:
            e = envoys.get(v["key"])
            if e is None:
                continue
            before = e.stats()
            cpu0 = e.proc.cpu_seconds()
            rls_proc = rls_procs.get(v.get("rls", ""))
            rls0 = rls_proc.cpu_seconds() if rls_proc is not None else None
            redis0 = redis_commands(redis_port) if v.get("peer") or v.get("quota") else None
            redis_cpu0 = redis_proc.cpu_seconds() if redis0 is not None and redis_proc is not None else None
            res = wrk(e.url + "/", duration=duration)
            cpu1 = e.proc.cpu_seconds()
            rls1 = rls_proc.cpu_seconds() if rls_proc is not None else None
            redis1 = redis_commands(redis_port) if redis0 is not None else None
            redis_cpu1 = redis_proc.cpu_seconds() if redis_cpu0 is not None and redis_proc is not None else None
            if redis0 is not None and redis1 is not None:
                # Redis's own INFO call is one of them; the variants run one at a time.
                # Commands run by a script (redis.call) count too, as INFO counts them.
                res["redis_cmds_per_req"] = max(0, redis1 - redis0 - 1) / max(1, res["requests"])
            if redis_cpu0 is not None and redis_cpu1 is not None:
                res["redis_cpu_us_per_req"] = (redis_cpu1 - redis_cpu0) * 1e6 / max(1, res["requests"])
            after = e.stats()
            res["envoy_cpu_us_per_req"] = (cpu1 - cpu0) * 1e6 / max(1, res["requests"])
            res["envoy_cpu_util"] = (cpu1 - cpu0) / (res["duration_us"] / 1e6)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("wasmcustom.")}
            res["wasmcustom_delta"] = {k: v2 for k, v2 in delta.items() if v2}
            res["callouts"] = delta.get("wasmcustom.diana_global_callouts", 0)
            res["callouts_per_req"] = res["callouts"] / max(1, res["requests"])
            res["global_errors"] = delta.get("wasmcustom.diana_global_errors", 0)
            res["degraded_requests"] = delta.get("wasmcustom.diana_global_degraded_requests", 0)
            res["rq_2xx"] = after.get("http.ingress.downstream_rq_2xx", 0) - before.get("http.ingress.downstream_rq_2xx", 0)
            if v.get("peer"):
                # The ratelimit filter's verdicts (stats of the route's cluster) and the gRPC
                # calls Envoy made to the RLS: an RLS that errors would make the peer look
                # cheap, and with failure_mode_deny false its requests still get 200.
                for k in ("ok", "over_limit", "error", "failure_mode_allowed"):
                    stat = f"cluster.{NO_UPSTREAM}.ratelimit.{k}"
                    res[f"ratelimit_{k}"] = after.get(stat, 0) - before.get(stat, 0)
                stat = f"cluster.{v['rls_cluster']}.upstream_rq_total"
                res["rls_calls"] = after.get(stat, 0) - before.get(stat, 0)
                res["rls_calls_per_req"] = res["rls_calls"] / max(1, res["requests"])
                if rls0 is not None and rls1 is not None:
                    res["rls_cpu_us_per_req"] = (rls1 - rls0) * 1e6 / max(1, res["requests"])
            v["runs"].append(res)
            say(f"  {v['label']:<40} {res['rps']:>9.0f} req/s  p50 {res['lat_us']['p50']:>5} µs  "
                f"p99 {res['lat_us']['p99']:>6} µs  cpu {res['envoy_cpu_us_per_req']:.1f} µs/req"
                + (f"  callouts/req {res['callouts_per_req']:.4f} errors {res['global_errors']} degraded "
                   f"{res['degraded_requests']}" if v.get("quota") else "")
                + (f"  RLS calls/req {res['rls_calls_per_req']:.4f} ok {res['ratelimit_ok']} over_limit "
                   f"{res['ratelimit_over_limit']} error {res['ratelimit_error']}"
                   + (f" {v['rls']} cpu {res['rls_cpu_us_per_req']:.1f} µs/req" if "rls_cpu_us_per_req" in res
                      else "") if v.get("peer") else "")
                + (f"  redis cmds/req {res['redis_cmds_per_req']:.3f}" if "redis_cmds_per_req" in res else "")
                + (f" redis cpu {res['redis_cpu_us_per_req']:.1f} µs/req" if "redis_cpu_us_per_req" in res else "")
                + (f"  non-2xx {res['errors']['status']}" if res["errors"]["status"] else ""))
            if v.get("peer") and (res["ratelimit_error"] or res["rls_calls_per_req"] < 0.99):
                say(f"  warning: {v['label']}: not every request was decided by the RLS "
                    f"({res['ratelimit_error']} errors, {res['rls_calls_per_req']:.3f} calls/req): "
                    f"{tail(rls_proc.log, 3) if rls_proc else ''}")
            if not e.proc.alive():
                say(f"  {v['label']}: Envoy exited: {tail(e.proc.log)}")
                envoys.pop(v["key"])
    for v in vs:
        e = envoys.get(v["key"])
        if e is not None:
            v["rss_mib"] = e.proc.rss_mib()
            final = e.stats()
            v["final_wasmcustom"] = {k: val for k, val in final.items() if k.startswith("wasmcustom.")}
            if v.get("peer"):
                v["final_ratelimit"] = {k: val for k, val in final.items()
                                        if val and (".ratelimit." in k
                                                    or k.startswith(f"cluster.{v['rls_cluster']}.upstream_rq"))}
            v["wrk_command"] = v["runs"][0]["command"] if v.get("runs") else ""
            e.stop()
        runs = v.get("runs") or []
        if runs:
            v["median"] = {
                "rps": median([x["rps"] for x in runs]),
                "p50": median([x["lat_us"]["p50"] for x in runs]),
                "p75": median([x["lat_us"]["p75"] for x in runs]),
                "p90": median([x["lat_us"]["p90"] for x in runs]),
                "p99": median([x["lat_us"]["p99"] for x in runs]),
                "p99.9": median([x["lat_us"]["p99.9"] for x in runs]),
                "cpu_us_per_req": median([x["envoy_cpu_us_per_req"] for x in runs]),
                "cpu_util": median([x["envoy_cpu_util"] for x in runs]),
                "callouts_per_req": median([x["callouts_per_req"] for x in runs]),
                "global_errors": sum(x.get("global_errors", 0) for x in runs),
                "degraded_requests": sum(x.get("degraded_requests", 0) for x in runs),
                "non2xx": sum(x["errors"]["status"] for x in runs),
                "socket_errors": sum(x["errors"][k] for x in runs for k in ("connect", "read", "write", "timeout")),
            }
            for k in ("redis_cmds_per_req", "redis_cpu_us_per_req"):
                if any(k in x for x in runs):
                    v["median"][k] = median([x[k] for x in runs if k in x])
            if v.get("peer"):
                v["median"]["rls_calls_per_req"] = median([x["rls_calls_per_req"] for x in runs])
                v["median"]["rls_cpu_us_per_req"] = median([x.get("rls_cpu_us_per_req", float("nan")) for x in runs])
                for k in ("ok", "over_limit", "error", "failure_mode_allowed"):
                    v["median"][f"ratelimit_{k}"] = sum(x[f"ratelimit_{k}"] for x in runs)
        v.pop("filters", None)
        v.pop("extra_clusters", None)
    out["variants"] = vs
    return out


def probe_runtimes(procs: Procs, empty_wasm: Path, diana_wasm: Path) -> list[dict[str, Any]]:
    """Which wasm runtimes this Envoy build has, and whether allow_precompiled starts."""
    found = []
    doc = diana_doc([local_rule("TB")])
    cases = [
        ("envoy.wasm.runtime.v8", "empty", {}),
        ("envoy.wasm.runtime.wasmtime", "empty", {}),
        ("envoy.wasm.runtime.wamr", "empty", {}),
        ("envoy.wasm.runtime.wavm", "empty", {}),
        ("envoy.wasm.runtime.null", "empty", {}),
        (V8, "diana", {}),
        (V8, "diana", {"allow_precompiled": True}),
    ]
    for runtime, which, kw in cases:
        wasm = empty_wasm if which == "empty" else diana_wasm
        f = wasm_filter(which, str(wasm), doc if which == "diana" else "", runtime=runtime, **kw)
        name = f"probe-{runtime.rsplit('.', 1)[1]}-{which}" + ("-precompiled" if kw else "")
        e = Envoy(procs, name, [f], concurrency=1)
        row: dict[str, Any] = {"runtime": runtime, "filter": which, "allow_precompiled": bool(kw)}
        try:
            e.start(timeout=30)
            row["starts"] = True
            row["startup_s"] = round(e.startup_s, 2)
            e.stop()
        except RuntimeError as err:
            row["starts"] = False
            lines = [l.split("] ", 3)[-1] for l in str(err).splitlines() if "Failed to" in l]
            row["error"] = (lines[0] if lines else str(err).splitlines()[-1])[-300:]
        found.append(row)
        say(f"probe: {runtime} {which}{' allow_precompiled' if kw else ''}: "
            f"{'starts in %.2fs' % row['startup_s'] if row['starts'] else 'fails: ' + row['error']}")
    return found


HOSTCALL_KINDS = ["none", "header", "time", "shared_get", "shared_cas", "metric", "property"]
HOSTCALL_N = 32


def run_hostcalls(procs: Procs, cfg: dict[str, Any], probe_wasm: Path) -> dict[str, Any]:
    """What one proxy-wasm host call of each kind costs in this Envoy: bench/probe-filter
    makes HOSTCALL_N calls of one kind per request; (Envoy CPU µs/req − the `none` probe's)
    ÷ HOSTCALL_N. Same rig as the overhead section, interleaved rounds."""
    rounds = cfg["rounds"]
    duration = max(2, cfg["duration"] // 2)
    envoys = {}
    for kind in HOSTCALL_KINDS:
        f = wasm_filter("probe", str(probe_wasm), f"{kind} {HOSTCALL_N}")
        envoys[kind] = Envoy(procs, f"hostcall-{kind}", [f], concurrency=1, cpus="0").start()
    for kind in HOSTCALL_KINDS:
        wrk(envoys[kind].url + "/", duration=cfg["warmup"])
    runs: dict[str, list] = {k: [] for k in HOSTCALL_KINDS}
    for r in range(rounds):
        say(f"hostcalls: round {r + 1}/{rounds}")
        for kind in HOSTCALL_KINDS:
            e = envoys[kind]
            c0 = e.proc.cpu_seconds()
            res = wrk(e.url + "/", duration=duration)
            c1 = e.proc.cpu_seconds()
            res["envoy_cpu_us_per_req"] = (c1 - c0) * 1e6 / max(1, res["requests"])
            runs[kind].append(res)
    for e in envoys.values():
        e.stop()
    rows = []
    for kind in HOSTCALL_KINDS:
        per_round = [(x["envoy_cpu_us_per_req"] - y["envoy_cpu_us_per_req"]) / HOSTCALL_N
                     for x, y in zip(runs[kind], runs["none"])]
        row = {"kind": kind, "rps": median([x["rps"] for x in runs[kind]]),
               "cpu_us_per_req": median([x["envoy_cpu_us_per_req"] for x in runs[kind]]),
               "us_per_call": median(per_round) if kind != "none" else 0.0}
        rows.append(row)
        say(f"  {kind:<11} {row['rps']:>8.0f} req/s  {row['cpu_us_per_req']:.1f} µs/req  "
            f"{row['us_per_call']:.2f} µs per call")
    return {"n": HOSTCALL_N, "rounds": rounds, "duration_s": duration, "rows": rows}
