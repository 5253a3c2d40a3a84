//! Small constructors for the `serde_yaml` values the plan and the Envoy bootstrap are
//! built from (keys keep the order they are given in).

use serde_yaml::{Mapping, Value};

pub fn map(entries: Vec<(&str, Value)>) -> Value {
    let mut mapping = Mapping::new();
    for (key, value) in entries {
        mapping.insert(Value::String(key.to_string()), value);
    }
    Value::Mapping(mapping)
}

pub fn string(text: &str) -> Value {
    Value::String(text.to_string())
}

pub fn number(value: u64) -> Value {
    Value::Number(value.into())
}
