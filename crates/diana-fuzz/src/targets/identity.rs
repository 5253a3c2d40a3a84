//! Identities: header values and client addresses of any bytes. Properties: no panic;
//! surrounding spaces and tabs never change an identity; an empty (or blank) header
//! falls back as configured; the same bytes always give the same identity; a header
//! actor's name is checked (any bytes as a name are refused or accepted, never a panic);
//! a header value never hashes like the same bytes as a client address (kinds are separate
//! domains of the keyed hash); and a whole request with such headers goes through the
//! engine.
//! The input is `name \0 value \0 ip \0 path`.

use crate::rng::Rng;
use crate::Target;
use diana_core::actor::{
    ip_identity, ActorSource, Fallback, HeaderActor, HeaderKind, Identity, SourceKind,
};
use diana_core::config::parse_policy;
use diana_core::cx::Cx;
use diana_core::engine::Engine;
use diana_core::facts::RequestFacts;
use diana_core::hash::IdentityHasher;
use diana_core::metrics::NoMetrics;
use diana_core::store::{CasSemantics, MemoryHost};
use diana_core::time::Instant;

/// One request's facts, from the input.
struct Facts<'a> {
    name: &'a [u8],
    value: &'a [u8],
    ip: &'a [u8],
}

impl RequestFacts for Facts<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        (name.as_bytes() == self.name).then(|| self.value.to_vec())
    }
    fn client_ip(&self) -> Option<Vec<u8>> {
        (!self.ip.is_empty()).then(|| self.ip.to_vec())
    }
}

const DOCUMENT: &str = "resources:
  - Url: /
    rules:
      - {actor: device, rpu: 3, unit: minute, algo: W}
      - {actor: tenant, rpu: 2, unit: second, algo: SW, slices: 4}
  - Url: /a
    rules:
      - {actor: account, rpu: 1, unit: minute, algo: TB}
      - {actor: ip, rpu: 2, unit: second, algo: LB, burst: 1}
actors:
  tenant: {header: x-tenant, fallback: shared}
";

thread_local! {
    static ENGINE: Option<Engine> = parse_policy(DOCUMENT).ok().map(Engine::new);
}

pub struct Identities {
    names: Vec<&'static [u8]>,
}

impl Identities {
    pub fn new() -> Identities {
        Identities {
            names: vec![b"x-device-id", b"x-account-id", b"x-tenant", b"x-other"],
        }
    }
}

impl Default for Identities {
    fn default() -> Self {
        Identities::new()
    }
}

fn bytes(rng: &mut Rng) -> Vec<u8> {
    let len = if rng.one_in(100) {
        rng.index(70_000)
    } else {
        rng.index(40)
    };
    let blank = rng.one_in(8);
    (0..len)
        .map(|_| {
            if blank {
                *rng.pick(b" \t").unwrap_or(&b' ')
            } else if rng.one_in(3) {
                *rng.pick(b" \t\r\n\x00\xff:.,;=").unwrap_or(&b' ')
            } else {
                rng.byte()
            }
        })
        .collect()
}

fn split(input: &[u8]) -> Vec<&[u8]> {
    input.splitn(4, |&b| b == 0).collect()
}

impl Target for Identities {
    fn name(&self) -> &'static str {
        "identity"
    }
    fn weight(&self) -> u64 {
        20
    }
    fn generate(&self, rng: &mut Rng) -> Vec<u8> {
        let name: Vec<u8> = if rng.one_in(4) {
            bytes(rng)
                .into_iter()
                .filter(|&b| b != 0)
                .take(300)
                .collect()
        } else {
            rng.pick(&self.names)
                .map(|n| n.to_vec())
                .unwrap_or_default()
        };
        let value: Vec<u8> = bytes(rng).into_iter().map(|b| b.max(1)).collect();
        let ip: Vec<u8> = if rng.one_in(2) {
            format!("10.0.{}.{}", rng.below(3), rng.below(3)).into_bytes()
        } else {
            bytes(rng).into_iter().map(|b| b.max(1)).take(64).collect()
        };
        let path = *rng
            .pick(&["/", "/a", "/a/b", "/b", "//a/../a"])
            .unwrap_or(&"/");
        let mut input = name;
        for part in [value.as_slice(), ip.as_slice(), path.as_bytes()] {
            input.push(0);
            input.extend_from_slice(part);
        }
        input
    }

    fn run(&self, input: &[u8]) -> Result<(), String> {
        let parts = split(input);
        let part = |i: usize| parts.get(i).copied().unwrap_or_default();
        let (name, value, ip, path) = (part(0), part(1), part(2), part(3));
        let facts = Facts { name, value, ip };
        let hasher = IdentityHasher::configured(b"the fuzzer's identity key, 32+ bytes");

        // Any bytes as an actor's header name: refused or accepted, and if accepted the
        // actor reads that header (lower-cased).
        let raw_name = String::from_utf8_lossy(name);
        if let Ok(canonical) = HeaderKind.parse_value(&raw_name) {
            let def = HeaderKind.build(&canonical, Fallback::Skip);
            let _ = def.source.identify(&facts, &hasher);
        }

        // A header actor over every fallback.
        let header = String::from_utf8_lossy(name).to_ascii_lowercase();
        for fallback in Fallback::ALL {
            let actor = HeaderActor::new(&header, fallback);
            let identity = actor.identify(&facts, &hasher);
            if identity != actor.identify(&facts, &hasher) {
                return Err("the same request has two identities".to_string());
            }
            let trimmed = value.trim_ascii();
            let padded: Vec<u8> = [b" \t".as_slice(), value, b"\t  "].concat();
            let padded_facts = Facts {
                name,
                value: &padded,
                ip,
            };
            if actor.header().as_bytes() == name
                && actor.identify(&padded_facts, &hasher) != identity
            {
                return Err("spaces around a header value changed its identity".to_string());
            }
            if actor.header().as_bytes() == name && trimmed.is_empty() {
                let expected = fallback.identify(&facts, &hasher);
                if identity != expected {
                    return Err(format!(
                        "a blank header gave {identity:?}, not the {fallback} fallback {expected:?}"
                    ));
                }
            }
            if actor.header().as_bytes() == name
                && !trimmed.is_empty()
                && !matches!(identity, Identity::Key(_))
            {
                return Err(format!("a header value gave {identity:?}"));
            }
            // The same bytes as a client address are another identity.
            let as_address = Facts {
                name: b"",
                value: b"",
                ip: value,
            };
            if actor.header().as_bytes() == name
                && matches!(identity, Identity::Key(_))
                && identity == ip_identity(&as_address, &hasher)
            {
                return Err("a header value hashed like the same bytes as an address".to_string());
            }
        }
        let _ = ip_identity(&facts, &hasher);

        // The whole request through the engine.
        ENGINE.with(|engine| {
            let Some(engine) = engine else {
                return Err("the identity document does not parse".to_string());
            };
            let host = MemoryHost::new(CasSemantics::Envoy);
            let times = [1_767_225_600_000_000_000, 1_767_225_600_500_000_000];
            for now in times.map(Instant::from_unix_nanos) {
                let mut metrics = NoMetrics;
                let mut cx = Cx::new(&host, now, &mut metrics);
                let _ = engine.evaluate(&mut cx, path, &facts);
            }
            Ok(())
        })
    }
}
