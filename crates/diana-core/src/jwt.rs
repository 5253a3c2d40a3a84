//! The claims of a bearer token (a JWT, RFC 7519, in JWS compact form), **read, not
//! verified**, for actors that count requests by a claim (`actors: {user: {jwt_claim:
//! sub}}`). Diana does not check signatures: a filter that does (Envoy's `jwt_authn`, with
//! `forward: true` so that the token stays on the request) must run before it, or anyone
//! can count against anyone's claim. Every size is bounded, and anything malformed — no
//! bearer token, not three segments, payload not base64url JSON, the claim absent or not a
//! scalar — reads as no claim: the actor's fallback decides.
//!
//! A claim is named as it is (`sub`, `https://example.com/tenant`), or by a JSON Pointer
//! (RFC 6901) into the payload when it is nested (`/org/id`, `/roles/0`).
//!
//! On Envoy a claim can also be read from the payload that `jwt_authn` verified and left
//! in the request's dynamic metadata (`payload_in_metadata`): [`ClaimOrigin::JwtAuthn`].
//! proxy-wasm walks the path there for Diana (`metadata.filter_metadata[<namespace>]
//! [<name>][<segment>]...`) and hands over the leaf as Envoy serialises a CEL value: a
//! string's bytes, a number (JSON numbers are doubles in a protobuf `Struct`) as its eight
//! bytes little-endian, a boolean as one byte, an object or a list as proxy-wasm pairs,
//! `null` not at all. Those bytes are the identity, whatever the type
//! ([`metadata_claim`]).

use crate::facts::{BearerScheme, NoMetadata, RequestFacts};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde_json::Value;
use std::fmt;

/// Longest token read, in bytes (larger: no claim).
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// Most segments of a claim's path.
pub const MAX_PATH_SEGMENTS: usize = 8;
/// Longest segment of a claim's path, in bytes.
pub const MAX_SEGMENT_BYTES: usize = 256;

/// The dynamic-metadata namespace Envoy's `jwt_authn` filter writes.
pub const JWT_AUTHN_NAMESPACE: &str = "envoy.filters.http.jwt_authn";
/// Longest `payload_in_metadata` name.
pub const MAX_METADATA_NAME_BYTES: usize = 256;
/// Longest claim value read from metadata, in bytes (larger: no claim).
pub const MAX_METADATA_VALUE_BYTES: usize = MAX_TOKEN_BYTES;

/// Where a claim is read.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClaimOrigin {
    /// The request's `authorization: Bearer <JWT>`, read and not verified.
    Bearer,
    /// The payload an earlier `jwt_authn` filter verified and put in the request's dynamic
    /// metadata under this name (its provider's `payload_in_metadata`): Envoy only.
    JwtAuthn(String),
}

impl ClaimOrigin {
    /// `{jwt_authn: NAME}`: NAME is a provider's `payload_in_metadata` (1 to
    /// [`MAX_METADATA_NAME_BYTES`] bytes, no control character, no `;`).
    pub fn jwt_authn(name: &str) -> Result<ClaimOrigin, ClaimOriginError> {
        let name = name.trim();
        if name.is_empty() {
            return Err(ClaimOriginError::EmptyName);
        }
        if name.len() > MAX_METADATA_NAME_BYTES {
            return Err(ClaimOriginError::NameTooLong);
        }
        if let Some(bad) = name.chars().find(|c| c.is_control() || *c == ';') {
            return Err(ClaimOriginError::ForbiddenCharacter {
                name: name.to_string(),
                bad,
            });
        }
        Ok(ClaimOrigin::JwtAuthn(name.to_string()))
    }

    /// Whether `path` can be looked up from here: a metadata path is handed to the host
    /// NUL-separated, so no segment may hold a NUL.
    pub fn check(&self, path: &ClaimPath) -> Result<(), ClaimOriginError> {
        match self {
            ClaimOrigin::Bearer => Ok(()),
            ClaimOrigin::JwtAuthn(_) if path.segments().iter().any(|s| s.contains('\0')) => {
                Err(ClaimOriginError::NulInMetadataPath)
            }
            ClaimOrigin::JwtAuthn(_) => Ok(()),
        }
    }

