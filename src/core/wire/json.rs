//! JSON as the edge reads a client's body: serde_json's `Value`, except that an object
//! naming one key twice is an error. serde_json keeps the last copy, while the body that
//! goes upstream is the client's own bytes, whose parser may keep the first: the key the
//! edge computes and the request HolySheep answers must be the same request.

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::fmt;

/// Parses `text` as one JSON value with no repeated object key at any depth.
pub(crate) fn parse_strict(text: &str) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let value = de.deserialize_any(Strict)?;
    de.end()?;
    Ok(value)
}

/// Builds a `Value` as serde_json's own visitor does, refusing repeated keys.
struct Strict;

impl<'de> de::DeserializeSeed<'de> for Strict {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(Strict)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(Strict)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element_seed(Strict)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let mut map = Map::new();
        while let Some(key) = access.next_key::<String>()? {
            if map.contains_key(&key) {
                let shown: String = key.chars().take(64).collect();
                return Err(de::Error::custom(format_args!("the key '{shown}' appears twice in one object")));
            }
            let value = access.next_value_seed(Strict)?;
            map.insert(key, value);
        }
        Ok(Value::Object(map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_values_as_serde_json_without_repeated_keys() {
        let text = r#"{"a":[1,-2,3.5,"x",null,true,{"b":{}}],"c":1e2,"d":"\u00e9"}"#;
        assert_eq!(parse_strict(text).unwrap(), serde_json::from_str::<Value>(text).unwrap());
    }

    #[test]
    fn a_repeated_key_at_any_depth_is_an_error() {
        for text in [
            r#"{"model":"a","model":"b"}"#,
            r#"{"messages":[{"role":"user","role":"system"}]}"#,
            r#"{"x":{"y":1,"y":1}}"#,
            r#"{"m\u006fdel":"a","model":"b"}"#,
        ] {
            let e = parse_strict(text).unwrap_err();
            assert!(e.to_string().contains("appears twice"), "{text}: {e}");
        }
        assert!(parse_strict(r#"{"a":{"k":1},"b":{"k":1}}"#).is_ok(), "the same key in two objects");
    }

    #[test]
    fn trailing_bytes_and_bad_numbers_are_errors_as_in_serde_json() {
        assert!(parse_strict(r#"{"a":1} x"#).is_err());
        assert!(parse_strict(r#"{"n":1e999}"#).is_err());
    }
}
