//! Fuzzing of Diana's input handling on stable Rust (`scripts/fuzz`).
//!
//! cargo-fuzz and `libfuzzer-sys` need a nightly compiler (`-Z sanitizer`, coverage
//! instrumentation), which this project does not have; so this is a deterministic
//! generator-and-mutator without coverage feedback. Each target turns a case number into
//! an input — a document of the repository's corpus or a structured input, mutated — and
//! runs it through the core with properties checked. Every case is a function of
//! `(seed, target, case)`: a failure is replayed with `--replay`, and its input saved.
//!
//! Targets: the config parser (YAML and the JSON forms), the path normaliser, identities
//! from header bytes and client addresses, the quota service's answers (decoded, validated
//! and handed to the engine). Failures: a panic (caught with `catch_unwind`: the fuzz
//! binary builds with `panic = "unwind"`), a broken property, or an input that makes the
//! code allocate more than [`SOFT_LIMIT`] at once (see [`alloc`]).

pub mod alloc;
pub mod mutate;
pub mod rng;
pub mod targets;

use rng::Rng;
use std::cell::RefCell;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The most one input may make the code allocate at once (64 MiB).
pub const SOFT_LIMIT: u64 = 64 << 20;

/// A fuzz target.
pub trait Target: Sync {
    fn name(&self) -> &'static str;
    /// Share of the run's inputs (relative weight).
    fn weight(&self) -> u64;
    /// The input of one case.
    fn generate(&self, rng: &mut Rng) -> Vec<u8>;
    /// Runs one input through the code under test; `Err` names a broken property.
    fn run(&self, input: &[u8]) -> Result<(), String>;
}

/// How a run is bounded and where failures go.
#[derive(Debug, Clone)]
pub struct Options {
    pub seed: u64,
    /// Inputs over all targets, shared out by weight.
    pub inputs: u64,
    /// Wall-clock bound of the whole run, shared out by weight.
    pub seconds: f64,
    pub threads: usize,
    /// Where failing inputs are saved (`None`: not saved).
    pub failures_dir: Option<PathBuf>,
}

/// One failing case.
#[derive(Debug, Clone)]
pub struct Failure {
    pub target: &'static str,
    pub case: u64,
    pub message: String,
    pub input: Vec<u8>,
}

/// What one target's run did.
#[derive(Debug, Clone)]
pub struct Report {
    pub target: &'static str,
    pub inputs: u64,
    pub elapsed: Duration,
    /// Most bytes one input made the code allocate (0 without the counting allocator).
    pub peak_bytes: u64,
    pub failures: Vec<Failure>,
}

thread_local! {
    static PANIC_AT: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Silences the default panic output while fuzzing (each panic is reported once, with its
/// input) and keeps where it happened.
pub fn quiet_panics() {
    panic::set_hook(Box::new(|info| {
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let _ = PANIC_AT.try_with(|cell| *cell.borrow_mut() = at);
    }));
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-text panic)".to_string());
    let at = PANIC_AT.try_with(|cell| cell.take()).unwrap_or_default();
    format!("panic at {at}: {text}")
}

/// Runs case `case` of `target` (index `index` in the target list): `Err` on failure,
/// else the bytes it allocated at most.
pub fn run_case(
    target: &dyn Target,
    index: u64,
    seed: u64,
    case: u64,
) -> Result<u64, (String, Vec<u8>)> {
    let mut rng = Rng::for_case(seed, index, case);
    let input = target.generate(&mut rng);
    let base = alloc::start_case(target.name(), seed, case);
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| target.run(&input)));
    let used = alloc::used_since(base);
    match outcome {
        Ok(Ok(())) if used <= SOFT_LIMIT => Ok(used),
        Ok(Ok(())) => Err((
            format!("allocated {used} bytes for one input (limit {SOFT_LIMIT})"),
            input,
        )),
        Ok(Err(message)) => Err((message, input)),
        Err(payload) => Err((panic_message(payload.as_ref()), input)),
    }
}

/// Cases are handed out in chunks of this many.
const CHUNK: u64 = 64;
/// More failures than this of one target stop it (they are usually the same bug).
const MAX_FAILURES: usize = 20;

