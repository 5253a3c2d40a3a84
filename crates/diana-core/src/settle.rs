//! Settling a request once its answer is known: what a rule took up front against what
//! the answer says the request cost.
//!
//! ```text
//!                 request                          answer's headers
//!   rule takes `upfront` ──▶ admitted ──▶ upstream ──▶ settle(answer)
//!   (cost, or reserve;            │                      ├─ Owe(n):      charged past the limit
//!    all or nothing)              │                      ├─ GiveBack(n): returned to the counter
//!                                 │                      └─ Keep:        the reservation stands
//!                                 └─ no answer (client gone, reset): the reservation stands
//! ```
//!
//! - `response_cost` alone: the request took its `cost`; the answer's cost is owed on top.
//! - `response_cost.reserve`: the request took the reservation; the answer's cost replaces
//!   it (the difference owed or given back). An answer without a readable cost keeps the
//!   reservation charged: nothing says it cost less.
//! - `count.status`: the request took its cost; an answer of a counted status keeps it, any
//!   other gives it back. An unreadable status is counted.
//! - A cost read from the answer's body ([`settle_body`], `response_cost.usage | json`) is
//!   settled when the body ends, as a header's would be. A stream cut short (its client
//!   gone, its upstream reset) keeps the reservation and owes what the events before the
//!   cut already reported beyond it; a body without usable usage keeps the reservation.
//!
//! Pure: the engine carries the result out (the local counter, the lease stash, or a debt
//! to the quota service).

use crate::config::Rule;

/// What settling one rule of one request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Nothing changes.
    Keep,
    /// Charge this many more tokens, past the limit if need be.
    Owe(u32),
    /// Give this many tokens back to the counter the request took them from.
    GiveBack(u32),
}

/// Settles `rule` for one request: `reserved` is what the rule took up front and holds for
/// it (0: nothing, e.g. a rule in dry run that would have denied), `upfront` what the
/// request was to take, `answer` the value of [`Rule::answer_header`] in the response.
pub fn settle(rule: &Rule, reserved: u32, upfront: u32, answer: Option<&[u8]>) -> Settlement {
    let cost = match (&rule.count, &rule.response_cost) {
        (Some(count), _) => Some(if count.counts(answer) { upfront } else { 0 }),
        (None, Some(response_cost)) => response_cost.of(answer),
        (None, None) => return Settlement::Keep,
    };
    replace(rule, reserved, cost)
}

/// What an answer's body said a request cost (`response_cost.usage | json`), priced and
/// capped by the rule ([`crate::config::ResponseCost::charge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyCost {
    /// The body was read to its end and gave this cost.
    Read(u32),
    /// The stream was cut short (the client or the upstream went away) after whole events
    /// that gave this cost so far: a floor, not the cost (more may have been generated).
    CutShort(u32),
    /// No usable usage: none, malformed, not an integer, or cut short before any.
    Unknown,
}

/// Settles a rule whose cost the answer's body gives. A cost read whole replaces the
/// reservation (or is owed on top of the `cost` taken, without one), as a header's would;
/// a stream cut short keeps the reservation and owes only what it is known to have cost
/// beyond it; no usage keeps the reservation (nothing says it cost less).
pub fn settle_body(rule: &Rule, reserved: u32, body: BodyCost) -> Settlement {
    let reserves = rule
        .response_cost
        .as_ref()
        .is_some_and(|response_cost| response_cost.reserve.is_some());
    let cost = match body {
        BodyCost::Read(cost) => Some(cost),
        BodyCost::CutShort(seen) if reserves => Some(seen.max(reserved)),
        BodyCost::CutShort(seen) => Some(seen),
        BodyCost::Unknown => None,
    };
    replace(rule, reserved, cost)
}

