//! Calls are values: every call the engine wants made to the quota service is a [`Call`],
//! the callout to send and what its answer resumes ([`Then`]) — in the style of Kuadrant's
//! wasm-shim, whose tasks keep their continuation with their token. The worker keeps the
//! pair in one table of calls in flight and hands the answer back through one door,
//! [`Engine::answered`]; it never needs to know what kind of call it carries.
//!
//! ```text
//!   evaluate / resume ──▶ Decision::Call(Call)        a request's own call
//!   tick ───────────────▶ Vec<Call>                   refills ahead, response costs,
//!                                                     releases, places left and renewed
//!   answered(Then, Answer) ─┬─ Acquire  ─▶ the request's Decision
//!                           ├─ Orphan   ─▶ its grant serves later requests
//!                           ├─ Refill   ─▶ the stash
//!                           ├─ Payment  ─▶ what the service did not take is charged here
//!                           ├─ Release  ─▶ cached denials forgotten (a part not given
//!                           │              back: to the lease stash)
//!                           ├─ Leave    ─▶ places not given back are counted
//!                           └─ Renewal  ─▶ the places' new buckets
//! ```
//!
//! A call whose request went away: one made from another context still answers, and the
//! worker turns its continuation into an orphan's ([`Then::for_nobody`]); one made from
//! the request's own context dies with it ([`Engine::abandon_call`]: its grant is released
//! from the next tick).

use super::view::REPORT_EVERY;
use super::{Awaiting, Engine, EngineDecision, Held, Pending, PendingState};
use crate::algo::inflight::RENEW_EVERY;
use crate::breaker::{Report, FLEET_REPORT_EVERY};
use crate::call::{Answer, AnswerShape, Callout};
use crate::config::{Rule, Scope};
use crate::cx::Cx;
use crate::decision::{AfterResponse, Decision, Reserved, ResponseCharge};
use crate::global::debts::Debt;
use crate::global::{Asked, GlobalCharge, Payment, Refund};
use crate::local::Taken;
use crate::metrics::{Event, MetricSink, NoMetrics};
use crate::places::{HoldingId, PlaceAt, ServicePlace};
use crate::report::{self, BreakerReport, FleetParams, ReportRequest, ReportResponse};
use crate::settle::{settle, settle_body, BodyCost, Settlement};
use crate::store::{ChargeError, SharedData};
use crate::time::{Instant, Nanos};
use crate::usage::{Framing, NoValue, Usage, UsageReader};
use crate::wire::{self, AcquireRequest};

/// A report of the fleet's breakers goes once this long has passed since the previous
/// report: [`FLEET_REPORT_EVERY`] less 25 ms, so that a tick of that period that fires a
/// little early does not skip a period.
const FLEET_REPORT_DUE: Nanos = Nanos::from_millis(FLEET_REPORT_EVERY.whole_millis() - 25);

/// A call to make: the callout, and what its answer resumes.
#[derive(Debug)]
pub struct Call {
    pub callout: Callout,
    pub then: Then,
}

/// What a call's answer resumes (opaque outside the engine).
#[derive(Debug)]
pub struct Then(Kind);

#[derive(Debug)]
enum Kind {
    /// A request paused for its own call.
    Acquire(Pending),
    /// A request's call whose request is gone: what it grants serves later requests.
    Orphan(Pending),
    /// A refill of a lease stash ahead; no request waits for it.
    Refill(Asked),
    /// Response costs sent to the quota service.
    Payment(Vec<Debt>),
    /// The release of a gone request's grant, or of part of a rule's grant (with where
    /// its tokens go if the service gives nothing back): the (rule, identity) pairs it
    /// frees.
    Release(Vec<GlobalCharge>, Option<Refund>),
    /// Concurrency places of requests that ended, given back: how many.
    Leave(u64),
    /// Concurrency places renewed: of which holding each is, and what was asked.
    Renewal(Vec<(HoldingId, ServicePlace)>, AcquireRequest),
    /// The tick's report: what it carried of each breaker (to restore if it is lost), and
    /// the report itself (to check the answer against).
    Report(Vec<(usize, Report)>, ReportRequest),
}

