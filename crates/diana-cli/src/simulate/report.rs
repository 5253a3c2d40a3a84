//! The simulation as text (a table per second × rule, then totals, then the circuit
//! breakers) or JSON.

use super::breakers::{BreakerRun, GatewayCounts, TransitionAt};
use super::clock::{format_millis, format_seconds};
use super::tally::{Bin, Counts};
use super::Simulation;
use diana_core::breaker::Spec;
use diana_core::config::{Policy, Rule};
use diana_core::time::{Instant, Nanos, NANOS_PER_SECOND};
use serde_json::{json, Value};

/// The label of the all-requests rows.
const ALL: &str = "(all)";

fn milliseconds(nanos: Nanos) -> f64 {
    // Whole microseconds, so that the printed value does not depend on float noise.
    (nanos.get() / 1_000) as f64 / 1_000.0
}

fn delay_text(nanos: Nanos, delayed: u64) -> String {
    if delayed == 0 {
        "-".to_string()
    } else {
        format!("{:.1} ms", milliseconds(nanos))
    }
}

/// `10/second`, with the burst where the algorithm uses one.
pub fn limit_text(rule: &Rule) -> String {
    let limit = &rule.limit;
    if rule.algo.holds_until_done() {
        return format!("{} inside at once", limit.rpu);
    }
    let mut text = format!("{}/{}", limit.rpu, limit.unit_name());
    match rule.algo.code() {
        "TB" => text.push_str(&format!(", burst {}", limit.burst)),
        "LB" => text.push_str(&format!(", queue {}", limit.burst)),
        "SW" => text.push_str(&format!(", {} slices", limit.slices)),
        _ => {}
    }
    text
}

/// A rule counts in dry run (its own flag or the document's).
fn in_dry_run(policy: &Policy, rule: &Rule) -> bool {
    rule.dry_run || policy.dry_run
}

