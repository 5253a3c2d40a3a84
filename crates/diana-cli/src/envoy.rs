//! An Envoy v3 bootstrap that loads diana.wasm with a Diana document:
//!
//! ```text
//! listener -> http_connection_manager -> envoy.filters.http.wasm (Diana) -> router -> upstream
//! cluster <global.cluster>  -> --quota          (only when the document has global rules)
//! cluster <remote.cluster>  -> --config-center  (only when the document has `remote`)
//! ```
//!
//! Built as a `serde_yaml::Value` tree, printed as YAML. The document is embedded verbatim
//! (a `google.protobuf.StringValue`), so the line/column numbers of the filter's error
//! messages refer to it exactly as written.

use crate::plan::count_global;
use crate::yaml::{map, number, string};
use diana_core::config::Policy;
use diana_core::config::TOKEN_ENV;
use diana_core::metrics::{envoy_rule_tag_regex, RULE_LABEL};
use serde_yaml::Value;
use std::net::IpAddr;
use std::path::Path;

/// Where `scripts/build` puts the filter trimmed for Envoy (see `crates/diana-trim`).
pub const DEFAULT_WASM: &str = "target/wasm32-wasip1/release/diana-envoy.wasm";

const HCM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const ROUTER_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";
const STRING_VALUE_TYPE: &str = "type.googleapis.com/google.protobuf.StringValue";

/// Names tried, in order, for the protected service's cluster (the first one the document
/// does not use for `global.cluster` / `remote.cluster`).
const UPSTREAM_NAMES: [&str; 3] = ["upstream", "diana_upstream", "diana_protected_upstream"];

/// A host and port from the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    fn display(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    fn is_ip(&self) -> bool {
        self.host.parse::<IpAddr>().is_ok()
    }
}

/// Parses `HOST:PORT` (`[v6]:PORT` too), or a bare `PORT` when `default_host` is given.
pub fn parse_endpoint(
    flag: &str,
    text: &str,
    default_host: Option<&str>,
) -> Result<Endpoint, String> {
    let text = text.trim();
    let bad = |why: &str| format!("diana: invalid {flag} `{text}`: {why}");
    let port = |raw: &str| -> Result<u16, String> {
        match raw.parse::<u16>() {
            Ok(0) | Err(_) => Err(bad("the port must be a number from 1 to 65535")),
            Ok(port) => Ok(port),
        }
    };
    if let (Some(host), true) = (default_host, text.bytes().all(|b| b.is_ascii_digit())) {
        return Ok(Endpoint {
            host: host.to_string(),
            port: port(text)?,
        });
    }
    let expected = if default_host.is_some() {
        "expected PORT or HOST:PORT"
    } else {
        "expected HOST:PORT"
    };
    let (host, raw_port) = text.rsplit_once(':').ok_or_else(|| bad(expected))?;
    let bracketed = host
        .strip_prefix('[')
        .and_then(|inner| inner.strip_suffix(']'));
    let host = bracketed.unwrap_or(host);
    if host.is_empty() || host.contains(['/', ' ', '[', ']']) {
        return Err(bad(expected));
    }
    if host.contains(':') && (bracketed.is_none() || host.parse::<IpAddr>().is_err()) {
        return Err(bad("write an IPv6 address as [ADDRESS]:PORT"));
    }
    Ok(Endpoint {
        host: host.to_string(),
        port: port(raw_port)?,
    })
}

/// What `render-envoy` was asked for.
#[derive(Debug, Clone)]
pub struct Options {
    pub wasm: String,
    pub listen: Endpoint,
    pub admin: Endpoint,
    pub upstream: Endpoint,
    pub quota: Endpoint,
    pub config_center: Endpoint,
    pub concurrency: u32,
}

/// The bootstrap, and things worth telling the user on stderr.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub yaml: String,
    pub warnings: Vec<String>,
}

fn socket_address(endpoint: &Endpoint) -> Value {
    map(vec![(
        "socket_address",
        map(vec![
            ("address", string(&endpoint.host)),
            ("port_value", number(u64::from(endpoint.port))),
        ]),
    )])
}

