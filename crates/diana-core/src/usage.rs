//! Token usage read from an LLM answer as it passes, and a number read from a request body
//! (the `reserve.json` of an LLM budget), without holding the body.
//!
//! # What is read
//!
//! A [`UsageSource`] names where the usage is. The provider sources read the provider's own
//! usage object; the field names are the providers' (an absent field counts 0):
//!
//! | source | input | output | total |
//! |---|---|---|---|
//! | `openai` | `usage.prompt_tokens` | `usage.completion_tokens` | `usage.total_tokens` |
//! | ... Responses API | `usage.input_tokens`, `response.usage.input_tokens` | `usage.output_tokens`, `response.usage.output_tokens` | `usage.total_tokens`, `response.usage.total_tokens` |
//! | `anthropic` | `usage.input_tokens` + `usage.cache_creation_input_tokens` + `usage.cache_read_input_tokens`, also under `message.usage` | `usage.output_tokens`, also `message.usage.output_tokens` | none |
//! | `gemini` | `usageMetadata.promptTokenCount` + `usageMetadata.toolUsePromptTokenCount` | `usageMetadata.candidatesTokenCount` + `usageMetadata.thoughtsTokenCount` | `usageMetadata.totalTokenCount` |
//! | `json: a.b.c` | | | the number at `a.b.c` |
//!
//! - OpenAI's `prompt_tokens` already includes cached prompt tokens and `completion_tokens`
//!   the reasoning tokens. A stream carries usage only when the request asked for it
//!   (`stream_options: {include_usage: true}`): every chunk then has `"usage": null` and
//!   the last chunk before `data: [DONE]` the usage of the whole answer. The Responses
//!   API's `response.completed` event carries it as `response.usage`.
//! - Anthropic's `input_tokens` counts only the tokens that were not read from or written
//!   to the prompt cache, so the input is the sum of the three (as Anthropic's docs define
//!   the total input and as Envoy AI Gateway counts it). A stream's `message_start` event
//!   carries `message.usage` (input, and an output of 1 or so); each `message_delta`
//!   carries `usage` with the *cumulative* `output_tokens` (and in newer versions the input
//!   fields again): each field's last value wins.
//! - Gemini's counts are cumulative in every chunk of a stream; each `usageMetadata`
//!   object replaces the previous one as a whole (proto3 JSON leaves out fields that are
//!   0, so a field absent from the last object is 0, not its earlier value). Thinking
//!   tokens are billed as output. A Gemini stream without `alt=sse` is one JSON array of
//!   answers: arrays are transparent (below), so the last element's usage wins.
//! - `json: <dotted path>`: the number at that path of the answer (of the last SSE event
//!   that has it), read as the call's total.
//!
//! Paths name object keys from the top of a JSON document. An array is transparent: each
//! element is read as if it stood in the array's place (so `[{"usage": …}, …]` is read
//! like a stream of answers). Only the key path decides: a string that contains `"usage"`
//! (the model's text, a tool call's arguments) is a string, and an object named `usage`
//! deeper in the answer (inside `choices`, `content`) is not at the path.
//!
//! A value at a path must be a non-negative integer (`12`, or `12.0`); `null` counts as
//! absent; anything else (a string, `-1`, `1.5`, `1e3`, a number above `u64::MAX`) makes
//! the result [`NoValue::Invalid`].
//!
//! # Framing
//!
//! [`Framing::of_content_type`]: `text/event-stream` is read as server-sent events
//! (WHATWG HTML §9.2: lines end in CRLF, LF or CR; `:` starts a comment such as `: ping`;
//! an event's `data:` lines are joined with a line feed; a blank line ends the event; a
//! leading byte-order mark is skipped), each event's data as one JSON document, and a data
//! of exactly `[DONE]` as OpenAI's end marker. Anything else is read as one JSON document
//! (`application/json`; also Gemini's array of answers).
//!
//! # Memory and time
//!
//! The reader never holds any part of the body. It is a fixed-size value (at most
//! [`READER_BYTES_MAX`] bytes, checked at compile time) that allocates nothing while it
//! reads: a bit per open container (at most [`MAX_DEPTH`] deep), the match state of the
//! containers on the way to a usage field (at most [`MAX_FOLLOWED`]; deeper ones are not
//! read), how much of the current key matches, the number being read, and the values found.
//! Each byte is looked at once; the contents of strings are skipped a run at a time.
//! Nothing passes through the reader: it only looks at the bytes the host forwards.
//!
//! # Outcome
//!
//! ```text
//!  JSON body                                   SSE stream
//!  ─────────                                   ──────────
//!  feed ─▶ one JSON value ─▶ finish            feed ─▶ event ─▶ blank line ─▶ event's JSON
//!    │ syntax error / deeper than MAX_DEPTH:     │        whole: its values replace the earlier ones
//!    │ Malformed, nothing more is read           │        broken: skipped, counted (Malformed
//!    │ body ends inside the value: CutShort      │                if no event had usage)
//!    │ empty body: Absent                        │        [DONE]: skipped
//!    ▼                                           ▼ stream ends inside an event's JSON: CutShort
//!  finish: a value at a path not an integer: Invalid; no value at any path: Absent;
//!          otherwise the Usage
//! ```
//!
//! [`NoValue::CutShort`] carries what was seen before the cut, so the caller can settle
//! that or keep the reservation. An event left without its closing blank line at the end
//! of the stream is read if its JSON is whole.
//!
//! # Request side
//!
//! [`RequestReader`] reads one number at a dotted path of a JSON request body (a
//! reservation: `max_tokens`, `max_completion_tokens`, `generationConfig.maxOutputTokens`)
//! with the same bounded reader. If the key appears more than once, the largest value is
//! taken: parsers differ on which duplicate wins, and a reservation must not be lower than
//! what the upstream may use.

use std::fmt;
use std::sync::Arc;

/// The deepest nesting of objects and arrays a body may have (as deep as `serde_json`
/// parses by default). Deeper: [`Problem::TooDeep`].
pub const MAX_DEPTH: usize = 128;

/// How many nested containers on the way to a usage field are followed. A field below
/// more containers than this (arrays count, being transparent) is not read.
pub const MAX_FOLLOWED: usize = 16;

/// The longest [`JsonPath`], in bytes.
pub const JSON_PATH_MAX: usize = 128;

/// The most a reader holds, in bytes: its whole size (checked at compile time). It
/// allocates nothing while it reads, whatever the body's size.
pub const READER_BYTES_MAX: usize = 1024;

