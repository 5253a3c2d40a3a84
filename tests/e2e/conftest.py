"""pytest fixtures for Diana's end-to-end tests.

- `upstream`: one demo upstream for the whole session.
- `start_envoy(diana_config, ...)`: a real Envoy (4 workers by default) with the Diana
  filter and that document, ready to serve; stopped by PID when the test ends.
- `start_gateway(diana_config, ...)`: the same test on both hosts — a real Envoy (4 worker
  threads) and a real nginx + ngx_wasm_module (2 worker processes); the test is run once
  per host (`[envoy]`, `[nginx]`). On nginx, a worker that exits on a signal, or a trap or
  panic in error.log, fails the test.
- `shared_gateway(diana_config, ...)`: the same, but one gateway per module, host and
  document, shared by the tests that ask for it (each needs counters of its own).
- `procs`: start any other process (Redis, diana-quota, ...) tied to the test.
On a failing test, the logs of the test's processes are appended to the report.

Parallel runs (pytest-xdist, `-n N`; scripts/e2e): every test has its own log directory,
processes and ports (harness.free_port draws from a slice of ports of its own per worker);
the session upstream is one per worker. The tests in PAIRED (marker `paired`) and SERIAL
(marker `serial`) measure time or memory under load, which the CPU-bound tests of the
parallel part would change: scripts/e2e runs them after it, the paired ones two at a time
(they wait on their faults' phases most of the time), then the serial ones alone.
`--binding envoy,nginx,envoy-native` (or DIANA_BINDINGS) keeps the runs of the
host-parametrized tests on those bindings only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Envoy, ManagedProcess, Nginx, Upstream  # noqa: E402

_PROCS_ATTR = "_diana_processes"


class Processes:
    """The processes of one test (or one session), stopped in reverse order by PID."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.items: list[ManagedProcess] = []

    def add(self, p: ManagedProcess) -> ManagedProcess:
        self.items.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.items):
            try:
                p.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"stopping {p.name} (pid {p.proc.pid if p.proc else '?'}) failed: {e}", file=sys.stderr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[type-arg]
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
    if rep.failed and rep.when in ("setup", "call"):
        procs: Optional[Processes] = getattr(item, _PROCS_ATTR, None)
        if procs is not None:
            for p in procs.items:
                rep.sections.append((f"log of {p.name} ({p.log_path})", p.log_tail(120)))


