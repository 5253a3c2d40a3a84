//! The simulation as text (a table per second × rule, then totals) or JSON.

use super::clock::format_seconds;
use super::tally::{Bin, Counts};
use super::Simulation;
use diana_core::config::{Policy, Rule};
use diana_core::time::{Nanos, NANOS_PER_SECOND};
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
    let mut text = format!("{}/{}", limit.rpu, limit.unit.name());
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

fn count_cells(counts: &Counts) -> Vec<String> {
    vec![
        counts.admitted.to_string(),
        counts.delayed.to_string(),
        counts.rejected.to_string(),
        counts.dry_run.to_string(),
    ]
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
            row.extend(count_cells(&bin.all));
            rows.push(row);
            for (rule, counts) in rules.iter().zip(&bin.rules) {
                if counts.is_empty() {
                    continue;
                }
                let mut row = vec![String::new(), rule.name.clone()];
                row.extend(count_cells(counts));
                rows.push(row);
            }
        }
        out.push_str(&table(
            &[&title, "rule", "admitted", "delayed", "rejected", "dry-run"],
            &rows,
            2,
        ));
    }

    out.push('\n');
    let total = &simulation.tally.total;
    let mut rows: Vec<Vec<String>> = rules
        .iter()
        .zip(&total.rules)
        .map(|(rule, counts)| total_row(&rule.name, counts))
        .collect();
    rows.push(total_row(ALL, &total.all));
    out.push_str(&table(
        &[
            "totals",
            "admitted",
            "delayed",
            "rejected",
            "dry-run",
            "max delay",
            "mean delay",
        ],
        &rows,
        1,
    ));
    out.push_str(&format!(
        "{} requests: {} admitted, {} delayed, {} rejected; {} matched no rule; {} callouts to the simulated quota service\n",
        input.requests,
        total.all.admitted,
        total.all.delayed,
        total.all.rejected,
        simulation.tally.unmatched,
        simulation.callouts,
    ));
    out
}

fn total_row(name: &str, counts: &Counts) -> Vec<String> {
    let mut row = vec![name.to_string()];
    row.extend(count_cells(counts));
    row.push(delay_text(counts.delay_max, counts.delayed));
    row.push(delay_text(counts.delay_mean(), counts.delayed));
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

fn bin_json(start: u64, bin: &Bin) -> Value {
    json!({
        "t": start,
        "time": format_seconds(start),
        "all": counts_json(&bin.all),
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
                "unit": rule.limit.unit.name(),
                "burst": rule.limit.burst.get(),
                "dry_run": in_dry_run(policy, rule),
                "totals": counts_json(counts),
            })
        })
        .collect();
    let mut all = counts_json(&total.all);
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
        "seconds": simulation
            .tally
            .bins(interval)
            .iter()
            .map(|(start, bin)| bin_json(*start, bin))
            .collect::<Vec<_>>(),
    })
}
