//! Host-call cost probe. Plugin configuration: `<kind> <n>`, kind one of
//!   none        nothing (same as the empty filter)
//!   header      n × get_map_value_bytes(request headers, ":path")
//!   time        n × get_current_time
//!   shared_get  n × get_shared_data (one 16-byte key, created at configure time)
//!   shared_cas  n × (get_shared_data + set_shared_data with the CAS just read)
//!   metric      n × increment_metric (one counter)
//!   property    n × get_property(["source", "address"])
//! Every host result is handled; nothing here can panic.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::Cell;
use std::rc::Rc;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    None,
    Header,
    Time,
    SharedGet,
    SharedCas,
    Metric,
    Property,
}

const KEY: &str = "probe:key";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(ProbeRoot { plan: Rc::new(Cell::new((Kind::None, 0, 0))) })
    });
}}

struct ProbeRoot {
    /// (kind, n, metric id)
    plan: Rc<Cell<(Kind, u32, u32)>>,
}

impl Context for ProbeRoot {}

impl RootContext for ProbeRoot {
    fn on_configure(&mut self, size: usize) -> bool {
        let text = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size) {
            Ok(Some(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
            _ => String::new(),
        };
        let mut words = text.split_whitespace();
        let kind = match words.next().unwrap_or("none") {
            "header" => Kind::Header,
            "time" => Kind::Time,
            "shared_get" => Kind::SharedGet,
            "shared_cas" => Kind::SharedCas,
            "metric" => Kind::Metric,
            "property" => Kind::Property,
            _ => Kind::None,
        };
        let n = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
        let metric = hostcalls::define_metric(MetricType::Counter, "probe_calls").unwrap_or(0);
        let _ = hostcalls::set_shared_data(KEY, Some(&[7u8; 16]), None);
        self.plan.set((kind, n, metric));
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(ProbeHttp { plan: self.plan.get() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct ProbeHttp {
    plan: (Kind, u32, u32),
}

impl Context for ProbeHttp {}

impl HttpContext for ProbeHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let (kind, n, metric) = self.plan;
        let mut sink = 0usize;
        for _ in 0..n {
            match kind {
                Kind::None => {}
                Kind::Header => {
                    if let Ok(Some(v)) = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, ":path") {
                        sink = sink.wrapping_add(v.len());
                    }
                }
                Kind::Time => {
                    if let Ok(t) = hostcalls::get_current_time() {
                        let nanos = t.duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
                        sink = sink.wrapping_add(nanos as usize);
                    }
                }
                Kind::SharedGet => {
                    if let Ok((Some(v), _)) = hostcalls::get_shared_data(KEY) {
                        sink = sink.wrapping_add(v.len());
                    }
                }
                Kind::SharedCas => {
                    if let Ok((Some(mut v), cas)) = hostcalls::get_shared_data(KEY) {
                        if let Some(b) = v.first_mut() {
                            *b = b.wrapping_add(1);
                        }
                        let _ = hostcalls::set_shared_data(KEY, Some(&v), cas);
                    }
                }
                Kind::Metric => {
                    let _ = hostcalls::increment_metric(metric, 1);
                }
                Kind::Property => {
                    if let Ok(Some(v)) = hostcalls::get_property(vec!["source", "address"]) {
                        sink = sink.wrapping_add(v.len());
                    }
                }
            }
        }
        std::hint::black_box(sink);
        Action::Continue
    }
}
