//! The canonical form of a request body, which its key (and the semantic tier's partition)
//! hashes: compact JSON with object keys sorted, integral floats as integers, and the
//! fields that do not change the answer left out.

use crate::core::wire::write;
use serde_json::{Map, Number, Value};

/// Fields left out of the key: they change how the answer is delivered or attributed, or
/// where HolySheep looks for a cached prefix (`prompt_cache_key`), not what it says.
pub(crate) const KEY_EXCLUDED_FIELDS: [&str; 4] = ["stream", "stream_options", "user", "prompt_cache_key"];

/// Compact JSON with object keys sorted recursively (serde_json's map is a BTreeMap),
/// integral floats written as integers, and the excluded fields removed: the bytes
/// `serde_json::to_vec` writes for that value, written here directly (its serializer cost a
/// MISS several times the operators).
pub(crate) fn canonical_body(mut map: Map<String, Value>) -> Vec<u8> {
    for f in KEY_EXCLUDED_FIELDS {
        map.remove(f);
    }
    let mut out = Vec::with_capacity(256);
    write::object_into(&map, &mut out, write_number);
    out
}

/// An integral float as the integer it is (`1.0` and `1` ask the same); any other number
/// as serde_json writes it.
fn write_number(n: &Number, out: &mut Vec<u8>) {
    let integral = n.as_f64().filter(|f| n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15);
    match integral {
        Some(f) => write::number(&Number::from(f as i64), out),
        None => write::number(n, out),
    }
}
