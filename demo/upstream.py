#!/usr/bin/env python3
"""Demo upstream for Diana: a tiny HTTP/1.1 service (standard library only).

- `GET /healthz` -> 200 `ok`
- `GET /timeline[...]` -> 200, a small fake timeline (the Weitter "hot event" page)
- `GET /llm?tokens=N` -> 200, a fake LLM answer whose `x-llm-tokens: N` response header
  says how many tokens it used (default 100): what Diana's `response_cost` charges
  (`&delay_ms=M`: the answer comes after M ms, at most 10 s)
- `GET /signin?password=P` -> a fake sign-in: 200 when P is `right`, else 401
- `GET /dep?status=S&ms=M` -> a dependency whose health each request chooses: status S
  (default 200) after M ms (at most 10 s), with the echo body below (`/dep/...` too)
- `GET /dep/slow` -> the same dependency, whose health is switched at run time for every
  later request: `GET /__dep?ms=M&status=S` sets the delay (at most 10 s) and the status
  of `/dep/slow` (each omitted one is left as it was; initially 0 ms and 200) and answers
  the settings now in force (400 and nothing changed when `ms` is not 0-10000 or `status`
  not 200-599); `ms` or `status` in the request's own query still win
  (bench/cascade.py slows it from 20 ms to 2 s and back while traffic runs)
- `GET /slow?ms=M` -> 200 after M ms (at most 10 s); `GET /__inflight` -> how many
  requests are inside this upstream now and the most there were at once
  (`/__inflight?reset=1` starts counting afresh)
- anything else -> 200 with a small JSON body: the path as received, and the echoed
  `x-device-id` / `x-account-id` / `x-tenant-id` / `x-diana-fallback` headers (truncated
  to 64 characters).

Every answer but `/healthz` carries `x-upstream: NAME` when started with `--name NAME` (a
backup beside the main upstream, for a breaker's `fallback_header` route).

Usage: upstream.py [--host 127.0.0.1] [--port 18080] [--name NAME] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ECHO_HEADERS = ("x-device-id", "x-account-id", "x-tenant-id", "x-diana-fallback")
ECHO_MAX = 64


def _millis(query: dict[str, list[str]], name: str) -> int:
    value = query.get(name, ["0"])[0]
    return min(int(value), 10_000) if value.isdigit() else 0


def _status(value: str, default: int) -> int:
    """An HTTP status from a query value, `default` unless it is one of 200-599."""
    return int(value) if value.isdigit() and 200 <= int(value) <= 599 else default


class Switch:
    """How `/dep/slow` answers when its request does not say: set by `/__dep` for every
    later request (a dependency that slows down or fails while traffic runs)."""

    lock = threading.Lock()
    ms = 0
    status = 200

    @classmethod
    def set(cls, query: dict[str, list[str]]) -> tuple[dict[str, int], str]:
        """Applies `ms` and `status` from the query when both that are present are valid
        (`ms` 0-10000, `status` 200-599); else changes nothing and says which is not.
        Returns the settings in force and the error ("" when none)."""
        ms = query.get("ms", [None])[-1]
        status = query.get("status", [None])[-1]
        with cls.lock:
            if ms is not None and not (ms.isdigit() and int(ms) <= 10_000):
                return {"ms": cls.ms, "status": cls.status}, "ms must be 0-10000"
            if status is not None and _status(status, 0) == 0:
                return {"ms": cls.ms, "status": cls.status}, "status must be 200-599"
            if ms is not None:
                cls.ms = int(ms)
            if status is not None:
                cls.status = int(status)
            return {"ms": cls.ms, "status": cls.status}, ""

    @classmethod
    def get(cls) -> tuple[int, int]:
        with cls.lock:
            return cls.ms, cls.status


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Requests inside the upstream now, and the most at once (GET /__inflight).
    lock = threading.Lock()
    inside = 0
    most = 0
    # Headers and body leave in separate writes: without TCP_NODELAY, Nagle + the peer's
    # delayed ACK add ~40 ms to some responses, which would drown the latencies measured.
    disable_nagle_algorithm = True
    server_version = "diana-demo-upstream/1"
    verbose = False
    # `--name`: sent as `x-upstream` so that a client can tell which upstream answered.
    name = ""

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        if self.name:
            self.send_header("x-upstream", self.name)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _drain_body(self) -> None:
        length = self.headers.get("content-length")
        if length and length.isdigit():
            remaining = min(int(length), 1 << 20)
            while remaining > 0:
                chunk = self.rfile.read(min(remaining, 65536))
                if not chunk:
                    break
                remaining -= len(chunk)

    def _handle(self) -> None:
        with Handler.lock:
            Handler.inside += 1
            Handler.most = max(Handler.most, Handler.inside)
        try:
            self._answer()
        finally:
            with Handler.lock:
                Handler.inside -= 1

    def _answer(self) -> None:
        self._drain_body()
        # http.server collapses a leading "//" in self.path; echo the path as received.
        parts = self.requestline.split()
        path = parts[1] if len(parts) >= 2 else self.path
        if path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
            return
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        if path.startswith("/__inflight"):
            with Handler.lock:
                # This request itself is inside too.
                doc = {"inside": Handler.inside - 1, "most": Handler.most}
                if query.get("reset") == ["1"]:
                    Handler.most = Handler.inside
            self._send(200, (json.dumps(doc) + "\n").encode(), "application/json")
            return
        if path == "/__dep" or path.startswith("/__dep?"):
            settings, error = Switch.set(query)
            doc = {**settings, "error": error} if error else settings
            self._send(400 if error else 200, (json.dumps(doc) + "\n").encode(), "application/json")
            return
        if path == "/dep" or path.startswith(("/dep?", "/dep/")):
            ms, status = 0, 200
            if path == "/dep/slow" or path.startswith("/dep/slow?"):
                ms, status = Switch.get()
            if "ms" in query:
                ms = _millis(query, "ms")
            if "status" in query:
                status = _status(query["status"][0], 200)
            time.sleep(ms / 1000)
            doc = {"path": path}
            for name in ECHO_HEADERS:
                value = self.headers.get(name)
                if value is not None:
                    doc[name] = value[:ECHO_MAX]
            self._send(status, (json.dumps(doc) + "\n").encode(), "application/json")
            return
        if path == "/slow" or path.startswith("/slow?"):
            time.sleep(_millis(query, "ms") / 1000)
            self._send(200, b"slow\n", "text/plain")
            return
        if path == "/signin" or path.startswith("/signin?"):
            ok = query.get("password") == ["right"]
            self._send(200 if ok else 401, b"welcome\n" if ok else b"wrong password\n", "text/plain")
            return
        if path == "/llm" or path.startswith("/llm?"):
            time.sleep(_millis(query, "delay_ms") / 1000)
            tokens = query.get("tokens", ["100"])[0]
            tokens = tokens if tokens.isdigit() else "100"
            body = json.dumps({"completion": "42", "tokens": int(tokens)}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("x-llm-tokens", tokens)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if path.startswith("/timeline"):
            now = int(time.time())
            posts = [
                {"id": now * 10 + i, "author": f"celebrity{i}", "text": f"hot post #{i}"} for i in range(3)
            ]
            self._send(200, (json.dumps({"timeline": posts}) + "\n").encode(), "application/json")
            return
        doc: dict[str, object] = {"path": path, "method": self.command}
        for name in ECHO_HEADERS:
            value = self.headers.get(name)
            if value is not None:
                doc[name] = value[:ECHO_MAX]
        self._send(200, (json.dumps(doc) + "\n").encode(), "application/json")

    do_GET = _handle
    do_POST = _handle
    do_PUT = _handle
    do_DELETE = _handle
    do_HEAD = _handle

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        if self.verbose:
            sys.stderr.write("%s - %s\n" % (self.address_string(), format % args))


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--name", default="", help="sent as the x-upstream header of every answer")
    p.add_argument("--verbose", action="store_true", help="log every request to stderr")
    a = p.parse_args(argv)
    Handler.verbose = a.verbose
    Handler.name = a.name
    srv = Server((a.host, a.port), Handler)
    print(f"demo upstream listening on http://{a.host}:{a.port}", flush=True)
    try:
        srv.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
