//! What the integration tests share.

use diana_core::time::Instant;
use diana_core::worker::sim::{Service, Sim};
use diana_core::worker::HostProfile;
use proptest::test_runner::Config as ProptestConfig;

/// `default` cases, or `PROPTEST_CASES` when set. Failures are not persisted to files:
/// each one found becomes a named regression test next to the code it concerns.
#[allow(dead_code)] // not every test binary runs properties
pub fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// A simulated gateway of `workers` workers under `profile`, running `document` from
/// `start` with `service` as its quota service. A document the worker refuses stops the
/// test at once: the scenario cannot even be set up.
#[allow(dead_code)] // not every test binary starts a simulated gateway
#[allow(clippy::panic)]
pub fn started_sim(
    profile: HostProfile,
    document: &str,
    workers: usize,
    service: Service,
    start: Instant,
) -> Sim {
    match Sim::new(profile, document, workers, service, start) {
        Ok(sim) => sim,
        Err(refused) => panic!("document refused: {refused}"),
    }
}
