//! An Envoy v3 bootstrap that loads diana.wasm with a Diana document:
//!
//! ```text
//! listener -> http_connection_manager -> envoy.filters.http.wasm (Diana) -> router -> upstream
//! cluster <global.cluster>  -> --quota          (when the document has global rules, or --quota is given)
//! cluster <remote.cluster>  -> --config-center  (when the document has `remote`, or --config-center is given)
//! ```
//!
//! Built as a `serde_yaml::Value` tree, printed as YAML (with a header comment) or JSON. The
//! document is embedded verbatim (a `google.protobuf.StringValue`), so the line/column
//! numbers of the filter's error messages refer to it exactly as written.
//!
//! The one renderer of the repository: `scripts/run` and the end-to-end tests
//! (`tests/e2e/harness.py`) call `diana render-envoy --json` too; the tests render documents
//! unvalidated (`--no-validate`, the filter's own refusals are under test), Envoy without
//! the filter (`--no-filter`), answers from Envoy itself (`--direct-response`) and access logs.

use crate::plan::count_global;
use crate::yaml::{map, number, string};
use diana_core::config::Policy;
use diana_core::config::TOKEN_ENV;
use diana_core::jwt::ClaimOrigin;
use diana_core::metrics::{
    envoy_breaker_tag_regex, envoy_rule_tag_regex, BREAKER_LABEL, RULE_LABEL,
};
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
const FILE_ACCESS_LOG_TYPE: &str =
    "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog";

/// The cluster names a document that is not read (`--no-validate`, `--no-filter`) gets for
/// `--quota` / `--config-center`: `global.cluster`'s default, and the name the examples use
/// for `remote.cluster`.
const QUOTA_CLUSTER: &str = "diana_quota";
const CONFIG_CLUSTER: &str = "diana_config";

/// Endpoints used when the bootstrap needs a cluster that no option gave.
pub const DEFAULT_UPSTREAM: (&str, u16) = ("127.0.0.1", 8080);
pub const DEFAULT_QUOTA: (&str, u16) = ("127.0.0.1", 8081);
pub const DEFAULT_CONFIG_CENTER: (&str, u16) = ("127.0.0.1", 8082);

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
    pub fn new(host: &str, port: u16) -> Endpoint {
        Endpoint {
            host: host.to_string(),
            port,
        }
    }

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

/// A command-line value `render-envoy` refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    /// An endpoint option (`--listen`, `--upstream`, ...): the option, its value (trimmed)
    /// and what is wrong with it.
    #[error("invalid {flag} `{text}`: {problem}")]
    Endpoint {
        flag: String,
        text: String,
        problem: EndpointProblem,
    },
    /// `--direct-response` that is not `STATUS` or `STATUS:BODY` with a status Envoy takes.
    #[error(
        "invalid --direct-response `{text}`: expected STATUS or STATUS:BODY, \
         STATUS from 200 to 599"
    )]
    DirectResponse { text: String },
}

/// What is wrong with an endpoint option's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EndpointProblem {
    #[error("the port must be a number from 1 to 65535")]
    Port,
    /// Not `HOST:PORT`, and the option takes a bare port too.
    #[error("expected PORT or HOST:PORT")]
    NotPortOrHostPort,
    #[error("expected HOST:PORT")]
    NotHostPort,
    /// An IPv6 address without brackets (or something with colons that is not one).
    #[error("write an IPv6 address as [ADDRESS]:PORT")]
    UnbracketedIpv6,
}

