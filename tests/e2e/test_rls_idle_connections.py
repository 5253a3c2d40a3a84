"""Issue 41, item 4: the gateways' pooled connections to diana-quota keep working now that
diana-quota closes idle connections (an HTTP/1 connection with no request head within
`--header-timeout-ms`, 10 s by default, is closed: that is what bounds a stranger's slow
connections).

Measured with a real Envoy 1.40 and `diana render-envoy`'s own `diana_quota` cluster (the
one every bootstrap of the repository carries: `idle_timeout: 5s`), every request routed
through that cluster as the filter's callouts are:

- calls 4 s apart reuse one connection;
- left idle, Envoy closes its connection itself (5 s), before diana-quota would (10 s): the
  service closes none, so no callout is ever sent on a connection being closed;
- the control: the same cluster with Envoy's default idle timeout (an hour) sees
  diana-quota close the idle connection under it (Envoy counts it `destroy_remote`), the
  race the setting avoids."""

from __future__ import annotations

import json
import re
import time
import urllib.parse
from pathlib import Path
from typing import Optional

import harness
from harness import ManagedProcess, Quota, record

QUOTA_CLUSTER = "diana_quota"


class QuotaEnvoy(ManagedProcess):
    """Envoy rendered by `diana render-envoy` with a `diana_quota` cluster, its route sent
    to that cluster (so a request to Envoy is a call to diana-quota over the pooled
    connections of the filter's cluster). `idle_timeout`: None keeps the rendered one."""

    def __init__(self, log_dir: Path, quota_port: int, *, name: str, idle_timeout: Optional[str] = None) -> None:
        self.port = harness.free_port()
        self.admin_port = harness.free_port()
        bootstrap = json.loads(
            harness.render_envoy_json(
                listen_port=self.port, admin_port=self.admin_port, upstream_port=quota_port, quota_port=quota_port
            )
        )
        clusters = bootstrap["static_resources"]["clusters"]
        quota = next(c for c in clusters if c["name"] == QUOTA_CLUSTER)
        self.rendered_idle = quota["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        ]["common_http_protocol_options"]["idle_timeout"]
        if idle_timeout is not None:
            quota["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
                "common_http_protocol_options"
            ]["idle_timeout"] = idle_timeout
        manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        for host in manager["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                route["route"]["cluster"] = QUOTA_CLUSTER
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / f"{name}.json"
        path.write_text(json.dumps(bootstrap, indent=1))
        argv = [harness.envoy_binary(), "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "--log-level", "info"]
        super().__init__(name, argv, log_dir / f"{name}.log")

    def start(self, timeout: float = 60.0) -> "QuotaEnvoy":  # type: ignore[override]
        super().start()
        self.wait_ready(lambda: harness.http_get(self.admin_port, "/ready", timeout=1.0)[0] == 200, timeout, "ready")
        return self

    def cluster_counter(self, name: str) -> int:
        status, body, _ = harness.http_get(
            self.admin_port, "/stats?filter=" + urllib.parse.quote(rf"^cluster\.{QUOTA_CLUSTER}\.{name}$", safe=""), timeout=5.0
        )
        assert status == 200
        match = re.search(r": (\d+)$", body.decode().strip())
        return int(match.group(1)) if match else 0

    def call(self) -> int:
        return harness.request(self.port, "/healthz", timeout=10).status


def closed_by_quota(quota: Quota) -> int:
    """HTTP connections diana-quota closed for want of a request head (its metric)."""
    status, body, _ = harness.http_get(quota.port, "/metrics", timeout=5.0)
    assert status == 200
    found = re.search(r'diana_quota_connections_closed_total\{port="http",reason="header"\} (\d+)', body.decode())
    assert found, "no diana_quota_connections_closed_total in /metrics"
    return int(found.group(1))


def test_envoy_closes_its_idle_pooled_connections_before_diana_quota_does(procs):
    quota = procs.add(Quota(procs.log_dir)).start()  # the defaults: --header-timeout-ms 10000
    envoy = procs.add(QuotaEnvoy(procs.log_dir, quota.port, name="rendered")).start()
    assert envoy.rendered_idle == "5s"

    # Calls 4 s apart: one pooled connection, reused.
    answers = []
    for _ in range(4):
        answers.append(envoy.call())
        time.sleep(4)
    assert answers == [200] * 4, answers
    reused = envoy.cluster_counter("upstream_cx_total")
    assert reused == 1, f"{reused} connections for 4 calls 4 s apart"

    # Idle: Envoy closes it at 5 s; at 12 s diana-quota (10 s) has closed nothing.
    time.sleep(8)
    idle_closed = envoy.cluster_counter("upstream_cx_idle_timeout")
    remote_closed = envoy.cluster_counter("upstream_cx_destroy_remote")
    by_quota = closed_by_quota(quota)
    assert envoy.call() == 200
    print(f"rendered cluster (idle 5 s) vs diana-quota (10 s): Envoy idle-closed {idle_closed}, remote-closed {remote_closed}, diana-quota closed {by_quota}")
    assert (idle_closed, remote_closed, by_quota) == (1, 0, 0)

    # The control: Envoy's default idle timeout (an hour). diana-quota closes the idle
    # connection under it at 10 s.
    control = procs.add(QuotaEnvoy(procs.log_dir, quota.port, name="control", idle_timeout="3600s")).start()
    assert control.call() == 200
    time.sleep(12)
    control_remote = control.cluster_counter("upstream_cx_destroy_remote")
    control_by_quota = closed_by_quota(quota) - by_quota
    print(f"control (idle 1 h): Envoy remote-closed {control_remote}, diana-quota closed {control_by_quota}")
    assert (control_remote, control_by_quota) == (1, 1)
    record(
        "rls_pooled_connections_idle",
        {
            "rendered_idle_s": 5,
            "service_header_timeout_s": 10,
            "rendered": {"envoy_idle_closed": idle_closed, "closed_under_envoy": remote_closed},
            "control_idle_1h": {"closed_under_envoy": control_remote},
        },
    )