const _: () = assert!(std::mem::size_of::<UsageReader>() <= READER_BYTES_MAX);
const _: () = assert!(std::mem::size_of::<RequestReader>() <= READER_BYTES_MAX);

// ---------------------------------------------------------------------------------------
// Public values.

/// The token usage of one LLM call, as the provider reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens (for Anthropic with the cache's, for Gemini with the tools').
    pub input: u64,
    /// Generated tokens (for Gemini with the thinking tokens).
    pub output: u64,
    /// The total the provider reported, if it reports one; the number read for a
    /// `json:` source.
    pub total: Option<u64>,
}

impl Usage {
    /// The call's tokens without weights: the reported total, else input + output.
    pub fn tokens(&self) -> u64 {
        self.total
            .unwrap_or_else(|| self.input.saturating_add(self.output))
    }
}

/// Prices of input and output tokens (`weights: {input: 1, output: 4}`), so one budget can
/// be counted in input-token equivalents or in money units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Weights {
    pub input: u64,
    pub output: u64,
}

impl Weights {
    /// `input × w_in + output × w_out`, saturating at `u64::MAX` (a budget can never be
    /// owed less because a product overflowed). A `json:` source has no input or output:
    /// weights do not apply to it.
    pub fn cost(&self, usage: &Usage) -> u64 {
        usage
            .input
            .saturating_mul(self.input)
            .saturating_add(usage.output.saturating_mul(self.output))
    }
}

/// Where an answer's usage is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UsageSource {
    OpenAi,
    Anthropic,
    Gemini,
    /// The number at a dotted path of the answer, read as [`Usage::total`].
    JsonPath(JsonPath),
}

impl UsageSource {
    /// The provider named as the document names it: `openai`, `anthropic` or `gemini`.
    pub fn provider(name: &str) -> Result<UsageSource, UnknownProvider> {
        match name {
            "openai" => Ok(UsageSource::OpenAi),
            "anthropic" => Ok(UsageSource::Anthropic),
            "gemini" => Ok(UsageSource::Gemini),
            _ => Err(UnknownProvider),
        }
    }
}

/// A provider name that is not `openai`, `anthropic` or `gemini`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownProvider;

impl fmt::Display for UnknownProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("expected openai, anthropic or gemini")
    }
}

impl std::error::Error for UnknownProvider {}

/// A dotted path of object keys (`usage.total_tokens`): at most [`JSON_PATH_MAX`] bytes,
/// segments of printable ASCII other than `.`, none empty. Cheap to clone (shared).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JsonPath(Arc<str>);

impl JsonPath {
    pub fn parse(text: &str) -> Result<JsonPath, JsonPathError> {
        if text.is_empty() {
            return Err(JsonPathError::Empty);
        }
        if text.len() > JSON_PATH_MAX {
            return Err(JsonPathError::TooLong { length: text.len() });
        }
        for (index, segment) in text.split('.').enumerate() {
            if segment.is_empty() {
                return Err(JsonPathError::EmptySegment { index });
            }
        }
        if let Some((at, character)) = text.char_indices().find(|&(_, c)| !c.is_ascii_graphic()) {
            return Err(JsonPathError::Character { character, at });
        }
        Ok(JsonPath(Arc::from(text)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for JsonPath {
    type Err = JsonPathError;
    fn from_str(text: &str) -> Result<JsonPath, JsonPathError> {
        JsonPath::parse(text)
    }
}

impl fmt::Display for JsonPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a text is not a [`JsonPath`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonPathError {
    Empty,
    TooLong {
        length: usize,
    },
    /// The segment at this index (from 0) is empty: `a..b`, `.a`, `a.`.
    EmptySegment {
        index: usize,
    },
    /// A character that is not printable ASCII, at this byte offset.
    Character {
        character: char,
        at: usize,
    },
}

impl fmt::Display for JsonPathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsonPathError::Empty => f.write_str("a JSON path is a dotted list of keys, not empty"),
            JsonPathError::TooLong { length } => write!(
                f,
                "a JSON path is at most {JSON_PATH_MAX} bytes, this one is {length}"
            ),
            JsonPathError::EmptySegment { index } => {
                write!(f, "key {} of the JSON path is empty", index + 1)
            }
            JsonPathError::Character { character, at } => write!(
                f,
                "a JSON path's keys are printable ASCII: {character:?} at byte {at}"
            ),
        }
    }
}

impl std::error::Error for JsonPathError {}

/// How a body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// One JSON document.
    Json,
    /// Server-sent events, each event's data a JSON document.
    Sse,
}

impl Framing {
    /// `text/event-stream` (any case, parameters ignored) is [`Framing::Sse`]; anything
    /// else, a missing header included, is read as JSON.
    pub fn of_content_type(value: &[u8]) -> Framing {
        let media_type = value.split(|&b| b == b';').next().unwrap_or_default();
        if media_type
            .trim_ascii()
            .eq_ignore_ascii_case(b"text/event-stream")
        {
            Framing::Sse
        } else {
            Framing::Json
        }
    }
}

/// Why no value was read. `T` is what a whole read gives ([`Usage`], or the request's
/// number).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoValue<T> {
    /// The body was read to its end and has no value at the source's paths.
    Absent,
    /// The body is not what its framing says (a JSON body, or the first broken event of a
    /// stream none of whose events had a value).
    Malformed(Malformed),
    /// A value at a path is not a non-negative integer.
    Invalid(InvalidValue),
    /// The body ended inside a JSON document; what the whole documents (events) before the
    /// cut gave, and for a JSON body what was read before it, if anything.
    CutShort { seen: Option<T> },
}

impl<T> fmt::Display for NoValue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoValue::Absent => f.write_str("the body has no value at the configured path"),
            NoValue::Malformed(malformed) => malformed.fmt(f),
            NoValue::Invalid(invalid) => invalid.fmt(f),
            NoValue::CutShort { seen: Some(_) } => {
                f.write_str("the body ended inside a JSON document (after some values were read)")
            }
            NoValue::CutShort { seen: None } => {
                f.write_str("the body ended inside a JSON document, before any value")
            }
        }
    }
}

impl<T: fmt::Debug> std::error::Error for NoValue<T> {}

/// Where and how a body broke its framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed {
    /// The offset of the offending byte in the body (for an event that ended too early,
    /// of the blank line that ended it).
    pub at: u64,
    pub problem: Problem,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed JSON at byte {}: {}", self.at, self.problem)
    }
}

