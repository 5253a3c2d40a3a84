//! Actors: whose counter a request is charged to. An [`ActorSource`] turns the facts of a
//! request into an [`Identity`]; identities are hashed, so a raw header value never becomes
//! a key and its size never matters.
//!
//! Built-in actors: `all` (one counter per rule), `ip` (client address), `account`
//! (`x-account-id`, fallback skip), `device` (`x-device-id`, fallback ip). User-defined actors
//! come from the document's `actors:` section (`{header, fallback}`).
//! A new kind of source is a new type implementing [`ActorSource`] plus one entry in the
//! registry; existing sources are not touched.

use std::fmt;

/// What the filter knows of a request, read lazily from the host.
pub trait RequestFacts {
    /// A request header's value as raw bytes (not necessarily UTF-8), by lower-case name.
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// The client address without port (e.g. `10.0.0.1`, `::1`), as bytes.
    fn client_ip(&self) -> Option<Vec<u8>>;
}

/// Whose counter a request is charged to, for one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Identity {
    /// One counter shared by every request (actor `all`, or fallback `shared`).
    Everyone,
    /// A per-identity counter, keyed by this 64-bit hash of the identity's value.
    Key(u64),
    /// The rule does not apply to this request (fallback `skip` and no identity).
    Skip,
}

/// A source of identities for one actor name.
pub trait ActorSource: Send + Sync + fmt::Debug {
    fn identify(&self, request: &dyn RequestFacts) -> Identity;
    /// True when every request maps to [`Identity::Everyone`] (a one-slot table suffices).
    fn is_single_counter(&self) -> bool {
        false
    }
}
