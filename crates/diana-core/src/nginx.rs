//! How large nginx's `shm_kv` zone must be for a policy, so that it never evicts: what
//! `diana check` and `diana check-nginx` print, and what the filter names when a worker
//! finds no zone (`worker/configure.rs`).
//!
//! ngx_wasm_module 0.6 keeps each shared-data key in one slab allocation of
//! `96 + key + value` bytes (its `ngx_wa_shm_kv_node_t` is 96 bytes on 64-bit), rounded up
//! to a power of two (whole pages above half a page), plus the slab's own bookkeeping.
//! Diana's keys: one per slot of each rule's slot table (`slots` per identity rule, 1 for
//! `actor: all`), one per slot of a global rule's lease stash, one per resource breaker
//! ([`breaker_bytes`]), and a few singletons (the quota service's outage switch, the
//! lifecycle records, the remote document).

use crate::breaker::record::{record_bytes, record_key};
use crate::breaker::Spec;
use crate::config::{Policy, Rule, Scope};
use crate::global::stash;
use crate::remote::MAX_DOCUMENT_BYTES;
use crate::store::slot_record_bytes;
use std::collections::HashSet;

/// ngx_wa_shm_kv_node_t on 64-bit.
const NODE_BYTES: u64 = 96;
const PAGE: u64 = 4096;
/// The singleton records (outage switch, lifecycle, config-center health and poll claim) and
/// the slab allocator's bookkeeping of a small zone.
const FIXED_BYTES: u64 = 64 * 1024;

/// One key's slab allocation.
fn allocation(key: usize, value: usize) -> u64 {
    let size = NODE_BYTES + key as u64 + value as u64;
    if size > PAGE / 2 {
        size.div_ceil(PAGE) * PAGE
    } else {
        size.next_power_of_two().max(8)
    }
}

/// Decimal digits of the largest slot number of a table of `slots`.
fn digits(slots: u32) -> usize {
    slots.saturating_sub(1).max(1).ilog10() as usize + 1
}

/// Bytes the records of one rule can take. A one-counter rule (`actor: all`) has a spare
/// slot beside its own (`SlotAddress::single`).
pub fn rule_bytes(rule: &Rule) -> u64 {
    let slots = u64::from(rule.slots.get().max(2));
    let words = rule.algo.state_words(&rule.limit);
    let slot_key = rule.keys.slots.len() + digits(rule.slots.get());
    let mut bytes = slots * allocation(slot_key, slot_record_bytes(words));
    if rule.scope == Scope::Global {
        let lease_key = rule.keys.leases.len() + digits(rule.slots.get());
        bytes += slots * allocation(lease_key, stash::RECORD_BYTES);
    }
    bytes
}

/// Bytes the record of one resource breaker takes (its key, and its sealed state with one
/// entry per half-open place: [`record_bytes`]).
pub fn breaker_bytes(spec: &Spec) -> u64 {
    let settings = &spec.settings;
    allocation(
        record_key(&settings.name).len(),
        record_bytes(settings.half_open_calls.get()),
    )
}

/// The zone size for `policy`: every record at once, with 1/8 of slack for the slab
/// allocator's partly used pages, rounded up to whole MiB.
pub fn zone_bytes(policy: &Policy) -> u64 {
    zone_bytes_of(&[policy])
}

/// The zone size for several documents sharing one zone (several `proxy_wasm diana`
/// lines, `diana check-nginx`): a rule whose slot table an earlier document already has
/// (the same rule in both) counts once.
pub fn zone_bytes_of(policies: &[&Policy]) -> u64 {
    let mut seen: HashSet<&str> = HashSet::new();
    let mut breakers: HashSet<String> = HashSet::new();
    let mut bytes = FIXED_BYTES;
    for policy in policies {
        let tables: Vec<&str> = policy
            .rules()
            .map(|rule| rule.keys.slots.as_str())
            .collect();
        bytes += (policy.rules())
            .filter(|rule| !seen.contains(rule.keys.slots.as_str()))
            .map(rule_bytes)
            .sum::<u64>();
        seen.extend(tables);
        // A breaker's record is named after the breaker: the same name in two documents
        // is one record.
        for spec in policy.breakers() {
            if breakers.insert(record_key(&spec.settings.name)) {
                bytes += breaker_bytes(spec);
            }
        }
    }
    if policies.iter().any(|policy| policy.remote.is_some()) {
        // The published document, in whole pages (and room to replace it).
        bytes += 2 * allocation(32, MAX_DOCUMENT_BYTES + 64);
    }
    bytes += bytes / 8;
    bytes.div_ceil(1 << 20) << 20
}

