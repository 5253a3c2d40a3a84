"""Remote configuration end to end: a real Envoy (4 workers) and a real nginx (2 worker
processes) polling a config center that changes, fails, serves garbage, or is never up."""

from __future__ import annotations

import time

import pytest

import harness
from harness import ConfigCenter, free_port, record, send_concurrent, statuses


def local_doc(config_port_cluster: str = "diana_config", rpu: int = 1000) -> str:
    return f"""
resources:
  - Url: /
    rules:
      - {{name: main, rpu: {rpu}, unit: hour}}
remote: {{cluster: {config_port_cluster}, authority: config, path: /diana.yaml, poll_seconds: 1}}
response: {{status: 429}}
"""


def remote_doc(rpu: int, extra_rule: str = "") -> str:
    return f"""
resources:
  - Url: /
    rules:
      - {{name: main, rpu: {rpu}, unit: hour}}{extra_rule}
response: {{status: 429}}
"""


def admitted(port: int, n: int = 40) -> int:
    return statuses(send_concurrent(port, n)).get(200, 0)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} (last: {last})")


def metric(gw, name: str) -> int:
    """A counter as it stands (polled: the workers flush their counts every second)."""
    return gw.diana_metrics(settle=0).get(name, 0)


def wait_applied_everywhere(gw, at_least: int, what: str) -> None:
    """Every VM applied the document: the reload count reached `at_least` (a lower bound:
    a gateway may run more root contexts than it says) and has
    then stayed still for longer than a worker takes to adopt a published document."""
    wait_for(lambda: metric(gw, "diana_config_reloads") >= at_least, 15, what)
    # Each worker checks for a published document every second, and its counts reach the
    # host from its tick, up to a second later.
    quiet_for = 2.6
    last, since = metric(gw, "diana_config_reloads"), time.monotonic()
    deadline = since + 15
    while time.monotonic() - since < quiet_for:
        assert time.monotonic() < deadline, f"reload count never settled: {what}"
        time.sleep(0.2)
        now = metric(gw, "diana_config_reloads")
        if now != last:
            last, since = now, time.monotonic()


def test_remote_document_replaces_local_then_survives_failures_and_garbage(start_gateway):
    port = free_port()
    with ConfigCenter(port) as center:
        center.document = remote_doc(5)
        gw = start_gateway(local_doc(), config_port=port)
        # Every worker switches to the remote limit: exactly 5 per hour in total.
        vms = gw.root_contexts
        wait_applied_everywhere(gw, 2 * vms, "remote document applied by every worker")
        assert statuses(send_concurrent(gw.port, 20)) == {200: 5, 429: 15}
        # Conditional requests: the center is asked with If-None-Match and answers 304.
        wait_for(lambda: center.not_modified >= 2, 10, "304 answers to If-None-Match")
        polls_per_second = len(center.requests) / 1.0
        assert any("if-none-match" in r for r in center.requests)

        # The center fails: the last good document stays, the failure is counted.
        center.mode = "error"
        wait_for(lambda: metric(gw, "diana_config_fetch_errors") >= 2, 10, "fetch errors counted")
        assert admitted(gw.port, 10) == 0, "still the remote limit (exhausted)"
        # It serves garbage: refused, counted, nothing changes.
        center.mode = "garbage"
        wait_for(lambda: metric(gw, "diana_config_rejected") >= 1, 10, "garbage refused")
        assert admitted(gw.port, 10) == 0
        # Envoy flushes its log file periodically: wait for the lines.
        wait_for(lambda: "invalid remote document" in gw.log_text(), 20, "the invalid document logged")
        assert gw.log_text().count("config center failing") == 1, "the switch to failing is logged once"

        # Recovery with a changed document: a new rule appears; the unchanged rule keeps
        # its counter (still exhausted), the new one starts fresh.
        reloads = metric(gw, "diana_config_reloads")
        center.document = remote_doc(5, "\n      - {name: extra, rpu: 100, unit: hour}")
        center.mode = "ok"
        wait_applied_everywhere(gw, reloads + vms, "changed document applied")
        assert admitted(gw.port, 10) == 0, "unchanged rule kept its state across the reload"
        wait_for(lambda: "config center is back" in gw.log_text(), 20, "recovery logged")

        # A different limit for `main` is a different counter: it starts fresh.
        reloads = metric(gw, "diana_config_reloads")
        center.document = remote_doc(7)
        wait_applied_everywhere(gw, reloads + vms, "new limit applied")
        assert statuses(send_concurrent(gw.port, 20)) == {200: 7, 429: 13}
        # One worker polls per period, not four.
        n0 = len(center.requests)
        time.sleep(3.2)
        per_second = (len(center.requests) - n0) / 3.2
        assert per_second <= 1.5, f"{per_second:.1f} polls/s with poll_seconds 1 and {vms} root contexts"
        record(f"{gw.label}: remote: polls per second ({vms} root contexts, poll_seconds 1)", round(per_second, 2))
        del polls_per_second


