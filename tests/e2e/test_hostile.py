"""Hostile input never crashes the filter (DESIGN §1: header values are bytes; §6: no
reachable panic). A panic would kill the worker's VM and every later request on that
worker would fail, so each hostile request is followed by a normal one on the same
keep-alive connection (same worker), and by a spread of fresh connections."""

from __future__ import annotations

import pytest

from harness import KeepAlive, errors, request, send_concurrent, statuses

CONFIG = """\
resources:
  - Url: /
    rules:
      - {name: by_device, actor: device, unit: minute, rpu: 1000}
      - {name: by_account, actor: account, unit: minute, rpu: 1000}
      - {name: by_tenant, actor: tenant, unit: minute, rpu: 1000}
  - Url: /sample
    rules:
      - {name: sample_by_device, actor: device, algo: SW, unit: minute, rpu: 1000}
actors:
  tenant: {header: x-tenant-id, fallback: shared}
"""

HOSTILE_VALUES = {
    "non-utf8": b"\xff\xfe",
    "latin1": b"caf\xe9",
    "16KiB": b"d" * 16384,
    "empty": b"",
    "spaces": b"   ",
    "nul-like": b"%00",
    "utf8": "устройство".encode(),
}

HOSTILE_PATHS = ["/%ff%fe", "/%", "/%zz", "/..", "/../../..", "/sample/%2e%2e/%2e%2e", "//" * 200, "/" + "a" * 8000,
                 "/sample;x=1", "/sample%00", "/?" + "q" * 4000]  # fmt: skip

PANIC_MARKERS = ("panicked", "Function: proxy_on_", "RuntimeError", "Wasm VM failed")


def _assert_no_crash_in_log(gw):
    bad = [ln for ln in gw.log_text().splitlines() if any(m in ln for m in PANIC_MARKERS)]
    bad += gw.crash_lines()
    assert not bad, "filter crashed:\n" + "\n".join(bad[:20])


def _assert_answered(r, what):
    assert r.error is None, (what, r.error)
    assert r.status is not None and r.status != 500, (what, r)
    if r.status == 503:
        assert r.body == b"rate limited\n", (what, r)


@pytest.fixture
def gw(shared_gateway):
    # One gateway per host for the module: every test checks that it still answers and
    # that nothing crashed; their requests stay far below the limits (1,000 a minute).
    return shared_gateway(CONFIG)


@pytest.mark.parametrize("header", ["x-device-id", "x-account-id", "x-tenant-id"])
def test_hostile_header_values(gw, header):
    for name, value in HOSTILE_VALUES.items():
        with KeepAlive(gw.port) as ka:
            r = ka.send("/sample", {header: value})
            _assert_answered(r, f"{header}={name}")
            assert r.status == 200, (name, r)
            follow = ka.send("/", {"x-device-id": "normal"})
            assert follow.status == 200, f"worker broken after {header}={name}: {follow}"
    resps = send_concurrent(gw.port, 16, "/", lambda i: {"x-device-id": f"after-{i}"})
    assert statuses(resps) == {200: 16}, errors(resps)
    _assert_no_crash_in_log(gw)


def test_hostile_repeated_headers(gw):
    with KeepAlive(gw.port) as ka:
        ka.conn.putrequest("GET", "/", skip_accept_encoding=True)
        for v in (b"a", b"\xff", b"", b"b" * 1000):
            ka.conn.putheader("x-device-id", v)
            ka.conn.putheader("x-account-id", v)
        ka.conn.endheaders()
        r = ka.conn.getresponse()
        r.read()
        assert r.status == 200, r.status
        assert ka.send("/").status == 200
    _assert_no_crash_in_log(gw)


def test_hostile_paths(gw):
    for p in HOSTILE_PATHS:
        with KeepAlive(gw.port) as ka:
            r = ka.send(p, {"x-device-id": "paths"})
            _assert_answered(r, p[:40])
            # The proxy may close the connection after a 4xx of its own; use a new one then
            follow = request(gw.port, "/", {"x-device-id": "normal"})
            assert follow.status == 200, f"broken after path {p[:40]!r}: {follow}"
    resps = send_concurrent(gw.port, 16, "/sample")
    assert statuses(resps) == {200: 16}, errors(resps)
    _assert_no_crash_in_log(gw)
