//! The worker's part of the fleet view (issue 43, "See the flood"): what this worker saw
//! since its previous report, for the quota service's `GET /v1/view` and `/ui`.
//!
//! ```text
//!   a request decided ──▶ per rule: admitted / limited / dry-run limited
//!                         per-identity rule: its identity as shown, into the sketch of
//!                         the limited or of the admitted
//!   a request evaluated ─▶ its longest matched resource, into the paths' sketch
//!   the tick ────────────▶ the report's rules and paths (then everything is forgotten)
//! ```
//!
//! **On only when the document writes a `global` section** (it names a quota service to
//! report to), also when every rule is local. Off, the engine holds no view and a request
//! pays nothing for it.
//!
//! **Memory is fixed whatever clients send**: per per-identity rule two Space-Saving
//! sketches ([`crate::hot::SpaceSaving`]) of `max(4 × top, 16)` counters, at most
//! [`MAX_TOP`] (so a summary never lists more than a report may carry), `top` the rule's
//! `hot.top` (10 by default); one sketch of the paths of [`PATHS_CAPACITY`] counters; three
//! counts per rule. Four times `top` counters so that the `top` the page lists are close to
//! exact: every count is at most `N / (4 × top)` above the truth (`N` the list's total),
//! and any identity heavier than that is listed.
//!
//! **What it costs a request** when on: a sketch update per per-identity rule decided (the
//! identity shown is read only then: the header or claim's value copied, or under `hot:
//! {show: digest}` the identity's keyed hash written in hex), one for its path, and three
//! counter increments; each an `O(log m)` heap step and a hash-table probe.
//!
//! **Best effort**: the counts a report carries are forgotten when it is sent; a report
//! lost or refused loses them (the breakers' part of the report is restored, this is not).
//! Rules whose counts do not fit a report ([`crate::report::MAX_RULES`]) are dropped, the
//! least limited first; hot lists that do not fit its size ([`ReportRequest::fit`]) too.
//!
//! [`ReportRequest::fit`]: crate::report::ReportRequest::fit

use crate::actor::Identity;
use crate::config::{HotShow, Policy, Rule, DEFAULT_HOT_TOP};
use crate::hot::{Label, SpaceSaving, Summary};
use crate::metrics::RuleEvent;
use crate::report::{RuleLine, MAX_RULES, MAX_TOP};
use crate::time::{Instant, Nanos};

/// Counters of the paths' sketch: as many as a report may list.
pub(crate) const PATHS_CAPACITY: usize = MAX_TOP;

/// The least time between two reports that carry only the view (with breakers of `scope:
/// global` a report goes at every tick, and carries the view too): the worker's base tick.
pub(crate) const REPORT_EVERY: Nanos = Nanos::from_secs(1);

/// The counters of a rule's sketches for `hot.top` = `top`.
pub(crate) fn capacity(top: usize) -> usize {
    // 16 ≤ MAX_TOP: clamp cannot panic.
    top.saturating_mul(4).clamp(16, MAX_TOP)
}

/// One rule's part.
#[derive(Debug)]
struct RuleView {
    admitted: u64,
    limited: u64,
    dry_run_limited: u64,
    /// Per-identity rules only: the identities of the limited and of the admitted.
    hot: Option<Box<HotPair>>,
}

#[derive(Debug)]
struct HotPair {
    limited: SpaceSaving,
    admitted: SpaceSaving,
}

/// One worker's view (see the module's docs).
#[derive(Debug)]
pub(crate) struct View {
    /// By [`Rule::index`].
    rules: Vec<RuleView>,
    paths: SpaceSaving,
    /// Each resource's `Url` as a label, by its index in [`Policy::resources`] (made once).
    path_labels: Vec<Label>,
    /// When the counts now held began: the previous report, else the first request or tick.
    since: Option<Instant>,
}

/// What one report carries of the view.
#[derive(Debug)]
pub(crate) struct Taken {
    pub rules: Vec<RuleLine>,
    pub paths: Option<Summary>,
}

