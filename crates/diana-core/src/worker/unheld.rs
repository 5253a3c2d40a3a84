//! A host that does not hold paused requests ([`HostProfile::pausing_needs`]): nginx
//! without `proxy_wasm_request_headers_in_access on;`. ngx_wasm_module then runs the
//! request headers step in nginx's rewrite phase, where a pause is not kept: a later
//! request of a keep-alive connection goes upstream while Diana waits for its call, ends,
//! and its worker crashes when the call answers (it reads the answer into the freed
//! request). Nothing the filter can read before pausing tells the two phases apart, so the
//! first such request costs a worker; what the worker can do is see it (the request's
//! context is deleted while its own call is in flight, which with the directive does not
//! happen) and tell every worker, through shared data, not to pause for calls for
//! [`UNHELD_FOR`]: their global rules are decided locally meanwhile, as when the host
//! refuses a call, and each logs the directive to add.
//!
//! [`HostProfile::pausing_needs`]: super::HostProfile::pausing_needs

use crate::store::{decode_instant, encode_instant, recordable, SharedData, Store};
use crate::time::{Instant, Nanos};

/// The shared-data key: when a worker last saw the host run a paused request on.
pub const UNHELD_KEY: &str = "diana/host/unheld";

/// How long every worker stays from pausing after that. An nginx reload keeps the
/// `shm_kv` zone, so this record outlives the fix: short enough that adding the directive
/// brings exact global rules back soon, long enough that a gateway without it loses at
/// most one worker per period.
pub const UNHELD_FOR: Nanos = Nanos::from_secs(10 * 60);

/// Tells every worker that the host ran a paused request on at `now`.
pub(super) fn record(store: &Store, host: &dyn SharedData, now: Instant) {
    let written = store.update(host, UNHELD_KEY, |_| {
        (Some(encode_instant(recordable(now))), ())
    });
    if let Err(error) = written {
        log::warn!("diana: cannot tell the other workers not to pause: {error}");
    }
}

/// Until when requests must not pause for calls (`None`: they may). A record further
/// ahead than `now` cannot come from this clock running forward (it stepped back): it
/// counts from `now`, so a step keeps workers local for at most one period more.
pub(super) fn unheld_until(store: &Store, host: &dyn SharedData, now: Instant) -> Option<Instant> {
    let seen = match store.read(host, UNHELD_KEY) {
        Ok(record) => decode_instant(record.as_deref()),
        Err(error) => {
            log::debug!("diana: {UNHELD_KEY} unreadable: {error}");
            Instant::EPOCH
        }
    };
    if seen == Instant::EPOCH {
        return None;
    }
    let until = seen.min(now).saturating_add(UNHELD_FOR);
    (now < until).then_some(until)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{CasSemantics, MemoryHost};
    use crate::time::NANOS_PER_SECOND;

    #[test]
    fn a_record_keeps_workers_from_pausing_for_one_period() {
        let host = MemoryHost::new(CasSemantics::Nginx);
        let store = Store::strict();
        let t0 = Instant::EPOCH + 1_000 * NANOS_PER_SECOND;
        assert_eq!(unheld_until(&store, &host, t0), None);
        record(&store, &host, t0);
        assert_eq!(unheld_until(&store, &host, t0), Some(t0 + UNHELD_FOR));
        assert_eq!(
            unheld_until(&store, &host, t0 + UNHELD_FOR - Nanos::new(1)),
            Some(t0 + UNHELD_FOR)
        );
        assert_eq!(unheld_until(&store, &host, t0 + UNHELD_FOR), None);
        // Seen again later: another period from then.
        record(&store, &host, t0 + UNHELD_FOR * 2);
        let until = unheld_until(&store, &host, t0 + UNHELD_FOR * 2);
        assert_eq!(until, Some(t0 + UNHELD_FOR * 3));
    }

    #[test]
    fn a_clock_stepped_back_keeps_workers_local_one_period_at_most() {
        let host = MemoryHost::new(CasSemantics::Nginx);
        let store = Store::strict();
        let t0 = Instant::EPOCH + 1_000_000 * NANOS_PER_SECOND;
        record(&store, &host, t0);
        let earlier = t0 - 3600 * NANOS_PER_SECOND;
        assert_eq!(
            unheld_until(&store, &host, earlier),
            Some(earlier + UNHELD_FOR)
        );
    }
}
