//! Streams as values. `Reassembler` reads HolySheep's server-sent events chunk by chunk
//! (an event may be split anywhere across chunks), hands back the complete events to pass
//! on to the client (without the usage event when the client did not ask for it) and, when
//! the stream ended properly, the answer it amounts to, with every field the stream carried:
//! a `chat.completion` or a `text_completion` merged from its chunks (`merge`), a `response`
//! as the Responses API's terminal event carries it. `replay` turns a stored answer into the
//! event stream OpenAI sends for it.

mod replay;
mod responses;

#[cfg(test)]
use replay::PIECE_CHARS;

use crate::core::api::endpoint::Endpoint;
use crate::core::api::headers;
use crate::core::api::objects::Signer;
use crate::core::api::response::Response;
use crate::core::api::usage::Usage;
use crate::core::wire::write;
use crate::core::wire::{json, sort};
use serde_json::{Map, Value};
use std::mem::discriminant;

/// Bytes of events past which the answer is no longer assembled (it could not be stored).
const MAX_ANSWER_BYTES: usize = 16 << 20;
/// An unfinished event longer than this is passed on as it is, and the answer not kept.
const MAX_PENDING_BYTES: usize = MAX_ANSWER_BYTES;
/// Items with an `index` one list may hold (tool calls): each later piece looks its item up.
const MAX_INDEXED_ITEMS: usize = 1024;

/// The most choices an assembled answer holds (OpenAI's `n` is at most 128).
const MAX_CHOICES: usize = 128;

/// Fields that name something rather than carry streamed text: a later value replaces the
/// earlier one instead of extending it. `index` and `type` as in OpenAI's SDKs; `id` and
/// `role` as in openai-node (a provider repeating the role in every chunk would otherwise
/// build "assistantassistant").
const NAMES: [&str; 4] = ["index", "type", "id", "role"];

/// Two pieces of one field that do not merge (a string, then an object): the answer cannot
/// be rebuilt without loss, so it is not stored.
#[derive(Debug)]
struct Conflict;

/// One streamed answer being read.
#[derive(Debug, Default)]
pub struct Reassembler {
    forward_usage: bool,
    /// Whose stream it is: chat's and completions' are chunks with choices; the Responses
    /// API's are typed events, whose usage and end are those of the event that ends the
    /// stream (`response.completed`, `.incomplete`, `.failed`).
    endpoint: Endpoint,
    /// An answer is assembled (not for a follower of a live tail, whose leader does).
    assemble: bool,
    tail: Vec<u8>,
    /// How far into `tail` no event separator starts (so a long event is scanned once).
    searched: usize,
    /// The chunks' fields but `choices`, `object` and `usage`: id, model, service_tier, ...
    head: Map<String, Value>,
    /// Ordered by index: the choice so far, its deltas merged into its `message`.
    choices: Vec<(u64, Map<String, Value>)>,
    usage: Option<Value>,
    /// The `response` of the Responses stream's `response.completed` or `.incomplete`.
    response: Option<Value>,
    done: bool,
    /// An event was not JSON, or a field did not merge, or the answer grew past the bounds.
    malformed: bool,
    /// Bytes of the events read so far.
    read_bytes: usize,
    streamed_chars: u64,
    /// Signs the response id of a verified tenant's Responses stream (`api::objects`) ...
    signer: Option<Signer>,
    /// ... once an event named it (and the response it continues).
    response_id: Option<String>,
    previous_id: Option<String>,
}

impl Reassembler {
    /// `forward_usage`: pass the usage event on (the client asked for `include_usage`).
    pub fn new(forward_usage: bool) -> Reassembler {
        Reassembler::of(Endpoint::Chat, forward_usage)
    }

    /// A stream of `endpoint`, assembled into its answer.
    pub fn of(endpoint: Endpoint, forward_usage: bool) -> Reassembler {
        Reassembler { forward_usage, endpoint, assemble: endpoint.streams_shared(), ..Reassembler::default() }
    }

    /// Reading only to pass the events on and learn the usage: no answer is assembled (a
    /// follower of a live tail, whose leader assembles it).
    pub fn passing(self) -> Reassembler {
        Reassembler { assemble: false, ..self }
    }

    /// With the response id of every event signed by `signer` (a verified tenant's
    /// Responses stream; the events' lengths change).
    pub fn signing(self, signer: Option<Signer>) -> Reassembler {
        Reassembler { signer, ..self }
    }

