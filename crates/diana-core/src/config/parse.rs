//! placeholder
use super::{ConfigError, Policy};
pub fn parse_policy(_text: &str) -> Result<Policy, ConfigError> {
    Err(ConfigError { message: "not implemented".into() })
}