/// Lays out rows: the first `text_columns` left-aligned, the others right-aligned.
fn table(header: &[&str], rows: &[Vec<String>], text_columns: usize) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| (*h).to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (index, (cell, width)) in row.iter().zip(&widths).enumerate() {
            if index > 0 {
                line.push_str("  ");
            }
            if index < text_columns {
                line.push_str(&format!("{cell:<width$}"));
            } else {
                line.push_str(&format!("{cell:>width$}"));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `breakers`: the document has circuit breakers, and the all-requests rows show what
/// they failed fast (a document without them prints as it always did).
fn count_cells(counts: &Counts, breakers: bool) -> Vec<String> {
    let mut cells = vec![
        counts.admitted.to_string(),
        counts.delayed.to_string(),
        counts.rejected.to_string(),
        counts.dry_run.to_string(),
    ];
    if breakers {
        cells.push(counts.fast_failed.to_string());
    }
    cells
}

/// The text report. `per_second` false prints the totals only.
pub fn render_text(
    policy: &Policy,
    simulation: &Simulation,
    source: &str,
    interval: u64,
    per_second: bool,
) -> String {
    let input = &simulation.input;
    let rules: Vec<&Rule> = policy.rules().collect();
    let breakers = !simulation.breakers.is_empty();
    let mut out = format!(
        "diana simulate: {} {} from {source} through {} {}, {} {}\n",
        input.requests,
        plural(input.requests, "request", "requests"),
        rules.len(),
        plural(rules.len() as u64, "rule", "rules"),
        simulation.gateways,
        plural(simulation.gateways as u64, "gateway", "gateways"),
    );
    if let (Some(first), Some(last)) = (input.first, input.last) {
        let (first, last) = (
            first.periods(NANOS_PER_SECOND),
            last.periods(NANOS_PER_SECOND),
        );
        out.push_str(&format!(
            "time: {} to {} ({} s)\n",
            format_seconds(first),
            format_seconds(last),
            last - first + 1
        ));
    }
    let mut read = format!(
        "lines: {} read, {} requests ({} JSON, {} Envoy)",
        input.lines, input.requests, input.jsonl, input.envoy
    );
    for (count, what) in [
        (input.blank, "blank"),
        (input.no_request, "Envoy lines without a request"),
        (input.malformed, "malformed"),
        (input.late, "out of order beyond the reordering window"),
    ] {
        if count > 0 {
            read.push_str(&format!(", {count} {what}"));
        }
    }
    out.push_str(&read);
    out.push('\n');
    for (line, reason) in &input.malformed_examples {
        out.push_str(&format!("malformed: line {line}: {reason}\n"));
    }
    if input.malformed > input.malformed_examples.len() as u64 {
        out.push_str(&format!(
            "malformed: ... and {} more\n",
            input.malformed - input.malformed_examples.len() as u64
        ));
    }
    if simulation.unresolved > 0 {
        out.push_str(&format!(
            "warning: {} requests still wanted a callout after several answers (counted as rejected)\n",
            simulation.unresolved
        ));
    }

    out.push_str("\nrules, in evaluation order\n");
    let rule_rows: Vec<Vec<String>> = rules
        .iter()
        .map(|rule| {
            vec![
                rule.name.clone(),
                rule.scope.name().to_string(),
                rule.algo.code().to_string(),
                rule.actor_name.clone(),
                limit_text(rule),
                if in_dry_run(policy, rule) {
                    "dry run".to_string()
                } else {
                    String::new()
                },
            ]
        })
        .collect();
    out.push_str(&table(
        &["rule", "scope", "algo", "actor", "limit", ""],
        &rule_rows,
        6,
    ));

    if per_second {
        let title = if interval == 1 {
            "per second".to_string()
        } else {
            format!("per {interval} s")
        };
        out.push('\n');
        let mut rows = Vec::new();
        for (start, bin) in simulation.tally.bins(interval) {
            let mut row = vec![format_seconds(start), ALL.to_string()];
            row.extend(count_cells(&bin.all, breakers));
            rows.push(row);
            for (rule, counts) in rules.iter().zip(&bin.rules) {
                if counts.is_empty() {
                    continue;
                }
                let mut row = vec![String::new(), rule.name.clone()];
                // No rule saw a fast-failed request: the column is the all-requests row's.
                row.extend(count_cells(counts, false));
                if breakers {
                    row.push(String::new());
                }
                rows.push(row);
            }
        }
        let mut header = vec![
            title.as_str(),
            "rule",
            "admitted",
            "delayed",
            "rejected",
            "dry-run",
        ];
        if breakers {
            header.push("fast-failed");
        }
        out.push_str(&table(&header, &rows, 2));
    }

    out.push('\n');
    let total = &simulation.tally.total;
    let mut rows: Vec<Vec<String>> = rules
        .iter()
        .zip(&total.rules)
        .map(|(rule, counts)| total_row(&rule.name, counts, breakers, false))
        .collect();
    rows.push(total_row(ALL, &total.all, breakers, true));
    let mut header = vec![
        "totals",
        "admitted",
        "delayed",
        "rejected",
        "dry-run",
        "max delay",
        "mean delay",
    ];
    if breakers {
        header.insert(5, "fast-failed");
    }
    out.push_str(&table(&header, &rows, 1));
    let fast_failed = if breakers {
        format!(
            ", {} fast-failed by a breaker, {} sent to a breaker's fallback",
            total.all.fast_failed, total.all.fallback
        )
    } else {
        String::new()
    };
    out.push_str(&format!(
        "{} requests: {} admitted, {} delayed, {} rejected{fast_failed}; {} matched no rule; {} callouts to the simulated quota service\n",
        input.requests,
        total.all.admitted,
        total.all.delayed,
        total.all.rejected,
        simulation.tally.unmatched,
        simulation.callouts,
    ));
    if breakers {
        out.push_str(&breakers_text(policy, simulation));
    }
    out
}

/// `all`: the all-requests row, which has a fast-failed count (a rule's row leaves it
/// blank).
fn total_row(name: &str, counts: &Counts, breakers: bool, all: bool) -> Vec<String> {
    let mut row = vec![name.to_string()];
    row.extend(count_cells(counts, breakers && all));
    if breakers && !all {
        row.push(String::new());
    }
    row.push(delay_text(counts.delay_max, counts.delayed));
    row.push(delay_text(counts.delay_mean(), counts.delayed));
    row
}

/// What trips a breaker: `failed ≥ 0.5 ([5xx])`, `slow (> 1000 ms) ≥ 0.5`, or both.
pub fn trips_text(spec: &Spec) -> String {
    let settings = &spec.settings;
    let mut parts = Vec::new();
    if let Some(slow) = settings.slow() {
        parts.push(format!(
            "slow (> {} ms) ≥ {}",
            slow.threshold.whole_millis(),
            slow.ratio
        ));
    }
    if let Some(ratio) = settings.failure_ratio() {
        parts.push(format!("failed {} ≥ {ratio}", settings.failure_status));
    }
    parts.join(" or ")
}

fn seconds_text(nanos: Nanos) -> String {
    format!("{:.3} s", milliseconds(nanos) / 1_000.0)
}

/// `+12.345 s` after the log's first request.
fn relative_text(at: Instant, start: Instant) -> String {
    format!(
        "+{:.3} s",
        milliseconds(at.saturating_since(start)) / 1_000.0
    )
}

fn percent(count: u32, calls: u32) -> String {
    if calls == 0 {
        return "-".to_string();
    }
    format!("{:.1}%", f64::from(count) * 100.0 / f64::from(calls))
}

/// The breakers' settings, totals and transitions.
fn breakers_text(policy: &Policy, simulation: &Simulation) -> String {
    let specs: Vec<&Spec> = policy.breakers().collect();
    let spec_of = |run: &BreakerRun| specs.iter().find(|spec| spec.index == run.index).copied();
    let runs = &simulation.breakers.runs;
    let several = simulation.gateways > 1;
    let start = simulation.input.first.unwrap_or(Instant::EPOCH);
    let mut out = String::from("\nbreakers\n");
    let rows: Vec<Vec<String>> = runs
        .iter()
        .filter_map(|run| {
            let spec = spec_of(run)?;
            let settings = &spec.settings;
            Some(vec![
                run.name.clone(),
                settings.reach.name().to_string(),
                trips_text(spec),
                settings.min_calls.to_string(),
                format!("{} s", settings.window.seconds()),
                seconds_text(settings.open_for),
                settings.half_open_calls.to_string(),
                settings.force.name().to_string(),
                spec.fallback_header
                    .clone()
                    .unwrap_or_else(|| "-".to_string()),
            ])
        })
        .collect();
    out.push_str(&table(
        &[
            "breaker",
            "scope",
            "opens when",
            "min calls",
            "window",
            "open for",
            "probes",
            "force",
            "fallback",
        ],
        &rows,
        3,
    ));
    out.push('\n');
    let mut rows = Vec::new();
    for run in runs {
        for (gateway, counts) in run.gateways.iter().enumerate() {
            let mut row = vec![run.name.clone()];
            if several {
                row.push(gateway.to_string());
            }
            row.extend(gateway_cells(counts));
            row.push(counts.transitions.to_string());
            rows.push(row);
        }
    }
    let mut header = vec!["breaker totals"];
    if several {
        header.push("gateway");
    }
    header.extend([
        "calls",
        "slow",
        "failed",
        "no answer",
        "fast-failed",
        "time open",
        "state at end",
        "transitions",
    ]);
    out.push_str(&table(&header, &rows, 1));
    for run in runs {
        out.push_str(&format!(
            "\ntransitions of {}: {}",
            run.name, run.transitions_total
        ));
        if run.transitions_total > run.transitions.len() as u64 {
            out.push_str(&format!(" (the first {} listed)", run.transitions.len()));
        }
        out.push('\n');
        if run.transitions.is_empty() {
            continue;
        }
        let rows: Vec<Vec<String>> = run
            .transitions
            .iter()
            .map(|at| transition_cells(at, start, several))
            .collect();
        let mut header = vec!["after start", "time"];
        if several {
            header.push("gateway");
        }
        header.extend(["from", "to", "why", "calls", "slow", "failed"]);
        let text_columns = header.len() - 3;
        out.push_str(&table(&header, &rows, text_columns));
    }
    out
}

fn gateway_cells(counts: &GatewayCounts) -> Vec<String> {
    vec![
        counts.calls.to_string(),
        counts.slow.to_string(),
        counts.failed.to_string(),
        counts.unanswered.to_string(),
        counts.fast_failed.to_string(),
        seconds_text(counts.open),
        counts.last.name().to_string(),
    ]
}

fn transition_cells(at: &TransitionAt, start: Instant, several: bool) -> Vec<String> {
    let transition = &at.transition;
    let figures = transition.figures;
    let mut row = vec![relative_text(at.at, start), format_millis(at.at)];
    if several {
        row.push(at.gateway.to_string());
    }
    row.extend([
        transition.from.name().to_string(),
        transition.to.name().to_string(),
        transition.cause.to_string(),
        figures.calls.to_string(),
        percent(figures.slow, figures.calls),
        percent(figures.failed, figures.calls),
    ]);
    row
}

fn plural<'a>(count: u64, one: &'a str, many: &'a str) -> &'a str {
    if count == 1 {
        one
    } else {
        many
    }
}

fn counts_json(counts: &Counts) -> Value {
    json!({
        "admitted": counts.admitted,
        "delayed": counts.delayed,
        "rejected": counts.rejected,
        "dry_run": counts.dry_run,
        "delay_max_ms": milliseconds(counts.delay_max),
        "delay_mean_ms": milliseconds(counts.delay_mean()),
    })
}

/// The all-requests counts: a rule's, and what the breakers failed fast.
fn all_json(counts: &Counts) -> Value {
    let mut value = counts_json(counts);
    if let Some(object) = value.as_object_mut() {
        object.insert("fast_failed".into(), json!(counts.fast_failed));
        object.insert("fallback".into(), json!(counts.fallback));
    }
    value
}

fn breakers_json(policy: &Policy, simulation: &Simulation) -> Value {
    let start = simulation.input.first.unwrap_or(Instant::EPOCH);
    let relative_ms = |at: Instant| milliseconds(at.saturating_since(start));
    let runs: Vec<Value> = simulation
        .breakers
        .runs
        .iter()
        .map(|run| {
            let spec = policy.breakers().find(|spec| spec.index == run.index);
            let settings = spec.map(|spec| {
                let settings = &spec.settings;
                json!({
                    "scope": settings.reach.name(),
                    "opens_when": trips_text(spec),
                    "slow_ms": settings.slow().map(|slow| slow.threshold.whole_millis()),
                    "slow_ratio": settings.slow().map(|slow| slow.ratio.to_string()),
                    "failure_ratio": settings.failure_ratio().map(|ratio| ratio.to_string()),
                    "failure_status": settings.failure_status.to_string(),
                    "min_calls": settings.min_calls.get(),
                    "window_seconds": settings.window.seconds(),
                    "open_seconds": milliseconds(settings.open_for) / 1_000.0,
                    "half_open_calls": settings.half_open_calls.get(),
                    "force": settings.force.name(),
                    "fallback_header": spec.fallback_header,
                })
            });
            json!({
                "index": run.index,
                "name": run.name,
                "settings": settings,
                "gateways": run.gateways.iter().enumerate().map(|(gateway, counts)| json!({
                    "gateway": gateway,
                    "calls": counts.calls,
                    "slow": counts.slow,
                    "failed": counts.failed,
                    "no_answer": counts.unanswered,
                    "fast_failed": counts.fast_failed,
                    "open_ms": milliseconds(counts.open),
                    "state_at_end": counts.last.name(),
                    "transitions": counts.transitions,
                })).collect::<Vec<_>>(),
                "transitions_total": run.transitions_total,
                "transitions": run.transitions.iter().map(|at| json!({
                    "at_ms": relative_ms(at.at),
                    "time": format_millis(at.at),
                    "gateway": at.gateway,
                    "from": at.transition.from.name(),
                    "to": at.transition.to.name(),
                    "why": at.transition.cause.to_string(),
                    "calls": at.transition.figures.calls,
                    "slow": at.transition.figures.slow,
                    "failed": at.transition.figures.failed,
                })).collect::<Vec<_>>(),
                "open_periods": run.open_periods.iter().map(|&(from, to, gateway)| json!({
                    "gateway": gateway,
                    "from_ms": relative_ms(from),
                    "to_ms": to.map(relative_ms),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    Value::Array(runs)
}

fn bin_json(start: u64, bin: &Bin) -> Value {
    json!({
        "t": start,
        "time": format_seconds(start),
        "all": all_json(&bin.all),
        "rules": bin.rules.iter().map(counts_json).collect::<Vec<_>>(),
    })
}

/// The machine-readable report.
pub fn render_json(policy: &Policy, simulation: &Simulation, source: &str, interval: u64) -> Value {
    let input = &simulation.input;
    let total = &simulation.tally.total;
    let rules: Vec<Value> = policy
        .rules()
        .zip(&total.rules)
        .map(|(rule, counts)| {
            json!({
                "index": rule.index,
                "name": rule.name,
                "scope": rule.scope.name(),
                "algo": rule.algo.code(),
                "actor": rule.actor_name,
                "rpu": rule.limit.rpu.get(),
                "unit": rule.limit.unit_name(),
                "burst": rule.limit.burst.get(),
                "dry_run": in_dry_run(policy, rule),
                "totals": counts_json(counts),
            })
        })
        .collect();
    let mut all = all_json(&total.all);
    if let Some(object) = all.as_object_mut() {
        object.insert("requests".into(), json!(input.requests));
        object.insert("unmatched".into(), json!(simulation.tally.unmatched));
    }
    json!({
        "source": source,
        "input": {
            "lines": input.lines,
            "requests": input.requests,
            "jsonl": input.jsonl,
            "envoy": input.envoy,
            "blank": input.blank,
            "no_request": input.no_request,
            "malformed": input.malformed,
            "malformed_examples": input
                .malformed_examples
                .iter()
                .map(|(line, reason)| json!({"line": line, "reason": reason.to_string()}))
                .collect::<Vec<_>>(),
            "late": input.late,
            "first": input.first.map(|t| format_seconds(t.periods(NANOS_PER_SECOND))),
            "last": input.last.map(|t| format_seconds(t.periods(NANOS_PER_SECOND))),
        },
        "gateways": simulation.gateways,
        "callouts": simulation.callouts,
        "unresolved": simulation.unresolved,
        "interval_seconds": interval,
        "rules": rules,
        "all": all,
        "breakers": breakers_json(policy, simulation),
        "seconds": simulation
            .tally
            .bins(interval)
            .iter()
            .map(|(start, bin)| bin_json(*start, bin))
            .collect::<Vec<_>>(),
    })
}
