//! `diana`: the command-line companion of the Diana filter.
//!
//! - `diana check FILE` validates a Diana document with the filter's own parser
//!   (`diana_core::config::parse_policy`) and prints the effective plan, every default
//!   filled in; on error it prints the filter's message and exits 1.
//! - `diana render-envoy FILE` validates the document and prints an Envoy v3 bootstrap
//!   that loads `diana.wasm` with it.
//! - `diana schema [--kong]` prints a JSON Schema (draft 4) of the document's JSON forms;
//!   with `--kong`, wrapped as Kong filter metadata (`kong/diana.meta.json`).
//! - `diana simulate POLICY LOG` replays a request log (JSON lines or Envoy's access log)
//!   through the policy with the log's own clock and prints per second and per rule what
//!   would have been admitted, delayed and rejected (`--json`, `--svg FILE`).
//!
//! Exit codes: 0 success, 1 invalid document, 2 usage or I/O error.

mod envoy;
mod nginx;
mod plan;
mod schema;
mod simulate;
mod yaml;

use clap::{Args, Parser, Subcommand};
use diana_core::config::{parse_policy, Policy};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::PathBuf;
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
    /// Validate a document and print an Envoy v3 bootstrap (YAML) that loads diana.wasm with it.
    RenderEnvoy(RenderArgs),
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
    file: PathBuf,
    /// diana.wasm as Envoy will open it (a relative path is relative to Envoy's working directory).
    #[arg(long, default_value = envoy::DEFAULT_WASM)]
    wasm: String,
    /// Listener: PORT (on 0.0.0.0) or HOST:PORT.
    #[arg(long, default_value = "10000")]
    listen: String,
    /// Admin interface: PORT (on 127.0.0.1) or HOST:PORT.
    #[arg(long, default_value = "9901")]
    admin: String,
    /// The protected service, HOST:PORT (an IP makes a STATIC cluster, a name a STRICT_DNS one).
    #[arg(long, default_value = "127.0.0.1:8080")]
    upstream: String,
    /// diana-quota, HOST:PORT: the `global.cluster` cluster (only when the document has global rules).
    #[arg(long, default_value = "127.0.0.1:8081")]
    quota: String,
    /// Config center, HOST:PORT: the `remote.cluster` cluster (only when the document has `remote`).
    #[arg(long = "config-center", default_value = "127.0.0.1:8082")]
    config_center: String,
    /// Worker threads: Envoy takes this on its command line (`--concurrency`), not in the
    /// bootstrap; it goes in the run command printed in the header comment.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    concurrency: u32,
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
}

fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Check { file, json } => {
            let text = read_input(&file)?;
            let policy = validate(&text)?;
            let out = if json {
                plan::render_json(&policy).map_err(Failure::io)?
            } else {
                plan::render_text(&policy).map_err(Failure::io)?
            };
            write_stdout(&out)
        }
        Command::RenderEnvoy(args) => {
            let text = read_input(&args.file)?;
            let policy = validate(&text)?;
            let options = envoy::Options {
                wasm: args.wasm,
                listen: envoy::parse_endpoint("--listen", &args.listen, Some("0.0.0.0"))
                    .map_err(Failure::io)?,
                admin: envoy::parse_endpoint("--admin", &args.admin, Some("127.0.0.1"))
                    .map_err(Failure::io)?,
                upstream: envoy::parse_endpoint("--upstream", &args.upstream, None)
                    .map_err(Failure::io)?,
                quota: envoy::parse_endpoint("--quota", &args.quota, None).map_err(Failure::io)?,
                config_center: envoy::parse_endpoint("--config-center", &args.config_center, None)
                    .map_err(Failure::io)?,
                concurrency: args.concurrency,
            };
            let rendered = envoy::render(&policy, &text, &options).map_err(Failure::io)?;
            for warning in &rendered.warnings {
                let _ = writeln!(io::stderr().lock(), "diana: warning: {warning}");
            }
            write_stdout(&rendered.yaml)
        }
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

fn run_simulate(args: SimulateArgs) -> Result<(), Failure> {
    if args.policy.as_os_str() == "-" && args.log.as_os_str() == "-" {
        return Err(Failure::io(
            "diana: the policy and the log cannot both come from standard input".into(),
        ));
    }
    let policy = validate(&read_input(&args.policy)?)?;
    let envoy_fields = args
        .envoy_fields
        .iter()
        .map(|field| simulate::EnvoyField::parse(field))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| Failure::io(format!("diana: {err}")))?;
    if !(0.0..=3_600.0).contains(&args.reorder_seconds) {
        return Err(Failure::io(
            "diana: --reorder-seconds must be between 0 and 3600".into(),
        ));
    }
    let options = simulate::Options {
        format: args.format,
        envoy_fields,
        gateways: args.gateways as usize,
        reorder: (args.reorder_seconds * 1e9) as u64,
    };
    let source = args.log.display().to_string();
    let input: Box<dyn BufRead> = if args.log.as_os_str() == "-" {
        Box::new(BufReader::new(io::stdin().lock()))
    } else {
        let file = std::fs::File::open(&args.log)
            .map_err(|err| Failure::io(format!("diana: cannot read {source}: {err}")))?;
        Box::new(BufReader::with_capacity(1 << 16, file))
    };
    let simulation = simulate::simulate(&policy, input, &options)
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
        message: err.message,
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
