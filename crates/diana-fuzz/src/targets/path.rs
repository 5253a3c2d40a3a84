//! The path normaliser. [`Normalise`]: raw bytes (random, or rich in separators, dots and
//! escapes) → the result is normal, starts with `/`, has no `.`/`..` segment (nothing
//! escapes the root), stays within `3n + 1` bytes, and normalising it again changes
//! nothing. [`Spellings`]: a normal path and a random other spelling of it (unreserved
//! characters percent-encoded in either case, escapes in lower case, `//`, `.` and
//! `x/..` inserted, `..` above the root, a trailing `/`, a query or fragment) → the
//! spelling normalises to the path. The input is `path \0 spelling`.

use crate::rng::Rng;
use crate::Target;
use diana_core::path::{is_normal, normalize};

const ALPHABET: &[u8] = b"/%.?#aAzZ09~-_:@!$&'()*+,;= \\\"<>^`{|}2eEfF\x00\x7f\x80\xc3\xa9\xff";

/// Raw path bytes.
pub struct Normalise;

impl Target for Normalise {
    fn name(&self) -> &'static str {
        "path_normalise"
    }
    fn weight(&self) -> u64 {
        30
    }
    fn generate(&self, rng: &mut Rng) -> Vec<u8> {
        let cap = if rng.one_in(50) { 4_000 } else { 48 };
        let len = rng.index(cap);
        let random = rng.one_in(4);
        (0..len)
            .map(|_| {
                if random {
                    rng.byte()
                } else {
                    rng.pick(ALPHABET).copied().unwrap_or(b'/')
                }
            })
            .collect()
    }
    fn run(&self, input: &[u8]) -> Result<(), String> {
        check_normal(input).map(|_| ())
    }
}

/// Checks what `normalize(raw)` must be; returns it.
fn check_normal(raw: &[u8]) -> Result<Vec<u8>, String> {
    let out = normalize(raw).into_owned();
    let show = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    if out.first() != Some(&b'/') {
        return Err(format!("{:?} does not start with /", show(&out)));
    }
    if !out.is_ascii() || !is_normal(&out) {
        return Err(format!("{:?} is not normal", show(&out)));
    }
    if out
        .split(|&b| b == b'/')
        .skip(1)
        .any(|segment| segment == b"." || segment == b"..")
    {
        return Err(format!("{:?} keeps a dot segment", show(&out)));
    }
    if out.len() > raw.len() * 3 + 1 {
        return Err(format!("{} bytes from {}", out.len(), raw.len()));
    }
    let again = normalize(&out);
    if again.as_ref() != out.as_slice() {
        return Err(format!(
            "not idempotent: {:?} -> {:?}",
            show(&out),
            show(&again)
        ));
    }
    Ok(out)
}

/// A path and another spelling of it.
pub struct Spellings;

const UNRESERVED: &[u8] = b"abcxyzABCXYZ0129-._~";
const OTHER: &[&[u8]] = &[
    b"!", b"$", b"&", b"(", b"*", b"+", b",", b";", b"=", b":", b"@",
];
const ESCAPES: &[&[u8]] = &[
    b"%2F", b"%3F", b"%23", b"%25", b"%20", b"%C3%A9", b"%00", b"%FF",
];

fn hex(rng: &mut Rng, nibble: u8) -> u8 {
    let digit = b"0123456789ABCDEF"
        .get(usize::from(nibble & 15))
        .copied()
        .unwrap_or(b'0');
    if rng.one_in(2) {
        digit.to_ascii_lowercase()
    } else {
        digit
    }
}

/// A normal segment: unreserved and sub-delim characters, escapes of reserved bytes;
/// never `.` or `..`.
fn segment(rng: &mut Rng) -> Vec<u8> {
    loop {
        let mut out = Vec::new();
        for _ in 0..1 + rng.index(6) {
            match rng.below(6) {
                0 => out.extend_from_slice(rng.pick(OTHER).copied().unwrap_or(b"!")),
                1 => out.extend_from_slice(rng.pick(ESCAPES).copied().unwrap_or(b"%2F")),
                _ => out.push(rng.pick(UNRESERVED).copied().unwrap_or(b'a')),
            }
        }
        if out != b"." && out != b".." {
            return out;
        }
    }
}

