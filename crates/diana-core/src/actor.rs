//! Actors: whose counter a request is charged to. An [`ActorSource`] turns the facts of a
//! request into an [`Identity`]; identities are hashed, so a raw header value never becomes
//! a key and its size never matters. The hash is keyed ([`IdentityHasher`], DESIGN §6) and
//! each source hashes in its own domain ([`IdentityKind`]): a client chooses its header
//! values, not where they land, and no header value can equal another client's address.
//!
//! Built-in actors: `all` (one counter per rule), `ip` (client address), `account`
//! (`x-account-id`, fallback skip), `device` (`x-device-id`, fallback ip). User-defined actors
//! come from the document's `actors:` section (`{header, fallback}`).
//! A new kind of source is a new type implementing [`ActorSource`] plus one entry in the
//! registry; existing sources are not touched.

use crate::facts::{NoMetadata, RequestFacts};
use crate::hash::{IdentityHasher, IdentityKind};
use crate::jwt::{self, Claim, ClaimOrigin, ClaimPath, ClaimPathError};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Whose counter a request is charged to, for one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Identity {
    /// One counter shared by every request (actor `all`, or fallback `shared`).
    Everyone,
    /// A per-identity counter, keyed by this 64-bit keyed hash of the identity's kind and
    /// value ([`IdentityHasher::identity`]).
    Key(u64),
    /// The rule does not apply to this request (fallback `skip` and no identity).
    Skip,
}

/// A source of identities for one actor name.
pub trait ActorSource: Send + Sync + fmt::Debug {
    /// The identity of `request`, hashed with `hasher` (the rule's: see
    /// [`crate::config::Rule::identify`]).
    fn identify(&self, request: &dyn RequestFacts, hasher: &IdentityHasher) -> Identity {
        self.identify_shown(request, hasher, &mut None)
    }
    /// [`ActorSource::identify`], keeping the value the identity was read from in `shown`
    /// (the fleet view's hot lists; nothing is read twice). A source that has no such
    /// value leaves it `None`.
    fn identify_shown(
        &self,
        request: &dyn RequestFacts,
        hasher: &IdentityHasher,
        shown: &mut Option<Vec<u8>>,
    ) -> Identity;
    /// True when every request maps to [`Identity::Everyone`] (a one-slot table suffices).
    fn is_single_counter(&self) -> bool {
        false
    }
}

// ---------------------------------------------------------------------------------------
// Implementations.

/// Longest accepted header name in an `actors:` entry.
pub const MAX_HEADER_NAME: usize = 256;

/// The identity of a client address: `Key` of its hash, or `Everyone` when the host gave
/// no address (a missing address is a host limitation, not a reason to let a request
/// through uncounted: such requests share one counter).
pub fn ip_identity(request: &dyn RequestFacts, hasher: &IdentityHasher) -> Identity {
    ip_identity_shown(request, hasher, &mut None)
}

/// [`ip_identity`], keeping the address in `shown`.
fn ip_identity_shown(
    request: &dyn RequestFacts,
    hasher: &IdentityHasher,
    shown: &mut Option<Vec<u8>>,
) -> Identity {
    match request.client_ip() {
        Some(ip) => match ip.trim_ascii() {
            [] => Identity::Everyone,
            ip => {
                let identity = Identity::Key(hasher.identity(IdentityKind::Ip, ip));
                *shown = Some(ip.to_vec());
                identity
            }
        },
        None => Identity::Everyone,
    }
}

/// Actor `all`: one counter per rule.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllActor;

impl ActorSource for AllActor {
    fn identify_shown(
        &self,
        _request: &dyn RequestFacts,
        _hasher: &IdentityHasher,
        _shown: &mut Option<Vec<u8>>,
    ) -> Identity {
        Identity::Everyone
    }

    fn is_single_counter(&self) -> bool {
        true
    }
}

/// Actor `ip`: one counter per client address; requests without an address share one.
#[derive(Debug, Clone, Copy, Default)]
pub struct IpActor;

impl ActorSource for IpActor {
    fn identify_shown(
        &self,
        request: &dyn RequestFacts,
        hasher: &IdentityHasher,
        shown: &mut Option<Vec<u8>>,
    ) -> Identity {
        ip_identity_shown(request, hasher, shown)
    }
}

/// What a header actor does when the request has no (or an empty) identity header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fallback {
    /// The rule does not apply to the request ([`Identity::Skip`]).
    Skip,
    /// Count the request against its client address (shared counter without one).
    Ip,
    /// Count the request against one counter shared by all such requests.
    Shared,
}

impl Fallback {
    pub const ALL: [Fallback; 3] = [Fallback::Skip, Fallback::Ip, Fallback::Shared];

