//! The filter's logger: `log` records go to the host's log (`proxy_log`) with exactly one
//! `diana:` per line (`diana_core::logline` says when the host's own prefix already has
//! it). Replaces the proxy-wasm SDK's logger, which passes messages through unchanged, and
//! its panic hook (a panic is logged at critical level, as the SDK does).

use diana_core::logline;
use proxy_wasm::hostcalls;
use proxy_wasm::types::LogLevel;
use std::sync::OnceLock;

/// Whether the host's prefix already ends in `diana:`, decided on the first line written
/// once the properties can be read (the root context's `on_configure`). Only
/// `plugin_root_id` is read on nginx, which answers it safely (`"0"`), where other plugin
/// properties can crash its worker.
static HOST_SAYS_DIANA: OnceLock<bool> = OnceLock::new();

struct Logger;

/// Installs the logger (once per VM) and sets the level.
pub fn init(level: log::LevelFilter) {
    if log::set_logger(&Logger).is_ok() {
        std::panic::set_hook(Box::new(|info| {
            write(LogLevel::Critical, &info.to_string())
        }));
    }
    log::set_max_level(level);
}

fn host_says_diana() -> bool {
    if let Some(&says) = HOST_SAYS_DIANA.get() {
        return says;
    }
    let Ok(root_id) = hostcalls::get_property(vec!["plugin_root_id"]) else {
        return false;
    };
    let says = !logline::is_nginx_root_id(root_id.as_deref()) && {
        let Ok(vm_id) = hostcalls::get_property(vec!["plugin_vm_id"]) else {
            return false;
        };
        logline::host_says_diana(root_id.as_deref(), vm_id.as_deref())
    };
    *HOST_SAYS_DIANA.get_or_init(|| says)
}

fn write(level: LogLevel, message: &str) {
    // Nothing useful can be done when the host refuses a log line.
    let _ = hostcalls::log(level, &logline::line(message, host_says_diana()));
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            let level = match record.level() {
                log::Level::Trace => LogLevel::Trace,
                log::Level::Debug => LogLevel::Debug,
                log::Level::Info => LogLevel::Info,
                log::Level::Warn => LogLevel::Warn,
                log::Level::Error => LogLevel::Error,
            };
            write(level, &record.args().to_string());
        }
    }

    fn flush(&self) {}
}
