"""Faults between the parts: what the gateways do when the link to the quota service, or
the quota service's link to Redis, goes bad — measured, and asserted where the design
promises something (DESIGN §4 "Degrade", docs/wire-format.md "Deadlines").

Topology of every test (all on 127.0.0.1, ports chosen at run time):

    client ─▶ gateway 1 ─┐                                   (Envoy 4 workers, or nginx 2)
    client ─▶ gateway 2 ─┴▶ faultproxy ─▶ diana-quota ─▶ faultproxy ─▶ redis-server
                            (gateway link)                  (redis link)

`tests/e2e/faultproxy.py` injects, switched at run time: latency (10 ms … 2 s on the
answers), a black hole (accept, never answer; held data delivered when it heals),
connection resets, and half-open connections (the open connections go silent for good,
never closed). Also: Redis restarted, and a Redis Cluster master killed with its
replica promoted.

While a fault lasts and after it, a steady load runs on both gateways (new connection per
request, `x-tenant-id` from a small set) and every answer is kept. Asserted each time:
- no request fails: every answer is 200 or the configured rejection (429 here), no 5xx
  from the gateway, no connection error, no timeout of the client;
- no request waits longer than the callout timeout (`global.timeout_ms`, 200 ms here)
  plus a scheduling margin, during the fault and after;
- the gateways do degrade to local enforcement when the fault makes the service fail
  (`diana_global_degraded` = 1 on both), and do not when it does not (10 ms of latency);
- after the fault, both gateways are global again (`diana_global_degraded` back to 0 and
  callouts answered again) within a bound, and a fresh limit admits exactly `rpu` over
  the two gateways.
Measured and recorded (conftest prints them, RELIABILITY.md "Faults between the parts"):
p50/p99/max latency and statuses during each step and after recovery, seconds until
global again.

CI runs a subset that keeps the whole file within about three minutes: every fault on
the gateway link on both hosts (the callout path is host code; half-open only on Envoy,
whose upstream pools keep connections — ngx_wasm_module opens one per callout), every
fault on the Redis link, Redis restart and cluster failover on Envoy (the gateway only
sees the service's fast 503s there, the same on both hosts). `DIANA_FAULTS_LONG=1` runs
the service-side tests on both hosts too, with 10 s faults and seven latency steps."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import pytest

import harness
from harness import FaultProxy, Quota, Redis, Resp, record, send_concurrent, statuses

LONG = os.environ.get("DIANA_FAULTS_LONG", "") not in ("", "0")
HOSTS_ALL = ["envoy", "nginx"]
# Host-independent faults (the gateway only sees the quota service's fast 503s): one host
# in CI, both in the long run.
HOSTS_SERVICE_SIDE = HOSTS_ALL if LONG else ["envoy"]

TIMEOUT_MS = 200  # global.timeout_ms of the gateways
RETRY_SECONDS = 1  # global.retry_seconds: the breaker probes once a second
REJECT = 429
FRESH_RPU = 20
RATE_PER_GATEWAY = 40.0  # steady load, requests per second and gateway
TENANTS = 16  # identities of the steady load (keys spread over cluster slots)
HEALTHY_SECONDS = 1.0
FAULT_SECONDS = 10.0 if LONG else 2.5
AFTER_SECONDS = 5.0 if LONG else 1.5
# Longest wait of one request: a callout that times out, plus scheduling on a machine
# whose two cores are shared by the gateways, the service, Redis, the proxies and the
# load generator.
SCHEDULING_MARGIN = 0.300
MAX_WAIT = TIMEOUT_MS / 1000 + SCHEDULING_MARGIN
# From the end of a fault until both gateways are global again: one retry period for
# the breaker, the service's reconnect back-off (100 ms), polling, and margin.
MAX_RECOVERY_SECONDS = RETRY_SECONDS + 4.0

DOC = f"""
resources:
  - Url: /
    rules:
      - {{name: steady, actor: tenant, rpu: 1000000, unit: hour, algo: TB, scope: global}}
      - {{name: fresh, actor: fresh, rpu: {FRESH_RPU}, unit: hour, algo: TB, scope: global}}
actors:
  tenant: {{header: x-tenant-id}}
  fresh: {{header: x-fresh-id}}
