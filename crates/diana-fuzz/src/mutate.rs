//! Byte-level mutations of a starting input (AFL-style havoc without coverage feedback):
//! bit flips, random and "interesting" bytes, insertions of tokens the formats care
//! about, deletions, duplications, splices from another corpus entry, numbers swapped for
//! boundary values.

use crate::rng::Rng;

/// Tokens that matter to YAML, JSON, paths and the document's fields.
const TOKENS: &[&[u8]] = &[
    b"\n",
    b"\n  ",
    b"\n    - ",
    b": ",
    b"- ",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b"\"",
    b"'",
    b"#",
    b"&a ",
    b"*a",
    b"<<: *a",
    b"!!binary ",
    b"!!str ",
    b"!!int ",
    b"? ",
    b"|\n",
    b">-\n",
    b"---\n",
    b"...\n",
    b"~",
    b"null",
    b"true",
    b"1e999",
    b"-1",
    b"0x10",
    b"0o7",
    b".inf",
    b"\t",
    b"\r\n",
    b"\\u0000",
    b"\\ud800",
    b"\xef\xbb\xbf",
    b"\xff",
    b"\x00",
    b"%",
    b"%2e",
    b"%2F",
    b"/..",
    b"/./",
    b"//",
    b"?",
    b"Url",
    b"url",
    b"resources",
    b"rules",
    b"rpu",
    b"unit",
    b"algo",
    b"scope",
    b"actor",
    b"actors",
    b"header",
    b"fallback",
    b"burst",
    b"slices",
    b"slots",
    b"lease",
    b"name",
    b"dry_run",
    b"response",
    b"status",
    b"body",
    b"headers",
    b"global",
    b"remote",
    b"metrics",
    b"path",
    b"timeout_ms",
    b"retry_seconds",
    b"poll_seconds",
    b"max_wait_seconds",
    b"results",
    b"allowed",
    b"granted",
    b"remaining",
    b"reset_ms",
    b"retry_after_ms",
    b"delay_ms",
    b"error",
];

/// Boundary numbers, as text.
const NUMBERS: &[&[u8]] = &[
    b"0",
    b"1",
    b"-1",
    b"2",
    b"59",
    b"60",
    b"61",
    b"255",
    b"256",
    b"65535",
    b"65536",
    b"100000",
    b"1048576",
    b"1048577",
    b"2147483647",
    b"2147483648",
    b"4294967295",
    b"4294967296",
    b"9223372036854775807",
    b"18446744073709551615",
    b"18446744073709551616",
    b"99999999999999999999999999999",
    b"1.5",
    b"-0",
    b"1e3",
    b"0.0000001",
];

fn is_digit(byte: Option<&u8>) -> bool {
    byte.is_some_and(u8::is_ascii_digit)
}

/// Applies 1–8 random mutations to `data`, with `other` (another corpus entry) for splices.
/// The result is capped at `max_len` bytes.
pub fn mutate(rng: &mut Rng, data: &mut Vec<u8>, other: &[u8], max_len: usize) {
    let rounds = 1 + rng.below(8);
    for _ in 0..rounds {
        let len = data.len();
        let at = rng.index(len + 1);
        match rng.below(11) {
            0 => {
                if let Some(byte) = data.get_mut(at) {
                    *byte ^= 1 << rng.below(8);
                }
            }
            1 => {
                if let Some(byte) = data.get_mut(at) {
                    *byte = rng.byte();
                }
            }
            2 | 3 => {
                if let Some(token) = rng.pick(TOKENS) {
                    data.splice(at..at, token.iter().copied());
                }
            }
            4 => {
                let end = (at + 1 + rng.index(16)).min(len);
                if at < end {
                    data.drain(at..end);
                }
            }
            5 => {
                // Duplicate a range (repetition: deep nesting, long lists).
                let end = (at + 1 + rng.index(64)).min(len);
                if let Some(copy) = data.get(at..end).map(<[u8]>::to_vec) {
                    let times = 1 + rng.index(4);
                    for _ in 0..times {
                        data.splice(at..at, copy.iter().copied());
                    }
                }
            }
            6 => {
                // Splice a range of another entry.
                let from = rng.index(other.len() + 1);
                let to = (from + rng.index(128)).min(other.len());
                if let Some(piece) = other.get(from..to) {
                    data.splice(at..at, piece.iter().copied());
                }
            }
            7 | 8 => {
                // Replace the number under (or after) `at` by a boundary value.
                let start = (at..len).find(|&i| is_digit(data.get(i)));
                if let (Some(start), Some(number)) = (start, rng.pick(NUMBERS)) {
                    let end = (start..len)
                        .find(|&i| !is_digit(data.get(i)))
                        .unwrap_or(len);
                    data.splice(start..end, number.iter().copied());
                }
            }
            9 => {
                let count = 1 + rng.index(8);
                let bytes: Vec<u8> = (0..count).map(|_| rng.byte()).collect();
                data.splice(at..at, bytes);
            }
            _ => {
                // Change indentation at a line start.
                let line = data
                    .get(..at)
                    .and_then(|head| head.iter().rposition(|&b| b == b'\n'))
                    .map_or(0, |i| i + 1);
                if rng.one_in(2) {
                    data.splice(line..line, [b' '; 2]);
                } else if data.get(line) == Some(&b' ') {
                    data.remove(line);
                }
            }
        }
        data.truncate(max_len);
    }
}

/// Random bytes, mostly short.
pub fn random_bytes(rng: &mut Rng, max_len: usize) -> Vec<u8> {
    let cap = max_len.min(1 + rng.index(256));
    let len = rng.index(cap + 1);
    (0..len).map(|_| rng.byte()).collect()
}
