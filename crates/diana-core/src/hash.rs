//! The one stable 64-bit hash used for identities, slots and rule ids. Stable across
//! processes and builds (XXH3), because gateways and the quota service must agree on keys.

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
