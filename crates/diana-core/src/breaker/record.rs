//! A breaker's state in shared data, one record per gateway process shared by every
//! worker ([`Record`], at [`record_key`]), and each worker's [`Handle`] on it.
//!
//! # The record
//!
//! One sealed record ([`crate::store::seal`]) per breaker, `diana/breaker/<16 hex digits
//! of a hash of the name>`: the key's length is bounded whatever the name, and the seal's
//! key check tells this breaker's record from another key's sharing the entry (nginx's
//! `shm_kv` finds a key by its CRC32 alone). A record that is missing (never written,
//! evicted by a full zone, released), another key's, or not decodable (another version,
//! garbage) reads as a fresh closed breaker with an empty window: an eviction forgets the
//! window and an opening, never wedges. Updates are compare-and-swaps with bounded
//! retries and race-free creation ([`Store::update`], both hosts' CAS rules), and a record
//! is written only when an operation changed it. The payload is binary, at most
//! [`record_bytes`] sealed (253 bytes with 3 half-open places), little-endian:
//!
//! ```text
//! u8  version (1)
//! edition:  u32 slow_ratio ppm (0: none) | u32 failure_ratio ppm (0: none) | u32 min_calls
//!           u32 window seconds | u64 open_for ns | u8 half_open_calls | u64 probe_timeout ns
//!           u8 force (0 auto, 1 open, 2 closed) | u64 installed (ns since the epoch)
//! phase:    u8 0 closed | 1 open, u64 until | 2 half-open, u64 round,
//!           half_open_calls × (u8 0 free / 1 good / 2 out, u64 taken)
//! window:   u64 head slice, 10 × (u32 calls, u32 slow, u32 failed)
//! source:   u8 0 local | 1 fleet, u64 trusted_until, u8 status (gauge), u64 half_open_at,
//!           u64 round, u32 granted, u32 used, u32 wanted
//! ```
//!
//! A fresh record starts from `auto`: the first operation under a document with `force`
//! makes the switch, and its transition is logged once per gateway.
//!
//! # The cost while closed
//!
//! A closed breaker must cost next to nothing per request, so the request path of a
//! [`Handle`] does not touch shared data while closed:
//! - [`Handle::check`] answers from the verdict it last read for [`VERDICT_CACHE`]
//!   (50 ms): a closed breaker (or forced either way) is one comparison of instants, and
//!   so is an open one (never past its end). Half-open is always read and written
//!   (probes are taken by compare-and-swap: exactly `half_open_calls` across workers).
//! - When shared data fails, [`Handle::check`] says so ([`Checked::trouble`]) and answers
//!   the defined fallback: a host error lets the call through (a broken store must not
//!   fail every request), contention fails fast with `Retry-After: 1` (as a rule's does).
//! - [`Handle::record`] adds a call's outcome to the worker's pending [`Tally`]; the
//!   worker's tick calls [`Handle::flush`] (every second is enough: nothing here needs
//!   the faster tick), which merges it into the record (the batch counts in the slice of
//!   the flush) and reads the state back. A slow or failed outcome flushes at once when
//!   the window as last read plus the pending calls would trip the breaker, else at most
//!   once per [`EARLY_FLUSH_GAP`] (100 ms) per worker: evidence that can open the
//!   breaker reaches the record within 100 ms whichever workers saw it, good calls alone
//!   within a tick. A healthy dependency costs nothing; a failing one ten
//!   compare-and-swaps a second per worker, and one per bad outcome that can trip it.
//!
//! So another worker's trip reaches this one within 50 ms, and a worker whose outcomes
//! trip it fails fast from its next request on.
//!
//! # Followed mode (`scope: global`)
//!
//! The gateway reports its calls to the quota service every [`FLEET_REPORT_EVERY`]
//! (250 ms, from its tick) and obeys the state the
//! service answers for the fleet ([`FleetAnswer`]: closed, open with the time until
//! half-open, or half-open with how many probe places this gateway may use). Any worker
//! that gets an answer writes it into the record ([`Handle::follow`]), so every worker
//! obeys it: the record's [`Source`] is then `Fleet`, trusted for [`FLEET_TRUST`] (3 s:
//! three missed ticks) after the answer. While trusted, [`Handle::check`] follows the
//! fleet (probes only on the granted places, [`Probe::Fleet`]); the calls still count in
//! the local window (without judging it), so that a fallback starts with data. Once no
//! answer has come for [`FLEET_TRUST`], the local machine decides again: the first
//! operation that notices makes a [`Cause::FleetLost`] transition (logged once), and the
//! next flush judges the local window. Each worker accumulates what the service needs,
//! the calls and the probe outcomes since its last report ([`Handle::take_report`]); the
//! workers' reports add up. `force` is the document's, so it applies before the fleet.
//!
//! The fleet's probe places are the gateway's, kept in the record: a half-open answer
//! grants places on top of those the gateway has used in the round (`granted`, `used`);
//! a half-open request takes one if `used < granted` and fails fast otherwise, counted as
//! demand (`wanted`); a probe a rule rejects gives its place back (`used - 1`). The report
//! built at a tick ([`Handle::take_report`]) withdraws the places granted and not used
//! and takes the demand ([`PlaceClaim`]): the service frees the unused ones and grants on
//! the demand, so that places never sit with a gateway that has no request for them.
//! Probe outcomes are reported as counts ([`ProbeTally`]); the service settles its
//! places with them ([`State::settle`], [`State::grant`], [`State::release`]).
//!
//! A change of who decides (local ↔ fleet) is a transition even when the status stays.