response: {{status: {REJECT}}}
global: {{timeout_ms: {TIMEOUT_MS}, retry_seconds: {RETRY_SECONDS}}}
"""


# --------------------------------------------------------------------------- load


class Load:
    """Steady traffic on every gateway from background threads: `rate` requests per
    second and gateway, each on a new connection, `x-tenant-id` cycling over `TENANTS`
    values (so only the `steady` rule applies). Every answer is kept with its gateway."""

    def __init__(self, gateways: Sequence, rate: float = RATE_PER_GATEWAY, threads_per_gateway: int = 6) -> None:
        self.gateways = list(gateways)
        self.rate = rate
        self.threads_per_gateway = threads_per_gateway
        self.results: list[tuple[int, Resp]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    def _run(self, g: int, k: int) -> None:
        port = self.gateways[g].port
        period = self.threads_per_gateway / self.rate
        t0 = time.monotonic() + k * period / self.threads_per_gateway
        i = 0
        while not self.stopping.is_set():
            delay = t0 + i * period - time.monotonic()
            if delay > 0:
                self.stopping.wait(delay)
                continue
            tenant = f"load-{(i * self.threads_per_gateway + k) % TENANTS}"
            r = harness.request(port, "/", {"x-tenant-id": tenant}, timeout=5.0)
            with self.lock:
                self.results.append((g, r))
            i += 1
            if time.monotonic() - (t0 + i * period) > 1.0:  # far behind (a slow answer): skip ahead
                i = int((time.monotonic() - t0) / period)

    def start(self) -> "Load":
        for g in range(len(self.gateways)):
            for k in range(self.threads_per_gateway):
                t = threading.Thread(target=self._run, args=(g, k), daemon=True)
                t.start()
                self.threads.append(t)
        return self

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=15)
        assert not any(t.is_alive() for t in self.threads), "a load thread did not stop"

    def __enter__(self) -> "Load":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def between(self, t0: float, t1: float) -> list[Resp]:
        """Answers to the requests sent in [t0, t1) (monotonic clock)."""
        with self.lock:
            return [r for _, r in self.results if t0 <= r.t_sent < t1]


def failed(resps: Sequence[Resp]) -> list[Resp]:
    """Requests that did not get 200 or the configured rejection."""
    return [r for r in resps if r.error or r.status not in (200, REJECT)]


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


@dataclass
class Window:
    """The answers of one phase and what they say."""

    label: str
    resps: list[Resp]
    degraded_requests: int = 0
    figures: dict[str, object] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        lats = [r.latency for r in self.resps if r.status is not None]
        return {
            "requests": len(self.resps),
            "statuses": statuses(self.resps),
            "failed": len(failed(self.resps)),
            "p50_ms": round(quantile(lats, 0.50) * 1000, 1),
            "p99_ms": round(quantile(lats, 0.99) * 1000, 1),
            "max_ms": round(max(lats, default=float("nan")) * 1000, 1),
            "degraded_requests": self.degraded_requests,
            **self.figures,
        }

    def check(self, max_wait: float = MAX_WAIT) -> None:
        bad = failed(self.resps)
        assert not bad, f"{self.label}: {len(bad)} failed requests, e.g. {bad[:3]}; {statuses(self.resps)}"
        assert self.resps, f"{self.label}: no request was answered"
        worst = max(r.latency for r in self.resps)
        assert worst <= max_wait, f"{self.label}: a request waited {worst * 1000:.0f} ms (bound {max_wait * 1000:.0f})"


# --------------------------------------------------------------------------- the stack


def metric(m: dict[str, int], name: str) -> int:
    return int(m.get(name, 0))


def answered(m: dict[str, int]) -> int:
    """Callouts that got an answer the filter believed (callouts minus failures)."""
    return metric(m, "diana_global_callouts") - metric(m, "diana_global_errors")


QUOTA_COUNTERS = ("store_errors_total", "deadline_expired_total", "shed_total", "late_releases_total")


@dataclass
class Stack:
    gateways: list
    quota: Quota
    gateway_link: FaultProxy
    redis_link: Optional[FaultProxy]
    redis: Optional[Redis]

    @property
    def label(self) -> str:
        """The host as test figures name it."""
        return self.gateways[0].label

    def metrics(self, settle: float = harness.METRICS_LAG_S) -> list[dict[str, int]]:
        """Both gateways' metrics; `settle` (see harness.METRICS_LAG_S) is waited once."""
        return harness.metrics_of(self.gateways, settle)

    def quota_counters(self, since: Optional[dict[str, int]] = None) -> dict[str, int]:
        """diana-quota's failure counters (store errors by kind, deadlines, sheds, late
        releases), minus `since` when given."""
        status, body, _ = harness.http_get(self.quota.port, "/metrics", timeout=5.0)
        assert status == 200, status
        out: dict[str, int] = {}
        for line in body.decode().splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, _, value = line.rpartition(" ")
            if any(w in name for w in QUOTA_COUNTERS):
                short = name.replace("diana_quota_", "").replace("_total", "")
                out[short] = int(float(value)) - (since or {}).get(short, 0)
        return {k: v for k, v in out.items() if v}

    def degraded_requests(self, ms: Optional[list[dict[str, int]]] = None) -> int:
        """The requests both gateways enforced locally: from `ms` (a reading already
        taken, when one settled reading serves several figures), else read now (settled)."""
        return sum(metric(m, "diana_global_degraded_requests") for m in (self.metrics() if ms is None else ms))

    def global_again(self, answered_before: Sequence[int]) -> bool:
        """Both gateways' breakers closed, and each had a callout answered since (polled)."""
        ms = self.metrics(settle=0)
        return all(
            metric(m, "diana_global_degraded") == 0 and answered(m) > before for m, before in zip(ms, answered_before)
        )


