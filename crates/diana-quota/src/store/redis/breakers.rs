//! The fleet's breakers in Redis and Redis Cluster: the machine runs here, in Rust (the
//! same [`crate::store::breakers::apply`] the memory store runs, so there is no second
//! implementation to keep equal); Redis keeps each state in one key and makes every update
//! atomic by an optimistic swap (`lua/breaker.lua`):
//!
//! ```text
//!   read   GET key + TIME          (one script call: the state and Redis's instant)
//!   run    the machine on a copy   (Rust; nothing to write when nothing changed)
//!   swap   SET key new PX ttl      only if the key still holds what was read
//!          written ─▶ answer        changed by another replica ─▶ read again
//!                                   (at most MAX_ATTEMPTS times, then 503)
//! ```
//!
//! Why not `WATCH`/`MULTI`: a watch belongs to a connection, and the service multiplexes
//! one connection (one per cluster node) among every request in flight, so a watch would
//! be cancelled or crossed by other requests' commands; a compare-and-swap script needs no
//! connection of its own and routes by its one key on a cluster. Why not a Lua port of the
//! machine: the gateways, the memory store and Redis then run one implementation.
//!
//! Contention: reports on one state are serialised within a replica (a striped lock, so a
//! swap only loses to another replica's write), and each lost swap means another replica's
//! write landed: with `r` replicas a report waits behind at most `r − 1` writes per round
//! of retries. The whole exchange stays within the request's deadline (503 at worst; the
//! gateway sends its calls again with its next report).
//!
//! Keys: `diana:{breaker:<key>}:B:<slow ppm>:<failure ppm>:<min_calls>:<window s>:<open
//! ms>:<half_open_calls>:<probe timeout ms>`, bound to the parameters like a counter's, in
//! the slot of the breaker's key, with a time to live of [`idle_after`] refreshed on every
//! write.

use super::RedisStore;
use crate::store::breakers::{
    apply, decode, encode, idle_after, BreakerCall, Decided, FleetBreakers,
};
use crate::store::StoreError;
use async_trait::async_trait;
use diana_core::hash::hash64;
use diana_core::report::FleetParams;
use diana_core::time::Instant;
use redis::Script;
use std::sync::LazyLock;

/// Reads and swaps of breaker states.
static SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/breaker.lua")));

/// Swaps tried on one state before the report is answered 503.
pub const MAX_ATTEMPTS: usize = 16;

/// Locks that serialise the reports of one replica on one state (a state's key picks one;
/// two states may share one, which only orders them).
pub(super) struct Stripes(Box<[tokio::sync::Mutex<()>]>);

const STRIPES: u64 = 64;
const STRIPE_SEED: u64 = 0x6272_6b5f_7374_7270;

impl Stripes {
    pub(super) fn new() -> Stripes {
        Stripes((0..STRIPES).map(|_| tokio::sync::Mutex::new(())).collect())
    }

    fn of(&self, key: &str) -> Option<&tokio::sync::Mutex<()>> {
        let at = usize::try_from(hash64(STRIPE_SEED, key.as_bytes()) % STRIPES).ok()?;
        self.0.get(at)
    }
}

/// The Redis key of a breaker's state under `params`.
pub fn breaker_key(key: &str, params: &FleetParams) -> String {
    format!(
        "diana:{{breaker:{key}}}:B:{}:{}:{}:{}:{}:{}:{}",
        params.slow_ratio_ppm,
        params.failure_ratio_ppm,
        params.min_calls,
        params.window_seconds,
        params.open_ms,
        params.half_open_calls,
        params.probe_timeout_ms
    )
}

/// Redis `TIME` as an instant.
fn instant(seconds: u64, micros: u64) -> Instant {
    Instant::from_unix_nanos(
        seconds
            .saturating_mul(1_000_000_000)
            .saturating_add(micros.saturating_mul(1_000)),
    )
}

impl RedisStore {
    /// [`FleetBreakers::report`] on the machine's clock `now` instead of Redis `TIME` when
    /// given (tests on a fake clock). The breakers are decided concurrently, each on its
    /// own key.
    pub async fn report_at(
        &self,
        calls: &[BreakerCall],
        now: Option<Instant>,
    ) -> Result<Vec<Decided>, StoreError> {
        let answers =
            futures_util::future::join_all(calls.iter().map(|call| self.decide(call, now))).await;
        answers.into_iter().collect()
    }

    async fn decide(
        &self,
        call: &BreakerCall,
        now: Option<Instant>,
    ) -> Result<Decided, StoreError> {
        let key = breaker_key(&call.key, &call.params);
        let tag = format!("breaker:{}", call.key);
        let ttl_ms = idle_after(&call.params).whole_millis();
        let out_of_range =
            || StoreError::Unsupported(format!("breaker {}: parameters out of range", call.key));
        let _serial = match self.breaker_locks.of(&key) {
            Some(lock) => Some(lock.lock().await),
            None => None,
        };
        for _ in 0..MAX_ATTEMPTS {
            let mut read = SCRIPT.prepare_invoke();
            read.key(&key).arg("read");
            let (held, present, seconds, micros): (Vec<u8>, u8, u64, u64) = self
                .query(Some(&tag), |mut conn| async move {
                    read.invoke_async(&mut conn).await
                })
                .await?;
            let now = now.unwrap_or_else(|| instant(seconds, micros));
            let stored = (present == 1).then_some(held.as_slice());
            let mut state = decode(stored, &call.params).ok_or_else(out_of_range)?;
            let before = state.clone();
            let decided = apply(&mut state, call, now).ok_or_else(out_of_range)?;
            if state == before {
                return Ok(decided);
            }
            let mut swap = SCRIPT.prepare_invoke();
            swap.key(&key)
                .arg("swap")
                .arg(present)
                .arg(held.as_slice())
                .arg(encode(&state))
                .arg(ttl_ms);
            let written: u8 = self
                .query(Some(&tag), |mut conn| async move {
                    swap.invoke_async(&mut conn).await
                })
                .await?;
            if written == 1 {
                return Ok(decided);
            }
        }
        Err(StoreError::Unavailable(format!(
            "breaker {}: its state changed under {MAX_ATTEMPTS} swaps in a row",
            call.key
        )))
    }
}

#[async_trait]
impl FleetBreakers for RedisStore {
    async fn report(&self, calls: &[BreakerCall]) -> Result<Vec<Decided>, StoreError> {
        self.report_at(calls, None).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_bound_to_the_parameters_in_the_breakers_slot() {
        let params = FleetParams {
            slow_ratio_ppm: 500_000,
            failure_ratio_ppm: 0,
            min_calls: 20,
            window_seconds: 10,
            open_ms: 30_000,
            half_open_calls: 3,
            probe_timeout_ms: 2_000,
        };
        let key = breaker_key("0123abcd", &params);
        assert_eq!(
            key,
            "diana:{breaker:0123abcd}:B:500000:0:20:10:30000:3:2000"
        );
        let other = breaker_key(
            "0123abcd",
            &FleetParams {
                min_calls: 21,
                ..params
            },
        );
        assert_ne!(key, other);
        assert_eq!(
            super::super::cluster_slot("breaker:0123abcd"),
            crc16::State::<crc16::XMODEM>::calculate(b"breaker:0123abcd") % 16_384
        );
        assert_eq!(instant(2, 5), Instant::from_unix_nanos(2_000_005_000));
    }
}
