"""Costs (DESIGN §3 `cost`, `response_cost`; §4 Cost), on both gateways: a request's cost
from a header, all or nothing; an LLM token budget charged from the upstream's answer
(`x-llm-tokens`, sent by the demo upstream's `/llm?tokens=N`), past the limit, so that
the identity owes until the budget has refilled; and the same budget global, across two
gateways sharing diana-quota."""

from __future__ import annotations

import pytest

from harness import Quota, quota_counter, record, request, wait_until

BUDGET = """
resources:
  - Url: /llm
    rules:
      - name: llm_tokens
        actor: account
        algo: TB
        unit: hour
        rpu: 1000
        scope: {scope}
        response_cost: {{header: x-llm-tokens, max: 100000}}
response: {{status: 429}}
global: {{timeout_ms: 200}}
"""


def statuses_of(port: int, paths: list[str], account: str) -> list[int]:
    return [request(port, p, {"x-account-id": account}).status for p in paths]


def test_a_request_cost_from_a_header_all_or_nothing(start_gateway):
    gw = start_gateway(
        """
resources:
  - Url: /
    rules:
      - {name: weighted, actor: all, algo: W, unit: hour, rpu: 10, cost: {header: x-cost, default: 1, max: 8}}
  - Url: /batch
    rules:
      - {name: batches, actor: all, algo: W, unit: hour, rpu: 2}
"""
    )
    seen = [request(gw.port, "/", {"x-cost": c}).status for c in ("4", "4", "4", "junk", "1")]
    # 4 + 4 = 8; a third 4 does not fit (2 left) and takes nothing; "junk" is the default 1.
    assert seen == [200, 200, 503, 200, 200], seen
    # A batch of cost 8 rejected by /batch after `/` admitted it gives its 8 back.
    gw2 = start_gateway(
        """
resources:
  - Url: /
    rules:
      - {name: weighted, actor: all, algo: W, unit: hour, rpu: 10, cost: {header: x-cost, default: 1, max: 8}}
  - Url: /batch
    rules:
      - {name: batches, actor: all, algo: W, unit: hour, rpu: 1}
"""
    )
    batches = [request(gw2.port, "/batch", {"x-cost": "8"}).status for _ in range(4)]
    after = [request(gw2.port, "/", {"x-cost": "2"}).status for _ in range(2)]
    record(f"{gw.label}: cost from x-cost (W rpu 10)", f"4,4,4,junk,1 -> {seen}; /batch x4 cost 8 -> {batches}; then / cost 2 -> {after}")
    assert batches == [200, 503, 503, 503], batches
    assert after == [200, 503], after  # 10 - 8 = 2 left, not 10 - 4 x 8


def test_an_llm_token_budget_charged_from_the_answer(start_gateway):
    gw = start_gateway(BUDGET.format(scope="local"))
    alice = statuses_of(gw.port, ["/llm?tokens=600", "/llm?tokens=600", "/llm?tokens=10"], "alice")
    bob = statuses_of(gw.port, ["/llm?tokens=10"], "bob")
    record(f"{gw.label}: token budget 1000/hour (local)", f"alice 600, 600, 10 -> {alice}; bob 10 -> {bob}")
    # 1000 - 601 = 399 left: the second passes (it needs 1), then owes 202: denied.
    assert alice == [200, 200, 429], alice
    assert bob == [200], bob


def test_an_llm_token_budget_shared_by_two_gateways(procs, start_gateway):
    quota = procs.add(Quota(procs.log_dir)).start()
    doc = BUDGET.format(scope="global")
    one, two = start_gateway(doc, quota_port=quota.port), start_gateway(doc, quota_port=quota.port)
    charged = lambda: quota_counter(quota.port, "diana_quota_tokens_charged_total")  # noqa: E731
    first = request(one.port, "/llm?tokens=900", {"x-account-id": "carol"}).status
    # The cost is sent from gateway one's tick (within about a second): wait until
    # diana-quota has charged it.
    wait_until(lambda: charged() >= 899, 15, "the 899 tokens owed after the first answer charged")
    second = request(two.port, "/llm?tokens=200", {"x-account-id": "carol"}).status
    wait_until(lambda: charged() >= 899 + 199, 15, "the 199 tokens owed after the second answer charged")
    third = request(one.port, "/llm?tokens=1", {"x-account-id": "carol"}).status
    other = request(two.port, "/llm?tokens=1", {"x-account-id": "dave"}).status
    record(
        f"{one.label}: token budget 1000/hour global over 2 gateways",
        f"carol 900 on one -> {first}, 200 on two -> {second}, then 1 on one -> {third}; dave -> {other}",
    )
    # 1000 - 1 - 900 = 99 left when gateway two asks: admitted; then 99 - 1 - 200 < 0.
    assert (first, second, third, other) == (200, 200, 429, 200)
