//! JSON read in place. One pass checks that a text is one JSON value as serde_json reads
//! it (UTF-8, its grammar, no control character inside a string, valid escapes, members'
//! names that are Rust strings, fewer than 128 levels deep as serde_json builds a `Value`); its members and items are then found by
//! walking the checked text, with nothing built. What the edge reads of answers and of
//! its peers' messages: a few fields of a body it does not otherwise need as a tree.

use std::borrow::Cow;

/// Arrays and objects nest fewer levels than this (as serde_json builds a `Value`).
const MAX_DEPTH: usize = 128;

/// One checked JSON value: its text, without the whitespace around it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Json<'a> {
    text: &'a str,
}

/// `bytes` as one JSON value with nothing but whitespace around it.
pub(crate) fn read(bytes: &[u8]) -> Option<Json<'_>> {
    let (json, rest) = read_first(bytes)?;
    rest.trim_ascii().is_empty().then_some(json)
}

/// `read(bytes)?.fields(names)` in one pass: the document is checked as its top-level
/// members are found (`None` when it is not one JSON object).
pub(crate) fn read_fields<'a, const N: usize>(bytes: &'a [u8], names: [&str; N]) -> Option<[Option<Json<'a>>; N]> {
    let text = std::str::from_utf8(bytes).ok()?;
    let (found, end) = pick(text, space(text.as_bytes(), 0), names, true, false)?;
    (space(text.as_bytes(), end) == text.len()).then_some(found)
}

/// The members named in `names` of the object opening at `open` in `text`, and where it
/// ends: `None` when it is not an object, names one of them twice, has a name that is no
/// Rust string, or (unless `others`) a member of another name. Its values are checked
/// unless `checked` says they were.
fn pick<'a, const N: usize>(
    text: &'a str,
    open: usize,
    names: [&str; N],
    others: bool,
    checked: bool,
) -> Option<([Option<Json<'a>>; N], usize)> {
    let b = text.as_bytes();
    if b.get(open) != Some(&b'{') {
        return None;
    }
    let mut found = [None; N];
    let mut i = space(b, open + 1);
    if b.get(i) == Some(&b'}') {
        return Some((found, i + 1));
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let name_end = if checked { string_end(b, i)? } else { name_end(b, i)? };
        let colon = space(b, name_end);
        if b.get(colon) != Some(&b':') {
            return None;
        }
        let start = space(b, colon + 1);
        let end = if checked { skip(b, start) } else { check(b, start, 1)? };
        let name = Json { text: text.get(i..name_end)? }.as_str()?;
        match names.iter().position(|n| *n == name) {
            Some(k) => {
                let slot = found.get_mut(k)?;
                if slot.is_some() {
                    return None;
                }
                *slot = Some(Json { text: text.get(start..end)? });
            }
            None if others => {}
            None => return None,
        }
        i = space(b, end);
        match b.get(i) {
            Some(b',') => i = space(b, i + 1),
            Some(b'}') => return Some((found, i + 1)),
            _ => return None,
        }
    }
}

/// The JSON value at the start of `bytes` (after whitespace), and what follows it.
pub(crate) fn read_first(bytes: &[u8]) -> Option<(Json<'_>, &[u8])> {
    let text = std::str::from_utf8(bytes).ok()?;
    let start = space(text.as_bytes(), 0);
    let end = check(text.as_bytes(), start, 0)?;
    Some((Json { text: text.get(start..end)? }, bytes.get(end..)?))
}

impl<'a> Json<'a> {
    /// The value's JSON text.
    pub(crate) fn text(self) -> &'a str {
        self.text
    }

    pub(crate) fn is_null(self) -> bool {
        self.text == "null"
    }

    pub(crate) fn as_bool(self) -> Option<bool> {
        match self.text {
            "true" => Some(true),
            "false" => Some(false),
            _ => None,
        }
    }

    /// A number written as an integer from 0 to `u64::MAX` (as serde reads a `u64`: a
    /// fraction, an exponent or a sign is not one).
    pub(crate) fn as_u64(self) -> Option<u64> {
        let digits = self.text;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    }

    /// Any number, as the nearest `f64`.
    pub(crate) fn as_f64(self) -> Option<f64> {
        super::float::parse(self.text)
    }

    /// A string's value, its escapes read (`None`: not a string, or an escape naming half
    /// of a surrogate pair alone, which no Rust string can hold).
    pub(crate) fn as_str(self) -> Option<Cow<'a, str>> {
        let inner = self.text.strip_prefix('"')?.strip_suffix('"')?;
        if !inner.contains('\\') {
            return Some(Cow::Borrowed(inner));
        }
        unescape(inner).map(Cow::Owned)
    }

    /// An object's members in order (nothing when it is not an object).
    pub(crate) fn members(self) -> Members<'a> {
        let b = self.text.as_bytes();
        let at = if b.first() == Some(&b'{') { 1 } else { b.len() };
        Members { text: self.text, at }
    }

    /// An array's items in order (nothing when it is not an array).
    pub(crate) fn items(self) -> Items<'a> {
        let b = self.text.as_bytes();
        let at = if b.first() == Some(&b'[') { 1 } else { b.len() };
        Items { text: self.text, at }
    }

    pub(crate) fn is_object(self) -> bool {
        self.text.starts_with('{')
    }

    pub(crate) fn is_array(self) -> bool {
        self.text.starts_with('[')
    }

    /// The members named in `names`, read in one walk, as a derived serde reader reads a
    /// struct's fields: `None` when it is not an object or names one of them twice; a
    /// name it lacks is `None` in its slot; other members are skipped.
    pub(crate) fn fields<const N: usize>(self, names: [&str; N]) -> Option<[Option<Json<'a>>; N]> {
        self.pick(names, true)
    }

    /// As `fields`, and `None` when it has a member of another name (serde's
    /// `deny_unknown_fields`).
    pub(crate) fn only_fields<const N: usize>(self, names: [&str; N]) -> Option<[Option<Json<'a>>; N]> {
        self.pick(names, false)
    }

    fn pick<const N: usize>(self, names: [&str; N], others: bool) -> Option<[Option<Json<'a>>; N]> {
        pick(self.text, 0, names, others, true).map(|(found, _)| found)
    }
}

