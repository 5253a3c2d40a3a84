//! Who is hot: the heaviest identities (or paths) of a rule, counted in fixed memory
//! whatever clients send, and merged across workers and gateways.
//!
//! # The sketch
//!
//! [`SpaceSaving`] is the Space-Saving sketch of Metwally, Agrawal and El Abbadi
//! ("Efficient computation of frequent and top-k elements in data streams", ICDT 2005),
//! weighted: `m` counters, each a label, a count and an error.
//!
//! ```text
//!   add(x, w):  x has a counter ─────────────────▶ count += w
//!               a counter is free ───────────────▶ (x, count w, error 0)
//!               all m in use: take the smallest ─▶ (x, count min + w, error min)
//! ```
//!
//! With `N` the total weight added, for a single sketch:
//!
//! - a listed label's true count lies in `[count − error, count]`;
//! - a label not listed has a true count of at most [`floor`](SpaceSaving::floor): the
//!   smallest count once all `m` counters are in use, 0 before;
//! - `floor ≤ N / m`, and so every error is at most `N / m`: any label heavier than `N / m`
//!   is listed.
//!
//! # Merging
//!
//! A [`Summary`] (a sketch's snapshot, also its wire form) merges with others as in Agarwal,
//! Cormode, Huang, Phillips, Wei and Yi, "Mergeable summaries" (PODS 2012, §2): Space-Saving
//! with `m` counters is Misra–Gries with `m − 1` counters once each count is lowered by the
//! summary's floor. The merge adds the lowered counts label by label, subtracts the `m`-th
//! largest sum from every sum and keeps those left above zero (at most `m − 1`), then raises
//! them by the new floor `ε = ⌊(N − N̂) / m⌋`, where `N` is the total weight of all the merged
//! streams and `N̂` the sum of the kept, lowered counts. For a merged summary, of any number of
//! summaries merged in any order:
//!
//! - a listed label's true count lies in `[count − error, count]`, `error ≤ ε` (the lower
//!   end is also kept at least the sum of the parts' lower ends);
//! - a label not listed has a true count of at most `ε` ([`Summary::floor`]);
//! - `ε ≤ N / m`, with `m` the smallest capacity among the parts and the merge's own.
//!
//! Merging summaries that were not full (fewer labels than counters) is exact.
//!
//! # Windows
//!
//! [`HotWindow`] counts "the last minute" as a ring of sketches, one per interval (6 × 10 s
//! by default); a read merges the intervals that the window covers, the current one
//! included, so it sees between `(slices − 1) × interval` and `slices × interval` of the
//! past. Memory is `slices × m` counters, fixed.
//!
//! # Labels and memory
//!
//! A [`Label`] is at most [`LABEL_MAX`] (64) bytes of text: the caller's bytes, valid UTF-8
//! kept (a backslash doubled), any other byte written `\xNN`, cut at the last whole character
//! that fits. A label is held inline (no allocation); a sketch of capacity `m` holds `m`
//! counters of 96 bytes and an index of them, allocated once when it is made (at most
//! [`CAPACITY_MAX`]).

use crate::hash::hash64;
use crate::time::{Instant, Nanos};
use hashbrown::HashTable;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The longest label, in bytes.
pub const LABEL_MAX: usize = 64;

/// The most counters a sketch or summary may have.
pub const CAPACITY_MAX: usize = 1024;

/// The seed of the labels' index hash (not keyed: the index holds at most `m` labels, so
/// colliding labels cost at most a scan of `m`).
const LABEL_SEED: u64 = 0x686f_7420_6c61_6265;

// ---------------------------------------------------------------------------------------
// Labels.

/// What a counter counts: at most [`LABEL_MAX`] bytes of text, held inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Label {
    len: u8,
    bytes: [u8; LABEL_MAX],
}

impl Label {
    const EMPTY: Label = Label {
        len: 0,
        bytes: [0; LABEL_MAX],
    };

