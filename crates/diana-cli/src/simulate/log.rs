//! Request logs, line by line: JSON lines or Envoy's default access-log format, each line
//! recognised on its own (or forced with `--format`). Reading streams: one line in memory
//! at a time, at most [`MAX_LINE_BYTES`] of it.
//!
//! JSON lines: `{"ts": "2026-11-22T10:00:00.250Z" | 1763805600.25, "path": "/x",
//! "method": "GET", "headers": {"x-device-id": "..."}, "client_ip": "10.0.0.1"}` — `ts`
//! and `path` required; `status` (the answer's status) and `response_headers` (an object
//! of strings) say what the upstream answered, for the rules settled by their answer
//! (`response_cost`, `count`), `response_body` (a string: a JSON answer, or a stream's
//! server-sent events) for the rules that read the answer's usage (`response_cost.usage |
//! json`), and `duration_ms` how long it lasted (`max_in_flight`: Envoy's
//! `%DURATION%` says it too); other fields are ignored.
//!
//! Envoy's default format (`[%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%
//! %PROTOCOL%" %RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION%
//! %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% "%REQ(X-FORWARDED-FOR)%" "%REQ(USER-AGENT)%"
//! "%REQ(X-REQUEST-ID)%" "%REQ(:AUTHORITY)%" "%UPSTREAM_HOST%"`), optionally followed by
//! more fields that `--envoy-field` names in order (a header, or `client_ip` for
//! `%DOWNSTREAM_REMOTE_ADDRESS%`). The request carries the headers the format records
//! (`user-agent`, `x-request-id`, `x-forwarded-for`, `:authority`/`host`); its client
//! address is the last `X-Forwarded-For` entry unless a `client_ip` field gives it.

use diana_core::facts::RequestFacts;
use diana_core::properties::client_ip_from_address;
use diana_core::time::{Instant, Nanos};
use std::io::{self, BufRead};

use super::clock::{parse_epoch_seconds, parse_rfc3339, TimeError};

/// Longest line read; a longer one is malformed (and skipped without being held).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// How lines are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Each line on its own: `{` starts JSON, `[` an Envoy line.
    Auto,
    Jsonl,
    Envoy,
}

/// A field appended to Envoy's default format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvoyField {
    /// `%REQ(NAME)%`: a request header (name lower-cased).
    Header(String),
    /// `%DOWNSTREAM_REMOTE_ADDRESS%` (or `..._WITHOUT_PORT`): the client address.
    ClientIp,
}

/// An `--envoy-field` value that is neither `client_ip` nor a header name (as given,
/// trimmed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--envoy-field {field:?}: a header name or client_ip expected")]
pub struct EnvoyFieldError {
    pub field: String,
}

impl EnvoyField {
    /// `client_ip`, or a header name.
    pub fn parse(text: &str) -> Result<EnvoyField, EnvoyFieldError> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("client_ip") {
            return Ok(EnvoyField::ClientIp);
        }
        let valid = !text.is_empty()
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
        if valid {
            Ok(EnvoyField::Header(text.to_ascii_lowercase()))
        } else {
            Err(EnvoyFieldError {
                field: text.to_string(),
            })
        }
    }
}

/// One request of the log: what the filter would have seen of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// When it arrived.
    pub ts: Instant,
    /// Line number in the log (from 1).
    pub line: u64,
    /// `:path` as sent.
    pub path: Vec<u8>,
    /// Lower-case names.
    pub headers: Vec<(String, Vec<u8>)>,
    pub client_ip: Option<Vec<u8>>,
    /// What the upstream answered, as far as the log says: `:status` and response headers
    /// (lower-case names).
    pub response: Vec<(String, Vec<u8>)>,
    /// The answer's body, where the log has it (JSON lines' `response_body`).
    pub response_body: Option<Vec<u8>>,
    /// How long the request lasted (0: not said), for what it holds until it ends
    /// (`max_in_flight`).
    pub duration: Nanos,
}

impl RequestFacts for Request {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.headers
            .iter()
            .find(|(known, _)| known == name)
            .map(|(_, value)| value.clone())
    }

    fn client_ip(&self) -> Option<Vec<u8>> {
        self.client_ip.clone()
    }
}

/// What one line holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    Request(Request, Format),
    /// Empty or white space only.
    Blank,
    /// An Envoy line without a request (`"- - -"`: Envoy answered before any filter, e.g.
    /// a 400 from the codec).
    NoRequest,
}

