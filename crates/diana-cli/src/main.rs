//! `diana`: the command-line companion of the Diana filter.
//!
//! - `diana check FILE` validates a Diana document with the filter's own parser
//!   (`diana_core::config::parse_policy`) and prints the effective plan, every default
//!   filled in; on error it prints the filter's message and exits 1.
//! - `diana render-envoy FILE` validates the document and prints an Envoy v3 bootstrap
//!   that loads `diana.wasm` with it (YAML, or JSON with `--json`); `scripts/run` and the
//!   end-to-end tests render theirs with it too.
//! - `diana schema [--kong]` prints a JSON Schema (draft 4) of the document's JSON forms;
//!   with `--kong`, wrapped as Kong filter metadata (`kong/diana.meta.json`).
//! - `diana simulate POLICY LOG` replays a request log (JSON lines or Envoy's access log)
//!   through the policy with the log's own clock and prints per second and per rule what
//!   would have been admitted, delayed and rejected (`--json`, `--svg FILE`).
//!
//! - `diana check-nginx NGINX_CONF` reads an nginx configuration (its includes too) and
//!   reports, with file:line, what ngx_wasm_module does not let the filter catch at run
//!   time: no `shm_kv` zone for Diana's keys, a location with global rules and without
//!   `proxy_wasm_request_headers_in_access on;`, a zone too small for the document, an
//!   upstream not written `host:port`; the documents are checked as `diana check` does.
//!
//! Exit codes: 0 success, 1 invalid document (or, for `check-nginx`, problems found),
//! 2 usage or I/O error (or an nginx configuration that cannot be parsed).

mod envoy;
mod nginx;
mod nginx_check;
mod nginx_conf;
mod plan;
mod schema;
mod simulate;
mod yaml;

use clap::{Args, Parser, Subcommand};
use diana_core::config::{parse_policy, Policy};
use diana_core::time::Nanos;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Exit code of an invalid document.
const EXIT_INVALID: u8 = 1;
/// Exit code of a usage or I/O error (clap uses 2 for usage errors too).
const EXIT_IO: u8 = 2;

#[derive(Parser, Debug)]
#[command(
    name = "diana",
    version,
    about = "Check Diana rate-limiter documents and render gateway configuration for them",
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Validate a document and print the effective plan (every default filled in).
    ///
    /// On error, prints the filter's own message (field path, line and column) to
    /// stderr and exits 1.
    Check {
        /// The Diana document (YAML or JSON); `-` reads standard input.
        file: PathBuf,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check an nginx configuration that runs Diana through ngx_wasm_module, before you
    /// reload it.
    ///
    /// Reads NGINX_CONF and the files it includes (relative to its directory, globs
    /// allowed), and prints one line per problem with its file:line: no `shm_kv` zone for
    /// Diana's keys in the `wasm { }` block, a location running `proxy_wasm diana` with a
    /// global rule without `proxy_wasm_request_headers_in_access on;`, a zone smaller than
    /// the documents need, a document the filter refuses (checked as `diana check` does),
    /// `global.cluster` / `remote.cluster` not written host:port. Exits 1 when it found a
    /// problem, 2 when the configuration cannot be read or parsed, 0 with a one-line
    /// summary otherwise.
    CheckNginx {
        /// The nginx configuration file (nginx.conf).
        nginx_conf: PathBuf,
        /// Check this Diana document (YAML or JSON; `-` reads standard input) instead of
        /// those written in the `proxy_wasm diana '<document>'` lines.
        #[arg(long, value_name = "FILE")]
        document: Option<PathBuf>,
    },
    /// Validate a document and print an Envoy v3 bootstrap (YAML, or JSON) that loads
    /// diana.wasm with it.
    ///
    /// The document's `global.cluster` / `remote.cluster` are rendered when it needs them
    /// (global rules, `remote`) or when --quota / --config-center (or their -port forms) are
    /// given.
    RenderEnvoy(Box<RenderArgs>),
    /// Print a JSON Schema (draft 4) of the document's JSON forms (block, list of blocks, full form).
    Schema {
        /// Wrap it as Kong filter metadata: `{"config_schema": ...}` (kong/diana.meta.json).
        #[arg(long)]
        kong: bool,
    },
    /// Replay a request log through a policy with the log's own clock (the filter's engine,
    /// no gateway) and print per second and per rule what would have been admitted,
    /// delayed and rejected.
    ///
    /// The log holds JSON lines (`{"ts": RFC 3339 or epoch seconds, "path": "/x",
    /// "headers": {...}, "client_ip": "..."}`) or Envoy's default access-log format, told
    /// apart line by line. Malformed lines are counted and the first few named; they never
    /// stop the replay.
    Simulate(SimulateArgs),
}