def start_stack(procs, start_gateway, *, redis_url: Optional[str] = None, redis_proxy: bool = True) -> Stack:
    """Redis (unless `redis_url`), a proxy on the Redis link (unless not `redis_proxy`),
    diana-quota, a proxy on the gateway link, two gateways."""
    redis = None
    redis_link = None
    if redis_url is None:
        redis = procs.add(Redis(procs.log_dir)).start()
        redis_url = redis.url
        if redis_proxy:
            redis_link = procs.add(FaultProxy(procs.log_dir, redis.port, name="faultproxy-redis")).start()
            redis_url = f"redis://{harness.HOST}:{redis_link.port}"
    quota = procs.add(Quota(procs.log_dir, redis_url)).start()
    gateway_link = procs.add(FaultProxy(procs.log_dir, quota.port, name="faultproxy-quota")).start()
    gateways = [start_gateway(DOC, quota_port=gateway_link.port) for _ in range(2)]
    return Stack(gateways, quota, gateway_link, redis_link, redis)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, period: float = 0.1) -> float:
    """Polls `predicate` until true; returns the seconds it took; fails after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def burst(gateways: Sequence, n: int, headers: dict[str, str]) -> list[Resp]:
    """`n` requests at once, half on each gateway, each on its own connection."""
    out: list[Resp] = []
    lock = threading.Lock()

    def run(g) -> None:
        r = send_concurrent(g.port, n // len(gateways), "/", headers)
        with lock:
            out.extend(r)

    threads = [threading.Thread(target=run, args=(g,)) for g in gateways]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def wait_global(stack: Stack, what: str, timeout: float = 15.0) -> float:
    """Sends a request to each gateway every 50 ms (the load may be stopped) until both
    breakers are closed and each gateway had a callout answered; returns the seconds."""
    before = [answered(m) for m in stack.metrics()]

    def probe() -> bool:
        for g in stack.gateways:
            harness.request(g.port, "/", {"x-tenant-id": "probe"}, timeout=5.0)
        return stack.global_again(before)

    return wait_until(probe, timeout, what, period=0.05)


def new_fresh_id(stack: Stack) -> tuple[str, int]:
    """A fresh limit's identity, none of its requests admitted yet."""
    return f"fresh-{uuid.uuid4().hex}", 0


