"""Every actor kind keeps separate counters per identity (DESIGN §3 actors, §4 actor key).
Rules are TB rpu 3 per hour: nothing refills during a test."""

from __future__ import annotations

import base64
from typing import Optional

from harness import errors, record, send_concurrent, statuses

RPU = 3
N = 6  # per identity, concurrent on separate connections


def _config(actor: str, extra: str = "") -> str:
    return f"""\
resources:
  - Url: /
    rules:
      - name: per_{actor}
        actor: {actor}
        algo: TB
        unit: hour
        rpu: {RPU}
{extra}"""


def _burst(gw, headers: Optional[dict], source: Optional[str] = None) -> dict:
    resps = send_concurrent(gw.port, N, "/", headers, source_address=source)
    assert not errors(resps), errors(resps)
    return statuses(resps)


LIMITED = {200: RPU, 503: N - RPU}


def test_actor_all_is_one_counter(start_gateway):
    gw = start_gateway(_config("all"))
    resps = send_concurrent(
        gw.port, 12, "/", lambda i: {"x-device-id": f"d{i}", "x-account-id": f"a{i}", "x-tenant-id": f"t{i}"}
    )
    assert not errors(resps)
    assert statuses(resps) == {200: RPU, 503: 12 - RPU}


def test_actor_account_separate_counters_and_skip_without_header(start_gateway):
    gw = start_gateway(_config("account"))
    a = _burst(gw, {"x-account-id": "alice"})
    b = _burst(gw, {"x-account-id": "bob", "x-device-id": "same-device"})
    anonymous = _burst(gw, None)
    anonymous2 = _burst(gw, {"x-device-id": "same-device"})
    record(f"{gw.label}: actor account", f"alice {a}, bob {b}, no header {anonymous} + {anonymous2}")
    assert a == LIMITED
    assert b == LIMITED
    # default fallback for account is `skip`: the rule does not apply
    assert anonymous == {200: N}
    assert anonymous2 == {200: N}


def test_actor_device_separate_counters_and_ip_fallback(start_gateway):
    gw = start_gateway(_config("device"))
    d1 = _burst(gw, {"x-device-id": "phone-1"})
    d2 = _burst(gw, {"x-device-id": "phone-2", "x-account-id": "alice"})
    no_header = _burst(gw, {"x-account-id": "carol"})
    no_header_again = _burst(gw, None)
    record(f"{gw.label}: actor device", f"phone-1 {d1}, phone-2 {d2}, no header (ip fallback) {no_header} then {no_header_again}")
    assert d1 == LIMITED
    assert d2 == LIMITED
    # default fallback for device is the client address: one counter for 127.0.0.1
    assert no_header == LIMITED
    assert no_header_again == {503: N}


def test_actor_ip_uses_client_address(start_gateway):
    gw = start_gateway(_config("ip"))
    # two loopback source addresses are two clients
    ip2 = send_concurrent(gw.port, N, "/", lambda i: {"x-device-id": f"d{i}"}, source_address="127.0.0.2")
    ip3 = send_concurrent(gw.port, N, "/", lambda i: {"x-device-id": f"d{i}"}, source_address="127.0.0.3")
    assert not errors(ip2 + ip3), errors(ip2 + ip3)
    s2, s3 = statuses(ip2), statuses(ip3)
    again2 = _burst(gw, {"x-device-id": "other"}, source="127.0.0.2")
    record(f"{gw.label}: actor ip", f"127.0.0.2 {s2}, 127.0.0.3 {s3}, 127.0.0.2 again {again2}")
    assert s2 == LIMITED
    assert s3 == LIMITED
    assert again2 == {503: N}


def test_user_defined_actor_with_shared_fallback(start_gateway):
    gw = start_gateway(
        _config(
            "tenant",
            extra="actors:\n  tenant: {header: x-tenant-id, fallback: shared}\n",
        )
    )
    t1 = _burst(gw, {"x-tenant-id": "acme"})
    t2 = _burst(gw, {"x-tenant-id": "globex", "x-device-id": "phone-1"})
    shared = _burst(gw, {"x-device-id": "phone-9"})
    shared_again = _burst(gw, {"x-account-id": "alice"})
    record(f"{gw.label}: actor tenant (user-defined)", f"acme {t1}, globex {t2}, no header (shared) {shared} then {shared_again}")
    assert t1 == LIMITED
    assert t2 == LIMITED
    assert shared == LIMITED
    assert shared_again == {503: N}


def _bearer(payload: str, signature: str = "c2ln") -> dict:
    """An `authorization` header with a JWT whose payload is `payload` (not signed: Diana
    reads claims, a filter before it verifies them)."""
    def b64(raw: str) -> str:
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    header = b64('{"alg":"RS256"}')
    return {"authorization": f"Bearer {header}.{b64(payload)}.{signature}"}


def test_actor_from_a_jwt_claim_counts_by_the_claim(start_gateway):
    gw = start_gateway(
        _config(
            "user",
            extra="actors:\n  user: {jwt_claim: /org/id, fallback: shared}\n",
        )
    )
    # Two tokens of one organisation (other subjects, other signatures): one counter.
    acme = _burst(gw, _bearer('{"sub":"alice","org":{"id":"acme"}}'))
    acme_again = _burst(gw, _bearer('{"sub":"bob","org":{"id":"acme"}}', signature="b3RoZXI"))
    globex = _burst(gw, _bearer('{"sub":"carol","org":{"id":"globex"}}'))
    # The claim's text as a header, another scheme, a malformed token, no such claim: the
    # shared fallback, none of them on acme's counter.
    no_claim = _burst(gw, {"x-device-id": "acme", **_bearer('{"sub":"dave"}')})
    no_claim_again = _burst(gw, {"authorization": "Bearer not.a-jwt"})
    record(
        f"{gw.label}: actor from a JWT claim (/org/id)",
        f"acme {acme} then {acme_again}, globex {globex}, no claim (shared) {no_claim} then {no_claim_again}",
    )
    assert acme == LIMITED
    assert acme_again == {503: N}
    assert globex == LIMITED
    assert no_claim == LIMITED
    assert no_claim_again == {503: N}
