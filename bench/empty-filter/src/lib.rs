//! A stock proxy-wasm SDK filter that does nothing: the cost of "a Rust wasm filter is
//! loaded and called for every request", with none of Diana's work. scripts/bench compares
//! Diana against it.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(EmptyRoot) });
}}

struct EmptyRoot;

impl Context for EmptyRoot {}

impl RootContext for EmptyRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(EmptyHttp))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct EmptyHttp;

impl Context for EmptyHttp {}

impl HttpContext for EmptyHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }
}
