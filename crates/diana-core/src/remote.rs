//! Remote configuration (config center), as a pure state machine the root context drives.
//!
//! One worker polls per period: a worker whose tick finds the period over claims the poll
//! in shared data ([`POLL_KEY`]) by compare-and-swap, so N workers make one request, not N.
//! A valid new document is published in shared data ([`DOCUMENT_KEY`]) with a version
//! number, and the version alone in a small record of its own ([`VERSION_KEY`]): every
//! worker's tick reads that small record and copies the document out of shared data only
//! when it is newer than its own. Rules whose parameters did not change keep their counters, because a rule's
//! state lives under keys derived from those parameters ([`crate::config::Rule::id`]).
//!
//! Failures (center down, 5xx, invalid document) keep the last good document (or the local
//! one if there never was one); the switch from healthy to failing and back is logged once
//! and counted. `ETag` / `If-None-Match` are honoured; `304` means unchanged.

use crate::config::{parse_policy, Policy, RemoteSpec};
use crate::store::{decode_u64, SharedData, Store};
use crate::time::{Nanos, NANOS_PER_SECOND};

/// Shared-data key holding the next time a poll is due (claimed by CAS).
pub const POLL_KEY: &str = "diana/remote/next_poll";
/// Shared-data key holding the last good remote document: version, ETag and text.
pub const DOCUMENT_KEY: &str = "diana/remote/document";
/// Shared-data key holding the version of the published document alone.
pub const VERSION_KEY: &str = "diana/remote/version";
/// Largest remote document accepted.
pub const MAX_DOCUMENT_BYTES: usize = 1 << 20;

/// A remote document as published in shared data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub version: u64,
    pub etag: Option<String>,
    pub text: String,
}

impl Published {
    /// `version (8 bytes LE) | etag length (4 bytes LE) | etag | text`.
    pub fn encode(&self) -> Vec<u8> {
        let etag = self.etag.as_deref().unwrap_or("").as_bytes();
        let mut bytes = Vec::with_capacity(12 + etag.len() + self.text.len());
        bytes.extend_from_slice(&self.version.to_le_bytes());
        bytes.extend_from_slice(&(etag.len() as u32).to_le_bytes());
        bytes.extend_from_slice(etag);
        bytes.extend_from_slice(self.text.as_bytes());
        bytes
    }

    pub fn decode(bytes: &[u8]) -> Option<Published> {
        let version = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let etag_len = u32::from_le_bytes(bytes.get(8..12)?.try_into().ok()?) as usize;
        let etag = std::str::from_utf8(bytes.get(12..12 + etag_len)?).ok()?;
        let text = std::str::from_utf8(bytes.get(12 + etag_len..)?).ok()?;
        Some(Published {
            version,
            etag: (!etag.is_empty()).then(|| etag.to_string()),
            text: text.to_string(),
        })
    }
}

/// Reads the published remote document, if any.
pub fn read_published(store: &Store, host: &dyn SharedData) -> Option<Published> {
    store
        .read(host, DOCUMENT_KEY)
        .ok()
        .flatten()
        .and_then(|payload| Published::decode(&payload))
}

/// The version of the published remote document (0: none), from its small record.
pub fn published_version(store: &Store, host: &dyn SharedData) -> u64 {
    decode_u64(store.read(host, VERSION_KEY).ok().flatten().as_deref())
}

/// How early a tick may land and still claim the next poll. Ticks jitter by a few
/// milliseconds; without this slack a lone worker would find its tick just short of the
/// deadline and poll every other period.
const TICK_SLACK: Nanos = NANOS_PER_SECOND / 20;

/// Claims this period's poll: true for exactly one worker per period. A claim further
/// ahead than one period comes from a clock that stepped back: it is due, so a clock step
/// never stops the polls for longer than one period.
pub fn claim_poll(store: &Store, host: &dyn SharedData, spec: &RemoteSpec, now: Nanos) -> bool {
    let period = u64::from(spec.poll_seconds.max(1)) * NANOS_PER_SECOND - TICK_SLACK;
    store
        .update(host, POLL_KEY, |current| {
            let due = decode_u64(current);
            if now < due && due - now <= period {
                (None, false)
            } else {
                (
                    Some(now.saturating_add(period).to_le_bytes().to_vec()),
                    true,
                )
            }
        })
        .unwrap_or(false)
}

