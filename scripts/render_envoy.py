#!/usr/bin/env python3
"""Render an Envoy bootstrap that loads the Diana filter.

Used by scripts/run and by the end-to-end tests (tests/e2e/harness.py imports it), so
the bootstrap that people run and the one that is tested are the same code.

The output is JSON (Envoy reads JSON bootstraps; JSON is also valid YAML). The Diana
document is embedded verbatim as a google.protobuf.StringValue, so the line/column
numbers in the filter's error messages refer to the document exactly as written.

Standard library only.

CLI:
  render_envoy.py --listen-port 10000 --admin-port 9901 --upstream-port 18080 \
      --diana-config envoy/demo-diana.yaml --wasm target/wasm32-wasip1/release/diana-envoy.wasm \
      [--quota-port 18081] [--config-port 18082] [--no-filter] [--access-log FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

WASM_FILTER = "envoy.filters.http.wasm"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network."
    "http_connection_manager.v3.HttpConnectionManager"
)
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
STRING_VALUE_TYPE = "type.googleapis.com/google.protobuf.StringValue"
FILE_ACCESS_LOG = "envoy.access_loggers.file"
FILE_ACCESS_LOG_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"

# Cluster names the Diana document refers to by default (DESIGN §3: global.cluster,
# remote.cluster). dispatch_http_call needs them to exist in the bootstrap.
QUOTA_CLUSTER = "diana_quota"
CONFIG_CLUSTER = "diana_config"
UPSTREAM_CLUSTER = "demo_upstream"

# Envoy's /stats/prometheus: `diana_rule_allowed{rule="login_burst"}` instead of one metric
# per rule. Envoy matches the regex against the full stat name
# (`wasmcustom.diana_rule_allowed.login_burst`), removes the first capture group from the
# name and takes the second as the value of the `rule` tag. The same label the filter's
# own metrics path uses (crates/diana-core/src/metrics.rs: RULE_LABEL, envoy_rule_tag_regex;
# `diana render-envoy` writes the same entry).
RULE_TAG_REGEX = r"^wasmcustom\.diana_rule_(?:allowed|limited|dry_run_limited)(\.([A-Za-z0-9_]+))$"


def stats_config() -> dict[str, Any]:
    """`stats_config` with the tag that labels Diana's rule counters by rule."""
    return {"stats_tags": [{"tag_name": "rule", "regex": RULE_TAG_REGEX}]}


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": int(port)}}


