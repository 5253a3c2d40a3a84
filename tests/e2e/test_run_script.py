"""The README's run command: `scripts/run` (with --no-build: scripts/test has built
already) starts the demo upstream, diana-quota and Envoy with envoy/demo-diana.yaml,
answers as its banner says, and stops every child on SIGINT (Ctrl-C)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import harness
from harness import REPO, WASM, free_port, http_get, port_open, request, wait_for_fresh_minute


def test_scripts_run_serves_the_demo_policy_and_stops_on_ctrl_c(log_dir):
    assert WASM.is_file(), f"{WASM} missing: run scripts/build"
    ports = {
        "DIANA_PORT": free_port(),
        "DIANA_ADMIN_PORT": free_port(),
        "DIANA_UPSTREAM_PORT": free_port(),
        "DIANA_QUOTA_PORT": free_port(),
    }
    assert len(set(ports.values())) == 4
    env = dict(os.environ, **{k: str(v) for k, v in ports.items()}, DIANA_RUN_FOR="120", DIANA_WASM=str(WASM))
    p = subprocess.Popen(
        ["bash", "scripts/run", "--no-build"],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own session, as in a terminal
        # SIGINT at its default, as a terminal gives it: a test run started in the background
        # (`cmd &`) ignores SIGINT, a disposition children inherit, and bash cannot trap a
        # signal that was ignored when it started.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: list[str] = []
    banner = threading.Event()

    def reader() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                banner.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        assert banner.wait(120), "scripts/run did not print its banner:\n" + "".join(lines)
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
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        t.join(timeout=5)
        (log_dir / "run.out").write_text("".join(lines))
    out = "".join(lines)
    assert p.returncode == 130, out
    assert "stopping envoy" in out and "stopping upstream" in out, out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(port_open(v) for v in ports.values()):
        time.sleep(0.2)
    assert not any(port_open(v) for v in ports.values()), f"something still listens after Ctrl-C: {ports}"
