//! The quota service's side of the global protocol, without I/O: how `diana-quota` decides
//! the rules of one request ([`decide`], which the service runs under its lock and mirrors
//! in Lua), the in-memory decision [`table`] its embedded store keeps, and [`MemoryQuota`],
//! an in-process service over the same table that answers the engine's callouts directly
//! (for `diana simulate`, the worker's `Sim` and native tests). One table for both, so that
//! the simulated service cannot decide otherwise than the real one.

pub mod decide;
pub mod fleet;
pub mod ledger;
pub mod table;

use crate::algo::{Algorithm, Limit, Mark};
use crate::call::{Answer, Callout};
use crate::time::{Instant, Nanos};
use crate::wire::{
    self, AcquireRequest, AcquireResponse, ErrorResponse, ReleaseResponse, Released, ResolvedRule,
    RuleResult, WireError,
};
use ledger::{CallLedger, CounterDigest, Grant, Noted};
use std::fmt;
use table::Table;

/// One rule's decision, with where its grant was counted (for a later release).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    pub result: RuleResult,
    /// Meaningful only when `result.granted > 0`.
    pub mark: Mark,
}

impl Outcome {
    /// The grants of concurrency places still held, as a leave names them: `want` places
    /// of each rule, counted at its place (`wire::resolve_places`).
    pub fn held(rules: &[ResolvedRule<'_>], places: Vec<Mark>) -> Vec<Outcome> {
        rules
            .iter()
            .zip(places)
            .map(|(rule, mark)| Outcome {
                result: RuleResult {
                    allowed: true,
                    granted: rule.want.get(),
                    ..RuleResult::default()
                },
                mark,
            })
            .collect()
    }
}

/// The counter a rule addresses: its key **bound to its algorithm and every parameter of
/// its limit**. A request with the same key but another algorithm, rate, unit, burst or
/// slice count addresses another counter: it can neither read nor reset (nor deny through)
/// the first one. Every store keys its counters by this (the memory store as is, Redis as
/// [`CounterId::params`] after the hash tag), so they all behave alike.
///
/// Except a concurrency limit (`IF`, [`Algorithm::state_follows_limit`]): its counter is
/// its key and algorithm alone (`limit` is `None`), and each acquire checks the places
/// held against the N it carries. The places of the requests inside are the same places
/// whatever N a gateway's document says, so an edit of `max_in_flight` (or two gateways
/// mid-rollout, one at 3 and one at 4) keeps counting them: each admits while fewer than
/// its own N are held. A request naming another N reads and takes the same places; it
/// cannot reach anyone else's key (keys are keyed hashes of the identity).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CounterId {
    pub key: String,
    pub algo: &'static str,
    /// `None`: not bound to its limit (a concurrency limit).
    pub limit: Option<Limit>,
}

impl CounterId {
    /// The counter of a validated rule (aliases and case already resolved: `token bucket`
    /// per `Hours` is `TB` per `hour`).
    pub fn of(rule: &ResolvedRule<'_>) -> CounterId {
        CounterId {
            key: rule.key.to_string(),
            algo: rule.algo.code(),
            limit: bound_limit(rule.algo, &rule.limit),
        }
    }

    /// Whether `rule` addresses this counter.
    pub fn is(&self, rule: &ResolvedRule<'_>) -> bool {
        self.key == rule.key
            && self.algo == rule.algo.code()
            && self.limit == bound_limit(rule.algo, &rule.limit)
    }

    /// The parameters, as they follow the key in a store's name for the counter:
    /// `<ALGO>:<rpu>:<unit>:<burst>:<slices>` (`TB:10:second:10:10`), `IF` alone.
    pub fn params(&self) -> String {
        match &self.limit {
            Some(limit) => counter_params(self.algo, limit),
            None => self.algo.to_string(),
        }
    }
}

/// The limit a counter of `algo` is bound to (`None`: its state does not follow it).
fn bound_limit(algo: &dyn Algorithm, limit: &Limit) -> Option<Limit> {
    algo.state_follows_limit().then(|| Limit {
        period: limit.period.map(|period| period.bound(algo.code())),
        ..limit.clone()
    })
}