/// An optional member read by `read`: `Some(None)` when it is absent or `null`, `None`
/// when it is there and `read` refuses it.
pub(crate) fn opt<'a, T>(member: Option<Json<'a>>, read: impl FnOnce(Json<'a>) -> Option<T>) -> Option<Option<T>> {
    match member {
        Some(v) if !v.is_null() => read(v).map(Some),
        _ => Some(None),
    }
}

/// An object's members: each name (its escapes read) and value.
pub(crate) struct Members<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Iterator for Members<'a> {
    type Item = (Cow<'a, str>, Json<'a>);

    fn next(&mut self) -> Option<Self::Item> {
        let b = self.text.as_bytes();
        let start = space(b, self.at);
        if b.get(start) != Some(&b'"') {
            self.at = b.len();
            return None;
        }
        let name_end = skip(b, start);
        let name = Json { text: self.text.get(start..name_end)? }.as_str()?;
        let colon = space(b, name_end);
        let value_start = space(b, colon + 1);
        let value_end = skip(b, value_start);
        let value = Json { text: self.text.get(value_start..value_end)? };
        self.at = after_separator(b, value_end);
        Some((name, value))
    }
}

/// An array's items.
pub(crate) struct Items<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Iterator for Items<'a> {
    type Item = Json<'a>;

    fn next(&mut self) -> Option<Json<'a>> {
        let b = self.text.as_bytes();
        let start = space(b, self.at);
        if matches!(b.get(start), None | Some(b']')) {
            self.at = b.len();
            return None;
        }
        let end = skip(b, start);
        self.at = after_separator(b, end);
        Some(Json { text: self.text.get(start..end)? })
    }
}

/// Past the comma that follows a member or an item (at the closing bracket when none).
fn after_separator(b: &[u8], at: usize) -> usize {
    let at = space(b, at);
    if b.get(at) == Some(&b',') {
        at + 1
    } else {
        at
    }
}

