"""The rejection response and rate-limit headers (docs/design.md §4 "Rejection"), the IETF
RateLimit fields read with a structured-field parser (PyPI `http-sf`), dry run, and the
rule-labelled Prometheus output of Envoy's admin.

Metric names: Envoy shows a proxy-wasm metric as `wasmcustom.<name>`, a flat string.
The exact names are listed in the README "Metrics" section (now `diana_rule_allowed.<rule>`,
`diana_rule_limited.<rule>`, `diana_rule_dry_run_limited.<rule>`); harness.rule_metric
accepts any name that holds the counter's kind and ends with the rule name."""

from __future__ import annotations

import re
import time

import pytest

from harness import METRICS_LAG_S, http_get, record, request, rule_metric, send_concurrent, statuses


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
    record(f"{gw.label}: default rejection headers", {k: no.header(k) for k in ("retry-after",) + RATELIMIT_HEADERS})
    m = gw.diana_metrics()
    record(f"{gw.label}: metrics after 1 allowed + 1 limited", {k: v for k, v in m.items() if "one_per_hour" in k})
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


def _three_per_hour(start_gateway, header_style: str = ""):
    """A gateway with one rule, 3 per hour, and `headers: all` in `header_style`."""
    style = f"\n  header_style: {header_style}" if header_style else ""
    return start_gateway(
        f"""\
resources:
  - Url: /
    rules:
      - {{name: three_per_hour, actor: all, unit: hour, rpu: 3}}
response:
  headers: all{style}
"""
    )


def test_headers_all_on_admitted_responses(start_gateway):
    gw = _three_per_hour(start_gateway)
    seen = [request(gw.port, "/") for _ in range(4)]
    assert [r.status for r in seen] == [200, 200, 200, 503]
    remaining = [_int_header(r, "x-ratelimit-remaining") for r in seen]
    record(f"{gw.label}: headers: all, remaining after each of 4 requests (rpu 3)", remaining)
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
    record(f"{gw.label}: document dry run metrics (6 requests, rpu 2)", {k: v for k, v in m.items() if "dry_doc" in k})
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
    record(f"{gw.label}: rule dry run metrics (6 requests, rpu 2)", {k: v for k, v in m.items() if k.startswith("diana_rule")})
    assert rule_metric(m, "dry_run_limited", "dry_rule") == 4, m
    assert rule_metric(m, "limited", "dry_rule") == 0, m
    # the dry-run rule's would-be rejections did not stop the next rule from being charged
    assert rule_metric(m, "allowed", "enforced") == 6, m
    assert rule_metric(m, "limited", "enforced") == 0, m


# --------------------------------------------------------------------------- IETF fields

IETF_HEADERS = ("ratelimit-policy", "ratelimit")


def _sf_list(r, name: str) -> list:
    """A structured-field List (RFC 8941) parsed by a real parser: [(item, {param: value})]."""
    import http_sf  # scripts/install-deps installs it (tests/e2e/requirements-extra.txt)

    raw = r.header(name)
    assert raw is not None, f"missing {name}: {r.headers}"
    parsed = http_sf.parse(raw.encode("ascii"), tltype="list")
    assert isinstance(parsed, list) and parsed, f"{name}: {raw!r} is not a non-empty List"
    return parsed


def _one_item(r, name: str) -> tuple[str, dict]:
    items = _sf_list(r, name)
    assert len(items) == 1, f"{name}: one policy expected, got {items}"
    value, params = items[0]
    assert isinstance(value, str), f"{name}: the item must be a String naming the rule, got {value!r}"
    for key, v in params.items():
        assert isinstance(v, int) and not isinstance(v, bool), f"{name}: parameter {key}={v!r} is not an Integer"
    return value, params


# A rule name that needs escaping in an sf-string: double quotes and a backslash (written in
# YAML single quotes, where both are literal).
TRICKY_NAME = 'per-hour "api" \\ v1'


