//! Metric names and the events the engine reports. The glue defines one host metric per
//! name (`define_metric`); Envoy shows them under `wasmcustom.`. Names are listed in the
//! README. Rule names are sanitised to `[A-Za-z0-9_]` so any rule name is a valid stat name.

/// Per-rule counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RuleEvent {
    /// The rule admitted the request (it was charged).
    Allowed,
    /// The rule rejected the request.
    Limited,
    /// The rule would have rejected the request but is in dry run.
    DryRunLimited,
}

impl RuleEvent {
    pub const ALL: [RuleEvent; 3] = [
        RuleEvent::Allowed,
        RuleEvent::Limited,
        RuleEvent::DryRunLimited,
    ];

    fn suffix(self) -> &'static str {
        match self {
            RuleEvent::Allowed => "allowed",
            RuleEvent::Limited => "limited",
            RuleEvent::DryRunLimited => "dry_run_limited",
        }
    }
}

/// Per-breaker counters (DESIGN §4b), beside the state gauge ([`breaker_metric_name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerEvent {
    /// A request went to the breaker's upstream and its outcome was judged.
    Calls,
    /// ... and it was slow.
    Slow,
    /// ... and it failed (a failure status, a reset, a timeout).
    Failed,
    /// A request failed fast (answered, or sent to the fallback) while open or half-open.
    FastFailed,
    /// The breaker changed state (each transition once per gateway, by the worker that
    /// made it).
    Transitions,
}

impl BreakerEvent {
    pub const ALL: [BreakerEvent; 5] = [
        BreakerEvent::Calls,
        BreakerEvent::Slow,
        BreakerEvent::Failed,
        BreakerEvent::FastFailed,
        BreakerEvent::Transitions,
    ];

    fn suffix(self) -> &'static str {
        match self {
            BreakerEvent::Calls => "calls",
            BreakerEvent::Slow => "slow",
            BreakerEvent::Failed => "failed",
            BreakerEvent::FastFailed => "fast_failed",
            BreakerEvent::Transitions => "transitions",
        }
    }
}

/// The state gauge of a breaker: 0 closed, 1 open, 2 half-open.
pub const BREAKER_STATE: &str = "state";

/// `diana_breaker_<event>.<breaker>` (or `diana_breaker_state.<breaker>` for the gauge):
/// shown with a `breaker` label in Prometheus text, as the rules' with `rule`.
pub fn breaker_metric_name(breaker_stat_name: &str, family: &str) -> String {
    format!("diana_breaker_{family}.{breaker_stat_name}")
}

/// The label that carries the breaker of a breaker metric in Prometheus text.
pub const BREAKER_LABEL: &str = "breaker";

/// The `regex` of the Envoy `stats_config.stats_tags` entry (with `tag_name: breaker`)
/// for the breakers' metrics (see [`envoy_rule_tag_regex`]).
pub fn envoy_breaker_tag_regex() -> String {
    let mut families: Vec<&str> = BreakerEvent::ALL
        .iter()
        .map(|event| event.suffix())
        .collect();
    families.push(BREAKER_STATE);
    format!(
        r"^wasmcustom\.diana_breaker_(?:{})(\.([A-Za-z0-9_]+))$",
        families.join("|")
    )
}

impl BreakerEvent {
    /// Its metric family (`calls`, `slow`, …).
    pub fn family(self) -> &'static str {
        self.suffix()
    }
}

