//! `log` records to Envoy's log (`[dynamic_modules]` id), with one `diana:` per line
//! (`diana_core::logline`; Envoy's prefix here never names Diana). The writer is handed in
//! (`ffi`'s, over the ABI), so this module knows nothing of the ABI.

use diana_core::logline;
use std::sync::OnceLock;

/// Writes one line at a level (Envoy decides whether its level lets it through).
pub type Write = fn(log::Level, &str);

struct Logger {
    write: Write,
}

/// Installs the logger (once per process; Envoy's level decides what is written).
pub fn init(write: Write) {
    static LOGGER: OnceLock<Logger> = OnceLock::new();
    if log::set_logger(LOGGER.get_or_init(|| Logger { write })).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            (self.write)(
                record.level(),
                &logline::line(&record.args().to_string(), false),
            );
        }
    }

    fn flush(&self) {}
}
