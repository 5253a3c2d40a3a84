"""Every charge right (DESIGN §4 "A rejected request consumes nothing", "Scope global",
"Degrade"), end to end on both gateways:

- a flood that `/login` rejects does not drain the `/` budget other pages share, with the
  rules local, global, and mixed;
- the quota service's answers are checked before they are believed: a service that grants
  more than asked is not believed (the rule is decided locally with its own limit); one
  that refuses (4xx) is decided locally too, counted apart, logged once with its reason;
- a leaky bucket never holds a request longer than `max_wait_seconds`.

The lying and refusing services are small HTTP servers of this test, on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness import HOST, Quota, free_port, record, request, send_concurrent, statuses

HIERARCHY = """
resources:
  - Url: /
    rules: [{{name: site, actor: all, algo: W, unit: hour, rpu: 10, scope: {root}}}]
  - Url: /login
    rules: [{{name: login, actor: all, algo: W, unit: hour, rpu: 1, scope: {login}}}]
response: {{status: 429}}
global: {{timeout_ms: 200}}
"""


@pytest.mark.parametrize("root,login", [("local", "local"), ("global", "global"), ("local", "global")])
def test_a_rejected_flood_on_login_leaves_the_site_budget(procs, start_gateway, root, login):
    quota = procs.add(Quota(procs.log_dir)).start()
    gw = start_gateway(HIERARCHY.format(root=root, login=login), quota_port=quota.port)
    flood = send_concurrent(gw.port, 10, "/login")
    pages = [request(gw.port, "/home").status for _ in range(10)]
    record(
        f"{gw.label}: / {root} rpu 10 over /login {login} rpu 1",
        f"10 concurrent /login {statuses(flood)}, then 10 /home {pages}",
    )
    assert statuses(flood) == {200: 1, 429: 9}, statuses(flood)
    # Only the admitted /login counted against `/`: nine pages are left, then the limit.
    assert pages == [200] * 9 + [429], pages


class FakeQuota:
    """A quota service that answers what the test says: a lie (`granted` far above what
    was asked) or a refusal (400 with a reason)."""

    def __init__(self, mode: str) -> None:
        self.port = free_port()
        self.calls = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("content-length", "0"))
                asked = json.loads(self.rfile.read(length))
                if self.path != "/v1/acquire":
                    # The tick's report (the fleet view, every second with a global
                    # section) is no decision: answered empty, not counted.
                    self._send(200, {})
                    return
                fake.calls += 1
                if mode == "lie":
                    results = [
                        {"allowed": True, "granted": 1000, "remaining": 999, "reset_ms": 1000,
                         "retry_after_ms": 0, "delay_ms": 0}
                        for _ in asked["rules"]
                    ]  # fmt: skip
                    self._send(200, {"results": results})
                else:
                    self._send(400, {"error": "rules[0].want: must be between 1 and 100000, got 0"})

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((HOST, self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeQuota":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


GLOBAL = """
resources:
  - Url: /
    rules: [{name: shared, actor: all, algo: W, unit: hour, rpu: 5, scope: global, lease: 2}]
response: {status: 429}
global: {timeout_ms: 200, retry_seconds: 30}
"""


def test_a_service_that_grants_more_than_asked_is_not_believed(start_gateway):
    with FakeQuota("lie") as fake:
        gw = start_gateway(GLOBAL, quota_port=fake.port)
        resps = [request(gw.port, "/") for _ in range(30)]
        st = statuses(resps)
        m = gw.diana_metrics()
        record(
            f"{gw.label}: a service answering granted 1000 to want 2",
            f"30 requests {st}; callouts {fake.calls}; invalid answers {m.get('diana_global_invalid_answers')}",
        )
        # Decided locally with the rule's own limit (5 per hour), not 1000 tokens.
        assert st == {200: 5, 429: 25}, st
        assert m.get("diana_global_invalid_answers", 0) >= 1, m
        assert m.get("diana_global_degraded") == 1, m
        assert gw.log_text().count("answered what was not asked") >= 1


def test_a_refusal_is_decided_locally_counted_and_logged_once(start_gateway):
    with FakeQuota("refuse") as fake:
        gw = start_gateway(GLOBAL, quota_port=fake.port)
        resps = [request(gw.port, "/") for _ in range(8)]
        st = statuses(resps)
        m = gw.diana_metrics()
        deadline = time.monotonic() + 10
        while "the quota service refused" not in gw.log_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        lines = [ln for ln in gw.log_text().splitlines() if "the quota service refused" in ln]
        record(f"{gw.label}: a refusing service (400)", f"8 requests {st}; refused {m.get('diana_global_refused')}; {lines[:1]}")
        assert st == {200: 5, 429: 3}, st
        # Refused, not failed: the breaker stays closed, so every request asked again.
        assert m.get("diana_global_refused") == 8, m
        assert m.get("diana_global_degraded", 0) == 0, m
        assert fake.calls == 8
        # Logged with the service's reason, once per worker at most.
        assert lines and "rules[0].want" in lines[0], gw.log_text()[-2000:]
        assert len(lines) <= gw.root_contexts, lines


def test_a_leaky_bucket_never_holds_a_request_for_an_hour(start_envoy):
    """1 per hour: the second request's turn is an hour away; it is rejected at once with
    Retry-After instead of being held (max_wait_seconds, default 10). (nginx never holds a
    request: see test_algorithms.)"""
    gw = start_envoy("Url: /\nrules:\n  - {name: hourly, algo: LB, rpu: 1, unit: hour, burst: 3}\n")
    first = request(gw.port, "/")
    t0 = time.monotonic()
    second = request(gw.port, "/", timeout=30)
    waited = time.monotonic() - t0
    record("envoy: LB 1/hour, second request", f"{second.status} after {waited:.2f}s, Retry-After {second.header('retry-after')}")
    assert first.status == 200
    assert second.status == 503 and waited < 2, (second, waited)
    assert 3580 <= int(second.header("retry-after")) <= 3600, second.headers
