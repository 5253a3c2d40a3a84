//! Request path normalisation, so that spelling a path differently does not escape a limit.
//!
//! [`normalize`] turns the raw `:path` pseudo-header (bytes, possibly with a query, possibly
//! not UTF-8) into a canonical path, following RFC 3986 §6.2.2:
//!
//! - `?query` and `#fragment` are cut off;
//! - percent-escapes of unreserved characters (`A-Z a-z 0-9 - . _ ~`) are decoded, every
//!   other escape keeps its `%` and gets upper-case hex (`%2f` → `%2F`; an encoded `/` stays
//!   encoded and so stays inside its segment);
//! - a `%` not followed by two hex digits becomes `%25`, and any byte that may not appear
//!   raw in a path (controls, space, `"`, `<`, `>`, `\`, `^`, `` ` ``, `{`, `|`, `}`, bytes ≥ 0x80)
//!   is percent-encoded, so a raw UTF-8 spelling and its encoded spelling agree;
//! - empty segments are dropped (`//` merged), `.` segments removed, `..` removes the
//!   previous segment and never climbs above the root;
//! - the result starts with `/` (added when missing) and has no trailing `/` except the
//!   root itself.
//!
//! So `//sample`, `/sample/./x/..`, `/x/../sample`, `/%73ample`, `/sample/` and
//! `/sample?q=1` all become `/sample`. Work is one pass over the input, the output is at
//! most three times the input plus one byte, and no input makes it panic.

use std::borrow::Cow;

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";

/// Normalises a raw request path (see the module documentation). Borrows the input when it
/// is already normal (the common case: no allocation), allocates otherwise.
pub fn normalize(raw: &[u8]) -> Cow<'_, [u8]> {
    let path = strip_query(raw);
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    let mut out = Vec::with_capacity(path.len().saturating_add(1));
    out.push(b'/');
    for segment in path.split(|&byte| byte == b'/') {
        push_segment(&mut out, segment);
    }
    Cow::Owned(out)
}

/// Normalises a path given as text (the `Url` of a resource block). The result is ASCII.
pub fn normalize_str(raw: &str) -> String {
    match normalize(raw.as_bytes()) {
        Cow::Borrowed(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Cow::Owned(bytes) => String::from_utf8(bytes)
            .unwrap_or_else(|err| String::from_utf8_lossy(err.as_bytes()).into_owned()),
    }
}

/// The path without its `?query` or `#fragment`.
pub fn strip_query(raw: &[u8]) -> &[u8] {
    match raw.iter().position(|&byte| byte == b'?' || byte == b'#') {
        Some(end) => raw.get(..end).unwrap_or(raw),
        None => raw,
    }
}

/// True when `path` is already in the form [`normalize`] produces.
pub fn is_normal(path: &[u8]) -> bool {
    match path {
        [b'/'] => true,
        [b'/', rest @ ..] => rest.split(|&byte| byte == b'/').all(|segment| {
            !segment.is_empty() && segment != b"." && segment != b".." && is_normal_segment(segment)
        }),
        _ => false,
    }
}

/// Every byte plain, every escape upper-case hex of a byte that is not unreserved.
fn is_normal_segment(segment: &[u8]) -> bool {
    let mut rest = segment;
    loop {
        match rest {
            [] => return true,
            [b'%', high, low, tail @ ..] => match (upper_hex_value(*high), upper_hex_value(*low)) {
                (Some(high), Some(low)) if !is_unreserved(high << 4 | low) => rest = tail,
                _ => return false,
            },
            [byte, tail @ ..] if is_plain(*byte) => rest = tail,
            _ => return false,
        }
    }
}

fn upper_hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'a'..=b'f' => None,
        _ => hex_value(byte),
    }
}

/// True when the normalised `prefix` covers the normalised `path` on a segment boundary.
pub fn prefix_matches(prefix: &[u8], path: &[u8]) -> bool {
    if prefix == b"/" {
        return true;
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.first() == Some(&b'/'),
        None => false,
    }
}

