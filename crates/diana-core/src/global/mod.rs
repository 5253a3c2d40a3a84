//! Global scope, filter side: plans the one callout of a request and interprets its
//! answer, from state it owns — the lease stash ([`stash`]) and the outage switch
//! ([`outage`]), both in shared data so that every worker of a gateway shares them — and
//! the calls the tick makes for the requests' sake (refills ahead, response costs,
//! releases, places left and renewed), each planned here and read back here.
//!
//! ```text
//! plan ─┬─ every rule served by leases (or a dry-run denial) ─▶ Done
//!       ├─ a cached denial ───────────────────────────────────▶ Rejected (leases taken given back)
//!       ├─ outage switch open ────────────────────────────────▶ Degrade (enforce those rules locally)
//!       └─ otherwise ─────────────────────────────────────────▶ Call (the complete callout) + Asked
//! interpret(Asked, reply) ─┬─ a valid answer, every rule admits ─▶ Done (spare tokens stashed)
//!                          ├─ a valid answer, a rule denies ─────▶ Rejected (every grant stashed, leases taken given back, denial cached)
//!                          ├─ 4xx (refused) ─────────────────────▶ Degrade, counted apart, logged once with the reason
//!                          └─ failure or invalid answer ─────────▶ Degrade, outage switch opened
//!                                 (no answer, or one not believed: the call released from the next tick)
//! ```
//!
//! Nothing the service answers is believed before [`wire::validate_response`] has checked
//! it against the request: one result per rule, `granted` within `cost..=want`, durations
//! and counts within what the limit allows. The engine sequences; this module never calls
//! back into it.

pub mod debts;
pub mod flights;
pub mod outage;
pub mod stash;

use crate::call::{Answer, Answered, Callout, DispatchError, MAX_SERVICE_ANSWER_BYTES};
use crate::config::{GlobalSpec, Policy, Rule};
use crate::cx::Cx;
use crate::metrics::{Event, MetricSink};
use crate::places::leaving::Leaving;
use crate::places::{places_in, ServicePlace};
use crate::response::RuleReport;
use crate::store::{SharedData, SlotAddress, Store};
use crate::time::{ceil_seconds, ceil_seconds_at_least_one, Instant, Nanos};
use crate::wire::{
    self, AcquireRequest, AcquireResponse, CallRule, ErrorResponse, ReleaseResponse, RuleRequest,
    RuleResult,
};
use debts::{Debt, Owed};
use flights::{FlightKey, Flights, RiderId};
use outage::{Gate, Outage};
use smallvec::SmallVec;
use stash::{Grant, RefillOrder, Stash, StashReceipt, Take};
use std::cell::{Cell, RefCell};

/// Refills ahead waiting for the worker's tick, at most (more are asked again by the
/// requests that find their stash low).
const MAX_REFILL_ORDERS: usize = 64;

/// Refills ahead sent by one tick, at most.
pub const MAX_REFILLS_PER_TICK: usize = 8;

/// The longest a wait-endpoint callout may take beyond `timeout_ms` (the service caps
/// its waits at 10 s).
pub const MAX_SERVICE_WAIT_MS: u64 = wire::MAX_WAIT_MS;

/// Releases waiting for the tick, at most (beyond, a gone request's grant stays charged).
const MAX_RELEASES: usize = 1024;

/// The quota service's endpoint `name` (`wait`, `charge`, `release`) beside its acquire
/// endpoint: `/v1/acquire` → `/v1/<name>`; any other path gets `/<name>` appended.
pub fn endpoint_beside(acquire_path: &str, name: &str) -> String {
    match acquire_path.strip_suffix("/acquire") {
        Some(base) => format!("{base}/{name}"),
        None => format!("{}/{name}", acquire_path.trim_end_matches('/')),
    }
}

/// Ids of the calls a VM makes for its requests (the wire's `call`): a random prefix,
/// drawn once, and a counter. `None` when the host has no random source: the calls then
/// carry no id and cannot be released.
#[derive(Debug, Default)]
struct CallIds {
    prefix: std::cell::OnceCell<Option<String>>,
    next: Cell<u64>,
}

impl CallIds {
    fn next(&self) -> Option<String> {
        let prefix = self.prefix.get_or_init(|| {
            crate::store::identity::random_key()
                .ok()
                .map(|bytes| bytes.iter().map(|byte| format!("{byte:02x}")).collect())
        });
        let counter = self.next.get();
        self.next.set(counter.wrapping_add(1));
        prefix
            .as_ref()
            .map(|prefix| format!("{prefix}-{counter:x}"))
    }
}

/// True when each request of `rule` asks the service for itself: a leaky bucket's turns
/// and a concurrency limit's places are never leased ahead nor coalesced.
fn asks_alone(rule: &Rule) -> bool {
    rule.algo.waits() || rule.algo.holds_until_done()
}

/// The quota service key of one (rule, identity): the same on every gateway.
pub fn global_key(rule: &Rule, address: SlotAddress) -> String {
    format!("{:016x}:{:016x}", rule.id, address.fingerprint)
}

/// A global rule of the request being evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalCharge {
    /// The rule's [`Rule::index`].
    pub index: usize,
    pub address: SlotAddress,
    /// Tokens the request takes.
    pub cost: u32,
}

/// What one global rule said about an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The rule admits (and was charged). No report when leased tokens paid.
    Admitted {
        index: usize,
        report: Option<RuleReport>,
        delay: Nanos,
        /// A concurrency limit's place at the service, which the request holds until it
        /// ends (see [`Global::queue_leave`]).
        place: Option<ServicePlace>,
    },
    /// The rule, in dry run, would have denied.
    WouldDeny { index: usize },
}

/// The rule that rejects the request, and what it reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denial {
    pub index: usize,
    pub report: RuleReport,
}

/// The call that gives back the grant of a call whose answer nobody will read (see
/// [`Global::abandon_call`]), or part of one rule's grant ([`Global::refund`]), and the
/// (rule, identity) pairs it frees.
#[derive(Debug, Clone)]
pub struct Release {
    pub callout: Callout,
    pub charges: Vec<GlobalCharge>,
    /// Part of one rule's grant: where the tokens go if the service gives nothing back.
    pub fallback: Option<Refund>,
}

/// Tokens a settled request gives back to this gateway's lease stash when the service
/// cannot take them back (see [`Global::refund`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refund {
    /// The rule's [`Rule::index`].
    pub index: usize,
    pub address: SlotAddress,
    pub tokens: u32,
    /// Until when the stash may spend them.
    pub until: Instant,
}

/// One entry per global rule of a request, inline: a request rarely has more than two,
/// and the plan every request served from the stash makes allocates nothing.
pub type PerRule<T> = SmallVec<[T; 2]>;

