//! The description of the document (`raw::document`, what the JSON schema, the pin pass
//! and the position finder read) against the readers themselves, field by field.
//!
//! Every field of every mapping, walked from the root (each form, each alternative), is
//! written with values the description admits and values it does not, in a document
//! otherwise made of the description's own examples: a value the description admits is
//! never refused by the typed pass; one it does not admit is refused at that field (a rule
//! across keys, at its mapping). Each rule across keys is broken once. Then every field
//! is changed by a remote document: refused naming the field exactly when the description
//! pins it. A field added to a reader and not to the description (or the other way round),
//! a range, a name list or a pin rule that differs, fails here.

use crate::config::error::PinnedValue;
use crate::config::raw::{document, present, NonEmpty, Ratio, ScopeField, StatusList};
use crate::config::shape::{document_struct, Constraint, Describe, Kind, Pin, Shape};
use crate::config::{parse_policy, parse_remote, ConfigError, ConfigErrorKind, RemoteError};
use serde_json::{json, Map, Value};

/// A step of a probe's path in the document.
#[derive(Debug, Clone)]
enum Seg {
    Key(String),
    Index(usize),
}

/// `resources[0].rules[1].rpu`, as a refusal names it.
fn path_text(path: &[Seg]) -> String {
    let mut text = String::new();
    for seg in path {
        match seg {
            Seg::Key(key) => {
                if !text.is_empty() {
                    text.push('.');
                }
                text.push_str(key);
            }
            Seg::Index(index) => text.push_str(&format!("[{index}]")),
        }
    }
    text
}

fn at(path: &[Seg], seg: Seg) -> Vec<Seg> {
    let mut path = path.to_vec();
    path.push(seg);
    path
}

fn key(path: &[Seg], key: &str) -> Vec<Seg> {
    at(path, Seg::Key(key.to_string()))
}

/// Writes `value` at `path` (the mappings on the way exist).
fn set(doc: &mut Value, path: &[Seg], value: Value) {
    let Some((last, parents)) = path.split_last() else {
        *doc = value;
        return;
    };
    let mut node = doc;
    for seg in parents {
        node = match seg {
            Seg::Key(key) => &mut node[key.as_str()],
            Seg::Index(index) => &mut node[*index],
        };
    }
    match last {
        Seg::Key(key) => {
            node.as_object_mut()
                .unwrap_or_else(|| panic!("no mapping at {}", path_text(parents)))
                .insert(key.clone(), value);
        }
        Seg::Index(index) => node[*index] = value,
    }
}

/// Removes the key at `path`.
fn remove(doc: &mut Value, path: &[Seg]) {
    let Some((Seg::Key(last), parents)) = path.split_last() else {
        panic!("not a key: {}", path_text(path));
    };
    let mut node = doc;
    for seg in parents {
        node = match seg {
            Seg::Key(key) => &mut node[key.as_str()],
            Seg::Index(index) => &mut node[*index],
        };
    }
    if let Some(map) = node.as_object_mut() {
        map.remove(last);
    }
}

/// A value the shape admits: its first alternative, its required keys, its examples.
fn example(shape: &Shape) -> Value {
    match &shape.kind {
        Kind::Boolean => json!(false),
        Kind::Integer { min, .. } => json!(min),
        Kind::Ratio => json!(0.5),
        Kind::String { example, .. } => json!(example),
        Kind::Words { words, .. } | Kind::Exact(words) => json!(words[0]),
        Kind::List { item, min, .. } => Value::Array(vec![example(item); min.unwrap_or(1).max(1)]),
        Kind::Object(object) => {
            let mut map = Map::new();
            for field in object.fields.iter().filter(|field| field.required) {
                map.insert(field.key.to_string(), example(&field.shape));
            }
            if let Some(entries) = &object.entries {
                if object.min_entries.unwrap_or(0) > 0 {
                    map.insert(entries.example.to_string(), example(&entries.value));
                }
            }
            for constraint in &object.constraints {
                match constraint {
                    Constraint::ExactlyOne(keys) | Constraint::AtLeastOne(keys) => {
                        let field = object.fields.iter().find(|field| field.key == keys[0]);
                        let value = field.map_or(json!(1), |field| example(&field.shape));
                        map.insert(keys[0].to_string(), value);
                    }
                    Constraint::Required(key) => {
                        let field = object.fields.iter().find(|field| field.key == *key);
                        let value = field.map_or(json!(1), |field| example(&field.shape));
                        map.insert(key.to_string(), value);
                    }
                    Constraint::AtMostOne(_) | Constraint::Needs { .. } | Constraint::Never(_) => {}
                }
            }
            // A key written brings the key it needs.
            for constraint in &object.constraints {
                if let Constraint::Needs { key, needs } = constraint {
                    if map.contains_key(*key) && !map.contains_key(*needs) {
                        let field = object.fields.iter().find(|field| field.key == *needs);
                        let value = field.map_or(json!(1), |field| example(&field.shape));
                        map.insert(needs.to_string(), value);
                    }
                }
            }
            Value::Object(map)
        }
        Kind::OneOf(shapes) | Kind::AnyOf(shapes) => example(&shapes[0]),
    }
}

