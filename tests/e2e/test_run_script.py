"""The README's run command: `scripts/run` (with --no-build: scripts/test has built
already) starts the demo upstream, diana-quota and Envoy with envoy/demo-diana.yaml,
answers as its banner says, and stops every child on SIGINT (Ctrl-C)."""

from __future__ import annotations

import time

import harness
from harness import free_port, http_get, port_open, request, scripts_run, wait_for_fresh_minute


def test_scripts_run_serves_the_demo_policy_and_stops_on_ctrl_c(log_dir):
    ports = {
        "DIANA_PORT": free_port(),
        "DIANA_ADMIN_PORT": free_port(),
        "DIANA_UPSTREAM_PORT": free_port(),
        "DIANA_QUOTA_PORT": free_port(),
    }
    assert len(set(ports.values())) == 4
    env = {**{k: str(v) for k, v in ports.items()}, "DIANA_RUN_FOR": "120"}
    with scripts_run(log_dir, env) as run:
        gw = ports["DIANA_PORT"]
        assert request(gw, "/").status == 200
        wait_for_fresh_minute(5)  # the /sample rule is a fixed window on the epoch minute
        codes = [request(gw, "/sample", {"x-device-id": "phone-1"}).status for _ in range(7)]
        assert codes == [200] * 5 + [503] * 2, codes  # sample_device: 5 per minute per device
        # llm_tokens: 1 token up front, then the answer's x-llm-tokens (900), in debt after two.
        llm = [request(gw, "/llm?tokens=900", {"x-account-id": "alice"}).status for _ in range(3)]
        assert llm == [200, 200, 503], llm
        assert request(gw, "/llm?tokens=900", {"x-account-id": "bob"}).status == 200
        # sample_global went through the quota service that scripts/run started (Diana's
        # counters reach Envoy's stats from the workers' ticks: wait for one).
        time.sleep(harness.METRICS_LAG_S)
        status, body, _ = http_get(ports["DIANA_ADMIN_PORT"], "/stats?filter=diana_global")
        stats = dict(line.rsplit(": ", 1) for line in body.decode().splitlines() if ": " in line)
        assert int(stats["wasmcustom.diana_global_callouts"]) >= 5, stats
        assert int(stats["wasmcustom.diana_global_errors"]) == 0, stats
    p, out = run.process, run.output
    assert p.returncode == 130, out
    assert "stopping envoy" in out and "stopping upstream" in out, out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(port_open(v) for v in ports.values()):
        time.sleep(0.2)
    assert not any(port_open(v) for v in ports.values()), f"something still listens after Ctrl-C: {ports}"
