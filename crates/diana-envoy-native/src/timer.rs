//! The workers' tick. Envoy gives an HTTP filter no timer, only schedulers that post an
//! event from any thread: a stream's to the stream's worker thread, the filter
//! configuration's to the main thread. One module thread (`diana-timer`) keeps, for each
//! configuration, its scheduler and when the earliest of its workers' ticks is due, and at
//! that time commits [`TICK_EVENT`] to it; the main thread then runs every worker tick that
//! is due (`filter::config_scheduled`) and arms the next. A due time only moves earlier
//! here ([`arm`]); firing clears it, and the main thread arms the next from the workers'.
//! A tick wanted at once does not come through here: the hook that wants it commits it
//! (`filter::Config::arm_tick`), outside this lock.
//!
//! ```text
//!   register ──▶ (armed: none) ──arm(after)──▶ (armed: due) ──due──▶ commit TICK_EVENT
//!                     ▲                │ arm(earlier): moves it          │
//!                     └────────────────┴─────────────────────────────────┘
//!   remove: forgotten, its scheduler handed back (from any state, under the lock)
//! ```

use crate::envoy::ConfigScheduler;
use hashbrown::HashMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The scheduled event that runs the workers' ticks.
pub const TICK_EVENT: u64 = 1;

/// The longest the timer thread sleeps without looking again.
const IDLE_WAIT: Duration = Duration::from_secs(1);

struct Arm {
    scheduler: Arc<dyn ConfigScheduler>,
    due: Option<Instant>,
}

struct Timer {
    /// Per configuration: its scheduler and when to fire.
    arms: Mutex<HashMap<u64, Arm>>,
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
                log::error!("diana: cannot start the timer thread ({error}): no tick runs");
                None
            }
        }
    })
}

/// Keeps `scheduler` for configuration `config` until [`remove`]. `false`: no timer thread.
pub fn register(config: u64, scheduler: Arc<dyn ConfigScheduler>) -> bool {
    let Some(timer) = timer() else {
        return false;
    };
    match timer.arms.lock() {
        Ok(mut arms) => {
            arms.insert(
                config,
                Arm {
                    scheduler,
                    due: None,
                },
            );
            true
        }
        Err(_) => false,
    }
}

/// Fires configuration `config`'s tick event within `after`, or earlier if already armed so.
/// (A tick wanted at once is committed by the hook that wants it: `filter::Config`.)
pub fn arm(config: u64, after: Duration) {
    let Some(Some(timer)) = TIMER.get() else {
        return;
    };
    let due = Instant::now() + after;
    if let Ok(mut arms) = timer.arms.lock() {
        if let Some(arm) = arms.get_mut(&config) {
            if arm.due.is_none_or(|armed| due < armed) {
                arm.due = Some(due);
                timer.wake.notify_one();
            }
        }
    }
}

/// Forgets configuration `config` and hands its scheduler back, under the lock the timer
/// commits under: once this returns, the timer thread no longer commits to it.
pub fn remove(config: u64) -> Option<Arc<dyn ConfigScheduler>> {
    let Some(Some(timer)) = TIMER.get() else {
        return None;
    };
    let mut arms = timer.arms.lock().ok()?;
    arms.remove(&config).map(|arm| arm.scheduler)
}

fn run(timer: &'static Timer) {
    let Ok(mut arms) = timer.arms.lock() else {
        return;
    };
    loop {
        let now = Instant::now();
        for arm in arms.values_mut() {
            if arm.due.is_some_and(|due| due <= now) {
                arm.due = None;
                arm.scheduler.commit(TICK_EVENT);
            }
        }
        let wait = arms
            .values()
            .filter_map(|arm| arm.due)
            .map(|due| due.saturating_duration_since(now))
            .min()
            .unwrap_or(IDLE_WAIT)
            .min(IDLE_WAIT);
        arms = match timer.wake.wait_timeout(arms, wait) {
            Ok((arms, _)) => arms,
            Err(_) => return,
        };
    }
}
