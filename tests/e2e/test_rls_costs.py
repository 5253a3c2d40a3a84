"""Issue 41, item 1: costs known after the response, spent through Envoy 1.40's own
`envoy.filters.http.ratelimit` filter against diana-quota on Redis, as Envoy Gateway's
response costs and LLM token budgets spend them:

- at request time a descriptor with `hits_addend: 0`: a check, refused once the budget is
  spent;
- when the stream ends (`apply_on_stream_done`) the same descriptor with the response's
  cost, from the upstream's `x-llm-tokens` header (through `header_to_metadata`, read by
  `hits_addend.format`), counted whatever is left, as envoyproxy/ratelimit counts it.

Before: every check was OK and a charge that did not fit counted nothing, so a budget of 5
an hour let every request through at a cost of 4 each."""

from __future__ import annotations

import re
import time
import urllib.parse

import harness
from harness import Redis, record
from test_rls import header_action, native, ratelimit_filter, rls_quota, tenant, wait_for_fresh_hour

BUDGET = """
domain: edge
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 5}
"""


COST_NAMESPACE = "diana.costs"


def cost_from_response_header(header: str) -> dict:
    """`header_to_metadata` on the response: the upstream's `header` becomes the dynamic
    metadata `diana.costs/tokens`, which the stream-end descriptor's `hits_addend` reads
    (Envoy 1.40 formats `hits_addend` with the request's headers only)."""
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "response_rules": [
                {"header": header, "on_header_present": {"metadata_namespace": COST_NAMESPACE, "key": "tokens", "type": "STRING"}}
            ],
        },
    }


def post_hoc_costs() -> dict:
    """The route's rate limits (`RateLimitPerRoute.rate_limits`: Envoy 1.40 reads
    `hits_addend` and `apply_on_stream_done` there): a check at request time, the
    response's cost when the stream ends."""
    tenant_action = [header_action("x-tenant", "tenant")]
    return {
        "envoy.filters.http.ratelimit": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
            "rate_limits": [
                {"actions": tenant_action, "hits_addend": {"number": 0}},
                {
                    "actions": tenant_action,
                    "apply_on_stream_done": True,
                    "hits_addend": {"format": f"%DYNAMIC_METADATA({COST_NAMESPACE}:tokens)%"},
                },
            ],
        }
    }


def admin_counters(admin_port: int, pattern: str) -> dict[str, int]:
    """Envoy's counters whose name matches `pattern`."""
    status, body, _ = harness.http_get(admin_port, "/stats?filter=" + urllib.parse.quote(pattern, safe=""), timeout=5.0)
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        name, sep, value = line.rpartition(": ")
        if sep and re.fullmatch(r"\d+", value.strip()):
            out[name] = int(value)
    return out


def test_a_request_time_check_and_a_stream_end_cost_spend_one_budget(procs, upstream):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = rls_quota(procs, BUDGET, redis.url)
    gateway = native(
        procs, upstream, quota,
        filters=[ratelimit_filter(x_ratelimit_headers=False), cost_from_response_header("x-llm-tokens")],
        route_filter_config=post_hoc_costs(),
    )  # fmt: skip
    wait_for_fresh_hour()
    who = {"x-tenant": tenant()}
    served = []
    for _ in range(6):
        served.append(harness.request(gateway.port, "/llm?tokens=4", who, timeout=10).status)
        # The cost is charged when the stream ends, after the answer: let it land.
        time.sleep(0.3)
    calls = admin_counters(gateway.admin_port, r"cluster\.upstream\.ratelimit\.")
    passed = served.count(200)
    print(f"budget 5/hour, 6 requests costing 4 when they end: {served}; Envoy's filter: {calls}")
    # Two checks pass (0 and 4 counted: something left), the charges count 8, every later
    # check is refused.
    assert served == [200, 200, 429, 429, 429, 429], served
    # Another tenant has its own 5.
    assert harness.request(gateway.port, "/llm?tokens=4", {"x-tenant": tenant()}).status == 200
    # The counter in Redis holds the 8 served: the second charge went past the limit.
    keys = [k for k in harness.redis_cli(redis.port, "--scan", "--pattern", "diana:{rls:*").split() if k]
    counts = sorted(int(harness.redis_cli(redis.port, "HGET", key, "c").strip() or 0) for key in keys)
    assert counts == [4, 8], counts
    record(
        "rls_post_hoc_costs",
        {"budget": 5, "cost": 4, "requests": 6, "passed": passed, "served": passed * 4, "counted": counts[-1]},
    )
