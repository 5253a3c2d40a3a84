"""Circuit breaking (DESIGN §4b, issue "Circuit breaking"), on every binding: a resource's
`breaker` opens on slow or failed calls to its upstream, answers at once while open (the
document's response, `Retry-After` until it probes again) or sends the request on marked
with `fallback_header`, lets exactly `half_open_calls` probes through, opens again on a
failed probe and closes on good ones; `force` from the config center switches it; with
`scope: global` two gateways follow one state kept by diana-quota.

The upstream is the demo's `/dep?status=S&ms=M`: each request chooses how the dependency
answers, so tests running in parallel share nothing."""

from __future__ import annotations

import json
import time

from harness import ConfigCenter, Quota, Upstream, free_port, record, request, wait_until

BODY = "circuit open\n"


def doc(breaker: str, extra: str = "") -> str:
    return f"""
resources:
  - Url: /dep
    breaker: {{name: dep, {breaker}}}
response: {{status: 503, body: "{BODY.strip()}\\n", headers: all}}
{extra}"""


def fast_failed(resp) -> bool:
    """Answered by Diana's breaker, not by the upstream."""
    return resp.status == 503 and resp.body == BODY.encode() and resp.header("x-ratelimit-limit") == "0"


def dep(port: int, status: int = 200, ms: int = 0, headers=None):
    return request(port, f"/dep?status={status}&ms={ms}", headers)


def test_failures_open_it_a_failed_probe_opens_it_again_good_ones_close_it(start_gateway):
    gw = start_gateway(doc("failure_ratio: 0.5, min_calls: 6, open_seconds: 2, half_open_calls: 2"))
    answered = [dep(gw.port, 503).status for _ in range(6)]
    assert answered == [503] * 6, answered
    opened = wait_until(lambda: fast_failed(dep(gw.port, 200)), 3, "the breaker open")
    # One worker saw it open; another trusts the closed verdict it last read for up to
    # 50 ms (breaker::record::VERDICT_CACHE), the documented bound for every worker.
    time.sleep(0.1)
    resp = dep(gw.port, 200)
    assert fast_failed(resp), (resp.status, resp.body)
    assert resp.header("retry-after") in ("1", "2"), resp.headers
    # Another path is not this breaker's.
    assert request(gw.port, "/other").status == 200
    # Half-open after open_seconds: a probe that fails opens it again at once.
    wait_until(lambda: not fast_failed(dep(gw.port, 503)), 4, "half-open: a probe let through")
    again = dep(gw.port, 200)
    reopened = fast_failed(again)
    # Half-open again: good probes close it.
    wait_until(lambda: dep(gw.port, 200).status == 200, 4, "half-open: a good probe")
    closed = wait_until(lambda: all(dep(gw.port, 200).status == 200 for _ in range(5)), 4, "closed")
    metrics = gw.diana_metrics()
    record(
        f"{gw.label}: breaker, 6 failures of 6 (min_calls 6, open 2 s, 2 probes)",
        f"open after {opened:.2f} s; a failed probe reopened it: {reopened}; closed {closed:.2f} s after a good probe; "
        f"calls {metrics.get('diana_breaker_calls.dep')}, failed {metrics.get('diana_breaker_failed.dep')}, "
        f"fast-failed {metrics.get('diana_breaker_fast_failed.dep')}, transitions {metrics.get('diana_breaker_transitions.dep')}",
    )
    assert reopened, (again.status, again.body)
    assert metrics.get("diana_breaker_state.dep") == 0, metrics
    assert metrics.get("diana_breaker_transitions.dep", 0) >= 5, metrics  # open, half, open, half, closed
    assert "breaker dep: closed -> open" in gw.log_text() or wait_until(
        lambda: "breaker dep: closed -> open" in gw.log_text(), 10, "the transition logged"
    )


def test_slow_answers_open_it(start_gateway):
    gw = start_gateway(doc("slow_ms: 100, slow_ratio: 0.5, min_calls: 4, open_seconds: 30"))
    for _ in range(4):
        assert dep(gw.port, 200, ms=250).status == 200
    took = wait_until(lambda: fast_failed(dep(gw.port, 200)), 3, "the breaker open on slow calls")
    # One worker saw it open; another trusts the closed verdict it last read for up to
    # 50 ms (breaker::record::VERDICT_CACHE), the documented bound for every worker.
    time.sleep(0.1)
    resp = dep(gw.port, 200)
    record(f"{gw.label}: breaker, 4 answers of 250 ms (slow_ms 100)", f"open {took:.2f} s after; Retry-After {resp.header('retry-after')}")
    assert fast_failed(resp)
    assert 25 <= int(resp.header("retry-after")) <= 30, resp.headers


