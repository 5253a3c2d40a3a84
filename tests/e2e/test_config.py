"""Configuration as the gateways see it: the accepted forms of the document, and a bad
document refused with a message naming the field and its line/column (docs/design.md §3),
and one `diana:` on every line the filter logs.

Envoy 1.40 behaviour with a plugin whose on_configure returns false at startup: the wasm
log line carries the filter's message, then `Unable to create Wasm plugin diana`, and the
bootstrap fails: Envoy exits with code 1 and never opens the listener.

nginx 1.27.4 + ngx_wasm_module 0.6.0: a filter whose on_configure returns false stops
the worker processes for good while the master keeps the port open (every request then
hangs), so on nginx the filter accepts the document, logs the refusal once per worker and
answers `on_invalid_config` (503 by default) until it is fixed: the document is never
enforced half-way (tests/e2e/test_nginx_invalid.py has the rest)."""

from __future__ import annotations

import re
import time

import pytest

from harness import REPO, Envoy, Nginx, errors, record, request, send_concurrent, statuses


def _start_bad(procs, upstream, doc: str, name: str, host: str = "envoy"):
    if host == "nginx":
        nginx = procs.add(Nginx(procs.log_dir, diana_config=doc, upstream_port=upstream.port, name=name, raw_document=True))
        _, ready = nginx.start_expecting_failure(timeout=60)
        assert not ready, "nginx applied a bad Diana document"
        log = nginx.error_text()
        assert "exited with fatal code" not in log, log[-3000:]
        r = request(nginx.port, "/", timeout=5)
        assert r.status == 503, f"a request passed the refused filter: {r}"
        return nginx, log
    envoy = procs.add(Envoy(procs.log_dir, diana_config=doc, upstream_port=upstream.port, name=name,
                            native=host == "envoy-native"))
    code, ready = envoy.start_expecting_failure(timeout=60)
    log = envoy.log_text()
    assert not ready, "Envoy started with a bad Diana document"
    assert code not in (None, 0), f"Envoy neither exited nor became ready; exit code {code}"
    assert not envoy.alive()
    return envoy, log


def _filter_error_lines(log: str) -> list[str]:
    return [
        ln
        for ln in log.splitlines()
        if ("wasm log" in ln or "[proxy-wasm]" in ln or "[dynamic_modules] [:] diana:" in ln)
        and ("error" in ln or "critical" in ln or "warn" in ln)
    ]


BAD_RPU = """\
resources:
  - Url: /
    rules:
      - name: ok
        rpu: 5
  - Url: /sample
    rules:
      - name: broken
        actor: device
        rpu: 0
"""


def test_rpu_zero_is_refused_with_field_and_position(procs, upstream, host):
    _, log = _start_bad(procs, upstream, BAD_RPU, f"{host}-bad-rpu", host)
    lines = _filter_error_lines(log)
    record(f"{host}: bad document (rpu: 0) log", lines[:3])
    assert lines, f"no error from the filter in the Envoy log:\n{log[-3000:]}"
    # One `diana:` per line: Envoy's own prefix (`wasm log diana diana: `) already ends in
    # it and the filter adds none; ngx_wasm_module's (`[proxy-wasm]["diana" #0] `) does
    # not, and the filter adds it.
    for ln in lines:
        assert ln.count("diana:") == 1, f"`diana:` is not there exactly once: {ln}"
        assert "configuration rejected" in ln, ln
    msg = "\n".join(lines)
    assert "rpu" in msg
    m = re.search(r"line\D{0,3}(\d+)", msg, re.IGNORECASE)
    assert m, f"no line number in: {msg}"
    assert re.search(r"col(umn)?\D{0,3}\d+", msg, re.IGNORECASE), f"no column in: {msg}"
    expected_line = BAD_RPU.splitlines().index("        rpu: 0") + 1
    assert int(m.group(1)) == expected_line, f"line {m.group(1)} reported, `rpu: 0` is on line {expected_line}: {msg}"
    if host == "envoy":
        assert "Unable to create Wasm plugin diana" in log or "Failed to configure" in log


