//! The proxy-wasm contexts: each callback becomes one event of the VM's
//! [`Worker`], and its [`Command`]s become host calls. The worker is borrowed only while
//! it handles the event, never while a command is carried out: a local reply re-enters the
//! filter at once on Envoy.

use crate::host::{self, ProxyWasm};
use diana_core::worker::{Command, ContextId, HostProfile, LocalReply, Step, Worker};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, MapType};
use std::cell::RefCell;
use std::rc::Rc;

type Shared = Rc<RefCell<Worker>>;

/// Runs one event on the worker (it is never borrowed already, by construction; if it
/// were, skipping the event is the defined behaviour, never a panic).
fn handle(worker: &Shared, event: impl FnOnce(&mut Worker) -> Step) -> Step {
    match worker.try_borrow_mut() {
        Ok(mut worker) => event(&mut worker),
        Err(_) => {
            log::error!("diana: worker busy; event skipped");
            Step::default()
        }
    }
}

/// Carries out `commands` from the context `current`, entering another request's context
/// where a command is for it, and making `current` the effective context again after.
fn carry_out(current: ContextId, commands: Vec<Command>) {
    let mut effective = current;
    let mut enter = |context: ContextId| {
        if effective == context {
            return true;
        }
        match hostcalls::set_effective_context(context) {
            Ok(()) => {
                effective = context;
                true
            }
            Err(status) => {
                log::debug!("diana: request {context} is gone: {status:?}");
                false
            }
        }
    };
    for command in commands {
        match command {
            Command::Resume(context) if enter(context) => {
                if let Err(status) = hostcalls::resume_http_request() {
                    log::debug!("diana: cannot resume request {context}: {status:?}");
                }
            }
            Command::Reply(context, reply) if enter(context) => send(&reply),
            Command::EditRequest(context, edits) if enter(context) => {
                for edit in edits {
                    if let Err(status) = hostcalls::set_map_value(
                        MapType::HttpRequestHeaders,
                        &edit.name,
                        edit.value.as_deref(),
                    ) {
                        log::debug!("diana: cannot set request header {}: {status:?}", edit.name);
                    }
                }
            }
            Command::Resume(_) | Command::Reply(..) | Command::EditRequest(..) => {}
            Command::AddHeaders(headers) if enter(current) => {
                for (name, value) in headers {
                    if let Err(status) =
                        hostcalls::add_map_value(MapType::HttpResponseHeaders, name, &value)
                    {
                        log::debug!("diana: cannot add {name}: {status:?}");
                    }
                }
            }
            Command::SetTick(period) if enter(current) => {
                if let Err(status) = hostcalls::set_tick_period(period) {
                    log::warn!("diana: cannot set tick period: {status:?}");
                }
            }
            // Not asked of proxy-wasm hosts (`HostProfile::ticks_on_demand`): the tick runs
            // on its period.
            Command::AddHeaders(_) | Command::SetTick(_) | Command::TickNow => {}
        }
    }
    enter(current);
}

fn send(reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    let body = Some(reply.body.as_bytes());
    if let Err(status) = hostcalls::send_http_response(u32::from(reply.status), headers, body) {
        log::warn!("diana: cannot send the local reply: {status:?}");
    }
}

pub struct DianaRoot {
    context_id: ContextId,
    worker: Shared,
    /// `on_vm_start` came first: the host started this instance with its worker process.
    /// ngx_wasm_module runs `on_configure` alone in the instance it makes after one
    /// trapped (see `Worker::probe_shared_data_first`).
    vm_started: bool,
}

impl DianaRoot {
    pub fn new(context_id: ContextId) -> DianaRoot {
        DianaRoot {
            context_id,
            // The host is known from `on_configure` on (see `host::profile`).
            worker: Rc::new(RefCell::new(Worker::new(HostProfile::ENVOY))),
            vm_started: false,
        }
    }
}

impl Context for DianaRoot {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body: usize, _: usize) {
        let step = handle(&self.worker, |w| {
            let answer = host::call_answer(w.answer_shape(token), headers, body);
            w.on_call_answered(&ProxyWasm, token, answer)
        });
        carry_out(self.context_id, step.commands);
    }
}

