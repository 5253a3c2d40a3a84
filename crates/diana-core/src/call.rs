//! A call the host makes on the filter's behalf (to the quota service or the config
//! center), and its answer as the host hands it back: both plain values, so that no
//! binding keeps an answer for the worker to pull back, and no binding fakes a count.
//!
//! What a call *means* — which request it resumes, what its answer settles — is not here:
//! the engine keeps that with the call (`engine::Then`), and the worker keeps the pair in
//! one table of calls in flight until the answer comes.

use crate::store::HostError;
use std::fmt;

/// The largest answer body a binding reads (a config-center document may be this large;
/// a quota service answer is held to [`MAX_SERVICE_ANSWER_BYTES`] when it is read).
pub const MAX_ANSWER_BYTES: usize = crate::remote::MAX_DOCUMENT_BYTES;

/// The largest quota-service answer believed.
pub const MAX_SERVICE_ANSWER_BYTES: usize = 64 * 1024;

/// Answer headers kept, at most (the service and config centers send a handful), and
/// their bytes in all: beyond, the rest is dropped.
pub const MAX_ANSWER_HEADERS: usize = 32;
pub const MAX_ANSWER_HEADER_BYTES: usize = 8 * 1024;

/// What of a call's answer the worker reads, so that a binding reading it through host
/// calls (proxy-wasm) copies nothing more: these headers (`:status` first), and the body
/// when it is at most `max_body` bytes (a larger one is [`BodyError::TooLarge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnswerShape {
    pub headers: &'static [&'static str],
    pub max_body: usize,
}

impl AnswerShape {
    /// The status alone (a call whose body means nothing to its caller).
    pub const STATUS: AnswerShape = AnswerShape {
        headers: &[":status"],
        max_body: 0,
    };
    /// The status and a quota-service answer's body.
    pub const SERVICE: AnswerShape = AnswerShape {
        headers: &[":status"],
        max_body: MAX_SERVICE_ANSWER_BYTES,
    };
}

/// An HTTP call the host makes on the filter's behalf (`dispatch_http_call`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    /// Envoy: a cluster name; nginx: `host:port`.
    pub upstream: String,
    /// `:method`, `:path`, `:authority` first, then the others.
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

/// What became of a call, as the host tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The host refused to make the call (unknown cluster, bad upstream).
    NotSent(DispatchError),
    /// No answer: timeout, connection refused or reset (a reply without headers).
    NoAnswer,
    /// An answer.
    Answered(Answered),
}

/// An answer that came: its status (0 when unreadable), its headers (at most
/// [`MAX_ANSWER_HEADERS`], names in lower case) and its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answered {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Result<Vec<u8>, BodyError>,
}

/// Why an answer's body was not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// Larger than its caller reads (at most [`MAX_ANSWER_BYTES`]): its size.
    TooLarge(usize),
    /// The host refused to hand it over.
    Unreadable(HostError),
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::TooLarge(size) => write!(f, "{size} bytes is larger than read"),
            BodyError::Unreadable(error) => write!(f, "{error}"),
        }
    }
}

impl Answer {
    /// An answer with this status and body, and no headers (tests, simulations).
    pub fn with(status: u16, body: Vec<u8>) -> Answer {
        Answer::Answered(Answered {
            status,
            headers: Vec::new(),
            body: Ok(body),
        })
    }

    /// An answer as a host hands it over: the status read from `:status` (0 when missing
    /// or unreadable), the other headers kept within the bounds, and the body (or why it
    /// was not read: see [`Answer::read_body`]).
    pub fn from_host(
        headers: impl IntoIterator<Item = (String, Vec<u8>)>,
        body: Result<Vec<u8>, BodyError>,
    ) -> Answer {
        let mut status = 0;
        let mut kept = Vec::new();
        let mut bytes = 0usize;
        for (name, value) in headers {
            if name == ":status" {
                status = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|text| text.trim().parse::<u16>().ok())
                    .unwrap_or(0);
                continue;
            }
            bytes = bytes.saturating_add(name.len()).saturating_add(value.len());
            if kept.len() >= MAX_ANSWER_HEADERS || bytes > MAX_ANSWER_HEADER_BYTES {
                continue;
            }
            kept.push((name.to_ascii_lowercase(), value));
        }
        Answer::Answered(Answered {
            status,
            headers: kept,
            body,
        })
    }

    /// A body of `size` bytes as a binding reads it within `shape`: `read` is asked for
    /// it only when it fits.
    pub fn read_body(
        shape: AnswerShape,
        size: usize,
        read: impl FnOnce() -> Result<Vec<u8>, HostError>,
    ) -> Result<Vec<u8>, BodyError> {
        if size > shape.max_body {
            return Err(BodyError::TooLarge(size));
        }
        if size == 0 {
            return Ok(Vec::new());
        }
        read().map_err(BodyError::Unreadable)
    }

    /// The status of an answer that came.
    pub fn status(&self) -> Option<u16> {
        match self {
            Answer::Answered(answered) => Some(answered.status),
            _ => None,
        }
    }
}

impl Answered {
    /// A header's value (names compared in lower case).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(held, _)| held.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_slice())
    }

    /// The body, if it was read and is at most `max` bytes.
    pub fn body_within(&self, max: usize) -> Option<&[u8]> {
        self.body
            .as_ref()
            .ok()
            .filter(|body| body.len() <= max)
            .map(Vec::as_slice)
    }
}

/// Why the host did not send a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DispatchError {
    /// The host refused it (unknown cluster, no upstream, a closed VM): its status.
    Refused { upstream: String, status: String },
    /// The upstream is not `host:port`, which this host needs (a malformed one traps
    /// inside ngx_wasm_module's dispatch).
    NotHostPort { upstream: String },
    /// Not sent: this host would not hold the request paused for the answer without the
    /// configuration line `needs` (see `HostProfile::pausing_needs`). The service is not
    /// at fault: the request is decided locally, the breaker stays as it is.
    CannotPause { needs: &'static str },
}

impl fmt::Display for DispatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DispatchError::Refused { upstream, status } => {
                write!(f, "{status} (upstream {upstream})")
            }
            DispatchError::NotHostPort { upstream } => {
                write!(
                    f,
                    "upstream {upstream:?} is not host:port, which this host needs"
                )
            }
            DispatchError::CannotPause { needs } => {
                write!(f, "this host holds no paused request without `{needs}`")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_from_the_host_keeps_its_status_and_bounded_headers() {
        let mut headers = vec![
            (":status".to_string(), b"200".to_vec()),
            ("ETag".to_string(), b"\"v1\"".to_vec()),
        ];
        headers.extend((0..100).map(|i| (format!("x-{i}"), vec![b'a'; 10])));
        let Answer::Answered(answered) = Answer::from_host(headers, Ok(b"{}".to_vec())) else {
            panic!("an answer");
        };
        assert_eq!(answered.status, 200);
        assert_eq!(answered.header("etag"), Some(&b"\"v1\""[..]));
        assert_eq!(answered.headers.len(), MAX_ANSWER_HEADERS);
        assert_eq!(answered.body_within(2), Some(&b"{}"[..]));
        assert_eq!(answered.body_within(1), None);
    }

    #[test]
    fn an_unreadable_status_is_zero() {
        for status in [&b"abc"[..], b"", b"\xff", b"99999"] {
            let answer = Answer::from_host(
                vec![(":status".to_string(), status.to_vec())],
                Ok(Vec::new()),
            );
            assert_eq!(answer.status(), Some(0), "{status:?}");
        }
        assert_eq!(Answer::from_host(vec![], Ok(Vec::new())).status(), Some(0));
    }
}
