//! Who may call the gateway endpoints (`/v1/acquire`, `/v1/wait`, `/v1/charge`): only a
//! caller presenting `authorization: Bearer <secret>` with one of the service's secrets.
//! Everything else is answered `401` (with `www-authenticate: Bearer`) before its body is
//! read, and nothing is touched. `/healthz`, `/readyz` and `/metrics` need no secret (they
//! reveal no counter and no key).
//!
//! - The secrets come from `--token-file PATH` (one per line: several are accepted at once,
//!   for rotation) and/or the environment variable [`TOKEN_ENV`]; never from a
//!   command-line value (which `ps` would show). Each is at least [`MIN_SECRET_BYTES`]
//!   bytes of printable ASCII.
//! - A presented token is compared with every secret, each as a SHA-256 digest, with
//!   `subtle`'s constant-time equality, without stopping at the first match: the time taken
//!   tells nothing of which secret matched, nor how much of one, nor its length.
//! - A secret is never logged, nor printed in an error (not even its length).
//! - Without any secret the service refuses to start, unless `--insecure-no-auth` says to
//!   serve everyone ([`Auth::insecure`]).

use axum::http::{header, HeaderMap};
use sha2::{Digest, Sha256};
use std::fmt;
use std::path::Path;
use std::sync::{Arc, RwLock};
use subtle::{Choice, ConstantTimeEq};

/// The environment variable that may hold the secret (or several, one per line).
pub const TOKEN_ENV: &str = "DIANA_QUOTA_TOKEN";

/// The authentication scheme, as sent back in `www-authenticate`.
pub const SCHEME: &str = "Bearer";

/// A secret: the filter's own type (its `Debug` and `Display` never show it).
pub use diana_core::secret::{Secret, SecretError, MIN_SECRET_BYTES};

/// The message when no secret was given.
pub const NO_SECRET: &str = "no secret to authenticate the gateways: give --token-file PATH \
(one secret per line, at least 32 bytes each) or the environment variable DIANA_QUOTA_TOKEN; \
or, to serve without authentication (anyone who can reach the port can read, drain and reset \
every counter), --insecure-no-auth";

/// Why secrets, or the way the service authenticates, were refused. No variant holds a
/// secret, nor shows one; `origin` names where the secrets came from (`--token-file
/// /etc/diana/token: line 2`, `DIANA_QUOTA_TOKEN`).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{origin}: {error}")]
    BadSecret {
        origin: String,
        #[source]
        error: SecretError,
    },
    #[error("{origin}: no secret in it (one per line)")]
    NoSecretIn { origin: String },
    #[error("{origin}: {error}")]
    Unreadable {
        origin: String,
        #[source]
        error: std::io::Error,
    },
    #[error("{TOKEN_ENV}: not valid UTF-8 (a secret is printable ASCII)")]
    EnvironmentNotUtf8,
    /// Neither a secret nor `--insecure-no-auth`: the service must not start.
    #[error("{NO_SECRET}")]
    NoSecret,
    #[error(
        "--insecure-no-auth, but a secret is given too (--token-file or {TOKEN_ENV}): choose one"
    )]
    InsecureWithSecret,
    /// Secrets cannot replace "no authentication" (a reload under `--insecure-no-auth`).
    #[error("authentication is off (--insecure-no-auth)")]
    Off,
    /// A reload without a token file (the environment is read at start only).
    #[error("nothing to reload: no --token-file ({TOKEN_ENV} is read at start only)")]
    NoTokenFile,
}

/// Checks one secret (already trimmed); `origin` names where it comes from, for the
/// error (which never contains the secret).
pub fn checked(text: &str, origin: &str) -> Result<Secret, AuthError> {
    Secret::new(text).map_err(|error| AuthError::BadSecret {
        origin: origin.to_string(),
        error,
    })
}

fn digest_of(secret: &Secret) -> [u8; 32] {
    digest(secret.expose().as_bytes())
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The secrets in `text`: one per line, surrounding whitespace (and the newline) trimmed,
/// blank lines skipped. `origin` (`--token-file /etc/x`, `DIANA_QUOTA_TOKEN`) names the
/// source in errors, with the line number when there are several lines.
pub fn parse_secrets(text: &str, origin: &str) -> Result<Vec<Secret>, AuthError> {
    let lines: Vec<&str> = text.lines().collect();
    let mut secrets = Vec::new();
    for (number, line) in lines.iter().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = if lines.len() > 1 {
            format!("{origin}: line {}", number + 1)
        } else {
            origin.to_string()
        };
        secrets.push(checked(line, &at)?);
    }
    if secrets.is_empty() {
        return Err(AuthError::NoSecretIn {
            origin: origin.to_string(),
        });
    }
    Ok(secrets)
}