/// Parses `HOST:PORT` (`[v6]:PORT` too), or a bare `PORT` when `default_host` is given.
pub fn parse_endpoint(
    flag: &str,
    text: &str,
    default_host: Option<&str>,
) -> Result<Endpoint, OptionError> {
    let text = text.trim();
    let bad = |problem: EndpointProblem| OptionError::Endpoint {
        flag: flag.to_string(),
        text: text.to_string(),
        problem,
    };
    let port = |raw: &str| -> Result<u16, OptionError> {
        match raw.parse::<u16>() {
            Ok(0) | Err(_) => Err(bad(EndpointProblem::Port)),
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
        EndpointProblem::NotPortOrHostPort
    } else {
        EndpointProblem::NotHostPort
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
        return Err(bad(EndpointProblem::UnbracketedIpv6));
    }
    Ok(Endpoint {
        host: host.to_string(),
        port: port(raw_port)?,
    })
}

/// What the filter is given.
#[derive(Debug, Clone, Copy)]
pub enum Filter<'a> {
    /// A validated document: the clusters it needs are rendered under its names.
    Validated {
        policy: &'a Policy,
        document: &'a str,
    },
    /// A document embedded unread (`--no-validate`): only the clusters given by options,
    /// under the default names.
    Unvalidated { document: &'a str },
    /// No Diana filter (`--no-filter`): Envoy alone, a baseline.
    Absent,
}

impl Filter<'_> {
    fn document(&self) -> Option<&str> {
        match self {
            Filter::Validated { document, .. } | Filter::Unvalidated { document } => Some(document),
            Filter::Absent => None,
        }
    }
}

/// An HTTP access log written to a file: Envoy's default format, or `format`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessLog {
    pub path: String,
    pub format: Option<String>,
}

/// What `render-envoy` was asked for. `None` endpoints were not given: the cluster is then
/// rendered, at its default endpoint, only when the bootstrap needs it.
#[derive(Debug, Clone)]
pub struct Options {
    pub wasm: String,
    pub listen: Endpoint,
    pub admin: Endpoint,
    pub upstream: Option<Endpoint>,
    pub quota: Option<Endpoint>,
    pub config_center: Option<Endpoint>,
    pub concurrency: u32,
    /// Envoy's `normalize_path` and `merge_slashes`, and an escaped slash unescaped and
    /// redirected (the filter normalises on its own too).
    pub normalize_path: bool,
    /// Proxies in front of Envoy whose `X-Forwarded-For` entries are trusted
    /// (`xff_num_trusted_hops`); 0: the client is the peer of the connection.
    pub xff_trusted_hops: u32,
    /// The route's timeout (an Envoy duration).
    pub route_timeout: String,
    /// Answer every request from Envoy itself, after the filter chain: (status, body).
    pub direct_response: Option<(u16, String)>,
    pub access_logs: Vec<AccessLog>,
    /// Envoy's `jwt_authn` before Diana (`--jwt-issuer`, `--jwks`).
    pub jwt: Option<JwtProvider>,
}

/// A token issuer whose tokens Envoy's `jwt_authn` verifies before Diana, with its keys in
/// a local JWKS file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtProvider {
    pub issuer: String,
    pub jwks: String,
}

/// The `payload_in_metadata` name rendered when the document names none.
pub const DEFAULT_JWT_PAYLOAD: &str = "jwt_payload";
/// The provider's name in the rendered `jwt_authn`.
const JWT_PROVIDER: &str = "diana";
const JWT_AUTHN_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication";

/// How the document reads claims, as far as the `jwt_authn` before it must serve them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ClaimsRead {
    /// The `payload_in_metadata` names of `from: {jwt_authn: NAME}`, in document order.
    payloads: Vec<String>,
    /// Who reads a claim from the `authorization` header (`Policy::header_claims`).
    header: Vec<String>,
}

impl ClaimsRead {
    fn of(policy: &Policy) -> ClaimsRead {
        let mut payloads: Vec<String> = Vec::new();
        for rule in policy.rules() {
            let from_actor = rule
                .actor_source()
                .into_iter()
                .find(|(key, _)| *key == "from")
                .and_then(|(_, from)| from.strip_prefix("jwt_authn:").map(str::to_string));
            let from_plan = rule
                .plan
                .as_ref()
                .and_then(|choice| choice.by.metadata_claim())
                .and_then(|claim| match claim.origin() {
                    ClaimOrigin::JwtAuthn(name) => Some(name.clone()),
                    ClaimOrigin::Bearer => None,
                });
            for name in from_actor.into_iter().chain(from_plan) {
                if !payloads.contains(&name) {
                    payloads.push(name);
                }
            }
        }
        ClaimsRead {
            payloads,
            header: policy.header_claims(),
        }
    }

    fn any(&self) -> bool {
        !self.payloads.is_empty() || !self.header.is_empty()
    }
}

