"""A remote document cannot redirect or disarm (DESIGN §6), end to end on a real Envoy
(4 workers) and a real nginx (2 worker processes): a config center that serves a document
moving `global.cluster`, one setting the blanket `dry_run`, one badly signed and one unsigned
is refused every time — counted, logged once naming the field or the signature — while the
local document's limit keeps holding; a correctly signed document is then adopted by every
worker."""

from __future__ import annotations

import pytest

import base64
import hashlib
import hmac
import secrets

from harness import ConfigCenter, free_port, send_concurrent, statuses
from test_remote import metric, wait_applied_everywhere, wait_for

SIGNATURE_HEADER = "x-diana-signature"
KEY = "e2e-config-center-" + secrets.token_hex(16)


def sign(body: bytes, key: str = KEY) -> str:
    """What the README says to run: openssl dgst -sha256 -hmac KEY -binary | openssl base64 -A."""
    return base64.b64encode(hmac.new(key.encode(), body, hashlib.sha256).digest()).decode()


def local_doc(rpu: int) -> str:
    return f"""
resources:
  - Url: /
    rules:
      - {{name: main, rpu: {rpu}, unit: hour}}
remote:
  cluster: diana_config
  authority: config
  path: /diana.yaml
  poll_seconds: 1
  signature: {{hmac_sha256: "{KEY}"}}
response: {{status: 429}}
"""


def remote_doc(rpu: int, extra: str = "") -> str:
    return f"""
resources:
  - Url: /
    rules:
      - {{name: main, rpu: {rpu}, unit: hour}}
response: {{status: 429}}
{extra}"""


def refused_once_more(gw, what: str, log_line: str, serve=None) -> None:
    """`serve()` puts a document up (None: it is up already, since before the gateway
    started); it is refused (counted), and its reason logged once more than before
    `serve()` (once at all, without it: the first poll may come before the gateway is
    ready, and a refusal is logged once). The log is read before the document changes,
    so a poll right after the change cannot log the line before it is counted."""
    before = metric(gw, "diana_config_remote_refused")
    logged = 0
    if serve is not None:
        logged = gw.log_text().count(log_line)
        serve()
    wait_for(lambda: metric(gw, "diana_config_remote_refused") > before, 15, f"{what} refused")
    # Envoy flushes its log file periodically: wait for the line.
    wait_for(lambda: gw.log_text().count(log_line) > logged, 20, f"{what}: refusal logged")


def test_remote_documents_that_redirect_disarm_or_are_badly_signed_are_refused(start_gateway):
    port = free_port()
    with ConfigCenter(port) as center:
        # Well signed, but it moves the quota service's cluster: refused from the first poll.
        center.document = remote_doc(1000, 'global: {cluster: "127.0.0.1:9"}\n')
        center.headers_for = lambda body: {SIGNATURE_HEADER: sign(body)}
        gw = start_gateway(local_doc(rpu=3), config_port=port)
        refused_once_more(gw, "a moved global.cluster", "remote document refused: global.cluster: ")
        # The local document's limit holds: 3 per hour, not the remote 1000.
        assert statuses(send_concurrent(gw.port, 9)) == {200: 3, 429: 6}

        # Well signed, but a blanket dry run: refused.
        def dry_run():
            center.document = remote_doc(1000, "dry_run: true\n")

        refused_once_more(gw, "a blanket dry run", "remote document refused: dry_run: ", dry_run)
        assert statuses(send_concurrent(gw.port, 5)) == {429: 5}, "still limited (not in dry run)"

        # A harmless document, signed with another key, then not signed at all: refused.
        # Each change is made in the order that never serves a well-signed harmless
        # document in between (a poll may come between two assignments).
        def signed_with_another_key():
            center.headers_for = lambda body: {SIGNATURE_HEADER: sign(body, key="another-key-" + "x" * 32)}
            center.document = remote_doc(1000)

        def unsigned():
            center.headers_for = lambda body: {}

        def modified_after_signing():  # the signature of the previous body
            center.document = remote_doc(1001)
            center.headers_for = lambda body: {SIGNATURE_HEADER: sign(remote_doc(1000).encode())}

        refused_once_more(gw, "a badly signed document", "the signature does not verify", signed_with_another_key)
        refused_once_more(gw, "an unsigned document", "unsigned: the answer has no x-diana-signature header", unsigned)
        refused_once_more(gw, "a document modified after signing", "the signature does not verify", modified_after_signing)
        assert statuses(send_concurrent(gw.port, 5)) == {429: 5}
        assert "remote (version" not in gw.log_text(), "nothing but the local document was applied"
        assert KEY not in gw.log_text(), "the signing key is never logged"
        # Each refusal is logged once, not once per poll (documents are polled every second).
        assert gw.log_text().count("remote document refused: dry_run: ") == 1

        # Correctly signed: adopted by every worker (a new limit, so a new counter: 5).
        reloads = metric(gw, "diana_config_reloads")
        center.document = remote_doc(5)
        center.headers_for = lambda body: {SIGNATURE_HEADER: sign(body)}
        wait_applied_everywhere(gw, reloads + gw.root_contexts, "the signed document applied by every worker")
        assert statuses(send_concurrent(gw.port, 20)) == {200: 5, 429: 15}