/// The secrets of a token file (see [`parse_secrets`]).
pub fn read_token_file(path: &Path) -> Result<Vec<Secret>, AuthError> {
    let origin = format!("--token-file {}", path.display());
    match std::fs::read_to_string(path) {
        Ok(text) => parse_secrets(&text, &origin),
        Err(error) => Err(AuthError::Unreadable { origin, error }),
    }
}

/// Warns when a token file can be read by others than its owner.
pub fn warn_if_readable_by_others(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(metadata) = std::fs::metadata(path) {
            let mode = metadata.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                tracing::warn!(
                    "--token-file {}: readable by group or others (mode {mode:o}); chmod 600 it",
                    path.display()
                );
            }
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// No `authorization` header.
    Missing,
    /// Not `Bearer <token>`, several headers, or a token that is no secret of ours.
    Invalid,
}

impl Rejection {
    /// The metric label (`diana_quota_unauthorized_total{reason=…}`).
    pub fn label(self) -> &'static str {
        match self {
            Rejection::Missing => "missing",
            Rejection::Invalid => "invalid",
        }
    }
}

/// The secrets the service accepts (any one of them), or none at all when authentication
/// is off. The set can be replaced while serving (`SIGHUP` re-reads the token file).
pub struct Auth {
    required: bool,
    digests: RwLock<Arc<Vec<[u8; 32]>>>,
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Auth")
            .field("required", &self.required)
            .field("secrets", &self.secrets())
            .finish()
    }
}

impl Auth {
    /// No authentication: every caller is served (`--insecure-no-auth`, tests).
    pub fn insecure() -> Auth {
        Auth {
            required: false,
            digests: RwLock::new(Arc::new(Vec::new())),
        }
    }

    /// Requires one of `secrets` (at least one).
    pub fn with_secrets(secrets: &[Secret]) -> Result<Auth, AuthError> {
        let auth = Auth {
            required: true,
            digests: RwLock::new(Arc::new(Vec::new())),
        };
        auth.replace(secrets)?;
        Ok(auth)
    }

    /// Whether a secret is required.
    pub fn is_required(&self) -> bool {
        self.required
    }

    /// How many secrets are accepted.
    pub fn secrets(&self) -> usize {
        self.current().len()
    }

    /// Accepts `secrets` from now on instead of the current ones (a reload). Refused, and
    /// nothing changed, when there are none or authentication is off.
    pub fn replace(&self, secrets: &[Secret]) -> Result<(), AuthError> {
        if !self.required {
            return Err(AuthError::Off);
        }
        if secrets.is_empty() {
            return Err(AuthError::NoSecret);
        }
        let digests: Vec<[u8; 32]> = secrets.iter().map(digest_of).collect();
        *self
            .digests
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Arc::new(digests);
        Ok(())
    }

    fn current(&self) -> Arc<Vec<[u8; 32]>> {
        self.digests
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Whether `token` is one of the secrets: its digest is compared with every secret's
    /// in constant time, all of them every time.
    pub fn accepts(&self, token: &[u8]) -> bool {
        let presented = digest(token);
        let mut matched = Choice::from(0);
        for known in self.current().iter() {
            matched |= known.as_slice().ct_eq(presented.as_slice());
        }
        bool::from(matched)
    }

    /// Checks a request's headers: exactly one `authorization: Bearer <token>` (the scheme
    /// in any case) whose token is a secret. Always `Ok` when authentication is off.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), Rejection> {
        if !self.required {
            return Ok(());
        }
        self.check_values(
            headers
                .get_all(header::AUTHORIZATION)
                .iter()
                .map(|value| value.as_bytes()),
        )
    }

