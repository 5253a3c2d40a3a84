//! Where a value is written: the field path and line/column of a value the typed pass
//! accepted but a check across fields refuses (a `cost` above what the rule can grant, a
//! `response_cost` on a leaky bucket, two rules sharing a metric name, …), and which of
//! some fields of the description a text writes (the pin pass of remote documents).
//!
//! The typed pass keeps no positions (serde gives none without an error), so a refusal
//! found later names the value by its [`Site`] (document, then keys and indices), and this
//! module reads the text once more to that value and stops there with an error: the
//! reader's own position of that error is the value's, and `serde_path_to_error` names
//! the path exactly as every other message does. It runs only for a refused document. A
//! key is matched under every spelling the description gives it (`Url`, `url`).

use super::error::Position;
use super::raw::document;
use super::shape::{Shape, Way};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// One step from a value to one inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// The value of a key in a mapping (under any of its spellings).
    Key(String),
    /// An element of a sequence.
    Index(usize),
}

/// A value of the text: its document (from 0) and the steps to it from the document's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Site {
    pub document: usize,
    pub steps: Vec<Step>,
}

impl Site {
    pub fn new(document: usize) -> Site {
        Site {
            document,
            steps: Vec::new(),
        }
    }

    /// The value at `key` inside this one.
    pub fn key(&self, key: &str) -> Site {
        let mut site = self.clone();
        site.steps.push(Step::Key(key.to_string()));
        site
    }

    /// The element `index` inside this one.
    pub fn index(&self, index: usize) -> Site {
        let mut site = self.clone();
        site.steps.push(Step::Index(index));
        site
    }
}

/// Where the reader stops at a value it is asked to find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// Where the value starts (YAML), or just into it (JSON: after a scalar, after the `{`
    /// or `[` of a mapping or sequence).
    AtValue,
    /// Once the whole value is read (JSON: after its closing `}` or `]`; YAML: where it
    /// starts, as before): where a reader that judged the whole value would stop.
    AfterValue,
}

/// Where a site is: `(document label, path, position)`. The document label is set when the
/// text holds more than one document; the path and position are those of the value, or of
/// the nearest value around it that the text writes (a default is refused at its rule).
pub(super) fn locate(
    text: &str,
    json: bool,
    site: &Site,
    stop: Stop,
) -> (Option<usize>, String, Option<Position>) {
    let description = document();
    let mut steps: &[Step] = &site.steps;
    loop {
        let seek = Seek {
            steps,
            shape: Some(&description),
            stop,
        };
        let found = if json {
            at_json(text, seek)
        } else {
            at_yaml(text, site.document, seek)
        };
        match (found, steps.split_last()) {
            (Some((path, position)), _) => {
                let label = (!json && serde_yaml::Deserializer::from_str(text).nth(1).is_some())
                    .then_some(site.document + 1);
                return (label, path, position);
            }
            (None, Some((_, shorter))) => steps = shorter,
            (None, None) => return (None, String::new(), None),
        }
    }
}

fn at_json(text: &str, seek: Seek<'_>) -> Option<(String, Option<Position>)> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let mut track = serde_path_to_error::Track::new();
    let error = seek
        .deserialize(serde_path_to_error::Deserializer::new(
            &mut deserializer,
            &mut track,
        ))
        .err()?;
    if !error.to_string().contains(HERE) {
        return None;
    }
    let position = (error.line() > 0).then(|| Position {
        line: error.line(),
        column: error.column(),
    });
    Some((path_text(track), position))
}

fn at_yaml(text: &str, document: usize, seek: Seek<'_>) -> Option<(String, Option<Position>)> {
    let document = serde_yaml::Deserializer::from_str(text).nth(document)?;
    let mut track = serde_path_to_error::Track::new();
    let error = seek
        .deserialize(serde_path_to_error::Deserializer::new(document, &mut track))
        .err()?;
    if !error.to_string().contains(HERE) {
        return None;
    }
    let position = error.location().map(|location| Position {
        line: location.line(),
        column: location.column(),
    });
    Some((path_text(track), position))
}

fn path_text(track: serde_path_to_error::Track) -> String {
    let path = track.path().to_string();
    if path == "." {
        String::new()
    } else {
        path
    }
}

/// A walker's visits of scalars: nothing on the way, nothing to do.
macro_rules! passes_scalars {
    () => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
            Ok(())
        }

        fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
            Ok(())
        }

        fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
            Ok(())
        }

        fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
            Ok(())
        }

        fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
            Ok(())
        }

        fn visit_unit<E: de::Error>(self) -> Result<(), E> {
            Ok(())
        }

        fn visit_none<E: de::Error>(self) -> Result<(), E> {
            Ok(())
        }
    };
}

/// What [`Here`] expects: every value refuses it, so the reader reports its position.
const HERE: &str = "\u{1}diana-locate\u{1}";

/// Walks the steps; returns `Ok` when the text does not hold them, an error raised at the
/// value when it does. `shape` is what the description says is here (`None`: nothing).
struct Seek<'s> {
    steps: &'s [Step],
    shape: Option<&'s Shape>,
    stop: Stop,
}