/// What the global rules of a request need before the answer.
#[derive(Debug)]
pub enum Plan {
    /// Decided without a call.
    Done(PerRule<Admission>),
    /// A cached denial rejects the request.
    Rejected(Denial, PerRule<Admission>),
    /// The breaker keeps these rules local: enforce them with the same parameters. The
    /// leased tokens already taken must be given back if the request is rejected.
    Degrade {
        outcomes: PerRule<Admission>,
        local: Vec<GlobalCharge>,
        served: PerRule<StashReceipt>,
    },
    /// Another request of this worker has a callout in flight for one of these rules:
    /// wait for it (see [`flights`]), then plan again.
    Park(RiderId),
    /// Make this call; interpret its reply with the [`Asked`].
    Call {
        outcomes: PerRule<Admission>,
        callout: Callout,
        asked: Asked,
    },
}

/// What a callout asked, kept with the paused request to interpret the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    charges: Vec<GlobalCharge>,
    /// Leased tokens taken for the request's other global rules.
    served: Vec<StashReceipt>,
    request: AcquireRequest,
    probe: bool,
    /// The flights this call is (see [`flights`]).
    flying: Vec<FlightKey>,
    /// A refill ahead: no request waits for it, every token granted goes to the stash.
    refill: bool,
}

impl Asked {
    /// True when this call is the breaker's probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// True when this call refills a stash ahead (no request waits for it).
    pub fn is_refill(&self) -> bool {
        self.refill
    }

    /// The body sent.
    pub fn request(&self) -> &AcquireRequest {
        &self.request
    }

    /// The rules of this call whose grant a settled answer may give back in part (those
    /// that settle), each with its place in the call; none without a call id or for a
    /// refill (its grant went to the stash).
    pub fn settling_rules(&self, policy: &Policy) -> Vec<(usize, CallRule)> {
        let Some(call) = self.request.call.as_ref().filter(|_| !self.refill) else {
            return Vec::new();
        };
        self.charges
            .iter()
            .enumerate()
            .filter(|(_, charge)| policy.rule(charge.index).is_some_and(Rule::settles))
            .filter_map(|(at, charge)| {
                let rule = u32::try_from(at).ok()?;
                let call = call.clone();
                Some((charge.index, CallRule { call, rule }))
            })
            .collect()
    }
}

/// How a worker's response costs get paid.
#[derive(Debug)]
pub enum Payment {
    Nothing,
    /// Make this call; what it does not take goes to [`Global::paid`].
    Call(Callout, Vec<Debt>),
    /// Charge these locally (the service is unavailable).
    Local(Vec<Debt>),
}

/// What the answer to a callout means.
#[derive(Debug)]
pub enum Interpretation {
    Done(Vec<Admission>),
    Rejected(Denial, Vec<Admission>),
    /// The service could not decide: enforce these rules locally. The leased tokens
    /// already taken must be given back if the request is rejected.
    Degrade {
        local: Vec<GlobalCharge>,
        served: Vec<StashReceipt>,
    },
}

/// Why a reply could not be believed.
enum Failure {
    /// The service refused what was sent (4xx): its status and its own reason.
    Refused(u16, String),
    /// The service could not be asked, or did not answer.
    Unavailable(Unavailable),
    /// The service answered something that does not match what was asked.
    Invalid(InvalidAnswer),
    /// Not asked: the host would not hold the request for the answer (the worker logged
    /// why). The service is not at fault.
    NotHeld,
}

impl Failure {
    /// True when the service may have granted what was asked though the gateway cannot
    /// use it: no answer came (the call may have been decided before the timeout or the
    /// reset), or one came that is not believed. Not after a refusal (4xx: nothing was
    /// granted), a call never sent, or another status (the service answers 5xx when it
    /// did not decide, or gave a late decision back itself).
    fn may_have_granted(&self) -> bool {
        matches!(
            self,
            Failure::Unavailable(Unavailable::NoAnswer) | Failure::Invalid(_)
        )
    }
}

/// Why the quota service could not decide.
#[derive(Debug)]
enum Unavailable {
    NotSent(DispatchError),
    /// Timeout, connection refused or reset.
    NoAnswer,
    /// An answer with a status other than 200 or 4xx.
    Status(u16),
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unavailable::NotSent(error) => write!(f, "callout not sent: {error}"),
            Unavailable::NoAnswer => f.write_str("no answer (timeout or connection failure)"),
            Unavailable::Status(status) => write!(f, "status {status}"),
        }
    }
}

/// What is wrong with an answer.
#[derive(Debug)]
enum InvalidAnswer {
    TooLarge,
    /// Not the wire format's JSON.
    Unreadable(serde_json::Error),
    /// Valid JSON that does not answer what was asked (the wire check's finding).
    Mismatch(wire::WireError),
}

impl std::fmt::Display for InvalidAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InvalidAnswer::TooLarge => {
                write!(f, "answer larger than {MAX_SERVICE_ANSWER_BYTES} bytes")
            }
            InvalidAnswer::Unreadable(error) => write!(f, "unreadable answer: {error}"),
            InvalidAnswer::Mismatch(error) => write!(f, "{error}"),
        }
    }
}

/// The global half of one policy's evaluation, per VM.
#[derive(Debug)]
pub struct Global {
    spec: GlobalSpec,
    document_dry_run: bool,
    resumes_elsewhere: bool,
    store: Store,
    outage: Outage,
    stash: Stash,
    flights: Flights,
    /// Response costs owed to the service, sent from the tick.
    owed: Owed,
    /// Stashes running low, to refill ahead from the tick (see [`Global::plan_refills`]).
    refills: RefCell<Vec<(GlobalCharge, RefillOrder)>>,
    /// A refusal or an invalid answer was logged by this VM (each is logged once).
    refusal_logged: Cell<bool>,
    invalid_logged: Cell<bool>,
    /// Ids for the calls of requests, so that one whose answer is lost can be released.
    calls: CallIds,
    /// Concurrency places of requests that ended, given back from the tick.
    leaving: Leaving,
    /// Releases of the calls of requests that went away, sent from the next tick (the
    /// root context, whose calls outlive any request).
    releases: RefCell<Vec<Release>>,
    /// A payment of response costs is in flight (one at a time).
    paying: Cell<bool>,
    /// This gateway's id in its reports, once known.
    gateway: std::cell::OnceCell<String>,
}

impl Global {
    pub fn new(policy: &Policy, resumes_elsewhere: bool) -> Global {
        Global {
            spec: policy.global.clone(),
            document_dry_run: policy.dry_run,
            resumes_elsewhere,
            store: Store::new(),
            outage: Outage::new(policy.global.retry_seconds),
            stash: Stash::default(),
            flights: Flights::default(),
            owed: Owed::default(),
            refills: RefCell::new(Vec::new()),
            refusal_logged: Cell::new(false),
            invalid_logged: Cell::new(false),
            calls: CallIds::default(),
            leaving: Leaving::default(),
            releases: RefCell::new(Vec::new()),
            paying: Cell::new(false),
            gateway: std::cell::OnceCell::new(),
        }
    }

