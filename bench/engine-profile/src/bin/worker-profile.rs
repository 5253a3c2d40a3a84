//! worker-profile POLICY_FILE ITERATIONS [REQUESTS_PER_SECOND]
//! One worker (Envoy's profile) over diana-core's in-memory shared data: configures it with
//! the document, then runs ITERATIONS requests through every event a proxy-wasm host gives
//! the worker (request headers, response headers with `:status: 200`, the context's end),
//! the clock advancing so that REQUESTS_PER_SECOND (default 300: Envoy under valgrind)
//! arrive a second, and the tick every second. Prints the host calls made per request by
//! kind: in the wasm filter each is a crossing of the VM's boundary, which costs more than
//! the Rust around it. Run under callgrind with ITERATIONS = 0 and = N: the difference ÷ N
//! is the worker's own instructions per request, natively.

use diana_core::call::{Callout, DispatchError};
use diana_core::facts::RequestFacts;
use diana_core::store::{CasSemantics, HostError, MemoryHost, SetOutcome, SharedData};
use diana_core::time::{Clock, Instant, Nanos};
use diana_core::worker::{CallToken, Host, HostProfile, MetricId, MetricKind, Worker};
use std::cell::Cell;
use std::process::ExitCode;

#[derive(Default)]
struct Calls {
    get: Cell<u64>,
    set: Cell<u64>,
    header: Cell<u64>,
    response_header: Cell<u64>,
    now: Cell<u64>,
    metric: Cell<u64>,
}

struct Bench {
    shared: MemoryHost,
    clock: Cell<Instant>,
    calls: Calls,
}

fn bump(cell: &Cell<u64>) {
    cell.set(cell.get() + 1);
}

impl SharedData for Bench {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        bump(&self.calls.get);
        self.shared.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
        bump(&self.calls.set);
        self.shared.set(key, value, cas)
    }
}

impl RequestFacts for Bench {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        bump(&self.calls.header);
        (name == ":path").then(|| b"/".to_vec())
    }
    fn client_ip(&self) -> Option<Vec<u8>> {
        Some(b"127.0.0.1".to_vec())
    }
}

impl Clock for Bench {
    fn now(&self) -> Option<Instant> {
        bump(&self.calls.now);
        Some(self.clock.get())
    }
}

impl Host for Bench {
    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        bump(&self.calls.response_header);
        (name == ":status").then(|| b"200".to_vec())
    }
    fn dispatch(&self, _callout: &Callout) -> Result<CallToken, DispatchError> {
        Err(DispatchError::Refused {
            upstream: String::new(),
            status: "bench".to_string(),
        })
    }
    fn define_metric(&self, _kind: MetricKind, _name: &str) -> Option<MetricId> {
        Some(1)
    }
    fn add_to_metric(&self, _metric: MetricId, _count: u64) {
        bump(&self.calls.metric);
    }
    fn set_metric(&self, _metric: MetricId, _value: u64) {
        bump(&self.calls.metric);
    }
    fn metric_value(&self, _metric: MetricId) -> u64 {
        0
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: worker-profile POLICY_FILE ITERATIONS [REQUESTS_PER_SECOND]");
        return ExitCode::FAILURE;
    }
    let Ok(text) = std::fs::read(&args[1]) else {
        eprintln!("cannot read {}", args[1]);
        return ExitCode::FAILURE;
    };
    let n: u64 = args[2].parse().unwrap_or(0);
    let rate: u64 = args.get(3).and_then(|r| r.parse().ok()).unwrap_or(300).max(1);
    let gap = Nanos::new(1_000_000_000 / rate);
    let start = Instant::from_unix_nanos(1_700_000_000_000_000_000);
    let host = Bench {
        shared: MemoryHost::new(CasSemantics::Envoy),
        clock: Cell::new(start),
        calls: Calls::default(),
    };
    let mut worker = Worker::new(HostProfile::ENVOY);
    if let Err(refused) = worker.configure(&host, &text) {
        eprintln!("refused: {refused:?}");
        return ExitCode::FAILURE;
    }
    let _ = worker.on_tick(&host);
    let mut last_tick = start;
    let before = [
        host.calls.get.get(),
        host.calls.set.get(),
        host.calls.header.get(),
        host.calls.response_header.get(),
        host.calls.now.get(),
        host.calls.metric.get(),
    ];
    let mut paused = 0u64;
    for i in 0..n {
        let context = (i % 1_000_000) as u32 + 2;
        host.clock.set(host.clock.get() + gap);
        let step = worker.on_request_headers(&host, context);
        paused += u64::from(step.pause);
        host.clock.set(host.clock.get() + Nanos::new(200_000));
        let _ = worker.on_response_headers(&host, context);
        let _ = worker.on_context_gone(&host, context);
        if host.clock.get().saturating_since(last_tick) >= Nanos::from_secs(1) {
            last_tick = host.clock.get();
            let _ = worker.on_tick(&host);
        }
    }
    let after = [
        host.calls.get.get(),
        host.calls.set.get(),
        host.calls.header.get(),
        host.calls.response_header.get(),
        host.calls.now.get(),
        host.calls.metric.get(),
    ];
    let per = |k: usize| (after[k] - before[k]) as f64 / n.max(1) as f64;
    println!(
        "{n} requests ({paused} paused) at {rate}/s: host calls per request: \
         get_shared_data {:.4}, set_shared_data {:.4}, request header {:.4}, \
         response header {:.4}, clock {:.4}, metrics {:.4}; requests held at the end {}",
        per(0),
        per(1),
        per(2),
        per(3),
        per(4),
        per(5),
        worker.requests_held()
    );
    ExitCode::SUCCESS
}
