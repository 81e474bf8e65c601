//! Streams as values. `Reassembler` reads HolySheep's server-sent events chunk by chunk
//! (an event may be split anywhere across chunks), hands back the complete events to pass
//! on to the client (without the usage event when the client did not ask for it) and, when
//! the stream ended properly (every choice finished, then `[DONE]`), the `chat.completion`
//! it amounts to. `replay` turns a stored `chat.completion` into the event stream OpenAI
//! sends for it.

use super::cache::Response;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

pub const CONTENT_TYPE: &str = "text/event-stream";

/// Characters of content (or tool-call arguments) per replayed event.
pub const PIECE_CHARS: usize = 24;

#[derive(Debug, Default)]
struct ToolCall {
    id: Option<String>,
    kind: Option<String>,
    name: String,
    arguments: String,
}

#[derive(Debug, Default)]
struct Choice {
    content: Option<String>,
    refusal: Option<String>,
    tool_calls: BTreeMap<u64, ToolCall>,
    finish_reason: Option<Value>,
}

/// One streamed answer being read.
#[derive(Debug, Default)]
pub struct Reassembler {
    forward_usage: bool,
    tail: Vec<u8>,
    head: Map<String, Value>,
    choices: BTreeMap<u64, Choice>,
    usage: Option<Value>,
    done: bool,
    malformed: bool,
    streamed_chars: u64,
}

impl Reassembler {
    /// `forward_usage`: pass the usage event on (the client asked for `include_usage`).
    pub fn new(forward_usage: bool) -> Reassembler {
        Reassembler { forward_usage, ..Reassembler::default() }
    }

    /// Feeds one chunk; returns the bytes to pass on now (the complete events in it).
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        self.tail.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some((end, sep)) = event_end(&self.tail) {
            let event: Vec<u8> = self.tail.drain(..end + sep).collect();
            if self.read_event(&event[..end]) {
                out.extend_from_slice(&event);
            }
        }
        out
    }

    /// The stream ended: whatever incomplete event is left, passed on as it is.
    pub fn flush(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.tail)
    }

    /// The answer as a `chat.completion` (status 200, JSON), when the stream ended properly.
    pub fn completion(&self) -> Option<Response> {
        let finished = !self.choices.is_empty() && self.choices.values().all(|c| c.finish_reason.is_some());
        if !self.done || self.malformed || !finished {
            return None;
        }
        let mut v = self.head.clone();
        v.insert("object".into(), json!("chat.completion"));
        let choices: Vec<Value> = self.choices.iter().map(|(i, c)| choice_json(*i, c)).collect();
        v.insert("choices".into(), Value::Array(choices));
        v.insert("usage".into(), self.usage.clone().unwrap_or(Value::Null));
        Some(Response::json(200, serde_json::to_vec(&Value::Object(v)).unwrap_or_default()))
    }

    /// The `usage` the stream reported, if any.
    pub fn usage(&self) -> Option<(u64, u64)> {
        let u = self.usage.as_ref()?;
        Some((u["prompt_tokens"].as_u64()?, u["completion_tokens"].as_u64()?))
    }

    /// Completion tokens streamed so far, estimated at four characters a token.
    pub fn streamed_tokens_estimate(&self) -> u64 {
        self.streamed_chars.div_ceil(4)
    }

    /// Reads one event (without its separator); `false` when it is not to be passed on.
    fn read_event(&mut self, event: &[u8]) -> bool {
        let text = String::from_utf8_lossy(event);
        let data: Vec<&str> =
            text.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.strip_prefix(' ').unwrap_or(d)).collect();
        if data.is_empty() {
            return true;
        }
        let data = data.join("\n");
        if data.trim() == "[DONE]" {
            self.done = true;
            return true;
        }
        let Ok(Value::Object(chunk)) = serde_json::from_str::<Value>(&data) else {
            self.malformed = true;
            return true;
        };
        self.read_chunk(chunk)
    }

    fn read_chunk(&mut self, mut chunk: Map<String, Value>) -> bool {
        for field in ["id", "created", "model", "system_fingerprint"] {
            if let Some(v) = chunk.get(field).filter(|v| !v.is_null()) {
                self.head.entry(field).or_insert_with(|| v.clone());
            }
        }
        let usage = chunk.remove("usage").filter(|u| !u.is_null());
        let choices = match chunk.remove("choices") {
            Some(Value::Array(c)) => c,
            _ => Vec::new(),
        };
        for c in &choices {
            self.read_choice(c);
        }
        match usage {
            Some(u) => {
                self.usage = Some(u);
                // The usage event (no choices) reaches only clients that asked for it.
                self.forward_usage || !choices.is_empty()
            }
            None => true,
        }
    }

    fn read_choice(&mut self, c: &Value) {
        let choice = self.choices.entry(c["index"].as_u64().unwrap_or(0)).or_default();
        let delta = &c["delta"];
        for (field, into) in [("content", &mut choice.content), ("refusal", &mut choice.refusal)] {
            if let Some(s) = delta[field].as_str() {
                self.streamed_chars += s.chars().count() as u64;
                into.get_or_insert_with(String::new).push_str(s);
            }
        }
        for t in delta["tool_calls"].as_array().into_iter().flatten() {
            let call = choice.tool_calls.entry(t["index"].as_u64().unwrap_or(0)).or_default();
            if let Some(id) = t["id"].as_str() {
                call.id = Some(id.to_owned());
            }
            if let Some(kind) = t["type"].as_str() {
                call.kind = Some(kind.to_owned());
            }
            call.name.push_str(t["function"]["name"].as_str().unwrap_or(""));
            let args = t["function"]["arguments"].as_str().unwrap_or("");
            self.streamed_chars += args.chars().count() as u64;
            call.arguments.push_str(args);
        }
        if let Some(f) = c.get("finish_reason").filter(|f| !f.is_null()) {
            choice.finish_reason = Some(f.clone());
        }
    }
}