/// Another value the shape admits (for a remote document that changes a field), if the
/// description can tell one.
fn second(shape: &Shape) -> Option<Value> {
    match &shape.kind {
        Kind::Boolean => Some(json!(true)),
        Kind::Integer { min, max } => (min != max).then(|| json!(max)),
        Kind::Ratio => Some(json!(1)),
        Kind::String {
            example,
            max_length,
            ..
        } => {
            let longer = format!("{example}{}", example.chars().last()?);
            (max_length.is_none_or(|max| longer.len() <= max)).then(|| json!(longer))
        }
        Kind::Words { words, .. } => Some(json!(words.get(1).unwrap_or(&words[0]).to_uppercase())),
        Kind::Exact(words) => words.get(1).map(|word| json!(word)),
        Kind::List { item, min, .. } => match min {
            Some(min) if *min > 0 => Some(Value::Array(vec![second(item)?])),
            _ => Some(json!([])),
        },
        Kind::Object(object) => {
            let mut value = example(shape);
            let map = value.as_object_mut()?;
            let (name, _) = map.iter().next()?;
            let name = name.clone();
            let field = object.fields.iter().find(|field| field.key == name)?;
            map.insert(name, second(&field.shape)?);
            Some(value)
        }
        Kind::OneOf(shapes) | Kind::AnyOf(shapes) => {
            second(&shapes[0]).or_else(|| shapes.get(1).map(example))
        }
    }
}

/// Whether the shape admits `value`; `None`: the description cannot tell without reading
/// it as the reader does (a string other than the example, a mapping).
fn admits(shape: &Shape, value: &Value) -> Option<bool> {
    match &shape.kind {
        Kind::Boolean => Some(value.is_boolean()),
        Kind::Integer { min, max } => {
            Some(value.as_u64().is_some_and(|n| (*min..=*max).contains(&n)))
        }
        Kind::Ratio => Some(value.as_f64().is_some_and(|x| x > 0.0 && x <= 1.0)),
        Kind::String { example, .. } => match value.as_str() {
            None => Some(false),
            Some(text) if text == example => Some(true),
            Some(_) => None,
        },
        Kind::Words { words, plural } => Some(value.as_str().is_some_and(|text| {
            let text = text.trim().to_ascii_lowercase();
            let singular = if *plural {
                text.strip_suffix('s').unwrap_or(&text)
            } else {
                &text
            };
            words
                .iter()
                .any(|word| word.eq_ignore_ascii_case(&text) || word.eq_ignore_ascii_case(singular))
        })),
        Kind::Exact(words) => Some(value.as_str().is_some_and(|text| words.contains(&text))),
        Kind::List { item, min, max } => {
            let Some(items) = value.as_array() else {
                return Some(false);
            };
            if items.len() < min.unwrap_or(0) || items.len() > max.unwrap_or(usize::MAX) {
                return Some(false);
            }
            let verdicts: Vec<Option<bool>> = items
                .iter()
                .map(|item_value| admits(item, item_value))
                .collect();
            if verdicts.contains(&Some(false)) {
                Some(false)
            } else if verdicts.iter().all(|verdict| *verdict == Some(true)) {
                Some(true)
            } else {
                None
            }
        }
        Kind::Object(_) => {
            if !value.is_object() {
                Some(false)
            } else if *value == example(shape) {
                Some(true)
            } else {
                None
            }
        }
        Kind::OneOf(shapes) | Kind::AnyOf(shapes) => {
            let verdicts: Vec<Option<bool>> =
                shapes.iter().map(|shape| admits(shape, value)).collect();
            if verdicts.contains(&Some(true)) {
                Some(true)
            } else if verdicts.iter().all(|verdict| *verdict == Some(false)) {
                Some(false)
            } else {
                None
            }
        }
    }
}

