"""Security end to end (SECURITY.md), on both hosts with real Redis and diana-quota:

- diana-quota answers only gateways: a caller without the credential, or with a wrong one,
  gets 401 and changes no counter (Redis is read before and after); a gateway whose
  `global.token` is wrong is refused (counted, logged once), decides locally and never
  opens its breaker;
- a counter cannot be reset or read by a request with other parameters;
- a forged identity (a header value whose old, unkeyed hash equals a victim's address)
  does not lock the victim out.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest

import harness
from harness import HOST, Quota, Redis, record, redis_cli, statuses

WINDOW_DOC = """
resources:
  - Url: /
    rules:
      - {name: guarded, actor: all, rpu: 3, unit: hour, algo: TB, scope: global}
response: {status: 429}
global: {timeout_ms: 300, retry_seconds: 30}
"""


def redis_state(port: int) -> dict[str, str]:
    """Every counter of the Redis at `port` with its type and value (the release ledger's
    keys, which the gateway's own calls write, aside)."""
    out: dict[str, str] = {}
    for key in sorted(harness.counter_keys(redis_cli(port, "--scan").split("\n"))):
        kind = redis_cli(port, "TYPE", key).strip()
        if kind == "hash":
            value = redis_cli(port, "HGETALL", key)
        elif kind == "string":
            value = redis_cli(port, "GET", key)
        elif kind == "zset":
            value = redis_cli(port, "ZRANGE", key, "0", "-1", "WITHSCORES")
        else:
            value = redis_cli(port, "DUMP", key)
        out[key] = f"{kind}:{value}"
    return out


def post(port: int, path: str, body: dict, authorization: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        headers = {"content-type": "application/json"}
        if authorization is not None:
            headers["authorization"] = authorization
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def acquire_body(key: str, **params: object) -> dict:
    rule = {"key": key, "algo": "TB", "rpu": 3, "unit": "hour", "burst": 3, "slices": 10, "want": 1}
    rule.update(params)
    return {"rules": [rule]}


def gateway_key(redis_port: int) -> str:
    """The wire key (`<rule-id>:<identity>`) of the one counter the gateway made, read from
    its Redis key name (`…{<key>}…`, the hash tag)."""
    keys = harness.counter_keys(redis_cli(redis_port, "--scan").split("\n"))
    assert len(keys) == 1, keys
    name = keys[0]
    assert "{" in name and "}" in name, name
    return name[name.index("{") + 1 : name.index("}")]


def test_quota_service_answers_only_gateways(start_gateway, procs):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = procs.add(Quota(procs.log_dir, redis.url)).start()
    gw = start_gateway(WINDOW_DOC, quota_port=quota.port)

    # The gateway (with the credential) counts globally: 3 admitted, then 429.
    first = [harness.request(gw.port, "/").status for _ in range(2)]
    assert first == [200, 200], first
    key = gateway_key(redis.port)
    before = redis_state(redis.port)

    # Strangers: no credential, a wrong one, the right one in the wrong scheme, a prefix of
    # it. Each tries to drain the gateway's counter (want 100,000) and to reset it.
    token = harness.QUOTA_TOKEN
    attempts = {
        "none": None,
        "wrong": "Bearer " + "x" * len(token),
        "basic": "Basic " + token,
        "prefix": "Bearer " + token[:-1],
        "empty": "Bearer ",
    }
    for what, authorization in attempts.items():
        for path, body in [
            ("/v1/acquire", acquire_body(key, want=100000, burst=100000, rpu=100000)),
            ("/v1/charge", acquire_body(key, want=100000)),
            ("/v1/acquire", acquire_body(key, unit="second")),
        ]:
            status, answer = post(quota.port, path, body, authorization)
            assert status == 401, (what, path, status, answer)
            assert b"remaining" not in answer, answer
    assert redis_state(redis.port) == before, "an unauthenticated call changed Redis"
    # A body it never read: even a malformed one is 401, not 400.
    status, _ = post(quota.port, "/v1/acquire", {"nonsense": True}, None)
    assert status == 401

    # Health and metrics reveal no counter.
    for path in ("/healthz", "/readyz", "/metrics"):
        status, body, _ = harness.http_get(quota.port, path)
        assert status == 200, path
        assert key.split(":")[0] not in body.decode(errors="replace"), path

    # The gateway's budget is intact: exactly one more admitted.
    rest = [harness.request(gw.port, "/").status for _ in range(3)]
    assert rest == [200, 429, 429], rest
    record(f"{gw.label}: unauthenticated calls", f"{len(attempts) * 3} calls, all 401, Redis unchanged")


def test_a_gateway_with_a_wrong_token_is_refused_and_limits_locally(start_gateway, procs):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = procs.add(Quota(procs.log_dir, redis.url)).start()
    gw = start_gateway(WINDOW_DOC, quota_port=quota.port, quota_token="w" * 48, workers=1)
    resps = [harness.request(gw.port, "/") for _ in range(6)]
    m = gw.diana_metrics()
    st = statuses(resps)
    # Refused (401): decided locally with the same limit; the breaker stays closed, so every
    # request asks the service again (and is refused again).
    assert st == {200: 3, 429: 3}, st
    assert m.get("diana_global_refused", 0) >= 3, m
    assert m.get("diana_global_degraded", 0) == 0, m
    assert redis_cli(redis.port, "DBSIZE").strip() == "0"
    log = gw.log_text() if gw.kind == "envoy" else gw.error_text()
    lines = [line for line in log.splitlines() if "refused this gateway's credential" in line]
    assert len(lines) >= 1, log[-3000:]
    assert "w" * 48 not in log, "the token was logged"
    record(f"{gw.label}: wrong token", f"{st}; refused {m.get('diana_global_refused')}; degraded 0")


def test_a_request_with_other_parameters_neither_resets_nor_reads_a_counter(start_gateway, procs):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = procs.add(Quota(procs.log_dir, redis.url)).start()
    gw = start_gateway(WINDOW_DOC, quota_port=quota.port)
    got = [harness.request(gw.port, "/").status for _ in range(4)]
    assert got == [200, 200, 200, 429], got
    key = gateway_key(redis.port)
    before = redis_state(redis.port)

    # An authenticated caller (a misconfigured or compromised gateway) sends the same key
    # with other parameters: a token bucket of rpu 1/day, a second-long window, a larger
    # burst. None may reset the gateway's counter or read it.
    auth = "Bearer " + harness.QUOTA_TOKEN
    for params in [
        {"rpu": 1, "unit": "day", "burst": 1},
        {"algo": "W", "unit": "second"},
        {"burst": 1000, "rpu": 1000},
        {"algo": "SW", "unit": "minute", "slices": 60},
    ]:
        status, answer = post(quota.port, "/v1/acquire", acquire_body(key, **params), auth)
        assert status in (200, 400), (params, status, answer)
        if status == 200:
            result = json.loads(answer)["results"][0]
            # A counter of its own parameters, fresh: not the gateway's (0 remaining).
            assert result["allowed"], (params, result)
    after = {k: v for k, v in redis_state(redis.port).items() if k in before}
    assert after == before, "a request with other parameters touched the gateway's counter"
    assert harness.request(gw.port, "/").status == 429
    record(f"{gw.label}: parameter mismatch", "4 foreign-parameter requests; the counter unchanged, still 429")


FORGE_LOCAL_DOC = """
resources:
  - Url: /
    rules:
      - {name: per_device, actor: device, rpu: 3, unit: hour, algo: TB}
response: {status: 429}
"""

FORGE_GLOBAL_DOC = """
resources:
  - Url: /
    rules:
      - {name: per_device, actor: device, rpu: 3, unit: hour, algo: TB, scope: global}
response: {status: 429}
identity_key: IDENTITY_KEY
global: {timeout_ms: 300, retry_seconds: 30}
"""


@pytest.mark.parametrize("scope", ["local", "global"])
def test_a_forged_identity_does_not_lock_out_its_victim(start_gateway, procs, scope):
    import forge

    # An address whose old identity has a header-safe forgery (about one in 2,500 has).
    victim_ip = forge.forgeable_ip()
    forged = forge.forged_device_id(victim_ip)
    # The attack as it was: under the old unkeyed hash this header value IS the victim's
    # address identity (forge checks it against the python xxhash module).
    assert forge.old_header_identity(forged) == forge.old_ip_identity(victim_ip)

    if scope == "local":
        gw = start_gateway(FORGE_LOCAL_DOC)
    else:
        redis = procs.add(Redis(procs.log_dir)).start()
        quota = procs.add(Quota(procs.log_dir, redis.url)).start()
        gw = start_gateway(FORGE_GLOBAL_DOC.replace("IDENTITY_KEY", "k" * 20 + harness.QUOTA_TOKEN[:24]), quota_port=quota.port)

    # The attacker, from another address, spends "the victim's" budget three times over.
    attacker = [harness.request(gw.port, "/", {"x-device-id": forged}, source_address="127.0.0.1").status for _ in range(5)]
    assert attacker == [200, 200, 200, 429, 429], attacker
    # The victim (no device header: identified by its address) is not locked out.
    victim = [harness.request(gw.port, "/", source_address=victim_ip).status for _ in range(4)]
    assert victim == [200, 200, 200, 429], victim
    record(f"{gw.label} {scope}: forged identity", f"attacker {attacker}; victim {victim}")


PER_ADDRESS_DOC = """
resources:
  - Url: /
    rules:
      - {name: per_address, actor: ip, rpu: 3, unit: hour, algo: TB}
response: {status: 429}
"""


def test_a_forwarded_for_header_does_not_choose_the_client_address(start_gateway):
    """A client that writes X-Forwarded-For neither spends another client's budget nor
    escapes its own: the `ip` identity is the connection's peer (Envoy: the bootstrap's
    `use_remote_address: true`; nginx: `$remote_addr`)."""
    gw = start_gateway(PER_ADDRESS_DOC)
    victim_ip = "127.0.0.9"
    # The first names the victim, the others are new every time (an escape).
    forwarded = [victim_ip, "10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"]
    attacker = [
        harness.request(gw.port, "/", {"x-forwarded-for": value}, source_address="127.0.0.1").status
        for value in forwarded
    ]
    assert attacker == [200, 200, 200, 429, 429], attacker
    victim = [harness.request(gw.port, "/", source_address=victim_ip).status for _ in range(4)]
    assert victim == [200, 200, 200, 429], victim
    record(f"{gw.label}: X-Forwarded-For", f"attacker {attacker}; victim {victim}")
