//! The counter keys of RLS descriptors and RLQS buckets: a keyed hash of values the
//! gateway's clients choose (a header, a path, a token), so that nobody can aim a value at
//! another's counter.
//!
//! `rls:` and the first 128 bits, in hex, of HMAC-SHA256 under the deployment's RLS key
//! (`--rls-key-file` or `DIANA_QUOTA_RLS_KEY`, at least 32 bytes) of a label, the domain,
//! then each entry's key and value, each written as its length in bytes (u32,
//! little-endian) followed by its bytes. Every replica given the same key computes the same
//! counters; without the key nobody can compute where a value lands. Without a configured
//! key the *public* key is used (a warning at start): anyone can then compute the counter
//! of a value, but HMAC-SHA256 stays collision-resistant, so no chosen value can land on
//! another's counter either (the unkeyed XXH3-128 this replaces could be aimed: it is not
//! collision-resistant against someone who chooses the input).
//!
//! The key is never shown: not in `Debug`, not in logs.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::path::{Path, PathBuf};

/// The prefix of the counter key of a descriptor.
pub const KEY_PREFIX: &str = "rls:";

/// The label every counter key's hash starts with: a new label is a new key space.
const LABEL: &[u8] = b"diana-quota rls counter v2";

/// The text the public key is: what a deployment without its own key uses.
const PUBLIC_KEY: &[u8] = b"diana-quota public rls key: set --rls-key-file";

/// The environment variable that may hold the RLS key (never a command-line value).
pub const KEY_ENV: &str = "DIANA_QUOTA_RLS_KEY";

/// The shortest key accepted, in bytes.
pub const MIN_KEY_BYTES: usize = 32;

/// Where the key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOrigin {
    /// `--rls-key-file` or `DIANA_QUOTA_RLS_KEY`: secret, shared by the replicas.
    Configured,
    /// The public key: replicas agree, and so can anyone.
    Public,
}

/// The keyed hash of counter keys.
#[derive(Clone)]
pub struct CounterKeys {
    /// HMAC-SHA256 under the key, with the label already fed (cloned per key).
    mac: Hmac<Sha256>,
    origin: KeyOrigin,
}

/// Why the RLS key cannot be used (the service does not start).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("--rls-key-file {}: {reason}", path.display())]
    Unreadable { path: PathBuf, reason: String },
    #[error("{source_name}: the RLS key must be at least {MIN_KEY_BYTES} bytes (got {bytes}); e.g. `openssl rand -hex 32`")]
    TooShort { source_name: String, bytes: usize },
    #[error("--rls-key-file and {KEY_ENV} both given: keep one")]
    Both,
    #[error("{KEY_ENV} is not valid UTF-8")]
    NotUtf8,
}

impl CounterKeys {
    /// Keys under `secret` (surrounding whitespace ignored); `source_name` names where it
    /// came from in errors.
    pub fn with_secret(secret: &str, source_name: &str) -> Result<CounterKeys, KeyError> {
        let secret = secret.trim();
        if secret.len() < MIN_KEY_BYTES {
            return Err(KeyError::TooShort {
                source_name: source_name.to_string(),
                bytes: secret.len(),
            });
        }
        Ok(CounterKeys::keyed(secret.as_bytes(), KeyOrigin::Configured))
    }

    /// The public key ([`KeyOrigin::Public`]).
    pub fn public() -> CounterKeys {
        CounterKeys::keyed(PUBLIC_KEY, KeyOrigin::Public)
    }

    /// The key of a file (its whole content, trimmed), of `DIANA_QUOTA_RLS_KEY`'s value, or
    /// the public key when neither is given.
    pub fn from_sources(
        file: Option<&Path>,
        env_value: Option<&str>,
    ) -> Result<CounterKeys, KeyError> {
        match (file, env_value) {
            (Some(_), Some(_)) => Err(KeyError::Both),
            (Some(path), None) => {
                let text = std::fs::read_to_string(path).map_err(|error| KeyError::Unreadable {
                    path: path.to_path_buf(),
                    reason: error.to_string(),
                })?;
                CounterKeys::with_secret(&text, &format!("--rls-key-file {}", path.display()))
            }
            (None, Some(value)) => CounterKeys::with_secret(value, KEY_ENV),
            (None, None) => Ok(CounterKeys::public()),
        }
    }

