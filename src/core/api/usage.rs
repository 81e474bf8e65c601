//! What HolySheep billed for one answer: the `usage` of a chat completion (or of a
//! stream's usage event), with the prompt tokens its prompt cache served
//! (`prompt_tokens_details.cached_tokens`, billed at a discount).

use crate::core::wire::bytes;
use crate::core::wire::scan::{self, Json};
use crate::core::wire::write;

/// Completion tokens assumed when a request sets no `max_tokens`/`max_completion_tokens`.
pub(crate) const DEFAULT_COMPLETION_ESTIMATE: u64 = 256;

/// One answer's tokens. `cached` is part of `prompt` (never more than it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt: u64,
    pub completion: u64,
    pub cached: u64,
}

impl Usage {
    /// Tokens without a prompt cache's share.
    pub fn new(prompt: u64, completion: u64) -> Usage {
        Usage { prompt, completion, cached: 0 }
    }

    /// With `cached` of the prompt tokens served from the prompt cache.
    pub(crate) fn with_cached(self, cached: u64) -> Usage {
        Usage { cached: cached.min(self.prompt), ..self }
    }

    /// Every token the answer counted (what a token bucket is charged).
    pub fn total(&self) -> u64 {
        self.prompt.saturating_add(self.completion)
    }

    /// The prompt tokens billed at the full input price.
    pub(crate) fn fresh_prompt(&self) -> u64 {
        self.prompt - self.cached
    }
}

/// What one attempt is billed, as far as the edge can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Billed {
    /// HolySheep's `usage`, whatever else the answer is.
    Known(Usage),
    /// HolySheep's own JSON error: nothing.
    Nothing,
    /// No answer, a cut-off stream, an answer that is not HolySheep's (Envoy's own 503
    /// after a reset, say) or one without `usage`: it may have cost its worst case, and is
    /// charged that.
    #[default]
    Unknown,
    /// The attempt never reached HolySheep (the callout was refused at dispatch, the
    /// connection could not be made, Envoy's circuit breaker turned it away): nothing, and
    /// its token estimate goes back to the bucket.
    Unsent,
}

impl Billed {
    /// What an answer HolySheep sent back says it was billed, read before anything the
    /// edge does to it: its `usage` when it carries one (a 200 the edge refuses to pass on
    /// as not the endpoint's object included); nothing for a non-200 that is an
    /// OpenAI-shaped JSON error; otherwise its worst case.
    pub fn of_answer(status: u16, content_type: &str, body: &[u8]) -> Billed {
        if let Some(u) = of_answer(body) {
            return Billed::Known(u);
        }
        // Its `error` is read only where it can decide: a non-200 said to be JSON.
        let json = content_type.to_ascii_lowercase().contains("json");
        let error = (status != 200 && json).then(|| scan::read_fields(body, ["error"])).flatten();
        Billed::of_members(status, None, error.and_then(|[e]| e))
    }

    /// `of_answer` of a JSON body whose whole text was checked, from its top-level `usage`
    /// and `error` members (read in the pass that checked it).
    pub(crate) fn of_members(status: u16, usage: Option<Json<'_>>, error: Option<Json<'_>>) -> Billed {
        if let Some(u) = usage.and_then(read) {
            return Billed::Known(u);
        }
        if status != 200 && error.is_some_and(Json::is_object) {
            return Billed::Nothing;
        }
        Billed::Unknown
    }

    /// What an answer that may be Envoy's own reply was billed: `of_answer`, but nothing
    /// (`Unsent`) when it carries no `usage` and is Envoy's reply for a request it never
    /// sent, by its text (`envoy_never_sent`) or, a 503, by `x-envoy-overloaded`
    /// (`overloaded`). Only for a reply the shell knows Envoy made itself (no upstream
    /// answered: a callout's without `x-envoy-upstream-service-time`, a stream's without
    /// an upstream response): a hop on HolySheep's side writes the same text about its own
    /// attempts, which may have been billed.
    pub fn of_envoys_answer(status: u16, overloaded: bool, content_type: &str, body: &[u8]) -> Billed {
        match Billed::of_answer(status, content_type, body) {
            known @ Billed::Known(_) => known,
            _ if (status == 503 && overloaded) || envoy_never_sent(status, content_type, body) => Billed::Unsent,
            other => other,
        }
    }
}