/// Where the first complete event in `buf` ends, and its separator's length.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

fn choice_json(index: u64, c: &Choice) -> Value {
    let mut message = json!({"role": "assistant", "content": c.content, "refusal": c.refusal});
    if !c.tool_calls.is_empty() {
        let calls: Vec<Value> = c
            .tool_calls
            .values()
            .map(|t| {
                json!({"id": t.id, "type": t.kind.as_deref().unwrap_or("function"),
                       "function": {"name": t.name, "arguments": t.arguments}})
            })
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    json!({"index": index, "message": message, "logprobs": null, "finish_reason": c.finish_reason})
}

/// The answer in the form the client asked for: a 200 `chat.completion` becomes its event
/// stream for a streaming client; anything else (errors) stays JSON, as OpenAI answers
/// errors before a stream starts.
pub fn for_client(response: Response, stream: bool, include_usage: bool) -> Response {
    if !stream || response.status != 200 {
        return response;
    }
    match replay(&response.body, include_usage) {
        Some(body) => Response { content_type: CONTENT_TYPE.into(), body, ..response },
        None => response,
    }
}

/// The event stream of a stored `chat.completion`: per choice a first event with the role,
/// the content (and refusal) in pieces of `PIECE_CHARS` characters, each tool call as
/// OpenAI streams it (id, type and name, then argument pieces), a last event with the
/// finish reason; then the usage event when asked for, then `[DONE]`.
pub fn replay(completion: &[u8], include_usage: bool) -> Option<Vec<u8>> {
    let v: Value = serde_json::from_slice(completion).ok()?;
    let head: Map<String, Value> = ["id", "created", "model", "system_fingerprint"]
        .iter()
        .filter_map(|f| v.get(*f).map(|x| ((*f).to_owned(), x.clone())))
        .collect();
    let mut out = Vec::new();
    let mut emit = |choices: Value, usage: Option<&Value>| {
        let mut chunk = head.clone();
        chunk.insert("object".into(), json!("chat.completion.chunk"));
        chunk.insert("choices".into(), choices);
        if let Some(u) = usage {
            chunk.insert("usage".into(), u.clone());
        }
        out.extend_from_slice(b"data: ");
        out.extend(serde_json::to_vec(&Value::Object(chunk)).unwrap_or_default());
        out.extend_from_slice(b"\n\n");
    };
    for c in v["choices"].as_array()? {
        for delta in deltas(&c["message"]) {
            emit(json!([{"index": c["index"], "delta": delta, "logprobs": null, "finish_reason": null}]), None);
        }
        emit(json!([{"index": c["index"], "delta": {}, "logprobs": null, "finish_reason": c["finish_reason"]}]), None);
    }
    if include_usage {
        emit(json!([]), Some(&v["usage"]));
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    Some(out)
}

/// The deltas that rebuild one message.
fn deltas(message: &Value) -> Vec<Value> {
    let mut out = vec![json!({"role": "assistant", "content": ""})];
    for field in ["content", "refusal"] {
        for piece in pieces(message[field].as_str().unwrap_or("")) {
            out.push(json!({ field: piece }));
        }
    }
    for (i, t) in message["tool_calls"].as_array().into_iter().flatten().enumerate() {
        out.push(json!({"tool_calls": [{"index": i, "id": t["id"], "type": t["type"],
                                         "function": {"name": t["function"]["name"], "arguments": ""}}]}));
        for piece in pieces(t["function"]["arguments"].as_str().unwrap_or("")) {
            out.push(json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}));
        }
    }
    out
}