/// Values written for a field of this shape, each with whether the description admits it.
fn probes(shape: &Shape) -> Vec<(Value, bool)> {
    match &shape.kind {
        Kind::Boolean => vec![
            (json!(true), true),
            (json!(false), true),
            (json!("yes"), false),
            (json!(1), false),
        ],
        Kind::Integer { min, max } => {
            let mut probes = vec![
                (json!(min), true),
                (json!(max), true),
                (json!(0.5), false),
                (json!("1"), false),
            ];
            if *max < u64::MAX {
                probes.push((json!(max + 1), false));
            }
            probes.push(if *min > 0 {
                (json!(min - 1), false)
            } else {
                (json!(-1), false)
            });
            probes
        }
        Kind::Ratio => vec![
            (json!(0.5), true),
            (json!(1), true),
            (json!(0), false),
            (json!(1.5), false),
            (json!(-0.5), false),
        ],
        Kind::String {
            example,
            min_length,
            max_length,
            ..
        } => {
            let mut probes = vec![(json!(example), true)];
            if let (Some(max), Some(last)) = (max_length, example.chars().last()) {
                let mut long = example.to_string();
                while long.len() <= *max {
                    long.push(last);
                }
                probes.push((json!(long), false));
            }
            if let Some(min) = min_length.filter(|min| *min > 0) {
                probes.push((json!(example[..min - 1]), false));
            }
            probes
        }
        Kind::Words { words, plural } => {
            let mut probes = vec![(json!("no-such-word"), false)];
            for word in words {
                probes.push((json!(word), true));
                probes.push((json!(word.to_uppercase()), true));
                probes.push((json!(format!(" {word} ")), true));
                probes.push((json!(format!("{word}s")), *plural));
            }
            probes
        }
        Kind::Exact(words) => {
            let mut probes = vec![(json!("no-such-word"), false)];
            for word in words {
                probes.push((json!(word), true));
                if word.to_uppercase() != *word {
                    probes.push((json!(word.to_uppercase()), false));
                }
            }
            probes
        }
        Kind::List { item, min, max } => {
            let one = example(item);
            let least = min.unwrap_or(0);
            let mut probes = vec![
                (Value::Array(vec![one.clone(); least.max(1)]), true),
                (json!("x"), false),
            ];
            if least > 0 {
                probes.push((json!([]), false));
            } else {
                probes.push((json!([]), true));
            }
            if let Some(max) = max {
                probes.push((Value::Array(vec![one.clone(); *max]), true));
                probes.push((Value::Array(vec![one; max + 1]), false));
            }
            probes
        }
        Kind::Object(_) => vec![
            (example(shape), true),
            (json!("x"), false),
            (json!(5), false),
        ],
        Kind::OneOf(shapes) | Kind::AnyOf(shapes) => {
            let mut found = Vec::new();
            for (index, alternative) in shapes.iter().enumerate() {
                for (value, own) in probes(alternative) {
                    let others: Vec<Option<bool>> = shapes
                        .iter()
                        .enumerate()
                        .filter(|(other, _)| *other != index)
                        .map(|(_, shape)| admits(shape, &value))
                        .collect();
                    if own || others.contains(&Some(true)) {
                        found.push((value, true));
                    } else if others.iter().all(|verdict| *verdict == Some(false)) {
                        found.push((value, false));
                    }
                }
            }
            found
        }
    }
}

/// A value of the environment the document names (`{env: NAME}`) is not the description's.
fn from_the_environment(error: &ConfigError) -> bool {
    matches!(&error.kind, ConfigErrorKind::Invalid { reason } if reason.contains("environment variable `"))
}

