//! The lifecycle of a rule's shared-data records: when a new document drops a rule, the
//! records of its table (its slots, its lease stash) are released as far as the host
//! allows — deleted on nginx, emptied on Envoy, which never frees a key — so that a config
//! center that keeps changing documents cannot grow the gateway's memory without bound.
//!
//! A rule whose limit is edited (`rpu`, `unit`, `burst`, `slices`, the algorithm) keeps its
//! table ([`crate::config::RuleKeys`]): its records are written again under the new
//! generation as identities come back, and nothing is left behind to release. What a
//! janitor task releases is a table no rule uses any more: a rule removed, renamed, moved
//! to another url or actor, or given another `slots`.
//!
//! The set of tables in force is kept in shared data ([`RULES_KEY`]). A worker that
//! installs a policy compares it with that set: tables that are gone become janitor tasks
//! ([`JANITOR_KEY`]), tables that are (back) in force are taken off the task list. Workers
//! then clear the tasks' keys a chunk at a time ([`sweep`], from their ticks): each chunk is
//! claimed by compare-and-swap, so the work is shared, never done twice, and bounded per
//! tick. At most [`MAX_TASKS`] tables wait for release; beyond, the oldest are forgotten
//! and their records stay until an identity of a table that reuses the names writes them
//! again (nginx's `shm_kv` also evicts them when full).

use crate::config::{Policy, Rule, RuleKeys, Scope};
use crate::store::{slot_key_in, SharedData, Store, ONLY_GENERATION};

/// The tables in force: `(table id, slots, global)` of each rule, 13 bytes apiece.
pub const RULES_KEY: &str = "diana/lifecycle/rules";
/// The records still to release: `(table id, slots, next slot, global)`, 17 bytes apiece.
pub const JANITOR_KEY: &str = "diana/lifecycle/janitor";
/// Slots released per sweep and worker.
pub const CHUNK: u32 = 512;
/// Most tasks kept (the oldest beyond are forgotten: their keys stay until reused).
pub const MAX_TASKS: usize = 256;

/// A rule's records, as far as their release needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Footprint {
    /// The rule's table ([`crate::config::RuleKeys::table`]).
    id: u64,
    slots: u32,
    global: bool,
}

impl Footprint {
    fn of(rule: &Rule) -> Footprint {
        Footprint {
            id: rule.keys.table,
            slots: rule.slots.get(),
            global: rule.scope == Scope::Global,
        }
    }
}

/// A rule being released: its footprint and the next slot to clear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Task {
    rule: Footprint,
    next: u32,
}

fn decode_rules(payload: Option<&[u8]>) -> Vec<Footprint> {
    payload
        .unwrap_or_default()
        .chunks_exact(13)
        .filter_map(|chunk| {
            Some(Footprint {
                id: u64::from_le_bytes(chunk.get(..8)?.try_into().ok()?),
                slots: u32::from_le_bytes(chunk.get(8..12)?.try_into().ok()?),
                global: *chunk.get(12)? != 0,
            })
        })
        .collect()
}

fn encode_rules(rules: &[Footprint]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(rules.len() * 13);
    for rule in rules {
        bytes.extend_from_slice(&rule.id.to_le_bytes());
        bytes.extend_from_slice(&rule.slots.to_le_bytes());
        bytes.push(u8::from(rule.global));
    }
    bytes
}

fn decode_tasks(payload: Option<&[u8]>) -> Vec<Task> {
    payload
        .unwrap_or_default()
        .chunks_exact(17)
        .filter_map(|chunk| {
            Some(Task {
                rule: Footprint {
                    id: u64::from_le_bytes(chunk.get(..8)?.try_into().ok()?),
                    slots: u32::from_le_bytes(chunk.get(8..12)?.try_into().ok()?),
                    global: *chunk.get(16)? != 0,
                },
                next: u32::from_le_bytes(chunk.get(12..16)?.try_into().ok()?),
            })
        })
        .collect()
}

fn encode_tasks(tasks: &[Task]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(tasks.len() * 17);
    for task in tasks {
        bytes.extend_from_slice(&task.rule.id.to_le_bytes());
        bytes.extend_from_slice(&task.rule.slots.to_le_bytes());
        bytes.extend_from_slice(&task.next.to_le_bytes());
        bytes.push(u8::from(task.rule.global));
    }
    bytes
}

