//! What the filter knows of a request, read lazily from the host: its headers, the client
//! address and (Envoy) its dynamic metadata. A leaf: identities (`actor`) and
//! claims (`jwt`) read through it.

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
}

/// The host cannot read the request's dynamic metadata ([`RequestFacts::filter_metadata`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoMetadata;