    fn dry_run(&self, rule: &Rule) -> bool {
        rule.dry_run || self.document_dry_run
    }

    /// Decides what leases and cached denials can, and plans one call for the rest.
    pub fn plan(&self, cx: &mut Cx<'_>, policy: &Policy, charges: &[GlobalCharge]) -> Plan {
        let mut outcomes = PerRule::new();
        let mut served = PerRule::new();
        let mut ask = Vec::new();
        let mut rates = Vec::new();
        for charge in charges {
            let Some(rule) = policy.rule(charge.index) else {
                continue;
            };
            if rule.algo.holds_until_done() {
                // A place is the service's to give, one per request: nothing stashed,
                // no denial remembered (a place may free at any moment).
                ask.push(*charge);
                rates.push(0);
                continue;
            }
            match self
                .stash
                .take(cx.shared, rule, charge.address, charge.cost, cx.now)
            {
                Take::Served(receipt, refill) => {
                    if let Some(refill) = refill {
                        self.order_refill(charge, refill);
                    }
                    served.push(receipt);
                    outcomes.push(Admission::Admitted {
                        index: charge.index,
                        report: None,
                        delay: Nanos::ZERO,
                        place: None,
                    });
                }
                Take::Denied { retry_at, reset_at } => {
                    cx.metrics.event(Event::CachedDenial);
                    if self.dry_run(rule) {
                        outcomes.push(Admission::WouldDeny {
                            index: charge.index,
                        });
                        continue;
                    }
                    self.give_back(cx, policy, &served);
                    let report = RuleReport {
                        limit: rule.limit.rpu.get(),
                        remaining: 0,
                        reset_seconds: ceil_seconds(reset_at.saturating_since(cx.now)),
                        retry_after_seconds: ceil_seconds_at_least_one(
                            retry_at.saturating_since(cx.now),
                        ),
                    };
                    return Plan::Rejected(
                        Denial {
                            index: charge.index,
                            report,
                        },
                        outcomes,
                    );
                }
                Take::Ask { spend_rate } => {
                    ask.push(*charge);
                    rates.push(spend_rate);
                }
            }
        }
        if ask.is_empty() {
            return Plan::Done(outcomes);
        }
        // Leaky-bucket turns and concurrency places are per request: never coalesced
        // (see `flights`).
        let coalesced = |charge: &&GlobalCharge| {
            self.resumes_elsewhere
                && policy
                    .rule(charge.index)
                    .is_some_and(|rule| !asks_alone(rule))
        };
        let behind = ask.iter().filter(coalesced).find(|charge| {
            self.flights
                .in_flight((charge.index, charge.address.fingerprint))
        });
        if let Some(charge) = behind {
            let key = (charge.index, charge.address.fingerprint);
            if let Some(rider) = self.flights.park(key, charge.cost) {
                self.give_back(cx, policy, &served);
                cx.metrics.event(Event::GlobalCoalesced);
                return Plan::Park(rider);
            }
        }
        let probe = match self.outage.gate(&self.store, cx.shared, cx.now) {
            Gate::Call => false,
            Gate::Probe => true,
            Gate::Local => {
                return Plan::Degrade {
                    outcomes,
                    local: ask,
                    served,
                }
            }
        };
        let mut request = AcquireRequest {
            rules: ask
                .iter()
                .zip(&rates)
                .filter_map(|(charge, &spend_rate)| {
                    let rule = policy.rule(charge.index)?;
                    Some(self.rule_request(rule, charge, spend_rate, cx.now))
                })
                .collect(),
            call: self.calls.next(),
            rule: None,
        };
        fit_total_want(&mut request.rules);
        let body = match serde_json::to_vec(&request) {
            Ok(body) => body,
            Err(error) => {
                log::error!("diana: cannot encode the quota request: {error}");
                return Plan::Degrade {
                    outcomes,
                    local: ask,
                    served,
                };
            }
        };
        let flying: Vec<FlightKey> = ask
            .iter()
            .filter(coalesced)
            .map(|charge| (charge.index, charge.address.fingerprint))
            .collect();
        self.flights.take_off(&flying, self.flight_deadline(cx.now));
        cx.metrics.event(Event::GlobalCallout);
        let wait = !self.resumes_elsewhere
            && ask
                .iter()
                .filter_map(|charge| policy.rule(charge.index))
                .any(|rule| rule.algo.waits());
        let callout = self.callout(body, wait);
        Plan::Call {
            outcomes,
            callout,
            asked: Asked {
                charges: ask,
                served: served.into_vec(),
                request,
                probe,
                flying,
                refill: false,
            },
        }
    }

    /// A stash that ran low is refilled ahead, by a call of the worker's own (from its
    /// tick, so that no request waits for it), while the requests keep spending what is
    /// left: in the steady state a request never waits for a callout. Only where requests
    /// can wait on a flight (Envoy): the call is a flight, and the requests that empty the
    /// stash before its answer park behind it instead of calling too.
    fn order_refill(&self, charge: &GlobalCharge, refill: RefillOrder) {
        if !self.resumes_elsewhere
            || self
                .flights
                .in_flight((charge.index, charge.address.fingerprint))
        {
            return;
        }
        let Ok(mut orders) = self.refills.try_borrow_mut() else {
            return;
        };
        let same = |(order, _): &(GlobalCharge, RefillOrder)| {
            order.index == charge.index && order.address.fingerprint == charge.address.fingerprint
        };
        if orders.len() < MAX_REFILL_ORDERS && !orders.iter().any(same) {
            orders.push((*charge, refill));
        }
    }

    /// Whether a stash waits to be refilled ahead.
    pub fn wants_refill(&self) -> bool {
        self.refills
            .try_borrow()
            .is_ok_and(|orders| !orders.is_empty())
    }

