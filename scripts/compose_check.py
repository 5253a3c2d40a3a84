#!/usr/bin/env python3
"""The checks scripts/compose-test runs against the docker-compose stack once it is up.

Every request goes to Envoy's published ports on 127.0.0.1; the stack is docker-compose.yml
with docker/envoy.yaml (`/sample`: 5 per minute per device, global scope through
diana-quota and Redis; every answer Diana refuses is 503 + Retry-After + X-RateLimit-*).

1. ready   Envoy's admin /ready, the upstream through Envoy (`/`), and diana-quota answering
           200 to the filter's callouts (warm-up requests with their own device ids).
2. demo    the README's demo: 7 requests to /sample with x-device-id: phone-1 must answer
           200 200 200 200 200 503 503, the 503s from Diana (its headers and body); Diana's
           metrics are in the admin /stats; Redis holds the global counters.
3. outage  traffic to /sample from 40 devices at ~25 requests/s while the Redis container
           is stopped (`podman stop`) and started again: every answer must be 200 or
           Diana's 503 (no Envoy error, no connection error); the filter must degrade
           (gauge wasmcustom.diana_global_degraded = 1) and come back to global (gauge 0,
           diana-quota answering 200 again, Redis counting again).

Standard library only. Exit status 0 when every check passed; the last line is
'N passed, N failed'.

Usage: compose_check.py --port P --admin-port A --redis-container NAME
                        [--podman podman] [--outage-seconds 8]
"""

from __future__ import annotations

import argparse
import http.client
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Callable, Dict, List, Optional, Tuple

DEGRADED = "wasmcustom.diana_global_degraded"
QUOTA_200 = "cluster.diana_quota.upstream_rq_200"
QUOTA_503 = "cluster.diana_quota.upstream_rq_503"


def log(message: str) -> None:
    print(f"[compose-check] {message}", flush=True)


