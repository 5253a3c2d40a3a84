//! Documents from the config center (DESIGN §6: a remote document cannot redirect or
//! disarm). What the local document says about where the filter connects — `global`'s
//! `cluster`, `authority`, `path` and `token`, the whole `remote` section — and its
//! document-level `dry_run` and `identity_key` are pinned: a remote document that leaves
//! them out inherits the local values, and one that writes a different value is refused,
//! naming the field and its position, unless the local document's `remote.allow` names it
//! (`global`, `remote`, `dry_run`, `identity_key`). `remote.allow` and `remote.signature`
//! are the local document's alone: a remote document may only repeat them unchanged.
//!
//! Which fields are pinned is the description's to say (each field's [`Pin`], declared
//! with the field in `raw`); this module says what "unchanged" means for each of them
//! ([`SLOTS`]) and what a remote document that leaves one out keeps ([`inherit`]).
//!
//! ```text
//!  text ──parse_policy──▶ Policy (valid, as a local document would be)
//!   └──locate::written(pinned ways)──▶ (site, field, value) in text order
//!        └──judge──▶ same as the local value, or allowed ─▶ next
//!                    changed ──locate(site)──▶ Refused(path, line, column)
//!  Policy ──inherit(pinned fields left out)──▶ adopted
//! ```

use super::error::{ConfigError, ConfigErrorKind, PinRefusal, RemoteError};
use super::locate::{locate, written, Stop};
use super::model::{Pinned, Policy, RemoteSpec};
use super::parse::{is_json, parse_policy};
use super::raw::{document, AnyText, IdentityKeyField, PinnedField, SecretField, SignatureField};
use super::shape::{Pin, Way};
use crate::hash::IdentityKey;
use serde::Deserialize;
use std::num::NonZeroU32;

/// Parses a document from the config center against the local document `local`: valid
/// (as [`parse_policy`] would have it), pinned fields unchanged unless allowed, and the
/// pinned fields it leaves out taken from `local`. The signature is checked before this
/// (see [`crate::remote::accept`]).
pub fn parse_remote(text: &str, local: &Policy) -> Result<Policy, RemoteError> {
    let mut policy = parse_policy(text).map_err(RemoteError::Invalid)?;
    let written = check_pins(text, local).map_err(RemoteError::Refused)?;
    inherit(&mut policy, local, &written);
    Ok(policy)
}

/// The pinned fields a remote document writes, by path (`global.cluster`).
struct Written(Vec<String>);

impl Written {
    fn has(&self, path: &str) -> bool {
        self.0.iter().any(|written| written == path)
    }
}

/// The refusal pass: every pinned field the text writes is compared with the local value,
/// in the order the text writes them; the first changed one is refused at its position.
fn check_pins(text: &str, local: &Policy) -> Result<Written, ConfigError> {
    let description = document();
    let pinned = description.pinned();
    let ways: Vec<Vec<Way>> = pinned.iter().map(|(way, _)| way.clone()).collect();
    let json = is_json(text);
    // The text was found valid just before: the reader cannot fail here.
    let found = written(text, json, &ways)
        .map_err(|reason| ConfigError::of(ConfigErrorKind::Invalid { reason }))?;
    let mut paths = Vec::new();
    for (site, index, value) in found {
        let Some((way, field)) = pinned.get(index) else {
            continue;
        };
        let path = dotted(way);
        if let Err(kind) = judge(&path, field.pin, &value, local) {
            let (document, path, position) = locate(text, json, &site, Stop::AfterValue);
            return Err(ConfigError {
                document,
                path,
                position,
                kind,
            });
        }
        paths.push(path);
    }
    Ok(Written(paths))
}

/// `global.cluster`; `[]` for every element of a list, `*` for every entry.
fn dotted(way: &[Way]) -> String {
    let mut path = String::new();
    for step in way {
        match step {
            Way::Key { key, .. } => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
            }
            Way::Element => path.push_str("[]"),
            Way::Entry => path.push_str(".*"),
        }
    }
    path
}