/// What is wrong at a [`Malformed`] offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// A byte that cannot stand there.
    Unexpected(u8),
    /// A control character inside a string.
    ControlCharacter(u8),
    /// A backslash not followed by a JSON escape.
    BadEscape,
    /// A number that breaks JSON's grammar.
    BadNumber,
    /// Nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// An event's data ended inside its JSON document.
    Unfinished,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Unexpected(byte) => write!(f, "unexpected byte 0x{byte:02x}"),
            Problem::ControlCharacter(byte) => {
                write!(f, "control character 0x{byte:02x} in a string")
            }
            Problem::BadEscape => f.write_str("bad escape in a string"),
            Problem::BadNumber => f.write_str("bad number"),
            Problem::TooDeep => write!(f, "nested deeper than {MAX_DEPTH}"),
            Problem::Unfinished => f.write_str("the event's data ends inside its JSON"),
        }
    }
}

/// A value at a usage path that is not a token count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidValue {
    /// The dotted path the value was at.
    pub path: String,
    pub problem: NumberProblem,
}

impl fmt::Display for InvalidValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the value at {} is {}", self.path, self.problem)
    }
}

/// Why a value is not a token count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumberProblem {
    /// A string, `true`, `false`, an object or an array.
    NotANumber,
    Negative,
    /// A fraction other than `.0`, or an exponent.
    NotAnInteger,
    /// Above `u64::MAX`.
    TooLarge,
}

impl fmt::Display for NumberProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NumberProblem::NotANumber => "not a number",
            NumberProblem::Negative => "negative",
            NumberProblem::NotAnInteger => "not an integer",
            NumberProblem::TooLarge => "too large",
        })
    }
}

// ---------------------------------------------------------------------------------------
// The readers.

/// Reads an answer's usage as the body passes: [`feed`](Self::feed) each chunk the host
/// forwards, [`finish`](Self::finish) at the end of the stream.
#[derive(Debug, Clone)]
pub struct UsageReader {
    reader: Reader,
}

impl UsageReader {
    pub fn new(source: &UsageSource, framing: Framing) -> UsageReader {
        let table = match source {
            UsageSource::OpenAi => Table::Provider(&OPENAI),
            UsageSource::Anthropic => Table::Provider(&ANTHROPIC),
            UsageSource::Gemini => Table::Provider(&GEMINI),
            UsageSource::JsonPath(path) => Table::Path(path.clone()),
        };
        UsageReader {
            reader: Reader::new(table, framing, Combine::Last),
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        self.reader.feed(chunk);
    }

    /// The body's bytes fed so far.
    pub fn bytes_read(&self) -> u64 {
        self.reader.read
    }

    pub fn finish(self) -> Result<Usage, NoValue<Usage>> {
        self.reader
            .finish()
            .map(|values| usage_of(&values))
            .map_err(|no| no.map_seen(|values| usage_of(&values)))
    }
}

/// Reads the number at one dotted path of a JSON request body (the largest, if the key
/// appears more than once).
#[derive(Debug, Clone)]
pub struct RequestReader {
    reader: Reader,
}

impl RequestReader {
    pub fn new(path: &JsonPath) -> RequestReader {
        RequestReader {
            reader: Reader::new(Table::Path(path.clone()), Framing::Json, Combine::Max),
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        self.reader.feed(chunk);
    }

    pub fn bytes_read(&self) -> u64 {
        self.reader.read
    }

    pub fn finish(self) -> Result<u64, NoValue<u64>> {
        self.reader
            .finish()
            .map(|values| values.total)
            .map_err(|no| no.map_seen(|values| values.total))
    }
}

impl<T> NoValue<T> {
    fn map_seen<U>(self, f: impl FnOnce(T) -> U) -> NoValue<U> {
        match self {
            NoValue::Absent => NoValue::Absent,
            NoValue::Malformed(malformed) => NoValue::Malformed(malformed),
            NoValue::Invalid(invalid) => NoValue::Invalid(invalid),
            NoValue::CutShort { seen } => NoValue::CutShort { seen: seen.map(f) },
        }
    }
}

// ---------------------------------------------------------------------------------------
// What to look for.

/// What the number at a target adds to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Input,
    Output,
    Total,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A count: kept in this slot (the index of the provider's field, several paths may
    /// share one), added to this part.
    Count { slot: u8 },
    /// An object here replaces every count read before it.
    Group,
}

#[derive(Debug)]
struct Target {
    path: &'static str,
    role: Role,
}

#[derive(Debug)]
struct Provider {
    targets: &'static [Target],
    /// The part each slot adds to.
    parts: &'static [Part],
}

const fn count(path: &'static str, slot: u8) -> Target {
    Target {
        path,
        role: Role::Count { slot },
    }
}

static OPENAI: Provider = Provider {
    targets: &[
        count("usage.prompt_tokens", 0),
        count("usage.completion_tokens", 1),
        count("usage.total_tokens", 2),
        count("usage.input_tokens", 0),
        count("usage.output_tokens", 1),
        count("response.usage.input_tokens", 0),
        count("response.usage.output_tokens", 1),
        count("response.usage.total_tokens", 2),
    ],
    parts: &[Part::Input, Part::Output, Part::Total],
};

static ANTHROPIC: Provider = Provider {
    targets: &[
        count("usage.input_tokens", 0),
        count("usage.cache_creation_input_tokens", 1),
        count("usage.cache_read_input_tokens", 2),
        count("usage.output_tokens", 3),
        count("message.usage.input_tokens", 0),
        count("message.usage.cache_creation_input_tokens", 1),
        count("message.usage.cache_read_input_tokens", 2),
        count("message.usage.output_tokens", 3),
    ],
    parts: &[Part::Input, Part::Input, Part::Input, Part::Output],
};

static GEMINI: Provider = Provider {
    targets: &[
        Target {
            path: "usageMetadata",
            role: Role::Group,
        },
        count("usageMetadata.promptTokenCount", 0),
        count("usageMetadata.toolUsePromptTokenCount", 1),
        count("usageMetadata.candidatesTokenCount", 2),
        count("usageMetadata.thoughtsTokenCount", 3),
        count("usageMetadata.totalTokenCount", 4),
    ],
    parts: &[
        Part::Input,
        Part::Input,
        Part::Output,
        Part::Output,
        Part::Total,
    ],
};

/// The most slots a source has, and the most targets (a bit each in a `u16`).
const SLOTS: usize = 5;
const MAX_TARGETS: usize = 16;

const _: () = assert!(OPENAI.targets.len() <= MAX_TARGETS && OPENAI.parts.len() <= SLOTS);
const _: () = assert!(ANTHROPIC.targets.len() <= MAX_TARGETS && ANTHROPIC.parts.len() <= SLOTS);
const _: () = assert!(GEMINI.targets.len() <= MAX_TARGETS && GEMINI.parts.len() <= SLOTS);

/// The targets of one reader.
#[derive(Debug, Clone)]
enum Table {
    Provider(&'static Provider),
    /// One path, a count in slot 0 read as the total.
    Path(JsonPath),
}

impl Table {
    fn len(&self) -> usize {
        match self {
            Table::Provider(provider) => provider.targets.len(),
            Table::Path(_) => 1,
        }
    }

