"""The fleet view fed by real gateways (issue 43, "See the flood"): diana-quota and two
gateways of the binding under test whose document writes a `global` section, so that each
worker reports every second what its rules admitted and limited, the hottest identities
and paths, and its breakers (`POST /v1/report`). One device floods a per-device rule of
`scope: local` through both gateways; a `scope: global` breaker trips on the demo
upstream's failures (`/dep?status=503`). `/v1/view` and the page at `/ui`, in a real
headless Chromium, then show that device first among the limited with the exact count,
the breaker open, both gateways; an identity made of markup shows as text; the token
never reaches a URL.

test_fleet_ui.py keeps its synthetic reports for what real gateways cannot send (a rule
name or a path made of markup: a gateway sends its rules' metric names and its
resources' Urls) or cannot send while reachable (a degraded gateway).
"""

from __future__ import annotations

import json
import secrets
import time

from browser import Chromium
from harness import HOST, QUOTA_TEST_FLAGS, Quota, record, request, wait_until
from test_fleet_ui import READ_PAGE, get

FLOODER = "device-42"
# The identity whose value is markup: were it parsed, an <img> would run its handler.
MARKUP = "<img src=x onerror=window.__diana_pwned=1>"
LIMIT = 5
FLOOD = 40  # requests of FLOODER per gateway
MARKUP_SENT = 8
OTHERS = ("device-1", "device-2", "device-3")

DOCUMENT = f"""
resources:
  - Url: /api
    rules:
      - {{name: per-device, actor: device, rpu: {LIMIT}, unit: hour, scope: local}}
  - Url: /dep
    breaker: {{name: payments, failure_ratio: 0.5, min_calls: 6, open_seconds: 300, scope: global}}
response: {{status: 429}}
global: {{timeout_ms: 200}}
"""

# The rule's name in reports and in the view: its metric name.
RULE = "per_device"


def view(port: int, token: str) -> dict:
    status, _, body = get(port, "/v1/view", f"Bearer {token}")
    assert status == 200, (status, body)
    return json.loads(body)


def rule_of(shown: dict) -> dict:
    return next((rule for rule in shown["rules"] if rule["name"] == RULE), {})


