//! Diana's proxy-wasm filter: the thin host glue. It moves data between
//! `proxy_wasm::hostcalls` and the host-agnostic logic in `diana_core`.
