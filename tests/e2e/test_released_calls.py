"""Issue "every token accounted for", item 5: under `lease: 1` a client that goes away while
its request waits for the quota service's answer does not cost the budget a token.

The host drops the answer to a request whose context is gone (Envoy: the proxy-wasm SDK
files a call's answer under the request's context), so what the service granted that call
used to stay charged and unspent. Now each call carries an id, and the worker that saw
the request go sends `/v1/release` from its next tick: the service gives the grant back
(whichever of the acquire and the release it decides first).

A slow link between the gateway and diana-quota (300 ms, tests/e2e/faultproxy.py) keeps
each call in flight long enough for its client (100 ms timeout) to leave. Then patient
clients spend what is left: the requests the gateway admitted over the whole run add up to
the limit, exactly. nginx does not read the client of a paused request (the request is
resumed when its call answers, and counts as admitted then), so there the gone requests
are admitted ones and nothing needs releasing; the sum holds on both hosts."""

from __future__ import annotations

import time

import harness
from harness import FaultProxy, Quota, quota_counter, record, request, wait_until

LIMIT = 10
GONE = 5

DOC = f"""
resources:
  - Url: /
    rules:
      - {{name: shared, rpu: {LIMIT}, unit: hour, algo: TB, scope: global, lease: 1}}
response: {{status: 429}}
global: {{timeout_ms: 2000, retry_seconds: 2}}
"""


def test_clients_that_leave_mid_call_cost_no_token(procs, start_gateway):
    quota = procs.add(Quota(procs.log_dir)).start()
    link = procs.add(FaultProxy(procs.log_dir, quota.port, name="faultproxy-quota")).start()
    gateway = start_gateway(DOC, quota_port=link.port)
    link.set("latency", ms=300)

    gone = [request(gateway.port, "/", timeout=0.1) for _ in range(GONE)]
    assert all(r.status is None for r in gone), [(r.status, r.error) for r in gone]
    if gateway.kind == "envoy":
        # Each release goes out from the worker's next tick (at most a second), then
        # through the slow link: wait until diana-quota has given every grant back.
        wait_until(
            lambda: quota_counter(quota.port, "diana_quota_call_releases_total") >= GONE,
            20,
            f"diana-quota to take back the {GONE} grants of the clients that left",
        )
    else:
        # nginx admits the gone requests when their calls answer: wait until diana-quota
        # has decided every one of them, then for their answers to cross the slow link.
        wait_until(
            lambda: quota_counter(quota.port, "diana_quota_decisions_total") >= GONE,
            20,
            f"diana-quota to decide the {GONE} calls of the clients that left",
        )
        time.sleep(0.3)

    patient = [request(gateway.port, "/", timeout=5.0).status for _ in range(LIMIT + 3)]
    metrics = gateway.diana_metrics()
    admitted = harness.metric_sum(metrics, "diana_rule_allowed")
    released = harness.metric_sum(metrics, "diana_global_releases")
    _, body, _ = harness.http_get(quota.port, "/metrics")
    quota_released = sum(
        int(line.split()[-1])
        for line in body.decode().splitlines()
        if line.startswith("diana_quota_call_releases_total")
    )
    record(
        f"{gateway.label}: lease 1, {GONE} clients left mid-call",
        f"patient {patient.count(200)} of {LIMIT + 3} admitted; admitted in all {admitted}; "
        f"releases sent {released}, given back by diana-quota {quota_released}",
    )
    assert set(patient) <= {200, 429}, patient
    assert admitted == LIMIT, (admitted, patient)
    if gateway.kind == "envoy":
        # Every gone request's grant came back: the patient clients got the whole budget.
        assert patient.count(200) == LIMIT, patient
        assert released == GONE, metrics
        assert quota_released == GONE
    else:
        assert patient.count(200) + GONE == LIMIT, patient
