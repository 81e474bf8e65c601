//! Server-sent events: a chat completion as OpenAI streams it, and the sender that writes
//! any answer's events with the planned holds and cuts.

use crate::Body;
use crate::{Fault, Mock};
use http_body_util::channel::Channel;
use http_body_util::Either;
use hyper::body::Bytes;
use hyper::Response;
use serde_json::{json, Value};
use std::time::Duration;

impl Mock {
    /// Sends `events` one by one, `event_delay_ms` apart, each in two writes split inside
    /// the event (so a reader sees partial events), holding or cutting as `fault` says.
    pub(crate) fn stream(&self, events: Vec<String>, fault: &Fault) -> Response<Body> {
        let (mut tx, channel) = Channel::<Bytes, std::io::Error>::new(4);
        let (mock, hold, cut) = (self.clone(), fault.hold_after_events, fault.cut_after_events);
        tokio::spawn(async move {
            for (i, event) in events.into_iter().enumerate() {
                if hold == Some(i) {
                    mock.release.notified().await;
                }
                if cut == Some(i) {
                    tx.abort(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "planned cut"));
                    return;
                }
                let delay = mock.state().event_delay_ms;
                if delay > 0 && i > 0 {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                let bytes = Bytes::from(event);
                let mid = bytes.len() / 2;
                if tx.send_data(bytes.slice(..mid)).await.is_err() {
                    return;
                }
                tokio::task::yield_now().await;
                if tx.send_data(bytes.slice(mid..)).await.is_err() {
                    return;
                }
                mock.state().events_sent += 1;
            }
        });
        let mut r = Response::new(Either::Right(channel));
        r.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("text/event-stream"));
        r
    }
}

/// The events OpenAI streams for `c`: the role, the content 8 characters at a time, tool
/// calls (id, type and name first, then argument pieces), the finish reason; the usage
/// event when asked for; `[DONE]`.
pub(crate) fn chat_events(c: &Value, include_usage: bool) -> Vec<String> {
    let chunk = |choices: Value| {
        let mut v = json!({"id": c["id"], "object": "chat.completion.chunk", "created": c["created"],
                           "model": c["model"], "system_fingerprint": c["system_fingerprint"], "choices": choices});
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    };
    let piece = pieces;
    let mut out = Vec::new();
    for choice in c["choices"].as_array().into_iter().flatten() {
        let i = &choice["index"];
        let delta = |d: Value| chunk(json!([{"index": i, "delta": d, "logprobs": null, "finish_reason": null}]));
        out.push(delta(json!({"role": "assistant", "content": "", "refusal": null})));
        let tokens = choice["logprobs"]["content"].as_array();
        for (t, p) in piece(choice["message"]["content"].as_str().unwrap_or("")).into_iter().enumerate() {
            // The piece's own token, as OpenAI sends the logprobs of a chunk's tokens with it.
            let logprobs = tokens.and_then(|all| all.get(t)).map(|tok| json!({"content": [tok], "refusal": null}));
            out.push(chunk(
                json!([{"index": i, "delta": {"content": p}, "logprobs": logprobs, "finish_reason": null}]),
            ));
        }
        for (t, call) in choice["message"]["tool_calls"].as_array().into_iter().flatten().enumerate() {
            out.push(delta(json!({"tool_calls": [{"index": t, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}]})));
            for p in piece(call["function"]["arguments"].as_str().unwrap_or("")) {
                out.push(delta(json!({"tool_calls": [{"index": t, "function": {"arguments": p}}]})));
            }
        }
        out.push(chunk(json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": choice["finish_reason"]}])));
    }
    let usage = include_usage.then(|| chunk(json!([])));
    data_events(out, usage, &c["usage"])
}

/// `chunks` as `data:` events, then the usage event (`usage_chunk` carrying `usage`) when
/// the client asked for it, then `[DONE]`.
pub(crate) fn data_events(mut chunks: Vec<Value>, usage_chunk: Option<Value>, usage: &Value) -> Vec<String> {
    if let Some(mut u) = usage_chunk {
        u["usage"] = usage.clone();
        chunks.push(u);
    }
    let mut events: Vec<String> = chunks.iter().map(|v| format!("data: {v}\n\n")).collect();
    events.push("data: [DONE]\n\n".to_owned());
    events
}

/// `s` in pieces of 8 characters: the content a stream sends in each event.
pub(crate) fn pieces(s: &str) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    chars.chunks(8).map(|p| p.iter().collect()).collect()
}