/// Records `policy` as the one in force; the rules it no longer has become janitor tasks.
/// Returns how many rules were dropped (0 when nothing changed).
pub fn adopt(store: &Store, host: &dyn SharedData, policy: &Policy) -> usize {
    let current: Vec<Footprint> = policy.rules().map(Footprint::of).collect();
    let dropped = store
        .update(host, RULES_KEY, |stored| {
            let before = decode_rules(stored);
            let dropped: Vec<Footprint> = before
                .iter()
                .filter(|old| !current.iter().any(|new| new.id == old.id))
                .copied()
                .collect();
            let same = before.len() == current.len() && dropped.is_empty();
            let write = (!same).then(|| encode_rules(&current));
            (write, dropped)
        })
        .unwrap_or_default();
    let count = dropped.len();
    let result = store.update(host, JANITOR_KEY, |stored| {
        let mut tasks = decode_tasks(stored);
        let before = tasks.len();
        // A rule back in force keeps its counters: never release it.
        tasks.retain(|task| !current.iter().any(|rule| rule.id == task.rule.id));
        let removed = tasks.len() != before;
        for rule in &dropped {
            if !tasks.iter().any(|task| task.rule.id == rule.id) {
                tasks.push(Task {
                    rule: *rule,
                    next: 0,
                });
            }
        }
        if tasks.len() > MAX_TASKS {
            let excess = tasks.len() - MAX_TASKS;
            tasks.drain(..excess);
        }
        let changed = removed || !dropped.is_empty();
        (changed.then(|| encode_tasks(&tasks)), ())
    });
    if let Err(error) = result {
        log::debug!("diana: janitor tasks: {error}");
    }
    count
}

/// True when some records are still to be released.
pub fn has_work(store: &Store, host: &dyn SharedData) -> bool {
    store
        .read(host, JANITOR_KEY)
        .ok()
        .flatten()
        .is_some_and(|payload| !decode_tasks(Some(&payload)).is_empty())
}

