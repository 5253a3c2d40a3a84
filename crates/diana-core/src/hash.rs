//! Hashes. Two kinds, for two jobs:
//!
//! - [`hash64`] / [`hash_parts`]: a stable, *public* 64-bit hash (XXH3) for what every
//!   process and build must agree on and nobody can aim at: rule ids, record checks.
//! - [`IdentityHasher`]: the *keyed* hash of client identities (SipHash-1-3 under a 128-bit
//!   key, DESIGN §6). A client chooses its header values, never where they land: without
//!   the key nobody can compute the slot, fingerprint or global key of a value, and the
//!   actor's kind is part of the input, so no header value can equal a client address.
//!   XXH3 with a fixed seed was invertible for short inputs: an 8-byte `x-device-id` could
//!   be made to land on the counter of any IP address.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use siphasher::sip::SipHasher13;
use std::fmt;
use std::hash::Hasher as _;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Hashes bytes with a domain-separating seed.
pub fn hash64(seed: u64, bytes: &[u8]) -> u64 {
    xxh3_64_with_seed(bytes, seed)
}

/// Hashes several byte strings as one, each length-prefixed so `("ab","c") != ("a","bc")`.
pub fn hash_parts(seed: u64, parts: &[&[u8]]) -> u64 {
    let mut buffer = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
    for part in parts {
        buffer.extend_from_slice(&(part.len() as u64).to_le_bytes());
        buffer.extend_from_slice(part);
    }
    hash64(seed, &buffer)
}

// ---------------------------------------------------------------------------------------
// The keyed identity hash.

/// The label the identity key is derived under (HMAC-SHA256 of it, keyed with the
/// deployment's `identity_key`): a new label is a new key space.
const KDF_LABEL: &[u8] = b"diana identity hash v1";

/// The text from which the *public* identity key is derived: the key of global rules in a
/// document without `identity_key` (every gateway must agree, and there is no secret).
/// Anyone can compute it: see [`KeyOrigin::Public`].
const PUBLIC_KEY_TEXT: &[u8] = b"diana public identity key: set identity_key";

/// Domain tag of client-address identities (actor `ip`, fallback `ip`).
const TAG_IP: u8 = 1;
/// Domain tag of header identities; the header's name follows, length-prefixed.
const TAG_HEADER: u8 = 2;
/// Domain tag of bearer-token claim identities; the claim's path follows, length-prefixed.
const TAG_CLAIM: u8 = 3;
/// Domain tag of claims an earlier filter verified (Envoy's `jwt_authn` metadata); the
/// payload's metadata name and the claim's path follow, each length-prefixed.
const TAG_VERIFIED_CLAIM: u8 = 4;

/// A 128-bit identity key. Never shown: not in `Debug`, not in logs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IdentityKey([u8; 16]);

impl IdentityKey {
    /// The key derived from a deployment secret (`identity_key`): HMAC-SHA256 keyed with
    /// the secret over a fixed label, first 128 bits. Every gateway given the same secret
    /// derives the same key.
    pub fn derive(secret: &[u8]) -> IdentityKey {
        let mut bytes = [0u8; 16];
        // HMAC takes a key of any length; `new_from_slice` cannot fail for it.
        if let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) {
            mac.update(KDF_LABEL);
            let digest = mac.finalize().into_bytes();
            for (byte, derived) in bytes.iter_mut().zip(digest.iter()) {
                *byte = *derived;
            }
        }
        IdentityKey(bytes)
    }

    /// The public key: what global rules use when the document sets no `identity_key`.
    pub fn public() -> IdentityKey {
        IdentityKey::derive(PUBLIC_KEY_TEXT)
    }

    /// A key from raw bytes (a random per-process key read from shared data).
    pub fn from_bytes(bytes: [u8; 16]) -> IdentityKey {
        IdentityKey(bytes)
    }

    /// A public name of this key (the gateway's id in its reports, when it is the
    /// process's key): HMAC-SHA256 over a fixed label, 8 bytes in hex. It tells keys apart
    /// and says nothing of the key.
    pub fn public_id(self) -> String {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.0) else {
            return String::new();
        };
        mac.update(b"diana gateway id");
        mac.finalize()
            .into_bytes()
            .iter()
            .take(8)
            .map(|byte| format!("{byte:02x}"))
            .collect()
    }

    /// The raw bytes, for the one place that stores a per-process key in shared data.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    fn halves(self) -> (u64, u64) {
        let [a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7] = self.0;
        (
            u64::from_le_bytes([a0, a1, a2, a3, a4, a5, a6, a7]),
            u64::from_le_bytes([b0, b1, b2, b3, b4, b5, b6, b7]),
        )
    }
}