@pytest.mark.parametrize(
    "doc,field",
    [
        ("Url: /\nrules:\n  - rpu: 5\n    rpm: 7\n", ["rpm"]),  # unknown key
        ("Url: sample\nrules:\n  - rpu: 5\n", ["url"]),  # Url not starting with /
        ("Url: /\nrules:\n  - rpu: 5\n    algo: XYZ\n", ["algo"]),  # bad value
        ("resources:\n  - Url: /a\n    rules: [{rpu: 1}]\n  - Url: /a\n    rules: [{rpu: 2}]\n", ["url", "/a"]),
        # What the quota service would refuse is refused at load (DESIGN §3).
        ("Url: /\nrules:\n  - {rpu: 5, scope: global, lease: 200000}\n", ["lease", "100000"]),
        ("Url: /\nrules:\n  - {rpu: 100, scope: global, cost: 20}\n", ["lease"]),
        # Issue 22, item 4: each was accepted before (null read as the default, two
        # `resources:` lists merged, a lease that means nothing on a local rule).
        ("Url: /\nrules:\n  - rpu: 5\n    name:\n", ["rules[0].name: null where a value is expected"]),
        ("resources: [{Url: /, rules: [{rpu: 5}]}]\n---\nresources: [{Url: /a, rules: [{rpu: 5}]}]\n", ["section `resources` is already given"]),
        ("Url: /\nrules:\n  - {rpu: 5, lease: 10}\n", ["rules[0].lease: lease applies to scope: global rules only"]),
    ],
    ids=[
        "unknown-key",
        "url-without-slash",
        "bad-algo",
        "duplicate-resource",
        "lease-too-large",
        "cost-above-lease",
        "null-name",
        "resources-twice",
        "lease-on-local-rule",
    ],
)
def test_bad_documents_are_refused(procs, upstream, host, doc, field):
    """`field`: the message must name one of these (case-insensitive)."""
    _, log = _start_bad(procs, upstream, doc, f"{host}-bad", host)
    msg = "\n".join(_filter_error_lines(log))
    assert any(f.lower() in msg.lower() for f in field), f"error does not name {field}:\n{msg or log[-3000:]}"


def test_log_lines_say_diana_once(start_gateway):
    """Every line the filter logs carries exactly one `diana:`, whoever prints it."""
    gw = start_gateway("Url: /\nrules:\n  - {rpu: 100}\n")
    assert request(gw.port, "/").status == 200
    text = gw.error_text() if gw.kind == "nginx" else gw.log_text()
    lines = [ln for ln in text.splitlines() if "local configuration applied" in ln]
    record(f"{gw.label}: configuration applied log line", lines[:1])
    assert lines, text[-3000:]
    for ln in lines:
        assert ln.count("diana:") == 1, f"`diana:` is not there exactly once: {ln}"
        assert "diana: local configuration applied" in ln, ln


def test_ietf_rule_names_refused_at_load_name_the_rule(procs, upstream, host):
    """A rule name that cannot be a structured-field string (not printable ASCII) is refused
    when the document is loaded, naming the field and its position."""
    doc = "resources:\n  - Url: /\n    rules:\n      - {rpu: 1, name: \"café\"}\nresponse: {header_style: ietf}\n"
    _, log = _start_bad(procs, upstream, doc, f"{host}-bad-name", host)
    msg = "\n".join(_filter_error_lines(log))
    assert "rules[0].name" in msg and "printable ASCII" in msg and "line 4" in msg, msg or log[-3000:]



FORMS = {
    "seed-block": "Url: /\nrules:\n  - actor: all\n    unit: hour\n    rpu: 2\n",
    "sequence": "- Url: /\n  rules:\n    - {actor: all, unit: hour, rpu: 2}\n- Url: /other\n  rules:\n    - {rpu: 100}\n",
    "multi-document": "Url: /\nrules:\n  - {actor: all, unit: hour, rpu: 2}\n---\nUrl: /other\nrules:\n  - {rpu: 100}\n",
    "json": '{"resources": [{"Url": "/", "rules": [{"actor": "all", "unit": "hour", "rpu": 2, "algo": "tb"}]}]}',
    "case-insensitive-algo": "Url: /\nrules:\n  - {actor: all, unit: hour, rpu: 2, algo: token bucket}\n",
}


@pytest.mark.parametrize("form", list(FORMS))
def test_accepted_document_forms(start_gateway, form):
    gw = start_gateway(FORMS[form])
    resps = send_concurrent(gw.port, 6, "/")
    assert not errors(resps), errors(resps)
    assert statuses(resps) == {200: 2, 503: 4}


def test_seed_document_without_quota_service_degrades_to_local(start_gateway):
    """The seed document has a global rule; with no diana_quota cluster/service the rule is
    enforced locally and no request fails (DESIGN §4 Degrade)."""
    seed = (REPO / "tests/fixtures/seed.yaml").read_text()
    gw = start_gateway(seed)
    t0 = time.monotonic()
    resps = send_concurrent(gw.port, 15, "/", {"x-device-id": "seed-dev"})
    elapsed = time.monotonic() - t0
    st = statuses(resps)
    record(f"{gw.label}: seed document, quota service absent, 15 concurrent requests from one device", f"{st} in {elapsed:.2f}s")
    assert not errors(resps), errors(resps)
    assert set(st) <= {200, 503}, st
    # TB rpu 10/s, burst 10, enforced locally: 10, plus what refills while the burst lasts
    assert 10 <= st.get(200, 0) <= 10 + int(elapsed * 10) + 1, st
