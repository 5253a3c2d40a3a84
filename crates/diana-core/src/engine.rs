//! One request's evaluation: from the request's facts and the current time to a
//! [`Decision`] (admit, admit after a wait, reject, or ask the quota service first).
//!
//! Order of evaluation (DESIGN §4): matching resource blocks least specific first, rules in
//! document order; the first rule that denies ends the evaluation and later rules are not
//! charged. Local rules are charged as they come; global rules of the request are
//! collected and decided together in one callout after every local rule has admitted the
//! request (so a request rejected locally never costs a callout).

use crate::actor::{Identity, RequestFacts};
use crate::config::{Policy, Rule, Scope};
use crate::global::{GlobalRuleRef, Pending};
use crate::matching;
use crate::metrics::{Event, MetricSink, RuleEvent};
use crate::path;
use crate::response::{admitted_headers, Rejection, RuleReport};
use crate::store::{key_prefix, SharedData, SlotAddress, SlotTable, Store};
use crate::time::Nanos;

/// What the host must do with the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Let it through now, adding these headers to the response (`headers: all`).
    Allow {
        headers: Vec<(&'static str, String)>,
    },
    /// Let it through at `until` (leaky bucket): pause it and resume it then.
    Delay {
        until: Nanos,
        headers: Vec<(&'static str, String)>,
    },
    /// Answer with this local reply.
    Reject(Rejection),
    /// Send this callout to the quota service, pause the request, and hand the answer to
    /// [`Engine::complete_global`].
    Callout(Pending),
}

/// The immutable policy plus the per-VM machinery to evaluate it.
#[derive(Debug)]
pub struct Engine {
    policy: Policy,
    /// Index of each resource's first rule in the flat rule numbering used by metrics.
    offsets: Vec<usize>,
    /// Flat rule index → (resource, rule within it).
    flat: Vec<(usize, usize)>,
    /// Flat rule index → the rule's shared-data key prefix.
    key_prefixes: Vec<String>,
    /// Flat rule index → the prefix of the rule's lease-stash keys (global rules).
    lease_prefixes: Vec<String>,
    /// False when the only resource is `/`: every request matches, the path is not needed.
    needs_path: bool,
    store: Store,
    /// The host can pause a request and resume it later (Envoy: yes; nginx: no).
    can_pause: bool,
    /// This VM's recent reading of the circuit breaker (see [`crate::global`]).
    pub(crate) breaker: crate::global::BreakerCache,
}

/// What the local pass over the rules gathered so far.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// The admitted rule with the fewest remaining requests (for `headers: all`).
    pub tightest: Option<RuleReport>,
    /// Longest leaky-bucket wait among admitting rules.
    pub delay: Nanos,
}

impl Progress {
    pub(crate) fn admit(&mut self, report: RuleReport, delay: Nanos) {
        self.delay = self.delay.max(delay);
        if self
            .tightest
            .is_none_or(|tightest| report.remaining < tightest.remaining)
        {
            self.tightest = Some(report);
        }
    }
}

/// The outcome of charging one rule locally.
pub(crate) enum LocalOutcome {
    Admitted,
    Rejected(Rejection),
}

impl Engine {
    pub fn new(policy: Policy) -> Engine {
        let mut offsets = Vec::with_capacity(policy.resources.len());
        let mut flat = Vec::new();
        for (resource_index, resource) in policy.resources.iter().enumerate() {
            offsets.push(flat.len());
            flat.extend((0..resource.rules.len()).map(|rule| (resource_index, rule)));
        }
        let key_prefixes = policy
            .resources
            .iter()
            .flat_map(|resource| resource.rules.iter().map(|rule| key_prefix(rule.id)))
            .collect();
        let lease_prefixes = policy
            .resources
            .iter()
            .flat_map(|resource| resource.rules.iter())
            .map(|rule| match rule.scope {
                Scope::Global => crate::global::lease_key_prefix(rule.id),
                Scope::Local => String::new(),
            })
            .collect();
        let needs_path = !matches!(policy.resources.as_slice(), [only] if only.url == "/");
        Engine {
            policy,
            offsets,
            flat,
            key_prefixes,
            lease_prefixes,
            needs_path,
            store: Store::new(),
            can_pause: true,
            breaker: crate::global::BreakerCache::default(),
        }
    }

    /// Declares whether the host can pause and later resume a request. Without it, a
    /// local leaky-bucket wait becomes a rejection with `Retry-After` (nothing reserved),
    /// and global leaky-bucket rules use the quota service's wait endpoint.
    pub fn with_pausing(mut self, can_pause: bool) -> Engine {
        self.can_pause = can_pause;
        self
    }