use super::machine::{Admission, CallWindow, Phase, Place, State, Ticket};
use super::settings::{Edition, Force, Params, Ratio, Reach, Settings, Window, SLICES};
use super::tap::Tap;
use super::{Cause, Outcome, ProbeTally, Status, Tally, Transition, Transitions};
use crate::hash::hash64;
use crate::store::{recordable, ChargeError, SharedData, Store};
use crate::time::{ceil_seconds_at_least_one, Instant, Nanos};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::num::{NonZeroU32, NonZeroU8};
use std::sync::Arc;

/// The first byte of a record's payload.
pub const RECORD_VERSION: u8 = 1;

/// What every breaker's key starts with.
pub const KEY_PREFIX: &str = "diana/breaker/";

/// Seed of the hash that turns a name into a key.
const KEY_SEED: u64 = 0x6469_616e_615f_6362; // "diana_cb"

/// How long a worker trusts the verdict it last read of a closed or open breaker.
pub const VERDICT_CACHE: Nanos = Nanos::from_millis(50);

/// The least time between two flushes a worker makes outside its tick.
pub const EARLY_FLUSH_GAP: Nanos = Nanos::from_millis(100);

/// How long the fleet's state, as the quota service last answered it, is obeyed.
pub const FLEET_TRUST: Nanos = Nanos::from_secs(3);

/// How far a worker's instant may lag the instant another worker wrote the fleet's state
/// at (it read its clock, then the other wrote, then it read the record) before a trust
/// that far ahead is taken for a clock stepped back.
const FLEET_TRUST_SKEW: Nanos = Nanos::from_secs(1);

/// The furthest a trusted fleet state's end may lie ahead of a worker's instant.
const FLEET_TRUST_AHEAD: Nanos = Nanos::new(FLEET_TRUST.get() + FLEET_TRUST_SKEW.get());

/// How often a worker reports its `scope: global` breakers' calls to the quota service and
/// reads the fleet's state back: a gateway that never saw a bad answer must fail fast
/// within a second of another gateway's evidence (DESIGN §4b), which takes that gateway's
/// report and then this one's, each at most this long after the fact, plus two round
/// trips and [`VERDICT_CACHE`]. The worker's tick runs at least this often while a
/// document has such a breaker, and no faster tick (a request waiting for its turn, a
/// parked one) reports more often.
pub const FLEET_REPORT_EVERY: Nanos = Nanos::from_millis(250);

/// The shared-data key of the breaker `name`.
pub fn record_key(name: &str) -> String {
    format!("{KEY_PREFIX}{:016x}", hash64(KEY_SEED, name.as_bytes()))
}

/// The most bytes a sealed record of a breaker with `half_open_calls` places takes in
/// shared data (the key check included): for sizing nginx's `shm_kv` zone.
pub const fn record_bytes(half_open_calls: u8) -> usize {
    8 + PAYLOAD_FIXED + PLACE_BYTES * half_open_calls as usize
}

const EDITION_BYTES: usize = 4 + 4 + 4 + 4 + 8 + 1 + 8 + 1 + 8;
const PLACE_BYTES: usize = 1 + 8;
const WINDOW_BYTES: usize = 8 + SLICES * 12;
const FLEET_BYTES: usize = 8 + 1 + 8 + 8 + 4 + 4 + 4;
/// Version, edition, the longest phase but its places, window, the longest source.
const PAYLOAD_FIXED: usize = 1 + EDITION_BYTES + (1 + 8) + WINDOW_BYTES + (1 + FLEET_BYTES);

/// What the quota service answers about one breaker of the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FleetAnswer {
    pub status: Status,
    /// Open: milliseconds until the fleet's breaker goes half-open.
    pub half_open_in_ms: u64,
    /// Half-open: the service's id of the round.
    pub round: u64,
    /// Half-open: probe places granted to this gateway by this answer, on top of those it
    /// has used in the round (the service grants on what the gateway's report wanted).
    pub places: u32,
}

/// The fleet's state as this gateway follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fleet {
    /// Obeyed until then ([`FLEET_TRUST`] after the answer).
    pub trusted_until: Instant,
    pub status: Status,
    /// Open: when the fleet's breaker goes half-open (at most `open_seconds` after the
    /// answer).
    pub half_open_at: Instant,
    pub round: u64,
    /// Probe places this gateway may use in the round (those used included).
    pub granted: u32,
    /// Probe places used in the round (a place given back is no longer used).
    pub used: u32,
    /// Half-open requests that found no place since the last report: the demand the next
    /// report asks places for.
    pub wanted: u32,
}

/// The fleet's probe places as a report gives them back and asks for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct PlaceClaim {
    pub round: u64,
    /// Granted and not used: withdrawn from this gateway, for the service to free.
    pub unused: u32,
    /// Requests that wanted a place and found none.
    pub wanted: u32,
}