    /// From the worker's tick: one call per stash that ran low (at most
    /// [`MAX_REFILLS_PER_TICK`]), each asking for the rule's lease with a cost of one, each
    /// a flight. None while the breaker keeps global rules local.
    pub fn plan_refills(&self, cx: &mut Cx<'_>, policy: &Policy) -> Vec<(Callout, Asked)> {
        let orders: Vec<(GlobalCharge, RefillOrder)> = match self.refills.try_borrow_mut() {
            Ok(mut orders) => orders.drain(..).collect(),
            Err(_) => return Vec::new(),
        };
        let mut calls = Vec::new();
        for (charge, refill) in orders.into_iter().take(MAX_REFILLS_PER_TICK) {
            let key = (charge.index, charge.address.fingerprint);
            let Some(rule) = policy.rule(charge.index) else {
                continue;
            };
            if self.flights.in_flight(key) {
                continue;
            }
            let probe = match self.outage.gate(&self.store, cx.shared, cx.now) {
                Gate::Call => false,
                Gate::Probe => true,
                Gate::Local => return calls,
            };
            let charge = GlobalCharge { cost: 1, ..charge };
            let request = AcquireRequest::new(vec![self.rule_request(
                rule,
                &charge,
                refill.spend_rate,
                cx.now,
            )]);
            let Ok(body) = serde_json::to_vec(&request) else {
                continue;
            };
            let flying = vec![key];
            self.flights.take_off(&flying, self.flight_deadline(cx.now));
            cx.metrics.event(Event::GlobalCallout);
            cx.metrics.event(Event::RefillAhead);
            calls.push((
                self.callout(body, false),
                Asked {
                    charges: vec![charge],
                    served: Vec::new(),
                    request,
                    probe,
                    flying,
                    refill: true,
                },
            ));
        }
        calls
    }

    /// The request for one rule. `spend_rate`: tokens per second this gateway spends of
    /// it, which sizes `lease: auto` (see [`stash::next_lease`]: what is spent in 100 ms, at most the
    /// rule's cap; one request's cost at first).
    /// A calendar rule (`unit: week | month`) names the period that contains `now`.
    fn rule_request(
        &self,
        rule: &Rule,
        charge: &GlobalCharge,
        spend_rate: u64,
        now: Instant,
    ) -> RuleRequest {
        // A leaky bucket's turns and a concurrency limit's places cannot be prefetched:
        // one request, its own.
        let want = if asks_alone(rule) {
            charge.cost
        } else {
            stash::next_lease(rule, spend_rate).max(charge.cost)
        };
        // The woken requests still waiting to plan again are served by this flight.
        let want = if asks_alone(rule) {
            want
        } else {
            let behind = self
                .flights
                .expected((charge.index, charge.address.fingerprint));
            let want = u64::from(want).saturating_add(behind);
            u32::try_from(want.min(u64::from(wire::MAX_WANT))).unwrap_or(wire::MAX_WANT)
        };
        let mut request = RuleRequest::new(
            global_key(rule, charge.address),
            rule.algo,
            &rule.limit,
            want,
        )
        .with_period(&rule.limit, now);
        request.cost = charge.cost;
        request.dry_run = self.dry_run(rule);
        if rule.algo.waits() {
            request.max_delay_ms = Some(if self.resumes_elsewhere {
                rule.max_wait.whole_millis()
            } else {
                rule.max_wait
                    .min(Nanos::from_millis(MAX_SERVICE_WAIT_MS))
                    .whole_millis()
            });
        }
        request
    }

    /// When a flight taken off at `now` is overdue: its call's own timeout. Flights are
    /// coalesced calls, which need a host that pauses, so never the longer wait calls.
    fn flight_deadline(&self, now: Instant) -> Instant {
        now.saturating_add(Nanos::from_millis(u64::from(self.spec.timeout_ms)))
    }

    fn callout(&self, body: Vec<u8>, wait: bool) -> Callout {
        let (path, timeout_ms) = if wait {
            (
                endpoint_beside(&self.spec.path, "wait"),
                u64::from(self.spec.timeout_ms).saturating_add(MAX_SERVICE_WAIT_MS),
            )
        } else {
            (self.spec.path.clone(), u64::from(self.spec.timeout_ms))
        };
        self.callout_to(path, timeout_ms, body)
    }

    /// The call that carries the tick's report (`/v1/report` beside the acquire path).
    pub fn report_callout(&self, body: Vec<u8>) -> Callout {
        self.callout_to(
            endpoint_beside(&self.spec.path, "report"),
            u64::from(self.spec.timeout_ms),
            body,
        )
    }

    /// True while the outage switch keeps global rules local.
    pub fn keeps_local(&self, cx: &mut Cx<'_>) -> bool {
        self.outage.keeps_local(&self.store, cx.shared, cx.now)
    }

    /// This gateway process's id in its reports: the public name of its random process
    /// key, which every worker shares (`None` while shared data cannot give one).
    pub fn gateway_id(&self, shared: &dyn SharedData) -> Option<String> {
        if let Some(id) = self.gateway.get() {
            return Some(id.clone());
        }
        let key = crate::store::identity::process_key(
            &self.store,
            shared,
            crate::store::identity::random_key,
        )
        .ok()?;
        Some(self.gateway.get_or_init(|| key.public_id()).clone())
    }

    fn callout_to(&self, path: String, timeout_ms: u64, body: Vec<u8>) -> Callout {
        let mut headers = vec![
            (":method", "POST".to_string()),
            (":path", path),
            (":authority", self.spec.authority.clone()),
            ("content-type", wire::CONTENT_TYPE.to_string()),
            (wire::TIMEOUT_HEADER, timeout_ms.to_string()),
        ];
        if let Some(token) = &self.spec.token {
            headers.push(("authorization", format!("Bearer {}", token.expose())));
        }
        Callout {
            upstream: self.spec.cluster.clone(),
            headers,
            body,
            timeout_ms,
        }
    }

