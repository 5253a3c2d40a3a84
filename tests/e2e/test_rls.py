"""Envoy's own `ratelimit` filter (RLS, envoy.service.ratelimit.v3) against diana-quota on
Redis: real Envoy 1.40 gateways with no Diana in them, diana-quota serving
`--rls-listen`/`--rls-config` (envoyproxy/ratelimit's own configuration format).

- two native gateways admit exactly the limit between them;
- a wasm-Diana gateway and a native gateway spend one budget (a descriptor names the
  counter of the Diana global rule with `diana_key`);
- diana-quota or Redis killed: Envoy's failure mode applies at once (deny: 500; allow:
  200), no request hangs;
- a bad descriptor is refused with a clear log line, a bad file stops diana-quota at start;
- `unit: month` in a `timezone`: a calendar month's budget, reset (Retry-After, the Redis
  key's expiry) at the month's end in that zone.

The helpers here (a native Envoy, diana-quota with RLS) serve test_rlqs.py too."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

import harness
from harness import HOST, QUOTA_TOKEN, ManagedProcess, Quota, Redis, record, send_concurrent, statuses


# --------------------------------------------------------------------------- helpers


def grpc_service(rls_port_cluster: str = "diana_rls", token: Optional[str] = QUOTA_TOKEN) -> dict:
    """Envoy's gRPC service for diana-quota: the cluster, and the secret as metadata."""
    service: dict = {"envoy_grpc": {"cluster_name": rls_port_cluster}}
    if token is not None:
        service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {token}"}]
    return service


def ratelimit_filter(
    domain: str = "edge",
    *,
    failure_mode_deny: bool = True,
    timeout: str = "1s",
    x_ratelimit_headers: bool = True,
    token: Optional[str] = QUOTA_TOKEN,
) -> dict:
    """envoy.filters.http.ratelimit calling diana-quota's RLS."""
    config = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
        "domain": domain,
        "timeout": timeout,
        "failure_mode_deny": failure_mode_deny,
        "rate_limit_service": {"grpc_service": grpc_service(token=token), "transport_api_version": "V3"},
    }
    if x_ratelimit_headers:
        config["enable_x_ratelimit_headers"] = "DRAFT_VERSION_03"
    return {"name": "envoy.filters.http.ratelimit", "typed_config": config}


def header_action(header: str, key: str) -> dict:
    return {"request_headers": {"header_name": header, "descriptor_key": key}}


def generic_action(value: str) -> dict:
    return {"generic_key": {"descriptor_value": value}}


def native_bootstrap(
    *,
    port: int,
    admin_port: int,
    upstream_port: int,
    rls_port: int,
    filters: Sequence[dict],
    rate_limits: Sequence[Sequence[dict]] = (),
    route_filter_config: Optional[dict] = None,
) -> dict:
    """An Envoy bootstrap: listener -> `filters` -> router -> the upstream; the virtual
    host's rate_limits (one list of actions per descriptor, or a whole `RateLimit` entry as
    a dict); the route's `typed_per_filter_config` (`route_filter_config`); a `diana_rls`
    HTTP/2 cluster."""

    def static(name: str, cluster_port: int, http2: bool = False) -> dict:
        cluster: dict = {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "0.25s",
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": HOST, "port_value": cluster_port}}}}]}],
            },
        }
        if http2:
            cluster["typed_extension_protocol_options"] = {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            }
        return cluster

    virtual_host: dict = {
        "name": "all",
        "domains": ["*"],
        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "15s"}}],
    }
    if route_filter_config:
        virtual_host["routes"][0]["typed_per_filter_config"] = dict(route_filter_config)
    if rate_limits:
        virtual_host["rate_limits"] = [
            dict(actions) if isinstance(actions, dict) else {"actions": list(actions)} for actions in rate_limits
        ]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {"name": "local", "virtual_hosts": [virtual_host]},
        "http_filters": [
            *filters,
            {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": HOST, "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {"socket_address": {"address": HOST, "port_value": port}},
                    "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}],
                }
            ],
            "clusters": [static("upstream", upstream_port), static("diana_rls", rls_port, http2=True)],
        },
    }