/// Why a reader refused a document: where, and whether the typed pass did (a check across
/// fields may still refuse what the typed pass read).
struct Refused {
    path: String,
    typed: bool,
    message: String,
}

/// Reads a document's text.
type Reader<'r> = &'r dyn Fn(&str) -> Result<(), Refused>;

/// The filter's reader.
fn policy(text: &str) -> Result<(), Refused> {
    parse_policy(text).map(drop).map_err(|error| Refused {
        path: error.path.clone(),
        typed: matches!(error.kind, ConfigErrorKind::Invalid { .. })
            && !from_the_environment(&error),
        message: error.to_string(),
    })
}

/// Reads `doc` and checks the verdict at `path`.
fn check(
    read: Reader<'_>,
    doc: &Value,
    path: &[Seg],
    admitted: bool,
    what: &str,
    failures: &mut Vec<String>,
) {
    let text = doc.to_string();
    let here = path_text(path);
    let under = |path: &str| {
        here.is_empty()
            || path == here
            || path.starts_with(&format!("{here}."))
            || path.starts_with(&format!("{here}["))
    };
    match read(&text) {
        Ok(()) if admitted => {}
        Ok(()) => failures.push(format!(
            "{here} = {what}: refused by the description, accepted by the reader\n  {text}"
        )),
        Err(refused) if admitted => {
            if refused.typed {
                failures.push(format!(
                    "{here} = {what}: admitted by the description, refused by the reader: {}\n  {text}",
                    refused.message
                ));
            }
        }
        Err(refused) if under(&refused.path) => {}
        Err(refused) => failures.push(format!(
            "{here} = {what}: refused elsewhere: {}\n  {text}",
            refused.message
        )),
    }
}

/// Makes the mapping at `path` fit its rules across keys once `name` is written: the
/// other keys of its group go, and a key it needs comes (without the others of its group).
fn keep_rules(object: &crate::config::shape::Object, doc: &mut Value, path: &[Seg], name: &str) {
    let others_of = |name: &str| -> Vec<&'static str> {
        object
            .constraints
            .iter()
            .filter_map(|constraint| match constraint {
                Constraint::ExactlyOne(keys) | Constraint::AtMostOne(keys)
                    if keys.contains(&name) =>
                {
                    Some(keys)
                }
                _ => None,
            })
            .flatten()
            .copied()
            .filter(|other| *other != name)
            .collect()
    };
    for other in others_of(name) {
        remove(doc, &key(path, other));
    }
    for constraint in &object.constraints {
        if let Constraint::Needs { key: wanted, needs } = constraint {
            if *wanted == name {
                for other in others_of(needs) {
                    remove(doc, &key(path, other));
                }
                let value = object
                    .fields
                    .iter()
                    .find(|field| field.key == *needs)
                    .map(|field| example(&field.shape));
                set(doc, &key(path, needs), value.unwrap_or(json!(1)));
            }
        }
    }
}

