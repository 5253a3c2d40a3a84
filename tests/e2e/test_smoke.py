"""The harness itself, on an Envoy without the Diana filter: processes, readiness,
request spreading over workers, raw paths and header bytes, wrk flood, RSS, stats."""

from __future__ import annotations

import json
import subprocess

import harness
from harness import (
    DIANA_BIN,
    REPO,
    WASM,
    envoy_binary,
    request,
    send_concurrent,
    statuses,
    wrk_flood,
)


def test_plain_envoy_forwards_and_spreads_connections(start_envoy, upstream):
    envoy = start_envoy(None)
    resps = send_concurrent(envoy.port, 40, "/hello", {"x-device-id": "dev-1"})
    assert statuses(resps) == {200: 40}, [r.error for r in resps if r.error]
    body = json.loads(resps[0].body)
    assert body["path"] == "/hello"
    assert body["x-device-id"] == "dev-1"
    per_worker = envoy.worker_connections()
    busy = [k for k, v in per_worker.items() if v > 0]
    print("connections per worker:", per_worker)
    assert len(per_worker) == 4, per_worker
    assert len(busy) >= 2, f"connections were not spread over workers: {per_worker}"


def test_raw_paths_and_header_bytes_reach_upstream_unchanged(start_envoy):
    envoy = start_envoy(None)
    for raw in ["//sample", "/sample/./x", "/x/../sample", "/%73ample", "/sample?q=1"]:
        r = request(envoy.port, raw)
        assert r.status == 200, (raw, r)
        assert json.loads(r.body)["path"] == raw
    r = request(envoy.port, "/", {"x-device-id": b"\xff\xfe", "x-account-id": b""})
    assert r.status == 200, r
    r = request(envoy.port, "/", {"x-device-id": "a" * 16384})
    assert r.status == 200, r


def test_wrk_flood_and_rss(start_envoy, log_dir):
    envoy = start_envoy(None, direct_response=(200, "ok\n"), upstream_port=None)
    before = envoy.rss()
    res = wrk_flood(envoy.port, 4000, prefix="smoke", work_dir=log_dir, max_seconds=30)
    after = envoy.rss()
    print(f"wrk: {res.requests} requests in {res.seconds:.1f}s; RSS {before >> 20} -> {after >> 20} MiB")
    assert 4000 <= res.requests <= 4000 + 64, res.output
    assert res.non_2xx == 0 and res.socket_errors == 0, res.output
    stats = envoy.stats(r"^http\.ingress\.downstream_rq_total$")
    assert stats["http.ingress.downstream_rq_total"] >= 4000


def test_example_bootstrap_is_valid(log_dir):
    """envoy/envoy.yaml (the documented deployable example) passes `envoy --mode validate`,
    as written, from a directory where its target/wasm32-wasip1/release/diana-envoy.wasm is
    the module under test (harness.documented_tree)."""
    assert WASM.is_file(), f"{WASM} missing: run scripts/build"
    p = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", "envoy/envoy.yaml", "--disable-hot-restart"],
        cwd=harness.documented_tree(log_dir / "tree"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def test_demo_config_is_valid(log_dir):
    """envoy/demo-diana.yaml (what scripts/run loads), rendered like scripts/run does,
    passes `envoy --mode validate` (which loads the filter and runs its on_configure)."""
    assert WASM.is_file(), f"{WASM} missing: run scripts/build"
    out = log_dir / "demo.json"
    subprocess.run(
        [str(DIANA_BIN), "render-envoy", "--listen-port", "10000", "--admin-port", "9901",
         "--upstream-port", "18080", "--quota-port", "18081", "--diana-config", "envoy/demo-diana.yaml",
         "--wasm", str(WASM), "--normalize-path", "--json", "--out", str(out)],
        cwd=REPO, check=True, timeout=60,
    )  # fmt: skip
    p = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