impl RootContext for DianaRoot {
    fn on_vm_start(&mut self, _: usize) -> bool {
        self.vm_started = true;
        true
    }

    fn on_configure(&mut self, size: usize) -> bool {
        let document = match host::configuration(size) {
            Ok(document) => document,
            Err(status) => {
                log::error!("diana: cannot read the plugin configuration: {status:?}");
                return false;
            }
        };
        let profile = host::profile();
        let configured = match self.worker.try_borrow_mut() {
            Ok(mut worker) => {
                if worker.engine().is_none() && worker.profile() != profile {
                    *worker = Worker::new(profile);
                }
                // nginx: no shared data here, where a trap would stop the worker.
                worker.probe_shared_data_first(&ProxyWasm, self.vm_started);
                worker.configure(&ProxyWasm, &document)
            }
            Err(_) => return false,
        };
        match configured {
            Ok(step) => {
                carry_out(self.context_id, step.commands);
                true
            }
            Err(_) => false,
        }
    }

    fn on_tick(&mut self) {
        let step = handle(&self.worker, |w| w.on_tick(&ProxyWasm));
        carry_out(self.context_id, step.commands);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(DianaHttp {
            context_id,
            worker: Rc::clone(&self.worker),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct DianaHttp {
    context_id: ContextId,
    worker: Shared,
}

impl Context for DianaHttp {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body: usize, _: usize) {
        let step = handle(&self.worker, |w| {
            let answer = host::call_answer(w.answer_shape(token), headers, body);
            w.on_call_answered(&ProxyWasm, token, answer)
        });
        carry_out(self.context_id, step.commands);
    }
}

/// `proxy_on_delete` drops the context: the one end-of-request callback the trimmed module
/// keeps (see `crates/diana-trim`), whether the request ended or its client went away.
impl Drop for DianaHttp {
    fn drop(&mut self) {
        let context = self.context_id;
        // A request that held places at the quota service sets a short tick, which gives
        // them back (only the tick period: the context itself is going).
        let step = handle(&self.worker, |w| w.on_context_gone(&ProxyWasm, context));
        carry_out(context, step.commands);
    }
}

impl HttpContext for DianaHttp {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        let context = self.context_id;
        // Never `on_request_headers_with_body`: a paused request gets no body callback
        // on proxy-wasm until it resumes (`HostProfile::holds_requests_for_bodies`).
        let step = handle(&self.worker, |w| w.on_request_headers(&ProxyWasm, context));
        carry_out(context, step.commands);
        if step.pause {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_response_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        let context = self.context_id;
        let step = handle(&self.worker, |w| w.on_response_headers(&ProxyWasm, context));
        carry_out(context, step.commands);
        if end_of_stream {
            // No body follows: the rules that read one settle on an empty body now.
            self.body_chunk(0, true);
        }
        Action::Continue
    }

    /// Kept only in the module for documents that read answers (`diana-envoy-bodies.wasm`,
    /// see `crates/diana-trim`), and in nginx's untrimmed one. The chunk is read (a host
    /// call and a copy) only for a request whose rules read it; it always goes on as it
    /// came.
    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        self.body_chunk(size, end_of_stream);
        Action::Continue
    }

    /// Trailers end the answer's body (a stream with trailers never sends an
    /// end-of-stream body chunk).
    fn on_http_response_trailers(&mut self, _: usize) -> Action {
        self.body_chunk(0, true);
        Action::Continue
    }
}

impl DianaHttp {
    fn body_chunk(&self, size: usize, end: bool) {
        let context = self.context_id;
        let reads = match self.worker.try_borrow() {
            Ok(worker) => worker.reads_response_body(context),
            Err(_) => false,
        };
        if !reads {
            return;
        }
        let chunk = host::response_body(size);
        let step = handle(&self.worker, |w| {
            w.on_response_body(&ProxyWasm, context, &chunk, end)
        });
        carry_out(context, step.commands);
    }
}
