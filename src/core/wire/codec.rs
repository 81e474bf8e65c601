//! A small record format for shared-data values: `n` text fields, one per line, then an
//! opaque body. Decoding never panics and rejects anything malformed.

use std::borrow::Cow;

pub(crate) fn encode(fields: &[&str], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 128);
    for f in fields {
        out.extend_from_slice(f.as_bytes());
        out.push(b'\n');
    }
    out.extend_from_slice(body);
    out
}

/// Splits `N` newline-terminated UTF-8 fields off the front; the rest is the body.
pub(crate) fn decode<const N: usize>(raw: &[u8]) -> Option<([&str; N], &[u8])> {
    let (raw_fields, rest) = fields::<N>(raw)?;
    let mut fields = [""; N];
    for (field, bytes) in fields.iter_mut().zip(raw_fields) {
        *field = std::str::from_utf8(bytes).ok()?;
    }
    Some((fields, rest))
}

/// `decode` without the UTF-8 check, for fields read as bytes (keys, numbers): the check
/// costs more than the rest of reading a record.
pub(crate) fn fields<const N: usize>(raw: &[u8]) -> Option<([&[u8]; N], &[u8])> {
    let mut fields: [&[u8]; N] = [&[]; N];
    let mut rest = raw;
    for field in &mut fields {
        let end = rest.iter().position(|&b| b == b'\n')?;
        *field = rest.get(..end)?;
        rest = rest.get(end + 1..)?;
    }
    Some((fields, rest))
}

/// A number's decimal digits, as `to_string` writes them but without the formatter (every
/// record holds a few, and the formatter costs hundreds of operators a number in wasm).
pub struct Decimal {
    digits: [u8; 20],
    at: usize,
}

impl Decimal {
    pub fn as_bytes(&self) -> &[u8] {
        self.digits.get(self.at..).unwrap_or_default()
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(self.digits.get(self.at..).unwrap_or_default()).unwrap_or_default()
    }
}

pub fn decimal(n: u64) -> Decimal {
    let (mut digits, mut at, mut rest) = ([0u8; 20], 20, n);
    // Two digits a step, from the table: half the divisions.
    while rest >= 10 {
        let pair = (rest % 100) as usize * 2;
        rest /= 100;
        at -= 2;
        digits[at] = DIGIT_PAIRS[pair];
        digits[at + 1] = DIGIT_PAIRS[pair + 1];
    }
    // The loop leaves one digit, or none (its last pair was 10 to 99).
    if rest > 0 || n == 0 {
        at -= 1;
        digits[at] = b'0' + rest as u8;
    }
    Decimal { digits, at }
}

/// `00` to `99`, two bytes each.
const DIGIT_PAIRS: [u8; 200] = {
    let mut table = [0; 200];
    let mut i = 0;
    while i < 100 {
        table[2 * i] = b'0' + (i / 10) as u8;
        table[2 * i + 1] = b'0' + (i % 10) as u8;
        i += 1;
    }
    table
};

/// Lowercase hexadecimal digits, by value.
pub(crate) const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

/// `n` as 16 hexadecimal digits, zero-padded (what `hex_number` reads back).
pub(crate) fn hex_fixed(n: u64) -> [u8; 16] {
    let mut out = [b'0'; 16];
    for (i, d) in out.iter_mut().rev().enumerate() {
        *d = HEX_DIGITS[((n >> (4 * i)) & 0xf) as usize];
    }
    out
}

/// A record's number, as `to_string` writes it: ASCII digits only, at most `u64::MAX`.
/// (`str::parse::<u64>` checks each step for overflow with a 128-bit multiply, a library
/// call on wasm32 that made every record read cost thousands of operators.)
pub(crate) fn number(s: impl AsRef<[u8]>) -> Option<u64> {
    read(s.as_ref(), 10, 19)
}

/// A record's number in hexadecimal (`format!("{:x}")`), at most `u64::MAX`.
pub(crate) fn hex_number(s: impl AsRef<[u8]>) -> Option<u64> {
    read(s.as_ref(), 16, 16)
}

