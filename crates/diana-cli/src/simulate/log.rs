//! Request logs, line by line: JSON lines or Envoy's default access-log format, each line
//! recognised on its own (or forced with `--format`). Reading streams: one line in memory
//! at a time, at most [`MAX_LINE_BYTES`] of it.
//!
//! JSON lines: `{"ts": "2026-11-22T10:00:00.250Z" | 1763805600.25, "path": "/x",
//! "method": "GET", "headers": {"x-device-id": "..."}, "client_ip": "10.0.0.1"}` — `ts`
//! and `path` required; `status` (the answer's status) and `response_headers` (an object
//! of strings) say what the upstream answered, for the rules settled by their answer
//! (`response_cost`, `count`), and `duration_ms` how long it lasted (`max_in_flight`: Envoy's
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

use diana_core::actor::RequestFacts;
use diana_core::properties::client_ip_from_address;
use diana_core::time::{Instant, Nanos};
use std::io::{self, BufRead};

use super::clock::{parse_epoch_seconds, parse_rfc3339};

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

impl EnvoyField {
    /// `client_ip`, or a header name.
    pub fn parse(text: &str) -> Result<EnvoyField, String> {
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
            Err(format!(
                "--envoy-field {text:?}: a header name or client_ip expected"
            ))
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

/// Reads one line: a request, a line to pass over, or why it is malformed.
pub fn parse_line(
    bytes: &[u8],
    line: u64,
    format: Format,
    extra: &[EnvoyField],
) -> Result<Line, String> {
    let trimmed = bytes.trim_ascii();
    if trimmed.is_empty() {
        return Ok(Line::Blank);
    }
    let format = match format {
        Format::Auto => match trimmed.first() {
            Some(b'{') => Format::Jsonl,
            Some(b'[') => Format::Envoy,
            _ => {
                return Err(
                    "neither a JSON object nor an Envoy access-log line (\"[time] ...\")".into(),
                )
            }
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

fn parse_json(bytes: &[u8], line: u64) -> Result<Request, String> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|err| format!("not JSON: {err}"))?;
    let object = value
        .as_object()
        .ok_or("a JSON object expected, one request per line")?;
    let ts = match object.get("ts") {
        Some(serde_json::Value::Number(number)) => parse_epoch_seconds(&number.to_string()),
        Some(serde_json::Value::String(text)) => {
            parse_rfc3339(text).or_else(|err| parse_epoch_seconds(text).map_err(|_| err))
        }
        Some(_) => Err("epoch seconds or an RFC 3339 string expected".to_string()),
        None => Err("missing".to_string()),
    }
    .map_err(|err| format!("\"ts\": {err}"))?;
    let path = match object.get("path") {
        Some(serde_json::Value::String(path)) if !path.is_empty() => path.as_bytes().to_vec(),
        Some(_) => return Err("\"path\": a non-empty string expected".into()),
        None => return Err("\"path\": missing".into()),
    };
    if let Some(method) = object.get("method") {
        if !method.is_string() {
            return Err("\"method\": a string expected".into());
        }
    }
    let mut headers = Vec::new();
    match object.get("headers") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(map)) => {
            for (name, value) in map {
                let value = value
                    .as_str()
                    .ok_or_else(|| format!("\"headers\".{name:?}: a string expected"))?;
                headers.push((name.to_ascii_lowercase(), value.as_bytes().to_vec()));
            }
        }
        Some(_) => return Err("\"headers\": an object of strings expected".into()),
    }
    let client_ip = match object.get("client_ip") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(ip)) => client_ip_from_address(ip.as_bytes()),
        Some(_) => return Err("\"client_ip\": a string expected".into()),
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
        Some(_) => return Err("\"status\": a number expected".into()),
    }
    match object.get("response_headers") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(map)) => {
            for (name, value) in map {
                let value = value
                    .as_str()
                    .ok_or_else(|| format!("\"response_headers\".{name:?}: a string expected"))?;
                response.push((name.to_ascii_lowercase(), value.as_bytes().to_vec()));
            }
        }
        Some(_) => return Err("\"response_headers\": an object of strings expected".into()),
    }
    let duration = match object.get("duration_ms") {
        None | Some(serde_json::Value::Null) => Nanos::ZERO,
        Some(serde_json::Value::Number(ms)) => ms
            .as_f64()
            .filter(|ms| ms.is_finite() && *ms >= 0.0)
            // Truncation intended: nanoseconds of at most a day.
            .map(|ms| Nanos::new((ms.min(86_400_000.0) * 1_000_000.0) as u64))
            .ok_or("\"duration_ms\": a number of milliseconds ≥ 0 expected")?,
        Some(_) => return Err("\"duration_ms\": a number expected".into()),
    };
    Ok(Request {
        ts,
        line,
        path,
        headers,
        client_ip,
        response,
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
fn envoy_fields(mut rest: &[u8]) -> Result<Vec<&[u8]>, String> {
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
                .ok_or_else(|| format!("field {}: no closing quote", fields.len() + 2))?;
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

fn parse_envoy(bytes: &[u8], line: u64, extra: &[EnvoyField]) -> Result<Option<Request>, String> {
    let rest = bytes
        .strip_prefix(b"[")
        .ok_or("an Envoy line starts with [%START_TIME%]")?;
    let close = rest
        .iter()
        .position(|&b| b == b']')
        .ok_or("no ] after the start time")?;
    let time = std::str::from_utf8(rest.get(..close).unwrap_or_default())
        .map_err(|_| "the start time is not text")?;
    let ts = parse_rfc3339(time)
        .or_else(|err| parse_epoch_seconds(time).map_err(|_| err))
        .map_err(|err| format!("start time: {err}"))?;
    let fields = envoy_fields(rest.get(close + 1..).unwrap_or_default())?;
    let expected = ENVOY_FIELDS + extra.len();
    if fields.len() != expected {
        return Err(format!(
            "{} fields after the time, expected {expected} (Envoy's default format{})",
            fields.len(),
            if extra.is_empty() {
                String::new()
            } else {
                format!(" and {} --envoy-field", extra.len())
            }
        ));
    }
    let field = |index: usize| fields.get(index).copied().unwrap_or_default();
    let code = field(RESPONSE_CODE);
    if code.is_empty() || !code.iter().all(u8::is_ascii_digit) {
        return Err("field 3 (%RESPONSE_CODE%): a number expected".into());
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

    fn request(line: Result<Line, String>) -> Request {
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

    #[test]
    fn malformed_json_lines_say_why() {
        for (text, reason) in [
            (&b"{\"ts\": 1, \"path\": \"/\""[..], "not JSON"),
            (b"[1, 2]", "start time"),
            (b"{\"path\": \"/\"}", "\"ts\": missing"),
            (b"{\"ts\": -5, \"path\": \"/\"}", "\"ts\": -5 is not a time"),
            (
                b"{\"ts\": \"noon\", \"path\": \"/\"}",
                "\"ts\": \"noon\" is not an RFC 3339",
            ),
            (b"{\"ts\": 1, \"path\": 7}", "\"path\": a non-empty string"),
            (
                b"{\"ts\": 1, \"path\": \"/\", \"headers\": {\"a\": 1}}",
                "\"headers\".\"a\"",
            ),
            (
                b"{\"ts\": 1, \"path\": \"/\", \"headers\": []}",
                "\"headers\": an object",
            ),
            (b"{\"ts\": 1, \"path\": \"/\", \"method\": 1}", "\"method\""),
            (b"GET / HTTP/1.1", "neither a JSON object"),
        ] {
            let err = parse_line(text, 1, Format::Auto, &[]).unwrap_err();
            assert!(
                err.contains(reason),
                "{err} for {:?}",
                String::from_utf8_lossy(text)
            );
        }
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
        assert_eq!(parse_line(line, 1, Format::Auto, &[]), Ok(Line::NoRequest));
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
            err.contains("12 fields after the time, expected 14"),
            "{err}"
        );
        assert!(EnvoyField::parse("bad header").is_err());
    }

    #[test]
    fn malformed_envoy_lines_say_why() {
        for (text, reason) in [
            (
                &br#"[yesterday] "GET / HTTP/1.1" 200 - 0 0 0 - "-" "-" "-" "-" "-""#[..],
                "start time",
            ),
            (br#"[2026-01-01T00:00:01Z "GET / HTTP/1.1" 200"#, "no ]"),
            (
                br#"[2026-01-01T00:00:01Z] "GET / HTTP/1.1" 200 - 0 0"#,
                "5 fields",
            ),
            (
                br#"[2026-01-01T00:00:01Z] "GET / HTTP/1.1" OK - 0 0 0 - "-" "-" "-" "-" "-""#,
                "RESPONSE_CODE",
            ),
            (
                br#"[2026-01-01T00:00:01Z] "GET / HTTP/1.1 200 - 0 0 0 -"#,
                "closing quote",
            ),
        ] {
            let err = parse_line(text, 1, Format::Envoy, &[]).unwrap_err();
            assert!(
                err.contains(reason),
                "{err} for {:?}",
                String::from_utf8_lossy(text)
            );
        }
        let err = parse_line(ENVOY, 1, Format::Jsonl, &[]).unwrap_err();
        assert!(err.contains("not JSON"), "{err}");
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