    /// As `diana check` and a rule's id show it: `None` for the bearer token (so ids of
    /// rules that read the header did not change), `jwt_authn:NAME` otherwise.
    pub fn describe(&self) -> Option<String> {
        match self {
            ClaimOrigin::Bearer => None,
            ClaimOrigin::JwtAuthn(name) => Some(format!("jwt_authn:{name}")),
        }
    }
}

/// Why a claim's origin (`from: {jwt_authn: NAME}`) was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOriginError {
    EmptyName,
    /// Longer than [`MAX_METADATA_NAME_BYTES`].
    NameTooLong,
    /// A control character or `;` in the name.
    ForbiddenCharacter {
        name: String,
        bad: char,
    },
    /// A claim path with a NUL, which the host's NUL-separated metadata path cannot carry.
    NulInMetadataPath,
}

impl fmt::Display for ClaimOriginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClaimOriginError::EmptyName => f.write_str("empty `payload_in_metadata` name"),
            ClaimOriginError::NameTooLong => write!(
                f,
                "a `payload_in_metadata` name has at most {MAX_METADATA_NAME_BYTES} bytes"
            ),
            ClaimOriginError::ForbiddenCharacter { name, bad } => write!(
                f,
                "invalid `payload_in_metadata` name `{}`: character {bad:?} is not allowed",
                name.escape_debug()
            ),
            ClaimOriginError::NulInMetadataPath => {
                f.write_str("a claim read from jwt_authn's metadata cannot contain a NUL")
            }
        }
    }
}

impl std::error::Error for ClaimOriginError {}

/// A claim and where it is read: the bearer token, or jwt_authn's metadata (an actor's
/// `jwt_claim`, a plan's `by: {jwt_claim}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    path: ClaimPath,
    origin: ClaimOrigin,
    /// From metadata: the payload's name, then the claim's segments.
    metadata_path: Vec<String>,
}

impl Claim {
    pub fn new(path: ClaimPath, origin: ClaimOrigin) -> Claim {
        let metadata_path = match &origin {
            ClaimOrigin::Bearer => Vec::new(),
            ClaimOrigin::JwtAuthn(name) => std::iter::once(name.clone())
                .chain(path.segments())
                .collect(),
        };
        Claim {
            path,
            origin,
            metadata_path,
        }
    }

    pub fn path(&self) -> &ClaimPath {
        &self.path
    }

    pub fn origin(&self) -> &ClaimOrigin {
        &self.origin
    }

    /// The claim's value in `request` (`None`: no token, a malformed one, no such claim);
    /// `Err(NoMetadata)` when it is read from metadata this host does not have.
    pub fn read(&self, request: &dyn RequestFacts) -> Result<Option<Vec<u8>>, NoMetadata> {
        match &self.origin {
            ClaimOrigin::Bearer => Ok(request
                .header("authorization")
                .and_then(|header| claim(bearer(&header, request.bearer_scheme())?, &self.path))),
            ClaimOrigin::JwtAuthn(_) => {
                let path: Vec<&str> = self.metadata_path.iter().map(String::as_str).collect();
                request
                    .filter_metadata(JWT_AUTHN_NAMESPACE, &path)
                    .map(metadata_claim)
            }
        }
    }

    /// As `diana check` shows it: `/sub`, or `/sub from jwt_authn:NAME`.
    pub fn describe(&self) -> String {
        match self.origin.describe() {
            None => self.path.pointer().to_string(),
            Some(origin) => format!("{} from {origin}", self.path.pointer()),
        }
    }
}

/// Where a claim is in a token's payload, kept as a JSON Pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimPath {
    /// Empty: no claim (see [`ClaimPath::matching_nothing`]).
    pointer: String,
}

/// Why a claim's path was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimPathError {
    Empty,
    TooManySegments,
    SegmentTooLong,
    /// A `~` not followed by `0` or `1` in a JSON Pointer.
    BadEscape,
}