/// Process-wide counters and gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// Shared data failed; the request was admitted uncounted.
    StoreError,
    /// Other workers kept winning the compare-and-swap race; the request was rejected
    /// with `Retry-After: 1` rather than admitted uncounted.
    StoreContention,
    /// The host clock could not be read; the request was admitted, nothing written.
    ClockError,
    /// An identity was charged on a shared slot (both candidate slots busy).
    SlotCollision,
    /// A leaky-bucket request was paused to wait for its turn.
    Delayed,
    /// A paused request was abandoned (client went away) before its turn.
    DelayAbandoned,
    /// A callout to the quota service was sent.
    GlobalCallout,
    /// A callout failed (dispatch error, timeout, 5xx, unreadable body).
    GlobalError,
    /// Global rules were enforced locally because the quota service is unavailable.
    GlobalDegradedRequest,
    /// The quota service refused a request (4xx): decided locally, logged once.
    GlobalRefused,
    /// The quota service answered what was not asked (wrong count, a grant above the
    /// want, impossible values): not believed, decided locally, logged once.
    GlobalInvalidAnswer,
    /// A callout answered for a rule with `lease` > 1 (spare tokens were stashed).
    LeaseRefill,
    /// A global rule was answered from a cached denial, without a callout.
    CachedDenial,
    /// A request waited for another request's callout for the same rule and identity
    /// instead of making its own (single flight).
    GlobalCoalesced,
    /// A stash running low was refilled ahead by a call of the worker's own.
    RefillAhead,
    /// A release was sent for the call of a request that went away before its answer
    /// (the host dropped the answer), or whose answer was lost: what the service granted
    /// it goes back. Or one that gave back part of a rule's grant (a settled answer)
    /// was answered `released: true`.
    GlobalReleased,
    /// A settled request's tokens (`count: {status}` not counted, a reservation settled
    /// lower) went to this gateway's lease stash instead of back to the quota service:
    /// they came from the stash, its call carried no id, the release could not be sent,
    /// or the service gave nothing back (the call forgotten, unreachable).
    RefundStashed,
    /// A release could not be sent (more than 1,024 waited for the tick, or the host
    /// refused the call): what the service granted that call stays charged until its
    /// window or bucket moves on.
    ReleaseUnsent,
    /// A request's concurrency places at the quota service (one rule's) could not be given
    /// back: the queue of places waiting for the tick was full, the breaker kept global
    /// rules local, or the leave call failed. The service reclaims them 60–80 s after
    /// their last renewal; until then they count against the limit.
    PlacesUnreturned,
    /// A new configuration was applied (local or remote).
    ConfigReload,
    /// A configuration document was refused.
    ConfigRejected,
    /// The config center could not be reached or answered an error.
    ConfigFetchError,
    /// A report to the quota service (the fleet's breakers) went unanswered, or its answer
    /// was refused: its calls go into the next one.
    ReportFailed,
    /// A remote document was refused because the local document does not let it in
    /// (a pinned field changed, or a missing or bad signature: DESIGN §6).
    ConfigRemoteRefused,
    /// An answer's body gave the usage a rule charges (`response_cost.usage | json`): the
    /// request's charge was settled from it.
    UsageSettled,
    /// An answer's body was read to its end, or cut short, without a usable usage (none,
    /// malformed, not an integer, the stream cut before it): the request keeps what it
    /// took up front.
    UsageUnread,
}

impl Event {
    pub const ALL: [Event; 26] = [
        Event::StoreError,
        Event::StoreContention,
        Event::ClockError,
        Event::SlotCollision,
        Event::Delayed,
        Event::DelayAbandoned,
        Event::GlobalCallout,
        Event::GlobalError,
        Event::GlobalDegradedRequest,
        Event::GlobalRefused,
        Event::GlobalInvalidAnswer,
        Event::LeaseRefill,
        Event::CachedDenial,
        Event::GlobalCoalesced,
        Event::RefillAhead,
        Event::GlobalReleased,
        Event::ReleaseUnsent,
        Event::RefundStashed,
        Event::PlacesUnreturned,
        Event::ConfigReload,
        Event::ConfigRejected,
        Event::ConfigFetchError,
        Event::ConfigRemoteRefused,
        Event::ReportFailed,
        Event::UsageSettled,
        Event::UsageUnread,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Event::StoreError => "diana_store_errors",
            Event::StoreContention => "diana_store_contention",
            Event::ClockError => "diana_clock_errors",
            Event::SlotCollision => "diana_slot_collisions",
            Event::Delayed => "diana_delayed",
            Event::DelayAbandoned => "diana_delay_abandoned",
            Event::GlobalCallout => "diana_global_callouts",
            Event::GlobalError => "diana_global_errors",
            Event::GlobalDegradedRequest => "diana_global_degraded_requests",
            Event::GlobalRefused => "diana_global_refused",
            Event::GlobalInvalidAnswer => "diana_global_invalid_answers",
            Event::LeaseRefill => "diana_global_lease_refills",
            Event::CachedDenial => "diana_global_cached_denials",
            Event::GlobalCoalesced => "diana_global_coalesced",
            Event::RefillAhead => "diana_global_refills_ahead",
            Event::GlobalReleased => "diana_global_releases",
            Event::ReleaseUnsent => "diana_global_releases_unsent",
            Event::RefundStashed => "diana_global_refunds_stashed",
            Event::PlacesUnreturned => "diana_global_places_unreturned",
            Event::ConfigReload => "diana_config_reloads",
            Event::ConfigRejected => "diana_config_rejected",
            Event::ConfigFetchError => "diana_config_fetch_errors",
            Event::ConfigRemoteRefused => "diana_config_remote_refused",
            Event::ReportFailed => "diana_report_failures",
            Event::UsageSettled => "diana_usage_settled",
            Event::UsageUnread => "diana_usage_unread",
        }
    }
}