impl fmt::Debug for IdentityKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IdentityKey(<redacted>)")
    }
}

/// Where an [`IdentityHasher`]'s key comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyOrigin {
    /// Derived from the document's `identity_key`: secret, shared by the deployment.
    Configured,
    /// The process's random key (local rules of a document without `identity_key`): secret,
    /// shared by the process's workers through shared data.
    Process,
    /// The public key (global rules of a document without `identity_key`): gateways agree,
    /// but anyone who reads this code can compute where a value lands.
    Public,
    /// A local rule whose process key is not bound yet (the filter binds it when it installs
    /// the policy: `store::identity::bind`). Hashes with the public key meanwhile, so
    /// native tools (`diana simulate`, tests) stay deterministic.
    Unbound,
}

/// The identity kinds, each its own domain of the hash: a value of one kind never hashes
/// like a value of another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityKind<'a> {
    /// A client address (actor `ip`, and the `ip` fallback of header actors).
    Ip,
    /// The value of the named request header (lower case).
    Header(&'a str),
    /// A claim of the bearer token, by its path (a JSON Pointer, [`crate::jwt::ClaimPath`]).
    Claim(&'a str),
    /// A claim of a token an earlier filter verified and left in the request's metadata
    /// (Envoy's `jwt_authn`, `payload_in_metadata: payload`), by its path: never the same
    /// identity as the same text read, unverified, from a bearer token.
    VerifiedClaim { payload: &'a str, path: &'a str },
}

/// The keyed hash of identities: SipHash-1-3 under a 128-bit key, the identity's kind
/// first in the input. A value: each rule carries the one it uses.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IdentityHasher {
    k0: u64,
    k1: u64,
    origin: KeyOrigin,
}

impl IdentityHasher {
    pub fn new(key: IdentityKey, origin: KeyOrigin) -> IdentityHasher {
        let (k0, k1) = key.halves();
        IdentityHasher { k0, k1, origin }
    }

    /// Keyed with the deployment's secret (`identity_key`).
    pub fn configured(secret: &[u8]) -> IdentityHasher {
        IdentityHasher::new(IdentityKey::derive(secret), KeyOrigin::Configured)
    }

    /// Keyed with the public key ([`KeyOrigin::Public`]).
    pub fn public() -> IdentityHasher {
        IdentityHasher::new(IdentityKey::public(), KeyOrigin::Public)
    }

    /// A local rule's hasher before the process key is bound ([`KeyOrigin::Unbound`]).
    pub fn unbound() -> IdentityHasher {
        IdentityHasher::new(IdentityKey::public(), KeyOrigin::Unbound)
    }

    /// Keyed with the process's random key.
    pub fn process(key: IdentityKey) -> IdentityHasher {
        IdentityHasher::new(key, KeyOrigin::Process)
    }

    pub fn origin(&self) -> KeyOrigin {
        self.origin
    }

    /// The key (to carry a document's key over to another policy: pinning).
    pub fn key(&self) -> IdentityKey {
        let [a0, a1, a2, a3, a4, a5, a6, a7] = self.k0.to_le_bytes();
        let [b0, b1, b2, b3, b4, b5, b6, b7] = self.k1.to_le_bytes();
        IdentityKey([
            a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
        ])
    }

