use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

fn label(text: &str) -> Label {
    Label::new(text.as_bytes())
}

fn hot(text: &str, count: u64, error: u64) -> Hot {
    Hot {
        label: label(text),
        count,
        error,
    }
}

#[test]
fn labels_keep_text_escape_other_bytes_and_fit_in_64_bytes() {
    let a63 = "a".repeat(63);
    let a62 = "a".repeat(62);
    let cases: Vec<(Vec<u8>, String)> = vec![
        (b"alice".to_vec(), "alice".into()),
        (b"".to_vec(), "".into()),
        (vec![b'a'; 100], "a".repeat(64)),
        ("é".repeat(40).into_bytes(), "é".repeat(32)),
        (format!("{a63}é").into_bytes(), a63.clone()),
        (br"a\b".to_vec(), r"a\\b".into()),
        (b"\xff\xfeok".to_vec(), r"\xff\xfeok".into()),
        ([a62.as_bytes(), b"\xff"].concat(), a62.clone()),
        ([a62.as_bytes(), b"\\"].concat(), format!("{a62}\\\\")),
        ([a63.as_bytes(), b"\\"].concat(), a63.clone()),
        // Markup is text here: the page escapes what it shows.
        (
            b"<script>alert(1)</script>".to_vec(),
            "<script>alert(1)</script>".into(),
        ),
        // An escape cannot be forged: a literal `\xff` and the byte 0xff differ.
        (br"\xff".to_vec(), r"\\xff".into()),
    ];
    for (value, expected) in cases {
        let made = Label::new(&value);
        assert_eq!(made.as_str(), expected, "{value:?}");
        assert!(made.as_str().len() <= LABEL_MAX);
    }
    assert_eq!(
        Label::from_text(&"x".repeat(64)).map(|l| l.as_str().len()),
        Some(64)
    );
    assert_eq!(Label::from_text(&"x".repeat(65)), None);
}

#[test]
fn space_saving_counts_as_the_paper_says() {
    // Capacity 2: a, a, b, c: c takes b's counter (the smallest) with b's count as error.
    let mut sketch = SpaceSaving::new(2);
    for value in ["a", "a", "b", "c"] {
        sketch.add(value.as_bytes(), 1);
    }
    assert_eq!(sketch.top(10), vec![hot("a", 2, 0), hot("c", 2, 1)]);
    assert_eq!((sketch.floor(), sketch.total()), (2, 4));
    // Weighted: d with weight 5 takes the smallest (a or c, 2 each).
    sketch.add(b"d", 5);
    let top = sketch.top(10);
    assert_eq!(top.first(), Some(&hot("d", 7, 2)));
    assert_eq!(top.len(), 2);
    assert_eq!(sketch.floor(), 2);
    // Not full: exact, no floor.
    let mut sketch = SpaceSaving::new(10);
    for (value, weight) in [("x", 3), ("y", 1), ("x", 2), ("z", 0)] {
        sketch.add(value.as_bytes(), weight);
    }
    assert_eq!(sketch.top(1), vec![hot("x", 5, 0)]);
    assert_eq!(sketch.top(10), vec![hot("x", 5, 0), hot("y", 1, 0)]);
    assert_eq!((sketch.floor(), sketch.total()), (0, 6));
    sketch.clear();
    assert_eq!((sketch.top(10), sketch.total()), (vec![], 0));
}

#[test]
fn capacities_are_held_to_their_range() {
    assert_eq!(SpaceSaving::new(0).capacity(), 1);
    assert_eq!(SpaceSaving::new(CAPACITY_MAX + 1).capacity(), CAPACITY_MAX);
    assert_eq!(Summary::empty(0).capacity(), 1);
    let window = HotWindow::new(0, Nanos::ZERO, 5);
    assert_eq!(
        (window.slices.len(), window.span()),
        (1, Nanos::from_millis(1))
    );
    assert_eq!(
        HotWindow::new(1000, Nanos::from_secs(1), 5).slices.len(),
        SLICES_MAX
    );
    assert_eq!(HotWindow::minute(10).span(), Nanos::from_secs(60));
}