impl fmt::Display for ClaimPathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClaimPathError::Empty => f.write_str("empty claim"),
            ClaimPathError::TooManySegments => {
                write!(f, "a claim path has at most {MAX_PATH_SEGMENTS} segments")
            }
            ClaimPathError::SegmentTooLong => {
                write!(f, "a claim name has at most {MAX_SEGMENT_BYTES} bytes")
            }
            ClaimPathError::BadEscape => {
                f.write_str("`~` in a JSON Pointer must be followed by 0 (for ~) or 1 (for /)")
            }
        }
    }
}

impl std::error::Error for ClaimPathError {}

impl ClaimPath {
    /// A claim name (`sub`), or a JSON Pointer (`/org/id`).
    pub fn parse(raw: &str) -> Result<ClaimPath, ClaimPathError> {
        let raw = raw.trim();
        let segments: Vec<String> = match raw.strip_prefix('/') {
            None => vec![raw.to_string()],
            Some(pointer) => pointer.split('/').map(unescape).collect::<Result<_, _>>()?,
        };
        if segments.iter().all(String::is_empty) {
            return Err(ClaimPathError::Empty);
        }
        if segments.len() > MAX_PATH_SEGMENTS {
            return Err(ClaimPathError::TooManySegments);
        }
        if segments.iter().any(|s| s.len() > MAX_SEGMENT_BYTES) {
            return Err(ClaimPathError::SegmentTooLong);
        }
        let pointer = segments
            .iter()
            .map(|segment| format!("/{}", segment.replace('~', "~0").replace('/', "~1")))
            .collect();
        Ok(ClaimPath { pointer })
    }

    /// A path that finds no claim in any token (every request takes the fallback).
    pub fn matching_nothing() -> ClaimPath {
        ClaimPath {
            pointer: String::new(),
        }
    }

    /// The path as a JSON Pointer (`/sub`, `/org/id`): its canonical form.
    pub fn pointer(&self) -> &str {
        &self.pointer
    }

    /// The path's segments, unescaped (`/a~1b/c` is `a/b`, `c`): the keys to walk in
    /// metadata. None for [`ClaimPath::matching_nothing`].
    pub fn segments(&self) -> Vec<String> {
        self.pointer
            .split('/')
            .skip(1)
            .map(|segment| segment.replace("~1", "/").replace("~0", "~"))
            .collect()
    }

    /// The claim's value in `payload`, as the bytes an identity is made of: a string's
    /// text, a number's or a boolean's JSON text. `None` for anything else.
    fn find(&self, payload: &Value) -> Option<Vec<u8>> {
        if self.pointer.is_empty() {
            return None;
        }
        match payload.pointer(&self.pointer)? {
            Value::String(text) if !text.is_empty() => Some(text.as_bytes().to_vec()),
            Value::Number(number) => Some(number.to_string().into_bytes()),
            Value::Bool(flag) => Some(flag.to_string().into_bytes()),
            _ => None,
        }
    }
}

