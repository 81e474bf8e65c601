//! A stored `response` as the Responses API streams it: typed events, each with its
//! `sequence_number` from 0, in the order OpenAI sends them and its SDKs check
//! (openai-python's `ResponseStreamState` refuses a content event before its item was
//! added, and an item that changes identity):
//!
//! 1. `response.created` and `response.in_progress`, with the response as it starts
//!    (`in_progress`, no output, no usage);
//! 2. for each output item: `response.output_item.added` (the item without what streams),
//!    what streams of it, `response.output_item.done` (the item whole):
//!    - a message: per content part `response.content_part.added`, its text
//!      (`response.output_text.delta`, its annotations, `response.output_text.done`) or
//!      its refusal (`response.refusal.delta`, `.done`), `response.content_part.done`;
//!    - a function call: `response.function_call_arguments.delta`, `.done`;
//!    - a custom tool call: `response.custom_tool_call_input.delta`, `.done`;
//!    - reasoning: per summary part `response.reasoning_summary_part.added`, its text
//!      (`response.reasoning_summary_text.delta`, `.done`), `.part.done`;
//!    - any other item: added and done whole;
//! 3. `response.completed` (or `.incomplete`, `.failed`, after the response's status)
//!    with the stored response, usage and all.
//!
//! Text streams in pieces of `PIECE_CHARS` characters; a part's log probabilities go with
//! its first piece and whole with its `.done`.

use super::replay::pieces;
use crate::core::wire::{json, write};
use serde_json::Value;

/// The events being written, numbered as they go.
#[derive(Default)]
struct Events {
    next: u64,
    out: Vec<u8>,
}

/// An event's fields after its `type` and `sequence_number`.
type Fields = Vec<(&'static str, Value)>;

impl Events {
    /// One event: `event: <kind>` and its data, `type` and `sequence_number` first (the
    /// kind and the field names are the edge's own, plain ASCII: written as they are).
    fn emit(&mut self, kind: &str, fields: Fields) {
        let out = &mut self.out;
        for piece in ["event: ", kind, "\ndata: {\"type\":\"", kind, "\",\"sequence_number\":"] {
            out.extend_from_slice(piece.as_bytes());
        }
        write::value_into(&Value::from(self.next), out, write::number);
        for (name, value) in &fields {
            for piece in [",\"", name, "\":"] {
                out.extend_from_slice(piece.as_bytes());
            }
            write::value_into(value, out, write::number);
        }
        out.extend_from_slice(b"}\n\n");
        self.next += 1;
    }
}

/// Where an event belongs: its item's id and place in the output, and the place of the
/// part it streams (`content_index` or `summary_index`), if any.
struct Place<'a> {
    id: &'a Value,
    at: usize,
    part: Option<(&'static str, usize)>,
}

impl Place<'_> {
    /// An event of this place, `fields` after its own.
    fn emit(&self, events: &mut Events, kind: &str, fields: Fields) {
        let mut all = vec![("item_id", self.id.clone()), ("output_index", self.at.into())];
        all.extend(self.part.map(|(name, index)| (name, index.into())));
        all.extend(fields);
        events.emit(kind, all);
    }

    /// `text` in `kind.delta` events (each with `logprobs` beside it, when given: all of
    /// them with the first piece, none with the others), then an `annotation.added` event
    /// per annotation, then `kind.done` with the whole text as `kind.field` (and
    /// `logprobs`).
    fn stream(&self, events: &mut Events, kind: &Text, text: &str, logprobs: Option<Value>, annotations: &[Value]) {
        for (i, piece) in pieces(text).into_iter().enumerate() {
            let mut fields = vec![("delta", Value::from(piece))];
            let none = || Value::Array(Vec::new());
            fields.extend(logprobs.as_ref().map(|l| ("logprobs", if i == 0 { l.clone() } else { none() })));
            self.emit(events, kind.delta, fields);
        }
        for (n, annotation) in annotations.iter().enumerate() {
            let fields = vec![("annotation_index", n.into()), ("annotation", annotation.clone())];
            self.emit(events, "response.output_text.annotation.added", fields);
        }
        let mut done = vec![(kind.field, Value::from(text))];
        done.extend(logprobs.map(|l| ("logprobs", l)));
        self.emit(events, kind.done, done);
    }
}

