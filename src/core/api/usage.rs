//! What HolySheep billed for one answer: the `usage` of a chat completion (or of a
//! stream's usage event), with the prompt tokens its prompt cache served
//! (`prompt_tokens_details.cached_tokens`, billed at a discount).

use crate::core::wire::bytes;

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
}

impl Billed {
    /// What an answer HolySheep sent back says it was billed, read before anything the
    /// edge does to it: its `usage` when it carries one (a 200 the edge refuses to pass on
    /// as not the endpoint's object included); nothing for a non-200 that is an
    /// OpenAI-shaped JSON error; otherwise its worst case.
    pub fn of_answer(status: u16, content_type: &str, body: &[u8]) -> Billed {
        #[derive(serde::Deserialize)]
        struct Error {
            #[serde(rename = "error")]
            _error: serde_json::Map<String, serde_json::Value>,
        }
        if let Some(u) = of_answer(body) {
            return Billed::Known(u);
        }
        let json = content_type.to_ascii_lowercase().contains("json");
        if status != 200 && json && serde_json::from_slice::<Error>(body).is_ok() {
            return Billed::Nothing;
        }
        Billed::Unknown
    }
}

/// `usage` as OpenAI-compatible APIs write it: chat and completions (`prompt_tokens`,
/// `completion_tokens`), embeddings (`prompt_tokens`, `total_tokens`) and the Responses
/// API (`input_tokens`, `output_tokens`, `input_tokens_details`).
#[derive(serde::Deserialize)]
struct Raw {
    #[serde(alias = "input_tokens")]
    prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    completion_tokens: Option<u64>,
    #[serde(default)]
    total_tokens: Option<u64>,
    #[serde(default, alias = "input_tokens_details")]
    prompt_tokens_details: Option<Details>,
}

#[derive(serde::Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl Raw {
    /// `None` when it says nothing of the completion (neither its tokens nor a total).
    fn usage(self) -> Option<Usage> {
        let completion = self.completion_tokens.or_else(|| self.total_tokens?.checked_sub(self.prompt_tokens))?;
        let cached = self.prompt_tokens_details.and_then(|d| d.cached_tokens).unwrap_or(0);
        Some(Usage::new(self.prompt_tokens, completion).with_cached(cached))
    }
}

/// The `usage` value of an answer or of a stream's usage event.
pub(crate) fn of_value(v: &serde_json::Value) -> Option<Usage> {
    <Raw as serde::Deserialize>::deserialize(v).ok().and_then(Raw::usage)
}

/// The top-level `usage` of a chat completion.
pub fn of_answer(body: &[u8]) -> Option<Usage> {
    #[derive(serde::Deserialize)]
    struct Completion {
        usage: Raw,
    }
    if let Some(usage) = trailing(body) {
        return Some(usage);
    }
    let c: Completion = serde_json::from_slice(body).ok()?;
    c.usage.usage()
}

/// `usage` when it is the last member of the answer's top-level object, where
/// OpenAI-compatible APIs put it: read from the end, without walking the choices. In JSON
/// the bytes `"usage"` followed by `:` can only be a member name (a quote inside a string
/// is escaped), and a member followed by nothing but the one closing brace is a member of
/// the outermost object.
fn trailing(body: &[u8]) -> Option<Usage> {
    const NAME: &[u8] = b"\"usage\"";
    let at = body.windows(NAME.len()).rposition(|w| w[0] == b'"' && bytes::same(w, NAME))?;
    let value = body[at + NAME.len()..].trim_ascii_start().strip_prefix(b":")?;
    let mut values = serde_json::Deserializer::from_slice(value).into_iter::<Raw>();
    let u = values.next()?.ok()?;
    let tail = value.get(values.byte_offset()..)?;
    (tail.trim_ascii() == b"}").then(|| u.usage()).flatten()
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
