//! Circuit breakers (DESIGN §4b) in the worker, under every host's rules, on the simulated
//! gateway (`diana_core::worker::sim`): slow and failed calls open a breaker, an open one
//! answers at once or sends the request on marked, half-open lets exactly its probes
//! through, a probe a rule rejects gives its place back, a request that ends without an
//! answer failed, a reload keeps or drops a breaker, and `scope: global` follows the
//! fleet's state from the quota service (falling back to its own when the service is
//! silent).

// The helpers below stop a test at once when a scenario cannot even be set up.
#![allow(clippy::panic)]

#[allow(dead_code)]
mod common;

use diana_core::quota::MemoryQuota;
use diana_core::time::{Instant, Nanos, NANOS_PER_SECOND};
use diana_core::worker::sim::{Fate, Service, Sim};
use diana_core::worker::HostProfile;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

const S: Nanos = NANOS_PER_SECOND;
/// 2026-01-01T00:00:01Z.
const T0: Instant = Instant::from_unix_nanos(1_767_225_601 * S.get());

fn sim(profile: HostProfile, document: &str, workers: usize) -> Sim {
    common::started_sim(
        profile,
        document,
        workers,
        Service::Answers(Nanos::ZERO),
        T0,
    )
}

/// A request to `path` on `worker`; its fate right after.
fn send(sim: &mut Sim, worker: usize, path: &str) -> (u32, Option<Fate>) {
    let context = sim.send(worker, "10.0.0.1", &[(":path", path)]);
    (context, sim.fate(context).cloned())
}

/// A request that goes upstream and is answered `status` after `after`.
fn call(sim: &mut Sim, worker: usize, path: &str, status: u16, after: Duration) -> bool {
    let (context, fate) = send(sim, worker, path);
    if !matches!(fate, Some(Fate::Admitted(_))) {
        return false;
    }
    sim.advance(after);
    sim.respond(context, &[(":status", &status.to_string())]);
    sim.end(context);
    true
}

fn fast_failed(fate: &Option<Fate>) -> bool {
    matches!(fate, Some(Fate::Replied(503)))
}

fn retry_after(sim: &Sim, context: u32) -> Option<u64> {
    sim.reply(context)?
        .headers
        .iter()
        .find(|(name, _)| *name == "retry-after")
        .and_then(|(_, value)| value.parse().ok())
}

const FAILING: &str = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, min_calls: 4, open_seconds: 2, half_open_calls: 2}\n";

#[test]
fn failures_open_it_and_half_open_lets_exactly_its_probes_through() {
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, FAILING, 2);
        sim.advance(Duration::from_secs(1));
        // Four calls, two failed, spread over both workers: the window reaches 50 %.
        for (worker, status) in [(0, 200), (1, 503), (0, 503), (1, 200)] {
            assert!(call(
                &mut sim,
                worker,
                "/pay",
                status,
                Duration::from_millis(5)
            ));
        }
        // Within a tick the evidence is shared: both workers fail fast (a worker trusts
        // the verdict it last read for 50 ms).
        sim.advance(Duration::from_millis(1_060));
        for worker in [0, 1] {
            let (context, fate) = send(&mut sim, worker, "/pay");
            assert!(fast_failed(&fate), "{}: {fate:?}", profile.name);
            let wait = retry_after(&sim, context);
            assert!(
                wait.is_some_and(|w| (1..=2).contains(&w)),
                "{}: {wait:?}",
                profile.name
            );
        }
        // Another path is not this breaker's.
        let (_, other) = send(&mut sim, 0, "/other");
        assert!(matches!(other, Some(Fate::Admitted(_))), "{}", profile.name);
        // open_seconds over: half-open, exactly two probes go through.
        sim.advance(Duration::from_millis(1_950));
        let (first, one) = send(&mut sim, 0, "/pay");
        let (second, two) = send(&mut sim, 1, "/pay");
        let (_, three) = send(&mut sim, 0, "/pay");
        assert!(
            matches!(one, Some(Fate::Admitted(_))),
            "{}: {one:?}",
            profile.name
        );
        assert!(
            matches!(two, Some(Fate::Admitted(_))),
            "{}: {two:?}",
            profile.name
        );
        assert!(
            fast_failed(&three),
            "{}: a third probe {three:?}",
            profile.name
        );
        // Both good: closed, and the window starts afresh.
        for probe in [first, second] {
            sim.respond(probe, &[(":status", "200")]);
            sim.end(probe);
        }
        assert!(
            call(&mut sim, 0, "/pay", 200, Duration::from_millis(5)),
            "{}",
            profile.name
        );
        sim.advance(Duration::from_secs(1));
        sim.flush_metrics();
        assert_eq!(
            sim.host.metric("diana_breaker_state.pay"),
            0,
            "{}",
            profile.name
        );
        // closed -> open, open -> half-open, half-open -> closed: once each per gateway.
        assert_eq!(
            sim.host.metric("diana_breaker_transitions.pay"),
            3,
            "{}",
            profile.name
        );
        assert_eq!(
            sim.host.metric("diana_breaker_failed.pay"),
            2,
            "{}",
            profile.name
        );
        assert!(
            sim.violations.is_empty(),
            "{}: {:?}",
            profile.name,
            sim.violations
        );
    }
}

