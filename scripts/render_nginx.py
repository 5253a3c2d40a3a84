#!/usr/bin/env python3
"""Render an nginx.conf that loads the Diana filter through ngx_wasm_module.

Used by the end-to-end tests (tests/e2e/harness.py imports it), so that the nginx
configuration that is tested is the one this script writes; nginx/README.md explains
each directive.

The Diana document goes into `proxy_wasm diana '<document>'`. nginx interprets backslash
escapes inside quoted strings, so the document is quoted for nginx here. With
`--quota-port` / `--config-port` the document is rewritten (as JSON) to call the quota
service and the config center at 127.0.0.1:PORT, which is how ngx_wasm_module names an
upstream (Envoy takes a cluster name); `--metrics-path` adds a `metrics` section, since
nginx has no /stats of its own.

CLI:
  render_nginx.py --listen-port 8000 --upstream-port 18080 --diana-config envoy/demo-diana.yaml \\
      --wasm target/wasm32-wasip1/release/diana.wasm --prefix /tmp/nginx [--workers 2] \\
      [--quota-port 18081] [--config-port 18082] [--metrics-path /__diana/metrics] \\
      [--shm-size 16m] [--eviction lru] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import yaml  # PyYAML: scripts/install-deps installs it

HOST = "127.0.0.1"


def full_form(text: str) -> dict[str, Any]:
    """Any form of a Diana document (one block, a sequence of blocks, several `---`
    documents, the full form) as one full-form mapping."""
    full: dict[str, Any] = {"resources": []}
    for doc in yaml.safe_load_all(text):
        if doc is None:
            continue
        if isinstance(doc, list):
            full["resources"].extend(doc)
        elif isinstance(doc, dict) and any(k in doc for k in ("Url", "url", "rules")):
            full["resources"].append(doc)
        elif isinstance(doc, dict):
            for key, value in doc.items():
                if key == "resources":
                    full["resources"].extend(value or [])
                else:
                    full[key] = value
        else:
            raise ValueError(f"not a Diana document: {doc!r}")
    return full


def nginx_document(
    text: str,
    *,
    quota_port: Optional[int] = None,
    config_port: Optional[int] = None,
    metrics_path: Optional[str] = None,
) -> str:
    """The document as the nginx gateway gets it: upstreams as host:port, and a metrics
    path. Without any of them the text is passed as written (so that the filter's error
    positions refer to it exactly)."""
    if quota_port is None and config_port is None and metrics_path is None:
        return text
    full = full_form(text)
    if quota_port is not None:
        full.setdefault("global", {})["cluster"] = f"{HOST}:{quota_port}"
    if config_port is not None and isinstance(full.get("remote"), dict):
        full["remote"]["cluster"] = f"{HOST}:{config_port}"
    if metrics_path is not None:
        full.setdefault("metrics", {"path": metrics_path})
    return json.dumps(full, separators=(",", ":"))


def fallback_headers(text: str) -> list[str]:
    """The `fallback_header` of every resource's breaker in the document (lowercase, in
    order, once each); none when the document does not parse (the filter says why)."""
    try:
        full = full_form(text)
    except Exception:  # noqa: BLE001 - a broken document is the filter's to refuse
        return []
    names: list[str] = []
    for resource in full.get("resources") or []:
        breaker = resource.get("breaker") if isinstance(resource, dict) else None
        header = breaker.get("fallback_header") if isinstance(breaker, dict) else None
        if isinstance(header, str) and header and header.lower() not in names:
            names.append(header.lower())
    return names


def fallback_lines(text: str) -> str:
    """nginx's proxy module sends upstream every request header ngx_wasm_module removed
    (a removed header is only marked, and proxy_pass neither looks at the mark nor matches
    a marked header against proxy_set_header), so Diana clears a client's `fallback_header`
    on nginx by setting it empty; this line makes the proxy module replace that entry by
    its value, Diana's or the empty one, and nginx sends no header of an empty value."""
    lines = ""
    for name in fallback_headers(text):
        if all(c.isalnum() or c in "-_" for c in name):
            variable = "$http_" + name.replace("-", "_")
            lines += f"            proxy_set_header {name} {variable};\n"
    return lines


