"""nginx must never hang on a typo (issue "A new user's first hour", item 1).

With ngx_wasm_module 0.6.0, a filter whose on_configure returns false makes every worker
exit (`exited with fatal code 2 and cannot be respawned`) while the master keeps the port
open: every request then hangs, also in locations without Diana. So on nginx the filter
keeps its workers alive and answers `on_invalid_config` (503 by default, or `allow`) at
once, with one error-level line per worker naming the field and its position.

A `wasm {}` block without a `shm_kv` zone cannot be handled so: ngx_wasm_module traps
inside the first shared-data call (`failed getting value from shm (could not resolve
namespace)`, ngx_wa_shm_kv_resolve_key → a host trap, not a status), and no property
tells the filter beforehand. nginx/README.md's troubleshooting says what to add."""

from __future__ import annotations

import time

import pytest

from harness import Nginx, record, request

BAD_RPU = """\
resources:
  - Url: /
    rules:
      - name: broken
        rpu: 0
"""



def _timed(port: int, path: str) -> tuple[object, float]:
    started = time.monotonic()
    r = request(port, path, timeout=5)
    return r.status, time.monotonic() - started


@pytest.mark.parametrize(
    "case,document,shm_size,expected,cause",
    [
        ("refused document", BAD_RPU, "16m", 503, "rules[0].rpu"),
        ("refused document, on_invalid_config: allow", "on_invalid_config: allow\n" + BAD_RPU, "16m", 200, "rules[0].rpu"),
    ],
)
def test_an_invalid_setup_keeps_nginx_answering(procs, upstream, case, document, shm_size, expected, cause):
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
    assert len(lines) >= nginx.workers, log[-3000:]
    assert all(cause in ln for ln in lines[: nginx.workers]), lines
    # The workers stay up: a second round answers the same.
    assert request(nginx.port, "/", timeout=5).status == expected
    assert request(nginx.port, "/__plain/y", timeout=5).status == 200