#[test]
fn memory_stays_as_it_was_made_whatever_is_added() {
    let mut sketch = SpaceSaving::new(64);
    let (heap, index) = (sketch.heap.capacity(), sketch.index.capacity());
    for n in 0u32..200_000 {
        sketch.add(format!("client-{n}").as_bytes(), 1);
        sketch.add(b"heavy", 1);
    }
    assert_eq!(
        (sketch.heap.capacity(), sketch.index.capacity()),
        (heap, index)
    );
    assert_eq!(sketch.heap.len(), 64);
    assert_eq!(sketch.index.len(), 64);
    // And the heavy one is on top, with its whole count.
    assert_eq!(
        sketch
            .top(1)
            .first()
            .map(|h| (h.label.as_str(), h.count >= 200_000)),
        Some(("heavy", true))
    );
}

#[test]
fn a_flood_of_distinct_clients_does_not_hide_the_heavy_one() {
    // 10,000 clients once each, one client 2,000 times, interleaved; 20 counters:
    // N / m = 600, so every other count is at most 601.
    let mut sketch = SpaceSaving::new(20);
    for n in 0..10_000u32 {
        sketch.add(format!("bot-{n}").as_bytes(), 1);
        if n % 5 == 0 {
            sketch.add(b"celebrity", 1);
        }
    }
    let top = sketch.top(3);
    assert_eq!(top.first().map(|h| h.label.as_str()), Some("celebrity"));
    assert!(top.iter().skip(1).all(|h| h.count <= 601), "{top:?}");
    assert!(sketch.floor() <= 12_000 / 20);
}

// ---------------------------------------------------------------------------------------
// Bounds against exact counts.

/// Checks every bound the module's docs state of `summary` against exact counts.
fn check_bounds(
    summary: &Summary,
    exact: &HashMap<Label, u64>,
    capacity: usize,
) -> Result<(), TestCaseError> {
    let total: u64 = exact.values().sum();
    prop_assert_eq!(summary.total(), total);
    prop_assert!(
        summary.floor() <= total / capacity as u64,
        "floor {} > N/m = {}/{}",
        summary.floor(),
        total,
        capacity
    );
    prop_assert!(summary.items.len() <= capacity);
    for item in &summary.items {
        let truth = exact.get(&item.label).copied().unwrap_or(0);
        prop_assert!(
            item.guaranteed() <= truth && truth <= item.count,
            "{:?}: true count {} not in [{}, {}]",
            item.label,
            truth,
            item.guaranteed(),
            item.count
        );
        prop_assert!(
            item.error <= summary.floor(),
            "{:?}: error above the floor {}",
            item,
            summary.floor()
        );
    }
    for (label, &truth) in exact {
        if !summary.items.iter().any(|item| item.label == *label) {
            prop_assert!(
                truth <= summary.floor(),
                "{:?} ({}) not listed above the floor {}",
                label,
                truth,
                summary.floor()
            );
        }
    }
    Ok(())
}

/// Streams of (label number, weight): few labels, many, or an adversarial flood of distinct
/// labels with one heavy label among them.
fn stream() -> impl Strategy<Value = Vec<(u32, u64)>> {
    prop_oneof![
        proptest::collection::vec((0u32..8, 1u64..5), 0..400),
        proptest::collection::vec((0u32..300, 1u64..3), 0..1500),
        (proptest::collection::vec(any::<bool>(), 0..1500), 1u64..4).prop_map(|(heavy, weight)| {
            heavy
                .into_iter()
                .enumerate()
                .map(|(n, heavy)| {
                    if heavy {
                        (u32::MAX, weight)
                    } else {
                        (n as u32, 1)
                    }
                })
                .collect()
        }),
    ]
}

