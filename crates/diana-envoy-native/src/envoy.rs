//! What the binding asks of Envoy: its dynamic-module handles as traits (in the style of
//! Envoy's Rust SDK, whose `EnvoyHttpFilter` and schedulers are traits with a mock), and
//! the plain values that cross the boundary. `filter`, `host` and `timer` see Envoy only
//! through here; `ffi` implements the traits over the ABI, and the tests' fake Envoy
//! (`fake.rs`) over threads that keep Envoy 1.40's rules.
//!
//! - [`EnvoyFilter`]: one stream's filter, lent to a hook of that stream for the hook's
//!   duration, on the stream's worker thread (the borrow keeps it from being stored).
//! - [`EnvoyConfig`]: the filter configuration, shared by every thread for as long as the
//!   configuration lives. Its metrics may be written from any thread; its callouts and its
//!   scheduler are the main thread's (Envoy keeps the callouts in an unsynchronised table
//!   of the configuration and looks their cluster up in the calling thread's cluster
//!   manager), and [`EnvoyConfig::concurrency`] answers only there.
//! - [`StreamScheduler`], [`ConfigScheduler`]: commit an event from any thread to a
//!   stream's worker thread (`on_http_filter_scheduled`) or to the main thread
//!   (`on_http_filter_config_scheduled`); an event for a stream or configuration gone by
//!   then is dropped. Owned: dropping one deletes it, so it is deleted once and never
//!   committed to after.
//!
//! ```text
//!   ffi (the ABI) ──implements──▶ envoy ◀──implements── fake (tests)
//!      │ hooks                      ▲                     │ hooks
//!      └──────────▶ filter ─────────┤ host, timer ────────┘
//! ```

use diana_core::call::{Answer, AnswerShape, Callout};
use diana_core::worker::MetricKind;
use std::fmt;

/// Envoy's id of a callout: unique per owner (one stream's filter, or the configuration),
/// and handed back with its answer.
pub type CalloutId = u64;

/// What the request-headers hook answers Envoy. (The response's hooks always answer
/// `Continue`: its headers, body chunks and trailers are read as they pass, never stopped
/// or buffered.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadersStatus {
    Continue,
    /// `StopIteration`: the headers wait, and the request's body still comes to the filter's
    /// body hooks (which buffer it, [`BodyStatus::StopIterationAndBuffer`]) — a request the
    /// worker holds for its body (`reserve.json`).
    StopIteration,
    /// `StopAllIterationAndWatermark`: what proxy-wasm's `Pause` is in Envoy (the body is
    /// held, within the connection's buffer limits, and reaches no body hook of the filter
    /// until it continues decoding).
    StopAllAndWatermark,
}

/// What the request-body hook answers Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyStatus {
    /// The chunk goes on; after a [`HeadersStatus::StopIteration`], the request goes on with
    /// it (its headers, the body Envoy buffered, this chunk).
    Continue,
    /// `StopIterationAndBuffer`: Envoy keeps the chunk with those before it (up to the
    /// buffer limit, past which it answers 413 itself) until the filter continues decoding.
    StopIterationAndBuffer,
}

/// What the request-trailers hook answers Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrailersStatus {
    /// The trailers go on (and with them a request stopped at its headers or body).
    Continue,
    /// `StopIteration`: they wait, with the rest of the request, until the filter continues
    /// decoding.
    StopIteration,
}

/// Why Envoy did not start a callout (`envoy_dynamic_module_type_http_callout_init_result`
/// other than `Success`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalloutRefused {
    MissingRequiredHeaders,
    ClusterNotFound,
    DuplicateCalloutId,
    CannotCreateRequest,
    /// A value this module does not know.
    Unknown,
}

impl fmt::Display for CalloutRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CalloutRefused::MissingRequiredHeaders => "MissingRequiredHeaders",
            CalloutRefused::ClusterNotFound => "ClusterNotFound",
            CalloutRefused::DuplicateCalloutId => "DuplicateCalloutId",
            CalloutRefused::CannotCreateRequest => "CannotCreateRequest",
            CalloutRefused::Unknown => "Unknown",
        })
    }
}