fn unescape(segment: &str) -> Result<String, ClaimPathError> {
    let mut out = String::with_capacity(segment.len());
    let mut chars = segment.chars();
    while let Some(c) = chars.next() {
        if c == '~' {
            match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => return Err(ClaimPathError::BadEscape),
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// The token of an `authorization` header's value, found as the host's verifier finds the
/// token it verifies. Envoy's `jwt_authn` (its default location, `Bearer ` as the value
/// prefix, [`BearerScheme::AsWritten`]): after the first `Bearer ` (as written) anywhere in
/// the value, the first run of base64url characters and dots. Reading it any other way would
/// let a client add to a token that verifies (`Bearer <valid> .x`, `bearer <forged>, Bearer
/// <valid>`) and have Diana read a claim jwt_authn never saw, or none; and a value with no
/// `Bearer ` carries no token for jwt_authn, which lets it through unverified where the
/// token is optional (`bearer <forged>`): none for Diana either. In front of nginx
/// ([`BearerScheme::AnyCase`]) such a value may still start with the scheme in another case
/// (RFC 7235: it is case-insensitive, and verifiers there take it so).
pub fn bearer(value: &[u8], scheme: BearerScheme) -> Option<&[u8]> {
    const PREFIX: &[u8] = b"Bearer ";
    let is_token = |byte: &u8| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.');
    let as_written = value
        .windows(PREFIX.len())
        .position(|window| window == PREFIX);
    let at = match (as_written, scheme) {
        (Some(at), _) => at,
        (None, BearerScheme::AsWritten) => return None,
        (None, BearerScheme::AnyCase) => {
            let start = value.iter().position(|byte| !byte.is_ascii_whitespace())?;
            value
                .get(start..start + PREFIX.len())?
                .eq_ignore_ascii_case(PREFIX)
                .then_some(start)?
        }
    };
    // The first run of token characters after the prefix.
    value
        .get(at + PREFIX.len()..)?
        .split(|byte| !is_token(byte))
        .find(|run| !run.is_empty())
}

/// The claim at `path` in the payload of `token`, unverified (see the module doc).
pub fn claim(token: &[u8], path: &ClaimPath) -> Option<Vec<u8>> {
    if token.len() > MAX_TOKEN_BYTES {
        return None;
    }
    let mut parts = token.split(|&byte| byte == b'.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None; // not a JWS (a JWE has five parts, and its payload is encrypted)
    }
    let payload = payload
        .strip_suffix(b"==")
        .or_else(|| payload.strip_suffix(b"="))
        .unwrap_or(payload);
    let json = URL_SAFE_NO_PAD.decode(payload).ok()?;
    let payload: Value = serde_json::from_slice(&json).ok()?;
    path.find(&payload)
}

/// A claim as the host handed it over from `jwt_authn`'s metadata (see the module doc):
/// its bytes, or `None` when absent, empty or longer than [`MAX_METADATA_VALUE_BYTES`].
pub fn metadata_claim(value: Option<Vec<u8>>) -> Option<Vec<u8>> {
    value.filter(|value| !value.is_empty() && value.len() <= MAX_METADATA_VALUE_BYTES)
}

/// A claim's value as proxy-wasm hands over a leaf of a protobuf `Struct`, for a host that
/// reads metadata by type (Envoy's dynamic modules): so that every Envoy binding counts
/// a claim under the same identity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MetadataLeaf<'a> {
    String(&'a [u8]),
    Number(f64),
    Bool(bool),
}

impl MetadataLeaf<'_> {
    /// The bytes Envoy's proxy-wasm `get_property` returns for this leaf.
    pub fn to_bytes(self) -> Vec<u8> {
        match self {
            MetadataLeaf::String(text) => text.to_vec(),
            MetadataLeaf::Number(number) => number.to_le_bytes().to_vec(),
            MetadataLeaf::Bool(flag) => vec![u8::from(flag)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(payload: &str) -> Vec<u8> {
        let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none"}"#);
        format!("{header}.{}.sig", URL_SAFE_NO_PAD.encode(payload)).into_bytes()
    }

    fn path(raw: &str) -> ClaimPath {
        ClaimPath::parse(raw).unwrap()
    }

    #[test]
    fn claims_are_read_by_name_or_pointer() {
        let payload = r#"{"sub":"alice","https://x.example/tenant":"t1","org":{"id":42,"a/b":true,"t~":"x"},"roles":["admin","ops"],"empty":"","nil":null,"obj":{}}"#;
        let t = token(payload);
        let cases: [(&str, Option<&str>); 12] = [
            ("sub", Some("alice")),
            ("/sub", Some("alice")),
            ("https://x.example/tenant", Some("t1")),
            ("/org/id", Some("42")),
            ("/org/a~1b", Some("true")),
            ("/org/t~0", Some("x")),
            ("/roles/1", Some("ops")),
            ("/roles/2", None),
            ("empty", None),
            ("nil", None),
            ("obj", None),
            ("missing", None),
        ];
        for (raw, expected) in cases {
            let got = claim(&t, &path(raw));
            assert_eq!(got.as_deref(), expected.map(str::as_bytes), "{raw}");
        }
    }

    #[test]
    fn malformed_tokens_have_no_claim() {
        let p = path("sub");
        let good = URL_SAFE_NO_PAD.encode(br#"{"sub":"a"}"#);
        let padded = base64::engine::general_purpose::URL_SAFE.encode(br#"{"sub":"ab"}"#);
        assert_eq!(
            claim(format!("h.{good}.s").as_bytes(), &p).as_deref(),
            Some(&b"a"[..])
        );
        assert_eq!(
            claim(format!("h.{padded}.s").as_bytes(), &p).as_deref(),
            Some(&b"ab"[..])
        );
        for bad in [
            String::new(),
            "onlyone".to_string(),
            format!("h.{good}"),
            format!("h.{good}.s.x.y"),
            "h.!!!.s".to_string(),
            format!("h.{}.s", URL_SAFE_NO_PAD.encode(b"not json")),
            format!("h.{}.s", URL_SAFE_NO_PAD.encode(b"[1,2]")),
            format!("h.{good}.{}", "s".repeat(MAX_TOKEN_BYTES)),
        ] {
            assert_eq!(claim(bad.as_bytes(), &p), None, "{bad:.40}");
        }
    }

    #[test]
    fn the_bearer_token_is_the_one_the_hosts_verifier_verifies() {
        // The value, and the token read on Envoy (jwt_authn) and in front of nginx.
        type Case<'a> = (&'a [u8], Option<&'a [u8]>, Option<&'a [u8]>);
        let h: Option<&[u8]> = Some(b"h.p.s");
        let cases: [Case; 18] = [
            (b"Bearer h.p.s", h, h),
            (b"  Bearer   h.p.s  ", h, h),
            (b"Bearer h-_.p.s9", Some(b"h-_.p.s9"), Some(b"h-_.p.s9")),
            // What follows the token is not part of it: jwt_authn verified `h.p.s` alone.
            (b"Bearer h.p.s .x", h, h),
            (b"Bearer h.p.s,x.y.z", h, h),
            (b"Bearer h.p.s=", h, h),
            // What precedes `Bearer ` is not either, nor a second `Bearer `.
            (b"Basic abc, Bearer h.p.s", h, h),
            (b"Bearer h.p.s, Bearer x.y.z", h, h),
            (b"Bearer  ,h.p.s", h, h),
            // Without `Bearer ` as written jwt_authn finds no token (an optional one lets
            // the request through unchecked): none on Envoy; in front of nginx the scheme
            // in another case, at the start only.
            (b"bearer h.p.s", None, h),
            (b" BEARER h.p.s", None, h),
            (b"bearer x.y.z, Bearer h.p.s", h, h),
            (b"Basic abc, bearer h.p.s", None, None),
            (b"Basic abc", None, None),
            (b"Bearer ", None, None),
            (b"Bearer ,;", None, None),
            (b"Bearer", None, None),
            (b"", None, None),
        ];
        for (value, on_envoy, any_case) in cases {
            let shown = String::from_utf8_lossy(value);
            assert_eq!(
                bearer(value, BearerScheme::AsWritten),
                on_envoy,
                "{shown:?}"
            );
            assert_eq!(bearer(value, BearerScheme::AnyCase), any_case, "{shown:?}");
        }
    }

    #[test]
    fn jwt_authn_origins_are_checked() {
        let cases: [(&str, Result<&str, &str>); 8] = [
            ("jwt_payload", Ok("jwt_payload")),
            (" jwt_payload ", Ok("jwt_payload")),
            (
                "https://issuer.example.com",
                Ok("https://issuer.example.com"),
            ),
            ("", Err("empty")),
            ("  ", Err("empty")),
            ("a;b", Err("';' is not allowed")),
            ("a\nb", Err("'\\n' is not allowed")),
            ("a\u{85}b", Err("is not allowed")),
        ];
        for (raw, expected) in cases {
            match (ClaimOrigin::jwt_authn(raw), expected) {
                (Ok(origin), Ok(name)) => {
                    assert_eq!(origin, ClaimOrigin::JwtAuthn(name.to_string()), "{raw:?}");
                    assert_eq!(origin.describe(), Some(format!("jwt_authn:{name}")));
                }
                (Err(error), Err(piece)) => {
                    assert!(error.to_string().contains(piece), "{raw:?}: {error}")
                }
                (got, _) => panic!("{raw:?}: {got:?}"),
            }
        }
        let long = "n".repeat(MAX_METADATA_NAME_BYTES);
        assert!(ClaimOrigin::jwt_authn(&long).is_ok());
        assert_eq!(
            ClaimOrigin::jwt_authn(&format!("{long}n")),
            Err(ClaimOriginError::NameTooLong)
        );
        assert_eq!(ClaimOrigin::Bearer.describe(), None);
        // A path is handed to the host NUL-separated: no NUL in a segment from metadata.
        let origin = ClaimOrigin::JwtAuthn("p".to_string());
        assert_eq!(
            origin.check(&path("/a\0b")),
            Err(ClaimOriginError::NulInMetadataPath)
        );
        assert!(origin.check(&path("/a/b")).is_ok());
        assert!(ClaimOrigin::Bearer.check(&path("/a\0b")).is_ok());
    }

    #[test]
    fn segments_are_the_unescaped_keys() {
        let cases: [(&str, &[&str]); 5] = [
            ("sub", &["sub"]),
            ("/org/id", &["org", "id"]),
            ("a/b", &["a/b"]),
            ("/a~1b/t~0/~01", &["a/b", "t~", "~1"]),
            ("/roles/0", &["roles", "0"]),
        ];
        for (raw, expected) in cases {
            assert_eq!(path(raw).segments(), expected, "{raw}");
        }
        assert!(ClaimPath::matching_nothing().segments().is_empty());
    }

    /// The bytes Envoy's proxy-wasm `get_property` returns for a leaf (`serializeValue`):
    /// a typed reader (the dynamic module) must produce the same ones.
    #[test]
    fn metadata_leaves_are_serialised_as_proxy_wasm_does() {
        let cases: [(MetadataLeaf<'_>, &[u8]); 6] = [
            (MetadataLeaf::String(b"alice"), b"alice"),
            (MetadataLeaf::Number(42.0), &[0, 0, 0, 0, 0, 0, 0x45, 0x40]),
            (MetadataLeaf::Number(-1.5), &[0, 0, 0, 0, 0, 0, 0xf8, 0xbf]),
            (MetadataLeaf::Bool(true), &[1]),
            (MetadataLeaf::Bool(false), &[0]),
            (MetadataLeaf::String(b""), b""),
        ];
        for (leaf, bytes) in cases {
            assert_eq!(leaf.to_bytes(), bytes, "{leaf:?}");
        }
        // What counts: non-empty and bounded.
        let cases: [(Option<Vec<u8>>, bool); 5] = [
            (Some(b"alice".to_vec()), true),
            (Some(vec![0]), true),
            (Some(Vec::new()), false),
            (None, false),
            (Some(vec![b'x'; MAX_METADATA_VALUE_BYTES + 1]), false),
        ];
        for (value, counts) in cases {
            let len = value.as_ref().map(Vec::len);
            assert_eq!(metadata_claim(value).is_some(), counts, "{len:?}");
        }
        assert!(metadata_claim(Some(vec![b'x'; MAX_METADATA_VALUE_BYTES])).is_some());
    }

    #[test]
    fn paths_are_checked_and_have_one_canonical_form() {
        assert_eq!(path("sub").pointer(), "/sub");
        assert_eq!(path(" /org/id ").pointer(), "/org/id");
        assert_eq!(path("a/b").pointer(), "/a~1b");
        assert_eq!(path("/a~1b").pointer(), "/a~1b");
        assert_eq!(ClaimPath::parse(""), Err(ClaimPathError::Empty));
        assert_eq!(ClaimPath::parse("/"), Err(ClaimPathError::Empty));
        assert_eq!(ClaimPath::parse("/a~2"), Err(ClaimPathError::BadEscape));
        assert_eq!(
            ClaimPath::parse(&"/a".repeat(MAX_PATH_SEGMENTS + 1)),
            Err(ClaimPathError::TooManySegments)
        );
        assert_eq!(
            ClaimPath::parse(&"x".repeat(MAX_SEGMENT_BYTES + 1)),
            Err(ClaimPathError::SegmentTooLong)
        );
    }
}
