//! The identity key a process uses when the document sets no `identity_key` (DESIGN §6).
//!
//! - **Local rules** hash identities with a random key of the *process*: generated once
//!   (`getrandom`; WASI `random_get` in the filter) and kept in shared data, so that every
//!   worker (Envoy thread, nginx process) computes the same slot for a client and the
//!   counts stay exact across workers. Clients cannot compute where a value lands.
//! - **Global rules** must agree across gateways, which share nothing but the document: they
//!   use a fixed public key ([`crate::hash::IdentityKey::public`]), and loading such a policy
//!   logs one warning saying what that risks ([`public_key_warning`]).
//!
//! The filter calls [`prepare`] for every policy it installs (the local document, each
//! remote one, each reload): the key is read again every time, so a worker always adopts
//! the key the process holds.
//!
//! **Creation is race-free and converges.** The key is created through
//! [`Store::update`]: a create-CAS that matches no entry (Envoy inserts a missing key
//! whatever the CAS, so a plain CAS 0 would let a second creator overwrite the first), CAS 0
//! on nginx (which only accepts it for a missing key). Two workers that both find the key
//! missing both try; one write wins, the other is refused, reads the winner's key and adopts
//! it. After any write the worker reads the record again and uses what is *stored*, never
//! what it generated. A record of another key sharing the entry (nginx finds entries by a
//! CRC32 of the key alone) is never overwritten while a spare entry is left: the key lives
//! in the first of [`PROCESS_KEYS`] that is not another key's, and a reader adopts the first
//! valid one.
//!
//! **The window left.** nginx evicts entries from a full `shm_kv` zone (`diana check`
//! prints a zone size that never evicts). If the key is evicted, the next worker to install
//! a policy (a reload, a respawned worker, a new remote document) creates a new one while
//! the others keep the old one until their own next install: until then a client has one
//! counter per key, so a local limit can admit up to twice its rate for that client, for
//! one configuration period at most. Envoy never evicts. Two workers creating the key in
//! two different spare entries at the same instant (possible only while the first entry
//! changes hands) is the same window, closed at the next install.

use super::{open, HostError, SharedData, Store};
use crate::config::{Policy, Scope};
use crate::hash::{IdentityKey, KeyOrigin};
use std::fmt;

/// Where the process key lives: the first entry that is not another key's (see the module
/// docs), the second as a spare.
pub const PROCESS_KEYS: [&str; 2] = ["diana/identity/0", "diana/identity/1"];

/// Bytes of a stored key (after the record's key check).
pub const KEY_BYTES: usize = 16;

/// Why the process key could not be had: the local rules then hash with the public key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    Host(HostError),
    /// Other workers kept winning the race (never seen: each write settles it).
    Contention,
    /// The random source failed.
    Random(getrandom::Error),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Host(error) => error.fmt(f),
            KeyError::Contention => f.write_str("shared data contended"),
            KeyError::Random(error) => write!(f, "random source: {error}"),
        }
    }
}

impl From<HostError> for KeyError {
    fn from(error: HostError) -> Self {
        KeyError::Host(error)
    }
}

/// 128 random bits from the operating system (WASI `random_get` in the filter).
pub fn random_key() -> Result<[u8; KEY_BYTES], getrandom::Error> {
    let mut bytes = [0u8; KEY_BYTES];
    getrandom::fill(&mut bytes)?;
    Ok(bytes)
}

/// What an entry of [`PROCESS_KEYS`] holds.
enum Entry {
    /// A process key (this key's record).
    Key(IdentityKey),
    /// Nothing, a released value, or a record of this key that is not a key: usable.
    Free,
    /// Another key's record sharing the entry (nginx): left alone.
    Foreign,
}

fn decode(payload: &[u8]) -> Option<IdentityKey> {
    <[u8; KEY_BYTES]>::try_from(payload)
        .ok()
        .filter(|bytes| bytes.iter().any(|&byte| byte != 0))
        .map(IdentityKey::from_bytes)
}

fn entry(host: &dyn SharedData, key: &str) -> Result<Entry, HostError> {
    Ok(match host.get(key)? {
        None => Entry::Free,
        Some((bytes, _)) => match open(key, &bytes) {
            Some(payload) => decode(payload).map_or(Entry::Free, Entry::Key),
            None if bytes.len() < 8 => Entry::Free,
            None => Entry::Foreign,
        },
    })
}