fn space(b: &[u8], mut at: usize) -> usize {
    while matches!(b.get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// The end of the checked value starting at `at`.
fn skip(b: &[u8], at: usize) -> usize {
    match b.get(at) {
        Some(b'"') => string_end(b, at).unwrap_or(b.len()),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut i = at;
            while let Some(&c) = b.get(i) {
                match c {
                    b'"' => {
                        i = string_end(b, i).unwrap_or(b.len());
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return i + 1;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            b.len()
        }
        _ => {
            let mut i = at;
            while b.get(i).is_some_and(|c| !matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')) {
                i += 1;
            }
            i
        }
    }
}

/// The bytes that end a string's plain run: a quote, an escape, a control character.
static STOPS: [bool; 256] = {
    let mut stops = [false; 256];
    let mut c = 0;
    while c < 0x20 {
        stops[c] = true;
        c += 1;
    }
    stops[b'"' as usize] = true;
    stops[b'\\' as usize] = true;
    stops
};

/// The end of the plain run of a string's bytes from `at`: the next quote, escape or
/// control character (or the end of `b`).
pub(crate) fn plain_end(b: &[u8], at: usize) -> usize {
    let rest = b.get(at..).unwrap_or_default();
    at + rest.iter().position(|&c| STOPS[usize::from(c)]).unwrap_or(rest.len())
}

/// Past the closing quote of the string whose opening quote is at `at` (`None`: a
/// control character, a bad escape, or no end).
fn string_end(b: &[u8], at: usize) -> Option<usize> {
    let mut i = at + 1;
    loop {
        i = plain_end(b, i);
        match *b.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => {
                i += match *b.get(i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 2,
                    b'u' if b.get(i + 2..i + 6)?.iter().all(u8::is_ascii_hexdigit) => 6,
                    _ => return None,
                }
            }
            c if c < 0x20 => return None,
            _ => i += 1,
        }
    }
}

/// Past a member's name at `at`: a string whose escapes make a Rust string (a name is
/// read, as serde_json reads a field's name; a lone surrogate is no name). `string_end`'s
/// walk, noting a `\u` escape (the only kind that can name half of a surrogate pair).
fn name_end(b: &[u8], at: usize) -> Option<usize> {
    let mut i = at + 1;
    let mut unicode = false;
    loop {
        i = plain_end(b, i);
        match *b.get(i)? {
            b'"' => break,
            b'\\' => {
                i += match *b.get(i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 2,
                    b'u' if b.get(i + 2..i + 6)?.iter().all(u8::is_ascii_hexdigit) => {
                        unicode = true;
                        6
                    }
                    _ => return None,
                }
            }
            c if c < 0x20 => return None,
            _ => i += 1,
        }
    }
    if unicode {
        unescape(std::str::from_utf8(b.get(at + 1..i)?).ok()?)?;
    }
    Some(i + 1)
}

/// Checks the value at `at` (`depth` containers around it): the end of it.
fn check(b: &[u8], at: usize, depth: usize) -> Option<usize> {
    match *b.get(at)? {
        b'"' => string_end(b, at),
        b'{' => container(b, at, depth, b'}', |b, at, depth| {
            if b.get(at) != Some(&b'"') {
                return None;
            }
            let colon = space(b, name_end(b, at)?);
            (b.get(colon) == Some(&b':')).then_some(())?;
            check(b, space(b, colon + 1), depth)
        }),
        b'[' => container(b, at, depth, b']', check),
        b't' => literal(b, at, b"true"),
        b'f' => literal(b, at, b"false"),
        b'n' => literal(b, at, b"null"),
        _ => number(b, at),
    }
}

/// An object or an array opening at `at`: its entries (members or items), checked by
/// `entry`, separated by commas, then `close`.
fn container(
    b: &[u8],
    at: usize,
    depth: usize,
    close: u8,
    entry: fn(&[u8], usize, usize) -> Option<usize>,
) -> Option<usize> {
    let depth = depth + 1;
    if depth >= MAX_DEPTH {
        return None;
    }
    let mut i = space(b, at + 1);
    if b.get(i) == Some(&close) {
        return Some(i + 1);
    }
    loop {
        i = space(b, entry(b, i, depth)?);
        match *b.get(i)? {
            b',' => i = space(b, i + 1),
            c if c == close => return Some(i + 1),
            _ => return None,
        }
    }
}

fn literal(b: &[u8], at: usize, word: &[u8]) -> Option<usize> {
    (b.get(at..at + word.len())? == word).then_some(at + word.len())
}

/// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
fn number(b: &[u8], at: usize) -> Option<usize> {
    let digits = |mut i: usize| {
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        (i > start).then_some(i)
    };
    let mut i = at + usize::from(b.get(at) == Some(&b'-'));
    i = match *b.get(i)? {
        b'0' => i + 1,
        b'1'..=b'9' => digits(i)?,
        _ => return None,
    };
    if b.get(i) == Some(&b'.') {
        i = digits(i + 1)?;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        i += usize::from(matches!(b.get(i), Some(b'+' | b'-')));
        i = digits(i)?;
    }
    Some(i)
}

/// A checked string's inside with its escapes read.
fn unescape(inner: &str) -> Option<String> {
    let mut out = String::with_capacity(inner.len());
    let mut rest = inner;
    while let Some(at) = rest.find('\\') {
        out.push_str(rest.get(..at)?);
        let (c, used) = escape(rest.as_bytes().get(at + 1..)?).ok()?;
        out.push(c);
        rest = rest.get(at + 1 + used..)?;
    }
    out.push_str(rest);
    Some(out)
}

/// Why an escape names no character.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Escape {
    /// The text ends inside it.
    Unended,
    /// Not one of JSON's escapes, or a `\u` without four hex digits.
    Invalid,
    /// Half of a surrogate pair alone, which no Rust string can hold.
    LoneSurrogate,
}

/// The character the escape at the start of `b` (after its `\`) names and the bytes it
/// takes (a surrogate pair's two `\u` escapes are one), or why it names none and at
/// which byte of `b`.
pub(crate) fn escape(b: &[u8]) -> Result<(char, usize), (Escape, usize)> {
    let simple = match *b.first().ok_or((Escape::Unended, 0))? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let high = hex4(b, 1)?;
            let code = match high {
                0xD800..=0xDBFF => {
                    if b.get(5..7) != Some(b"\\u") {
                        return Err((Escape::LoneSurrogate, 5));
                    }
                    let low = hex4(b, 7)?;
                    if !(0xDC00..=0xDFFF).contains(&low) {
                        return Err((Escape::LoneSurrogate, 11));
                    }
                    let pair = 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00);
                    return char::from_u32(pair).map(|c| (c, 11)).ok_or((Escape::Invalid, 11));
                }
                0xDC00..=0xDFFF => return Err((Escape::LoneSurrogate, 5)),
                n => n,
            };
            return char::from_u32(code).map(|c| (c, 5)).ok_or((Escape::Invalid, 5));
        }
        _ => return Err((Escape::Invalid, 0)),
    };
    Ok((simple, 1))
}