/// Who decides a breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// This gateway's own machine ([`State`]).
    Local,
    /// The quota service, for the fleet (`scope: global`).
    Fleet(Fleet),
}

/// A probe's claim: a place of the local round, or one of the places the fleet granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Probe {
    Local(Ticket),
    Fleet { round: u64 },
}

/// What one gateway keeps for one breaker: the machine's state and who decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub state: State,
    pub source: Source,
}

/// Why stored bytes are not a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// Another layout (an older or newer Diana).
    Version(u8),
    /// Fewer bytes than the layout needs.
    Truncated,
    /// More bytes than the layout has.
    Trailing,
    /// A field holds a value no record holds.
    Invalid(&'static str),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Version(version) => write!(f, "breaker record version {version}"),
            DecodeError::Truncated => f.write_str("breaker record truncated"),
            DecodeError::Trailing => f.write_str("breaker record too long"),
            DecodeError::Invalid(field) => write!(f, "breaker record: invalid {field}"),
        }
    }
}

impl std::error::Error for DecodeError {}

impl Record {
    /// A fresh closed breaker, decided locally.
    pub fn new(edition: &Edition) -> Record {
        Record {
            state: State::new(edition),
            source: Source::Local,
        }
    }

    /// The record in a payload, or a fresh one when there is none or it does not decode.
    /// A fresh record starts from `auto` under `mine`'s other parameters, so that the first
    /// operation under a forced document makes (and logs) the switch.
    pub fn from_payload(payload: Option<&[u8]>, mine: &Edition) -> Record {
        payload
            .and_then(|bytes| Record::decode(bytes).ok())
            .unwrap_or_else(|| {
                Record::new(&Edition {
                    params: Params {
                        force: Force::Auto,
                        ..mine.params
                    },
                    installed: mine.installed,
                })
            })
    }

    fn trusted_fleet(&self, now: Instant) -> Option<Fleet> {
        match self.source {
            Source::Fleet(fleet) if fleet_is_trusted(&fleet, now) => Some(fleet),
            Source::Fleet(_) | Source::Local => None,
        }
    }

    /// The fleet's state when it decides: trusted and not overridden by `force`.
    fn followed(&self, now: Instant) -> Option<Fleet> {
        if self.state.params().force != Force::Auto {
            return None;
        }
        self.trusted_fleet(now)
    }

    /// The state as metrics show it: the switch, else the fleet's while followed, else the
    /// local machine's.
    pub fn status(&self, now: Instant) -> Status {
        match self.followed(now) {
            Some(fleet) => fleet.status,
            None => self.state.status(),
        }
    }

    /// [`State::sync`], then the end of an untrusted fleet's reign. Transitions carry the
    /// status as shown (the fleet's while it is followed).
    fn sync(&mut self, mine: &Edition, now: Instant) -> Transitions {
        let shown = self.status(now);
        let mut transitions = self.state.sync(mine, now);
        if self.trusted_fleet(now).is_some() {
            // Followed, the local machine is closed underneath: only a switch changes what
            // is shown, from the fleet's status to the forced one or back.
            transitions.clear();
            let after = self.status(now);
            if shown != after {
                transitions.push(Transition {
                    from: shown,
                    to: after,
                    cause: Cause::Forced(self.state.params().force),
                    figures: self.state.window_total(now),
                });
            }
        } else if let Source::Fleet(fleet) = self.source {
            self.source = Source::Local;
            let from = match self.state.params().force {
                Force::Auto => fleet.status,
                Force::Open | Force::Closed => self.state.status(),
            };
            transitions.push(Transition {
                from,
                to: self.state.status(),
                cause: Cause::FleetLost,
                figures: self.state.window_total(now),
            });
        }
        transitions
    }

    /// [`State::check`], or the fleet's verdict while it is followed.
    pub fn check(&mut self, mine: &Edition, now: Instant) -> (Admission<Probe>, Transitions) {
        let mut transitions = self.sync(mine, now);
        let open_for = self.state.params().open_for;
        let half_open_calls = u32::from(self.state.params().half_open_calls.get());
        if let (Some(_), Source::Fleet(fleet)) = (self.followed(now), &mut self.source) {
            let admission = match fleet.status {
                Status::Closed => Admission::Call,
                Status::Open => Admission::FastFail {
                    retry_after: ceil_seconds_at_least_one(
                        fleet.half_open_at.saturating_since(now).min(open_for),
                    ),
                },
                Status::HalfOpen if fleet.used < fleet.granted => {
                    fleet.used += 1;
                    Admission::Probe(Probe::Fleet { round: fleet.round })
                }
                Status::HalfOpen => {
                    fleet.wanted = fleet.wanted.saturating_add(1).min(half_open_calls);
                    Admission::FastFail { retry_after: 1 }
                }
            };
            return (admission, transitions);
        }
        let (admission, more) = self.state.check(mine, now);
        transitions.extend(more);
        (admission.map_probe(Probe::Local), transitions)
    }

    /// Records calls that were not probes: judged by the local machine, or only counted
    /// while the fleet decides.
    pub fn record(&mut self, mine: &Edition, tally: Tally, now: Instant) -> Transitions {
        let mut transitions = self.sync(mine, now);
        let more = match self.followed(now) {
            Some(_) => self.state.count(mine, tally, now),
            None => self.state.record(mine, tally, now),
        };
        transitions.extend(more);
        transitions
    }