/// `<ALGO>:<rpu>:<unit>:<burst>:<slices>`, every parameter of a counter in one canonical
/// form (`W:100:minute:100:10`): distinct parameters give distinct names, and a key cannot
/// hold `{` or `}`, so `diana:{<key>}:<params>` names one counter only. A concurrency
/// limit's counter is not bound to its limit ([`CounterId`]): `IF` alone.
pub fn counter_params(algo: &str, limit: &Limit) -> String {
    if crate::algo::lookup_wire(algo).is_some_and(|algo| !algo.state_follows_limit()) {
        return algo.to_string();
    }
    // A calendar period: its unit, and for a fixed window the period it counts in
    // (`W:100:month.1764543600000.2678400000:100:1`), so that every period has its own
    // counter; a bucket carries on over periods (`TB:100:month:100:1`).
    let unit = match limit.period {
        None => limit.unit.name().to_string(),
        Some(period) if algo == "W" => format!(
            "{}.{}.{}",
            period.unit.name(),
            period.start.unix_nanos() / 1_000_000,
            period.length.get() / 1_000_000
        ),
        Some(period) => period.unit.name().to_string(),
    };
    format!(
        "{algo}:{}:{unit}:{}:{}",
        limit.rpu, limit.burst, limit.slices
    )
}

// ---------------------------------------------------------------------------------------
// The service's times: the decision's deadline and `/v1/wait`'s hold.

/// diana-quota's times (`--deadline-ms`, `--timeout-margin-ms`, `--max-wait-ms`): when a
/// decision is answered and how long `/v1/wait` may hold its answer. The HTTP service and
/// [`MemoryQuota`] both work them out here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceTimes {
    /// The longest a decision takes to be answered.
    pub deadline: Nanos,
    /// With the gateway's timeout `T` (`x-diana-timeout-ms`), the answer comes before
    /// `T − margin`.
    pub margin: Nanos,
    /// The longest `/v1/wait` holds its answer.
    pub max_wait: Nanos,
}

impl Default for ServiceTimes {
    /// diana-quota's defaults: 40 ms, 10 ms, 10 s.
    fn default() -> Self {
        ServiceTimes {
            deadline: Nanos::from_millis(40),
            margin: Nanos::from_millis(10),
            max_wait: Nanos::from_millis(wire::MAX_WAIT_MS),
        }
    }
}

impl ServiceTimes {
    /// How long the gateway waits, counted from the call's arrival (`T − margin`), if it
    /// said (`timeout`: its `x-diana-timeout-ms`).
    pub fn gateway(&self, timeout: Option<Nanos>) -> Option<Nanos> {
        timeout.map(|timeout| Nanos::new(timeout.get().saturating_sub(self.margin.get())))
    }

    /// The decision's budget from the call's arrival: the deadline, or less when the
    /// gateway stops waiting sooner.
    pub fn budget(&self, timeout: Option<Nanos>) -> Nanos {
        self.gateway(timeout)
            .map_or(self.deadline, |gateway| gateway.min(self.deadline))
    }

    /// The furthest turn `/v1/wait` may hold a request for: `max_wait`, and no later than
    /// the gateway stops waiting once the decision's budget is spent. A waiting rule's
    /// `max_delay` is capped to it (a later turn is denied, not reserved).
    pub fn wait_cap(&self, timeout: Option<Nanos>) -> Nanos {
        let budget = self.budget(timeout);
        self.gateway(timeout).map_or(self.max_wait, |gateway| {
            self.max_wait
                .min(Nanos::new(gateway.get().saturating_sub(budget.get())))
        })
    }
}

/// Caps the `max_delay` of every rule whose algorithm waits at `cap` (`/v1/wait`).
pub fn cap_delays(rules: &mut [ResolvedRule<'_>], cap: Nanos) {
    // Whole milliseconds, as the wire carries them.
    let cap = Nanos::saturating_from_millis(cap.whole_millis());
    for rule in rules.iter_mut().filter(|rule| rule.algo.waits()) {
        rule.max_delay = Some(rule.max_delay.map_or(cap, |own| own.min(cap)));
    }
}

/// `/v1/wait`'s hold: when every rule is allowed, the longest delay, at most `most`; every
/// delay is reported minus the hold (so 0 when the whole delay was held). Zero when a rule
/// is denied (the answer goes at once: the gateway rejects the request anyway).
pub fn hold(results: &mut [RuleResult], most: Nanos) -> Nanos {
    if !results.iter().all(|result| result.allowed) {
        return Nanos::ZERO;
    }
    let longest = results
        .iter()
        .map(|result| result.delay_ms)
        .max()
        .unwrap_or(0);
    let held = Nanos::saturating_from_millis(longest).min(most);
    let held_ms = held.whole_millis();
    for result in results.iter_mut() {
        result.delay_ms = result.delay_ms.saturating_sub(held_ms);
    }
    held
}

// ---------------------------------------------------------------------------------------
// The in-process service.

/// Why an endpoint of [`MemoryQuota`] answers with an error, as the service would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointError {
    /// The request breaks the wire format, or asks what the table cannot do (a debt on a
    /// leaky bucket): 400.
    BadRequest(String),
    /// The table is full of live counters: 503.
    Full(table::Full),
    /// The fleet's breaker table is full of live states: 503.
    FleetFull(String),
}

