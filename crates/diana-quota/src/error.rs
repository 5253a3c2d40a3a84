//! Why the service does not start, or stops: each cause a variant, so that callers and
//! tests match on what happened and the binary prints one line that says what to fix.

use crate::auth::AuthError;
use crate::rls::{ConfigError, KeyError};
use crate::store::RedisUrlError;

/// The service cannot start (or its server failed).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Redis(#[from] RedisUrlError),
    /// An `--rls-config` file cannot be read or is invalid.
    #[error(transparent)]
    RlsConfig(#[from] ConfigError),
    /// The RLS key (`--rls-key-file`, `DIANA_QUOTA_RLS_KEY`) cannot be used.
    #[error(transparent)]
    RlsKey(#[from] KeyError),
    #[error("--rls-config without --rls-listen: give the address to serve RLS on")]
    RlsConfigWithoutListen,
    #[error(
        "--rls-listen without --rls-config: give envoyproxy/ratelimit configuration files (a file or a directory)"
    )]
    RlsListenWithoutConfig,
    #[error("--insecure-open-view with --view-token-file: choose one")]
    OpenViewWithToken,
    /// `flag` names the listener (`--listen`, `--rls-listen`).
    #[error("cannot listen on {address} ({flag}): {error}")]
    Listen {
        address: String,
        flag: &'static str,
        #[source]
        error: std::io::Error,
    },
    /// The HTTP (`protocol` "HTTP") or gRPC server failed while serving.
    #[error("{protocol} server error: {error}")]
    Serve {
        protocol: &'static str,
        #[source]
        error: std::io::Error,
    },
}

impl StartError {
    /// The error of a listener that could not be bound (or read back) on `address`, the
    /// value of `flag`.
    pub fn listen(flag: &'static str, address: &str) -> impl FnOnce(std::io::Error) -> StartError {
        let address = address.to_string();
        move |error| StartError::Listen {
            address,
            flag,
            error,
        }
    }
}
