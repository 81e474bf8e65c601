//! JSON parsed into serde_json's `Value` by the edge's own reader, in one pass: the values
//! serde_json builds (integers as `u64`/`i64` where they fit, other numbers as `f64`, a
//! number out of `f64`'s range refused, no lone surrogate, fewer than 128 levels deep; a
//! float is the nearest `f64`, where serde_json's default reader may be one unit off),
//! without the code of serde_json's generic deserializer. `parse_strict` reads a client's
//! body: naming one key twice in an object is an error there. serde_json keeps the last
//! copy, while the body that goes upstream is the client's own bytes, whose parser may keep
//! the first: the key the edge computes and the request HolySheep answers must be the same
//! request. `parse` reads everything else (an answer, a stream's event, a store's record)
//! as serde_json does, the last copy of a key kept.

use super::float;
use super::scan::{self, Escape};
use serde_json::map::Entry;
use serde_json::{Map, Value};
use std::fmt;

/// Arrays and objects nest fewer levels than this (serde_json's recursion limit).
const MAX_DEPTH: usize = 128;

/// Why a text is not JSON, and where (as serde_json says it: `expected value at line 1
/// column 5`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JsonError {
    what: String,
    line: usize,
    column: usize,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at line {} column {}", self.what, self.line, self.column)
    }
}

/// An object of `members` (a later one of a name replaces an earlier), as `json!` builds
/// it, without its conversions (each of which may fail, and is unwrapped).
pub(crate) fn object<const N: usize>(members: [(&str, Value); N]) -> Value {
    let mut map = Map::new();
    for (name, v) in members {
        map.insert(name.to_owned(), v);
    }
    Value::Object(map)
}

/// `text` as one JSON value with no repeated object key at any depth.
pub(crate) fn parse_strict(text: &str) -> Result<Value, JsonError> {
    Parser { text, b: text.as_bytes(), at: 0, strict: true }.document()
}

/// `text` as one JSON value, as `serde_json::from_str` reads it.
pub(crate) fn read(text: &str) -> Result<Value, JsonError> {
    Parser { text, b: text.as_bytes(), at: 0, strict: false }.document()
}

/// `bytes` as one JSON value, as `serde_json::from_slice` reads it.
pub(crate) fn parse(bytes: &[u8]) -> Option<Value> {
    read(std::str::from_utf8(bytes).ok()?).ok()
}

struct Parser<'a> {
    text: &'a str,
    b: &'a [u8],
    at: usize,
    strict: bool,
}

