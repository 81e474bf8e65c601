//! Whole answers of the chunked APIs as the event streams OpenAI sends for them: a
//! `chat.completion` as `chat.completion.chunk` events, a `text_completion` as
//! `text_completion` chunks, both ending in the usage event when asked for, then `[DONE]`.

use crate::core::api::endpoint::Endpoint;
use crate::core::wire::{json, write};
use serde_json::{Map, Value};

/// Characters of content (or tool-call arguments) per replayed event.
pub(crate) const PIECE_CHARS: usize = 24;

/// The `data:` events of one chunked answer: every event carries the answer's fields but
/// its choices and usage (`id`, `created`, `model`, `system_fingerprint`, ...).
struct Chunks {
    head: Map<String, Value>,
    usage: Value,
    out: Vec<u8>,
}

impl Chunks {
    /// The chunks of a stored answer, named `object`, and its choices.
    fn of(answer: &[u8], object: &str) -> Option<(Chunks, Vec<Value>)> {
        let Value::Object(mut head) = json::parse(answer)? else { return None };
        let Some(Value::Array(choices)) = head.remove("choices") else { return None };
        let usage = head.remove("usage").unwrap_or(Value::Null);
        head.insert("object".into(), Value::from(object));
        Some((Chunks { head, usage, out: Vec::new() }, choices))
    }

    /// One event with these `choices`.
    fn emit(&mut self, choices: Vec<Value>, usage: Option<&Value>) {
        let mut chunk = self.head.clone();
        chunk.insert("choices".into(), Value::Array(choices));
        if let Some(u) = usage {
            chunk.insert("usage".into(), u.clone());
        }
        self.out.extend_from_slice(b"data: ");
        write::value_into(&Value::Object(chunk), &mut self.out, write::number);
        self.out.extend_from_slice(b"\n\n");
    }

    /// The usage event when asked for, then `[DONE]`.
    fn end(mut self, include_usage: bool) -> Vec<u8> {
        if include_usage {
            let usage = std::mem::take(&mut self.usage);
            self.emit(Vec::new(), Some(&usage));
        }
        self.out.extend_from_slice(b"data: [DONE]\n\n");
        self.out
    }
}

/// The event stream of a stored `chat.completion` or `text_completion` (`endpoint`), every
/// field in it sent again: the answer's fields (but choices and usage) in every event; per
/// choice what streams of it (a message's `deltas`; a completion's text in pieces), its log
/// probabilities in one event, a last event with the finish reason and the choice's other
/// fields; then the usage event when asked for, then `[DONE]`. Accumulated as the SDKs
/// do (strings appended, lists extended), the events give the stored choices back.
///
/// The log probabilities go in one event of their own before the finish event. OpenAI
/// sends each piece's tokens with it, but the stored tokens do not line up with our
/// `PIECE_CHARS` pieces, and the SDKs append whatever token list comes (openai-python
/// extends `logprobs.content` and `.refusal`, openai-node pushes them).
pub fn chunked(answer: &[u8], endpoint: Endpoint, include_usage: bool) -> Option<Vec<u8>> {
    let text = endpoint == Endpoint::Completions;
    let (object, streamed, empty) = match text {
        true => ("text_completion", "text", Value::from("")),
        false => ("chat.completion.chunk", "delta", Value::Object(Map::new())),
    };
    let (mut chunks, choices) = Chunks::of(answer, object)?;
    for c in &choices {
        let event = |piece: Value, logprobs: Value| {
            json::object([
                ("index", c["index"].clone()),
                (streamed, piece),
                ("logprobs", logprobs),
                ("finish_reason", Value::Null),
            ])
        };
        let streamed_pieces = match text {
            true => pieces(c["text"].as_str().unwrap_or_default()).into_iter().map(Value::from).collect(),
            false => deltas(&c["message"]),
        };
        for piece in streamed_pieces {
            chunks.emit(vec![event(piece, Value::Null)], None);
        }
        if !c["logprobs"].is_null() {
            chunks.emit(vec![event(empty.clone(), c["logprobs"].clone())], None);
        }
        let mut last = c.as_object().cloned().unwrap_or_default();
        last.remove("message");
        last.insert(streamed.into(), empty.clone());
        last.insert("logprobs".into(), Value::Null);
        chunks.emit(vec![Value::Object(last)], None);
    }
    Some(chunks.end(include_usage))
}

/// The deltas that rebuild one message: a first with the role, content "" (as OpenAI
/// starts) and every field but content, refusal and tool calls whole (reasoning, audio,
/// annotations: openai-node keeps the latest value of a field it does not know, so one
/// piece is what both SDKs rebuild); content and refusal in pieces of `PIECE_CHARS`
/// characters; each tool call as OpenAI streams it (all of it but its arguments, then
/// argument pieces).
fn deltas(message: &Value) -> Vec<Value> {
    let mut first = Map::new();
    first.insert("role".into(), Value::from("assistant"));
    first.insert("content".into(), Value::from(""));
    let mut texts = Vec::new();
    let mut calls: &[Value] = &[];
    for (field, value) in message.as_object().into_iter().flatten() {
        match (field.as_str(), value) {
            ("tool_calls", Value::Array(c)) if !c.is_empty() && c.iter().all(Value::is_object) => calls = c,
            ("content" | "refusal", Value::String(s)) if !s.is_empty() => texts.push((field, s)),
            _ => {
                first.insert(field.clone(), value.clone());
            }
        }
    }
    let mut out = vec![Value::Object(first)];
    for (field, text) in texts {
        out.extend(pieces(text).into_iter().map(|piece| json::object([(field.as_str(), Value::from(piece))])));
    }
    for (i, call) in calls.iter().enumerate() {
        let mut call = call.clone();
        let arguments = match call.pointer_mut("/function/arguments") {
            Some(Value::String(a)) => std::mem::take(a),
            _ => String::new(),
        };
        if let Some(c) = call.as_object_mut() {
            c.insert("index".into(), Value::from(i));
        }
        out.push(json::object([("tool_calls", Value::Array(vec![call]))]));
        for piece in pieces(&arguments) {
            let function = json::object([("arguments", Value::from(piece))]);
            let call = json::object([("index", Value::from(i)), ("function", function)]);
            out.push(json::object([("tool_calls", Value::Array(vec![call]))]));
        }
    }
    out
}

/// `text` in pieces of `PIECE_CHARS` characters (never splitting a character).
pub(super) fn pieces(mut text: &str) -> Vec<String> {
    let mut out = Vec::new();
    while !text.is_empty() {
        let end = text.char_indices().nth(PIECE_CHARS).map_or(text.len(), |(at, _)| at);
        let (piece, rest) = text.split_at(end);
        out.push(piece.to_owned());
        text = rest;
    }
    out
}