#[test]
fn slow_answers_open_it_and_a_slow_probe_opens_it_again() {
    let document = "resources:\n  - Url: /\n    breaker: {name: slow, slow_ms: 100, slow_ratio: 0.5, min_calls: 2, open_seconds: 1, half_open_calls: 1}\n";
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, document, 1);
        sim.advance(Duration::from_secs(1));
        assert!(call(&mut sim, 0, "/", 200, Duration::from_millis(150)));
        assert!(call(&mut sim, 0, "/", 200, Duration::from_millis(20)));
        sim.advance(Duration::from_secs(1));
        let (_, fate) = send(&mut sim, 0, "/");
        assert!(
            fast_failed(&fate),
            "{}: 1 of 2 slow: {fate:?}",
            profile.name
        );
        sim.advance(Duration::from_secs(1));
        // The probe answers well, but late: open again.
        assert!(call(&mut sim, 0, "/", 200, Duration::from_millis(300)));
        let (_, fate) = send(&mut sim, 0, "/");
        assert!(
            fast_failed(&fate),
            "{}: after a slow probe {fate:?}",
            profile.name
        );
    }
}

/// The clock is read at a call's response only when its judging needs the time: a
/// breaker with `slow_ms` (how long the call took), a probe, or a slow or failed outcome
/// that may flush the window now. A good call of a breaker without `slow_ms` is counted
/// without it (in wasm a clock read costs more than the rest of the call's judging): so
/// it is counted even while the clock cannot be read, where a call that needs the time
/// is not judged then (`diana_clock_errors`, as for any response's work without a clock).
#[test]
fn a_good_call_is_judged_without_the_clock_unless_its_time_counts() {
    let slow = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, slow_ms: 100, slow_ratio: 0.5, min_calls: 4}\n";
    for profile in HostProfile::ALL {
        // (document, status, counted without a clock)
        for (document, status, counted) in [
            (FAILING, "200", true),
            (FAILING, "503", false),
            (slow, "200", false),
        ] {
            let mut sim = sim(profile, document, 1);
            sim.advance(Duration::from_secs(1));
            let (context, fate) = send(&mut sim, 0, "/pay");
            assert!(matches!(fate, Some(Fate::Admitted(_))), "{fate:?}");
            sim.advance(Duration::from_millis(5));
            sim.host.set_clock_readable(false);
            sim.respond(context, &[(":status", status)]);
            sim.host.set_clock_readable(true);
            sim.end(context);
            sim.flush_metrics();
            let case = format!("{}: {status} {document:?}", profile.name);
            assert_eq!(
                sim.host.metric("diana_breaker_calls.pay"),
                u64::from(counted),
                "{case}"
            );
            assert_eq!(
                sim.host.metric("diana_clock_errors"),
                u64::from(!counted),
                "{case}"
            );
            // With the clock, every call is judged.
            assert!(call(&mut sim, 0, "/pay", 200, Duration::from_millis(5)));
            assert!(call(&mut sim, 0, "/pay", 503, Duration::from_millis(5)));
            sim.flush_metrics();
            assert_eq!(
                sim.host.metric("diana_breaker_calls.pay"),
                u64::from(counted) + 2,
                "{case}"
            );
            assert_eq!(sim.host.metric("diana_breaker_failed.pay"), 1, "{case}");
        }
    }
}