/// Envoy's own 503 for a request it never sent: its router's local reply (`text/plain`,
/// `upstream connect error or disconnect/reset before headers. reset reason: <reason>`)
/// where the reason is one that comes before a request leaves: the connection could not
/// be made (`local connection failure`, `remote connection failure`, older Envoys'
/// `connection failure`, `connection timeout`), the cluster's circuit breaker overflowed
/// (`overflow`), or HTTP/2's `REFUSED_STREAM` from the peer, which promises the stream was
/// not processed (`remote refused stream reset`). A reset after the request
/// went out (`connection termination`, `remote reset`, ...) may have been billed, as may
/// a reply after retries (`retried and the latest reset reason: ...`, which names only the
/// last). Envoy says this only in text (its `%RESPONSE_FLAGS%` `UF`/`UO` reach the access
/// log alone).
fn envoy_never_sent(status: u16, content_type: &str, body: &[u8]) -> bool {
    const HEAD: &[u8] = b"upstream connect error or disconnect/reset before headers. reset reason: ";
    const BEFORE_SENDING: [&[u8]; 6] = [
        b"local connection failure",
        b"remote connection failure",
        b"connection failure",
        b"connection timeout",
        b"overflow",
        b"remote refused stream reset",
    ];
    if status != 503 || !content_type.trim_start().to_ascii_lowercase().starts_with("text/plain") {
        return false;
    }
    let Some(reason) = body.strip_prefix(HEAD) else { return false };
    // The reason runs to the first comma (`, transport failure reason: ...` may follow).
    let reason = reason.split(|&b| b == b',').next().unwrap_or_default().trim_ascii();
    BEFORE_SENDING.contains(&reason)
}

/// `usage` as OpenAI-compatible APIs write it: chat and completions (`prompt_tokens`,
/// `completion_tokens`), embeddings (`prompt_tokens`, `total_tokens`) and the Responses
/// API (`input_tokens`, `output_tokens`, `input_tokens_details`). `None` when it is not
/// one, or says nothing of the completion (neither its tokens nor a total). A count may
/// be `null` (not said), but not of another type; a name may be given once, either way.
fn read(usage: Json<'_>) -> Option<Usage> {
    let names = ["prompt_tokens", "input_tokens", "completion_tokens", "output_tokens", "total_tokens"];
    let [p, i, c, o, t, pd, id] = usage.fields([
        names[0],
        names[1],
        names[2],
        names[3],
        names[4],
        "prompt_tokens_details",
        "input_tokens_details",
    ])?;
    let prompt = either(p, i)?.and_then(Json::as_u64)?;
    let completion = count(either(c, o)?)?;
    let total = count(t)?;
    let cached = match either(pd, id)? {
        Some(d) if !d.is_null() => count(d.fields(["cached_tokens"])?[0])?,
        _ => None,
    };
    let completion = completion.or_else(|| total?.checked_sub(prompt))?;
    Some(Usage::new(prompt, completion).with_cached(cached.unwrap_or(0)))
}

/// A count that may be absent or `null`; `None` when it is of another type.
fn count(v: Option<Json<'_>>) -> Option<Option<u64>> {
    match v {
        Some(v) if !v.is_null() => v.as_u64().map(Some),
        _ => Some(None),
    }
}

/// One of a name and its alias; `None` when both are given.
fn either<'a>(a: Option<Json<'a>>, b: Option<Json<'a>>) -> Option<Option<Json<'a>>> {
    if a.is_some() && b.is_some() {
        None
    } else {
        Some(a.or(b))
    }
}

/// The `usage` value of a stream's usage event.
pub(crate) fn of_value(v: &serde_json::Value) -> Option<Usage> {
    read(scan::read(&write::value(v))?)
}

/// The top-level `usage` of a chat completion.
pub fn of_answer(body: &[u8]) -> Option<Usage> {
    if let Some(usage) = trailing(body) {
        return Some(usage);
    }
    let [usage] = scan::read_fields(body, ["usage"])?;
    read(usage?)
}

