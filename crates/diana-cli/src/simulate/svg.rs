//! The simulation as a self-contained SVG chart, written by hand: one panel for all
//! requests, then one per rule, time on x, requests per second on y, bars stacked
//! admitted / delayed / rejected (and, with circuit breakers, fast-failed), and a dashed
//! line for what dry-run rules would have rejected. Each breaker's open periods shade the
//! all-requests panel, named.

use super::clock::format_seconds;
use super::report::limit_text;
use super::tally::{Bin, Counts};
use super::Simulation;
use diana_core::config::Policy;
use std::fmt::Write;

const WIDTH: f64 = 960.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = 24.0;
const PLOT_HEIGHT: f64 = 150.0;
/// Title above a panel, axis labels below it.
const PANEL_GAP: f64 = 78.0;
const HEADER: f64 = 74.0;
/// Most bars per panel: longer logs are drawn in wider bins.
const MAX_BARS: u64 = 600;
/// Most rule panels.
const MAX_RULE_PANELS: usize = 12;

const ADMITTED: &str = "#2ca02c";
const DELAYED: &str = "#ff7f0e";
const REJECTED: &str = "#d62728";
const DRY_RUN: &str = "#222";
const FAST_FAILED: &str = "#9467bd";
const OPEN: &str = "#9467bd";
/// Most open periods drawn (each breaker lists at most [`super::breakers::MAX_TRANSITIONS`]).
const MAX_BANDS: usize = 2_000;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The y axis for values up to `peak`: a round step (1, 2, 2.5 or 5 × 10^k) and the
/// number of steps (at most 5) that reach at least `peak`.
fn y_axis(peak: f64) -> (f64, u32) {
    if peak <= 0.0 {
        return (1.0, 1);
    }
    let raw = peak / 5.0;
    let scale = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * scale)
        .find(|&step| step >= raw - 1e-12)
        .unwrap_or(10.0 * scale);
    let steps = (peak / step - 1e-9).ceil().max(1.0) as u32;
    (step, steps)
}

/// A tick step (seconds) giving at most about ten labels over `span` seconds.
fn tick_step(span: u64, interval: u64) -> u64 {
    [
        1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21_600, 43_200, 86_400,
    ]
    .into_iter()
    .map(|step: u64| step.max(interval).div_ceil(interval) * interval)
    .find(|&step| span / step <= 10)
    .unwrap_or_else(|| span.div_ceil(10).max(1))
}

