//! The worker's tick. Envoy gives an HTTP filter no timer, only a scheduler per stream that
//! posts an event to the stream's worker thread from any thread. One module thread keeps,
//! for each Envoy worker thread that needs a tick, the scheduler of one of its paused
//! requests and when to fire; at that time it commits a tick event to it, which runs the
//! worker's tick on its own thread. A worker thread with no paused request needs no timer:
//! its tick work (refills, releases, debts, polls, sweeps) runs, when due, at the start of
//! its next request (`filter::request_headers`), and its counts are flushed to Envoy's
//! stats when its last request ends.

use crate::ffi::Scheduler;
use hashbrown::HashMap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The scheduled event that runs the tick.
pub const TICK_EVENT: u64 = 1;

/// The longest the timer thread sleeps without looking again.
const IDLE_WAIT: Duration = Duration::from_secs(1);

struct Timer {
    /// Per worker thread: the scheduler to fire and when.
    arms: Mutex<HashMap<u64, (Scheduler, Instant)>>,
    wake: Condvar,
}

static TIMER: OnceLock<Option<&'static Timer>> = OnceLock::new();

fn timer() -> Option<&'static Timer> {
    *TIMER.get_or_init(|| {
        let timer: &'static Timer = Box::leak(Box::new(Timer {
            arms: Mutex::new(HashMap::new()),
            wake: Condvar::new(),
        }));
        match std::thread::Builder::new()
            .name("diana-timer".to_string())
            .spawn(move || run(timer))
        {
            Ok(_) => Some(timer),
            Err(error) => {
                log::error!(
                    "diana: cannot start the timer thread ({error}): ticks run only at requests"
                );
                None
            }
        }
    })
}

/// Fires `scheduler` with [`TICK_EVENT`] after `after` (replacing this thread's arm).
pub fn arm(thread: u64, scheduler: Scheduler, after: Duration) {
    let Some(timer) = timer() else {
        return;
    };
    let due = Instant::now() + after;
    if let Ok(mut arms) = timer.arms.lock() {
        arms.insert(thread, (scheduler, due));
        timer.wake.notify_one();
    }
}

/// Forgets this thread's arm. Called before its scheduler is deleted (under the lock the
/// timer commits under, so a deleted scheduler is never committed to).
pub fn disarm(thread: u64) {
    let Some(Some(timer)) = TIMER.get() else {
        return;
    };
    if let Ok(mut arms) = timer.arms.lock() {
        arms.remove(&thread);
    }
}

fn run(timer: &'static Timer) {
    let Ok(mut arms) = timer.arms.lock() else {
        return;
    };
    loop {
        let now = Instant::now();
        arms.retain(|_, (scheduler, due)| {
            if *due <= now {
                scheduler.commit(TICK_EVENT);
                false
            } else {
                true
            }
        });
        let wait = arms
            .values()
            .map(|(_, due)| due.saturating_duration_since(now))
            .min()
            .unwrap_or(IDLE_WAIT)
            .min(IDLE_WAIT);
        arms = match timer.wake.wait_timeout(arms, wait) {
            Ok((arms, _)) => arms,
            Err(_) => return,
        };
    }
}
