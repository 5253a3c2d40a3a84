//! One request's evaluation, sequenced: from the request's facts and the current time to a
//! [`Decision`] (admit, admit after a wait, reject, or call the quota service first).
//!
//! Order (DESIGN §4): the matching resource blocks least specific first, rules in document
//! order, the first rule that denies ends the evaluation. Within that order the local
//! rules that never make a request wait are charged first, then the leaky buckets (whose
//! reserved turns are the only charges that cannot always be given back exactly), then the
//! global rules, all in one callout — so a request rejected locally never costs a callout.
//!
//! **A rejected request consumes nothing.** Every charge a rule makes is kept as a receipt;
//! when a later rule denies, each is given back ([`crate::store::Store::release`] for
//! local counters, the lease stash for leased global tokens), and the quota service
//! decides the global rules of one request all or nothing. Metrics follow the same rule:
//! `allowed` counts the rules of admitted requests only, `limited` the rule that rejected.

use crate::actor::{Identity, RequestFacts};
use crate::algo::inflight::RENEW_EVERY;
use crate::config::{PlanSource, Policy, Rule, Scope};
use crate::decision::{
    AfterResponse, Callout, Decision, Place, PlaceAt, Reply, Reserved, ResponseCharge,
};
use crate::global::debts::Debt;
use crate::global::flights::RiderId;
use crate::global::stash::StashReceipt;
use crate::global::wire::AcquireRequest;
use crate::global::{
    Admission, Asked, Denial, Global, GlobalCharge, Interpretation, Leave, Payment, Plan, Release,
    ServicePlace,
};
use crate::local::{Local, LocalCharge, Taken};
use crate::matching;
use crate::metrics::{Event, MetricSink, NoMetrics, RuleEvent};
use crate::path;
use crate::response::{admitted_rule_headers, Rejection, RuleReport};
use crate::settle::{settle, Settlement};
use crate::store::{ChargeError, SharedData, SlotAddress, SlotTable};
use crate::time::{ceil_seconds, ceil_seconds_at_least_one, Clock, Instant, Nanos};
use smallvec::SmallVec;

/// The rules of one request are few: these lists stay on the stack (no allocation on the
/// hot path).
type Few<T> = SmallVec<[T; 4]>;

/// What the engine answers: a [`Decision`] whose call carries the paused request's state.
pub type EngineDecision = Decision<Pending>;

/// A refill ahead in flight (see [`Engine::refill`]).
#[derive(Debug)]
pub(crate) struct Refill(Asked);

/// A paused request: what was charged so far, and what it waits for. Boxed: a decision
/// that admits at once (the hot path) is then a few words to move, not the paused
/// request's whole state.
#[derive(Debug)]
pub struct Pending(Box<PendingState>);

#[derive(Debug)]
struct PendingState {
    held: Few<Held>,
    progress: Progress,
    stage: Stage,
    /// Leaky-bucket rules whose turn is taken when the request may leave (see
    /// [`Engine::defer_turns`]).
    turns: Few<Turn>,
}

/// A leaky-bucket rule's turn, taken once the request's global rules are decided.
#[derive(Debug, Clone, Copy)]
struct Turn {
    rule: usize,
    address: SlotAddress,
    cost: u32,
}

impl Pending {
    fn new(held: Few<Held>, progress: Progress, stage: Stage, turns: Few<Turn>) -> Pending {
        Pending(Box::new(PendingState {
            held,
            progress,
            stage,
            turns,
        }))
    }
}

/// What a paused request waits for.
#[derive(Debug)]
enum Stage {
    /// The answer to its callout.
    Asked(Asked),
    /// Another request's callout for one of its global rules; then it plans again.
    Parked {
        charges: Few<GlobalCharge>,
        rider: RiderId,
    },
}

impl Pending {
    /// What the callout asked (for tests); `None` for a parked request.
    #[cfg(test)]
    pub(crate) fn asked(&self) -> Option<&Asked> {
        match &self.0.stage {
            Stage::Asked(asked) => Some(asked),
            Stage::Parked { .. } => None,
        }
    }

    /// The id under which a parked request is woken ([`Engine::next_woken`]).
    pub(crate) fn rider(&self) -> Option<RiderId> {
        match &self.0.stage {
            Stage::Asked(_) => None,
            Stage::Parked { rider, .. } => Some(*rider),
        }
    }
}

/// A local charge, kept until the request is decided.
#[derive(Debug)]
struct Held {
    rule: usize,
    address: SlotAddress,
    cost: u32,
    taken: Taken,
}

/// What the evaluation gathered so far.
#[derive(Debug, Default)]
struct Progress {
    /// The admitting rule with the fewest remaining requests (for `headers: all`).
    tightest: Option<(usize, RuleReport)>,
    /// Longest leaky-bucket wait among admitting rules.
    delay: Nanos,
    /// Rule metrics to report once the request is decided.
    tally: Few<(usize, RuleEvent)>,
    /// Response costs to charge once the upstream has answered (a `Vec`: rarely any, and
    /// an empty one is a word to move).
    after: Vec<ResponseCharge>,
    /// Concurrency places the quota service granted, held until the request ends.
    service_places: Vec<ServicePlace>,
}

