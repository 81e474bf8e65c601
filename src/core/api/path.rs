//! Request paths as a server behind nginx resolves them: query and fragment dropped,
//! unreserved percent-escapes (and `/`) decoded, repeated slashes merged, `.` and `..`
//! segments resolved, a trailing slash ignored. Uses nothing else of the core.

/// The path's segments as a server would resolve them.
pub(crate) fn segments(path: &str) -> Vec<String> {
    let path = path.split(['?', '#']).next().unwrap_or("");
    let mut segments: Vec<String> = Vec::new();
    for segment in decode_unreserved(path).split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s.to_owned()),
        }
    }
    segments
}

/// Decodes `%XX` escapes of unreserved characters (RFC 3986: letters, digits, `-._~`) and
/// of `/`, which servers commonly decode before routing; others stay as they are.
fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        let decoded = hex.and_then(|h| u8::from_str_radix(h, 16).ok()).map(char::from);
        match decoded.filter(|c| bytes[i] == b'%' && (c.is_ascii_alphanumeric() || "-._~/".contains(*c))) {
            Some(c) => {
                out.push(c);
                i += 3;
            }
            None => {
                out.push(char::from(bytes[i]));
                i += 1;
            }
        }
    }
    out
}
