"""Actors from a claim of a token that Envoy's `jwt_authn` verified (issue #18, item 4):
`{jwt_claim: CLAIM, from: {jwt_authn: NAME}}` reads the payload jwt_authn left in the
request's dynamic metadata (`payload_in_metadata: NAME`), not the `authorization` header;
so does a plan's `by: {jwt_claim: CLAIM, from: {jwt_authn: NAME}}` (item 5).

A real Envoy runs `jwt_authn` before Diana, with a local JWKS of an RSA key made here
(the `cryptography` package: nothing is signed by hand) and `forward: false`, so the token
never reaches Diana. Rules are TB rpu 3 per hour: nothing refills during a test.

On hosts without that metadata the actor's fallback decides, and the filter says so once
in its log: nginx (no jwt_authn there; `diana check-nginx` reports such a document) and
Envoy's dynamic module (ABI v0.2.0 reads metadata one level deep: namespace and key, and
jwt_authn's payload is a Struct under its key)."""

from __future__ import annotations

import base64
import json
import struct
import time
from typing import Optional

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from harness import Envoy, errors, record, send_concurrent, statuses

RPU = 3
N = 6  # per burst, concurrent on separate connections
LIMITED = {200: RPU, 503: N - RPU}
ISSUER = "https://issuer.diana.test"
PAYLOAD = "jwt_payload"  # the provider's payload_in_metadata
KID = "diana-e2e"
NO_METADATA = "from jwt_authn's metadata (payload_in_metadata: jwt_payload), and this host has none"