class Check:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def expect(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
            log(f"ok    {what}")
        else:
            self.failed += 1
            log(f"FAIL  {what}")
        return ok


def request(
    port: int, path: str, headers: Optional[Dict[str, str]] = None, timeout: float = 5.0
) -> Tuple[int, Dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def is_diana_rejection(status: int, headers: Dict[str, str], body: bytes) -> bool:
    return (
        status == 503
        and "retry-after" in headers
        and "x-ratelimit-limit" in headers
        and body == b"rate limited\n"
    )


def stats(admin_port: int, pattern: str) -> Dict[str, int]:
    _, _, body = request(admin_port, f"/stats?filter={pattern}")
    values: Dict[str, int] = {}
    for line in body.decode().splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            values[name] = int(value)
    return values


def wait_for(what: str, condition: Callable[[], bool], timeout: float, step: float = 0.1) -> Optional[float]:
    """Seconds until `condition()` held, or None after `timeout` (exceptions count as false)."""
    start = time.monotonic()
    while True:
        try:
            if condition():
                return time.monotonic() - start
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() - start > timeout:
            log(f"timed out after {timeout:.0f}s waiting for {what}")
            return None
        time.sleep(step)


def podman(args: argparse.Namespace, *command: str) -> str:
    done = subprocess.run(
        [args.podman, *command], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(command)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout.strip()


def redis_keys(args: argparse.Namespace) -> int:
    return int(podman(args, "exec", args.redis_container, "redis-cli", "dbsize"))


def phase_ready(args: argparse.Namespace, check: Check) -> bool:
    ready = wait_for("Envoy /ready", lambda: request(args.admin_port, "/ready")[0] == 200, 60)
    if not check.expect(ready is not None, "Envoy admin /ready answers 200"):
        return False
    upstream = wait_for("the upstream through Envoy", lambda: request(args.port, "/")[0] == 200, 60)
    if not check.expect(upstream is not None, "GET / through Envoy reaches the demo upstream (200)"):
        return False
    warm = [0]

    def quota_answers() -> bool:
        warm[0] += 1
        request(args.port, "/sample", {"x-device-id": f"warmup-{warm[0]}"})
        return stats(args.admin_port, "diana_quota.upstream_rq_200$").get(QUOTA_200, 0) > 0

    quota = wait_for("diana-quota answering 200", quota_answers, 60, step=0.5)
    return check.expect(
        quota is not None,
        f"diana-quota answers the filter's callouts (200) after {warm[0]} warm-up request(s)",
    )


def phase_demo(args: argparse.Namespace, check: Check) -> None:
    answers = [request(args.port, "/sample", {"x-device-id": "phone-1"}) for _ in range(7)]
    statuses = [status for status, _, _ in answers]
    log(f"/sample x-device-id: phone-1, 7 requests: {' '.join(map(str, statuses))}")
    check.expect(statuses == [200] * 5 + [503] * 2, "the demo answers 200 200 200 200 200 503 503")
    status, headers, body = answers[-1]
    check.expect(
        is_diana_rejection(status, headers, body),
        "the 503 is Diana's: Retry-After {}, X-RateLimit-Limit {}, body {!r}".format(
            headers.get("retry-after"), headers.get("x-ratelimit-limit"), body
        ),
    )
    def counted(metrics: Dict[str, int]) -> bool:
        return (
            metrics.get("wasmcustom.diana_rule_allowed.sample_global", 0) >= 5
            and metrics.get("wasmcustom.diana_rule_limited.sample_global", 0) >= 2
            and metrics.get("wasmcustom.diana_global_callouts", 0) > 0
            and metrics.get(DEGRADED) == 0
        )

    # Diana's workers hand their counts to Envoy from their ticks (a second at most).
    deadline = time.monotonic() + 5
    metrics = stats(args.admin_port, "^wasmcustom\\.")
    while not counted(metrics) and time.monotonic() < deadline:
        time.sleep(0.2)
        metrics = stats(args.admin_port, "^wasmcustom\\.")
    for name in sorted(metrics):
        print(f"    {name}: {metrics[name]}")
    check.expect(
        counted(metrics),
        "Diana's metrics are in Envoy's /stats (sample_global allowed >= 5, limited >= 2, "
        "callouts > 0, not degraded)",
    )
    keys = redis_keys(args)
    check.expect(keys > 0, f"Redis holds the global counters ({keys} keys)")


class Traffic(threading.Thread):
    """Requests /sample in a loop on one keep-alive connection, recording every outcome."""

    def __init__(self, port: int, rate: float, devices: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.interval = 1.0 / rate
        self.devices = devices
        self.stop_event = threading.Event()
        self.outcomes: List[Tuple[float, str]] = []  # (monotonic time, "200"/"limited"/other)
        self.errors: List[str] = []

    def run(self) -> None:
        conn: Optional[http.client.HTTPConnection] = None
        i = 0
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            i += 1
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/sample", headers={"x-device-id": f"load-{i % self.devices}"})
                resp = conn.getresponse()
                body = resp.read()
                headers = {k.lower(): v for k, v in resp.getheaders()}
                if resp.status == 200:
                    outcome = "200"
                elif is_diana_rejection(resp.status, headers, body):
                    outcome = "limited"
                else:
                    outcome = f"{resp.status} {body[:80]!r}"
                    self.errors.append(outcome)
            except (OSError, http.client.HTTPException) as error:
                outcome = f"error {type(error).__name__}: {error}"
                self.errors.append(outcome)
                if conn is not None:
                    conn.close()
                conn = None
            self.outcomes.append((time.monotonic(), outcome))
            next_at += self.interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        if conn is not None:
            conn.close()

    def counts(self, start: float = 0.0, end: float = float("inf")) -> Counter:
        return Counter(o if o in ("200", "limited") else "other" for t, o in self.outcomes if start <= t < end)


def phase_outage(args: argparse.Namespace, check: Check) -> None:
    traffic = Traffic(args.port, rate=25.0, devices=40)
    traffic.start()
    try:
        time.sleep(2.0)
        quota_200_before = stats(args.admin_port, "diana_quota.upstream_rq_200$").get(QUOTA_200, 0)
        t_stop = time.monotonic()
        podman(args, "stop", "-t", "2", args.redis_container)
        t_stopped = time.monotonic()
        log(f"redis container stopped ({t_stopped - t_stop:.1f}s for podman stop)")
        degraded = wait_for(
            "the filter to degrade", lambda: stats(args.admin_port, "diana_global_degraded$").get(DEGRADED) == 1, 20
        )
        check.expect(
            degraded is not None,
            "the filter degrades to local enforcement ({} = 1, {:.1f}s after Redis stopped)".format(
                DEGRADED, (t_stopped - t_stop) + (degraded or 0.0)
            ),
        )
        time.sleep(max(0.0, args.outage_seconds - (time.monotonic() - t_stop)))
        down = stats(args.admin_port, "diana_quota.upstream_rq_(200|503)$")
        t_start = time.monotonic()
        podman(args, "start", args.redis_container)
        t_started = time.monotonic()
        log(
            f"redis container started again after {t_start - t_stop:.1f}s down "
            f"({t_started - t_start:.1f}s for podman start)"
        )

        def global_again() -> bool:
            now = stats(args.admin_port, "diana_global_degraded$|diana_quota.upstream_rq_200$")
            return now.get(DEGRADED) == 0 and now.get(QUOTA_200, 0) > down.get(QUOTA_200, 0)

        back = wait_for("the filter to be global again", global_again, 30)
        check.expect(
            back is not None,
            "global again: {} = 0 and diana-quota answering 200, {:.1f}s after Redis started".format(
                DEGRADED, (t_started - t_start) + (back or 0.0)
            ),
        )
        time.sleep(2.0)
    finally:
        traffic.stop_event.set()
        traffic.join(10)
    after = stats(args.admin_port, "diana_quota.upstream_rq_(200|503)$")
    total = traffic.counts()
    during = traffic.counts(t_stop, t_started)
    log(
        "traffic: {} requests: {} x 200, {} x Diana 503, {} other; while Redis was down: {} x 200, "
        "{} x Diana 503, {} other".format(
            sum(total.values()), total["200"], total["limited"], total["other"],
            during["200"], during["limited"], during["other"],
        )
    )
    log(
        "diana-quota answers seen by Envoy: 200 x {} before the stop, 503 x {} during the outage "
        "(the filter stops calling while degraded), 200 x {} after the restart".format(
            quota_200_before,
            down.get(QUOTA_503, 0),
            after.get(QUOTA_200, 0) - down.get(QUOTA_200, 0),
        )
    )
    for error in traffic.errors[:10]:
        log(f"    failed request: {error}")
    check.expect(
        sum(total.values()) > 0 and total["other"] == 0 and sum(during.values()) > 0,
        f"no request failed during the Redis outage ({len(traffic.errors)} errors)",
    )
    keys = redis_keys(args)
    check.expect(keys > 0, f"the restarted Redis (empty, no persistence) counts again ({keys} keys)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--admin-port", type=int, required=True)
    parser.add_argument("--redis-container", required=True)
    parser.add_argument("--podman", default="podman")
    parser.add_argument("--outage-seconds", type=float, default=8.0)
    args = parser.parse_args()
    check = Check()
    try:
        log("phase 1: ready")
        if phase_ready(args, check):
            log("phase 2: the README's demo")
            phase_demo(args, check)
            log("phase 3: Redis stopped mid-traffic, then started again")
            phase_outage(args, check)
    except Exception as error:  # a check that could not run is a failure, reported as such
        check.expect(False, f"check aborted: {type(error).__name__}: {error}")
    print(f"compose-check: {check.passed} passed, {check.failed} failed", flush=True)
    return 0 if check.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
