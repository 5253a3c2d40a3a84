//! The quota service's answers, as the filter reads them. [`Answers`]: a random acquire
//! request (valid or not) and an answer to it — an honest one (what the service decides,
//! from a counter state it has used before), that answer mutated, random results, or
//! random bytes — through `wire::decode_request` and `wire::decode_response`. Properties:
//! no panic; a request that decodes survives a serialise/decode round trip; an invalid
//! request validates no answer; an honest answer is accepted; an accepted answer keeps
//! every promise of the format (checked here independently). [`Callouts`]: the same
//! answers (and failures: no answer, not sent, error statuses) handed to the filter's
//! worker for the callout it made, under each host's profile: no panic, no second callout
//! for a completed request, every answered request resumed or answered, an honest answer
//! obeyed, nothing held once the contexts are gone.

use crate::mutate::{mutate, random_bytes};
use crate::rng::Rng;
use crate::Target;
use diana_core::algo::Verdict;
use diana_core::call::{Answer, MAX_SERVICE_ANSWER_BYTES};
use diana_core::time::{Instant, Nanos};
use diana_core::wire::{
    self, AcquireRequest, AcquireResponse, RuleRequest, RuleResult, MAX_SLICES, MAX_WANT,
};
use diana_core::worker::sim::SimHost;
use diana_core::worker::{Command, HostProfile, Worker};

const ALGOS: &[&str] = &[
    "W",
    "SW",
    "LB",
    "TB",
    "tb",
    "token bucket",
    "Sliding Window",
    "IF",
    "if",
    "x",
    "",
];
const UNITS: &[&str] = &[
    "second", "minute", "hour", "day", "Seconds", "week", "month", "",
];
/// 2026-01-01T00:00:00Z plus a little.
const NOW: Instant = Instant::from_unix_nanos(1_767_225_600_123_456_789);

fn key(rng: &mut Rng) -> String {
    if rng.one_in(20) {
        return String::from_utf8_lossy(&random_bytes(rng, 200)).into_owned();
    }
    let cap = if rng.one_in(20) { 200 } else { 40 };
    let len = 1 + rng.index(cap);
    (0..len)
        .map(|_| char::from(*rng.pick(b"abcdef0123456789:_.-").unwrap_or(&b'a')))
        .collect()
}

fn small_or_any(rng: &mut Rng, small: u64) -> u32 {
    if rng.one_in(5) {
        rng.interesting_u64() as u32
    } else {
        1 + rng.below(small) as u32
    }
}

fn rule(rng: &mut Rng) -> RuleRequest {
    let want = if rng.one_in(10) {
        rng.interesting_u64() as u32
    } else {
        let cap = if rng.one_in(4) { MAX_WANT } else { 5 };
        1 + rng.below(u64::from(cap)) as u32
    };
    let cost = if rng.one_in(10) {
        rng.interesting_u64() as u32
    } else {
        1 + rng.below(u64::from(want.max(1))) as u32
    };
    RuleRequest {
        place: rng.one_in(3).then(|| rng.interesting_u64()),
        key: key(rng),
        algo: rng.pick(ALGOS).map_or("W", |a| *a).to_string(),
        rpu: small_or_any(rng, 20),
        unit: rng.pick(UNITS).map_or("second", |u| *u).to_string(),
        burst: small_or_any(rng, 10),
        slices: if rng.one_in(10) {
            rng.interesting_u64() as u32
        } else {
            1 + rng.below(u64::from(MAX_SLICES)) as u32
        },
        want,
        cost,
        max_delay_ms: if rng.one_in(2) {
            None
        } else {
            Some(rng.interesting_u64() % 100_000_000)
        },
        dry_run: rng.one_in(5),
        period: rng.one_in(4).then(|| diana_core::wire::WirePeriod {
            start_ms: rng.interesting_u64(),
            len_ms: if rng.one_in(2) {
                7 * 86_400_000
            } else {
                rng.interesting_u64()
            },
        }),
    }
}

