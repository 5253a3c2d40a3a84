"""Concurrency limits (issue "Limits people ask for, round two", item 1): `max_in_flight: N`
lets at most N requests of an identity inside the gateway at once. A request holds its
place from admission to its end; the rest are rejected at once. Measured at the upstream
(the demo's `/__inflight`: the most requests inside it at once), on both hosts."""

from __future__ import annotations

import json
import socket
import time

from harness import HOST, errors, record, request, send_concurrent, statuses

N = 5

DOC = f"""
resources:
  - Url: /slow
    rules:
      - name: inside
        actor: account
        max_in_flight: {N}
response: {{status: 429, headers: all, header_style: both}}
"""


def inflight(upstream_port: int, reset: bool = False) -> dict:
    _, body = request_json(upstream_port, "/__inflight" + ("?reset=1" if reset else ""))
    return body


def request_json(port: int, path: str) -> tuple[int, dict]:
    r = request(port, path)
    return r.status, json.loads(r.body)


def test_at_most_n_requests_of_an_identity_are_inside_at_once(start_gateway, upstream):
    gw = start_gateway(DOC)
    inflight(upstream.port, reset=True)
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
        f"{gw.kind}: max_in_flight {N}, 50 concurrent requests held 1 s by the upstream",
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


def test_clients_that_leave_mid_request_give_their_places_back(start_gateway):
    gw = start_gateway(DOC)
    account = "initech"
    # N clients take every place with requests the upstream would hold 5 s, then leave.
    sockets = []
    for _ in range(N):
        s = socket.create_connection((HOST, gw.port), timeout=5)
        s.sendall(f"GET /slow?ms=5000 HTTP/1.1\r\nHost: x\r\nx-account-id: {account}\r\n\r\n".encode())
        sockets.append(s)
    time.sleep(0.5)
    full = request(gw.port, "/slow?ms=1", {"x-account-id": account}).status
    for s in sockets:
        s.close()
    # Their places come back as their requests end (well before the upstream's 5 s).
    deadline = time.monotonic() + 3
    back = 0
    while time.monotonic() < deadline:
        resps = send_concurrent(gw.port, N, "/slow?ms=300", {"x-account-id": account})
        back = statuses(resps).get(200, 0)
        if back == N:
            break
        time.sleep(0.2)
    left_after = 3 - (deadline - time.monotonic())
    record(
        f"{gw.kind}: max_in_flight {N}, {N} clients leave mid-request",
        f"while inside: another request -> {full}; places back after {left_after:.1f} s: {back} of {N}",
    )
    assert full == 429
    assert back == N, back
