//! The filter's logger: `log` records go to the host's log (`proxy_log`) with exactly one
//! `diana:` per line (`diana_core::logline` says when the host's own prefix already has
//! it). Replaces the proxy-wasm SDK's logger, which passes messages through unchanged, and
//! its panic hook (a panic is logged at critical level, as the SDK does).

use diana_core::logline;
use proxy_wasm::hostcalls;
use proxy_wasm::types::LogLevel;
use std::sync::atomic::{AtomicU8, Ordering};

/// Not known yet: decided on the first line written (in the root context's
/// `on_configure`, where the properties are readable on both hosts).
const UNKNOWN: u8 = 0;
const HOST_SAYS_DIANA: u8 = 1;
const WE_SAY_DIANA: u8 = 2;

static PREFIX: AtomicU8 = AtomicU8::new(UNKNOWN);

struct Logger;

static LOGGER: Logger = Logger;

/// Installs the logger (once per VM) and sets the level.
pub fn init(level: log::LevelFilter) {
    if log::set_logger(&LOGGER).is_ok() {
        std::panic::set_hook(Box::new(|info| {
            write(LogLevel::Critical, &info.to_string());
        }));
    }
    log::set_max_level(level);
}

/// Whether the host's prefix already ends in `diana:` (remembered once the properties
/// could be read). Only `plugin_root_id` is read on nginx: ngx_wasm_module answers it
/// safely (`"0"`), where other plugin properties can crash its worker.
fn host_says_diana() -> bool {
    match PREFIX.load(Ordering::Relaxed) {
        HOST_SAYS_DIANA => return true,
        WE_SAY_DIANA => return false,
        _ => {}
    }
    let Ok(root_id) = hostcalls::get_property(vec!["plugin_root_id"]) else {
        return false;
    };
    let says = if logline::is_nginx_root_id(root_id.as_deref()) {
        false
    } else {
        let Ok(vm_id) = hostcalls::get_property(vec!["plugin_vm_id"]) else {
            return false;
        };
        logline::host_says_diana(root_id.as_deref(), vm_id.as_deref())
    };
    let decided = if says { HOST_SAYS_DIANA } else { WE_SAY_DIANA };
    PREFIX.store(decided, Ordering::Relaxed);
    says
}

fn write(level: LogLevel, message: &str) {
    let line = logline::line(message, host_says_diana());
    // Nothing useful can be done when the host refuses a log line.
    let _ = hostcalls::log(level, &line);
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Trace => LogLevel::Trace,
            log::Level::Debug => LogLevel::Debug,
            log::Level::Info => LogLevel::Info,
            log::Level::Warn => LogLevel::Warn,
            log::Level::Error => LogLevel::Error,
        };
        write(level, &record.args().to_string());
    }

    fn flush(&self) {}
}