    /// A local probe's outcome ([`State::probe_outcome`]). (A fleet probe's goes into the
    /// worker's report, not here.)
    pub fn probe_outcome(
        &mut self,
        mine: &Edition,
        ticket: Ticket,
        outcome: Outcome,
        now: Instant,
    ) -> Transitions {
        let mut transitions = self.sync(mine, now);
        transitions.extend(self.state.probe_outcome(mine, ticket, outcome, now));
        transitions
    }

    /// A probe that never became a call gives its place back: a local ticket's place, or
    /// one of the fleet's places of the same round.
    pub fn give_back(&mut self, mine: &Edition, probe: Probe, now: Instant) -> Transitions {
        let mut transitions = self.sync(mine, now);
        match probe {
            Probe::Local(ticket) => transitions.extend(self.state.give_back(mine, ticket, now)),
            Probe::Fleet { round } => {
                if let Source::Fleet(fleet) = &mut self.source {
                    if fleet.round == round {
                        fleet.used = fleet.used.saturating_sub(1);
                    }
                }
            }
        }
        transitions
    }

    /// The quota service's answer for the fleet: followed from now on, for
    /// [`FLEET_TRUST`]. The local machine stands down to closed (its round's tickets are
    /// void) and keeps counting. The time until half-open is taken as at most
    /// `open_seconds`, the places in a round as at most `half_open_calls`.
    pub fn follow(&mut self, mine: &Edition, answer: FleetAnswer, now: Instant) -> Transitions {
        let mut transitions = self.sync(mine, now);
        let shown = self.status(now);
        let was_following = matches!(self.source, Source::Fleet(_));
        let params = *self.state.params();
        let half_open_in =
            Nanos::saturating_from_millis(answer.half_open_in_ms).min(params.open_for);
        let (used, wanted) = match self.source {
            Source::Fleet(fleet) if fleet.round == answer.round => (fleet.used, fleet.wanted),
            Source::Fleet(_) | Source::Local => (0, 0),
        };
        let granted = used
            .saturating_add(answer.places)
            .min(u32::from(params.half_open_calls.get()));
        self.state.stand_down();
        self.source = Source::Fleet(Fleet {
            trusted_until: now.saturating_add(FLEET_TRUST),
            status: answer.status,
            half_open_at: recordable(now.saturating_add(half_open_in)),
            round: answer.round,
            granted: granted.max(used),
            used,
            wanted,
        });
        let after = self.status(now);
        if !was_following || shown != after {
            transitions.push(Transition {
                from: shown,
                to: after,
                cause: Cause::Fleet,
                figures: self.state.window_total(now),
            });
        }
        transitions
    }

    /// For a report: the fleet's places granted and not used are withdrawn (the service
    /// frees them) and the demand since the last report is taken. Nothing unless the
    /// fleet is followed.
    pub fn claim_places(&mut self, now: Instant) -> Option<PlaceClaim> {
        self.followed(now)?;
        let Source::Fleet(fleet) = &mut self.source else {
            return None;
        };
        let claim = PlaceClaim {
            round: fleet.round,
            unused: fleet.granted.saturating_sub(fleet.used),
            wanted: fleet.wanted,
        };
        fleet.granted = fleet.used;
        fleet.wanted = 0;
        (claim.unused > 0 || claim.wanted > 0).then_some(claim)
    }

    /// What a worker may answer from memory for a while without reading the record, and
    /// until when: closed (or forced either way) for [`VERDICT_CACHE`], open until its
    /// end (at most [`VERDICT_CACHE`]), never half-open, never past the fleet's trust.
    fn cacheable(&self, now: Instant) -> Option<(Cached, Instant)> {
        let soon = now.saturating_add(VERDICT_CACHE);
        let params = self.state.params();
        match params.force {
            Force::Open => {
                let retry_after = params.forced_retry_after();
                return Some((Cached::FastFail(retry_after), soon));
            }
            Force::Closed => return Some((Cached::Call, soon)),
            Force::Auto => {}
        }
        if let Some(fleet) = self.trusted_fleet(now) {
            let soon = soon.min(fleet.trusted_until);
            return match fleet.status {
                Status::Closed => Some((Cached::Call, soon)),
                Status::Open if fleet.half_open_at > now => Some((
                    Cached::FastFailUntil(fleet.half_open_at),
                    soon.min(fleet.half_open_at),
                )),
                Status::Open | Status::HalfOpen => None,
            };
        }
        match self.state.phase() {
            Phase::Closed => Some((Cached::Call, soon)),
            Phase::Open { until } if *until > now => {
                Some((Cached::FastFailUntil(*until), soon.min(*until)))
            }
            Phase::Open { .. } | Phase::HalfOpen { .. } => None,
        }
    }

    /// True when calls recorded now may open the breaker (local, auto, closed).
    fn judges(&self, now: Instant) -> bool {
        self.state.params().force == Force::Auto
            && self.trusted_fleet(now).is_none()
            && *self.state.phase() == Phase::Closed
    }

