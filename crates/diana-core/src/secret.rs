//! Secrets the document carries (`global.token`, `identity_key`, a remote signing key):
//! a type that never shows its value — not in `Debug`, not in `Display`, not in an error —
//! so that no log line, plan or panic message can leak one by accident.

use std::fmt;

/// The shortest secret Diana accepts, in bytes: 256 bits of a random secret.
pub const MIN_SECRET_BYTES: usize = 32;

/// A secret value. Compared only where it is used (the quota service compares in constant
/// time); here it is carried and handed to the host.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

/// Why a value cannot be a secret. Carries no part of the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretError {
    /// Shorter than [`MIN_SECRET_BYTES`].
    TooShort { bytes: usize },
    /// Holds a byte that cannot travel in an HTTP header (a control character or a space).
    NotHeaderSafe,
    /// `{env: NAME}` names a variable the process does not have.
    MissingEnv { name: String },
}

impl fmt::Display for SecretError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Not even its length is shown.
            SecretError::TooShort { .. } => write!(
                f,
                "a secret must be at least {MIN_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)"
            ),
            SecretError::NotHeaderSafe => f.write_str(
                "a secret may hold printable ASCII only, without spaces (it travels in an HTTP header)",
            ),
            SecretError::MissingEnv { name } => write!(
                f,
                "environment variable `{name}` is not set in the gateway's process (Envoy: list it in \
                 vm_config.environment_variables.host_env_keys; nginx: `env {name};` in the main context)"
            ),
        }
    }
}

impl std::error::Error for SecretError {}

impl Secret {
    /// Checks a secret's value: at least [`MIN_SECRET_BYTES`] bytes of printable ASCII
    /// without spaces. Surrounding white space (a file's trailing newline) is dropped.
    pub fn new(value: &str) -> Result<Secret, SecretError> {
        let value = value.trim();
        if value.len() < MIN_SECRET_BYTES {
            return Err(SecretError::TooShort { bytes: value.len() });
        }
        if !value.bytes().all(|byte| byte.is_ascii_graphic()) {
            return Err(SecretError::NotHeaderSafe);
        }
        Ok(Secret(value.to_string()))
    }

    /// Reads a secret from the process environment (`{env: NAME}` in the document).
    pub fn from_env(name: &str) -> Result<Secret, SecretError> {
        match std::env::var(name) {
            Ok(value) => Secret::new(&value),
            Err(_) => Err(SecretError::MissingEnv {
                name: name.to_string(),
            }),
        }
    }

    /// The value, for the one place that must send or key with it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_shows_its_value() {
        let value = "s3cr3t-".repeat(6);
        let secret = Secret::new(&value).expect("long enough");
        assert_eq!(secret.expose(), value);
        for shown in [format!("{secret:?}"), format!("{secret}")] {
            assert!(!shown.contains("s3cr3t"), "{shown}");
        }
    }

    #[test]
    fn short_or_unsendable_secrets_are_refused_without_their_value() {
        let cases: [(&str, SecretError); 3] = [
            ("short-secret", SecretError::TooShort { bytes: 12 }),
            ("", SecretError::TooShort { bytes: 0 }),
            (
                "0123456789abcdef 0123456789abcdef",
                SecretError::NotHeaderSafe,
            ),
        ];
        for (value, want) in cases {
            let error = Secret::new(value).expect_err(value);
            assert_eq!(error, want);
            if !value.is_empty() {
                assert!(!error.to_string().contains(value));
            }
        }
        // A file's trailing newline is not part of the secret.
        let padded = format!("{}\n", "k".repeat(32));
        assert_eq!(Secret::new(&padded).expect("ok").expose(), "k".repeat(32));
    }

    #[test]
    fn a_missing_environment_variable_is_named() {
        let error = Secret::from_env("DIANA_TEST_SURELY_UNSET_VARIABLE").expect_err("unset");
        assert!(error
            .to_string()
            .contains("DIANA_TEST_SURELY_UNSET_VARIABLE"));
    }
}