/// What the service would answer to `request` from counters it has used before (random
/// earlier requests, the clock possibly stepping back by less than a unit), deciding
/// every rule all or nothing like diana-quota. `None` for an invalid request.
fn honest(rng: &mut Rng, request: &AcquireRequest) -> Option<AcquireResponse> {
    let rules = request.resolve().ok()?;
    let mut decided = Vec::new();
    for rule in &rules {
        let mut state = vec![0; rule.algo.state_words(&rule.limit)];
        let unit = rule.limit.unit.nanos();
        for _ in 0..rng.below(6) {
            let at = NOW - unit + Nanos::new(rng.below(2 * unit.get() - 1));
            let want = 1 + rng.below(u64::from(rule.want.get())) as u32;
            if rule.algo.allows_debt() && rng.one_in(4) {
                rule.algo.charge_debt(&rule.limit, &mut state, at, want);
            } else {
                rule.algo.acquire(&rule.limit, &mut state, at, want);
            }
        }
        let mut verdict = rule.algo.acquire_at_least(
            &rule.limit,
            &mut state,
            NOW,
            rule.cost.get(),
            rule.want.get(),
        );
        if let Some(max) = rule.max_delay.filter(|&max| verdict.delay > max) {
            verdict = Verdict {
                granted: 0,
                retry_after: verdict.delay - max,
                delay: Nanos::ZERO,
                ..verdict
            };
        }
        decided.push(verdict);
    }
    let admitted = rules
        .iter()
        .zip(&decided)
        .all(|(rule, verdict)| verdict.allowed() || rule.dry_run);
    let results = decided
        .iter()
        .enumerate()
        .map(|(at, verdict)| {
            let mut result = RuleResult::from_verdict(verdict);
            if let Some(rule) = rules.get(at) {
                result = result.placed(rule.algo, verdict.mark);
            }
            if !admitted || !verdict.allowed() {
                result.place = None;
                result.granted = 0;
                result.delay_ms = 0;
            }
            result
        })
        .collect();
    Some(AcquireResponse { results })
}

fn random_result(rng: &mut Rng) -> RuleResult {
    RuleResult {
        place: rng.one_in(2).then(|| rng.interesting_u64()),
        allowed: rng.one_in(2),
        granted: if rng.one_in(2) {
            rng.below(4) as u32
        } else {
            rng.interesting_u64() as u32
        },
        remaining: rng.interesting_u64(),
        reset_ms: rng.interesting_u64(),
        retry_after_ms: rng.interesting_u64(),
        delay_ms: if rng.one_in(2) {
            0
        } else {
            rng.interesting_u64()
        },
    }
}

/// How an answer was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Honest = 0,
    Mutated = 1,
    Random = 2,
    Bytes = 3,
}

/// An answer body to `request`, and how it was made.
fn answer(rng: &mut Rng, request: &AcquireRequest, waited: bool) -> (Kind, Vec<u8>) {
    let mut honest = honest(rng, request);
    if waited {
        for result in honest
            .iter_mut()
            .flat_map(|answer| answer.results.iter_mut())
        {
            result.delay_ms = 0;
        }
    }
    let kind = match rng.below(8) {
        0..=2 if honest.is_some() => Kind::Honest,
        3..=5 if honest.is_some() => Kind::Mutated,
        7 => Kind::Bytes,
        _ => Kind::Random,
    };
    let body = match (kind, &honest) {
        (Kind::Honest, Some(answer)) => serde_json::to_vec(answer).unwrap_or_default(),
        (Kind::Mutated, Some(answer)) => {
            let mut body = serde_json::to_vec(answer).unwrap_or_default();
            let other = serde_json::to_vec(&answer.results.first()).unwrap_or_default();
            mutate(rng, &mut body, &other, 70_000);
            body
        }
        (Kind::Bytes, _) => random_bytes(rng, 4_096),
        _ => {
            let count = (request.rules.len() + rng.index(3)).saturating_sub(1);
            let results = (0..count).map(|_| random_result(rng)).collect();
            serde_json::to_vec(&AcquireResponse { results }).unwrap_or_default()
        }
    };
    (kind, body)
}

/// Checks an accepted answer against the format's promises, independently of
/// `validate_response`.
fn promises_kept(request: &AcquireRequest, response: &AcquireResponse) -> Result<(), String> {
    let rules = request
        .resolve()
        .map_err(|e| format!("an answer to an invalid request was accepted: {e}"))?;
    if rules.len() != response.results.len() {
        return Err("accepted with a wrong number of results".to_string());
    }
    for (i, (rule, result)) in rules.iter().zip(&response.results).enumerate() {
        let broken = |what: &str| Err(format!("results[{i}] accepted with {what}: {result:?}"));
        if result.granted > rule.want.get() {
            return broken("more granted than wanted");
        }
        if result.granted > 0 && result.granted < rule.cost.get() {
            return broken("less granted than the cost");
        }
        if result.granted > 0 && !result.allowed {
            return broken("a grant that is not allowed");
        }
        if result.remaining > rule.algo.capacity(&rule.limit) {
            return broken("more remaining than the capacity");
        }
        if result.delay_ms > 0 && (result.granted == 0 || !rule.algo.waits()) {
            return broken("a delay where none can be");
        }
        let longest = wire::max_duration_ms(&rule.limit);
        if [result.reset_ms, result.retry_after_ms, result.delay_ms]
            .iter()
            .any(|&ms| ms > longest)
        {
            return broken("a duration past the longest the limit allows");
        }
    }
    Ok(())
}