impl<'de> DeserializeSeed<'de> for Seek<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        match self.steps {
            [] => deserializer.deserialize_any(Here { stop: self.stop }),
            _ => deserializer.deserialize_any(self),
        }
    }
}

impl<'de> Visitor<'de> for Seek<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Some((Step::Key(wanted), rest)) = self.steps.split_first() else {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            return Ok(());
        };
        let field = self.shape.and_then(|shape| shape.field(wanted));
        while let Some(key) = map.next_key::<serde_yaml::Value>()? {
            let Some(key) = key.as_str() else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            if field.map_or(key == wanted, |field| field.spelled(key)) {
                let shape = match field {
                    Some(field) => Some(&field.shape),
                    None => self.shape.and_then(Shape::entry),
                };
                return map.next_value_seed(Seek {
                    steps: rest,
                    shape,
                    stop: self.stop,
                });
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Some((Step::Index(wanted), rest)) = self.steps.split_first() else {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            return Ok(());
        };
        let mut index = 0;
        while index < *wanted {
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
            index += 1;
        }
        seq.next_element_seed(Seek {
            steps: rest,
            shape: self.shape.and_then(Shape::item),
            stop: self.stop,
        })?;
        Ok(())
    }

    passes_scalars!();
}

/// Refuses whatever value it is given, expecting [`HERE`]; with [`Stop::AfterValue`], once
/// it has read the whole of a mapping or sequence.
struct Here {
    stop: Stop,
}

impl<'de> Visitor<'de> for Here {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(HERE)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        if self.stop == Stop::AfterValue {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        }
        Err(de::Error::invalid_type(de::Unexpected::Map, &self))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if self.stop == Stop::AfterValue {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
        }
        Err(de::Error::invalid_type(de::Unexpected::Seq, &self))
    }
}

/// The values a text writes for some fields of the description, each reached by a [`Way`]
/// from the document's root: where each is, which of `ways` reached it, and the value, in
/// the order the text writes them. `Err`: the reader's message (the text is not a
/// document).
pub(super) fn written(
    text: &str,
    json: bool,
    ways: &[Vec<Way>],
) -> Result<Vec<(Site, usize, serde_json::Value)>, String> {
    let mut found = Vec::new();
    let targets: Vec<(usize, &[Way])> = ways
        .iter()
        .enumerate()
        .map(|(index, way)| (index, way.as_slice()))
        .collect();
    if json {
        let mut deserializer = serde_json::Deserializer::from_str(text);
        Collect {
            targets: targets.clone(),
            site: Site::new(0),
            found: &mut found,
        }
        .deserialize(&mut deserializer)
        .map_err(|error| error.to_string())?;
        return Ok(found);
    }
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        Collect {
            targets: targets.clone(),
            site: Site::new(index),
            found: &mut found,
        }
        .deserialize(document)
        .map_err(|error| error.to_string())?;
    }
    Ok(found)
}

/// Walks a value toward the `targets` (what is left of each way, with its index); collects
/// the values where a way ends.
struct Collect<'w, 'f> {
    targets: Vec<(usize, &'w [Way])>,
    site: Site,
    found: &'f mut Vec<(Site, usize, serde_json::Value)>,
}

impl<'de> DeserializeSeed<'de> for Collect<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Collect<'_, '_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<serde_yaml::Value>()? {
            let Some(key) = key.as_str() else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            let onward: Vec<(usize, &[Way])> = self
                .targets
                .iter()
                .filter_map(|(index, way)| match way.split_first() {
                    Some((step, rest)) if step.takes_key(key) => Some((*index, rest)),
                    _ => None,
                })
                .collect();
            let site = self.site.key(key);
            if let Some((index, _)) = onward.iter().find(|(_, rest)| rest.is_empty()) {
                let value = map.next_value::<serde_json::Value>()?;
                self.found.push((site, *index, value));
            } else if onward.is_empty() {
                map.next_value::<IgnoredAny>()?;
            } else {
                map.next_value_seed(Collect {
                    targets: onward,
                    site,
                    found: &mut *self.found,
                })?;
            }
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let onward: Vec<(usize, &[Way])> = self
            .targets
            .iter()
            .filter_map(|(index, way)| match way.split_first() {
                Some((Way::Element, rest)) => Some((*index, rest)),
                _ => None,
            })
            .collect();
        let mut position = 0;
        loop {
            let site = self.site.index(position);
            let more = if let Some((index, _)) = onward.iter().find(|(_, rest)| rest.is_empty()) {
                match seq.next_element::<serde_json::Value>()? {
                    Some(value) => {
                        self.found.push((site, *index, value));
                        true
                    }
                    None => false,
                }
            } else if onward.is_empty() {
                seq.next_element::<IgnoredAny>()?.is_some()
            } else {
                seq.next_element_seed(Collect {
                    targets: onward.clone(),
                    site,
                    found: &mut *self.found,
                })?
                .is_some()
            };
            if !more {
                return Ok(());
            }
            position += 1;
        }
    }

    passes_scalars!();
}