def test_with_a_fallback_header_an_open_breaker_sends_the_request_to_the_backup(start_gateway, procs):
    # The README's route: a request carrying `x-diana-fallback: dep` goes to the backup
    # (Envoy: a route matching the header; nginx: a `map` on $http_x_diana_fallback).
    backup = procs.add(Upstream(procs.log_dir, name="backup")).start()
    gw = start_gateway(
        doc("failure_ratio: 0.5, min_calls: 4, open_seconds: 30, fallback_header: x-diana-fallback"),
        fallback_route=("x-diana-fallback", "dep", backup.port),
    )
    # A client cannot choose the backup itself: its own value never reaches a route or
    # the upstream.
    forged = dep(gw.port, 200, headers={"x-diana-fallback": "dep"})
    assert forged.status == 200 and forged.header("x-upstream") is None, forged.headers
    assert "x-diana-fallback" not in json.loads(forged.body), forged.body
    for _ in range(4):
        dep(gw.port, 500)
    wait_until(lambda: dep(gw.port, 200).header("x-upstream") == "backup", 3, "requests routed to the backup")
    # One worker saw it open; another trusts the closed verdict it last read for up to
    # 50 ms (breaker::record::VERDICT_CACHE), the documented bound for every worker.
    time.sleep(0.1)
    marked = dep(gw.port, 503)  # the main upstream would answer 503; the backup is asked for it too
    body = json.loads(marked.body)
    record(
        f"{gw.label}: breaker open with fallback_header",
        f"status {marked.status} from {marked.header('x-upstream')}, which saw {body}",
    )
    assert marked.header("x-upstream") == "backup" and body["x-diana-fallback"] == "dep", (marked.headers, body)
    # Other paths still go to the main upstream.
    other = request(gw.port, "/other")
    assert other.status == 200 and other.header("x-upstream") is None, other.headers


def test_force_from_the_config_center_switches_it_at_the_next_poll(start_gateway):
    port = free_port()
    breaker = "failure_ratio: 0.5, open_seconds: 9, force: {force}"
    local = doc(breaker.format(force="auto"), "remote: {cluster: diana_config, authority: config, path: /diana.yaml, poll_seconds: 1}")
    with ConfigCenter(port) as center:
        center.document = doc(breaker.format(force="auto"))
        gw = start_gateway(local, config_port=port)
        assert dep(gw.port).status == 200
        center.document = doc(breaker.format(force="open"))
        took = wait_until(lambda: fast_failed(dep(gw.port)), 10, "force: open applied")
        # One worker applied it; every worker applies a published document within a second
        # (README "Remote configuration"): then every request fails fast, whichever worker
        # takes it (each request comes on a new connection).
        spread = wait_until(lambda: all(fast_failed(dep(gw.port)) for _ in range(8)), 10, "force: open on every worker")
        assert spread < 2.5, f"force: open reached every worker {spread:.2f} s after the first"
        assert dep(gw.port).header("retry-after") == "9"
        center.document = doc(breaker.format(force="closed"))
        back = wait_until(lambda: dep(gw.port).status == 200, 10, "force: closed applied")
        # Closed by hand: failures no longer open it.
        for _ in range(30):
            dep(gw.port, 503)
        time.sleep(1.2)
        still = dep(gw.port)
        record(
            f"{gw.label}: force from the config center (poll 1 s)",
            f"open after {took:.2f} s (every worker {spread:.2f} s later), closed after {back:.2f} s; 30 failures then -> {still.status}",
        )
        assert still.status == 200
        wait_until(lambda: "force: open" in gw.log_text(), 10, "the switch logged")


def test_two_gateways_follow_one_global_breaker(start_gateway, procs):
    quota = procs.add(Quota(procs.log_dir)).start()
    # A report that outlasts the callout timeout (50 ms by default) trips the quota
    # service's outage switch and keeps a gateway local for retry_seconds: on a machine
    # busy with parallel tests that, not the breaker, decided when B followed.
    document = doc("failure_ratio: 0.5, min_calls: 6, open_seconds: 30, scope: global", "global: {timeout_ms: 500}")
    a = start_gateway(document, quota_port=quota.port)
    b = start_gateway(document, quota_port=quota.port)
    # B only ever sees good answers; A's fail. Every request B lets through while it waits
    # for the fleet is a good call in the fleet's window too, reported at B's next tick, so
    # A's evidence must outweigh them: 20 failures against B's 3 calls and its polls (10 a
    # second) stay at or above the failed share of 0.5 for 1.7 s of reporting lag. (With 6
    # failures and a poll every 50 ms, B's polls reported before A's failures kept the share
    # under 0.5 when A's reports came a few hundred milliseconds late: B never followed.)
    for _ in range(3):
        assert dep(b.port, 200).status == 200
    for _ in range(20):
        dep(a.port, 502)
    took = wait_until(lambda: fast_failed(dep(b.port, 200)), 5, "B following the fleet's open breaker", period=0.1)
    record(
        f"{a.label}: a global breaker over two gateways",
        f"B (no bad answer of its own) failed fast {took:.2f} s after A's last failure",
    )
    # DESIGN §4b: within a second of another gateway's evidence (each gateway reports
    # every 250 ms: README "Circuit breaking").
    assert took < 1.0, f"B followed {took:.2f} s after A's evidence"
    # The service stops: each gateway falls back to its own breaker (B's window is clean).
    quota.stop()
    wait_until(lambda: dep(b.port, 200).status == 200, 10, "B back on its own breaker")
    wait_until(lambda: "quota service silent" in b.log_text(), 10, "the fallback logged")