fn name(number: u32) -> Label {
    Label::new(format!("id-{number}").as_bytes())
}

fn exact_of<'a>(items: impl IntoIterator<Item = &'a (u32, u64)>) -> HashMap<Label, u64> {
    let mut exact = HashMap::new();
    for &(number, weight) in items {
        *exact.entry(name(number)).or_insert(0) += weight;
    }
    exact
}

fn sketch_of<'a>(items: impl IntoIterator<Item = &'a (u32, u64)>, capacity: usize) -> SpaceSaving {
    let mut sketch = SpaceSaving::new(capacity);
    for &(number, weight) in items {
        sketch.add_label(name(number), weight);
    }
    sketch
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_sketch_keeps_its_stated_bounds(items in stream(), capacity in 1usize..40) {
        let sketch = sketch_of(&items, capacity);
        let summary = sketch.summary();
        check_bounds(&summary, &exact_of(&items), capacity)?;
        // A label heavier than N / m is always listed.
        let exact = exact_of(&items);
        let total: u64 = exact.values().sum();
        for (label, &truth) in &exact {
            if truth > total / capacity as u64 {
                prop_assert!(summary.items.iter().any(|item| item.label == *label));
            }
        }
        // The heap and its index agree.
        for (at, counter) in sketch.heap.iter().enumerate() {
            prop_assert_eq!(sketch.index.find(counter.hash, |&p| p == at), Some(&at));
            if at > 0 {
                prop_assert!(sketch.heap[(at - 1) / 2].count <= counter.count);
            }
        }
    }

    #[test]
    fn merged_sketches_keep_the_merge_s_stated_bounds(
        items in stream(),
        parts in proptest::collection::vec((0usize..5, 1usize..40), 1..6),
        capacity in 1usize..40,
    ) {
        // Deal the items to the parts by their position.
        let mut dealt: Vec<Vec<(u32, u64)>> = vec![Vec::new(); parts.len()];
        for (n, item) in items.iter().enumerate() {
            dealt[parts[n % parts.len()].0 % parts.len()].push(*item);
        }
        let summaries: Vec<Summary> = dealt
            .iter()
            .zip(&parts)
            .map(|(items, &(_, capacity))| sketch_of(items, capacity).summary())
            .collect();
        let smallest = parts.iter().map(|&(_, c)| c).min().unwrap_or(capacity).min(capacity);
        let merged = Summary::merge(&summaries, capacity);
        prop_assert_eq!(merged.capacity(), smallest);
        check_bounds(&merged, &exact_of(&items), smallest)?;
        // Merges of merges, in another order, keep them too.
        let (left, right) = summaries.split_at(summaries.len() / 2);
        let nested = Summary::merge([&Summary::merge(right, capacity), &Summary::merge(left, capacity)], capacity);
        check_bounds(&nested, &exact_of(&items), smallest)?;
        // Through the wire and back, the same.
        let wire = serde_json::to_string(&nested).unwrap();
        prop_assert_eq!(serde_json::from_str::<Summary>(&wire).unwrap(), nested);
    }
}

#[test]
fn merging_summaries_that_are_not_full_is_exact() {
    let mut one = SpaceSaving::new(10);
    let mut two = SpaceSaving::new(10);
    for (value, weight) in [("a", 5), ("b", 2)] {
        one.add(value.as_bytes(), weight);
    }
    for (value, weight) in [("a", 1), ("c", 9)] {
        two.add(value.as_bytes(), weight);
    }
    let merged = Summary::merge([&one.summary(), &two.summary()], 10);
    assert_eq!(
        merged.top(10),
        &[hot("c", 9, 0), hot("a", 6, 0), hot("b", 2, 0)]
    );
    assert_eq!(
        (merged.floor(), merged.total(), merged.capacity()),
        (0, 17, 10)
    );
    assert_eq!(merged.top(1), &[hot("c", 9, 0)]);
    assert_eq!(Summary::merge([], 10), Summary::empty(10));
}

