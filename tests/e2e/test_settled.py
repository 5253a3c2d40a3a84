"""Requests settled with their answers (issue "Limits people ask for, round two", items 2
and 3), on both hosts, local and global:

- `response_cost.reserve`: an LLM call reserves tokens up front, all or nothing, and the
  answer's `x-llm-tokens` settles it (the difference given back or owed). 20 concurrent
  calls on a budget of 1,000 with a reservation of 200: at most 5 pass, and the budget ends
  charged the sum of the answers' costs; without `reserve` all 20 pass on the last tokens.
- `count: {status: [401]}`: only failed logins are counted: 5 an hour per account, on a
  fake login upstream (the demo's `/signin?password=P`)."""

from __future__ import annotations

from harness import Quota, errors, record, request, send_concurrent, statuses

LLM = """
resources:
  - Url: /llm
    rules:
      - name: llm_tokens
        actor: account
        algo: TB
        unit: hour
        rpu: 1000
        scope: {scope}
{extra}        response_cost: {{header: x-llm-tokens, max: 100000{reserve}}}
response: {{status: 429}}
global: {{timeout_ms: 500}}
"""

LOGIN = """
resources:
  - Url: /signin
    rules:
      - name: failed_logins
        actor: account
        algo: W
        unit: hour
        rpu: 5
        scope: {scope}
        count: {{status: [401, 403]}}
response: {{status: 429}}
global: {{timeout_ms: 500}}
"""


def llm_doc(scope: str, reserve: bool) -> str:
    extra = "        lease: 200\n" if scope == "global" else ""
    return LLM.format(scope=scope, extra=extra, reserve=", reserve: 200" if reserve else "")


def gateway(procs, start_gateway, doc: str, scope: str):
    if scope == "global":
        quota = procs.add(Quota(procs.log_dir)).start()
        return start_gateway(doc, quota_port=quota.port)
    return start_gateway(doc)


def test_a_reservation_keeps_concurrent_llm_calls_within_the_budget(procs, start_gateway):
    for scope in ("local", "global"):
        gw = gateway(procs, start_gateway, llm_doc(scope, reserve=True), scope)
        account = {"x-account-id": f"reserving-{scope}"}
        # 20 calls in flight at once (each answered after 500 ms, using 120 tokens).
        burst = send_concurrent(gw.port, 20, "/llm?tokens=120&delay_ms=500", account, timeout=15)
        assert not errors(burst), errors(burst)
        seen = statuses(burst)
        # Settled: 5 x 120 = 600 charged, 400 left: two more reservations of 200 pass.
        after = [request(gw.port, "/llm?tokens=200", account).status for _ in range(3)]
        global_events = {k: v for k, v in gw.diana_metrics(settle=0).items() if k.startswith("diana_global") and v}
        record(
            f"{gw.label}: budget 1000/hour, reserve 200, 20 concurrent calls of 120 tokens ({scope})",
            f"{seen}; then 3 calls -> {after}; {global_events}",
        )
        assert seen == {200: 5, 429: 15}, seen
        assert after == [200, 200, 429], after


def test_without_a_reservation_concurrent_calls_overshoot_the_budget(start_gateway):
    gw = start_gateway(llm_doc("local", reserve=False))
    account = {"x-account-id": "not-reserving"}
    burst = send_concurrent(gw.port, 20, "/llm?tokens=120&delay_ms=500", account, timeout=15)
    assert not errors(burst), errors(burst)
    seen = statuses(burst)
    after = request(gw.port, "/llm?tokens=1", account).status
    record(
        f"{gw.label}: budget 1000/hour without reserve, 20 concurrent calls of 120 tokens",
        f"{seen} (charged 20 + 20 x 120 = 2,420 of 1,000); then -> {after}",
    )
    # Each took 1 token up front: all pass, and the answers leave the budget in debt.
    assert seen == {200: 20}, seen
    assert after == 429


def test_only_failed_logins_are_counted(procs, start_gateway):
    for scope in ("local", "global"):
        gw = gateway(procs, start_gateway, LOGIN.format(scope=scope), scope)
        erin = {"x-account-id": f"erin-{scope}"}

        def login(password: str, who: dict = erin) -> int:
            return request(gw.port, f"/signin?password={password}", who).status

        successes = [login("right") for _ in range(10)]
        failures = [login("guess") for _ in range(6)]
        locked = login("right")
        other = login("right", {"x-account-id": f"frank-{scope}"})
        record(
            f"{gw.label}: 5 failed logins an hour per account ({scope})",
            f"10 good -> {set(successes)}; 6 wrong -> {failures}; then good -> {locked}; another account -> {other}",
        )
        assert successes == [200] * 10, successes
        assert failures == [401] * 5 + [429], failures
        assert (locked, other) == (429, 200)


def test_concurrent_wrong_passwords_cannot_all_take_the_last_attempt(start_gateway):
    gw = start_gateway(LOGIN.format(scope="local"))
    grace = {"x-account-id": "grace"}
    first = [request(gw.port, "/signin?password=guess", grace).status for _ in range(4)]
    burst = send_concurrent(gw.port, 10, "/signin?password=guess", grace)
    assert not errors(burst), errors(burst)
    seen = statuses(burst)
    record(f"{gw.label}: 4 failed logins, then 10 concurrent wrong passwords", f"{first}; {seen}")
    assert first == [401] * 4
    assert seen == {401: 1, 429: 9}, seen