/// Whether a remote document may write `value` for the field at `path`: the same as the
/// local document's, or allowed by its `remote.allow`.
fn judge(
    path: &str,
    pin: Pin,
    value: &serde_json::Value,
    local: &Policy,
) -> Result<(), ConfigErrorKind> {
    let slot = SLOTS.iter().find(|slot| slot.path == path);
    // A field pinned without a slot is refused whatever it says (a test lists them all).
    let same = match slot {
        Some(slot) => {
            (slot.same)(value, local).map_err(|reason| ConfigErrorKind::Invalid { reason })?
        }
        None => false,
    };
    let refusal = match pin {
        Pin::Free => return Ok(()),
        Pin::Pinned(pinned) if allowed(local, pinned.allowed_by()) => return Ok(()),
        _ if same => return Ok(()),
        Pin::Pinned(value) => PinRefusal::Changed {
            value,
            local: slot.and_then(|slot| (slot.shown)(local)),
        },
        Pin::LocalOnly(field) => PinRefusal::LocalOnly(field),
    };
    Err(ConfigErrorKind::Pinned { refusal })
}

/// Whether the local document lets a remote one change `pinned`.
fn allowed(local: &Policy, pinned: Pinned) -> bool {
    local
        .remote
        .as_ref()
        .is_some_and(|remote| remote.allows(pinned))
}

/// What "unchanged" means for one pinned field.
struct Slot {
    /// Its path, as [`dotted`] writes it.
    path: &'static str,
    /// Whether the value written (read as the field's reader reads it) is the local
    /// document's; `Err`: the reader's message.
    same: fn(&serde_json::Value, &Policy) -> Result<bool, String>,
    /// The local value as a refusal shows it; `None` for a secret (never shown), where
    /// the local document has none, or for a field only the local document sets.
    shown: fn(&Policy) -> Option<String>,
}

/// Every pinned field of the description (`raw`), and nothing else.
const SLOTS: [Slot; 12] = [
    Slot {
        path: "global.cluster",
        same: |value, local| Ok(text(value)? == local.global.cluster),
        shown: |local| Some(quoted(&local.global.cluster)),
    },
    Slot {
        path: "global.authority",
        same: |value, local| Ok(text(value)? == local.global.authority),
        shown: |local| Some(quoted(&local.global.authority)),
    },
    Slot {
        path: "global.path",
        same: |value, local| Ok(text(value)? == local.global.path),
        shown: |local| Some(quoted(&local.global.path)),
    },
    Slot {
        path: "global.token",
        same: |value, local| Ok(local.global.token.as_ref() == Some(&read::<SecretField>(value)?.0)),
        // Never the value of either secret.
        shown: |_| None,
    },
    Slot {
        path: "remote.cluster",
        same: |value, local| Ok(remote(local).map(|r| &r.cluster) == Some(&text(value)?)),
        shown: |local| remote(local).map(|r| quoted(&r.cluster)),
    },
    Slot {
        path: "remote.authority",
        same: |value, local| Ok(remote(local).map(|r| &r.authority) == Some(&text(value)?)),
        shown: |local| remote(local).map(|r| quoted(&r.authority)),
    },
    Slot {
        path: "remote.path",
        same: |value, local| Ok(remote(local).map(|r| &r.path) == Some(&text(value)?)),
        shown: |local| remote(local).map(|r| quoted(&r.path)),
    },
    Slot {
        path: "remote.poll_seconds",
        same: |value, local| {
            Ok(remote(local).map(|r| r.poll_seconds) == Some(read::<NonZeroU32>(value)?.get()))
        },
        shown: |local| remote(local).map(|r| r.poll_seconds.to_string()),
    },
    Slot {
        path: "remote.allow",
        // The same names, in any order, repeats ignored.
        same: |value, local| {
            let written = read::<Vec<PinnedField>>(value)?;
            let local = remote(local)
                .map(|r| r.allow.as_slice())
                .unwrap_or_default();
            Ok(written.iter().all(|name| local.contains(&name.0))
                && local
                    .iter()
                    .all(|name| written.iter().any(|w| w.0 == *name)))
        },
        shown: |_| None,
    },
    Slot {
        path: "remote.signature",
        same: |value, local| {
            let written = read::<SignatureField>(value)?.0;
            Ok(remote(local).and_then(|r| r.signature.as_ref()) == Some(&written))
        },
        shown: |_| None,
    },
    Slot {
        path: "dry_run",
        same: |value, local| Ok(read::<bool>(value)? == local.dry_run),
        shown: |local| Some(local.dry_run.to_string()),
    },
    Slot {
        path: "identity_key",
        same: |value, local| {
            let key = read::<IdentityKeyField>(value)?.0;
            Ok(local.identity_key() == Some(IdentityKey::derive(key.expose().as_bytes())))
        },
        // Never the value of either secret.
        shown: |_| None,
    },
];

