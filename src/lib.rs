//! Diana's proxy-wasm filter: the thin host glue. It only moves data between
//! `proxy_wasm::hostcalls` and the host-agnostic logic in `diana_core`; every decision is
//! made there and tested natively. Every hostcall result is handled: a panic would kill the
//! worker's VM and fail every later request.
//!
//! - `host`: the host's shared data, request facts, metrics and clock behind the core's traits.
//! - `filter`: the root context (configuration, ticks resuming waiting requests) and the
//!   HTTP context (evaluate on request headers; pause, resume, reject; callout answers).
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