def test_a_config_center_that_is_never_up_leaves_the_local_document(start_gateway):
    port = free_port()  # nothing listens there
    gw = start_gateway(local_doc(rpu=4), config_port=port)
    wait_for(lambda: metric(gw, "diana_config_fetch_errors") >= 2, 15, "fetch errors counted")
    assert statuses(send_concurrent(gw.port, 12)) == {200: 4, 429: 8}
    wait_for(lambda: "config center failing" in gw.log_text(), 20, "failure logged")
    time.sleep(3)
    assert gw.log_text().count("config center failing") == 1, "logged once, not once per poll or worker"


@pytest.mark.parametrize("first", ["garbage", "error"])
def test_a_config_center_that_starts_broken_keeps_the_local_document(start_gateway, first):
    port = free_port()
    with ConfigCenter(port) as center:
        center.mode = first
        gw = start_gateway(local_doc(rpu=3), config_port=port)
        name = "diana_config_rejected" if first == "garbage" else "diana_config_fetch_errors"
        wait_for(lambda: metric(gw, name) >= 1, 15, f"{first} counted")
        assert statuses(send_concurrent(gw.port, 9)) == {200: 3, 429: 6}


def per_identity_doc(rpu: int) -> str:
    return f"""
resources:
  - Url: /
    rules:
      - {{name: per_device, actor: device, rpu: {rpu}, unit: hour, slots: 4096}}
      - {{name: per_account, actor: account, algo: SW, rpu: {rpu}, unit: minute, slots: 4096}}
response: {{status: 429}}
"""


def test_alternating_documents_under_traffic_leave_memory_flat(start_gateway):
    """A config center that keeps switching between two documents with per-identity rules
    (DESIGN §4 Lifecycle): every switch drops the other document's rules (their records
    are released: deleted on nginx, emptied on Envoy) and the gateway's memory stays flat."""
    alternations = int(__import__("os").environ.get("DIANA_ALTERNATIONS", "50"))
    port = free_port()
    with ConfigCenter(port) as center:
        docs = [per_identity_doc(50), per_identity_doc(60)]
        center.document = docs[0]
        gw = start_gateway(local_doc(), config_port=port)
        wait_applied_everywhere(gw, 2 * gw.root_contexts, "first remote document applied")
        rss = []
        failures = []
        for i in range(alternations):
            center.document = docs[(i + 1) % 2]
            t_end = time.monotonic() + 1.2
            while time.monotonic() < t_end:
                resps = send_concurrent(
                    gw.port,
                    32,
                    "/",
                    lambda k, i=i: {"x-device-id": f"d{i}-{k}", "x-account-id": f"a{i}-{k}"},
                )
                failures += [r for r in resps if r.status not in (200, 429)]
            if i in (alternations // 5, alternations - 1):
                rss.append(gw.rss())
        mib = 1 << 20
        growth = rss[-1] - rss[0]
        reloads = gw.diana_metrics().get("diana_config_reloads", 0)
        record(
            f"{gw.label}: {alternations} alternating documents under traffic",
            f"RSS {rss[0] / mib:.1f} -> {rss[-1] / mib:.1f} MiB ({growth / mib:+.1f}) between switch "
            f"{alternations // 5} and {alternations}; reloads {reloads}; failed requests {len(failures)}",
        )
        assert not failures, failures[:3]
        assert reloads >= alternations, reloads
        assert growth < 8 * mib, f"memory grew by {growth / mib:.1f} MiB"
