"""Calendar budgets (`unit: week | month` in a `timezone`, README "LLM budgets"), on every
gateway: a month's budget of 3 per account, local on one gateway and global over two
gateways sharing diana-quota (each gateway names the period in its call, diana-quota counts
by the period's start): 3 admitted, the 4th refused with Retry-After = the seconds left in
the month in the rule's zone."""

from __future__ import annotations

import datetime
import time
from zoneinfo import ZoneInfo

import pytest

from harness import Quota, record, request

DOC = """
resources:
  - Url: /
    rules:
      - {{name: monthly, actor: account, algo: W, unit: month, timezone: {zone}, rpu: 3, scope: {scope}}}
response: {{status: 429}}
global: {{timeout_ms: 500}}
"""
ZONE = "Pacific/Auckland"  # far from UTC: a month that ends at another UTC instant


def month_bounds(zone: str) -> tuple[datetime.datetime, datetime.datetime, datetime.datetime]:
    """Now in `zone`, the first instant of its month there, and of the next month."""
    now = datetime.datetime.now(ZoneInfo(zone))
    first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    nxt = (first + datetime.timedelta(days=32)).replace(day=1)
    return now, first, nxt


def seconds_to_next_month(zone: str) -> float:
    now, _, nxt = month_bounds(zone)
    return nxt.timestamp() - now.timestamp()


def check(statuses: list[int], refused, expected: float) -> None:
    assert statuses == [200, 200, 200, 429], statuses
    retry = int(refused.header("retry-after"))
    # Whole seconds, rounded up, with a second of slack for the time between them.
    assert expected - 2 <= retry <= expected + 2, (retry, expected)


@pytest.mark.parametrize("scope", ["local", "global"])
def test_a_months_budget_lasts_the_month_in_its_zone(procs, start_gateway, scope):
    if seconds_to_next_month(ZONE) < 120:
        time.sleep(seconds_to_next_month(ZONE) + 2)
    doc = DOC.format(zone=ZONE, scope=scope)
    if scope == "global":
        quota = procs.add(Quota(procs.log_dir)).start()
        one, two = start_gateway(doc, quota_port=quota.port), start_gateway(doc, quota_port=quota.port)
    else:
        one = two = start_gateway(doc)
    who = {"x-account-id": f"monthly-{scope}-{time.time_ns()}"}
    answers = [request(gw.port, "/", who) for gw in (one, two, one, two)]
    expected = seconds_to_next_month(ZONE)
    statuses = [a.status for a in answers]
    record(
        f"{one.label}: a month's budget of 3 ({ZONE}), {scope}",
        f"{statuses}, Retry-After {answers[-1].header('retry-after')} (the month ends in {expected:.0f} s)",
    )
    check(statuses, answers[-1], expected)
