//! Load test to saturation: `diana-quota` (memory store, then Redis) at rising
//! concurrency, closed loop over keep-alive HTTP/1.1 connections on 127.0.0.1.
//!
//! ```text
//! cargo build --release -p diana-quota --example load
//! target/release/examples/load [--seconds 3] [--concurrency 8,32,128,512]
//!     [--max-in-flight 64] [--stores memory,redis] [--quota-bin target/release/diana-quota]
//! ```
//!
//! Starts its own `redis-server` and `diana-quota` on free loopback ports (stopped by PID
//! at the end; the service gets a fresh secret in `DIANA_QUOTA_TOKEN`, which every request
//! presents as `authorization: Bearer …`), sends `POST /v1/acquire` with two rules (a token bucket and a sliding
//! window that never run out, one pair of keys per connection), and prints, per store and
//! concurrency: answers per second, the share of 200s and of 503s (shed as overloaded,
//! or at the deadline), and p50/p99 latency of the 200s and of the shed answers.
//! Everything runs on this machine: the figures include the load generator's own CPU.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

struct Options {
    seconds: u64,
    concurrency: Vec<usize>,
    max_in_flight: usize,
    stores: Vec<String>,
    quota_bin: String,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        seconds: 3,
        concurrency: vec![8, 32, 128, 512],
        max_in_flight: 64,
        stores: vec!["memory".into(), "redis".into()],
        quota_bin: "target/release/diana-quota".into(),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let [flag, value] = pair else {
            return Err(format!("{pair:?}: a flag without a value"));
        };
        let number = |value: &str| value.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--seconds" => options.seconds = number(value)?,
            "--max-in-flight" => options.max_in_flight = number(value)? as usize,
            "--quota-bin" => options.quota_bin = value.clone(),
            "--stores" => options.stores = value.split(',').map(str::to_string).collect(),
            "--concurrency" => {
                options.concurrency = value
                    .split(',')
                    .map(|c| number(c).map(|c| c as usize))
                    .collect::<Result<_, _>>()?
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(options)
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    listener
        .local_addr()
        .map(|address| address.port())
        .map_err(|e| e.to_string())
}

/// A child process, killed (by its PID) when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(program: &str, args: &[String], env: &[(&str, &str)]) -> Result<Process, String> {
    Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map(Process)
        .map_err(|e| format!("{program}: {e}"))
}