impl View {
    /// The view of `policy`, or `None` when its document names no quota service.
    pub(crate) fn of(policy: &Policy) -> Option<View> {
        if !policy.global.written {
            return None;
        }
        let rules = policy
            .rules()
            .map(|rule| RuleView {
                admitted: 0,
                limited: 0,
                dry_run_limited: 0,
                hot: shows_identities(rule).then(|| {
                    let top = rule.hot.map_or(DEFAULT_HOT_TOP, |hot| hot.top);
                    let capacity = capacity(usize::from(top.get()));
                    Box::new(HotPair {
                        limited: SpaceSaving::new(capacity),
                        admitted: SpaceSaving::new(capacity),
                    })
                }),
            })
            .collect();
        Some(View {
            rules,
            paths: SpaceSaving::new(PATHS_CAPACITY),
            path_labels: policy
                .resources
                .iter()
                .map(|resource| Label::new(resource.url.as_bytes()))
                .collect(),
            since: None,
        })
    }

    /// True when `rule` keeps hot lists: the request's identity as shown is wanted.
    pub(crate) fn wants_identity(&self, rule: usize) -> bool {
        self.rules.get(rule).is_some_and(|view| view.hot.is_some())
    }

    /// A request matched the resource at `resource` (its longest match), at `now`.
    pub(crate) fn path(&mut self, resource: usize, now: Instant) {
        self.since.get_or_insert(now);
        if let Some(label) = self.path_labels.get(resource) {
            self.paths.add_label(*label, 1);
        }
    }

    /// `rule` decided `event` for a request whose identity shows as `shown` (none: a rule
    /// for everyone, or a request without an identity of its own).
    pub(crate) fn record(
        &mut self,
        rule: usize,
        event: RuleEvent,
        shown: Option<Label>,
        now: Instant,
    ) {
        self.since.get_or_insert(now);
        let Some(view) = self.rules.get_mut(rule) else {
            return;
        };
        let sketch = match event {
            RuleEvent::Allowed => {
                view.admitted = view.admitted.saturating_add(1);
                view.hot.as_mut().map(|hot| &mut hot.admitted)
            }
            RuleEvent::Limited => {
                view.limited = view.limited.saturating_add(1);
                view.hot.as_mut().map(|hot| &mut hot.limited)
            }
            // Nobody was turned away: not among the limited identities.
            RuleEvent::DryRunLimited => {
                view.dry_run_limited = view.dry_run_limited.saturating_add(1);
                None
            }
        };
        if let (Some(sketch), Some(label)) = (sketch, shown) {
            sketch.add_label(label, 1);
        }
    }

    /// When the counts now held began (the previous report, else the first request or tick).
    pub(crate) fn since(&self) -> Option<Instant> {
        self.since
    }

    /// True when a report is due for the view alone at `now` ([`REPORT_EVERY`]).
    pub(crate) fn due(&mut self, now: Instant) -> bool {
        let since = *self.since.get_or_insert(now);
        now.saturating_since(since) >= REPORT_EVERY
    }

    /// Everything counted, as a report's `rules` and `paths` (`names`: each rule's name in
    /// the report, by index), and forgotten: the next counts begin at `now`.
    pub(crate) fn take<'p>(
        &mut self,
        rules: impl Iterator<Item = &'p Rule>,
        now: Instant,
    ) -> Taken {
        let mut lines: Vec<RuleLine> = Vec::new();
        for (rule, view) in rules.zip(self.rules.iter_mut()) {
            if view.admitted == 0 && view.limited == 0 && view.dry_run_limited == 0 {
                continue;
            }
            let summary = |sketch: &mut SpaceSaving| {
                let summary = (sketch.total() > 0).then(|| sketch.summary());
                sketch.clear();
                summary
            };
            let (hot_limited, hot_admitted) = match view.hot.as_deref_mut() {
                Some(hot) => (summary(&mut hot.limited), summary(&mut hot.admitted)),
                None => (None, None),
            };
            lines.push(RuleLine {
                name: rule.metric_name.clone(),
                admitted: std::mem::take(&mut view.admitted),
                limited: std::mem::take(&mut view.limited),
                dry_run_limited: std::mem::take(&mut view.dry_run_limited),
                hot_limited,
                hot_admitted,
            });
        }
        if lines.len() > MAX_RULES {
            // The rules the flood is about first: the most limited, then the busiest.
            lines.sort_by(|a, b| {
                (b.limited, b.dry_run_limited, b.admitted).cmp(&(
                    a.limited,
                    a.dry_run_limited,
                    a.admitted,
                ))
            });
            lines.truncate(MAX_RULES);
        }
        let paths = (self.paths.total() > 0).then(|| self.paths.summary());
        self.paths.clear();
        self.since = Some(now);
        Taken {
            rules: lines,
            paths,
        }
    }

    /// The counters one rule's sketches have (tests: fixed whatever was sent).
    #[cfg(test)]
    pub(crate) fn sketch_sizes(&self, rule: usize) -> Option<(usize, usize)> {
        let hot = self.rules.get(rule)?.hot.as_ref()?;
        Some((hot.limited.capacity(), hot.admitted.capacity()))
    }
}

