//! The fleet view's reports (issue 43, "See the flood") from the worker, under every host's
//! rules, on the simulated gateway: a document with a `global` section reports every
//! second what each rule admitted and limited and its hottest identities and paths, also
//! when every rule is local; `hot: {show: digest}` shows no value; a document without one
//! reports nothing; the sketches stay the size they were made whatever clients send.

// The helpers below stop a test at once when a scenario cannot even be set up.
#![allow(clippy::panic)]

#[allow(dead_code)]
mod common;

use diana_core::report::{ReportRequest, RuleLine, MAX_INTERVAL_MS};
use diana_core::time::{Instant, Nanos, NANOS_PER_SECOND};
use diana_core::worker::sim::{Fate, Service, Sim};
use diana_core::worker::HostProfile;
use std::time::Duration;

const S: Nanos = NANOS_PER_SECOND;
/// 2026-01-01T00:00:01Z.
const T0: Instant = Instant::from_unix_nanos(1_767_225_601 * S.get());

const GLOBAL: &str = "global: {cluster: \"127.0.0.1:18081\"}\n";

/// One local per-device rule of `limit` a minute (and `hot` as written) under /api, and a
/// rule for everyone under /.
fn document(limit: u32, hot: &str, global: &str) -> String {
    format!(
        "resources:\n  - Url: /\n    rules: [{{name: everyone, rpu: 100000, unit: minute}}]\n  - Url: /api\n    rules: [{{name: per-device, actor: device, rpu: {limit}, unit: minute{hot}}}]\n{global}"
    )
}

fn sim(profile: HostProfile, document: &str, workers: usize) -> Sim {
    common::started_sim(
        profile,
        document,
        workers,
        Service::Answers(Nanos::ZERO),
        T0,
    )
}

/// A request from `device` to `path` on `worker`; true when admitted (it is answered and
/// ends at once).
fn request(sim: &mut Sim, worker: usize, path: &str, device: &str) -> bool {
    let context = sim.send(
        worker,
        "10.0.0.1",
        &[(":path", path), ("x-device-id", device)],
    );
    let admitted = matches!(sim.fate(context), Some(Fate::Admitted(_)));
    if admitted {
        sim.respond(context, &[(":status", "200")]);
    }
    sim.end(context);
    admitted
}

/// Every report's line of `rule`.
fn lines<'r>(reports: &'r [ReportRequest], rule: &str) -> Vec<&'r RuleLine> {
    reports
        .iter()
        .flat_map(|report| &report.rules)
        .filter(|line| line.name == rule)
        .collect()
}

/// The sum of `count` over the lines.
fn sum(lines: &[&RuleLine], count: impl Fn(&RuleLine) -> u64) -> u64 {
    lines.iter().map(|line| count(line)).sum()
}

#[test]
fn a_flood_from_one_device_shows_it_first_among_the_limited() {
    for profile in HostProfile::ALL {
        let limit = 5;
        let mut sim = sim(profile, &document(limit, "", GLOBAL), 2);
        sim.advance(Duration::from_secs(1));
        sim.take_reports();
        let (mut admitted, mut limited) = (0u64, 0u64);
        // device-42 floods through both workers; a few others send one request each.
        for round in 0..40 {
            let worker = round % 2;
            if request(&mut sim, worker, "/api/items", "device-42") {
                admitted += 1;
            } else {
                limited += 1;
            }
            if round % 8 == 0 {
                assert!(request(
                    &mut sim,
                    worker,
                    "/api/items",
                    &format!("device-{round}")
                ));
                admitted += 1;
            }
        }
        assert!(limited > 0, "{}", profile.name);
        sim.advance(Duration::from_millis(1_100));
        let reports = sim.take_reports();
        // Each worker reports once a second.
        assert_eq!(reports.len(), 2, "{}: {reports:?}", profile.name);
        let per_device = lines(&reports, "per_device");
        assert_eq!(
            sum(&per_device, |line| line.limited),
            limited,
            "{}",
            profile.name
        );
        assert_eq!(
            sum(&per_device, |line| line.admitted),
            admitted,
            "{}",
            profile.name
        );
        for line in &per_device {
            let Some(hot) = &line.hot_limited else {
                panic!("{}: no hot_limited in {line:?}", profile.name);
            };
            let first = &hot.top(1)[0];
            assert_eq!(first.label.as_str(), "device-42", "{}", profile.name);
            // Few identities: the sketch counts exactly.
            assert_eq!(first.count, line.limited, "{}", profile.name);
            assert_eq!(first.error, 0, "{}", profile.name);
            assert_eq!(hot.top(usize::MAX).len(), 1, "{}", profile.name);
        }
        // The rule for everyone counts as its metrics do (the admitted requests: a rejected
        // one is not counted admitted by the rules it passed), and keeps no identities.
        let everyone = lines(&reports, "everyone");
        assert_eq!(
            sum(&everyone, |line| line.admitted),
            admitted,
            "{}",
            profile.name
        );
        assert!(everyone
            .iter()
            .all(|line| line.hot_limited.is_none() && line.hot_admitted.is_none()));
        // The hottest path is the longest matched resource.
        for report in &reports {
            let paths = report.paths.as_ref().map(|paths| paths.top(1).to_vec());
            let first = paths.as_deref().and_then(|top| top.first());
            assert_eq!(
                first.map(|hot| hot.label.as_str()),
                Some("/api"),
                "{}",
                profile.name
            );
            assert!((1..=MAX_INTERVAL_MS).contains(&report.interval_ms));
            assert!(!report.degraded);
            assert!(report.breakers.is_empty());
        }
        // Nothing counted twice: a second later the reports carry nothing of the flood.
        sim.advance(Duration::from_millis(1_000));
        let quiet = sim.take_reports();
        assert_eq!(quiet.len(), 2, "{}: {quiet:?}", profile.name);
        for report in &quiet {
            assert!(report.rules.is_empty(), "{}: {report:?}", profile.name);
            assert!(report.paths.is_none());
            // The real time since the previous report, about a second.
            assert!(
                (900..=1_100).contains(&report.interval_ms),
                "{}: {}",
                profile.name,
                report.interval_ms
            );
        }
    }
}