#[derive(Args, Debug)]
struct SimulateArgs {
    /// The Diana document (YAML or JSON).
    policy: PathBuf,
    /// The request log; `-` reads standard input.
    log: PathBuf,
    /// How lines are read: each on its own (`auto`), or all as one format.
    #[arg(long, value_enum, default_value = "auto")]
    format: simulate::Format,
    /// Fields appended to Envoy's default format, in order: a request header name (for
    /// `"%REQ(X-DEVICE-ID)%"`) or `client_ip` (for `"%DOWNSTREAM_REMOTE_ADDRESS%"`).
    /// Repeat the option or separate names with commas.
    #[arg(long = "envoy-field", value_delimiter = ',', value_name = "FIELD")]
    envoy_fields: Vec<String>,
    /// Spread the requests round robin over this many gateways, each with its own local
    /// counters; global rules share one simulated quota service.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    gateways: u32,
    /// Seconds per row of the table and bar of the chart.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    interval: u64,
    /// Lines at most this many seconds out of time order are replayed in time order.
    #[arg(long = "reorder-seconds", default_value_t = simulate::REORDER_SECONDS)]
    reorder_seconds: f64,
    /// Print the totals only (no per-second table).
    #[arg(long)]
    totals: bool,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    /// Also write an SVG chart: requests per second over time, stacked admitted, delayed
    /// and rejected, one panel for all requests and one per rule.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct RenderArgs {
    /// The Diana document (YAML or JSON); `-` reads standard input.
    #[arg(required_unless_present_any = ["diana_config", "no_filter"])]
    file: Option<PathBuf>,
    /// The Diana document, given as an option instead of FILE.
    #[arg(long = "diana-config", value_name = "FILE", conflicts_with = "file")]
    diana_config: Option<PathBuf>,
    /// Render Envoy without the Diana filter (and without a document): a baseline.
    #[arg(long = "no-filter", conflicts_with_all = ["file", "diana_config"])]
    no_filter: bool,
    /// Embed the document as it is, unvalidated (to see the filter refuse it): the quota
    /// and config-center clusters are then only those given by options, named
    /// `diana_quota` and `diana_config`.
    #[arg(long = "no-validate")]
    no_validate: bool,
    /// diana.wasm as Envoy will open it (a relative path is relative to Envoy's working directory).
    #[arg(long, default_value = envoy::DEFAULT_WASM)]
    wasm: String,
    /// Listener: PORT (on 0.0.0.0) or HOST:PORT [default: 10000].
    #[arg(long)]
    listen: Option<String>,
    /// Listener on 127.0.0.1:PORT.
    #[arg(long = "listen-port", value_name = "PORT", conflicts_with = "listen", value_parser = port_parser())]
    listen_port: Option<u16>,
    /// Admin interface: PORT (on 127.0.0.1) or HOST:PORT [default: 9901].
    #[arg(long)]
    admin: Option<String>,
    /// Admin interface on 127.0.0.1:PORT.
    #[arg(long = "admin-port", value_name = "PORT", conflicts_with = "admin", value_parser = port_parser())]
    admin_port: Option<u16>,
    /// The protected service, HOST:PORT (an IP makes a STATIC cluster, a name a STRICT_DNS
    /// one) [default: 127.0.0.1:8080, unless --direct-response].
    #[arg(long)]
    upstream: Option<String>,
    /// The protected service on 127.0.0.1:PORT.
    #[arg(long = "upstream-port", value_name = "PORT", conflicts_with = "upstream", value_parser = port_parser())]
    upstream_port: Option<u16>,
    /// diana-quota, HOST:PORT: the `global.cluster` cluster [default: 127.0.0.1:8081, when
    /// the document has global rules].
    #[arg(long)]
    quota: Option<String>,
    /// diana-quota on 127.0.0.1:PORT.
    #[arg(long = "quota-port", value_name = "PORT", conflicts_with = "quota", value_parser = port_parser())]
    quota_port: Option<u16>,
    /// Config center, HOST:PORT: the `remote.cluster` cluster [default: 127.0.0.1:8082, when
    /// the document has `remote`].
    #[arg(long = "config-center")]
    config_center: Option<String>,
    /// Config center on 127.0.0.1:PORT.
    #[arg(long = "config-port", value_name = "PORT", conflicts_with = "config_center", value_parser = port_parser())]
    config_port: Option<u16>,
    /// Worker threads: Envoy takes this on its command line (`--concurrency`), not in the
    /// bootstrap; it goes in the run command printed in the header comment.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    concurrency: u32,
    /// Let Envoy normalise paths, merge slashes and redirect escaped slashes before any
    /// filter sees them, so that jwt_authn's rules, Diana and the routes see one path (the
    /// default).
    #[arg(long = "normalize-path", overrides_with = "no_normalize_path")]
    normalize_path: bool,
    /// Leave the path as the client spelled it (the filter normalises on its own).
    #[arg(long = "no-normalize-path", overrides_with = "normalize_path")]
    no_normalize_path: bool,
    /// Proxies in front of Envoy (load balancers) whose X-Forwarded-For entries are trusted:
    /// the client address is the entry this many from the end. 0: the connection's peer.
    #[arg(long = "xff-trusted-hops", default_value_t = 0, value_name = "N")]
    xff_trusted_hops: u32,
    /// The route's timeout, an Envoy duration.
    #[arg(long = "route-timeout", default_value = "15s", value_name = "DURATION")]
    route_timeout: String,
    /// Answer every request from Envoy itself after the filter chain (no upstream needed):
    /// STATUS or STATUS:BODY.
    #[arg(long = "direct-response", value_name = "STATUS[:BODY]")]
    direct_response: Option<String>,
    /// Also write an HTTP access log, in Envoy's default format, to FILE (repeatable).
    #[arg(long = "access-log", value_name = "FILE")]
    access_log: Vec<String>,
    /// Also write an HTTP access log to FILE in Envoy's text FORMAT (repeatable).
    #[arg(long = "formatted-access-log", num_args = 2, value_names = ["FILE", "FORMAT"], allow_hyphen_values = true)]
    formatted_access_log: Vec<String>,
    /// Verify tokens of this issuer with Envoy's jwt_authn before Diana: required on every
    /// path, the verified payload in the request's metadata under the name the document's
    /// `from: {jwt_authn: NAME}` reads (the recommended way to count by a claim; the token
    /// is forwarded only when the document reads it from the header). With --jwks.
    #[arg(long = "jwt-issuer", value_name = "ISSUER", requires = "jwks")]
    jwt_issuer: Option<String>,
    /// The issuer's keys for --jwt-issuer: a local JWKS file, as Envoy opens it.
    #[arg(long = "jwks", value_name = "FILE", requires = "jwt_issuer")]
    jwks: Option<String>,
    /// Print JSON instead of YAML (implied by an --out file ending in `.json`).
    #[arg(long)]
    json: bool,
    /// Write the bootstrap to FILE instead of standard output.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

fn port_parser() -> clap::builder::RangedI64ValueParser<u16> {
    clap::value_parser!(u16).range(1..)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let _ = writeln!(io::stderr().lock(), "{}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

/// Why a command failed: what to print on stderr and the exit code.
struct Failure {
    message: String,
    code: u8,
}

impl Failure {
    fn io(message: String) -> Failure {
        Failure {
            message,
            code: EXIT_IO,
        }
    }

    /// One of the commands' own errors: a usage or I/O error, printed after `diana: `.
    fn tool(error: &dyn std::error::Error) -> Failure {
        Failure::io(format!("diana: {error}"))
    }
}

impl From<envoy::OptionError> for Failure {
    fn from(error: envoy::OptionError) -> Failure {
        Failure::tool(&error)
    }
}

impl From<envoy::RenderError> for Failure {
    fn from(error: envoy::RenderError) -> Failure {
        Failure::tool(&error)
    }
}

impl From<plan::PlanError> for Failure {
    fn from(error: plan::PlanError) -> Failure {
        Failure::tool(&error)
    }
}

impl From<simulate::EnvoyFieldError> for Failure {
    fn from(error: simulate::EnvoyFieldError) -> Failure {
        Failure::tool(&error)
    }
}

fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Check { file, json } => {
            let text = read_input(&file)?;
            let policy = validate(&text)?;
            let out = if json {
                plan::render_json(&policy)?
            } else {
                plan::render_text(&policy)?
            };
            write_stdout(&out)
        }
        Command::CheckNginx {
            nginx_conf,
            document,
        } => run_check_nginx(&nginx_conf, document.as_ref()),
        Command::RenderEnvoy(args) => run_render_envoy(*args),
        Command::Schema { kong } => {
            let value = if kong {
                schema::kong_meta()
            } else {
                schema::schema()
            };
            let mut text = serde_json::to_string_pretty(&value)
                .map_err(|err| Failure::io(format!("diana: cannot print the schema: {err}")))?;
            text.push('\n');
            write_stdout(&text)
        }
        Command::Simulate(args) => run_simulate(args),
    }
}

fn run_check_nginx(conf: &Path, document: Option<&PathBuf>) -> Result<(), Failure> {
    let config = nginx_conf::load(conf).map_err(|err| Failure::io(err.message))?;
    let text = document.map(read_input).transpose()?;
    let name = document.map(|path| path.display().to_string());
    let document = match (&text, &name) {
        (Some(text), Some(name)) => Some(nginx_check::Document { name, text }),
        _ => None,
    };
    let outcome = nginx_check::check(&config, document.as_ref());
    if outcome.problems.is_empty() {
        return write_stdout(&format!("{}\n", outcome.summary));
    }
    let mut out = outcome.problems.join("\n");
    out.push('\n');
    write_stdout(&out)?;
    let count = outcome.problems.len();
    Err(Failure {
        message: format!(
            "diana: {count} problem{} in {}",
            if count == 1 { "" } else { "s" },
            conf.display()
        ),
        code: EXIT_INVALID,
    })
}

fn run_render_envoy(args: RenderArgs) -> Result<(), Failure> {
    // `--x-port PORT` is `--x 127.0.0.1:PORT`.
    let endpoint = |flag: &str,
                    text: &Option<String>,
                    port: Option<u16>,
                    default_host: Option<&str>|
     -> Result<Option<envoy::Endpoint>, Failure> {
        match (text, port) {
            (_, Some(port)) => Ok(Some(envoy::Endpoint::new("127.0.0.1", port))),
            (Some(text), None) => Ok(Some(envoy::parse_endpoint(flag, text, default_host)?)),
            (None, None) => Ok(None),
        }
    };
    let listen = endpoint("--listen", &args.listen, args.listen_port, Some("0.0.0.0"))?
        .unwrap_or_else(|| envoy::Endpoint::new("0.0.0.0", 10000));
    let admin = endpoint("--admin", &args.admin, args.admin_port, Some("127.0.0.1"))?
        .unwrap_or_else(|| envoy::Endpoint::new("127.0.0.1", 9901));
    let mut access_logs: Vec<envoy::AccessLog> = (args.access_log.iter())
        .map(|path| envoy::AccessLog {
            path: path.clone(),
            format: None,
        })
        .collect();
    // clap gives the FILE FORMAT pairs one after the other.
    access_logs.extend(
        args.formatted_access_log
            .chunks_exact(2)
            .filter_map(|pair| match pair {
                [path, format] => Some(envoy::AccessLog {
                    path: path.clone(),
                    format: Some(format.clone()),
                }),
                _ => None,
            }),
    );
    let options = envoy::Options {
        wasm: args.wasm,
        listen,
        admin,
        upstream: endpoint("--upstream", &args.upstream, args.upstream_port, None)?,
        quota: endpoint("--quota", &args.quota, args.quota_port, None)?,
        config_center: endpoint(
            "--config-center",
            &args.config_center,
            args.config_port,
            None,
        )?,
        concurrency: args.concurrency,
        normalize_path: !args.no_normalize_path,
        xff_trusted_hops: args.xff_trusted_hops,
        route_timeout: args.route_timeout,
        direct_response: (args.direct_response.as_deref())
            .map(envoy::parse_direct_response)
            .transpose()?,
        access_logs,
        jwt: match (args.jwt_issuer, args.jwks) {
            (Some(issuer), Some(jwks)) => Some(envoy::JwtProvider { issuer, jwks }),
            _ => None,
        },
    };

    let text = match args.file.as_ref().or(args.diana_config.as_ref()) {
        Some(file) if !args.no_filter => Some(read_input(file)?),
        _ => None,
    };
    let policy = match &text {
        Some(text) if !args.no_validate => Some(validate(text)?),
        _ => None,
    };
    let filter = match (&text, &policy) {
        (Some(document), Some(policy)) => envoy::Filter::Validated { policy, document },
        (Some(document), None) => envoy::Filter::Unvalidated { document },
        (None, _) => envoy::Filter::Absent,
    };
    let rendered = envoy::render(filter, &options)?;
    for warning in &rendered.warnings {
        let _ = writeln!(io::stderr().lock(), "diana: warning: {warning}");
    }
    let json = args.json
        || (args.out.as_ref()).is_some_and(|out| out.extension().is_some_and(|ext| ext == "json"));
    let out = if json {
        rendered.json()?
    } else {
        rendered.yaml()?
    };
    match &args.out {
        Some(path) => std::fs::write(path, out)
            .map_err(|err| Failure::io(format!("diana: cannot write {}: {err}", path.display()))),
        None => write_stdout(&out),
    }
}

fn run_simulate(args: SimulateArgs) -> Result<(), Failure> {
    if args.policy.as_os_str() == "-" && args.log.as_os_str() == "-" {
        return Err(Failure::io(
            "diana: the policy and the log cannot both come from standard input".into(),
        ));
    }
    let document = read_input(&args.policy)?;
    let policy = validate(&document)?;
    let envoy_fields = args
        .envoy_fields
        .iter()
        .map(|field| simulate::EnvoyField::parse(field))
        .collect::<Result<Vec<_>, _>>()?;
    if !(0.0..=3_600.0).contains(&args.reorder_seconds) {
        return Err(Failure::io(
            "diana: --reorder-seconds must be between 0 and 3600".into(),
        ));
    }
    let options = simulate::Options {
        format: args.format,
        envoy_fields,
        gateways: args.gateways as usize,
        reorder: Nanos::new((args.reorder_seconds * 1e9) as u64),
    };
    let source = args.log.display().to_string();
    let input: Box<dyn BufRead> = if args.log.as_os_str() == "-" {
        Box::new(BufReader::new(io::stdin().lock()))
    } else {
        let file = std::fs::File::open(&args.log)
            .map_err(|err| Failure::io(format!("diana: cannot read {source}: {err}")))?;
        Box::new(BufReader::with_capacity(1 << 16, file))
    };
    let simulation = simulate::simulate(&policy, &document, input, &options)
        .map_err(|err| Failure::io(format!("diana: cannot read {source}: {err}")))?;
    if let Some(path) = &args.svg {
        let chart = simulate::render_svg(&policy, &simulation, &source, args.interval);
        std::fs::write(path, chart)
            .map_err(|err| Failure::io(format!("diana: cannot write {}: {err}", path.display())))?;
    }
    let out = if args.json {
        let value = simulate::render_json(&policy, &simulation, &source, args.interval);
        let mut text = serde_json::to_string_pretty(&value)
            .map_err(|err| Failure::io(format!("diana: cannot print the result: {err}")))?;
        text.push('\n');
        text
    } else {
        simulate::render_text(&policy, &simulation, &source, args.interval, !args.totals)
    };
    write_stdout(&out)
}

/// The filter's verdict on the document; its message, unchanged, on error.
fn validate(text: &str) -> Result<Policy, Failure> {
    parse_policy(text).map_err(|err| Failure {
        message: err.to_string(),
        code: EXIT_INVALID,
    })
}

/// The document from a file or, for `-`, standard input. It must be UTF-8 (the filter
/// receives its configuration as text too).
fn read_input(file: &PathBuf) -> Result<String, Failure> {
    let bytes = if file.as_os_str() == "-" {
        let mut buffer = Vec::new();
        io::stdin()
            .lock()
            .read_to_end(&mut buffer)
            .map_err(|err| Failure::io(format!("diana: cannot read standard input: {err}")))?;
        buffer
    } else {
        std::fs::read(file)
            .map_err(|err| Failure::io(format!("diana: cannot read {}: {err}", file.display())))?
    };
    String::from_utf8(bytes).map_err(|err| Failure {
        message: format!(
            "the configuration is not UTF-8 text (invalid byte at offset {})",
            err.utf8_error().valid_up_to()
        ),
        code: EXIT_INVALID,
    })
}

fn write_stdout(text: &str) -> Result<(), Failure> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .or_else(|err| {
            // `diana check x | head` closes the pipe early: not an error worth reporting.
            if err.kind() == io::ErrorKind::BrokenPipe {
                Ok(())
            } else {
                Err(Failure::io(format!("diana: cannot write output: {err}")))
            }
        })
}