/// Where a request's breaker calls wait for its response: with its binding where the host
/// keeps them (`keeps_breaker_calls`: the native module) when judging them is all that is
/// left of it, else in its worker. A request that also has headers to add, or a response
/// cost, or that probes, stays with its worker everywhere.
#[test]
fn a_breakers_call_waits_with_the_binding_only_where_the_host_keeps_it() {
    let with_headers = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, min_calls: 4}\n    rules: [{rpu: 100, unit: minute}]\nresponse: {headers: all}\n";
    let with_cost = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, min_calls: 4}\n    rules: [{rpu: 100, unit: minute, response_cost: {header: x-cost, max: 10}}]\n";
    for profile in HostProfile::ALL {
        for (document, kept) in [
            (FAILING, profile.keeps_breaker_calls),
            (with_headers, false),
            (with_cost, false),
        ] {
            let mut sim = sim(profile, document, 1);
            sim.advance(Duration::from_secs(1));
            let (context, fate) = send(&mut sim, 0, "/pay");
            assert!(matches!(fate, Some(Fate::Admitted(_))), "{fate:?}");
            let case = format!("{}: {document:?}", profile.name);
            assert_eq!(sim.keeps_calls_of(context), kept, "{case}");
            assert_eq!(sim.tracks(context), !kept, "{case}");
            sim.respond(context, &[(":status", "503")]);
            sim.end(context);
            sim.flush_metrics();
            assert_eq!(sim.host.metric("diana_breaker_failed.pay"), 1, "{case}");
            assert!(
                !sim.keeps_calls_of(context) && !sim.tracks(context),
                "{case}"
            );
            assert!(sim.violations.is_empty(), "{case}: {:?}", sim.violations);
        }
        // A probe is judged by the worker (its outcome may close or reopen the breaker).
        let mut sim = sim(profile, FAILING, 1);
        sim.advance(Duration::from_secs(1));
        for _ in 0..4 {
            assert!(call(&mut sim, 0, "/pay", 503, Duration::from_millis(5)));
        }
        sim.advance(Duration::from_secs(3));
        let (probe, fate) = send(&mut sim, 0, "/pay");
        assert!(matches!(fate, Some(Fate::Admitted(_))), "{fate:?}");
        assert!(!sim.keeps_calls_of(probe), "{}", profile.name);
        assert!(sim.tracks(probe), "{}", profile.name);
    }
}

/// A request whose binding keeps its breaker calls across a reload is judged by the
/// document it was admitted under: the replaced configuration stays until it is, whatever
/// the ticks in between, and its failure counts.
#[test]
fn a_kept_call_outlives_a_reload_and_counts() {
    let profile = HostProfile::ENVOY_NATIVE;
    let mut sim = sim(profile, FAILING, 1);
    sim.advance(Duration::from_secs(1));
    let (context, _) = send(&mut sim, 0, "/pay");
    assert!(sim.keeps_calls_of(context));
    let replaced = "resources:\n  - Url: /other\n    rules: [{rpu: 100, unit: minute}]\n";
    assert!(sim.configure(replaced).is_ok());
    sim.advance(Duration::from_secs(5));
    sim.respond(context, &[(":status", "503")]);
    sim.end(context);
    sim.flush_metrics();
    assert_eq!(sim.host.metric("diana_breaker_calls.pay"), 1);
    assert_eq!(sim.host.metric("diana_breaker_failed.pay"), 1);
    assert!(sim.violations.is_empty(), "{:?}", sim.violations);
}

#[test]
fn a_request_that_ends_without_an_answer_failed() {
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, FAILING, 1);
        sim.advance(Duration::from_secs(1));
        for _ in 0..4 {
            let (context, fate) = send(&mut sim, 0, "/pay");
            assert!(matches!(fate, Some(Fate::Admitted(_))));
            sim.advance(Duration::from_millis(5));
            // Reset before its response headers (an upstream timeout, a reset).
            sim.end(context);
        }
        sim.advance(Duration::from_secs(1));
        let (_, fate) = send(&mut sim, 0, "/pay");
        assert!(fast_failed(&fate), "{}: {fate:?}", profile.name);
    }
}

#[test]
fn requests_diana_rejects_are_not_calls_and_a_rejected_probe_gives_its_place_back() {
    // A rule of 1 request a minute per device behind the breaker.
    let document = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, min_calls: 2, open_seconds: 2, half_open_calls: 1}\n    rules: [{actor: device, rpu: 1, unit: minute}]\n";
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, document, 1);
        sim.advance(Duration::from_secs(1));
        let device = |d: &'static str| [(":path", "/pay"), ("x-device-id", d)];
        // Many rejections by the rule: none is a call (the breaker never trips on them).
        for _ in 0..10 {
            sim.send(0, "10.0.0.1", &device("flood"));
        }
        for d in ["a", "b"] {
            let c = sim.send(0, "10.0.0.1", &device(d));
            sim.respond(c, &[(":status", "500")]);
            sim.end(c);
        }
        sim.advance(Duration::from_secs(1));
        let c = sim.send(0, "10.0.0.1", &device("c"));
        assert!(fast_failed(&sim.fate(c).cloned()), "{}", profile.name);
        sim.advance(Duration::from_secs(2));
        // Half-open: the one probe place is taken by a request the rule rejects ("a" is
        // spent): it gives its place back, and the next request probes.
        let spent = sim.send(0, "10.0.0.1", &device("a"));
        assert_eq!(
            sim.fate(spent),
            Some(&Fate::Replied(503)),
            "{}",
            profile.name
        );
        let probe = sim.send(0, "10.0.0.1", &device("d"));
        assert!(
            matches!(sim.fate(probe), Some(Fate::Admitted(_))),
            "{}: {:?}",
            profile.name,
            sim.fate(probe)
        );
    }
}