/// Another spelling of a normal segment.
fn respell(rng: &mut Rng, segment: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = segment;
    while let Some((&byte, tail)) = rest.split_first() {
        if byte == b'%' {
            // An escape: same value, hex digits in either case.
            let digits = tail.get(..2).unwrap_or_default();
            out.push(b'%');
            for &d in digits {
                out.push(if rng.one_in(2) {
                    d.to_ascii_lowercase()
                } else {
                    d
                });
            }
            rest = tail.get(2..).unwrap_or_default();
            continue;
        }
        if UNRESERVED.contains(&byte) && rng.one_in(3) {
            out.push(b'%');
            out.push(hex(rng, byte >> 4));
            out.push(hex(rng, byte));
        } else {
            out.push(byte);
        }
        rest = tail;
    }
    out
}

const DOT: &[&[u8]] = &[b".", b"%2e", b"%2E"];
const DOTDOT: &[&[u8]] = &[b"..", b"%2e%2e", b".%2E", b"%2E."];

impl Target for Spellings {
    fn name(&self) -> &'static str {
        "path_spellings"
    }
    fn weight(&self) -> u64 {
        20
    }
    fn generate(&self, rng: &mut Rng) -> Vec<u8> {
        let segments: Vec<Vec<u8>> = (0..rng.index(6)).map(|_| segment(rng)).collect();
        let mut path = Vec::new();
        for s in &segments {
            path.push(b'/');
            path.extend_from_slice(s);
        }
        if path.is_empty() {
            path.push(b'/');
        }
        let mut spelling = Vec::new();
        // Climbing above the root first changes nothing.
        for _ in 0..rng.below(3) {
            spelling.push(b'/');
            spelling.extend_from_slice(rng.pick(DOTDOT).copied().unwrap_or(b".."));
        }
        for s in &segments {
            for _ in 0..rng.below(3) {
                match rng.below(3) {
                    0 => spelling.push(b'/'),
                    1 => {
                        spelling.push(b'/');
                        spelling.extend_from_slice(rng.pick(DOT).copied().unwrap_or(b"."));
                    }
                    _ => {
                        spelling.push(b'/');
                        let detour = segment(rng);
                        spelling.extend_from_slice(&respell(rng, &detour));
                        spelling.push(b'/');
                        spelling.extend_from_slice(rng.pick(DOTDOT).copied().unwrap_or(b".."));
                    }
                }
            }
            spelling.push(b'/');
            spelling.extend_from_slice(&respell(rng, s));
        }
        if rng.one_in(3) {
            spelling.push(b'/');
        }
        if rng.one_in(3) {
            spelling.push(if rng.one_in(2) { b'?' } else { b'#' });
            spelling.extend_from_slice(b"q=/../x/%2e?#");
        }
        if spelling.first() == Some(&b'/') && rng.one_in(8) {
            spelling.remove(0);
        }
        let mut input = path;
        input.push(0);
        input.extend_from_slice(&spelling);
        input
    }
    fn run(&self, input: &[u8]) -> Result<(), String> {
        let Some(split) = input.iter().position(|&b| b == 0) else {
            return check_normal(input).map(|_| ());
        };
        let (path, spelling) = (
            input.get(..split).unwrap_or_default(),
            input.get(split + 1..).unwrap_or_default(),
        );
        let show = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        if !is_normal(path) {
            return Err(format!("generated path {:?} is not normal", show(path)));
        }
        let out = check_normal(spelling)?;
        if out != path {
            return Err(format!(
                "{:?} normalises to {:?}, not {:?}",
                show(spelling),
                show(&out),
                show(path)
            ));
        }
        Ok(())
    }
}
