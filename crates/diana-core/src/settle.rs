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
    let (cost, reserved) = match (&rule.count, &rule.response_cost) {
        (Some(count), _) => (
            Some(if count.counts(answer) { upfront } else { 0 }),
            reserved,
        ),
        (None, Some(response_cost)) if response_cost.reserve.is_some() => {
            (response_cost.of(answer), reserved)
        }
        // Owed on top of what the request took.
        (None, Some(response_cost)) => (Some(response_cost.of(answer).unwrap_or(0)), 0),
        (None, None) => (None, 0),
    };
    match cost {
        None => Settlement::Keep,
        Some(cost) if cost > reserved => Settlement::Owe(cost - reserved),
        Some(cost) if cost < reserved => Settlement::GiveBack(reserved - cost),
        Some(_) => Settlement::Keep,
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
    fn a_rule_that_settles_nothing_keeps_everything() {
        assert_eq!(settle(&rule("cost: 3"), 3, 3, Some(b"7")), Settlement::Keep);
    }
}