    pub const fn name(self) -> &'static str {
        match self {
            Fallback::Skip => "skip",
            Fallback::Ip => "ip",
            Fallback::Shared => "shared",
        }
    }

    /// Parses `skip`, `ip`, `shared` (case-insensitive).
    pub fn parse(text: &str) -> Option<Fallback> {
        let text = text.trim();
        Fallback::ALL
            .into_iter()
            .find(|fallback| fallback.name().eq_ignore_ascii_case(text))
    }

    /// The identity of a request that has no identity of its own.
    pub fn identify(self, request: &dyn RequestFacts, hasher: &IdentityHasher) -> Identity {
        self.identify_shown(request, hasher, &mut None)
    }

    /// [`Fallback::identify`], keeping the address in `shown` when it is the fallback.
    pub fn identify_shown(
        self,
        request: &dyn RequestFacts,
        hasher: &IdentityHasher,
        shown: &mut Option<Vec<u8>>,
    ) -> Identity {
        match self {
            Fallback::Skip => Identity::Skip,
            Fallback::Ip => ip_identity_shown(request, hasher, shown),
            Fallback::Shared => Identity::Everyone,
        }
    }
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An actor whose identity is the value of one request header (bytes, any length, any
/// encoding; surrounding spaces and tabs are ignored, and an empty value counts as absent).
#[derive(Debug, Clone)]
pub struct HeaderActor {
    header: String,
    fallback: Fallback,
}

impl HeaderActor {
    /// `header` is lower-cased. The header's name is part of the hashed input
    /// ([`IdentityKind::Header`]), so two actors reading the same header agree, and a value
    /// of one header never lands where the same value of another header (or an address) does.
    pub fn new(header: &str, fallback: Fallback) -> HeaderActor {
        let header = header.trim().to_ascii_lowercase();
        HeaderActor { header, fallback }
    }

    pub fn header(&self) -> &str {
        &self.header
    }

    pub fn fallback(&self) -> Fallback {
        self.fallback
    }
}

impl ActorSource for HeaderActor {
    fn identify_shown(
        &self,
        request: &dyn RequestFacts,
        hasher: &IdentityHasher,
        shown: &mut Option<Vec<u8>>,
    ) -> Identity {
        if let Some(value) = request.header(&self.header) {
            let trimmed = value.trim_ascii();
            if !trimmed.is_empty() {
                let identity =
                    Identity::Key(hasher.identity(IdentityKind::Header(&self.header), trimmed));
                *shown = Some(trimmed.to_vec());
                return identity;
            }
        }
        self.fallback.identify_shown(request, hasher, shown)
    }
}

/// An actor whose identity is a claim of a JWT: of the request's bearer token
/// (`authorization: Bearer <jwt>`), read but not verified ([`crate::jwt`]), so a filter
/// that verifies the token must run first; or of the payload an earlier `jwt_authn` filter
/// verified and left in the request's metadata ([`ClaimOrigin::JwtAuthn`], Envoy). No
/// token, a malformed one, or no such claim: the fallback.
#[derive(Debug)]
pub struct JwtClaimActor {
    /// Its JSON Pointer is part of the hashed input ([`IdentityKind::Claim`], or
    /// [`IdentityKind::VerifiedClaim`] with the payload's name).
    claim: Claim,
    fallback: Fallback,
    /// Set once this actor found that the host has no metadata (logged once).
    told_no_metadata: AtomicBool,
}

impl JwtClaimActor {
    pub fn new(path: ClaimPath, origin: ClaimOrigin, fallback: Fallback) -> JwtClaimActor {
        JwtClaimActor {
            claim: Claim::new(path, origin),
            fallback,
            told_no_metadata: AtomicBool::new(false),
        }
    }

    fn claim(&self, request: &dyn RequestFacts) -> Option<Vec<u8>> {
        self.claim.read(request).unwrap_or_else(|NoMetadata| {
            if let ClaimOrigin::JwtAuthn(name) = self.claim.origin() {
                if !self.told_no_metadata.swap(true, Ordering::Relaxed) {
                    log::error!(
                        "diana: an actor reads the claim {} from jwt_authn's metadata (payload_in_metadata: {name}), and this host has none (only Envoy's wasm filter reads it): every request takes the fallback `{}`",
                        self.claim.path().pointer(),
                        self.fallback
                    );
                }
            }
            None
        })
    }
}

impl ActorSource for JwtClaimActor {
    fn identify_shown(
        &self,
        request: &dyn RequestFacts,
        hasher: &IdentityHasher,
        shown: &mut Option<Vec<u8>>,
    ) -> Identity {
        let Some(value) = self.claim(request) else {
            return self.fallback.identify_shown(request, hasher, shown);
        };
        let path = self.claim.path().pointer();
        let kind = match self.claim.origin() {
            ClaimOrigin::Bearer => IdentityKind::Claim(path),
            ClaimOrigin::JwtAuthn(name) => IdentityKind::VerifiedClaim {
                payload: name.as_str(),
                path,
            },
        };
        let identity = Identity::Key(hasher.identity(kind, &value));
        *shown = Some(value);
        identity
    }
}

// ---------------------------------------------------------------------------------------
// Registry.

/// A resolved actor: its source and a canonical description of where identities come
/// from (part of a rule's id, so changing the source of an actor resets its counters).
#[derive(Debug, Clone)]
pub struct ActorDef {
    pub source: Arc<dyn ActorSource>,
    /// e.g. `all`, `ip`, `header=x-device-id;fallback=ip`.
    pub spec: String,
}

/// A kind of identity source that an `actors:` entry can use, selected by its key
/// (`tenant: {header: x-tenant-id}` uses the kind whose key is `header`). A new kind is a
/// new implementation plus one entry in [`SOURCE_KINDS`].
pub trait SourceKind: Sync + fmt::Debug {
    /// The key that selects this kind in an `actors:` entry.
    fn key(&self) -> &'static str;
    /// Validates the value written for the key and returns its canonical form.
    fn parse_value(&self, raw: &str) -> Result<String, SourceValueError>;
    /// Builds the actor from a value returned by [`SourceKind::parse_value`].
    fn build(&self, value: &str, fallback: Fallback) -> ActorDef;
    /// What the value may look like, for the JSON schema: a regular expression and the
    /// longest value, in bytes.
    fn value_shape(&self) -> (&'static str, usize);
}

/// Why the value written for an actor's source was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceValueError {
    EmptyHeaderName,
    /// Longer than [`MAX_HEADER_NAME`].
    HeaderNameTooLong,
    /// A character no header name holds (`raw` as written).
    HeaderCharacter {
        raw: String,
        bad: char,
    },
    Claim(ClaimPathError),
}

impl From<ClaimPathError> for SourceValueError {
    fn from(error: ClaimPathError) -> Self {
        SourceValueError::Claim(error)
    }
}

impl fmt::Display for SourceValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceValueError::EmptyHeaderName => f.write_str("empty header name"),
            SourceValueError::HeaderNameTooLong => {
                write!(f, "header name longer than {MAX_HEADER_NAME} bytes")
            }
            SourceValueError::HeaderCharacter { raw, bad } => write!(
                f,
                "invalid header name `{}`: character {bad:?} is not allowed in a header name",
                raw.escape_debug()
            ),
            SourceValueError::Claim(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for SourceValueError {}

/// An `actors:` entry that would redefine a built-in actor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservedActor {
    pub name: String,
}

impl fmt::Display for ReservedActor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "actor `{}` is built in and cannot be redefined",
            self.name
        )
    }
}