    /// Feeds one chunk; returns the bytes to pass on now (the complete events in it).
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut tail = std::mem::take(&mut self.tail);
        tail.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some((end, sep)) = event_end(&tail, self.searched.max(start)) {
            if self.read_event(&tail[start..end]) {
                out.extend_from_slice(&self.signed(&tail[start..end + sep]));
            }
            start = end + sep;
        }
        tail.drain(..start);
        if tail.len() > MAX_PENDING_BYTES {
            // No event is that long: pass it on, and keep nothing of this answer.
            self.malformed = true;
            out.extend_from_slice(&self.signed(&tail));
            tail.clear();
        }
        // A separator may yet start in the last three bytes, completed by the next chunk.
        self.searched = tail.len().saturating_sub(3);
        self.tail = tail;
        out
    }

    /// Whether the stream's `[DONE]` has been read.
    pub fn done(&self) -> bool {
        self.done
    }

    /// The stream ended: whatever incomplete event is left, passed on as it is.
    pub fn flush(&mut self) -> Vec<u8> {
        self.searched = 0;
        let tail = std::mem::take(&mut self.tail);
        self.signed(&tail)
    }

    /// Event bytes as the client gets them: with the response's ids signed, once an event
    /// named them, for a tenant's Responses stream.
    fn signed(&self, events: &[u8]) -> Vec<u8> {
        let (Some(s), Some(id)) = (&self.signer, &self.response_id) else { return events.to_vec() };
        let signed = s.sign_in(events, id);
        match &self.previous_id {
            Some(previous) => s.sign_in(&signed, previous),
            None => signed,
        }
    }

    /// The answer (status 200, JSON) when the stream ended properly: a `chat.completion` or
    /// a `text_completion` whose every choice finished before `[DONE]`, or the `response`
    /// of a Responses stream that ended `completed` or `incomplete` (its ids signed for a
    /// tenant, as a plain answer's are).
    pub fn completion(&self) -> Option<Response> {
        if !self.assemble || !self.done || self.malformed {
            return None;
        }
        let body = match self.endpoint {
            Endpoint::Responses => {
                let r = self.response.as_ref()?;
                if r.get("object").and_then(Value::as_str) != Some("response") || !r["output"].is_array() {
                    return None;
                }
                let body = write::value(r);
                match &self.signer {
                    Some(s) => s.sign_answer(&body)?,
                    None => body,
                }
            }
            _ => self.merged()?,
        };
        Some(Response::json(200, body))
    }

    /// The chunks' answer, when every choice finished.
    fn merged(&self) -> Option<Vec<u8>> {
        let finished = |c: &Map<String, Value>| c.get("finish_reason").is_some_and(|f| !f.is_null());
        if self.choices.is_empty() || !self.choices.iter().all(|(_, c)| finished(c)) {
            return None;
        }
        let mut v = self.head.clone();
        v.insert("object".into(), Value::from(self.endpoint.object()));
        let choices = self.choices.iter().map(|(_, c)| {
            let mut c = c.clone();
            if let Some(message) = c.get_mut("message") {
                finish_message(message);
            }
            Value::Object(c)
        });
        v.insert("choices".into(), Value::Array(choices.collect()));
        v.insert("usage".into(), self.usage.clone().unwrap_or(Value::Null));
        Some(write::value(&Value::Object(v)))
    }

    /// The `usage` the stream reported, if any.
    pub fn usage(&self) -> Option<Usage> {
        crate::core::api::usage::of_value(self.usage.as_ref()?)
    }

    /// Completion tokens streamed so far, estimated at four characters a token.
    pub fn streamed_tokens_estimate(&self) -> u64 {
        self.streamed_chars.div_ceil(4)
    }

    /// Reads one event (without its separator); `false` when it is not to be passed on.
    fn read_event(&mut self, event: &[u8]) -> bool {
        self.read_bytes = self.read_bytes.saturating_add(event.len());
        self.malformed |= self.read_bytes > MAX_ANSWER_BYTES;
        let Ok(text) = std::str::from_utf8(event) else {
            self.malformed = true;
            return true;
        };
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
        let Ok(Value::Object(chunk)) = json::parse(data.as_bytes()).ok_or(()) else {
            self.malformed = true;
            return true;
        };
        self.read_chunk(chunk)
    }

    fn read_chunk(&mut self, mut chunk: Map<String, Value>) -> bool {
        if self.endpoint == Endpoint::Responses {
            self.read_typed(chunk);
            return true;
        }
        let usage = chunk.remove("usage").filter(|u| !u.is_null());
        let choices = match chunk.remove("choices") {
            Some(Value::Array(c)) => c,
            None | Some(Value::Null) => Vec::new(),
            Some(_) => {
                self.malformed = true;
                Vec::new()
            }
        };
        // The usage event (no choices) reaches only clients that asked for it.
        let forward = usage.is_none() || self.forward_usage || !choices.is_empty();
        self.streamed_chars +=
            choices.iter().map(|c| streamed_chars(&c["delta"]) + text_chars(&c["text"])).sum::<u64>();
        chunk.remove("object");
        // An answer that cannot be kept is not assembled any further.
        if self.assemble && !self.malformed && self.read_fields(chunk, choices).is_err() {
            self.malformed = true;
        }
        if usage.is_some() {
            self.usage = usage;
        }
        forward
    }

    /// One typed event of the Responses API: text deltas counted, and the usage and the
    /// end read from the event that ends the stream, whose response is the answer.
    fn read_typed(&mut self, mut event: Map<String, Value>) {
        if self.response_id.is_none() {
            let named = |f: &str| event.get("response")?.get(f)?.as_str().map(str::to_owned);
            self.response_id = named("id");
            self.previous_id = named("previous_response_id");
        }
        // The status each event that ends the stream says it ended with.
        let ended = match event.get("type").and_then(Value::as_str).unwrap_or_default() {
            "response.completed" => Some("completed"),
            "response.incomplete" => Some("incomplete"),
            "response.failed" => Some("failed"),
            // A stream that carries an error event is no answer to keep.
            "error" => {
                self.malformed = true;
                None
            }
            kind if kind.ends_with(".delta") => {
                self.streamed_chars += event.get("delta").map_or(0, text_chars);
                None
            }
            _ => None,
        };
        let Some(status) = ended else { return };
        if self.done {
            // The first event that ends the stream is its end: anything after it is no
            // known form, and the answer is not kept.
            self.malformed = true;
            return;
        }
        let usage = event.get("response").and_then(|r| r.get("usage")).filter(|u| !u.is_null());
        self.usage = usage.cloned();
        self.done = true;
        let response = event.remove("response").unwrap_or(Value::Null);
        // Kept only as the event says it ended, without an error, under the id its first
        // event named (the id every event was signed under).
        let whole = response.get("status").and_then(Value::as_str) == Some(status)
            && response.get("error").is_none_or(Value::is_null)
            && response.get("id").and_then(Value::as_str) == self.response_id.as_deref();
        if self.assemble && status != "failed" && whole {
            self.response = Some(response);
        }
    }

    /// A chunk's fields (the latest value of each is the answer's) and its choices.
    fn read_fields(&mut self, chunk: Map<String, Value>, choices: Vec<Value>) -> Result<(), Conflict> {
        for (field, value) in chunk {
            latest(self.head.entry(field).or_insert(Value::Null), value)?;
        }
        choices.into_iter().try_for_each(|c| self.read_choice(c))
    }

    /// One choice of a chunk: its `delta` merged into the message, its `logprobs` into the
    /// choice's (token lists appended), the latest value of each other field kept.
    fn read_choice(&mut self, choice: Value) -> Result<(), Conflict> {
        let Value::Object(mut fields) = choice else { return Err(Conflict) };
        if fields.contains_key("message") {
            return Err(Conflict); // a chunk's choice has a delta: a message beside it is no known form
        }
        let index = fields.get("index").and_then(Value::as_u64).unwrap_or(0);
        // Chat streams a message in deltas, completions stream the choice's text itself.
        let (streamed, merged_into, fresh) = match self.endpoint {
            Endpoint::Completions => ("text", "text", Value::from("")),
            _ => ("delta", "message", Value::Object(Map::new())),
        };
        let at = match self.choices.binary_search_by_key(&index, |(i, _)| *i) {
            Ok(at) => at,
            // More choices than a request can ask for (`n` is at most 128): no known answer.
            Err(_) if self.choices.len() >= MAX_CHOICES => return Err(Conflict),
            Err(at) => {
                let fresh = [("index", Value::from(index)), (merged_into, fresh), ("logprobs", Value::Null)];
                self.choices.insert(at, (index, fresh.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()));
                at
            }
        };
        let Some((_, into)) = self.choices.get_mut(at) else { return Err(Conflict) };
        if let Some(piece) = fields.remove(streamed) {
            merge(into.entry(merged_into).or_insert(Value::Null), piece)?;
        }
        if let Some(logprobs) = fields.remove("logprobs") {
            merge(into.entry("logprobs").or_insert(Value::Null), logprobs)?;
        }
        for (field, value) in fields {
            latest(into.entry(field).or_insert(Value::Null), value)?;
        }
        Ok(())
    }
}