    fn all(&self) -> u16 {
        // At most MAX_TARGETS (16) targets: checked above.
        u16::try_from((1u32 << self.len().min(MAX_TARGETS)) - 1).unwrap_or(u16::MAX)
    }

    fn path(&self, target: usize) -> &[u8] {
        match self {
            Table::Provider(provider) => provider
                .targets
                .get(target)
                .map_or(&[][..], |t| t.path.as_bytes()),
            Table::Path(path) => path.as_str().as_bytes(),
        }
    }

    fn role(&self, target: usize) -> Role {
        match self {
            Table::Provider(provider) => {
                provider.targets.get(target).map_or(Role::Group, |t| t.role)
            }
            Table::Path(_) => Role::Count { slot: 0 },
        }
    }

    fn part(&self, slot: usize) -> Part {
        match self {
            Table::Provider(provider) => provider.parts.get(slot).copied().unwrap_or(Part::Total),
            Table::Path(_) => Part::Total,
        }
    }

    /// The targets of `live.mask` whose whole path leads to the value at `live`.
    fn complete(&self, live: Live) -> u16 {
        bits(live.mask)
            .filter(|&target| self.path(target).len() + 1 == usize::from(live.pos))
            .fold(0, |mask, target| mask | 1 << target)
    }
}

/// The indexes of the set bits of `mask`.
fn bits(mut mask: u16) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let bit = mask.trailing_zeros();
        // Clear the lowest set bit.
        mask &= mask.wrapping_sub(1);
        (bit < u16::BITS).then_some(bit as usize)
    })
}

// ---------------------------------------------------------------------------------------
// Values found.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Slot {
    /// Not written since the last commit.
    #[default]
    Untouched,
    /// Emptied by a group that began again.
    Cleared,
    Set {
        value: Result<u64, NumberProblem>,
        /// The target it was read at (for the error's path).
        target: u8,
    },
}

/// How a second value for a slot combines with the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Combine {
    /// The last one wins (an answer's usage).
    Last,
    /// The largest valid one wins (a reservation).
    Max,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slots([Slot; SLOTS]);

impl Slots {
    fn record(
        &mut self,
        combine: Combine,
        slot: usize,
        target: usize,
        value: Result<u64, NumberProblem>,
    ) {
        let Some(held) = self.0.get_mut(slot) else {
            return;
        };
        let new = Slot::Set {
            value,
            target: target as u8,
        };
        *held = match (combine, *held, value) {
            (Combine::Max, Slot::Set { value: Ok(old), .. }, Ok(value)) if old >= value => *held,
            (Combine::Max, Slot::Set { value: Ok(_), .. }, Err(_)) => *held,
            _ => new,
        };
    }

    fn clear(&mut self) {
        self.0 = [Slot::Cleared; SLOTS];
    }

    /// `self` with `newer`'s writes on top.
    fn overlaid(mut self, newer: &Slots) -> Slots {
        for (held, new) in self.0.iter_mut().zip(newer.0) {
            match new {
                Slot::Untouched => {}
                Slot::Cleared => *held = Slot::Untouched,
                Slot::Set { .. } => *held = new,
            }
        }
        self
    }
}

/// The values a whole read gives, by part: what [`UsageReader`] and [`RequestReader`]
/// make their results from.
struct Values {
    input: u64,
    output: u64,
    total: u64,
    has_total: bool,
}

fn usage_of(values: &Values) -> Usage {
    Usage {
        input: values.input,
        output: values.output,
        total: values.has_total.then_some(values.total),
    }
}

/// The values of committed slots: none set is `Ok(None)`; an invalid one is an error.
fn values_of(table: &Table, slots: &Slots) -> Result<Option<Values>, InvalidValue> {
    let mut values = Values {
        input: 0,
        output: 0,
        total: 0,
        has_total: false,
    };
    let mut any = false;
    for (index, slot) in slots.0.iter().enumerate() {
        let Slot::Set { value, target } = *slot else {
            continue;
        };
        let value = value.map_err(|problem| InvalidValue {
            path: String::from_utf8_lossy(table.path(usize::from(target))).into_owned(),
            problem,
        })?;
        any = true;
        match table.part(index) {
            Part::Input => values.input = values.input.saturating_add(value),
            Part::Output => values.output = values.output.saturating_add(value),
            Part::Total => {
                values.total = values.total.saturating_add(value);
                values.has_total = true;
            }
        }
    }
    Ok(any.then_some(values))
}

// ---------------------------------------------------------------------------------------
// The JSON tokenizer: validates one document a byte at a time and follows the key path.

