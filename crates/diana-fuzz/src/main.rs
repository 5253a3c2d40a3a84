//! `diana-fuzz`: runs every fuzz target for a bounded number of inputs and time (see the
//! crate docs and `scripts/fuzz`). Exit status 1 when any input failed.
//!
//! ```text
//! diana-fuzz [--inputs N] [--seconds S] [--seed N] [--threads N] [--target NAME]
//!            [--replay CASE] [--short] [--list]
//! ```

use diana_fuzz::{alloc::Counting, quiet_panics, run, run_case, targets, Options, Target};
use std::path::PathBuf;
use std::process::ExitCode;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The default run: ten million inputs, at most twenty minutes.
const DEFAULT_INPUTS: u64 = 10_000_000;
const DEFAULT_SECONDS: f64 = 1_200.0;
/// `--short` (CI): two hundred thousand inputs, at most 45 seconds.
const SHORT_INPUTS: u64 = 200_000;
const SHORT_SECONDS: f64 = 45.0;

struct Args {
    options: Options,
    target: Option<String>,
    replay: Option<u64>,
    list: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        options: Options {
            seed: 1,
            inputs: DEFAULT_INPUTS,
            seconds: DEFAULT_SECONDS,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            failures_dir: Some(PathBuf::from("target/fuzz-failures")),
        },
        target: None,
        replay: None,
        list: false,
    };
    let mut iter = std::env::args().skip(1);
    while let Some(flag) = iter.next() {
        let mut value = |name: &str| iter.next().ok_or(format!("{name} needs a value"));
        let number = |text: String| text.parse::<u64>().map_err(|e| format!("{text}: {e}"));
        match flag.as_str() {
            "--inputs" => args.options.inputs = number(value("--inputs")?)?,
            "--seconds" => {
                let text = value("--seconds")?;
                args.options.seconds = text.parse().map_err(|e| format!("{text}: {e}"))?;
            }
            "--seed" => args.options.seed = number(value("--seed")?)?,
            "--threads" => {
                args.options.threads = usize::try_from(number(value("--threads")?)?).unwrap_or(1)
            }
            "--target" => args.target = Some(value("--target")?),
            "--replay" => args.replay = Some(number(value("--replay")?)?),
            "--short" => {
                args.options.inputs = SHORT_INPUTS;
                args.options.seconds = SHORT_SECONDS;
            }
            "--list" => args.list = true,
            other => {
                return Err(format!(
                    "unknown argument {other} (see the top of src/main.rs)"
                ))
            }
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(error) => {
            eprintln!("diana-fuzz: {error}");
            return ExitCode::from(2);
        }
    };
    let all = targets::all();
    if args.list {
        for target in &all {
            println!("{}", target.name());
        }
        return ExitCode::SUCCESS;
    }
    let chosen: Vec<(u64, &dyn Target)> = all
        .iter()
        .enumerate()
        .map(|(index, target)| (index as u64, target.as_ref()))
        .filter(|(_, target)| {
            args.target
                .as_deref()
                .is_none_or(|name| name == target.name())
        })
        .collect();
    if chosen.is_empty() {
        eprintln!("diana-fuzz: no target named {:?} (--list)", args.target);
        return ExitCode::from(2);
    }
    if let Some(case) = args.replay {
        return replay(&chosen, &args.options, case);
    }
    quiet_panics();
    let options = &args.options;
    println!(
        "diana-fuzz: seed {}, {} inputs, at most {} s, {} threads",
        options.seed, options.inputs, options.seconds, options.threads
    );
    let started = std::time::Instant::now();
    let reports = run(&chosen, options);
    let mut total = 0;
    let mut failed = 0;
    println!(
        "\n{:<16} {:>12} {:>9} {:>12} {:>9} {:>14}",
        "target", "inputs", "seconds", "inputs/s", "failures", "max bytes/input"
    );
    for report in &reports {
        let seconds = report.elapsed.as_secs_f64();
        println!(
            "{:<16} {:>12} {:>9.1} {:>12.0} {:>9} {:>14}",
            report.target,
            report.inputs,
            seconds,
            report.inputs as f64 / seconds.max(1e-9),
            report.failures.len(),
            report.peak_bytes
        );
        total += report.inputs;
        failed += report.failures.len();
    }
    println!(
        "{:<16} {:>12} {:>9.1}\n{} passed, {} failed",
        "total",
        total,
        started.elapsed().as_secs_f64(),
        total - failed as u64,
        failed
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Prints the input of one case and runs it with the default panic output.
fn replay(chosen: &[(u64, &dyn Target)], options: &Options, case: u64) -> ExitCode {
    let mut failed = false;
    for &(index, target) in chosen {
        let mut rng = diana_fuzz::rng::Rng::for_case(options.seed, index, case);
        let input = target.generate(&mut rng);
        println!(
            "{} case {case} (seed {}), {} bytes:\n{:?}",
            target.name(),
            options.seed,
            input.len(),
            String::from_utf8_lossy(&input)
        );
        match run_case(target, index, options.seed, case) {
            Ok(used) => println!("ok ({used} bytes allocated at most)"),
            Err((message, _)) => {
                println!("FAILED: {message}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