#[test]
fn merging_subtracts_the_m_th_largest_as_misra_gries_does() {
    // Exact parts (not full): a 5, b 3; c 1; merged into 2 counters.
    let mut one = SpaceSaving::new(3);
    one.add(b"a", 5);
    one.add(b"b", 3);
    let mut two = SpaceSaving::new(3);
    two.add(b"c", 1);
    // Estimates a 5, b 3, c 1; the 2nd largest (3) is subtracted: a 2 is kept; N̂ = 2,
    // ε = (9 − 2) / 2 = 3; a: count 5, lower max(2, 5) = 5, error 0.
    let merged = Summary::merge([&one.summary(), &two.summary()], 2);
    assert_eq!(merged.top(10), &[hot("a", 5, 0)]);
    assert_eq!((merged.floor(), merged.capacity()), (3, 2));
    // A full part is lowered by its floor first: a 5 − 3, b 3 − 3; c 1; the 2nd largest
    // (1) subtracted leaves a 1; ε = (9 − 1) / 2 = 4.
    let mut full = SpaceSaving::new(2);
    full.add(b"a", 5);
    full.add(b"b", 3);
    let merged = Summary::merge([&full.summary(), &two.summary()], 2);
    assert_eq!(merged.top(10), &[hot("a", 5, 0)]);
    assert_eq!(merged.floor(), 4);
}

// ---------------------------------------------------------------------------------------
// The wire.

#[test]
fn a_summary_travels_in_its_compact_form() {
    let mut sketch = SpaceSaving::new(2);
    for value in ["a", "a", "b", "c"] {
        sketch.add(value.as_bytes(), 1);
    }
    let text = serde_json::to_string(&sketch.summary()).unwrap();
    assert_eq!(
        text,
        r#"{"capacity":2,"total":4,"floor":2,"items":[["a",2,0],["c",2,1]]}"#
    );
    assert_eq!(
        serde_json::from_str::<Summary>(&text).unwrap(),
        sketch.summary()
    );
}

