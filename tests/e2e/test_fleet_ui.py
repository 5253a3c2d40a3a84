"""The fleet view's page (`GET /ui`, crates/diana-quota/src/ui) in a real headless Chromium,
looked at as an operator would during a flood: open the page, sign in with the view's
token, and read what it shows — the flooding identity first in its rule's top list, the
limited rate above zero, the payments breaker open, the degraded gateway, an identity made
of markup shown as text (no element created) — while it refreshes itself without reloading.

The flood comes from two gateways' tick reports (`POST /v1/report`, the wire format of
docs/wire-format.md, built here from the documented JSON), sent every second as the
gateways' ticks send them.

Also: `/ui` and `/v1/view` refuse callers without the credential (the page is a shell that
holds nothing; its data needs the token), and the token never reaches a URL or the page.

The screenshot is kept under .tmp/ (`fleet-ui.png` in the test's log directory, and
.tmp/fleet-ui.png); DIANA_UI_SCREENSHOT=PATH also writes it there, after DIANA_UI_FLOOD_S
more seconds of flood (docs/fleet-view.png: DIANA_UI_SCREENSHOT=docs/fleet-view.png
DIANA_UI_FLOOD_S=150).
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

import pytest

import harness
from browser import Chromium
from harness import HOST, QUOTA_TEST_FLAGS, QUOTA_TOKEN, Quota

# The identity whose value is markup: were it parsed, an <img> would run its handler.
MARKUP = "<img src=x onerror=window.__diana_pwned=1>"
MARKUP_RULE = "<marquee>per-ip</marquee>"
MARKUP_PATH = "/search?q=<script>window.__diana_pwned=2</script>"
FLOODER = "device-42"

BREAKER_PARAMS = {
    "slow_ratio_ppm": 0,
    "failure_ratio_ppm": 500_000,
    "min_calls": 20,
    "window_seconds": 10,
    # Open for longer than the test: it must still show open at the end.
    "open_ms": 300_000,
    "half_open_calls": 3,
    "probe_timeout_ms": 2_000,
}


def summary(items: list[tuple[str, int]], capacity: int = 10) -> dict[str, Any]:
    """A Space-Saving summary as a gateway sends it (exact here: error 0)."""
    return {"capacity": capacity, "total": sum(c for _, c in items), "floor": 0,
            "items": [[label, count, 0] for label, count in items]}  # fmt: skip


class Fleet:
    """Two gateways flooding `per-device` with FLOODER (and a few others), reporting every
    second; the fleet breaker `payments` tripped by gw-eu-1's failed calls; gw-us-1
    degraded. Each gateway follows the breaker status the service answers, as a gateway
    does."""

    GATEWAYS = ("gw-eu-1", "gw-us-1")

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.token = token
        self.status = {gateway: "closed" for gateway in self.GATEWAYS}
        self.tick = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def report(self, gateway: str) -> dict[str, Any]:
        eu = gateway == "gw-eu-1"
        flood = 380 if eu else 340
        return {
            "gateway": gateway,
            "interval_ms": 1000,
            "degraded": not eu,
            "breakers": [
                {"key": "payments-7f3a", "name": "payments", "fleet": True, "params": BREAKER_PARAMS,
                 "status": self.status[gateway],
                 # gw-eu-1's first tick: 30 calls to payments, 25 failed: the fleet's
                 # breaker opens (min 20 calls, half failed).
                 "calls": {"calls": 30, "slow": 0, "failed": 25} if eu and self.tick == 0 else {"calls": 0, "slow": 0, "failed": 0}},
                {"key": "search-01", "name": "search", "fleet": False, "params": BREAKER_PARAMS, "status": "closed"},
            ],
            "rules": [
                {"name": "per-device", "admitted": 60, "limited": flood + 25,
                 "hot_limited": summary([(FLOODER, flood), (MARKUP, 15), ("device-7", 6 if eu else 4), ("device-9", 4)]),
                 "hot_admitted": summary([("device-7", 25), ("device-9", 20), (FLOODER, 10), ("device-3", 5)])},
                {"name": "per-account", "admitted": 40, "limited": 0,
                 "hot_admitted": summary([("alice", 22), ("bob", 18)])},
                {"name": MARKUP_RULE, "admitted": 12, "limited": 2,
                 "hot_limited": summary([("203.0.113.9", 2)])},
            ],
            "paths": summary([("/sample", flood + 85), ("/login", 40), (MARKUP_PATH, 12)]),
        }  # fmt: skip

    def send_round(self) -> None:
        for gateway in self.GATEWAYS:
            status, body = post(self.port, "/v1/report", self.report(gateway), self.token)
            if status != 200:
                self.failures.append(f"{gateway}: {status} {body!r}")
                continue
            answers = json.loads(body)["breakers"]
            self.status[gateway] = answers[0]["status"]
        self.tick += 1

    def __enter__(self) -> "Fleet":
        self.send_round()

        def run() -> None:
            while not self._stop.wait(1.0):
                self.send_round()

        self._thread = threading.Thread(target=run, name="fleet-reports", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def post(port: int, path: str, body: Any, token: Optional[str]) -> tuple[int, bytes]:
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


def get(port: int, path: str, authorization: Optional[str] = None) -> tuple[int, dict[str, str], bytes]:
    headers = {} if authorization is None else {"authorization": authorization}
    request = urllib.request.Request(f"http://{HOST}:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, {k.lower(): v for k, v in answer.headers.items()}, answer.read()
    except urllib.error.HTTPError as refused:
        return refused.code, {k.lower(): v for k, v in refused.headers.items()}, refused.read()


def start_quota(procs, log_dir: Path, view_token: str) -> Quota:
    token_file = log_dir / "view.token"
    token_file.write_text(view_token + "\n")
    token_file.chmod(0o600)
    return procs.add(Quota(log_dir, flags=(*QUOTA_TEST_FLAGS, "--view-token-file", str(token_file)))).start()


# What the page shows, read from its DOM as text (what a person reads).
READ_PAGE = """(() => {
  const text = (node, selector) => { const found = node.querySelector(selector); return found ? found.textContent : null; };
  const all = (node, selector) => [...node.querySelectorAll(selector)];
  return {
    showing: document.documentElement.dataset.showing || null,
    renders: Number(document.documentElement.dataset.renders || 0),
    status: text(document, '#status'),
    rules: all(document, '#rules .card.rule').map((card) => ({
      name: text(card, 'h3'),
      admitted: text(card, '.rate.admitted b'),
      limited: text(card, '.rate.limited b'),
      hotLimited: all(card, '.hot-limited tr.hot-item').map((row) => [text(row, '.label'), text(row, '.count')]),
      hotAdmitted: all(card, '.hot-admitted tr.hot-item').map((row) => [text(row, '.label'), text(row, '.count')]),
      chartPaths: all(card, 'svg.chart path').length,
    })),
    breakers: all(document, '#breakers .card.breaker').map((card) => ({
      name: text(card, 'h3'),
      status: text(card, '.breaker-head .badge'),
      transitions: all(card, 'ol.transitions li').map((li) => li.textContent),
      text: card.textContent,
    })),
    paths: all(document, '#paths tr.hot-item .label').map((label) => label.textContent),
    gateways: all(document, '#gateways tr.gateway').map((row) => ({ id: text(row, '.name'), rules: text(row, '.badge') })),
    tiles: Object.fromEntries(all(document, '#summary .tile').map((tile) => [text(tile, '.name'), text(tile, '.value')])),
    injected: all(document, 'body img:not(.logo), body script, body iframe, body marquee').length,
    pwned: window.__diana_pwned === undefined ? null : window.__diana_pwned,
    bodyText: document.body.innerText,
    url: location.href,
    navigations: performance.getEntriesByType('navigation').length,
  };
})()"""


def test_fleet_page_shows_the_flood_in_a_real_browser(procs, log_dir):
    view_token = secrets.token_hex(24)
    quota = start_quota(procs, log_dir, view_token)
    with Fleet(quota.port, QUOTA_TOKEN) as fleet:
        assert fleet.failures == [], fleet.failures
        # The fleet's breaker opened on gw-eu-1's first report; both gateways follow it.
        assert fleet.status == {"gw-eu-1": "open", "gw-us-1": "open"}, fleet.status
        chromium = procs.add(Chromium(log_dir)).start()
        page = chromium.page()
        try:
            run_the_page(page, quota, view_token, log_dir)
        finally:
            page.close()
        assert fleet.failures == [], fleet.failures


def run_the_page(page, quota: Quota, view_token: str, log_dir: Path) -> None:
    base = f"http://{HOST}:{quota.port}"
    page.navigate(f"{base}/ui")
    # Without a token: the sign-in form, and nothing of the fleet.
    page.wait_for("document.documentElement.dataset.showing === 'signin'", 15, "asking for the token")
    shown = page.evaluate(READ_PAGE)
    for secret in (FLOODER, "per-device", "gw-eu-1", "payments"):
        assert secret not in shown["bodyText"], shown["bodyText"]

    # A token that is not printable ASCII is not even sent.
    page.evaluate("document.getElementById('token').focus()")
    page.type_text("jeton-à-coller")
    page.press_enter()
    page.wait_for("document.getElementById('signin-error').textContent.includes('printable ASCII')", 15, "refusing a non-ASCII token")
    assert not [r for r in page.requests if r["headers"].get("authorization")], page.requests

    # A wrong token is refused, and says so.
    page.evaluate("document.getElementById('token').focus()")
    page.type_text("not-the-token-" + secrets.token_hex(16))
    page.press_enter()
    page.wait_for("document.getElementById('signin-error').textContent.includes('refused')", 15, "telling the token was refused")
    refused = page.evaluate(READ_PAGE)
    assert "refused" in refused["bodyText"] and FLOODER not in refused["bodyText"], refused["bodyText"]

    # The view's read-only token, typed as a person would, then Enter.
    page.evaluate("document.getElementById('token').focus()")
    page.type_text(view_token)
    page.press_enter()
    page.wait_for(
        "document.documentElement.dataset.showing === 'view' && document.querySelectorAll('#rules .card.rule').length === 3",
        15, "showing the view",
    )  # fmt: skip
    # It refreshes itself: more draws, the same document (no reload), a marker kept.
    page.evaluate("window.__same_document = true")
    first = page.evaluate(READ_PAGE)["renders"]
    page.wait_for(f"Number(document.documentElement.dataset.renders) >= {first + 2}", 15, "refreshed twice")
    # Let the reports of two more ticks land, then read the page. (For the README's picture,
    # DIANA_UI_FLOOD_S lets the flood run longer first, so that its charts show it start.)
    time.sleep(2.5 + (float(os.environ.get("DIANA_UI_FLOOD_S", "0")) if os.environ.get("DIANA_UI_SCREENSHOT") else 0))
    shown = page.evaluate(READ_PAGE)
    assert page.evaluate("window.__same_document === true") and shown["navigations"] == 1, shown["navigations"]

    shots = [log_dir / "fleet-ui.png", harness.REPO / ".tmp" / "fleet-ui.png"]
    if os.environ.get("DIANA_UI_SCREENSHOT"):
        shots.append(Path(os.environ["DIANA_UI_SCREENSHOT"]))
    for shot in shots:
        page.screenshot(shot)
    print(f"screenshot: {shots[0]}")
    print(json.dumps({k: v for k, v in shown.items() if k != "bodyText"}, indent=1)[:6000])

    # The flooded rule comes first, its flooding identity first in its top list.
    rules = shown["rules"]
    assert [r["name"] for r in rules] == ["per-device", MARKUP_RULE, "per-account"], rules
    flooded = rules[0]
    assert flooded["hotLimited"][0][0] == FLOODER, flooded
    assert int(flooded["hotLimited"][0][1].replace(",", "")) > int(flooded["hotLimited"][1][1].replace(",", "")), flooded
    # The limited rate above zero (the two gateways report 700+ a second; the page averages
    # over 10 to 20 s, some of it before the flood); a chart per rule.
    assert float(flooded["limited"].replace(",", "")) > 0, flooded
    assert float(flooded["admitted"].replace(",", "")) > 0, flooded
    assert float(rules[2]["limited"]) == 0, rules[2]
    assert all(r["chartPaths"] >= 2 for r in rules), rules
    assert float(shown["tiles"]["limited / s"].replace(",", "")) >= float(flooded["limited"].replace(",", "")), shown["tiles"]
    # The markup is text: shown as typed, no element made of it, nothing ran.
    assert MARKUP in [label for label, _ in flooded["hotLimited"]], flooded
    assert MARKUP_RULE in [r["name"] for r in rules]
    assert MARKUP_PATH in shown["paths"], shown["paths"]
    assert shown["injected"] == 0 and shown["pwned"] is None, shown
    # The fleet's breaker shown open, with its transition and each gateway's view.
    breakers = {b["name"]: b for b in shown["breakers"]}
    assert breakers["payments"]["status"] == "open", breakers
    assert any("closed" in t and "open" in t and "failed share reached" in t for t in breakers["payments"]["transitions"]), breakers
    assert "half-open in" in breakers["payments"]["text"], breakers
    assert breakers["search"]["status"] == "closed", breakers
    assert shown["tiles"]["breakers not closed"] == "1", shown["tiles"]
    # Which gateways reported, and whether they run degraded.
    assert {g["id"]: g["rules"] for g in shown["gateways"]} == {"gw-eu-1": "ok", "gw-us-1": "degraded"}, shown["gateways"]
    assert shown["paths"][0] == "/sample", shown["paths"]

    # The token: in no URL, not in the page, not in localStorage; sent as a header to /v1/view only.
    assert view_token not in shown["url"]
    assert page.evaluate(f"document.documentElement.outerHTML.includes({json.dumps(view_token)})") is False
    assert page.evaluate("window.localStorage.length") == 0
    assert all(view_token not in r["url"] for r in page.requests), page.requests
    views = [r for r in page.requests if r["url"] == f"{base}/v1/view"]
    assert len(views) >= 3, page.requests
    authorizations = {v["headers"].get("authorization", v["headers"].get("Authorization")) for v in views}
    assert f"Bearer {view_token}" in authorizations, authorizations
    assert all(r["url"].startswith(base + "/") for r in page.requests if not r["url"].startswith("about:")), page.requests
    # No script error, nothing the Content-Security-Policy had to block.
    assert page.exceptions == [], page.exceptions
    blocked = [line for line in page.console if "Content Security Policy" in line or "Refused to" in line]
    assert blocked == [], page.console

    # "Forget the token": back to the sign-in form, nothing of the fleet left on the page.
    page.click("#forget")
    page.wait_for("document.documentElement.dataset.showing === 'signin'", 10, "signed out")
    after = page.evaluate(READ_PAGE)
    assert FLOODER not in after["bodyText"] and "payments" not in after["bodyText"], after["bodyText"]
    assert page.evaluate("window.sessionStorage.length") == 0


def test_the_page_and_the_view_refuse_callers_without_the_credential(procs, log_dir):
    view_token = secrets.token_hex(24)
    quota = start_quota(procs, log_dir, view_token)
    fleet = Fleet(quota.port, QUOTA_TOKEN)
    fleet.send_round()
    assert fleet.failures == [], fleet.failures
    # The view: 401 without a credential or with a wrong one; the view's token and the
    # gateways' secret read it.
    for authorization, expected in [
        (None, 401),
        ("Bearer " + secrets.token_hex(24), 401),
        ("Basic " + view_token, 401),
        (view_token, 401),
        (f"Bearer {view_token}", 200),
        (f"Bearer {QUOTA_TOKEN}", 200),
    ]:
        status, headers, body = get(quota.port, "/v1/view", authorization)
        assert status == expected, (authorization, status, body)
        if expected == 401:
            assert headers.get("www-authenticate") == "Bearer", headers
            assert FLOODER.encode() not in body and b"gw-eu-1" not in body, body
        else:
            assert FLOODER.encode() in body
            assert view_token.encode() not in body and QUOTA_TOKEN.encode() not in body
    # The view's token opens the view only: it neither reports nor decides.
    status, _ = post(quota.port, "/v1/report", fleet.report("gw-eu-1"), view_token)
    assert status == 401
    # The page: a shell with nothing of the fleet, the same to anyone, with its policy.
    for path in ("/ui", "/ui/", "/ui/app.js", "/ui/style.css", "/ui/icon.svg"):
        status, headers, body = get(quota.port, path)
        assert status == 200, path
        assert "script-src 'self'" in headers["content-security-policy"], headers
        assert "default-src 'none'" in headers["content-security-policy"], headers
        assert headers["x-content-type-options"] == "nosniff", headers
        for secret in (FLOODER, "gw-eu-1", "payments", view_token, QUOTA_TOKEN):
            assert secret.encode() not in body, (path, secret)
        assert get(quota.port, path, f"Bearer {view_token}")[2] == body, path


def test_without_authentication_the_page_stays_empty_unless_the_view_is_opened(procs, log_dir):
    closed = procs.add(Quota(log_dir, tokens=None)).start()
    status, _, _ = get(closed.port, "/v1/view")
    assert status == 401
    status, _, _ = get(closed.port, "/v1/view", f"Bearer {QUOTA_TOKEN}")
    assert status == 401
    assert get(closed.port, "/ui")[0] == 200
    opened = procs.add(Quota(log_dir, tokens=None, flags=(*QUOTA_TEST_FLAGS, "--insecure-open-view"))).start()
    status, _, body = get(opened.port, "/v1/view")
    assert status == 200 and json.loads(body)["reports"] == 0
    # In the browser: the closed one asks for a token; the opened one shows the view at
    # once, and says that anyone can read it.
    chromium = procs.add(Chromium(log_dir)).start()
    page = chromium.page()
    try:
        page.navigate(f"http://{HOST}:{closed.port}/ui")
        page.wait_for("document.documentElement.dataset.showing === 'signin'", 15, "asking for a token")
        page.navigate(f"http://{HOST}:{opened.port}/ui")
        page.wait_for("document.documentElement.dataset.showing === 'view'", 15, "showing the open view")
        shown = page.evaluate(READ_PAGE)
        assert "open to anyone" in shown["status"], shown["status"]
        assert shown["tiles"]["gateways reporting"] == "0", shown["tiles"]
        assert page.evaluate("document.getElementById('forget').hidden") is True
        assert page.exceptions == [], page.exceptions
    finally:
        page.close()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-v"]))