impl Then {
    /// The request this call resumes went away, and the call still answers (it was made
    /// from another context): its answer serves later requests instead.
    pub fn for_nobody(self) -> Then {
        match self.0 {
            Kind::Acquire(pending) => Then(Kind::Orphan(pending)),
            kind => Then(kind),
        }
    }

    /// What of the answer is read: a payment's, a release's and a leave's status alone.
    pub fn answer_shape(&self) -> AnswerShape {
        match self.0 {
            Kind::Payment(_) | Kind::Release(_, None) | Kind::Leave(_) => AnswerShape::STATUS,
            // Whether the service gave the part back decides where its tokens go.
            Kind::Release(_, Some(_))
            | Kind::Acquire(_)
            | Kind::Orphan(_)
            | Kind::Refill(_)
            | Kind::Renewal(..)
            | Kind::Report(..) => AnswerShape::SERVICE,
        }
    }

    /// True when a request waits for this call's answer.
    pub fn resumes_a_request(&self) -> bool {
        matches!(self.0, Kind::Acquire(_))
    }

    pub(crate) fn acquire(pending: Pending) -> Then {
        Then(Kind::Acquire(pending))
    }

    /// The response costs a payment carries (tests).
    #[cfg(test)]
    pub(crate) fn debts(&self) -> &[Debt] {
        match &self.0 {
            Kind::Payment(debts) => debts,
            _ => &[],
        }
    }

    /// What a request's call asked (tests).
    #[cfg(test)]
    pub(crate) fn asked(&self) -> Option<&Asked> {
        match &self.0 {
            Kind::Acquire(pending) | Kind::Orphan(pending) => pending.asked(),
            Kind::Refill(asked) => Some(asked),
            _ => None,
        }
    }
}

impl Engine {
    /// The one door for answers: `answer` to the call `then` came with. A request's own
    /// call gives that request's [`Decision`]; every other kind settles here.
    pub fn answered(&self, cx: &mut Cx<'_>, then: Then, answer: Answer) -> Option<EngineDecision> {
        match then.0 {
            Kind::Acquire(pending) => return Some(self.complete(cx, pending, answer)),
            Kind::Orphan(pending) => self.complete_for_nobody(cx, pending, answer),
            Kind::Refill(asked) => {
                let _ = self.global.interpret(cx, &self.policy, asked, answer);
            }
            Kind::Payment(debts) => {
                for debt in self.global.paid(cx, debts, answer) {
                    self.charge_debt_locally(cx, debt);
                }
            }
            Kind::Release(charges, fallback) => {
                self.global
                    .released(cx, &self.policy, &charges, fallback, &answer)
            }
            Kind::Report(carried, report) => self.reported(cx, carried, &report, &answer),
            Kind::Leave(places) => self.global.left(cx, places, &answer),
            Kind::Renewal(renewing, request) => {
                let buckets = self.global.renewed(&request, &answer);
                for (at, (holding, asked)) in renewing.into_iter().enumerate() {
                    let bucket = buckets
                        .as_ref()
                        .and_then(|buckets| buckets.get(at).copied());
                    if !self
                        .places
                        .renewal_answered(holding, &asked, bucket, cx.now)
                    {
                        // Its request ended meanwhile: given back from where it is now.
                        let place = ServicePlace {
                            bucket: bucket.unwrap_or(asked.bucket),
                            ..asked
                        };
                        self.global.queue_leave(place, cx.metrics);
                    }
                }
            }
        }
        None
    }