impl Progress {
    fn admit(&mut self, index: usize, report: Option<RuleReport>, delay: Nanos) {
        self.delay = self.delay.max(delay);
        if let Some(report) = report {
            if self
                .tightest
                .is_none_or(|(_, tightest)| report.remaining < tightest.remaining)
            {
                self.tightest = Some((index, report));
            }
        }
        self.tally.push((index, RuleEvent::Allowed));
    }

    fn would_deny(&mut self, index: usize) {
        self.tally.push((index, RuleEvent::DryRunLimited));
    }

    fn apply(&mut self, outcomes: impl IntoIterator<Item = Admission>) {
        for outcome in outcomes {
            match outcome {
                Admission::Admitted {
                    index,
                    report,
                    delay,
                    place,
                } => {
                    self.admit(index, report, delay);
                    self.service_places.extend(place);
                }
                Admission::WouldDeny { index } => self.would_deny(index),
            }
        }
    }
}

/// The rules of one request, in charging order.
struct Applicable<'p> {
    local: Few<(&'p Rule, SlotAddress, u32)>,
    global: Few<GlobalCharge>,
    /// The rules with a response cost (rarely any).
    after: Vec<ResponseCharge>,
}

/// The plans of one request, each source read once (a rule with plans is several rules
/// reading the same header).
#[derive(Default)]
struct PlansRead<'p> {
    read: Few<(&'p PlanSource, Option<Vec<u8>>)>,
}

impl<'p> PlansRead<'p> {
    fn read(&mut self, by: &'p PlanSource, facts: &dyn RequestFacts) -> Option<&[u8]> {
        let at = match self.read.iter().position(|(source, _)| *source == by) {
            Some(at) => at,
            None => {
                self.read.push((by, by.read(facts)));
                self.read.len() - 1
            }
        };
        self.read.get(at).and_then(|(_, value)| value.as_deref())
    }
}

/// The immutable policy plus the per-VM machinery to evaluate it.
#[derive(Debug)]
pub struct Engine {
    policy: Policy,
    /// False when the only resource is `/`: every request matches, the path is not needed.
    needs_path: bool,
    /// The host can pause a request and resume it later (Envoy: yes; nginx: no).
    can_pause: bool,
    local: Local,
    global: Global,
}

impl Engine {
    pub fn new(policy: Policy) -> Engine {
        let needs_path = !matches!(policy.resources.as_slice(), [only] if only.url == "/");
        let global = Global::new(&policy, true);
        Engine {
            policy,
            needs_path,
            can_pause: true,
            local: Local::new(),
            global,
        }
    }