#[test]
fn with_a_fallback_header_an_open_breaker_sends_the_request_on_marked() {
    let document = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, min_calls: 2, open_seconds: 30, fallback_header: x-diana-fallback}\n";
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, document, 1);
        sim.advance(Duration::from_secs(1));
        // A client's own value of the header never reaches the upstream.
        let forged = sim.send(
            0,
            "10.0.0.1",
            &[(":path", "/pay"), ("x-diana-fallback", "pay")],
        );
        assert_eq!(sim.upstream_header(forged, "x-diana-fallback"), None);
        // nginx's proxy module sends a removed header on: there it is emptied instead.
        assert_eq!(
            sim.emptied_header(forged, "x-diana-fallback"),
            profile.removed_headers_reach_upstream,
            "{}",
            profile.name
        );
        sim.respond(forged, &[(":status", "500")]);
        sim.end(forged);
        assert!(call(&mut sim, 0, "/pay", 500, Duration::from_millis(1)));
        sim.advance(Duration::from_secs(1));
        let (marked, fate) = send(&mut sim, 0, "/pay");
        assert!(
            matches!(fate, Some(Fate::Admitted(_))),
            "{}: {fate:?}",
            profile.name
        );
        assert_eq!(
            sim.upstream_header(marked, "x-diana-fallback"),
            Some("pay"),
            "{}",
            profile.name
        );
        sim.flush_metrics();
        assert_eq!(sim.host.metric("diana_breaker_fast_failed.pay"), 1);
        assert!(
            sim.violations.is_empty(),
            "{}: {:?}",
            profile.name,
            sim.violations
        );
    }
}

#[test]
fn force_switches_it_and_a_reload_keeps_or_drops_it() {
    let open = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, force: open, open_seconds: 7}\n";
    let auto = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, force: auto, open_seconds: 7}\n";
    let none = "resources:\n  - Url: /pay\n    rules: [{rpu: 100}]\n";
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, open, 1);
        sim.advance(Duration::from_secs(1));
        let (context, fate) = send(&mut sim, 0, "/pay");
        assert!(fast_failed(&fate), "{}: forced open {fate:?}", profile.name);
        assert_eq!(retry_after(&sim, context), Some(7), "{}", profile.name);
        // Back to auto: closed underneath, calls go through.
        sim.configure(auto).unwrap_or_else(|e| panic!("{e}"));
        sim.advance(Duration::from_millis(100));
        let (_, fate) = send(&mut sim, 0, "/pay");
        assert!(
            matches!(fate, Some(Fate::Admitted(_))),
            "{}: {fate:?}",
            profile.name
        );
        // Forced open again, then a document without the breaker: it is gone.
        sim.configure(open).unwrap_or_else(|e| panic!("{e}"));
        sim.advance(Duration::from_millis(100));
        assert!(
            fast_failed(&send(&mut sim, 0, "/pay").1),
            "{}",
            profile.name
        );
        sim.configure(none).unwrap_or_else(|e| panic!("{e}"));
        sim.advance(Duration::from_millis(100));
        let (_, fate) = send(&mut sim, 0, "/pay");
        assert!(
            matches!(fate, Some(Fate::Admitted(_))),
            "{}: {fate:?}",
            profile.name
        );
    }
}