/// The four hex digits at `at` of `b`, or the byte that is not one.
fn hex4(b: &[u8], at: usize) -> Result<u32, (Escape, usize)> {
    (at..at + 4).try_fold(0, |n, i| {
        let c = *b.get(i).ok_or((Escape::Unended, i))?;
        let digit = char::from(c).to_digit(16).ok_or((Escape::Invalid, i))?;
        Ok(n * 16 + digit)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first member named `name`.
    fn member<'a>(json: Json<'a>, name: &str) -> Option<Json<'a>> {
        json.members().find(|(key, _)| key == name).map(|(_, value)| value)
    }
    use serde::de::IgnoredAny;

    /// Texts serde_json reads and refuses, each read here as serde_json reads it.
    const TEXTS: &[&str] = &[
        "0",
        "-0",
        "1",
        "-1",
        "12.5",
        "1e3",
        "1E+3",
        "1.5e-3",
        "01",
        "1.",
        ".5",
        "-",
        "+1",
        "1e",
        "1e+",
        "--1",
        "true",
        "false",
        "null",
        "nul",
        "truex",
        "tru",
        r#""""#,
        r#""a""#,
        r#""\"""#,
        r#""\u00e9""#,
        r#""\uD83D\uDE00""#,
        r#""\x""#,
        r#""\u12""#,
        r#""\u12G4""#,
        "\"a\tb\"",
        "\"a\u{1}\"",
        "\"é\"",
        r#""unterminated"#,
        "[]",
        "[1,2]",
        "[1,]",
        "[,1]",
        "[1 2]",
        "{}",
        r#"{"a":1}"#,
        r#"{"a":1,}"#,
        r#"{"a" 1}"#,
        r#"{a:1}"#,
        r#"{"a":1 "b":2}"#,
        r#"{"a":[1,{"b":null}],"c":"}"}"#,
        " [ 1 , { \"a\" : [ ] } ] ",
        "[1]]",
        "{}}",
        "",
        "   ",
        "[",
        "{",
        r#"{"a"}"#,
        r#"{"a":}"#,
        r#"["\\"]"#,
        r#"["\\\""]"#,
        "[1]x",
        "1 2",
    ];

    #[test]
    fn a_name_must_be_a_string_but_a_value_need_not() {
        // serde_json reads a member's name (and refuses a lone surrogate there) but skips
        // the values it does not keep.
        assert!(read(br#"{"a":1,"\ud800":1}"#).is_none());
        assert!(read(br#"{"a":"\ud800"}"#).is_some());
        assert!(member(read(br#"{"\u0061":1}"#).unwrap(), "a").is_some());
    }

    #[test]
    fn fields_read_in_one_pass_are_those_of_the_checked_document() {
        let names = ["a", "b", "c"];
        for text in [
            r#"{"a":1,"b":[2,{"x":"y"}],"z":null}"#,
            r#" { } "#,
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,}"#,
            r#"{"a":1} x"#,
            r#"{"\u0061":"escaped name","c":"\ud800"}"#,
            r#"{"\ud800":1}"#,
            r#"{"a":1,"\ud800":1}"#,
            r#"{"a":[1,]}"#,
            r#"[1]"#,
            r#"{"a" 1}"#,
            "",
        ] {
            let two_passes = read(text.as_bytes()).and_then(|d| d.fields(names));
            assert_eq!(read_fields(text.as_bytes(), names), two_passes, "{text}");
        }
        let deep = format!(r#"{{"a":{}{}}}"#, "[".repeat(126), "]".repeat(126));
        assert!(read_fields(deep.as_bytes(), names).is_some());
        let deeper = format!(r#"{{"a":{}{}}}"#, "[".repeat(127), "]".repeat(127));
        assert!(read_fields(deeper.as_bytes(), names).is_none(), "128 levels with the object");
    }

    #[test]
    fn a_text_is_json_exactly_when_serde_json_reads_it() {
        for text in TEXTS {
            let serde = serde_json::from_str::<IgnoredAny>(text).is_ok();
            assert_eq!(read(text.as_bytes()).is_some(), serde, "{text:?}");
        }
        let deep = |n: usize| "[".repeat(n) + &"]".repeat(n);
        // serde_json skips an ignored value at any depth, and builds a `Value` 128 deep.
        for n in [127, 128, 129, 4096] {
            let serde = serde_json::from_str::<serde_json::Value>(&deep(n)).is_ok();
            assert_eq!(read(deep(n).as_bytes()).is_some(), serde, "{n} levels");
        }
        assert!(read(b"\"\xff\"").is_none(), "not UTF-8");
    }

    #[test]
    fn members_and_items_are_found_in_place() {
        let j = read(br#" {"a" : 1, "b\u0021":[true, "x,]", {"c":{}}], "d":null } "#).unwrap();
        let names: Vec<String> = j.members().map(|(k, _)| k.into_owned()).collect();
        assert_eq!(names, ["a", "b!", "d"]);
        assert_eq!(member(j, "a").and_then(Json::as_u64), Some(1));
        let items: Vec<&str> = member(j, "b!").unwrap().items().map(Json::text).collect();
        assert_eq!(items, ["true", r#""x,]""#, r#"{"c":{}}"#]);
        assert!(member(j, "d").unwrap().is_null());
        assert_eq!(member(j, "e"), None);
        assert_eq!(j.items().count(), 0, "an object has no items");
        assert_eq!(read(b"[]").unwrap().items().count(), 0);
        assert_eq!(read(b"{ }").unwrap().members().count(), 0);
    }

    #[test]
    fn fields_are_read_as_a_derived_reader_reads_them() {
        let j = read(br#"{"x":1,"a":2,"b":3}"#).unwrap();
        assert_eq!(j.fields(["a", "c"]).map(|[a, c]| (a.map(Json::text), c)), Some((Some("2"), None)));
        assert_eq!(read(br#"{"a":2,"a":3}"#).unwrap().fields(["a"]), None, "a field named twice");
        assert!(read(br#"{"x":2,"x":3}"#).unwrap().fields(["a"]).is_some(), "other members are skipped");
        assert_eq!(read(b"[1]").unwrap().fields(["a"]), None);
    }

    #[test]
    fn scalars_read_as_serde_reads_them() {
        for text in ["0", "-0", "18446744073709551615", "18446744073709551616", "1.0", "1e2", "-1", "\"1\"", "null"] {
            let serde = serde_json::from_str::<u64>(text).ok();
            assert_eq!(read(text.as_bytes()).unwrap().as_u64(), serde, "{text}");
        }
        for text in ["1.5", "-2e-3", "7", "\"7\""] {
            assert_eq!(read(text.as_bytes()).unwrap().as_f64(), serde_json::from_str::<f64>(text).ok(), "{text}");
        }
        for text in
            [r#""plain""#, r#""q\"\\\/\b\f\n\r\t""#, r#""\u00e9\uD83D\uDE00""#, r#""\uDE00""#, r#""\uD83Dx""#, "1"]
        {
            let serde = serde_json::from_str::<String>(text).ok();
            assert_eq!(read(text.as_bytes()).unwrap().as_str().map(Cow::into_owned), serde, "{text}");
        }
        assert!(matches!(read(br#""plain""#).unwrap().as_str(), Some(Cow::Borrowed("plain"))));
        assert_eq!(read(b"true").unwrap().as_bool(), Some(true));
        assert_eq!(read(b"1").unwrap().as_bool(), None);
    }

    #[test]
    fn the_first_value_and_what_follows() {
        let (j, rest) = read_first(br#" {"a":1} } "#).unwrap();
        assert_eq!((j.text(), rest), (r#"{"a":1}"#, &b" } "[..]));
        assert!(read_first(b"{").is_none());
    }
}