def test_real_gateways_show_the_flooding_device_first(start_gateway, procs, log_dir):
    view_token = secrets.token_hex(24)
    token_file = log_dir / "view.token"
    token_file.write_text(view_token + "\n")
    token_file.chmod(0o600)
    quota = procs.add(Quota(log_dir, flags=(*QUOTA_TEST_FLAGS, "--view-token-file", str(token_file)))).start()
    gateways = [start_gateway(DOCUMENT, quota_port=quota.port) for _ in range(2)]
    label = gateways[0].label

    # The flood: FLOODER through both gateways, the markup identity and a few others
    # through the first. The rule is local: each gateway admits LIMIT of each identity.
    limited = admitted = 0
    t0 = time.monotonic()
    for gateway in gateways:
        for _ in range(FLOOD):
            status = request(gateway.port, "/api/items", {"x-device-id": FLOODER}).status
            assert status in (200, 429), status
            limited += status == 429
            admitted += status == 200
    for _ in range(MARKUP_SENT):
        status = request(gateways[0].port, "/api/items", {"x-device-id": MARKUP}).status
        limited += status == 429
        admitted += status == 200
    for other in OTHERS:
        assert request(gateways[0].port, "/api/items", {"x-device-id": other}).status == 200
        admitted += 1
    flood_s = time.monotonic() - t0
    assert limited == 2 * (FLOOD - LIMIT) + (MARKUP_SENT - LIMIT), limited
    # The fleet's breaker: 6 failed calls through the first gateway, half or more failed.
    for _ in range(6):
        request(gateways[0].port, "/dep?status=503")

    # Every worker reports within a second or two: the view's totals reach the counts.
    wait_until(
        lambda: rule_of(view(quota.port, view_token)).get("totals", {}).get("limited") == limited,
        15, "the view counting every limited request",
    )  # fmt: skip
    wait_until(
        lambda: rule_of(view(quota.port, view_token)).get("totals", {}).get("admitted") == admitted,
        15, "the view counting every admitted request",
    )  # fmt: skip
    shown = view(quota.port, view_token)
    rule = rule_of(shown)
    hot = rule["hot_limited"]["items"]
    assert hot[0]["label"] == FLOODER, hot
    # Few identities: the sketches count exactly.
    assert hot[0]["count"] == 2 * (FLOOD - LIMIT) and hot[0]["error"] == 0, hot
    assert [item["label"] for item in hot] == [FLOODER, MARKUP], hot
    assert {item["label"] for item in rule["hot_admitted"]["items"]} == {FLOODER, MARKUP, *OTHERS}, rule
    paths = [item["label"] for item in shown["paths"]["items"]]
    assert paths[0] == "/api" and "/dep" in paths, paths
    assert len(shown["gateways"]) == 2, shown["gateways"]
    assert not any(gateway["degraded"] for gateway in shown["gateways"]), shown["gateways"]
    wait_until(
        lambda: any(
            breaker["name"] == "payments" and (breaker["state"] or {}).get("status") == "open"
            for breaker in view(quota.port, view_token)["breakers"]
        ),
        10, "the fleet's breaker open in the view",
    )  # fmt: skip
    record(
        f"{label}: fleet view from two real gateways",
        f"{FLOODER} first of the limited ({hot[0]['count']} of {limited} limited, {admitted} admitted, "
        f"flood of {2 * FLOOD + MARKUP_SENT + len(OTHERS)} requests in {flood_s:.2f} s)",
    )

    # The page, as an operator reads it.
    chromium = procs.add(Chromium(log_dir)).start()
    page = chromium.page()
    try:
        base = f"http://{HOST}:{quota.port}"
        page.navigate(f"{base}/ui")
        page.wait_for("document.documentElement.dataset.showing === 'signin'", 15, "asking for the token")
        page.evaluate("document.getElementById('token').focus()")
        page.type_text(view_token)
        page.press_enter()
        page.wait_for(
            "document.documentElement.dataset.showing === 'view' && document.querySelectorAll('#rules .card.rule').length >= 1",
            15, "showing the view",
        )  # fmt: skip
        shown = page.evaluate(READ_PAGE)
        page.screenshot(log_dir / "fleet-gateways.png")
        print(json.dumps({k: v for k, v in shown.items() if k != "bodyText"}, indent=1)[:4000])
        card = next(card for card in shown["rules"] if card["name"] == RULE)
        assert card["hotLimited"][0][0] == FLOODER, card
        assert int(card["hotLimited"][0][1].replace(",", "")) == 2 * (FLOOD - LIMIT), card
        # The page averages over 10 to 20 s: above zero.
        assert float(card["limited"].replace(",", "")) > 0, card
        record(f"{label}: fleet view page, limited rate of {RULE}", f"{card['limited']} /s")
        # The markup is text: shown as sent, no element made of it, nothing ran.
        assert MARKUP in [row_label for row_label, _ in card["hotLimited"]], card
        assert shown["injected"] == 0 and shown["pwned"] is None, shown
        assert shown["paths"][0] == "/api", shown["paths"]
        breakers = {b["name"]: b for b in shown["breakers"]}
        assert breakers["payments"]["status"] == "open", breakers
        assert len(shown["gateways"]) == 2, shown["gateways"]
        # The token: in no URL, not in the page, sent as a header to /v1/view only.
        assert view_token not in shown["url"]
        assert all(view_token not in r["url"] for r in page.requests), page.requests
        assert page.evaluate(f"document.documentElement.outerHTML.includes({json.dumps(view_token)})") is False
        assert page.evaluate("window.localStorage.length") == 0
        assert page.exceptions == [], page.exceptions
    finally:
        page.close()


if __name__ == "__main__":  # pragma: no cover
    import pytest

    raise SystemExit(pytest.main([__file__, "-v"]))