/// Why a line is malformed: counted, and the first few named in the report (the message
/// is the reason shown there).
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// Longer than [`MAX_LINE_BYTES`]: skipped without being read.
    #[error("longer than {MAX_LINE_BYTES} bytes")]
    TooLong,
    /// Neither format, told by the first character (`--format auto`).
    #[error("neither a JSON object nor an Envoy access-log line (\"[time] ...\")")]
    Unrecognised,
    #[error("not JSON: {0}")]
    NotJson(#[from] serde_json::Error),
    #[error("a JSON object expected, one request per line")]
    NotAnObject,
    /// A field of a JSON line (`ts`, `path`, ...) and what is wrong with it.
    #[error("\"{field}\": {problem}")]
    Field {
        field: &'static str,
        problem: FieldProblem,
    },
    /// A value in a JSON line's `headers` or `response_headers` (`field`) that is not a
    /// string, under its header `name`.
    #[error("\"{field}\".{name:?}: a string expected")]
    HeaderNotString { field: &'static str, name: String },
    /// Read as an Envoy line (`--format envoy`) without the `[` that opens it.
    #[error("an Envoy line starts with [%START_TIME%]")]
    NoStartTime,
    #[error("no ] after the start time")]
    UnclosedStartTime,
    #[error("the start time is not text")]
    StartTimeNotText(#[source] std::str::Utf8Error),
    /// An Envoy line's start time is neither RFC 3339 nor epoch seconds (the RFC 3339
    /// reason).
    #[error("start time: {0}")]
    StartTime(#[source] TimeError),
    /// A quoted field of an Envoy line that does not end; numbered from 1, the start time
    /// first.
    #[error("field {field}: no closing quote")]
    UnclosedQuote { field: usize },
    /// An Envoy line without as many fields as the default format has, plus the
    /// `appended` ones `--envoy-field` names.
    #[error(
        "{found} fields after the time, expected {} (Envoy's default format{})",
        ENVOY_FIELDS + .appended,
        appended_fields(*.appended)
    )]
    FieldCount { found: usize, appended: usize },
    #[error("field 3 (%RESPONSE_CODE%): a number expected")]
    ResponseCode,
}

/// ` and 2 --envoy-field`, or nothing.
fn appended_fields(appended: usize) -> String {
    if appended == 0 {
        String::new()
    } else {
        format!(" and {appended} --envoy-field")
    }
}

/// What is wrong with a field of a JSON line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FieldProblem {
    #[error("missing")]
    Missing,
    /// A `ts` string that is neither RFC 3339 nor epoch seconds (the RFC 3339 reason), or
    /// a number out of range.
    #[error("{0}")]
    Time(#[from] TimeError),
    #[error("epoch seconds or an RFC 3339 string expected")]
    NotATime,
    #[error("a non-empty string expected")]
    NotANonEmptyString,
    #[error("a string expected")]
    NotAString,
    #[error("an object of strings expected")]
    NotAnObjectOfStrings,
    #[error("a number expected")]
    NotANumber,
    #[error("a number of milliseconds ≥ 0 expected")]
    NotMilliseconds,
}

impl FieldProblem {
    /// This problem in `field` of a JSON line.
    fn of(self, field: &'static str) -> LineError {
        LineError::Field {
            field,
            problem: self,
        }
    }
}

/// Reads one line: a request, a line to pass over, or why it is malformed.
pub fn parse_line(
    bytes: &[u8],
    line: u64,
    format: Format,
    extra: &[EnvoyField],
) -> Result<Line, LineError> {
    let trimmed = bytes.trim_ascii();
    if trimmed.is_empty() {
        return Ok(Line::Blank);
    }
    let format = match format {
        Format::Auto => match trimmed.first() {
            Some(b'{') => Format::Jsonl,
            Some(b'[') => Format::Envoy,
            _ => return Err(LineError::Unrecognised),
        },
        known => known,
    };
    let request = match format {
        Format::Envoy => parse_envoy(trimmed, line, extra)?,
        _ => Some(parse_json(trimmed, line)?),
    };
    Ok(match request {
        Some(request) => Line::Request(request, format),
        None => Line::NoRequest,
    })
}

fn parse_json(bytes: &[u8], line: u64) -> Result<Request, LineError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)?;
    let object = value.as_object().ok_or(LineError::NotAnObject)?;
    let ts = match object.get("ts") {
        Some(serde_json::Value::Number(number)) => {
            parse_epoch_seconds(&number.to_string()).map_err(FieldProblem::from)
        }
        Some(serde_json::Value::String(text)) => parse_rfc3339(text)
            .or_else(|err| parse_epoch_seconds(text).map_err(|_| err))
            .map_err(FieldProblem::from),
        Some(_) => Err(FieldProblem::NotATime),
        None => Err(FieldProblem::Missing),
    }
    .map_err(|problem| problem.of("ts"))?;
    let path = match object.get("path") {
        Some(serde_json::Value::String(path)) if !path.is_empty() => path.as_bytes().to_vec(),
        Some(_) => return Err(FieldProblem::NotANonEmptyString.of("path")),
        None => return Err(FieldProblem::Missing.of("path")),
    };
    if let Some(method) = object.get("method") {
        if !method.is_string() {
            return Err(FieldProblem::NotAString.of("method"));
        }
    }
    let mut headers = Vec::new();
    match object.get("headers") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(map)) => {
            for (name, value) in map {
                let value = value.as_str().ok_or_else(|| LineError::HeaderNotString {
                    field: "headers",
                    name: name.clone(),
                })?;
                headers.push((name.to_ascii_lowercase(), value.as_bytes().to_vec()));
            }
        }
        Some(_) => return Err(FieldProblem::NotAnObjectOfStrings.of("headers")),
    }
    let client_ip = match object.get("client_ip") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(ip)) => client_ip_from_address(ip.as_bytes()),
        Some(_) => return Err(FieldProblem::NotAString.of("client_ip")),
    };
    let mut response = Vec::new();
    match object.get("status") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Number(status)) => {
            response.push((":status".to_string(), status.to_string().into_bytes()));
        }
        Some(serde_json::Value::String(status)) => {
            response.push((":status".to_string(), status.as_bytes().to_vec()));
        }
        Some(_) => return Err(FieldProblem::NotANumber.of("status")),
    }
    match object.get("response_headers") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(map)) => {
            for (name, value) in map {
                let value = value.as_str().ok_or_else(|| LineError::HeaderNotString {
                    field: "response_headers",
                    name: name.clone(),
                })?;
                response.push((name.to_ascii_lowercase(), value.as_bytes().to_vec()));
            }
        }
        Some(_) => return Err(FieldProblem::NotAnObjectOfStrings.of("response_headers")),
    }
    let response_body = match object.get("response_body") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(body)) => Some(body.as_bytes().to_vec()),
        Some(_) => return Err(FieldProblem::NotAString.of("response_body")),
    };
    let duration = match object.get("duration_ms") {
        None | Some(serde_json::Value::Null) => Nanos::ZERO,
        Some(serde_json::Value::Number(ms)) => ms
            .as_f64()
            .filter(|ms| ms.is_finite() && *ms >= 0.0)
            // Truncation intended: nanoseconds of at most a day.
            .map(|ms| Nanos::new((ms.min(86_400_000.0) * 1_000_000.0) as u64))
            .ok_or(FieldProblem::NotMilliseconds.of("duration_ms"))?,
        Some(_) => return Err(FieldProblem::NotANumber.of("duration_ms")),
    };
    Ok(Request {
        ts,
        line,
        path,
        headers,
        client_ip,
        response,
        response_body,
        duration,
    })
}