async fn wait_listening(port: u16) -> Result<(), String> {
    let started = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        if started.elapsed() > Duration::from_secs(10) {
            return Err(format!("nothing listens on {port}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// One answer: its status, whether it was shed, and how long it took.
struct Answer {
    status: u16,
    shed: bool,
    micros: u32,
}

/// Sends one request on the connection and reads the answer.
async fn exchange(
    stream: &mut BufReader<TcpStream>,
    request: &[u8],
) -> std::io::Result<(u16, Vec<u8>)> {
    stream.get_mut().write_all(request).await?;
    let mut line = String::new();
    stream.read_line(&mut line).await?;
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
    let mut length = 0;
    loop {
        line.clear();
        stream.read_line(&mut line).await?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0; length];
    stream.read_exact(&mut body).await?;
    Ok((status, body))
}

/// A secret for this run (at least 32 bytes; the service refuses a shorter one).
fn secret() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos())
        .unwrap_or(0);
    format!("load-{}-{nanos:032x}", std::process::id())
}

/// One closed-loop client until `end`.
async fn client(port: u16, token: &str, id: usize, end: Instant) -> Vec<Answer> {
    let body = format!(
        r#"{{"rules":[{{"key":"load:{id}","algo":"TB","rpu":4000000000,"unit":"second","burst":4000000000,"slices":1,"want":1}},{{"key":"load:{id}","algo":"SW","rpu":4000000000,"unit":"second","burst":1,"slices":10,"want":1}}]}}"#
    );
    let request = format!(
        "POST /v1/acquire HTTP/1.1\r\nhost: quota\r\ncontent-type: application/json\r\nauthorization: Bearer {token}\r\ncontent-length: {}\r\nx-diana-timeout-ms: 50\r\n\r\n{body}",
        body.len()
    );
    let mut answers = Vec::new();
    let mut connection: Option<BufReader<TcpStream>> = None;
    while Instant::now() < end {
        let stream = match connection.as_mut() {
            Some(stream) => stream,
            None => match TcpStream::connect(("127.0.0.1", port)).await {
                Ok(stream) => connection.insert(BufReader::new(stream)),
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
            },
        };
        let sent = Instant::now();
        match exchange(stream, request.as_bytes()).await {
            Ok((status, body)) => answers.push(Answer {
                status,
                shed: status == 503 && body.windows(10).any(|w| w == b"overloaded"),
                micros: u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX),
            }),
            Err(_) => connection = None,
        }
    }
    answers
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted
        .get(rank)
        .map_or(f64::NAN, |&micros| f64::from(micros) / 1_000.0)
}

async fn run_level(port: u16, token: &str, concurrency: usize, seconds: u64) -> String {
    let end = Instant::now() + Duration::from_secs(seconds);
    let tasks: Vec<_> = (0..concurrency)
        .map(|id| {
            let token = token.to_string();
            tokio::spawn(async move { client(port, &token, id, end).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        if let Ok(mut part) = task.await {
            answers.append(&mut part);
        }
    }
    let total = answers.len().max(1) as f64;
    let mut ok: Vec<u32> = answers
        .iter()
        .filter(|a| a.status == 200)
        .map(|a| a.micros)
        .collect();
    let mut shed: Vec<u32> = answers
        .iter()
        .filter(|a| a.shed)
        .map(|a| a.micros)
        .collect();
    let late = answers
        .iter()
        .filter(|a| a.status == 503 && !a.shed)
        .count();
    let other = answers
        .iter()
        .filter(|a| a.status != 200 && a.status != 503)
        .count();
    ok.sort_unstable();
    shed.sort_unstable();
    format!(
        "| {concurrency} | {:.0} | {:.0} | {:.1} % | {:.1} % | {:.2} | {:.2} | {:.2} | {:.2} | {other} |",
        answers.len() as f64 / seconds as f64,
        ok.len() as f64 / seconds as f64,
        shed.len() as f64 * 100.0 / total,
        late as f64 * 100.0 / total,
        percentile(&ok, 0.5),
        percentile(&ok, 0.99),
        percentile(&shed, 0.5),
        percentile(&shed, 0.99),
    )
}

async fn main_async(options: Options) -> Result<(), String> {
    println!(
        "diana-quota --max-in-flight {} (other flags default: --deadline-ms 40), {} s per level, requests of 2 rules (TB + SW) with x-diana-timeout-ms: 50\n",
        options.max_in_flight, options.seconds
    );
    for store in &options.stores {
        let mut redis = None;
        let quota_port = free_port()?;
        let mut args = vec![
            "--listen".to_string(),
            format!("127.0.0.1:{quota_port}"),
            "--log".to_string(),
            "warn".to_string(),
            "--max-in-flight".to_string(),
            options.max_in_flight.to_string(),
        ];
        if store == "redis" {
            let redis_port = free_port()?;
            redis = Some(spawn(
                "redis-server",
                &[
                    "--port".into(),
                    redis_port.to_string(),
                    "--bind".into(),
                    "127.0.0.1".into(),
                    "--save".into(),
                    String::new(),
                    "--appendonly".into(),
                    "no".into(),
                ],
                &[],
            )?);
            wait_listening(redis_port).await?;
            args.push("--redis".into());
            args.push(format!("redis://127.0.0.1:{redis_port}"));
        }
        let token = secret();
        let quota = spawn(&options.quota_bin, &args, &[("DIANA_QUOTA_TOKEN", &token)])?;
        wait_listening(quota_port).await?;
        println!("### {store}\n");
        println!("| connections | answers/s | 200/s | shed (overloaded) | 503 at the deadline | p50 200 (ms) | p99 200 (ms) | p50 shed (ms) | p99 shed (ms) | other |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        // Warm-up: connections, the script loaded.
        let _ = run_level(quota_port, &token, 4, 1).await;
        for &concurrency in &options.concurrency {
            println!(
                "{}",
                run_level(quota_port, &token, concurrency, options.seconds).await
            );
        }
        println!();
        drop(quota);
        drop(redis);
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let result = options().and_then(|options| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?
            .block_on(main_async(options))
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("load: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}
