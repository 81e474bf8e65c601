//! The caller's W3C trace context (`traceparent`, `tracestate`), carried onto the call the
//! edge makes to HolySheep so that HolySheep's spans join the caller's trace. A header that
//! is not a valid trace context is dropped: the call starts no trace of the caller's, and
//! the request is served as ever.

use crate::core::api::headers;

/// The most bytes of `tracestate` passed on: the length W3C asks every vendor to pass on
/// at least (a longer one is dropped whole rather than cut inside a member).
const MAX_STATE: usize = 512;
/// The longest `traceparent` of a later version passed on.
const MAX_PARENT: usize = 256;

/// A caller's trace context, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    parent: String,
    state: Option<String>,
}

impl TraceContext {
    /// The context `traceparent` and `tracestate` give, if `traceparent` is one
    /// (trace-context level 1: `version-traceid-parentid-flags`, lowercase hex, ids not all
    /// zeros, version not `ff`; a later version may carry more after the flags).
    /// `tracestate` goes with it when it is printable ASCII of at most `MAX_STATE` bytes.
    pub fn of(parent: Option<&str>, state: Option<&str>) -> Option<TraceContext> {
        let parent = parent?.trim_matches([' ', '\t']);
        let b = parent.as_bytes();
        let hex = |r: std::ops::Range<usize>| {
            b.get(r).is_some_and(|s| s.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')))
        };
        let zeros = |r: std::ops::Range<usize>| b.get(r).is_some_and(|s| s.iter().all(|c| *c == b'0'));
        let shaped = b.len() >= 55
            && hex(0..2)
            && !parent.starts_with("ff")
            && [2, 35, 52].iter().all(|&i| b[i] == b'-')
            && hex(3..35)
            && hex(36..52)
            && hex(53..55)
            && !zeros(3..35)
            && !zeros(36..52)
            && (b.len() == 55 && parent.starts_with("00")
                || !parent.starts_with("00") && (b.len() == 55 || b[55] == b'-'))
            && b.len() <= MAX_PARENT
            && b.iter().all(|c| (0x21..0x7f).contains(c));
        if !shaped {
            return None;
        }
        let state = state
            .map(|s| s.trim_matches([' ', '\t']))
            .filter(|s| !s.is_empty() && s.len() <= MAX_STATE && s.bytes().all(|c| (0x20..0x7f).contains(&c)));
        Some(TraceContext { parent: parent.to_owned(), state: state.map(str::to_owned) })
    }

    /// The headers the call to HolySheep carries.
    pub fn headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        let state = self.state.as_deref().map(|s| (headers::TRACESTATE, s));
        std::iter::once((headers::TRACEPARENT, self.parent.as_str())).chain(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_goes_on_with_its_tracestate_anything_else_is_dropped() {
        let t = TraceContext::of(Some(GOOD), Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")).unwrap();
        let sent: Vec<_> = t.headers().collect();
        assert_eq!(sent, [("traceparent", GOOD), ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")]);
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more";
        assert!(TraceContext::of(Some(later), None).is_some(), "a later version may say more");
        for tail in ["-a b", "-a\r\nx: y"] {
            assert_eq!(TraceContext::of(Some(&format!("{}{tail}", &later[..55])), None), None, "{tail:?}");
        }
        let long = format!("{}-{}", &later[..55], "x".repeat(MAX_PARENT));
        assert_eq!(TraceContext::of(Some(&long), None), None);
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ];
        for b in bad {
            assert_eq!(TraceContext::of(Some(b), Some("a=b")), None, "{b}");
        }
        assert_eq!(TraceContext::of(None, Some("a=b")), None);
        let long = "a=".to_owned() + &"b".repeat(MAX_STATE);
        for state in [long.as_str(), "a=b\u{7}", "", "a=\u{e9}"] {
            let t = TraceContext::of(Some(GOOD), Some(state)).unwrap();
            assert_eq!(t.headers().count(), 1, "{state:?} is not passed on");
        }
    }
}