def assert_fresh_limit_exact(
    stack: Stack,
    label: str,
    pick: Callable[[Stack], tuple[str, int]] = new_fresh_id,
    attempts: int = 3,
) -> None:
    """A limit never used before admits exactly rpu of 3 x rpu requests sent over both
    gateways in waves of 10: they are global again, and nothing of the fault is left in
    the count. `pick` gives the limit's identity and how many of its requests it already
    admitted. Exactness is promised while the gateways are global: an attempt during
    which a gateway degraded (one answer from Redis later than its 20 ms timeout on this
    busy machine is enough) is not judged, and another fresh limit is tried once both are
    global again (at most `attempts`); an attempt without degrading must be exact."""
    for attempt in range(1, attempts + 1):
        fresh_id, already = pick(stack)
        # Read without waiting for the workers' counts: a degraded request they hand over
        # later can only make this attempt look degraded (not judged, another tried), never
        # make a degraded one look exact; the reading after the burst waits for them.
        deg0 = stack.degraded_requests(stack.metrics(settle=0))
        headers = {"x-fresh-id": fresh_id}
        resps: list[Resp] = []
        while len(resps) + already < 3 * FRESH_RPU:
            resps += burst(stack.gateways, 10, headers)
        assert not failed(resps), f"{label}: {statuses(resps)} {failed(resps)[:3]}"
        if stack.degraded_requests() == deg0:
            want = {200: FRESH_RPU - already, REJECT: len(resps) - (FRESH_RPU - already)}
            assert statuses(resps) == want, f"{label}: {statuses(resps)}, expected {want} ({already} admitted before)"
            record(
                f"{stack.label}: {label}: fresh limit after recovery",
                f"{FRESH_RPU} of {3 * FRESH_RPU} admitted (attempt {attempt})",
            )
            return
        wait_global(stack, f"{label}: global again after a degraded exact-count attempt")
    raise AssertionError(f"{label}: the gateways degraded during each of {attempts} exact-count attempts")


@dataclass
class Step:
    """One fault held for a while: `degrades` says whether the gateways must go local
    (True), must stay global (False), or may do either (None: measured only)."""

    label: str
    fault: str
    params: dict[str, object]
    degrades: Optional[bool]


def healthy_phase(stack: Stack, load: Load, k: str) -> list[dict[str, int]]:
    """HEALTHY_SECONDS of the load with nothing wrong: every answer good, both gateways
    global with callouts answered. Records the figures under `k`; returns the (settled)
    metrics read at its end, the baseline of the fault that follows."""
    t0 = time.monotonic()
    time.sleep(HEALTHY_SECONDS)
    healthy = Window("healthy", load.between(t0, time.monotonic()))
    record(f"{k}: healthy", healthy.summary())
    healthy.check()
    ms = stack.metrics()
    assert all(metric(m, "diana_global_degraded") == 0 for m in ms), "global before the fault"
    assert all(answered(m) > 0 for m in ms), "callouts answered before the fault"
    return ms


def run_steps(stack: Stack, proxy: FaultProxy, steps: Sequence[Step], label: str) -> None:
    """Healthy traffic, then each step's fault for FAULT_SECONDS, then the fault cleared:
    checks every phase, measures the time until both gateways are global again, the
    latency after recovery, and a fresh limit's exact count. Records the figures."""
    k = f"{stack.label}: {label}"
    with Load(stack.gateways) as load:
        # One settled reading ends each phase and is the next one's baseline (each settled
        # reading waits METRICS_LAG_S). A step's degraded count is read while its fault is
        # still on; a request of it that the workers hand over only later is counted in the
        # next step, which degrades too (the steps go from in time to late).
        ms = healthy_phase(stack, load, k)

        for step in steps:
            deg0 = stack.degraded_requests(ms)
            q0 = stack.quota_counters()
            proxy.set(step.fault, **step.params)
            t_on = time.monotonic()
            time.sleep(FAULT_SECONDS)
            ms = stack.metrics()
            t_off = time.monotonic()
            w = Window(f"{label}: {step.label}", load.between(t_on, t_off), stack.degraded_requests(ms) - deg0)
            w.figures["proxy"] = {x: proxy.stats()[x] for x in ("reset", "frozen", "connect_failed")}
            w.figures["diana-quota"] = stack.quota_counters(q0)
            record(f"{k}: during {step.label}", w.summary())
            w.check()
            gauges = [metric(m, "diana_global_degraded") for m in ms]
            if step.degrades is True:
                assert gauges == [1, 1], f"{step.label}: both gateways enforce locally: {gauges}"
                assert w.degraded_requests > 0
            elif step.degrades is False:
                assert gauges == [0, 0], f"{step.label}: the gateways stay global: {gauges}"
                assert w.degraded_requests == 0, f"{step.label}: {w.degraded_requests} requests were degraded"

        before = [answered(m) for m in ms]
        proxy.clear()
        t_clear = time.monotonic()
        took = wait_until(lambda: stack.global_again(before), 30, f"{label}: both gateways global again")
        t_global = time.monotonic()
        time.sleep(AFTER_SECONDS)
        after = Window(f"{label}: after recovery", load.between(t_global, time.monotonic()))
        recovering = Window(f"{label}: recovering", load.between(t_clear, t_global))
    record(f"{k}: seconds until global again", round(took, 2))
    record(f"{k}: recovering", recovering.summary())
    record(f"{k}: after recovery", after.summary())
    recovering.check()
    after.check()
    assert took <= MAX_RECOVERY_SECONDS, f"{label}: global again after {took:.1f}s"
    assert_fresh_limit_exact(stack, label)