impl std::error::Error for ReservedActor {}

/// `{header: NAME}`: identity from a request header.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeaderKind;

impl SourceKind for HeaderKind {
    fn key(&self) -> &'static str {
        "header"
    }

    fn parse_value(&self, raw: &str) -> Result<String, SourceValueError> {
        let name = raw.trim().to_ascii_lowercase();
        let body = name.strip_prefix(':').unwrap_or(&name);
        if body.is_empty() {
            return Err(SourceValueError::EmptyHeaderName);
        }
        if name.len() > MAX_HEADER_NAME {
            return Err(SourceValueError::HeaderNameTooLong);
        }
        if let Some(bad) = body.bytes().find(|&byte| !is_token_byte(byte)) {
            return Err(SourceValueError::HeaderCharacter {
                raw: raw.to_string(),
                bad: char::from(bad),
            });
        }
        Ok(name)
    }

    fn build(&self, value: &str, fallback: Fallback) -> ActorDef {
        let actor = HeaderActor::new(value, fallback);
        let spec = format!("header={};fallback={}", actor.header(), fallback);
        ActorDef {
            source: Arc::new(actor),
            spec,
        }
    }

    fn value_shape(&self) -> (&'static str, usize) {
        ("^\\s*:?[!#$%&'*+.^_`|~0-9A-Za-z-]+\\s*$", MAX_HEADER_NAME)
    }
}

/// `{jwt_claim: sub}` or `{jwt_claim: /org/id}`: identity from a claim of the bearer token.
#[derive(Debug, Clone, Copy, Default)]
pub struct JwtClaimKind;

impl SourceKind for JwtClaimKind {
    fn key(&self) -> &'static str {
        "jwt_claim"
    }

    fn parse_value(&self, raw: &str) -> Result<String, SourceValueError> {
        Ok(ClaimPath::parse(raw)?.pointer().to_string())
    }

    fn build(&self, value: &str, fallback: Fallback) -> ActorDef {
        JwtClaimKind::build_from(value, ClaimOrigin::Bearer, fallback)
    }

    fn value_shape(&self) -> (&'static str, usize) {
        ("\\S", jwt::MAX_PATH_SEGMENTS * (jwt::MAX_SEGMENT_BYTES + 1))
    }
}

impl JwtClaimKind {
    /// The actor of the claim at `value` (a canonical pointer, from `parse_value`), read
    /// from `origin` (`from:` in the document). Its spec, part of the rule's id, names the
    /// origin unless it is the bearer token: `jwt_claim=/sub;from=jwt_authn:NAME;...`.
    pub fn build_from(value: &str, origin: ClaimOrigin, fallback: Fallback) -> ActorDef {
        let path = ClaimPath::parse(value).unwrap_or_else(|_| ClaimPath::matching_nothing());
        let from = origin
            .describe()
            .map(|from| format!(";from={from}"))
            .unwrap_or_default();
        ActorDef {
            spec: format!("jwt_claim={}{from};fallback={fallback}", path.pointer()),
            source: Arc::new(JwtClaimActor::new(path, origin, fallback)),
        }
    }
}

/// RFC 9110 `tchar`.
fn is_token_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

/// Every kind of source an `actors:` entry may use.
pub static SOURCE_KINDS: [&dyn SourceKind; 2] = [&HeaderKind, &JwtClaimKind];

/// Finds a source kind by its key.
pub fn source_kind(key: &str) -> Option<&'static dyn SourceKind> {
    SOURCE_KINDS.iter().copied().find(|kind| kind.key() == key)
}

/// A built-in actor whose definition the document may replace (`account`, `device`).
#[derive(Debug, Clone, Copy)]
pub struct ConfigurableBuiltin {
    pub name: &'static str,
    pub kind: &'static dyn SourceKind,
    pub value: &'static str,
    pub fallback: Fallback,
}

/// `account` and `device`, as DESIGN §3 defines them.
pub static CONFIGURABLE_BUILTINS: [ConfigurableBuiltin; 2] = [
    ConfigurableBuiltin {
        name: "account",
        kind: &HeaderKind,
        value: "x-account-id",
        fallback: Fallback::Skip,
    },
    ConfigurableBuiltin {
        name: "device",
        kind: &HeaderKind,
        value: "x-device-id",
        fallback: Fallback::Ip,
    },
];

/// Actor names that cannot be redefined: `all`, `ip`, and `actor` (the seed's spelling of
/// `account`).
pub const RESERVED_ACTORS: [&str; 3] = ["all", "ip", "actor"];

/// Fallback of a user-defined actor that does not say.
pub const DEFAULT_USER_FALLBACK: Fallback = Fallback::Skip;

/// Built-in actors and the document's definitions, by name.
#[derive(Debug, Clone)]
pub struct ActorRegistry {
    entries: Vec<(String, ActorDef)>,
}

impl Default for ActorRegistry {
    fn default() -> Self {
        ActorRegistry::builtin()
    }
}

impl ActorRegistry {
    /// `all`, `ip`, `account`, `device` (and `actor` as another name for `account`).
    pub fn builtin() -> ActorRegistry {
        let mut entries = vec![
            (
                "all".to_string(),
                ActorDef {
                    source: Arc::new(AllActor),
                    spec: "all".to_string(),
                },
            ),
            (
                "ip".to_string(),
                ActorDef {
                    source: Arc::new(IpActor),
                    spec: "ip".to_string(),
                },
            ),
        ];
        for builtin in &CONFIGURABLE_BUILTINS {
            entries.push((
                builtin.name.to_string(),
                builtin.kind.build(builtin.value, builtin.fallback),
            ));
        }
        ActorRegistry { entries }
    }