    /// An answer came and the clock cannot be read: nothing is written; a request's call
    /// is settled all the same (its flights land, the requests parked behind it plan
    /// again) and the request admitted, as without a clock anywhere.
    pub fn without_clock(&self, shared: &dyn SharedData, then: Then) -> Option<EngineDecision> {
        match then.0 {
            Kind::Acquire(pending) => {
                self.forget(shared, pending);
                Some(Decision::Allow {
                    headers: Vec::new(),
                    after: None,
                    upstream: Vec::new(),
                })
            }
            Kind::Orphan(pending) => {
                self.forget(shared, pending);
                None
            }
            Kind::Refill(asked) => {
                self.global.forget_call(shared, &self.policy, asked);
                None
            }
            // Debts and places are counted where they were; a payment may be made again.
            Kind::Payment(_) => {
                self.global.payment_forgotten();
                None
            }
            // A part of a grant not given back stays charged (stricter).
            Kind::Release(..) | Kind::Leave(_) | Kind::Renewal(..) => None,
            // Its calls go into the next report.
            Kind::Report(carried, _) => {
                for (breaker, report) in carried {
                    self.breakers.restore(Instant::EPOCH, breaker, report);
                }
                None
            }
        }
    }

    /// The call of a request that went away will never answer (it was made from the
    /// request's own context, and the host drops it with the request): what the request
    /// had charged is given back, the requests parked behind its call plan again, and
    /// what the service granted it is released from the next tick
    /// ([`crate::global::Global::abandon_call`]).
    pub fn abandon_call(&self, cx: &mut Cx<'_>, then: Then) {
        match then.0 {
            Kind::Acquire(pending) | Kind::Orphan(pending) => self.abandon(cx, pending),
            // A call of the tick's own is never dropped with a request.
            _ => {}
        }
    }

    /// A paused request went away: what it had charged is given back; parked, it leaves
    /// its flight; calling, its call is released (see [`Engine::abandon_call`]).
    pub fn abandon(&self, cx: &mut Cx<'_>, pending: Pending) {
        let PendingState {
            held,
            awaiting,
            progress,
            ..
        } = *pending.0;
        self.breakers
            .give_back(cx, self.local.store(), &progress.breakers);
        match awaiting {
            Awaiting::Answer(asked) => self.global.abandon_call(cx, &self.policy, asked),
            Awaiting::Flight { rider, .. } => self.global.unpark(rider),
        }
        self.give_back_held(cx.shared, &held, cx.now, &mut NoMetrics);
    }

    /// A paused request whose answer is lost, without a clock: its call settled, nothing
    /// written but the flights' and stash's own bookkeeping.
    fn forget(&self, shared: &dyn SharedData, pending: Pending) {
        let PendingState { awaiting, .. } = *pending.0;
        match awaiting {
            Awaiting::Answer(asked) => self.global.forget_call(shared, &self.policy, asked),
            Awaiting::Flight { rider, .. } => self.global.unpark(rider),
        }
    }

    /// The answer to the call of a request that is gone (see [`Engine::abandon_call`] for
    /// one whose answer will never come): what the service granted serves later requests
    /// from the lease stash, and what the request held goes back.
    fn complete_for_nobody(&self, cx: &mut Cx<'_>, pending: Pending, answer: Answer) {
        let PendingState {
            held,
            awaiting,
            progress,
            ..
        } = *pending.0;
        self.breakers
            .give_back(cx, self.local.store(), &progress.breakers);
        match awaiting {
            Awaiting::Answer(asked) => {
                self.global
                    .interpret_for_nobody(cx, &self.policy, asked, answer)
            }
            Awaiting::Flight { rider, .. } => self.global.unpark(rider),
        }
        self.give_back_held(cx.shared, &held, cx.now, &mut NoMetrics);
    }

