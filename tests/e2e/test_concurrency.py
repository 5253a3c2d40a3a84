"""Concurrency limits (issue "Limits people ask for, round two", item 1): `max_in_flight: N`
lets at most N requests of an identity inside the gateway at once. A request holds its
place from admission to its end; the rest are rejected at once. Measured at the upstream
(the demo's `/__inflight`: the most requests inside it at once), on every host; with
`scope: global`, over two gateways sharing places held by diana-quota in Redis."""

from __future__ import annotations

import json
import socket
import time

from harness import HOST, Quota, Redis, errors, record, request, send_concurrent, spread, statuses

N = 5


def document(scope: str) -> str:
    """`max_in_flight: N` per account on /slow, in `scope` (`global`: the quota service's
    timeout raised for a loaded test machine)."""
    quota = "global: {timeout_ms: 500}\n" if scope == "global" else ""
    return f"""
resources:
  - Url: /slow
    rules:
      - name: inside
        actor: account
        max_in_flight: {N}
        scope: {scope}
response: {{status: 429, headers: all, header_style: both}}
{quota}"""


DOC = document("local")
GLOBAL_DOC = document("global")


def inflight(upstream_port: int, reset: bool = False) -> dict:
    _, body = request_json(upstream_port, "/__inflight" + ("?reset=1" if reset else ""))
    return body


def quiet_upstream(upstream_port: int) -> None:
    """Waits for the requests of earlier tests to leave the upstream (a client that left
    does not stop its `/slow` request there), then counts afresh."""
    deadline = time.monotonic() + 8
    while inflight(upstream_port)["inside"] > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    inflight(upstream_port, reset=True)


def request_json(port: int, path: str) -> tuple[int, dict]:
    r = request(port, path)
    return r.status, json.loads(r.body)


def test_at_most_n_requests_of_an_identity_are_inside_at_once(start_gateway, upstream):
    gw = start_gateway(DOC)
    quiet_upstream(upstream.port)
    started = time.monotonic()
    burst = send_concurrent(gw.port, 50, "/slow?ms=1000", {"x-account-id": "acme"}, timeout=15)
    assert not errors(burst), errors(burst)
    seen = statuses(burst)
    most = inflight(upstream.port)["most"]
    rejected_fast = sum(1 for r in burst if r.status == 429 and r.latency < 0.5)
    # Once they are done, the places are free again.
    again = send_concurrent(gw.port, 8, "/slow?ms=200", {"x-account-id": "acme"})
    other = request(gw.port, "/slow?ms=1", {"x-account-id": "globex"}).status
    rejection = next(r for r in burst if r.status == 429)
    record(
        f"{gw.label}: max_in_flight {N}, 50 concurrent requests held 1 s by the upstream",
        f"{seen}; most inside the upstream at once {most}; rejections under 0.5 s {rejected_fast}; "
        f"then 8 more -> {statuses(again)}; another account -> {other}; "
        f"RateLimit-Policy {rejection.headers.get('ratelimit-policy')!r}; took {time.monotonic() - started:.1f} s",
    )
    assert seen == {200: N, 429: 50 - N}, seen
    assert most <= N, most
    assert rejected_fast == 50 - N
    assert statuses(again) == {200: N, 429: 8 - N}
    assert other == 200
    assert rejection.headers.get("ratelimit-policy") == f'"inside";q={N};qu="concurrency"'


def leave_mid_request(entry: int, other: int, account: str) -> tuple[int, int, float]:
    """N clients of `account` take every place through gateway port `entry` with requests
    the upstream would hold 5 s, then leave. Returns what a request through `other` got
    while they were inside, how many of N requests through `other` were admitted once
    their places came back (polled for 3 s), and when."""
    sockets = []
    for _ in range(N):
        s = socket.create_connection((HOST, entry), timeout=5)
        s.sendall(f"GET /slow?ms=5000 HTTP/1.1\r\nHost: x\r\nx-account-id: {account}\r\n\r\n".encode())
        sockets.append(s)
    time.sleep(0.5)
    full = request(other, "/slow?ms=1", {"x-account-id": account}).status
    for s in sockets:
        s.close()
    # Their places come back as their requests end (well before the upstream's 5 s).
    started = time.monotonic()
    back = 0
    while time.monotonic() - started < 3:
        back = statuses(send_concurrent(other, N, "/slow?ms=300", {"x-account-id": account})).get(200, 0)
        if back == N:
            break
        time.sleep(0.2)
    return full, back, time.monotonic() - started


def test_clients_that_leave_mid_request_give_their_places_back(start_gateway):
    gw = start_gateway(DOC)
    full, back, after = leave_mid_request(gw.port, gw.port, "initech")
    record(
        f"{gw.label}: max_in_flight {N}, {N} clients leave mid-request",
        f"while inside: another request -> {full}; places back after {after:.1f} s: {back} of {N}",
    )
    assert full == 429
    assert back == N, back


def test_a_global_limit_holds_n_places_over_two_gateways(procs, start_gateway, upstream):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = procs.add(Quota(procs.log_dir, redis.url)).start()
    gateways = [start_gateway(GLOBAL_DOC, quota_port=quota.port) for _ in range(2)]
    quiet_upstream(upstream.port)
    burst = spread(gateways, 40, "/slow?ms=1000", {"x-account-id": "acme"}, timeout=15)
    assert not errors(burst), errors(burst)
    seen = statuses(burst)
    most = inflight(upstream.port)["most"]
    rejected_fast = sum(1 for r in burst if r.status == 429 and r.latency < 0.5)
    # Every place was given back when its request ended (a leave to the service, from the
    # worker's next tick: at once on Envoy, within 0.1 s on nginx): the next requests
    # find all of them, on either gateway.
    time.sleep(1.2)
    again = spread(gateways, 10, "/slow?ms=300", {"x-account-id": "acme"})
    other = request(gateways[1].port, "/slow?ms=1", {"x-account-id": "globex"}).status
    # Every leave reached the service: none counted as not given back (README "Metrics").
    unreturned = [gw.diana_metrics().get("diana_global_places_unreturned") for gw in gateways]
    record(
        f"{gateways[0].label}: global max_in_flight {N} over 2 gateways, 40 concurrent requests held 1 s",
        f"{seen}; most inside the upstream at once {most}; rejections under 0.5 s {rejected_fast}; "
        f"then 10 more -> {statuses(again)}; another account -> {other}; "
        f"places not given back per gateway {unreturned}",
    )
    assert seen == {200: N, 429: 40 - N}, seen
    assert most <= N, most
    assert rejected_fast == 40 - N
    assert statuses(again) == {200: N, 429: 10 - N}, statuses(again)
    assert other == 200
    assert unreturned == [0, 0], unreturned


def test_global_places_of_clients_that_leave_come_back(procs, start_gateway):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = procs.add(Quota(procs.log_dir, redis.url)).start()
    first, second = (start_gateway(GLOBAL_DOC, quota_port=quota.port) for _ in range(2))
    full, back, after = leave_mid_request(first.port, second.port, "umbrella")
    record(
        f"{first.label}: global max_in_flight {N}, {N} clients of gateway 1 leave mid-request",
        f"while inside: a request on gateway 2 -> {full}; places back on gateway 2 after "
        f"{after:.1f} s: {back} of {N}",
    )
    assert full == 429
    assert back == N, back