LATENCY_STEPS_MS = [10, 50, 100, 200, 500, 1000, 2000] if LONG else [10, 2000]


def latency_steps(in_time_ms: int, late_ms: int) -> list[Step]:
    """Latency steps: up to `in_time_ms` the answers come in time (the gateways stay
    global); from `late_ms` on they cannot (they go local); in between, measured only."""

    def degrades(ms: int) -> Optional[bool]:
        return False if ms <= in_time_ms else True if ms > late_ms else None

    return [Step(f"latency {ms} ms", "latency", {"ms": ms}, degrades(ms)) for ms in LATENCY_STEPS_MS]


def fault_steps(fault: str, in_time_ms: int, late_ms: int) -> list[Step]:
    if fault == "latency":
        return latency_steps(in_time_ms, late_ms)
    return [Step(fault, fault, {}, True)]


# --------------------------------------------------------------------------- gateway link


# The gateway waits TIMEOUT_MS for the service; the service answers within its 40 ms
# deadline. Latency that leaves the answer in time must not degrade: up to 100 ms here;
# from TIMEOUT_MS on no answer can come in time.
GATEWAY_LINK_IN_TIME_MS = 100


@pytest.mark.parametrize("fault", ["latency", "blackhole", "reset"])
def test_gateway_link_fault_degrades_then_recovers(procs, start_gateway, fault):
    """A fault between the gateways and diana-quota: the callouts time out or fail, the
    gateways enforce the global rules locally without failing or holding any request
    beyond the callout timeout, and are global (and exact) again soon after it heals."""
    stack = start_stack(procs, start_gateway, redis_proxy=False)
    steps = fault_steps(fault, GATEWAY_LINK_IN_TIME_MS, TIMEOUT_MS)
    run_steps(stack, stack.gateway_link, steps, f"gateway link {fault}")