/// The first stored process key, if any.
fn stored(host: &dyn SharedData) -> Result<Option<IdentityKey>, HostError> {
    for key in PROCESS_KEYS {
        if let Entry::Key(found) = entry(host, key)? {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

/// The process's identity key: the stored one, or a new one from `random` stored race-free
/// (see the module docs). `random` is called at most once, and only when no key is stored.
pub fn process_key(
    store: &Store,
    host: &dyn SharedData,
    random: impl FnOnce() -> Result<[u8; KEY_BYTES], getrandom::Error>,
) -> Result<IdentityKey, KeyError> {
    if let Some(found) = stored(host)? {
        return Ok(found);
    }
    let fresh = random().map_err(KeyError::Random)?;
    // The first entry that is not another key's; both taken: the first, like an eviction.
    let mut home = PROCESS_KEYS[0];
    for key in PROCESS_KEYS {
        if !matches!(entry(host, key)?, Entry::Foreign) {
            home = key;
            break;
        }
    }
    let written = store
        .update(host, home, |current| match current.and_then(decode) {
            // Another worker created it first: adopt it, write nothing.
            Some(existing) => (None, existing),
            None => (Some(fresh.to_vec()), IdentityKey::from_bytes(fresh)),
        })
        .map_err(|error| match error {
            super::ChargeError::Host(error) => KeyError::Host(error),
            super::ChargeError::Contention => KeyError::Contention,
        })?;
    // Whatever was written, use what is stored (the first valid entry): every worker
    // converges on it.
    Ok(stored(host)?.unwrap_or(written))
}

/// The warning for a policy whose global rules hash identities with the public key (no
/// `identity_key`); `None` when there is nothing to warn about.
pub fn public_key_warning(policy: &Policy) -> Option<String> {
    let exposed = policy
        .rules()
        .filter(|rule| {
            rule.scope == Scope::Global
                && rule.identity.origin() == KeyOrigin::Public
                && !rule.actor.is_single_counter()
        })
        .count();
    (exposed > 0).then(|| {
        format!(
            "WARNING: identity_key is not set: {exposed} global rule(s) hash client identities with a \
             public key, so that gateways agree. Anyone who knows Diana's code can compute where a header \
             value lands and aim requests at another client's global counter (lock that client out). Set \
             identity_key to a secret of at least 32 bytes shared by every gateway (e.g. `openssl rand -hex 32`)."
        )
    })
}

/// Prepares a policy the filter is about to install: logs [`public_key_warning`] once, and
/// binds the process key to the local rules of a document without `identity_key`. On a
/// failure (no shared data, no random source) those rules keep the public key, and that is
/// logged: requests are still counted, exactly, but the slots can be computed.
pub fn prepare(policy: &mut Policy, store: &Store, host: &dyn SharedData) {
    if let Some(warning) = public_key_warning(policy) {
        log::warn!("diana: {warning}");
    }
    if !policy.needs_process_key() {
        return;
    }
    match process_key(store, host, random_key) {
        Ok(key) => policy.bind_process_key(key),
        Err(error) => log::error!(
            "diana: no per-process identity key ({error}); local rules hash identities with the public \
             key until the next configuration load; set identity_key to avoid this"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::Identity;
    use crate::config::parse_policy;
    use crate::facts::RequestFacts;
    use crate::store::{seal, CasSemantics, MemoryHost};
    use std::sync::{Arc, Barrier};

    struct Device(&'static [u8]);

    impl RequestFacts for Device {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            (name == "x-device-id").then(|| self.0.to_vec())
        }
        fn client_ip(&self) -> Option<Vec<u8>> {
            Some(b"10.0.0.1".to_vec())
        }
    }

    fn key_bytes(seed: u8) -> Result<[u8; 16], getrandom::Error> {
        Ok([seed; 16])
    }

    /// (d) Many workers, each with its own store (its own VM), start at once on one host:
    /// every one ends with the same key, on both hosts' CAS rules.
    #[test]
    fn many_workers_converge_on_one_process_key() {
        for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
            for round in 0..20 {
                let host = Arc::new(MemoryHost::new(semantics));
                let workers = 8;
                let start = Arc::new(Barrier::new(workers));
                let handles: Vec<_> = (0..workers)
                    .map(|worker| {
                        let host = Arc::clone(&host);
                        let start = Arc::clone(&start);
                        std::thread::spawn(move || {
                            let store = Store::new();
                            start.wait();
                            // Each worker would generate a different key.
                            let key =
                                process_key(&store, host.as_ref(), || key_bytes(worker as u8 + 1))
                                    .unwrap();
                            key.to_bytes()
                        })
                    })
                    .collect();
                let keys: Vec<[u8; 16]> = handles
                    .into_iter()
                    .map(|worker| worker.join().unwrap())
                    .collect();
                assert!(
                    keys.iter().all(|key| *key == keys[0]),
                    "{semantics:?} round {round}: {keys:?}"
                );
                // And it is the stored one, which a later worker adopts without generating.
                let later = process_key(&Store::new(), host.as_ref(), || {
                    panic!("a stored key must be adopted")
                })
                .unwrap();
                assert_eq!(later.to_bytes(), keys[0]);
            }
        }
    }

    /// The interleaving that loses a creation on Envoy when it passes CAS 0: another worker
    /// creates the key between our read and our write. We adopt its key.
    #[test]
    fn a_competitors_key_created_in_between_is_adopted() {
        struct Racing {
            inner: MemoryHost,
            raced: std::cell::Cell<bool>,
        }
        impl SharedData for Racing {
            fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
                self.inner.get(key)
            }
            fn set(
                &self,
                key: &str,
                value: &[u8],
                cas: u32,
            ) -> Result<super::super::SetOutcome, HostError> {
                if !self.raced.replace(true) {
                    self.inner.set(key, &seal(key, &[9; 16]), 0)?;
                }
                self.inner.set(key, value, cas)
            }
        }
        for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
            let host = Racing {
                inner: MemoryHost::new(semantics),
                raced: std::cell::Cell::new(false),
            };
            let key = process_key(&Store::new(), &host, || key_bytes(1)).unwrap();
            assert_eq!(key.to_bytes(), [9; 16], "{semantics:?}");
        }
    }

    #[test]
    fn another_keys_record_in_the_entry_is_left_alone() {
        // nginx: every key in one entry would be the worst case; here the first process
        // key's entry holds another key's record.
        let host = MemoryHost::new(CasSemantics::Nginx);
        let foreign = seal("diana/0000000000000001/7", &[1; 24]);
        host.put_raw(PROCESS_KEYS[0], &foreign);
        let key = process_key(&Store::new(), &host, || key_bytes(3)).unwrap();
        assert_eq!(key.to_bytes(), [3; 16]);
        assert_eq!(host.get(PROCESS_KEYS[0]).unwrap().unwrap().0, foreign);
        // Adopted again from the spare entry.
        let again = process_key(&Store::new(), &host, || key_bytes(4)).unwrap();
        assert_eq!(again.to_bytes(), [3; 16]);
    }

    #[test]
    fn prepare_binds_local_rules_and_keeps_configured_ones() {
        let document = "resources:\n  - Url: /\n    rules:\n      - {rpu: 5, actor: device}\n      - {rpu: 5, actor: device, scope: global}\n";
        let host = MemoryHost::new(CasSemantics::Envoy);
        let mut policy = parse_policy(document).unwrap();
        assert!(policy.needs_process_key());
        assert!(public_key_warning(&policy).is_some());
        prepare(&mut policy, &Store::new(), &host);
        let rules: Vec<_> = policy.rules().collect();
        assert_eq!(rules[0].identity.origin(), KeyOrigin::Process);
        assert_eq!(rules[1].identity.origin(), KeyOrigin::Public);
        // Two workers (two parses, two stores) agree on the local identity.
        let mut other = parse_policy(document).unwrap();
        prepare(&mut other, &Store::new(), &host);
        let device = Device(b"phone-1");
        let local = rules[0].identify(&device);
        assert!(matches!(local, Identity::Key(_)));
        assert_eq!(local, other.rules().next().unwrap().identify(&device));
        // ...and differ from a process that has another key.
        let elsewhere = MemoryHost::new(CasSemantics::Envoy);
        let mut third = parse_policy(document).unwrap();
        prepare(&mut third, &Store::new(), &elsewhere);
        assert_ne!(local, third.rules().next().unwrap().identify(&device));

        // A document with identity_key: nothing to bind, nothing to warn about.
        let keyed = format!("{document}identity_key: \"{}\"\n", "k".repeat(40));
        let mut policy = parse_policy(&keyed).unwrap();
        assert!(!policy.needs_process_key());
        assert_eq!(public_key_warning(&policy), None);
        prepare(&mut policy, &Store::new(), &host);
        assert!(policy
            .rules()
            .all(|rule| rule.identity.origin() == KeyOrigin::Configured));
    }
}