#[test]
fn a_digest_shows_no_value() {
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, &document(1, ", hot: {show: digest}", GLOBAL), 1);
        sim.advance(Duration::from_secs(1));
        for _ in 0..5 {
            request(&mut sim, 0, "/api", "device-42");
        }
        request(&mut sim, 0, "/api", "device-7");
        sim.advance(Duration::from_millis(1_100));
        let reports = sim.take_reports();
        let per_device = lines(&reports, "per_device");
        assert_eq!(sum(&per_device, |line| line.limited), 4, "{}", profile.name);
        let mut labels = Vec::new();
        for line in &per_device {
            for list in [&line.hot_limited, &line.hot_admitted]
                .into_iter()
                .flatten()
            {
                labels.extend(list.top(usize::MAX).iter().map(|hot| hot.label));
            }
        }
        // device-42 limited and admitted, device-7 admitted: two lists of one digest and
        // one of another.
        assert_eq!(labels.len(), 3, "{}: {labels:?}", profile.name);
        for label in &labels {
            let text = label.as_str();
            assert!(!text.contains("device"), "{}: {text}", profile.name);
            assert_eq!(text.len(), 16, "{}: {text}", profile.name);
            assert!(text.bytes().all(|b| b.is_ascii_hexdigit()));
        }
        let distinct: std::collections::BTreeSet<&str> =
            labels.iter().map(|label| label.as_str()).collect();
        assert_eq!(distinct.len(), 2, "{}: {labels:?}", profile.name);
        // The body sent holds no value either.
        let body = serde_json::to_string(&reports).unwrap_or_default();
        assert!(!body.contains("device-"), "{}", profile.name);
    }
}

#[test]
fn without_a_global_section_nothing_is_reported() {
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, &document(1, "", ""), 1);
        sim.advance(Duration::from_secs(1));
        for _ in 0..5 {
            request(&mut sim, 0, "/api", "device-42");
        }
        sim.advance(Duration::from_secs(3));
        assert!(sim.take_reports().is_empty(), "{}", profile.name);
        assert_eq!(sim.quota_calls(), 0, "{}", profile.name);
    }
}

#[test]
fn ten_thousand_identities_fit_in_the_sketch_made_for_them() {
    let top = 10;
    for profile in HostProfile::ALL {
        let mut sim = sim(
            profile,
            &document(1, &format!(", hot: {{top: {top}}}"), GLOBAL),
            1,
        );
        sim.advance(Duration::from_secs(1));
        sim.take_reports();
        // One flooding device among 10,000 that each send twice (the second is limited).
        for device in 0..10_000 {
            let name = format!("device-{device}");
            request(&mut sim, 0, "/api", &name);
            request(&mut sim, 0, "/api", &name);
            if device % 10 == 0 {
                request(&mut sim, 0, "/api", "flood");
            }
        }
        sim.advance(Duration::from_millis(1_100));
        let reports = sim.take_reports();
        let per_device = lines(&reports, "per_device");
        assert_eq!(per_device.len(), 1, "{}", profile.name);
        let line = per_device[0];
        assert_eq!(line.limited, 10_000 + 999, "{}", profile.name);
        for list in [&line.hot_limited, &line.hot_admitted] {
            let Some(list) = list else {
                panic!("{}: a list missing in {line:?}", profile.name);
            };
            // max(4 × top, 16) counters, whatever came.
            assert_eq!(list.capacity(), 4 * top, "{}", profile.name);
            assert!(list.top(usize::MAX).len() <= 4 * top);
        }
        let Some(hot) = &line.hot_limited else {
            return;
        };
        let first = &hot.top(1)[0];
        assert_eq!(first.label.as_str(), "flood", "{}", profile.name);
        // Its true count (999) lies within the bounds the list gives.
        assert!(first.guaranteed() <= 999 && 999 <= first.count);
        assert!(hot.floor() <= hot.total() / (4 * top) as u64);
    }
}