/// Probes every field under `shape`, written at `path` of `doc` (which holds an example
/// there); a named shape is walked once.
fn walk(
    read: Reader<'_>,
    shape: &Shape,
    doc: &Value,
    path: &[Seg],
    walked: &mut Vec<&'static str>,
    failures: &mut Vec<String>,
) {
    if let Some(name) = shape.name {
        if walked.contains(&name) {
            return;
        }
        walked.push(name);
    }
    match &shape.kind {
        Kind::Object(object) => {
            for field in &object.fields {
                let spellings: Vec<&str> = std::iter::once(field.key)
                    .chain(field.aliases.iter().copied())
                    .collect();
                for spelling in &spellings {
                    let mut base = doc.clone();
                    for other in &spellings {
                        remove(&mut base, &key(path, other));
                    }
                    keep_rules(object, &mut base, path, field.key);
                    let here = key(path, spelling);
                    for (value, admitted) in probes(&field.shape) {
                        let mut probe = base.clone();
                        let what = value.to_string();
                        set(&mut probe, &here, value);
                        check(read, &probe, &here, admitted, &what, failures);
                    }
                    let mut null = base.clone();
                    set(&mut null, &here, Value::Null);
                    check(read, &null, &here, false, "null", failures);
                    let mut written = base.clone();
                    set(&mut written, &here, example(&field.shape));
                    walk(read, &field.shape, &written, &here, walked, failures);
                }
                if field.required {
                    let mut missing = doc.clone();
                    for spelling in &spellings {
                        remove(&mut missing, &key(path, spelling));
                    }
                    check(
                        read,
                        &missing,
                        path,
                        false,
                        &format!("without {}", field.key),
                        failures,
                    );
                }
            }
            // Not a name an entry may take either (no spaces in plan or actor names).
            let mut unknown = doc.clone();
            set(&mut unknown, &key(path, "no such key"), json!(1));
            check(read, &unknown, path, false, "an unknown key", failures);
            if let Some(entries) = &object.entries {
                let here = key(path, entries.example);
                for (value, admitted) in probes(&entries.value) {
                    let mut probe = doc.clone();
                    let what = value.to_string();
                    set(&mut probe, &here, value);
                    check(read, &probe, &here, admitted, &what, failures);
                }
                if let Some(max) = object.max_entries {
                    let mut full = doc.clone();
                    for index in 0..=max {
                        set(
                            &mut full,
                            &key(path, &format!("{}{index}", entries.example)),
                            example(&entries.value),
                        );
                    }
                    check(
                        read,
                        &full,
                        path,
                        false,
                        &format!("{} entries", max + 1),
                        failures,
                    );
                }
                if object.min_entries.unwrap_or(0) > 0 {
                    let mut empty = doc.clone();
                    set(&mut empty, path, json!({}));
                    check(read, &empty, path, false, "no entries", failures);
                }
                let mut written = doc.clone();
                set(&mut written, &here, example(&entries.value));
                walk(read, &entries.value, &written, &here, walked, failures);
            }
            let value_of = |name: &str| {
                object
                    .fields
                    .iter()
                    .find(|field| field.key == name)
                    .map_or_else(
                        || {
                            object
                                .entries
                                .as_ref()
                                .map_or(json!(1), |e| example(&e.value))
                        },
                        |field| example(&field.shape),
                    )
            };
            for constraint in &object.constraints {
                let named: Vec<&str> = match constraint {
                    Constraint::ExactlyOne(keys)
                    | Constraint::AtMostOne(keys)
                    | Constraint::AtLeastOne(keys) => keys.clone(),
                    Constraint::Needs { key, needs } => vec![key, needs],
                    Constraint::Required(key) => vec![key],
                    Constraint::Never(_) => Vec::new(),
                };
                for name in named {
                    if !object.fields.iter().any(|field| field.key == name) {
                        failures.push(format!(
                            "{}: {constraint:?} names no field `{name}`",
                            path_text(path)
                        ));
                    }
                }
                let mut broken = doc.clone();
                let what = format!("{constraint:?} broken");
                match constraint {
                    Constraint::ExactlyOne(keys) => {
                        for name in keys {
                            set(&mut broken, &key(path, name), value_of(name));
                        }
                        check(read, &broken, path, false, &what, failures);
                        let mut none = doc.clone();
                        for name in keys {
                            remove(&mut none, &key(path, name));
                        }
                        check(read, &none, path, false, &what, failures);
                        continue;
                    }
                    Constraint::AtMostOne(keys) => {
                        for name in keys.iter().take(2) {
                            set(&mut broken, &key(path, name), value_of(name));
                        }
                    }
                    Constraint::AtLeastOne(keys) => {
                        for name in keys {
                            remove(&mut broken, &key(path, name));
                        }
                    }
                    Constraint::Needs { key: name, needs } => {
                        set(&mut broken, &key(path, name), value_of(name));
                        remove(&mut broken, &key(path, needs));
                    }
                    Constraint::Never(name) => set(&mut broken, &key(path, name), value_of(name)),
                    Constraint::Required(name) => remove(&mut broken, &key(path, name)),
                }
                check(read, &broken, path, false, &what, failures);
            }
        }
        Kind::List { item, .. } => {
            let here = at(path, Seg::Index(0));
            for (value, admitted) in probes(item) {
                let mut probe = doc.clone();
                let what = value.to_string();
                set(&mut probe, &here, value);
                check(read, &probe, &here, admitted, &what, failures);
            }
            walk(read, item, doc, &here, walked, failures)
        }
        Kind::OneOf(shapes) | Kind::AnyOf(shapes) => {
            for alternative in shapes {
                let mut written = doc.clone();
                set(&mut written, path, example(alternative));
                walk(read, alternative, &written, path, walked, failures);
            }
        }
        _ => {}
    }
}

