//! What an evaluation answers: admit, admit after a wait, reject, make a call first, or
//! wait for another request's call. A leaf: what a call or a wait carries is the
//! evaluator's own type (`C`, `W`), so this module knows neither.
//! Complete data, so that the host glue only moves bytes: a rejection carries its status,
//! body and headers; a call carries its upstream, headers, body and timeout.

use crate::breaker::Probe;
use crate::local::Taken;
use crate::places::HoldingId;
use crate::response::Rejection;
use crate::store::SlotAddress;
use crate::time::Instant;
use crate::wire::CallRule;
use smallvec::SmallVec;

/// What the host must do with the request. `C` is a call with what its answer resumes,
/// `W` what a request parked behind another request's call needs to be planned again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<C, W> {
    /// Let it through now, with `upstream`'s changes to its own headers, adding `headers`
    /// to the response; once the upstream has answered, hand `after` back with the
    /// response headers it names.
    Allow {
        headers: Vec<(&'static str, String)>,
        after: Option<AfterResponse>,
        upstream: Vec<HeaderEdit>,
    },
    /// Let it through at `until` (leaky bucket): pause it and resume it then.
    Delay {
        until: Instant,
        headers: Vec<(&'static str, String)>,
        after: Option<AfterResponse>,
        upstream: Vec<HeaderEdit>,
    },
    /// Answer with this local reply.
    Reject(Rejection),
    /// Make this call and pause the request until its answer.
    Call(C),
    /// Pause the request behind another request's call (single flight); once the engine
    /// lists it as woken, hand `W` back to be planned again (Envoy only: a host that can
    /// resume a request from its tick).
    Wait(W),
}

/// What to settle once the upstream has answered (`response_cost`, `count`): for each
/// rule, the response header to read, the identity, and what the request took up front
/// ([`crate::settle`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AfterResponse {
    pub(crate) charges: Vec<ResponseCharge>,
    /// Concurrency places the request holds until it ends (`max_in_flight`): the
    /// engine keeps them ([`crate::places::Holdings`]), the request this id.
    pub(crate) holding: Option<HoldingId>,
    /// The breakers whose upstream this request is a call to (DESIGN §4b), judged when its
    /// response headers come (or it ends without them).
    pub(crate) breakers: BreakerCalls,
    /// When the request left Diana (the start of its breakers' calls).
    pub(crate) left_at: Instant,
}

/// The breakers one request is a call of: inline for one (a resource's own breaker, the
/// common case), so that a request through a breaker allocates nothing for it.
pub(crate) type BreakerCalls = SmallVec<[BreakerCall; 1]>;

/// One breaker's call: the request goes to the breaker's upstream, as a probe when the
/// breaker is half-open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BreakerCall {
    pub breaker: usize,
    pub probe: Option<Probe>,
}

/// A change Diana makes to a request's own headers before it goes on: set `name` to
/// `value`, or remove it (`None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEdit {
    pub name: String,
    pub value: Option<String>,
}

/// One rule of an admitted request, to settle with its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResponseCharge {
    pub rule: usize,
    /// The response header its cost is read from (`:status` for `count`); `None`: the
    /// answer's body (`response_cost.usage | json`, read as it passes).
    pub header: Option<String>,
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
    /// From the quota service (directly, or this gateway's lease stash). Tokens given back
    /// go back to the service when the request's own call granted them (`from`: a release
    /// of part of that rule's grant), else — or when that fails — to the stash, spendable
    /// by the identity's next requests here until `until`.
    Global {
        tokens: u32,
        until: Instant,
        from: Option<CallRule>,
    },
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

/// A response's `:status` value as a number, as `str::trim` then `u16::from_str` read it
/// (`None`: not one). The usual value, one to five ASCII digits, is read directly, without
/// the UTF-8 check and the trim.
pub fn status_code(value: &[u8]) -> Option<u16> {
    if let [_, ..] = value {
        if value.len() <= 5 && value.iter().all(u8::is_ascii_digit) {
            let number = value
                .iter()
                .fold(0u32, |number, digit| number * 10 + u32::from(digit - b'0'));
            return u16::try_from(number).ok();
        }
    }
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

impl AfterResponse {
    /// The response headers to read, in the order their values are handed back.
    pub fn headers(&self) -> impl Iterator<Item = &str> {
        self.charges
            .iter()
            .filter_map(|charge| charge.header.as_deref())
    }

    /// True when a rule's cost is read from the answer's body: the request is settled
    /// when its body ends ([`crate::engine::Engine::after_body`]).
    pub fn reads_body(&self) -> bool {
        self.charges.iter().any(|charge| charge.header.is_none())
    }

    /// The rules whose cost the answer's body gives, in the order their costs are handed
    /// back.
    pub(crate) fn body_charges(&self) -> impl Iterator<Item = &ResponseCharge> {
        self.charges.iter().filter(|charge| charge.header.is_none())
    }

    pub fn is_empty(&self) -> bool {
        self.charges.is_empty() && self.holding.is_none() && self.breakers.is_empty()
    }

    /// True when the response's status is read (a breaker judges the call).
    pub fn reads_status(&self) -> bool {
        !self.breakers.is_empty()
    }

    /// The concurrency places the request holds until it ends.
    pub fn holding(&self) -> Option<HoldingId> {
        self.holding
    }
}

#[cfg(test)]
mod tests {
    use super::status_code;

    /// The direct reading of plain digits answers what the general one does.
    #[test]
    fn a_status_is_read_as_trim_then_parse_reads_it() {
        let general =
            |value: &[u8]| -> Option<u16> { std::str::from_utf8(value).ok()?.trim().parse().ok() };
        let mut values: Vec<Vec<u8>> = [
            "",
            "0",
            "200",
            "503",
            "099",
            "00200",
            "65535",
            "65536",
            "99999",
            "100000",
            "1234567",
            " 200",
            "200 ",
            "\t503\r\n",
            "+200",
            "-1",
            "2 00",
            "20a",
            "\u{a0}200",
            "２００",
        ]
        .iter()
        .map(|value| value.as_bytes().to_vec())
        .collect();
        values.push(vec![0xff, b'2', b'0', b'0']);
        values.extend((0..=99_999u32).map(|n| n.to_string().into_bytes()));
        values.extend((0..1000u32).map(|n| format!("{n:05}").into_bytes()));
        for value in values {
            assert_eq!(status_code(&value), general(&value), "{value:?}");
        }
    }
}
