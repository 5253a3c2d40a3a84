//! The Diana document: parsing (YAML or JSON, every form of DESIGN §3), defaults and
//! validation, producing an immutable [`Policy`]. A bad document yields one
//! [`ConfigError`] naming the field and, for YAML/JSON text, its line and column.

mod model;
mod parse;
mod raw;
#[cfg(test)]
mod tests;

pub use model::*;
pub use parse::parse_policy;
