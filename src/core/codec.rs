//! A small record format for shared-data values: `n` text fields, one per line, then an
//! opaque body. Decoding never panics and rejects anything malformed.

use std::borrow::Cow;

pub fn encode(fields: &[&str], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 128);
    for f in fields {
        out.extend_from_slice(f.as_bytes());
        out.push(b'\n');
    }
    out.extend_from_slice(body);
    out
}

/// Splits `n` newline-terminated UTF-8 fields off the front; the rest is the body.
pub fn decode(raw: &[u8], n: usize) -> Option<(Vec<&str>, &[u8])> {
    let mut fields = Vec::with_capacity(n);
    let mut rest = raw;
    for _ in 0..n {
        let end = rest.iter().position(|&b| b == b'\n')?;
        fields.push(std::str::from_utf8(&rest[..end]).ok()?);
        rest = &rest[end + 1..];
    }
    Some((fields, rest))
}

/// Header pairs as one field: `name: value` joined by tabs.
pub fn headers_field(headers: &[(String, String)]) -> String {
    let mut out = String::new();
    for (i, (name, value)) in headers.iter().enumerate() {
        if i > 0 {
            out.push('\t');
        }
        out.push_str(name);
        out.push_str(": ");
        out.extend(value.chars().map(|c| if matches!(c, '\n' | '\r' | '\t') { ' ' } else { c }));
    }
    out
}

pub fn parse_headers(f: &str) -> Vec<(String, String)> {
    f.split('\t').filter_map(|p| p.split_once(": ")).map(|(n, v)| (n.to_owned(), v.to_owned())).collect()
}

/// Replaces newlines so a value can travel as one field (copied only when it has some).
pub fn field(s: &str) -> Cow<'_, str> {
    if s.contains(['\n', '\r']) {
        Cow::Owned(s.replace(['\n', '\r'], " "))
    } else {
        Cow::Borrowed(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_short_input() {
        let raw = encode(&["a", "", "c d"], b"body\nwith newline");
        let (f, body) = decode(&raw, 3).unwrap();
        assert_eq!(f, vec!["a", "", "c d"]);
        assert_eq!(body, b"body\nwith newline");
        assert!(decode(b"a\nb", 3).is_none());
        assert!(decode(b"\xff\n", 1).is_none());
        assert_eq!(field("a\nb\r"), "a b ");
        let h = vec![("retry-after".to_owned(), "2".to_owned()), ("x-m".to_owned(), "a: b".to_owned())];
        assert_eq!(parse_headers(&headers_field(&h)), h);
        assert!(parse_headers("").is_empty());
    }
}
