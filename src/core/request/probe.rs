//! Which requests take part in the semantic tier, and the partition each belongs to.

use crate::core::config::Config;
use crate::core::request::canonical::canonical_body;
use crate::core::wire::digest::sha256;
use serde_json::{Map, Value};

/// The longest question embedded, in bytes (an embedding model reads about 8 000 tokens).
pub(crate) const MAX_TEXT_BYTES: usize = 16 * 1024;

/// A request that takes part: the SHA-256 of everything that changes its answer except the
/// last user message's text, and that text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub partition: [u8; 32],
    pub text: String,
}

/// The request's probe, when it takes part: its model is covered, it is deterministic
/// (temperature 0 or a seed, one choice), asks for no log probabilities, offers no tools
/// unless `allow_tools`, and ends with a user message of text. `scope` and `path` are its
/// tenant scope and path, as in its key.
pub(crate) fn probe(
    config: &Config,
    map: &Map<String, Value>,
    (scope, path): (&str, &str),
    deterministic: bool,
) -> Option<Probe> {
    let s = &config.semantic;
    let model = map.get("model").and_then(Value::as_str)?;
    // Log probabilities are the stored question's, not this one's.
    let logprobs = map.get("logprobs").is_some_and(|l| l.as_bool() == Some(true));
    if !deterministic || logprobs || !s.covers(model) || (!s.allow_tools && offers_tools(map)) {
        return None;
    }
    let messages = map.get("messages").and_then(Value::as_array)?;
    let last = messages.last()?;
    if last.get("role").and_then(Value::as_str) != Some("user") {
        return None;
    }
    let text = text_of(last.get("content")?)?;
    if text.trim().is_empty() || text.len() > MAX_TEXT_BYTES {
        return None;
    }
    let mut rest = map.clone();
    if let Some(Value::Object(m)) = rest.get_mut("messages").and_then(Value::as_array_mut).and_then(|m| m.last_mut()) {
        m.insert("content".into(), Value::Null);
    }
    Some(Probe { partition: partition(config, (scope, path), &canonical_body(rest)), text })
}

/// `tools` or `functions` offered, or a tool call asked for.
fn offers_tools(map: &Map<String, Value>) -> bool {
    let offered = |f: &str| map.get(f).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty()));
    let choice = map.get("tool_choice").is_some_and(|c| !c.is_null() && c.as_str() != Some("none"));
    offered("tools") || offered("functions") || choice
}

/// A message's text: a string, or parts that are all text (joined by newlines).
fn text_of(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let texts: Option<Vec<&str>> = parts
                .iter()
                .map(|p| {
                    p.get("text")
                        .and_then(Value::as_str)
                        .filter(|_| p.get("type").and_then(Value::as_str) == Some("text"))
                })
                .collect();
            texts.map(|t| t.join("\n"))
        }
        _ => None,
    }
}

/// The partition: the path, the tenant scope, the embedding model and its length (vectors
/// of two models are not comparable) and the canonical body without the question.
fn partition(config: &Config, (scope, path): (&str, &str), canonical: &[u8]) -> [u8; 32] {
    let s = &config.semantic;
    let dims = s.dimensions.map(|d| d.to_string()).unwrap_or_default();
    let parts = [b"semantic".as_slice(), path.as_bytes(), scope.as_bytes(), s.embedding_model.as_bytes()];
    let mut message = Vec::with_capacity(128 + canonical.len());
    for part in parts.into_iter().chain([dims.as_bytes(), canonical]) {
        message.extend_from_slice(&(part.len() as u64).to_be_bytes());
        message.extend_from_slice(part);
    }
    sha256(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config() -> Config {
        Config::parse(br#"{"semantic":{"enabled":true,"models":["gpt-4.1"]}}"#).unwrap()
    }

    fn probe_of(body: Value, scope: &str) -> Option<Probe> {
        let map = body.as_object().unwrap().clone();
        let deterministic = map.get("temperature").and_then(Value::as_f64) == Some(0.0) || map.contains_key("seed");
        probe(&config(), &map, (scope, "/v1/chat/completions"), deterministic)
    }

    fn chat(system: &str, question: &str) -> Value {
        json!({"model": "gpt-4.1", "temperature": 0, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]})
    }

    #[test]
    fn a_paraphrase_shares_the_partition_and_only_its_text_differs() {
        let a = probe_of(chat("Be brief.", "What is the capital of France?"), "t").unwrap();
        let b = probe_of(chat("Be brief.", "what's the capital of france"), "t").unwrap();
        assert_eq!(a.partition, b.partition);
        assert_eq!(
            (a.text.as_str(), b.text.as_str()),
            ("What is the capital of France?", "what's the capital of france")
        );
        let mut streamed = chat("Be brief.", "capital?");
        streamed["stream"] = json!(true);
        assert_eq!(
            probe_of(streamed, "t").unwrap().partition,
            a.partition,
            "a stream is answered from the same entries"
        );
    }

    #[test]
    fn everything_but_the_question_separates_partitions() {
        let base = probe_of(chat("Be brief.", "q"), "t").unwrap().partition;
        let mut other_model = chat("Be brief.", "q");
        other_model["model"] = json!("gpt-4.1-mini");
        let mut earlier = chat("Be brief.", "q");
        earlier["messages"] = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "q"}]);
        let mut param = chat("Be brief.", "q");
        param["max_tokens"] = json!(10);
        let mut seeded_warm = chat("Be brief.", "q");
        seeded_warm["temperature"] = json!(0.9);
        seeded_warm["seed"] = json!(7);
        let others = [
            probe_of(chat("Be long.", "q"), "t").map(|p| p.partition),
            probe_of(chat("Be brief.", "q"), "u").map(|p| p.partition),
            probe_of(earlier, "t").map(|p| p.partition),
            probe_of(param, "t").map(|p| p.partition),
            probe_of(seeded_warm, "t").map(|p| p.partition),
        ];
        for (i, p) in others.iter().enumerate() {
            assert!(p.is_some_and(|p| p != base), "case {i} is its own partition");
        }
        assert!(probe_of(other_model, "t").is_none(), "a model the tier does not cover");
    }

    #[test]
    fn only_deterministic_text_questions_without_tools_take_part() {
        let mut warm = chat("s", "q");
        warm["temperature"] = json!(0.9);
        let mut tools = chat("s", "q");
        tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
        let mut image = chat("s", "q");
        image["messages"][1]["content"] = json!([{"type": "image_url", "image_url": {"url": "x"}}]);
        let mut assistant_last = chat("s", "q");
        assistant_last["messages"][1]["role"] = json!("assistant");
        let mut logprobs = chat("s", "q");
        logprobs["logprobs"] = json!(true);
        let cases = [
            ("warm", warm),
            ("tools", tools),
            ("image", image),
            ("assistant last", assistant_last),
            ("logprobs", logprobs),
        ];
        for (what, body) in cases {
            assert!(probe_of(body, "t").is_none(), "{what}");
        }
        let mut parts = chat("s", "q");
        parts["messages"][1]["content"] = json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]);
        assert_eq!(probe_of(parts, "t").unwrap().text, "a\nb");
        let mut allowed = config();
        allowed.semantic.allow_tools = true;
        let mut tools = chat("s", "q");
        tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
        assert!(probe(&allowed, tools.as_object().unwrap(), ("t", "/v1/chat/completions"), true).is_some());
    }
}
