"""Envoy's `rate_limit_quota` filter (RLQS, envoy.service.rate_limit_quota.v3) against
diana-quota on Redis: usage reports in, assignments out, on the same counters as RLS.

- a bucket gets the gateway's share, then DENY_ALL once the counter is spent; every
  request the gateway admitted is charged (an RLS gateway on the same descriptor then
  finds the budget spent);
- diana-quota killed: requests are never held, and the assignment expires into the
  bucket's configured behaviour.

Envoy 1.40 reports every 5 s whatever the buckets' reporting_interval says, so these tests
take a few seconds each."""

from __future__ import annotations

import time

import harness
from harness import Redis, record, statuses
from test_rls import grpc_service, header_action, native, ratelimit_filter, rls_quota, tenant, wait_for_fresh_hour

HEADER_INPUT = "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput"


def quota_filter(domain: str = "edge", *, expired: str = "DENY_ALL", reporting: str = "1s") -> dict:
    """envoy.filters.http.rate_limit_quota (as docs/rls.md shows it): requests with an
    `x-tenant` header go to the bucket {tenant: <header>}; ALLOW_ALL until the first
    assignment, `expired` once an assignment expired."""
    settings = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings",
        "bucket_id_builder": {
            "bucket_id_builder": {
                "tenant": {"custom_value": {"name": "tenant", "typed_config": {"@type": HEADER_INPUT, "header_name": "x-tenant"}}}
            }
        },
        "reporting_interval": reporting,
        "no_assignment_behavior": {"fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"}},
        # Without a timeout Envoy leaves the fallback at once for no_assignment_behavior.
        "expired_assignment_behavior": {
            "fallback_rate_limit": {"blanket_rule": expired},
            "expired_assignment_behavior_timeout": "60s",
        },
    }
    matcher = {
        "matcher_list": {
            "matchers": [
                {
                    "predicate": {
                        "single_predicate": {
                            "input": {"name": "tenant", "typed_config": {"@type": HEADER_INPUT, "header_name": "x-tenant"}},
                            "value_match": {"safe_regex": {"google_re2": {}, "regex": ".+"}},
                        }
                    },
                    "on_match": {"action": {"name": "rate_limit_quota", "typed_config": settings}},
                }
            ]
        }
    }
    return {
        "name": "envoy.filters.http.rate_limit_quota",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig",
            "rlqs_server": grpc_service(),
            "domain": domain,
            "bucket_matchers": matcher,
        },
    }


CONFIG = """
domain: edge
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 10}
"""


def test_buckets_get_a_share_then_deny_all_on_the_shared_counter(procs, upstream):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = rls_quota(procs, CONFIG, redis.url)
    gateway = native(procs, upstream, quota, filters=[quota_filter()], name="rlqs")
    rls = native(procs, upstream, quota, filters=[ratelimit_filter()], rate_limits=[[header_action("x-tenant", "tenant")]], name="rls")
    wait_for_fresh_hour()
    who = {"x-tenant": tenant()}
    # The bucket's first request is admitted before any assignment (no_assignment_behavior
    # ALLOW_ALL) and reported at once; the assignment (the share, at most the 9 left)
    # follows within milliseconds.
    first = [harness.request(gateway.port, "/", who)]
    time.sleep(0.5)
    first += [harness.request(gateway.port, "/", who) for _ in range(24)]
    assert not harness.errors(first), harness.errors(first)[:3]
    admitted = sum(1 for r in first if r.status == 200)
    assert statuses(first) == {200: 10, 429: 15}, statuses(first)
    # At the next report (Envoy 1.40 reports every 5 s) every admitted request is charged
    # and the counter is spent: DENY_ALL here, OVER_LIMIT for the RLS gateway on the same
    # descriptor.
    time.sleep(5.5)
    later = [harness.request(gateway.port, "/", who) for _ in range(10)]
    assert statuses(later) == {429: 10}, statuses(later)
    assert harness.request(rls.port, "/", who).status == 429
    # Another tenant: its own bucket, its own budget.
    other = [harness.request(gateway.port, "/", {"x-tenant": tenant()}) for _ in range(5)]
    assert statuses(other) == {200: 5}, statuses(other)
    record("rlqs_share_then_deny", {"sent": 25, "admitted": admitted, "limit": 10})


def test_killing_diana_quota_never_holds_a_request(procs, upstream):
    redis = procs.add(Redis(procs.log_dir)).start()
    quota = rls_quota(procs, CONFIG.replace("10}", "100000}"), redis.url)
    gateway = native(procs, upstream, quota, filters=[quota_filter(expired="DENY_ALL")], name="rlqs")
    who = {"x-tenant": tenant()}
    warm = [harness.request(gateway.port, "/", who) for _ in range(5)]
    assert statuses(warm) == {200: 5}, statuses(warm)
    quota.stop()
    killed = time.monotonic()
    seen: list[tuple[float, int]] = []
    slowest = 0.0
    while time.monotonic() - killed < 12:
        r = harness.request(gateway.port, "/", who, timeout=5)
        assert r.status in (200, 429), r
        slowest = max(slowest, r.latency)
        seen.append((time.monotonic() - killed, r.status))
        if r.status == 429:
            break
        time.sleep(0.1)
    assert slowest < 1.0, slowest
    # The last assignment lived for a reporting interval + 2 s (7 s): then DENY_ALL (the
    # bucket's expired_assignment_behavior).
    assert seen and seen[-1][1] == 429, seen[-5:]
    record("rlqs_quota_killed", {"expired_after_s": round(seen[-1][0], 2), "slowest_s": round(slowest, 3)})