    /// The tick: idle batches go back to their counters, the places of requests inside are
    /// renewed, and the calls due are listed — the response costs owed (one payment in
    /// flight at a time), the releases of gone requests' grants, the places of ended
    /// requests, the renewals of places at the service, the refills ahead.
    pub fn tick(&self, cx: &mut Cx<'_>) -> Vec<Call> {
        self.global.tick(cx, &self.policy);
        self.return_unspent(cx);
        let mut calls = Vec::new();
        match self.global.plan_payment(cx, &self.policy) {
            Payment::Nothing => {}
            Payment::Call(callout, debts) => calls.push(Call {
                callout,
                then: Then(Kind::Payment(debts)),
            }),
            Payment::Local(debts) => {
                for debt in debts {
                    self.charge_debt_locally(cx, debt);
                }
            }
        }
        calls.extend(
            self.global
                .take_releases(cx, &self.policy)
                .into_iter()
                .map(|release| Call {
                    callout: release.callout,
                    then: Then(Kind::Release(release.charges, release.fallback)),
                }),
        );
        self.renew(cx, &mut calls);
        while let Some((callout, places)) = self.global.plan_leave(cx, &self.policy) {
            calls.push(Call {
                callout,
                then: Then(Kind::Leave(places)),
            });
        }
        if !self.breakers.is_empty() {
            self.breakers.flush(cx, self.local.store());
        }
        calls.extend(self.plan_report(cx));
        calls.extend(self.global.plan_refills(cx, &self.policy).into_iter().map(
            |(callout, asked)| Call {
                callout,
                then: Then(Kind::Refill(asked)),
            },
        ));
        calls
    }

    /// The tick's report to the quota service, when there is something to say: the calls
    /// of the breakers of `scope: global` (the fleet's state follows them), every
    /// [`FLEET_REPORT_EVERY`] (not at every tick: a tick of a millisecond while requests
    /// wait would send a report a millisecond); and, while the fleet view is on
    /// ([`super::view`]), what this worker saw since its previous report, at least every
    /// [`REPORT_EVERY`] even when it saw nothing (the view then knows the gateway is
    /// alive). A report carries both whichever is due.
    fn plan_report(&self, cx: &mut Cx<'_>) -> Option<Call> {
        let mut view = self.view.as_ref().map(|view| view.borrow_mut());
        let view_due = view.as_mut().is_some_and(|view| view.due(cx.now));
        if !view_due && !self.fleet_report_due(cx.now) {
            return None;
        }
        // The id before the reports are taken: a report taken and then not sent would lose
        // its calls (the fleet would never see the evidence).
        let gateway = self.global.gateway_id(cx.shared)?;
        let reports = self.breakers.reports(cx, self.local.store());
        if reports.is_empty() && !view_due {
            return None;
        }
        let mut carried = Vec::new();
        let mut breakers = Vec::new();
        for (breaker, report) in reports {
            let Some(spec) = self.breakers.spec(breaker) else {
                continue;
            };
            let params = FleetParams::of(&spec.settings.params());
            let report = report.unwrap_or_default();
            breakers.push(BreakerReport {
                key: params.key(&spec.settings.name),
                name: spec.settings.name.clone(),
                fleet: true,
                params,
                status: self.breakers.status(breaker),
                calls: report.calls,
                probes: report.probes,
                places: report.places,
            });
            carried.push((breaker, report));
        }
        // The real time the counts cover: since this worker's previous report, else since
        // the view began counting, else (a first report of breakers alone) the base tick.
        let previous = self
            .last_report
            .get()
            .or_else(|| view.as_ref().and_then(|view| view.since()));
        let interval_ms = previous
            .map_or(REPORT_EVERY.whole_millis(), |previous| {
                cx.now.saturating_since(previous).whole_millis()
            })
            .clamp(1, report::MAX_INTERVAL_MS);
        self.last_report.set(Some(cx.now));
        let taken = view.map(|mut view| view.take(self.policy.rules(), cx.now));
        let (rules, paths) = taken.map_or((Vec::new(), None), |taken| (taken.rules, taken.paths));
        let mut request = ReportRequest {
            gateway,
            interval_ms,
            degraded: self.global.keeps_local(cx),
            breakers,
            rules,
            paths,
        };
        for breaker in &request.breakers {
            let calls = breaker.calls;
            log::debug!(
                "diana: breaker {} report: {} calls ({} slow, {} failed), {} probes",
                breaker.name,
                calls.calls,
                calls.slow,
                calls.failed,
                breaker.probes.good + breaker.probes.bad.calls
            );
        }
        let Some(body) = request.fit(report::MAX_REPORT_BYTES) else {
            // Not sent: the breakers' calls go into the next report.
            for (breaker, report) in carried {
                self.breakers.restore(cx.now, breaker, report);
            }
            return None;
        };
        Some(Call {
            callout: self.global.report_callout(body),
            then: Then(Kind::Report(carried, request)),
        })
    }