/// The fields of Envoy's default format after `[%START_TIME%]`.
const ENVOY_FIELDS: usize = 12;
const REQUEST_LINE: usize = 0;
const RESPONSE_CODE: usize = 1;
const DURATION: usize = 5;
const FORWARDED_FOR: usize = 7;
const USER_AGENT: usize = 8;
const REQUEST_ID: usize = 9;
const AUTHORITY: usize = 10;

/// Splits an Envoy line after its time: quoted fields (up to a `"` followed by a space or
/// the end) and bare words.
fn envoy_fields(mut rest: &[u8]) -> Result<Vec<&[u8]>, LineError> {
    let mut fields = Vec::new();
    loop {
        rest = rest.trim_ascii_start();
        let Some(&first) = rest.first() else {
            return Ok(fields);
        };
        if first == b'"' {
            let body = rest.get(1..).unwrap_or_default();
            let end = (0..body.len())
                .find(|&i| {
                    body.get(i) == Some(&b'"') && matches!(body.get(i + 1), None | Some(b' '))
                })
                .ok_or(LineError::UnclosedQuote {
                    field: fields.len() + 2,
                })?;
            fields.push(body.get(..end).unwrap_or_default());
            rest = body.get(end + 1..).unwrap_or_default();
        } else {
            let end = rest.iter().position(|&b| b == b' ').unwrap_or(rest.len());
            fields.push(rest.get(..end).unwrap_or_default());
            rest = rest.get(end..).unwrap_or_default();
        }
    }
}