/// Claims one chunk of the first task and releases its keys. Returns the keys released.
pub fn sweep(store: &Store, host: &dyn SharedData) -> usize {
    let claimed = store.update(host, JANITOR_KEY, |stored| {
        let mut tasks = decode_tasks(stored);
        let Some(task) = tasks.first_mut() else {
            return (None, None);
        };
        let claim = (
            task.rule,
            task.next,
            task.next.saturating_add(CHUNK).min(task.rule.slots),
        );
        task.next = claim.2;
        if task.next >= task.rule.slots {
            tasks.remove(0);
        }
        (Some(encode_tasks(&tasks)), Some(claim))
    });
    let Ok(Some((rule, from, to))) = claimed else {
        return 0;
    };
    // Released whatever generation wrote them: only the key names matter here.
    let keys = RuleKeys::of(rule.id, ONLY_GENERATION);
    let mut released = 0;
    // A one-counter rule may have used its spare slot 1 ([`SlotAddress::single`]).
    let spare = (rule.slots == 1 && from == 0).then_some(1);
    for slot in (from..to).chain(spare) {
        let mut prefixes = vec![&keys.slots];
        if rule.global {
            prefixes.push(&keys.leases);
        }
        for prefix in prefixes {
            if let Ok(true) = store.clear(host, &slot_key_in(prefix, slot)) {
                released += 1;
            }
        }
    }
    released
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::fake::Facts;
    use crate::config::parse_policy;
    use crate::engine::Engine;
    use crate::metrics::NoMetrics;
    use crate::store::{CasSemantics, MemoryHost};
    use crate::time::Instant;

    const S: u64 = 1_000_000_000;

    fn doc(rpu: u32, slots: u32) -> String {
        format!("Url: /\nrules:\n  - {{actor: device, rpu: {rpu}, unit: minute, slots: {slots}}}\n")
    }

    /// `identities` devices from `first` on, one request each; how many were admitted.
    fn traffic_from(engine: &Engine, host: &MemoryHost, first: u32, identities: u32) -> usize {
        (first..first + identities)
            .filter(|i| {
                let facts = Facts::default().header("x-device-id", format!("d{i}").as_bytes());
                let decision = engine.evaluate(
                    &mut crate::cx::Cx::new(
                        host,
                        Instant::from_unix_nanos(1_000 * S),
                        &mut NoMetrics,
                    ),
                    b"/",
                    &facts,
                );
                matches!(decision, crate::decision::Decision::Allow { .. })
            })
            .count()
    }

    fn traffic(engine: &Engine, host: &MemoryHost, identities: u32) {
        traffic_from(engine, host, 0, identities);
    }

    fn table(policy: &Policy) -> u64 {
        policy.rules().next().unwrap().keys.table
    }

    #[test]
    fn a_dropped_table_is_released_and_a_returning_one_kept() {
        for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
            let host = MemoryHost::new(semantics);
            let store = Store::new();
            let first = parse_policy(&doc(5, 1500)).unwrap();
            assert_eq!(adopt(&store, &host, &first), 0);
            let engine = Engine::new(first.clone());
            traffic(&engine, &host, 300);
            let with_counters = host.key_count();
            assert!(with_counters > 250, "{with_counters}");
            // A new document with another table size: the old table is dropped, its 1,500
            // slots swept in chunks.
            let second = parse_policy(&doc(5, 1400)).unwrap();
            assert_eq!(adopt(&store, &host, &second), 1);
            assert!(has_work(&store, &host));
            let mut released = 0;
            let mut sweeps = 0;
            while has_work(&store, &host) {
                released += sweep(&store, &host);
                sweeps += 1;
            }
            assert_eq!(sweeps, 3, "1500 slots in chunks of {CHUNK}");
            assert_eq!(released, with_counters - 1, "every slot of the old table");
            if semantics == CasSemantics::Nginx {
                assert_eq!(host.key_count(), 2, "only the lifecycle records are left");
            }
            // Back and forth: a table that returns before its sweep keeps its counters.
            let engine = Engine::new(second.clone());
            traffic(&engine, &host, 10);
            adopt(&store, &host, &first);
            adopt(&store, &host, &second);
            let payload = store.read(&host, JANITOR_KEY).unwrap();
            let pending: Vec<u64> = decode_tasks(payload.as_deref())
                .iter()
                .map(|task| task.rule.id)
                .collect();
            assert_eq!(pending, [table(&first)], "{semantics:?}");
        }
    }

    /// Issue "every token accounted for", item 8: a config center that keeps tuning a
    /// per-identity rule's limit, under traffic from new identities each time. Envoy never
    /// frees a key name, so before, each edit left the names of every slot the old rule
    /// had used (200 edits × 300 identities: some 60,000 names); now the edited rule
    /// writes the same names again and the table never holds more than its slots.
    #[test]
    fn edits_of_a_limit_reuse_the_key_names_of_its_table() {
        for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
            let host = MemoryHost::new(semantics);
            let store = Store::new();
            let mut first = 0;
            for edit in 0..200u32 {
                let algo = ["W", "SW", "TB"][edit as usize % 3];
                let document = format!(
                    "Url: /\nrules:\n  - {{actor: device, rpu: {}, unit: minute, slots: 1500, algo: {algo}}}\n",
                    5 + edit % 7
                );
                let policy = parse_policy(&document).unwrap();
                assert_eq!(adopt(&store, &host, &policy), 0, "an edit drops no table");
                traffic_from(&Engine::new(policy), &host, first, 300);
                first += 300;
            }
            assert!(!has_work(&store, &host));
            let keys = host.key_count();
            assert!(
                keys <= 1500 + 2,
                "{semantics:?}: {keys} keys after 200 edits"
            );
        }
    }

    /// The records an edited rule finds were written under other parameters: they read as
    /// free, never as its state, and an edit back is a fresh counter again.
    #[test]
    fn an_edited_limit_counts_afresh_and_never_reads_the_old_state() {
        let host = MemoryHost::new(CasSemantics::Envoy);
        let one = |rpu: u32, algo: &str| {
            let document = format!(
                "Url: /\nrules:\n  - {{actor: device, rpu: {rpu}, unit: minute, algo: {algo}}}\n"
            );
            Engine::new(parse_policy(&document).unwrap())
        };
        let spend = |engine: &Engine| {
            (0..20)
                .filter(|_| traffic_from(engine, &host, 7, 1) == 1)
                .count()
        };
        assert_eq!(spend(&one(5, "W")), 5);
        assert_eq!(spend(&one(6, "W")), 6, "rpu 5 -> 6: a fresh window");
        assert_eq!(spend(&one(5, "W")), 5, "and back: fresh again");
        assert_eq!(
            spend(&one(4, "TB")),
            4,
            "W -> TB: no window words read as tokens"
        );
        assert_eq!(spend(&one(4, "TB")), 0, "an unchanged rule keeps its state");
    }

    #[test]
    fn a_dropped_one_counter_rule_releases_its_spare_slot_too() {
        let host = MemoryHost::new(CasSemantics::Nginx);
        let store = Store::new();
        let first = parse_policy("Url: /\nrules:\n  - {rpu: 5, unit: minute}\n").unwrap();
        adopt(&store, &host, &first);
        let rule = first.rules().next().unwrap();
        // Slot 0 held another key's record: the counter lives in the spare slot 1.
        let spare = slot_key_in(&rule.keys.slots, 1);
        host.put_raw(&slot_key_in(&rule.keys.slots, 0), b"another key's record");
        traffic(&Engine::new(first.clone()), &host, 1);
        let generation = rule.keys.generation;
        assert!(store.read_for(&host, &spare, generation).unwrap().is_some());
        let second = parse_policy("Url: /other\nrules:\n  - {rpu: 5, unit: minute}\n").unwrap();
        assert_eq!(adopt(&store, &host, &second), 1);
        while has_work(&store, &host) {
            sweep(&store, &host);
        }
        assert_eq!(host.get(&spare).unwrap(), None);
    }

    #[test]
    fn adopting_the_same_policy_twice_changes_nothing() {
        let host = MemoryHost::new(CasSemantics::Envoy);
        let store = Store::new();
        let policy = parse_policy(&doc(5, 1500)).unwrap();
        adopt(&store, &host, &policy);
        let (_, cas) = host.get(RULES_KEY).unwrap().unwrap();
        assert_eq!(adopt(&store, &host, &policy), 0);
        assert_eq!(host.get(RULES_KEY).unwrap().unwrap().1, cas);
        assert!(!has_work(&store, &host));
        assert_eq!(sweep(&store, &host), 0);
    }
}