def quote(text: str) -> str:
    """A single-quoted nginx string holding `text` as is."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render(
    *,
    listen_port: int,
    upstream_port: int,
    diana_config: Optional[str],
    wasm_path: str,
    prefix: str,
    workers: int = 2,
    quota_port: Optional[int] = None,
    config_port: Optional[int] = None,
    metrics_path: Optional[str] = None,
    shm_size: Optional[str] = "16m",
    eviction: str = "lru",
    raw_document: bool = False,
    direct_response: Optional[tuple[int, int, str]] = None,
    fallback_route: Optional[tuple[str, str, int]] = None,
    wasmtime_cache_config: Optional[str] = None,
) -> str:
    """The nginx.conf text. `diana_config` None renders nginx without the filter.
    `direct_response` (port, status, body): the upstream is a second server of this nginx
    on that port answering at once, to measure the gateway and the filter alone.
    `shm_size` None leaves the shm_kv zone out (a broken setup, for the tests). Requests
    under `/__plain/` go upstream without the filter. `fallback_route` (header, value, port):
    requests carrying `header: value` (a breaker's `fallback_header`, set by Diana) go to
    a second upstream on that port, through a `map` (README "Circuit breakers").
    `wasmtime_cache_config`: a Wasmtime cache configuration file (TOML): every nginx
    worker process compiles the module at start (~2 CPU-seconds each for diana.wasm),
    unless an earlier start left the compiled code in that cache (nginx/README.md)."""
    filter_lines = ""
    wasm_block = ""
    if diana_config is not None:
        document = (
            diana_config
            if raw_document
            else nginx_document(
                diana_config,
                quota_port=quota_port,
                config_port=config_port,
                metrics_path=metrics_path,
            )
        )
        # on_request_headers in the access phase: paused in the rewrite phase (the
        # default), a keep-alive connection's later requests went upstream without waiting
        # for Diana's callout, and the worker crashed when the callout answered
        # (ngx_wasm_module 0.6.0; nginx/README.md).
        filter_lines = (
            "            proxy_wasm_request_headers_in_access on;\n"
            f"            proxy_wasm diana {quote(document)};\n"
        ) + fallback_lines(diana_config)
        shm_line = (
            ""
            if shm_size is None
            else f"""    # Diana's keys are diana/...: they live in this zone. Never eviction=none (a write
    # into a full zone traps); size it with `diana check` (nginx/README.md).
    shm_kv diana {shm_size} eviction={eviction};
"""
        )
        cache_lines = (
            ""
            if wasmtime_cache_config is None
            else f"""    wasmtime {{
        cache_config {wasmtime_cache_config};
    }}
"""
        )
        wasm_block = f"""
wasm {{
    module diana {wasm_path};
{cache_lines}{shm_line}}}
"""
    backend = "http://backend"
    fallback_block = ""
    if fallback_route is not None:
        header, value, port = fallback_route
        if not all(c.isalnum() or c in "-_" for c in header) or not value.isalnum():
            raise ValueError(f"fallback_route: {header!r}: {value!r} is not a plain header and value")
        # The map is evaluated when proxy_pass reads it, in the content phase: after the
        # access phase where Diana set (or removed) the header.
        fallback_block = f"""
    upstream backup {{
        server {HOST}:{port};
        keepalive 16;
    }}
    map $http_{header.lower().replace("-", "_")} $diana_upstream {{
        default backend;
        {value} backup;
    }}
"""
        backend = "http://$diana_upstream"
    direct_server = ""
    if direct_response is not None:
        port, status, body = direct_response
        direct_server = f"""
    server {{
        listen {HOST}:{port};
        location / {{
            return {status} {quote(body)};
        }}
    }}
"""
    # A debugging aid: DIANA_NGINX_LOG_LEVEL=debug shows Diana's debug lines (reports, answers).
    log_level = os.environ.get("DIANA_NGINX_LOG_LEVEL", "info")
    return f"""# Rendered by scripts/render_nginx.py
daemon off;
master_process on;
worker_processes {workers};
# The quota service's credential (global.token's default) reaches the filter from the
# environment: nginx clears its workers' environment but for the variables named here.
env DIANA_QUOTA_TOKEN;
error_log {prefix}/error.log {log_level};
pid {prefix}/nginx.pid;

events {{
    worker_connections 4096;
}}
{wasm_block}
http {{
    access_log off;
    # Envoy accepts 60 KiB of request headers; nginx's default is 8 KiB per line.
    large_client_header_buffers 4 32k;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;

    upstream backend {{
        server {HOST}:{upstream_port if direct_response is None else direct_response[0]};
        keepalive 64;
    }}
{fallback_block}{direct_server}
    server {{
        listen {HOST}:{listen_port} reuseport;
        location / {{
{filter_lines}            add_header X-Diana-Worker $pid always;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_pass {backend};
        }}
        location /__plain/ {{
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_pass http://backend;
        }}
    }}
}}
"""


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen-port", type=int, required=True)
    p.add_argument("--upstream-port", type=int, required=True)
    p.add_argument("--diana-config", help="the Diana document (a file); omit for nginx without the filter")
    p.add_argument("--wasm", default="target/wasm32-wasip1/release/diana.wasm")
    p.add_argument("--prefix", required=True, help="nginx prefix: logs, pid and temp files go here")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--quota-port", type=int)
    p.add_argument("--config-port", type=int)
    p.add_argument("--metrics-path")
    p.add_argument("--shm-size", default="16m")
    p.add_argument("--eviction", default="lru", choices=["lru", "slru", "none"])
    p.add_argument("--out")
    args = p.parse_args(argv)
    document = None
    if args.diana_config:
        with open(args.diana_config, encoding="utf-8") as f:
            document = f.read()
    text = render(
        listen_port=args.listen_port,
        upstream_port=args.upstream_port,
        diana_config=document,
        wasm_path=args.wasm,
        prefix=args.prefix,
        workers=args.workers,
        quota_port=args.quota_port,
        config_port=args.config_port,
        metrics_path=args.metrics_path,
        shm_size=args.shm_size,
        eviction=args.eviction,
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
