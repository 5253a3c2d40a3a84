//! The dynamic metadata of an RLS answer (`--rls-response-metadata`), as envoyproxy/ratelimit
//! sends it with `RESPONSE_DYNAMIC_METADATA`: Envoy's `ratelimit` filter files it under
//! `envoy.filters.http.ratelimit` (or the filter's `metadata_namespace`), for the filters
//! after it (routing on a quota, logging):
//!
//! ```text
//! domain       the call's domain
//! descriptors  per descriptor: entries ["key=value", …], limit (its override, if any,
//!              as `requests_per_unit:10 unit:MINUTE`), hitsAddend (its own, if set)
//! hitsAddend   the call's, when not 0
//! metadata     the `metadata` of the rules of the descriptors that passed (not over their
//!              limit, not unlimited), merged: a key already there stays (two maps under
//!              one key merge, the first value wins elsewhere)
//! ```
//!
//! With `quota_mode` rules the answer is OK while a soft limit is over, and what tells the
//! gateway is here: the descriptors whose status is `OVER_LIMIT` are the quota violations,
//! and `metadata` holds only what the descriptors within their limits configured (e.g. the
//! service a request may still be routed to).

use super::config::Rule;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

fn text(value: impl Into<String>) -> Value {
    Value {
        kind: Some(Kind::StringValue(value.into())),
    }
}

fn number(value: f64) -> Value {
    Value {
        kind: Some(Kind::NumberValue(value)),
    }
}

/// The answer's metadata; `passed`: the rule of each descriptor that passed (`None` for
/// one without a rule).
pub fn answer(request: &RateLimitRequest, passed: &[Option<&Rule>]) -> Struct {
    let mut fields = std::collections::HashMap::new();
    fields.insert("domain".to_string(), text(request.domain.clone()));
    let descriptors = request
        .descriptors
        .iter()
        .map(|descriptor| {
            let mut fields = std::collections::HashMap::new();
            let entries = descriptor
                .entries
                .iter()
                .map(|entry| text(format!("{}={}", entry.key, entry.value)))
                .collect();
            fields.insert(
                "entries".to_string(),
                Value {
                    kind: Some(Kind::ListValue(ListValue { values: entries })),
                },
            );
            if let Some(limit) = &descriptor.limit {
                let unit =
                    ProtoUnit::try_from(limit.unit).map_or("UNKNOWN", |unit| unit.as_str_name());
                fields.insert(
                    "limit".to_string(),
                    text(format!(
                        "requests_per_unit:{} unit:{unit}",
                        limit.requests_per_unit
                    )),
                );
            }
            if let Some(hits) = &descriptor.hits_addend {
                // A JSON number, as the protocol's Struct carries it.
                #[allow(clippy::cast_precision_loss)]
                fields.insert("hitsAddend".to_string(), number(hits.value as f64));
            }
            Value {
                kind: Some(Kind::StructValue(Struct { fields })),
            }
        })
        .collect();
    fields.insert(
        "descriptors".to_string(),
        Value {
            kind: Some(Kind::ListValue(ListValue {
                values: descriptors,
            })),
        },
    );
    if request.hits_addend != 0 {
        fields.insert(
            "hitsAddend".to_string(),
            number(f64::from(request.hits_addend)),
        );
    }
    let mut merged = Struct::default();
    for rule in passed.iter().flatten() {
        if let Some(metadata) = &rule.metadata {
            merge(&mut merged, metadata);
        }
    }
    if !merged.fields.is_empty() {
        fields.insert(
            "metadata".to_string(),
            Value {
                kind: Some(Kind::StructValue(merged)),
            },
        );
    }
    Struct { fields }
}

/// Adds `source`'s keys to `into`: a key already there stays, except that two maps under
/// one key merge (envoyproxy/ratelimit's `mergeMetadata`).
fn merge(into: &mut Struct, source: &Struct) {
    for (key, value) in &source.fields {
        match into.fields.get_mut(key) {
            Some(Value {
                kind: Some(Kind::StructValue(existing)),
            }) => {
                if let Some(Kind::StructValue(nested)) = &value.kind {
                    merge(existing, nested);
                }
            }
            Some(_) => {}
            None => {
                into.fields.insert(key.clone(), value.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, Value)]) -> Struct {
        Struct {
            fields: pairs
                .iter()
                .map(|(key, value)| (key.to_string(), value.clone()))
                .collect(),
        }
    }

    fn nested(pairs: &[(&str, Value)]) -> Value {
        Value {
            kind: Some(Kind::StructValue(map(pairs))),
        }
    }

    #[test]
    fn metadata_merges_with_the_first_value_winning() {
        let mut merged = Struct::default();
        merge(
            &mut merged,
            &map(&[
                ("name", text("service_1")),
                ("service", nested(&[("a", text("1"))])),
            ]),
        );
        merge(
            &mut merged,
            &map(&[
                ("name", text("service_2")),
                ("other", text("x")),
                ("service", nested(&[("a", text("2")), ("b", text("3"))])),
            ]),
        );
        assert_eq!(
            merged,
            map(&[
                ("name", text("service_1")),
                ("other", text("x")),
                ("service", nested(&[("a", text("1")), ("b", text("3"))])),
            ])
        );
    }
}