/// An Envoy field's value: `-` means not set.
fn set(field: &[u8]) -> Option<&[u8]> {
    (field != b"-" && !field.is_empty()).then_some(field)
}

fn parse_envoy(
    bytes: &[u8],
    line: u64,
    extra: &[EnvoyField],
) -> Result<Option<Request>, LineError> {
    let rest = bytes.strip_prefix(b"[").ok_or(LineError::NoStartTime)?;
    let close = rest
        .iter()
        .position(|&b| b == b']')
        .ok_or(LineError::UnclosedStartTime)?;
    let time = std::str::from_utf8(rest.get(..close).unwrap_or_default())
        .map_err(LineError::StartTimeNotText)?;
    let ts = parse_rfc3339(time)
        .or_else(|err| parse_epoch_seconds(time).map_err(|_| err))
        .map_err(LineError::StartTime)?;
    let fields = envoy_fields(rest.get(close + 1..).unwrap_or_default())?;
    if fields.len() != ENVOY_FIELDS + extra.len() {
        return Err(LineError::FieldCount {
            found: fields.len(),
            appended: extra.len(),
        });
    }
    let field = |index: usize| fields.get(index).copied().unwrap_or_default();
    let code = field(RESPONSE_CODE);
    if code.is_empty() || !code.iter().all(u8::is_ascii_digit) {
        return Err(LineError::ResponseCode);
    }
    let mut words = field(REQUEST_LINE).split(|&b| b == b' ');
    let _method = words.next();
    let Some(path) = words.next().and_then(set) else {
        return Ok(None);
    };
    let mut headers = Vec::new();
    let mut client_ip = None;
    if let Some(forwarded) = set(field(FORWARDED_FOR)) {
        headers.push(("x-forwarded-for".to_string(), forwarded.to_vec()));
        client_ip = forwarded
            .rsplit(|&b| b == b',')
            .next()
            .and_then(client_ip_from_address);
    }
    for (index, name) in [(USER_AGENT, "user-agent"), (REQUEST_ID, "x-request-id")] {
        if let Some(value) = set(field(index)) {
            headers.push((name.to_string(), value.to_vec()));
        }
    }
    if let Some(authority) = set(field(AUTHORITY)) {
        headers.push((":authority".to_string(), authority.to_vec()));
        headers.push(("host".to_string(), authority.to_vec()));
    }
    for (offset, wanted) in extra.iter().enumerate() {
        let Some(value) = set(field(ENVOY_FIELDS + offset)) else {
            continue;
        };
        match wanted {
            EnvoyField::ClientIp => client_ip = client_ip_from_address(value),
            EnvoyField::Header(name) => {
                headers.retain(|(known, _)| known != name);
                headers.push((name.clone(), value.to_vec()));
            }
        }
    }
    Ok(Some(Request {
        ts,
        line,
        path: path.to_vec(),
        headers,
        client_ip,
        // %RESPONSE_CODE% (0: no answer came).
        response: vec![(":status".to_string(), code.to_vec())],
        response_body: None,
        // %DURATION%, in milliseconds.
        duration: set(field(DURATION))
            .and_then(|ms| std::str::from_utf8(ms).ok()?.parse::<u64>().ok())
            .map_or(Nanos::ZERO, |ms| Nanos::from_millis(ms.min(86_400_000))),
    }))
}

/// A line of the input, or the sign that it was longer than [`MAX_LINE_BYTES`].
pub enum RawLine<'a> {
    Text(&'a [u8]),
    TooLong,
}

/// Reads lines without ever holding more than [`MAX_LINE_BYTES`] of one.
pub struct LineReader<R> {
    inner: R,
    buffer: Vec<u8>,
    number: u64,
}