    /// The label of a value: UTF-8 kept (a backslash written `\\`), other bytes written
    /// `\xNN`, cut at the last whole character or escape that fits in [`LABEL_MAX`] bytes.
    /// Two values whose labels are equal share their first bytes.
    pub fn new(value: &[u8]) -> Label {
        let mut label = Label::EMPTY;
        for chunk in value.utf8_chunks() {
            for character in chunk.valid().chars() {
                let fits = if character == '\\' {
                    label.push(b"\\\\")
                } else {
                    label.push(character.encode_utf8(&mut [0; 4]).as_bytes())
                };
                if !fits {
                    return label;
                }
            }
            for &byte in chunk.invalid() {
                let escape = [b'\\', b'x', hex(byte >> 4), hex(byte & 0xf)];
                if !label.push(&escape) {
                    return label;
                }
            }
        }
        label
    }

    /// A label's text as it is (from the wire): `None` if longer than [`LABEL_MAX`].
    pub fn from_text(text: &str) -> Option<Label> {
        let mut label = Label::EMPTY;
        label.push(text.as_bytes()).then_some(label)
    }

    pub fn as_str(&self) -> &str {
        // Only whole UTF-8 characters are ever pushed.
        std::str::from_utf8(self.bytes.get(..usize::from(self.len)).unwrap_or_default())
            .unwrap_or_default()
    }

    /// Appends `piece` if it fits.
    fn push(&mut self, piece: &[u8]) -> bool {
        let at = usize::from(self.len);
        match self.bytes.get_mut(at..at + piece.len()) {
            Some(room) => {
                room.copy_from_slice(piece);
                self.len += piece.len() as u8;
                true
            }
            None => false,
        }
    }
}

fn hex(nibble: u8) -> u8 {
    b"0123456789abcdef"
        .get(usize::from(nibble))
        .copied()
        .unwrap_or(b'0')
}

impl fmt::Debug for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn label_hash(label: &Label) -> u64 {
    hash64(LABEL_SEED, label.as_str().as_bytes())
}

// ---------------------------------------------------------------------------------------
// The live sketch.

#[derive(Debug, Clone, Copy)]
struct Counter {
    label: Label,
    hash: u64,
    count: u64,
    error: u64,
}

/// A Space-Saving sketch of fixed capacity (see the module's docs).
#[derive(Clone)]
pub struct SpaceSaving {
    capacity: usize,
    /// A binary min-heap on `count`: the smallest is at 0.
    heap: Vec<Counter>,
    /// Each label's position in `heap`, by the label's hash.
    index: HashTable<usize>,
    total: u64,
}

/// A position no counter has, for the moment two swap places.
const MOVING: usize = usize::MAX;