    /// The payload: the layout is in the module docs.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(PAYLOAD_FIXED + 255 * PLACE_BYTES);
        out.push(RECORD_VERSION);
        let edition = self.state.edition();
        let params = edition.params;
        put_u32(&mut out, params.slow_ratio.map_or(0, Ratio::ppm));
        put_u32(&mut out, params.failure_ratio.map_or(0, Ratio::ppm));
        put_u32(&mut out, params.min_calls.get());
        put_u32(&mut out, params.window.seconds());
        put_u64(&mut out, params.open_for.get());
        out.push(params.half_open_calls.get());
        put_u64(&mut out, params.probe_timeout.get());
        out.push(params.force.code());
        put_u64(&mut out, edition.installed.unix_nanos());
        match self.state.phase() {
            Phase::Closed => out.push(0),
            Phase::Open { until } => {
                out.push(1);
                put_u64(&mut out, until.unix_nanos());
            }
            Phase::HalfOpen { round, places } => {
                out.push(2);
                put_u64(&mut out, round.unix_nanos());
                for place in places {
                    let (tag, taken) = match place {
                        Place::Free => (0, 0),
                        Place::Good => (1, 0),
                        Place::Out(taken) => (2, taken.unix_nanos()),
                    };
                    out.push(tag);
                    put_u64(&mut out, taken);
                }
            }
        }
        let calls = self.state.calls();
        put_u64(&mut out, calls.head());
        for slice in calls.slices() {
            put_u32(&mut out, slice.calls);
            put_u32(&mut out, slice.slow);
            put_u32(&mut out, slice.failed);
        }
        match self.source {
            Source::Local => out.push(0),
            Source::Fleet(fleet) => {
                out.push(1);
                put_u64(&mut out, fleet.trusted_until.unix_nanos());
                out.push(fleet.status.gauge());
                put_u64(&mut out, fleet.half_open_at.unix_nanos());
                put_u64(&mut out, fleet.round);
                put_u32(&mut out, fleet.granted);
                put_u32(&mut out, fleet.used);
                put_u32(&mut out, fleet.wanted);
            }
        }
        out
    }

    /// A payload [`Record::encode`] wrote; anything else is refused, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        let mut input = Reader { bytes };
        let version = input.u8()?;
        if version != RECORD_VERSION {
            return Err(DecodeError::Version(version));
        }
        let ratio = |ppm: u32| match ppm {
            0 => Ok(None),
            ppm => Ratio::from_ppm(ppm)
                .map(Some)
                .map_err(|_| DecodeError::Invalid("ratio")),
        };
        let slow_ratio = ratio(input.u32()?)?;
        let failure_ratio = ratio(input.u32()?)?;
        let min_calls = NonZeroU32::new(input.u32()?).ok_or(DecodeError::Invalid("min_calls"))?;
        let window = NonZeroU32::new(input.u32()?)
            .map(Window::from_secs)
            .ok_or(DecodeError::Invalid("window"))?;
        // Never zero (settings: at least a second): a round that begins after a forced
        // reset at the same instant is then later than the round the reset dropped, whose
        // tickets must not match a place of the new one.
        let open_for = Some(Nanos::new(input.u64()?))
            .filter(|open_for| !open_for.is_zero())
            .ok_or(DecodeError::Invalid("open_for"))?;
        let half_open_calls =
            NonZeroU8::new(input.u8()?).ok_or(DecodeError::Invalid("half_open_calls"))?;
        let probe_timeout = Nanos::new(input.u64()?);
        let force = Force::from_code(input.u8()?).ok_or(DecodeError::Invalid("force"))?;
        let installed = input.instant()?;
        let edition = Edition {
            params: Params {
                slow_ratio,
                failure_ratio,
                min_calls,
                window,
                open_for,
                half_open_calls,
                probe_timeout,
                force,
            },
            installed,
        };
        let phase = match input.u8()? {
            0 => Phase::Closed,
            1 => Phase::Open {
                until: input.instant()?,
            },
            2 => {
                let round = input.instant()?;
                let places = (0..half_open_calls.get())
                    .map(|_| {
                        let tag = input.u8()?;
                        let taken = input.instant()?;
                        match tag {
                            0 => Ok(Place::Free),
                            1 => Ok(Place::Good),
                            2 => Ok(Place::Out(taken)),
                            _ => Err(DecodeError::Invalid("place")),
                        }
                    })
                    .collect::<Result<Vec<Place>, DecodeError>>()?;
                Phase::HalfOpen { round, places }
            }
            _ => return Err(DecodeError::Invalid("phase")),
        };
        let head = input.u64()?;
        let mut slices = [Tally::ZERO; SLICES];
        for slice in &mut slices {
            *slice = Tally {
                calls: input.u32()?,
                slow: input.u32()?,
                failed: input.u32()?,
            };
        }
        let calls = CallWindow::from_parts(head, slices);
        let source = match input.u8()? {
            0 => Source::Local,
            1 => Source::Fleet(Fleet {
                trusted_until: input.instant()?,
                status: Status::from_gauge(input.u8()?)
                    .ok_or(DecodeError::Invalid("fleet status"))?,
                half_open_at: input.instant()?,
                round: input.u64()?,
                granted: input.u32()?,
                used: input.u32()?,
                wanted: input.u32()?,
            }),
            _ => return Err(DecodeError::Invalid("source")),
        };
        if !input.bytes.is_empty() {
            return Err(DecodeError::Trailing);
        }
        let state =
            State::from_parts(edition, phase, calls).ok_or(DecodeError::Invalid("phase"))?;
        Ok(Record { state, source })
    }
}