/// Gauge: 1 while the circuit breaker keeps global rules local, else 0.
pub const DEGRADED_GAUGE: &str = "diana_global_degraded";

/// The host metric name of a rule counter: `diana_rule_<event>.<rule>`, where `<rule>` is
/// the rule's [`stat_name`] (`Rule::metric_name`).
pub fn rule_metric_name(rule_stat_name: &str, event: RuleEvent) -> String {
    format!("diana_rule_{}.{}", event.suffix(), rule_stat_name)
}

/// The label that carries the rule of a rule counter in Prometheus text: in the filter's
/// own metrics path ([`prometheus_text`]) and in Envoy's `/stats/prometheus`
/// ([`envoy_rule_tag_regex`]).
pub const RULE_LABEL: &str = "rule";

/// The `regex` of the Envoy `stats_config.stats_tags` entry (with `tag_name: rule`) that
/// makes Envoy's `/stats/prometheus` show `diana_rule_allowed{rule="login_burst"}` rather
/// than one metric per rule. Envoy matches it against the full stat name
/// (`wasmcustom.diana_rule_allowed.login_burst`), removes the first capture group
/// (`.login_burst`) from the name and takes the second (`login_burst`) as the tag's value.
/// Envoy's text `/stats` keeps the full names.
pub fn envoy_rule_tag_regex() -> String {
    let events: Vec<&str> = RuleEvent::ALL.iter().map(|event| event.suffix()).collect();
    format!(
        r"^wasmcustom\.diana_rule_(?:{})(\.([A-Za-z0-9_]+))$",
        events.join("|")
    )
}

/// A rule name as it appears in metric names (see [`rule_metric_name`]): `/#0` (the first
/// rule of `/`) becomes `root_0`, `/api/v1#2` becomes `api_v1_2`, `login-burst` becomes
/// `login_burst`. Two rules whose names map to the same stat name are refused at load.
pub fn stat_name(rule_name: &str) -> String {
    let trimmed = rule_name.trim_start_matches('/');
    let named = if trimmed.is_empty() || trimmed.starts_with('#') {
        format!("root{trimmed}")
    } else {
        trimmed.to_string()
    };
    sanitize(&named)
}

/// Keeps `[A-Za-z0-9_]`, maps everything else to `_`, at most 64 bytes.
pub fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect()
}