/// Runs every target in turn, each on all threads, within its share (by weight) of the
/// inputs and of the time. Each target comes with its index in [`targets::all`], which
/// with the seed and the case number makes its inputs.
pub fn run(targets: &[(u64, &dyn Target)], options: &Options) -> Vec<Report> {
    let total_weight: u64 = targets.iter().map(|(_, t)| t.weight()).sum::<u64>().max(1);
    targets
        .iter()
        .map(|&(index, target)| {
            let inputs = options.inputs.saturating_mul(target.weight()) / total_weight;
            let seconds = options.seconds * target.weight() as f64 / total_weight as f64;
            run_target(target, index, options, inputs.max(1), seconds)
        })
        .collect()
}

fn run_target(
    target: &dyn Target,
    index: u64,
    options: &Options,
    inputs: u64,
    seconds: f64,
) -> Report {
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds.max(0.01));
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let peak = AtomicU64::new(0);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..options.threads.max(1) {
            scope.spawn(|| loop {
                let first = next.fetch_add(CHUNK, Ordering::Relaxed);
                if first >= inputs || Instant::now() >= deadline {
                    break;
                }
                if failures.lock().map_or(true, |f| f.len() >= MAX_FAILURES) {
                    break;
                }
                let last = (first + CHUNK).min(inputs);
                for case in first..last {
                    match run_case(target, index, options.seed, case) {
                        Ok(used) => {
                            peak.fetch_max(used, Ordering::Relaxed);
                        }
                        Err((message, input)) => {
                            let failure = Failure {
                                target: target.name(),
                                case,
                                message,
                                input,
                            };
                            report_failure(&failure, options);
                            if let Ok(mut list) = failures.lock() {
                                list.push(failure);
                            }
                        }
                    }
                }
                done.fetch_add(last - first, Ordering::Relaxed);
            });
        }
    });
    Report {
        target: target.name(),
        inputs: done.into_inner(),
        elapsed: started.elapsed(),
        peak_bytes: peak.into_inner(),
        failures: failures.into_inner().unwrap_or_default(),
    }
}

/// Prints a failure with the command that replays it, and saves its input.
pub fn report_failure(failure: &Failure, options: &Options) {
    let shown = String::from_utf8_lossy(&failure.input);
    let shown: String = shown.chars().take(2_000).collect();
    eprintln!(
        "\nFAIL {} case {}: {}\n  replay: scripts/fuzz --target {} --seed {} --replay {}\n  input ({} bytes): {:?}",
        failure.target,
        failure.case,
        failure.message,
        failure.target,
        options.seed,
        failure.case,
        failure.input.len(),
        shown
    );
    if let Some(dir) = &options.failures_dir {
        let path = dir.join(format!(
            "{}-{}-{}.bin",
            failure.target, options.seed, failure.case
        ));
        if std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&path, &failure.input))
            .is_ok()
        {
            eprintln!("  saved: {}", path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target whose inputs fail in each way the driver must catch.
    struct Faulty;

    impl Target for Faulty {
        fn name(&self) -> &'static str {
            "faulty"
        }
        fn weight(&self) -> u64 {
            1
        }
        fn generate(&self, rng: &mut Rng) -> Vec<u8> {
            vec![rng.byte() % 4]
        }
        fn run(&self, input: &[u8]) -> Result<(), String> {
            match input.first() {
                Some(0) => panic!("boom"),
                Some(1) => Err("broken".to_string()),
                _ => Ok(()),
            }
        }
    }

    fn options(inputs: u64) -> Options {
        Options {
            seed: 7,
            inputs,
            seconds: 60.0,
            threads: 2,
            failures_dir: None,
        }
    }

    #[test]
    fn panics_and_broken_properties_are_caught_with_their_case() {
        quiet_panics();
        let reports = run(&[(0, &Faulty)], &options(200));
        let _ = std::panic::take_hook();
        let failures = &reports[0].failures;
        assert!(failures.iter().any(|f| f.message.contains("boom")));
        assert!(failures.iter().any(|f| f.message == "broken"));
        // The case number regenerates the failing input.
        for failure in failures {
            let mut rng = Rng::for_case(7, 0, failure.case);
            assert_eq!(Faulty.generate(&mut rng), failure.input);
        }
    }

    #[test]
    fn every_target_passes_a_short_run() {
        let all = targets::all();
        let chosen: Vec<(u64, &dyn Target)> = all
            .iter()
            .enumerate()
            .map(|(i, t)| (i as u64, t.as_ref()))
            .collect();
        for report in run(&chosen, &options(4_000)) {
            assert!(report.inputs > 0, "{}", report.target);
            assert!(
                report.failures.is_empty(),
                "{}: {:?}",
                report.target,
                report.failures
            );
        }
    }
}