/// Up to 20 digits of `radix`; the first `fits` of them cannot overflow, the rest are
/// checked.
fn read(digits: &[u8], radix: u32, fits: usize) -> Option<u64> {
    if digits.is_empty() || digits.len() > 20 {
        return None;
    }
    let r = u64::from(radix);
    let mut n: u64 = 0;
    for (i, &c) in digits.iter().enumerate() {
        let d = u64::from(char::from(c).to_digit(radix)?);
        if i >= fits && n > (u64::MAX - d) / r {
            return None;
        }
        n = n.wrapping_mul(r).wrapping_add(d);
    }
    Some(n)
}

/// Header pairs as one field: `name: value` joined by tabs.
pub(crate) fn headers_field(headers: &[(String, String)]) -> String {
    let mut out = String::new();
    for (i, (name, value)) in headers.iter().enumerate() {
        if i > 0 {
            out.push('\t');
        }
        out.push_str(name);
        out.push_str(": ");
        // Checked by bytes (the three are ASCII): decoding every character costs more.
        if value.bytes().any(|b| matches!(b, b'\n' | b'\r' | b'\t')) {
            out.extend(value.chars().map(|c| if matches!(c, '\n' | '\r' | '\t') { ' ' } else { c }));
        } else {
            out.push_str(value);
        }
    }
    out
}

pub(crate) fn parse_headers(f: &str) -> Vec<(String, String)> {
    f.split('\t').filter_map(|p| p.split_once(": ")).map(|(n, v)| (n.to_owned(), v.to_owned())).collect()
}

/// Replaces newlines so a value can travel as one field (copied only when it has some).
pub(crate) fn field(s: &str) -> Cow<'_, str> {
    if s.bytes().any(|b| matches!(b, b'\n' | b'\r')) {
        Cow::Owned(s.replace(['\n', '\r'], " "))
    } else {
        Cow::Borrowed(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_back_as_written_and_nothing_else_reads() {
        for n in [0, 1, 9, 10, 1_764_489_600_000, u64::MAX / 10, u64::MAX - 1, u64::MAX] {
            assert_eq!(number(n.to_string()), Some(n), "{n}");
            assert_eq!(decimal(n).as_str(), n.to_string());
        }
        let powers = (0..20).map(|p| 10u64.pow(p)).flat_map(|t| [t - 1, t, t + 1]);
        for n in (0..10_000).chain(powers) {
            assert_eq!(decimal(n).as_str(), n.to_string());
        }
        assert_eq!(number("007"), Some(7));
        for n in [0, 0xff, 1.5f64.to_bits(), u64::MAX] {
            assert_eq!(hex_number(format!("{n:x}")), Some(n), "{n:x}");
            assert_eq!(hex_fixed(n), *format!("{n:016x}").as_bytes());
        }
        assert_eq!((hex_number("1_0"), hex_number("10000000000000000"), hex_number("")), (None, None, None));
        for bad in [
            "",
            "+1",
            "-1",
            "1 ",
            " 1",
            "1.0",
            "x",
            "18446744073709551616",
            "99999999999999999999",
            "000000000000000000001",
        ] {
            assert_eq!(number(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn round_trips_and_rejects_short_input() {
        let raw = encode(&["a", "", "c d"], b"body\nwith newline");
        let (f, body) = decode::<3>(&raw).unwrap();
        assert_eq!(f, ["a", "", "c d"]);
        assert_eq!(body, b"body\nwith newline");
        assert!(decode::<3>(b"a\nb").is_none());
        assert!(decode::<1>(b"\xff\n").is_none());
        assert_eq!(field("a\nb\r"), "a b ");
        let h = vec![("retry-after".to_owned(), "2".to_owned()), ("x-m".to_owned(), "a: b".to_owned())];
        assert_eq!(parse_headers(&headers_field(&h)), h);
        let odd = vec![("x-a".to_owned(), "1\t2\n3\r4".to_owned()), ("x-b".to_owned(), "é".to_owned())];
        assert_eq!(parse_headers(&headers_field(&odd)), [("x-a".into(), "1 2 3 4".into()), ("x-b".into(), "é".into())]);
        assert!(parse_headers("").is_empty());
    }
}
