"""Forged claims past jwt_authn (issue 41, item 3), on a real Envoy with `jwt_authn` in front
of Diana, whose actor reads `sub` from the `authorization` header (the form the attack
needs: jwt_authn forwards the token, Diana reads it unverified).

(a) Paths. jwt_authn requires a token on `/api` only. With Envoy's default path handling
`//api/x`, `/%61pi/x`, `/./api/x` and `/x/../api/x` do not match that rule, so a forged token
(signed by another key, `sub: victim`) passes unverified, while Diana normalises each to
`/api/x` and counts it as the victim: the first three spend the victim's budget of 3 (Diana
refuses the fourth, and then the victim). Every
bootstrap the repository ships (envoy/envoy.yaml, envoy/native.yaml, docker/envoy.yaml,
`diana render-envoy`'s output) carries `normalize_path`, `merge_slashes` and
`path_with_escaped_slashes_action`; with those, each spelling reaches jwt_authn as `/api/x`
and is refused 401, and the victim keeps its budget.

(b) The scheme. On `/opt` the token is optional (`allow_missing`): jwt_authn finds no token
in `authorization: bearer <forged>` (it looks for `Bearer ` as written) and lets the request
through unchecked. Diana reads that header as jwt_authn does, so it finds no claim either
(the fallback), and the victim keeps its budget; Diana also warns at load that the
document reads a claim from the header."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import rsa

from harness import DIANA_BIN, REPO, Envoy, errors, record, request
from test_jwt_metadata import Issuer, with_jwt_authn

RPU = 3
SPELLINGS = ["//api/x", "/%61pi/x", "/./api/x", "/x/../api/x"]
PATH_SETTINGS = ("normalize_path", "merge_slashes", "path_with_escaped_slashes_action")
SHIPPED = ["envoy/envoy.yaml", "envoy/native.yaml", "docker/envoy.yaml"]
WARNING = "actor `user` read a claim from the authorization header"

DOCUMENT = f"""\
resources:
  - Url: /api
    rules: [{{name: per_user, actor: user, algo: TB, unit: hour, rpu: {RPU}}}]
  - Url: /opt
    rules: [{{name: per_user_opt, actor: user, algo: TB, unit: hour, rpu: {RPU}}}]
actors:
  user: {{jwt_claim: sub, fallback: shared}}
"""

RULES = [
    {"match": {"prefix": "/api"}, "requires": {"provider_name": "diana_e2e"}},
    {"match": {"prefix": "/opt"}, "requires": {"requires_any": {"requirements": [
        {"provider_name": "diana_e2e"}, {"allow_missing": {}}]}}},
]  # fmt: skip


def _connection_managers(doc: dict) -> list[dict]:
    return [
        f["typed_config"]
        for listener in doc["static_resources"]["listeners"]
        for chain in listener.get("filter_chains", [])
        for f in chain.get("filters", [])
        if f.get("name") == "envoy.filters.network.http_connection_manager"
    ]


def path_settings(doc: dict) -> dict:
    """The path settings of a bootstrap's one connection manager."""
    (hcm,) = _connection_managers(doc)
    return {key: hcm[key] for key in PATH_SETTINGS if key in hcm}


def rendered() -> dict:
    """What `diana render-envoy` renders by default (no document needed for the listener)."""
    out = subprocess.run([str(DIANA_BIN), "render-envoy", "--json", "--no-filter"], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    return json.loads(out.stdout)


SETTINGS = {"normalize_path": True, "merge_slashes": True, "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT"}


def test_every_shipped_bootstrap_sees_one_path():
    """Each bootstrap the repository ships, and render-envoy's default, normalise the path
    for every filter (jwt_authn's rules included), as the README says."""
    found = {name: path_settings(yaml.safe_load((REPO / name).read_text())) for name in SHIPPED}
    found["render-envoy"] = path_settings(rendered())
    record("shipped bootstraps' path settings", found)
    assert found == {name: SETTINGS for name in found}


@pytest.mark.parametrize("paths", ["envoy-defaults", "shipped"])
@pytest.mark.parametrize("host", ["envoy", "envoy-native"])
def test_forged_claims_do_not_pass_jwt_authn(host, paths, procs, upstream):
    issuer = Issuer()
    envoy = Envoy(procs.log_dir, diana_config=DOCUMENT, upstream_port=upstream.port, concurrency=2,
                  name=host, native=host == "envoy-native")  # fmt: skip
    with_jwt_authn(envoy, issuer.jwks, rules=RULES, forward=True)
    doc = json.loads(envoy.bootstrap_path.read_text())
    for hcm in _connection_managers(doc):
        for key in PATH_SETTINGS:
            hcm.pop(key, None)  # Envoy's defaults (the harness renders them off)
        if paths == "shipped":
            hcm.update(SETTINGS)
    envoy.bootstrap_path.write_text(json.dumps(doc))
    procs.add(envoy)
    envoy.start()

    forged = issuer.token({"sub": "victim"}, key=rsa.generate_private_key(65537, 2048))
    victim = issuer.bearer({"sub": "victim"})
    spelled = {path: request(envoy.port, path, {"authorization": f"Bearer {forged}"}) for path in SPELLINGS}
    lower = [request(envoy.port, "/opt/x", {"authorization": f"bearer {forged}"}) for _ in range(RPU)]
    assert not errors(list(spelled.values()) + lower), errors(list(spelled.values()) + lower)
    after = [request(envoy.port, "/api/x", victim).status for _ in range(RPU)]
    after_opt = [request(envoy.port, "/opt/x", victim).status for _ in range(RPU)]
    forged_statuses = {path: r.status for path, r in spelled.items()}
    record(
        f"{host}: forged sub=victim past jwt_authn ({paths} path settings)",
        f"spellings {forged_statuses}, then the victim on /api: {after}; "
        f"`bearer <forged>` on the optional /opt: {[r.status for r in lower]}, then the victim: {after_opt}",
    )
    # (b) jwt_authn lets the lower-case scheme through unchecked; Diana reads no claim in it
    # (the fallback's shared counter pays), and the victim keeps its budget.
    assert [r.status for r in lower] == [200] * RPU
    assert after_opt == [200] * RPU
    assert WARNING in envoy.log_text()
    if paths == "envoy-defaults":
        # The reproduction: every spelling passes jwt_authn, and Diana counts it as the
        # victim: three spend the victim's budget, Diana refuses the fourth, then the victim.
        assert list(forged_statuses.values()) == [200] * RPU + [503]
        assert after == [503] * RPU
    else:
        assert forged_statuses == {path: 401 for path in SPELLINGS}
        assert after == [200] * RPU