/// One stream's filter in Envoy, as a hook of that stream is lent it (on the stream's
/// worker thread, for the hook's duration).
pub trait EnvoyFilter {
    /// A request header's first value, copied.
    fn request_header(&self, name: &str) -> Option<Vec<u8>>;
    /// A response header's first value, copied (during the response-headers hook).
    fn response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// A response header's first value lent to `read` where Envoy holds it, uncopied
    /// (during the response-headers hook; `read` makes no call to Envoy).
    fn read_response_header(&self, name: &str, read: &mut dyn FnMut(Option<&[u8]>)) {
        read(self.response_header(name).as_deref());
    }
    /// The response's status as Envoy records it for the stream (`response.code`: what
    /// the upstream answered, or Envoy's own answer once it set it), during the
    /// response-headers hook; `None` while Envoy has set none.
    fn response_code(&self) -> Option<u16> {
        None
    }
    /// Adds a response header (during the response-headers hook); `false`: not added.
    fn add_response_header(&self, name: &str, value: &str) -> bool;
    /// Sets a request header to `value`, replacing every value it had; `None` removes it
    /// (before the request goes on: during its headers hook, or while it is stopped).
    fn set_request_header(&self, name: &str, value: Option<&str>) -> bool;
    /// Has Envoy choose the request's route again, from its headers as they are now. Envoy
    /// picked a route when the request arrived and keeps it while a dynamic module edits
    /// the headers (the wasm host clears it on every edit): a route matching a header
    /// Diana set or removed would otherwise follow the client's own value.
    fn clear_route_cache(&self);
    /// `source.address` (`ip:port` for an IP peer).
    fn source_address(&self) -> Option<Vec<u8>>;
    /// Answers the request with a local reply. Envoy may end the stream before this
    /// returns, and so run the stream's destroy hook inside it.
    fn send_response(&self, status: u16, headers: &[(&str, &str)], body: &[u8]);
    /// Starts a one-shot callout; its answer comes to this stream's callout hook with the
    /// returned id, on its thread, unless the stream goes first (then it is cancelled and
    /// never answered).
    fn callout(&self, callout: &Callout) -> Result<CalloutId, CalloutRefused>;
    /// Resumes a request its headers hook stopped (a no-op otherwise).
    fn continue_decoding(&self);
    /// A scheduler posting to this stream's thread (`None`: Envoy gave none).
    fn new_scheduler(&self) -> Option<Box<dyn StreamScheduler>>;
    /// Lends `read` the request's body chunk that the request-body hook is forwarding
    /// (Envoy's "received" request body: this hook's chunk, not what Envoy buffered of the
    /// chunks before it), as Envoy holds it: its slices, in order, borrowed for `read`'s call
    /// only (none when Envoy has no chunk). Only during the request-body hook; `read` runs
    /// exactly once. Reads, never changes: the hook's status says whether Envoy buffers it.
    fn read_request_body(&self, read: &mut dyn FnMut(&[&[u8]]));
    /// Lends `read` the answer's body chunk that the response-body hook is forwarding
    /// (Envoy's "received" response body: this hook's chunk, not what is buffered), as
    /// Envoy holds it: its slices, in order, borrowed for `read`'s call only (none when Envoy
    /// has no chunk). Only during the response-body hook; `read` runs exactly once. Reads,
    /// never changes: nothing is buffered or held, and the chunk goes on as it came.
    fn read_response_body(&self, read: &mut dyn FnMut(&[&[u8]]));
}

