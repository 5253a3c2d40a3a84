//! Documents from the config center (DESIGN §6: a remote document cannot redirect or
//! disarm). What the local document says about where the filter connects — `global`'s
//! `cluster`, `authority`, `path` and `token`, the whole `remote` section — and its
//! document-level `dry_run` and `identity_key` are pinned: a remote document that leaves
//! them out inherits the local values, and one that writes a different value is refused,
//! naming the field and its position, unless the local document's `remote.allow` names it
//! (`global`, `remote`, `dry_run`, `identity_key`). `remote.allow` and `remote.signature`
//! are the local document's alone: a remote document may only repeat them unchanged.
//!
//! The check is a pass of its own over the text (after the document was found valid), so
//! that each refusal carries the field path and the line and column of the value, like
//! every other configuration error.

use super::parse::{compose, is_json, parse_policy};
use super::raw::{
    deserialize_str_with, IdentityKeyField, PinnedField, SecretField, SignatureField,
};
use super::{ConfigError, ConfigErrorKind, Pinned, Policy, RemoteSpec};
use crate::hash::IdentityKey;
use serde::de::{
    self, DeserializeSeed, Deserializer, IgnoredAny, IntoDeserializer, MapAccess, SeqAccess,
    Visitor,
};
use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::num::NonZeroU32;

/// Why a remote document was not adopted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteError {
    /// Not a valid document (the same messages as a local one).
    Invalid(ConfigError),
    /// Valid, but it changes what the local document pins, or its signature is missing or
    /// wrong (DESIGN §6).
    Refused(ConfigError),
}

impl RemoteError {
    /// The refusal of the document itself (without what kind of refusal it is).
    pub fn error(&self) -> &ConfigError {
        match self {
            RemoteError::Invalid(error) | RemoteError::Refused(error) => error,
        }
    }

    /// That refusal's message.
    pub fn message(&self) -> String {
        self.error().to_string()
    }
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteError::Invalid(error) => write!(f, "invalid remote document: {error}"),
            RemoteError::Refused(error) => write!(f, "remote document refused: {error}"),
        }
    }
}

impl std::error::Error for RemoteError {}

/// Why a value of a remote document was refused ([`ConfigErrorKind::Pinned`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinRefusal {
    /// A pinned value differs from the local document's, and the local `remote.allow`
    /// does not name it.
    Changed {
        value: PinnedValue,
        /// The local value as the message shows it; `None` for a secret (never shown) or
        /// where the local document has none.
        local: Option<String>,
    },
    /// `remote.allow` or `remote.signature` differs from the local document's: only the
    /// local document sets them.
    LocalOnly(LocalOnly),
}

/// A pinned value, as a refusal names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinnedValue {
    /// `global.cluster`, `global.authority` or `global.path`.
    QuotaService,
    /// `global.token`.
    QuotaCredential,
    /// `remote.cluster`, `remote.authority`, `remote.path` or `remote.poll_seconds`.
    ConfigCenter,
    /// The document-level `dry_run`.
    DryRun,
    /// `identity_key`.
    IdentityKey,
}

impl PinnedValue {
    /// The `remote.allow` entry that would let a remote document change it.
    pub fn allowed_by(self) -> Pinned {
        match self {
            PinnedValue::QuotaService | PinnedValue::QuotaCredential => Pinned::Global,
            PinnedValue::ConfigCenter => Pinned::Remote,
            PinnedValue::DryRun => Pinned::DryRun,
            PinnedValue::IdentityKey => Pinned::IdentityKey,
        }
    }

    fn described(self) -> &'static str {
        match self {
            PinnedValue::QuotaService => "where the quota service is called",
            PinnedValue::QuotaCredential => "the quota service's credential",
            PinnedValue::ConfigCenter => "where or how often the config center is polled",
            PinnedValue::DryRun => "the document-level dry run",
            PinnedValue::IdentityKey => "the identity key",
        }
    }
}

/// A field of `remote` that only the local document sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalOnly {
    Allow,
    Signature,
}

impl LocalOnly {
    fn name(self) -> &'static str {
        match self {
            LocalOnly::Allow => "allow",
            LocalOnly::Signature => "signature",
        }
    }
}