#[test]
fn a_summary_that_cannot_be_is_refused() {
    let long = "x".repeat(65);
    let cases: Vec<(String, &str)> = vec![
        (
            r#"{"capacity":0,"total":0,"floor":0,"items":[]}"#.into(),
            "capacity 0 is not between 1 and 1024",
        ),
        (
            r#"{"capacity":1025,"total":0,"floor":0,"items":[]}"#.into(),
            "capacity 1025 is not between 1 and 1024",
        ),
        (
            r#"{"capacity":1,"total":9,"floor":0,"items":[["a",1,0],["b",1,0]]}"#.into(),
            "2 items in 1 counters",
        ),
        (
            format!(r#"{{"capacity":2,"total":9,"floor":0,"items":[["{long}",1,0]]}}"#),
            "item 0: a label is at most 64 bytes",
        ),
        (
            r#"{"capacity":2,"total":9,"floor":0,"items":[["a",1,0],["a",2,0]]}"#.into(),
            "item 1: a label listed twice",
        ),
        (
            r#"{"capacity":2,"total":9,"floor":0,"items":[["a",1,2]]}"#.into(),
            "item 0: an error above its count or a count above the total",
        ),
        (
            r#"{"capacity":2,"total":9,"floor":0,"items":[["a",10,0]]}"#.into(),
            "item 0: an error above its count or a count above the total",
        ),
        (
            r#"{"capacity":2,"total":9,"floor":10,"items":[]}"#.into(),
            "a floor above the total",
        ),
        (
            r#"{"capacity":2,"total":9,"floor":0,"items":[],"more":1}"#.into(),
            "unknown field `more`",
        ),
        (
            r#"{"capacity":2,"total":-1,"floor":0,"items":[]}"#.into(),
            "invalid value",
        ),
    ];
    for (text, expected) in cases {
        let refused = serde_json::from_str::<Summary>(&text).map_err(|e| e.to_string());
        assert!(
            matches!(&refused, Err(message) if message.contains(expected)),
            "{text}: {refused:?}"
        );
    }
    // Items arrive in any order and are listed largest first.
    let summary: Summary =
        serde_json::from_str(r#"{"capacity":3,"total":9,"floor":0,"items":[["b",1,0],["a",5,1]]}"#)
            .unwrap();
    assert_eq!(summary.top(5), &[hot("a", 5, 1), hot("b", 1, 0)]);
}

// ---------------------------------------------------------------------------------------
// The window.

fn secs(seconds: u64) -> Instant {
    Instant::from_unix_nanos(seconds * 1_000_000_000)
}

#[test]
fn the_window_sees_the_slices_it_covers() {
    let mut window = HotWindow::new(3, Nanos::from_secs(10), 8);
    window.add(secs(1_000_000), b"a", 5);
    window.add(secs(1_000_010), b"b", 3);
    window.add(secs(1_000_025), b"c", 1);
    let labels = |window: &HotWindow, now| -> Vec<(String, u64)> {
        window
            .summary(now)
            .top(10)
            .iter()
            .map(|h| (h.label.as_str().to_owned(), h.count))
            .collect()
    };
    let owned = |items: &[(&str, u64)]| -> Vec<(String, u64)> {
        items.iter().map(|&(l, c)| (l.to_owned(), c)).collect()
    };
    assert_eq!(
        labels(&window, secs(1_000_025)),
        owned(&[("a", 5), ("b", 3), ("c", 1)])
    );
    assert_eq!(
        labels(&window, secs(1_000_029)),
        owned(&[("a", 5), ("b", 3), ("c", 1)])
    );
    assert_eq!(
        labels(&window, secs(1_000_030)),
        owned(&[("b", 3), ("c", 1)])
    );
    assert_eq!(labels(&window, secs(1_000_045)), owned(&[("c", 1)]));
    assert_eq!(labels(&window, secs(1_000_050)), owned(&[]));
    // Before the counts (a clock read earlier): nothing from the future.
    assert_eq!(labels(&window, secs(999_990)), owned(&[]));
    // A slice reused for a newer interval forgets the old one.
    window.add(secs(1_000_030), b"d", 2);
    assert_eq!(
        labels(&window, secs(1_000_030)),
        owned(&[("b", 3), ("d", 2), ("c", 1)])
    );
    // A clock stepped back counts in the slice it lands on.
    window.add(secs(1_000_000), b"e", 7);
    assert_eq!(
        labels(&window, secs(1_000_030)),
        owned(&[("e", 7), ("b", 3), ("d", 2), ("c", 1)])
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn the_window_keeps_the_bounds_over_what_it_covers(
        events in proptest::collection::vec((0u64..120, 0u32..40, 1u64..4), 0..600),
        read_at in 0u64..140,
        capacity in 1usize..12,
    ) {
        let mut window = HotWindow::new(6, Nanos::from_secs(10), capacity);
        // What happened up to the read, in order.
        let mut events: Vec<_> = events.into_iter().filter(|&(second, _, _)| second <= read_at).collect();
        events.sort_by_key(|&(second, _, _)| second);
        for &(second, number, weight) in &events {
            window.add(secs(second), name(number).as_str().as_bytes(), weight);
        }
        // Covered: the intervals read_at / 10 − 5 ..= read_at / 10, of events not after it.
        let now = read_at / 10;
        let covered: Vec<(u32, u64)> = events
            .iter()
            .filter(|&&(second, _, _)| second / 10 <= now && second / 10 + 6 > now)
            .map(|&(_, number, weight)| (number, weight))
            .collect();
        check_bounds(&window.summary(secs(read_at)), &exact_of(&covered), capacity)?;
    }
}