impl EndpointError {
    /// The HTTP status the service answers.
    pub fn status(&self) -> u16 {
        match self {
            EndpointError::BadRequest(_) => 400,
            EndpointError::Full(_) | EndpointError::FleetFull(_) => 503,
        }
    }
}

impl fmt::Display for EndpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndpointError::BadRequest(reason) => f.write_str(reason),
            EndpointError::Full(full) => write!(f, "store full: {full}"),
            EndpointError::FleetFull(reason) => write!(f, "store full: {reason}"),
        }
    }
}

impl From<WireError> for EndpointError {
    fn from(error: WireError) -> Self {
        EndpointError::BadRequest(error.to_string())
    }
}

impl From<table::Full> for EndpointError {
    fn from(full: table::Full) -> Self {
        EndpointError::Full(full)
    }
}

impl From<table::ChargeRefused> for EndpointError {
    fn from(refused: table::ChargeRefused) -> Self {
        match refused {
            table::ChargeRefused::Debtless(debtless) => {
                EndpointError::BadRequest(debtless.to_string())
            }
            table::ChargeRefused::Full(full) => EndpointError::Full(full),
        }
    }
}

/// A quota service in memory that decides as `diana-quota` decides, over the same decision
/// [`Table`] as its embedded store: every endpoint of the wire format (`/v1/acquire` all or
/// nothing with rules in dry run aside, `/v1/wait` with its delays capped and held as the
/// service holds them, `/v1/charge` past the limits, `/v1/release` by call id, `/v1/leave`
/// and `/v1/renew` for concurrency places). Time is the caller's (`now`), but never earlier
/// than the latest it was given: like `diana-quota` on Redis `TIME`, the service has one
/// clock, whichever gateway's simulated clock calls. Answers are immediate: there is no
/// network, no timeout and no failure; a `/v1/wait` answer says what the service would
/// have held it for ([`MemoryQuota::answer_held`]).
#[derive(Debug)]
pub struct MemoryQuota {
    table: Table,
    /// The fleet's breakers (`/v1/report`).
    fleet: fleet::FleetTable,
    calls: u64,
    ledger: CallLedger,
    times: ServiceTimes,
    /// The latest instant a call was answered at.
    clock: Instant,
    /// The latest reports received, oldest first (at most [`REPORTS_KEPT`]): what the
    /// fleet view would have been told (tests read them, [`MemoryQuota::take_reports`]).
    reports: std::collections::VecDeque<crate::report::ReportRequest>,
    /// Reports received, all of them (answered or refused).
    reports_received: u64,
}

/// The reports a [`MemoryQuota`] keeps, at most (older ones are dropped).
pub const REPORTS_KEPT: usize = 64;

impl Default for MemoryQuota {
    fn default() -> Self {
        MemoryQuota::with_table(Table::default())
    }
}

/// An answer of [`MemoryQuota`]: what the gateway gets, and how long the service held it
/// before answering (`/v1/wait`; zero otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub reply: Answer,
    pub held: Nanos,
}

impl MemoryQuota {
    pub fn new() -> MemoryQuota {
        MemoryQuota::default()
    }

    /// A service over `table` (e.g. with another cap on counters), with diana-quota's
    /// default times.
    pub fn with_table(table: Table) -> MemoryQuota {
        MemoryQuota {
            table,
            fleet: fleet::FleetTable::new(fleet::DEFAULT_MAX_STATES),
            calls: 0,
            ledger: CallLedger::default(),
            times: ServiceTimes::default(),
            clock: Instant::EPOCH,
            reports: std::collections::VecDeque::new(),
            reports_received: 0,
        }
    }

    /// Callouts answered so far.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Counters held (idle ones included until the next sweep).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Answers one callout of the engine at `now`, as the service would: `200` with its
    /// answer, `400` with the reason when the request breaks the wire format, `503` when
    /// the table is full. [`MemoryQuota::answer_held`] without the hold.
    pub fn answer(&mut self, callout: &Callout, now: Instant) -> Answer {
        self.answer_held(callout, now).reply
    }

