"""Plans (issue "Limits people ask for, round two", item 5): a rule's limit chosen per
request from a header the auth layer sets (`rpu: {by: x-plan, values: {...}, default: N}`),
each plan counted on its own counter, locally and through diana-quota, on both hosts."""

from __future__ import annotations

from harness import Quota, record, request

PLANS = """
resources:
  - Url: /
    rules:
      - name: api
        actor: account
        algo: {algo}
        unit: hour
        scope: {scope}
        rpu: {{by: x-plan, values: {{free: 2, pro: 5}}, default: 1}}
response: {{status: 429}}
global: {{timeout_ms: 500}}
"""


def admitted(port: int, account: str, plan: str | None, n: int) -> int:
    headers = {"x-account-id": account}
    if plan is not None:
        headers["x-plan"] = plan
    return sum(request(port, "/", headers).status == 200 for _ in range(n))


def run(port: int) -> dict[str, int]:
    return {
        "free": admitted(port, "acme", "free", 6),
        "pro": admitted(port, "acme", "pro", 8),
        "unknown plan": admitted(port, "acme", "gold", 4),
        "no plan": admitted(port, "acme", None, 4),
        "other account, pro": admitted(port, "globex", "pro", 8),
    }


EXPECTED = {"free": 2, "pro": 5, "unknown plan": 1, "no plan": 0, "other account, pro": 5}


def test_each_plan_has_its_own_limit_and_counter(start_gateway):
    gw = start_gateway(PLANS.format(algo="W", scope="local"))
    seen = run(gw.port)
    record(f"{gw.label}: plans free 2, pro 5, default 1 per hour (local)", str(seen))
    assert seen == EXPECTED, seen
    metrics = gw.diana_metrics()
    # Metrics per plan: api.free, api.pro and api.default.
    counts = {plan: metrics.get(f"diana_rule_allowed.api_{plan}") for plan in ("free", "pro", "default")}
    assert counts == {"free": 2, "pro": 10, "default": 1}, metrics

def test_plans_of_a_global_rule_are_shared_by_gateways(procs, start_gateway):
    quota = procs.add(Quota(procs.log_dir)).start()
    doc = PLANS.format(algo="TB", scope="global")
    one, two = start_gateway(doc, quota_port=quota.port), start_gateway(doc, quota_port=quota.port)
    first = admitted(one.port, "initech", "pro", 3) + admitted(two.port, "initech", "pro", 5)
    free = admitted(two.port, "initech", "free", 2) + admitted(one.port, "initech", "free", 2)
    record(f"{one.label}: plans global over 2 gateways", f"pro 3 + 5 -> {first} admitted; free 2 + 2 -> {free}")
    assert (first, free) == (5, 2), (first, free)