    /// The 64-bit identity of `value` of `kind`.
    pub fn identity(&self, kind: IdentityKind<'_>, value: &[u8]) -> u64 {
        let mut hasher = SipHasher13::new_with_keys(self.k0, self.k1);
        match kind {
            IdentityKind::Ip => hasher.write(&[TAG_IP]),
            IdentityKind::Header(name) => {
                hasher.write(&[TAG_HEADER]);
                hasher.write(&(name.len() as u64).to_le_bytes());
                hasher.write(name.as_bytes());
            }
            IdentityKind::Claim(path) => {
                hasher.write(&[TAG_CLAIM]);
                hasher.write(&(path.len() as u64).to_le_bytes());
                hasher.write(path.as_bytes());
            }
            IdentityKind::VerifiedClaim { payload, path } => {
                hasher.write(&[TAG_VERIFIED_CLAIM]);
                for part in [payload, path] {
                    hasher.write(&(part.len() as u64).to_le_bytes());
                    hasher.write(part.as_bytes());
                }
            }
        }
        hasher.write(value);
        hasher.finish()
    }
}

impl Default for IdentityHasher {
    fn default() -> Self {
        IdentityHasher::unbound()
    }
}

impl fmt::Debug for IdentityHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdentityHasher")
            .field("origin", &self.origin)
            .field("key", &"<redacted>")
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_separate_domains() {
        let hasher = IdentityHasher::configured(&[7; 32]);
        let ip = hasher.identity(IdentityKind::Ip, b"203.0.7.112");
        assert_ne!(
            ip,
            hasher.identity(IdentityKind::Header("x-device-id"), b"203.0.7.112")
        );
        // The header's name is part of the domain, length-prefixed.
        assert_ne!(
            hasher.identity(IdentityKind::Header("x-a"), b"bc"),
            hasher.identity(IdentityKind::Header("x-ab"), b"c")
        );
        assert_eq!(ip, hasher.identity(IdentityKind::Ip, b"203.0.7.112"));
        // A verified claim is not the same claim read from an unverified token, and the
        // payload's name and the path are separate, length-prefixed parts.
        let verified = |payload, path| IdentityKind::VerifiedClaim { payload, path };
        let sub = hasher.identity(verified("jwt_payload", "/sub"), b"alice");
        assert_ne!(sub, hasher.identity(IdentityKind::Claim("/sub"), b"alice"));
        assert_ne!(sub, hasher.identity(verified("other", "/sub"), b"alice"));
        assert_ne!(
            hasher.identity(verified("a", "/bc"), b"v"),
            hasher.identity(verified("a/", "bc"), b"v")
        );
        assert_eq!(
            sub,
            hasher.identity(verified("jwt_payload", "/sub"), b"alice")
        );
    }

    /// Fixed outputs, so that the formula never changes by accident (every gateway of a
    /// deployment must agree) and so that tests/e2e/forge.py can check its own copy.
    #[test]
    fn known_vectors() {
        let hasher = IdentityHasher::configured(b"diana-identity-key-test-vector-0123456789");
        assert_eq!(
            hasher.identity(IdentityKind::Header("x-device-id"), b"phone-1"),
            0x1a4a_f47a_a854_c323
        );
        assert_eq!(
            hasher.identity(IdentityKind::Ip, b"127.0.0.1"),
            0x5722_9451_51ce_bec0
        );
    }

    #[test]
    fn the_key_decides_and_is_never_shown() {
        let secret = b"correct horse battery staple, 32+ bytes";
        let one = IdentityHasher::configured(secret);
        let two = IdentityHasher::configured(secret);
        let other = IdentityHasher::configured(b"another deployment's secret, 32+ bytes");
        let value = IdentityKind::Header("x-device-id");
        assert_eq!(one.identity(value, b"d"), two.identity(value, b"d"));
        assert_ne!(one.identity(value, b"d"), other.identity(value, b"d"));
        assert_ne!(
            one.identity(value, b"d"),
            IdentityHasher::public().identity(value, b"d")
        );
        assert_eq!(one.origin(), KeyOrigin::Configured);
        let shown = format!("{one:?} {:?}", IdentityKey::derive(secret));
        assert!(!shown.contains("horse"), "{shown}");
        let (k0, k1) = IdentityKey::derive(secret).halves();
        assert!(!shown.contains(&format!("{k0}")) && !shown.contains(&format!("{k0:x}")));
        assert!(!shown.contains(&format!("{k1}")) && !shown.contains(&format!("{k1:x}")));
        // Unbound hashes like the public key (only the origin differs).
        assert_eq!(
            IdentityHasher::unbound().identity(value, b"d"),
            IdentityHasher::public().identity(value, b"d")
        );
    }
}