/// True when `rule` counts identities one by one (its actor is not `all`).
pub(crate) fn shows_identities(rule: &Rule) -> bool {
    !rule.actor.is_single_counter()
}

/// The label of a request's identity under `rule`, as the rule's `hot.show` says: the
/// value read (its first 64 bytes), or the identity's keyed hash in hex. `None` for a
/// request without an identity of its own (it shares one counter with its kind).
pub(crate) fn shown(rule: &Rule, identity: &Identity, value: Option<&[u8]>) -> Option<Label> {
    let Identity::Key(hash) = identity else {
        return None;
    };
    match rule.hot.map_or(HotShow::default(), |hot| hot.show) {
        HotShow::Value => value.map(Label::new),
        HotShow::Digest => {
            let mut hex = [0u8; 16];
            for (at, digit) in hex.iter_mut().enumerate() {
                let nibble = (hash >> (60 - 4 * at)) & 0xf;
                *digit = b"0123456789abcdef"
                    .get(nibble as usize)
                    .copied()
                    .unwrap_or(b'0');
            }
            Some(Label::new(&hex))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_policy;
    use crate::time::NANOS_PER_SECOND;

    const T0: Instant = Instant::from_unix_nanos(1_767_225_601 * NANOS_PER_SECOND.get());

    fn policy(hot: &str, global: &str) -> Policy {
        let document = format!(
            "resources:\n  - Url: /\n    rules: [{{name: all, rpu: 9}}, {{name: dev, actor: device, rpu: 9{hot}}}]\n{global}"
        );
        parse_policy(&document).unwrap_or_else(|error| panic!("{error}"))
    }

    #[test]
    fn a_sketch_holds_four_times_top_within_bounds() {
        for (top, counters) in [(1, 16), (4, 16), (5, 20), (10, 40), (25, 100), (100, 100)] {
            assert_eq!(capacity(top), counters, "top {top}");
        }
    }

    #[test]
    fn on_only_with_a_global_section_and_hot_lists_only_per_identity() {
        assert!(View::of(&policy("", "")).is_none());
        let view = View::of(&policy(", hot: {top: 3}", "global: {cluster: q}\n")).unwrap();
        assert!(!view.wants_identity(0));
        assert!(view.wants_identity(1));
        assert_eq!(view.sketch_sizes(0), None);
        assert_eq!(view.sketch_sizes(1), Some((16, 16)));
        let view = View::of(&policy("", "global: {cluster: q}\n")).unwrap();
        assert_eq!(view.sketch_sizes(1), Some((40, 40)));
    }

    #[test]
    fn taking_reports_what_was_counted_once() {
        let policy = policy("", "global: {cluster: q}\n");
        let mut view = View::of(&policy).unwrap();
        let hot = Label::new(b"device-42");
        for _ in 0..3 {
            view.record(1, RuleEvent::Limited, Some(hot), T0);
        }
        view.record(1, RuleEvent::Allowed, Some(Label::new(b"device-7")), T0);
        view.record(1, RuleEvent::DryRunLimited, Some(hot), T0);
        view.record(0, RuleEvent::Allowed, None, T0);
        view.path(0, T0);
        let later = T0.saturating_add(Nanos::from_millis(1_500));
        assert!(view.due(later));
        let taken = view.take(policy.rules(), later);
        let [all, dev] = taken.rules.as_slice() else {
            panic!("{:?}", taken.rules);
        };
        assert_eq!(
            (all.admitted, all.limited, all.hot_limited.is_none()),
            (1, 0, true)
        );
        assert_eq!((dev.admitted, dev.limited, dev.dry_run_limited), (1, 3, 1));
        let limited = dev.hot_limited.as_ref().unwrap().top(usize::MAX);
        assert_eq!(limited.len(), 1);
        assert_eq!((limited[0].label, limited[0].count), (hot, 3));
        let paths = taken.paths.unwrap();
        assert_eq!(paths.top(1)[0].label.as_str(), "/");
        // Forgotten, and the next counts begin now.
        assert_eq!(view.since(), Some(later));
        assert!(!view.due(later));
        let again = view.take(policy.rules(), later);
        assert!(again.rules.is_empty() && again.paths.is_none());
    }
}
