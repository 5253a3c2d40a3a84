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
//!
//! A document is judged against the local one (DESIGN §6, [`accept`]): with
//! `remote.signature` it must come with a good signature in [`SIGNATURE_HEADER`], and it
//! may not change what the local document pins ([`crate::config::parse_remote`]). A refused
//! document is kept out like an invalid one, and counted apart.

use crate::config::{parse_remote, ConfigError, ConfigErrorKind, Policy, RemoteError, RemoteSpec};
pub use crate::signature::SIGNATURE_HEADER;
use crate::store::{decode_instant, decode_u64, encode_instant, SharedData, Store};
use crate::time::{Instant, Nanos};

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
    /// The [`SIGNATURE_HEADER`] it came with: every worker checks it again before adopting
    /// the document, against its own local document (which may have gained a key since).
    pub signature: Option<String>,
    pub text: String,
}

impl Published {
    /// `version (8 bytes LE) | etag length (4 bytes LE) | etag | signature length (4 bytes
    /// LE) | signature | text`.
    pub fn encode(&self) -> Vec<u8> {
        let etag = self.etag.as_deref().unwrap_or("").as_bytes();
        let signature = self.signature.as_deref().unwrap_or("").as_bytes();
        let mut bytes = Vec::with_capacity(16 + etag.len() + signature.len() + self.text.len());
        bytes.extend_from_slice(&self.version.to_le_bytes());
        for field in [etag, signature] {
            bytes.extend_from_slice(&(field.len() as u32).to_le_bytes());
            bytes.extend_from_slice(field);
        }
        bytes.extend_from_slice(self.text.as_bytes());
        bytes
    }