fn number(value: f64) -> String {
    if value >= 100.0 || value.fract() == 0.0 {
        format!("{value:.0}")
    } else {
        let text = format!("{value:.2}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

struct Panel<'a> {
    title: String,
    /// One per bar: the counts of that bin (None: no request).
    bars: Vec<Option<&'a Counts>>,
}

/// The chart. `interval` is the narrowest bin in seconds (widened for long logs).
pub fn render_svg(policy: &Policy, simulation: &Simulation, source: &str, interval: u64) -> String {
    let tally = &simulation.tally;
    let (first, last) = match (tally.seconds.keys().next(), tally.seconds.keys().last()) {
        (Some(&first), Some(&last)) => (first, last),
        _ => (0, 0),
    };
    let mut interval = interval.max(1);
    let span = last - first + 1;
    if span.div_ceil(interval) > MAX_BARS {
        interval = span.div_ceil(MAX_BARS).div_ceil(interval) * interval;
    }
    let start = first - first % interval;
    let count = usize::try_from((last - start) / interval + 1).unwrap_or(1);
    let bins: Vec<(u64, Bin)> = tally.bins(interval);
    let mut slots: Vec<Option<&Bin>> = vec![None; count];
    for (bin_start, bin) in &bins {
        let index = usize::try_from((bin_start - start) / interval).unwrap_or(0);
        if let Some(slot) = slots.get_mut(index) {
            *slot = Some(bin);
        }
    }

    let mut panels = vec![Panel {
        title: "all requests".to_string(),
        bars: slots.iter().map(|bin| bin.map(|b| &b.all)).collect(),
    }];
    let rules: Vec<_> = policy.rules().collect();
    for (index, rule) in rules.iter().enumerate().take(MAX_RULE_PANELS) {
        let dry_run = if rule.dry_run || policy.dry_run {
            ", dry run"
        } else {
            ""
        };
        panels.push(Panel {
            title: format!(
                "rule {}: {} {} actor {}, {}{dry_run}",
                rule.name,
                rule.scope.name(),
                rule.algo.code(),
                rule.actor_name,
                limit_text(rule)
            ),
            bars: slots
                .iter()
                .map(|bin| bin.and_then(|b| b.rules.get(index)))
                .collect(),
        });
    }

    let height = HEADER + panels.len() as f64 * (PLOT_HEIGHT + PANEL_GAP) + 10.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" font-size="15" font-weight="bold" text-anchor="middle">diana simulate: {}</text>"#,
        WIDTH / 2.0,
        escape(source)
    );
    let total = &tally.total.all;
    let bin_text = if interval == 1 {
        "per second".to_string()
    } else {
        format!("mean per second over {interval} s bins")
    };
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="40" text-anchor="middle">{} requests from {}: {} admitted, {} delayed, {} rejected{}; {bin_text}</text>"#,
        WIDTH / 2.0,
        simulation.input.requests,
        format_seconds(first),
        total.admitted,
        total.delayed,
        total.rejected,
        if simulation.breakers.is_empty() {
            String::new()
        } else {
            format!(", {} fast-failed", total.fast_failed)
        },
    );
    let breakers = &simulation.breakers;
    let mut legend = vec![
        (ADMITTED, "admitted", false),
        (DELAYED, "delayed (leaky bucket)", false),
        (REJECTED, "rejected", false),
    ];
    if !breakers.is_empty() {
        legend.push((FAST_FAILED, "fast-failed (breaker open)", false));
    }
    legend.push((DRY_RUN, "dry run: would reject", true));
    let mut x = LEFT;
    for (color, label, dashed) in legend {
        if dashed {
            let _ = writeln!(
                svg,
                r#"<line x1="{x}" x2="{}" y1="55" y2="55" stroke="{color}" stroke-width="2" stroke-dasharray="4,3"/>"#,
                x + 14.0
            );
        } else {
            let _ = writeln!(
                svg,
                r#"<rect x="{x}" y="49" width="14" height="12" fill="{color}"/>"#
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="59">{}</text>"#,
            x + 19.0,
            escape(label)
        );
        x += 28.0 + label.len() as f64 * 6.2;
    }

    let plot_width = WIDTH - LEFT - RIGHT;
    let bar_width = plot_width / count as f64;
    let seconds = interval as f64;
    let span = count as u64 * interval;
    let step = tick_step(span, interval);
    for (number_in_list, panel) in panels.iter().enumerate() {
        let top = HEADER + number_in_list as f64 * (PLOT_HEIGHT + PANEL_GAP) + 18.0;
        let peak = panel
            .bars
            .iter()
            .flatten()
            .map(|c| {
                ((c.admitted + c.delayed + c.rejected + c.fast_failed) as f64 / seconds)
                    .max(c.dry_run as f64 / seconds)
            })
            .fold(0.0, f64::max);
        let (y_step, y_steps) = y_axis(peak);
        let y_max = y_step * f64::from(y_steps);
        let y = |value: f64| top + PLOT_HEIGHT - PLOT_HEIGHT * (value / y_max).min(1.0);
        let _ = writeln!(svg, r#"<g>"#);
        let _ = writeln!(
            svg,
            r#"<text x="{LEFT}" y="{}" font-size="12" font-weight="bold">{}</text>"#,
            top - 6.0,
            escape(&panel.title)
        );
        if number_in_list == 0 {
            // Each breaker's open periods, behind the bars, on its own row of labels.
            let span_nanos = (span as f64) * 1e9;
            let origin = start as f64 * 1e9;
            let x_of = |nanos: u64| {
                LEFT + plot_width * ((nanos as f64 - origin) / span_nanos).clamp(0.0, 1.0)
            };
            let end_nanos = simulation.input.last.map_or(0, |last| {
                last.unix_nanos().max((start + span) * 1_000_000_000)
            });
            let mut drawn = 0;
            for (row, run) in breakers.runs.iter().enumerate() {
                for (number, &(from, to, gateway)) in run.open_periods.iter().enumerate() {
                    if drawn >= MAX_BANDS {
                        break;
                    }
                    drawn += 1;
                    let x0 = x_of(from.unix_nanos());
                    let x1 = x_of(to.map_or(end_nanos, |to| to.unix_nanos())).max(x0 + 1.0);
                    let gateway = if simulation.gateways > 1 {
                        format!(" (gateway {gateway})")
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        svg,
                        r#"<rect x="{x0:.2}" y="{top}" width="{:.2}" height="{PLOT_HEIGHT}" fill="{OPEN}" fill-opacity="0.15"><title>breaker {} open{gateway}</title></rect>"#,
                        x1 - x0,
                        escape(&run.name)
                    );
                    // Named where the name fits (and on the first): short openings close
                    // together would print over each other.
                    if number == 0 || x1 - x0 >= 40.0 {
                        let _ = writeln!(
                            svg,
                            r#"<text x="{:.2}" y="{:.1}" fill="{OPEN}">{} open</text>"#,
                            x0 + 3.0,
                            top + 12.0 + 12.0 * row as f64,
                            escape(&run.name)
                        );
                    }
                }
            }
        }
        for tick in 0..=y_steps {
            let value = y_step * f64::from(tick);
            let _ = writeln!(
                svg,
                r##"<line x1="{LEFT}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="#e0e0e0"/>"##,
                LEFT + plot_width,
                y(value),
                y(value)
            );
            let _ = writeln!(
                svg,
                r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
                LEFT - 6.0,
                y(value) + 4.0,
                number(value)
            );
        }
        let mut dry_points = Vec::new();
        for (index, bar) in panel.bars.iter().enumerate() {
            let x = LEFT + index as f64 * bar_width;
            let Some(counts) = bar else {
                dry_points.push((x, 0.0));
                continue;
            };
            let mut base = 0.0;
            for (value, color) in [
                (counts.admitted, ADMITTED),
                (counts.delayed, DELAYED),
                (counts.rejected, REJECTED),
                (counts.fast_failed, FAST_FAILED),
            ] {
                if value == 0 {
                    continue;
                }
                let rate = value as f64 / seconds;
                let (y0, y1) = (y(base + rate), y(base));
                let _ = writeln!(
                    svg,
                    r#"<rect x="{x:.2}" y="{y0:.2}" width="{:.2}" height="{:.2}" fill="{color}"><title>{}: {value} {}</title></rect>"#,
                    (bar_width - if bar_width > 4.0 { 1.0 } else { 0.0 }).max(0.5),
                    (y1 - y0).max(0.0),
                    format_seconds(start + index as u64 * interval),
                    match color {
                        ADMITTED => "admitted",
                        DELAYED => "delayed",
                        REJECTED => "rejected",
                        _ => "fast-failed",
                    }
                );
                base += rate;
            }
            dry_points.push((x, counts.dry_run as f64 / seconds));
        }
        if dry_points.iter().any(|&(_, value)| value > 0.0) {
            let mut path = String::new();
            for (index, &(x, value)) in dry_points.iter().enumerate() {
                let command = if index == 0 { 'M' } else { 'L' };
                let _ = write!(
                    path,
                    "{command}{x:.1},{:.1} H{:.1} ",
                    y(value),
                    x + bar_width
                );
            }
            let _ = writeln!(
                svg,
                r#"<path d="{}" fill="none" stroke="{DRY_RUN}" stroke-width="1.5" stroke-dasharray="4,3"/>"#,
                path.trim_end()
            );
        }
        let _ = writeln!(
            svg,
            r##"<rect x="{LEFT}" y="{top}" width="{plot_width}" height="{PLOT_HEIGHT}" fill="none" stroke="#444"/>"##
        );
        let mut tick = 0;
        while tick <= span {
            let x = LEFT + plot_width * tick as f64 / span as f64;
            let _ = writeln!(
                svg,
                r##"<line x1="{x:.1}" x2="{x:.1}" y1="{}" y2="{}" stroke="#444"/>"##,
                top + PLOT_HEIGHT,
                top + PLOT_HEIGHT + 4.0
            );
            let _ = writeln!(
                svg,
                r#"<text x="{x:.1}" y="{}" text-anchor="middle">{tick}</text>"#,
                top + PLOT_HEIGHT + 16.0
            );
            tick += step;
        }
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">seconds since {}</text>"#,
            LEFT + plot_width / 2.0,
            top + PLOT_HEIGHT + 32.0,
            format_seconds(start)
        );
        let _ = writeln!(
            svg,
            r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">requests/s</text>"#,
            LEFT - 48.0,
            top + PLOT_HEIGHT / 2.0
        );
        let _ = writeln!(svg, "</g>");
    }
    if rules.len() > MAX_RULE_PANELS {
        let _ = writeln!(
            svg,
            r#"<text x="{LEFT}" y="{}">{} more rules are not drawn (see the table)</text>"#,
            height - 4.0,
            rules.len() - MAX_RULE_PANELS
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_get_round_tops_and_few_ticks() {
        assert_eq!(y_axis(0.0), (1.0, 1));
        assert_eq!(y_axis(3.0), (1.0, 3));
        assert_eq!(y_axis(7.0), (2.0, 4));
        assert_eq!(y_axis(120.0), (25.0, 5));
        assert_eq!(y_axis(121.0), (25.0, 5));
        assert_eq!(y_axis(0.4), (0.1, 4));
        assert_eq!(tick_step(12, 1), 2);
        assert_eq!(tick_step(40, 1), 5);
        assert_eq!(tick_step(86_400, 1), 21_600);
        assert_eq!(tick_step(600, 60), 60);
        assert_eq!(escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
        assert_eq!(number(2.5), "2.5");
        assert_eq!(number(150.0), "150");
    }
}