#[test]
fn the_description_and_the_readers_agree_on_every_field() {
    let description = document();
    let mut failures = Vec::new();
    walk(
        &policy,
        &description,
        &example(&description),
        &[],
        &mut Vec::new(),
        &mut failures,
    );
    assert!(
        failures.is_empty(),
        "{} disagreements:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every field the full form reaches: its path from the root, its pin rule, its shape,
/// and a document that holds examples on the way to it.
fn fields_of(
    shape: &Shape,
    doc: &Value,
    path: &[Seg],
    found: &mut Vec<(Vec<Seg>, Pin, Shape, Value)>,
) {
    match &shape.kind {
        Kind::Object(object) => {
            for field in &object.fields {
                let here = key(path, field.key);
                let mut base = doc.clone();
                keep_rules(object, &mut base, path, field.key);
                found.push((here.clone(), field.pin, field.shape.clone(), base.clone()));
                set(&mut base, &here, example(&field.shape));
                fields_of(&field.shape, &base, &here, found);
            }
            if let Some(entries) = &object.entries {
                let here = key(path, entries.example);
                let mut base = doc.clone();
                set(&mut base, &here, example(&entries.value));
                fields_of(&entries.value, &base, &here, found);
            }
        }
        Kind::List { item, .. } => fields_of(item, doc, &at(path, Seg::Index(0)), found),
        Kind::OneOf(shapes) | Kind::AnyOf(shapes) => {
            for alternative in shapes
                .iter()
                .filter(|shape| matches!(shape.kind, Kind::Object(_)))
            {
                let mut base = doc.clone();
                set(&mut base, path, example(alternative));
                fields_of(alternative, &base, path, found);
            }
        }
        _ => {}
    }
}

/// A remote document that changes a field is refused, naming that field, exactly when the
/// description pins it; repeating the local value is not refused. (A free mapping changed
/// whole may be refused for a pinned value inside it, a free value for the pinned one
/// around it: not for itself.)
#[test]
fn a_remote_document_may_change_exactly_the_fields_the_description_leaves_free() {
    let description = document();
    let Kind::AnyOf(forms) = &description.kind else {
        panic!("the document is one of its forms");
    };
    let full = forms
        .iter()
        .find(|form| form.name == Some("full"))
        .expect("the full form");
    let mut fields = Vec::new();
    fields_of(full, &example(full), &[], &mut fields);
    let (mut pinned_checked, mut free_checked) = (0, 0);
    let mut failures = Vec::new();
    for (path, pin, shape, around) in fields {
        let here = path_text(&path);
        let Some(changed) = second(&shape) else {
            assert_eq!(
                pin,
                Pin::Free,
                "{here}: no second value to change a pinned field to"
            );
            continue;
        };
        let mut local_doc = around;
        set(&mut local_doc, &path, example(&shape));
        let Ok(local) = parse_policy(&local_doc.to_string()) else {
            // A value that needs others around it (`lease` needs `scope: global`).
            assert_eq!(
                pin,
                Pin::Free,
                "{here}: the local document is refused: {local_doc}"
            );
            continue;
        };
        let mut remote_doc = local_doc.clone();
        set(&mut remote_doc, &path, changed);
        let refused = match parse_remote(&remote_doc.to_string(), &local) {
            Err(RemoteError::Refused(error)) => Some(error),
            Err(RemoteError::Invalid(error))
                if pin != Pin::Free && !from_the_environment(&error) =>
            {
                failures.push(format!(
                    "{here}: the changed remote document is invalid: {error}"
                ));
                continue;
            }
            _ => None,
        };
        match (pin, refused) {
            (Pin::Free, None) => free_checked += 1,
            // Refused for a pinned value inside it, or around it: not for this one.
            (Pin::Free, Some(error)) if error.path != here => free_checked += 1,
            (Pin::Free, Some(error)) => {
                failures.push(format!("{here} is free, yet refused: {error}"))
            }
            (_, None) => failures.push(format!(
                "{here} is pinned, yet a remote document changed it"
            )),
            (_, Some(error)) => {
                if error.path != here || !matches!(error.kind, ConfigErrorKind::Pinned { .. }) {
                    failures.push(format!("{here}: refused as {error:?}"));
                }
                // The local value repeated is adopted.
                if let Err(error) = parse_remote(&local_doc.to_string(), &local) {
                    failures.push(format!(
                        "{here}: the local value repeated is refused: {error}"
                    ));
                }
                pinned_checked += 1;
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(pinned_checked, 12, "every pinned field is changed once");
    assert!(free_checked >= 40, "free fields changed: {free_checked}");
}

document_struct! {
    /// A block of the kind the next fields bring (a resource's `breaker`): a name among
    /// words, a ratio, a list of statuses or classes, and a value a remote document may not
    /// change.
    #[expecting = "a nested test block"]
    struct RawNested {
        mode: Option<ScopeField>;
        share: Option<Ratio> => "A share of requests";
        statuses: Option<StatusList>;
        target: Option<NonEmpty> [Pin::Pinned(PinnedValue::QuotaService)];
    }
}

document_struct! {
    /// Holds [`RawNested`] under a list, as a resource holds its rules.
    #[expecting = "a test document"]
    struct RawOuter {
        items: Vec<RawNested>;
    }
}

/// The description machinery on a nested block of the kinds the next fields need: the
/// reader and the description agree on every field, and the pinned value is found.
#[test]
fn a_nested_block_of_words_ratios_statuses_and_pins_is_described_by_its_declaration() {
    fn outer(text: &str) -> Result<(), Refused> {
        let mut deserializer = serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize::<_, RawOuter>(&mut deserializer)
            .map(drop)
            .map_err(|error| Refused {
                path: error.path().to_string(),
                typed: true,
                message: error.to_string(),
            })
    }
    let shape = RawOuter::shape();
    let mut failures = Vec::new();
    walk(
        &outer,
        &shape,
        &example(&shape),
        &[],
        &mut Vec::new(),
        &mut failures,
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    let pinned: Vec<(String, Pin)> = shape
        .pinned()
        .into_iter()
        .map(|(way, field)| (format!("{way:?}"), field.pin))
        .collect();
    assert_eq!(pinned.len(), 1, "{pinned:?}");
    assert_eq!(pinned[0].1, Pin::Pinned(PinnedValue::QuotaService));
    assert!(
        pinned[0].0.contains("Element") && pinned[0].0.contains("target"),
        "{pinned:?}"
    );

    let nested = shape
        .field("items")
        .and_then(|items| items.shape.item())
        .expect("items");
    let share = nested.field("share").expect("share");
    assert!(matches!(share.shape.kind, Kind::Ratio));
    assert!(!share.required);
    let statuses = nested.field("statuses").expect("statuses");
    assert!(matches!(
        &statuses.shape.kind,
        Kind::List { min: Some(1), max: Some(32), item } if matches!(item.kind, Kind::OneOf(_))
    ));
    // A JSON array is not a mapping, as in YAML.
    assert!(outer(r#"{"items": [["global"]]}"#).is_err());
    let read: RawOuter = serde_json::from_str(
        r#"{"items": [{"mode": " GLOBAL ", "share": 0.25, "statuses": [401, "5xx"], "target": "x"}]}"#,
    )
    .expect("a nested block");
    let item = &read.items[0];
    assert_eq!(
        item.mode.as_ref().map(|mode| mode.0),
        Some(crate::config::Scope::Global)
    );
    assert_eq!(item.share.as_ref().map(|share| share.0), Some(0.25));
    assert_eq!(
        item.statuses.as_ref().map(|list| list.0.clone()),
        Some(vec![(401, 401), (500, 599)])
    );
    assert_eq!(
        item.target.as_ref().map(|target| target.0.as_str()),
        Some("x")
    );
}
