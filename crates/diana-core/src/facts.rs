//! What the filter knows of a request, read lazily from the host: its headers, the client
//! address, (Envoy) its dynamic metadata, and how the host's verifier reads its bearer token. A leaf: identities (`actor`) and
//! claims (`jwt`) read through it.

use crate::usage::JsonPath;
/// What the filter knows of a request, read lazily from the host.
pub trait RequestFacts {
    /// A request header's value as raw bytes (not necessarily UTF-8), by lower-case name.
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// The client address without port (e.g. `10.0.0.1`, `::1`), as bytes.
    fn client_ip(&self) -> Option<Vec<u8>>;
    /// A leaf of the request's dynamic metadata (Envoy): `filter_metadata[namespace]`,
    /// then `path` through nested objects (a list by its index), as Envoy's proxy-wasm
    /// `get_property` hands it over (a string's bytes, a number's eight bytes little
    /// endian, a boolean's one byte: `jwt::MetadataLeaf::to_bytes`). `Ok(None)`: not
    /// there. `Err(NoMetadata)`: this host has no dynamic metadata, or cannot reach this
    /// path (nginx; Envoy's dynamic modules, whose ABI reads one level).
    fn filter_metadata(
        &self,
        _namespace: &str,
        _path: &[&str],
    ) -> Result<Option<Vec<u8>>, NoMetadata> {
        Err(NoMetadata)
    }
    /// How the token verifier in front of Diana on this host finds the bearer token of
    /// `authorization` (the one whose claims Diana may read: `jwt::bearer`). The stricter
    /// reading unless the host says otherwise.
    fn bearer_scheme(&self) -> BearerScheme {
        BearerScheme::AsWritten
    }
    /// The number the request's JSON body has at `path` (`reserve.json`), where the
    /// request was held until its body was read; `None`: not read, or no number there.
    fn body_number(&self, _path: &JsonPath) -> Option<u64> {
        None
    }
}

/// How a host's token verifier finds the bearer token in `authorization`, so that Diana
/// reads the token that was verified and no other (issue 41, item 3b).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BearerScheme {
    /// Envoy's `jwt_authn` (its default location, `value_prefix: "Bearer "`): after the
    /// first `Bearer `, as written, anywhere in the value. A value without it carries no
    /// token: jwt_authn finds none, and where the token is optional lets the request
    /// through unverified, so Diana must not read a claim there either (`bearer <forged>`).
    AsWritten,
    /// Also the scheme in any case at the start of the value (RFC 7235: it is
    /// case-insensitive), as verifiers in front of nginx take it.
    AnyCase,
}

/// The host cannot read the request's dynamic metadata ([`RequestFacts::filter_metadata`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoMetadata;