    /// [`Auth::check`] on the values of the `authorization` header (or gRPC metadata key):
    /// exactly one, `Bearer <token>`, whose token is a secret.
    pub fn check_values<'a>(
        &self,
        mut values: impl Iterator<Item = &'a [u8]>,
    ) -> Result<(), Rejection> {
        if !self.required {
            return Ok(());
        }
        let Some(value) = values.next() else {
            return Err(Rejection::Missing);
        };
        if values.next().is_some() {
            return Err(Rejection::Invalid);
        }
        let value = value.trim_ascii();
        let Some(space) = value.iter().position(|&byte| byte == b' ') else {
            return Err(Rejection::Invalid);
        };
        let (scheme, token) = value.split_at(space);
        let token = token.trim_ascii();
        if !scheme.eq_ignore_ascii_case(SCHEME.as_bytes()) || token.is_empty() {
            return Err(Rejection::Invalid);
        }
        if self.accepts(token) {
            Ok(())
        } else {
            Err(Rejection::Invalid)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const ONE: &str = "0123456789abcdef0123456789abcdef";
    const TWO: &str = "fedcba9876543210fedcba9876543210-second";

    fn headers(values: &[&str]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for value in values {
            map.append(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn secrets_are_checked_and_never_shown() {
        assert_eq!(ONE.len(), MIN_SECRET_BYTES);
        assert!(checked(ONE, "x").is_ok());
        let short = &ONE[..31];
        let error = checked(short, "DIANA_QUOTA_TOKEN").unwrap_err();
        assert!(matches!(
            error,
            AuthError::BadSecret {
                error: SecretError::TooShort { bytes: 31 },
                ..
            }
        ));
        let error = error.to_string();
        assert_eq!(
            error,
            "DIANA_QUOTA_TOKEN: a secret must be at least 32 bytes (e.g. `openssl rand -hex 32`)"
        );
        assert!(!error.contains(short));
        let spaced = format!("{ONE} x");
        let error = checked(&spaced, "x").unwrap_err().to_string();
        assert!(error.contains("printable ASCII"), "{error}");
        assert!(!error.contains(ONE));
        assert_eq!(
            format!("{:?}", checked(ONE, "x").unwrap()),
            "Secret(<redacted>)"
        );
        let auth = Auth::with_secrets(&[checked(ONE, "x").unwrap()]).unwrap();
        assert!(!format!("{auth:?}").contains(ONE));
    }

    #[test]
    fn a_file_holds_one_secret_per_line() {
        let secrets = parse_secrets(&format!("{ONE}\n"), "f").unwrap();
        assert_eq!(secrets, [checked(ONE, "f").unwrap()]);
        let secrets = parse_secrets(&format!("  {ONE}  \r\n\n\t{TWO}\t\n\n"), "f").unwrap();
        assert_eq!(secrets.len(), 2);
        assert_eq!(
            parse_secrets(&format!("{ONE}\nshort\n"), "--token-file /t")
                .unwrap_err()
                .to_string(),
            "--token-file /t: line 2: a secret must be at least 32 bytes (e.g. `openssl rand -hex 32`)"
        );
        let empty = parse_secrets("\n  \n", "--token-file /t").unwrap_err();
        assert!(matches!(&empty, AuthError::NoSecretIn { origin } if origin == "--token-file /t"));
        assert_eq!(
            empty.to_string(),
            "--token-file /t: no secret in it (one per line)"
        );
        let missing = read_token_file(Path::new("/nonexistent/diana-token")).unwrap_err();
        assert!(matches!(&missing, AuthError::Unreadable { error, .. }
            if error.kind() == std::io::ErrorKind::NotFound));
        assert!(missing
            .to_string()
            .starts_with("--token-file /nonexistent/diana-token: "));
    }

    #[test]
    fn only_a_bearer_secret_passes() {
        let secrets = parse_secrets(&format!("{ONE}\n{TWO}"), "f").unwrap();
        let auth = Auth::with_secrets(&secrets).unwrap();
        assert!(auth.is_required());
        assert_eq!(auth.secrets(), 2);
        for good in [
            format!("Bearer {ONE}"),
            format!("Bearer {TWO}"),
            format!("bearer {ONE}"),
            format!("BEARER   {ONE} "),
        ] {
            assert_eq!(auth.check(&headers(&[&good])), Ok(()), "{good}");
        }
        assert_eq!(auth.check(&HeaderMap::new()), Err(Rejection::Missing));
        for bad in [
            format!("Bearer {ONE}x"),
            format!("Bearer {}", &ONE[..31]),
            format!("Basic {ONE}"),
            format!("Bearer{ONE}"),
            ONE.to_string(),
            "Bearer ".to_string(),
            "Bearer".to_string(),
            String::new(),
        ] {
            assert_eq!(
                auth.check(&headers(&[&bad])),
                Err(Rejection::Invalid),
                "{bad:?}"
            );
        }
        // Two headers, even both right: refused.
        let both = [format!("Bearer {ONE}"), format!("Bearer {ONE}")];
        assert_eq!(
            auth.check(&headers(&[&both[0], &both[1]])),
            Err(Rejection::Invalid)
        );
    }

    #[test]
    fn secrets_can_be_replaced_and_never_emptied() {
        let auth = Auth::with_secrets(&[checked(ONE, "x").unwrap()]).unwrap();
        assert!(auth.accepts(ONE.as_bytes()));
        auth.replace(&[checked(TWO, "x").unwrap()]).unwrap();
        assert!(!auth.accepts(ONE.as_bytes()));
        assert!(auth.accepts(TWO.as_bytes()));
        assert!(auth.replace(&[]).is_err());
        assert!(
            auth.accepts(TWO.as_bytes()),
            "a refused reload changes nothing"
        );
        assert!(Auth::with_secrets(&[]).is_err());
    }

    #[test]
    fn insecure_serves_everyone() {
        let auth = Auth::insecure();
        assert!(!auth.is_required());
        assert_eq!(auth.check(&HeaderMap::new()), Ok(()));
        assert_eq!(auth.check(&headers(&["Bearer nonsense"])), Ok(()));
        assert!(auth.replace(&[checked(ONE, "x").unwrap()]).is_err());
    }
}