/// The `envoy.filters.http.jwt_authn` entry before Diana: one provider whose verified
/// payload goes to the request's metadata under `payload` (what `from: {jwt_authn: NAME}`
/// reads), the token forwarded only when the document reads it from the header, and a
/// valid token required on every path (the rules Diana limits by claim must not be
/// reachable without one).
fn jwt_authn_filter(provider: &JwtProvider, payload: &str, forward: bool) -> Value {
    map(vec![
        ("name", string("envoy.filters.http.jwt_authn")),
        (
            "typed_config",
            map(vec![
                ("@type", string(JWT_AUTHN_TYPE)),
                (
                    "providers",
                    map(vec![(
                        JWT_PROVIDER,
                        map(vec![
                            ("issuer", string(&provider.issuer)),
                            (
                                "local_jwks",
                                map(vec![("filename", string(&provider.jwks))]),
                            ),
                            ("payload_in_metadata", string(payload)),
                            ("forward", Value::Bool(forward)),
                        ]),
                    )]),
                ),
                (
                    "rules",
                    Value::Sequence(vec![map(vec![
                        ("match", map(vec![("prefix", string("/"))])),
                        (
                            "requires",
                            map(vec![("provider_name", string(JWT_PROVIDER))]),
                        ),
                    ])]),
                ),
            ]),
        ),
    ])
}

/// Why the bootstrap cannot be rendered or printed.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// Every name of [`UPSTREAM_NAMES`] is taken by another cluster.
    #[error("no free name for the upstream cluster")]
    NoUpstreamName,
    #[error("cannot print the bootstrap: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("cannot print the bootstrap: {0}")]
    Json(#[from] serde_json::Error),
}

/// The bootstrap, the comment lines that head its YAML form, and things worth telling the
/// user on stderr.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub bootstrap: Value,
    pub comments: Vec<String>,
    pub warnings: Vec<String>,
}

impl Rendered {
    /// YAML, headed by the comments.
    pub fn yaml(&self) -> Result<String, RenderError> {
        let body = serde_yaml::to_string(&self.bootstrap)?;
        let mut yaml = String::new();
        for comment in &self.comments {
            yaml.push_str(&format!("# {comment}\n"));
        }
        yaml.push_str(&body);
        Ok(yaml)
    }

    /// JSON (Envoy reads a `.json` bootstrap as JSON), indented by two spaces.
    pub fn json(&self) -> Result<String, RenderError> {
        let mut json = serde_json::to_string_pretty(&self.bootstrap)?;
        json.push('\n');
        Ok(json)
    }
}