/// `text` in pieces of `PIECE_CHARS` characters (never splitting a character).
fn pieces(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(PIECE_CHARS).map(|c| c.iter().collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sse(chunks: &[Value]) -> Vec<u8> {
        let mut out: Vec<u8> = chunks.iter().flat_map(|c| format!("data: {c}\n\n").into_bytes()).collect();
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }

    fn chunk(delta: Value, finish: Value) -> Value {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "gpt-4.1",
               "system_fingerprint": "fp", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    }

    fn upstream_stream() -> Vec<u8> {
        sse(&[
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": "Héllo, "}), Value::Null),
            chunk(json!({"content": "wörld 🐑"}), Value::Null),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                         "function": {"name": "lookup", "arguments": ""}}]}),
                Value::Null,
            ),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"q\":"}}]}), Value::Null),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"sheep\"}"}}]}), Value::Null),
            chunk(json!({}), json!("tool_calls")),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "gpt-4.1",
                   "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}),
        ])
    }

    fn reassemble(bytes: &[u8], split: usize, forward_usage: bool) -> (Vec<u8>, Reassembler) {
        let mut r = Reassembler::new(forward_usage);
        let mut out = Vec::new();
        for piece in bytes.chunks(split) {
            out.extend(r.push(piece));
        }
        out.extend(r.flush());
        (out, r)
    }

    #[test]
    fn events_split_anywhere_reassemble_into_the_same_completion() {
        let bytes = upstream_stream();
        let (_, whole) = reassemble(&bytes, bytes.len(), true);
        let expected = whole.completion().expect("complete").body;
        for split in [1, 2, 3, 7, 64] {
            let (out, r) = reassemble(&bytes, split, true);
            assert_eq!(out, bytes, "split {split}: everything passed on unchanged");
            assert_eq!(r.completion().map(|c| c.body), Some(expected.clone()), "split {split}");
        }
        let v: Value = serde_json::from_slice(&expected).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!((v["id"].as_str(), v["created"].as_u64()), (Some("chatcmpl-1"), Some(7)));
        assert_eq!(v["system_fingerprint"], "fp");
        let m = &v["choices"][0]["message"];
        assert_eq!(m["content"], "Héllo, wörld 🐑");
        assert_eq!(m["tool_calls"][0]["id"], "call_1");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "lookup");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{\"q\":\"sheep\"}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(v["usage"]["total_tokens"], 14);
    }

    #[test]
    fn the_usage_event_reaches_only_clients_that_asked() {
        let bytes = upstream_stream();
        let (out, r) = reassemble(&bytes, 5, false);
        let text = String::from_utf8(out).unwrap();
        assert!(!text.contains("\"choices\":[]"), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert_eq!(r.usage(), Some((5, 9)), "the edge still learns the usage");
    }

    #[test]
    fn a_stream_cut_off_is_no_completion_but_counts_what_was_streamed() {
        let bytes = upstream_stream();
        let cut = &bytes[..bytes.len() / 2];
        let (out, r) = reassemble(cut, 9, true);
        assert_eq!(out, cut, "what arrived is passed on, the partial event last");
        assert!(r.completion().is_none());
        assert!(r.streamed_tokens_estimate() > 0);
        let no_done = &bytes[..bytes.len() - "data: [DONE]\n\n".len()];
        assert!(reassemble(no_done, 100, true).1.completion().is_none(), "no [DONE], not stored");
    }

    #[test]
    fn replay_rebuilds_the_same_completion_in_small_pieces() {
        let bytes = upstream_stream();
        let stored = reassemble(&bytes, 1000, true).1.completion().unwrap().body;
        for include_usage in [true, false] {
            let replayed = replay(&stored, include_usage).unwrap();
            let text = String::from_utf8(replayed.clone()).unwrap();
            let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
            assert!(events.iter().all(|e| e.starts_with("data: ")));
            assert_eq!(events.last(), Some(&"data: [DONE]"));
            let first: Value = serde_json::from_str(&events[0][6..]).unwrap();
            assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
            assert_eq!(first["object"], "chat.completion.chunk");
            assert_eq!((first["id"].as_str(), first["system_fingerprint"].as_str()), (Some("chatcmpl-1"), Some("fp")));
            assert_eq!(text.contains("\"choices\":[]"), include_usage);
            let again = reassemble(&replayed, 3, true).1;
            let v: Value = serde_json::from_slice(&again.completion().unwrap().body).unwrap();
            let original: Value = serde_json::from_slice(&stored).unwrap();
            assert_eq!(v["choices"], original["choices"]);
            assert_eq!(v["usage"].is_null(), !include_usage);
        }
    }

    #[test]
    fn long_content_is_replayed_in_pieces_that_never_split_a_character() {
        let content: String = "ü🐑ab".repeat(40);
        let completion = json!({"id": "x", "created": 1, "model": "m", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}], "usage": null});
        let replayed = replay(completion.to_string().as_bytes(), false).unwrap();
        let text = String::from_utf8(replayed).unwrap();
        let pieces: Vec<String> = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
            .filter(|s| !s.is_empty())
            .collect();
        assert!(pieces.len() >= 5, "{} pieces", pieces.len());
        assert!(pieces.iter().all(|p| (1..=PIECE_CHARS).contains(&p.chars().count())));
        assert_eq!(pieces.concat(), content);
    }

    /// Random answers (text with multi-byte characters, tool calls, several choices),
    /// replayed and cut at random points, always reassemble to themselves.
    #[test]
    fn random_answers_survive_replay_and_random_cuts() {
        let mut seed = 0x5eed_u64;
        let mut next = |below: u64| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % below.max(1)
        };
        let alphabet: Vec<char> = "ab c\n\"é🐑{}:,".chars().collect();
        for round in 0..300 {
            let mut text =
                |n: u64| -> String { (0..n).map(|_| alphabet[next(alphabet.len() as u64) as usize]).collect() };
            let choices: Vec<Value> = (0..1 + round % 3)
                .map(|i| {
                    let tools: Vec<Value> = (0..round % 2)
                        .map(|t| {
                            json!({"id": format!("call_{t}"), "type": "function",
                                        "function": {"name": format!("f{t}"), "arguments": text(40)}})
                        })
                        .collect();
                    let mut message = json!({"role": "assistant", "content": text(100), "refusal": null});
                    if !tools.is_empty() {
                        message["tool_calls"] = Value::Array(tools);
                    }
                    json!({"index": i, "message": message, "logprobs": null, "finish_reason": "stop"})
                })
                .collect();
            let completion = json!({"id": format!("c{round}"), "object": "chat.completion", "created": round,
                "model": "m", "system_fingerprint": "fp", "choices": choices,
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}});
            let events = replay(completion.to_string().as_bytes(), true).unwrap();
            let mut r = Reassembler::new(true);
            let mut at = 0;
            while at < events.len() {
                let n = (1 + next(64) as usize).min(events.len() - at);
                r.push(&events[at..at + n]);
                at += n;
            }
            let back: Value = serde_json::from_slice(&r.completion().expect("complete").body).unwrap();
            assert_eq!(back, completion, "round {round}");
        }
    }

    #[test]
    fn errors_stay_json_for_streaming_clients() {
        let e = Response::json(429, br#"{"error":{}}"#.to_vec());
        assert_eq!(for_client(e.clone(), true, true), e);
        let ok = Response::json(200, br#"{"id":"x","choices":[],"usage":null}"#.to_vec());
        assert_eq!(for_client(ok.clone(), true, false).content_type, CONTENT_TYPE);
        assert_eq!(for_client(ok.clone(), false, false), ok);
    }
}
