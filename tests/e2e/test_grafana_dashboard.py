"""The Grafana dashboard (dashboards/diana.json) asks only for metrics that exist: every
metric name in its PromQL (panels and template variables) is exported by a live
diana-quota (`/metrics`, after two gateways' reports, a decision and a refused call) or a
live gateway (Envoy's `/stats/prometheus`, with the `rule` tag `diana render-envoy` sets,
after a few requests through a global rule), and every label the query groups or matches
on is a label of that metric there. A renamed metric or label fails here, not on an
operator's screen during a flood."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Iterator

import harness
from harness import HOST, QUOTA_TOKEN, Quota, http_get, request

DASHBOARD = harness.REPO / "dashboards" / "diana.json"

# PromQL words that are not metric names.
FUNCTIONS = {
    "abs", "avg", "bottomk", "ceil", "changes", "clamp_max", "clamp_min", "count", "delta", "deriv",
    "floor", "group", "histogram_quantile", "idelta", "increase", "irate", "label_replace", "max",
    "min", "quantile", "rate", "round", "scalar", "sort", "sort_desc", "stddev", "sum", "time",
    "topk", "vector", "avg_over_time", "max_over_time", "min_over_time", "sum_over_time",
}  # fmt: skip
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""

    def walk(panels: list) -> Iterator[tuple[str, str]]:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    yield f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]
            yield from walk(panel.get("panels", []))

    yield from walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        # label_values(metric, label): the metric, with the label it must carry.
        m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", query)
        assert m, f"variable {variable['name']}: a query this test cannot read: {query}"
        yield f"variable {variable['name']}", f"max by ({m.group(2)}) ({m.group(1)})"


def metric_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = GROUPING.sub(r"\1", text)  # the labels of by (...), on (...)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+|ms|[smhdwy])?\b", "", text)  # numbers, offset durations
    return {word for word in IDENT.findall(text) if word not in FUNCTIONS and word not in KEYWORDS}


def label_names(expr: str) -> dict[str, set[str]]:
    """The labels an expression needs of each of its metrics: those its selector matches
    on, and those the expression groups by (every metric under a `by` must carry them)."""
    grouped: set[str] = set()
    for _, labels in GROUPING.findall(expr):
        grouped |= {label.strip() for label in labels.split(",") if label.strip()}
    needed = {name: set(grouped) for name in metric_names(expr)}
    for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", expr):
        needed.setdefault(name, set(grouped)).update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    return needed


def exposition(text: str) -> tuple[dict[str, set[str]], dict[str, str]]:
    """Prometheus or OpenMetrics text: {sample name: label names} and {family: type}."""
    samples: dict[str, set[str]] = {}
    families: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            families[name] = kind.strip()
        elif line and not line.startswith("#"):
            m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s", line)
            assert m, f"not a sample line: {line}"
            labels = set(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(2) or ""))
            samples.setdefault(m.group(1), set()).update(labels)
    return samples, families


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def declared(name: str, families: dict[str, str]) -> bool:
    """A family the exposition declares, though no sample of it was seen yet (a counter
    of failures that did not happen)."""
    for kind, suffixes in SUFFIXES.items():
        for suffix in suffixes:
            if name.endswith(suffix) and families.get(name[: -len(suffix)]) == kind:
                return True
    return families.get(name) is not None


GATEWAY_DOC = """
resources:
  - Url: /
    rules:
      - {name: per_device, actor: device, algo: TB, unit: hour, rpu: 3, scope: global}
      - {name: would_limit, actor: all, algo: TB, unit: hour, rpu: 1, scope: local, dry_run: true}