    /// Interprets the answer to a call planned by [`Global::plan`].
    pub fn interpret(
        &self,
        cx: &mut Cx<'_>,
        policy: &Policy,
        asked: Asked,
        answer: Answer,
    ) -> Interpretation {
        self.flights.land(&asked.flying, cx.now);
        let results = match self.check(&asked, answer) {
            Ok(results) => results,
            Err(failure) => {
                if failure.may_have_granted() {
                    // The service may have decided the call and its answer is lost (a
                    // timeout after it took a place, a reset, an answer not believed):
                    // the request is decided here instead, so what the service granted
                    // goes back as for a client that left. A place would otherwise be
                    // held for nobody until the service reclaims it, 60 to 80 s later.
                    self.queue_release(cx, &asked.request, asked.charges.clone());
                }
                self.failed(cx, failure, asked.probe);
                if !asked.refill {
                    cx.metrics.event(Event::GlobalDegradedRequest);
                }
                return Interpretation::Degrade {
                    local: asked.charges,
                    served: asked.served,
                };
            }
        };
        if asked.probe && self.outage.close(&self.store, cx.shared, cx.now) {
            log::warn!("diana: quota service is back; global rules are global again");
            cx.metrics.degraded(false);
        }
        let admitted = asked.charges.iter().zip(&results).all(|(charge, result)| {
            result.granted >= charge.cost
                || policy
                    .rule(charge.index)
                    .is_none_or(|rule| self.dry_run(rule))
        });
        let mut outcomes = Vec::new();
        let mut denial = None;
        for (charge, result) in asked.charges.iter().zip(&results) {
            let Some(rule) = policy.rule(charge.index) else {
                continue;
            };
            let report = RuleReport::from_result(rule, result);
            let took = if !asked.refill && admitted && result.granted >= charge.cost {
                charge.cost
            } else {
                0
            };
            // A concurrency limit's places are never stashed, and no denial of theirs is
            // remembered (a place may free at any moment): one granted to nobody (a
            // request that is gone, or rejected by another rule) is given back at once.
            let holds = rule.algo.holds_until_done();
            let place = |places: u32| {
                result.place.filter(|_| holds).map(|bucket| ServicePlace {
                    index: charge.index,
                    address: charge.address,
                    bucket,
                    places,
                })
            };
            // Every token granted beyond what the request took is kept for later
            // requests (a lease, or an older service's grant for a rejected request).
            let spare = result.granted.saturating_sub(took);
            if holds {
                if let Some(unheld) = place(spare).filter(|_| spare > 0) {
                    self.queue_leave(unheld, cx.metrics);
                }
            } else if spare > 0 || (rule.lease_auto && result.granted > 0) {
                // An automatic lease learns this gateway's rate from every grant, even
                // one with nothing to spare.
                if spare > 0 && rule.lease.get() > 1 {
                    cx.metrics.event(Event::LeaseRefill);
                }
                let lifetime =
                    Nanos::saturating_from_millis(result.reset_ms).max(rule.limit.unit.nanos());
                self.stash.keep(
                    cx.shared,
                    rule,
                    charge.address,
                    Grant {
                        spare: u64::from(spare),
                        took: u64::from(took),
                        valid_until: cx.now.saturating_add(lifetime),
                    },
                    cx.now,
                );
            }
            if !result.allowed && !holds {
                let at = |ms: u64| cx.now.saturating_add(Nanos::saturating_from_millis(ms));
                let (retry_at, reset_at) = (at(result.retry_after_ms), at(result.reset_ms));
                self.stash
                    .deny(cx.shared, rule, charge.address, retry_at, reset_at, cx.now);
            }
            if took > 0 {
                let delay = Nanos::saturating_from_millis(result.delay_ms);
                if !delay.is_zero()
                    && !self.resumes_elsewhere
                    && denial.is_none()
                    && !self.dry_run(rule)
                {
                    // The service could not wait it all out and this host cannot hold it.
                    let report = RuleReport {
                        retry_after_seconds: ceil_seconds_at_least_one(delay),
                        ..report
                    };
                    denial = Some(Denial {
                        index: charge.index,
                        report,
                    });
                    continue;
                }
                outcomes.push(Admission::Admitted {
                    index: charge.index,
                    report: Some(report),
                    delay,
                    place: place(took),
                });
            } else if !result.allowed && self.dry_run(rule) {
                outcomes.push(Admission::WouldDeny {
                    index: charge.index,
                });
            } else if !result.allowed && denial.is_none() {
                denial = Some(Denial {
                    index: charge.index,
                    report,
                });
            }
        }
        match denial {
            None => Interpretation::Done(outcomes),
            Some(denial) => {
                self.give_back(cx, policy, &asked.served);
                for outcome in &outcomes {
                    if let Admission::Admitted {
                        place: Some(place), ..
                    } = *outcome
                    {
                        self.queue_leave(place, cx.metrics);
                    }
                }
                let dry: Vec<Admission> = outcomes
                    .into_iter()
                    .filter(|outcome| matches!(outcome, Admission::WouldDeny { .. }))
                    .collect();
                Interpretation::Rejected(denial, dry)
            }
        }
    }

    /// A request that held `place` at the service ended: it is given back from the tick.
    /// Places that cannot wait ([`crate::places::leaving`]: the queue is full) are counted in
    /// [`Event::PlacesUnreturned`]; the service reclaims them after its bound.
    pub fn queue_leave(&self, place: ServicePlace, metrics: &mut dyn MetricSink) {
        if let Err(refused) = self.leaving.push(place) {
            metrics.events(Event::PlacesUnreturned, u64::from(refused.places));
        }
    }

    /// True when places wait to be given back.
    pub fn wants_leave(&self) -> bool {
        !self.leaving.is_empty()
    }

    /// From the tick: the call that gives back the places of requests that ended (at most
    /// [`wire::MAX_RULES`] entries; the tick asks again until none wait), with how many
    /// places it carries. None when none wait, or while the outage switch keeps global
    /// rules local: every place waiting is then dropped and counted
    /// ([`Event::PlacesUnreturned`]), and the service reclaims them after its bound (a
    /// gateway that cannot reach it cannot give anything back).
    pub fn plan_leave(&self, cx: &mut Cx<'_>, policy: &Policy) -> Option<(Callout, u64)> {
        if self.leaving.is_empty() {
            return None;
        }
        if self.outage.keeps_local(&self.store, cx.shared, cx.now) {
            let dropped = self.leaving.take(usize::MAX);
            cx.metrics
                .events(Event::PlacesUnreturned, places_in(&dropped));
            return None;
        }
        let taken = self.leaving.take(wire::MAX_RULES);
        let request = self
            .places_request(policy, &taken)
            .and_then(|request| serde_json::to_vec(&request).ok());
        let Some(body) = request else {
            cx.metrics
                .events(Event::PlacesUnreturned, places_in(&taken));
            return None;
        };
        let callout = self.callout_to(
            endpoint_beside(&self.spec.path, "leave"),
            u64::from(self.spec.timeout_ms),
            body,
        );
        Some((callout, places_in(&taken)))
    }

    /// The answer to a leave call: its places were given back unless the service did not
    /// answer 2xx, in which case they are counted in [`Event::PlacesUnreturned`] (not
    /// sent again: a leave whose answer was lost may have been applied, and giving places
    /// back twice would let more requests in than the limit).
    pub fn left(&self, cx: &mut Cx<'_>, places: u64, answer: &Answer) {
        if !matches!(answer.status(), Some(200..=299)) {
            cx.metrics.events(Event::PlacesUnreturned, places);
        }
    }

    /// The call that renews `places` (at most [`wire::MAX_RULES`]), and what it asked, to
    /// read the answer with ([`Global::renewed`]). None while the outage switch keeps global
    /// rules local (renewed when the service is back; it reclaims them after its bound).
    pub fn plan_renewal(
        &self,
        cx: &mut Cx<'_>,
        policy: &Policy,
        places: &[ServicePlace],
    ) -> Option<(Callout, AcquireRequest)> {
        if places.is_empty() || self.outage.keeps_local(&self.store, cx.shared, cx.now) {
            return None;
        }
        let request = self.places_request(policy, places)?;
        let body = serde_json::to_vec(&request).ok()?;
        let callout = self.callout_to(
            endpoint_beside(&self.spec.path, "renew"),
            u64::from(self.spec.timeout_ms),
            body,
        );
        Some((callout, request))
    }

