"""The two builds of the filter: diana-envoy.wasm (what Envoy and Istio load; the proxy-wasm
callbacks Diana does not implement are trimmed away, so Envoy never enters the VM for them)
and diana.wasm (cargo's output with every SDK callback, for ngx_wasm_module hosts, which
call some callbacks without checking they exist). Both must limit the same way."""

from __future__ import annotations

import subprocess

import pytest

from harness import NGINX_WASM, TRIM_BIN, WASM, request

UNTRIMMED = NGINX_WASM  # cargo's output, which scripts/build trims into WASM
TRIM = TRIM_BIN

# What crates/diana-trim keeps (KEPT_CALLBACKS) and what the SDK exports besides callbacks.
KEPT = {
    "proxy_on_context_create", "proxy_on_delete", "proxy_on_vm_start", "proxy_on_configure",
    "proxy_on_tick", "proxy_on_request_headers", "proxy_on_response_headers",
    "proxy_on_http_call_response", "proxy_on_memory_allocate",
}  # fmt: skip
NOT_CALLED_PER_REQUEST_ANY_MORE = {"proxy_on_log", "proxy_on_done", "proxy_on_response_body", "proxy_on_request_body"}
# What diana-trim --bodies keeps besides (BODY_CALLBACKS): the module for documents that read
# usage from answers' bodies.
BODIES = WASM.with_name("diana-envoy-bodies.wasm")
BODY_CALLBACKS = {"proxy_on_response_body", "proxy_on_response_trailers"}


def exports(wasm) -> set[str]:
    assert TRIM.is_file(), f"{TRIM} missing: run scripts/build"
    p = subprocess.run([str(TRIM), "--list", str(wasm)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return set(p.stdout.split())


def test_the_envoy_module_exports_only_the_callbacks_diana_implements():
    trimmed, full = exports(WASM), exports(UNTRIMMED)
    callbacks = {name for name in trimmed if name.startswith("proxy_on_")}
    assert callbacks == KEPT, f"unexpected callback set: {sorted(callbacks ^ KEPT)}"
    assert NOT_CALLED_PER_REQUEST_ANY_MORE <= full, "cargo's build should have every SDK callback"
    assert not NOT_CALLED_PER_REQUEST_ANY_MORE & trimmed
    # Nothing but callbacks went: memory, the allocator, the ABI marker stay.
    assert {n for n in full if not n.startswith("proxy_on_")} == {n for n in trimmed if not n.startswith("proxy_on_")}
    assert WASM.stat().st_size < UNTRIMMED.stat().st_size


def test_the_module_for_answers_adds_only_the_answer_body_callbacks():
    bodies = exports(BODIES)
    callbacks = {name for name in bodies if name.startswith("proxy_on_")}
    assert callbacks == KEPT | BODY_CALLBACKS, f"unexpected callback set: {sorted(callbacks ^ (KEPT | BODY_CALLBACKS))}"
    assert not {"proxy_on_request_body", "proxy_on_log", "proxy_on_done"} & bodies


@pytest.mark.parametrize("module", ["diana-envoy.wasm", "diana.wasm"])
def test_both_modules_limit_the_same_way(start_envoy, module):
    wasm = WASM if module == "diana-envoy.wasm" else UNTRIMMED
    envoy = start_envoy(
        """\
resources:
  - Url: /
    rules:
      - {name: three_per_hour, unit: hour, rpu: 3}
response:
  headers: all
""",
        wasm=wasm,
    )
    seen = [request(envoy.port, "/") for _ in range(5)]
    assert [r.status for r in seen] == [200, 200, 200, 503, 503]
    # Response headers on admitted answers: the response-headers callback ran.
    assert [r.header("x-ratelimit-remaining") for r in seen[:3]] == ["2", "1", "0"]
