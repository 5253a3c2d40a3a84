"""The rejection response and rate-limit headers (DESIGN §4 "Rejection"), and dry run.

Metric names: Envoy shows a proxy-wasm metric as `wasmcustom.<name>`, a flat string.
The exact names are listed in the README "Metrics" section (now `diana_rule_allowed.<rule>`,
`diana_rule_limited.<rule>`, `diana_rule_dry_run_limited.<rule>`); harness.rule_metric
accepts any name that holds the counter's kind and ends with the rule name."""

from __future__ import annotations

from harness import record, request, rule_metric, send_concurrent, statuses


def _int_header(r, name: str) -> int:
    v = r.header(name)
    assert v is not None, f"missing {name}: {r.headers}"
    assert v.strip().isdigit(), f"{name}: {v!r} is not delta-seconds / an integer"
    return int(v)


RATELIMIT_HEADERS = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")


def test_default_rejection_is_503_with_headers(start_gateway):
    gw = start_gateway("Url: /\nrules:\n  - {name: one_per_hour, actor: all, unit: hour, rpu: 1}\n")
    ok = request(gw.port, "/")
    no = request(gw.port, "/")
    assert ok.status == 200, ok
    for h in RATELIMIT_HEADERS:  # headers: limited (default) -> only on rejections
        assert ok.header(h) is None, ok.headers
    assert no.status == 503, no
    assert no.body == b"rate limited\n"
    retry = _int_header(no, "retry-after")
    assert retry >= 1
    assert _int_header(no, "x-ratelimit-limit") == 1
    assert _int_header(no, "x-ratelimit-remaining") == 0
    reset = _int_header(no, "x-ratelimit-reset")
    assert 1 <= reset <= 3600 and 1 <= retry <= 3600, (retry, reset)
    record(f"{gw.kind}: default rejection headers", {k: no.header(k) for k in ("retry-after",) + RATELIMIT_HEADERS})
    m = gw.diana_metrics()
    record(f"{gw.kind}: metrics after 1 allowed + 1 limited", {k: v for k, v in m.items() if "one_per_hour" in k})
    assert m, "no diana_ metrics"
    assert rule_metric(m, "limited", "one_per_hour") == 1, m
    assert rule_metric(m, "allowed", "one_per_hour") == 1, m


def test_custom_status_body_and_no_ratelimit_headers(start_gateway):
    gw = start_gateway(
        """\
resources:
  - Url: /
    rules:
      - {name: one_per_hour, actor: all, unit: hour, rpu: 1}
response:
  status: 429
  body: "slow down\\n"
  headers: none
"""
    )
    assert request(gw.port, "/").status == 200
    no = request(gw.port, "/")
    assert no.status == 429, no
    assert no.body == b"slow down\n"
    assert _int_header(no, "retry-after") >= 1  # always sent on a rejection
    for h in RATELIMIT_HEADERS:
        assert no.header(h) is None, no.headers


def test_headers_all_on_admitted_responses(start_gateway):
    gw = start_gateway(
        """\
resources:
  - Url: /
    rules:
      - {name: three_per_hour, actor: all, unit: hour, rpu: 3}
response:
  headers: all
"""
    )
    seen = [request(gw.port, "/") for _ in range(4)]
    assert [r.status for r in seen] == [200, 200, 200, 503]
    remaining = [_int_header(r, "x-ratelimit-remaining") for r in seen]
    record(f"{gw.kind}: headers: all, remaining after each of 4 requests (rpu 3)", remaining)
    for r in seen:
        assert _int_header(r, "x-ratelimit-limit") == 3
        _int_header(r, "x-ratelimit-reset")
    assert remaining == [2, 1, 0, 0]
    assert seen[0].header("retry-after") is None
    assert _int_header(seen[3], "retry-after") >= 1


def test_document_dry_run_never_rejects_and_counts(start_gateway):
    gw = start_gateway(
        """\
resources:
  - Url: /
    rules:
      - {name: dry_doc, actor: all, unit: hour, rpu: 2}
dry_run: true
"""
    )
    resps = send_concurrent(gw.port, 6, "/")
    assert statuses(resps) == {200: 6}
    m = gw.diana_metrics()
    record(f"{gw.kind}: document dry run metrics (6 requests, rpu 2)", {k: v for k, v in m.items() if "dry_doc" in k})
    assert rule_metric(m, "dry_run_limited", "dry_doc") == 4, m
    assert rule_metric(m, "limited", "dry_doc") == 0, m
    assert rule_metric(m, "allowed", "dry_doc") == 2, m


def test_rule_dry_run_never_rejects_and_counts(start_gateway):
    gw = start_gateway(
        """\
resources:
  - Url: /
    rules:
      - {name: dry_rule, actor: all, unit: hour, rpu: 2, dry_run: true}
      - {name: enforced, actor: all, unit: hour, rpu: 100}
"""
    )
    resps = send_concurrent(gw.port, 6, "/")
    assert statuses(resps) == {200: 6}
    m = gw.diana_metrics()
    record(f"{gw.kind}: rule dry run metrics (6 requests, rpu 2)", {k: v for k, v in m.items() if k.startswith("diana_rule")})
    assert rule_metric(m, "dry_run_limited", "dry_rule") == 4, m
    assert rule_metric(m, "limited", "dry_rule") == 0, m
    # the dry-run rule's would-be rejections did not stop the next rule from being charged
    assert rule_metric(m, "allowed", "enforced") == 6, m
    assert rule_metric(m, "limited", "enforced") == 0, m