    fn keyed(key: &[u8], origin: KeyOrigin) -> CounterKeys {
        // HMAC takes a key of any length: `new_from_slice` cannot fail.
        let mut mac = match Hmac::<Sha256>::new_from_slice(key) {
            Ok(mac) => mac,
            Err(_) => return CounterKeys::keyed(PUBLIC_KEY, KeyOrigin::Public),
        };
        mac.update(LABEL);
        CounterKeys { mac, origin }
    }

    pub fn origin(&self) -> KeyOrigin {
        self.origin
    }

    /// The counter key of a descriptor of `domain` with these entries (for a wildcard with
    /// `share_threshold`, the entry's value is the pattern as written).
    pub fn counter_key(&self, domain: &str, entries: &[(&str, &str)]) -> String {
        let mut mac = self.mac.clone();
        let mut feed = |text: &str| {
            let length = u32::try_from(text.len()).unwrap_or(u32::MAX);
            mac.update(&length.to_le_bytes());
            mac.update(text.as_bytes());
        };
        feed(domain);
        for (key, value) in entries {
            feed(key);
            feed(value);
        }
        let digest = mac.finalize().into_bytes();
        let mut out = String::with_capacity(KEY_PREFIX.len() + 32);
        out.push_str(KEY_PREFIX);
        for byte in digest.iter().take(16) {
            out.push_str(&format!("{byte:02x}"));
        }
        out
    }
}

impl Default for CounterKeys {
    fn default() -> Self {
        CounterKeys::public()
    }
}

impl fmt::Debug for CounterKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CounterKeys")
            .field("origin", &self.origin)
            .field("key", &"<redacted>")
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "an-rls-key-of-at-least-32-bytes-for-tests";

    /// The derivation, pinned: a change here changes every counter.
    #[test]
    fn keys_are_the_documented_hmac() {
        let keys = CounterKeys::with_secret(SECRET, "test").unwrap();
        let mut mac = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
        mac.update(b"diana-quota rls counter v2");
        for text in ["d", "k", "v"] {
            mac.update(&u32::try_from(text.len()).unwrap().to_le_bytes());
            mac.update(text.as_bytes());
        }
        let digest = mac.finalize().into_bytes();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(keys.counter_key("d", &[("k", "v")]), format!("rls:{hex}"));
    }

    #[test]
    fn keys_depend_on_the_secret_domain_and_entries() {
        let ours = CounterKeys::with_secret(SECRET, "test").unwrap();
        let theirs =
            CounterKeys::with_secret("another-deployment-key-of-32-bytes-or-more", "t").unwrap();
        let public = CounterKeys::public();
        let key = ours.counter_key("d", &[("k", "v")]);
        assert_eq!(key, ours.counter_key("d", &[("k", "v")]));
        assert_eq!(key.len(), 36);
        assert_ne!(key, theirs.counter_key("d", &[("k", "v")]));
        assert_ne!(key, public.counter_key("d", &[("k", "v")]));
        assert_ne!(key, ours.counter_key("e", &[("k", "v")]));
        assert_ne!(
            ours.counter_key("d", &[("ab", "c")]),
            ours.counter_key("d", &[("a", "bc")])
        );
        assert_ne!(
            ours.counter_key("d", &[("k", "v"), ("k2", "v2")]),
            ours.counter_key("d", &[("k2", "v2"), ("k", "v")])
        );
        // The old unkeyed XXH3-128 of the same input is not what is used any more.
        let mut bytes = Vec::new();
        for text in ["d", "k", "v"] {
            bytes.extend_from_slice(&u32::try_from(text.len()).unwrap().to_le_bytes());
            bytes.extend_from_slice(text.as_bytes());
        }
        let unkeyed = format!("rls:{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes));
        assert_ne!(public.counter_key("d", &[("k", "v")]), unkeyed);
    }

    #[test]
    fn short_keys_are_refused_and_never_shown() {
        assert_eq!(
            CounterKeys::with_secret("short", "DIANA_QUOTA_RLS_KEY").unwrap_err(),
            KeyError::TooShort {
                source_name: "DIANA_QUOTA_RLS_KEY".to_string(),
                bytes: 5
            }
        );
        let keys = CounterKeys::with_secret(SECRET, "test").unwrap();
        assert!(!format!("{keys:?}").contains(SECRET));
        assert_eq!(keys.origin(), KeyOrigin::Configured);
        assert_eq!(CounterKeys::public().origin(), KeyOrigin::Public);
        assert_eq!(
            CounterKeys::from_sources(Some(Path::new("/x")), Some(SECRET)).unwrap_err(),
            KeyError::Both
        );
    }
}