impl Parser<'_> {
    fn document(mut self) -> Result<Value, JsonError> {
        let value = self.value(0)?;
        self.space();
        if self.at < self.b.len() {
            return Err(self.fail("trailing characters"));
        }
        Ok(value)
    }

    /// The error `what` at the current byte.
    fn fail(&self, what: impl Into<String>) -> JsonError {
        let seen = self.b.get(..self.at.min(self.b.len())).unwrap_or_default();
        let line = 1 + seen.iter().filter(|&&c| c == b'\n').count();
        let start = seen.iter().rposition(|&c| c == b'\n').map_or(0, |n| n + 1);
        JsonError { what: what.into(), line, column: self.at.saturating_sub(start) + 1 }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }

    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.at += 1;
        }
    }

    /// A value inside `depth` arrays and objects.
    fn value(&mut self, depth: usize) -> Result<Value, JsonError> {
        self.space();
        match self.peek() {
            None => Err(self.fail("EOF while parsing a value")),
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().map(Value::String),
            Some(b't') => self.literal("true", Value::Bool(true)),
            Some(b'f') => self.literal("false", Value::Bool(false)),
            Some(b'n') => self.literal("null", Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.fail("expected value")),
        }
    }

    fn literal(&mut self, word: &str, value: Value) -> Result<Value, JsonError> {
        for &expected in word.as_bytes() {
            match self.peek() {
                Some(c) if c == expected => self.at += 1,
                Some(_) => return Err(self.fail("expected ident")),
                None => return Err(self.fail("EOF while parsing a value")),
            }
        }
        Ok(value)
    }

    fn open(&mut self, depth: usize) -> Result<(), JsonError> {
        if depth >= MAX_DEPTH {
            return Err(self.fail("recursion limit exceeded"));
        }
        self.at += 1;
        self.space();
        Ok(())
    }

    fn array(&mut self, depth: usize) -> Result<Value, JsonError> {
        self.open(depth)?;
        let mut items = Vec::new();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.value(depth)?);
            self.space();
            match self.peek() {
                Some(b',') => {
                    self.at += 1;
                    self.space();
                    if self.peek() == Some(b']') {
                        return Err(self.fail("trailing comma"));
                    }
                }
                Some(b']') => {
                    self.at += 1;
                    return Ok(Value::Array(items));
                }
                Some(_) => return Err(self.fail("expected `,` or `]`")),
                None => return Err(self.fail("EOF while parsing a list")),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, JsonError> {
        self.open(depth)?;
        let mut map = Map::new();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Ok(Value::Object(map));
        }
        loop {
            match self.peek() {
                Some(b'"') => {}
                Some(_) => return Err(self.fail("key must be a string")),
                None => return Err(self.fail("EOF while parsing an object")),
            }
            let key = self.string()?;
            self.space();
            match self.peek() {
                Some(b':') => self.at += 1,
                Some(_) => return Err(self.fail("expected `:`")),
                None => return Err(self.fail("EOF while parsing an object")),
            }
            let value = self.value(depth)?;
            match map.entry(key) {
                Entry::Vacant(slot) => {
                    slot.insert(value);
                }
                Entry::Occupied(slot) if self.strict => {
                    let shown: String = slot.key().chars().take(64).collect();
                    return Err(self.fail(format!("the key '{shown}' appears twice in one object")));
                }
                Entry::Occupied(mut slot) => {
                    slot.insert(value);
                }
            }
            self.space();
            match self.peek() {
                Some(b',') => {
                    self.at += 1;
                    self.space();
                    if self.peek() == Some(b'}') {
                        return Err(self.fail("trailing comma"));
                    }
                }
                Some(b'}') => {
                    self.at += 1;
                    return Ok(Value::Object(map));
                }
                Some(_) => return Err(self.fail("expected `,` or `}`")),
                None => return Err(self.fail("EOF while parsing an object")),
            }
        }
    }

    /// The string at the current `"`, its escapes read.
    fn string(&mut self) -> Result<String, JsonError> {
        self.at += 1;
        let mut out = String::new();
        // The text since the last escape (it starts and ends at ASCII bytes, so slicing
        // the `&str` there cannot fail).
        let mut plain = self.at;
        loop {
            // The plain bytes up to the next quote, escape or control character.
            self.at = scan::plain_end(self.b, self.at);
            let Some(c) = self.peek() else { return Err(self.fail("EOF while parsing a string")) };
            match c {
                b'"' => {
                    out.push_str(self.text.get(plain..self.at).unwrap_or_default());
                    self.at += 1;
                    return Ok(out);
                }
                b'\\' => {
                    out.push_str(self.text.get(plain..self.at).unwrap_or_default());
                    self.at += 1;
                    out.push(self.escape()?);
                    plain = self.at;
                }
                0..=0x1f => return Err(self.fail("control character (\\u0000-\\u001F) found while parsing a string")),
                _ => self.at += 1,
            }
        }
    }

    /// The character an escape (after its `\`) names.
    fn escape(&mut self) -> Result<char, JsonError> {
        let start = self.at;
        match scan::escape(self.b.get(start..).unwrap_or_default()) {
            Ok((c, used)) => {
                self.at += used;
                Ok(c)
            }
            Err((why, at)) => {
                self.at = start + at;
                Err(self.fail(match why {
                    Escape::Unended => "EOF while parsing a string",
                    Escape::Invalid => "invalid escape",
                    Escape::LoneSurrogate => "lone leading surrogate in hex escape",
                }))
            }
        }
    }

    /// A number: a whole one as `u64` (or negative, `i64`) where it fits, as serde_json
    /// reads it (`-0` is the float); otherwise the nearest `f64`, refused when infinite.
    fn number(&mut self) -> Result<Value, JsonError> {
        let start = self.at;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.at += 1;
        }
        match self.peek() {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.fail("invalid number")),
        }
        let whole_end = self.at;
        let mut whole = true;
        if self.peek() == Some(b'.') {
            self.at += 1;
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.fail("invalid number"));
            }
            self.digits();
            whole = false;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.fail("invalid number"));
            }
            self.digits();
            whole = false;
        }
        // ASCII digits and signs: char boundaries.
        let text = self.text.get(start..self.at).unwrap_or_default();
        if whole {
            let digits = self.b.get(start + usize::from(negative)..whole_end).unwrap_or_default();
            let magnitude = digits.iter().try_fold(0u64, |n, &d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')));
            match (negative, magnitude) {
                (false, Some(n)) => return Ok(Value::from(n)),
                (true, Some(n)) => {
                    let n = (n as i64).wrapping_neg();
                    if n < 0 {
                        return Ok(Value::from(n));
                    }
                }
                (_, None) => {}
            }
        }
        let x = float::parse(text).ok_or_else(|| self.fail("invalid number"))?;
        if !x.is_finite() {
            return Err(self.fail("number out of range"));
        }
        Ok(Value::from(x))
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Texts serde_json reads (and the edge must read the same) or refuses.
    const CORPUS: &[&str] = &[
        r#"{"a":[1,-2,3.5,"x",null,true,{"b":{}}],"c":1e2,"d":"\u00e9"}"#,
        " [ ] ",
        "{}",
        r#""\ud83d\ude00 \" \\ \/ \b \f \n \r \t""#,
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775808",
        "-9223372036854775809",
        "-0",
        "0.0",
        "-0.5e-3",
        "1E+2",
        "123456789012345678901234567890",
        "1e308",
        "1e309",
        "-1e400",
        "01",
        "1.",
        ".5",
        "-",
        "+1",
        "1e",
        "nul",
        "truex",
        "[1,]",
        r#"{"a":1,}"#,
        r#"{"a" 1}"#,
        "{1:2}",
        "[1 2]",
        r#""\ud800""#,
        r#""\udc00""#,
        r#""\ud800\u0041""#,
        r#""\x""#,
        "\"a\tb\"",
        "\"unterminated",
        "",
        "   ",
        "[] []",
        r#"{"k":1,"k":2}"#,
        "\"é ü 中\"",
        "[[[[[[[[[[]]]]]]]]]]",
    ];

    #[test]
    fn the_values_serde_json_reads_and_the_texts_it_refuses() {
        for text in CORPUS {
            let theirs = serde_json::from_str::<Value>(text).ok();
            assert_eq!(parse(text.as_bytes()), theirs, "{text}");
        }
        for depth in [126, 127, 128, 129] {
            let text = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            let theirs = serde_json::from_str::<Value>(&text).ok();
            assert_eq!(parse(text.as_bytes()), theirs, "{depth} levels");
            assert_eq!(parse(text.as_bytes()).is_some(), depth < 128);
        }
        assert_eq!(parse(b"\"\xff\""), None, "not UTF-8");
    }

    /// Equal, but for floats, which serde_json's default reader may round one unit off in
    /// the last place (the edge's are the nearest).
    fn near(a: &Value, b: &Value) -> bool {
        match (a, b) {
            (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
                let (x, y) = (x.as_f64().unwrap_or(f64::NAN), y.as_f64().unwrap_or(f64::NAN));
                x == y || ((x - y) / x).abs() < 1e-15
            }
            (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| near(x, y)),
            (Value::Object(x), Value::Object(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|((k, x), (l, y))| k == l && near(x, y))
            }
            _ => a == b,
        }
    }

    #[test]
    fn every_text_near_the_corpus_reads_as_serde_json_reads_it() {
        // Each text with one byte dropped, and with one of a few bytes put in at each place.
        for text in CORPUS {
            let b = text.as_bytes();
            for at in 0..=b.len() {
                let mut variants = Vec::new();
                if at < b.len() {
                    variants.push([&b[..at], &b[at + 1..]].concat());
                }
                for c in [b'"', b'\\', b'[', b'}', b',', b'-', b'e', b'0', b' ', b'u'] {
                    variants.push([&b[..at], &[c][..], &b[at..]].concat());
                }
                for v in variants {
                    let (ours, theirs) = (parse(&v), serde_json::from_slice::<Value>(&v).ok());
                    let same = match (&ours, &theirs) {
                        (Some(a), Some(b)) => near(a, b),
                        _ => ours == theirs,
                    };
                    assert!(same, "{}: {ours:?} / {theirs:?}", String::from_utf8_lossy(&v));
                }
            }
        }
    }

    #[test]
    fn numbers_are_the_kinds_serde_json_makes() {
        let v = parse(b"[18446744073709551615, -9223372036854775808, -0, 2.5, 18446744073709551616]").unwrap();
        assert!(v[0].is_u64());
        assert!(v[1].is_i64());
        assert!(v[2].is_f64() && v[2].as_f64().unwrap().is_sign_negative());
        assert!(v[3].is_f64());
        assert!(v[4].is_f64());
    }

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
        assert_eq!(parse(br#"{"k":1,"k":2}"#).unwrap()["k"], 2, "elsewhere the last is kept");
    }

    #[test]
    fn an_error_says_what_and_where() {
        let cases = [
            ("{\"a\":1} x", "trailing characters at line 1 column 9"),
            ("{\n  \"a\": tru\n}", "expected ident at line 2 column 11"),
            ("[1,\n2,,3]", "expected value at line 2 column 3"),
            ("{\"n\":1e999}", "number out of range at line 1 column 11"),
            ("{\"a\":\"\\q\"}", "invalid escape at line 1 column 8"),
        ];
        for (text, said) in cases {
            assert_eq!(parse_strict(text).unwrap_err().to_string(), said, "{text}");
        }
    }
}
