"""A fault-injecting TCP proxy for the end-to-end tests, switchable at run time.

Run as a process (one proxy = one listening port forwarding to one target):

    python tests/e2e/faultproxy.py --listen PORT --target PORT --control PORT

and driven through its control port, one JSON object per line each way:

    {"op": "set", "fault": "none"}                       forward everything
    {"op": "set", "fault": "latency", "ms": 200}         answers delayed
    {"op": "set", "fault": "blackhole"}                  accept, never answer
    {"op": "set", "fault": "reset", "probability": 1.0}  connections reset (RST)
    {"op": "set", "fault": "halfopen"}                   open connections go silent for good
    {"op": "stats"}                                      counters

(`harness.FaultProxy` is the tests' client.)

What each fault does, and why this way:

- `latency ms`: every chunk from the target back to the client is held `ms` before it is
  written (order kept), so a request/answer round trip costs `ms` more. Chunks read
  before the fault is cleared keep their delay.
- `blackhole`: nothing moves in either direction on any connection, and new connections
  are accepted but not forwarded (a hung peer, or a network path that drops packets).
  Nothing is dropped: what was read is held and delivered once the fault is cleared, as
  TCP would after a partition heals (the client has usually given up and closed by then;
  its late request still reaches the target). Dropping bytes in the middle of a stream
  is not something TCP does, and would desynchronise pipelined protocols (RESP) in ways
  no real network can.
- `reset`: every open connection is reset (RST to both sides, SO_LINGER 0) and, while
  the fault lasts, each new connection is reset at once with `probability`.
- `halfopen`: the connections open now stop moving data for good, in both directions,
  and are never closed (a peer that vanished, or a NAT that lost its state, without a
  FIN or RST); the proxy stops reading them, so their kernel buffers fill. New
  connections are forwarded normally. It is a one-shot action: the fault is then `none`
  again, and the frozen connections stay frozen until their client gives up on them.

Standard library only (asyncio); the loop is single-threaded, so every switch is seen by
every connection at once. Every connection is closed when the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import sys
import time
from typing import Any, Optional

CHUNK = 64 * 1024
FAULTS = ("none", "latency", "blackhole", "reset", "halfopen")
# Chunks from the target on their way back to the client, each with when it may be written.
Chunks = "asyncio.Queue[tuple[float, bytes]]"


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} faultproxy: {msg}", flush=True)


def _rst(writer: Optional[asyncio.StreamWriter]) -> None:
    """Close with a reset (RST), not a FIN."""
    if writer is None or writer.is_closing():
        return
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


class Conn:
    """One client connection and its connection to the target."""

    def __init__(self, cid: int, client: asyncio.StreamWriter) -> None:
        self.cid = cid
        self.client = client
        self.upstream: Optional[asyncio.StreamWriter] = None
        self.frozen = False
        self.tasks: list[asyncio.Task[Any]] = []


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.fault = "none"
        self.latency = 0.0
        self.reset_probability = 1.0
        self.flowing = asyncio.Event()  # cleared while black-holed
        self.flowing.set()
        self.never = asyncio.Event()  # never set: what a frozen connection waits for
        self.conns: dict[int, Conn] = {}
        self.next_id = 0
        self.counters = {
            "accepted": 0,
            "forwarded": 0,  # connections made to the target
            "connect_failed": 0,
            "reset": 0,
            "frozen": 0,
            "bytes_up": 0,
            "bytes_down": 0,
        }

    # -- control

    def set_fault(self, fault: str, params: dict[str, Any]) -> None:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
        self.latency = float(params.get("ms", 0)) / 1000.0 if fault == "latency" else 0.0
        if fault == "blackhole":
            self.flowing.clear()
        else:
            self.flowing.set()
        if fault == "reset":
            self.reset_probability = float(params.get("probability", 1.0))
            for conn in list(self.conns.values()):
                if random.random() < self.reset_probability:
                    self._reset(conn)
        if fault == "halfopen":
            for conn in self.conns.values():
                if not conn.frozen:
                    conn.frozen = True
                    self.counters["frozen"] += 1
            fault = "none"  # one shot: new connections are forwarded
        self.fault = fault
        _log(f"fault {fault} {params} ({len(self.conns)} connections open)")

    def stats(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "latency_ms": self.latency * 1000.0,
            "open": len(self.conns),
            "frozen_open": sum(1 for c in self.conns.values() if c.frozen),
            **self.counters,
        }

    # -- connections

    def _reset(self, conn: Conn) -> None:
        self.counters["reset"] += 1
        _rst(conn.client)
        _rst(conn.upstream)
        for task in conn.tasks:
            task.cancel()
        self.conns.pop(conn.cid, None)

    async def _moving(self, conn: Conn) -> None:
        """Returns when data may move on `conn`; never while it is frozen."""
        await self.flowing.wait()
        if conn.frozen:
            await self.never.wait()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counters["accepted"] += 1
        self.next_id += 1
        conn = Conn(self.next_id, writer)
        if self.fault == "reset" and random.random() < self.reset_probability:
            self.counters["reset"] += 1
            _rst(writer)
            return
        self.conns[conn.cid] = conn
        try:
            await self._moving(conn)  # black hole: accepted, not forwarded
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError as e:
                self.counters["connect_failed"] += 1
                _log(f"#{conn.cid}: cannot connect to {self.target[0]}:{self.target[1]}: {e}")
                _rst(writer)
                return
            self.counters["forwarded"] += 1
            conn.upstream = up_writer
            if conn.cid not in self.conns:  # reset while connecting
                _rst(up_writer)
                return
            queue: Chunks = asyncio.Queue()
            conn.tasks = [
                asyncio.ensure_future(self._pump(conn, reader, up_writer, "bytes_up")),
                asyncio.ensure_future(self._pump_delayed(conn, up_reader, queue)),
                asyncio.ensure_future(self._write_delayed(conn, queue, writer)),
            ]
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            if self.conns.pop(conn.cid, None) is not None:
                for w in (conn.client, conn.upstream):
                    if w is not None and not w.is_closing():
                        w.close()

    async def _pump(self, conn: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str) -> None:
        """Client -> target, as it comes (while moving)."""
        try:
            while True:
                data = await reader.read(CHUNK)
                await self._moving(conn)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                self.counters[counter] += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            self._broken(conn)

    async def _pump_delayed(self, conn: Conn, reader: asyncio.StreamReader, queue: "Chunks") -> None:
        """Target -> queue, each chunk stamped with when it may be written."""
        try:
            while True:
                data = await reader.read(CHUNK)
                await self._moving(conn)
                await queue.put((time.monotonic() + self.latency, data))
                if not data:
                    return
        except (ConnectionError, OSError):
            self._broken(conn)

    async def _write_delayed(self, conn: Conn, queue: "Chunks", writer: asyncio.StreamWriter) -> None:
        """Queue -> client, each chunk at its time."""
        try:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._moving(conn)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                self.counters["bytes_down"] += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            self._broken(conn)

    def _broken(self, conn: Conn) -> None:
        """One side failed: the other side is reset too (what a real peer would see)."""
        if conn.frozen:
            return
        if self.conns.pop(conn.cid, None) is not None:
            _rst(conn.client)
            _rst(conn.upstream)
            for task in conn.tasks:
                task.cancel()


async def control(proxy: Proxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            line = await reader.readline()
            if not line:
                return
            try:
                cmd = json.loads(line)
                op = cmd.get("op")
                if op == "set":
                    proxy.set_fault(str(cmd.get("fault")), cmd)
                elif op != "stats":
                    raise ValueError(f"unknown op {op!r}")
                answer: dict[str, Any] = {"ok": True, **proxy.stats()}
            except Exception as e:  # noqa: BLE001 - reported to the client
                answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            writer.write((json.dumps(answer) + "\n").encode())
            await writer.drain()
    finally:
        writer.close()


async def serve(args: argparse.Namespace) -> None:
    proxy = Proxy(args.target_host, args.target)
    server = await asyncio.start_server(proxy.handle, args.host, args.listen, backlog=1024)
    ctl = await asyncio.start_server(lambda r, w: control(proxy, r, w), args.host, args.control)
    _log(f"{args.host}:{args.listen} -> {args.target_host}:{args.target}, control on {args.host}:{args.control}")
    async with server, ctl:
        await asyncio.gather(server.serve_forever(), ctl.serve_forever())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--listen", type=int, required=True)
    p.add_argument("--target-host", default="127.0.0.1")
    p.add_argument("--target", type=int, required=True)
    p.add_argument("--control", type=int, required=True)
    args = p.parse_args()
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