def test_ietf_fields_on_rejection(start_gateway):
    gw = start_gateway(
        f"""\
resources:
  - Url: /
    rules:
      - {{name: '{TRICKY_NAME}', actor: all, unit: hour, rpu: 2}}
response:
  status: 429
  header_style: ietf
"""
    )
    admitted = [request(gw.port, "/") for _ in range(2)]
    no = request(gw.port, "/")
    assert [r.status for r in admitted] == [200, 200], admitted
    for r in admitted:  # headers: limited (default) -> nothing on admitted answers
        for h in IETF_HEADERS + RATELIMIT_HEADERS:
            assert r.header(h) is None, r.headers
    assert no.status == 429, no
    for h in RATELIMIT_HEADERS:  # ietf instead of X-RateLimit-*
        assert no.header(h) is None, no.headers
    retry = _int_header(no, "retry-after")
    name, policy = _one_item(no, "ratelimit-policy")
    assert name == TRICKY_NAME, (name, TRICKY_NAME)
    assert policy == {"q": 2, "w": 3600}, policy
    name, limit = _one_item(no, "ratelimit")
    assert name == TRICKY_NAME
    assert set(limit) == {"r", "t"}, limit
    assert limit["r"] == 0
    # On a rejection, t is the wait until a request would be admitted: Retry-After itself.
    assert limit["t"] == retry and 1 <= retry <= 3600, (limit, retry)
    record(f"{gw.label}: ietf rejection headers", {h: no.header(h) for h in ("retry-after",) + IETF_HEADERS})


def test_both_styles_and_headers_all(start_gateway):
    gw = _three_per_hour(start_gateway, "both")
    seen = [request(gw.port, "/") for _ in range(4)]
    assert [r.status for r in seen] == [200, 200, 200, 503]
    assert [_int_header(r, "x-ratelimit-remaining") for r in seen] == [2, 1, 0, 0]
    no = seen[3]
    assert _int_header(no, "x-ratelimit-limit") == 3
    assert _one_item(no, "ratelimit-policy") == ("three_per_hour", {"q": 3, "w": 3600})
    name, limit = _one_item(no, "ratelimit")
    assert name == "three_per_hour" and limit["r"] == 0
    assert limit["t"] == _int_header(no, "retry-after")
    record(f"{gw.label}: header_style both, rejection", {h: no.header(h) for h in ("retry-after",) + RATELIMIT_HEADERS + IETF_HEADERS})


def test_ietf_fields_on_admitted_answers(start_gateway):
    gw = _three_per_hour(start_gateway, "ietf")
    seen = [request(gw.port, "/") for _ in range(3)]
    assert [r.status for r in seen] == [200, 200, 200]
    for r, remaining in zip(seen, [2, 1, 0]):
        for h in RATELIMIT_HEADERS:
            assert r.header(h) is None, r.headers
        assert r.header("retry-after") is None
        assert _one_item(r, "ratelimit-policy") == ("three_per_hour", {"q": 3, "w": 3600})
        name, limit = _one_item(r, "ratelimit")
        assert name == "three_per_hour"
        assert limit["r"] == remaining
        # Admitted: t is the time until the limit has recovered (within the hour).
        assert 1 <= limit["t"] <= 3600, limit
    record(f"{gw.label}: ietf fields on admitted answers", [{h: r.header(h) for h in IETF_HEADERS} for r in seen])


# --------------------------------------------------------------------------- Prometheus