/// A cluster with one endpoint: STATIC for an IP, STRICT_DNS for a name. Circuit-breaker
/// thresholds are raised so that a flood meets Diana, not Envoy's defaults (1,024).
fn cluster(name: &str, endpoint: &Endpoint, connect_timeout: &str) -> Value {
    let kind = if endpoint.is_ip() {
        "STATIC"
    } else {
        "STRICT_DNS"
    };
    map(vec![
        ("name", string(name)),
        ("type", string(kind)),
        ("connect_timeout", string(connect_timeout)),
        (
            "circuit_breakers",
            map(vec![(
                "thresholds",
                Value::Sequence(vec![map(vec![
                    ("max_connections", number(100_000)),
                    ("max_pending_requests", number(100_000)),
                    ("max_requests", number(100_000)),
                    ("max_retries", number(3)),
                ])]),
            )]),
        ),
        (
            "load_assignment",
            map(vec![
                ("cluster_name", string(name)),
                (
                    "endpoints",
                    Value::Sequence(vec![map(vec![(
                        "lb_endpoints",
                        Value::Sequence(vec![map(vec![(
                            "endpoint",
                            map(vec![("address", socket_address(endpoint))]),
                        )])]),
                    )])]),
                ),
            ]),
        ),
    ])
}

/// The `envoy.filters.http.wasm` entry that loads Diana with `document` as its configuration.
fn wasm_filter(document: &str, wasm: &str) -> Value {
    map(vec![
        ("name", string("envoy.filters.http.wasm")),
        (
            "typed_config",
            map(vec![
                ("@type", string(WASM_TYPE)),
                (
                    "config",
                    map(vec![
                        ("name", string("diana")),
                        ("root_id", string("diana")),
                        (
                            "vm_config",
                            map(vec![
                                // One shared-data space for every worker's VM: Diana's
                                // process-wide local counters live there.
                                ("vm_id", string("diana")),
                                ("runtime", string("envoy.wasm.runtime.v8")),
                                (
                                    "code",
                                    map(vec![("local", map(vec![("filename", string(wasm))]))]),
                                ),
                                // The quota service's credential reaches the filter from
                                // Envoy's environment (global.token's default), not from
                                // the document.
                                (
                                    "environment_variables",
                                    map(vec![(
                                        "host_env_keys",
                                        Value::Sequence(vec![string(TOKEN_ENV)]),
                                    )]),
                                ),
                            ]),
                        ),
                        (
                            "configuration",
                            map(vec![
                                ("@type", string(STRING_VALUE_TYPE)),
                                ("value", string(document)),
                            ]),
                        ),
                    ]),
                ),
            ]),
        ),
    ])
}

/// `stats_config` with the tag that gives Diana's rule counters a `rule` label in Envoy's
/// `/stats/prometheus` (`diana_rule_allowed{rule="login_burst"}`, the names and label the
/// filter's own metrics path uses); `/stats` keeps the full names.
pub fn stats_config() -> Value {
    map(vec![(
        "stats_tags",
        Value::Sequence(vec![map(vec![
            ("tag_name", string(RULE_LABEL)),
            ("regex", string(&envoy_rule_tag_regex())),
        ])]),
    )])
}

fn listener(options: &Options, document: &str, upstream_cluster: &str) -> Value {
    let route = map(vec![
        ("match", map(vec![("prefix", string("/"))])),
        (
            "route",
            map(vec![
                ("cluster", string(upstream_cluster)),
                ("timeout", string("15s")),
            ]),
        ),
    ]);
    let route_config = map(vec![
        ("name", string("local")),
        (
            "virtual_hosts",
            Value::Sequence(vec![map(vec![
                ("name", string("all")),
                ("domains", Value::Sequence(vec![string("*")])),
                ("routes", Value::Sequence(vec![route])),
            ])]),
        ),
    ]);
    let hcm = map(vec![
        ("@type", string(HCM_TYPE)),
        ("stat_prefix", string("ingress")),
        ("codec_type", string("AUTO")),
        // The upstream then sees the path Diana matched (Diana normalises on its own too).
        ("normalize_path", Value::Bool(true)),
        ("merge_slashes", Value::Bool(true)),
        ("route_config", route_config),
        (
            "http_filters",
            Value::Sequence(vec![
                // Diana first: a rejected request costs nothing further down the chain.
                wasm_filter(document, &options.wasm),
                map(vec![
                    ("name", string("envoy.filters.http.router")),
                    ("typed_config", map(vec![("@type", string(ROUTER_TYPE))])),
                ]),
            ]),
        ),
    ]);
    map(vec![
        ("name", string("ingress")),
        ("address", socket_address(&options.listen)),
        (
            "filter_chains",
            Value::Sequence(vec![map(vec![(
                "filters",
                Value::Sequence(vec![map(vec![
                    (
                        "name",
                        string("envoy.filters.network.http_connection_manager"),
                    ),
                    ("typed_config", hcm),
                ])]),
            )])]),
        ),
    ])
}