def run_half_open(stack: Stack, proxy: FaultProxy, label: str, bound: float = MAX_RECOVERY_SECONDS) -> None:
    """Healthy traffic, then every open connection of the link frozen for good (never
    closed, new connections fine): the side that holds them must notice (a timeout) and
    use new ones, by itself — the fault is never cleared. Measures how long the gateways
    stay local, checks every answer, the recovery, and a fresh limit's exact count."""
    k = f"{stack.label}: {label}"
    with Load(stack.gateways) as load:
        deg0 = stack.degraded_requests(healthy_phase(stack, load, k))
        frozen = proxy.set("halfopen")["frozen"]
        t_freeze = time.monotonic()
        # Sample the breakers until FAULT_SECONDS have passed and both are closed again
        # (bounded): the last sample that saw one open ends the local period.
        last_open: Optional[float] = None
        while True:
            now = time.monotonic()
            gauges = [metric(m, "diana_global_degraded") for m in stack.metrics(settle=0)]
            if any(gauges):
                last_open = now
            elif now - t_freeze >= FAULT_SECONDS:
                break
            assert now - t_freeze < FAULT_SECONDS + 30, f"{label}: still local {now - t_freeze:.0f}s after the freeze"
            time.sleep(0.05)
        t_end = time.monotonic()
        local_seconds = 0.0 if last_open is None else last_open - t_freeze
        before = [answered(m) for m in stack.metrics()]
        took = wait_until(lambda: stack.global_again(before), 30, f"{label}: callouts answered again")
        during = Window(f"{label}: frozen", load.between(t_freeze, t_end), stack.degraded_requests() - deg0)
        during.figures["connections frozen"] = frozen
        during.figures["seconds local"] = round(local_seconds, 2)
        t_global = time.monotonic()
        time.sleep(AFTER_SECONDS)
        after = Window(f"{label}: after recovery", load.between(t_global, time.monotonic()))
    record(f"{k}: during", during.summary())
    record(f"{k}: after recovery", after.summary())
    during.check()
    after.check()
    assert frozen > 0, f"{label}: no connection was open to freeze: the test tested nothing"
    assert during.degraded_requests > 0, f"{label}: {frozen} connections frozen and no callout failed?"
    assert took < 5, f"{label}: callouts answered again only {took:.1f}s after the breakers closed"
    assert local_seconds <= bound, f"{label}: local for {local_seconds:.1f}s after the freeze"
    assert_fresh_limit_exact(stack, label)


# ngx_wasm_module opens a connection per callout and closes it after the answer: there is
# nothing to freeze between calls (measured: 0 connections frozen), so this is an Envoy
# test (its upstream pools keep connections to the service).
@pytest.mark.parametrize("host", ["envoy"])
def test_gateway_link_half_open_connections(procs, start_gateway):
    """The pooled connections between the gateways and diana-quota go silent without
    closing: a callout on one times out (the gateway drops that connection), the breaker
    opens, and a later probe on a new connection closes it again. No request fails or
    waits longer than the callout timeout. Each worker thread holds its own pooled
    connection, and each can cost one failed probe: the local period is bounded by
    workers x (retry_seconds + timeout)."""
    stack = start_stack(procs, start_gateway, redis_proxy=False)
    workers = stack.gateways[0].concurrency
    bound = workers * (RETRY_SECONDS + TIMEOUT_MS / 1000) + 2.0
    run_half_open(stack, stack.gateway_link, "gateway link half-open", bound)


# --------------------------------------------------------------------------- Redis link


# diana-quota waits 20 ms for Redis (--redis-timeout-ms): from 20 ms of latency on,
# every decision fails. Below that it depends on the machine: 10 ms + the proxy + a busy
# CPU passes 20 ms now and then, and one late answer opens a gateway's breaker for
# retry_seconds. Measured only.
REDIS_LINK_IN_TIME_MS = 0
REDIS_TIMEOUT_MS = 20


@pytest.mark.parametrize("host", HOSTS_SERVICE_SIDE)
@pytest.mark.parametrize("fault", ["latency", "blackhole", "reset"])
def test_redis_link_fault_degrades_then_recovers(procs, start_gateway, fault):
    """A fault between diana-quota and Redis: the service answers 503 within its deadline
    (Redis timeouts 20 ms, then a fast 503 during the reconnect back-off), the gateways
    enforce locally without failing any request, and are global (and exact) again soon
    after it heals."""
    stack = start_stack(procs, start_gateway)
    assert stack.redis_link is not None
    steps = fault_steps(fault, REDIS_LINK_IN_TIME_MS, REDIS_TIMEOUT_MS)
    run_steps(stack, stack.redis_link, steps, f"redis link {fault}")


@pytest.mark.parametrize("host", HOSTS_SERVICE_SIDE)
def test_redis_link_half_open_connection(procs, start_gateway):
    """diana-quota's connection to Redis goes silent without closing: every command on it
    times out. The service must notice and connect again by itself (new connections
    work), so that the gateways are global again without anyone restarting anything."""
    stack = start_stack(procs, start_gateway)
    assert stack.redis_link is not None
    run_half_open(stack, stack.redis_link, "redis link half-open")


# --------------------------------------------------------------------------- Redis itself


REDIS_DOWN_SECONDS = 1.0