impl<R: BufRead> LineReader<R> {
    pub fn new(inner: R) -> LineReader<R> {
        LineReader {
            inner,
            buffer: Vec::new(),
            number: 0,
        }
    }

    /// The next line (without its end of line) and its number, or `None` at the end.
    pub fn next_line(&mut self) -> io::Result<Option<(u64, RawLine<'_>)>> {
        self.buffer.clear();
        let mut too_long = false;
        let mut read_any = false;
        loop {
            let available = match self.inner.fill_buf() {
                Ok(available) => available,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(err),
            };
            if available.is_empty() {
                if !read_any {
                    return Ok(None);
                }
                break;
            }
            read_any = true;
            let (chunk, used, done) = match available.iter().position(|&b| b == b'\n') {
                Some(end) => (available.get(..end).unwrap_or_default(), end + 1, true),
                None => (available, available.len(), false),
            };
            if !too_long {
                if self.buffer.len() + chunk.len() > MAX_LINE_BYTES {
                    too_long = true;
                    self.buffer.clear();
                } else {
                    self.buffer.extend_from_slice(chunk);
                }
            }
            self.inner.consume(used);
            if done {
                break;
            }
        }
        self.number += 1;
        if too_long {
            return Ok(Some((self.number, RawLine::TooLong)));
        }
        if self.buffer.last() == Some(&b'\r') {
            self.buffer.pop();
        }
        Ok(Some((self.number, RawLine::Text(&self.buffer))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Nanos = diana_core::time::NANOS_PER_SECOND;

    fn request(line: Result<Line, LineError>) -> Request {
        match line {
            Ok(Line::Request(request, _)) => request,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn json_lines_with_either_kind_of_time() {
        let r = request(parse_line(
            br#"{"ts": 1767225601.25, "method": "GET", "path": "/x?q=1", "headers": {"X-Device-Id": "d1"}, "client_ip": "10.0.0.1:5000", "status": 200}"#,
            3,
            Format::Auto,
            &[],
        ));
        assert_eq!(r.ts, Instant::EPOCH + (1_767_225_601 * S + S / 4));
        assert_eq!((r.line, r.path.as_slice()), (3, &b"/x?q=1"[..]));
        assert_eq!(r.header("x-device-id"), Some(b"d1".to_vec()));
        assert_eq!(r.client_ip(), Some(b"10.0.0.1".to_vec()));
        let r = request(parse_line(
            br#"{"ts": "2026-01-01T00:00:01.5Z", "path": "/"}"#,
            1,
            Format::Jsonl,
            &[],
        ));
        assert_eq!(r.ts, Instant::EPOCH + (1_767_225_601 * S + S / 2));
        assert!(r.headers.is_empty() && r.client_ip.is_none());
    }

    /// Malformed lines: each one's error, told by `is`, and its message (`...` at the end:
    /// its start).
    type Malformed<'a> = (&'a [u8], fn(&LineError) -> bool, &'a str);

    fn say_why(format: Format, cases: &[Malformed]) {
        for (text, is, message) in cases {
            let err = parse_line(text, 1, format, &[]).unwrap_err();
            let shown = String::from_utf8_lossy(text);
            assert!(is(&err), "{err:?} for {shown:?}");
            match message.strip_suffix("...") {
                Some(start) => assert!(err.to_string().starts_with(start), "{err}"),
                None => assert_eq!(err.to_string(), *message, "for {shown:?}"),
            }
        }
    }

    #[test]
    fn malformed_json_lines_say_why() {
        use FieldProblem::*;
        let not_epoch = |text: &str| Time(TimeError::NotEpochSeconds { text: text.into() });
        let not_rfc3339 = |text: &str| Time(TimeError::NotRfc3339 { text: text.into() });
        for (text, field, problem, message) in [
            (r#"{"path": "/"}"#, "ts", Missing, r#""ts": missing"#),
            (
                r#"{"ts": -5, "path": "/"}"#,
                "ts",
                not_epoch("-5"),
                r#""ts": -5 is not a time in seconds since the epoch (1970) or later"#,
            ),
            (
                r#"{"ts": "noon", "path": "/"}"#,
                "ts",
                not_rfc3339("noon"),
                r#""ts": "noon" is not an RFC 3339 time (like 2026-11-22T10:00:00.250Z) at or after 1970"#,
            ),
            (
                r#"{"ts": true, "path": "/"}"#,
                "ts",
                NotATime,
                r#""ts": epoch seconds or an RFC 3339 string expected"#,
            ),
            (r#"{"ts": 1}"#, "path", Missing, r#""path": missing"#),
            (
                r#"{"ts": 1, "path": 7}"#,
                "path",
                NotANonEmptyString,
                r#""path": a non-empty string expected"#,
            ),
            (
                r#"{"ts": 1, "path": "/", "headers": []}"#,
                "headers",
                NotAnObjectOfStrings,
                r#""headers": an object of strings expected"#,
            ),
            (
                r#"{"ts": 1, "path": "/", "method": 1}"#,
                "method",
                NotAString,
                r#""method": a string expected"#,
            ),
            (
                r#"{"ts": 1, "path": "/", "status": []}"#,
                "status",
                NotANumber,
                r#""status": a number expected"#,
            ),
            (
                r#"{"ts": 1, "path": "/", "duration_ms": -1}"#,
                "duration_ms",
                NotMilliseconds,
                r#""duration_ms": a number of milliseconds ≥ 0 expected"#,
            ),
        ] {
            let err = parse_line(text.as_bytes(), 1, Format::Auto, &[]).unwrap_err();
            assert!(
                matches!(&err, LineError::Field { field: f, problem: p } if *f == field && *p == problem),
                "{err:?} for {text}"
            );
            assert_eq!(err.to_string(), message, "for {text}");
        }
        say_why(
            Format::Auto,
            &[
                (
                    br#"{"ts": 1, "path": "/", "response_headers": {"a": 1}}"#,
                    |e| matches!(e, LineError::HeaderNotString { field: "response_headers", name } if name == "a"),
                    r#""response_headers"."a": a string expected"#,
                ),
                (
                    br#"{"ts": 1, "path": "/""#,
                    |e| matches!(e, LineError::NotJson(_)),
                    "not JSON: ...",
                ),
                (
                    b"[1, 2]",
                    |e| matches!(e, LineError::StartTime(_)),
                    "start time: ...",
                ),
                (
                    b"GET / HTTP/1.1",
                    |e| matches!(e, LineError::Unrecognised),
                    r#"neither a JSON object nor an Envoy access-log line ("[time] ...")"#,
                ),
            ],
        );
        say_why(
            Format::Jsonl,
            &[(
                b"[1, 2]",
                |e| matches!(e, LineError::NotAnObject),
                "a JSON object expected, one request per line",
            )],
        );
    }

    const ENVOY: &[u8] = br#"[2016-04-15T20:17:00.310Z] "POST /api/v1/locations HTTP/2" 204 - 154 0 226 100 "10.0.35.28" "nsq2http" "cc21d9b0-cf5c-432b-8c7e-98aeb7988cd2" "locations" "tcp://10.0.2.1:80""#;

    #[test]
    fn envoy_default_lines() {
        let r = request(parse_line(ENVOY, 9, Format::Auto, &[]));
        assert_eq!(
            r.ts,
            Instant::EPOCH + (1_460_751_420 * S + Nanos::new(310_000_000))
        );
        assert_eq!(r.path, b"/api/v1/locations");
        assert_eq!(r.client_ip(), Some(b"10.0.35.28".to_vec()));
        assert_eq!(r.header("user-agent"), Some(b"nsq2http".to_vec()));
        assert_eq!(r.header("host"), Some(b"locations".to_vec()));
        // A user agent with spaces and quotes inside, and no X-Forwarded-For.
        let line = br#"[2026-01-01T00:00:01.000Z] "GET /a b HTTP/1.1" 503 - 0 13 0 - "-" "Mozilla/5.0 (X11; "quoted")" "-" "h" "-""#;
        let r = request(parse_line(line, 1, Format::Envoy, &[]));
        assert_eq!(r.path, b"/a");
        assert_eq!(
            r.header("user-agent"),
            Some(b"Mozilla/5.0 (X11; \"quoted\")".to_vec())
        );
        assert_eq!((r.client_ip(), r.header("x-request-id")), (None, None));
        // No request at all.
        let line = br#"[2026-01-01T00:00:01.000Z] "- - -" 400 DPE 0 11 0 - "-" "-" "-" "-" "-""#;
        assert!(matches!(
            parse_line(line, 1, Format::Auto, &[]),
            Ok(Line::NoRequest)
        ));
    }

    #[test]
    fn envoy_lines_with_appended_fields() {
        let extra = [
            EnvoyField::parse("X-Device-Id").unwrap(),
            EnvoyField::parse("client_ip").unwrap(),
        ];
        let mut line = ENVOY.to_vec();
        line.extend_from_slice(br#" "phone-1" "192.168.1.9:41000""#);
        let r = request(parse_line(&line, 1, Format::Auto, &extra));
        assert_eq!(r.header("x-device-id"), Some(b"phone-1".to_vec()));
        assert_eq!(r.client_ip(), Some(b"192.168.1.9".to_vec()));
        // The same line without them does not have the fields asked for.
        let err = parse_line(ENVOY, 1, Format::Auto, &extra).unwrap_err();
        assert!(
            matches!(
                err,
                LineError::FieldCount {
                    found: 12,
                    appended: 2
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "12 fields after the time, expected 14 (Envoy's default format and 2 --envoy-field)"
        );
        let err = EnvoyField::parse(" bad header ");
        assert_eq!(
            err,
            Err(EnvoyFieldError {
                field: "bad header".into()
            })
        );
        assert_eq!(
            err.map_err(|err| err.to_string()),
            Err("--envoy-field \"bad header\": a header name or client_ip expected".into())
        );
    }

    #[test]
    fn malformed_envoy_lines_say_why() {
        say_why(
            Format::Envoy,
            &[
                (
                    br#"[yesterday] "GET / HTTP/1.1" 200 - 0 0 0 - "-" "-" "-" "-" "-""#,
                    |e| matches!(e, LineError::StartTime(TimeError::NotRfc3339 { text }) if text == "yesterday"),
                    r#"start time: "yesterday" is not an RFC 3339 time (like 2026-11-22T10:00:00.250Z) at or after 1970"#,
                ),
                (
                    br#"[2026-01-01T00:00:01Z "GET / HTTP/1.1" 200"#,
                    |e| matches!(e, LineError::UnclosedStartTime),
                    "no ] after the start time",
                ),
                (
                    b"[\xff] - 200",
                    |e| matches!(e, LineError::StartTimeNotText(_)),
                    "the start time is not text",
                ),
                (
                    br#"[2026-01-01T00:00:01Z] "GET / HTTP/1.1" 200 - 0 0"#,
                    |e| {
                        matches!(
                            e,
                            LineError::FieldCount {
                                found: 5,
                                appended: 0
                            }
                        )
                    },
                    "5 fields after the time, expected 12 (Envoy's default format)",
                ),
                (
                    br#"[2026-01-01T00:00:01Z] "GET / HTTP/1.1" OK - 0 0 0 - "-" "-" "-" "-" "-""#,
                    |e| matches!(e, LineError::ResponseCode),
                    "field 3 (%RESPONSE_CODE%): a number expected",
                ),
                (
                    br#"[2026-01-01T00:00:01Z] "GET / HTTP/1.1 200 - 0 0 0 -"#,
                    |e| matches!(e, LineError::UnclosedQuote { field: 2 }),
                    "field 2: no closing quote",
                ),
                (
                    br#"{"ts": 1, "path": "/"}"#,
                    |e| matches!(e, LineError::NoStartTime),
                    "an Envoy line starts with [%START_TIME%]",
                ),
            ],
        );
        say_why(
            Format::Jsonl,
            &[(
                ENVOY,
                |e| matches!(e, LineError::NotJson(_)),
                "not JSON: ...",
            )],
        );
    }

    #[test]
    fn lines_are_read_without_holding_a_huge_one() {
        let mut text = b"first\r\n".to_vec();
        text.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES + 10));
        text.extend_from_slice(b"\nlast");
        let mut reader = LineReader::new(io::BufReader::with_capacity(64, text.as_slice()));
        let mut seen = Vec::new();
        while let Some((number, line)) = reader.next_line().unwrap() {
            seen.push(match line {
                RawLine::Text(text) => (number, String::from_utf8(text.to_vec()).unwrap()),
                RawLine::TooLong => (number, "too long".to_string()),
            });
        }
        assert_eq!(
            seen,
            [
                (1, "first".to_string()),
                (2, "too long".to_string()),
                (3, "last".to_string())
            ]
        );
    }
}