    /// The answer to a report: each breaker follows the fleet's state; a report lost or
    /// refused has its breakers' calls go into the next one (and the breakers fall back to
    /// their own state once the fleet's is no longer trusted). Its view's counts are not
    /// restored: the view is best effort.
    fn reported(
        &self,
        cx: &mut Cx<'_>,
        carried: Vec<(usize, Report)>,
        report: &ReportRequest,
        answer: &Answer,
    ) {
        let response = match answer {
            Answer::Answered(answered) if answered.status == 200 => answered
                .body_within(crate::call::MAX_SERVICE_ANSWER_BYTES)
                .and_then(|body| serde_json::from_slice::<ReportResponse>(body).ok())
                .filter(|response| report::check_response(report, response).is_ok()),
            _ => None,
        };
        let Some(response) = response else {
            let status = match answer {
                Answer::Answered(answered) => answered.status,
                Answer::NotSent(_) | Answer::NoAnswer => 0,
            };
            log::debug!(
                "diana: a report was not answered (status {status}): its calls go into the next one"
            );
            cx.metrics.event(Event::ReportFailed);
            for (breaker, report) in carried {
                self.breakers.restore(cx.now, breaker, report);
            }
            return;
        };
        for ((breaker, _), answer) in carried.into_iter().zip(response.breakers) {
            log::debug!("diana: the fleet answered {answer:?} for breaker {breaker}");
            self.breakers
                .follow(cx, self.local.store(), breaker, answer);
        }
    }

    /// Tokens of local batches this worker no longer spends go back to their counters
    /// (see [`crate::local`]). Returns how many.
    pub(crate) fn return_unspent(&self, cx: &mut Cx<'_>) -> usize {
        self.local.return_unspent(cx.shared, cx.now, |index| {
            let rule = self.policy.rule(index)?;
            Some((rule, self.table(rule)))
        })
    }

    /// The places of the requests inside taken or renewed [`RENEW_EVERY`] ago or more are
    /// counted as of now, so that they are never reclaimed as lost while the request
    /// lasts: local ones at once, those at the quota service in calls of at most
    /// [`wire::MAX_RULES`] places.
    fn renew(&self, cx: &mut Cx<'_>, calls: &mut Vec<Call>) {
        if !self.places.any() {
            return;
        }
        let mut at_service: Vec<(HoldingId, ServicePlace)> = Vec::new();
        let now = cx.now;
        self.places.visit(|holding, place| {
            if now.saturating_since(place.renewed) < RENEW_EVERY {
                return;
            }
            if let PlaceAt::Service { .. } = place.at {
                at_service.extend(place.start_renewal().map(|due| (holding, due)));
                return;
            }
            let (Some(rule), PlaceAt::Local(Taken::Shared(receipt))) =
                (self.policy.rule(place.rule), &place.at)
            else {
                return;
            };
            match self
                .local
                .store()
                .renew(cx.shared, &self.table(rule), receipt, now)
            {
                Ok(Some(renewed)) => {
                    place.at = PlaceAt::Local(Taken::Shared(renewed));
                    place.renewed = now;
                }
                // Its record went to another identity: the place is gone already.
                Ok(None) => place.renewed = now,
                Err(ChargeError::Contention) => cx.metrics.event(Event::StoreContention),
                Err(ChargeError::Host(error)) => {
                    log::warn!("diana: rule {}: place not renewed: {error}", rule.name);
                    cx.metrics.event(Event::StoreError);
                }
            }
        });
        for renewing in at_service.chunks(wire::MAX_RULES) {
            let asked: Vec<ServicePlace> = renewing.iter().map(|(_, place)| *place).collect();
            match self.global.plan_renewal(cx, &self.policy, &asked) {
                Some((callout, request)) => calls.push(Call {
                    callout,
                    then: Then(Kind::Renewal(renewing.to_vec(), request)),
                }),
                // Not renewed now (the service is out of reach): due again next tick.
                None => {
                    for (holding, asked) in renewing {
                        self.places.renewal_answered(*holding, asked, None, now);
                    }
                }
            }
        }
    }