/// `shm_kv diana <size>;` for `policy`.
pub fn directive(policy: &Policy) -> String {
    format!("shm_kv diana {}m;", zone_bytes(policy) >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_policy;

    #[test]
    fn slab_allocations_round_like_ngx_slab() {
        // A fixed-window slot: key "diana/<16 hex>/65535" (28 bytes), value 32 bytes.
        assert_eq!(allocation(28, slot_record_bytes(2)), 256);
        // A 60-slice sliding window: 8 + 8 + 61 * 8 = 504 bytes of value.
        assert_eq!(allocation(28, slot_record_bytes(61)), 1024);
        assert_eq!(allocation(32, 5_000), 8_192);
    }

    #[test]
    fn a_per_identity_rule_needs_its_table_and_an_all_rule_one_key() {
        let policy = parse_policy(
            "Url: /\nrules:\n  - {actor: device, rpu: 10}\n  - {actor: all, rpu: 100}\n",
        )
        .unwrap();
        let rules: Vec<u64> = policy.rules().map(rule_bytes).collect();
        assert_eq!(rules, [65_536 * 256, 2 * 256]);
        // 16 MiB of slots + 64 KiB + 1/8 slack: 19 MiB.
        assert_eq!(directive(&policy), "shm_kv diana 19m;");
        let global = parse_policy(
            "Url: /\nrules:\n  - {actor: device, rpu: 10, scope: global, slots: 1000}\n",
        )
        .unwrap();
        assert_eq!(global.rules().map(rule_bytes).sum::<u64>(), 1000 * 256 * 2);
    }

    #[test]
    fn each_breaker_counts_its_record_once() {
        let one = parse_policy(
            "Url: /pay
breaker: {failure_ratio: 0.5}
",
        )
        .unwrap();
        let spec = one.breakers().next().unwrap();
        // Key "diana/breaker/<16 hex>" (30 bytes), 253 bytes of record with 3 places:
        // 96 + 30 + 253 = 379, a 512-byte slab.
        assert_eq!(record_bytes(3), 253);
        assert_eq!(breaker_bytes(spec), 512);
        let wide = parse_policy(
            "Url: /pay
breaker: {failure_ratio: 0.5, half_open_calls: 255}
",
        )
        .unwrap();
        // 96 + 30 + 253 + 252 × 9 = 2647: whole pages above half a page.
        assert_eq!(breaker_bytes(wide.breakers().next().unwrap()), 4096);
        let none = parse_policy(
            "Url: /pay
rules: [{rpu: 1}]
",
        )
        .unwrap();
        let both = parse_policy(
            "Url: /pay
rules: [{rpu: 1}]
breaker: {failure_ratio: 0.5, half_open_calls: 255}
",
        )
        .unwrap();
        let bare = zone_bytes_of(&[&none]);
        assert!(zone_bytes_of(&[&both]) >= bare);
        // The same breakers in two documents sharing the zone are one record each.
        let many: String = (0..600)
            .map(|n| {
                format!("- Url: /b{n}\n  breaker: {{failure_ratio: 0.5, half_open_calls: 255}}\n")
            })
            .collect();
        let many = parse_policy(&many).unwrap();
        let alone = zone_bytes_of(&[&many]);
        assert_eq!(zone_bytes_of(&[&many, &many]), alone);
        // 600 records of a page each.
        assert!(
            alone >= FIXED_BYTES + 600 * 4096 && alone > bare,
            "{alone} vs {bare}"
        );
    }
}
