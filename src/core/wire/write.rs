//! JSON the edge writes itself: objects whose members it appends in order, with nothing
//! built first (its messages to its peers, what it keeps in the spend store), and any
//! `Value`, byte for byte as `serde_json::to_vec` writes it (a body it rewrote, its error
//! bodies, a request's canonical form), without serde_json's serializer.

use super::codec;
use serde_json::{Map, Number, Value};

/// A JSON object being written.
pub(crate) struct Object {
    out: String,
}

impl Object {
    pub(crate) fn new() -> Object {
        Object { out: String::from("{") }
    }

    /// Starts the member `name` (a name the edge chose: nothing in it to escape).
    fn name(mut self, name: &str) -> Object {
        if self.out.len() > 1 {
            self.out.push(',');
        }
        self.out.push('"');
        self.out.push_str(name);
        self.out.push_str("\":");
        self
    }

    /// The member `name` holding `json`, a JSON text.
    pub(crate) fn raw(self, name: &str, json: &str) -> Object {
        let mut o = self.name(name);
        o.out.push_str(json);
        o
    }

    pub(crate) fn u64(self, name: &str, n: u64) -> Object {
        let mut o = self.name(name);
        o.out.push_str(&n.to_string());
        o
    }

    pub(crate) fn bool(self, name: &str, b: bool) -> Object {
        self.raw(name, if b { "true" } else { "false" })
    }

    pub(crate) fn str(self, name: &str, text: &str) -> Object {
        let quoted = string(text);
        self.raw(name, &quoted)
    }

    /// A number, or `null` when there is none (or it is not finite, as serde_json writes it).
    pub(crate) fn f64(self, name: &str, n: Option<f64>) -> Object {
        match n.filter(|n| n.is_finite()) {
            Some(n) => self.raw(name, ryu::Buffer::new().format_finite(n)),
            None => self.raw(name, "null"),
        }
    }

    /// A whole number, or `null` when there is none.
    pub(crate) fn opt_u64(self, name: &str, n: Option<u64>) -> Object {
        match n {
            Some(n) => self.u64(name, n),
            None => self.raw(name, "null"),
        }
    }

    pub(crate) fn finish(mut self) -> String {
        self.out.push('}');
        self.out
    }
}

/// `text` as a JSON string, escaped as serde_json escapes it.
pub(crate) fn string(text: &str) -> String {
    let mut out = Vec::with_capacity(text.len() + 2);
    string_into(text, &mut out);
    // Escapes are ASCII, and the rest is `text`'s UTF-8.
    String::from_utf8(out).unwrap_or_default()
}

/// `v` as compact JSON, as serde_json writes it.
pub(crate) fn value(v: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    value_into(v, &mut out, number);
    out
}

/// `v` appended to `out`, each number written by `number` (`write::number` writes it as
/// serde_json does).
pub(crate) fn value_into(v: &Value, out: &mut Vec<u8>, number: fn(&Number, &mut Vec<u8>)) {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => number(n, out),
        Value::String(s) => string_into(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                value_into(item, out, number);
            }
            out.push(b']');
        }
        Value::Object(o) => object_into(o, out, number),
    }
}

/// An object's members in the map's order (sorted: serde_json's map is a `BTreeMap`).
pub(crate) fn object_into(o: &Map<String, Value>, out: &mut Vec<u8>, number: fn(&Number, &mut Vec<u8>)) {
    out.push(b'{');
    for (i, (k, v)) in o.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        string_into(k, out);
        out.push(b':');
        value_into(v, out, number);
    }
    out.push(b'}');
}

/// A number as serde_json writes it: an integer in decimal, a float as ryu's shortest
/// form that reads back the same (`null` for one that is not finite, which no `Value`
/// holds).
pub(crate) fn number(n: &Number, out: &mut Vec<u8>) {
    if let Some(u) = n.as_u64() {
        out.extend_from_slice(codec::decimal(u).as_str().as_bytes());
    } else if let Some(i) = n.as_i64() {
        out.push(b'-');
        out.extend_from_slice(codec::decimal(i.unsigned_abs()).as_str().as_bytes());
    } else {
        match n.as_f64().filter(|f| f.is_finite()) {
            Some(f) => out.extend_from_slice(ryu::Buffer::new().format_finite(f).as_bytes()),
            None => out.extend_from_slice(b"null"),
        }
    }
}

/// A string as serde_json writes it: `"` and `\` escaped, control characters as `\b`,
/// `\t`, `\n`, `\f`, `\r` or `\u00xx`, every other character as it is.
pub(crate) fn string_into(s: &str, out: &mut Vec<u8>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_is_written_as_serde_json_writes_it() {
        let o = Object::new()
            .str("model", "gpt-\"4.1\"\n")
            .u64("id", u64::MAX)
            .u64("zero", 0)
            .bool("waits", true)
            .opt_u64("actual", None)
            .f64("remaining", Some(1.5))
            .f64("nan", Some(f64::NAN))
            .raw("hints", "{}")
            .finish();
        let expected = serde_json::json!({"model": "gpt-\"4.1\"\n", "id": u64::MAX, "zero": 0, "waits": true,
            "actual": null, "remaining": 1.5, "nan": null, "hints": {}});
        assert_eq!(serde_json::from_str::<serde_json::Value>(&o).unwrap(), expected);
        assert!(o.starts_with(r#"{"model":"gpt-\"4.1\"\n","id":18446744073709551615,"zero":0,"#), "{o}");
        assert_eq!(Object::new().finish(), "{}");
    }

    #[test]
    fn a_value_is_written_as_serde_json_writes_it() {
        let values = [
            serde_json::json!(null),
            serde_json::json!({"b": [1, -1, u64::MAX, i64::MIN, 0.5, -0.0, 1e300, 1.5e-7, 123456789.125],
                "a": {"quote\"back\\slash": "tab\tnew\nline\u{1}\u{1f}\u{7f}é😀", "t": true, "f": false},
                "": [], "e": {}, "n": null}),
            serde_json::json!("\u{8}\u{c}\r/"),
            serde_json::json!([[], [[]], {"x": [{"y": -12}]}]),
        ];
        for v in values {
            assert_eq!(value(&v), serde_json::to_vec(&v).unwrap(), "{v}");
        }
        assert_eq!(string("a\"b\u{0}"), serde_json::to_string("a\"b\u{0}").unwrap());
    }
}