    /// Settles an admitted request once the upstream has answered ([`crate::settle`]):
    /// `values` are the response headers [`AfterResponse::headers`] names, in order (`None`
    /// when absent). What is owed is charged to local rules at once, past their limit if
    /// need be, and to global rules from the tick (a payment); what is given back goes
    /// where it was taken from (the local counter, or this gateway's lease stash). The
    /// request's concurrency places stay held until it ends ([`Engine::end`]).
    pub fn after_response(
        &self,
        cx: &mut Cx<'_>,
        after: &AfterResponse,
        values: &[Option<Vec<u8>>],
        status: Option<u16>,
    ) {
        if !after.breakers.is_empty() {
            self.breakers.judge(
                cx,
                self.local.store(),
                &after.breakers,
                after.left_at,
                crate::breaker::answered_status(status),
            );
        }
        let by_header = after
            .charges
            .iter()
            .filter(|charge| charge.header.is_some());
        for (charge, value) in by_header.zip(values) {
            let Some(rule) = self.policy.rule(charge.rule) else {
                continue;
            };
            let settlement = settle(
                rule,
                charge.reserved.tokens(),
                charge.upfront,
                value.as_deref(),
            );
            self.carry_out_settlement(cx, rule, charge, settlement);
        }
    }

    /// What a request reads from its answer's body, one reader per rule whose cost is
    /// there, in the order [`Engine::after_body`] takes their results.
    pub fn body_readers(&self, after: &AfterResponse, framing: Framing) -> Vec<UsageReader> {
        after
            .body_charges()
            .filter_map(|charge| self.policy.rule(charge.rule))
            .filter_map(Rule::response_body_source)
            .map(|source| UsageReader::new(&source, framing))
            .collect()
    }

    /// Settles the rules whose cost an answer's body gives, once it ended (or was cut
    /// short): `read` is each reader's result, in [`Engine::body_readers`]' order. Returns
    /// the first reader's trouble, if any (for the worker's one log line).
    pub fn after_body(
        &self,
        cx: &mut Cx<'_>,
        after: &AfterResponse,
        read: Vec<Result<Usage, NoValue<Usage>>>,
    ) -> Option<UsageTrouble> {
        let mut trouble = None;
        let charges = after
            .body_charges()
            .filter_map(|charge| Some((charge, self.policy.rule(charge.rule)?)));
        for ((charge, rule), read) in charges.zip(read) {
            let Some(response_cost) = rule.response_cost.as_ref() else {
                continue;
            };
            let body = match read {
                Ok(usage) => BodyCost::Read(response_cost.charge(&usage)),
                Err(NoValue::CutShort { seen }) => {
                    BodyCost::CutShort(seen.map_or(0, |usage| response_cost.charge(&usage)))
                }
                Err(problem) => {
                    trouble.get_or_insert_with(|| UsageTrouble {
                        rule: rule.name.clone(),
                        problem: problem.to_string(),
                    });
                    BodyCost::Unknown
                }
            };
            cx.metrics.event(match body {
                BodyCost::Read(_) => Event::UsageSettled,
                BodyCost::CutShort(_) | BodyCost::Unknown => Event::UsageUnread,
            });
            let settlement = settle_body(rule, charge.reserved.tokens(), body);
            self.carry_out_settlement(cx, rule, charge, settlement);
        }
        trouble
    }