    /// The answer to a renewal: the bucket each place is counted in now, in order; None
    /// when the service did not renew them (no answer, a refusal, an answer that does not
    /// match what was asked).
    pub fn renewed(&self, request: &AcquireRequest, answer: &Answer) -> Option<Vec<u64>> {
        let Answer::Answered(answered) = answer else {
            return None;
        };
        if answered.status != 200 {
            return None;
        }
        let body = answered.body_within(MAX_SERVICE_ANSWER_BYTES)?;
        let response = wire::decode_response(request, body).ok()?;
        response
            .results
            .iter()
            .zip(&request.rules)
            .map(|(result, asked)| result.place.filter(|_| result.granted == asked.want))
            .collect()
    }

    /// The body naming `places`, each with its rule's counter and bucket.
    fn places_request(&self, policy: &Policy, places: &[ServicePlace]) -> Option<AcquireRequest> {
        let rules: Vec<RuleRequest> = places
            .iter()
            .filter_map(|place| {
                let rule = policy.rule(place.index)?;
                let mut request = RuleRequest::new(
                    global_key(rule, place.address),
                    rule.algo,
                    &rule.limit,
                    place.places.max(1),
                );
                request.cost = request.want;
                request.place = Some(place.bucket);
                Some(request)
            })
            .take(wire::MAX_RULES)
            .collect();
        (!rules.is_empty()).then(|| AcquireRequest::new(rules))
    }

    /// From the worker's tick: idle batches of leased tokens go back to the shared stash.
    pub fn tick(&self, cx: &mut Cx<'_>, policy: &Policy) {
        self.stash.return_unspent(cx.shared, policy, cx.now);
    }

    /// A request paused for its call is gone before the answer: its flights land (the
    /// requests parked behind them plan again) and the leased tokens it took go back.
    ///
    /// If the call carried an id, the call that gives back what the service granted it is
    /// queued for the next tick ([`Global::take_releases`]): nobody will read the answer
    /// (the host dropped it with its request), and without the release its tokens would
    /// stay charged — under `lease: 1`, tokens that the requests parked behind it ask for
    /// again.
    pub fn abandon_call(&self, cx: &mut Cx<'_>, policy: &Policy, asked: Asked) {
        self.flights.land(&asked.flying, cx.now);
        self.give_back(cx, policy, &asked.served);
        self.queue_release(cx, &asked.request, asked.charges);
    }

    /// Queues the release of the call `request` was (nothing without a call id): its
    /// grant goes back to the service from the next tick.
    fn queue_release(&self, cx: &mut Cx<'_>, request: &AcquireRequest, charges: Vec<GlobalCharge>) {
        if request.call.is_none() {
            return;
        }
        let Ok(body) = serde_json::to_vec(request) else {
            return;
        };
        let release = Release {
            callout: self.release_callout(body),
            charges,
            fallback: None,
        };
        match self.releases.try_borrow_mut() {
            Ok(mut releases) if releases.len() < MAX_RELEASES => releases.push(release),
            _ => cx.metrics.event(Event::ReleaseUnsent),
        }
    }

    fn release_callout(&self, body: Vec<u8>) -> Callout {
        self.callout_to(
            endpoint_beside(&self.spec.path, "release"),
            u64::from(self.spec.timeout_ms),
            body,
        )
    }

    /// The answer to `asked` came but cannot be read without a clock: its flights land and
    /// the leased tokens it took go back; the service keeps what it granted (unspent, as
    /// when a clock-less gateway is answered), and there is nothing to release.
    pub fn forget_call(&self, shared: &dyn SharedData, policy: &Policy, asked: Asked) {
        self.flights.land(&asked.flying, Instant::EPOCH);
        for receipt in &asked.served {
            if let Some(rule) = policy.rule(receipt.rule) {
                self.stash.give_back(shared, rule, receipt, Instant::EPOCH);
            }
        }
    }

    /// A payment's answer came but cannot be read without a clock: another may be made.
    pub fn payment_forgotten(&self) {
        self.paying.set(false);
    }

    /// From the tick: the releases queued since the last one. A refund's tokens have
    /// waited in this gateway's stash since the answer ([`Global::refund`]): what is
    /// still there is taken out and released; tokens a later request here spent meanwhile
    /// have done their work, and their release is dropped.
    pub fn take_releases(&self, cx: &mut Cx<'_>, policy: &Policy) -> Vec<Release> {
        let queued = self
            .releases
            .try_borrow_mut()
            .map(|mut releases| std::mem::take(&mut *releases))
            .unwrap_or_default();
        queued
            .into_iter()
            .filter(|release| {
                let Some(refund) = &release.fallback else {
                    return true;
                };
                let Some(rule) = policy.rule(refund.index) else {
                    return false;
                };
                matches!(
                    self.stash
                        .take(cx.shared, rule, refund.address, refund.tokens, cx.now),
                    Take::Served(..)
                )
            })
            .collect()
    }

    /// The answer to a release: sent, the tokens are back at the service (given back now,
    /// or when its acquire is decided), so a denial cached for its (rule, identity)
    /// meanwhile no longer holds; not sent, that grant stays charged, as before releases
    /// existed.
    ///
    /// A release of part of one rule's grant (`fallback`) reads the answer: the tokens are
    /// back at the service only when it says `released: true`; otherwise (not sent, no
    /// answer, a refusal, the call forgotten) they go to this gateway's stash instead.
    pub fn released(
        &self,
        cx: &mut Cx<'_>,
        policy: &Policy,
        charges: &[GlobalCharge],
        fallback: Option<Refund>,
        answer: &Answer,
    ) {
        if let Some(refund) = fallback {
            if !gave_back(answer) {
                if let Answer::NotSent(error) = answer {
                    cx.metrics.event(Event::ReleaseUnsent);
                    log::debug!("diana: a release was not sent: {error}");
                }
                cx.metrics.event(Event::RefundStashed);
                if let Some(rule) = policy.rule(refund.index) {
                    self.stash_refund(cx, rule, &refund);
                }
                return;
            }
        }
        if let Answer::NotSent(error) = answer {
            cx.metrics.event(Event::ReleaseUnsent);
            log::debug!("diana: a release was not sent: {error}");
            return;
        }
        cx.metrics.event(Event::GlobalReleased);
        for charge in charges {
            if let Some(rule) = policy.rule(charge.index) {
                self.stash.forget_denial(cx.shared, rule, charge.address);
            }
        }
    }

