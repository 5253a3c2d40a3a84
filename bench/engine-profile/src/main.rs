//! engine-profile POLICY_FILE ITERATIONS [PATH]
//! Parses the Diana document, then evaluates ITERATIONS requests for PATH (default `/`),
//! 1 µs apart, against diana-core's in-memory shared data (Envoy CAS rules). Prints the
//! decisions seen. Run under callgrind with ITERATIONS = 0 and = N: the difference ÷ N is
//! the instruction count of one evaluation.

use diana_core::facts::RequestFacts;
use diana_core::config::parse_policy;
use diana_core::cx::Cx;
use diana_core::decision::Decision;
use diana_core::engine::Engine;
use diana_core::metrics::MetricSink;
use diana_core::metrics::{Event, RuleEvent};
use diana_core::store::{CasSemantics, MemoryHost};
use diana_core::time::{Instant, Nanos};
use std::process::ExitCode;

struct Facts;

impl RequestFacts for Facts {
    fn header(&self, _name: &str) -> Option<Vec<u8>> {
        None
    }
    fn client_ip(&self) -> Option<Vec<u8>> {
        Some(b"127.0.0.1".to_vec())
    }
}

#[derive(Default)]
struct Count(u64);

impl MetricSink for Count {
    fn rule_event(&mut self, _rule: usize, _event: RuleEvent) {
        self.0 += 1;
    }
    fn event(&mut self, _event: Event) {
        self.0 += 1;
    }
    fn events(&mut self, _event: Event, count: u64) {
        self.0 += count;
    }
    fn degraded(&mut self, _on: bool) {}
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: engine-profile POLICY_FILE ITERATIONS [PATH]");
        return ExitCode::FAILURE;
    }
    let Ok(text) = std::fs::read_to_string(&args[1]) else {
        eprintln!("cannot read {}", args[1]);
        return ExitCode::FAILURE;
    };
    let policy = match parse_policy(&text) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("policy: {e}");
            return ExitCode::FAILURE;
        }
    };
    let n: u64 = args[2].parse().unwrap_or(0);
    let path = args.get(3).cloned().unwrap_or_else(|| "/".to_string());
    let engine = Engine::new(policy);
    let host = MemoryHost::new(CasSemantics::Envoy);
    let mut metrics = Count::default();
    let (mut allow, mut other) = (0u64, 0u64);
    let start = Instant::from_unix_nanos(1_700_000_000_000_000_000);
    for i in 0..n {
        let mut cx = Cx::new(&host, start + Nanos::new(i * 1000), &mut metrics);
        match engine.evaluate(&mut cx, path.as_bytes(), &Facts) {
            Decision::Allow { .. } => allow += 1,
            _ => other += 1,
        }
    }
    println!("allow {allow} other {other} metric events {}", metrics.0);
    ExitCode::SUCCESS
}
