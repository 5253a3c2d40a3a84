"""nginx must never hang on a typo (issue "A new user's first hour", item 1).

With ngx_wasm_module 0.6.0, a filter whose on_configure returns false, or traps, makes every
worker exit (`exited with fatal code 2 and cannot be respawned`) while the master keeps the
port open: every request then hangs, also in locations without Diana. So on nginx the filter
keeps its workers alive and answers `on_invalid_config` (503 by default, or `allow`) at
once, with one error-level line per worker naming the cause:

- a refused document: the field and its position;
- a `wasm {}` block without a `shm_kv` zone: ngx_wasm_module traps inside every shared-data
  call (`failed getting value from shm (could not resolve namespace)`), and no host call
  tells beforehand. The filter touches no shared data in on_configure there: the first
  request or tick probes it, the trap costs that request (a 500) and the instance, and the
  instance the module makes next reads the probe's gauge (the module's metrics outlive an
  instance) and names the directive to add, with the size `diana check` prints
  (crates/diana-core/src/worker/configure.rs)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from harness import DIANA_BIN, ManagedProcess, Nginx, port_open, record, request

BAD_RPU = """\
resources:
  - Url: /
    rules:
      - name: broken
        rpu: 0
"""

# A per-device rule: its slot table makes the zone `diana check` asks for larger than 1m.
GOOD = """\
resources:
  - Url: /
    rules:
      - name: per-device
        actor: device
        rpu: 1000
        unit: second
"""

# The cause the log line must name when there is no zone: the directive, with its size.
SHM_KV = "the shm_kv directive diana check prints"


def shm_kv_directive(document: str) -> str:
    """`shm_kv diana <size>;` as `diana check` sizes it for `document`."""
    p = subprocess.run([str(DIANA_BIN), "check", "--json", "-"], input=document, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return f"shm_kv diana {json.loads(p.stdout)['nginx']['shm_kv_bytes'] >> 20}m;"



def _timed(port: int, path: str) -> tuple[object, float]:
    started = time.monotonic()
    r = request(port, path, timeout=5)
    return r.status, time.monotonic() - started


@pytest.mark.parametrize(
    "case,document,shm_size,expected,cause",
    [
        ("refused document", BAD_RPU, "16m", 503, "rules[0].rpu"),
        ("refused document, on_invalid_config: allow", "on_invalid_config: allow\n" + BAD_RPU, "16m", 200, "rules[0].rpu"),
        ("no shm_kv zone", GOOD, None, 503, SHM_KV),
        ("no shm_kv zone, on_invalid_config: allow", "on_invalid_config: allow\n" + GOOD, None, 200, SHM_KV),
    ],
)
def test_an_invalid_setup_keeps_nginx_answering(procs, upstream, case, document, shm_size, expected, cause):
    if cause == SHM_KV:
        cause = shm_kv_directive(document)
        assert cause != "shm_kv diana 1m;", "the document should need more than the smallest zone"
    nginx = procs.add(
        Nginx(procs.log_dir, diana_config=document, upstream_port=upstream.port, name="nginx-invalid",
              raw_document=True, shm_size=shm_size)
    )
    _, ready = nginx.start_expecting_failure(timeout=60)
    assert not ready, "nginx applied a configuration it should not have"
    plain, plain_s = _timed(nginx.port, "/__plain/x")
    diana, diana_s = _timed(nginx.port, "/")
    record(f"nginx {case}", f"plain location {plain} in {plain_s:.3f} s; Diana location {diana} in {diana_s:.3f} s")
    log = nginx.error_text()
    assert plain == 200, f"a location without Diana does not answer: {plain}\n{log[-3000:]}"
    assert diana == expected and diana_s < 1.0, f"{diana} after {diana_s:.3f} s\n{log[-3000:]}"
    assert "exited with fatal code" not in log and "exited on signal" not in log, log[-3000:]
    lines = [ln for ln in log.splitlines() if "[error]" in ln and "diana:" in ln]
    record(f"nginx {case}: log line", lines[:1])
    assert len(lines) == nginx.workers, log[-3000:]
    assert all(cause in ln for ln in lines), lines
    if shm_size is None:
        assert all("`shm_kv`" in ln and "could not resolve namespace" in ln for ln in lines), lines
    # The workers stay up: a second round answers the same.
    assert request(nginx.port, "/", timeout=5).status == expected
    assert request(nginx.port, "/__plain/y", timeout=5).status == 200


def test_without_a_zone_nginx_answers_from_its_first_moment(procs, upstream):
    """Without a zone, requests from the moment the workers listen, before any tick: each
    worker's first Diana request probes shared data itself and traps (nginx answers it
    500), the rest get 503 (on_invalid_config) at once; nothing hangs, no worker exits, the
    plain location answers 200 throughout."""
    nginx = procs.add(
        Nginx(procs.log_dir, diana_config=GOOD, upstream_port=upstream.port, name="nginx-no-zone-early",
              raw_document=True, shm_size=None)
    )
    ManagedProcess.start(nginx)
    deadline = time.monotonic() + 60
    # Listening, and both workers have loaded the module (on_configure follows at once).
    while not (port_open(nginx.port) and nginx.error_text().count('successfully loaded "diana"') >= nginx.workers):
        assert time.monotonic() < deadline, nginx.error_text()[-3000:]
        time.sleep(0.01)
    seen = []
    for i in range(20):
        plain, plain_s = _timed(nginx.port, f"/__plain/{i}")
        diana, diana_s = _timed(nginx.port, "/")
        assert plain == 200, f"plain location: {plain}\n{nginx.error_text()[-3000:]}"
        assert diana_s < 1.0, f"{diana} after {diana_s:.3f} s"
        seen.append(diana)
    record("nginx no shm_kv zone, requests from the first moment", seen)
    assert set(seen) <= {500, 503}, seen
    assert seen.count(500) <= nginx.workers, seen
    assert seen[-1] == 503, seen
    log = nginx.error_text()
    assert "exited with fatal code" not in log and "exited on signal" not in log, log[-3000:]
    assert len(nginx.worker_pids()) == nginx.workers
