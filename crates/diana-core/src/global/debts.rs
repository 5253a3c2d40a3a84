//! Response costs of global rules (`response_cost`): known only once the upstream has
//! answered, they are owed to the quota service. A worker collects them per (rule,
//! identity) and sends them together from its tick in one `POST /v1/charge` — nginx allows
//! a callout only from a request's headers, a tick or a callout's answer, never from the
//! response. A charge the service does not take (it is down, or refuses) is charged to the
//! rule's local counter instead, as a degraded request would be.
//!
//! Memory is bounded: at most [`MAX_OWED`] identities are owed at once per worker; a debt
//! that finds the table full is charged locally at once.

use crate::store::SlotAddress;
use std::cell::RefCell;

/// Most (rule, identity) debts a worker keeps between two ticks.
pub const MAX_OWED: usize = 1024;

/// One identity's debt to one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Debt {
    pub rule: usize,
    pub address: SlotAddress,
    pub tokens: u64,
}

/// A worker's debts not yet sent.
#[derive(Debug, Default)]
pub struct Owed {
    debts: RefCell<Vec<Debt>>,
}

impl Owed {
    /// Adds a debt; gives it back when the table is full (charge it locally then).
    pub fn add(&self, debt: Debt) -> Option<Debt> {
        let Ok(mut debts) = self.debts.try_borrow_mut() else {
            return Some(debt);
        };
        if let Some(owed) = debts
            .iter_mut()
            .find(|owed| owed.rule == debt.rule && owed.address == debt.address)
        {
            owed.tokens = owed.tokens.saturating_add(debt.tokens);
            return None;
        }
        if debts.len() >= MAX_OWED {
            return Some(debt);
        }
        debts.push(debt);
        None
    }

    /// Takes every debt out, to send.
    pub fn take(&self) -> Vec<Debt> {
        self.debts
            .try_borrow_mut()
            .map(|mut debts| std::mem::take(&mut *debts))
            .unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.debts
            .try_borrow()
            .map_or(true, |debts| debts.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debts_merge_per_identity_and_the_table_is_bounded() {
        let owed = Owed::default();
        let address = SlotAddress::single();
        assert_eq!(
            owed.add(Debt {
                rule: 0,
                address,
                tokens: 5
            }),
            None
        );
        assert_eq!(
            owed.add(Debt {
                rule: 0,
                address,
                tokens: 7
            }),
            None
        );
        for i in 1..MAX_OWED {
            let other = SlotAddress::of(i as u64, 1 << 20);
            assert_eq!(
                owed.add(Debt {
                    rule: 0,
                    address: other,
                    tokens: 1
                }),
                None
            );
        }
        let overflow = Debt {
            rule: 1,
            address,
            tokens: 3,
        };
        assert_eq!(owed.add(overflow), Some(overflow));
        let debts = owed.take();
        assert_eq!(debts.len(), MAX_OWED);
        assert_eq!(debts[0].tokens, 12);
        assert!(owed.is_empty());
    }
}