    /// The answer to a call whose request is gone (its client left while the call was in
    /// flight): every token the service granted is kept for later requests, as a refill's
    /// would be, and the tokens the request took from stashes go back.
    pub fn interpret_for_nobody(
        &self,
        cx: &mut Cx<'_>,
        policy: &Policy,
        mut asked: Asked,
        answer: Answer,
    ) {
        self.give_back(cx, policy, &asked.served);
        asked.served.clear();
        asked.refill = true;
        let _ = self.interpret(cx, policy, asked, answer);
    }

    /// A parked request is gone.
    pub fn unpark(&self, rider: RiderId) {
        self.flights.unpark(rider);
    }

    /// A woken request plans again: it asks for itself from now on.
    pub fn replanning(&self, rider: RiderId) {
        self.flights.replanning(rider);
    }

    /// Flights whose answer is overdue are treated as landed (their riders are woken).
    pub fn land_overdue(&self, now: Instant) {
        self.flights.land_overdue(now);
    }

    /// The next parked request to plan again (its flight landed), in the order they parked.
    pub fn next_woken(&self) -> Option<RiderId> {
        self.flights.next_woken()
    }

    /// True when requests are parked: the host must tick to wake them.
    pub fn has_riders(&self) -> bool {
        self.flights.busy()
    }

    /// True when parked requests were woken (their flight landed) and wait to be planned
    /// again.
    pub fn has_woken_riders(&self) -> bool {
        self.flights.has_woken()
    }

    /// Gives back `tokens` a request of `address` had from the service and did not use
    /// (its answer settled for less, [`crate::settle`]: `count: {status}` not counted, a
    /// reservation settled lower). They go to this gateway's lease stash at once, where
    /// the identity's next requests here spend them (until `until`): a client that logs
    /// in successfully twice in a row is not refused while the tokens travel. When the
    /// request's own call granted them (`from`), the next tick takes what is still in the
    /// stash back out and releases it to the service ([`Global::take_releases`]): a
    /// release of part of that rule's grant, so that behind a load balancer the
    /// identity's next request, on any gateway, finds them. Otherwise (the tokens came
    /// from the stash, the call had no id), or when the release finds nothing
    /// ([`Global::released`]), they stay in (or go back to) this gateway's stash.
    pub fn refund(&self, cx: &mut Cx<'_>, rule: &Rule, refund: Refund, from: Option<&CallRule>) {
        self.stash_refund(cx, rule, &refund);
        if let Some(from) = from {
            let mut request = AcquireRequest::new(vec![RuleRequest::new(
                global_key(rule, refund.address),
                rule.algo,
                &rule.limit,
                refund.tokens,
            )
            .with_period(&rule.limit, cx.now)]);
            request.call = Some(from.call.clone());
            request.rule = Some(from.rule);
            if let Ok(body) = serde_json::to_vec(&request) {
                let release = Release {
                    callout: self.release_callout(body),
                    charges: vec![GlobalCharge {
                        index: refund.index,
                        address: refund.address,
                        cost: refund.tokens,
                    }],
                    fallback: Some(refund),
                };
                if let Ok(mut releases) = self.releases.try_borrow_mut() {
                    if releases.len() < MAX_RELEASES {
                        releases.push(release);
                        return;
                    }
                }
            }
        }
        cx.metrics.event(Event::RefundStashed);
    }

    /// Tokens of a settled request to this gateway's lease stash; a denial remembered for
    /// the identity is forgotten, so that it does not hide them.
    fn stash_refund(&self, cx: &mut Cx<'_>, rule: &Rule, refund: &Refund) {
        let receipt =
            StashReceipt::refund(rule, refund.address, u64::from(refund.tokens), refund.until);
        self.stash.give_back(cx.shared, rule, &receipt, cx.now);
        self.stash.forget_denial(cx.shared, rule, refund.address);
    }

    /// Owes `debt` (a response cost) to the service; when this worker's table of debts is
    /// full, gives it back to be charged locally at once.
    pub fn owe(&self, debt: Debt) -> Option<Debt> {
        self.owed.add(debt)
    }

    /// True when response costs wait to be sent.
    pub fn owes(&self) -> bool {
        !self.owed.is_empty()
    }

    /// Plans the callout that pays this worker's debts (one in flight at a time), or gives
    /// them back to be charged locally when the outage switch keeps global rules local.
    pub fn plan_payment(&self, cx: &mut Cx<'_>, policy: &Policy) -> Payment {
        if self.paying.get() {
            return Payment::Nothing;
        }
        let debts = self.owed.take();
        if debts.is_empty() {
            return Payment::Nothing;
        }
        if self.outage.gate(&self.store, cx.shared, cx.now) == Gate::Local {
            return Payment::Local(debts);
        }
        // One charge carries at most MAX_RULES rules of at most MAX_WANT tokens each, and
        // MAX_TOTAL_WANT in all: what does not fit (a debt's rest included) stays owed and
        // goes with the next tick's charge.
        let mut rules = Vec::new();
        let mut sent: Vec<Debt> = Vec::new();
        let mut later: Vec<Debt> = Vec::new();
        let mut total = 0u64;
        for debt in debts {
            let Some(rule) = policy.rule(debt.rule) else {
                continue;
            };
            let mut left = debt.tokens;
            while left > 0 && rules.len() < wire::MAX_RULES && total < wire::MAX_TOTAL_WANT {
                let room = left
                    .min(u64::from(wire::MAX_WANT))
                    .min(wire::MAX_TOTAL_WANT - total);
                let tokens = u32::try_from(room).unwrap_or(wire::MAX_WANT);
                left -= u64::from(tokens);
                total += u64::from(tokens);
                rules.push(
                    RuleRequest::new(
                        global_key(rule, debt.address),
                        rule.algo,
                        &rule.limit,
                        tokens,
                    )
                    .with_period(&rule.limit, cx.now),
                );
            }
            if left < debt.tokens {
                sent.push(Debt {
                    tokens: debt.tokens - left,
                    ..debt
                });
            }
            if left > 0 {
                later.push(Debt {
                    tokens: left,
                    ..debt
                });
            }
        }
        // The debts were all taken out, so the rests fit back (the table only shrank); one
        // that does not is charged locally with the rest, never dropped.
        let mut local: Vec<Debt> = later
            .into_iter()
            .filter_map(|debt| self.owed.add(debt))
            .collect();
        if rules.is_empty() {
            return if local.is_empty() {
                Payment::Nothing
            } else {
                Payment::Local(local)
            };
        }
        if !local.is_empty() {
            local.extend(sent);
            return Payment::Local(local);
        }
        let body = match serde_json::to_vec(&AcquireRequest::new(rules)) {
            Ok(body) => body,
            Err(_) => return Payment::Local(sent),
        };
        cx.metrics.event(Event::GlobalCallout);
        let callout = self.callout_to(
            endpoint_beside(&self.spec.path, "charge"),
            u64::from(self.spec.timeout_ms),
            body,
        );
        self.paying.set(true);
        Payment::Call(callout, sent)
    }

