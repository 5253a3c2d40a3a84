//! The Diana document: parsing (YAML or JSON, every form of DESIGN §3), defaults and
//! validation, producing an immutable [`Policy`]. A bad document yields one
//! [`ConfigError`]: what is wrong ([`ConfigErrorKind`]), the field path and, for what the
//! text holds, its line and column — checks across fields included.

mod error;
mod locate;
mod model;
mod parse;
mod pin;
mod raw;
mod shape;
#[cfg(test)]
mod tests;

pub use error::*;
pub use model::*;
pub use parse::{parse_policy, TOKEN_ENV};
pub use pin::parse_remote;
pub use raw::document;
pub use shape::{case_insensitive, Constraint, Entries, Field, Kind, Object, Pin, Shape, Way};
