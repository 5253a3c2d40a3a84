//! Where a value is written: the field path and line/column of a value the typed pass
//! accepted but a check across fields refuses (a `cost` above what the rule can grant, a
//! `response_cost` on a leaky bucket, two rules sharing a metric name, …).
//!
//! The typed pass keeps no positions (serde gives none without an error), so a refusal
//! found later names the value by its [`Site`] (document, then keys and indices), and this
//! module reads the text once more to that value and stops there with an error: the
//! reader's own position of that error is the value's, and `serde_path_to_error` names
//! the path exactly as every other message does. It runs only for a refused document.

use super::model::Position;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// One step from a value to one inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// The value of a key in a mapping (`Url` also matches its alias `url`).
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

/// Where a site is: `(document label, path, position)`. The document label is set when the
/// text holds more than one document; the path and position are those of the value, or of
/// the nearest value around it that the text writes (a default is refused at its rule).
pub(super) fn locate(
    text: &str,
    json: bool,
    site: &Site,
) -> (Option<usize>, String, Option<Position>) {
    let mut steps: &[Step] = &site.steps;
    loop {
        let found = if json {
            at_json(text, steps)
        } else {
            at_yaml(text, site.document, steps)
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

fn at_json(text: &str, steps: &[Step]) -> Option<(String, Option<Position>)> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let mut track = serde_path_to_error::Track::new();
    let error = Seek { steps }
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

fn at_yaml(text: &str, document: usize, steps: &[Step]) -> Option<(String, Option<Position>)> {
    let document = serde_yaml::Deserializer::from_str(text).nth(document)?;
    let mut track = serde_path_to_error::Track::new();
    let error = Seek { steps }
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

/// What [`Here`] expects: every value refuses it, so the reader reports its position.
const HERE: &str = "\u{1}diana-locate\u{1}";

/// Walks the steps; returns `Ok` when the text does not hold them, an error raised at the
/// value when it does.
struct Seek<'s> {
    steps: &'s [Step],
}

impl<'de> DeserializeSeed<'de> for Seek<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        match self.steps {
            [] => deserializer.deserialize_any(Here),
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
        while let Some(key) = map.next_key::<serde_yaml::Value>()? {
            let matches = key
                .as_str()
                .is_some_and(|key| key == wanted || (wanted == "Url" && key == "url"));
            if matches {
                return map.next_value_seed(Seek { steps: rest });
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
        seq.next_element_seed(Seek { steps: rest })?;
        Ok(())
    }

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
}

/// Refuses whatever value it is given, expecting [`HERE`].
struct Here;

impl Visitor<'_> for Here {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(HERE)
    }
}