/// The Prometheus text exposition of Diana's metrics, from `(host metric name, value,
/// is a gauge)`: a rule counter `diana_rule_allowed.login_burst` is written
/// `diana_rule_allowed{rule="login_burst"}`, so that one metric carries every rule.
pub fn prometheus_text<'a>(values: impl IntoIterator<Item = (&'a str, u64, bool)>) -> String {
    /// (family, is a gauge, samples by rule).
    type Family<'n> = (&'n str, bool, Vec<(Option<&'n str>, u64)>);
    let mut families: Vec<Family<'a>> = Vec::new();
    for (name, value, gauge) in values {
        let (family, rule) = match name.split_once('.') {
            Some((family, rule)) => (family, Some(rule)),
            None => (name, None),
        };
        match families.iter_mut().find(|(known, _, _)| *known == family) {
            Some((_, _, samples)) => samples.push((rule, value)),
            None => families.push((family, gauge, vec![(rule, value)])),
        }
    }
    let mut text = String::new();
    for (family, gauge, samples) in families {
        let kind = if gauge { "gauge" } else { "counter" };
        text.push_str(&format!("# TYPE {family} {kind}\n"));
        for (rule, value) in samples {
            let label = if family.starts_with("diana_breaker_") {
                BREAKER_LABEL
            } else {
                RULE_LABEL
            };
            match rule {
                Some(rule) => text.push_str(&format!("{family}{{{label}=\"{rule}\"}} {value}\n")),
                None => text.push_str(&format!("{family} {value}\n")),
            }
        }
    }
    text
}

/// Where the engine reports what happened.
pub trait MetricSink {
    /// `rule` is the rule's index in [`crate::engine::Engine::rules`].
    fn rule_event(&mut self, rule: usize, event: RuleEvent);
    fn event(&mut self, event: Event) {
        self.events(event, 1);
    }
    /// `count` occurrences of `event` at once (places counted by the place).
    fn events(&mut self, event: Event, count: u64);
    /// The quota service's outage switch opened (`true`) or closed (`false`): the
    /// [`DEGRADED_GAUGE`].
    fn degraded(&mut self, on: bool);
    /// `count` occurrences of a breaker's `event` (`breaker`: its index among the policy's
    /// breakers).
    fn breaker_event(&mut self, _breaker: usize, _event: BreakerEvent, _count: u64) {}
    /// A breaker's state as this worker last saw it: 0 closed, 1 open, 2 half-open.
    fn breaker_state(&mut self, _breaker: usize, _state: u8) {}
    /// A breaker changed state at `at`: the same value its log line is rendered from, for
    /// a host that keeps transitions as data (the simulated gateway of `diana simulate`).
    fn breaker_transition(
        &mut self,
        _breaker: usize,
        _at: crate::time::Instant,
        _transition: &crate::breaker::Transition,
    ) {
    }
}

/// A sink that drops everything.
#[derive(Debug, Default)]
pub struct NoMetrics;

impl MetricSink for NoMetrics {
    fn rule_event(&mut self, _rule: usize, _event: RuleEvent) {}
    fn events(&mut self, _event: Event, _count: u64) {}
    fn degraded(&mut self, _on: bool) {}
}

/// A sink that counts in memory, for tests and the CLI.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CountingMetrics {
    pub rules: std::collections::BTreeMap<(usize, &'static str), u64>,
    pub events: std::collections::BTreeMap<&'static str, u64>,
    pub degraded: bool,
    pub breakers: std::collections::BTreeMap<(usize, &'static str), u64>,
    pub breaker_states: std::collections::BTreeMap<usize, u8>,
}

impl CountingMetrics {
    pub fn rule(&self, rule: usize, event: RuleEvent) -> u64 {
        self.rules
            .get(&(rule, event.suffix()))
            .copied()
            .unwrap_or(0)
    }
    pub fn event_count(&self, event: Event) -> u64 {
        self.events.get(event.name()).copied().unwrap_or(0)
    }
    pub fn breaker(&self, breaker: usize, event: BreakerEvent) -> u64 {
        self.breakers
            .get(&(breaker, event.suffix()))
            .copied()
            .unwrap_or(0)
    }
}

impl MetricSink for CountingMetrics {
    fn rule_event(&mut self, rule: usize, event: RuleEvent) {
        *self.rules.entry((rule, event.suffix())).or_default() += 1;
    }
    fn events(&mut self, event: Event, count: u64) {
        *self.events.entry(event.name()).or_default() += count;
    }
    fn degraded(&mut self, on: bool) {
        self.degraded = on;
    }
    fn breaker_event(&mut self, breaker: usize, event: BreakerEvent, count: u64) {
        *self.breakers.entry((breaker, event.suffix())).or_default() += count;
    }
    fn breaker_state(&mut self, breaker: usize, state: u8) {
        self.breaker_states.insert(breaker, state);
    }
}

#[cfg(test)]
mod tests {
    use super::{envoy_rule_tag_regex, prometheus_text, rule_metric_name, stat_name, RuleEvent};

    #[test]
    fn rule_counters_become_one_family_with_a_rule_label() {
        let text = prometheus_text([
            ("diana_rule_allowed.root_0", 5, false),
            ("diana_rule_allowed.login", 1, false),
            ("diana_global_degraded", 0, true),
        ]);
        assert_eq!(
            text,
            "# TYPE diana_rule_allowed counter\ndiana_rule_allowed{rule=\"root_0\"} 5\ndiana_rule_allowed{rule=\"login\"} 1\n# TYPE diana_global_degraded gauge\ndiana_global_degraded 0\n"
        );
    }

    #[test]
    fn envoy_tag_regex_covers_every_rule_counter() {
        assert_eq!(
            envoy_rule_tag_regex(),
            r"^wasmcustom\.diana_rule_(?:allowed|limited|dry_run_limited)(\.([A-Za-z0-9_]+))$"
        );
        // Every rule counter, as Envoy names it, has the shape the regex expects: a family
        // the alternation lists, then `.` and a stat-safe rule name.
        for event in RuleEvent::ALL {
            let name = format!(
                "wasmcustom.{}",
                rule_metric_name(&stat_name("/api/v1#2"), event)
            );
            let (family, rule) = name.rsplit_once('.').expect("a rule suffix");
            assert_eq!(rule, "api_v1_2");
            assert!(
                family.starts_with("wasmcustom.diana_rule_")
                    && envoy_rule_tag_regex().contains(event.suffix()),
                "{name}"
            );
        }
    }

    #[test]
    fn rule_names_become_stat_safe() {
        for (name, expected) in [
            ("/#0", "root_0"),
            ("/sample#1", "sample_1"),
            ("/api/v1#2", "api_v1_2"),
            ("login-burst", "login_burst"),
            ("/", "root"),
        ] {
            assert_eq!(stat_name(name), expected);
        }
    }
}