impl SpaceSaving {
    /// A sketch of `capacity` counters, held to `1..=CAPACITY_MAX`.
    pub fn new(capacity: usize) -> SpaceSaving {
        let capacity = capacity.clamp(1, CAPACITY_MAX);
        SpaceSaving {
            capacity,
            heap: Vec::with_capacity(capacity),
            // Twice the counters: an eviction removes a label and inserts another, and
            // hashbrown cleans its tombstones in place only while the table is at most half
            // full; with room for 2m it never grows.
            index: HashTable::with_capacity(2 * capacity),
            total: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The total weight added.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The most any label not listed can have counted: the smallest count once every
    /// counter is in use, 0 before.
    pub fn floor(&self) -> u64 {
        if self.heap.len() < self.capacity {
            0
        } else {
            self.heap.first().map_or(0, |smallest| smallest.count)
        }
    }

    /// Counts `weight` more for the label of `value` (see [`Label::new`]).
    pub fn add(&mut self, value: &[u8], weight: u64) {
        self.add_label(Label::new(value), weight);
    }

    pub fn add_label(&mut self, label: Label, weight: u64) {
        if weight == 0 {
            return;
        }
        self.total = self.total.saturating_add(weight);
        let hash = label_hash(&label);
        let heap = &self.heap;
        let found = self
            .index
            .find(hash, |&at| heap.get(at).is_some_and(|c| c.label == label))
            .copied();
        if let Some(at) = found {
            if let Some(counter) = self.heap.get_mut(at) {
                counter.count = counter.count.saturating_add(weight);
            }
            self.sift_down(at);
        } else if self.heap.len() < self.capacity {
            let at = self.heap.len();
            self.heap.push(Counter {
                label,
                hash,
                count: weight,
                error: 0,
            });
            let heap = &self.heap;
            self.index.insert_unique(hash, at, |&at| {
                heap.get(at).map_or(0, |counter| counter.hash)
            });
            self.sift_up(at);
        } else if let Some(smallest) = self.heap.first().copied() {
            if let Ok(entry) = self.index.find_entry(smallest.hash, |&at| at == 0) {
                entry.remove();
            }
            if let Some(root) = self.heap.first_mut() {
                *root = Counter {
                    label,
                    hash,
                    count: smallest.count.saturating_add(weight),
                    error: smallest.count,
                };
            }
            let heap = &self.heap;
            self.index.insert_unique(hash, 0, |&at| {
                heap.get(at).map_or(0, |counter| counter.hash)
            });
            self.sift_down(0);
        }
    }

    /// The `k` largest counts, largest first (ties by label).
    pub fn top(&self, k: usize) -> Vec<Hot> {
        let mut items = self.items();
        items.truncate(k);
        items
    }

    /// The sketch as a [`Summary`]: to merge, or to send.
    pub fn summary(&self) -> Summary {
        Summary {
            capacity: self.capacity,
            total: self.total,
            floor: self.floor(),
            items: self.items(),
        }
    }

    /// Forgets everything counted (the memory stays).
    pub fn clear(&mut self) {
        self.heap.clear();
        self.index.clear();
        self.total = 0;
    }

    fn items(&self) -> Vec<Hot> {
        let mut items: Vec<Hot> = self
            .heap
            .iter()
            .map(|counter| Hot {
                label: counter.label,
                count: counter.count,
                error: counter.error,
            })
            .collect();
        sort(&mut items);
        items
    }

    fn count_at(&self, at: usize) -> Option<u64> {
        self.heap.get(at).map(|counter| counter.count)
    }

    fn sift_up(&mut self, mut at: usize) {
        while at > 0 {
            let parent = (at - 1) / 2;
            if self.count_at(at) < self.count_at(parent) {
                self.swap(at, parent);
                at = parent;
            } else {
                break;
            }
        }
    }

    fn sift_down(&mut self, mut at: usize) {
        loop {
            let left = 2 * at + 1;
            let Some(left_count) = self.count_at(left) else {
                break;
            };
            let child = match self.count_at(left + 1) {
                Some(right_count) if right_count < left_count => left + 1,
                _ => left,
            };
            if self.count_at(child) < self.count_at(at) {
                self.swap(at, child);
                at = child;
            } else {
                break;
            }
        }
    }

    /// Swaps two counters and their positions in the index (two labels may share a hash,
    /// so one is parked at [`MOVING`] while the other moves).
    fn swap(&mut self, a: usize, b: usize) {
        let (Some(hash_a), Some(hash_b)) = (
            self.heap.get(a).map(|c| c.hash),
            self.heap.get(b).map(|c| c.hash),
        ) else {
            return;
        };
        self.heap.swap(a, b);
        self.reposition(hash_a, a, MOVING);
        self.reposition(hash_b, b, a);
        self.reposition(hash_a, MOVING, b);
    }

    fn reposition(&mut self, hash: u64, from: usize, to: usize) {
        if let Some(at) = self.index.find_mut(hash, |&at| at == from) {
            *at = to;
        }
    }
}

impl fmt::Debug for SpaceSaving {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpaceSaving")
            .field("capacity", &self.capacity)
            .field("total", &self.total)
            .field("items", &self.items())
            .finish()
    }
}

/// A counted label: its true count lies in `[count − error, count]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hot {
    pub label: Label,
    pub count: u64,
    pub error: u64,
}

impl Hot {
    /// The count the label surely has.
    pub fn guaranteed(&self) -> u64 {
        self.count.saturating_sub(self.error)
    }
}

/// Largest count first, ties by label.
fn sort(items: &mut [Hot]) {
    items.sort_unstable_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then_with(|| a.label.as_str().cmp(b.label.as_str()))
    });
}

// ---------------------------------------------------------------------------------------
// Summaries: snapshots, merges, the wire form.

/// A sketch's counted labels with their bounds (see the module's docs), largest first: what
/// merges, and what is sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SummaryWire", into = "SummaryWire")]
pub struct Summary {
    capacity: usize,
    total: u64,
    floor: u64,
    items: Vec<Hot>,
}