/// The match state of a container (or of a value about to begin): which targets' paths
/// lead here (`mask`), and where their next key starts in the dotted path (`pos`; the
/// same for all of them, since they matched the same keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Live {
    mask: u16,
    pos: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A value: the document's, after `:`, or after `,` in an array.
    Value,
    /// Right after `[`.
    ValueOrClose,
    /// Right after `{`.
    KeyOrClose,
    /// After `,` in an object.
    Key,
    Colon,
    CommaOrClose,
    /// The document's value is whole; only whitespace may follow.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escape {
    None,
    Backslash,
    Unicode { digits: u8, code: u16 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NumAt {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Num {
    at: NumAt,
    value: u64,
    problem: Option<NumberProblem>,
}

impl Num {
    fn flag(&mut self, problem: NumberProblem) {
        self.problem.get_or_insert(problem);
    }

    fn digit(&mut self, byte: u8) {
        match self
            .value
            .checked_mul(10)
            .and_then(|value| value.checked_add(u64::from(byte - b'0')))
        {
            Some(value) => self.value = value,
            None => self.flag(NumberProblem::TooLarge),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Word {
    True,
    False,
    Null,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lex {
    Between(Expect),
    Str { key: bool, escape: Escape },
    Number(Num),
    Word { word: Word, rest: &'static [u8] },
    Failed,
}

/// How a document's data ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// One whole value.
    Complete,
    /// Only whitespace.
    Empty,
    /// Inside the value.
    Incomplete,
    Failed,
}

#[derive(Debug, Clone, Copy)]
struct Json {
    lex: Lex,
    /// Open containers; bit `d` of `kinds` is set when the one at depth `d` is an object.
    depth: u8,
    kinds: [u64; MAX_DEPTH / 64],
    /// The match state of the outermost `followed` open containers (the rest lead nowhere).
    followed: u8,
    live: [Live; MAX_FOLLOWED],
    /// The key being read: the targets it still matches, its length so far, and where it
    /// starts in their paths.
    key_mask: u16,
    key_len: u8,
    key_pos: u8,
    /// The match state of the value after the key just read.
    after_key: Live,
    /// The targets the scalar being read is the value of.
    scalar_for: u16,
}

const DEAD: Live = Live { mask: 0, pos: 0 };

impl Json {
    const fn new() -> Json {
        Json {
            lex: Lex::Between(Expect::Value),
            depth: 0,
            kinds: [0; MAX_DEPTH / 64],
            followed: 0,
            live: [DEAD; MAX_FOLLOWED],
            key_mask: 0,
            key_len: 0,
            key_pos: 0,
            after_key: DEAD,
            scalar_for: 0,
        }
    }

    /// Reads `bytes`; on an error, its offset in `bytes` (nothing more is read after it).
    fn feed(&mut self, doc: &mut Doc, bytes: &[u8]) -> Result<(), (usize, Problem)> {
        let mut at = 0;
        loop {
            if let Lex::Str {
                key,
                escape: Escape::None,
            } = self.lex
            {
                if key && self.key_mask != 0 {
                    // A key that may be on a path: byte by byte.
                } else if let Some(run) = string_stop(bytes.get(at..).unwrap_or_default()) {
                    // A value's string, or a key on no path: skip to what ends or escapes it.
                    at += run;
                } else {
                    return Ok(());
                }
            }
            let Some(&byte) = bytes.get(at) else {
                return Ok(());
            };
            match self.step(doc, byte) {
                Ok(true) => at += 1,
                Ok(false) => {}
                Err(problem) => {
                    self.lex = Lex::Failed;
                    return Err((at, problem));
                }
            }
        }
    }

    /// Reads one byte: whether it was consumed (a number ends at the byte after it, which
    /// is then read again).
    fn step(&mut self, doc: &mut Doc, byte: u8) -> Result<bool, Problem> {
        match self.lex {
            Lex::Between(expect) => self.between(doc, expect, byte).map(|()| true),
            Lex::Str { key, escape } => self.string(doc, key, escape, byte).map(|()| true),
            Lex::Number(num) => self.number(doc, num, byte),
            Lex::Word { word, rest } => match rest.split_first() {
                Some((&next, rest)) if next == byte => {
                    if rest.is_empty() {
                        self.scalar_end(doc, word_value(word));
                    } else {
                        self.lex = Lex::Word { word, rest };
                    }
                    Ok(true)
                }
                _ => Err(Problem::Unexpected(byte)),
            },
            Lex::Failed => Err(Problem::Unexpected(byte)),
        }
    }

    fn between(&mut self, doc: &mut Doc, expect: Expect, byte: u8) -> Result<(), Problem> {
        if matches!(byte, b' ' | b'\t' | b'\n' | b'\r') {
            return Ok(());
        }
        match (expect, byte) {
            (Expect::ValueOrClose, b']') => self.close(byte),
            (Expect::Value | Expect::ValueOrClose, _) => self.begin_value(doc, byte),
            (Expect::KeyOrClose, b'}') => self.close(byte),
            (Expect::KeyOrClose | Expect::Key, b'"') => {
                let live = self.top();
                self.key_mask = live.mask;
                self.key_len = 0;
                self.key_pos = live.pos;
                self.lex = Lex::Str {
                    key: true,
                    escape: Escape::None,
                };
                Ok(())
            }
            (Expect::Colon, b':') => {
                self.lex = Lex::Between(Expect::Value);
                Ok(())
            }
            (Expect::CommaOrClose, b',') => {
                self.lex = Lex::Between(if self.in_object() {
                    Expect::Key
                } else {
                    Expect::Value
                });
                Ok(())
            }
            (Expect::CommaOrClose, b']' | b'}') => self.close(byte),
            _ => Err(Problem::Unexpected(byte)),
        }
    }

    fn begin_value(&mut self, doc: &mut Doc, byte: u8) -> Result<(), Problem> {
        let live = if self.depth == 0 {
            Live {
                mask: doc.table.all(),
                pos: 0,
            }
        } else if self.in_object() {
            self.after_key
        } else {
            // Arrays are transparent: an element is at its array's place.
            self.top()
        };
        let complete = if live.mask == 0 {
            0
        } else {
            doc.table.complete(live)
        };
        match byte {
            b'{' => {
                for target in bits(complete) {
                    match doc.table.role(target) {
                        Role::Group => doc.staged.clear(),
                        Role::Count { slot } => doc.staged.record(
                            doc.combine,
                            usize::from(slot),
                            target,
                            Err(NumberProblem::NotANumber),
                        ),
                    }
                }
                self.open(
                    true,
                    Live {
                        mask: live.mask & !complete,
                        pos: live.pos,
                    },
                )?;
                self.lex = Lex::Between(Expect::KeyOrClose);
            }
            b'[' => {
                self.open(false, live)?;
                self.lex = Lex::Between(Expect::ValueOrClose);
            }
            b'"' => {
                self.scalar_for = complete;
                self.lex = Lex::Str {
                    key: false,
                    escape: Escape::None,
                };
            }
            b'-' | b'0'..=b'9' => {
                self.scalar_for = complete;
                let mut num = Num {
                    at: NumAt::Int,
                    value: 0,
                    problem: None,
                };
                match byte {
                    b'-' => {
                        num.at = NumAt::Minus;
                        num.flag(NumberProblem::Negative);
                    }
                    b'0' => num.at = NumAt::Zero,
                    _ => num.digit(byte),
                }
                self.lex = Lex::Number(num);
            }
            b't' => self.word(complete, Word::True, b"rue"),
            b'f' => self.word(complete, Word::False, b"alse"),
            b'n' => self.word(complete, Word::Null, b"ull"),
            _ => return Err(Problem::Unexpected(byte)),
        }
        Ok(())
    }

    fn word(&mut self, complete: u16, word: Word, rest: &'static [u8]) {
        self.scalar_for = complete;
        self.lex = Lex::Word { word, rest };
    }

    /// The match state of the innermost open container.
    fn top(&self) -> Live {
        if self.depth > 0 && self.followed == self.depth {
            self.live
                .get(usize::from(self.depth) - 1)
                .copied()
                .unwrap_or(DEAD)
        } else {
            DEAD
        }
    }

    fn in_object(&self) -> bool {
        let Some(depth) = usize::from(self.depth).checked_sub(1) else {
            return false;
        };
        self.kinds
            .get(depth / 64)
            .is_some_and(|word| word & (1 << (depth % 64)) != 0)
    }

    fn open(&mut self, object: bool, live: Live) -> Result<(), Problem> {
        let depth = usize::from(self.depth);
        let Some(word) = self.kinds.get_mut(depth / 64) else {
            return Err(Problem::TooDeep);
        };
        if object {
            *word |= 1 << (depth % 64);
        } else {
            *word &= !(1 << (depth % 64));
        }
        if live.mask != 0 && self.followed == self.depth {
            if let Some(slot) = self.live.get_mut(depth) {
                *slot = live;
                self.followed += 1;
            }
        }
        self.depth += 1;
        Ok(())
    }

    fn close(&mut self, byte: u8) -> Result<(), Problem> {
        if self.depth == 0 || self.in_object() != (byte == b'}') {
            return Err(Problem::Unexpected(byte));
        }
        self.depth -= 1;
        self.followed = self.followed.min(self.depth);
        self.value_end();
        Ok(())
    }

    fn value_end(&mut self) {
        self.lex = Lex::Between(if self.depth == 0 {
            Expect::Done
        } else {
            Expect::CommaOrClose
        });
    }

    fn string(
        &mut self,
        doc: &mut Doc,
        key: bool,
        escape: Escape,
        byte: u8,
    ) -> Result<(), Problem> {
        let decoded = match escape {
            Escape::None => match byte {
                b'"' => {
                    if key {
                        self.key_end(doc);
                    } else {
                        self.scalar_end(doc, Some(Err(NumberProblem::NotANumber)));
                    }
                    return Ok(());
                }
                b'\\' => {
                    self.lex = Lex::Str {
                        key,
                        escape: Escape::Backslash,
                    };
                    return Ok(());
                }
                0..=0x1f => return Err(Problem::ControlCharacter(byte)),
                _ => Some(byte),
            },
            Escape::Backslash => {
                let decoded = match byte {
                    b'"' | b'\\' | b'/' => byte,
                    b'b' => 0x08,
                    b'f' => 0x0c,
                    b'n' => b'\n',
                    b'r' => b'\r',
                    b't' => b'\t',
                    b'u' => {
                        self.lex = Lex::Str {
                            key,
                            escape: Escape::Unicode { digits: 0, code: 0 },
                        };
                        return Ok(());
                    }
                    _ => return Err(Problem::BadEscape),
                };
                Some(decoded)
            }
            Escape::Unicode { digits, code } => {
                let digit = match byte {
                    b'0'..=b'9' => byte - b'0',
                    b'a'..=b'f' => byte - b'a' + 10,
                    b'A'..=b'F' => byte - b'A' + 10,
                    _ => return Err(Problem::BadEscape),
                };
                let code = code << 4 | u16::from(digit);
                if digits < 3 {
                    self.lex = Lex::Str {
                        key,
                        escape: Escape::Unicode {
                            digits: digits + 1,
                            code,
                        },
                    };
                    return Ok(());
                }
                // Paths are ASCII: a key with another character matches none.
                u8::try_from(code).ok().filter(u8::is_ascii)
            }
        };
        if key {
            match decoded {
                Some(byte) => self.key_byte(doc, byte),
                None => self.key_mask = 0,
            }
        }
        self.lex = Lex::Str {
            key,
            escape: Escape::None,
        };
        Ok(())
    }

    fn key_byte(&mut self, doc: &Doc, byte: u8) {
        if self.key_mask != 0 {
            let at = usize::from(self.key_pos) + usize::from(self.key_len);
            for target in bits(self.key_mask) {
                match doc.table.path(target).get(at) {
                    Some(&expected) if expected == byte && expected != b'.' => {}
                    _ => self.key_mask &= !(1 << target),
                }
            }
        }
        // Paths are at most JSON_PATH_MAX (128) bytes: a longer key matches none.
        match self.key_len.checked_add(1) {
            Some(len) => self.key_len = len,
            None => self.key_mask = 0,
        }
    }

    fn key_end(&mut self, doc: &Doc) {
        let at = usize::from(self.key_pos) + usize::from(self.key_len);
        for target in bits(self.key_mask) {
            if !matches!(doc.table.path(target).get(at), None | Some(b'.')) {
                self.key_mask &= !(1 << target);
            }
        }
        self.after_key = match u8::try_from(at + 1) {
            Ok(pos) => Live {
                mask: self.key_mask,
                pos,
            },
            Err(_) => DEAD,
        };
        self.lex = Lex::Between(Expect::Colon);
    }

    fn number(&mut self, doc: &mut Doc, mut num: Num, byte: u8) -> Result<bool, Problem> {
        num.at = match (num.at, byte) {
            (NumAt::Minus, b'0') => NumAt::Zero,
            (NumAt::Minus | NumAt::Int, b'1'..=b'9') | (NumAt::Int, b'0') => {
                num.digit(byte);
                NumAt::Int
            }
            (NumAt::Zero | NumAt::Int, b'.') => NumAt::Dot,
            (NumAt::Dot | NumAt::Frac, b'0'..=b'9') => {
                if byte != b'0' {
                    num.flag(NumberProblem::NotAnInteger);
                }
                NumAt::Frac
            }
            (NumAt::Zero | NumAt::Int | NumAt::Frac, b'e' | b'E') => {
                num.flag(NumberProblem::NotAnInteger);
                NumAt::Exp
            }
            (NumAt::Exp, b'+' | b'-') => NumAt::ExpSign,
            (NumAt::Exp | NumAt::ExpSign | NumAt::ExpDigits, b'0'..=b'9') => NumAt::ExpDigits,
            (NumAt::Zero | NumAt::Int | NumAt::Frac | NumAt::ExpDigits, _) => {
                self.scalar_end(doc, num_value(num));
                return Ok(false);
            }
            _ => return Err(Problem::BadNumber),
        };
        self.lex = Lex::Number(num);
        Ok(true)
    }

    /// A scalar value ended: record it for the targets it is the value of.
    fn scalar_end(&mut self, doc: &mut Doc, value: Option<Result<u64, NumberProblem>>) {
        if let Some(value) = value {
            for target in bits(self.scalar_for) {
                if let Role::Count { slot } = doc.table.role(target) {
                    doc.staged
                        .record(doc.combine, usize::from(slot), target, value);
                }
            }
        }
        self.scalar_for = 0;
        self.value_end();
    }

    /// The data ended here.
    fn end(&mut self, doc: &mut Doc) -> End {
        match self.lex {
            Lex::Failed => End::Failed,
            Lex::Between(Expect::Done) => End::Complete,
            Lex::Between(Expect::Value) if self.depth == 0 => End::Empty,
            Lex::Number(num)
                if self.depth == 0
                    && matches!(
                        num.at,
                        NumAt::Zero | NumAt::Int | NumAt::Frac | NumAt::ExpDigits
                    ) =>
            {
                self.scalar_end(doc, num_value(num));
                End::Complete
            }
            _ => End::Incomplete,
        }
    }
}

fn num_value(num: Num) -> Option<Result<u64, NumberProblem>> {
    Some(match num.problem {
        Some(problem) => Err(problem),
        None => Ok(num.value),
    })
}

/// `null` is no value; `true` and `false` are not numbers.
fn word_value(word: Word) -> Option<Result<u64, NumberProblem>> {
    match word {
        Word::Null => None,
        Word::True | Word::False => Some(Err(NumberProblem::NotANumber)),
    }
}

// ---------------------------------------------------------------------------------------
// Framing: one JSON document, or server-sent events.

/// What one document (a JSON body, an SSE event's data) writes, and where.
#[derive(Debug, Clone)]
struct Doc {
    table: Table,
    combine: Combine,
    /// Written by the document being read; committed when it is whole.
    staged: Slots,
}

/// Where a server-sent-events line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At its first byte.
    Start,
    /// In the field name: how much of `data` it matched so far, or [`NOT_DATA`].
    Field {
        matched: u8,
    },
    /// Right after the field's colon (one space may follow).
    Space {
        data: bool,
    },
    Value {
        data: bool,
    },
    Comment,
}

const NOT_DATA: u8 = u8::MAX;
const DONE: &[u8] = b"[DONE]";
const BOM: &[u8] = b"\xef\xbb\xbf";

#[derive(Debug, Clone, Copy)]
struct Sse {
    line: Line,
    after_cr: bool,
    /// How much of a leading byte-order mark was skipped; 3 once past it.
    bom: u8,
    /// The pending event has a data line.
    data: bool,
    /// Where the last data line ended (the line feed that joins it to the next one is
    /// there).
    data_end: u64,
    /// How much of `[DONE]` the pending event's data matched, or [`NOT_DATA`].
    done: u8,
    /// Where the pending event's JSON broke.
    broken: Option<Malformed>,
    /// The first event that broke.
    first_broken: Option<Malformed>,
}

#[derive(Debug, Clone, Copy)]
enum Frame {
    Json { broken: Option<Malformed> },
    Sse(Sse),
}

#[derive(Debug, Clone)]
struct Reader {
    table: Table,
    doc: Doc,
    json: Json,
    frame: Frame,
    /// Written by the whole documents read so far.
    committed: Slots,
    read: u64,
}

impl Reader {
    fn new(table: Table, framing: Framing, combine: Combine) -> Reader {
        Reader {
            doc: Doc {
                table: table.clone(),
                combine,
                staged: Slots::default(),
            },
            table,
            json: Json::new(),
            frame: match framing {
                Framing::Json => Frame::Json { broken: None },
                Framing::Sse => Frame::Sse(Sse {
                    line: Line::Start,
                    after_cr: false,
                    bom: 0,
                    data: false,
                    data_end: 0,
                    done: 0,
                    broken: None,
                    first_broken: None,
                }),
            },
            committed: Slots::default(),
            read: 0,
        }
    }

    fn feed(&mut self, chunk: &[u8]) {
        let base = self.read;
        self.read = self.read.saturating_add(chunk.len() as u64);
        match &mut self.frame {
            Frame::Json { broken: None } => {
                if let Err((at, problem)) = self.json.feed(&mut self.doc, chunk) {
                    self.frame = Frame::Json {
                        broken: Some(Malformed {
                            at: base + at as u64,
                            problem,
                        }),
                    };
                }
            }
            Frame::Json { broken: Some(_) } => {}
            Frame::Sse(sse) => {
                let mut sse = *sse;
                self.feed_sse(&mut sse, base, chunk);
                self.frame = Frame::Sse(sse);
            }
        }
    }

    fn feed_sse(&mut self, sse: &mut Sse, base: u64, chunk: &[u8]) {
        let mut at = 0;
        while let Some(&byte) = chunk.get(at) {
            if usize::from(sse.bom) < BOM.len() {
                if BOM.get(usize::from(sse.bom)) == Some(&byte)
                    && base + at as u64 == u64::from(sse.bom)
                {
                    sse.bom += 1;
                    at += 1;
                    continue;
                }
                sse.bom = BOM.len() as u8;
            }
            if sse.after_cr && byte == b'\n' {
                sse.after_cr = false;
                at += 1;
                continue;
            }
            sse.after_cr = byte == b'\r';
            if byte == b'\r' || byte == b'\n' {
                self.end_line(sse, base + at as u64);
                at += 1;
                continue;
            }
            match sse.line {
                Line::Start if byte == b':' => {
                    sse.line = Line::Comment;
                    at += 1;
                }
                Line::Start => {
                    sse.line = Line::Field {
                        matched: data_match(0, byte),
                    };
                    at += 1;
                }
                Line::Field { matched } if byte == b':' => {
                    let data = usize::from(matched) == b"data".len();
                    if data {
                        self.data_line(sse);
                    }
                    sse.line = Line::Space { data };
                    at += 1;
                }
                Line::Field { matched } => {
                    sse.line = Line::Field {
                        matched: data_match(matched, byte),
                    };
                    at += 1;
                }
                Line::Space { data } => {
                    sse.line = Line::Value { data };
                    if byte == b' ' {
                        at += 1;
                    }
                }
                Line::Comment | Line::Value { data: false } => {
                    // Skip to the end of the line.
                    let rest = chunk.get(at..).unwrap_or_default();
                    at += line_end(rest).unwrap_or(rest.len());
                }
                Line::Value { data: true } => {
                    let rest = chunk.get(at..).unwrap_or_default();
                    let run = line_end(rest).unwrap_or(rest.len());
                    let data = rest.get(..run).unwrap_or_default();
                    self.event_data(sse, base + at as u64, data);
                    at += run;
                }
            }
        }
    }

    /// A `data` field's value begins: lines after the first are joined with a line feed.
    fn data_line(&mut self, sse: &mut Sse) {
        if sse.data {
            self.event_data(sse, sse.data_end, b"\n");
        }
        sse.data = true;
    }

    fn event_data(&mut self, sse: &mut Sse, offset: u64, data: &[u8]) {
        if sse.done != NOT_DATA {
            for &byte in data {
                sse.done = match DONE.get(usize::from(sse.done)) {
                    Some(&expected) if expected == byte => sse.done + 1,
                    _ => NOT_DATA,
                };
                if sse.done == NOT_DATA {
                    break;
                }
            }
        }
        if sse.broken.is_none() {
            if let Err((at, problem)) = self.json.feed(&mut self.doc, data) {
                sse.broken = Some(Malformed {
                    at: offset + at as u64,
                    problem,
                });
            }
        }
    }

    fn end_line(&mut self, sse: &mut Sse, offset: u64) {
        match sse.line {
            Line::Start => self.dispatch(sse, offset),
            // `data` alone on a line: a data line with an empty value.
            Line::Field { matched } if usize::from(matched) == b"data".len() => {
                self.data_line(sse);
                sse.data_end = offset;
            }
            Line::Space { data: true } | Line::Value { data: true } => sse.data_end = offset,
            _ => {}
        }
        sse.line = Line::Start;
    }

    /// A blank line: the pending event is whole.
    fn dispatch(&mut self, sse: &mut Sse, offset: u64) {
        if sse.data && usize::from(sse.done) != DONE.len() {
            let broken = match self.json.end(&mut self.doc) {
                End::Complete => {
                    self.committed = self.committed.overlaid(&self.doc.staged);
                    None
                }
                End::Empty => None,
                End::Incomplete => Some(Malformed {
                    at: offset,
                    problem: Problem::Unfinished,
                }),
                End::Failed => sse.broken,
            };
            if sse.first_broken.is_none() {
                sse.first_broken = broken;
            }
        }
        self.json = Json::new();
        self.doc.staged = Slots::default();
        sse.data = false;
        sse.done = 0;
        sse.broken = None;
    }

    fn finish(mut self) -> Result<Values, NoValue<Values>> {
        let seen = |table: &Table, slots: &Slots| values_of(table, slots).ok().flatten();
        let first_broken = match self.frame {
            Frame::Json {
                broken: Some(broken),
            } => return Err(NoValue::Malformed(broken)),
            Frame::Json { broken: None } => match self.json.end(&mut self.doc) {
                End::Complete => {
                    self.committed = self.committed.overlaid(&self.doc.staged);
                    None
                }
                End::Empty => return Err(NoValue::Absent),
                End::Incomplete | End::Failed => {
                    let slots = self.committed.overlaid(&self.doc.staged);
                    return Err(NoValue::CutShort {
                        seen: seen(&self.table, &slots),
                    });
                }
            },
            Frame::Sse(mut sse) => {
                // An event left without its blank line is read if its JSON is whole.
                if sse.data && usize::from(sse.done) != DONE.len() {
                    match self.json.end(&mut self.doc) {
                        End::Complete => {
                            self.committed = self.committed.overlaid(&self.doc.staged);
                        }
                        End::Empty => {}
                        End::Incomplete => {
                            return Err(NoValue::CutShort {
                                seen: seen(&self.table, &self.committed),
                            })
                        }
                        End::Failed => {
                            if sse.first_broken.is_none() {
                                sse.first_broken = sse.broken;
                            }
                        }
                    }
                }
                sse.first_broken
            }
        };
        match values_of(&self.table, &self.committed) {
            Err(invalid) => Err(NoValue::Invalid(invalid)),
            Ok(Some(values)) => Ok(values),
            Ok(None) => Err(first_broken.map_or(NoValue::Absent, NoValue::Malformed)),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Scanning runs of bytes eight at a time (the bytes of strings and of lines are most of a
// body): a word is looked at byte by byte only if it holds a byte that stops the run.

const ONES: u64 = u64::from_le_bytes([0x01; 8]);
const HIGHS: u64 = u64::from_le_bytes([0x80; 8]);

/// Whether a byte of `word` is zero.
const fn has_zero(word: u64) -> bool {
    word.wrapping_sub(ONES) & !word & HIGHS != 0
}

/// Whether a byte of `word` equals `byte`.
const fn has_byte(word: u64, byte: u8) -> bool {
    has_zero(word ^ (ONES * byte as u64))
}

/// Whether a byte of `word` is below `bound` (at most 128).
const fn has_below(word: u64, bound: u8) -> bool {
    word.wrapping_sub(ONES * bound as u64) & !word & HIGHS != 0
}

/// The offset of the first byte of `bytes` for which `stops`, looking at eight at a time
/// with `word_stops` (true if any of a word's bytes stops).
fn scan(
    bytes: &[u8],
    stops: impl Fn(u8) -> bool,
    word_stops: impl Fn(u64) -> bool,
) -> Option<usize> {
    let mut words = bytes.chunks_exact(8);
    let mut at = 0;
    for word in &mut words {
        let stop = <[u8; 8]>::try_from(word).map_or(true, |w| word_stops(u64::from_le_bytes(w)));
        if stop {
            if let Some(found) = word.iter().position(|&b| stops(b)) {
                return Some(at + found);
            }
        }
        at += 8;
    }
    words
        .remainder()
        .iter()
        .position(|&b| stops(b))
        .map(|found| at + found)
}

/// Where a string's plain run ends: a quote, a backslash or a control character.
fn string_stop(bytes: &[u8]) -> Option<usize> {
    scan(
        bytes,
        |b| b == b'"' || b == b'\\' || b < 0x20,
        |w| has_byte(w, b'"') || has_byte(w, b'\\') || has_below(w, 0x20),
    )
}

/// Where a line ends: CR or LF.
fn line_end(bytes: &[u8]) -> Option<usize> {
    scan(
        bytes,
        |b| b == b'\r' || b == b'\n',
        |w| has_byte(w, b'\r') || has_byte(w, b'\n'),
    )
}

/// The next state of matching a field name against `data`.
fn data_match(matched: u8, byte: u8) -> u8 {
    match b"data".get(usize::from(matched)) {
        Some(&expected) if expected == byte => matched + 1,
        _ => NOT_DATA,
    }
}

#[cfg(test)]
mod tests;