/// A text that streams: the field that holds it whole, and its events' kinds.
struct Text {
    field: &'static str,
    delta: &'static str,
    done: &'static str,
}

static ARGUMENTS: Text = Text {
    field: "arguments",
    delta: "response.function_call_arguments.delta",
    done: "response.function_call_arguments.done",
};
static INPUT: Text = Text {
    field: "input",
    delta: "response.custom_tool_call_input.delta",
    done: "response.custom_tool_call_input.done",
};
static OUTPUT_TEXT: Text =
    Text { field: "text", delta: "response.output_text.delta", done: "response.output_text.done" };
static REFUSAL: Text = Text { field: "refusal", delta: "response.refusal.delta", done: "response.refusal.done" };
static SUMMARY_TEXT: Text = Text {
    field: "text",
    delta: "response.reasoning_summary_text.delta",
    done: "response.reasoning_summary_text.done",
};

/// The event stream of a stored `response` (see the module); `None` for anything else.
pub fn replay(answer: &[u8]) -> Option<Vec<u8>> {
    let Value::Object(response) = json::parse(answer)? else { return None };
    if response.get("object").and_then(Value::as_str) != Some("response") {
        return None;
    }
    let Some(Value::Array(output)) = response.get("output") else { return None };
    let mut events = Events::default();
    let mut open = response.clone();
    open.insert("status".into(), Value::from("in_progress"));
    open.insert("output".into(), Value::Array(Vec::new()));
    for unfinished in ["usage", "incomplete_details", "completed_at", "error"] {
        if let Some(v) = open.get_mut(unfinished) {
            *v = Value::Null;
        }
    }
    let open = Value::Object(open);
    events.emit("response.created", vec![("response", open.clone())]);
    events.emit("response.in_progress", vec![("response", open)]);
    for (at, item) in output.iter().enumerate() {
        item_events(&mut events, at, item);
    }
    let terminal = match response.get("status").and_then(Value::as_str) {
        Some("incomplete") => "response.incomplete",
        Some("failed") => "response.failed",
        _ => "response.completed",
    };
    events.emit(terminal, vec![("response", Value::Object(response))]);
    Some(events.out)
}

/// The events of output item `at`: added (without what streams of it), what streams of
/// it, done (whole).
fn item_events(events: &mut Events, at: usize, item: &Value) {
    let mut added = item.clone();
    let kind = item.get("type").and_then(Value::as_str).unwrap_or_default();
    // What streams of the item: a list of parts, or one text.
    let (list, text) = match kind {
        "message" => (Some("content"), None),
        "reasoning" => (Some("summary"), None),
        "function_call" => (None, Some(&ARGUMENTS)),
        "custom_tool_call" => (None, Some(&INPUT)),
        _ => (None, None),
    };
    let mut parts = Vec::new();
    if let Some(fields) = added.as_object_mut() {
        if let Some(status) = fields.get_mut("status") {
            *status = Value::from("in_progress");
        }
        match (list, text) {
            (Some(list), _) => {
                if let Some(Value::Array(l)) = fields.get_mut(list) {
                    parts = std::mem::take(l);
                }
            }
            (_, Some(text)) => {
                fields.insert(text.field.into(), Value::from(""));
            }
            _ => {}
        }
    }
    events.emit("response.output_item.added", vec![("output_index", at.into()), ("item", added)]);
    let id = item.get("id").unwrap_or(&Value::Null);
    let whole = |field| item.get(field).and_then(Value::as_str).unwrap_or_default();
    if let Some(text) = text {
        Place { id, at, part: None }.stream(events, text, whole(text.field), None, &[]);
    }
    for (index, part) in parts.iter().enumerate() {
        let place = match kind {
            "message" => Place { id, at, part: Some(("content_index", index)) },
            _ => Place { id, at, part: Some(("summary_index", index)) },
        };
        part_events(events, &place, kind == "message", part);
    }
    events.emit("response.output_item.done", vec![("output_index", at.into()), ("item", item.clone())]);
}

