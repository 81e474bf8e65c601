//! The endpoints of the OpenAI API the edge governs, as values: where each is sent, what
//! its request must hold, which of its fields bound the tokens it can be billed, what
//! kind of object a 200 answer is, and whether its streams can be shared. The intake, the
//! flight and both shells take an `Endpoint` and nothing else of a request's kind.

use crate::core::wire::scan::Json;
use serde_json::{Map, Value};

/// A governed endpoint, named by its path in any spelling (`of_path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    #[default]
    Chat,
    /// `POST /v1/completions` (the legacy text completions: the same `usage`).
    Completions,
    /// `POST /v1/embeddings`: input tokens only, never streamed.
    Embeddings,
    /// `POST /v1/responses`: `usage.input_tokens` / `output_tokens`, typed stream events.
    Responses,
}

/// A member a request must hold: its name, what it must be (for the error), the check.
pub(crate) type Required = (&'static str, &'static str, fn(&Value) -> bool);

pub const ALL: [Endpoint; 4] = [Endpoint::Chat, Endpoint::Completions, Endpoint::Embeddings, Endpoint::Responses];

impl Endpoint {
    /// The path HolySheep is called on (the canonical spelling).
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Responses => "/v1/responses",
        }
    }

    /// The endpoint a request path names, as a server behind nginx would read it (see
    /// `path::segments`); `None` for every other path.
    pub fn of_path(path: &str) -> Option<Endpoint> {
        if let Some(e) = ALL.into_iter().find(|e| e.path() == path) {
            return Some(e);
        }
        let segments = crate::core::api::path::segments(path);
        ALL.into_iter().find(|e| e.path().split('/').skip(1).eq(segments.iter().map(String::as_str)))
    }

    /// `gen_ai.operation.name` (OpenTelemetry's GenAI conventions) for the access log.
    pub fn operation(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "text_completion",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Responses => "responses",
        }
    }

    /// The `object` of a 200 answer.
    pub fn object(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completions => "text_completion",
            Endpoint::Embeddings => "list",
            Endpoint::Responses => "response",
        }
    }

    /// The array a 200 answer must hold beside its `object`.
    fn items(self) -> &'static str {
        match self {
            Endpoint::Chat | Endpoint::Completions => "choices",
            Endpoint::Embeddings => "data",
            Endpoint::Responses => "output",
        }
    }

    /// The member that must be present, and what it must be.
    pub fn required(self) -> Option<Required> {
        match self {
            Endpoint::Chat => None, // `messages`, checked item by item by the intake
            Endpoint::Completions => Some(("prompt", "a string or an array", is_text_or_tokens)),
            Endpoint::Embeddings => Some(("input", "a non-empty string or a non-empty array", is_text_or_tokens)),
            Endpoint::Responses => None, // `input`, `prompt` or `previous_response_id`
        }
    }

    /// The members that bound the completion tokens of each choice; a request naming any
    /// of them (of any value) is sent as it came.
    pub(crate) fn limit_fields(self) -> &'static [&'static str] {
        match self {
            Endpoint::Chat => &["max_completion_tokens", "max_tokens"],
            Endpoint::Completions => &["max_tokens"],
            Endpoint::Embeddings => &[],
            Endpoint::Responses => &["max_output_tokens"],
        }
    }

    /// The member a budgeted call without a limit is sent with (`None`: it completes
    /// nothing, so its worst case is its input).
    pub(crate) fn cap_field(self) -> Option<&'static str> {
        self.limit_fields().last().copied()
    }

    /// Whether it produces tokens beyond its input.
    pub fn completes(self) -> bool {
        self != Endpoint::Embeddings
    }

    /// Whether its streams are reassembled into an answer the edge can store and replay
    /// (chat's and completions' chunks, the Responses API's typed events), so that they
    /// share the cache and the flight with the plain form. Embeddings never stream.
    pub(crate) fn streams_shared(self) -> bool {
        self.completes()
    }

    /// Whether a stream call is sent with `stream_options.include_usage` (the Responses
    /// API always ends with the usage in `response.completed`).
    pub fn asks_stream_usage(self) -> bool {
        matches!(self, Endpoint::Chat | Endpoint::Completions)
    }

    /// Whether a request may be shared with other callers (cached, coalesced): a Responses
    /// call that asks HolySheep to keep state (`store` true or absent,
    /// `previous_response_id`, `conversation`, `background`) makes an object only its
    /// caller may use, and one on a stored `prompt` without a pinned `version` may change
    /// with the template.
    pub(crate) fn shareable(self, map: &Map<String, Value>) -> bool {
        if self != Endpoint::Responses {
            return true;
        }
        let set = |f: &str| map.get(f).is_some_and(|v| !v.is_null());
        let stored = map.get("store").and_then(Value::as_bool).unwrap_or(true);
        let background = map.get("background").and_then(Value::as_bool).unwrap_or(false);
        let floating_prompt =
            map.get("prompt").is_some_and(|p| !p.is_null() && p.get("version").is_none_or(Value::is_null));
        !stored && !background && !set("previous_response_id") && !set("conversation") && !floating_prompt
    }

    /// Whether a 200 body is what this endpoint answers, from the top-level members of a
    /// JSON body whose whole text was checked (`upstream::response`): an object of the
    /// endpoint's `object` with its array (`choices`, `data`, `output`).
    pub(crate) fn is_answer_of(self, [object, choices, data, output]: [Option<Json<'_>>; 4]) -> bool {
        // Each array may be absent or null, but not of another type.
        let array = |v: Option<Json<'_>>| match v {
            Some(v) if !v.is_null() => v.is_array().then_some(true),
            _ => Some(false),
        };
        let (Some(choices), Some(data), Some(output)) = (array(choices), array(data), array(output)) else {
            return false;
        };
        let items = match self.items() {
            "choices" => choices,
            "data" => data,
            _ => output,
        };
        object.and_then(Json::as_str).is_some_and(|o| o == self.object()) && items
    }
}

