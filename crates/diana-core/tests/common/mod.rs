//! What the property tests share.

use proptest::test_runner::Config as ProptestConfig;

/// `default` cases, or `PROPTEST_CASES` when set. Failures are not persisted to files:
/// each one found becomes a named regression test next to the code it concerns.
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
