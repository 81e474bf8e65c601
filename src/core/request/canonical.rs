//! The canonical form of a request body, which its key (and the semantic tier's partition)
//! hashes: compact JSON with object keys sorted, integral floats as integers, and the
//! fields that do not change the answer left out.

use crate::core::wire::codec;
use serde_json::{Map, Number, Value};

/// Fields left out of the key: they change how the answer is delivered or attributed,
/// not what it says.
pub(crate) const KEY_EXCLUDED_FIELDS: [&str; 3] = ["stream", "stream_options", "user"];

/// Compact JSON with object keys sorted recursively (serde_json's map is a BTreeMap),
/// integral floats written as integers, and the excluded fields removed: the bytes
/// `serde_json::to_vec` writes for that value, written here directly (its serializer cost a
/// MISS several times the operators).
pub(crate) fn canonical_body(mut map: Map<String, Value>) -> Vec<u8> {
    for f in KEY_EXCLUDED_FIELDS {
        map.remove(f);
    }
    let mut out = Vec::with_capacity(256);
    write_object(&map, &mut out);
    out
}

fn write_value(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(item, out);
            }
            out.push(b']');
        }
        Value::Object(o) => write_object(o, out),
    }
}

fn write_object(o: &Map<String, Value>, out: &mut Vec<u8>) {
    out.push(b'{');
    for (i, (k, v)) in o.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(k, out);
        out.push(b':');
        write_value(v, out);
    }
    out.push(b'}');
}

/// An integral float as the integer it is (`1.0` and `1` ask the same); any other number
/// as serde_json writes it.
fn write_number(n: &Number, out: &mut Vec<u8>) {
    let integral = n.as_f64().filter(|f| n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15);
    let _ = match integral {
        Some(f) => serde_json::to_writer(&mut *out, &(f as i64)),
        None => serde_json::to_writer(&mut *out, n),
    };
}

/// A string as serde_json writes it: `"` and `\` escaped, control characters as `\b`,
/// `\t`, `\n`, `\f`, `\r` or `\u00xx`, every other character as it is.
fn write_string(s: &str, out: &mut Vec<u8>) {
    let bytes = s.as_bytes();
    out.push(b'"');
    let mut start = 0;
    let mut unicode = *b"\\u0000";
    for (i, &b) in bytes.iter().enumerate() {
        let escaped: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0a => b"\\n",
            0x0c => b"\\f",
            0x0d => b"\\r",
            0..=0x1f => {
                unicode[4] = codec::HEX_DIGITS[usize::from(b >> 4)];
                unicode[5] = codec::HEX_DIGITS[usize::from(b & 0xf)];
                &unicode
            }
            _ => continue,
        };
        out.extend_from_slice(bytes.get(start..i).unwrap_or_default());
        out.extend_from_slice(escaped);
        start = i + 1;
    }
    out.extend_from_slice(bytes.get(start..).unwrap_or_default());
    out.push(b'"');
}