    /// [`MemoryQuota::answer`], with how long the service would have held the answer
    /// (`/v1/wait` holds an admitted request for its turn): a simulation that delivers the
    /// answer that much later sees the service's timing too.
    pub fn answer_held(&mut self, callout: &Callout, now: Instant) -> Held {
        self.calls += 1;
        self.clock = self.clock.max(now);
        let now = self.clock;
        let header = |wanted: &str| {
            callout
                .headers
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(wanted))
                .map(|(_, value)| value.as_str())
        };
        let endpoint = header(":path")
            .unwrap_or("")
            .rsplit('/')
            .next()
            .unwrap_or("");
        let timeout = match header(wire::TIMEOUT_HEADER) {
            None => Ok(None),
            Some(text) => text
                .trim()
                .parse::<u64>()
                .map(|millis| Some(Nanos::saturating_from_millis(millis)))
                .map_err(|_| {
                    EndpointError::BadRequest(format!(
                        "{}: must be a whole number of milliseconds",
                        wire::TIMEOUT_HEADER
                    ))
                }),
        };
        let mut held = Nanos::ZERO;
        let answer = timeout.and_then(|timeout| {
            let body = &callout.body;
            match endpoint {
                "release" => json(&self.release_body(body, now)?),
                "leave" => json(&self.leave_body(body, now)?),
                "renew" => json(&self.renew_body(body, now)?),
                "charge" => json(&self.charge_body(body, now)?),
                "report" => json(&self.report_body(body, now)?),
                "wait" => {
                    let (response, hold) = self.wait_body(body, timeout, now)?;
                    held = hold;
                    json(&response)
                }
                _ => json(&self.acquire_body(body, now)?),
            }
        });
        let (status, body) = match answer {
            Ok(body) => (200, body),
            Err(refused) => (
                refused.status(),
                serde_json::to_vec(&ErrorResponse {
                    error: refused.to_string(),
                })
                .unwrap_or_default(),
            ),
        };
        Held {
            reply: Answer::with(status, body),
            held,
        }
    }

    /// Reports (`/v1/report`) among [`MemoryQuota::calls`].
    pub fn reports_received(&self) -> u64 {
        self.reports_received
    }

    /// The reports received since the last call, oldest first (the latest
    /// [`REPORTS_KEPT`]).
    pub fn take_reports(&mut self) -> Vec<crate::report::ReportRequest> {
        self.reports.drain(..).collect()
    }

    /// Answers a tick report (`/v1/report`) at `now`: the fleet's breakers as the service
    /// decides them (`fleet::answer_report`); the report is kept as it came
    /// ([`MemoryQuota::take_reports`]), the view is not built here.
    pub fn report_body(
        &mut self,
        body: &[u8],
        now: Instant,
    ) -> Result<crate::report::ReportResponse, EndpointError> {
        self.reports_received += 1;
        let report = crate::report::decode(body)
            .map_err(|error| EndpointError::BadRequest(error.to_string()))?;
        if self.reports.len() >= REPORTS_KEPT {
            self.reports.pop_front();
        }
        self.reports.push_back(report.clone());
        fleet::answer_report(&mut self.fleet, &report, now).map_err(|refused| match refused {
            fleet::Refused::Full { .. } => EndpointError::FleetFull(refused.to_string()),
            fleet::Refused::OutOfRange { .. } => EndpointError::BadRequest(refused.to_string()),
        })
    }

    /// Decides an acquire request body (the wire format's JSON) at `now`.
    pub fn acquire_body(
        &mut self,
        body: &[u8],
        now: Instant,
    ) -> Result<AcquireResponse, EndpointError> {
        let request = wire::decode_request(body)?;
        let rules = request.resolve()?;
        wire::check_periods(&rules, now)?;
        self.decide(&request, &rules, now)
    }

    /// Decides a `/v1/wait` body: the waiting rules' turns capped at what the service may
    /// hold ([`ServiceTimes::wait_cap`], from the gateway's `timeout`), then held
    /// ([`hold`]). Returns the answer and how long the service holds it.
    pub fn wait_body(
        &mut self,
        body: &[u8],
        timeout: Option<Nanos>,
        now: Instant,
    ) -> Result<(AcquireResponse, Nanos), EndpointError> {
        let request = wire::decode_request(body)?;
        let mut rules = request.resolve()?;
        wire::check_periods(&rules, now)?;
        cap_delays(&mut rules, self.times.wait_cap(timeout));
        let mut response = self.decide(&request, &rules, now)?;
        // No time passes here: the gateway's whole wait is still ahead.
        let most = self
            .times
            .gateway(timeout)
            .map_or(self.times.max_wait, |gateway| {
                self.times.max_wait.min(gateway)
            });
        let held = hold(&mut response.results, most);
        Ok((response, held))
    }

    /// Charges a `/v1/charge` body: every rule `want` tokens past its limit.
    pub fn charge_body(
        &mut self,
        body: &[u8],
        now: Instant,
    ) -> Result<AcquireResponse, EndpointError> {
        let request = wire::decode_request(body)?;
        let rules = request.resolve()?;
        wire::check_periods(&rules, now)?;
        let results = self.table.charge(&rules, now)?;
        Ok(AcquireResponse { results })
    }

    /// Decides resolved rules all or nothing and notes the call's grant for its release.
    fn decide(
        &mut self,
        request: &AcquireRequest,
        rules: &[ResolvedRule<'_>],
        now: Instant,
    ) -> Result<AcquireResponse, EndpointError> {
        let outcomes = self.table.acquire(rules, now)?;
        if let (Some(call), Some(grants)) = (&request.call, Grant::of(rules, &outcomes)) {
            if self.ledger.granted(call, grants, now) == Noted::AlreadyReleased {
                self.table.release(rules, &outcomes, now);
            }
        }
        let results = outcomes.into_iter().map(|outcome| outcome.result).collect();
        Ok(AcquireResponse { results })
    }

    /// Gives back what the acquire of the same call granted (a release body: the wire
    /// format's JSON, with its `call`).
    pub fn release_body(
        &mut self,
        body: &[u8],
        now: Instant,
    ) -> Result<ReleaseResponse, EndpointError> {
        let request = wire::decode_request(body)?;
        let (rules, call, released) = wire::resolve_release(&request)?;
        let grants = match released {
            Released::Whole => {
                let Some(grants) = self.ledger.release(call, now) else {
                    return Ok(ReleaseResponse { released: false });
                };
                grants
            }
            Released::Part { rule } => {
                let Some(asked) = rules.first() else {
                    return Ok(ReleaseResponse { released: false });
                };
                let counter = CounterDigest::of(asked);
                let part = self
                    .ledger
                    .take_part(call, rule, asked.want.get(), counter, now);
                match part.outcome(call, rule)? {
                    Some(grant) => vec![grant],
                    None => return Ok(ReleaseResponse { released: false }),
                }
            }
        };
        let outcomes = Grant::released(call, &rules, &grants)?;
        self.table.release(&rules, &outcomes, now);
        Ok(ReleaseResponse { released: true })
    }

    /// Gives back concurrency places (a leave body: the wire format's JSON, each rule with
    /// its `place`).
    pub fn leave_body(
        &mut self,
        body: &[u8],
        now: Instant,
    ) -> Result<ReleaseResponse, EndpointError> {
        let request = wire::decode_request(body)?;
        let (rules, places) = wire::resolve_places(&request)?;
        self.table
            .release(&rules, &Outcome::held(&rules, places), now);
        Ok(ReleaseResponse { released: true })
    }

    /// Renews concurrency places (a renew body): each result names the bucket they are
    /// counted in now.
    pub fn renew_body(
        &mut self,
        body: &[u8],
        now: Instant,
    ) -> Result<AcquireResponse, EndpointError> {
        let request = wire::decode_request(body)?;
        let (rules, places) = wire::resolve_places(&request)?;
        let outcomes = self.table.renew(&rules, &places, now)?;
        let results = outcomes.into_iter().map(|outcome| outcome.result).collect();
        Ok(AcquireResponse { results })
    }

    /// Gives back the grants of `outcomes`, an earlier decision of the same rules.
    pub fn release(&mut self, rules: &[ResolvedRule<'_>], outcomes: &[Outcome], now: Instant) {
        self.table.release(rules, outcomes, now);
    }

    /// Decides resolved rules at `now`, all or nothing, and keeps the charges if admitted
    /// (a full table answers as a denial of every rule: nothing charged).
    pub fn acquire(&mut self, rules: &[ResolvedRule<'_>], now: Instant) -> Vec<Outcome> {
        self.table
            .acquire(rules, now)
            .unwrap_or_else(|_| vec![Outcome::default(); rules.len()])
    }
}

/// The JSON of an answer.
fn json<T: serde::Serialize>(answer: &T) -> Result<Vec<u8>, EndpointError> {
    serde_json::to_vec(answer).map_err(|error| EndpointError::BadRequest(error.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::Nanos;
    use crate::wire::{AcquireRequest, RuleRequest};

    const NOW: Instant = Instant::from_unix_nanos(1_767_225_601_000_000_000);

    fn rule(key: &str, rpu: u32, want: u32, dry_run: bool) -> RuleRequest {
        RuleRequest {
            place: None,
            key: key.to_string(),
            algo: "W".to_string(),
            rpu,
            unit: "minute".to_string(),
            burst: rpu,
            slices: 10,
            want,
            cost: 1,
            max_delay_ms: None,
            dry_run,
            period: None,
        }
    }

    fn ask(quota: &mut MemoryQuota, rules: Vec<RuleRequest>, now: Instant) -> Vec<RuleResult> {
        let body = serde_json::to_vec(&AcquireRequest::new(rules)).unwrap();
        let callout = Callout {
            upstream: "diana_quota".to_string(),
            headers: Vec::new(),
            body,
            timeout_ms: 50,
        };
        match quota.answer(&callout, now) {
            Answer::Answered(crate::call::Answered {
                status: 200,
                body: Ok(body),
                ..
            }) => {
                serde_json::from_slice::<AcquireResponse>(&body)
                    .unwrap()
                    .results
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn decides_all_or_nothing_with_dry_run_rules_aside() {
        let mut quota = MemoryQuota::new();
        // `b` allows 1: the second request is denied by it, and `a` is not charged.
        for expected in [true, false, false] {
            let results = ask(
                &mut quota,
                vec![rule("a", 5, 1, false), rule("b", 1, 1, false)],
                NOW,
            );
            assert_eq!(results[1].allowed, expected);
            assert_eq!(results[0].granted, u32::from(expected));
        }
        // `a` still has 4: only one was kept.
        let results = ask(&mut quota, vec![rule("a", 5, 1, false)], NOW);
        assert_eq!(results[0].remaining, 3);
        // A dry-run rule's denial stops nobody.
        let results = ask(
            &mut quota,
            vec![rule("b", 1, 1, true), rule("a", 5, 1, false)],
            NOW,
        );
        assert!(!results[0].allowed);
        assert_eq!(results[1].granted, 1);
        assert_eq!(quota.calls(), 5);
    }

    #[test]
    fn grants_leases_as_asked_and_refuses_a_broken_request() {
        let mut quota = MemoryQuota::new();
        let results = ask(&mut quota, vec![rule("a", 5, 4, false)], NOW);
        assert_eq!(results[0].granted, 4);
        let results = ask(&mut quota, vec![rule("a", 5, 4, false)], NOW);
        assert_eq!(results[0].granted, 1, "only what is left");
        let callout = Callout {
            upstream: String::new(),
            headers: Vec::new(),
            body: b"{\"rules\":[]}".to_vec(),
            timeout_ms: 50,
        };
        assert!(matches!(
            quota.answer(&callout, NOW),
            Answer::Answered(crate::call::Answered { status: 400, .. })
        ));
    }

    #[test]
    fn a_counter_is_bound_to_its_parameters() {
        let mut quota = MemoryQuota::new();
        // W 2 per minute on `a`, spent.
        for expected in [true, true, false] {
            assert_eq!(
                ask(&mut quota, vec![rule("a", 2, 1, false)], NOW)[0].allowed,
                expected
            );
        }
        // The same key with another rate, unit or algorithm is another counter: it starts
        // full and describes itself, never the spent one.
        let mut per_second = rule("a", 2, 1, false);
        per_second.unit = "second".to_string();
        let mut bucket = rule("a", 1, 1, false);
        (bucket.algo, bucket.unit) = ("TB".to_string(), "day".to_string());
        for (other, remaining) in [(rule("a", 5, 1, false), 4), (per_second, 1), (bucket, 0)] {
            let result = ask(&mut quota, vec![other.clone()], NOW)[0];
            assert!(
                result.allowed && result.remaining == remaining,
                "{other:?}: {result:?}"
            );
        }
        // And the first is untouched: still spent.
        assert!(!ask(&mut quota, vec![rule("a", 2, 1, false)], NOW)[0].allowed);
        assert_eq!(quota.len(), 4);
        // Identity and canonical names: aliases resolve to one counter.
        let mut alias = rule("a", 2, 1, false);
        (alias.algo, alias.unit) = ("window".to_string(), "Minutes".to_string());
        let request = AcquireRequest::new(vec![alias, rule("a", 2, 1, false)]);
        let rules = request.resolve().unwrap();
        assert_eq!(CounterId::of(&rules[0]), CounterId::of(&rules[1]));
        assert_eq!(CounterId::of(&rules[0]).params(), "W:2:minute:2:10");
    }

    /// A release may give back part of one rule's grant of a call (`rule`: its place in
    /// the call, the body's one rule with `want` the tokens), at most what that rule was
    /// granted and once; only to that rule's counter; a whole release afterwards gives
    /// back what is left.
    #[test]
    fn a_release_gives_back_part_of_one_rules_grant() {
        let mut quota = MemoryQuota::new();
        let call = |path: &str, rules: Vec<RuleRequest>, rule: Option<u32>| Callout {
            upstream: "diana_quota".to_string(),
            headers: vec![(":path", path.to_string())],
            body: serde_json::to_vec(&AcquireRequest {
                rules,
                call: Some("c-1".to_string()),
                rule,
            })
            .unwrap(),
            timeout_ms: 50,
        };
        let (a, b) = (rule("a", 5, 1, false), rule("b", 5, 2, false));
        let granted =
            body(quota.answer(&call("/v1/acquire", vec![a.clone(), b.clone()], None), NOW));
        assert!(granted.contains(r#""granted":2"#), "{granted}");
        // What was left before this one more request took a token.
        let left = |quota: &mut MemoryQuota, key: &str| {
            ask(
                quota,
                vec![RuleRequest {
                    want: 1,
                    ..rule(key, 5, 1, false)
                }],
                NOW,
            )[0]
            .remaining
                + 1
        };
        let part = |tokens: u32| RuleRequest {
            want: tokens,
            ..b.clone()
        };
        let release = |quota: &mut MemoryQuota, rules: Vec<RuleRequest>, at: u32| {
            body(quota.answer(&call("/v1/release", rules, Some(at)), NOW))
        };
        assert_eq!(
            release(&mut quota, vec![part(1)], 1),
            r#"200 {"released":true}"#
        );
        // b: 2 granted, 1 given back: 4 left.
        assert_eq!(left(&mut quota, "b"), 4);
        // More than is left: what is left (1); then nothing.
        assert_eq!(
            release(&mut quota, vec![part(5)], 1),
            r#"200 {"released":true}"#
        );
        assert_eq!(
            release(&mut quota, vec![part(1)], 1),
            r#"200 {"released":false}"#
        );
        // b: the call's 2 both given back, 1 taken by `left`: 4 left again.
        assert_eq!(left(&mut quota, "b"), 4);
        // Refused: two rules, a place the call did not have, another counter.
        for (rules, at, field) in [
            (vec![part(1), a.clone()], 1, "rules"),
            (vec![part(1)], 2, "rule"),
            (vec![part(1)], 64, "rule"),
            (vec![RuleRequest { rpu: 6, ..part(1) }], 1, "rules[0]"),
        ] {
            let answer = release(&mut quota, rules, at);
            assert!(
                answer.starts_with(&format!("400 {{\"error\":\"{field}")),
                "{answer}"
            );
        }
        // The whole call afterwards: a's token back, nothing more of b's.
        assert_eq!(
            body(quota.answer(&call("/v1/release", vec![a, b], None), NOW)),
            r#"200 {"released":true}"#
        );
        assert_eq!(left(&mut quota, "a"), 5);
        assert_eq!(left(&mut quota, "b"), 3, "the two taken by `left`");
    }

    /// A concurrency limit's counter is its key alone (issue 41, item 5c): the places held
    /// are the same places under another N, and each acquire checks its own N.
    #[test]
    fn a_concurrency_counter_is_not_bound_to_its_limit() {
        let mut quota = MemoryQuota::new();
        let places = |n: u32| RuleRequest {
            algo: "IF".to_string(),
            unit: "second".to_string(),
            ..rule("p", n, 1, false)
        };
        // 3 of 3 held; under N = 4 one more, under N = 2 none.
        for expected in [true, true, true, false] {
            assert_eq!(ask(&mut quota, vec![places(3)], NOW)[0].allowed, expected);
        }
        let more = ask(&mut quota, vec![places(4)], NOW)[0];
        assert!(more.allowed && more.remaining == 0, "{more:?}");
        assert!(!ask(&mut quota, vec![places(4)], NOW)[0].allowed);
        let fewer = ask(&mut quota, vec![places(2)], NOW)[0];
        assert!(!fewer.allowed && fewer.remaining == 0, "{fewer:?}");
        assert_eq!(quota.len(), 1);
        let request = AcquireRequest::new(vec![places(3), places(9)]);
        let rules = request.resolve().unwrap();
        assert_eq!(CounterId::of(&rules[0]), CounterId::of(&rules[1]));
        assert!(CounterId::of(&rules[0]).is(&rules[1]));
        assert_eq!(CounterId::of(&rules[0]).params(), "IF");
        assert_eq!(counter_params("IF", &rules[1].limit), "IF");
        // Another key is another counter.
        let other = ask(
            &mut quota,
            vec![RuleRequest {
                key: "q".to_string(),
                ..places(3)
            }],
            NOW,
        );
        assert_eq!(other[0].remaining, 2);
    }

    fn call_to(path: &str, rules: Vec<RuleRequest>) -> Callout {
        Callout {
            upstream: "diana_quota".to_string(),
            headers: vec![(":path", path.to_string())],
            body: serde_json::to_vec(&AcquireRequest::new(rules)).unwrap(),
            timeout_ms: 50,
        }
    }

    fn body(answer: Answer) -> String {
        match answer {
            Answer::Answered(crate::call::Answered {
                status,
                body: Ok(body),
                ..
            }) => format!("{status} {}", String::from_utf8_lossy(&body)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn concurrency_places_are_left_and_renewed_by_their_bucket() {
        use crate::algo::inflight::{PLACE_SPAN, RECLAIMED_AFTER};
        let mut quota = MemoryQuota::new();
        let places = RuleRequest {
            algo: "IF".to_string(),
            unit: "second".to_string(),
            ..rule("p", 2, 1, false)
        };
        let first = ask(&mut quota, vec![places.clone()], NOW)[0];
        let second = ask(&mut quota, vec![places.clone()], NOW)[0];
        assert!(!ask(&mut quota, vec![places.clone()], NOW)[0].allowed);
        let bucket = first.place.unwrap();
        assert_eq!(second.place, Some(bucket));
        let placed = |bucket: u64| RuleRequest {
            place: Some(bucket),
            ..places.clone()
        };
        // Renewed a span later: counted in the next bucket, still two inside.
        let later = NOW + PLACE_SPAN;
        let renewed = body(quota.answer(&call_to("/v1/renew", vec![placed(bucket)]), later));
        let response: AcquireResponse =
            serde_json::from_str(renewed.trim_start_matches("200 ")).unwrap();
        let moved = response.results[0].place.unwrap();
        assert_eq!((response.results[0].granted, moved), (1, bucket + 1));
        assert!(!ask(&mut quota, vec![places.clone()], later)[0].allowed);
        // The renewed one leaves from its new bucket: one place frees.
        let left = body(quota.answer(&call_to("/v1/leave", vec![placed(moved)]), later));
        assert_eq!(left, "200 {\"released\":true}");
        assert!(ask(&mut quota, vec![places.clone()], later)[0].allowed);
        // The never-renewed second is reclaimed after the bound; the new one too.
        let reclaimed = later + RECLAIMED_AFTER;
        let both = ask(
            &mut quota,
            vec![RuleRequest {
                want: 2,
                ..places.clone()
            }],
            reclaimed,
        )[0];
        assert_eq!(both.granted, 2, "{both:?}");
        // Anything but places with their bucket is refused.
        let window = RuleRequest {
            algo: "W".to_string(),
            ..placed(bucket)
        };
        for wrong in [places.clone(), window] {
            let refused = body(quota.answer(&call_to("/v1/leave", vec![wrong]), reclaimed));
            assert!(refused.starts_with("400 "), "{refused}");
        }
    }

    #[test]
    fn idle_counters_are_swept_when_the_table_doubles() {
        let mut quota = MemoryQuota::new();
        for i in 1..table::MIN_SWEEP {
            ask(&mut quota, vec![rule(&format!("k{i}"), 5, 1, false)], NOW);
        }
        assert_eq!(quota.len(), table::MIN_SWEEP - 1);
        // A minute later every one of them is idle: the counter that fills the table
        // sweeps them.
        let later = NOW + Nanos::from_secs(61);
        ask(&mut quota, vec![rule("fresh", 5, 1, false)], later);
        assert_eq!(quota.len(), 1);
    }
}