impl Summary {
    /// Nothing counted, in `capacity` counters.
    pub fn empty(capacity: usize) -> Summary {
        Summary {
            capacity: capacity.clamp(1, CAPACITY_MAX),
            total: 0,
            floor: 0,
            items: Vec::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The total weight counted.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The most any label not listed can have counted.
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// The `k` largest counts, largest first.
    pub fn top(&self, k: usize) -> &[Hot] {
        self.items.get(..k).unwrap_or(&self.items)
    }

    /// The merge of `parts` in at most `capacity` counters (and never more than the
    /// smallest part's), as in Agarwal et al. (see the module's docs).
    pub fn merge<'a>(parts: impl IntoIterator<Item = &'a Summary>, capacity: usize) -> Summary {
        let mut capacity = capacity.clamp(1, CAPACITY_MAX);
        let mut total = 0u64;
        // Per label: the sum of the parts' counts lowered by their floors (Misra–Gries
        // estimates, never above the true count), and of their lower ends.
        let mut sums: hashbrown::HashMap<Label, (u64, u64)> = hashbrown::HashMap::new();
        for part in parts {
            capacity = capacity.min(part.capacity);
            total = total.saturating_add(part.total);
            for item in &part.items {
                let sum = sums.entry(item.label).or_default();
                sum.0 = sum.0.saturating_add(item.count.saturating_sub(part.floor));
                sum.1 = sum.1.saturating_add(item.guaranteed());
            }
        }
        // Keep at most m − 1 estimates: subtract the m-th largest from all.
        let mut estimates: Vec<u64> = sums.values().map(|sum| sum.0).filter(|&e| e > 0).collect();
        let cut = if estimates.len() >= capacity {
            let (_, mth, _) = estimates.select_nth_unstable_by(capacity - 1, |a, b| b.cmp(a));
            *mth
        } else {
            0
        };
        let kept: Vec<(Label, u64, u64)> = sums
            .into_iter()
            .filter_map(|(label, (estimate, lower))| {
                let estimate = estimate.saturating_sub(cut);
                (estimate > 0).then_some((label, estimate, lower))
            })
            .collect();
        let estimated: u64 = kept.iter().fold(0, |sum, &(_, e, _)| sum.saturating_add(e));
        let floor = total.saturating_sub(estimated) / capacity as u64;
        let mut items: Vec<Hot> = kept
            .into_iter()
            .map(|(label, estimate, lower)| {
                let count = estimate.saturating_add(floor);
                Hot {
                    label,
                    count,
                    error: count - lower.clamp(estimate, count),
                }
            })
            .collect();
        sort(&mut items);
        Summary {
            capacity,
            total,
            floor,
            items,
        }
    }
}

/// The wire form: `{"capacity": m, "total": N, "floor": ε, "items": [["label", count,
/// error], …]}`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SummaryWire {
    capacity: usize,
    total: u64,
    floor: u64,
    items: Vec<(String, u64, u64)>,
}

impl From<Summary> for SummaryWire {
    fn from(summary: Summary) -> SummaryWire {
        SummaryWire {
            capacity: summary.capacity,
            total: summary.total,
            floor: summary.floor,
            items: summary
                .items
                .into_iter()
                .map(|item| (item.label.as_str().to_owned(), item.count, item.error))
                .collect(),
        }
    }
}

/// Why a summary from the wire is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SummaryError {
    /// Not in `1..=CAPACITY_MAX`.
    Capacity(usize),
    /// More items than counters.
    TooManyItems { items: usize, capacity: usize },
    /// A label longer than [`LABEL_MAX`] bytes, at this item.
    LabelTooLong { item: usize },
    /// A label listed twice, at this item.
    DuplicateLabel { item: usize },
    /// An item whose numbers cannot be (error above count, count above the total), or a
    /// floor above the total.
    Inconsistent { item: Option<usize> },
}