/// `[kind] [request length, 4 bytes LE] request answer`.
fn encode(kind: Kind, request: &[u8], answer: &[u8]) -> Vec<u8> {
    let mut input = vec![kind as u8];
    input.extend_from_slice(&(request.len() as u32).to_le_bytes());
    input.extend_from_slice(request);
    input.extend_from_slice(answer);
    input
}

fn decode(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&kind, rest) = input.split_first()?;
    let (len, rest) = rest.split_first_chunk::<4>()?;
    let len = usize::try_from(u32::from_le_bytes(*len)).ok()?;
    Some((kind, rest.get(..len)?, rest.get(len..)?))
}

/// Requests and answers through the decoders.
pub struct Answers;

impl Target for Answers {
    fn name(&self) -> &'static str {
        "wire_answers"
    }
    fn weight(&self) -> u64 {
        12
    }
    fn generate(&self, rng: &mut Rng) -> Vec<u8> {
        let request = AcquireRequest::new((0..rng.index(5)).map(|_| rule(rng)).collect());
        let mut request_json = serde_json::to_vec(&request).unwrap_or_default();
        let (mut kind, body) = answer(rng, &request, false);
        if rng.one_in(8) {
            let other = request_json.clone();
            mutate(rng, &mut request_json, &other, 70_000);
            kind = Kind::Mutated;
        }
        encode(kind, &request_json, &body)
    }

    fn run(&self, input: &[u8]) -> Result<(), String> {
        let Some((kind, request_json, body)) = decode(input) else {
            return Ok(());
        };
        match wire::decode_request(request_json) {
            Ok(request) => {
                let again = serde_json::to_vec(&request).map_err(|e| e.to_string())?;
                if wire::decode_request(&again).as_ref() != Ok(&request) {
                    return Err("a decoded request does not survive a round trip".to_string());
                }
                // As a leave or renew body: places only, each with its bucket.
                if let Ok((rules, places)) = wire::resolve_places(&request) {
                    let held = rules.iter().all(|rule| rule.algo.holds_until_done());
                    let named = request.rules.iter().all(|rule| rule.place.is_some());
                    if !held || !named || places.len() != rules.len() {
                        return Err("resolve_places accepted what is not places".to_string());
                    }
                }
                match wire::decode_response(&request, body) {
                    Ok(response) => promises_kept(&request, &response),
                    Err(error) if kind == Kind::Honest as u8 => Err(format!(
                        "an honest answer was refused: {error}\n  answer: {}",
                        String::from_utf8_lossy(body)
                    )),
                    Err(_) => Ok(()),
                }
            }
            Err(_) => {
                // Undecodable or invalid: an answer to it is never accepted.
                let Ok(invalid) = serde_json::from_slice::<AcquireRequest>(request_json) else {
                    return Ok(());
                };
                match wire::decode_response(&invalid, body) {
                    Ok(_) => Err("an answer to an invalid request was accepted".to_string()),
                    Err(_) => Ok(()),
                }
            }
        }
    }
}

const DOCUMENT: &str = "resources:
  - Url: /
    rules:
      - {name: g1, rpu: 5, unit: second, algo: TB, scope: global, lease: 3}
      - {name: g2, rpu: 3, unit: minute, algo: SW, scope: global, actor: device}
      - {name: l1, rpu: 1000, unit: second, algo: W}
  - Url: /a
    rules:
      - {name: g3, rpu: 2, unit: second, algo: LB, scope: global, burst: 2}
      - {name: g4, rpu: 4, unit: hour, algo: W, scope: global, dry_run: true}
";

/// The document, with the quota service where each host wants it.
fn document(profile: HostProfile) -> String {
    let cluster = if profile.upstreams_are_host_port {
        "127.0.0.1:18081"
    } else {
        "diana_quota"
    };
    format!("{DOCUMENT}global: {{cluster: \"{cluster}\"}}\n")
}

/// The engine's own callouts, answered.
pub struct Callouts;

const STATUSES: &[u16] = &[200, 200, 200, 200, 400, 413, 429, 500, 503, 0, 204, 999];
const PATHS: &[&str] = &["/", "/a", "/a/b", "/b"];