/// The filter configuration in Envoy, shared by every thread while it lives.
pub trait EnvoyConfig: Send + Sync {
    /// Envoy's worker threads (`--concurrency`). Main thread only.
    fn concurrency(&self) -> u32;
    /// Defines a counter or a gauge: only while the configuration is being made (Envoy
    /// freezes metric creation after). Envoy's id of it.
    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<usize>;
    /// Any thread; `false`: not counted.
    fn add_to_counter(&self, metric: usize, count: u64) -> bool;
    /// Any thread; `false`: not set.
    fn set_gauge(&self, metric: usize, value: u64) -> bool;
    /// Starts a one-shot callout bound to no stream; its answer comes to the
    /// configuration's callout hook on the main thread with the returned id, unless the
    /// configuration goes first (then it is cancelled and never answered). Main thread
    /// only.
    fn callout(&self, callout: &Callout) -> Result<CalloutId, CalloutRefused>;
    /// A scheduler posting to the main thread (`None`: Envoy gave none). Main thread only.
    fn new_scheduler(&self) -> Option<Box<dyn ConfigScheduler>>;
}

/// Posts events to one stream's worker thread, from any thread; dropping it deletes it.
pub trait StreamScheduler: Send + Sync {
    /// `on_http_filter_scheduled(event)` runs on the stream's thread, if the stream is
    /// still there by then.
    fn commit(&self, event: u64);
}

/// Posts events to the main thread, from any thread; dropping it deletes it.
pub trait ConfigScheduler: Send + Sync {
    /// `on_http_filter_config_scheduled(event)` runs on the main thread, if the
    /// configuration is still there by then.
    fn commit(&self, event: u64);
}

/// A call's answer as a callout hook hands it over: Envoy's buffers, borrowed for the hook.
pub struct RawAnswer<'hook> {
    /// Headers came (the callout succeeded).
    pub answered: bool,
    pub headers: Vec<(&'hook [u8], &'hook [u8])>,
    pub body: Vec<&'hook [u8]>,
}

impl RawAnswer<'_> {
    fn body_size(&self) -> usize {
        self.body.iter().map(|chunk| chunk.len()).sum()
    }

    /// The worker's [`Answer`]: what `shape` names of it, copied out of Envoy's buffers.
    pub fn read(&self, shape: AnswerShape) -> Answer {
        if !self.answered {
            return Answer::NoAnswer;
        }
        let headers = self
            .headers
            .iter()
            .filter(|(name, _)| {
                shape
                    .headers
                    .iter()
                    .any(|wanted| name.eq_ignore_ascii_case(wanted.as_bytes()))
            })
            .map(|(name, value)| (String::from_utf8_lossy(name).into_owned(), value.to_vec()));
        let body = Answer::read_body(shape, self.body_size(), || Ok(self.body.concat()));
        Answer::from_host(headers, body)
    }
}

#[cfg(test)]
mod tests {
    use super::RawAnswer;
    use diana_core::call::{Answer, AnswerShape, BodyError};

    #[test]
    fn an_answer_is_read_within_its_shape() {
        let cases: [(RawAnswer<'_>, AnswerShape, Answer); 4] = [
            (
                RawAnswer {
                    answered: false,
                    headers: vec![(b":status", b"200")],
                    body: vec![b"{}"],
                },
                AnswerShape::SERVICE,
                Answer::NoAnswer,
            ),
            (
                RawAnswer {
                    answered: true,
                    headers: vec![(b":status", b"429"), (b"etag", b"x")],
                    body: vec![b"{\"a\"", b":1}"],
                },
                AnswerShape::SERVICE,
                Answer::with(429, b"{\"a\":1}".to_vec()),
            ),
            (
                RawAnswer {
                    answered: true,
                    headers: vec![(b":status", b"200")],
                    body: vec![b"ignored"],
                },
                AnswerShape::STATUS,
                Answer::from_host(
                    [(":status".to_string(), b"200".to_vec())],
                    Err(BodyError::TooLarge(7)),
                ),
            ),
            (
                RawAnswer {
                    answered: true,
                    headers: Vec::new(),
                    body: Vec::new(),
                },
                AnswerShape::SERVICE,
                Answer::with(0, Vec::new()),
            ),
        ];
        for (raw, shape, wanted) in cases {
            assert_eq!(raw.read(shape), wanted);
        }
    }
}
