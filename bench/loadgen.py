#!/usr/bin/env python3
"""Open-loop HTTP/1.1 load generator for scripts/bench (asyncio, standard library only).

Requests are scheduled at fixed times (rate phases), whatever the answers do: a slow
server does not slow the offered load down (no coordinated omission); latency is measured
from the scheduled time. Each request takes an idle keep-alive connection or opens one
(at most --max-conns in flight; a request that finds none waits, and that wait counts in
its latency).

    loadgen.py --target 127.0.0.1:10000 --path /hot/trending --phase 0:20:1000 \
        [--phase 20:30:200 ...] [--devices 2000] [--users 5000] [--start-at EPOCH] \
        [--timeout 5] [--out result.json] [--log requests.jsonl]

`--path` may contain `{user}` (a random user id out of --users). With --devices, each
request carries `x-device-id: d<random>`. Answers are classified:
  ok        2xx
  diana     429/503 with Retry-After or X-RateLimit-* and no X-Timeline header (Diana's rejection)
  upstream  503 with X-Timeline (the timeline upstream's own "queue full")
  s<code>   any other status (e.g. s503 from Envoy itself)
  timeout / error
The JSON output has totals and, per second of the schedule (by scheduled time), counts per
class and the latencies (ms) of that second's answers.

--log writes the exact request log: one JSON line per request written to a connection, in
the order sent, `{"ts": <epoch seconds when its bytes were written>, "method", "path",
"headers", "status", "class"}` — the input of `diana simulate`, which ignores the answer
fields (bench/weitter.py compares the two).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import defaultdict


def parse_phase(text: str) -> tuple[float, float, float]:
    a, b, r = text.split(":")
    return float(a), float(b), float(r)


def schedule(phases: list[tuple[float, float, float]]):
    """Offsets (seconds from start) of every request, in order."""
    for start, end, rate in phases:
        if rate <= 0:
            continue
        n = int(round((end - start) * rate))
        for k in range(n):
            yield start + k / rate


class Gen:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        host, port = a.target.rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.sem = asyncio.Semaphore(a.max_conns)
        self.bins: dict[int, dict] = defaultdict(lambda: {"sent": 0, "classes": defaultdict(int),
                                                          "lat_ms": defaultdict(list)})
        self.done_ok: dict[int, int] = defaultdict(int)
        self.totals: dict[str, int] = defaultdict(int)
        self.max_lag = 0.0
        self.opened = 0
        self.first_send: float | None = None
        self.last_send: float | None = None
        self.rng = random.Random(a.seed)
        # --log: (sent at, path, headers, status, class) of every request written.
        self.log: list[tuple[float, str, dict[str, str], int | None, str]] = []

    def request(self) -> tuple[bytes, str, dict[str, str]]:
        path = self.a.path
        if "{user}" in path:
            path = path.replace("{user}", f"u{self.rng.randrange(self.a.users)}")
        headers = {"host": self.a.host_header, "user-agent": "diana-bench"}
        if self.a.devices:
            headers["x-device-id"] = f"d{self.rng.randrange(self.a.devices)}"
        lines = [f"GET {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode(), path, headers

    async def conn(self):
        if self.idle:
            return self.idle.pop()
        self.opened += 1
        return await asyncio.open_connection(self.host, self.port)

    async def one(self, sched: float, t0: float) -> None:
        second = int(sched - t0)
        b = self.bins[second]
        b["sent"] += 1
        payload, path, headers = self.request()
        cls = "error"
        status: int | None = None
        sent_at: float | None = None
        async with self.sem:
            rw = None
            try:
                rw = await asyncio.wait_for(self.conn(), self.a.timeout)
                reader, writer = rw
                sent_at = time.time()
                if self.first_send is None:
                    self.first_send = sent_at
                self.last_send = max(self.last_send or 0.0, sent_at)
                writer.write(payload)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.a.timeout)
                lines = head.decode("latin-1").split("\r\n")
                status = int(lines[0].split()[1])
                answer = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        answer[k.strip().lower()] = v.strip()
                n = int(answer.get("content-length", "0"))
                if n:
                    await asyncio.wait_for(reader.readexactly(n), self.a.timeout)
                if 200 <= status < 300:
                    cls = "ok"
                elif "x-timeline" in answer:
                    cls = "upstream"
                elif status in (429, 503) and ("retry-after" in answer or "x-ratelimit-limit" in answer):
                    cls = "diana"
                else:
                    cls = f"s{status}"
                if answer.get("connection", "").lower() == "close":
                    writer.close()
                else:
                    self.idle.append(rw)
            except asyncio.TimeoutError:
                cls = "timeout"
                if rw:
                    rw[1].close()
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError, asyncio.LimitOverrunError):
                cls = "error"
                if rw:
                    rw[1].close()
        if self.a.log and sent_at is not None:
            self.log.append((sent_at, path, headers, status, cls))
        now = time.time()
        b["classes"][cls] += 1
        b["lat_ms"][cls].append(round((now - sched) * 1000, 3))
        self.totals[cls] += 1
        if cls == "ok":
            self.done_ok[int(now - t0)] += 1

    async def run(self) -> dict:
        a = self.a
        t0 = a.start_at if a.start_at else time.time() + 0.2
        tasks = set()
        while time.time() < t0 - 0.002:
            await asyncio.sleep(min(0.05, t0 - time.time() - 0.001))
        while time.time() < t0:
            pass
        it = schedule([parse_phase(p) for p in a.phase])
        nxt = next(it, None)
        sent = 0
        while nxt is not None:
            now = time.time()
            due = t0 + nxt
            if due > now:
                await asyncio.sleep(min(due - now, 0.002))
                continue
            # every request that is due, now
            while nxt is not None and t0 + nxt <= now:
                self.max_lag = max(self.max_lag, now - (t0 + nxt))
                t = asyncio.ensure_future(self.one(t0 + nxt, t0))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                sent += 1
                nxt = next(it, None)
            await asyncio.sleep(0)
        if tasks:
            await asyncio.wait(tasks, timeout=a.timeout + 2)
        for _, w in self.idle:
            w.close()
        if a.log:
            self.log.sort(key=lambda entry: entry[0])
            with open(a.log, "w") as f:
                for sent_at, path, headers, status, cls in self.log:
                    f.write(json.dumps({"ts": round(sent_at, 6), "method": "GET", "path": path, "headers": headers,
                                        "status": status, "class": cls}) + "\n")
        bins = {}
        for s in sorted(self.bins):
            b = self.bins[s]
            bins[s] = {"sent": b["sent"], "classes": dict(b["classes"]), "lat_ms": {k: v for k, v in b["lat_ms"].items()}}
        return {
            "label": a.label, "target": a.target, "path": a.path, "phases": a.phase, "start_at": t0,
            "sent": sent, "totals": dict(self.totals), "bins": bins,
            "ok_by_completion_second": dict(sorted(self.done_ok.items())),
            "max_schedule_lag_ms": round(self.max_lag * 1000, 2), "connections_opened": self.opened,
            "first_send": self.first_send, "last_send": self.last_send,
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="host:port")
    p.add_argument("--path", default="/")
    p.add_argument("--host-header", default="bench")
    p.add_argument("--phase", action="append", required=True, help="FROM:TO:RATE (seconds, seconds, req/s)")
    p.add_argument("--devices", type=int, default=0)
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--start-at", type=float, default=0.0, help="epoch seconds (default: now)")
    p.add_argument("--max-conns", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--label", default="")
    p.add_argument("--out")
    p.add_argument("--log", help="write every request sent as a JSON line (input of `diana simulate`)")
    a = p.parse_args()
    result = asyncio.run(Gen(a).run())
    text = json.dumps(result)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