    /// The name an actor is known by: `actor` (the seed's word) is `account`.
    pub fn canonical_name(name: &str) -> &str {
        if name == "actor" {
            "account"
        } else {
            name
        }
    }

    /// Defines or redefines (`account`, `device`) an actor. Reserved names are refused.
    pub fn define(&mut self, name: &str, def: ActorDef) -> Result<(), ReservedActor> {
        if RESERVED_ACTORS.contains(&name) {
            return Err(ReservedActor {
                name: name.to_string(),
            });
        }
        match self.entries.iter_mut().find(|(known, _)| known == name) {
            Some((_, existing)) => *existing = def,
            None => self.entries.push((name.to_string(), def)),
        }
        Ok(())
    }

    /// The actor known by `name` (or its canonical name).
    pub fn get(&self, name: &str) -> Option<&ActorDef> {
        let name = ActorRegistry::canonical_name(name);
        self.entries
            .iter()
            .find(|(known, _)| known == name)
            .map(|(_, def)| def)
    }

    /// Every name, in definition order (built-ins first; `actor` not listed).
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.entries.iter().map(|(name, _)| name.as_str())
    }
}

/// A request for tests: headers and a client address set by hand.
#[cfg(test)]
pub(crate) mod fake {
    use super::{NoMetadata, RequestFacts};
    use std::cell::RefCell;
    use std::collections::HashMap;

    #[derive(Default)]
    pub(crate) struct Facts {
        headers: HashMap<String, Vec<u8>>,
        ip: Option<Vec<u8>>,
        /// `None`: a host without dynamic metadata (nginx). Keys: namespace, then the path.
        metadata: Option<HashMap<Vec<String>, Vec<u8>>>,
        /// Every metadata path asked for, namespace first.
        pub(crate) asked: RefCell<Vec<Vec<String>>>,
    }

    impl Facts {
        /// A host with dynamic metadata, holding `value` at `namespace` / `path`.
        pub(crate) fn metadata(mut self, namespace: &str, path: &[&str], value: &[u8]) -> Facts {
            let key = std::iter::once(namespace)
                .chain(path.iter().copied())
                .map(str::to_string)
                .collect();
            self.metadata
                .get_or_insert_with(HashMap::new)
                .insert(key, value.to_vec());
            self
        }
        /// A host with dynamic metadata, none of it for this request.
        pub(crate) fn with_metadata(mut self) -> Facts {
            self.metadata.get_or_insert_with(HashMap::new);
            self
        }
        pub(crate) fn header(mut self, name: &str, value: &[u8]) -> Facts {
            self.headers.insert(name.to_string(), value.to_vec());
            self
        }
        pub(crate) fn ip(mut self, ip: &[u8]) -> Facts {
            self.ip = Some(ip.to_vec());
            self
        }
    }