    /// Declares whether the host can pause and later resume a request. Without it, a
    /// local leaky-bucket wait becomes a rejection with `Retry-After` (nothing reserved),
    /// and global leaky-bucket rules use the quota service's wait endpoint.
    pub fn with_pausing(mut self, can_pause: bool) -> Engine {
        self.can_pause = can_pause;
        self.global = Global::new(&self.policy, can_pause);
        self
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Every rule, in [`Rule::index`] order (the index of [`MetricSink::rule_event`]).
    pub fn rules(&self) -> impl Iterator<Item = &Rule> {
        self.policy.rules()
    }

    /// False when every request matches the same rules whatever its path (the policy's
    /// only resource is `/`): the host may then skip reading `:path`.
    pub(crate) fn needs_path(&self) -> bool {
        self.needs_path
    }

    /// True when `raw_path` (query ignored) is the policy's `metrics.path`: the host answers
    /// with its metrics instead of evaluating the request.
    pub(crate) fn serves_metrics(&self, raw_path: &[u8]) -> bool {
        self.policy
            .metrics
            .as_ref()
            .is_some_and(|spec| path::normalize(raw_path).as_ref() == spec.path.as_bytes())
    }

    /// Evaluates one request. `raw_path` is the `:path` pseudo-header as sent; the clock is
    /// read only when some rule applies, and when it cannot be read the request is admitted
    /// and nothing is written (a broken clock must not rewrite counters near the epoch).
    pub fn evaluate(
        &self,
        host: &dyn SharedData,
        raw_path: &[u8],
        facts: &dyn RequestFacts,
        clock: impl Clock,
        metrics: &mut dyn MetricSink,
    ) -> EngineDecision {
        let applicable = self.applicable(raw_path, facts);
        if applicable.local.is_empty() && applicable.global.is_empty() {
            return Decision::Allow {
                headers: Vec::new(),
                after: None,
            };
        }
        let Some(now) = clock.now() else {
            metrics.event(Event::ClockError);
            return Decision::Allow {
                headers: Vec::new(),
                after: None,
            };
        };
        let mut progress = Progress {
            after: applicable.after,
            ..Progress::default()
        };
        let mut held = Few::new();
        for &(rule, address, cost) in &applicable.local {
            if let Err(rejection) = self.charge_locally(
                host,
                rule,
                address,
                cost,
                now,
                &mut progress,
                &mut held,
                metrics,
            ) {
                return self.reject(host, held, progress, rejection, now, metrics);
            }
        }
        if applicable.global.is_empty() {
            return self.finish(progress, &held, now, metrics);
        }
        let turns = Few::new();
        self.decide_globally(host, applicable.global, held, progress, turns, now, metrics)
    }

    /// The request waits for the quota service (its call, or another request's): the
    /// leaky-bucket turns it took are given back, to be taken again when it may leave.
    /// A turn kept across the wait would be spent while the request waits: with a 40 ms
    /// call, a request of a 10/s bucket served from the stash right after would reach
    /// the upstream 60 ms after this one.
    fn defer_turns(
        &self,
        host: &dyn SharedData,
        held: &mut Few<Held>,
        progress: &mut Progress,
        turns: &mut Few<Turn>,
        now: Instant,
    ) {
        let waits = |index: usize| self.policy.rule(index).is_some_and(|r| r.algo.waits());
        if !held.iter().any(|held| waits(held.rule)) {
            return;
        }
        let (deferred, kept): (Few<Held>, Few<Held>) =
            held.drain(..).partition(|held| waits(held.rule));
        *held = kept;
        self.give_back_held(host, &deferred, now, &mut NoMetrics);
        turns.extend(deferred.iter().map(|held| Turn {
            rule: held.rule,
            address: held.address,
            cost: held.cost,
        }));
        progress.tally.retain(|(index, _)| !waits(*index));
        if progress
            .tightest
            .as_ref()
            .is_some_and(|(index, _)| waits(*index))
        {
            progress.tightest = None;
        }
        progress.delay = Nanos::ZERO;
    }

    /// Takes the deferred leaky-bucket turns of a request that may leave now.
    fn take_turns(
        &self,
        host: &dyn SharedData,
        turns: &[Turn],
        held: &mut Few<Held>,
        progress: &mut Progress,
        now: Instant,
        metrics: &mut dyn MetricSink,
    ) -> Result<(), Rejection> {
        for turn in turns {
            let Some(rule) = self.policy.rule(turn.rule) else {
                continue;
            };
            self.charge_locally(
                host,
                rule,
                turn.address,
                turn.cost,
                now,
                progress,
                held,
                metrics,
            )?;
        }
        Ok(())
    }

    /// The global half of an evaluation: the local rules have admitted (`held`).
    #[allow(clippy::too_many_arguments)]
    fn decide_globally(
        &self,
        host: &dyn SharedData,
        charges: Few<GlobalCharge>,
        mut held: Few<Held>,
        mut progress: Progress,
        mut turns: Few<Turn>,
        now: Instant,
        metrics: &mut dyn MetricSink,
    ) -> EngineDecision {
        let plan = self.global.plan(host, &self.policy, &charges, now, metrics);
        if matches!(plan, Plan::Park(_) | Plan::Call { .. }) {
            self.defer_turns(host, &mut held, &mut progress, &mut turns, now);
        }
        match plan {
            Plan::Done(outcomes) => {
                progress.apply(outcomes);
                self.finish(progress, &held, now, metrics)
            }
            Plan::Rejected(denial, outcomes) => {
                progress.apply(outcomes);
                let rejection = self.denial(denial, &mut progress);
                self.reject(host, held, progress, rejection, now, metrics)
            }
            Plan::Degrade {
                outcomes,
                local,
                served,
            } => {
                progress.apply(outcomes);
                metrics.event(Event::GlobalDegradedRequest);
                self.degrade(host, local, &served, held, progress, now, metrics)
            }
            Plan::Park(rider) => Decision::Wait(Pending::new(
                held,
                progress,
                Stage::Parked { charges, rider },
                turns,
            )),
            Plan::Call {
                outcomes,
                callout,
                asked,
            } => {
                progress.apply(outcomes);
                let pending = Pending::new(held, progress, Stage::Asked(asked), turns);
                Decision::Call(callout, pending)
            }
        }
    }

    /// Plans a woken request again ([`Engine::next_woken`]): its flight has landed, so its
    /// global rules are likely served from the lease stash now.
    pub(crate) fn resume(
        &self,
        host: &dyn SharedData,
        pending: Pending,
        now: Option<Instant>,
        metrics: &mut dyn MetricSink,
    ) -> EngineDecision {
        let PendingState {
            mut held,
            mut progress,
            stage,
            turns,
        } = *pending.0;
        match stage {
            Stage::Parked { charges, rider } => {
                self.global.replanning(rider);
                let Some(now) = now else {
                    metrics.event(Event::ClockError);
                    return Decision::Allow {
                        headers: Vec::new(),
                        after: None,
                    };
                };
                if let Err(rejection) =
                    self.take_turns(host, &turns, &mut held, &mut progress, now, metrics)
                {
                    return self.reject(host, held, progress, rejection, now, metrics);
                }
                let turns = Few::new();
                self.decide_globally(host, charges, held, progress, turns, now, metrics)
            }
            stage @ Stage::Asked(_) => {
                let pending = Pending::new(held, progress, stage, turns);
                self.complete(host, pending, Reply::NoAnswer, now, metrics)
            }
        }
    }

    /// Flights whose answer is overdue (their request vanished unannounced) are treated as
    /// landed: their riders are woken. Called from the host's tick while
    /// [`Engine::has_riders`], before [`Engine::next_woken`].
    pub(crate) fn land_overdue(&self, now: Option<Instant>) {
        if let Some(now) = now {
            self.global.land_overdue(now);
        }
    }

    /// The next parked request to [`Engine::resume`], in the order they parked: one at a
    /// time, each resumed before the next is taken (see
    /// [`crate::global::flights::Flights::next_woken`]).
    pub(crate) fn next_woken(&self) -> Option<RiderId> {
        self.global.next_woken()
    }

    /// Every parked request to resume, at once (tests).
    #[cfg(test)]
    pub(crate) fn woken(&self, now: Option<Instant>) -> Vec<RiderId> {
        self.land_overdue(now);
        std::iter::from_fn(|| self.next_woken()).collect()
    }

    /// True when requests are parked behind another request's callout.
    pub(crate) fn has_riders(&self) -> bool {
        self.global.has_riders()
    }

    /// True when requests parked behind a callout that landed wait to be served
    /// ([`Engine::next_woken`]).
    pub(crate) fn has_woken_riders(&self) -> bool {
        self.global.has_woken_riders()
    }

    /// A paused request is gone (its client went away) and the answer to its call will
    /// never be read: what it had charged is given back, the requests parked behind its
    /// callout plan again, and the call that releases what the service granted it is
    /// returned, to send (see [`crate::global::Global::abandon_call`]).
    pub(crate) fn abandon(
        &self,
        host: &dyn SharedData,
        pending: Pending,
        now: Option<Instant>,
    ) -> Option<Release> {
        let now = now?;
        let PendingState { held, stage, .. } = *pending.0;
        let release = match stage {
            Stage::Asked(asked) => self.global.abandon_call(host, &self.policy, asked, now),
            Stage::Parked { rider, .. } => {
                self.global.leave(rider);
                None
            }
        };
        self.give_back_held(host, &held, now, &mut NoMetrics);
        release
    }

    /// A release sent by [`Engine::abandon`]'s caller was answered.
    pub(crate) fn released(&self, host: &dyn SharedData, release: &Release) {
        self.global.released(host, &self.policy, release);
    }

    /// The answer to the call of a request that is gone (see [`Engine::abandon`] for one
    /// whose answer will never come): what the service granted serves later requests from
    /// the lease stash, and what the request held goes back.
    pub(crate) fn complete_for_nobody(
        &self,
        host: &dyn SharedData,
        pending: Pending,
        reply: Reply,
        now: Option<Instant>,
        metrics: &mut dyn MetricSink,
    ) {
        let PendingState { held, stage, .. } = *pending.0;
        let Some(now) = now else {
            // Without a clock nothing is written; the call is settled all the same.
            metrics.event(Event::ClockError);
            // The answer came: the service keeps what it granted (unspent, as when a
            // clock-less gateway is answered); there is nothing to release.
            match stage {
                Stage::Asked(asked) => {
                    let _ = self
                        .global
                        .abandon_call(host, &self.policy, asked, Instant::EPOCH);
                }
                Stage::Parked { rider, .. } => self.global.leave(rider),
            }
            return;
        };
        match stage {
            Stage::Asked(asked) => {
                self.global
                    .interpret_for_nobody(host, &self.policy, asked, reply, now, metrics)
            }
            Stage::Parked { rider, .. } => self.global.leave(rider),
        }
        self.give_back_held(host, &held, now, &mut NoMetrics);
    }

    /// Finishes a request paused for a callout, with the host's account of the call.
    pub fn complete(
        &self,
        host: &dyn SharedData,
        pending: Pending,
        reply: Reply,
        now: Option<Instant>,
        metrics: &mut dyn MetricSink,
    ) -> EngineDecision {
        let PendingState {
            mut held,
            mut progress,
            stage,
            turns,
        } = *pending.0;
        let asked = match stage {
            Stage::Asked(asked) => asked,
            stage @ Stage::Parked { .. } => {
                let pending = Pending::new(held, progress, stage, turns);
                return self.resume(host, pending, now, metrics);
            }
        };
        let Some(now) = now else {
            // Admitted, as without a clock anywhere; the call is settled all the same (its
            // flight lands, the requests parked behind it plan again).
            metrics.event(Event::ClockError);
            self.global
                .abandon_call(host, &self.policy, asked, Instant::EPOCH);
            return Decision::Allow {
                headers: Vec::new(),
                after: None,
            };
        };
        if let Err(rejection) =
            self.take_turns(host, &turns, &mut held, &mut progress, now, metrics)
        {
            // The request cannot leave within its wait: what the service granted serves
            // later requests.
            self.global
                .interpret_for_nobody(host, &self.policy, asked, reply, now, metrics);
            return self.reject(host, held, progress, rejection, now, metrics);
        }
        match self
            .global
            .interpret(host, &self.policy, asked, reply, now, metrics)
        {
            Interpretation::Done(outcomes) => {
                progress.apply(outcomes);
                self.finish(progress, &held, now, metrics)
            }
            Interpretation::Rejected(denial, outcomes) => {
                progress.apply(outcomes);
                let rejection = self.denial(denial, &mut progress);
                self.reject(host, held, progress, rejection, now, metrics)
            }
            Interpretation::Degrade { local, served } => {
                self.degrade(host, local, &served, held, progress, now, metrics)
            }
        }
    }

    /// The rules that apply to a request, each with its identity and cost, in charging
    /// order (see the module docs).
    fn applicable(&self, raw_path: &[u8], facts: &dyn RequestFacts) -> Applicable<'_> {
        let path = if self.needs_path {
            path::normalize(raw_path)
        } else {
            std::borrow::Cow::Borrowed(&b"/"[..])
        };
        let mut applicable = Applicable {
            local: Few::new(),
            global: Few::new(),
            after: Vec::new(),
        };
        let mut waiting: Few<(&Rule, SlotAddress, u32)> = Few::new();
        let mut plans = PlansRead::default();
        for (_, resource) in matching::matching(&self.policy, &path) {
            for rule in &resource.rules {
                if let Some(choice) = &rule.plan {
                    if !choice.selects(plans.read(&choice.by, facts)) {
                        continue;
                    }
                }
                let address = match rule.identify(facts) {
                    Identity::Skip => continue,
                    Identity::Everyone => SlotAddress::single(),
                    Identity::Key(hash) => SlotAddress::of(hash, rule.slots.get()),
                };
                let cost = rule.upfront().of(facts);
                if let Some(header) = rule.answer_header() {
                    applicable.after.push(ResponseCharge {
                        rule: rule.index,
                        header: header.to_string(),
                        address,
                        upfront: cost,
                        reserved: Reserved::Nothing,
                    });
                }
                match rule.scope {
                    Scope::Global => applicable.global.push(GlobalCharge {
                        index: rule.index,
                        address,
                        cost,
                    }),
                    Scope::Local if rule.algo.waits() => waiting.push((rule, address, cost)),
                    Scope::Local => applicable.local.push((rule, address, cost)),
                }
            }
        }
        applicable.local.extend(waiting);
        applicable
    }