/// Renders the bootstrap for a validated `policy` whose text is `document`.
pub fn render(policy: &Policy, document: &str, options: &Options) -> Result<Rendered, String> {
    let mut warnings = Vec::new();
    let mut notes = Vec::new();
    let mut clusters: Vec<(String, Endpoint, &str)> = Vec::new();

    if count_global(policy) > 0 {
        clusters.push((
            policy.global.cluster.clone(),
            options.quota.clone(),
            "diana-quota (global rules)",
        ));
    }
    if let Some(remote) = &policy.remote {
        match clusters.iter().find(|(name, _, _)| *name == remote.cluster) {
            Some((_, endpoint, _)) => {
                if *endpoint != options.config_center {
                    warnings.push(format!(
                        "remote.cluster and global.cluster are both `{}`: the cluster points at \
                         --quota {}, --config-center {} is not used",
                        remote.cluster,
                        endpoint.display(),
                        options.config_center.display()
                    ));
                }
            }
            None => clusters.push((
                remote.cluster.clone(),
                options.config_center.clone(),
                "config center (remote)",
            )),
        }
    }
    let upstream_name = UPSTREAM_NAMES
        .iter()
        .find(|candidate| clusters.iter().all(|(name, _, _)| name != *candidate))
        .copied()
        .ok_or_else(|| "diana: no free name for the upstream cluster".to_string())?;
    if !Path::new(&options.wasm).is_file() {
        warnings.push(format!(
            "{} does not exist here (Envoy opens it relative to its own working directory); \
             build it with `cargo build --release --target wasm32-wasip1`",
            options.wasm
        ));
    }

    let mut cluster_values = vec![cluster(upstream_name, &options.upstream, "1s")];
    notes.push(format!(
        "cluster {upstream_name}: the protected service at {}",
        options.upstream.display()
    ));
    for (name, endpoint, what) in &clusters {
        cluster_values.push(cluster(name, endpoint, "0.25s"));
        notes.push(format!("cluster {name}: {what} at {}", endpoint.display()));
    }

    let bootstrap = map(vec![
        (
            "admin",
            map(vec![("address", socket_address(&options.admin))]),
        ),
        ("stats_config", stats_config()),
        (
            "static_resources",
            map(vec![
                (
                    "listeners",
                    Value::Sequence(vec![listener(options, document, upstream_name)]),
                ),
                ("clusters", Value::Sequence(cluster_values)),
            ]),
        ),
    ]);
    let body = serde_yaml::to_string(&bootstrap)
        .map_err(|err| format!("diana: cannot print the bootstrap: {err}"))?;

    let mut yaml = String::from("# Envoy bootstrap for Diana, rendered by `diana render-envoy`.\n");
    yaml.push_str(&format!(
        "# Run: envoy -c THIS_FILE --concurrency {}\n",
        options.concurrency
    ));
    yaml.push_str(&format!(
        "# listener {} -> diana.wasm ({}) -> router -> {upstream_name}\n",
        options.listen.display(),
        options.wasm
    ));
    yaml.push_str(&format!(
        "# admin {} (Diana metrics: /stats?filter=wasmcustom, /stats/prometheus with a rule label)\n",
        options.admin.display()
    ));
    for note in &notes {
        yaml.push_str(&format!("# {note}\n"));
    }
    yaml.push_str(&body);
    Ok(Rendered { yaml, warnings })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let ok = |text: &str, default: Option<&str>| parse_endpoint("--x", text, default);
        assert_eq!(
            ok("8080", Some("0.0.0.0")),
            Ok(Endpoint {
                host: "0.0.0.0".into(),
                port: 8080
            })
        );
        assert_eq!(
            ok("10.0.0.1:81", None),
            Ok(Endpoint {
                host: "10.0.0.1".into(),
                port: 81
            })
        );
        assert_eq!(
            ok("[::1]:81", None),
            Ok(Endpoint {
                host: "::1".into(),
                port: 81
            })
        );
        assert_eq!(ok("quota.svc:8081", None).map(|e| e.is_ip()), Ok(false));
        for bad in [
            "8080",
            "host:",
            "host:0",
            "host:70000",
            ":80",
            "::1:80",
            "a b:1",
        ] {
            assert!(ok(bad, None).is_err(), "{bad}");
        }
    }
}