/// [`prefix_matches`] with ASCII letters compared without regard to case (a resource's
/// `path: {case_insensitive: true}`, for a backend that serves `/Admin` as `/admin`).
/// Escapes are upper-case hex on both normalised sides, so they compare alike anyway.
pub fn prefix_matches_ignoring_case(prefix: &[u8], path: &[u8]) -> bool {
    if prefix == b"/" {
        return true;
    }
    match (path.get(..prefix.len()), path.get(prefix.len()..)) {
        (Some(head), Some(rest)) => {
            head.eq_ignore_ascii_case(prefix) && (rest.is_empty() || rest.first() == Some(&b'/'))
        }
        _ => false,
    }
}

/// The normalised `path` without the parameters of its segments (`;jsessionid=…`, as a
/// servlet container reads a path: a segment ends at its first `;`), normalised again, so
/// that a `..;` segment climbs as `..` does (`/public/..;/admin` is `/admin`) and a segment
/// that was only a parameter goes (`/;x/admin` is `/admin`). An escaped `%3B` is part of its
/// segment, not a parameter. Borrows a path without `;` (no allocation).
pub fn strip_parameters(path: &[u8]) -> Cow<'_, [u8]> {
    if !path.contains(&b';') {
        return Cow::Borrowed(path);
    }
    let mut out = Vec::with_capacity(path.len().saturating_add(1));
    out.push(b'/');
    for segment in path.split(|&byte| byte == b'/') {
        let name = segment
            .split(|&byte| byte == b';')
            .next()
            .unwrap_or_default();
        push_segment(&mut out, name);
    }
    Cow::Owned(out)
}

/// [`prefix_matches`] for two normalised urls.
pub fn is_prefix(prefix: &str, path: &str) -> bool {
    prefix_matches(prefix.as_bytes(), path.as_bytes())
}

/// Number of segments of a normalised path: 0 for `/`, 1 for `/a`, 2 for `/a/b`.
pub fn segment_count(path: &[u8]) -> usize {
    match path {
        [] | [b'/'] => 0,
        _ => path.iter().filter(|&&byte| byte == b'/').count(),
    }
}

/// Appends one raw segment to `out` (which is `/` or `/a/b`, never with a trailing `/`),
/// decoding and encoding it, then applies the empty / `.` / `..` rules.
fn push_segment(out: &mut Vec<u8>, segment: &[u8]) {
    let before = out.len();
    if before > 1 {
        out.push(b'/');
    }
    let start = out.len();
    encode_segment(out, segment);
    let written = out.get(start..).unwrap_or_default();
    if written.is_empty() || written == b"." {
        out.truncate(before);
    } else if written == b".." {
        out.truncate(before);
        pop_segment(out);
    }
}

/// Removes the last segment of `out` (`/a/b` → `/a`, `/a` → `/`, `/` stays).
fn pop_segment(out: &mut Vec<u8>) {
    match out.iter().rposition(|&byte| byte == b'/') {
        Some(0) | None => out.truncate(1),
        Some(slash) => out.truncate(slash),
    }
}

fn encode_segment(out: &mut Vec<u8>, segment: &[u8]) {
    let mut rest = segment;
    loop {
        match rest {
            [] => break,
            [b'%', high, low, tail @ ..]
                if hex_value(*high).is_some() && hex_value(*low).is_some() =>
            {
                let value = hex_value(*high).unwrap_or(0) << 4 | hex_value(*low).unwrap_or(0);
                if is_unreserved(value) {
                    out.push(value);
                } else {
                    push_escape(out, value);
                }
                rest = tail;
            }
            [byte, tail @ ..] => {
                if is_plain(*byte) {
                    out.push(*byte);
                } else {
                    push_escape(out, *byte);
                }
                rest = tail;
            }
        }
    }
}

fn push_escape(out: &mut Vec<u8>, value: u8) {
    out.push(b'%');
    for nibble in [value >> 4, value & 0x0f] {
        out.push(HEX_UPPER.get(usize::from(nibble)).copied().unwrap_or(b'0'));
    }
}

fn hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

/// RFC 3986 unreserved: `ALPHA / DIGIT / "-" / "." / "_" / "~"`.
fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