class NativeEnvoy(ManagedProcess):
    """Envoy without Diana: its own rate limit filters calling diana-quota over gRPC."""

    def __init__(
        self,
        log_dir: Path,
        *,
        upstream_port: int,
        rls_port: int,
        filters: Sequence[dict],
        rate_limits: Sequence[Sequence[dict]] = (),
        route_filter_config: Optional[dict] = None,
        name: str = "native",
        concurrency: int = 2,
        log_level: str = "info",
    ) -> None:
        self.port = harness.free_port()
        self.admin_port = harness.free_port()
        while self.admin_port == self.port:
            self.admin_port = harness.free_port()
        bootstrap = native_bootstrap(
            port=self.port, admin_port=self.admin_port, upstream_port=upstream_port,
            rls_port=rls_port, filters=filters, rate_limits=rate_limits,
            route_filter_config=route_filter_config,
        )  # fmt: skip
        log_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap_path = log_dir / f"{name}.json"
        self.bootstrap_path.write_text(json.dumps(bootstrap, indent=1))
        argv = [
            harness.envoy_binary(), "-c", str(self.bootstrap_path), "--concurrency", str(concurrency),
            "--disable-hot-restart", "--log-level", log_level,
        ]  # fmt: skip
        super().__init__(name, argv, log_dir / f"{name}.log")

    def is_ready(self) -> bool:
        status, _, _ = harness.http_get(self.admin_port, "/ready", timeout=1.0)
        return status == 200 and harness.port_open(self.port)

    def start(self, timeout: float = 60.0) -> "NativeEnvoy":  # type: ignore[override]
        super().start()
        self.wait_ready(self.is_ready, timeout, "ready (admin /ready and listener open)")
        return self


def rls_quota(
    procs,
    config: str,
    redis_url: Optional[str],
    *,
    extra: Sequence[str] = (),
    name: str = "rls.yaml",
) -> Quota:
    """diana-quota serving RLS/RLQS on a free port (`.rls_port`) from `config`, on Redis."""
    path = procs.log_dir / name
    path.write_text(config)
    rls_port = harness.free_port()
    flags = (*harness.QUOTA_TEST_FLAGS, "--rls-listen", f"{HOST}:{rls_port}", "--rls-config", str(path), *extra)
    quota = procs.add(Quota(procs.log_dir, redis_url, flags=flags))
    quota.rls_port = rls_port  # type: ignore[attr-defined]
    quota.start()
    quota.wait_ready(lambda: harness.port_open(rls_port), 10, "serving gRPC on --rls-listen")
    return quota


def native(
    procs, upstream, quota, *, filters: Sequence[dict], rate_limits=(), name: str = "native", log_level: str = "info",
    route_filter_config: Optional[dict] = None,
) -> NativeEnvoy:
    return procs.add(
        NativeEnvoy(procs.log_dir, upstream_port=upstream.port, rls_port=quota.rls_port,
                    filters=filters, rate_limits=rate_limits, name=name, log_level=log_level,
                    route_filter_config=route_filter_config)
    ).start()  # fmt: skip


def tenant() -> str:
    """A tenant value of its own for one test (counters never meet across tests)."""
    return "t" + uuid.uuid4().hex[:12]


def wait_for_fresh_hour(min_remaining: float = 20.0) -> None:
    """Fixed windows of an hour: not within `min_remaining` seconds of the hour's end."""
    remaining = 3600.0 - (time.time() % 3600.0)
    if remaining < min_remaining:
        time.sleep(remaining + 0.2)