/// The headers of a poll request.
pub fn poll_headers<'a>(
    spec: &'a RemoteSpec,
    etag: Option<&'a str>,
) -> Vec<(&'static str, &'a str)> {
    let mut headers = vec![
        (":method", "GET"),
        (":path", spec.path.as_str()),
        (":authority", spec.authority.as_str()),
        ("accept", "application/yaml, application/json"),
    ];
    if let Some(etag) = etag {
        headers.push(("if-none-match", etag));
    }
    headers
}

/// What a poll's answer means.
#[derive(Debug)]
pub enum PollOutcome {
    /// A valid new document: publish it and apply it.
    New {
        policy: Box<Policy>,
        text: String,
        etag: Option<String>,
    },
    /// `304`, or the same document again.
    Unchanged,
    /// Center down or error status: keep what we have.
    Failed(String),
    /// The center answered a document that is not valid: keep what we have.
    Rejected(String),
}

/// Interprets a poll's answer. `status` 0 means no response (timeout, connection failure).
pub fn interpret(
    status: u16,
    etag: Option<String>,
    body: &[u8],
    current: Option<&Published>,
) -> PollOutcome {
    match status {
        0 => return PollOutcome::Failed("config center unreachable (no response)".into()),
        304 => return PollOutcome::Unchanged,
        200 => {}
        other => return PollOutcome::Failed(format!("config center answered {other}")),
    }
    if body.len() > MAX_DOCUMENT_BYTES {
        return PollOutcome::Rejected(format!(
            "invalid remote document: {} bytes exceeds {MAX_DOCUMENT_BYTES}",
            body.len()
        ));
    }
    let text = match std::str::from_utf8(body) {
        Ok(text) => text,
        Err(error) => {
            return PollOutcome::Rejected(format!("invalid remote document: not UTF-8: {error}"))
        }
    };
    if current.is_some_and(|published| published.text == text) {
        return PollOutcome::Unchanged;
    }
    match parse_policy(text) {
        Ok(policy) => PollOutcome::New {
            policy: Box::new(policy),
            text: text.to_string(),
            etag,
        },
        Err(error) => PollOutcome::Rejected(format!("invalid remote document: {error}")),
    }
}

/// Publishes a new document with the next version, then the version in its own record;
/// returns the version.
pub fn publish(
    store: &Store,
    host: &dyn SharedData,
    text: &str,
    etag: Option<String>,
) -> Option<u64> {
    let version = store
        .update(host, DOCUMENT_KEY, |current| {
            let version = current
                .and_then(Published::decode)
                .map(|p| p.version)
                .unwrap_or(0)
                + 1;
            let published = Published {
                version,
                etag: etag.clone(),
                text: text.to_string(),
            };
            (Some(published.encode()), version)
        })
        .ok()?;
    store
        .update(host, VERSION_KEY, |current| {
            // Never backwards: two publishers may finish out of order.
            let newest = decode_u64(current).max(version);
            (Some(newest.to_le_bytes().to_vec()), ())
        })
        .ok()?;
    Some(version)
}

/// Shared-data key holding the hash of the last invalid document refused.
pub const REJECTED_KEY: &str = "diana/remote/rejected";

/// Remembers an invalid document's hash; true the first time this document is refused
/// (by any worker), so each bad document is logged with its reason once, not every poll.
pub fn first_rejection(store: &Store, host: &dyn SharedData, body: &[u8]) -> bool {
    let digest = crate::hash::hash64(0x7265_6a65_6374, body)
        .to_le_bytes()
        .to_vec();
    store
        .update(host, REJECTED_KEY, |current| {
            if current == Some(digest.as_slice()) {
                (None, false)
            } else {
                (Some(digest.clone()), true)
            }
        })
        .unwrap_or(false)
}

/// Shared-data key holding whether the config center is failing (1) or healthy (0).
pub const HEALTH_KEY: &str = "diana/remote/failing";