def run_outage(
    stack: Stack, label: str, fail: Callable[[], None], heal: Callable[[], None], ready: Callable[[], bool]
) -> dict[str, float]:
    """Healthy traffic; `fail()`; `heal()` (returns at once); `ready()` polled until the
    store is back: measures every answer from the failure until both gateways are global
    again and after. Returns the phase instants' durations."""
    k = f"{stack.label}: {label}"
    with Load(stack.gateways) as load:
        deg0 = stack.degraded_requests(healthy_phase(stack, load, k))
        t_fail = time.monotonic()
        fail()
        heal()
        wait_until(ready, 60, f"{label}: the store back")
        t_back = time.monotonic()
        before = [answered(m) for m in stack.metrics()]
        took = wait_until(lambda: stack.global_again(before), 30, f"{label}: both gateways global again")
        t_global = time.monotonic()
        time.sleep(AFTER_SECONDS)
        during = Window(f"{label}: outage", load.between(t_fail, t_global), stack.degraded_requests() - deg0)
        after = Window(f"{label}: after recovery", load.between(t_global, time.monotonic()))
    times = {
        "seconds until the store is back": round(t_back - t_fail, 2),
        "seconds until global again after that": round(took, 2),
        "seconds local in all": round(t_global - t_fail, 2),
    }
    during.figures.update(times)
    record(f"{k}: outage", during.summary())
    record(f"{k}: after recovery", after.summary())
    during.check()
    after.check()
    assert during.degraded_requests > 0, f"{label}: the outage was not seen?"
    assert took <= MAX_RECOVERY_SECONDS, f"{label}: global again {took:.1f}s after the store was back"
    return times


@pytest.mark.parametrize("host", HOSTS_SERVICE_SIDE)
def test_redis_restarted(procs, start_gateway):
    """Redis stopped and started again on the same port a second later (its counters are
    lost: no persistence here): diana-quota answers 503 at once while it is down, the
    gateways go local without failing a request, and are global (and exact) again within
    one retry period of Redis being back — nobody restarts diana-quota."""
    stack = start_stack(procs, start_gateway, redis_proxy=False)
    assert stack.redis is not None
    old = stack.redis

    def restart() -> None:
        time.sleep(REDIS_DOWN_SECONDS)
        stack.redis = procs.add(Redis(procs.log_dir, port=old.port)).start()

    run_outage(
        stack,
        "redis restarted",
        fail=lambda: old.stop(timeout=5),
        heal=restart,
        ready=lambda: harness.port_open(old.port),
    )
    assert_fresh_limit_exact(stack, "redis restarted")


# A node is declared failed after this long without answering its peers (the default,
# 15 s, would make the test wait 15 s for the failover).
CLUSTER_NODE_TIMEOUT_MS = 1000


def cluster_nodes(port: int) -> list[dict[str, str]]:
    """`CLUSTER NODES` as seen from the node on `port`: id, port, flags, master id."""
    out = []
    for line in harness.redis_cli(port, "cluster", "nodes").splitlines():
        f = line.split()
        if len(f) >= 8:
            out.append({"id": f[0], "port": f[1].split("@")[0].rsplit(":", 1)[1], "flags": f[2], "master": f[3]})
    return out


def keys(port: int) -> set[str]:
    """The counters on the node at `port` (the release ledger's keys aside)."""
    return set(harness.counter_keys(harness.redis_cli(port, "--scan", "--pattern", "diana:*").split()))