/// `usage` when it is the last member of the answer's top-level object, where
/// OpenAI-compatible APIs put it: read from the end, without walking the choices. In JSON
/// the bytes `"usage"` after `{` or `,` and followed by `:` can only be a member name (a
/// quote inside a string, or inside a name such as `x\"usage`, is escaped), and a member
/// followed by nothing but the one closing brace is a member of the outermost object.
fn trailing(body: &[u8]) -> Option<Usage> {
    const NAME: &[u8] = b"\"usage\"";
    let at = body.windows(NAME.len()).rposition(|w| w[0] == b'"' && bytes::same(w, NAME))?;
    if !matches!(body.get(..at)?.trim_ascii_end().last(), Some(b'{' | b',')) {
        return None;
    }
    let value = body[at + NAME.len()..].trim_ascii_start().strip_prefix(b":")?;
    let (usage, tail) = scan::read_first(value)?;
    (tail.trim_ascii() == b"}").then(|| read(usage)).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_the_answer() {
        let plain = br#"{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
        assert_eq!(of_answer(plain), Some(Usage::new(3, 4)));
        assert_eq!(of_answer(b"{}"), None);
        let cached = br#"{"id":"x","usage":{"prompt_tokens":2048,"completion_tokens":4,"total_tokens":2052,
            "prompt_tokens_details":{"cached_tokens":1920,"audio_tokens":0}}}"#;
        assert_eq!(of_answer(cached), Some(Usage { prompt: 2048, completion: 4, cached: 1920 }));
        let odd = br#"{"usage":{"prompt_tokens":5,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":9}}}"#;
        assert_eq!(of_answer(odd).map(|u| (u.cached, u.fresh_prompt())), Some((5, 0)), "never more than the prompt");
        let null = br#"{"usage":{"prompt_tokens":5,"completion_tokens":1,"prompt_tokens_details":null}}"#;
        assert_eq!(of_answer(null), Some(Usage::new(5, 1)));
    }

    #[test]
    fn usage_is_the_top_level_one_wherever_it_stands() {
        let u = r#""usage":{"prompt_tokens":3,"completion_tokens":4}"#;
        let three_four = Some(Usage::new(3, 4));
        // Last, read from the end; first, or followed by another member, parsed whole.
        assert_eq!(of_answer(format!(r#"{{"id":"x", {u} }}"#).as_bytes()), three_four);
        assert_eq!(of_answer(format!(r#"{{{u},"id":"x"}}"#).as_bytes()), three_four);
        // A nested `usage` (or one quoted in the content) is never taken for the answer's.
        let nested = r#""choices":[{"message":{"content":"\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":9}}","usage":{"prompt_tokens":8,"completion_tokens":8}}}]"#;
        assert_eq!(of_answer(format!(r#"{{{u},{nested}}}"#).as_bytes()), three_four);
        assert_eq!(of_answer(format!(r#"{{{nested}}}"#).as_bytes()), None);
        assert_eq!(of_answer(br#"{"usage":{"prompt_tokens":3}}"#), None, "incomplete usage");
        // Nor is a member whose name ends in an escaped quote and `usage`.
        let named = r#""x\"usage":{"prompt_tokens":999,"completion_tokens":999}"#;
        assert_eq!(of_answer(format!(r#"{{{u},{named}}}"#).as_bytes()), three_four);
        assert_eq!(of_answer(format!(r#"{{"id":"x",{named}}}"#).as_bytes()), None);
    }

    #[test]
    fn only_envoys_own_reply_for_a_request_it_never_sent_is_unsent() {
        let envoy =
            |reason: &str| format!("upstream connect error or disconnect/reset before headers. reset reason: {reason}");
        let text = "text/plain";
        for reason in [
            "remote connection failure",
            "remote connection failure, transport failure reason: delayed connect error: Connection refused",
            "connection failure",
            "local connection failure",
            "connection timeout",
            "overflow",
            "remote refused stream reset",
        ] {
            assert_eq!(
                Billed::of_envoys_answer(503, false, text, envoy(reason).as_bytes()),
                Billed::Unsent,
                "{reason}"
            );
        }
        // After the request left, or not Envoy's own reply: it may have been billed.
        for reason in ["connection termination", "remote reset", "local reset", "protocol error", "overflowing"] {
            assert_eq!(
                Billed::of_envoys_answer(503, false, text, envoy(reason).as_bytes()),
                Billed::Unknown,
                "{reason}"
            );
        }
        let overflow = envoy("overflow");
        assert_eq!(Billed::of_envoys_answer(502, false, text, overflow.as_bytes()), Billed::Unknown, "not a 503");
        assert_eq!(Billed::of_envoys_answer(503, false, "application/json", overflow.as_bytes()), Billed::Unknown);
        assert_eq!(Billed::of_envoys_answer(503, false, text, format!("x {overflow}").as_bytes()), Billed::Unknown);
        let retried = "upstream connect error or disconnect/reset before headers. retried and the latest reset \
                       reason: remote connection failure";
        assert_eq!(Billed::of_envoys_answer(503, false, text, retried.as_bytes()), Billed::Unknown, "earlier tries");
        assert_eq!(Billed::of_answer(503, text, overflow.as_bytes()), Billed::Unknown, "not known to be Envoy's");
        // The circuit breaker's mark, unless the answer says what it was billed.
        assert_eq!(Billed::of_envoys_answer(503, true, text, b"overloaded"), Billed::Unsent);
        let usage = br#"{"usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        assert_eq!(Billed::of_envoys_answer(503, true, "application/json", usage), Billed::Known(Usage::new(3, 4)));
    }

    #[test]
    fn embeddings_and_responses_usage_read_as_chats() {
        let embeddings = br#"{"object":"list","data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}"#;
        assert_eq!(of_answer(embeddings), Some(Usage::new(8, 0)));
        let responses =
            br#"{"object":"response","usage":{"input_tokens":2000,"input_tokens_details":{"cached_tokens":1024},
            "output_tokens":7,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":2007},"user":null}"#;
        assert_eq!(of_answer(responses), Some(Usage { prompt: 2000, completion: 7, cached: 1024 }));
        assert_eq!(of_answer(br#"{"usage":{"prompt_tokens":9,"total_tokens":3}}"#), None, "a total below the prompt");
    }
}