impl fmt::Display for SummaryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SummaryError::Capacity(capacity) => {
                write!(f, "capacity {capacity} is not between 1 and {CAPACITY_MAX}")
            }
            SummaryError::TooManyItems { items, capacity } => {
                write!(f, "{items} items in {capacity} counters")
            }
            SummaryError::LabelTooLong { item } => {
                write!(f, "item {item}: a label is at most {LABEL_MAX} bytes")
            }
            SummaryError::DuplicateLabel { item } => write!(f, "item {item}: a label listed twice"),
            SummaryError::Inconsistent { item: Some(item) } => write!(
                f,
                "item {item}: an error above its count or a count above the total"
            ),
            SummaryError::Inconsistent { item: None } => f.write_str("a floor above the total"),
        }
    }
}

impl std::error::Error for SummaryError {}

impl TryFrom<SummaryWire> for Summary {
    type Error = SummaryError;

    fn try_from(wire: SummaryWire) -> Result<Summary, SummaryError> {
        if !(1..=CAPACITY_MAX).contains(&wire.capacity) {
            return Err(SummaryError::Capacity(wire.capacity));
        }
        if wire.items.len() > wire.capacity {
            return Err(SummaryError::TooManyItems {
                items: wire.items.len(),
                capacity: wire.capacity,
            });
        }
        if wire.floor > wire.total {
            return Err(SummaryError::Inconsistent { item: None });
        }
        let mut seen = hashbrown::HashSet::with_capacity(wire.items.len());
        let mut items = Vec::with_capacity(wire.items.len());
        for (item, (text, count, error)) in wire.items.iter().enumerate() {
            let label = Label::from_text(text).ok_or(SummaryError::LabelTooLong { item })?;
            if !seen.insert(label) {
                return Err(SummaryError::DuplicateLabel { item });
            }
            if error > count || *count > wire.total {
                return Err(SummaryError::Inconsistent { item: Some(item) });
            }
            items.push(Hot {
                label,
                count: *count,
                error: *error,
            });
        }
        sort(&mut items);
        Ok(Summary {
            capacity: wire.capacity,
            total: wire.total,
            floor: wire.floor,
            items,
        })
    }
}

// ---------------------------------------------------------------------------------------
// The last minute.

/// The hottest labels of the last `slices × interval` (see the module's docs).
#[derive(Debug, Clone)]
pub struct HotWindow {
    interval: Nanos,
    /// Each slice's interval number (instant / interval) and its sketch.
    slices: Vec<(u64, SpaceSaving)>,
}

/// The most slices a window may have.
pub const SLICES_MAX: usize = 60;

impl HotWindow {
    /// The last minute in 6 slices of 10 s, `capacity` counters each.
    pub fn minute(capacity: usize) -> HotWindow {
        HotWindow::new(6, Nanos::from_secs(10), capacity)
    }

    /// `slices` (held to `1..=SLICES_MAX`) sketches of `capacity` counters, each counting
    /// one `interval` (at least a millisecond).
    pub fn new(slices: usize, interval: Nanos, capacity: usize) -> HotWindow {
        HotWindow {
            interval: interval.max(Nanos::from_millis(1)),
            slices: vec![(0, SpaceSaving::new(capacity)); slices.clamp(1, SLICES_MAX)],
        }
    }

    /// Counts `weight` for the label of `value` at `now`.
    pub fn add(&mut self, now: Instant, value: &[u8], weight: u64) {
        let number = now.periods(self.interval);
        let count = self.slices.len() as u64;
        if let Some((slice, sketch)) = self.slices.get_mut((number % count) as usize) {
            // A slice last used for an older interval starts again; an instant older than
            // the slice's (a clock stepped back) is counted in it as it is.
            if *slice < number {
                sketch.clear();
                *slice = number;
            }
            sketch.add(value, weight);
        }
    }

    /// The merge of the slices the window covers at `now`.
    pub fn summary(&self, now: Instant) -> Summary {
        let number = now.periods(self.interval);
        let count = self.slices.len() as u64;
        let capacity = self.slices.first().map_or(1, |(_, s)| s.capacity());
        let live: Vec<Summary> = self
            .slices
            .iter()
            .filter(|(slice, sketch)| {
                sketch.total() > 0 && *slice <= number && *slice + count > number
            })
            .map(|(_, sketch)| sketch.summary())
            .collect();
        Summary::merge(&live, capacity)
    }

    /// How far back the window sees at most.
    pub fn span(&self) -> Nanos {
        self.interval.saturating_mul(self.slices.len() as u64)
    }
}

#[cfg(test)]
mod tests;