    /// Carries out one rule's settlement: what is owed is charged to a local rule at once,
    /// past its limit if need be, and to a global rule from the tick (a payment); what is
    /// given back goes where it was taken from.
    fn carry_out_settlement(
        &self,
        cx: &mut Cx<'_>,
        rule: &Rule,
        charge: &ResponseCharge,
        settlement: Settlement,
    ) {
        match settlement {
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
                    self.charge_debt_locally(cx, debt);
                }
            }
            Settlement::GiveBack(tokens) => match &charge.reserved {
                Reserved::Nothing => {}
                Reserved::Local(taken) => {
                    let part = taken.part(tokens);
                    let held = [Held {
                        rule: rule.index,
                        address: charge.address,
                        cost: part.tokens(),
                        taken: part,
                    }];
                    self.give_back_held(cx.shared, &held, cx.now, cx.metrics);
                }
                Reserved::Global { until, from, .. } => {
                    let refund = Refund {
                        index: rule.index,
                        address: charge.address,
                        tokens,
                        until: *until,
                    };
                    self.global.refund(cx, rule, refund, from.as_ref());
                }
            },
        }
    }

    /// An admitted request ended without response headers (a reset, an upstream timeout,
    /// its client gone): a failed call of each of its breakers. Its response costs are not
    /// settled (what it took up front stands).
    pub fn unanswered(&self, cx: &mut Cx<'_>, after: &AfterResponse) {
        self.breakers
            .judge(cx, self.local.store(), &after.breakers, after.left_at, None);
    }

    /// A request admitted to wait for its turn went away before it left Diana: not a call
    /// of its breakers (their probes' places go back).
    pub fn never_left(&self, cx: &mut Cx<'_>, after: &AfterResponse) {
        self.breakers
            .give_back(cx, self.local.store(), &after.breakers);
    }

    /// A request that held concurrency places ended (its response is done, its client
    /// left, its stream was reset): they are given back, local ones at once, those at the
    /// quota service from the tick.
    pub fn end(&self, cx: &mut Cx<'_>, holding: HoldingId) {
        let mut held: Vec<Held> = Vec::new();
        for place in self.places.end(holding) {
            match &place.at {
                PlaceAt::Local(taken) => held.push(Held {
                    rule: place.rule,
                    address: place.address,
                    cost: taken.tokens(),
                    taken: taken.clone(),
                }),
                PlaceAt::Service { .. } => {
                    if let Some(leaving) = place.to_leave() {
                        self.global.queue_leave(leaving, cx.metrics);
                    }
                }
            }
        }
        self.give_back_held(cx.shared, &held, cx.now, cx.metrics);
    }

    /// A request that held concurrency places ended and the clock cannot be read: those at
    /// the quota service are queued to go back all the same; local ones are reclaimed
    /// after `algo::inflight::RECLAIMED_AFTER`.
    pub fn end_without_clock(&self, holding: HoldingId, metrics: &mut dyn MetricSink) {
        for place in self.places.end(holding) {
            if let Some(leaving) = place.to_leave() {
                self.global.queue_leave(leaving, metrics);
            }
        }
    }

    /// True when this engine's breakers of `scope: global` are due for a report at `now`:
    /// [`FLEET_REPORT_DUE`] after the previous report, or a clock that went back.
    fn fleet_report_due(&self, now: Instant) -> bool {
        self.policy.has_fleet_breakers()
            && self
                .last_report
                .get()
                .is_none_or(|last| last > now || now.saturating_since(last) >= FLEET_REPORT_DUE)
    }

    /// True when this engine reports breakers of `scope: global`: the worker's tick then
    /// runs at least every [`FLEET_REPORT_EVERY`].
    pub fn reports_breakers(&self) -> bool {
        self.policy.has_fleet_breakers()
    }

    /// True when work waits for the tick that it would rather not wait a period for: a
    /// stash to refill ahead, places to give back, parked requests woken (their flight
    /// landed).
    pub fn wants_tick_soon(&self) -> bool {
        self.global.wants_refill() || self.global.wants_leave()
    }

    /// True while something of this engine is still in the world beyond its requests:
    /// response costs owed, parked requests, places on their way back, calls to release.
    /// A replaced configuration is let go once this is false and nothing refers to it.
    pub fn owes_work(&self) -> bool {
        self.global.owes() || self.global.has_riders() || self.global.wants_leave()
    }

    /// True when response costs wait to be sent (tests).
    #[cfg(test)]
    pub(crate) fn owes(&self) -> bool {
        self.global.owes()
    }
}

/// Why an answer's body gave a rule no usage (absent, malformed, not an integer): what the
/// worker logs once per configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageTrouble {
    pub rule: String,
    pub problem: String,
}
