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
//!
//! The engine's face is three verbs and their kin: [`Engine::evaluate`] (and
//! `Engine::resume` for a parked request) may return a call; [`Engine::tick`] lists the
//! calls due; [`Engine::answered`] takes any answer (`engine/calls.rs`). Every step is handed the
//! event's [`Cx`]: shared data, the instant, the metrics.

mod breakers;
mod calls;
mod view;

pub use calls::{Call, Then, UsageTrouble};

use crate::actor::Identity;
use crate::call::Answer;
use crate::config::Resource;
use crate::config::{PlanSource, Policy, Rule, Scope};
use crate::cx::Cx;
use crate::decision::{
    AfterResponse, BreakerCalls, Decision, HeaderEdit, Reserved, ResponseCharge,
};
use crate::facts::RequestFacts;
use crate::global::debts::Debt;
use crate::global::flights::RiderId;
use crate::global::stash::StashReceipt;
use crate::global::{Admission, Asked, Denial, Global, GlobalCharge, Interpretation, Plan};
use crate::hot::Label;
use crate::local::{Local, LocalCharge, Taken};
use crate::matching;
use crate::metrics::{Event, MetricSink, NoMetrics, RuleEvent};
use crate::path;
use crate::places::{Holdings, Place, PlaceAt, ServicePlace};
use crate::response::{admitted_rule_headers, Rejection, RuleReport};
use crate::store::{ChargeError, SharedData, SlotAddress, SlotTable};
use crate::time::{ceil_seconds, ceil_seconds_at_least_one, Instant, Nanos};
use crate::usage::JsonPath;
use crate::wire::CallRule;
use breakers::Breakers;
pub(crate) use breakers::TappedCalls;
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use view::View;

/// The rules of one request are few: these lists stay on the stack (no allocation on the
/// hot path).
type Few<T> = SmallVec<[T; 4]>;

/// What the engine answers: a [`Decision`] whose call carries what its answer resumes,
/// and whose wait carries the parked request's state.
pub type EngineDecision = Decision<Call, Pending>;

/// A paused request: what was charged so far, and what it waits for. Boxed: a decision
/// that admits at once (the hot path) is then a few words to move, not the paused
/// request's whole state.
#[derive(Debug)]
pub struct Pending(Box<PendingState>);

#[derive(Debug)]
struct PendingState {
    held: Few<Held>,
    progress: Progress,
    awaiting: Awaiting,
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
    fn new(held: Few<Held>, progress: Progress, awaiting: Awaiting, turns: Few<Turn>) -> Pending {
        Pending(Box::new(PendingState {
            held,
            progress,
            awaiting,
            turns,
        }))
    }
}

/// What a paused request waits for.
#[derive(Debug)]
enum Awaiting {
    /// The answer to its own call.
    Answer(Asked),
    /// Another request's call (a flight) for one of its global rules; then it plans again.
    Flight {
        charges: Few<GlobalCharge>,
        rider: RiderId,
    },
}

impl Pending {
    /// What the callout asked (for tests); `None` for a parked request.
    #[cfg(test)]
    pub(crate) fn asked(&self) -> Option<&Asked> {
        match &self.0.awaiting {
            Awaiting::Answer(asked) => Some(asked),
            Awaiting::Flight { .. } => None,
        }
    }

