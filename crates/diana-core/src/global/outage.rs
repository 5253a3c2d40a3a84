//! The quota service's outage switch: global rules fall back to local scope while the
//! service is unavailable (DESIGN §4 "Degrade"). Not the upstream breaker of a resource
//! (`crate::breaker`): this one guards Diana's own dependency. Shared by every worker of a
//! gateway through one shared-data record ([`OUTAGE_KEY`]): `open_until` (0 = closed). After a failure of the
//! quota service, global rules are enforced locally with the same parameters for
//! `retry_seconds`; then one request — whichever worker claims it first, by pushing
//! `open_until` forward with a compare-and-swap — probes the service, and its answer
//! closes or re-opens the switch.
//!
//! A VM trusts its last reading of a *closed* switch for [`OUTAGE_CACHE`], which saves a
//! shared-data read on every request while the service is healthy; another worker's
//! failure reaches it within that time (its own failures open the switch at once).
//!
//! A stored `open_until` further ahead than two retry periods cannot come from this clock
//! running forward (it stepped back): it is treated as due, so a clock step keeps global
//! rules local for at most one retry period more.

use crate::store::{decode_instant, encode_instant, recordable, SharedData, Store};
use crate::time::{Instant, Nanos};
use std::cell::Cell;

/// The shared-data key of the outage switch.
pub const OUTAGE_KEY: &str = "diana/outage";

/// How long a VM trusts its last reading of a closed switch.
pub const OUTAGE_CACHE: Nanos = Nanos::from_millis(100);

/// `open_until` of a closed switch.
const CLOSED: Instant = Instant::EPOCH;

/// What the switch allows a request that needs the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Closed: call.
    Call,
    /// Half-open: this request probes the service.
    Probe,
    /// Open: stay local.
    Local,
}

/// One VM's view of the switch.
#[derive(Debug)]
pub struct Outage {
    retry: Nanos,
    /// (trusted until, `open_until` read).
    cached: Cell<(Instant, Instant)>,
}

impl Outage {
    pub fn new(retry_seconds: u32) -> Outage {
        Outage {
            retry: Nanos::from_secs(u64::from(retry_seconds)),
            cached: Cell::new((Instant::EPOCH, CLOSED)),
        }
    }

    /// `open_until`, from the cache while it is fresh and said "closed", else from the host.
    fn open_until(&self, store: &Store, host: &dyn SharedData, now: Instant) -> Instant {
        let (trusted_until, open_until) = self.cached.get();
        if open_until == CLOSED && now < trusted_until && trusted_until - now <= OUTAGE_CACHE {
            return CLOSED;
        }
        let open_until = decode_instant(store.read(host, OUTAGE_KEY).ok().flatten().as_deref());
        self.remember(open_until, now);
        open_until
    }

    fn remember(&self, open_until: Instant, now: Instant) {
        self.cached
            .set((now.saturating_add(OUTAGE_CACHE), open_until));
    }

    /// A stored instant is due at `now`, or cannot come from this clock.
    fn due(&self, open_until: Instant, now: Instant) -> bool {
        now >= open_until || open_until - now > 2 * self.retry
    }

    /// True while the switch keeps global rules local (open, its retry period not over),
    /// read without claiming the probe: for calls that are not decisions (places given
    /// back or renewed), which must not stand in for the probe.
    pub fn keeps_local(&self, store: &Store, host: &dyn SharedData, now: Instant) -> bool {
        let open_until = self.open_until(store, host, now);
        open_until != CLOSED && !self.due(open_until, now)
    }

    /// Whether a request that needs the service may call it. A request that finds the
    /// retry period over claims the probe by pushing `open_until` forward, so that the
    /// other workers stay local until the probe answers.
    pub fn gate(&self, store: &Store, host: &dyn SharedData, now: Instant) -> Gate {
        let open_until = self.open_until(store, host, now);
        if open_until == CLOSED {
            return Gate::Call;
        }
        if !self.due(open_until, now) {
            return Gate::Local;
        }
        let claimed = store.update(host, OUTAGE_KEY, |current| {
            let current = decode_instant(current);
            if current == CLOSED {
                (None, Gate::Call)
            } else if self.due(current, now) {
                let next = recordable(now.saturating_add(self.retry));
                (Some(encode_instant(next)), Gate::Probe)
            } else {
                (None, Gate::Local)
            }
        });
        claimed.unwrap_or(Gate::Local)
    }

    /// Opens the switch for one retry period; true when it was closed (a switch to log).
    pub fn open(&self, store: &Store, host: &dyn SharedData, now: Instant) -> bool {
        self.set(store, host, recordable(now.saturating_add(self.retry)), now)
    }

    /// Closes the switch; true when it was open.
    pub fn close(&self, store: &Store, host: &dyn SharedData, now: Instant) -> bool {
        self.set(store, host, CLOSED, now)
    }

    fn set(&self, store: &Store, host: &dyn SharedData, open_until: Instant, now: Instant) -> bool {
        self.remember(open_until, now);
        store
            .update(host, OUTAGE_KEY, |current| {
                let before = decode_instant(current);
                let changed = (before == CLOSED) != (open_until == CLOSED);
                (Some(encode_instant(open_until)), changed)
            })
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{CasSemantics, MemoryHost};
    use crate::time::NANOS_PER_SECOND;

    const S: Nanos = NANOS_PER_SECOND;

    #[test]
    fn opens_probes_once_and_closes() {
        let host = MemoryHost::new(CasSemantics::Nginx);
        let store = Store::new();
        let (a, b) = (Outage::new(5), Outage::new(5));
        let t0 = Instant::EPOCH + 1_000 * S;
        assert_eq!(a.gate(&store, &host, t0), Gate::Call);
        assert!(a.open(&store, &host, t0));
        assert!(!a.open(&store, &host, t0), "already open: no second switch");
        assert_eq!(a.gate(&store, &host, t0 + S), Gate::Local);
        // b read "closed" before: it trusts that for OUTAGE_CACHE only.
        assert_eq!(b.gate(&store, &host, t0 + 4 * S), Gate::Local);
        // After retry_seconds exactly one worker probes.
        assert_eq!(b.gate(&store, &host, t0 + 5 * S), Gate::Probe);
        assert_eq!(a.gate(&store, &host, t0 + 5 * S), Gate::Local);
        assert!(b.close(&store, &host, t0 + 5 * S));
        assert_eq!(a.gate(&store, &host, t0 + 5 * S + OUTAGE_CACHE), Gate::Call);
    }

    #[test]
    fn a_clock_that_steps_back_never_keeps_it_open_beyond_one_retry_period() {
        let host = MemoryHost::new(CasSemantics::Envoy);
        let store = Store::new();
        let outage = Outage::new(5);
        let t0 = Instant::EPOCH + 1_000_000 * S;
        outage.open(&store, &host, t0);
        // An hour back: the stored deadline is an hour and 5 s away, which no retry
        // period explains: it is due.
        assert_eq!(outage.gate(&store, &host, t0 - 3_600 * S), Gate::Probe);
        // Less than one retry period back: still open, at most one period more.
        outage.open(&store, &host, t0);
        assert_eq!(outage.gate(&store, &host, t0 - S / 2), Gate::Local);
    }
}
