//! One description of the document: every key, what its value may be (type, range, names,
//! pattern), whether it must be written, and whether a remote document may change it.
//!
//! The readers declare it, so it cannot say something they do not do: each mapping of the
//! document is declared once, with [`document_struct!`], which writes both its serde reader
//! (in `raw`) and its [`Describe`] impl; a value type with a reader of its own (a number
//! in a range, a name from a registry, a header name, a secret) implements [`Describe`]
//! next to its visitor, from the same constants. What reads the description:
//!
//! ```text
//!   raw::document() ──▶ diana schema      the JSON schema (draft 4) and Kong's metadata
//!                  ├──▶ pin               which values a remote document may not change
//!                  ├──▶ locate            which spellings a key has (`Url`, `url`)
//!                  └──▶ parse             which keys make a document a block
//! ```
//!
//! Adding a field (docs/design.md, "Adding a field", says it at length):
//!
//! 1. one line in its mapping's [`document_struct!`] in `raw`: `key: Option<T>` (or `T`
//!    when it must be written), `[Pin::Pinned(PinnedValue::…)]` or
//!    `[Pin::LocalOnly(…)]` when a remote document may not change it, `=> "what it
//!    means"` for the schema. A nested block is a struct declared the same way
//!    (`#[shape = |shape: Shape| shape.named("…")]` to describe it once; `.constraint(…)`
//!    for a rule across its keys, which `parse::build` enforces with a typed refusal);
//! 2. a new value type: its reader and its [`Describe`] side by side, from the same
//!    constants (words from a registry: [`Shape::words`]; a share: `raw::Ratio`; integers:
//!    `raw::Ranged`; statuses or classes: `raw::StatusList`; a pattern with an example:
//!    [`Shape::string`]);
//! 3. what it means: `parse::build`, the CLI's plan, the README;
//! 4. a pinned field: its slot in `pin::SLOTS` and its line in `pin::inherit`;
//! 5. `diana schema --kong > kong/diana.meta.json`.
//!
//! `config/tests/description.rs` then checks the reader and the description field by
//! field, and the pin rule against the pin pass.

use super::error::{LocalOnly, PinnedValue};
use std::borrow::Cow;
use std::num::NonZeroU32;

/// Text of the description: mostly literals, some made from a registry.
pub type Text = Cow<'static, str>;

/// What a value may be.
#[derive(Debug, Clone)]
pub struct Shape {
    pub kind: Kind,
    /// The name it is described under once and referred to elsewhere (the JSON schema's
    /// `definitions`); `None`: described where it is used.
    pub name: Option<&'static str>,
    pub description: Option<Text>,
}