    /// The id under which a parked request is woken ([`Engine::next_woken`]).
    pub(crate) fn rider(&self) -> Option<RiderId> {
        match &self.0.awaiting {
            Awaiting::Answer(_) => None,
            Awaiting::Flight { rider, .. } => Some(*rider),
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
    /// The breakers the request is a call of (probes among them): given back if a rule
    /// rejects it, judged once it has been answered.
    breakers: BreakerCalls,
    /// Changes to the request's own headers (a breaker's fallback header).
    upstream: Vec<HeaderEdit>,
    /// The global rules that settle and were granted by the request's own call, each with
    /// its place in that call: what its answer does not count goes back to the service
    /// by that call's id ([`crate::global::Global::refund`]).
    from_call: Vec<(usize, CallRule)>,
    /// The fleet view's: the request's identity as shown, per rule that keeps hot lists
    /// (empty, and never allocated, while the view is off).
    shown: Vec<(usize, Label)>,
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
    /// See [`Progress::shown`].
    shown: Vec<(usize, Label)>,
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

/// The request header removed from requests whose answer's body is read for usage.
pub const ACCEPT_ENCODING: &str = "accept-encoding";

/// The immutable policy plus the per-VM machinery to evaluate it.
#[derive(Debug)]
pub struct Engine {
    policy: Policy,
    /// False when the only resource is `/`: every request matches, the path is not needed.
    needs_path: bool,
    /// A rule reserves from the request's body (`reserve.json`).
    reads_request_bodies: bool,
    /// The host can pause a request and resume it later (Envoy: yes; nginx: no).
    resumes_elsewhere: bool,
    local: Local,
    global: Global,
    /// The concurrency places of the requests inside.
    places: Holdings,
    /// The resources' breakers, as this worker follows them.
    breakers: Breakers,
    /// This worker's part of the fleet view ([`view`]): `None` when the document names no
    /// quota service.
    view: Option<RefCell<View>>,
    /// When this worker last sent a report (its `interval_ms` runs from there).
    last_report: Cell<Option<Instant>>,
}

impl Engine {
    pub fn new(policy: Policy) -> Engine {
        let needs_path = !matches!(policy.resources.as_slice(), [only] if only.url == "/");
        let reads_request_bodies = policy.reads_request_bodies();
        let global = Global::new(&policy, true);
        let breakers = Breakers::new(&policy);
        let view = View::of(&policy).map(RefCell::new);
        Engine {
            policy,
            needs_path,
            reads_request_bodies,
            resumes_elsewhere: true,
            local: Local::new(),
            global,
            places: Holdings::default(),
            breakers,
            view,
            last_report: Cell::new(None),
        }
    }

    /// Declares whether the host can pause and later resume a request. Without it, a
    /// local leaky-bucket wait becomes a rejection with `Retry-After` (nothing reserved),
    /// and global leaky-bucket rules use the quota service's wait endpoint.
    pub fn resuming_elsewhere(mut self, resumes_elsewhere: bool) -> Engine {
        self.resumes_elsewhere = resumes_elsewhere;
        self.global = Global::new(&self.policy, resumes_elsewhere);
        self
    }

    /// Dates this document's breaker settings by the instant the worker installed it (a
    /// newer document's win over an older one's in the breakers' shared records): without
    /// it, by the instant the engine first used a breaker.
    pub fn installed_at(self, at: Instant) -> Engine {
        self.breakers.installed_at(at);
        self
    }

    /// The worker replaced this document by a newer one: the breakers it has not used yet
    /// are never used (their settings must not reach the shared records); the requests it
    /// admitted settle as before.
    pub fn retire(&self) {
        self.breakers.retire();
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

    /// The paths of a request's JSON body its rules reserve from (`reserve.json`), for a
    /// request to `raw_path`; empty when none of its rules does (at once for a document
    /// without such a rule).
    pub(crate) fn request_body_paths(&self, raw_path: &[u8]) -> Vec<JsonPath> {
        if !self.reads_request_bodies {
            return Vec::new();
        }
        let path = path::normalize(raw_path);
        let mut paths: Vec<JsonPath> = Vec::new();
        for (_, resource) in matching::matching(&self.policy, &path) {
            for rule in &resource.rules {
                if let Some(at) = rule.request_body_path() {
                    if !paths.contains(at) {
                        paths.push(at.clone());
                    }
                }
            }
        }
        paths
    }

    /// True when `raw_path` (query ignored) is the policy's `metrics.path`: the host answers
    /// with its metrics instead of evaluating the request.
    pub(crate) fn serves_metrics(&self, raw_path: &[u8]) -> bool {
        self.policy
            .metrics
            .as_ref()
            .is_some_and(|spec| path::normalize(raw_path).as_ref() == spec.path.as_bytes())
    }

    /// Evaluates one request. `raw_path` is the `:path` pseudo-header as sent. (Without a
    /// clock the worker admits the request before it gets here: a broken clock must not
    /// rewrite counters near the epoch.)
    pub fn evaluate(
        &self,
        cx: &mut Cx<'_>,
        raw_path: &[u8],
        facts: &dyn RequestFacts,
    ) -> EngineDecision {
        let path = if self.needs_path {
            path::normalize(raw_path)
        } else {
            std::borrow::Cow::Borrowed(&b"/"[..])
        };
        let mut longest = None;
        let resources: Few<&Resource> = matching::matching(&self.policy, &path)
            .map(|(at, resource)| {
                longest = Some(at);
                resource
            })
            .collect();
        if let (Some(view), Some(at)) = (&self.view, longest) {
            // Least specific first: the last match is the longest.
            view.borrow_mut().path(at, cx.now);
        }
        let mut passed = if self.breakers.is_empty() {
            breakers::Passed::default()
        } else {
            match self.breakers.check(cx, self.local.store(), &resources) {
                Ok(passed) => passed,
                Err(fast_fail) => return self.fail_fast(fast_fail),
            }
        };
        let applicable = self.applicable(&resources, facts);
        if applicable
            .after
            .iter()
            .any(|charge| charge.header.is_none())
        {
            // The answer's usage is read from its body as it passes: it must come
            // uncompressed (a gzip body would read as malformed and keep the reservation).
            passed.upstream.push(HeaderEdit {
                name: ACCEPT_ENCODING.to_string(),
                value: None,
            });
        }
        if applicable.local.is_empty()
            && applicable.global.is_empty()
            && passed.calls.is_empty()
            && passed.upstream.is_empty()
        {
            return Decision::Allow {
                headers: Vec::new(),
                after: None,
                upstream: Vec::new(),
            };
        }
        let mut progress = Progress {
            after: applicable.after,
            shown: applicable.shown,
            breakers: passed.calls,
            upstream: passed.upstream,
            ..Progress::default()
        };
        let mut held = Few::new();
        for &(rule, address, cost) in &applicable.local {
            if let Err(rejection) =
                self.charge_locally(cx, rule, address, cost, &mut progress, &mut held)
            {
                return self.reject(cx, held, progress, rejection);
            }
        }
        if applicable.global.is_empty() {
            return self.finish(cx, progress, &held);
        }
        let turns = Few::new();
        self.decide_globally(cx, applicable.global, held, progress, turns)
    }

    /// The request waits for the quota service (its call, or another request's): the
    /// leaky-bucket turns it took are given back, to be taken again when it may leave.
    /// A turn kept across the wait would be spent while the request waits: with a 40 ms
    /// call, a request of a 10/s bucket served from the stash right after would reach
    /// the upstream 60 ms after this one.
    fn defer_turns(
        &self,
        cx: &mut Cx<'_>,
        held: &mut Few<Held>,
        progress: &mut Progress,
        turns: &mut Few<Turn>,
    ) {
        let waits = |index: usize| self.policy.rule(index).is_some_and(|r| r.algo.waits());
        if !held.iter().any(|held| waits(held.rule)) {
            return;
        }
        let (deferred, kept): (Few<Held>, Few<Held>) =
            held.drain(..).partition(|held| waits(held.rule));
        *held = kept;
        self.give_back_held(cx.shared, &deferred, cx.now, &mut NoMetrics);
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
        cx: &mut Cx<'_>,
        turns: &[Turn],
        held: &mut Few<Held>,
        progress: &mut Progress,
    ) -> Result<(), Rejection> {
        for turn in turns {
            let Some(rule) = self.policy.rule(turn.rule) else {
                continue;
            };
            self.charge_locally(cx, rule, turn.address, turn.cost, progress, held)?;
        }
        Ok(())
    }

    /// The global half of an evaluation: the local rules have admitted (`held`).
    #[allow(clippy::too_many_arguments)]
    fn decide_globally(
        &self,
        cx: &mut Cx<'_>,
        charges: Few<GlobalCharge>,
        mut held: Few<Held>,
        mut progress: Progress,
        mut turns: Few<Turn>,
    ) -> EngineDecision {
        let plan = self.global.plan(cx, &self.policy, &charges);
        if matches!(plan, Plan::Park(_) | Plan::Call { .. }) {
            self.defer_turns(cx, &mut held, &mut progress, &mut turns);
        }
        match plan {
            Plan::Done(outcomes) => {
                progress.apply(outcomes);
                self.finish(cx, progress, &held)
            }
            Plan::Rejected(denial, outcomes) => {
                progress.apply(outcomes);
                let rejection = self.denial(denial, &mut progress);
                self.reject(cx, held, progress, rejection)
            }
            Plan::Degrade {
                outcomes,
                local,
                served,
            } => {
                progress.apply(outcomes);
                cx.metrics.event(Event::GlobalDegradedRequest);
                self.degrade(cx, local, &served, held, progress)
            }
            Plan::Park(rider) => Decision::Wait(Pending::new(
                held,
                progress,
                Awaiting::Flight { charges, rider },
                turns,
            )),
            Plan::Call {
                outcomes,
                callout,
                asked,
            } => {
                progress.apply(outcomes);
                let pending = Pending::new(held, progress, Awaiting::Answer(asked), turns);
                Decision::Call(Call {
                    callout,
                    then: Then::acquire(pending),
                })
            }
        }
    }

    /// Plans a woken request again ([`Engine::next_woken`]): its flight has landed, so its
    /// global rules are likely served from the lease stash now.
    pub(crate) fn resume(&self, cx: &mut Cx<'_>, pending: Pending) -> EngineDecision {
        let PendingState {
            mut held,
            mut progress,
            awaiting,
            turns,
        } = *pending.0;
        match awaiting {
            Awaiting::Flight { charges, rider } => {
                self.global.replanning(rider);
                if let Err(rejection) = self.take_turns(cx, &turns, &mut held, &mut progress) {
                    return self.reject(cx, held, progress, rejection);
                }
                self.decide_globally(cx, charges, held, progress, Few::new())
            }
            awaiting @ Awaiting::Answer(_) => {
                let pending = Pending::new(held, progress, awaiting, turns);
                self.complete(cx, pending, Answer::NoAnswer)
            }
        }
    }

    /// Flights whose answer is overdue (their request vanished unannounced) are treated as
    /// landed: their riders are woken. Called from the host's tick while
    /// [`Engine::has_riders`], before [`Engine::next_woken`].
    pub(crate) fn land_overdue(&self, now: Instant) {
        self.global.land_overdue(now);
    }

    /// The next parked request to [`Engine::resume`], in the order they parked: one at a
    /// time, each resumed before the next is taken (see
    /// [`crate::global::flights::Flights::next_woken`]).
    pub(crate) fn next_woken(&self) -> Option<RiderId> {
        self.global.next_woken()
    }

    /// Every parked request to resume, at once (tests).
    #[cfg(test)]
    pub(crate) fn woken(&self, now: Instant) -> Vec<RiderId> {
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

    /// Finishes a request paused for a callout, with the host's account of the call.
    pub(crate) fn complete(
        &self,
        cx: &mut Cx<'_>,
        pending: Pending,
        answer: Answer,
    ) -> EngineDecision {
        let PendingState {
            mut held,
            mut progress,
            awaiting,
            turns,
        } = *pending.0;
        let asked = match awaiting {
            Awaiting::Answer(asked) => asked,
            awaiting @ Awaiting::Flight { .. } => {
                let pending = Pending::new(held, progress, awaiting, turns);
                return self.resume(cx, pending);
            }
        };
        if let Err(rejection) = self.take_turns(cx, &turns, &mut held, &mut progress) {
            // The request cannot leave within its wait: what the service granted serves
            // later requests.
            self.global
                .interpret_for_nobody(cx, &self.policy, asked, answer);
            return self.reject(cx, held, progress, rejection);
        }
        progress.from_call = asked.settling_rules(&self.policy);
        match self.global.interpret(cx, &self.policy, asked, answer) {
            Interpretation::Done(outcomes) => {
                progress.apply(outcomes);
                self.finish(cx, progress, &held)
            }
            Interpretation::Rejected(denial, outcomes) => {
                progress.apply(outcomes);
                let rejection = self.denial(denial, &mut progress);
                self.reject(cx, held, progress, rejection)
            }
            Interpretation::Degrade { local, served } => {
                self.degrade(cx, local, &served, held, progress)
            }
        }
    }

    /// The rules that apply to a request, each with its identity and cost, in charging
    /// order (see the module docs).
    fn applicable<'p>(
        &'p self,
        resources: &[&'p Resource],
        facts: &dyn RequestFacts,
    ) -> Applicable<'p> {
        let mut applicable = Applicable {
            local: Few::new(),
            global: Few::new(),
            after: Vec::new(),
            shown: Vec::new(),
        };
        let view = self.view.as_ref().map(RefCell::borrow);
        let mut waiting: Few<(&Rule, SlotAddress, u32)> = Few::new();
        let mut plans = PlansRead::default();
        for resource in resources {
            for rule in &resource.rules {
                if let Some(choice) = &rule.plan {
                    if !choice.selects(plans.read(&choice.by, facts)) {
                        continue;
                    }
                }
                // The identity as shown costs a copy of its value: read only for a rule
                // that keeps hot lists, while the view is on.
                let identity = if view
                    .as_ref()
                    .is_some_and(|view| view.wants_identity(rule.index))
                {
                    let mut value = None;
                    let identity = rule.identify_shown(facts, &mut value);
                    if let Some(label) = view::shown(rule, &identity, value.as_deref()) {
                        applicable.shown.push((rule.index, label));
                    }
                    identity
                } else {
                    rule.identify(facts)
                };
                let address = match identity {
                    Identity::Skip => continue,
                    Identity::Everyone => SlotAddress::single(),
                    Identity::Key(hash) => SlotAddress::of(hash, rule.slots.get()),
                };
                let cost = rule.upfront().of(facts);
                // Settled from a response header, or from the answer's body.
                let answer_header = rule.answer_header();
                if answer_header.is_some() || rule.response_body_source().is_some() {
                    applicable.after.push(ResponseCharge {
                        rule: rule.index,
                        header: answer_header.map(str::to_string),
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
            max_delay: if self.resumes_elsewhere {
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
        cx: &mut Cx<'_>,
        rule: &Rule,
        address: SlotAddress,
        cost: u32,
        progress: &mut Progress,
        held: &mut Few<Held>,
    ) -> Result<(), Rejection> {
        let table = self.table(rule);
        match self
            .local
            .charge(cx.shared, &table, rule, address, cost, cx.now)
        {
            Err(ChargeError::Host(error)) => {
                // The host store itself failed: a defined behaviour, admit uncounted.
                log::warn!("diana: rule {}: {error}; request admitted", rule.name);
                cx.metrics.event(Event::StoreError);
                Ok(())
            }
            Err(ChargeError::Contention) => {
                cx.metrics.event(Event::StoreContention);
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
                    cx.metrics.event(Event::SlotCollision);
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
                    cx.metrics.event(Event::SlotCollision);
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
        cx: &mut Cx<'_>,
        local: Vec<GlobalCharge>,
        served: &[StashReceipt],
        mut held: Few<Held>,
        mut progress: Progress,
    ) -> EngineDecision {
        for charge in local {
            let Some(rule) = self.policy.rule(charge.index) else {
                continue;
            };
            if let Err(rejection) = self.charge_locally(
                cx,
                rule,
                charge.address,
                charge.cost,
                &mut progress,
                &mut held,
            ) {
                self.global.give_back(cx, &self.policy, served);
                return self.reject(cx, held, progress, rejection);
            }
        }
        self.finish(cx, progress, &held)
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
        cx: &mut Cx<'_>,
        held: Few<Held>,
        progress: Progress,
        rejection: Rejection,
    ) -> EngineDecision {
        self.give_back_held(cx.shared, &held, cx.now, cx.metrics);
        // Not a call of its breakers: the probes' places go back.
        self.breakers
            .give_back(cx, self.local.store(), &progress.breakers);
        for &(index, event) in &progress.tally {
            if event != RuleEvent::Allowed {
                cx.metrics.rule_event(index, event);
            }
        }
        self.see(cx.now, &progress, false);
        Decision::Reject(rejection)
    }

    /// A breaker answers the request itself: the document's response, naming it.
    fn fail_fast(&self, fast_fail: breakers::FastFail) -> EngineDecision {
        let name = self
            .breakers
            .spec(fast_fail.breaker)
            .map_or("", |spec| spec.settings.name.as_str());
        Decision::Reject(Rejection::breaker(
            &self.policy.response,
            name,
            fast_fail.retry_after,
        ))
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
    fn finish(&self, cx: &mut Cx<'_>, mut progress: Progress, held: &[Held]) -> EngineDecision {
        for &(index, event) in &progress.tally {
            cx.metrics.rule_event(index, event);
        }
        self.see(cx.now, &progress, true);
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
                let from = progress
                    .from_call
                    .iter()
                    .find(|(index, _)| *index == rule.index)
                    .map(|(_, from)| from.clone());
                Reserved::Global {
                    tokens: charge.upfront,
                    until: cx.now.saturating_add(rule.limit.unit.nanos()),
                    from,
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
                renewed: cx.now,
            });
        let service_places = progress.service_places.iter().map(|place| Place {
            rule: place.index,
            address: place.address,
            at: PlaceAt::Service {
                bucket: place.bucket,
                places: place.places,
                renewing: false,
            },
            renewed: cx.now,
        });
        let places: Vec<Place> = local_places.chain(service_places).collect();
        let delayed = !progress.delay.is_zero() && self.resumes_elsewhere;
        let until = cx.now.saturating_add(progress.delay);
        let after = AfterResponse {
            charges: progress.after,
            holding: self.places.hold(places),
            breakers: progress.breakers,
            // A request held for its leaky-bucket turn leaves Diana then.
            left_at: if delayed { until } else { cx.now },
        };
        let after = (!after.is_empty()).then_some(after);
        let upstream = progress.upstream;
        if delayed {
            cx.metrics.event(Event::Delayed);
            Decision::Delay {
                until,
                headers,
                after,
                upstream,
            }
        } else {
            Decision::Allow {
                headers,
                after,
                upstream,
            }
        }
    }

    /// The fleet view counts a decided request's rule outcomes as its metrics do: every
    /// rule's of an admitted request (`admitted`), the rejecting rule's and the dry-run
    /// denials of a rejected one.
    fn see(&self, now: Instant, progress: &Progress, admitted: bool) {
        let Some(view) = &self.view else {
            return;
        };
        let mut view = view.borrow_mut();
        for &(index, event) in &progress.tally {
            if !admitted && event == RuleEvent::Allowed {
                continue;
            }
            let shown = progress
                .shown
                .iter()
                .find(|(rule, _)| *rule == index)
                .map(|(_, label)| *label);
            view.record(index, event, shown, now);
        }
    }

    fn charge_debt_locally(&self, cx: &mut Cx<'_>, debt: Debt) {
        let Some(rule) = self.policy.rule(debt.rule) else {
            return;
        };
        let tokens = u32::try_from(debt.tokens).unwrap_or(u32::MAX);
        let tokens =
            self.local
                .pay_from_batch(rule.index, debt.address.fingerprint, tokens, cx.now);
        if tokens == 0 {
            return;
        }
        match self.local.store().charge_debt(
            cx.shared,
            &self.table(rule),
            debt.address,
            cx.now,
            tokens,
        ) {
            Ok(_) => {}
            Err(ChargeError::Contention) => cx.metrics.event(Event::StoreContention),
            Err(ChargeError::Host(error)) => {
                log::warn!(
                    "diana: rule {}: response cost not charged: {error}",
                    rule.name
                );
                cx.metrics.event(Event::StoreError);
            }
        }
    }
}

#[cfg(test)]
mod tests;