/// A byte that stays as it is inside a normalised segment: unreserved, sub-delims, `:`, `@`.
/// (`%` is not plain: escapes are rewritten, a stray `%` becomes `%25`.)
fn is_plain(byte: u8) -> bool {
    is_unreserved(byte)
        || matches!(
            byte,
            b'!' | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'@'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(raw: &[u8]) -> String {
        String::from_utf8(normalize(raw).into_owned()).expect("normalised paths are ASCII")
    }

    #[test]
    fn normalisation_table() {
        let table: &[(&[u8], &str)] = &[
            (b"/sample", "/sample"),
            (b"//sample", "/sample"),
            (b"///sample//", "/sample"),
            (b"/sample/", "/sample"),
            (b"/sample/./x", "/sample/x"),
            (b"/sample/./x/..", "/sample"),
            (b"/x/../sample", "/sample"),
            (b"/%73ample", "/sample"),
            (b"/%73%61mple", "/sample"),
            (b"/%2e%2e/sample", "/sample"),
            (b"/a/%2E%2E/sample", "/sample"),
            (b"/a/%2e/b", "/a/b"),
            (b"/sample?q=1", "/sample"),
            (b"/sample?q=/../x", "/sample"),
            (b"/sample#frag", "/sample"),
            (b"/sample/?", "/sample"),
            (b"sample", "/sample"),
            (b"", "/"),
            (b"/", "/"),
            (b"?x", "/"),
            (b"//", "/"),
            (b"/.", "/"),
            (b"/..", "/"),
            (b"/../../..", "/"),
            (b"/../sample", "/sample"),
            (b"/a/b/../../../c", "/c"),
            (b"/a/b/c/../../d", "/a/d"),
            (b"/a/./../b", "/b"),
            (b"/...", "/..."),
            (b"/.hidden", "/.hidden"),
            (b"/a..b/c", "/a..b/c"),
            (b"/a%2fb", "/a%2Fb"),
            (b"/a%2Fb", "/a%2Fb"),
            (b"/a%3a", "/a%3A"),
            (b"/%7e%7E~", "/~~~"),
            (b"/%41%5a%30-%5f", "/AZ0-_"),
            (b"/%", "/%25"),
            (b"/%g1", "/%25g1"),
            (b"/%4", "/%254"),
            (b"/100%", "/100%25"),
            (b"/a b", "/a%20b"),
            (b"/caf\xc3\xa9", "/caf%C3%A9"),
            (b"/caf%c3%a9", "/caf%C3%A9"),
            (b"/\xff\x00", "/%FF%00"),
            (b"/a\\b", "/a%5Cb"),
            (b"/x:y@z!$&'()*+,;=", "/x:y@z!$&'()*+,;="),
            (b"/Sample", "/Sample"),
        ];
        for (raw, want) in table {
            assert_eq!(
                norm(raw),
                *want,
                "normalize({:?})",
                String::from_utf8_lossy(raw)
            );
            // Idempotent: a normal path normalises to itself, borrowed.
            let once = normalize(raw).into_owned();
            assert!(is_normal(&once), "{want} should be normal");
            assert!(
                matches!(normalize(&once), Cow::Borrowed(_)),
                "{want} should borrow"
            );
            assert_eq!(normalize(&once).as_ref(), once.as_slice());
        }
    }

    #[test]
    fn spellings_of_sample_agree() {
        for raw in [
            &b"//sample"[..],
            b"/sample/./x/..",
            b"/x/../sample",
            b"/%73ample",
            b"/sample?q=1",
            b"/./sample/",
        ] {
            assert_eq!(normalize(raw).as_ref(), b"/sample");
        }
    }

    #[test]
    fn normal_paths_borrow_without_allocating() {
        let raw = b"/sample/x?y=1";
        match normalize(raw) {
            Cow::Borrowed(bytes) => assert_eq!(bytes, b"/sample/x"),
            Cow::Owned(_) => panic!("a normal path should not allocate"),
        }
    }

    #[test]
    fn text_urls() {
        assert_eq!(normalize_str("/sample/"), "/sample");
        assert_eq!(normalize_str("/café"), "/caf%C3%A9");
        assert_eq!(normalize_str("/"), "/");
    }

    #[test]
    fn segments() {
        assert_eq!(segment_count(b"/"), 0);
        assert_eq!(segment_count(b"/a"), 1);
        assert_eq!(segment_count(b"/a/b"), 2);
    }

    #[test]
    fn random_bytes_never_panic_and_stay_bounded() {
        // A small deterministic generator (xorshift) over an alphabet rich in separators.
        let alphabet: &[u8] = b"/%.?#aA09~-_:@\\ 2eEfF\x00\xff\xc3";
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..20_000 {
            let len = (next() % 64) as usize;
            let raw: Vec<u8> = (0..len)
                .map(|_| {
                    let r = next();
                    if round % 3 == 0 {
                        r as u8
                    } else {
                        alphabet[(r as usize) % alphabet.len()]
                    }
                })
                .collect();
            let out = normalize(&raw).into_owned();
            assert!(out.len() <= raw.len() * 3 + 1, "{raw:?} -> {out:?}");
            assert!(
                is_normal(&out),
                "{raw:?} -> {:?}",
                String::from_utf8_lossy(&out)
            );
            assert!(out.is_ascii());
            assert_eq!(
                normalize(&out).as_ref(),
                out.as_slice(),
                "idempotent for {raw:?}"
            );
        }
    }

    #[test]
    fn parameters_are_stripped_from_every_segment_and_the_path_normalised_again() {
        let table: &[(&[u8], &str)] = &[
            (b"/admin", "/admin"),
            (b"/admin;jsessionid=1A2B", "/admin"),
            (b"/admin;jsessionid=1/users;v=2", "/admin/users"),
            (b"/public/..;/admin", "/admin"),
            (b"/public/..;x=1/admin", "/admin"),
            (b"/;x/admin", "/admin"),
            (b"/.;/admin", "/admin"),
            (b"/admin;", "/admin"),
            (b"/;", "/"),
            (b"/a%3Bb/c", "/a%3Bb/c"),
            (b"/a;b%3Bc/d", "/a/d"),
            (b"/x:y@z!$&'()*+,;=", "/x:y@z!$&'()*+,"),
        ];
        for (normalised, want) in table {
            let normalised = normalize(normalised).into_owned();
            let stripped = strip_parameters(&normalised);
            assert_eq!(
                String::from_utf8_lossy(&stripped),
                *want,
                "strip_parameters({:?})",
                String::from_utf8_lossy(&normalised)
            );
            assert!(is_normal(&stripped), "{want}");
        }
        // Without a `;`, nothing is allocated.
        assert!(matches!(strip_parameters(b"/admin/x"), Cow::Borrowed(_)));
    }

    #[test]
    fn a_prefix_may_match_in_any_case() {
        let table: &[(&str, &str, bool)] = &[
            ("/admin", "/ADMIN", true),
            ("/admin", "/Admin/x", true),
            ("/admin", "/admin", true),
            ("/admin", "/ADMINS", false),
            ("/admin", "/ADMI", false),
            ("/Admin", "/aDMIN/Users", true),
            ("/", "/ANY", true),
            ("/a%2Fb", "/A%2Fb/c", true),
            ("/caf%C3%A9", "/CAF%C3%A9", true),
            ("/admin", "", false),
        ];
        for (prefix, path, want) in table {
            assert_eq!(
                prefix_matches_ignoring_case(prefix.as_bytes(), path.as_bytes()),
                *want,
                "{prefix} vs {path}"
            );
        }
    }

    #[test]
    fn long_inputs_are_linear() {
        let mut raw = Vec::new();
        for _ in 0..50_000 {
            raw.extend_from_slice(b"/a");
        }
        for _ in 0..50_000 {
            raw.extend_from_slice(b"/..");
        }
        assert_eq!(normalize(&raw).as_ref(), b"/");
        let dots = b"/..".repeat(100_000);
        assert_eq!(normalize(&dots).as_ref(), b"/");
    }
}