/// The events of one part: of a message's content (`content`) or of a reasoning's summary.
fn part_events(events: &mut Events, place: &Place<'_>, content: bool, part: &Value) {
    let (added, done) = match content {
        true => ("response.content_part.added", "response.content_part.done"),
        false => ("response.reasoning_summary_part.added", "response.reasoning_summary_part.done"),
    };
    let streamed = match (content, part.get("type").and_then(Value::as_str)) {
        (true, Some("output_text")) => Some(&OUTPUT_TEXT),
        (true, Some("refusal")) => Some(&REFUSAL),
        (false, _) => Some(&SUMMARY_TEXT),
        _ => None,
    };
    let mut started = part.clone();
    if let (Some(fields), Some(kind)) = (started.as_object_mut(), streamed) {
        fields.insert(kind.field.into(), Value::from(""));
        for list in ["annotations", "logprobs"] {
            if let Some(v) = fields.get_mut(list) {
                *v = Value::Array(Vec::new());
            }
        }
    }
    place.emit(events, added, vec![("part", started)]);
    if let Some(kind) = streamed {
        let text = part.get(kind.field).and_then(Value::as_str).unwrap_or_default();
        let output_text = std::ptr::eq(kind, &OUTPUT_TEXT);
        let logprobs = part.get("logprobs").filter(|l| l.is_array()).cloned().unwrap_or(Value::Array(Vec::new()));
        let annotations = part.get("annotations").and_then(Value::as_array).filter(|_| output_text);
        place.stream(events, kind, text, output_text.then_some(logprobs), annotations.map_or(&[], Vec::as_slice));
    }
    place.emit(events, done, vec![("part", part.clone())]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The events' data, parsed.
    fn events(bytes: &[u8]) -> Vec<Value> {
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (head, data) = e.split_once("\ndata: ").unwrap();
                let v: Value = serde_json::from_str(data).unwrap();
                assert_eq!(head.strip_prefix("event: "), v["type"].as_str(), "the event line names its type");
                v
            })
            .collect()
    }

    fn stored() -> Value {
        json!({"id": "resp_1", "object": "response", "created_at": 7, "status": "completed", "model": "gpt-4.1",
        "incomplete_details": null, "store": false, "usage": {"input_tokens": 9, "output_tokens": 12,
        "total_tokens": 21, "input_tokens_details": {"cached_tokens": 0}},
        "output": [
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Thinking about sheep."}]},
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [
                {"type": "output_text", "text": "Héllo, wörld 🐑, a long answer of many pieces.",
                 "annotations": [{"type": "url_citation", "url": "https://a.example", "start_index": 0,
                                  "end_index": 5, "title": "A"}],
                 "logprobs": [{"token": "H", "logprob": -0.1, "bytes": [72], "top_logprobs": []}]},
                {"type": "refusal", "refusal": "No."}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup",
             "arguments": "{\"q\":\"sheep of the northern hills\"}", "status": "completed"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"}
        ]})
    }

    /// What an SDK rebuilds from the events: each item from its added event and what
    /// streamed into it, checked against its done event.
    fn rebuilt(events: &[Value]) -> Vec<Value> {
        let mut items: Vec<Value> = Vec::new();
        for e in events {
            let at = e["output_index"].as_u64().unwrap_or(0) as usize;
            let kind = e["type"].as_str().unwrap();
            match kind {
                "response.output_item.added" => {
                    assert_eq!(at, items.len());
                    items.push(e["item"].clone());
                }
                "response.content_part.added" => {
                    items[at]["content"].as_array_mut().unwrap().push(e["part"].clone());
                }
                "response.output_text.delta" | "response.refusal.delta" => {
                    let field = if kind.contains("refusal") { "refusal" } else { "text" };
                    let part = &mut items[at]["content"][e["content_index"].as_u64().unwrap() as usize];
                    let so_far = part[field].as_str().unwrap().to_owned();
                    part[field] = Value::from(so_far + e["delta"].as_str().unwrap());
                    if kind.contains("text") {
                        part["logprobs"].as_array_mut().unwrap().extend(e["logprobs"].as_array().unwrap().clone());
                    }
                }
                "response.output_text.annotation.added" => {
                    let part = &mut items[at]["content"][e["content_index"].as_u64().unwrap() as usize];
                    part["annotations"].as_array_mut().unwrap().push(e["annotation"].clone());
                }
                "response.function_call_arguments.delta" => {
                    let so_far = items[at]["arguments"].as_str().unwrap().to_owned();
                    items[at]["arguments"] = Value::from(so_far + e["delta"].as_str().unwrap());
                }
                "response.reasoning_summary_part.added" => {
                    items[at]["summary"].as_array_mut().unwrap().push(e["part"].clone());
                }
                "response.reasoning_summary_text.delta" => {
                    let part = &mut items[at]["summary"][e["summary_index"].as_u64().unwrap() as usize];
                    let so_far = part["text"].as_str().unwrap().to_owned();
                    part["text"] = Value::from(so_far + e["delta"].as_str().unwrap());
                }
                "response.output_item.done" => {
                    if items[at].get("status").is_some() {
                        items[at]["status"] = e["item"]["status"].clone();
                    }
                    assert_eq!(items[at], e["item"], "the deltas rebuild item {at}");
                }
                _ => {}
            }
        }
        items
    }

    #[test]
    fn a_stored_response_streams_as_openai_sends_it_and_rebuilds_whole() {
        let r = stored();
        let out = replay(&serde_json::to_vec(&r).unwrap()).unwrap();
        let evs = events(&out);
        let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(&kinds[..3], ["response.created", "response.in_progress", "response.output_item.added"]);
        assert_eq!(kinds.last(), Some(&"response.completed"));
        for (n, e) in evs.iter().enumerate() {
            assert_eq!(e["sequence_number"], n, "numbered from 0 in order");
        }
        let open = &evs[0]["response"];
        assert_eq!(
            (&open["status"], &open["output"], &open["usage"]),
            (&json!("in_progress"), &json!([]), &Value::Null)
        );
        assert_eq!(evs.last().unwrap()["response"], r, "the stored response ends the stream, whole");
        assert_eq!(rebuilt(&evs), r["output"].as_array().unwrap().clone());
        let deltas = evs.iter().filter(|e| e["type"] == "response.output_text.delta").count();
        assert!(deltas > 1, "the text streams in pieces");
        for kind in [
            "response.refusal.done",
            "response.function_call_arguments.done",
            "response.reasoning_summary_text.done",
            "response.output_text.annotation.added",
            "response.content_part.done",
        ] {
            assert!(kinds.contains(&kind), "{kind} is sent");
        }
    }

    #[test]
    fn an_incomplete_response_ends_in_its_own_event_and_anything_else_is_not_replayed() {
        let mut r = stored();
        r["status"] = json!("incomplete");
        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        let evs = events(&replay(&serde_json::to_vec(&r).unwrap()).unwrap());
        assert_eq!(evs.last().unwrap()["type"], "response.incomplete");
        assert_eq!(evs[0]["response"]["incomplete_details"], Value::Null, "it starts unfinished");
        assert!(replay(br#"{"object":"chat.completion","choices":[]}"#).is_none());
        assert!(replay(br#"{"object":"response","output":{}}"#).is_none());
        assert!(replay(b"not json").is_none());
    }
}