impl fmt::Display for PinRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PinRefusal::Changed { value, local } => {
                write!(f, "a remote document may not change {}", value.described())?;
                if let Some(local) = local {
                    write!(f, " (the local document has {local})")?;
                }
                write!(
                    f,
                    "; the local document's `remote.allow: [{}]` would let it",
                    value.allowed_by().name()
                )
            }
            PinRefusal::LocalOnly(field) => write!(
                f,
                "only the local document sets remote.{}: a remote document may leave it out or repeat it unchanged",
                field.name()
            ),
        }
    }
}

impl std::error::Error for PinRefusal {}

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

/// Which pinned fields the remote document writes, and the refusal that stopped the pass
/// (serde's errors carry text only, so the refusal itself waits here).
#[derive(Default)]
struct Written {
    refusal: Cell<Option<PinRefusal>>,
    global_cluster: Cell<bool>,
    global_authority: Cell<bool>,
    global_path: Cell<bool>,
    global_token: Cell<bool>,
    remote_cluster: Cell<bool>,
    remote_authority: Cell<bool>,
    remote_path: Cell<bool>,
    remote_poll_seconds: Cell<bool>,
    dry_run: Cell<bool>,
    identity_key: Cell<bool>,
}

/// Takes every pinned field the remote document leaves out from the local document, and
/// `remote.allow` and `remote.signature` always.
fn inherit(policy: &mut Policy, local: &Policy, written: &Written) {
    let (global, base) = (&mut policy.global, &local.global);
    if !written.global_cluster.get() {
        global.cluster.clone_from(&base.cluster);
    }
    if !written.global_authority.get() {
        global.authority.clone_from(&base.authority);
    }
    if !written.global_path.get() {
        global.path.clone_from(&base.path);
    }
    if !written.global_token.get() {
        global.token.clone_from(&base.token);
    }
    if !written.dry_run.get() {
        policy.dry_run = local.dry_run;
    }
    if !written.identity_key.get() {
        policy.set_identity_key(local.identity_key());
    }
    match (&mut policy.remote, &local.remote) {
        (None, base) => policy.remote.clone_from(base),
        (Some(spec), Some(base)) => {
            let moved = written.remote_cluster.get() && spec.cluster != base.cluster;
            if !written.remote_cluster.get() {
                spec.cluster.clone_from(&base.cluster);
            }
            // Left out, `authority` is the cluster's name: the local one's unless the
            // cluster itself was (allowed to be) changed.
            if !written.remote_authority.get() && !moved {
                spec.authority.clone_from(&base.authority);
            }
            if !written.remote_path.get() {
                spec.path.clone_from(&base.path);
            }
            if !written.remote_poll_seconds.get() {
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

/// The refusal pass: every pinned field the text writes is compared with the local value.
fn check_pins(text: &str, local: &Policy) -> Result<Written, ConfigError> {
    let written = Written::default();
    if is_json(text) {
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let mut track = serde_path_to_error::Track::new();
        let probe = Document {
            local,
            written: &written,
        };
        if let Err(error) = probe.deserialize(serde_path_to_error::Deserializer::new(
            &mut deserializer,
            &mut track,
        )) {
            let position = (error.line() > 0).then(|| (error.line(), error.column()));
            let path = track.path().to_string();
            return Err(compose(
                None,
                &path,
                &error.to_string(),
                position,
                false,
                |reason| written.refused(reason),
            ));
        }
        return Ok(written);
    }
    let multiple = serde_yaml::Deserializer::from_str(text).nth(1).is_some();
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let mut track = serde_path_to_error::Track::new();
        let probe = Document {
            local,
            written: &written,
        };
        if let Err(error) =
            probe.deserialize(serde_path_to_error::Deserializer::new(document, &mut track))
        {
            let position = error
                .location()
                .map(|location| (location.line(), location.column()));
            let path = track.path().to_string();
            let label = multiple.then_some(index + 1);
            return Err(compose(
                label,
                &path,
                &error.to_string(),
                position,
                true,
                |reason| written.refused(reason),
            ));
        }
    }
    Ok(written)
}

impl Written {
    /// The kind of the error that stopped the pass: the refusal, or (the document was found
    /// valid before, so not expected) what serde said.
    fn refused(&self, reason: String) -> ConfigErrorKind {
        match self.refusal.take() {
            Some(refusal) => ConfigErrorKind::Pinned { refusal },
            None => ConfigErrorKind::Invalid { reason },
        }
    }
}

/// Whether the local document lets a remote one change `pinned`.
fn allowed(local: &Policy, pinned: Pinned) -> bool {
    local
        .remote
        .as_ref()
        .is_some_and(|remote| remote.allows(pinned))
}

/// Keeps `refusal` in `kept` (for [`Written::refused`]) and gives serde its text.
fn refuse<E: de::Error>(kept: &Cell<Option<PinRefusal>>, refusal: PinRefusal) -> E {
    let error = E::custom(&refusal);
    kept.set(Some(refusal));
    error
}

/// One document of the stream: looks at `global`, `remote`, `dry_run` and `identity_key`
/// only.
struct Document<'a> {
    local: &'a Policy,
    written: &'a Written,
}

impl<'de> DeserializeSeed<'de> for Document<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Document<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a Diana document")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (local, written) = (self.local, self.written);
        while let Some(key) = map.next_key::<serde_yaml::Value>()? {
            match key.as_str() {
                Some("global") => map.next_value_seed(Global { local, written })?,
                Some("remote") => map.next_value_seed(Remote { local, written })?,
                Some("dry_run") => map.next_value_seed(Check {
                    written: &written.dry_run,
                    refusal: &written.refusal,
                    check: |dry_run: bool| {
                        if dry_run == local.dry_run || allowed(local, Pinned::DryRun) {
                            Ok(())
                        } else {
                            Err(PinRefusal::Changed {
                                value: PinnedValue::DryRun,
                                local: Some(local.dry_run.to_string()),
                            })
                        }
                    },
                    value: PhantomData,
                })?,
                Some("identity_key") => map.next_value_seed(Check {
                    written: &written.identity_key,
                    refusal: &written.refusal,
                    check: |key: IdentityKeyField| {
                        let key = IdentityKey::derive(key.0.expose().as_bytes());
                        if local.identity_key() == Some(key) || allowed(local, Pinned::IdentityKey)
                        {
                            Ok(())
                        } else {
                            // Never the value of either secret.
                            Err(PinRefusal::Changed {
                                value: PinnedValue::IdentityKey,
                                local: None,
                            })
                        }
                    },
                    value: PhantomData,
                })?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
}

/// A value read as `T` and judged by `check` (`Err`: the refusal). Both happen inside the
/// value's own visitor, so that a refusal carries the position of the value.
struct Check<'a, T, F> {
    written: &'a Cell<bool>,
    refusal: &'a Cell<Option<PinRefusal>>,
    check: F,
    value: PhantomData<T>,
}

impl<'de, T: de::Deserialize<'de>, F: FnOnce(T) -> Result<(), PinRefusal>> DeserializeSeed<'de>
    for Check<'_, T, F>
{
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.written.set(true);
        deserializer.deserialize_any(CheckVisitor {
            refusal: self.refusal,
            check: self.check,
            value: PhantomData,
        })
    }
}

struct CheckVisitor<'a, T, F> {
    refusal: &'a Cell<Option<PinRefusal>>,
    check: F,
    value: PhantomData<T>,
}