def both(gateways, n: int, headers: dict) -> list[harness.Resp]:
    """`n` requests at once, split over the gateways, each on its own connection."""
    out: list[harness.Resp] = []
    lock = threading.Lock()

    def run(g):
        r = send_concurrent(g.port, n // len(gateways), "/", headers)
        with lock:
            out.extend(r)

    threads = [threading.Thread(target=run, args=(g,)) for g in gateways]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def redis_keys(redis: Redis, pattern: str) -> list[str]:
    return [k for k in harness.redis_cli(redis.port, "--scan", "--pattern", pattern).split() if k]


# --------------------------------------------------------------------------- tests

PER_TENANT = """
domain: edge
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 30}
"""


def test_two_native_gateways_admit_exactly_the_limit(procs, upstream):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = rls_quota(procs, PER_TENANT, redis.url, extra=("--rls-headers", "ietf"))
    actions = [[header_action("x-tenant", "tenant")]]
    gateways = [
        native(procs, upstream, quota, filters=[ratelimit_filter()], rate_limits=actions, name=f"native{i}")
        for i in (1, 2)
    ]
    wait_for_fresh_hour()
    who = {"x-tenant": tenant()}
    t0 = time.monotonic()
    resps = both(gateways, 120, who)
    took = time.monotonic() - t0
    assert not harness.errors(resps), harness.errors(resps)[:3]
    assert statuses(resps) == {200: 30, 429: 90}, statuses(resps)
    # Envoy's X-RateLimit-* (from the descriptor statuses) and diana-quota's IETF fields
    # and Retry-After (--rls-headers ietf) on the answers.
    refused = next(r for r in resps if r.status == 429)
    assert refused.header("x-ratelimit-limit").startswith("30"), refused.headers
    assert refused.header("x-ratelimit-remaining") == "0", refused.headers
    assert 1 <= int(refused.header("retry-after")) <= 3600, refused.headers
    assert refused.header("ratelimit-policy") == '"edge.tenant";q=30;w=3600', refused.headers
    assert refused.header("ratelimit").startswith('"edge.tenant";r=0;t='), refused.headers
    admitted = [r for r in resps if r.status == 200]
    assert sorted(int(r.header("x-ratelimit-remaining")) for r in admitted) == list(range(30)), [
        r.header("x-ratelimit-remaining") for r in admitted
    ]
    # One counter in Redis, named as docs/rls.md says.
    keys = redis_keys(redis, "diana:{rls:*")
    assert len(keys) == 1 and keys[0].endswith("}:W:30:hour:30:10"), keys
    # Another tenant has its own 30.
    other = both(gateways, 40, {"x-tenant": tenant()})
    assert statuses(other) == {200: 30, 429: 10}, statuses(other)
    record("rls_two_gateways", {"sent": 120, "admitted": 30, "limit": 30, "seconds": round(took, 2)})


def diana_rule_id(doc: str, log_dir: Path) -> str:
    """The id `diana check` gives the document's first rule."""
    path = log_dir / "diana.yaml"
    path.write_text(doc)
    out = subprocess.run([str(harness.DIANA_BIN), "check", "--json", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["resources"][0]["rules"][0]["id"]


def test_a_wasm_gateway_and_a_native_gateway_spend_one_budget(procs, upstream):
    doc = """
resources:
  - Url: /
    rules:
      - {name: shared, rpu: 20, unit: hour, algo: W, scope: global, lease: 1}
response: {status: 429}
global: {timeout_ms: 500, retry_seconds: 2}
"""
    # A Diana global rule with actor `all` counts under `<rule id>:0000000000000001`.
    key = f"{diana_rule_id(doc, procs.log_dir)}:0000000000000001"
    config = f"""
domain: edge
descriptors:
  - key: generic_key
    value: shared
    rate_limit: {{unit: hour, requests_per_unit: 20, diana_key: "{key}"}}
"""
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = rls_quota(procs, config, redis.url)
    nat = native(procs, upstream, quota, filters=[ratelimit_filter()], rate_limits=[[generic_action("shared")]])
    wasm = procs.add(harness.Envoy(procs.log_dir, diana_config=doc, upstream_port=upstream.port, quota_port=quota.port, name="wasm")).start()
    wait_for_fresh_hour()
    resps = both([nat, wasm], 80, {})
    assert not harness.errors(resps), harness.errors(resps)[:3]
    assert statuses(resps) == {200: 20, 429: 60}, statuses(resps)
    keys = harness.counter_keys(redis_keys(redis, "diana:{*"))
    assert keys == [f"diana:{{{key}}}:W:20:hour:20:10"], keys
    record("rls_wasm_and_native_one_budget", {"sent": 80, "admitted": 20, "limit": 20})


def timed(port: int, n: int, headers: dict) -> tuple[dict, float]:
    resps = [harness.request(port, "/", headers, timeout=10) for _ in range(n)]
    assert not harness.errors(resps), harness.errors(resps)[:3]
    return statuses(resps), max(r.latency for r in resps)


def test_failure_modes_apply_at_once_when_diana_quota_or_redis_dies(procs, upstream):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = rls_quota(procs, PER_TENANT.replace("30", "1000"), redis.url)
    actions = [[header_action("x-tenant", "tenant")]]
    deny = native(procs, upstream, quota, filters=[ratelimit_filter(failure_mode_deny=True, timeout="0.5s")], rate_limits=actions, name="deny")
    allow = native(procs, upstream, quota, filters=[ratelimit_filter(failure_mode_deny=False, timeout="0.5s")], rate_limits=actions, name="allow")
    who = {"x-tenant": tenant()}
    assert timed(deny.port, 3, who)[0] == {200: 3}
    figures = {}

    redis.stop()
    got, slowest = timed(deny.port, 10, who)
    assert got == {500: 10}, got
    assert slowest < 1.0, slowest
    figures["redis_down_deny_max_s"] = round(slowest, 3)
    got, slowest = timed(allow.port, 10, who)
    assert got == {200: 10}, got
    assert slowest < 1.0, slowest

    quota.stop()
    got, slowest = timed(deny.port, 10, who)
    assert got == {500: 10}, got
    assert slowest < 1.0, slowest
    figures["quota_down_deny_max_s"] = round(slowest, 3)
    got, slowest = timed(allow.port, 10, who)
    assert got == {200: 10}, got
    figures["quota_down_allow_max_s"] = round(slowest, 3)
    record("rls_failure_modes", figures)


def test_bad_descriptors_are_refused_with_a_clear_log_line(procs, upstream):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = rls_quota(procs, PER_TENANT, redis.url)
    actions = [[header_action("x-tenant", "tenant")]]
    deny = native(procs, upstream, quota, filters=[ratelimit_filter(failure_mode_deny=True)], rate_limits=actions, name="deny")
    allow = native(procs, upstream, quota, filters=[ratelimit_filter(failure_mode_deny=False)], rate_limits=actions, name="allow")
    huge = {"x-tenant": "t" * 5000}
    assert harness.request(deny.port, "/", huge).status == 500
    assert harness.request(allow.port, "/", huge).status == 200
    line = "RLS call refused: descriptors[0].entries[0].value: 5000 bytes, at most 4096 (key \"tenant\")"
    deadline = time.monotonic() + 5
    while line not in quota.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert line in quota.log_text(), quota.log_tail(20)
    # A call without the secret is refused too (401 semantics: Unauthenticated).
    anonymous = native(procs, upstream, quota, filters=[ratelimit_filter(token=None)], rate_limits=actions, name="anonymous")
    assert harness.request(anonymous.port, "/", {"x-tenant": tenant()}).status == 500

    # A bad configuration file stops diana-quota at start, naming the file and the field.
    bad = procs.log_dir / "bad.yaml"
    bad.write_text("domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n")
    proc = procs.add(
        ManagedProcess(
            "bad-quota",
            [str(harness.QUOTA_BIN), "--listen", f"{HOST}:{harness.free_port()}", "--insecure-no-auth",
             "--rls-listen", f"{HOST}:{harness.free_port()}", "--rls-config", str(bad)],
            procs.log_dir / "bad-quota.log",
        )
    ).start()  # fmt: skip
    assert proc.wait_exit(10) == 1
    assert f"{bad}: descriptors[0].rate_limit.unit: invalid rate limit unit `fortnight`" in proc.log_text(), proc.log_text()


MONTHLY = """
domain: edge
descriptors:
  - key: tenant
    rate_limit: {unit: month, requests_per_unit: 3, timezone: Pacific/Auckland}
"""


def test_a_month_in_a_time_zone_is_a_calendar_month(procs, upstream):
    from test_calendar import month_bounds, seconds_to_next_month

    zone = "Pacific/Auckland"  # far from UTC: its month ends at another UTC instant
    if seconds_to_next_month(zone) < 120:
        time.sleep(seconds_to_next_month(zone) + 2)
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = rls_quota(procs, MONTHLY, redis.url, extra=("--rls-headers", "ietf"))
    gateway = native(procs, upstream, quota, filters=[ratelimit_filter()], rate_limits=[[header_action("x-tenant", "tenant")]])
    who = {"x-tenant": tenant()}
    answers = [harness.request(gateway.port, "/", who) for _ in range(4)]
    expected = seconds_to_next_month(zone)
    assert [a.status for a in answers] == [200, 200, 200, 429], [(a.status, a.headers) for a in answers]
    refused = answers[-1]
    retry = int(refused.header("retry-after"))
    assert expected - 2 <= retry <= expected + 2, (retry, expected)
    # The policy's window is this month's length in Auckland (its days, and the hour a
    # change of the clocks adds or takes), in seconds.
    _, first, following = month_bounds(zone)
    length = following.timestamp() - first.timestamp()
    window = int(refused.header("ratelimit-policy").rsplit("w=", 1)[1])
    assert window == length, (window, length)
    # The counter's Redis key lives until the month ends there (a few seconds' margin).
    keys = redis_keys(redis, "diana:{rls:*")
    assert len(keys) == 1, keys
    ttl = int(harness.redis_cli(redis.port, "ttl", keys[0]).strip())
    assert expected - 5 <= ttl <= expected + 120, (ttl, expected)
    record("rls_calendar_month", {"statuses": [a.status for a in answers], "retry_after": retry, "month_ends_in_s": round(expected), "redis_ttl_s": ttl})