/// The kinds of values.
#[derive(Debug, Clone)]
pub enum Kind {
    Boolean,
    /// An integer in `min..=max`.
    Integer {
        min: u64,
        max: u64,
    },
    /// A number in (0, 1].
    Ratio,
    /// A string: a pattern it matches (a JSON schema regular expression), its length in
    /// bytes, and one value it may take (the description's tests write it).
    String {
        pattern: Option<Text>,
        min_length: Option<usize>,
        max_length: Option<usize>,
        example: Text,
    },
    /// One of these words, case-insensitive, surrounding spaces ignored; `plural`: with a
    /// trailing `s` too.
    Words {
        words: Vec<&'static str>,
        plural: bool,
    },
    /// Exactly one of these strings.
    Exact(Vec<&'static str>),
    /// A sequence of `min..=max` values of one shape.
    List {
        item: Box<Shape>,
        min: Option<usize>,
        max: Option<usize>,
    },
    Object(Object),
    /// Exactly one of these shapes (a number, or a mapping).
    OneOf(Vec<Shape>),
    /// At least one of these shapes (the document's forms).
    AnyOf(Vec<Shape>),
}

/// A mapping: its fields, the entries whose keys the writer names (plans, actors), and
/// the rules across its keys.
#[derive(Debug, Clone, Default)]
pub struct Object {
    pub fields: Vec<Field>,
    pub entries: Option<Entries>,
    pub min_entries: Option<usize>,
    pub max_entries: Option<usize>,
    pub constraints: Vec<Constraint>,
}

/// Entries whose keys the writer names: what a key looks like, one key it may be, and
/// what its value is.
#[derive(Debug, Clone)]
pub struct Entries {
    pub pattern: Text,
    pub example: &'static str,
    pub value: Box<Shape>,
}

/// A rule across the keys of one mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// Exactly one of these keys is written.
    ExactlyOne(Vec<&'static str>),
    /// At most one of these keys is written.
    AtMostOne(Vec<&'static str>),
    /// At least one of these keys is written.
    AtLeastOne(Vec<&'static str>),
    /// `key` only with `needs`.
    Needs {
        key: &'static str,
        needs: &'static str,
    },
    /// Never this key (a name the entries may not take).
    Never(&'static str),
    /// This key, which a `---` stream may write in another document, is written (the
    /// JSON forms are one document).
    Required(&'static str),
}

/// One key of a mapping.
#[derive(Debug, Clone)]
pub struct Field {
    pub key: &'static str,
    /// Other spellings the reader accepts for the key.
    pub aliases: &'static [&'static str],
    /// The key must be written (else it has a default, or means "none").
    pub required: bool,
    pub shape: Shape,
    /// What the key means, where it is used.
    pub description: Option<Text>,
    pub pin: Pin,
}

/// Whether a document from the config center may change a value (DESIGN §6: a remote
/// document cannot redirect or disarm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// A remote document writes it like any other value.
    Free,
    /// The local document's value holds: a remote document may leave it out (the local
    /// value is kept) or repeat it; a different value is refused unless the local
    /// `remote.allow` names [`PinnedValue::allowed_by`].
    Pinned(PinnedValue),
    /// Only the local document sets it: a remote document may leave it out or repeat it
    /// unchanged, whatever `remote.allow` says.
    LocalOnly(LocalOnly),
}

/// A type of the document that says what it may be.
pub trait Describe {
    fn shape() -> Shape;
}

impl Shape {
    pub fn new(kind: Kind) -> Shape {
        Shape {
            kind,
            name: None,
            description: None,
        }
    }

    pub fn boolean() -> Shape {
        Shape::new(Kind::Boolean)
    }

    pub fn integer(min: u64, max: u64) -> Shape {
        Shape::new(Kind::Integer { min, max })
    }

    pub fn ratio() -> Shape {
        Shape::new(Kind::Ratio)
    }

    pub fn string(example: impl Into<Text>) -> Shape {
        Shape::new(Kind::String {
            pattern: None,
            min_length: None,
            max_length: None,
            example: example.into(),
        })
    }

    pub fn words(words: Vec<&'static str>, plural: bool) -> Shape {
        Shape::new(Kind::Words { words, plural })
    }

    pub fn exact(words: Vec<&'static str>) -> Shape {
        Shape::new(Kind::Exact(words))
    }

    pub fn list(item: Shape) -> Shape {
        Shape::new(Kind::List {
            item: Box::new(item),
            min: None,
            max: None,
        })
    }

    pub fn object(fields: Vec<Field>) -> Shape {
        Shape::new(Kind::Object(Object {
            fields,
            ..Object::default()
        }))
    }

    pub fn one_of(shapes: Vec<Shape>) -> Shape {
        Shape::new(Kind::OneOf(shapes))
    }

    pub fn any_of(shapes: Vec<Shape>) -> Shape {
        Shape::new(Kind::AnyOf(shapes))
    }

    /// Described once under `name`.
    pub fn named(mut self, name: &'static str) -> Shape {
        self.name = Some(name);
        self
    }

    pub fn described(mut self, description: impl Into<Text>) -> Shape {
        self.description = Some(description.into());
        self
    }

    /// A string's pattern.
    pub fn pattern(mut self, regex: impl Into<Text>) -> Shape {
        if let Kind::String { pattern, .. } = &mut self.kind {
            *pattern = Some(regex.into());
        }
        self
    }

    /// A string's length bounds, in bytes.
    pub fn length(mut self, min: Option<usize>, max: Option<usize>) -> Shape {
        if let Kind::String {
            min_length,
            max_length,
            ..
        } = &mut self.kind
        {
            (*min_length, *max_length) = (min, max);
        }
        self
    }

    /// A list's length bounds.
    pub fn items(mut self, least: usize, most: usize) -> Shape {
        if let Kind::List { min, max, .. } = &mut self.kind {
            (*min, *max) = (Some(least), Some(most));
        }
        self
    }

    /// A mapping's entries named by the writer.
    pub fn entries(
        mut self,
        pattern: impl Into<Text>,
        example: &'static str,
        value: Shape,
        count: (Option<usize>, Option<usize>),
    ) -> Shape {
        if let Kind::Object(object) = &mut self.kind {
            object.entries = Some(Entries {
                pattern: pattern.into(),
                example,
                value: Box::new(value),
            });
            (object.min_entries, object.max_entries) = count;
        }
        self
    }

    /// A rule across a mapping's keys.
    pub fn constraint(mut self, constraint: Constraint) -> Shape {
        if let Kind::Object(object) = &mut self.kind {
            object.constraints.push(constraint);
        }
        self
    }

    /// The field `key` (or one of its aliases) of this mapping, or of the mapping among
    /// its alternatives.
    pub fn field(&self, key: &str) -> Option<&Field> {
        match &self.kind {
            Kind::Object(object) => object.fields.iter().find(|field| field.spelled(key)),
            Kind::OneOf(shapes) | Kind::AnyOf(shapes) => {
                shapes.iter().find_map(|shape| shape.field(key))
            }
            _ => None,
        }
    }

    /// What an element of this list (or of the list among its alternatives) is.
    pub fn item(&self) -> Option<&Shape> {
        match &self.kind {
            Kind::List { item, .. } => Some(item),
            Kind::OneOf(shapes) | Kind::AnyOf(shapes) => shapes.iter().find_map(Shape::item),
            _ => None,
        }
    }

    /// What a value of an entry named by the writer is.
    pub fn entry(&self) -> Option<&Shape> {
        match &self.kind {
            Kind::Object(object) => object.entries.as_ref().map(|entries| &*entries.value),
            Kind::OneOf(shapes) | Kind::AnyOf(shapes) => shapes.iter().find_map(Shape::entry),
            _ => None,
        }
    }

    /// Every field whose value a remote document may not simply change, with the way to
    /// it from this value, in the order the description gives them.
    pub fn pinned(&self) -> Vec<(Vec<Way>, &Field)> {
        let mut found = Vec::new();
        self.collect_pinned(&mut Vec::new(), &mut found);
        found
    }

    fn collect_pinned<'s>(&'s self, way: &mut Vec<Way>, found: &mut Vec<(Vec<Way>, &'s Field)>) {
        match &self.kind {
            Kind::Object(object) => {
                for field in &object.fields {
                    way.push(Way::Key {
                        key: field.key,
                        aliases: field.aliases,
                    });
                    if field.pin != Pin::Free && !found.iter().any(|(seen, _)| seen == way) {
                        found.push((way.clone(), field));
                    }
                    field.shape.collect_pinned(way, found);
                    way.pop();
                }
                if let Some(entries) = &object.entries {
                    way.push(Way::Entry);
                    entries.value.collect_pinned(way, found);
                    way.pop();
                }
            }
            Kind::List { item, .. } => {
                way.push(Way::Element);
                item.collect_pinned(way, found);
                way.pop();
            }
            Kind::OneOf(shapes) | Kind::AnyOf(shapes) => {
                for shape in shapes {
                    shape.collect_pinned(way, found);
                }
            }
            _ => {}
        }
    }
}

impl Field {
    /// A key whose value is `shape`.
    pub fn new(key: &'static str, required: bool, shape: Shape) -> Field {
        Field {
            key,
            aliases: &[],
            required,
            shape,
            description: None,
            pin: Pin::Free,
        }
    }

    /// A key whose value `T` reads (and describes).
    pub fn of<T: Describe>(key: &'static str, required: bool) -> Field {
        Field::new(key, required, T::shape())
    }

    pub fn described(mut self, description: impl Into<Text>) -> Field {
        self.description = Some(description.into());
        self
    }

    /// True when `key` is how the text may write this field.
    pub fn spelled(&self, key: &str) -> bool {
        self.key == key || self.aliases.contains(&key)
    }
}

/// A word as a pattern that matches it in any case (`tb` → `[Tt][Bb]`): letters as both
/// cases, digits, spaces, `_` and `-` as they are, any other character escaped. For a
/// pattern of words the reader takes case-insensitively.
pub fn case_insensitive(word: &str) -> String {
    let mut out = String::new();
    for c in word.chars() {
        if c.is_ascii_alphabetic() {
            out.push('[');
            out.push(c.to_ascii_uppercase());
            out.push(c.to_ascii_lowercase());
            out.push(']');
        } else if c.is_ascii_alphanumeric() || c == ' ' || c == '_' || c == '-' {
            out.push(c);
        } else {
            out.push('\\');
            out.push(c);
        }
    }
    out
}

/// A step from a value to values inside it, as the description knows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Way {
    /// The value of a field (under any of its spellings).
    Key {
        key: &'static str,
        aliases: &'static [&'static str],
    },
    /// Every element of a list.
    Element,
    /// Every entry whose key the writer names.
    Entry,
}

impl Way {
    /// True when this step goes into the value of the key `key`.
    pub fn takes_key(&self, key: &str) -> bool {
        match self {
            Way::Key {
                key: wanted,
                aliases,
            } => *wanted == key || aliases.contains(&key),
            Way::Entry => true,
            Way::Element => false,
        }
    }
}

impl Describe for bool {
    fn shape() -> Shape {
        Shape::boolean()
    }
}

/// A positive 32-bit integer (`rpu`, `burst`, a plan's limit).
impl Describe for NonZeroU32 {
    fn shape() -> Shape {
        Shape::integer(1, u64::from(u32::MAX)).named("positive")
    }
}

impl<T: Describe> Describe for Vec<T> {
    fn shape() -> Shape {
        Shape::list(T::shape())
    }
}

/// Declares a mapping of the document once: the serde reader (`deny_unknown_fields`; a
/// field of type `Option<T>` may be left out, and `null` is refused for it, see
/// `raw::present`) and its [`Describe`] impl. The fields keep the order written, which is
/// the reader's order (its "expected one of" lists).
///
/// ```text
/// document_struct! {
///     /// Rust documentation of the struct.
///     #[expecting = "the reader's `expected …` text"]
///     #[shape = |shape: Shape| shape.named("rule").described("For the JSON schema")]  // optional
///     pub(super) struct RawThing {
///         /// Rust documentation of the field.
///         key: Type;                                      // required
///         other: Option<Type> => "what it means";         // optional, described
///         url ("Url" | "url"): Type;                      // spelled `Url`, `url` also read
///         cluster: Option<Type> [Pin::Pinned(PinnedValue::QuotaService)] => "…";
///         allow: Option<Type> [Pin::LocalOnly(LocalOnly::Allow)];
///     }
/// }
/// ```
macro_rules! document_struct {
    (
        $(#[doc = $doc:literal])*
        #[expecting = $expecting:literal]
        $(#[shape = $finish:expr])?
        $vis:vis struct $name:ident { $($body:tt)* }
    ) => {
        $crate::config::shape::document_struct!(@field
            [$(#[doc = $doc])* #[expecting = $expecting] [$($finish)?] $vis $name]
            []
            $($body)*
        );
    };
    // An optional field.
    (@field $head:tt [$($done:tt)*]
        $(#[doc = $fdoc:literal])*
        $field:ident $(($key:literal $(| $alias:literal)*))? : Option<$ty:ty>
        $([$pin:expr])? $(=> $description:expr)? ;
        $($rest:tt)*
    ) => {
        $crate::config::shape::document_struct!(@field $head
            [$($done)* (
                [$(#[doc = $fdoc])*]
                [#[serde(default, deserialize_with = "present")]
                 $(#[serde(rename = $key $(, alias = $alias)*)])?]
                $field (Option<$ty>) ($ty) false
                ($crate::config::shape::document_struct!(@key $field $($key)?))
                ([$($($alias),*)?])
                ($crate::config::shape::document_struct!(@pin $($pin)?))
                ($crate::config::shape::document_struct!(@text $($description)?))
            )]
            $($rest)*
        );
    };
    // A required field.
    (@field $head:tt [$($done:tt)*]
        $(#[doc = $fdoc:literal])*
        $field:ident $(($key:literal $(| $alias:literal)*))? : $ty:ty
        $([$pin:expr])? $(=> $description:expr)? ;
        $($rest:tt)*
    ) => {
        $crate::config::shape::document_struct!(@field $head
            [$($done)* (
                [$(#[doc = $fdoc])*]
                [$(#[serde(rename = $key $(, alias = $alias)*)])?]
                $field ($ty) ($ty) true
                ($crate::config::shape::document_struct!(@key $field $($key)?))
                ([$($($alias),*)?])
                ($crate::config::shape::document_struct!(@pin $($pin)?))
                ($crate::config::shape::document_struct!(@text $($description)?))
            )]
            $($rest)*
        );
    };
    // Every field read: the struct and its description.
    (@field
        [$(#[doc = $doc:literal])* #[expecting = $expecting:literal] [$($finish:expr)?] $vis:vis $name:ident]
        [$((
            [$($doc_attr:tt)*] [$($serde_attr:tt)*] $field:ident ($ty:ty) ($described:ty) $required:literal
            ($key:expr) ([$($alias:expr),*]) ($pin:expr) ($description:expr)
        ))*]
    ) => {
        $(#[doc = $doc])*
        $vis struct $name {
            $($($doc_attr)* pub $field: $ty,)*
        }

        // Read from a mapping only: serde's derived reader would also take a JSON array
        // of the values in field order (YAML's reader never offers it one).
        const _: () = {
            type Written = $name;

            #[derive(serde::Deserialize)]
            #[serde(remote = "Written")]
            #[serde(deny_unknown_fields, expecting = $expecting)]
            #[allow(dead_code)]
            struct Fields {
                $($($serde_attr)* $field: $ty,)*
            }

            struct MapOnly;

            impl<'de> serde::de::Visitor<'de> for MapOnly {
                type Value = $name;

                fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    formatter.write_str($expecting)
                }

                fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<$name, A::Error> {
                    Fields::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                }
            }

            impl<'de> serde::Deserialize<'de> for $name {
                fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<$name, D::Error> {
                    deserializer.deserialize_map(MapOnly)
                }
            }
        };

        impl $crate::config::shape::Describe for $name {
            fn shape() -> $crate::config::shape::Shape {
                let shape = $crate::config::shape::Shape::object(vec![$(
                    $crate::config::shape::Field {
                        aliases: &[$($alias),*],
                        pin: $pin,
                        description: $description,
                        ..$crate::config::shape::Field::of::<$described>($key, $required)
                    },
                )*]);
                $(let shape = ($finish)(shape);)?
                shape
            }
        }
    };
    (@key $field:ident) => { stringify!($field) };
    (@key $field:ident $key:literal) => { $key };
    (@pin) => { $crate::config::shape::Pin::Free };
    (@pin $pin:expr) => { $pin };
    (@text) => { None };
    (@text $text:expr) => { Some($crate::config::shape::Text::from($text)) };
}

pub(super) use document_struct;