response: {status: 429}
global: {timeout_ms: 300}
"""


def report(gateway: str, degraded: bool) -> dict:
    params = {"slow_ratio_ppm": 0, "failure_ratio_ppm": 500_000, "min_calls": 20, "window_seconds": 10,
              "open_ms": 60_000, "half_open_calls": 3, "probe_timeout_ms": 2_000}  # fmt: skip
    hot = {"capacity": 10, "total": 9, "floor": 0, "items": [["device-42", 9, 0]]}
    return {
        "gateway": gateway, "interval_ms": 1000, "degraded": degraded,
        "breakers": [{"key": "payments-1", "name": "payments", "fleet": True, "params": params, "status": "closed",
                      "calls": {"calls": 30, "slow": 0, "failed": 25}}],
        "rules": [{"name": "per_device", "admitted": 3, "limited": 9, "dry_run_limited": 1,
                   "hot_limited": hot, "hot_admitted": hot}],
        "paths": hot,
    }  # fmt: skip


def post(port: int, path: str, body: object, token: str) -> int:
    data = json.dumps(body).encode()
    headers = {"content-type": "application/json", "authorization": f"Bearer {token}"}
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as refused:
        return refused.code


def test_every_dashboard_query_names_a_live_metric(procs, start_envoy):
    dashboard = json.loads(DASHBOARD.read_text())
    found = list(queries(dashboard))
    assert len(found) >= 20, found

    quota = procs.add(Quota(procs.log_dir)).start()
    # The fleet: two gateways' reports (a fleet breaker tripped, one gateway degraded).
    for gateway, degraded in (("gw-1", False), ("gw-2", True)):
        assert post(quota.port, "/v1/report", report(gateway, degraded), QUOTA_TOKEN) == 200
    # A gateway whose global rule calls diana-quota: a few devices, one over its limit.
    envoy = start_envoy(GATEWAY_DOC, concurrency=2, quota_port=quota.port)
    codes = [request(envoy.port, "/", {"x-device-id": "phone-1"}).status for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429], codes
    # A caller without the credential (diana_quota_unauthorized_total).
    assert post(quota.port, "/v1/acquire", {"rules": []}, "not-the-secret-" + "0" * 32) == 401
    harness.wait_until(
        lambda: "diana_rule_limited" in envoy_text(envoy) and 'rule="per_device"' in envoy_text(envoy),
        10, "Envoy exporting the rule counters with their rule tag",
    )  # fmt: skip
    status, body, _ = http_get(quota.port, "/metrics")
    assert status == 200
    quota_samples, quota_families = exposition(body.decode())
    gateway_samples, _ = exposition(envoy_text(envoy))

    problems = []
    sources: dict[str, str] = {}
    for where, expr in found:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        needed = label_names(expr)
        for name in sorted(names):
            labels = needed[name] - {"le"}
            if not name.startswith("diana_"):
                problems.append(f"{where}: {name} is not one of Diana's metrics")
            elif name in quota_samples:
                sources[name] = "diana-quota"
                missing = labels - quota_samples[name]
                if missing and not name.endswith("_bucket"):
                    problems.append(f"{where}: {name} has no label {sorted(missing)} on diana-quota ({sorted(quota_samples[name])})")
            elif name in gateway_samples:
                sources[name] = "gateway"
                missing = labels - gateway_samples[name]
                if missing:
                    problems.append(f"{where}: {name} has no label {sorted(missing)} on Envoy ({sorted(gateway_samples[name])})")
            elif declared(name, quota_families):
                sources[name] = "diana-quota (declared, no sample yet)"
            else:
                problems.append(f"{where}: {name} is exported by neither diana-quota nor the gateway")
    print(json.dumps(sources, indent=1, sort_keys=True))
    assert problems == [], "\n".join(problems)
    # Both sides are on the dashboard, the fleet's figures and the gateways' own.
    assert {"diana-quota", "gateway"} <= set(sources.values()), sources
    harness.record("grafana dashboard: metrics checked live", f"{len(sources)} names in {len(found)} queries")


def envoy_text(envoy) -> str:
    status, body, _ = http_get(envoy.admin_port, "/stats/prometheus", timeout=5.0)
    assert status == 200
    return body.decode()


def test_the_query_reader_finds_names_and_labels():
    # (expr, metric names, labels)
    # (expr, {metric name: the labels it needs})
    cases = [
        ('sum by (rule) (rate(diana_rule_limited{rule=~"$rule"}[1m]))', {"diana_rule_limited": {"rule"}}),
        ("histogram_quantile(0.99, sum by (le, path) (rate(diana_quota_request_duration_seconds_bucket[5m])))",
         {"diana_quota_request_duration_seconds_bucket": {"le", "path"}}),
        ('max by (rule) (a{list="limited",rank="1"}) / max by (rule) (b_total{x!="y"} > 0)',
         {"a": {"rule", "list", "rank"}, "b_total": {"rule", "x"}}),
        ("count(max by (breaker) (diana_quota_fleet_breaker_state) > 0) or vector(0)", {"diana_quota_fleet_breaker_state": {"breaker"}}),
        ("max(time() - diana_quota_fleet_gateway_last_report_timestamp_seconds)", {"diana_quota_fleet_gateway_last_report_timestamp_seconds": set()}),
        ('sum(rate(x{path="/v1/view"}[1m] offset 5m))', {"x": {"path"}}),
        ("rule_2 * 1e3 > 0.5", {"rule_2": set()}),
    ]  # fmt: skip
    for expr, needed in cases:
        assert metric_names(expr) == set(needed), expr
        assert label_names(expr) == needed, expr
    samples, families = exposition('# TYPE a_b counter\na_b_total{x="1",y="2"} 3\n# TYPE h histogram\nc 1\n')
    assert samples == {"a_b_total": {"x", "y"}, "c": set()}
    assert declared("h_bucket", families) and declared("a_b_total", families) and not declared("a_b_sum", families)


def test_dashboard_is_importable_json():
    dashboard = json.loads(Path(DASHBOARD).read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = []
    for panel in dashboard["panels"]:
        ids.append(panel["id"])
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "rule", "breaker"} <= variables