    /// The answer to a payment: the debts the service did not take, to charge locally.
    pub fn paid(&self, cx: &mut Cx<'_>, debts: Vec<Debt>, answer: Answer) -> Vec<Debt> {
        self.paying.set(false);
        match answer {
            Answer::Answered(Answered { status: 200, .. }) => Vec::new(),
            Answer::Answered(answered) if (400..500).contains(&answered.status) => {
                let reason = refusal_reason(&answered);
                self.failed(cx, Failure::Refused(answered.status, reason), false);
                debts
            }
            Answer::Answered(Answered { status, .. }) => {
                self.unavailable(cx, &format!("status {status}"));
                debts
            }
            Answer::NoAnswer => {
                self.unavailable(cx, "no answer to a charge");
                debts
            }
            Answer::NotSent(error) => {
                self.unavailable(cx, &error.to_string());
                debts
            }
        }
    }

    /// Gives leased tokens taken for a request back to the stash (the request was
    /// rejected after all).
    pub fn give_back(&self, cx: &mut Cx<'_>, policy: &Policy, served: &[StashReceipt]) {
        for receipt in served {
            if let Some(rule) = policy.rule(receipt.rule) {
                self.stash.give_back(cx.shared, rule, receipt, cx.now);
            }
        }
    }

    /// Checks an answer against what was asked.
    fn check(&self, asked: &Asked, answer: Answer) -> Result<Vec<RuleResult>, Failure> {
        let answered = match answer {
            Answer::NotSent(DispatchError::CannotPause { .. }) => return Err(Failure::NotHeld),
            Answer::NotSent(error) => {
                return Err(Failure::Unavailable(Unavailable::NotSent(error)))
            }
            Answer::NoAnswer => return Err(Failure::Unavailable(Unavailable::NoAnswer)),
            Answer::Answered(answered) => answered,
        };
        let status = answered.status;
        // A 4xx is a refusal whatever its body (too large, unreadable or absent): the service
        // is up, so it must never open the outage switch.
        if (400..500).contains(&status) {
            return Err(Failure::Refused(status, refusal_reason(&answered)));
        }
        let Some(body) = answered.body_within(MAX_SERVICE_ANSWER_BYTES) else {
            return Err(Failure::Invalid(InvalidAnswer::TooLarge));
        };
        if status != 200 {
            return Err(Failure::Unavailable(Unavailable::Status(status)));
        }
        let answer: AcquireResponse = serde_json::from_slice(body)
            .map_err(|error| Failure::Invalid(InvalidAnswer::Unreadable(error)))?;
        wire::validate_response(&asked.request, &answer)
            .map_err(|reason| Failure::Invalid(InvalidAnswer::Mismatch(reason)))?;
        Ok(answer.results)
    }

    fn failed(&self, cx: &mut Cx<'_>, failure: Failure, probe: bool) {
        match failure {
            Failure::Refused(status, reason) => {
                // The service is up; what was sent is at fault, not the service.
                cx.metrics.event(Event::GlobalRefused);
                if probe && self.outage.close(&self.store, cx.shared, cx.now) {
                    cx.metrics.degraded(false);
                }
                if !self.refusal_logged.replace(true) {
                    if status == 401 || status == 403 {
                        log::error!(
                            "diana: the quota service refused this gateway's credential ({status}: {reason}); \
                             check global.token against the service's --token-file; global rules are decided locally"
                        );
                    } else {
                        log::error!(
                            "diana: the quota service refused a request ({status}: {reason}); it is decided locally"
                        );
                    }
                }
            }
            Failure::Invalid(reason) => {
                cx.metrics.event(Event::GlobalInvalidAnswer);
                if !self.invalid_logged.replace(true) {
                    log::error!(
                        "diana: the quota service answered what was not asked ({reason}); not believed"
                    );
                }
                self.unavailable(cx, &reason.to_string());
            }
            Failure::Unavailable(reason) => self.unavailable(cx, &reason.to_string()),
            Failure::NotHeld => {}
        }
    }

    fn unavailable(&self, cx: &mut Cx<'_>, reason: &str) {
        cx.metrics.event(Event::GlobalError);
        if self.outage.open(&self.store, cx.shared, cx.now) {
            log::warn!(
                "diana: quota service unavailable ({reason}); global rules are enforced locally for {}s",
                self.spec.retry_seconds
            );
            cx.metrics.degraded(true);
        }
    }
}

/// Lowers the wants of one request's rules so that they add up to at most
/// [`wire::MAX_TOTAL_WANT`] (the service refuses more): each rule keeps its own cost (the
/// configuration keeps the costs within the bound) and the rest of the bound is shared in
/// proportion to what each asked beyond its cost.
fn fit_total_want(rules: &mut [RuleRequest]) {
    let total: u64 = rules.iter().map(|rule| u64::from(rule.want)).sum();
    if total <= wire::MAX_TOTAL_WANT {
        return;
    }
    let costs: u64 = rules
        .iter()
        .map(|rule| u64::from(rule.cost.min(rule.want)))
        .sum();
    let extra = total - costs;
    let room = wire::MAX_TOTAL_WANT.saturating_sub(costs);
    for rule in rules.iter_mut() {
        let cost = rule.cost.min(rule.want);
        let beyond = u64::from(rule.want - cost);
        let share = beyond.saturating_mul(room).checked_div(extra).unwrap_or(0);
        rule.want = cost.saturating_add(u32::try_from(share).unwrap_or(0));
    }
}

/// True when the answer to a release says a grant was given back (`released: true`).
fn gave_back(answer: &Answer) -> bool {
    match answer {
        Answer::Answered(answered) if answered.status == 200 => answered
            .body_within(MAX_SERVICE_ANSWER_BYTES)
            .and_then(|body| serde_json::from_slice::<ReleaseResponse>(body).ok())
            .is_some_and(|response| response.released),
        _ => false,
    }
}

/// The service's reason for a 4xx: its JSON `error`, else the body's text, at most 300
/// characters; empty when the body was too large to read.
fn refusal_reason(answered: &Answered) -> String {
    let Some(body) = answered.body_within(MAX_SERVICE_ANSWER_BYTES) else {
        return String::new();
    };
    serde_json::from_slice::<ErrorResponse>(body)
        .map(|error| error.error)
        .unwrap_or_else(|_| String::from_utf8_lossy(body).into_owned())
        .chars()
        .take(300)
        .collect()
}