def _prometheus_samples(text: str) -> dict[tuple[str, tuple], int]:
    """`family{a="x",b="y"} 5` -> {("family", (("a", "x"), ("b", "y"))): 5}."""
    out: dict[tuple[str, tuple], int] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        assert m, f"not a Prometheus sample line: {line!r}"
        labels = tuple(sorted(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        value = float(m.group(3))
        out[(m.group(1), labels)] = int(value) if value.is_integer() else value
    return out


def test_envoy_prometheus_labels_rule_counters(start_envoy):
    """Envoy's /stats/prometheus shows Diana's rule counters as one metric per kind with a
    `rule` label (stats_config.stats_tags of `diana render-envoy`), the same names and
    label as the filter's own metrics path."""
    gw = start_envoy(
        """\
resources:
  - Url: /
    rules:
      - {name: login-burst, actor: all, unit: hour, rpu: 2}
      - {name: site_dry, actor: all, unit: hour, rpu: 1, dry_run: true}
metrics:
  path: /__diana/metrics
"""
    )
    assert statuses([request(gw.port, "/") for _ in range(4)]) == {200: 2, 503: 2}
    time.sleep(METRICS_LAG_S)  # the workers hand their counts to Envoy from their ticks
    status, body, _ = http_get(gw.admin_port, "/stats/prometheus", timeout=5.0)
    assert status == 200
    samples = _prometheus_samples(body.decode())
    diana = {k: v for k, v in samples.items() if k[0].startswith("diana_rule")}
    record("envoy: /stats/prometheus rule counters", {f"{k[0]}{dict(k[1])}": v for k, v in sorted(diana.items())})
    expected = {
        ("diana_rule_allowed", (("rule", "login_burst"),)): 2,
        ("diana_rule_limited", (("rule", "login_burst"),)): 2,
        ("diana_rule_dry_run_limited", (("rule", "login_burst"),)): 0,
        # The dry-run rule is charged only for the requests the first rule admitted.
        ("diana_rule_allowed", (("rule", "site_dry"),)): 1,
        ("diana_rule_limited", (("rule", "site_dry"),)): 0,
        ("diana_rule_dry_run_limited", (("rule", "site_dry"),)): 1,
    }
    assert diana == expected, diana
    # No metric per rule is left over (the untagged names would be diana_rule_allowed_login_burst).
    assert not [k for k in samples if "login_burst" in k[0] or "site_dry" in k[0]], samples
    # /stats keeps the full names.
    assert gw.diana_metrics()["diana_rule_allowed.login_burst"] == 2
    # The filter's own metrics path (how nginx is read) has the same families and label.
    status, own, _ = http_get(gw.port, "/__diana/metrics", timeout=5.0)
    assert status == 200
    own_rules = {k: v for k, v in _prometheus_samples(own.decode()).items() if k[0].startswith("diana_rule")}
    assert own_rules == expected, own_rules


def test_every_rejection_in_a_burst_says_the_real_wait(start_gateway):
    """Issue 20.1: a rejection answered from a worker's remembered denial said
    `Retry-After: 1` while `X-RateLimit-Reset` said 55. Every rejection of a burst, computed
    or remembered, now carries the real wait: Retry-After equals the reset of a fixed
    window (within a second of rounding)."""
    gw = start_gateway("Url: /\nrules:\n  - {name: five_a_minute, actor: all, unit: minute, rpu: 5, algo: W}\n")
    # Windows are aligned to the epoch's minutes: start the burst well inside one.
    into_minute = time.time() % 60
    if into_minute > 50:
        time.sleep(60.2 - into_minute)
    answers = [request(gw.port, "/") for _ in range(25)]
    assert [r.status for r in answers[:5]] == [200] * 5, [r.status for r in answers]
    rejected = answers[5:]
    assert all(r.status == 503 for r in rejected), [r.status for r in rejected]
    pairs = [(_int_header(r, "retry-after"), _int_header(r, "x-ratelimit-reset")) for r in rejected]
    record(f"{gw.label}: Retry-After / X-RateLimit-Reset of 20 rejections in a burst", pairs)
    for retry, reset in pairs:
        assert abs(retry - reset) <= 1 and retry >= 1, pairs
    # The burst started at least 10 s before the window's end.
    assert min(retry for retry, _ in pairs) >= 9, pairs
