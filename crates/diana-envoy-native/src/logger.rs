//! `log` records to Envoy's log (`[dynamic_modules]` id), with one `diana:` per line
//! (`diana_core::logline`; Envoy's prefix here never names Diana).

use crate::ffi;
use diana_core::logline;

struct Logger;

static LOGGER: Logger = Logger;

/// Installs the logger (once per process; Envoy's level decides what is written).
pub fn init() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            ffi::log(
                record.level(),
                &logline::line(&record.args().to_string(), false),
            );
        }
    }

    fn flush(&self) {}
}