impl<'de, T: de::Deserialize<'de>, F: FnOnce(T) -> Result<(), PinRefusal>> CheckVisitor<'_, T, F> {
    fn judge<E: de::Error>(self, value: Result<T, E>) -> Result<(), E> {
        (self.check)(value?).map_err(|refusal| refuse(self.refusal, refusal))
    }
}

impl<'de, T: de::Deserialize<'de>, F: FnOnce(T) -> Result<(), PinRefusal>> Visitor<'de>
    for CheckVisitor<'_, T, F>
{
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a value")
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<(), E> {
        self.judge(T::deserialize(value.into_deserializer()))
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<(), E> {
        self.judge(T::deserialize(value.into_deserializer()))
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<(), E> {
        self.judge(T::deserialize(value.into_deserializer()))
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<(), E> {
        self.judge(T::deserialize(value.into_deserializer()))
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<(), E> {
        self.judge(T::deserialize(value.into_deserializer()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.judge(T::deserialize(().into_deserializer()))
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.visit_unit()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        self.judge(T::deserialize(de::value::SeqAccessDeserializer::new(seq)))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        self.judge(T::deserialize(de::value::MapAccessDeserializer::new(map)))
    }
}

/// A text value (cluster, authority, path) compared as written, so that the refusal points
/// at the value itself.
struct Text<'a> {
    written: &'a Cell<bool>,
    refusal: &'a Cell<Option<PinRefusal>>,
    /// The local value; `None`: the local document has none.
    local: Option<&'a str>,
    allowed: bool,
    value: PinnedValue,
}

impl<'de> DeserializeSeed<'de> for Text<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.written.set(true);
        deserialize_str_with(deserializer, "a string", |raw| {
            if self.allowed || self.local == Some(raw) {
                Ok(())
            } else {
                let refusal = PinRefusal::Changed {
                    value: self.value,
                    local: self.local.map(|local| format!("{local:?}")),
                };
                self.refusal.set(Some(refusal.clone()));
                Err(refusal)
            }
        })
    }
}

/// `global`: its connection fields are pinned.
struct Global<'a> {
    local: &'a Policy,
    written: &'a Written,
}

impl<'de> DeserializeSeed<'de> for Global<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Global<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("the `global` section")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (base, written) = (&self.local.global, self.written);
        let allowed = allowed(self.local, Pinned::Global);
        while let Some(key) = map.next_key::<String>()? {
            let (field, local) = match key.as_str() {
                "cluster" => (&written.global_cluster, &base.cluster),
                "authority" => (&written.global_authority, &base.authority),
                "path" => (&written.global_path, &base.path),
                "token" => {
                    map.next_value_seed(Check {
                        written: &written.global_token,
                        refusal: &written.refusal,
                        check: |token: SecretField| {
                            if allowed || base.token.as_ref() == Some(&token.0) {
                                Ok(())
                            } else {
                                // Never the value of either secret.
                                Err(PinRefusal::Changed {
                                    value: PinnedValue::QuotaCredential,
                                    local: None,
                                })
                            }
                        },
                        value: PhantomData,
                    })?;
                    continue;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            map.next_value_seed(Text {
                written: field,
                refusal: &written.refusal,
                local: Some(local),
                allowed,
                value: PinnedValue::QuotaService,
            })?;
        }
        Ok(())
    }
}

/// `remote`: pinned whole; `allow` and `signature` even when `remote` is allowed.
struct Remote<'a> {
    local: &'a Policy,
    written: &'a Written,
}

impl<'de> DeserializeSeed<'de> for Remote<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Remote<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("the `remote` section")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let base: Option<&RemoteSpec> = self.local.remote.as_ref();
        let written = self.written;
        let allowed = allowed(self.local, Pinned::Remote);
        while let Some(key) = map.next_key::<String>()? {
            let (field, local) = match key.as_str() {
                "cluster" => (&written.remote_cluster, base.map(|b| b.cluster.as_str())),
                "authority" => (
                    &written.remote_authority,
                    base.map(|b| b.authority.as_str()),
                ),
                "path" => (&written.remote_path, base.map(|b| b.path.as_str())),
                "poll_seconds" => {
                    map.next_value_seed(Check {
                        written: &written.remote_poll_seconds,
                        refusal: &written.refusal,
                        check: |seconds: NonZeroU32| {
                            let local = base.map(|b| b.poll_seconds);
                            if allowed || local == Some(seconds.get()) {
                                Ok(())
                            } else {
                                Err(PinRefusal::Changed {
                                    value: PinnedValue::ConfigCenter,
                                    local: local.map(|seconds| seconds.to_string()),
                                })
                            }
                        },
                        value: PhantomData,
                    })?;
                    continue;
                }
                "allow" => {
                    let unused = Cell::new(false);
                    map.next_value_seed(Check {
                        written: &unused,
                        refusal: &written.refusal,
                        check: |allow: Vec<PinnedField>| {
                            let local = base.map(|b| b.allow.as_slice()).unwrap_or_default();
                            let same = allow.iter().all(|name| local.contains(&name.0))
                                && local.iter().all(|name| allow.iter().any(|a| a.0 == *name));
                            if same {
                                Ok(())
                            } else {
                                Err(PinRefusal::LocalOnly(LocalOnly::Allow))
                            }
                        },
                        value: PhantomData,
                    })?;
                    continue;
                }
                "signature" => {
                    let unused = Cell::new(false);
                    map.next_value_seed(Check {
                        written: &unused,
                        refusal: &written.refusal,
                        check: |signature: SignatureField| {
                            if base.and_then(|b| b.signature.as_ref()) == Some(&signature.0) {
                                Ok(())
                            } else {
                                Err(PinRefusal::LocalOnly(LocalOnly::Signature))
                            }
                        },
                        value: PhantomData,
                    })?;
                    continue;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            map.next_value_seed(Text {
                written: field,
                refusal: &written.refusal,
                local,
                allowed,
                value: PinnedValue::ConfigCenter,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