DOCUMENT = f"""\
resources:
  - Url: /user
    rules: [{{name: per_user, actor: user, algo: TB, unit: hour, rpu: {RPU}}}]
  - Url: /org
    rules: [{{name: per_org, actor: org, algo: TB, unit: hour, rpu: {RPU}}}]
  - Url: /uid
    rules: [{{name: per_uid, actor: uid, algo: TB, unit: hour, rpu: {RPU}}}]
  - Url: /bearer
    rules: [{{name: per_bearer, actor: bearer, algo: TB, unit: hour, rpu: {RPU}}}]
  - Url: /tier
    rules:
      - name: per_tier
        actor: user
        algo: TB
        unit: hour
        rpu: {{by: {{jwt_claim: tier, from: {{jwt_authn: {PAYLOAD}}}}}, values: {{pro: 5}}, default: 1}}
actors:
  user: {{jwt_claim: sub, from: {{jwt_authn: {PAYLOAD}}}, fallback: shared}}
  org: {{jwt_claim: /org/id, from: {{jwt_authn: {PAYLOAD}}}, fallback: shared}}
  uid: {{jwt_claim: uid, from: {{jwt_authn: {PAYLOAD}}}, fallback: shared}}
  bearer: {{jwt_claim: sub, fallback: shared}}
"""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _uint(n: int) -> str:
    return _b64(n.to_bytes((n.bit_length() + 7) // 8, "big"))


class Issuer:
    """An RSA key, its JWKS, and RS256 tokens signed with it."""

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        numbers = self.key.public_key().public_numbers()
        self.jwks = json.dumps(
            {"keys": [{"kty": "RSA", "kid": KID, "alg": "RS256", "use": "sig", "n": _uint(numbers.n), "e": _uint(numbers.e)}]}
        )

    def token(self, claims: dict, key: Optional[rsa.RSAPrivateKey] = None) -> str:
        now = int(time.time())
        header = _b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": KID}).encode())
        payload = _b64(json.dumps({"iss": ISSUER, "iat": now, "exp": now + 3600, **claims}).encode())
        signing_input = f"{header}.{payload}".encode()
        signature = (key or self.key).sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
        return f"{header}.{payload}.{_b64(signature)}"

    def bearer(self, claims: dict, key: Optional[rsa.RSAPrivateKey] = None) -> dict:
        return {"authorization": f"Bearer {self.token(claims, key)}"}


def with_jwt_authn(envoy: Envoy, jwks: str, *, rules: Optional[list] = None, forward: bool = False) -> None:
    """Puts jwt_authn in front of Diana in `envoy`'s bootstrap: `rules` (default: every
    route requires a token of ISSUER, provider `diana_e2e`); the token is forwarded only with
    `forward` (else the `authorization` header is removed) and its payload goes to the
    metadata under PAYLOAD."""
    doc = json.loads(envoy.bootstrap_path.read_text())
    jwt_authn = {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {
                "diana_e2e": {
                    "issuer": ISSUER,
                    "local_jwks": {"inline_string": jwks},
                    "forward": forward,
                    "payload_in_metadata": PAYLOAD,
                }
            },
            "rules": rules or [{"match": {"prefix": "/"}, "requires": {"provider_name": "diana_e2e"}}],
        },
    }
    placed = 0
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            for net in chain.get("filters", []):
                filters = net.get("typed_config", {}).get("http_filters", [])
                names = [f.get("name") for f in filters]
                for diana in ("envoy.filters.http.wasm", "envoy.filters.http.dynamic_modules"):
                    if diana in names:
                        filters.insert(names.index(diana), jwt_authn)
                        placed += 1
                        break
    assert placed == 1, f"Diana's filter not found once in {envoy.bootstrap_path}"
    envoy.bootstrap_path.write_text(json.dumps(doc))


def _burst(gw, path: str, headers: Optional[dict]) -> dict:
    resps = send_concurrent(gw.port, N, path, headers)
    assert not errors(resps), errors(resps)
    return statuses(resps)


@pytest.fixture
def gateway(host, procs, upstream, start_gateway):
    """(gateway, issuer): Envoy (wasm or native) with jwt_authn in front of Diana; nginx
    as it is (no token is verified there)."""
    issuer = Issuer()
    if host == "nginx":
        return start_gateway(DOCUMENT), issuer
    envoy = Envoy(procs.log_dir, diana_config=DOCUMENT, upstream_port=upstream.port, concurrency=2,
                  name=host, native=host == "envoy-native")  # fmt: skip
    with_jwt_authn(envoy, issuer.jwks)
    procs.add(envoy)
    envoy.start()
    return envoy, issuer


def test_claims_are_read_from_the_payload_jwt_authn_verified(host, gateway):
    gw, issuer = gateway
    alice = issuer.bearer({"sub": "alice", "uid": 1001, "org": {"id": "acme"}})
    bob = issuer.bearer({"sub": "bob", "uid": 1002, "org": {"id": "acme"}})
    carol = {"sub": "carol", "uid": 1003, "org": {"id": "globex"}}
    dave = issuer.bearer({"sub": "dave"})  # no org, no uid

    if host == "nginx":
        # No jwt_authn: no metadata; every request takes the fallback (shared), and the
        # filter says why, once per worker.
        users = [_burst(gw, "/user", h) for h in (alice, bob)]
        record(f"{host}: jwt_claim from jwt_authn metadata", f"alice then bob (shared fallback) {users}")
        assert users == [LIMITED, {503: N}]
        assert NO_METADATA in gw.error_text()
        return

    # A token signed by another key (same kid, same claims as carol's): jwt_authn answers
    # 401, and Diana never counts it.
    forged = send_concurrent(gw.port, N, "/user", issuer.bearer(carol, key=rsa.generate_private_key(65537, 2048)))
    no_token = send_concurrent(gw.port, N, "/user", None)
    assert not errors(forged + no_token), errors(forged + no_token)
    assert statuses(forged) == {401: N}, statuses(forged)
    assert statuses(no_token) == {401: N}, statuses(no_token)

    by_user = {name: _burst(gw, "/user", h) for name, h in
               (("alice", alice), ("bob", bob), ("carol", issuer.bearer(carol)))}  # fmt: skip
    alice_again = _burst(gw, "/user", alice)
    # A nested claim (/org/id): alice and bob are one organisation; dave has none (shared).
    by_org = [_burst(gw, "/org", h) for h in (alice, bob, dave)]
    # A number (uid): alice and bob are two.
    by_uid = [_burst(gw, "/uid", h) for h in (alice, bob)]
    # What Envoy hands over (serializeValue): a string's bytes, a number's 8 bytes little
    # endian (a double). So the number whose 8 bytes spell "abcdefgh" and the string
    # "abcdefgh" are one identity: the documented price of an untyped value.
    spelled = struct.unpack("<d", b"abcdefgh")[0]
    by_bytes = [_burst(gw, "/uid", issuer.bearer({"sub": "eve", "uid": uid})) for uid in (spelled, "abcdefgh")]
    # forward: false: the `authorization` header is gone before Diana, so an actor that
    # reads the bearer token finds none, and everyone shares its fallback counter.
    by_bearer = [_burst(gw, "/bearer", h) for h in (alice, bob)]
    record(
        f"{host}: jwt_claim from jwt_authn metadata",
        f"forged 401 x{N}, users {by_user}, alice again {alice_again}, orgs {by_org}, uids {by_uid}, "
        f"uid {spelled!r} then 'abcdefgh' {by_bytes}, bearer header (stripped) {by_bearer}",
    )
    if host == "envoy-native":
        # ABI v0.2.0 cannot reach the payload's claims: every request takes the fallback
        # (shared), and the module says why in Envoy's log.
        assert list(by_user.values()) == [LIMITED, {503: N}, {503: N}]
        assert NO_METADATA in gw.log_text()
        return
    # Two users counted apart by `sub` from the metadata; carol has her whole budget: the
    # forged tokens were never counted.
    assert by_user == {"alice": LIMITED, "bob": LIMITED, "carol": LIMITED}
    assert alice_again == {503: N}
    assert by_org == [LIMITED, {503: N}, LIMITED]
    assert by_uid == [LIMITED, LIMITED]
    assert by_bytes == [LIMITED, {503: N}]
    assert by_bearer == [LIMITED, {503: N}]
    assert NO_METADATA not in gw.log_text()


def test_a_plan_is_read_from_the_payload_jwt_authn_verified(host, gateway):
    gw, issuer = gateway
    pro = issuer.bearer({"sub": "pat", "tier": "pro"})
    untiered = issuer.bearer({"sub": "sam"})
    tiers = [_burst(gw, "/tier", h) for h in (pro, untiered)]
    record(f"{host}: plan from jwt_authn metadata (pro 5, default 1)", f"pro then none {tiers}")
    if host == "envoy":
        assert tiers == [{200: 5, 503: 1}, {200: 1, 503: 5}]
    else:
        # No metadata: the actor's fallback (shared) and the default plan for everyone.
        assert tiers == [{200: 1, 503: 5}, {503: N}]
