"""nginx/nginx.conf, the documented example, runs as written: only the module path, the
ports and the log directory are substituted. It loads Diana in every worker, limits
`/` per device through diana-quota, answers its metrics path, and turns the leaky bucket
of `/sample` into `Retry-After` rejections (nginx cannot hold a request)."""

from __future__ import annotations

import time

import harness

from harness import (
    METRICS_LAG_S,
    NGINX_CRASH,
    NGINX_WASM,
    REPO,
    ManagedProcess,
    Quota,
    free_port,
    nginx_binary,
    parse_prometheus,
    port_open,
    record,
    request,
    send_concurrent,
    statuses,
)


def test_the_example_nginx_conf_runs_as_written(procs, upstream):
    quota = procs.add(Quota(procs.log_dir)).start()
    port = free_port()
    prefix = procs.log_dir / "nginx-example"
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    text = (REPO / "nginx/nginx.conf").read_text()
    for old, new in [
        ("/opt/diana/diana.wasm", str(NGINX_WASM)),
        ("listen 8000 reuseport;", f"listen 127.0.0.1:{port} reuseport;"),
        ("server 127.0.0.1:8080;", f"server 127.0.0.1:{upstream.port};"),
        ('"cluster":"127.0.0.1:8081"', f'"cluster":"127.0.0.1:{quota.port}"'),
        ("worker_processes  auto;", "worker_processes  2;"),
    ]:
        assert old in text, f"nginx/nginx.conf no longer has {old!r}"
        text = text.replace(old, new)
    conf = prefix / "nginx.conf"
    conf.write_text("daemon off;\npid logs/nginx.pid;\n" + text)
    nginx = procs.add(
        ManagedProcess(
            "nginx-example",
            [nginx_binary(), "-p", str(prefix), "-c", str(conf)],
            procs.log_dir / "nginx-example.log",
            # the credential, as nginx.conf's `env DIANA_QUOTA_TOKEN;` expects it
            env=harness.gateway_env(harness.QUOTA_TOKEN),
        )
    ).start()
    error_log = prefix / "logs/error.log"

    def ready() -> bool:
        return port_open(port) and error_log.read_text().count("local configuration applied") >= 4

    nginx.wait_ready(ready, 60, "every worker configured (two locations, two workers)")
    # `/`: per_device, 10 per second, global through diana-quota.
    resps = send_concurrent(port, 14, "/", {"x-device-id": "example"})
    st = statuses(resps)
    # `/sample`: a leaky bucket of 5 per second: one passes, the next is told to retry.
    sample = [request(port, "/sample").status for _ in range(2)]
    metrics_status, body = None, b""
    time.sleep(METRICS_LAG_S)  # the other worker hands its counts over from its tick
    r = request(port, "/diana/metrics")
    metrics_status, body = r.status, r.body
    metrics = parse_prometheus(body.decode())
    time.sleep(0.2)
    crashes = [line for line in error_log.read_text().splitlines() if NGINX_CRASH.search(line)]
    record("nginx: the example nginx.conf", f"/ x14 from one device {st}; /sample x2 {sample}; metrics {metrics_status}")
    assert crashes == [], crashes
    assert st == {200: 10, 429: 4}, st
    assert sample == [200, 429], sample
    assert metrics_status == 200, body[:200]
    assert metrics.get("diana_rule_allowed.per_device") == 11, metrics
    assert metrics.get("diana_global_callouts", 0) >= 10, metrics
