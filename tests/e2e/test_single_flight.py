"""Single flight: concurrent requests of one worker never make more than one callout per
global rule and identity at a time (docs/design.md §6). Between the gateway and the quota
service sits a slow counting proxy (every callout held 80 ms, so that requests pile up
behind it); it records how many callouts were in flight at once. One worker, one rule,
one identity: the proxy's peak is that worker's peak.

On Envoy the requests that find a callout in flight are parked and served by it (or by the
one after it, which asks for them too). On nginx nothing can be parked (a request is
resumed only by its own callout's answer): each request calls out, and the figures say so.
"""

from __future__ import annotations

import pytest

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import harness
from harness import Quota, record, send_concurrent, statuses

DELAY = 0.08


class CountingProxy:
    """Forwards POSTs to 127.0.0.1:`target` after `DELAY`, counting callouts in flight.
    The gateways' tick reports (`/v1/report`: the fleet view, every second when the
    document has a `global` section) are forwarded at once and not counted: they are not
    decisions, and `diana_global_callouts` does not count them either."""

    def __init__(self, target: int):
        self.target = target
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.total = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                decision = not self.path.startswith("/v1/report")
                with proxy.lock:
                    if decision:
                        proxy.in_flight += 1
                        proxy.total += 1
                        proxy.peak = max(proxy.peak, proxy.in_flight)
                try:
                    if decision:
                        time.sleep(DELAY)
                    conn = http.client.HTTPConnection("127.0.0.1", proxy.target, timeout=5)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    conn.request("POST", self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    answer = resp.read()
                    status = resp.status
                    conn.close()
                finally:
                    if decision:
                        with proxy.lock:
                            proxy.in_flight -= 1
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # nginx opens one connection per callout

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "CountingProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def doc(rpu: int, lease: str = "1") -> str:
    return f"""
resources:
  - Url: /
    rules:
      - {{name: shared, rpu: {rpu}, unit: hour, algo: TB, scope: global, lease: {lease}}}
response: {{status: 429}}
global: {{timeout_ms: 1000}}
"""


def test_one_callout_at_a_time_per_rule_per_worker(procs, start_gateway):
    quota = procs.add(Quota(procs.log_dir)).start()
    with CountingProxy(quota.port) as proxy:
        gw = start_gateway(doc(1000), quota_port=proxy.port, workers=1)
        t0 = time.monotonic()
        resps = send_concurrent(gw.port, 40)
        elapsed = time.monotonic() - t0
    metrics = gw.diana_metrics()
    callouts = harness.metric_sum(metrics, "diana_global_callouts")
    coalesced = harness.metric_sum(metrics, "diana_global_coalesced")
    record(
        f"{gw.label}: 40 concurrent requests, one worker, callouts held {DELAY * 1000:.0f} ms",
        f"{statuses(resps)} in {elapsed:.2f}s; {callouts} callouts, at most {proxy.peak} at once, {coalesced} requests parked",
    )
    assert not harness.errors(resps), harness.errors(resps)[:3]
    assert statuses(resps) == {200: 40}, statuses(resps)
    assert callouts == proxy.total
    if gw.kind == "envoy":
        assert proxy.peak == 1, f"{proxy.peak} callouts in flight at once"
        assert coalesced >= 20, coalesced
        # The first callout, then one for everyone parked behind it (a few more if some
        # requests arrived while the second was in flight).
        assert callouts <= 6, callouts
    else:
        assert coalesced == 0
        assert callouts == 40


def test_parked_requests_are_counted_exactly(procs, start_gateway):
    quota = procs.add(Quota(procs.log_dir)).start()
    with CountingProxy(quota.port) as proxy:
        gw = start_gateway(doc(25), quota_port=proxy.port, workers=2)
        resps = send_concurrent(gw.port, 60)
    record(f"{gw.label}: 60 concurrent requests against 25 per hour, callouts held {DELAY * 1000:.0f} ms",
           f"{statuses(resps)}; {proxy.total} callouts, at most {proxy.peak} at once")
    assert not harness.errors(resps), harness.errors(resps)[:3]
    assert statuses(resps) == {200: 25, 429: 35}, statuses(resps)
    if gw.kind == "envoy":
        assert proxy.peak <= 2, "one flight per worker"


def test_a_lease_is_refilled_ahead_and_no_request_waits_for_a_callout(procs, start_gateway):
    """Lease 10 with callouts held 80 ms by the proxy: once a worker's stash is down to
    half a lease its tick asks for the next one while requests spend the rest. Requests
    one after the other, 20 ms apart (a lease lasts 200 ms, longer than a refill's round
    trip): only each worker's first request calls out itself and waits; every later
    callout is a refill ahead. On nginx every callout is a request's own."""
    quota = procs.add(Quota(procs.log_dir)).start()
    with CountingProxy(quota.port) as proxy:
        gw = start_gateway(doc(100_000, lease="10"), quota_port=proxy.port, workers=1)
        slow = []
        resps = []
        for _ in range(150):
            r = harness.request(gw.port, "/", {})
            resps.append(r)
            if r.latency >= DELAY:
                slow.append(round(r.latency * 1000))
            time.sleep(0.02)
    metrics = gw.diana_metrics()
    callouts = harness.metric_sum(metrics, "diana_global_callouts")
    ahead = harness.metric_sum(metrics, "diana_global_refills_ahead")
    coalesced = harness.metric_sum(metrics, "diana_global_coalesced")
    record(
        f"{gw.label}: 150 requests 20 ms apart, lease 10, callouts held {DELAY * 1000:.0f} ms",
        f"{statuses(resps)}; {callouts} callouts ({ahead} refills ahead), {coalesced} parked; "
        f"requests that waited >= {DELAY * 1000:.0f} ms: {slow}",
    )
    assert statuses(resps) == {200: 150}, statuses(resps)
    assert callouts == proxy.total
    if gw.kind == "envoy":
        assert ahead >= 12, f"{ahead} refills ahead for 15 leases"
        assert callouts - ahead == 1, f"{callouts - ahead} callouts made by requests"
        assert len(slow) == 1, f"requests that waited for a callout: {slow}"
        assert proxy.peak == 1
    else:
        assert ahead == 0
        assert len(slow) == callouts