/// A written value as the field's reader reads it.
fn read<'v, T: Deserialize<'v>>(value: &'v serde_json::Value) -> Result<T, String> {
    T::deserialize(value).map_err(|error| error.to_string())
}

/// A written text value (cluster, authority, path), as written.
fn text(value: &serde_json::Value) -> Result<String, String> {
    read::<AnyText>(value).map(|text| text.0)
}

/// A text value as a refusal shows it.
fn quoted(text: &str) -> String {
    format!("{text:?}")
}

fn remote(local: &Policy) -> Option<&RemoteSpec> {
    local.remote.as_ref()
}

/// Takes every pinned field the remote document leaves out from the local document, and
/// `remote.allow` and `remote.signature` always.
fn inherit(policy: &mut Policy, local: &Policy, written: &Written) {
    let (global, base) = (&mut policy.global, &local.global);
    if !written.has("global.cluster") {
        global.cluster.clone_from(&base.cluster);
    }
    if !written.has("global.authority") {
        global.authority.clone_from(&base.authority);
    }
    if !written.has("global.path") {
        global.path.clone_from(&base.path);
    }
    if !written.has("global.token") {
        global.token.clone_from(&base.token);
    }
    if !written.has("dry_run") {
        policy.dry_run = local.dry_run;
    }
    if !written.has("identity_key") {
        policy.set_identity_key(local.identity_key());
    }
    match (&mut policy.remote, &local.remote) {
        (None, base) => policy.remote.clone_from(base),
        (Some(spec), Some(base)) => {
            let moved = written.has("remote.cluster") && spec.cluster != base.cluster;
            if !written.has("remote.cluster") {
                spec.cluster.clone_from(&base.cluster);
            }
            // Left out, `authority` is the cluster's name: the local one's unless the
            // cluster itself was (allowed to be) changed.
            if !written.has("remote.authority") && !moved {
                spec.authority.clone_from(&base.authority);
            }
            if !written.has("remote.path") {
                spec.path.clone_from(&base.path);
            }
            if !written.has("remote.poll_seconds") {
                spec.poll_seconds = base.poll_seconds;
            }
            spec.allow.clone_from(&base.allow);
            spec.signature.clone_from(&base.signature);
        }
        (Some(spec), None) => {
            spec.allow.clear();
            spec.signature = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{LocalOnly, PinnedValue};
    use crate::secret::Secret;

    const TOKEN: &str = "local-token-0123456789abcdef0123456789";
    const IDENTITY: &str = "local-identity-0123456789abcdef012345";

    /// A local document with every pinned field set, `more` added to its `remote` section.
    fn local_with(more: &str) -> Policy {
        let text = format!(
            "resources:\n  - Url: /\n    rules: [{{rpu: 10}}]\n\
             global: {{cluster: quota_local, authority: quota.local, path: /v1/acquire, token: {TOKEN}}}\n\
             remote: {{cluster: diana_config, authority: config, path: /diana.yaml, poll_seconds: 30{more}}}\n\
             identity_key: {IDENTITY}\n"
        );
        parse_policy(&text).unwrap_or_else(|error| panic!("{error}\n{text}"))
    }

    fn local() -> Policy {
        local_with("")
    }

    fn adopted(text: &str, local: &Policy) -> Policy {
        parse_remote(text, local).unwrap_or_else(|error| panic!("{error}\n---\n{text}"))
    }

    fn refused(text: &str, local: &Policy) -> String {
        match parse_remote(text, local) {
            Err(RemoteError::Refused(error)) => error.to_string(),
            other => panic!("should be refused: {other:?}\n---\n{text}"),
        }
    }

    /// The pin pass knows what "unchanged" means for every field the description pins, and
    /// for no other; and the pinned fields are those DESIGN §6 names.
    #[test]
    fn every_pinned_field_has_a_slot_and_every_slot_a_pinned_field() {
        let description = document();
        let mut pinned: Vec<String> = description
            .pinned()
            .iter()
            .map(|(way, _)| dotted(way))
            .collect();
        pinned.sort();
        let mut slots: Vec<&str> = SLOTS.iter().map(|slot| slot.path).collect();
        slots.sort();
        assert_eq!(pinned, slots);
        assert_eq!(
            slots,
            [
                "dry_run",
                "global.authority",
                "global.cluster",
                "global.path",
                "global.token",
                "identity_key",
                "remote.allow",
                "remote.authority",
                "remote.cluster",
                "remote.path",
                "remote.poll_seconds",
                "remote.signature",
            ]
        );
    }

    #[test]
    fn a_remote_document_that_omits_the_pinned_fields_inherits_the_local_ones() {
        let local = local();
        for text in [
            "Url: /\nrules: [{rpu: 5}]\n",
            "- Url: /\n  rules: [{rpu: 5}]\n",
            "resources: [{Url: /, rules: [{rpu: 5}]}]\nglobal: {timeout_ms: 20, lease: 4}\n",
            "{\"resources\": [{\"Url\": \"/\", \"rules\": [{\"rpu\": 5}]}], \"global\": {\"timeout_ms\": 20}}",
            "Url: /\nrules: [{rpu: 5}]\n---\nglobal: {timeout_ms: 20}\n",
        ] {
            let policy = adopted(text, &local);
            assert_eq!(policy.rules().next().map(|rule| rule.limit.rpu.get()), Some(5));
            assert_eq!(
                (
                    policy.global.cluster.as_str(),
                    policy.global.authority.as_str(),
                    policy.global.path.as_str()
                ),
                ("quota_local", "quota.local", "/v1/acquire"),
                "{text}"
            );
            assert_eq!(policy.global.token, local.global.token, "{text}");
            assert_eq!(policy.remote, local.remote, "{text}");
            assert_eq!(policy.identity_key(), local.identity_key(), "{text}");
            assert!(policy.identity_key().is_some());
            assert!(!policy.dry_run);
        }
        // The remote document's own tunables are its own.
        let policy = adopted(
            "resources: [{Url: /, rules: [{rpu: 5}]}]\nglobal: {timeout_ms: 20}\n",
            &local,
        );
        assert_eq!(policy.global.timeout_ms, 20);
        // A local document in dry run stays in dry run.
        let dry = parse_policy(
            "resources: [{Url: /, rules: [{rpu: 1}]}]\nremote: {cluster: c, path: /d}\ndry_run: true\n",
        )
        .unwrap();
        assert!(adopted("Url: /\nrules: [{rpu: 5}]\n", &dry).dry_run);
    }

    #[test]
    fn a_remote_document_may_repeat_the_pinned_values_unchanged() {
        let local = local();
        let text = format!(
            "resources: [{{Url: /, rules: [{{rpu: 5}}]}}]\n\
             global: {{cluster: quota_local, authority: quota.local, path: /v1/acquire, token: {TOKEN}}}\n\
             remote: {{cluster: diana_config, authority: config, path: /diana.yaml}}\n\
             identity_key: {IDENTITY}\ndry_run: false\n"
        );
        let policy = adopted(&text, &local);
        // `poll_seconds` left out of the section: the local 30, not the default 10.
        assert_eq!(policy.remote, local.remote);
    }

    #[test]
    fn a_remote_document_that_redirects_global_callouts_is_refused_naming_the_field() {
        let local = local();
        let cases: &[(&str, &[&str])] = &[
            (
                "resources: [{Url: /, rules: [{rpu: 5}]}]\nglobal:\n  timeout_ms: 20\n  cluster: \"evil:443\"\n",
                &["global.cluster: a remote document may not change where the quota service is called", "\"quota_local\"", "remote.allow: [global]", "at line 4 column 12"],
            ),
            (
                "resources: [{Url: /, rules: [{rpu: 5}]}]\nglobal: {authority: evil}\n",
                &["global.authority: ", "at line 2 column 21"],
            ),
            (
                "resources: [{Url: /, rules: [{rpu: 5}]}]\nglobal: {path: /steal}\n",
                &["global.path: ", "\"/v1/acquire\""],
            ),
            (
                "Url: /\nrules: [{rpu: 5}]\n---\nglobal: {cluster: evil}\n",
                &["document 2: global.cluster: "],
            ),
            (
                "{\"resources\": [{\"Url\": \"/\", \"rules\": [{\"rpu\": 5}]}],\n \"global\": {\"cluster\": \"evil\"}}",
                &["global.cluster: ", "at line 2 column"],
            ),
        ];
        for (text, wanted) in cases {
            let message = refused(text, &local);
            for want in *wanted {
                assert!(
                    message.contains(want),
                    "{message:?} lacks {want:?}\n---\n{text}"
                );
            }
        }
    }

    #[test]
    fn a_remote_document_that_changes_a_secret_is_refused_without_either_value() {
        let local = local();
        let other = "remote-secret-0123456789abcdef0123456789";
        for (text, field) in [
            (
                format!(
                    "resources: [{{Url: /, rules: [{{rpu: 5}}]}}]\nglobal: {{token: {other}}}\n"
                ),
                "global.token: a remote document may not change the quota service's credential",
            ),
            (
                format!("resources: [{{Url: /, rules: [{{rpu: 5}}]}}]\nidentity_key: {other}\n"),
                "identity_key: a remote document may not change the identity key",
            ),
        ] {
            let message = refused(&text, &local);
            assert!(message.contains(field), "{message}");
            assert!(message.contains(" at line 2 column "), "{message}");
            assert!(
                !message.contains(other) && !message.contains(TOKEN) && !message.contains(IDENTITY),
                "{message}"
            );
        }
    }

    #[test]
    fn a_remote_document_that_sets_the_blanket_dry_run_is_refused() {
        let local = local();
        let message = refused(
            "resources: [{Url: /, rules: [{rpu: 5}]}]\ndry_run: true\n",
            &local,
        );
        assert!(
            message.starts_with(
                "dry_run: a remote document may not change the document-level dry run"
            ),
            "{message}"
        );
        assert!(
            message.contains("remote.allow: [dry_run]") && message.ends_with("at line 2 column 10"),
            "{message}"
        );
        let message = refused("Url: /\nrules: [{rpu: 5}]\n---\ndry_run: true\n", &local);
        assert!(message.starts_with("document 2: dry_run: "), "{message}");
        // A rule's own dry run is the remote document's to set, like its rpu.
        let policy = adopted("Url: /\nrules: [{rpu: 5, dry_run: true}]\n", &local);
        assert!(!policy.dry_run && policy.rules().all(|rule| rule.dry_run));
    }

    #[test]
    fn a_remote_document_cannot_move_the_config_center_nor_loosen_its_own_checks() {
        let local = local();
        let block = "resources: [{Url: /, rules: [{rpu: 5}]}]\n";
        for (section, want) in [
            ("remote: {cluster: evil, path: /diana.yaml}", "remote.cluster: a remote document may not change where or how often the config center is polled"),
            ("remote: {cluster: diana_config, path: /other.yaml}", "remote.path: "),
            ("remote: {cluster: diana_config, authority: evil, path: /diana.yaml}", "remote.authority: "),
            ("remote: {cluster: diana_config, path: /diana.yaml, poll_seconds: 1}", "remote.poll_seconds: "),
            ("remote: {cluster: diana_config, path: /diana.yaml, allow: [dry_run]}", "remote.allow: only the local document sets remote.allow"),
            (
                "remote: {cluster: diana_config, path: /diana.yaml, signature: {hmac_sha256: remote-key-0123456789abcdef0123456789}}",
                "remote.signature: only the local document sets remote.signature",
            ),
        ] {
            let message = refused(&format!("{block}{section}\n"), &local);
            assert!(message.starts_with(want), "{message}");
            assert!(message.contains(" at line 2 column "), "{message}");
        }
    }

    #[test]
    fn a_refusal_carries_the_value_refused_and_the_local_one_unless_secret() {
        let local = local();
        let block = "resources: [{Url: /, rules: [{rpu: 5}]}]\n";
        let other = "remote-secret-0123456789abcdef0123456789";
        let changed = |value, local: Option<&str>| PinRefusal::Changed {
            value,
            local: local.map(str::to_string),
        };
        for (section, want, allow) in [
            (
                "global: {path: /v1/other}".to_string(),
                changed(PinnedValue::QuotaService, Some("\"/v1/acquire\"")),
                Some(Pinned::Global),
            ),
            (
                format!("global: {{token: {other}}}"),
                changed(PinnedValue::QuotaCredential, None),
                Some(Pinned::Global),
            ),
            (
                "remote: {cluster: diana_config, path: /diana.yaml, poll_seconds: 1}".to_string(),
                changed(PinnedValue::ConfigCenter, Some("30")),
                Some(Pinned::Remote),
            ),
            (
                "dry_run: true".to_string(),
                changed(PinnedValue::DryRun, Some("false")),
                Some(Pinned::DryRun),
            ),
            (
                format!("identity_key: {other}"),
                changed(PinnedValue::IdentityKey, None),
                Some(Pinned::IdentityKey),
            ),
            (
                "remote: {cluster: diana_config, path: /diana.yaml, allow: [global]}".to_string(),
                PinRefusal::LocalOnly(LocalOnly::Allow),
                None,
            ),
        ] {
            match parse_remote(&format!("{block}{section}\n"), &local) {
                Err(RemoteError::Refused(ConfigError {
                    kind: ConfigErrorKind::Pinned { refusal },
                    ..
                })) => {
                    assert_eq!(refusal, want, "{section}");
                    if let PinRefusal::Changed { value, .. } = refusal {
                        assert_eq!(Some(value.allowed_by()), allow, "{section}");
                    }
                }
                other => panic!("should be refused as pinned: {other:?}\n---\n{section}"),
            }
        }
    }

    #[test]
    fn what_the_local_document_allows_a_remote_one_may_change() {
        let local = local_with(", allow: [global, remote, dry_run, identity_key]");
        let other = "remote-secret-0123456789abcdef0123456789";
        let text = format!(
            "resources: [{{Url: /, rules: [{{rpu: 5}}]}}]\n\
             global: {{cluster: elsewhere, token: {other}}}\n\
             remote: {{cluster: center2, path: /v2.yaml, poll_seconds: 5}}\n\
             identity_key: {other}\ndry_run: true\n"
        );
        let policy = adopted(&text, &local);
        assert_eq!(policy.global.cluster, "elsewhere");
        // Left out: the local values.
        assert_eq!(policy.global.authority, "quota.local");
        assert_eq!(
            policy.global.token.as_ref().map(Secret::expose),
            Some(other)
        );
        assert!(policy.dry_run);
        assert_ne!(policy.identity_key(), local.identity_key());
        let remote = policy.remote.as_ref().unwrap();
        assert_eq!(
            (
                remote.cluster.as_str(),
                remote.authority.as_str(),
                remote.path.as_str(),
                remote.poll_seconds
            ),
            ("center2", "center2", "/v2.yaml", 5)
        );
        // The trust settings stay the local document's even so.
        assert_eq!(remote.allow, local.remote.as_ref().unwrap().allow);
        let message = refused(
            "resources: [{Url: /, rules: [{rpu: 5}]}]\nremote: {cluster: c, path: /p, allow: [global]}\n",
            &local,
        );
        assert!(message.starts_with("remote.allow: "), "{message}");
        // Only what is named: `dry_run` alone does not open `global`.
        let local = local_with(", allow: [dry_run]");
        assert!(
            adopted(
                "dry_run: true\nresources: [{Url: /, rules: [{rpu: 5}]}]\n",
                &local
            )
            .dry_run
        );
        refused(
            "resources: [{Url: /, rules: [{rpu: 5}]}]\nglobal: {cluster: x}\n",
            &local,
        );
    }

    #[test]
    fn an_invalid_remote_document_is_invalid_not_refused() {
        assert!(matches!(
            parse_remote("rules: [[[", &local()),
            Err(RemoteError::Invalid(_))
        ));
        assert!(matches!(
            parse_remote("Url: /\nrules: [{rpu: 0}]\n", &local()),
            Err(RemoteError::Invalid(_))
        ));
    }

    #[test]
    fn the_remote_section_keys_are_checked_with_positions_and_secrets_never_shown() {
        let cases: &[(&str, &str)] = &[
            ("allow: [everything]", "remote.allow[0]: unknown name in remote.allow `everything`, expected one of global, remote, dry_run, identity_key"),
            ("signature: {hmac_sha256: short}", "remote.signature.hmac_sha256: a secret must be at least 32 bytes"),
            ("signature: {md5: x}", "remote.signature: unknown field `md5`, expected `hmac_sha256` or `ed25519`"),
            ("signature: {}", "remote.signature: no signature key"),
            ("signature: {ed25519: bm90IGEga2V5}", "remote.signature.ed25519: an Ed25519 public key is 32 bytes"),
            (
                "signature: {hmac_sha256: 0123456789abcdef0123456789abcdef, ed25519: bm90}",
                "remote.signature: ",
            ),
        ];
        for (more, want) in cases {
            let text = format!("resources: [{{Url: /, rules: [{{rpu: 1}}]}}]\nremote:\n  cluster: c\n  path: /p\n  {more}\n");
            let message = parse_policy(&text).map(|_| ()).expect_err(more).to_string();
            assert!(message.starts_with(want), "{message}");
            assert!(message.contains(" at line 5 column "), "{message}");
            assert!(
                !message.contains("0123456789abcdef0123456789abcdef"),
                "{message}"
            );
        }
        let key = "hmac-key-0123456789abcdef0123456789abcdef";
        let policy = local_with(&format!(", signature: {{hmac_sha256: {key}}}"));
        assert_eq!(
            policy
                .remote
                .as_ref()
                .and_then(|r| r.signature.as_ref())
                .map(|s| s.kind()),
            Some("hmac_sha256")
        );
        let shown = format!("{policy:?}");
        for secret in [key, TOKEN, IDENTITY] {
            assert!(!shown.contains(secret), "Debug shows a secret: {shown}");
        }
    }
}
