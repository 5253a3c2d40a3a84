//! How large nginx's `shm_kv` zone must be for a policy: [`diana_core::nginx`], which the
//! filter also uses to name the zone a worker lacks.

pub use diana_core::nginx::{directive, zone_bytes, zone_bytes_of};