fn fleet_is_trusted(fleet: &Fleet, now: Instant) -> bool {
    // An instant further ahead than the trust itself cannot come from this clock running
    // forward: a clock stepped back does not extend the fleet's reign. Another worker may
    // have written the record after this one read its clock (a tick's or a request's
    // instant, taken before it reads the record): up to [`FLEET_TRUST_SKEW`] beyond the
    // trust is that, not a clock stepped back.
    now < fleet.trusted_until && fleet.trusted_until.saturating_since(now) <= FLEET_TRUST_AHEAD
}

fn put_u32(out: &mut Vec<u8>, value: u32) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes());
}

struct Reader<'b> {
    bytes: &'b [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let (head, rest) = self
            .bytes
            .split_first_chunk::<N>()
            .ok_or(DecodeError::Truncated)?;
        self.bytes = rest;
        Ok(*head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(u8::from_le_bytes(self.take()?))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take()?))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take()?))
    }

    fn instant(&mut self) -> Result<Instant, DecodeError> {
        Ok(Instant::from_unix_nanos(self.u64()?))
    }
}

/// A verdict a worker answers from memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cached {
    Call,
    /// Open: fail fast until then.
    FastFailUntil(Instant),
    /// Forced open: fail fast with this `Retry-After`.
    FastFail(u64),
}

/// What the quota service needs about one breaker since the last report: one worker's
/// calls and probe outcomes (the workers' reports add up) and the gateway's fleet places
/// (withdrawn unused ones, and the demand for more).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Report {
    pub calls: Tally,
    pub probes: ProbeTally,
    pub places: Option<PlaceClaim>,
}

impl Report {
    pub const fn is_empty(&self) -> bool {
        self.calls.is_empty() && self.probes.is_empty() && self.places.is_none()
    }
}

/// What [`Handle::check`] answers. With `trouble` (shared data failed), the admission is
/// the defined fallback: a host that cannot be read lets the call through (a broken store
/// must not fail every request); contention fails fast with `Retry-After: 1`, as a rule's
/// contention does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub admission: Admission<Probe>,
    pub transitions: Transitions,
    pub trouble: Option<ChargeError>,
}

/// One worker's view of one breaker: its settings as installed, a cached verdict, the
/// calls not yet merged into the record, and (scope global) what the next report carries.
/// Keep it across reloads that keep the breaker ([`Handle::reconfigure`]): its pending
/// calls are the gateway's evidence.
///
/// Its [`Tap`] is shared with the requests in flight whose binding keeps their calls
/// itself: the good calls counted there join the pending calls at the handle's next flush,
/// judgement or report ([`Handle::take_tapped`]).
#[derive(Debug)]
pub struct Handle {
    key: String,
    edition: Edition,
    reach: Reach,
    cached: Option<(Cached, Instant)>,
    /// Calls recorded since the last flush.
    pending: Tally,
    /// The window as last read.
    seen: Tally,
    /// Whether the record, as last read, judges calls (an early flush may trip it).
    judges: bool,
    early_flush_at: Option<Instant>,
    report: Report,
    status: Status,
    tap: Arc<Tap>,
}

impl Handle {
    /// The handle of `settings` installed at `installed` (the worker's instant of the
    /// document: see [`Edition`]).
    pub fn new(settings: &Settings, installed: Instant) -> Handle {
        Handle {
            key: record_key(&settings.name),
            edition: settings.edition(installed),
            reach: settings.reach,
            cached: None,
            pending: Tally::ZERO,
            seen: Tally::ZERO,
            judges: true,
            early_flush_at: None,
            report: Report::default(),
            status: Status::Closed,
            tap: Arc::new(Tap::new(settings.call_judge())),
        }
    }

    /// The tap a request's binding counts this breaker's good calls in, when it keeps the
    /// request's calls itself ([`super::tap`]).
    pub fn tap(&self) -> &Arc<Tap> {
        &self.tap
    }

    /// Whether a request in flight still keeps a call of this breaker (its tap).
    pub fn is_tapped(&self) -> bool {
        Arc::strong_count(&self.tap) > 1
    }

    /// The good calls counted in the tap since last taken, now pending here as if
    /// [`Handle::record`]ed one by one (none of them flushes early: each was taken only
    /// while the handle would have kept it in memory). Returns how many, for the calls
    /// metric.
    pub fn take_tapped(&mut self) -> u32 {
        let good = self.tap.take_counted();
        if good > 0 {
            let tally = Tally {
                calls: good,
                slow: 0,
                failed: 0,
            };
            self.pending = self.pending.merge(tally);
            if self.reach == Reach::Fleet {
                self.report.calls = self.report.calls.merge(tally);
            }
        }
        good
    }

