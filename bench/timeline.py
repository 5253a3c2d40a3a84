#!/usr/bin/env python3
"""A demo Weitter timeline service with a fixed capacity, for the hot-event benchmark.

A pool of --workers workers each takes --service-ms per request (a sleep: it stands for
the cache/database work of building a timeline page, and leaves the 2 CPU cores to the
gateway and the load generator), so capacity = workers / service time (4 / 20 ms = 200
req/s by default). Requests beyond what the workers are doing wait in a FIFO queue of at
most --queue entries; latency grows with the queue; when the queue is full the service
answers `503` at once with an `X-Timeline: queue-full` header (so the load generator can
tell the upstream's refusals from the gateway's).

    timeline.py --port 18080 [--workers 4] [--service-ms 20] [--queue 100]

GET /__stats answers (outside the queue) the per-second record: received, served,
rejected, and p50/p99 of the time from arrival to answer for served requests.
GET /__health answers 200. asyncio.Protocol, standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time


class Stats:
    def __init__(self) -> None:
        self.t0 = time.time()
        self.bins: dict[int, dict] = collections.defaultdict(
            lambda: {"received": 0, "served": 0, "rejected": 0, "lat_ms": []})

    def bin(self, t: float) -> dict:
        return self.bins[int(t)]

    def report(self) -> dict:
        out = {}
        for sec in sorted(self.bins):
            b = self.bins[sec]
            lat = sorted(b["lat_ms"])

            def pct(p: float) -> float | None:
                return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] if lat else None

            out[str(sec)] = {"received": b["received"], "served": b["served"], "rejected": b["rejected"],
                             "p50_ms": pct(50), "p99_ms": pct(99)}
        return out


class Service:
    def __init__(self, workers: int, service_s: float, queue: int) -> None:
        self.service_s = service_s
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=queue)
        self.stats = Stats()
        self.workers = workers

    def start(self) -> None:
        for _ in range(self.workers):
            asyncio.ensure_future(self.worker())

    async def worker(self) -> None:
        while True:
            proto, path, arrived = await self.queue.get()
            await asyncio.sleep(self.service_s)
            now = time.time()
            b = self.stats.bin(now)
            b["served"] += 1
            b["lat_ms"].append(round((now - arrived) * 1000, 2))
            body = json.dumps({"timeline": path, "posts": 20}).encode()
            proto.respond(200, body, [])


class Http(asyncio.Protocol):
    def __init__(self, service: Service) -> None:
        self.service = service
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def respond(self, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        reason = {200: "OK", 503: "Service Unavailable", 404: "Not Found"}.get(status, "X")
        head = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}", "Content-Type: application/json"]
        head += [f"{k}: {v}" for k, v in headers]
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, self.buf = self.buf.split(b"\r\n\r\n", 1)
            line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            path = line[1] if len(line) > 1 else "/"
            self.handle(path)

    def handle(self, path: str) -> None:
        svc = self.service
        if path == "/__health":
            self.respond(200, b"ok", [])
            return
        if path == "/__stats":
            self.respond(200, json.dumps({"t0": svc.stats.t0, "bins": svc.stats.report()}).encode(), [])
            return
        now = time.time()
        b = svc.stats.bin(now)
        b["received"] += 1
        try:
            svc.queue.put_nowait((self, path, now))
        except asyncio.QueueFull:
            b["rejected"] += 1
            self.respond(503, b'{"error":"timeline overloaded"}', [("X-Timeline", "queue-full")])


async def main_async(a: argparse.Namespace) -> None:
    service = Service(a.workers, a.service_ms / 1000, a.queue)
    service.start()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Http(service), a.host, a.port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--service-ms", type=float, default=20.0)
    p.add_argument("--queue", type=int, default=100)
    a = p.parse_args()
    try:
        asyncio.run(main_async(a))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