/// Parses `STATUS` or `STATUS:BODY` (`--direct-response`); Envoy takes a status from 200 to 599.
pub fn parse_direct_response(text: &str) -> Result<(u16, String), OptionError> {
    let (status, body) = text.split_once(':').unwrap_or((text, ""));
    match status.trim().parse::<u16>() {
        Ok(status @ 200..=599) => Ok((status, body.to_string())),
        _ => Err(OptionError::DirectResponse {
            text: text.to_string(),
        }),
    }
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

/// How long Envoy keeps an idle pooled connection to diana-quota: shorter than the
/// service's `--header-timeout-ms` (10 s by default; an idle HTTP/1 connection is closed by
/// the service then), so that Envoy always closes an idle connection first. Otherwise a
/// callout sent on a connection at the instant the service closes it fails, and the filter
/// falls back to its local limits for that request.
pub const QUOTA_IDLE_TIMEOUT: &str = "5s";

const HTTP_PROTOCOL_OPTIONS_TYPE: &str =
    "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// The quota service's cluster: HTTP/1.1 (as before) with [`QUOTA_IDLE_TIMEOUT`].
fn with_quota_idle_timeout(mut cluster: Value) -> Value {
    if let Value::Mapping(fields) = &mut cluster {
        fields.insert(
            string("typed_extension_protocol_options"),
            map(vec![(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                map(vec![
                    ("@type", string(HTTP_PROTOCOL_OPTIONS_TYPE)),
                    (
                        "common_http_protocol_options",
                        map(vec![("idle_timeout", string(QUOTA_IDLE_TIMEOUT))]),
                    ),
                    (
                        "explicit_http_config",
                        map(vec![("http_protocol_options", map(vec![]))]),
                    ),
                ]),
            )]),
        );
    }
    cluster
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

/// The trimmed module without body callbacks, as `scripts/build` names it; its sibling
/// keeps the callbacks of answers' bodies (`crates/diana-trim`).
const HEADERS_MODULE: &str = "diana-envoy.wasm";
const BODIES_MODULE: &str = "diana-envoy-bodies.wasm";

/// The module a document needs: one whose rules read answers' bodies
/// (`response_cost.usage | json`) needs the body callbacks, so `diana-envoy.wasm` becomes
/// its sibling `diana-envoy-bodies.wasm`; any other module is taken as given (the
/// untrimmed `diana.wasm` has every callback). A document that reads no body keeps the
/// module without them: no VM entry per body chunk.
fn module_for(policy: &Policy, wasm: &str, notes: &mut Vec<String>) -> String {
    if !policy.reads_response_bodies() {
        return wasm.to_string();
    }
    match wasm.strip_suffix(HEADERS_MODULE) {
        Some(dir) if dir.is_empty() || dir.ends_with('/') => {
            let bodies = format!("{dir}{BODIES_MODULE}");
            notes.push(format!(
                "the document reads answers' bodies (response_cost.usage | json): {bodies}, \
                 which keeps the body callbacks"
            ));
            bodies
        }
        _ => {
            notes.push(format!(
                "the document reads answers' bodies (response_cost.usage | json): {wasm} must \
                 keep the body callbacks (diana-envoy-bodies.wasm or the untrimmed diana.wasm)"
            ));
            wasm.to_string()
        }
    }
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

/// `stats_config` with the tags that give Diana's rule counters a `rule` label (and its
/// breakers' metrics a `breaker` label) in Envoy's
/// `/stats/prometheus` (`diana_rule_allowed{rule="login_burst"}`, the names and label the
/// filter's own metrics path uses); `/stats` keeps the full names.
pub fn stats_config() -> Value {
    map(vec![(
        "stats_tags",
        Value::Sequence(vec![
            map(vec![
                ("tag_name", string(RULE_LABEL)),
                ("regex", string(&envoy_rule_tag_regex())),
            ]),
            map(vec![
                ("tag_name", string(BREAKER_LABEL)),
                ("regex", string(&envoy_breaker_tag_regex())),
            ]),
        ]),
    )])
}

/// An access log entry of the connection manager.
fn file_access_log(log: &AccessLog) -> Value {
    let mut config = vec![
        ("@type", string(FILE_ACCESS_LOG_TYPE)),
        ("path", string(&log.path)),
    ];
    if let Some(format) = &log.format {
        config.push((
            "log_format",
            map(vec![(
                "text_format_source",
                map(vec![("inline_string", string(format))]),
            )]),
        ));
    }
    map(vec![
        ("name", string("envoy.access_loggers.file")),
        ("typed_config", map(config)),
    ])
}

/// `upstream_cluster` is `None` when Envoy answers by itself (`options.direct_response`);
/// `jwt_authn` goes before Diana when given.
fn listener(
    options: &Options,
    wasm: &str,
    document: Option<&str>,
    upstream_cluster: Option<&str>,
    jwt_authn: Option<Value>,
) -> Value {
    let action = match (&options.direct_response, upstream_cluster) {
        (Some((status, body)), _) => (
            "direct_response",
            map(vec![
                ("status", number(u64::from(*status))),
                ("body", map(vec![("inline_string", string(body))])),
            ]),
        ),
        (None, cluster) => (
            "route",
            map(vec![
                ("cluster", string(cluster.unwrap_or(UPSTREAM_NAMES[0]))),
                ("timeout", string(&options.route_timeout)),
            ]),
        ),
    };
    let route = map(vec![("match", map(vec![("prefix", string("/"))])), action]);
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
    // Diana first (after the token's verification, whose claims it may read): a rejected
    // request costs nothing further down the chain.
    let mut http_filters: Vec<Value> = jwt_authn
        .into_iter()
        .chain(document.map(|document| wasm_filter(document, wasm)))
        .collect();
    http_filters.push(map(vec![
        ("name", string("envoy.filters.http.router")),
        ("typed_config", map(vec![("@type", string(ROUTER_TYPE))])),
    ]));
    let mut hcm = vec![
        ("@type", string(HCM_TYPE)),
        ("stat_prefix", string("ingress")),
        ("codec_type", string("AUTO")),
        // By default every filter before Diana (jwt_authn: its rules match this path), the
        // routes and the upstream see the path Diana matched; without it `//api/x` or
        // `/x/../api/x` misses a jwt_authn rule on `/api` while Diana counts it as `/api/x`.
        // (Diana normalises on its own too: the end-to-end tests turn this off to exercise
        // the filter's own.)
        ("normalize_path", Value::Bool(options.normalize_path)),
        ("merge_slashes", Value::Bool(options.normalize_path)),
        // The client address (`source.address`, Diana's `ip` identity) is the connection's
        // peer, or the entry `xff_num_trusted_hops` from the end of X-Forwarded-For. Without
        // `use_remote_address` Envoy takes the last X-Forwarded-For entry, which any client
        // writes: it could charge its requests to another client, or escape its own limit.
        ("use_remote_address", Value::Bool(true)),
        (
            "xff_num_trusted_hops",
            number(u64::from(options.xff_trusted_hops)),
        ),
        ("route_config", route_config),
        ("http_filters", Value::Sequence(http_filters)),
    ];
    if options.normalize_path {
        // An escaped slash (`/api%2Fx`) stays inside its segment for Diana and the routes,
        // and some backends decode it: the client is sent to the unescaped path instead.
        hcm.push((
            "path_with_escaped_slashes_action",
            string("UNESCAPE_AND_REDIRECT"),
        ));
    }
    if !options.access_logs.is_empty() {
        hcm.push((
            "access_log",
            Value::Sequence(options.access_logs.iter().map(file_access_log).collect()),
        ));
    }
    let hcm = map(hcm);
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

/// Renders the bootstrap for `filter` (a validated document, an unread one, or none).
pub fn render(filter: Filter, options: &Options) -> Result<Rendered, RenderError> {
    let mut warnings = Vec::new();
    let mut notes = Vec::new();
    let mut clusters: Vec<(String, Endpoint, &str)> = Vec::new();
    let default = |(host, port): (&str, u16)| Endpoint::new(host, port);

    // The names of the quota service's and the config center's clusters, and whether the
    // document needs them; an unread document gets the clusters given by options only.
    let (quota_name, needs_quota, remote_name, needs_remote) = match filter {
        Filter::Validated { policy, .. } => (
            policy.global.cluster.as_str(),
            count_global(policy) > 0,
            policy
                .remote
                .as_ref()
                .map_or(CONFIG_CLUSTER, |remote| remote.cluster.as_str()),
            policy.remote.is_some(),
        ),
        Filter::Unvalidated { .. } | Filter::Absent => {
            (QUOTA_CLUSTER, false, CONFIG_CLUSTER, false)
        }
    };
    let quota = (options.quota.clone()).or_else(|| needs_quota.then(|| default(DEFAULT_QUOTA)));
    if let Some(quota) = quota {
        let what = if needs_quota {
            "diana-quota (global rules)"
        } else {
            "diana-quota"
        };
        clusters.push((quota_name.to_string(), quota, what));
    }
    let config_center = (options.config_center.clone())
        .or_else(|| needs_remote.then(|| default(DEFAULT_CONFIG_CENTER)));
    if let Some(config_center) = config_center {
        match clusters.iter().find(|(name, _, _)| name == remote_name) {
            Some((_, endpoint, _)) => {
                if *endpoint != config_center {
                    warnings.push(format!(
                        "remote.cluster and global.cluster are both `{remote_name}`: the cluster \
                         points at --quota {}, --config-center {} is not used",
                        endpoint.display(),
                        config_center.display()
                    ));
                }
            }
            None => {
                let what = if needs_remote {
                    "config center (remote)"
                } else {
                    "config center"
                };
                clusters.push((remote_name.to_string(), config_center, what));
            }
        }
    }
    // The protected service: needed unless Envoy answers by itself.
    let upstream = match (&options.upstream, &options.direct_response) {
        (Some(upstream), _) => Some(upstream.clone()),
        (None, None) => Some(default(DEFAULT_UPSTREAM)),
        (None, Some(_)) => None,
    };
    let upstream_name = match &upstream {
        Some(_) => Some(
            UPSTREAM_NAMES
                .iter()
                .find(|candidate| clusters.iter().all(|(name, _, _)| name != *candidate))
                .copied()
                .ok_or(RenderError::NoUpstreamName)?,
        ),
        None => None,
    };
    let claims = match filter {
        Filter::Validated { policy, .. } => ClaimsRead::of(policy),
        Filter::Unvalidated { .. } | Filter::Absent => ClaimsRead::default(),
    };
    if !claims.header.is_empty() {
        warnings.push(format!(
            "{} read a claim from the authorization header, which Diana does not verify: \
             read it from the payload jwt_authn verified instead (`from: {{jwt_authn: NAME}}`; \
             --jwt-issuer and --jwks render jwt_authn with `payload_in_metadata: NAME`)",
            claims.header.join(", ")
        ));
    }
    let jwt_authn = match &options.jwt {
        Some(provider) => {
            let payload = claims
                .payloads
                .first()
                .map_or(DEFAULT_JWT_PAYLOAD, String::as_str);
            if claims.payloads.len() > 1 {
                warnings.push(format!(
                    "the document reads the payloads {} from jwt_authn's metadata; one \
                     provider writes one: rendered `{payload}`",
                    claims.payloads.join(", "),
                ));
            }
            notes.push(format!(
                "jwt_authn before Diana: tokens of {} required on every path, the verified \
                 payload in the metadata as `{payload}`",
                provider.issuer
            ));
            Some(jwt_authn_filter(
                provider,
                payload,
                !claims.header.is_empty(),
            ))
        }
        None => {
            if claims.any() {
                warnings.push(
                    "the document reads claims: verify the token before Diana (--jwt-issuer and \
                     --jwks render Envoy's jwt_authn in front of it)"
                        .to_string(),
                );
            }
            None
        }
    };
    let document = filter.document();
    let wasm = match filter {
        Filter::Validated { policy, .. } => module_for(policy, &options.wasm, &mut notes),
        // Embedded unread; still, a document that does read answers gets the module that
        // can (one that does not parse reads nothing).
        Filter::Unvalidated { document } => match diana_core::config::parse_policy(document) {
            Ok(policy) => module_for(&policy, &options.wasm, &mut notes),
            Err(_) => options.wasm.clone(),
        },
        Filter::Absent => options.wasm.clone(),
    };
    if document.is_some() && !Path::new(&wasm).is_file() {
        warnings.push(format!(
            "{wasm} does not exist here (Envoy opens it relative to its own working directory); \
             build it with `scripts/build`",
        ));
    }

    let mut cluster_values = Vec::new();
    if let (Some(name), Some(endpoint)) = (upstream_name, &upstream) {
        cluster_values.push(cluster(name, endpoint, "1s"));
        notes.push(format!(
            "cluster {name}: the protected service at {}",
            endpoint.display()
        ));
    }
    for (name, endpoint, what) in &clusters {
        let value = cluster(name, endpoint, "0.25s");
        cluster_values.push(if name == quota_name {
            with_quota_idle_timeout(value)
        } else {
            value
        });
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
                    Value::Sequence(vec![listener(
                        options,
                        &wasm,
                        document,
                        upstream_name,
                        jwt_authn,
                    )]),
                ),
                ("clusters", Value::Sequence(cluster_values)),
            ]),
        ),
    ]);

    let jwt_step = if options.jwt.is_some() {
        "jwt_authn -> "
    } else {
        ""
    };
    let filter_step = match document {
        Some(_) => format!("{jwt_step}diana.wasm ({wasm}) -> "),
        None => format!("{jwt_step}no Diana filter -> "),
    };
    let destination = match (&options.direct_response, upstream_name) {
        (Some((status, _)), _) => format!("direct response {status}"),
        (None, name) => name.unwrap_or_default().to_string(),
    };
    let mut comments = vec![
        "Envoy bootstrap for Diana, rendered by `diana render-envoy`.".to_string(),
        format!(
            "Run: envoy -c THIS_FILE --concurrency {}",
            options.concurrency
        ),
        format!(
            "listener {} -> {filter_step}router -> {destination}",
            options.listen.display()
        ),
    ];
    if let Filter::Unvalidated { .. } = filter {
        comments.push("the document is embedded unvalidated (--no-validate)".to_string());
    }
    comments.push(format!(
        "admin {} (Diana metrics: /stats?filter=wasmcustom, /stats/prometheus with a rule label)",
        options.admin.display()
    ));
    comments.extend(notes);
    Ok(Rendered {
        bootstrap,
        comments,
        warnings,
    })
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
        for (bad, problem) in [
            ("8080", EndpointProblem::NotHostPort),
            ("host:", EndpointProblem::Port),
            ("host:0", EndpointProblem::Port),
            ("host:70000", EndpointProblem::Port),
            (":80", EndpointProblem::NotHostPort),
            ("::1:80", EndpointProblem::UnbracketedIpv6),
            ("a b:1", EndpointProblem::NotHostPort),
        ] {
            assert_eq!(
                ok(bad, None),
                Err(OptionError::Endpoint {
                    flag: "--x".into(),
                    text: bad.into(),
                    problem
                }),
                "{bad}"
            );
        }
        assert_eq!(
            ok(" x ", Some("0.0.0.0")).map_err(|err| err.to_string()),
            Err("invalid --x `x`: expected PORT or HOST:PORT".to_string())
        );
    }

    /// The quota service's cluster, rendered and in every bootstrap of the repository,
    /// closes idle connections before diana-quota would (its `--header-timeout-ms`, 10 s).
    #[test]
    fn the_quota_cluster_closes_idle_connections_before_the_service() {
        let options = |cluster: &Value| {
            cluster["typed_extension_protocol_options"]
                ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
                .clone()
        };
        let rendered = with_quota_idle_timeout(cluster(
            QUOTA_CLUSTER,
            &Endpoint::new("127.0.0.1", 8081),
            "0.25s",
        ));
        let expected = options(&rendered);
        assert_eq!(
            expected["common_http_protocol_options"]["idle_timeout"],
            string("5s")
        );
        let seconds: f64 = QUOTA_IDLE_TIMEOUT.trim_end_matches('s').parse().unwrap();
        assert!(
            seconds < 10.0,
            "shorter than diana-quota's --header-timeout-ms"
        );
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for file in ["envoy/envoy.yaml", "envoy/native.yaml", "docker/envoy.yaml"] {
            let text = std::fs::read_to_string(root.join(file)).unwrap();
            let bootstrap: Value = serde_yaml::from_str(&text).unwrap();
            let Some(clusters) = bootstrap["static_resources"]["clusters"].as_sequence() else {
                panic!("{file}: no clusters")
            };
            let quota: Vec<&Value> = clusters
                .iter()
                .filter(|cluster| cluster["name"] == string(QUOTA_CLUSTER))
                .collect();
            assert!(!quota.is_empty(), "{file}: no {QUOTA_CLUSTER} cluster");
            for cluster in quota {
                assert_eq!(options(cluster), expected, "{file}");
            }
        }
    }

    #[test]
    fn direct_responses() {
        assert_eq!(parse_direct_response("429"), Ok((429, String::new())));
        assert_eq!(
            parse_direct_response("200:a:b"),
            Ok((200, "a:b".to_string()))
        );
        for bad in ["99", "600", "x:y", ""] {
            let err = parse_direct_response(bad);
            assert_eq!(
                err,
                Err(OptionError::DirectResponse { text: bad.into() }),
                "{bad}"
            );
        }
        assert_eq!(
            parse_direct_response("x:y").map_err(|err| err.to_string()),
            Err(
                "invalid --direct-response `x:y`: expected STATUS or STATUS:BODY, \
                 STATUS from 200 to 599"
                    .to_string()
            )
        );
    }
}
