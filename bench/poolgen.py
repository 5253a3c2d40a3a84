#!/usr/bin/env python3
"""Open-loop arrivals served by a fixed pool of keep-alive connections (asyncio, standard
library only): the client side of the cascade scenario (bench/cascade.py).

Requests arrive at fixed times (`--rate` per second for `--duration` seconds), whatever
the answers do, and take the paths in turn (`--path A --path B`: A, B, A, B, ...). They
are served by exactly `--conns` connections, opened before the first arrival, in arrival
order: a request that arrives while every connection is busy waits in one queue for the
next free one, whichever path it is for. That shared pool is what a service's HTTP client
has (a bounded pool per host, as Go's `MaxConnsPerHost` or Apache HttpClient's
`maxPerRoute`): when one path's answers take 2 s, its requests hold the connections and the
other path's requests wait behind them. A request's latency runs from its arrival time (the
wait for a connection included: no coordinated omission) to the end of its answer.

    poolgen.py --target 127.0.0.1:10000 --conns 64 --rate 200 --duration 40 \
        --path /dep/slow --path /healthy --out result.json [--start-at EPOCH] [--timeout 12]

Answers are classified:
  ok        2xx
  diana     503 with Retry-After (Diana's answer: a breaker failing fast, or a rule)
  s<code>   any other status
  timeout   no complete answer within --timeout of being written (the connection is closed
            and opened again for the next request)
  error     the connection failed (reset, refused, malformed answer)
  unsent    still waiting for a connection when the run ended (--drain after the last arrival)
The JSON output has one row per request, in arrival order: [arrival (s from the start),
path index, wait for a connection (ms), latency (ms, arrival to answer; null when
unsent), status (0 when none), class], and the run's totals, the scheduler's largest
lag and the connections opened again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Optional

# An answer's head larger than this is malformed (a header section of Envoy's or the demo
# upstream's is ~300 bytes); bounds the memory a broken peer can make us use.
HEAD_LIMIT = 64 * 1024
# Likewise a body: the answers here are a few hundred bytes.
BODY_LIMIT = 1 << 20


class Malformed(Exception):
    """An answer that is not HTTP/1.1 as this client reads it."""


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> None:
    """Reads (and drops) the body: by Content-Length, or chunked."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        total = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError as e:
                raise Malformed(f"chunk size {size_line[:20]!r}") from e
            total += size
            if total > BODY_LIMIT:
                raise Malformed("body too large")
            await reader.readexactly(size + 2)
            if size == 0:
                return
    length = headers.get("content-length", "0")
    if not length.isdigit() or int(length) > BODY_LIMIT:
        raise Malformed(f"content-length {length[:20]!r}")
    if int(length):
        await reader.readexactly(int(length))


def classify(status: int, headers: dict[str, str]) -> str:
    if 200 <= status < 300:
        return "ok"
    if status == 503 and "retry-after" in headers:
        return "diana"
    return f"s{status}"


class Pool:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        host, port = a.target.rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.queue: asyncio.Queue[Optional[int]] = asyncio.Queue()
        self.arrival: list[float] = []
        # Per request: [arrival s, path index, wait ms, latency ms, status, class].
        self.rows: list[list] = []
        self.reopened = 0
        self.max_lag = 0.0
        self.t0 = 0.0

    def payload(self, path: str) -> bytes:
        return (f"GET {path} HTTP/1.1\r\nhost: {self.a.host_header}\r\nuser-agent: diana-bench\r\n\r\n").encode()

    async def exchange(self, rw, path: str) -> tuple[int, str, bool]:
        """One request on `rw`: (status, class, keep the connection)."""
        reader, writer = rw
        writer.write(self.payload(path))
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > HEAD_LIMIT:
            raise Malformed("head too large")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) < 2 or not parts[1].isdigit():
            raise Malformed(f"status line {lines[0][:40]!r}")
        status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        await read_body(reader, headers)
        return status, classify(status, headers), headers.get("connection", "").lower() != "close"

    async def open(self):
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=HEAD_LIMIT + 1024)
        return reader, writer

    async def worker(self) -> None:
        rw = await self.open()
        try:
            while True:
                k = await self.queue.get()
                if k is None:
                    return
                row = self.rows[k]
                started = time.time()
                row[2] = round((started - self.arrival[k]) * 1000, 3)
                path = self.a.path[row[1]]
                status, cls, keep = 0, "error", False
                try:
                    if rw is None:
                        self.reopened += 1
                        rw = await asyncio.wait_for(self.open(), self.a.timeout)
                    status, cls, keep = await asyncio.wait_for(self.exchange(rw, path), self.a.timeout)
                except asyncio.TimeoutError:
                    cls = "timeout"
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, Malformed):
                    cls = "error"
                if not keep and rw is not None:
                    rw[1].close()
                    rw = None
                row[3] = round((time.time() - self.arrival[k]) * 1000, 3)
                row[4], row[5] = status, cls
        finally:
            if rw is not None:
                rw[1].close()

    async def run(self) -> dict:
        a = self.a
        workers = [asyncio.ensure_future(self.worker()) for _ in range(a.conns)]
        # The connections open before the first arrival (a failure to open one ends the run).
        await asyncio.sleep(0)
        self.t0 = t0 = a.start_at if a.start_at else time.time() + 0.5
        n = int(round(a.rate * a.duration))
        while time.time() < t0:
            await asyncio.sleep(min(0.01, max(0.0, t0 - time.time())))
        for k in range(n):
            due = t0 + k / a.rate
            now = time.time()
            if due > now:
                await asyncio.sleep(due - now)
                now = time.time()
            self.max_lag = max(self.max_lag, now - due)
            # The arrival is the scheduled time, not when this loop got to it.
            self.arrival.append(due)
            self.rows.append([round(k / a.rate, 6), k % len(a.path), None, None, 0, "unsent"])
            self.queue.put_nowait(k)
            for w in workers:
                if w.done() and w.exception() is not None:
                    raise RuntimeError(f"a connection failed to open: {w.exception()}")
        for _ in workers:
            self.queue.put_nowait(None)
        done, pending = await asyncio.wait(workers, timeout=a.drain)
        for w in pending:
            w.cancel()
        totals: dict[str, int] = {}
        for row in self.rows:
            totals[row[5]] = totals.get(row[5], 0) + 1
        return {
            "target": a.target, "paths": a.path, "conns": a.conns, "rate": a.rate, "duration": a.duration,
            "start_at": t0, "timeout": a.timeout, "rows": self.rows, "totals": totals,
            "max_schedule_lag_ms": round(self.max_lag * 1000, 2), "connections_reopened": self.reopened,
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="host:port")
    p.add_argument("--path", action="append", required=True, help="taken in turn by the arrivals")
    p.add_argument("--host-header", default="bench")
    p.add_argument("--conns", type=int, default=64, help="the pool's connections")
    p.add_argument("--rate", type=float, required=True, help="arrivals per second")
    p.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    p.add_argument("--start-at", type=float, default=0.0, help="epoch seconds of the first arrival")
    p.add_argument("--timeout", type=float, default=12.0, help="seconds an answer may take once written")
    p.add_argument("--drain", type=float, default=60.0, help="seconds to finish after the last arrival")
    p.add_argument("--out", required=True, help="the JSON result")
    a = p.parse_args()
    if a.conns < 1 or a.rate <= 0 or a.duration <= 0:
        p.error("--conns, --rate and --duration must be positive")
    result = asyncio.run(Pool(a).run())
    Path(a.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