/// `scope: global` (DESIGN §4b): two gateways share one quota service; the second never
/// sees a bad answer, yet fails fast within a second of the first one's evidence (each
/// reports every 250 ms). With the service silent, each falls back to its own breaker.
#[test]
fn a_global_breaker_is_shared_by_the_fleet_and_falls_back_when_the_service_is_silent() {
    let document = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, min_calls: 4, open_seconds: 30, scope: global}\nglobal: {cluster: \"127.0.0.1:18081\"}\n";
    for profile in HostProfile::ALL {
        let quota = Rc::new(RefCell::new(MemoryQuota::new()));
        let mut a = sim(profile, document, 1).sharing_quota(Rc::clone(&quota));
        let mut b = sim(profile, document, 1).sharing_quota(Rc::clone(&quota));
        for gateway in [&mut a, &mut b] {
            gateway.advance(Duration::from_secs(1));
        }
        // B's calls are all good; A's mostly fail: 4 failed of 6 over the fleet.
        assert!(call(&mut b, 0, "/pay", 200, Duration::from_millis(1)));
        assert!(call(&mut b, 0, "/pay", 200, Duration::from_millis(1)));
        for _ in 0..4 {
            assert!(call(&mut a, 0, "/pay", 502, Duration::from_millis(1)));
        }
        let evidence = a.now();
        while !fast_failed(&send(&mut b, 0, "/pay").1) {
            for gateway in [&mut a, &mut b] {
                gateway.advance(Duration::from_millis(10));
            }
            let waited = b.now().saturating_since(evidence);
            assert!(
                waited < Nanos::from_secs(1),
                "{}: B did not follow the fleet within a second",
                profile.name
            );
        }
        // The service goes silent: after the fleet's state is no longer trusted, B decides
        // with its own breaker again (its window holds only good calls: closed).
        b.set_service(Service::Down(Nanos::from_millis(5)));
        b.advance(Duration::from_secs(5));
        let (_, fate) = send(&mut b, 0, "/pay");
        assert!(
            matches!(fate, Some(Fate::Admitted(_))),
            "{}: {fate:?}",
            profile.name
        );
        assert!(
            a.violations.is_empty() && b.violations.is_empty(),
            "{}",
            profile.name
        );
    }
}

/// A gateway with a breaker of `scope: global` reports to the quota service, and reads the
/// fleet's state back, four times a second on every host (the tick set once on nginx
/// included): the bound of "within a second" above. Without such a breaker, once a second
/// (the fleet view's own report).
#[test]
fn a_global_breaker_is_reported_every_quarter_second() {
    let global = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5, scope: global}\nglobal: {cluster: \"127.0.0.1:18081\"}\n";
    let local = "resources:\n  - Url: /pay\n    breaker: {name: pay, failure_ratio: 0.5}\nglobal: {cluster: \"127.0.0.1:18081\"}\n";
    for profile in HostProfile::ALL {
        for (document, expected) in [(global, 8), (local, 2)] {
            let mut sim = sim(profile, document, 1);
            sim.advance(Duration::from_secs(1));
            assert!(call(&mut sim, 0, "/pay", 200, Duration::from_millis(1)));
            sim.take_reports();
            sim.advance(Duration::from_secs(2));
            let reports = sim.take_reports();
            assert!(
                reports.len().abs_diff(expected) <= 1,
                "{}: {} reports in 2 s, expected {expected}",
                profile.name,
                reports.len()
            );
            let breakers = reports.iter().filter(|r| !r.breakers.is_empty()).count();
            assert_eq!(breakers, if expected == 8 { reports.len() } else { 0 });
        }
    }
}

/// The state gauge is one per gateway where the host shares metrics between workers: a
/// worker that made an earlier transition must not leave its older state in it after
/// another worker's later one. Here worker 1 makes open -> half-open and worker 0, later,
/// half-open -> closed; worker 1's metrics are flushed last.
#[test]
fn the_state_gauge_shows_the_latest_transition_whichever_worker_made_it() {
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, FAILING, 2);
        sim.advance(Duration::from_secs(1));
        for (worker, status) in [(0, 503), (0, 503), (0, 503), (0, 503)] {
            assert!(call(
                &mut sim,
                worker,
                "/pay",
                status,
                Duration::from_millis(5)
            ));
        }
        sim.advance(Duration::from_millis(3_100));
        let (first, one) = send(&mut sim, 1, "/pay");
        let (second, two) = send(&mut sim, 0, "/pay");
        assert!(
            matches!(
                (&one, &two),
                (Some(Fate::Admitted(_)), Some(Fate::Admitted(_)))
            ),
            "{}: two probes {one:?} {two:?}",
            profile.name
        );
        sim.respond(first, &[(":status", "200")]);
        sim.end(first);
        sim.respond(second, &[(":status", "200")]);
        sim.end(second);
        let (_, after) = send(&mut sim, 0, "/pay");
        assert!(
            matches!(after, Some(Fate::Admitted(_))),
            "{}: closed after two good probes: {after:?}",
            profile.name
        );
        sim.advance(Duration::from_secs(1));
        sim.flush_metrics();
        assert_eq!(
            sim.host.metric("diana_breaker_state.pay"),
            0,
            "{}: the gauge after half-open -> closed",
            profile.name
        );
    }
}