/// Records a poll result in shared data; true when this call switched the state between
/// healthy and failing, so exactly one worker logs each switch.
pub fn record_health(store: &Store, host: &dyn SharedData, ok: bool) -> bool {
    let failing = u8::from(!ok);
    store
        .update(host, HEALTH_KEY, |current| {
            let before = current.and_then(|b| b.first().copied()).unwrap_or(0);
            if before == failing {
                (None, false)
            } else {
                (Some(vec![failing]), true)
            }
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{CasSemantics, MemoryHost};

    const GOOD: &str = "Url: /\nrules:\n  - rpu: 5\n";

    fn spec() -> RemoteSpec {
        RemoteSpec {
            cluster: "diana_config".into(),
            authority: "config".into(),
            path: "/diana.yaml".into(),
            poll_seconds: 10,
        }
    }

    #[test]
    fn one_worker_polls_per_period() {
        for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
            let host = MemoryHost::new(semantics);
            let workers: Vec<Store> = (0..4).map(|_| Store::new()).collect();
            let now = 100 * NANOS_PER_SECOND;
            let claims = workers
                .iter()
                .filter(|w| claim_poll(w, &host, &spec(), now))
                .count();
            assert_eq!(claims, 1);
            let later = now + 9 * NANOS_PER_SECOND;
            assert_eq!(
                workers
                    .iter()
                    .filter(|w| claim_poll(w, &host, &spec(), later))
                    .count(),
                0
            );
            // A clock that stepped back a minute finds a claim it cannot explain: due.
            assert_eq!(
                workers
                    .iter()
                    .filter(|w| claim_poll(w, &host, &spec(), now - 60 * NANOS_PER_SECOND))
                    .count(),
                1
            );
            // The next tick may land a little early and still claims the poll.
            let next = now + 10 * NANOS_PER_SECOND - 3 * NANOS_PER_SECOND / 1000;
            assert_eq!(
                workers
                    .iter()
                    .filter(|w| claim_poll(w, &host, &spec(), next))
                    .count(),
                1
            );
        }
    }

    #[test]
    fn answers_are_interpreted() {
        assert!(matches!(
            interpret(0, None, b"", None),
            PollOutcome::Failed(_)
        ));
        assert!(matches!(
            interpret(503, None, GOOD.as_bytes(), None),
            PollOutcome::Failed(_)
        ));
        assert!(matches!(
            interpret(304, None, b"", None),
            PollOutcome::Unchanged
        ));
        assert!(matches!(
            interpret(200, None, b"rules: [[[", None),
            PollOutcome::Rejected(_)
        ));
        assert!(matches!(
            interpret(200, None, b"\xff\xfe", None),
            PollOutcome::Rejected(_)
        ));
        match interpret(200, Some("\"v1\"".into()), GOOD.as_bytes(), None) {
            PollOutcome::New { etag, text, .. } => {
                assert_eq!(etag.as_deref(), Some("\"v1\""));
                assert_eq!(text, GOOD);
            }
            other => panic!("{other:?}"),
        }
        let published = Published {
            version: 3,
            etag: None,
            text: GOOD.into(),
        };
        assert!(matches!(
            interpret(200, None, GOOD.as_bytes(), Some(&published)),
            PollOutcome::Unchanged
        ));
        let huge = vec![b'#'; MAX_DOCUMENT_BYTES + 1];
        assert!(matches!(
            interpret(200, None, &huge, None),
            PollOutcome::Rejected(_)
        ));
    }

    #[test]
    fn published_documents_round_trip_with_increasing_versions() {
        let host = MemoryHost::new(CasSemantics::Nginx);
        let store = Store::new();
        assert_eq!(publish(&store, &host, GOOD, Some("e1".into())), Some(1));
        assert_eq!(
            publish(&store, &host, "Url: /x\nrules: [{rpu: 1}]\n", None),
            Some(2)
        );
        let published = read_published(&store, &host).unwrap();
        assert_eq!(published.version, 2);
        assert_eq!(published_version(&store, &host), 2);
        assert_eq!(published.etag, None);
        assert!(Published::decode(b"short").is_none());
    }

    #[test]
    fn each_invalid_document_is_reported_once() {
        let host = MemoryHost::new(CasSemantics::Envoy);
        let (a, b) = (Store::new(), Store::new());
        assert!(first_rejection(&a, &host, b"garbage"));
        assert!(!first_rejection(&b, &host, b"garbage"));
        assert!(first_rejection(&b, &host, b"other garbage"));
    }

    #[test]
    fn health_switches_are_reported_once_across_workers() {
        let host = MemoryHost::new(CasSemantics::Nginx);
        let (a, b) = (Store::new(), Store::new());
        assert!(!record_health(&a, &host, true));
        assert!(record_health(&a, &host, false));
        assert!(
            !record_health(&b, &host, false),
            "another worker sees it already failing"
        );
        assert!(record_health(&b, &host, true));
        assert!(!record_health(&a, &host, true));
    }
}
