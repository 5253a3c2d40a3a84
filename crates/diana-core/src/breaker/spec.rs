//! A resource's breaker as a document configures it, resolved: its [`Settings`], where it
//! sends a request while open (`fallback_header`), and where it shows in metrics.

use super::Settings;

/// One breaker of a policy.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Position among the policy's breakers, resources in evaluation order (the index of
    /// its metrics and of each worker's handle on it).
    pub index: usize,
    pub settings: Settings,
    /// `fallback_header`, lower case: while open, a request goes on carrying
    /// `<header>: <name>` (for a route to a backup) instead of being answered. A client's
    /// own value of it is always removed.
    pub fallback_header: Option<String>,
    /// The name as it appears in metric names, unique among the policy's breakers.
    pub metric_name: String,
}