/// A string, or a non-empty array (of strings, token numbers, or arrays of them).
fn is_text_or_tokens(v: &Value) -> bool {
    match v {
        Value::String(s) => !s.is_empty(),
        Value::Array(items) => !items.is_empty() && items.iter().all(|i| i.is_string() || i.is_u64() || i.is_array()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_spelling_of_a_governed_path_names_its_endpoint() {
        assert_eq!(Endpoint::of_path("/v1/chat/completions"), Some(Endpoint::Chat));
        assert_eq!(Endpoint::of_path("//v1/./embeddings?x=1"), Some(Endpoint::Embeddings));
        assert_eq!(Endpoint::of_path("/v1/%72esponses/"), Some(Endpoint::Responses));
        assert_eq!(Endpoint::of_path("/v1/x/../completions"), Some(Endpoint::Completions));
        for other in ["/v1/files", "/v1/responses/resp_1", "/v1/embedding", "/v2/embeddings", "/"] {
            assert_eq!(Endpoint::of_path(other), None, "{other}");
        }
    }

    #[test]
    fn a_responses_call_that_keeps_state_is_its_callers_own() {
        let map = |v: Value| v.as_object().cloned().unwrap_or_default();
        assert!(!Endpoint::Responses.shareable(&map(json!({"input": "hi"}))), "store defaults to true");
        assert!(Endpoint::Responses.shareable(&map(json!({"input": "hi", "store": false}))));
        assert!(!Endpoint::Responses.shareable(&map(json!({"store": false, "previous_response_id": "resp_1"}))));
        assert!(!Endpoint::Responses.shareable(&map(json!({"store": false, "background": true}))));
        assert!(!Endpoint::Responses.shareable(&map(json!({"store": false, "conversation": "conv_1"}))));
        assert!(!Endpoint::Responses.shareable(&map(json!({"store": false, "prompt": {"id": "pmpt_1"}}))));
        assert!(
            Endpoint::Responses.shareable(&map(json!({"store": false, "prompt": {"id": "pmpt_1", "version": "2"}})))
        );
        assert!(Endpoint::Embeddings.shareable(&map(json!({"input": "hi"}))));
    }
}