    /// Tells the tap whether a good call may be counted there: what
    /// [`Handle::records_in_memory`] answers for one, after every change of the pending
    /// calls or of the view of the record.
    fn advise_tap(&self) {
        self.tap
            .set_takes_good(self.records_in_memory(Outcome::GOOD));
    }

    /// A reload that keeps this breaker (same name): new settings, the pending calls and
    /// the report kept, the cached verdict dropped.
    pub fn reconfigure(&mut self, settings: &Settings, installed: Instant) {
        self.key = record_key(&settings.name);
        self.edition = settings.edition(installed);
        self.reach = settings.reach;
        self.cached = None;
        // Calls in flight keep the old tap, and are judged by the settings they left with.
        self.take_tapped();
        self.tap = Arc::new(Tap::new(settings.call_judge()));
        self.advise_tap();
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// The status as this worker last read it (for the state gauge).
    pub fn status(&self) -> Status {
        self.status
    }

    /// Whether a request may go on, probe, or fail fast. No shared data while a verdict
    /// read less than [`VERDICT_CACHE`] ago is closed, forced or open.
    pub fn check(&mut self, store: &Store, host: &dyn SharedData, now: Instant) -> Checked {
        if let Some(admission) = self.cached_admission(now) {
            return Checked {
                admission,
                transitions: Transitions::new(),
                trouble: None,
            };
        }
        let edition = self.edition;
        let result = store.update(host, &self.key, |payload| {
            let mut record = Record::from_payload(payload, &edition);
            let before = record.clone();
            let (admission, transitions) = record.check(&edition, now);
            let view = View::of(&record, now);
            let write = (record != before).then(|| record.encode());
            (write, (admission, transitions, view))
        });
        match result {
            Ok((admission, transitions, view)) => {
                self.learn(view);
                Checked {
                    admission,
                    transitions,
                    trouble: None,
                }
            }
            Err(trouble) => {
                self.cached = None;
                let admission = match trouble {
                    ChargeError::Host(_) => Admission::Call,
                    ChargeError::Contention => Admission::FastFail { retry_after: 1 },
                };
                Checked {
                    admission,
                    transitions: Transitions::new(),
                    trouble: Some(trouble),
                }
            }
        }
    }

    /// Whether the verdict cached less than [`VERDICT_CACHE`] ago lets a request call:
    /// what [`Handle::check`] would answer without a transition, shared data or trouble
    /// (the common case, spelled out for the request path).
    pub fn calls_now(&self, now: Instant) -> bool {
        self.cached_admission(now) == Some(Admission::Call)
    }

    fn cached_admission(&self, now: Instant) -> Option<Admission<Probe>> {
        let (cached, trusted_until) = self.cached?;
        // A reading further ahead than the cache lasts is from before a clock step back.
        if now >= trusted_until || trusted_until.saturating_since(now) > VERDICT_CACHE {
            return None;
        }
        Some(match cached {
            Cached::Call => Admission::Call,
            Cached::FastFailUntil(until) => Admission::FastFail {
                retry_after: ceil_seconds_at_least_one(until.saturating_since(now)),
            },
            Cached::FastFail(retry_after) => Admission::FastFail { retry_after },
        })
    }

    /// A call's outcome (not a probe's: [`Handle::probe_outcome`]). Kept in memory until
    /// the next flush, unless slow or failed outcomes are pending: then flushed now, at
    /// once when the window as last read plus the pending calls would trip the breaker,
    /// else at most once per [`EARLY_FLUSH_GAP`] (a bad outcome held back by the gap goes
    /// with the next outcome after it). Not only when this worker's view would trip it:
    /// the evidence is often spread over the workers (4 failures on 4 workers, one each,
    /// trip `min_calls: 4` only in the record), and a tick later the good calls since
    /// would have diluted it.
    pub fn record(
        &mut self,
        store: &Store,
        host: &dyn SharedData,
        outcome: Outcome,
        now: Instant,
    ) -> Result<Transitions, ChargeError> {
        if self.record_in_memory(outcome) {
            return Ok(Transitions::new());
        }
        self.count(outcome);
        let rested = self
            .early_flush_at
            .is_none_or(|last| now.saturating_since(last) >= EARLY_FLUSH_GAP || last > now);
        // What this worker has seen can trip it: no waiting (one flush per bad outcome at
        // most, and once it trips the record no longer judges).
        let (slow, failed) = self.edition.params.reached(self.seen.merge(self.pending));
        if !rested && !(!outcome.is_good() && (slow || failed)) {
            return Ok(Transitions::new());
        }
        self.early_flush_at = Some(now);
        self.flush(store, host, now)
    }

    /// Whether [`Handle::record`] of a call with `outcome` only counts it in memory (no
    /// flush, so neither the time nor shared data): no slow or failed outcome would be
    /// pending with it, or the record as last read does not judge calls.
    pub fn records_in_memory(&self, outcome: Outcome) -> bool {
        let pending = self.pending.merge(Tally::of(outcome));
        !self.judges || (pending.slow == 0 && pending.failed == 0)
    }

    /// [`Handle::record`] of a call that [`Handle::records_in_memory`], which needs no
    /// instant: counted, and true; false, with nothing counted, for any other call.
    pub fn record_in_memory(&mut self, outcome: Outcome) -> bool {
        if !self.records_in_memory(outcome) {
            return false;
        }
        self.count(outcome);
        true
    }

    /// A call's outcome, counted in the pending calls (and the next report's).
    fn count(&mut self, outcome: Outcome) {
        self.pending.add(outcome);
        if self.reach == Reach::Fleet {
            self.report.calls.add(outcome);
        }
        self.advise_tap();
    }

    /// Merges the pending calls into the record and reads its state back (the worker's
    /// tick; a second apart is enough). Also what makes the transitions that only need
    /// time, and applies a reload's settings, when no request does. On an error the
    /// pending calls stay for the next flush.
    pub fn flush(
        &mut self,
        store: &Store,
        host: &dyn SharedData,
        now: Instant,
    ) -> Result<Transitions, ChargeError> {
        let pending = self.pending;
        let transitions = self.update(store, host, now, |record, edition| {
            record.record(edition, pending, now)
        })?;
        self.pending = Tally::ZERO;
        self.advise_tap();
        Ok(transitions)
    }

    /// A probe's outcome: a local probe's goes into the record now (it may close or
    /// reopen the breaker); a fleet probe's goes into the next report.
    pub fn probe_outcome(
        &mut self,
        store: &Store,
        host: &dyn SharedData,
        probe: Probe,
        outcome: Outcome,
        now: Instant,
    ) -> Result<Transitions, ChargeError> {
        match probe {
            Probe::Fleet { .. } => {
                self.report.probes.add(outcome);
                Ok(Transitions::new())
            }
            Probe::Local(ticket) => self.update(store, host, now, |record, edition| {
                record.probe_outcome(edition, ticket, outcome, now)
            }),
        }
    }

    /// A probe that never became a call (a rule rejected it, Diana answered it) gives its
    /// place back. Not an outcome.
    pub fn give_back(
        &mut self,
        store: &Store,
        host: &dyn SharedData,
        probe: Probe,
        now: Instant,
    ) -> Result<Transitions, ChargeError> {
        self.update(store, host, now, |record, edition| {
            record.give_back(edition, probe, now)
        })
    }

    /// The quota service's answer for this breaker (scope global): every worker of the
    /// gateway follows it.
    pub fn follow(
        &mut self,
        store: &Store,
        host: &dyn SharedData,
        answer: FleetAnswer,
        now: Instant,
    ) -> Result<Transitions, ChargeError> {
        self.update(store, host, now, |record, edition| {
            record.follow(edition, answer, now)
        })
    }

    /// What the next report to the quota service carries (scope global), taken: this
    /// worker's calls and probe outcomes since its last report, and the gateway's fleet
    /// places (a compare-and-swap on the record when the fleet is half-open). `None` when
    /// there is nothing to report. On an error the worker's part stays for the next one.
    pub fn take_report(
        &mut self,
        store: &Store,
        host: &dyn SharedData,
        now: Instant,
    ) -> Result<Option<Report>, ChargeError> {
        let edition = self.edition;
        let places = match self.status {
            Status::HalfOpen => store.update(host, &self.key, |payload| {
                let mut record = Record::from_payload(payload, &edition);
                let claim = record.claim_places(now);
                (claim.map(|_| record.encode()), claim)
            })?,
            Status::Closed | Status::Open => None,
        };
        let report = Report {
            places,
            ..std::mem::take(&mut self.report)
        };
        Ok((!report.is_empty()).then_some(report))
    }

    /// The calls and probe outcomes of a report that could not be sent go back, added to
    /// what came since. (Its withdrawn places stay withdrawn: the service frees them when
    /// their probes time out.)
    pub fn restore_report(&mut self, report: Report) {
        self.report = Report {
            calls: report.calls.merge(self.report.calls),
            probes: report.probes.merge(self.report.probes),
            places: None,
        };
    }

    /// Read-modify-write of the record: `change` runs on the record as stored (or a fresh
    /// one), and it is written back only if it changed.
    fn update(
        &mut self,
        store: &Store,
        host: &dyn SharedData,
        now: Instant,
        mut change: impl FnMut(&mut Record, &Edition) -> Transitions,
    ) -> Result<Transitions, ChargeError> {
        let edition = self.edition;
        let (transitions, view) = store.update(host, &self.key, |payload| {
            let mut record = Record::from_payload(payload, &edition);
            let before = record.clone();
            let transitions = change(&mut record, &edition);
            let view = View::of(&record, now);
            let write = (record != before).then(|| record.encode());
            (write, (transitions, view))
        })?;
        self.learn(view);
        Ok(transitions)
    }

    fn learn(&mut self, view: View) {
        self.cached = view.cache;
        self.seen = view.window;
        self.judges = view.judges;
        self.status = view.status;
        self.advise_tap();
    }
}

/// What a worker keeps of a record it has just read or written.
#[derive(Debug, Clone, Copy)]
struct View {
    cache: Option<(Cached, Instant)>,
    window: Tally,
    judges: bool,
    status: Status,
}

impl View {
    fn of(record: &Record, now: Instant) -> View {
        View {
            cache: record.cacheable(now),
            window: record.state.window_total(now),
            judges: record.judges(now),
            status: record.status(now),
        }
    }
}

#[cfg(test)]
mod tests;