def _sanitize(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[-120:]


@pytest.fixture
def log_dir(request: pytest.FixtureRequest) -> Path:
    d = harness.LOG_ROOT / _sanitize(request.node.nodeid)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture
def procs(request: pytest.FixtureRequest, log_dir: Path):
    ps = Processes(log_dir)
    setattr(request.node, _PROCS_ATTR, ps)
    try:
        yield ps
    finally:
        ps.stop_all()


@pytest.fixture(scope="session")
def upstream():
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    d = harness.LOG_ROOT / (f"session-{worker}" if worker else "session")
    d.mkdir(parents=True, exist_ok=True)
    up = Upstream(d)
    try:
        up.start()
        yield up
    finally:
        up.stop()


@pytest.fixture
def start_envoy(procs: Processes, upstream: Upstream) -> Callable[..., Envoy]:
    """start_envoy(diana_config, concurrency=4, **Envoy kwargs) -> a ready Envoy."""
    counter = [0]

    def start(diana_config: Optional[str], *, concurrency: int = 4, **kw) -> Envoy:
        counter[0] += 1
        kw.setdefault("upstream_port", upstream.port)
        kw.setdefault("name", "envoy" if counter[0] == 1 else f"envoy{counter[0]}")
        e = Envoy(procs.log_dir, diana_config=diana_config, concurrency=concurrency, **kw)
        procs.add(e)
        e.start()
        return e

    return start


def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker hands its figures to the controller, which prints and writes them all.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["diana_figures"] = harness.dumps(harness.FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # type: ignore[no-untyped-def]
    figures = getattr(node, "workeroutput", {}).get("diana_figures")
    if figures:
        harness.FIGURES.update(json.loads(figures))


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    if not harness.FIGURES or hasattr(config, "workeroutput"):
        return
    terminalreporter.section("Diana e2e figures")
    for k, v in harness.FIGURES.items():
        terminalreporter.write_line(f"{k}: {v}")
    try:
        harness.LOG_ROOT.mkdir(parents=True, exist_ok=True)
        (harness.LOG_ROOT / "figures.json").write_text(harness.dumps(harness.FIGURES) + "\n")
    except OSError:
        pass


# `envoy-native`: Envoy with Diana as a dynamic module (crates/diana-envoy-native) instead of
# the wasm filter; the same tests, the same expectations as `envoy` unless a test says why.
HOSTS = ["envoy", "nginx", "envoy-native"]


# Tests that assert times under load (recovery within N seconds, no request waiting over
# 500 ms): run by scripts/e2e after the parallel part, two at a time (marker `paired`). Each
# spends most of its time waiting through its fault's phases at 40 requests/s per gateway
# (the 28 tests of PAIRED and SERIAL one at a time: 373 s, the machine 72 % idle; these two
# at a time: their durations within a second or two of that, the worst request 207 ms of
# the 500 allowed; 2026-12-02). A module (every test of it) or module::test (every
# parametrization).
PAIRED = {
    "test_faults.py",
    "test_global.py::test_backend_killed_mid_run_degrades_to_local_then_recovers",
}


# Tests that load the machine themselves or slice time finely (a flood's RSS, a leaky
# bucket's 100 ms pace, requests sent in one-second slices): run after the paired ones,
# one at a time (marker `serial`), since tests beside them would take the CPU they measure.
SERIAL = {
    "test_memory.py",
    "test_algorithms.py::test_leaky_bucket_paces_and_rejects_overflow",
    # requests sent in time slices of a second, which a starved client or Envoy misses
    "test_simulate.py::test_replay_agrees_exactly_with_envoy_on_one_worker",
}


# The slowest tests of the parts run on several workers (seconds per run, each
# parametrization, idle machine, 2026-12-02): xdist's worksteal gives each worker a
# contiguous share of the collection and lets idle workers take from the end of others'
# shares, so a slow test that comes last runs alone at the end. They are put at the front
# of the shares instead, balanced between them (`_slow_first`).
SLOW = {
    "test_remote.py::test_alternating_documents_under_traffic_leave_memory_flat": 68,
    "test_nginx_shm.py::test_the_zone_diana_check_asks_for_never_evicts": 67,
    "test_rls_idle_connections.py::test_envoy_closes_its_idle_pooled_connections_before_diana_quota_does": 36,
    "test_remote.py::test_remote_document_replaces_local_then_survives_failures_and_garbage": 23,
    "test_nginx_shm.py::test_a_tiny_zone_evicts_without_failing_and_counters_start_over": 22,
    "test_global.py::test_redis_cluster_with_three_masters_is_exact": 14,
    # 11 s alone, up to 90 s beside others (its load generator and `diana simulate` runs)
    "test_simulate.py::test_replay_of_a_hot_event_agrees_with_envoy_within_the_timing_jitter": 40,
    # the paired part's slowest (22 s; the others 10 to 20 s)
    "test_faults.py::test_redis_cluster_master_killed_replica_promoted": 22,
}


def _item_key(item: pytest.Item) -> str:
    return f"{item.path.name}::{getattr(item, 'originalname', item.name)}"


def _listed(item: pytest.Item, names: set[str]) -> bool:
    """Whether `names` (PAIRED, SERIAL) holds the item's module or its module::test."""
    return item.path.name in names or _item_key(item) in names


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_slow_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """After every deselection (-m, -k, --binding): on a pytest-xdist worker, the order
    that puts the slow tests first in each worker's share (every worker computes the same
    order, as xdist requires)."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 0))
    if workers > 1:
        items[:] = _slow_first(items, workers)


def _slow_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """`items` reordered for worksteal on `workers` workers: its first distribution gives
    the first worker len // workers items, the next one (the rest) // (workers - 1), and so
    on. Each share starts with slow tests (longest first, each to the share with the least
    slow time so far), then the other tests in their order (a module's tests stay together,
    so its shared gateways start once per share)."""
    slow = sorted((i for i in items if _item_key(i) in SLOW), key=lambda i: -SLOW[_item_key(i)])
    rest = [i for i in items if _item_key(i) not in SLOW]
    sizes, left = [], len(items)
    for w in range(workers):
        sizes.append(left // (workers - w))
        left -= sizes[-1]
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for item in slow:
        open_shares = [w for w in range(workers) if len(shares[w]) < sizes[w]]
        w = min(open_shares, key=lambda w: loads[w])
        shares[w].append(item)
        loads[w] += SLOW[_item_key(item)]
    out: list[pytest.Item] = []
    for w in range(workers):
        take = sizes[w] - len(shares[w])
        out += shares[w] + rest[:take]
        rest = rest[take:]
    return out


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--binding",
        default=os.environ.get("DIANA_BINDINGS", ""),
        help=f"comma-separated bindings ({', '.join(HOSTS)}) the host-parametrized tests run on (default: all)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _listed(item, SERIAL):
            item.add_marker(pytest.mark.serial)
        elif _listed(item, PAIRED):
            item.add_marker(pytest.mark.paired)
    wanted = {b.strip() for b in str(config.getoption("--binding")).split(",") if b.strip()}
    if not wanted:
        return
    unknown = wanted - set(HOSTS)
    if unknown:
        raise pytest.UsageError(f"--binding: unknown {sorted(unknown)}; the bindings are {HOSTS}")
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        host = params.get("host", params.get("module_host"))
        (drop if host is not None and host not in wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(params=HOSTS)
def host(request: pytest.FixtureRequest) -> str:
    """The gateway a test runs on; every test that uses it runs once per host."""
    return request.param


@pytest.fixture
def start_gateway(host: str, procs: Processes, upstream: Upstream):
    """start_gateway(diana_config, workers=None, **kwargs) -> a ready Envoy or nginx.
    Envoy: `workers` worker threads (default 4); nginx: worker processes (default 2).
    `quota_port` / `config_port` make the global and remote upstreams 127.0.0.1:PORT."""
    started: list = []

    def start(diana_config: Optional[str], *, workers: Optional[int] = None, **kw):
        gw = _gateway(host, procs, upstream, len(started) + 1, diana_config, workers, kw)
        started.append(gw)
        return gw

    yield start
    _fail_on_crash(host, started)


def _gateway(host: str, procs: Processes, upstream: Upstream, number: int, diana_config, workers, kw):
    """The `number`th gateway of a test (or a module) on `host`, started and ready."""
    name = host if number == 1 else f"{host}{number}"
    kw.setdefault("upstream_port", upstream.port)
    if host in ("envoy", "envoy-native"):
        for nginx_only in ("raw_document", "shm_size", "eviction", "request_headers_in_access"):
            kw.pop(nginx_only, None)
        kw.setdefault("native", host == "envoy-native")
        gw = Envoy(procs.log_dir, diana_config=diana_config, concurrency=workers or 4, name=name, **kw)
    else:
        gw = Nginx(procs.log_dir, diana_config=diana_config, workers=workers or 2, name=name, **kw)
    procs.add(gw)
    gw.start()
    return gw


def _fail_on_crash(host: str, gateways) -> None:
    crashed = [(gw.name, line) for gw in gateways for line in gw.crash_lines()]
    if crashed:
        pytest.fail(f"{host}: a worker crashed or a filter trapped: {crashed[:10]}")


@pytest.fixture(scope="module", params=HOSTS)
def module_host(request: pytest.FixtureRequest) -> str:
    """The gateway of the module's shared gateways (`shared_gateway`), one run per host."""
    return request.param


@pytest.fixture(scope="module")
def _module_gateways(module_host: str, request: pytest.FixtureRequest, upstream: Upstream):
    # one directory per pytest worker: each worker that runs tests of the module has its own
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    d = harness.LOG_ROOT / _sanitize(f"{request.node.nodeid}-{module_host}-shared-{worker}")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True, exist_ok=True)
    procs = Processes(d)
    shared: dict = {}
    try:
        yield procs, shared
    finally:
        procs.stop_all()


@pytest.fixture
def shared_gateway(module_host: str, _module_gateways, upstream: Upstream, request: pytest.FixtureRequest):
    """shared_gateway(diana_config, workers=None, **kwargs): like start_gateway, but the
    gateway is shared by every test of the module (on the same host, in the same pytest
    worker) that asks for the same document and options, and stopped after the last of
    them: for tests that only send requests whose counters no other test of the module
    touches, and read nothing the others change. Its log is attached to a failing test's
    report; a crash or trap in it fails the test during which it is found."""
    procs, shared = _module_gateways
    setattr(request.node, _PROCS_ATTR, procs)

    def start(diana_config: Optional[str], *, workers: Optional[int] = None, **kw):
        key = (diana_config, workers, repr(sorted(kw.items())))
        if key not in shared:
            shared[key] = _gateway(module_host, procs, upstream, len(shared) + 1, diana_config, workers, kw)
        return shared[key]

    yield start
    _fail_on_crash(module_host, list(shared.values()))