def static_cluster(name: str, host: str, port: int, connect_timeout: str = "1s") -> dict[str, Any]:
    """A STATIC cluster with one endpoint and circuit breakers high enough for floods."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": connect_timeout,
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 100000,
                    "max_pending_requests": 100000,
                    "max_requests": 100000,
                    "max_retries": 3,
                }
            ]
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(host, port)}}]}],
        },
    }


# diana-core's config::TOKEN_ENV: global.token's default, read from the gateway's environment.
TOKEN_ENV = "DIANA_QUOTA_TOKEN"


def wasm_filter(diana_config: str, wasm_path: str, runtime: str = "envoy.wasm.runtime.v8") -> dict[str, Any]:
    """The envoy.filters.http.wasm entry that loads diana.wasm with `diana_config` as plugin configuration."""
    return {
        "name": WASM_FILTER,
        "typed_config": {
            "@type": WASM_TYPE,
            "config": {
                "name": "diana",
                "root_id": "diana",
                "configuration": {"@type": STRING_VALUE_TYPE, "value": diana_config},
                "vm_config": {
                    "vm_id": "diana",
                    "runtime": runtime,
                    "code": {"local": {"filename": str(wasm_path)}},
                    # The quota service's credential reaches the filter from Envoy's
                    # environment, not from the document (global.token's default).
                    "environment_variables": {"host_env_keys": [TOKEN_ENV]},
                },
            },
        },
    }


def file_access_log(path: str, text_format: Optional[str] = None) -> dict[str, Any]:
    """An HTTP access log written to `path`, in Envoy's default format unless `text_format`
    is given (`diana simulate` reads the default format, plus appended fields)."""
    config: dict[str, Any] = {"@type": FILE_ACCESS_LOG_TYPE, "path": str(path)}
    if text_format is not None:
        config["log_format"] = {"text_format_source": {"inline_string": text_format}}
    return {"name": FILE_ACCESS_LOG, "typed_config": config}


def render_bootstrap(
    *,
    listen_port: int,
    admin_port: int,
    upstream_port: Optional[int] = None,
    diana_config: Optional[str] = None,
    wasm_path: Optional[str] = None,
    quota_port: Optional[int] = None,
    config_port: Optional[int] = None,
    host: str = "127.0.0.1",
    direct_response: Optional[tuple[int, str]] = None,
    normalize_path: bool = False,
    route_timeout: str = "15s",
    extra_clusters: Optional[list[dict[str, Any]]] = None,
    access_logs: Optional[list[tuple[str, Optional[str]]]] = None,
) -> dict[str, Any]:
    """Build the bootstrap as a dict.

    - `diana_config=None` renders Envoy without the wasm filter (smoke tests, baselines).
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

    if direct_response is not None:
        status, body = direct_response
        route: dict[str, Any] = {
            "match": {"prefix": "/"},
            "direct_response": {"status": int(status), "body": {"inline_string": body}},
        }
    else:
        if upstream_port is None:
            raise ValueError("upstream_port is required unless direct_response is given")
        route = {"match": {"prefix": "/"}, "route": {"cluster": UPSTREAM_CLUSTER, "timeout": route_timeout}}

    http_filters: list[dict[str, Any]] = []
    if diana_config is not None:
        http_filters.append(wasm_filter(diana_config, str(wasm_path)))
    http_filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}})

    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "normalize_path": normalize_path,
        "merge_slashes": normalize_path,
        "route_config": {
            "name": "local",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}],
        },
        "http_filters": http_filters,
    }
    if access_logs:
        hcm["access_log"] = [file_access_log(path, text_format) for path, text_format in access_logs]

    clusters: list[dict[str, Any]] = []
    if upstream_port is not None:
        clusters.append(static_cluster(UPSTREAM_CLUSTER, host, upstream_port))
    if quota_port is not None:
        clusters.append(static_cluster(QUOTA_CLUSTER, host, quota_port, connect_timeout="0.25s"))
    if config_port is not None:
        clusters.append(static_cluster(CONFIG_CLUSTER, host, config_port, connect_timeout="0.25s"))
    clusters.extend(extra_clusters or [])

    return {
        "admin": {"address": _address(host, admin_port)},
        "stats_config": stats_config(),
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": _address(host, listen_port),
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def render_json(**kwargs: Any) -> str:
    return json.dumps(render_bootstrap(**kwargs), indent=2) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen-port", type=int, required=True)
    p.add_argument("--admin-port", type=int, required=True)
    p.add_argument("--upstream-port", type=int)
    p.add_argument("--quota-port", type=int)
    p.add_argument("--config-port", type=int)
    p.add_argument("--diana-config", help="file holding the Diana document (YAML or JSON)")
    p.add_argument("--wasm", default="target/wasm32-wasip1/release/diana-envoy.wasm")
    p.add_argument("--no-filter", action="store_true", help="render Envoy without the Diana filter")
    p.add_argument("--normalize-path", action="store_true", help="let Envoy normalise paths too")
    p.add_argument("--access-log", help="also write Envoy's access log (default format) to this file")
    p.add_argument("--out", help="output file (default: stdout)")
    a = p.parse_args(argv)

    diana_config = None
    if not a.no_filter:
        if not a.diana_config:
            p.error("--diana-config is required unless --no-filter")
        with open(a.diana_config, encoding="utf-8") as f:
            diana_config = f.read()

    text = render_json(
        listen_port=a.listen_port,
        admin_port=a.admin_port,
        upstream_port=a.upstream_port,
        diana_config=diana_config,
        wasm_path=a.wasm,
        quota_port=a.quota_port,
        config_port=a.config_port,
        normalize_path=a.normalize_path,
        access_logs=[(a.access_log, None)] if a.access_log else None,
    )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
