//! The Diana document: parsing (YAML or JSON, every form of DESIGN §3), defaults and
//! validation, producing an immutable [`Policy`]. A bad document yields one
//! [`ConfigError`] naming the field and, for YAML/JSON text, its line and column.

mod model;
mod parse;
mod pin;
mod raw;
#[cfg(test)]
mod tests;

pub use model::*;
pub use parse::{parse_policy, TOKEN_ENV};
pub use pin::{parse_remote, RemoteError};