    pub fn can_pause(&self) -> bool {
        self.can_pause
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Every rule in flat numbering (the index used by [`MetricSink::rule_event`]).
    pub fn rules(&self) -> impl Iterator<Item = &Rule> {
        self.policy.resources.iter().flat_map(|r| r.rules.iter())
    }

    /// False when every request matches the same rules whatever its path (the policy's
    /// only resource is `/`): the host may then skip reading `:path`.
    pub fn needs_path(&self) -> bool {
        self.needs_path
    }

    /// True when some rule is a leaky bucket (the host then needs a tick to resume waiters).
    pub fn has_waiting_rules(&self) -> bool {
        self.rules().any(|rule| rule.algo.code() == "LB")
    }

    /// True when some rule has global scope.
    pub fn has_global_rules(&self) -> bool {
        self.rules().any(|rule| rule.scope == Scope::Global)
    }

    /// Evaluates one request. `raw_path` is the `:path` pseudo-header as sent.
    pub fn evaluate(
        &self,
        host: &dyn SharedData,
        raw_path: &[u8],
        facts: &dyn RequestFacts,
        now: Nanos,
        metrics: &mut dyn MetricSink,
    ) -> Decision {
        let path = path::normalize(raw_path);
        let mut progress = Progress::default();
        let mut globals: Vec<GlobalRuleRef> = Vec::new();
        for (resource_index, resource) in matching::matching(&self.policy, &path) {
            let offset = self.offsets.get(resource_index).copied().unwrap_or(0);
            for (position, rule) in resource.rules.iter().enumerate() {
                let index = offset + position;
                let address = match rule.actor.identify(facts) {
                    Identity::Skip => continue,
                    Identity::Everyone => SlotAddress::single(),
                    Identity::Key(hash) => SlotAddress::of(hash, rule.slots.get()),
                };
                if rule.scope == Scope::Global {
                    globals.push(GlobalRuleRef { index, address });
                    continue;
                }
                if let LocalOutcome::Rejected(rejection) =
                    self.charge_locally(host, index, rule, address, now, &mut progress, metrics)
                {
                    return Decision::Reject(rejection);
                }
            }
        }
        if globals.is_empty() {
            return self.finish(progress, now);
        }
        crate::global::begin(self, host, globals, progress, now, metrics)
    }

    /// Charges `rule` in the process-wide local store. Store failures admit the request
    /// (a rate limiter must not fail requests because of its own bookkeeping) and are counted.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn charge_locally(
        &self,
        host: &dyn SharedData,
        index: usize,
        rule: &Rule,
        address: SlotAddress,
        now: Nanos,
        progress: &mut Progress,
        metrics: &mut dyn MetricSink,
    ) -> LocalOutcome {
        let table = SlotTable {
            key_prefix: self.key_prefixes.get(index).map_or("", String::as_str),
            algo: rule.algo,
            limit: &rule.limit,
            immediate_only: !self.can_pause,
        };
        match self.store.charge(host, &table, address, now, 1) {
            Err(error) => {
                log::warn!("diana: rule {}: {error}; request admitted", rule.name);
                metrics.event(Event::StoreError);
                LocalOutcome::Admitted
            }
            Ok(charge) => {
                if charge.collided {
                    metrics.event(Event::SlotCollision);
                }
                let report = RuleReport::new(rule, &charge.verdict);
                if charge.verdict.allowed() {
                    metrics.rule_event(index, RuleEvent::Allowed);
                    progress.admit(report, charge.verdict.delay);
                    LocalOutcome::Admitted
                } else {
                    self.deny(index, rule, &report, metrics)
                }
            }
        }
    }

    /// A rule said no: reject, unless the rule or the document is in dry run.
    pub(crate) fn deny(
        &self,
        index: usize,
        rule: &Rule,
        report: &RuleReport,
        metrics: &mut dyn MetricSink,
    ) -> LocalOutcome {
        if rule.dry_run || self.policy.dry_run {
            log::info!("diana: dry run: rule {} would reject", rule.name);
            metrics.rule_event(index, RuleEvent::DryRunLimited);
            return LocalOutcome::Admitted;
        }
        metrics.rule_event(index, RuleEvent::Limited);
        LocalOutcome::Rejected(Rejection::new(&self.policy.response, rule, report))
    }

    /// Every rule admitted: allow now or after the longest wait.
    pub(crate) fn finish(&self, progress: Progress, now: Nanos) -> Decision {
        let headers = admitted_headers(&self.policy.response, progress.tightest.as_ref());
        if progress.delay > 0 && self.can_pause {
            Decision::Delay {
                until: now.saturating_add(progress.delay),
                headers,
            }
        } else {
            Decision::Allow { headers }
        }
    }

    /// The rule at flat `index`.
    pub fn rule(&self, index: usize) -> Option<&Rule> {
        let &(resource, rule) = self.flat.get(index)?;
        self.policy.resources.get(resource)?.rules.get(rule)
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// The lease-stash key of one slot of a global rule (prefix computed once per rule).
    pub(crate) fn lease_key(&self, index: usize, slot: u32) -> String {
        crate::store::slot_key_in(
            self.lease_prefixes.get(index).map_or("", String::as_str),
            slot,
        )
    }

    /// Finishes a request paused for a callout (see [`crate::global`]).
    pub fn complete_global(
        &self,
        host: &dyn SharedData,
        pending: Pending,
        answer: Result<Vec<crate::global::wire::RuleResult>, crate::global::CalloutFailure>,
        now: Nanos,
        metrics: &mut dyn MetricSink,
    ) -> Decision {
        crate::global::complete(self, host, pending, answer, now, metrics)
    }
}

#[cfg(test)]
mod tests;
