"""Leaky-bucket waiters in a real Envoy: a paused request whose client goes away is
removed from the wait queue and counted, and the others still leave on time."""

from __future__ import annotations

import http.client
import time

import harness
from harness import HOST, record

DOC = """
Url: /
rules:
  - {name: paced, algo: LB, rpu: 2, unit: second, burst: 5}
"""


def open_request(port: int) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    conn.request("GET", "/")
    return conn


def test_a_waiting_request_whose_client_leaves_is_cleaned_up(start_envoy):
    envoy = start_envoy(DOC)
    first = harness.request(envoy.port, "/")
    assert first.status == 200
    # Three requests queue behind it (turns at 0.5 s, 1.0 s, 1.5 s); their clients leave.
    leavers = [open_request(envoy.port) for _ in range(3)]
    time.sleep(0.2)
    for conn in leavers:
        conn.sock.close()  # reset while paused
        conn.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = envoy.diana_metrics(settle=0)
        if metrics.get("diana_delay_abandoned", 0) >= 3:
            break
        time.sleep(0.1)
    metrics = envoy.diana_metrics()
    assert metrics.get("diana_delayed") == 3, metrics
    assert metrics.get("diana_delay_abandoned") == 3, metrics
    # The filter keeps working: the next request waits its turn and is served.
    t0 = time.monotonic()
    later = harness.request(envoy.port, "/", timeout=10)
    assert later.status == 200, later
    record("LB: abandoned waiters cleaned up", metrics.get("diana_delay_abandoned"))
    record("LB: next request after abandoned waiters waited s", round(time.monotonic() - t0, 3))
