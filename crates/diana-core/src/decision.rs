//! What an evaluation answers: admit, admit after a wait, reject, make a call first, or
//! wait for another request's call.
//! Complete data, so that the host glue only moves bytes: a rejection carries its status,
//! body and headers; a call carries its upstream, headers, body and timeout.

use crate::global::ServicePlace;
use crate::local::Taken;
use crate::response::Rejection;
use crate::store::SlotAddress;
use crate::time::Instant;
use std::fmt;

/// What the host must do with the request. `P` is what the evaluator needs back, with
/// the call's reply, to finish a request it paused for a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<P> {
    /// Let it through now, adding these headers to the response; once the upstream has
    /// answered, hand `after` back with the response headers it names.
    Allow {
        headers: Vec<(&'static str, String)>,
        after: Option<AfterResponse>,
    },
    /// Let it through at `until` (leaky bucket): pause it and resume it then.
    Delay {
        until: Instant,
        headers: Vec<(&'static str, String)>,
        after: Option<AfterResponse>,
    },
    /// Answer with this local reply.
    Reject(Rejection),
    /// Make this call, pause the request, and hand the reply back with `P`.
    Call(Callout, P),
    /// Pause the request behind another request's call (single flight); once the engine
    /// lists it as woken, hand `P` back to be planned again (Envoy only: a host that can
    /// resume a request from its tick).
    Wait(P),
}

/// An HTTP call the host makes on the filter's behalf (`dispatch_http_call`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    /// Envoy: a cluster name; nginx: `host:port`.
    pub upstream: String,
    /// `:method`, `:path`, `:authority` first, then the others.
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

/// What became of a call, as the host tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The host refused to make the call (unknown cluster, bad upstream).
    NotSent(DispatchError),
    /// No answer: timeout, connection refused or reset (a reply without headers).
    NoAnswer,
    /// An answer: its status (0 when unreadable) and body (`None` when it was larger than
    /// the caller accepts).
    Answered { status: u16, body: Option<Vec<u8>> },
}

/// What to settle once the upstream has answered (`response_cost`, `count`): for each
/// rule, the response header to read, the identity, and what the request took up front
/// ([`crate::settle`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AfterResponse {
    pub(crate) charges: Vec<ResponseCharge>,
    /// Concurrency places the request holds until it ends (`max_in_flight`).
    pub(crate) places: Vec<Place>,
}

/// A concurrency place an admitted request holds until it ends
/// ([`crate::algo::InFlight`]); its worker renews it while the request is inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Place {
    pub rule: usize,
    pub address: SlotAddress,
    pub at: PlaceAt,
    /// When it was taken or last renewed.
    pub renewed: Instant,
}

/// Where a place is counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PlaceAt {
    /// In this gateway's shared data (a local rule, or a global one while the quota
    /// service is unavailable).
    Local(Taken),
    /// At the quota service, in `bucket`. While a renewal is in flight (`renewing`), the
    /// renewal's answer says where it is: the request's end leaves it from there.
    Service {
        bucket: u64,
        places: u32,
        renewing: bool,
    },
}

impl Place {
    /// This place at the quota service, if it is counted there.
    pub(crate) fn at_service(&self) -> Option<ServicePlace> {
        match self.at {
            PlaceAt::Local(_) => None,
            PlaceAt::Service { bucket, places, .. } => Some(ServicePlace {
                index: self.rule,
                address: self.address,
                bucket,
                places,
            }),
        }
    }

    /// This place at the quota service, to give back now that its request ended; `None`
    /// when it is counted locally, or while its renewal is in flight (the renewal's answer
    /// says where it is, and gives it back from there).
    pub(crate) fn to_leave(&self) -> Option<ServicePlace> {
        match self.at {
            PlaceAt::Service {
                renewing: false, ..
            } => self.at_service(),
            _ => None,
        }
    }

    /// This place at the quota service, marked as renewing, unless a renewal of it is in
    /// flight already.
    pub(crate) fn start_renewal(&mut self) -> Option<ServicePlace> {
        let due = self.to_leave()?;
        if let PlaceAt::Service { renewing, .. } = &mut self.at {
            *renewing = true;
        }
        Some(due)
    }

    /// The answer to the renewal of `asked` came (`bucket`: where the service counts it
    /// now; `None`: not renewed, it stays where it was). True when `asked` is this place.
    pub(crate) fn renewal_answered(
        &mut self,
        asked: &ServicePlace,
        bucket: Option<u64>,
        now: Instant,
    ) -> bool {
        let PlaceAt::Service {
            bucket: held,
            places,
            renewing: true,
        } = self.at
        else {
            return false;
        };
        if self.rule != asked.index || self.address != asked.address || held != asked.bucket {
            return false;
        }
        self.at = PlaceAt::Service {
            bucket: bucket.unwrap_or(held),
            places,
            renewing: false,
        };
        if bucket.is_some() {
            self.renewed = now;
        }
        true
    }
}

/// One rule of an admitted request, to settle with its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResponseCharge {
    pub rule: usize,
    pub header: String,
    pub address: SlotAddress,
    /// What the request was to take up front (its cost, or its reservation).
    pub upfront: u32,
    /// What it did take, and from where, for a rule that settles.
    pub reserved: Reserved,
}

/// Tokens a rule holds for an admitted request until its answer settles them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) enum Reserved {
    /// None (the rule does not settle, or took nothing).
    #[default]
    Nothing,
    /// From the local counter (or this worker's batch of it).
    Local(Taken),
    /// From the quota service (directly, or this gateway's lease stash); tokens given back
    /// go to the stash, spendable by the identity's next requests here until `until`.
    Global { tokens: u32, until: Instant },
}

impl Reserved {
    /// How many tokens are held.
    pub fn tokens(&self) -> u32 {
        match self {
            Reserved::Nothing => 0,
            Reserved::Local(taken) => taken.tokens(),
            Reserved::Global { tokens, .. } => *tokens,
        }
    }
}

impl AfterResponse {
    /// The response headers to read, in the order their values are handed back.
    pub fn headers(&self) -> impl Iterator<Item = &str> {
        self.charges.iter().map(|charge| charge.header.as_str())
    }

    pub fn is_empty(&self) -> bool {
        self.charges.is_empty() && self.places.is_empty()
    }

    /// True when the request holds concurrency places until it ends.
    pub fn holds_places(&self) -> bool {
        !self.places.is_empty()
    }
}

/// Why the host did not send a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DispatchError {
    /// The host refused it (unknown cluster, no upstream, a closed VM): its status.
    Refused { upstream: String, status: String },
    /// The upstream is not `host:port`, which this host needs (a malformed one traps
    /// inside ngx_wasm_module's dispatch).
    NotHostPort { upstream: String },
    /// Not sent: this host would not hold the request paused for the answer without the
    /// configuration line `needs` (see `HostProfile::pausing_needs`). The service is not
    /// at fault: the request is decided locally, the breaker stays as it is.
    CannotPause { needs: &'static str },
}

impl fmt::Display for DispatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DispatchError::Refused { upstream, status } => {
                write!(f, "{status} (upstream {upstream})")
            }
            DispatchError::NotHostPort { upstream } => {
                write!(
                    f,
                    "upstream {upstream:?} is not host:port, which this host needs"
                )
            }
            DispatchError::CannotPause { needs } => {
                write!(f, "this host holds no paused request without `{needs}`")
            }
        }
    }
}