/// The cost an answer gave (`None`: unknown), against what the request holds: with a
/// reservation (or a `count`), the cost replaces what was reserved; a plain
/// `response_cost` is owed on top of what the request took.
fn replace(rule: &Rule, reserved: u32, cost: Option<u32>) -> Settlement {
    let (cost, reserved) = match (cost, rule.settles()) {
        (None, _) => return Settlement::Keep,
        (Some(cost), true) => (cost, reserved),
        // Owed on top of what the request took.
        (Some(cost), false) => (cost, 0),
    };
    match cost {
        cost if cost > reserved => Settlement::Owe(cost - reserved),
        cost if cost < reserved => Settlement::GiveBack(reserved - cost),
        _ => Settlement::Keep,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_policy;

    fn rule(fields: &str) -> Rule {
        let document = format!("Url: /\nrules:\n  - {{rpu: 1000, {fields}}}\n");
        match parse_policy(&document).map(|policy| policy.rule(0).cloned()) {
            Ok(Some(rule)) => rule,
            other => unreachable!("{document}: {other:?}"),
        }
    }

    /// Rule fields, reserved, upfront, the answer's value, and the settlement.
    type Case<'a> = (&'a str, u32, u32, Option<&'a [u8]>, Settlement);

    #[test]
    fn each_kind_of_rule_settles_as_the_module_says() {
        use Settlement::*;
        let plain = "response_cost: {header: x-used, max: 500}";
        let reserve = "response_cost: {header: x-used, max: 500, reserve: 200}";
        let count = "count: {status: [401, 403, 5xx]}";
        let table: &[Case] = &[
            // response_cost: owed on top of the cost, whatever was taken.
            (plain, 1, 1, Some(b"120"), Owe(120)),
            (plain, 1, 1, Some(b"0"), Keep),
            (plain, 1, 1, None, Keep),
            (plain, 1, 1, Some(b"lots"), Keep),
            (plain, 1, 1, Some(b"9000"), Owe(500)),
            // reserve: the answer's cost replaces the reservation.
            (reserve, 200, 200, Some(b"120"), GiveBack(80)),
            (reserve, 200, 200, Some(b"200"), Keep),
            (reserve, 200, 200, Some(b"350"), Owe(150)),
            (reserve, 200, 200, Some(b"9000"), Owe(300)),
            (reserve, 200, 200, Some(b"0"), GiveBack(200)),
            (reserve, 200, 200, None, Keep),
            (reserve, 200, 200, Some(b"-5"), Keep),
            // ... and a rule that took nothing (dry run) is charged the cost.
            (reserve, 0, 200, Some(b"120"), Owe(120)),
            // count: a counted status keeps the charge, any other gives it back.
            (count, 1, 1, Some(b"401"), Keep),
            (count, 1, 1, Some(b"503"), Keep),
            (count, 1, 1, Some(b"200"), GiveBack(1)),
            (count, 1, 1, Some(b"404"), GiveBack(1)),
            (count, 1, 1, None, Keep),
            (count, 1, 1, Some(b"junk"), Keep),
            (count, 0, 1, Some(b"403"), Owe(1)),
            (count, 0, 1, Some(b"200"), Keep),
        ];
        for &(fields, reserved, upfront, answer, expected) in table {
            assert_eq!(
                settle(&rule(fields), reserved, upfront, answer),
                expected,
                "{fields}, reserved {reserved}, answer {:?}",
                answer.map(String::from_utf8_lossy)
            );
        }
    }

    #[test]
    fn a_cost_from_the_body_settles_as_a_header_would_and_a_cut_keeps_the_reservation() {
        use BodyCost::*;
        use Settlement::*;
        let reserve = "response_cost: {usage: openai, reserve: 200}";
        let plain = "response_cost: {usage: openai}";
        let table: &[(&str, u32, BodyCost, Settlement)] = &[
            (reserve, 200, Read(120), GiveBack(80)),
            (reserve, 200, Read(200), Keep),
            (reserve, 200, Read(350), Owe(150)),
            (reserve, 200, Read(0), GiveBack(200)),
            (reserve, 200, Unknown, Keep),
            // Cut short: the reservation is a floor, what was seen beyond it is owed.
            (reserve, 200, CutShort(50), Keep),
            (reserve, 200, CutShort(260), Owe(60)),
            (reserve, 0, CutShort(50), Owe(50)),
            // Without a reservation: owed on top of the cost taken.
            (plain, 1, Read(120), Owe(120)),
            (plain, 1, Read(0), Keep),
            (plain, 1, CutShort(30), Owe(30)),
            (plain, 1, Unknown, Keep),
        ];
        for &(fields, reserved, body, expected) in table {
            assert_eq!(
                settle_body(&rule(fields), reserved, body),
                expected,
                "{fields}, reserved {reserved}, {body:?}"
            );
        }
    }

    #[test]
    fn a_rule_that_settles_nothing_keeps_everything() {
        assert_eq!(settle(&rule("cost: 3"), 3, 3, Some(b"7")), Settlement::Keep);
    }
}