    fn table<'r>(&self, rule: &'r Rule) -> SlotTable<'r> {
        SlotTable {
            key_prefix: &rule.keys.slots,
            generation: rule.keys.generation,
            algo: rule.algo,
            limit: &rule.limit,
            max_delay: if self.can_pause {
                rule.max_wait
            } else {
                Nanos::ZERO
            },
        }
    }

    /// Charges `rule` in the process-wide local store; a denial is the rejection to send.
    #[allow(clippy::too_many_arguments)]
    fn charge_locally(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        address: SlotAddress,
        cost: u32,
        now: Instant,
        progress: &mut Progress,
        held: &mut Few<Held>,
        metrics: &mut dyn MetricSink,
    ) -> Result<(), Rejection> {
        let table = self.table(rule);
        match self.local.charge(host, &table, rule, address, cost, now) {
            Err(ChargeError::Host(error)) => {
                // The host store itself failed: a defined behaviour, admit uncounted.
                log::warn!("diana: rule {}: {error}; request admitted", rule.name);
                metrics.event(Event::StoreError);
                Ok(())
            }
            Err(ChargeError::Contention) => {
                metrics.event(Event::StoreContention);
                let report = RuleReport {
                    limit: rule.limit.rpu.get(),
                    remaining: 0,
                    reset_seconds: 1,
                    retry_after_seconds: 1,
                };
                progress.tally.push((rule.index, RuleEvent::Limited));
                Err(Rejection::new(&self.policy.response, rule, &report))
            }
            Ok(LocalCharge::Admitted {
                taken,
                remaining,
                reset,
                delay,
                collided,
            }) => {
                if collided {
                    metrics.event(Event::SlotCollision);
                }
                held.push(Held {
                    rule: rule.index,
                    address,
                    cost,
                    taken,
                });
                let report = RuleReport {
                    limit: rule.limit.rpu.get(),
                    remaining,
                    reset_seconds: ceil_seconds(reset),
                    retry_after_seconds: 1,
                };
                progress.admit(rule.index, Some(report), delay);
                Ok(())
            }
            Ok(LocalCharge::Denied {
                retry_after,
                remaining,
                reset,
                collided,
            }) => {
                if collided {
                    metrics.event(Event::SlotCollision);
                }
                if rule.dry_run || self.policy.dry_run {
                    log::debug!("diana: dry run: rule {} would reject", rule.name);
                    progress.would_deny(rule.index);
                    return Ok(());
                }
                let report = RuleReport {
                    limit: rule.limit.rpu.get(),
                    remaining,
                    reset_seconds: ceil_seconds(reset),
                    retry_after_seconds: ceil_seconds_at_least_one(retry_after),
                };
                progress.tally.push((rule.index, RuleEvent::Limited));
                Err(Rejection::new(&self.policy.response, rule, &report))
            }
        }
    }

    /// Global rules enforced in local scope with the same parameters (the service is
    /// unavailable, or refused).
    #[allow(clippy::too_many_arguments)]
    fn degrade(
        &self,
        host: &dyn SharedData,
        local: Vec<GlobalCharge>,
        served: &[StashReceipt],
        mut held: Few<Held>,
        mut progress: Progress,
        now: Instant,
        metrics: &mut dyn MetricSink,
    ) -> EngineDecision {
        for charge in local {
            let Some(rule) = self.policy.rule(charge.index) else {
                continue;
            };
            if let Err(rejection) = self.charge_locally(
                host,
                rule,
                charge.address,
                charge.cost,
                now,
                &mut progress,
                &mut held,
                metrics,
            ) {
                self.global.give_back(host, &self.policy, served, now);
                return self.reject(host, held, progress, rejection, now, metrics);
            }
        }
        self.finish(progress, &held, now, metrics)
    }

    /// The rejection for a global rule's denial.
    fn denial(&self, denial: Denial, progress: &mut Progress) -> Rejection {
        progress.tally.push((denial.index, RuleEvent::Limited));
        match self.policy.rule(denial.index) {
            Some(rule) => Rejection::new(&self.policy.response, rule, &denial.report),
            None => Rejection::unnamed(&self.policy.response, &denial.report),
        }
    }

    /// Rejects: every local charge of the request is given back first.
    fn reject(
        &self,
        host: &dyn SharedData,
        held: Few<Held>,
        progress: Progress,
        rejection: Rejection,
        now: Instant,
        metrics: &mut dyn MetricSink,
    ) -> EngineDecision {
        self.give_back_held(host, &held, now, metrics);
        for (index, event) in progress.tally {
            if event != RuleEvent::Allowed {
                metrics.rule_event(index, event);
            }
        }
        Decision::Reject(rejection)
    }

    /// Gives back every local charge of a request that will not pass.
    fn give_back_held(
        &self,
        host: &dyn SharedData,
        held: &[Held],
        now: Instant,
        metrics: &mut dyn MetricSink,
    ) {
        for held in held.iter().rev() {
            let Some(rule) = self.policy.rule(held.rule) else {
                continue;
            };
            match self
                .local
                .give_back(host, &self.table(rule), rule, &held.taken, now)
            {
                Ok(()) => {}
                Err(ChargeError::Contention) => metrics.event(Event::StoreContention),
                Err(ChargeError::Host(error)) => {
                    log::warn!(
                        "diana: rule {}: cannot give a charge back: {error}",
                        rule.name
                    );
                    metrics.event(Event::StoreError);
                }
            }
        }
    }

    /// Every rule admitted: allow now or after the longest wait. What the rules that
    /// settle took (`held` locally, else from the service) is kept for the answer.
    fn finish(
        &self,
        mut progress: Progress,
        held: &[Held],
        now: Instant,
        metrics: &mut dyn MetricSink,
    ) -> EngineDecision {
        for &(index, event) in &progress.tally {
            metrics.rule_event(index, event);
        }
        for charge in &mut progress.after {
            let Some(rule) = self.policy.rule(charge.rule).filter(|rule| rule.settles()) else {
                continue;
            };
            charge.reserved = if let Some(local) = held.iter().find(|held| held.rule == rule.index)
            {
                Reserved::Local(local.taken.clone())
            } else if rule.scope == Scope::Global
                && progress.tally.contains(&(rule.index, RuleEvent::Allowed))
            {
                Reserved::Global {
                    tokens: charge.upfront,
                    until: now.saturating_add(rule.limit.unit.nanos()),
                }
            } else {
                Reserved::Nothing
            };
        }
        let tightest = progress
            .tightest
            .as_ref()
            .and_then(|(index, report)| Some((self.policy.rule(*index)?, report)));
        let headers = admitted_rule_headers(&self.policy.response, tightest);
        let local_places = held
            .iter()
            .filter(|held| {
                self.policy
                    .rule(held.rule)
                    .is_some_and(|rule| rule.algo.holds_until_done())
            })
            .map(|held| Place {
                rule: held.rule,
                address: held.address,
                at: PlaceAt::Local(held.taken.clone()),
                renewed: now,
            });
        let service_places = progress.service_places.iter().map(|place| Place {
            rule: place.index,
            address: place.address,
            at: PlaceAt::Service {
                bucket: place.bucket,
                places: place.places,
                renewing: false,
            },
            renewed: now,
        });
        let places: Vec<Place> = local_places.chain(service_places).collect();
        let after = AfterResponse {
            charges: progress.after,
            places,
        };
        let after = (!after.is_empty()).then_some(after);
        if !progress.delay.is_zero() && self.can_pause {
            metrics.event(Event::Delayed);
            Decision::Delay {
                until: now.saturating_add(progress.delay),
                headers,
                after,
            }
        } else {
            Decision::Allow { headers, after }
        }
    }

    /// Settles an admitted request once the upstream has answered ([`crate::settle`]):
    /// `values` are the response headers [`AfterResponse::headers`] names, in order (`None`
    /// when absent). What is owed is charged to local rules at once, past their limit if
    /// need be, and to global rules from the tick ([`Engine::pay_debts`]); what is given
    /// back goes where it was taken from (the local counter, or this gateway's lease
    /// stash).
    pub(crate) fn after_response(
        &self,
        host: &dyn SharedData,
        after: AfterResponse,
        values: &[Option<Vec<u8>>],
        now: Option<Instant>,
        metrics: &mut dyn MetricSink,
    ) {
        let Some(now) = now else {
            metrics.event(Event::ClockError);
            return;
        };
        for (charge, value) in after.charges.into_iter().zip(values) {
            let Some(rule) = self.policy.rule(charge.rule) else {
                continue;
            };
            let reserved = charge.reserved.tokens();
            match settle(rule, reserved, charge.upfront, value.as_deref()) {
                Settlement::Keep => {}
                Settlement::Owe(tokens) => {
                    let debt = Debt {
                        rule: charge.rule,
                        address: charge.address,
                        tokens: u64::from(tokens),
                    };
                    let local = match rule.scope {
                        Scope::Local => Some(debt),
                        Scope::Global => self.global.owe(debt),
                    };
                    if let Some(debt) = local {
                        self.charge_debt_locally(host, debt, now, metrics);
                    }
                }
                Settlement::GiveBack(tokens) => match &charge.reserved {
                    Reserved::Nothing => {}
                    Reserved::Local(taken) => {
                        let part = taken.part(tokens);
                        self.give_back_held(
                            host,
                            &[Held {
                                rule: rule.index,
                                address: charge.address,
                                cost: part.tokens(),
                                taken: part,
                            }],
                            now,
                            metrics,
                        );
                    }
                    Reserved::Global { until, .. } => {
                        self.global
                            .refund(host, rule, charge.address, tokens, *until, now);
                    }
                },
            }
        }
    }

    /// A request that held concurrency places ended (its response is done, its client
    /// left, its stream was reset): they are given back.
    pub(crate) fn leave(
        &self,
        host: &dyn SharedData,
        places: &[Place],
        now: Option<Instant>,
        metrics: &mut dyn MetricSink,
    ) {
        let mut held: Few<Held> = Few::new();
        for place in places {
            match &place.at {
                PlaceAt::Local(taken) => held.push(Held {
                    rule: place.rule,
                    address: place.address,
                    cost: taken.tokens(),
                    taken: taken.clone(),
                }),
                // Queued whatever the clock: the tick gives them back.
                PlaceAt::Service { .. } => {
                    if let Some(leaving) = place.to_leave() {
                        self.global.queue_leave(leaving, metrics);
                    }
                }
            }
        }
        let Some(now) = now else {
            // Without a clock nothing is written locally: those places are reclaimed
            // after `algo::inflight::RECLAIMED_AFTER`.
            return;
        };
        self.give_back_held(host, &held, now, metrics);
    }

    /// A place the quota service granted that no request holds any more (its request
    /// ended while the place's renewal was in flight): given back from the tick.
    pub(crate) fn queue_leave(&self, place: ServicePlace, metrics: &mut dyn MetricSink) {
        self.global.queue_leave(place, metrics);
    }

    /// True when places wait to be given back to the quota service.
    pub(crate) fn wants_leave(&self) -> bool {
        self.global.wants_leave()
    }

    /// From the tick: the call that gives back places of requests that ended.
    pub(crate) fn plan_leave(
        &self,
        host: &dyn SharedData,
        now: Instant,
        metrics: &mut dyn MetricSink,
    ) -> Option<Leave> {
        self.global.plan_leave(&self.policy, host, now, metrics)
    }

    /// The answer to a leave call (counts its places if they were not given back).
    pub(crate) fn left(&self, leave: &Leave, reply: &Reply, metrics: &mut dyn MetricSink) {
        self.global.left(leave, reply, metrics);
    }

    /// From the tick: the call that renews `places` at the quota service, and its body.
    pub(crate) fn plan_renewal(
        &self,
        host: &dyn SharedData,
        places: &[ServicePlace],
        now: Instant,
    ) -> Option<(Callout, AcquireRequest)> {
        self.global.plan_renewal(&self.policy, host, places, now)
    }

    /// The buckets a renewal's answer gives its places, in order (`None`: not renewed).
    pub(crate) fn renewed(&self, request: &AcquireRequest, reply: Reply) -> Option<Vec<u64>> {
        self.global.renewed(request, reply)
    }

    /// From the tick: the places of a request still inside that were taken or renewed
    /// [`RENEW_EVERY`] ago or more are counted as of now, so that they are never reclaimed
    /// as lost while the request lasts. Local places are renewed here; the places at the
    /// quota service that are due are returned, marked as renewing, for the worker to
    /// renew in one call ([`Engine::plan_renewal`]).
    pub(crate) fn renew(
        &self,
        host: &dyn SharedData,
        places: &mut [Place],
        now: Instant,
        metrics: &mut dyn MetricSink,
    ) -> Vec<ServicePlace> {
        let mut at_service = Vec::new();
        for place in places
            .iter_mut()
            .filter(|place| now.saturating_since(place.renewed) >= RENEW_EVERY)
        {
            if let PlaceAt::Service { .. } = place.at {
                at_service.extend(place.start_renewal());
                continue;
            }
            let (Some(rule), PlaceAt::Local(Taken::Shared(receipt))) =
                (self.policy.rule(place.rule), &place.at)
            else {
                continue;
            };
            match self
                .local
                .store()
                .renew(host, &self.table(rule), receipt, now)
            {
                Ok(Some(renewed)) => {
                    place.at = PlaceAt::Local(Taken::Shared(renewed));
                    place.renewed = now;
                }
                // Its record went to another identity: the place is gone already.
                Ok(None) => place.renewed = now,
                Err(ChargeError::Contention) => metrics.event(Event::StoreContention),
                Err(ChargeError::Host(error)) => {
                    log::warn!("diana: rule {}: place not renewed: {error}", rule.name);
                    metrics.event(Event::StoreError);
                }
            }
        }
        at_service
    }

    /// From the worker's tick: tokens of local batches this worker no longer spends go
    /// back to their counters (see [`crate::local`]). Returns how many.
    pub(crate) fn tick(&self, host: &dyn SharedData, clock: impl Clock) -> usize {
        let Some(now) = clock.now() else {
            return 0;
        };
        self.global.tick(host, &self.policy, now);
        self.local.return_unspent(host, now, |index| {
            let rule = self.policy.rule(index)?;
            Some((rule, self.table(rule)))
        })
    }

    /// True when a stash of leased tokens runs low and waits to be refilled ahead (the
    /// host then ticks soon: [`Engine::refill`]).
    pub(crate) fn wants_refill(&self) -> bool {
        self.global.wants_refill()
    }

    /// From the tick: the calls that refill running-low stashes ahead, each with what it
    /// asked (for [`Engine::refilled`]). No request waits for them.
    pub(crate) fn refill(
        &self,
        host: &dyn SharedData,
        now: Option<Instant>,
        metrics: &mut dyn MetricSink,
    ) -> Vec<(Callout, Refill)> {
        let Some(now) = now else {
            return Vec::new();
        };
        self.global
            .plan_refills(&self.policy, host, now, metrics)
            .into_iter()
            .map(|(callout, asked)| (callout, Refill(asked)))
            .collect()
    }

    /// The answer to a refill's call: the tokens granted go to the stash, a denial is
    /// cached, a failure opens the breaker; the requests parked behind it are woken
    /// ([`Engine::next_woken`]).
    pub(crate) fn refilled(
        &self,
        host: &dyn SharedData,
        refill: Refill,
        reply: Reply,
        now: Option<Instant>,
        metrics: &mut dyn MetricSink,
    ) {
        let Some(now) = now else {
            self.global
                .abandon_call(host, &self.policy, refill.0, Instant::EPOCH);
            return;
        };
        let _ = self
            .global
            .interpret(host, &self.policy, refill.0, reply, now, metrics);
    }

    /// True when response costs wait to be sent to the quota service.
    pub(crate) fn owes(&self) -> bool {
        self.global.owes()
    }

    /// From the tick: the callout that sends this worker's response costs to the quota
    /// service (`None`: nothing owed, or charged locally because the service is down).
    pub(crate) fn pay_debts(
        &self,
        host: &dyn SharedData,
        now: Option<Instant>,
        metrics: &mut dyn MetricSink,
    ) -> Option<(Callout, Vec<Debt>)> {
        let now = now?;
        match self.global.plan_payment(host, &self.policy, now, metrics) {
            Payment::Nothing => None,
            Payment::Call(callout, debts) => Some((callout, debts)),
            Payment::Local(debts) => {
                for debt in debts {
                    self.charge_debt_locally(host, debt, now, metrics);
                }
                None
            }
        }
    }

    /// The answer to [`Engine::pay_debts`]'s callout: what the service did not take is
    /// charged locally.
    pub(crate) fn debts_paid(
        &self,
        host: &dyn SharedData,
        debts: Vec<Debt>,
        reply: Reply,
        now: Option<Instant>,
        metrics: &mut dyn MetricSink,
    ) {
        let Some(now) = now else {
            return;
        };
        for debt in self.global.paid(host, debts, reply, now, metrics) {
            self.charge_debt_locally(host, debt, now, metrics);
        }
    }

    fn charge_debt_locally(
        &self,
        host: &dyn SharedData,
        debt: Debt,
        now: Instant,
        metrics: &mut dyn MetricSink,
    ) {
        let Some(rule) = self.policy.rule(debt.rule) else {
            return;
        };
        let tokens = u32::try_from(debt.tokens).unwrap_or(u32::MAX);
        let tokens = self
            .local
            .pay_from_batch(rule.index, debt.address.fingerprint, tokens, now);
        if tokens == 0 {
            return;
        }
        match self
            .local
            .store()
            .charge_debt(host, &self.table(rule), debt.address, now, tokens)
        {
            Ok(_) => {}
            Err(ChargeError::Contention) => metrics.event(Event::StoreContention),
            Err(ChargeError::Host(error)) => {
                log::warn!(
                    "diana: rule {}: response cost not charged: {error}",
                    rule.name
                );
                metrics.event(Event::StoreError);
            }
        }
    }
}

#[cfg(test)]
mod tests;