    pub fn decode(bytes: &[u8]) -> Option<Published> {
        let version = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let mut rest = bytes.get(8..)?;
        let mut field = || -> Option<Option<String>> {
            let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
            let text = std::str::from_utf8(rest.get(4..4usize.checked_add(len)?)?).ok()?;
            rest = rest.get(4 + len..)?;
            Some((!text.is_empty()).then(|| text.to_string()))
        };
        let etag = field()?;
        let signature = field()?;
        let text = std::str::from_utf8(rest).ok()?;
        Some(Published {
            version,
            etag,
            signature,
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
const TICK_SLACK: Nanos = Nanos::from_millis(50);

/// Claims this period's poll: true for exactly one worker per period.
///
/// A claim up to one period ahead is the normal case, and so is a little more: a worker
/// reads the clock at the start of its tick, and another worker may claim in between with
/// a later reading. Only a claim further ahead than two periods cannot come from this
/// clock running forward (it stepped back): it is due, so a clock step never stops the
/// polls for longer than two periods.
pub fn claim_poll(store: &Store, host: &dyn SharedData, spec: &RemoteSpec, now: Instant) -> bool {
    let period = Nanos::from_secs(u64::from(spec.poll_seconds.max(1))) - TICK_SLACK;
    store
        .update(host, POLL_KEY, |current| {
            let due = decode_instant(current);
            if now < due && due - now <= period.saturating_mul(2) {
                (None, false)
            } else {
                (Some(encode_instant(now.saturating_add(period))), true)
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

/// A poll answer's body: read, or only its size (not read: larger than
/// [`MAX_DOCUMENT_BYTES`], or the status says there is no document).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PollBody {
    Read(Vec<u8>),
    NotRead(usize),
}

impl PollBody {
    /// The bytes read (none when not read).
    pub fn bytes(&self) -> &[u8] {
        match self {
            PollBody::Read(body) => body,
            PollBody::NotRead(_) => &[],
        }
    }
}

fn too_large(size: usize) -> PollOutcome {
    PollOutcome::Rejected(RemoteError::Invalid(ConfigError::of(
        ConfigErrorKind::Invalid {
            reason: format!("{size} bytes exceeds {MAX_DOCUMENT_BYTES}"),
        },
    )))
}

/// What a poll's answer means.
#[derive(Debug)]
pub enum PollOutcome {
    /// A valid new document: publish it and apply it.
    New {
        policy: Box<Policy>,
        text: String,
        etag: Option<String>,
        signature: Option<String>,
    },
    /// `304`, or the same document again.
    Unchanged,
    /// Center down or error status: keep what we have.
    Failed(PollFailure),
    /// The center answered a document that is not valid (or too large): keep what we
    /// have.
    Rejected(RemoteError),
    /// The center answered a valid document that the local one does not let in (DESIGN
    /// §6: it changes a pinned field, or its signature is missing or wrong): keep what we
    /// have. Counted apart (`diana_config_remote_refused`) as well as rejected.
    Refused(RemoteError),
}

/// Why a poll brought no document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollFailure {
    /// No answer: timeout, connection refused or reset.
    Unreachable,
    /// An answer with a status other than 200 or 304.
    Status(u16),
}

impl std::fmt::Display for PollFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PollFailure::Unreachable => f.write_str("config center unreachable (no response)"),
            PollFailure::Status(status) => write!(f, "config center answered {status}"),
        }
    }
}

/// Judges a document from the config center against the local document: its signature
/// first (with `remote.signature`: over the exact bytes received), then
/// [`parse_remote`]. The reason of a refusal names the field, never a secret.
pub fn accept(
    body: &[u8],
    signature: Option<&[u8]>,
    local: &Policy,
) -> Result<Policy, RemoteError> {
    if let Some(key) = local
        .remote
        .as_ref()
        .and_then(|spec| spec.signature.as_ref())
    {
        key.verify(body, signature).map_err(|error| {
            RemoteError::Refused(ConfigError::of(ConfigErrorKind::Signature {
                scheme: key.kind(),
                reason: error.to_string(),
            }))
        })?;
    }
    let text = std::str::from_utf8(body).map_err(|error| {
        RemoteError::Invalid(ConfigError::of(ConfigErrorKind::NotUtf8 {
            reason: error.to_string(),
        }))
    })?;
    parse_remote(text, local)
}

/// Interprets a poll's answer against the local document. `status` 0 means no response
/// (timeout, connection failure); `signature` is the answer's [`SIGNATURE_HEADER`].
pub fn interpret(
    status: u16,
    etag: Option<String>,
    signature: Option<&[u8]>,
    body: &PollBody,
    current: Option<&Published>,
    local: &Policy,
) -> PollOutcome {
    match status {
        0 => return PollOutcome::Failed(PollFailure::Unreachable),
        304 => return PollOutcome::Unchanged,
        200 => {}
        other => return PollOutcome::Failed(PollFailure::Status(other)),
    }
    let body = match body {
        PollBody::Read(body) if body.len() <= MAX_DOCUMENT_BYTES => body.as_slice(),
        PollBody::Read(body) => return too_large(body.len()),
        PollBody::NotRead(size) => return too_large(*size),
    };
    // A header that is not text cannot be a signature; kept as text it could not be
    // published, so it is dropped (and a key, if any, finds the document unsigned).
    let signature = signature.and_then(|value| std::str::from_utf8(value).ok());
    // The same document with the same signature: judged already (and [`adopt`] judges it
    // again against a local document that changed since).
    if current.is_some_and(|published| {
        published.text.as_bytes() == body && published.signature.as_deref() == signature
    }) {
        return PollOutcome::Unchanged;
    }
    match accept(body, signature.map(str::as_bytes), local) {
        Ok(policy) => PollOutcome::New {
            policy: Box::new(policy),
            text: String::from_utf8_lossy(body).into_owned(),
            etag,
            signature: signature.map(str::to_string),
        },
        Err(error @ RemoteError::Invalid(_)) => PollOutcome::Rejected(error),
        Err(error @ RemoteError::Refused(_)) => PollOutcome::Refused(error),
    }
}

/// Adopts a published document (another worker's poll, or this one's before a reload):
/// judged again against this worker's local document.
pub fn adopt(published: &Published, local: &Policy) -> Result<Policy, RemoteError> {
    accept(
        published.text.as_bytes(),
        published.signature.as_deref().map(str::as_bytes),
        local,
    )
}

/// Publishes a new document with the next version, then the version in its own record;
/// returns the version.
pub fn publish(
    store: &Store,
    host: &dyn SharedData,
    text: &str,
    etag: Option<String>,
    signature: Option<String>,
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
                signature: signature.clone(),
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
    fn interpret_bytes(
        status: u16,
        etag: Option<String>,
        signature: Option<&[u8]>,
        body: &[u8],
        current: Option<&Published>,
        local: &Policy,
    ) -> PollOutcome {
        interpret(
            status,
            etag,
            signature,
            &PollBody::Read(body.to_vec()),
            current,
            local,
        )
    }

    use super::*;
    use crate::store::{CasSemantics, MemoryHost};

    const GOOD: &str = "Url: /\nrules:\n  - rpu: 5\n";

    /// The local document the answers are judged against.
    fn local() -> Policy {
        crate::config::parse_policy(
            "resources: [{Url: /, rules: [{rpu: 1}]}]\nremote: {cluster: diana_config, authority: config, path: /diana.yaml}\n",
        )
        .unwrap()
    }

    fn spec() -> RemoteSpec {
        RemoteSpec {
            cluster: "diana_config".into(),
            authority: "config".into(),
            path: "/diana.yaml".into(),
            poll_seconds: 10,
            allow: Vec::new(),
            signature: None,
        }
    }

    #[test]
    fn one_worker_polls_per_period() {
        use crate::time::NANOS_PER_SECOND;
        for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
            let host = MemoryHost::new(semantics);
            let workers: Vec<Store> = (0..4).map(|_| Store::new()).collect();
            let now = Instant::EPOCH + 100 * NANOS_PER_SECOND;
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
            // A worker that read the clock just before another one claimed (its tick
            // started first) finds the claim a little more than one period ahead: not
            // due, it does not poll a second time this period.
            let read_earlier = now - Nanos::from_millis(5);
            assert_eq!(
                workers
                    .iter()
                    .filter(|w| claim_poll(w, &host, &spec(), read_earlier))
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
            let next = now + 10 * NANOS_PER_SECOND - Nanos::from_millis(3);
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
            interpret_bytes(0, None, None, b"", None, &local()),
            PollOutcome::Failed(_)
        ));
        assert!(matches!(
            interpret_bytes(503, None, None, GOOD.as_bytes(), None, &local()),
            PollOutcome::Failed(_)
        ));
        assert!(matches!(
            interpret_bytes(304, None, None, b"", None, &local()),
            PollOutcome::Unchanged
        ));
        assert!(matches!(
            interpret_bytes(200, None, None, b"rules: [[[", None, &local()),
            PollOutcome::Rejected(_)
        ));
        assert!(matches!(
            interpret_bytes(200, None, None, b"\xff\xfe", None, &local()),
            PollOutcome::Rejected(_)
        ));
        match interpret_bytes(
            200,
            Some("\"v1\"".into()),
            None,
            GOOD.as_bytes(),
            None,
            &local(),
        ) {
            PollOutcome::New { etag, text, .. } => {
                assert_eq!(etag.as_deref(), Some("\"v1\""));
                assert_eq!(text, GOOD);
            }
            other => panic!("{other:?}"),
        }
        let published = Published {
            version: 3,
            etag: None,
            signature: None,
            text: GOOD.into(),
        };
        assert!(matches!(
            interpret_bytes(200, None, None, GOOD.as_bytes(), Some(&published), &local()),
            PollOutcome::Unchanged
        ));
        let huge = vec![b'#'; MAX_DOCUMENT_BYTES + 1];
        assert!(matches!(
            interpret_bytes(200, None, None, &huge, None, &local()),
            PollOutcome::Rejected(_)
        ));
        assert!(matches!(
            interpret(200, None, None, &PollBody::NotRead(huge.len()), None, &local()),
            PollOutcome::Rejected(reason) if reason.to_string().contains(&huge.len().to_string())
        ));
    }

    const KEY: &str = "config-center-key-0123456789abcdef0123";

    /// A local document that wants documents signed with `KEY`.
    fn signed_local() -> Policy {
        crate::config::parse_policy(&format!(
            "resources: [{{Url: /, rules: [{{rpu: 1}}]}}]\n\
             global: {{cluster: quota_local}}\n\
             remote: {{cluster: diana_config, path: /diana.yaml, signature: {{hmac_sha256: {KEY}}}}}\n"
        ))
        .unwrap()
    }

    /// What the config center sends in `x-diana-signature`: base64 of HMAC-SHA256(body).
    fn sign(key: &str, body: &[u8]) -> Vec<u8> {
        use base64::Engine as _;
        use hmac::{Hmac, Mac};
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).unwrap();
        mac.update(body);
        base64::engine::general_purpose::STANDARD
            .encode(mac.finalize().into_bytes())
            .into_bytes()
    }

    fn refusal(outcome: PollOutcome) -> String {
        match outcome {
            PollOutcome::Refused(reason) => reason.to_string(),
            other => panic!("should be refused: {other:?}"),
        }
    }

    #[test]
    fn a_signed_document_is_adopted_with_its_signature() {
        let local = signed_local();
        let signature = sign(KEY, GOOD.as_bytes());
        match interpret_bytes(200, None, Some(&signature), GOOD.as_bytes(), None, &local) {
            PollOutcome::New {
                policy,
                signature: kept,
                ..
            } => {
                assert_eq!(
                    kept.as_deref().map(str::as_bytes),
                    Some(signature.as_slice())
                );
                // It left out `global` and `remote`: the local ones.
                assert_eq!(policy.global.cluster, "quota_local");
                assert_eq!(policy.remote, local.remote);
                assert_eq!(policy.rules().next().map(|r| r.limit.rpu.get()), Some(5));
            }
            other => panic!("{other:?}"),
        }
        // Published with it, the same answer again changes nothing.
        let published = Published {
            version: 1,
            etag: None,
            signature: String::from_utf8(signature.clone()).ok(),
            text: GOOD.into(),
        };
        assert!(matches!(
            interpret_bytes(
                200,
                None,
                Some(&signature),
                GOOD.as_bytes(),
                Some(&published),
                &local
            ),
            PollOutcome::Unchanged
        ));
        assert!(adopt(&published, &local).is_ok());
    }

    #[test]
    fn an_unsigned_or_badly_signed_document_is_refused() {
        let local = signed_local();
        let body = GOOD.as_bytes();
        let unsigned = refusal(interpret_bytes(200, None, None, body, None, &local));
        assert!(
            unsigned.contains("remote.signature (hmac_sha256): unsigned"),
            "{unsigned}"
        );
        let other_key = sign("another-key-0123456789abcdef0123456789", body);
        let wrong = refusal(interpret_bytes(
            200,
            None,
            Some(&other_key),
            body,
            None,
            &local,
        ));
        assert!(wrong.contains("does not verify"), "{wrong}");
        let garbage = refusal(interpret_bytes(200, None, Some(b"%%%"), body, None, &local));
        assert!(garbage.contains("not a signature"), "{garbage}");
        let binary = refusal(interpret_bytes(
            200,
            None,
            Some(b"\xff\xfe"),
            body,
            None,
            &local,
        ));
        assert!(binary.contains("unsigned"), "{binary}");
        for reason in [unsigned, wrong, garbage, binary] {
            assert!(reason.starts_with("remote document refused: "), "{reason}");
            assert!(!reason.contains(KEY), "{reason}");
        }
        // Even a document that is invalid anyway: the signature is checked first.
        assert!(matches!(
            interpret_bytes(200, None, None, b"rules: [[[", None, &local),
            PollOutcome::Refused(_)
        ));
    }

    #[test]
    fn a_document_modified_after_signing_is_refused() {
        let local = signed_local();
        let signature = sign(KEY, GOOD.as_bytes());
        let modified = GOOD.replace("rpu: 5", "rpu: 500000");
        let reason = refusal(interpret_bytes(
            200,
            None,
            Some(&signature),
            modified.as_bytes(),
            None,
            &local,
        ));
        assert!(reason.contains("does not verify"), "{reason}");
        // A trailing newline is a modification too.
        let longer = format!("{GOOD}\n");
        refusal(interpret_bytes(
            200,
            None,
            Some(&signature),
            longer.as_bytes(),
            None,
            &local,
        ));
    }

    #[test]
    fn a_valid_document_that_changes_what_the_local_one_pins_is_refused() {
        for local in [local(), signed_local()] {
            for (body, field) in [
                (
                    "resources: [{Url: /, rules: [{rpu: 5}]}]\nglobal: {cluster: \"evil:443\"}\n",
                    "global.cluster: ",
                ),
                (
                    "resources: [{Url: /, rules: [{rpu: 5}]}]\ndry_run: true\n",
                    "dry_run: ",
                ),
                (
                    "resources: [{Url: /, rules: [{rpu: 5}]}]\nremote: {cluster: evil, path: /x}\n",
                    "remote.cluster: ",
                ),
            ] {
                let signature = sign(KEY, body.as_bytes());
                let reason = refusal(interpret_bytes(
                    200,
                    None,
                    Some(&signature),
                    body.as_bytes(),
                    None,
                    &local,
                ));
                assert!(
                    reason.starts_with(&format!("remote document refused: {field}")),
                    "{reason}"
                );
            }
        }
    }

    #[test]
    fn ed25519_signed_documents_are_adopted_and_others_refused() {
        use base64::Engine as _;
        use ed25519_dalek::{Signer, SigningKey};
        let b64 = base64::engine::general_purpose::STANDARD;
        let center = SigningKey::from_bytes(&[9u8; 32]);
        let local = crate::config::parse_policy(&format!(
            "resources: [{{Url: /, rules: [{{rpu: 1}}]}}]\n\
             remote: {{cluster: c, path: /p, signature: {{ed25519: \"{}\"}}}}\n",
            b64.encode(center.verifying_key().as_bytes())
        ))
        .unwrap();
        let good = b64.encode(center.sign(GOOD.as_bytes()).to_bytes());
        assert!(matches!(
            interpret_bytes(
                200,
                None,
                Some(good.as_bytes()),
                GOOD.as_bytes(),
                None,
                &local
            ),
            PollOutcome::New { .. }
        ));
        let impostor = SigningKey::from_bytes(&[8u8; 32]);
        let bad = b64.encode(impostor.sign(GOOD.as_bytes()).to_bytes());
        refusal(interpret_bytes(
            200,
            None,
            Some(bad.as_bytes()),
            GOOD.as_bytes(),
            None,
            &local,
        ));
        refusal(interpret_bytes(
            200,
            None,
            None,
            GOOD.as_bytes(),
            None,
            &local,
        ));
        let modified = GOOD.replace('5', "6");
        refusal(interpret_bytes(
            200,
            None,
            Some(good.as_bytes()),
            modified.as_bytes(),
            None,
            &local,
        ));
    }

    #[test]
    fn a_published_document_is_judged_again_by_the_local_document_that_adopts_it() {
        // Published while the local document had no key; the gateway then gained one.
        let published = Published {
            version: 4,
            etag: Some("\"e\"".into()),
            signature: None,
            text: GOOD.into(),
        };
        assert!(adopt(&published, &local()).is_ok());
        assert!(matches!(
            adopt(&published, &signed_local()),
            Err(RemoteError::Refused(_))
        ));
        // The same text, now signed, is a new document (not "unchanged").
        let signature = sign(KEY, GOOD.as_bytes());
        assert!(matches!(
            interpret_bytes(
                200,
                None,
                Some(&signature),
                GOOD.as_bytes(),
                Some(&published),
                &signed_local()
            ),
            PollOutcome::New { .. }
        ));
        // Published documents keep their signature.
        let with_signature = Published {
            signature: Some("c2lnbmF0dXJl".into()),
            ..published
        };
        assert_eq!(
            Published::decode(&with_signature.encode()),
            Some(with_signature)
        );
    }

    #[test]
    fn published_documents_round_trip_with_increasing_versions() {
        let host = MemoryHost::new(CasSemantics::Nginx);
        let store = Store::new();
        assert_eq!(
            publish(&store, &host, GOOD, Some("e1".into()), None),
            Some(1)
        );
        assert_eq!(
            publish(&store, &host, "Url: /x\nrules: [{rpu: 1}]\n", None, None),
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