@pytest.mark.parametrize("host", HOSTS_SERVICE_SIDE)
def test_redis_cluster_master_killed_replica_promoted(procs, start_gateway):
    """A Redis Cluster of 3 masters + 3 replicas; the master holding most of the load's
    keys is killed (SIGKILL): the requests on its slots fail at diana-quota (503) until
    its replica is promoted, the gateways go local without failing a request, and are
    global again soon after the promotion. Then a fresh limit whose key lives on the
    promoted node admits exactly rpu over the two gateways."""
    nodes = harness.start_cluster(procs, replicas=1, node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS)
    seeds = ",".join(f"{harness.HOST}:{n.port}" for n in nodes)
    stack = start_stack(procs, start_gateway, redis_url=f"redis+cluster://{seeds}")
    by_port = {n.port: n for n in nodes}
    # Warm up the load's keys, then pick the master holding most of them.
    for i in range(TENANTS):
        harness.request(stack.gateways[i % 2].port, "/", {"x-tenant-id": f"load-{i}"})
    masters = [x for x in cluster_nodes(nodes[0].port) if "master" in x["flags"]]
    victim_info = max(masters, key=lambda x: len(keys(int(x["port"]))))
    victim = by_port[int(victim_info["port"])]
    replica_info = next(x for x in cluster_nodes(nodes[0].port) if x["master"] == victim_info["id"])
    replica = by_port[int(replica_info["port"])]

    def kill() -> None:
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait_exit(10) is not None

    def promoted() -> bool:
        role = harness.redis_cli(replica.port, "role").split()
        info = harness.redis_cli(replica.port, "cluster", "info")
        return bool(role) and role[0] == "master" and "cluster_state:ok" in info

    times = run_outage(stack, "redis cluster: master killed", fail=kill, heal=lambda: None, ready=promoted)
    record(
        f"{stack.label}: redis cluster: master killed: keys on the victim",
        f"{len(keys(replica.port))} keys on its promoted replica; "
        f"promoted after {times['seconds until the store is back']} s "
        f"(cluster-node-timeout {CLUSTER_NODE_TIMEOUT_MS} ms)",
    )

    def on_promoted_node(stack: Stack) -> tuple[str, int]:
        for _ in range(60):
            fresh_id = f"fresh-{uuid.uuid4().hex}"
            before = keys(replica.port)
            r = harness.request(stack.gateways[0].port, "/", {"x-fresh-id": fresh_id})
            assert r.status == 200, r
            if keys(replica.port) - before:
                return fresh_id, 1
        raise AssertionError("no fresh identity of 60 landed on the promoted node")

    assert_fresh_limit_exact(stack, "redis cluster: master killed", pick=on_promoted_node)


# --------------------------------------------------------------------------- a saturated service


@pytest.mark.parametrize("host", ["envoy"])
def test_a_saturated_quota_service_sheds_and_no_gateway_request_fails(procs, start_gateway):
    """diana-quota allowed 2 decisions at once (`--max-in-flight 2`) with every Redis
    answer 30 ms late: two gateways with a lease-1 global rule (a callout per request)
    send it far more than it can decide. It sheds the rest at once (503 overloaded, a
    fast answer), the gateways treat that as unavailable and enforce locally for
    `retry_seconds`, and no request fails or waits beyond the callout timeout; once the
    load is gone, both are global again. (Envoy: the service side is host-independent.)"""
    redis = procs.add(Redis(procs.log_dir)).start()
    redis_link = procs.add(FaultProxy(procs.log_dir, redis.port, name="faultproxy-redis")).start()
    quota = procs.add(
        Quota(
            procs.log_dir,
            f"redis://{harness.HOST}:{redis_link.port}",
            flags=(*harness.QUOTA_TEST_FLAGS, "--max-in-flight", "2"),
        )
    ).start()
    redis_link.set("latency", ms=30)
    doc = DOC.replace("TB, scope: global}", "TB, scope: global, lease: 1}")
    gateways = [start_gateway(doc, quota_port=quota.port) for _ in range(2)]
    stack = Stack(gateways, quota, redis_link, redis_link, redis)
    q0 = stack.quota_counters()
    with Load(gateways, rate=150.0, threads_per_gateway=12) as load:
        t0 = time.monotonic()
        time.sleep(FAULT_SECONDS + 1.0)
        during = Window("saturated", load.between(t0, time.monotonic()), stack.degraded_requests())
    shed = stack.quota_counters(q0)
    during.figures["diana-quota"] = shed
    record("envoy: diana-quota saturated (max-in-flight 2, Redis +30 ms)", during.summary())
    during.check()
    assert any("shed" in k for k in shed), f"the service never shed: {shed}"
    assert during.degraded_requests > 0, "shed answers must make the gateways enforce locally"
    redis_link.clear()
    took = wait_global(stack, "global again once the load is gone")
    record("envoy: diana-quota saturated: seconds until global again after the load", round(took, 2))
    assert took <= MAX_RECOVERY_SECONDS
