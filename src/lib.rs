//! Diana's proxy-wasm filter: the thin host glue. Each proxy-wasm callback becomes an event
//! of `diana_core::worker::Worker`, which makes every decision and is tested natively under
//! each host's rules; its commands become hostcalls. Every hostcall result is handled: a
//! panic would kill the worker's VM and fail every later request.
//!
//! - `host`: the worker's `Host` trait over `proxy_wasm::hostcalls`, and which host this is.
//! - `filter`: the root and HTTP contexts: callbacks to events, commands to hostcalls.
//! - `logger`: `log` records to the host's log, with one `diana:` per line on every host.

#[cfg(target_arch = "wasm32")]
mod filter;
#[cfg(target_arch = "wasm32")]
mod host;
#[cfg(target_arch = "wasm32")]
mod logger;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    logger::init(log::LevelFilter::Info);
    proxy_wasm::set_root_context(|context_id| Box::new(filter::DianaRoot::new(context_id)));
}}