/// Merges a later piece of a field into the value so far, as OpenAI's SDKs accumulate a
/// stream (openai-python `accumulate_delta`, openai-node `ChatCompletionStream`): strings
/// are appended, objects merged field by field, lists merged by `extend`; null changes
/// nothing, and a number or bool replaces the one before (the python SDK adds numbers:
/// no field streams a number in parts). Values of different kinds are a conflict.
fn merge(into: &mut Value, from: Value) -> Result<(), Conflict> {
    match (into, from) {
        (Value::String(a), Value::String(b)) => a.push_str(&b),
        (Value::Object(a), Value::Object(b)) => {
            for (field, value) in b {
                let named = NAMES.contains(&field.as_str());
                let slot = a.entry(field).or_insert(Value::Null);
                if named {
                    latest(slot, value)?;
                } else {
                    merge(slot, value)?;
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => extend(a, b)?,
        (into, from) => latest(into, from)?,
    }
    Ok(())
}

/// `from` replaces `into`, unless it is null; a value of another kind is a conflict.
fn latest(into: &mut Value, from: Value) -> Result<(), Conflict> {
    if !from.is_null() {
        if !into.is_null() && discriminant(into) != discriminant(&from) {
            return Err(Conflict);
        }
        *into = from;
    }
    Ok(())
}

/// A list's later items: an object with an `index` merges into the item with that index
/// (tool calls), any other item is appended (log-probability tokens). A list that would
/// mix both is a conflict; so only the first item need be looked at, and appending to a
/// long list costs nothing more than to a short one.
fn extend(into: &mut Vec<Value>, from: Vec<Value>) -> Result<(), Conflict> {
    for item in from {
        let index = indexed(&item);
        if into.first().is_some_and(|first| indexed(first).is_some() != index.is_some()) {
            return Err(Conflict);
        }
        let full = index.is_some() && into.len() >= MAX_INDEXED_ITEMS;
        match index.and_then(|i| into.iter_mut().rev().find(|x| indexed(x) == Some(i))) {
            Some(same) => merge(same, item)?,
            None if full => return Err(Conflict),
            None => into.push(item),
        }
    }
    Ok(())
}

/// The `index` of a list item that is an object with one.
fn indexed(item: &Value) -> Option<u64> {
    item.as_object()?.get("index")?.as_u64()
}

/// Characters of content, refusal and tool-call arguments in a delta.
fn text_chars(text: &Value) -> u64 {
    text.as_str().map_or(0, |s| s.chars().count() as u64)
}

fn streamed_chars(delta: &Value) -> u64 {
    let calls = delta["tool_calls"].as_array().into_iter().flatten();
    let texts = [&delta["content"], &delta["refusal"]].into_iter().chain(calls.map(|t| &t["function"]["arguments"]));
    texts.filter_map(Value::as_str).map(|s| s.chars().count() as u64).sum()
}

/// The merged message as a non-streaming answer has it: role, content and refusal always
/// there; tool calls in index order, without the `index` they were merged by, with their
/// id, type, name and arguments.
fn finish_message(message: &mut Value) {
    let Some(m) = message.as_object_mut() else { return };
    m.entry("role").or_insert_with(|| Value::from("assistant"));
    m.entry("content").or_insert(Value::Null);
    m.entry("refusal").or_insert(Value::Null);
    let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) else { return };
    sort::sort_by(calls, |a, b| indexed(a) < indexed(b));
    for call in calls.iter_mut().filter_map(Value::as_object_mut) {
        call.remove("index");
        call.entry("id").or_insert(Value::Null);
        call.entry("type").or_insert_with(|| Value::from("function"));
        if let Some(f) = call.entry("function").or_insert_with(|| Value::Object(Map::new())).as_object_mut() {
            f.entry("name").or_insert_with(|| Value::from(""));
            f.entry("arguments").or_insert_with(|| Value::from(""));
        }
    }
}

/// Where the first complete event in `buf` at or after `from` ends, and its separator's
/// length.
fn event_end(buf: &[u8], from: usize) -> Option<(usize, usize)> {
    (from..buf.len()).find_map(|i| match &buf[i..] {
        [b'\n', b'\n', ..] => Some((i, 2)),
        [b'\r', b'\n', b'\r', b'\n', ..] => Some((i, 4)),
        _ => None,
    })
}

/// The answer in the form the client asked for: a 200 answer of `endpoint` becomes its
/// event stream for a streaming client; anything else (errors) stays JSON, as OpenAI
/// answers errors before a stream starts.
pub fn for_client(response: Response, endpoint: Endpoint, stream: bool, include_usage: bool) -> Response {
    if !stream || response.status != 200 {
        return response;
    }
    let body = match endpoint {
        Endpoint::Chat | Endpoint::Completions => replay::chunked(&response.body, endpoint, include_usage),
        Endpoint::Responses => responses::replay(&response.body),
        Endpoint::Embeddings => None,
    };
    match body {
        Some(body) => Response { content_type: headers::EVENT_STREAM.into(), body, ..response },
        None => response,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The event stream of a stored `chat.completion`.
    fn replay(completion: &[u8], include_usage: bool) -> Option<Vec<u8>> {
        replay::chunked(completion, Endpoint::Chat, include_usage)
    }
    use serde_json::json;

    #[test]
    fn a_tenants_responses_stream_carries_its_response_id_signed_in_every_event() {
        use crate::core::api::objects::{ObjectKey, Signer};
        let signer = Signer { key: ObjectKey::of_operator_key("k"), tenant: "alpha".into() };
        let signed = signer.key.sign("alpha", "resp_5");
        let mut r = Reassembler::of(Endpoint::Responses, false).signing(Some(signer));
        let stream = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_5\",\"status\":\"in_progress\"}}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_1\",\"delta\":\"hi\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_5\",\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n",
        );
        // Split inside the id: events are signed whole.
        let (a, b) = stream.split_at(60);
        let mut out = r.push(a.as_bytes());
        out.extend(r.push(b.as_bytes()));
        let out = String::from_utf8(out).unwrap();
        assert_eq!(out.matches(&format!("\"{signed}\"")).count(), 2, "{out}");
        assert!(!out.contains("\"resp_5\""), "{out}");
        assert!(out.contains("\"msg_1\""));
        assert_eq!(r.usage(), Some(Usage::new(3, 1)));
        // An event the stream ends on without its separator is signed too.
        r.push(b"data: {\"type\":\"response.failed\",\"response\":{\"id\":\"resp_5\"}}");
        assert!(String::from_utf8(r.flush()).unwrap().contains(&signed));
    }

    #[test]
    fn streams_past_the_bounds_pass_on_unchanged_and_are_not_kept() {
        let done = b"data: [DONE]\n\n".to_vec();
        let event = |v: Value| format!("data: {v}\n\n").into_bytes();
        let finish =
            event(json!({"id": "x", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}));
        // Not UTF-8: passed on, no answer.
        let mut r = Reassembler::new(false);
        let bad = b"data: {\"id\":\"\xff\"}\n\n".to_vec();
        assert_eq!(
            r.push(&[bad.clone(), finish.clone(), done.clone()].concat()),
            [bad, finish.clone(), done.clone()].concat()
        );
        assert!(r.completion().is_none());
        // An event that never ends: its bytes go on, not into memory.
        let mut r = Reassembler::new(false);
        let endless = vec![b'x'; MAX_PENDING_BYTES + 1];
        assert_eq!(r.push(&endless), endless);
        r.push(&[finish.clone(), done.clone()].concat());
        assert!(r.completion().is_none());
        // More tool calls than a list may index.
        let mut r = Reassembler::new(false);
        for i in 0..=MAX_INDEXED_ITEMS {
            r.push(&event(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "id": "c"}]}}]})));
        }
        r.push(&[finish.clone(), done.clone()].concat());
        assert!(r.completion().is_none());
        // More choices than a request can ask for, from the last index down (each would be
        // put first): passed on, no answer, and no list of them grown past the bound.
        let finished = |i: usize| json!({"index": i, "delta": {"content": "x"}, "finish_reason": "stop"});
        let mut r = Reassembler::new(false);
        let many = event(json!({"choices": (0..=MAX_CHOICES).rev().map(finished).collect::<Vec<_>>()}));
        assert_eq!(r.push(&many), many);
        r.push(&[finish, done].concat());
        assert!(r.completion().is_none());
        assert!(r.choices.len() <= MAX_CHOICES);
        // As many as a request can ask for make an answer.
        let mut r = Reassembler::new(false);
        r.push(&event(json!({"choices": (0..MAX_CHOICES).rev().map(finished).collect::<Vec<_>>()})));
        r.push(b"data: [DONE]\n\n");
        let v: Value = serde_json::from_slice(&r.completion().expect("128 choices").body).unwrap();
        assert_eq!(v["choices"].as_array().map(Vec::len), Some(MAX_CHOICES));
        assert_eq!(v["choices"][0]["index"], 0, "ordered by index");
    }

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
        assert_eq!(r.usage(), Some(Usage::new(5, 9)), "the edge still learns the usage");
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
        assert_eq!(for_client(e.clone(), Endpoint::Chat, true, true), e);
        let ok = Response::json(200, br#"{"id":"x","choices":[],"usage":null}"#.to_vec());
        assert_eq!(for_client(ok.clone(), Endpoint::Chat, true, false).content_type, headers::EVENT_STREAM);
        assert_eq!(for_client(ok.clone(), Endpoint::Chat, false, false), ok);
    }

    /// `chunk`, with more fields on its choice and on the chunk itself.
    fn chunk_with(delta: Value, finish: Value, choice_fields: Value, chunk_fields: Value) -> Value {
        let mut c = chunk(delta, finish);
        for (k, v) in choice_fields.as_object().unwrap() {
            c["choices"][0][k] = v.clone();
        }
        for (k, v) in chunk_fields.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    /// The log probabilities OpenAI streams beside the content piece made of `tokens`.
    fn token_logprobs(tokens: &[&str]) -> Vec<Value> {
        tokens
            .iter()
            .map(|t| {
                json!({"token": t, "logprob": -0.25, "bytes": t.as_bytes(),
                       "top_logprobs": [{"token": t, "logprob": -0.25, "bytes": t.as_bytes()}]})
            })
            .collect()
    }

    fn usage_chunk(extra: Value) -> Value {
        let mut c = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "gpt-4.1",
                           "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    /// A `logprobs: true` answer: choice 0 answers, choice 1 refuses.
    fn logprobs_stream() -> Vec<u8> {
        let lp = |tokens: &[&str]| json!({"logprobs": {"content": token_logprobs(tokens), "refusal": null}});
        let refusal = |tokens: &[&str]| json!({"logprobs": {"content": null, "refusal": token_logprobs(tokens)}});
        let second = |delta: Value, finish: Value, fields: Value| {
            let mut c = chunk_with(delta, finish, fields, json!({}));
            c["choices"][0]["index"] = json!(1);
            c
        };
        sse(&[
            chunk_with(
                json!({"role": "assistant", "content": "", "refusal": null}),
                Value::Null,
                json!({"logprobs": {"content": [], "refusal": null}}),
                json!({}),
            ),
            second(
                json!({"role": "assistant", "content": null, "refusal": ""}),
                Value::Null,
                json!({"logprobs": null}),
            ),
            chunk_with(json!({"content": "Héllo"}), Value::Null, lp(&["H", "éllo"]), json!({})),
            second(json!({"refusal": "I can't"}), Value::Null, refusal(&["I", " can't"])),
            chunk_with(json!({"content": " 🐑"}), Value::Null, lp(&[" 🐑"]), json!({})),
            second(json!({"refusal": " help."}), Value::Null, refusal(&[" help", "."])),
            chunk_with(json!({}), json!("stop"), json!({"logprobs": null}), json!({})),
            second(json!({}), json!("stop"), json!({"logprobs": null})),
            usage_chunk(json!({})),
        ])
    }

    fn completion_of(bytes: &[u8], split: usize) -> Value {
        let (out, r) = reassemble(bytes, split, true);
        assert_eq!(out, bytes, "split {split}: everything passed on unchanged");
        serde_json::from_slice(&r.completion().expect("complete").body).unwrap()
    }

    #[test]
    fn streamed_logprobs_are_appended_in_order() {
        let bytes = logprobs_stream();
        for split in [1, 5, 64, bytes.len()] {
            let v = completion_of(&bytes, split);
            assert_eq!(v["choices"][0]["message"]["content"], "Héllo 🐑");
            assert_eq!(
                v["choices"][0]["logprobs"],
                json!({"content": token_logprobs(&["H", "éllo", " 🐑"]), "refusal": null}),
                "split {split}"
            );
            assert_eq!(v["choices"][1]["message"]["refusal"], "I can't help.");
            assert_eq!(
                v["choices"][1]["logprobs"],
                json!({"content": null, "refusal": token_logprobs(&["I", " can't", " help", "."])}),
                "split {split}"
            );
        }
        let plain = completion_of(&upstream_stream(), 1000);
        let choice = plain["choices"][0].as_object().unwrap();
        assert!(choice.get("logprobs").is_some_and(Value::is_null), "no logprobs streamed: null, as OpenAI answers");
    }

    /// Reasoning, audio, annotations, provider fields on choices and chunks: every field
    /// streamed is in the completion, merged as OpenAI's SDKs accumulate a stream.
    fn rich_stream() -> Vec<u8> {
        let filter = json!({"hate": {"filtered": false, "severity": "safe"}});
        let citation = |url: &str, start: u64| {
            let at = json!({"url": url, "start_index": start, "end_index": start + 2});
            json!({"type": "url_citation", "url_citation": at})
        };
        sse(&[
            chunk_with(
                json!({"role": "assistant", "content": "", "reasoning_content": "Let me "}),
                Value::Null,
                json!({"logprobs": null, "content_filter_results": {}, "stop_reason": null}),
                json!({"service_tier": "default", "obfuscation": "q1"}),
            ),
            chunk_with(
                json!({"reasoning_content": "think about the sheep first."}),
                Value::Null,
                json!({"content_filter_results": filter, "stop_reason": null}),
                json!({"service_tier": "default", "obfuscation": "q2"}),
            ),
            chunk_with(
                json!({"content": "Hi",
                       "audio": {"id": "audio_1", "transcript": "Hi", "data": "AAA", "expires_at": 10}}),
                Value::Null,
                json!({}),
                json!({"obfuscation": "q3"}),
            ),
            chunk_with(
                json!({"content": " there", "audio": {"transcript": " there", "data": "BBB"},
                       "annotations": [citation("https://a", 0)]}),
                Value::Null,
                json!({}),
                json!({}),
            ),
            chunk_with(
                json!({"annotations": [citation("https://b", 3)],
                       "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                       "function": {"name": "lookup", "arguments": "{\"q\":"},
                                       "extra_content": {"google": {"thought_signature": "c2ln"}}}]}),
                Value::Null,
                json!({}),
                json!({}),
            ),
            chunk_with(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
                Value::Null,
                json!({}),
                json!({}),
            ),
            chunk_with(
                json!({}),
                json!("stop"),
                json!({"native_finish_reason": "STOP", "stop_reason": null}),
                json!({"obfuscation": "q6", "service_tier": null}),
            ),
            usage_chunk(json!({"obfuscation": "q7"})),
        ])
    }

    #[test]
    fn unknown_fields_are_kept_and_merged_as_the_sdks_accumulate_them() {
        let bytes = rich_stream();
        let expected = json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "gpt-4.1",
            "system_fingerprint": "fp", "service_tier": "default", "obfuscation": "q7",
            "choices": [{
                "index": 0, "finish_reason": "stop", "logprobs": null,
                "content_filter_results": {"hate": {"filtered": false, "severity": "safe"}},
                "stop_reason": null, "native_finish_reason": "STOP",
                "message": {
                    "role": "assistant", "content": "Hi there", "refusal": null,
                    "reasoning_content": "Let me think about the sheep first.",
                    "audio": {"id": "audio_1", "transcript": "Hi there", "data": "AAABBB", "expires_at": 10},
                    "annotations": [
                        {"type": "url_citation",
                         "url_citation": {"url": "https://a", "start_index": 0, "end_index": 2}},
                        {"type": "url_citation",
                         "url_citation": {"url": "https://b", "start_index": 3, "end_index": 5}},
                    ],
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "lookup", "arguments": "{\"q\":1}"},
                                    "extra_content": {"google": {"thought_signature": "c2ln"}}}],
                },
            }],
            "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
        });
        for split in [1, 3, 64, bytes.len()] {
            assert_eq!(completion_of(&bytes, split), expected, "split {split}");
        }
    }

    /// A field whose pieces do not merge: the events still pass on unchanged, but the
    /// answer is not stored (it could not be rebuilt without loss).
    #[test]
    fn fields_that_do_not_merge_pass_on_but_are_not_stored() {
        let delta = |d: Value| chunk(d, Value::Null);
        let on_choice = |f: Value| chunk_with(json!({}), Value::Null, f, json!({}));
        let on_chunk = |f: Value| chunk_with(json!({}), Value::Null, json!({}), f);
        let cases = [
            ("string, then object", delta(json!({"audio": "x"})), delta(json!({"audio": {"data": "y"}}))),
            ("text, then number", delta(json!({"content": "a"})), delta(json!({"content": 5}))),
            (
                "indexed list, then an item without index",
                delta(json!({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "{"}}]})),
                delta(json!({"tool_calls": [{"function": {"arguments": "}"}}]})),
            ),
            (
                "plain list, then an indexed item",
                delta(json!({"annotations": [{"type": "a"}]})),
                delta(json!({"annotations": [{"index": 0, "type": "b"}]})),
            ),
            (
                "logprobs object, then string",
                on_choice(json!({"logprobs": {"content": token_logprobs(&["a"]), "refusal": null}})),
                on_choice(json!({"logprobs": "a"})),
            ),
            (
                "choice field, text then number",
                on_choice(json!({"stop_reason": "x"})),
                on_choice(json!({"stop_reason": 3})),
            ),
            (
                "chunk field, text then object",
                on_chunk(json!({"service_tier": "default"})),
                on_chunk(json!({"service_tier": {"tier": 1}})),
            ),
        ];
        let finish = chunk(json!({}), json!("stop"));
        for (case, first, second) in cases {
            for alone in [&first, &second] {
                let bytes = sse(&[alone.clone(), finish.clone()]);
                assert!(reassemble(&bytes, 1000, true).1.completion().is_some(), "{case}: each alone is stored");
            }
            let bytes = sse(&[first, second, finish.clone()]);
            for split in [1, 7, bytes.len()] {
                let (out, r) = reassemble(&bytes, split, true);
                assert_eq!(out, bytes, "{case}: passed on unchanged");
                assert!(r.completion().is_none(), "{case}: not stored");
            }
        }
    }

    /// Replayed, an answer with log probabilities and unknown fields reassembles into
    /// itself; its log probabilities come in one event right before the finish event.
    #[test]
    fn replay_sends_logprobs_and_unknown_fields_again() {
        for bytes in [logprobs_stream(), rich_stream()] {
            let stored = reassemble(&bytes, bytes.len(), true).1.completion().unwrap().body;
            let original: Value = serde_json::from_slice(&stored).unwrap();
            for include_usage in [true, false] {
                let replayed = replay(&stored, include_usage).unwrap();
                for split in [3, replayed.len()] {
                    let mut expected = original.clone();
                    if !include_usage {
                        expected["usage"] = Value::Null;
                    }
                    assert_eq!(completion_of(&replayed, split), expected, "usage {include_usage}, split {split}");
                }
                let text = String::from_utf8(replayed).unwrap();
                let events: Vec<Value> = text
                    .split("\n\n")
                    .filter_map(|e| e.strip_prefix("data: "))
                    .filter_map(|d| serde_json::from_str(d).ok())
                    .collect();
                let reasoning: Vec<&Value> =
                    events.iter().filter_map(|e| e["choices"][0]["delta"].get("reasoning_content")).collect();
                let whole = &original["choices"][0]["message"]["reasoning_content"];
                assert_eq!(reasoning, whole.as_str().map_or(vec![], |_| vec![whole]), "a field SDKs don't know: whole");
                for (i, choice) in original["choices"].as_array().unwrap().iter().enumerate() {
                    let mine: Vec<&Value> =
                        events.iter().filter_map(|e| e["choices"].get(0)).filter(|c| c["index"] == i).collect();
                    let with: Vec<usize> = (0..mine.len()).filter(|&n| !mine[n]["logprobs"].is_null()).collect();
                    if choice["logprobs"].is_null() {
                        assert!(with.is_empty());
                        continue;
                    }
                    assert_eq!(with, [mine.len() - 2], "one logprobs event, right before the finish event");
                    assert_eq!(mine[mine.len() - 2]["logprobs"], choice["logprobs"]);
                    assert!(mine[mine.len() - 2]["finish_reason"].is_null());
                    assert_eq!(mine[mine.len() - 1]["finish_reason"], choice["finish_reason"]);
                }
            }
        }
    }

    /// Many events in one chunk, and one long event in many chunks: each byte is looked at
    /// a bounded number of times (draining or rescanning the buffer per event was quadratic).
    #[test]
    fn long_streams_are_read_in_linear_time() {
        let n = 20_000;
        let mut events: Vec<Value> = vec![chunk(json!({"role": "assistant", "content": ""}), Value::Null)];
        events.extend((0..n).map(|i| {
            let piece = format!("w{i} ");
            chunk_with(
                json!({"content": piece}),
                Value::Null,
                json!({"logprobs": {"content": token_logprobs(&[&piece]), "refusal": null}}),
                json!({}),
            )
        }));
        events.push(chunk(json!({}), json!("stop")));
        let many = sse(&events);
        let v = completion_of(&many, many.len());
        assert_eq!(v["choices"][0]["logprobs"]["content"].as_array().map(Vec::len), Some(n));
        let pieces: Vec<String> = (0..n).map(|i| format!("w{i} ")).collect();
        let long = sse(&[
            chunk_with(
                json!({"role": "assistant", "content": pieces.concat()}),
                Value::Null,
                json!({"logprobs": {"content": token_logprobs(&pieces.iter().map(String::as_str).collect::<Vec<_>>()),
                                    "refusal": null}}),
                json!({}),
            ),
            chunk(json!({}), json!("stop")),
        ]);
        assert!(long.len() > 1_000_000);
        let v = completion_of(&long, 97);
        assert_eq!(v["choices"][0]["message"]["content"], pieces.concat());
    }

    /// Streams of random fields of every kind (text, numbers, objects, indexed and plain
    /// lists, nulls, names, clashing kinds): every byte passes on, and any completion they
    /// make replays into events that reassemble to the same bytes (as fuzz/sse.rs checks).
    #[test]
    fn random_fields_survive_replay() {
        let mut seed = 0xf1e1d5_u64;
        let mut next = move |below: u64| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % below.max(1)
        };
        fn value(next: &mut dyn FnMut(u64) -> u64, depth: u32) -> Value {
            const KEYS: [&str; 10] = ["content", "index", "type", "id", "role", "text", "n", "tool_calls", "a", "b"];
            match next(if depth == 0 { 5 } else { 8 }) {
                0 => Value::Null,
                1 => json!(next(2) == 0),
                2 => json!(next(4)),
                3 | 4 => json!(["", "x", "é🐑", "yz", "a text longer than one replayed piece 🐑"][next(5) as usize]),
                5 | 6 => {
                    let key = |next: &mut dyn FnMut(u64) -> u64| KEYS[next(10) as usize].to_owned();
                    let fields = (0..next(4)).map(|_| (key(next), value(next, depth - 1)));
                    Value::Object(fields.collect())
                }
                _ => {
                    let keyed = next(3) == 0;
                    let items = (0..next(4)).map(|_| {
                        let mut item = value(next, depth - 1);
                        if keyed && item.is_object() {
                            item["index"] = json!(next(2));
                        }
                        item
                    });
                    Value::Array(items.collect())
                }
            }
        }
        let (mut stored, mut not_stored) = (0, 0);
        for round in 0..1000 {
            let mut chunks = Vec::new();
            for _ in 0..1 + next(6) {
                let mut c = json!({"id": "r", "object": "chat.completion.chunk"});
                let mut choices = Vec::new();
                for _ in 0..next(3) {
                    let delta = (0..next(3)).map(|_| {
                        (["content", "text", "tool_calls", "id", "role"][next(5) as usize], value(&mut next, 2))
                    });
                    let delta: Map<String, Value> = delta.map(|(k, v)| (k.to_owned(), v)).collect();
                    let mut choice = json!({"index": next(2), "delta": delta});
                    for field in ["logprobs", "finish_reason", "extra"] {
                        if next(2) == 0 {
                            choice[field] = value(&mut next, 2);
                        }
                    }
                    choices.push(choice);
                }
                c["choices"] = Value::Array(choices);
                for field in ["service_tier", "usage", "z"] {
                    if next(3) == 0 {
                        c[field] = value(&mut next, 2);
                    }
                }
                chunks.push(c);
            }
            for i in 0..2 {
                chunks.push(json!({"id": "r", "choices": [{"index": i, "delta": {}, "finish_reason": "stop"}]}));
            }
            let bytes = sse(&chunks);
            let (out, r) = reassemble(&bytes, 1 + next(50) as usize, true);
            assert_eq!(out, bytes, "round {round}");
            let Some(completion) = r.completion() else {
                not_stored += 1;
                continue;
            };
            stored += 1;
            let events = replay(&completion.body, true).unwrap();
            let (_, again) = reassemble(&events, 1 + next(50) as usize, true);
            assert_eq!(
                again.completion().map(|c| String::from_utf8(c.body).unwrap()),
                Some(String::from_utf8(completion.body).unwrap()),
                "round {round}: {}",
                String::from_utf8_lossy(&bytes)
            );
        }
        assert!(stored > 150 && not_stored > 150, "{stored} stored, {not_stored} not");
    }

    /// A stream of `endpoint` read in pieces of `split` bytes: its answer, if any.
    fn answer_of(endpoint: Endpoint, bytes: &[u8], split: usize) -> Option<Value> {
        let mut r = Reassembler::of(endpoint, true);
        for piece in bytes.chunks(split) {
            r.push(piece);
        }
        r.flush();
        r.completion().map(|c| serde_json::from_slice(&c.body).unwrap())
    }

    fn text_completion() -> Value {
        json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "gpt-4.1",
            "system_fingerprint": "fp", "choices": [
                {"text": " Héllo, wörld 🐑 and a longer text of many pieces", "index": 0, "finish_reason": "stop",
                 "logprobs": {"tokens": [" H", "éllo"], "token_logprobs": [-0.5, -0.25],
                              "top_logprobs": [{" H": -0.5}, {"éllo": -0.25}], "text_offset": [0, 2]}},
                {"text": "", "index": 1, "finish_reason": "length", "logprobs": null}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 11, "total_tokens": 15}})
    }

    #[test]
    fn a_completions_stream_is_assembled_and_replayed_with_its_text_and_log_probabilities() {
        // As OpenAI streams it: the text and each token's lists in pieces, then the finish.
        let piece = |text: &str, index: u64, logprobs: Value, finish: Value| {
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "gpt-4.1",
                "system_fingerprint": "fp",
                "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}]})
        };
        let lp = |t: &str, l: f64, at: u64| json!({"tokens": [t], "token_logprobs": [l], "top_logprobs": [{t: l}], "text_offset": [at]});
        let mut usage = text_completion();
        usage["choices"] = json!([]);
        let upstream = sse(&[
            piece(" H", 0, lp(" H", -0.5, 0), Value::Null),
            piece("", 1, Value::Null, json!("length")),
            piece("éllo", 0, lp("éllo", -0.25, 2), Value::Null),
            piece(", wörld 🐑 and a longer text of many pieces", 0, Value::Null, Value::Null),
            piece("", 0, Value::Null, json!("stop")),
            usage,
        ]);
        for split in [1, 7, upstream.len()] {
            assert_eq!(answer_of(Endpoint::Completions, &upstream, split), Some(text_completion()), "split {split}");
        }
        let stored = serde_json::to_vec(&text_completion()).unwrap();
        let replayed = for_client(Response::json(200, stored), Endpoint::Completions, true, true);
        assert_eq!(replayed.content_type, headers::EVENT_STREAM);
        let text = String::from_utf8(replayed.body.clone()).unwrap();
        assert!(text.matches("\"object\":\"text_completion\"").count() > 3, "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert_eq!(answer_of(Endpoint::Completions, &replayed.body, 5), Some(text_completion()), "replay rebuilds it");
        let unfinished = upstream[..upstream.len() / 2].to_vec();
        assert_eq!(answer_of(Endpoint::Completions, &unfinished, 9), None, "a stream cut off is no answer");
    }

    fn stored_response() -> Value {
        json!({"id": "resp_1", "object": "response", "created_at": 7, "status": "completed", "model": "gpt-4.1",
            "store": false, "previous_response_id": null,
            "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Héllo, wörld 🐑 in a few pieces of text",
                             "annotations": [], "logprobs": []}]}],
            "usage": {"input_tokens": 9, "output_tokens": 12, "total_tokens": 21}})
    }

    #[test]
    fn a_responses_stream_is_the_response_its_last_event_carries_and_replays_to_it() {
        let stored = serde_json::to_vec(&stored_response()).unwrap();
        let events = for_client(Response::json(200, stored.clone()), Endpoint::Responses, true, false).body;
        for split in [3, 64, events.len()] {
            assert_eq!(answer_of(Endpoint::Responses, &events, split), Some(stored_response()), "split {split}");
        }
        // Without its terminal event, or failed: nothing is kept.
        let cut = String::from_utf8(events.clone()).unwrap();
        let cut = &cut[..cut.find("event: response.completed").unwrap()];
        assert_eq!(answer_of(Endpoint::Responses, cut.as_bytes(), 50), None);
        let failed = String::from_utf8(events.clone()).unwrap().replace("response.completed", "response.failed");
        assert_eq!(answer_of(Endpoint::Responses, failed.as_bytes(), 50), None);
        // Ended as `completed` by a response that says otherwise, or with an error, or
        // under another id; an error event; a second end: nothing is kept.
        let text = String::from_utf8(events.clone()).unwrap();
        let at = text.find("event: response.completed").unwrap();
        let (start, end) = text.split_at(at);
        for changed in [
            end.replace("\"status\":\"completed\"", "\"status\":\"failed\""),
            end.replace("\"store\":false", "\"store\":false,\"error\":{\"code\":\"server_error\"}"),
            end.replace("\"id\":\"resp_1\"", "\"id\":\"resp_2\""),
            format!("event: error\ndata: {{\"type\":\"error\",\"message\":\"boom\"}}\n\n{end}"),
            format!("{end}{end}"),
        ] {
            assert_eq!(answer_of(Endpoint::Responses, format!("{start}{changed}").as_bytes(), 50), None, "{changed}");
        }
        // A tenant's answer is kept with its id signed, as a plain answer is.
        use crate::core::api::objects::{ObjectKey, Signer};
        let signer = Signer { key: ObjectKey::of_operator_key("k"), tenant: "alpha".into() };
        let mut r = Reassembler::of(Endpoint::Responses, false).signing(Some(signer.clone()));
        let passed = r.push(&events);
        let kept = r.completion().unwrap().body;
        assert_eq!(Some(kept.clone()), signer.sign_answer(&serde_json::to_vec(&stored_response()).unwrap()));
        let signed = signer.key.sign("alpha", "resp_1");
        assert!(String::from_utf8(kept).unwrap().contains(&signed));
        assert!(!String::from_utf8(passed).unwrap().contains("\"resp_1\""), "every event the client gets is signed");
        // A follower's reader passes the events on and keeps nothing.
        let mut follower = Reassembler::of(Endpoint::Responses, false).passing();
        assert_eq!(follower.push(&events), events);
        assert!(follower.completion().is_none() && follower.response.is_none());
    }
}