    impl RequestFacts for Facts {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers.get(name).cloned()
        }
        fn client_ip(&self) -> Option<Vec<u8>> {
            self.ip.clone()
        }
        fn filter_metadata(
            &self,
            namespace: &str,
            path: &[&str],
        ) -> Result<Option<Vec<u8>>, NoMetadata> {
            let key: Vec<String> = std::iter::once(namespace)
                .chain(path.iter().copied())
                .map(str::to_string)
                .collect();
            self.asked.borrow_mut().push(key.clone());
            let metadata = self.metadata.as_ref().ok_or(NoMetadata)?;
            Ok(metadata.get(&key).cloned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use fake::Facts;

    fn registry() -> ActorRegistry {
        ActorRegistry::builtin()
    }

    /// The hasher of these tests: keyed like a deployment's.
    fn hasher() -> IdentityHasher {
        IdentityHasher::configured(b"a deployment secret of at least 32 bytes")
    }

    fn identify(actor: &str, facts: &Facts) -> Identity {
        registry()
            .get(actor)
            .expect("known actor")
            .source
            .identify(facts, &hasher())
    }

    fn key(identity: Identity) -> u64 {
        match identity {
            Identity::Key(key) => key,
            other => panic!("expected a key, got {other:?}"),
        }
    }

    /// A bearer token whose payload is `payload` (unsigned: Diana does not verify).
    fn bearer(payload: &str) -> Vec<u8> {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        format!(
            "Bearer {}.{}.c2ln",
            b64.encode(br#"{"alg":"RS256"}"#),
            b64.encode(payload)
        )
        .into_bytes()
    }

    #[test]
    fn a_jwt_claim_actor_counts_by_the_claim_and_falls_back_without_it() {
        let def = |value: &str, fallback| {
            let canonical = JwtClaimKind.parse_value(value).expect("a claim path");
            JwtClaimKind.build(&canonical, fallback)
        };
        let user = def("sub", Fallback::Skip);
        assert_eq!(user.spec, "jwt_claim=/sub;fallback=skip");
        let with = |token: Vec<u8>| {
            Facts::default()
                .header("authorization", &token)
                .ip(b"10.0.0.1")
        };
        let who = |def: &ActorDef, facts: &Facts| def.source.identify(facts, &hasher());
        let alice = key(who(&user, &with(bearer(r#"{"sub":"alice","iat":1}"#))));
        // Another token of the same subject (other claims, another signature): the same.
        assert_eq!(
            who(&user, &with(bearer(r#"{"iat":2,"sub":"alice"}"#))),
            Identity::Key(alice)
        );
        assert_ne!(key(who(&user, &with(bearer(r#"{"sub":"bob"}"#)))), alice);
        // No token, another scheme, a malformed one, no such claim: the fallback.
        for facts in [
            Facts::default(),
            Facts::default().header("authorization", b"Basic YWxpY2U6eA=="),
            with(b"Bearer not-a-jwt".to_vec()),
            with(bearer(r#"{"iss":"x"}"#)),
            with(bearer(r#"{"sub":{"nested":true}}"#)),
        ] {
            assert_eq!(who(&user, &facts), Identity::Skip);
            assert_eq!(
                who(&def("sub", Fallback::Ip), &facts),
                ip_identity(&facts, &hasher())
            );
        }
        // A nested claim by JSON Pointer; numbers count by their JSON text.
        let org = def("/org/id", Fallback::Shared);
        let org_of = |payload: &str| who(&org, &with(bearer(payload)));
        assert_eq!(
            org_of(r#"{"sub":"a","org":{"id":7}}"#),
            org_of(r#"{"sub":"b","org":{"id":7}}"#)
        );
        assert_ne!(org_of(r#"{"org":{"id":7}}"#), org_of(r#"{"org":{"id":8}}"#));
        // The same text as a claim, as another claim, as a header, as an address: four
        // identities (the claim's path is part of the hashed input).
        let as_claim = key(who(
            &def("tenant", Fallback::Skip),
            &with(bearer(r#"{"tenant":"x1"}"#)),
        ));
        let as_other = key(who(
            &def("team", Fallback::Skip),
            &with(bearer(r#"{"team":"x1"}"#)),
        ));
        let header = HeaderKind.build("x-tenant", Fallback::Skip);
        let as_header = key(header
            .source
            .identify(&Facts::default().header("x-tenant", b"x1"), &hasher()));
        let as_address = key(ip_identity(&Facts::default().ip(b"x1"), &hasher()));
        let all = [as_claim, as_other, as_header, as_address];
        for (i, a) in all.iter().enumerate() {
            assert!(all[i + 1..].iter().all(|b| a != b), "{all:?}");
        }
    }

    /// `from: {jwt_authn: NAME}`: the claim is read from the payload jwt_authn verified,
    /// at `filter_metadata["envoy.filters.http.jwt_authn"][NAME][segments...]`, as the
    /// host hands it over; absent, empty, too long or no metadata at all: the fallback.
    #[test]
    fn a_claim_from_jwt_authn_metadata_counts_by_the_verified_payload() {
        use crate::jwt::{MetadataLeaf, JWT_AUTHN_NAMESPACE, MAX_METADATA_VALUE_BYTES};
        let def = |value: &str, name: &str, fallback| {
            let canonical = JwtClaimKind.parse_value(value).expect("a claim path");
            let origin = ClaimOrigin::jwt_authn(name).expect("a payload name");
            JwtClaimKind::build_from(&canonical, origin, fallback)
        };
        let user = def("sub", "jwt_payload", Fallback::Skip);
        assert_eq!(
            user.spec,
            "jwt_claim=/sub;from=jwt_authn:jwt_payload;fallback=skip"
        );
        let ns = JWT_AUTHN_NAMESPACE;
        let who = |def: &ActorDef, facts: &Facts| def.source.identify(facts, &hasher());
        let meta = |path: &[&str], value: &[u8]| {
            Facts::default().metadata(ns, path, value).ip(b"10.0.0.1")
        };

        // Where it looks: the namespace, the payload's name, then the path unescaped.
        let nested = def("/org/a~1b/0", "https://issuer.example", Fallback::Skip);
        let facts = meta(&["https://issuer.example", "org", "a/b", "0"], b"acme");
        assert!(matches!(who(&nested, &facts), Identity::Key(_)));
        assert_eq!(
            facts.asked.borrow().as_slice(),
            [vec![ns, "https://issuer.example", "org", "a/b", "0"]
                .into_iter()
                .map(str::to_string)
                .collect::<Vec<_>>()]
        );

        // Table: what the host holds at the path -> counted by it, or the fallback.
        let long = vec![b'x'; MAX_METADATA_VALUE_BYTES + 1];
        let cases: [(&str, Facts, bool); 8] = [
            ("a string", meta(&["jwt_payload", "sub"], b"alice"), true),
            (
                "a number",
                meta(
                    &["jwt_payload", "sub"],
                    &MetadataLeaf::Number(42.0).to_bytes(),
                ),
                true,
            ),
            (
                "a boolean",
                meta(
                    &["jwt_payload", "sub"],
                    &MetadataLeaf::Bool(false).to_bytes(),
                ),
                true,
            ),
            ("empty", meta(&["jwt_payload", "sub"], b""), false),
            ("too long", meta(&["jwt_payload", "sub"], &long), false),
            ("another payload", meta(&["other", "sub"], b"alice"), false),
            (
                "no metadata here",
                Facts::default().with_metadata().ip(b"10.0.0.1"),
                false,
            ),
            (
                "a host without metadata",
                Facts::default().ip(b"10.0.0.1"),
                false,
            ),
        ];
        for (what, facts, counted) in &cases {
            let identity = who(&user, facts);
            assert_eq!(matches!(identity, Identity::Key(_)), *counted, "{what}");
            if !counted {
                assert_eq!(identity, Identity::Skip, "{what}");
                assert_eq!(
                    who(&def("sub", "jwt_payload", Fallback::Ip), facts),
                    ip_identity(facts, &hasher()),
                    "{what}"
                );
            }
        }

        // One subject, one counter, whatever else the request carries; two subjects, two.
        let alice = key(who(&user, &meta(&["jwt_payload", "sub"], b"alice")));
        let alice_elsewhere = Facts::default()
            .metadata(ns, &["jwt_payload", "sub"], b"alice")
            .metadata(ns, &["jwt_payload", "iat"], b"1")
            .ip(b"192.0.2.9");
        assert_eq!(who(&user, &alice_elsewhere), Identity::Key(alice));
        assert_ne!(
            key(who(&user, &meta(&["jwt_payload", "sub"], b"bob"))),
            alice
        );
        // The metadata is read, never the header: an unverified token changes nothing.
        let forged = meta(&["jwt_payload", "sub"], b"alice")
            .header("authorization", &bearer(r#"{"sub":"mallory"}"#));
        assert_eq!(who(&user, &forged), Identity::Key(alice));

        // The same text, verified, unverified, under another payload name, under another
        // claim, as a header: five identities.
        let unverified = key(who(
            &JwtClaimKind.build("/sub", Fallback::Skip),
            &Facts::default().header("authorization", &bearer(r#"{"sub":"alice"}"#)),
        ));
        let other_payload = key(who(
            &def("sub", "other", Fallback::Skip),
            &meta(&["other", "sub"], b"alice"),
        ));
        let other_claim = key(who(
            &def("name", "jwt_payload", Fallback::Skip),
            &meta(&["jwt_payload", "name"], b"alice"),
        ));
        let as_header = key(HeaderKind
            .build("x-sub", Fallback::Skip)
            .source
            .identify(&Facts::default().header("x-sub", b"alice"), &hasher()));
        let all = [alice, unverified, other_payload, other_claim, as_header];
        for (i, a) in all.iter().enumerate() {
            assert!(all[i + 1..].iter().all(|b| a != b), "{all:?}");
        }
    }

    #[test]
    fn all_is_one_counter() {
        let all = registry().get("all").expect("all").clone();
        assert!(all.source.is_single_counter());
        assert_eq!(
            all.source.identify(&Facts::default(), &hasher()),
            Identity::Everyone
        );
        assert_eq!(
            all.source.identify(
                &Facts::default().header("x-account-id", b"a").ip(b"1.2.3.4"),
                &hasher()
            ),
            Identity::Everyone
        );
        for name in ["ip", "account", "device", "actor"] {
            assert!(
                !registry()
                    .get(name)
                    .expect("known")
                    .source
                    .is_single_counter(),
                "{name}"
            );
        }
    }

    #[test]
    fn ip_actor() {
        let a = key(identify("ip", &Facts::default().ip(b"10.0.0.1")));
        let b = key(identify("ip", &Facts::default().ip(b"10.0.0.2")));
        assert_ne!(a, b);
        assert_eq!(a, key(identify("ip", &Facts::default().ip(b"10.0.0.1"))));
        // No address (or an empty one): one shared counter, not a free pass.
        assert_eq!(identify("ip", &Facts::default()), Identity::Everyone);
        assert_eq!(
            identify("ip", &Facts::default().ip(b"")),
            Identity::Everyone
        );
    }

    #[test]
    fn header_actor_table() {
        let big = vec![b'x'; 16 * 1024];
        // Requests without the identity header: skip (account) or fall back (device).
        let cases: Vec<(&str, Facts, Identity)> = vec![
            ("account", Facts::default(), Identity::Skip),
            (
                "account",
                Facts::default().header("x-account-id", b""),
                Identity::Skip,
            ),
            (
                "account",
                Facts::default().header("x-account-id", b"  \t"),
                Identity::Skip,
            ),
            ("account", Facts::default().ip(b"1.1.1.1"), Identity::Skip),
            ("actor", Facts::default(), Identity::Skip),
            ("device", Facts::default(), Identity::Everyone),
            (
                "device",
                Facts::default().header("x-device-id", b""),
                Identity::Everyone,
            ),
        ];
        for (actor, facts, want) in &cases {
            assert_eq!(identify(actor, facts), *want, "{actor}");
        }

        // Keys: equal values agree, different values differ, any bytes work.
        let values: [&[u8]; 5] = [b"alice", b"bob", b"\xff\xfe\x80 caf\xc3\xa9", &big, b"\x00"];
        let mut seen = Vec::new();
        for value in values {
            let k = key(identify(
                "account",
                &Facts::default().header("x-account-id", value),
            ));
            assert_eq!(
                k,
                key(identify(
                    "account",
                    &Facts::default().header("x-account-id", value)
                ))
            );
            assert_eq!(
                k,
                key(identify(
                    "actor",
                    &Facts::default().header("x-account-id", value)
                ))
            );
            assert!(!seen.contains(&k));
            seen.push(k);
        }
        // Surrounding whitespace does not make a new identity.
        assert_eq!(
            key(identify(
                "account",
                &Facts::default().header("x-account-id", b" alice\t")
            )),
            key(identify(
                "account",
                &Facts::default().header("x-account-id", b"alice")
            ))
        );

        // device falls back to the client address, in the same key space as `ip`.
        let by_ip = key(identify("device", &Facts::default().ip(b"10.0.0.1")));
        assert_eq!(
            by_ip,
            key(identify("ip", &Facts::default().ip(b"10.0.0.1")))
        );
        // ...but a device id equal to an address string is a different identity.
        let by_header = key(identify(
            "device",
            &Facts::default()
                .header("x-device-id", b"10.0.0.1")
                .ip(b"9.9.9.9"),
        ));
        assert_ne!(by_ip, by_header);
    }

    /// (b) The actor's kind is part of the hashed input: a header value made of an address's
    /// bytes is not that address, under every key, for every header actor.
    #[test]
    fn a_header_value_equal_to_an_address_is_not_that_address() {
        let address = b"203.0.7.112";
        let hashers = [
            hasher(),
            IdentityHasher::public(),
            IdentityHasher::unbound(),
            IdentityHasher::process(crate::hash::IdentityKey::from_bytes([7; 16])),
        ];
        for hasher in hashers {
            let by_address = ip_identity(&Facts::default().ip(address), &hasher);
            assert!(matches!(by_address, Identity::Key(_)));
            for (actor, header) in [("device", "x-device-id"), ("account", "x-account-id")] {
                let source = registry().get(actor).expect("known").source.clone();
                let forged = Facts::default().header(header, address).ip(b"192.0.2.1");
                assert_ne!(source.identify(&forged, &hasher), by_address, "{actor}");
                // Without the header, device falls back to the very same address identity.
                if actor == "device" {
                    let plain = Facts::default().ip(address);
                    assert_eq!(source.identify(&plain, &hasher), by_address);
                }
            }
            // Two headers holding the same value are two identities, too.
            let value = Facts::default()
                .header("x-device-id", b"v")
                .header("x-account-id", b"v");
            assert_ne!(
                identify_with("device", &value, &hasher),
                identify_with("account", &value, &hasher)
            );
        }
    }

    fn identify_with(actor: &str, facts: &Facts, hasher: &IdentityHasher) -> Identity {
        registry()
            .get(actor)
            .expect("known actor")
            .source
            .identify(facts, hasher)
    }

    #[test]
    fn fallbacks() {
        let facts = Facts::default().ip(b"10.0.0.7");
        let skip = HeaderKind.build("x-t", Fallback::Skip);
        let ip = HeaderKind.build("x-t", Fallback::Ip);
        let shared = HeaderKind.build("x-t", Fallback::Shared);
        assert_eq!(skip.source.identify(&facts, &hasher()), Identity::Skip);
        assert_eq!(
            ip.source.identify(&facts, &hasher()),
            ip_identity(&facts, &hasher())
        );
        assert!(matches!(
            ip.source.identify(&facts, &hasher()),
            Identity::Key(_)
        ));
        assert_eq!(
            ip.source.identify(&Facts::default(), &hasher()),
            Identity::Everyone
        );
        assert_eq!(
            shared.source.identify(&facts, &hasher()),
            Identity::Everyone
        );
        // The fallback does not change the identity of a request that has the header.
        let with = Facts::default().header("x-t", b"v").ip(b"10.0.0.7");
        assert_eq!(
            skip.source.identify(&with, &hasher()),
            shared.source.identify(&with, &hasher())
        );
        assert_eq!(skip.spec, "header=x-t;fallback=skip");
        for fallback in Fallback::ALL {
            assert_eq!(
                Fallback::parse(&fallback.name().to_ascii_uppercase()),
                Some(fallback)
            );
        }
        assert_eq!(Fallback::parse("nope"), None);
    }

    #[test]
    fn header_names() {
        assert_eq!(
            HeaderKind.parse_value("X-Tenant-ID"),
            Ok("x-tenant-id".to_string())
        );
        assert_eq!(
            HeaderKind.parse_value(":authority"),
            Ok(":authority".to_string())
        );
        assert_eq!(
            HeaderKind.parse_value(""),
            Err(SourceValueError::EmptyHeaderName)
        );
        assert_eq!(
            HeaderKind.parse_value(":"),
            Err(SourceValueError::EmptyHeaderName)
        );
        let refused = HeaderKind.parse_value("x tenant");
        assert_eq!(
            refused,
            Err(SourceValueError::HeaderCharacter {
                raw: "x tenant".to_string(),
                bad: ' '
            })
        );
        assert_eq!(
            refused.map_err(|error| error.to_string()),
            Err(
                "invalid header name `x tenant`: character ' ' is not allowed in a header name"
                    .to_string()
            )
        );
        assert!(matches!(
            HeaderKind.parse_value("x:t"),
            Err(SourceValueError::HeaderCharacter { bad: ':', .. })
        ));
        assert_eq!(
            HeaderKind.parse_value(&"x".repeat(MAX_HEADER_NAME + 1)),
            Err(SourceValueError::HeaderNameTooLong)
        );
        // Upper-case names given to the actor are looked up lower-case.
        let actor = HeaderActor::new("X-Tenant-Id", Fallback::Skip);
        assert_eq!(actor.header(), "x-tenant-id");
        let facts = Facts::default().header("x-tenant-id", b"t1");
        assert!(matches!(
            actor.identify(&facts, &hasher()),
            Identity::Key(_)
        ));
    }

    #[test]
    fn registry_definitions() {
        let mut registry = registry();
        assert_eq!(
            registry.names().collect::<Vec<_>>(),
            ["all", "ip", "account", "device"]
        );
        for reserved in RESERVED_ACTORS {
            assert!(registry
                .define(reserved, HeaderKind.build("x", Fallback::Skip))
                .is_err());
        }
        registry
            .define("tenant", HeaderKind.build("x-tenant-id", Fallback::Skip))
            .expect("define");
        registry
            .define("account", HeaderKind.build("x-user", Fallback::Shared))
            .expect("redefine");
        assert_eq!(
            registry.names().collect::<Vec<_>>(),
            ["all", "ip", "account", "device", "tenant"]
        );
        assert_eq!(
            registry.get("account").expect("account").spec,
            "header=x-user;fallback=shared"
        );
        // `actor` follows a redefined `account`.
        assert_eq!(
            registry.get("actor").expect("actor").spec,
            "header=x-user;fallback=shared"
        );
        assert_eq!(
            registry.get("device").expect("device").spec,
            "header=x-device-id;fallback=ip"
        );
        assert!(registry.get("nobody").is_none());
        let facts = Facts::default().header("x-tenant-id", b"acme");
        assert!(matches!(
            registry
                .get("tenant")
                .expect("tenant")
                .source
                .identify(&facts, &hasher()),
            Identity::Key(_)
        ));
        assert!(source_kind("header").is_some());
        assert!(source_kind("cookie").is_none());
    }
}

/// The attack on the identity hash as it was (XXH3-64 with fixed public seeds, invertible
/// for inputs of 4 to 8 bytes): a test-only copy of the old formula and its inverse, to show
/// that the values that forged an address then are nobody in particular now.
#[cfg(test)]
mod forged {
    use super::fake::Facts;
    use super::Identity;
    use crate::config::parse_policy;
    use crate::decision::Decision;
    use crate::engine::Engine;
    use crate::metrics::NoMetrics;
    use crate::store::{CasSemantics, MemoryHost, SlotAddress};
    use crate::time::Instant;
    use xxhash_rust::xxh3::xxh3_64_with_seed;

    /// The old seeds (actor.rs before the keyed hash).
    const OLD_IP_SEED: u64 = 0x6469_616e_615f_6970;
    const OLD_HEADER_SEED: u64 = 0x6469_616e_615f_6864;

    fn old_ip(ip: &str) -> u64 {
        xxh3_64_with_seed(ip.as_bytes(), OLD_IP_SEED)
    }

    fn old_header_seed() -> u64 {
        xxh3_64_with_seed(b"x-device-id", OLD_HEADER_SEED)
    }

    fn old_device(value: &[u8]) -> u64 {
        xxh3_64_with_seed(value, old_header_seed())
    }

    const PRIME_MX2: u64 = 0x9FB2_1C65_1E98_DF25;
    /// `XXH3_kSecret` bytes 8..16 and 16..24, little endian.
    const SECRET_8: u64 = 0x1cad_21f7_2c81_017c;
    const SECRET_16: u64 = 0xdb97_9083_e96d_d4de;

    fn inverse(odd: u64) -> u64 {
        // Newton's iteration: each step doubles the correct low bits (3 to start).
        (0..6).fold(odd, |x, _| {
            x.wrapping_mul(2u64.wrapping_sub(odd.wrapping_mul(x)))
        })
    }

    /// XXH3-64's 4-to-8-byte path undone: the `len`-byte input whose hash under `seed` is
    /// `hash`, if one exists (for `len < 8` the two 4-byte reads overlap and must agree).
    fn invert(hash: u64, len: usize, seed: u64) -> Option<Vec<u8>> {
        let mut h = hash ^ (hash >> 28) ^ (hash >> 56);
        h = h.wrapping_mul(inverse(PRIME_MX2));
        h ^= (h >> 35) + len as u64;
        h = h.wrapping_mul(inverse(PRIME_MX2));
        // x ^ rotl(x, 49) ^ rotl(x, 24) is 1 + g over GF(2)[R]/(R^64 - 1) with g nilpotent
        // of order 64: its inverse is the product of (1 + g^(2^i)), i < 6.
        for i in 0..6 {
            h ^= h.rotate_left((49 << i) % 64) ^ h.rotate_left((24 << i) % 64);
        }
        let seed = seed ^ (u64::from((seed as u32).swap_bytes()) << 32);
        let input = h ^ (SECRET_8 ^ SECRET_16).wrapping_sub(seed);
        let (high, low) = (
            ((input >> 32) as u32).to_le_bytes(),
            (input as u32).to_le_bytes(),
        );
        let mut value = vec![0u8; len];
        value[..4].copy_from_slice(&high);
        for (i, byte) in low.into_iter().enumerate() {
            let at = len - 4 + i;
            if at < 4 && value[at] != byte {
                return None;
            }
            value[at] = byte;
        }
        Some(value)
    }

    /// A header value (printable ASCII, no space at either end) that the old scheme hashed
    /// exactly like `ip`'s address.
    fn forge(ip: &str) -> Option<Vec<u8>> {
        (4..=8)
            .rev()
            .filter_map(|len| invert(old_ip(ip), len, old_header_seed()))
            .find(|value| {
                value.iter().all(|byte| (0x20..0x7f).contains(byte))
                    && value.first() != Some(&b' ')
                    && value.last() != Some(&b' ')
            })
    }

    #[test]
    fn the_inverse_is_exact() {
        for (len, value) in [(8, &b"g-}OD.%{"[..]), (4, b"abcd"), (7, b"\x00\xff seven")] {
            let value = &value[..len];
            assert_eq!(
                invert(old_device(value), len, old_header_seed()).as_deref(),
                Some(value)
            );
        }
        // The report's attack: this device id was the client at 203.0.7.112.
        assert_eq!(forge("203.0.7.112").as_deref(), Some(&b"g-}OD.%{"[..]));
    }

    /// (a) Header values found by inverting the old hash: under it each landed on the slot,
    /// fingerprint and global key of an address; under the keyed hash they are another
    /// identity, and three forged requests no longer lock the address's client out of a
    /// 3-per-minute rule.
    #[test]
    fn values_that_forged_an_address_no_longer_share_its_counter() {
        let forged: Vec<(String, Vec<u8>)> = (0..=255u32)
            .flat_map(|c| (1..=255u32).map(move |d| format!("10.0.{c}.{d}")))
            .filter_map(|ip| forge(&ip).map(|value| (ip, value)))
            .take(3)
            .collect();
        assert_eq!(forged.len(), 3, "{forged:?}");

        let document = "resources: [{Url: /, rules: [{actor: device, rpu: 3, unit: minute}]}]\n\
                        identity_key: a-deployment-secret-of-32-bytes-or-more\n";
        let engine = Engine::new(parse_policy(document).expect("document"));
        let rule = engine.rules().next().expect("one rule");
        let admitted = |host: &MemoryHost, facts: &Facts, now: Instant| {
            matches!(
                engine.evaluate(
                    &mut crate::cx::Cx::new(host, now, &mut NoMetrics),
                    b"/",
                    facts
                ),
                Decision::Allow { .. }
            )
        };
        let now = 1_767_225_600_000_000_000u64;
        for (ip, value) in &forged {
            // Then: the same slots and fingerprint (so the same global key) as the address.
            assert_eq!(
                SlotAddress::of(old_device(value), 65_536),
                SlotAddress::of(old_ip(ip), 65_536),
                "{ip} {value:?}"
            );
            // Now: another identity.
            let attacker = Facts::default()
                .header("x-device-id", value)
                .ip(b"192.0.2.66");
            let victim = Facts::default().ip(ip.as_bytes());
            let (Identity::Key(a), Identity::Key(v)) =
                (rule.identify(&attacker), rule.identify(&victim))
            else {
                panic!("both have keys");
            };
            assert_ne!(SlotAddress::of(a, 65_536), SlotAddress::of(v, 65_536));
            // And they do not share a counter: the attacker spends its own three.
            let host = MemoryHost::new(CasSemantics::Envoy);
            let spent: Vec<bool> = (0..4)
                .map(|i| admitted(&host, &attacker, Instant::from_unix_nanos(now + i)))
                .collect();
            assert_eq!(spent, [true, true, true, false], "{ip}");
            let victim: Vec<bool> = (0..4)
                .map(|i| admitted(&host, &victim, Instant::from_unix_nanos(now + 10 + i)))
                .collect();
            assert_eq!(victim, [true, true, true, false], "{ip}: not locked out");
        }
    }
}