impl Target for Callouts {
    fn name(&self) -> &'static str {
        "wire_callouts"
    }
    fn weight(&self) -> u64 {
        5
    }
    /// `[profile, path, device, status index, reply kind, answer seed (8 bytes)]`.
    fn generate(&self, rng: &mut Rng) -> Vec<u8> {
        let mut input = vec![
            rng.byte() % 2,
            rng.index(PATHS.len()) as u8,
            rng.byte() % 4,
            rng.index(STATUSES.len()) as u8,
            rng.byte() % 8,
        ];
        input.extend_from_slice(&rng.next_u64().to_le_bytes());
        input
    }

    fn run(&self, input: &[u8]) -> Result<(), String> {
        let [profile, path, device, status, reply, seed @ ..] = input else {
            return Ok(());
        };
        let seed = u64::from_le_bytes(<[u8; 8]>::try_from(seed).unwrap_or_default());
        let profile = if *profile == 0 {
            HostProfile::ENVOY
        } else {
            HostProfile::NGINX
        };
        let status = STATUSES.get(usize::from(*status)).copied().unwrap_or(200);
        // The simulated gateway's host, driven by hand: one device's request on one path,
        // answers crafted here (it seeds a fixed identity key: a case replays exactly).
        let host = SimHost::new(profile, NOW);
        let path = PATHS.get(usize::from(*path)).copied().unwrap_or("/");
        host.set_request(
            Some(b"10.1.2.3".to_vec()),
            vec![
                (":path".to_string(), path.as_bytes().to_vec()),
                ("x-device-id".to_string(), vec![b'd', *device]),
            ],
        );
        host.refuse_dispatch(*reply == 1);
        let document = document(profile);
        let mut worker = Worker::new(profile);
        worker
            .configure(&host, document.as_bytes())
            .map_err(|refused| format!("the callout document is refused: {refused}"))?;
        let mut rng = Rng::new(seed);
        for context in 2..5 {
            let step = worker.on_request_headers(&host, context);
            let sent = host.take_dispatched();
            let Some((token, callout)) = sent.into_iter().next_back() else {
                let replied = step
                    .commands
                    .iter()
                    .any(|c| matches!(c, Command::Reply(..)));
                if step.pause && !replied && worker.waiting_until(context).is_none() {
                    return Err("a request was left paused with no call and no turn".into());
                }
                worker.on_context_gone(&host, context);
                host.set_now(host.now().unwrap_or(NOW) + Nanos::new(rng.below(2_000_000_000)));
                continue;
            };
            let request = wire::decode_request(&callout.body)
                .map_err(|e| format!("the worker sent an invalid request: {e}"))?;
            // `/v1/wait` waits out the delays itself: its answers carry none.
            let waited = callout
                .headers
                .iter()
                .any(|(name, value)| *name == ":path" && value.ends_with(wire::WAIT_PATH));
            let (kind, body) = answer(&mut rng, &request, waited);
            let honest = kind == Kind::Honest && status == 200 && *reply >= 3;
            // As a binding hands it over: read within the worker's shape of the answer.
            let shape = worker.answer_shape(token);
            let delivered = match reply {
                0 => Answer::NoAnswer,
                // Larger than the worker reads.
                2 => Answer::from_host(
                    [(":status".to_string(), status.to_string().into_bytes())],
                    Answer::read_body(shape, MAX_SERVICE_ANSWER_BYTES + 1, || Ok(body.clone())),
                ),
                _ => Answer::from_host(
                    [(":status".to_string(), status.to_string().into_bytes())],
                    Answer::read_body(shape, body.len(), || Ok(body.clone())),
                ),
            };
            let step = worker.on_call_answered(&host, token, delivered);
            if !host.take_dispatched().is_empty() {
                return Err("a completed request asks for another callout".to_string());
            }
            let replied = step
                .commands
                .iter()
                .any(|command| matches!(command, Command::Reply(c, _) if *c == context));
            let admitted = !replied;
            if !replied && !step.pause && worker.waiting_until(context).is_none() {
                let resumed = step
                    .commands
                    .iter()
                    .any(|command| matches!(command, Command::Resume(c) if *c == context));
                if !resumed && !profile.resumes_after_own_call {
                    return Err("an answered request is neither resumed nor answered".into());
                }
            }
            if honest {
                let answer: AcquireResponse =
                    serde_json::from_slice(&body).map_err(|e| e.to_string())?;
                let all = answer
                    .results
                    .iter()
                    .zip(&request.rules)
                    .all(|(result, rule)| result.allowed || rule.dry_run);
                if admitted != all {
                    return Err(format!(
                        "an honest answer {} the request, the worker {}: {}",
                        if all { "admits" } else { "denies" },
                        if admitted { "admitted" } else { "rejected" },
                        String::from_utf8_lossy(&body)
                    ));
                }
            }
            worker.on_context_gone(&host, context);
            host.set_now(host.now().unwrap_or(NOW) + Nanos::new(rng.below(2_000_000_000)));
            let _ = worker.on_tick(&host);
            // Refills ahead and payments from the tick: no answer (their flights land).
            for (token, _) in host.take_dispatched() {
                let _ = worker.on_call_answered(&host, token, Answer::NoAnswer);
            }
        }
        if worker.requests_held() != 0 {
            return Err("the worker holds requests whose contexts are gone".into());
        }
        Ok(())
    }
}
