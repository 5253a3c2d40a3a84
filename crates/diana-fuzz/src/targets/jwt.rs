//! Bearer-token claims (`actors: {user: {jwt_claim: …}}`): any bytes as a claim's path and
//! as an `authorization` header, and payloads of any JSON. Properties: no panic; a path
//! that parses has one canonical form (its JSON Pointer parses to itself); the claim read
//! from a token is what serde_json's own `Value::pointer` finds in its payload (a
//! non-empty string's text, a number's or boolean's JSON text, else none); the same
//! request always has the same identity; a claim never hashes like the same bytes as a
//! header value.
//! The input is `path \0 payload \0 authorization`.

use crate::rng::Rng;
use crate::Target;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use diana_core::actor::{Fallback, HeaderKind, Identity, JwtClaimKind, SourceKind};
use diana_core::facts::{BearerScheme, RequestFacts};
use diana_core::hash::IdentityHasher;
use diana_core::jwt::{self, ClaimPath};
use serde_json::Value;

struct Facts<'a> {
    authorization: &'a [u8],
    /// How the host's verifier reads the token (Envoy's, or one in front of nginx).
    scheme: BearerScheme,
}

impl RequestFacts for Facts<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        (name == "authorization" || name == "x-claim").then(|| self.authorization.to_vec())
    }
    fn client_ip(&self) -> Option<Vec<u8>> {
        None
    }
    fn bearer_scheme(&self) -> BearerScheme {
        self.scheme
    }
}

pub struct Claims;

const PATHS: [&str; 8] = [
    "sub",
    "/sub",
    "/org/id",
    "/roles/0",
    "/a~1b",
    "/x~0",
    "/",
    "https://a.example/t",
];

/// One of `items` (the first when the list is empty: never).
fn one(rng: &mut Rng, items: &[&'static str]) -> &'static str {
    rng.pick(items).copied().unwrap_or_default()
}

/// Any JSON, nested a few levels, with the keys and scalars the paths above look for.
fn json(rng: &mut Rng, depth: u32) -> String {
    match rng.below(if depth > 3 { 4 } else { 6 }) {
        0 => format!(
            "\"{}\"",
            one(rng, &["alice", "", "b\\u00e9", "x\\\"y", "01"])
        ),
        1 => one(rng, &["0", "-1", "1e999", "3.5", "18446744073709551616"]).to_string(),
        2 => one(rng, &["true", "false"]).to_string(),
        3 => "null".to_string(),
        4 => {
            let items: Vec<String> = (0..rng.index(4)).map(|_| json(rng, depth + 1)).collect();
            format!("[{}]", items.join(","))
        }
        _ => {
            let keys = ["sub", "org", "id", "roles", "a/b", "x~", "0", "t"];
            let items: Vec<String> = (0..rng.index(5))
                .map(|_| format!("\"{}\":{}", one(rng, &keys), json(rng, depth + 1)))
                .collect();
            format!("{{{}}}", items.join(","))
        }
    }
}

impl Target for Claims {
    fn name(&self) -> &'static str {
        "jwt"
    }
    fn weight(&self) -> u64 {
        10
    }
    fn generate(&self, rng: &mut Rng) -> Vec<u8> {
        let path: Vec<u8> = if rng.one_in(4) {
            (0..rng.index(20)).map(|_| rng.byte().max(1)).collect()
        } else {
            one(rng, &PATHS).as_bytes().to_vec()
        };
        let payload = if rng.one_in(8) {
            (0..rng.index(64)).map(|_| rng.byte().max(1)).collect()
        } else {
            json(rng, 0).into_bytes()
        };
        let authorization: Vec<u8> = match rng.below(4) {
            0 => (0..rng.index(100)).map(|_| rng.byte().max(1)).collect(),
            1 => format!("Bearer h.{}.s", String::from_utf8_lossy(&payload)).into_bytes(),
            _ => format!("bearer  h.{}.sig", URL_SAFE_NO_PAD.encode(&payload)).into_bytes(),
        };
        let mut input = path;
        for part in [payload.as_slice(), authorization.as_slice()] {
            input.push(0);
            input.extend_from_slice(part);
        }
        input
    }

    fn run(&self, input: &[u8]) -> Result<(), String> {
        let mut parts = input.splitn(3, |&b| b == 0);
        let (raw_path, payload, authorization) = (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        );
        let Ok(path) = ClaimPath::parse(&String::from_utf8_lossy(raw_path)) else {
            return Ok(());
        };
        if ClaimPath::parse(path.pointer()).as_ref() != Ok(&path) {
            return Err(format!(
                "{:?} is not the canonical form of itself",
                path.pointer()
            ));
        }

        // The claim is what serde_json's own pointer finds.
        let token = format!("h.{}.s", URL_SAFE_NO_PAD.encode(payload));
        let expected = serde_json::from_slice::<Value>(payload)
            .ok()
            .and_then(|value| match value.pointer(path.pointer())? {
                Value::String(text) if !text.is_empty() => Some(text.as_bytes().to_vec()),
                Value::Number(number) => Some(number.to_string().into_bytes()),
                Value::Bool(flag) => Some(flag.to_string().into_bytes()),
                _ => None,
            });
        let found = jwt::claim(token.as_bytes(), &path);
        if found != expected {
            return Err(format!(
                "claim {found:?}, serde_json's pointer finds {expected:?}"
            ));
        }

        // Any authorization header through the actor.
        let hasher = IdentityHasher::configured(b"the fuzzer's identity key, 32+ bytes");
        // Either host's reading, by the input (an even header length: nginx's).
        let scheme = if authorization.len() % 2 == 0 {
            BearerScheme::AnyCase
        } else {
            BearerScheme::AsWritten
        };
        let facts = Facts {
            authorization,
            scheme,
        };
        let actor = JwtClaimKind.build(path.pointer(), Fallback::Skip);
        let identity = actor.source.identify(&facts, &hasher);
        if identity != actor.source.identify(&facts, &hasher) {
            return Err("the same request has two identities".to_string());
        }
        let claimed = jwt::bearer(authorization, scheme).and_then(|token| jwt::claim(token, &path));
        match (&claimed, identity) {
            (Some(value), Identity::Key(key)) => {
                // The same bytes as a header value are another identity.
                let as_header = Facts {
                    authorization: value,
                    scheme,
                };
                let header = HeaderKind.build("x-claim", Fallback::Skip);
                if header.source.identify(&as_header, &hasher) == Identity::Key(key) {
                    return Err("a claim hashed like the same bytes as a header value".to_string());
                }
            }
            (None, Identity::Skip) => {}
            (claimed, identity) => {
                return Err(format!("claim {claimed:?} gave {identity:?}"));
            }
        }
        Ok(())
    }
}
