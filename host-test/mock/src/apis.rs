//! `/v1/completions` and `/v1/responses` as HolySheep answers them: deterministic text
//! echoing the prompt, OpenAI's shapes and `usage` (completions: `prompt_tokens`,
//! `completion_tokens`; Responses: `input_tokens`, `output_tokens`, their details), and
//! their event streams (completions: `text_completion` chunks, the usage chunk when asked,
//! `[DONE]`; Responses: typed events ending in `response.completed`).

use crate::reply::{error, json_response};
use crate::{Body, Mock};
use hyper::{Response, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// A request's digest (stream fields aside): the same answer streamed or not.
fn digest(req: &Value) -> String {
    let mut keyed = req.clone();
    if let Some(o) = keyed.as_object_mut() {
        o.remove("stream");
        o.remove("stream_options");
    }
    Sha256::digest(keyed.to_string().as_bytes()).iter().take(12).map(|b| format!("{b:02x}")).collect()
}

fn tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4).max(1)
}

/// The prompt of a completions request (a string, or the first of a list).
fn prompt(req: &Value) -> Result<String, String> {
    match &req["prompt"] {
        Value::String(s) => Ok(s.clone()),
        Value::Array(items) if !items.is_empty() => {
            Ok(items.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" "))
        }
        _ => Err("'prompt' must be a string or an array".into()),
    }
}

/// The `text_completion` answer, `n` choices of one text.
pub fn completion(req: &Value) -> Result<Value, String> {
    let model = req["model"].as_str().ok_or("you must provide a model parameter")?;
    let prompt = prompt(req)?;
    let d = digest(req);
    let text = format!(" HolySheep mock completion {d} of: {prompt}");
    let n = req["n"].as_u64().unwrap_or(1).clamp(1, 128);
    let (p, c) = (tokens(&prompt), text.split_whitespace().count() as u64 * n);
    let logprobs = req["logprobs"].as_u64().map_or(Value::Null, |_| text_logprobs(&text));
    let choices: Vec<Value> =
        (0..n).map(|i| json!({"text": text, "index": i, "logprobs": logprobs, "finish_reason": "stop"})).collect();
    Ok(json!({"id": format!("cmpl-{d}"), "object": "text_completion", "created": 1_764_000_000u64, "model": model,
        "choices": choices, "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}))
}

/// The legacy API's log probabilities of `text`: one token per 8-character piece (the
/// pieces a stream sends), each its own best alternative, offsets into the text.
fn text_logprobs(text: &str) -> Value {
    let pieces = crate::events::pieces(text);
    let lp = |i: usize| -((i % 7) as f64 + 1.0) / 8.0;
    let offsets = pieces.iter().scan(0, |at, p| {
        let here = *at;
        *at += p.len();
        Some(here)
    });
    json!({"tokens": pieces, "token_logprobs": (0..pieces.len()).map(lp).collect::<Vec<_>>(),
        "top_logprobs": pieces.iter().enumerate().map(|(i, p)| json!({p.as_str(): lp(i)})).collect::<Vec<_>>(),
        "text_offset": offsets.collect::<Vec<_>>()})
}

/// The events of a streamed completion: the text 8 characters at a time per choice (each
/// piece with its token's log probabilities, when asked), the finish, the usage chunk when
/// asked, `[DONE]`.
pub fn completion_events(c: &Value, include_usage: bool) -> Vec<String> {
    let chunk = |choices: Value| {
        let mut v = json!({"id": c["id"], "object": "text_completion", "created": c["created"], "model": c["model"],
            "choices": choices});
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    };
    let mut out = Vec::new();
    for choice in c["choices"].as_array().into_iter().flatten() {
        let lp = &choice["logprobs"];
        for (i, piece) in crate::events::pieces(choice["text"].as_str().unwrap_or("")).into_iter().enumerate() {
            let logprobs = match lp.is_null() {
                true => Value::Null,
                false => json!({"tokens": [lp["tokens"][i]], "token_logprobs": [lp["token_logprobs"][i]],
                    "top_logprobs": [lp["top_logprobs"][i]], "text_offset": [lp["text_offset"][i]]}),
            };
            out.push(chunk(
                json!([{"text": piece, "index": choice["index"], "logprobs": logprobs, "finish_reason": null}]),
            ));
        }
        out.push(chunk(json!([{"text": "", "index": choice["index"], "logprobs": null, "finish_reason": "stop"}])));
    }
    let usage = include_usage.then(|| chunk(json!([])));
    crate::events::data_events(out, usage, &c["usage"])
}

/// The input text of a Responses request (a string, or the text of its items).
fn input(req: &Value) -> Result<String, String> {
    match &req["input"] {
        Value::String(s) => Ok(s.clone()),
        Value::Array(items) => Ok(items
            .iter()
            .map(|i| match &i["content"] {
                Value::String(s) => s.clone(),
                Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect::<Vec<_>>().join(" "),
                _ => String::new(),
            })
            .collect::<Vec<_>>()
            .join("\n")),
        Value::Null if req["previous_response_id"].is_string() => Ok(String::new()),
        _ => Err("'input' must be a string or an array".into()),
    }
}

/// The `response` object: one message with one output text; `store` echoed.
pub fn response(req: &Value) -> Result<Value, String> {
    let model = req["model"].as_str().ok_or("you must provide a model parameter")?;
    let text_in = input(req)?;
    let d = digest(req);
    let text = format!("HolySheep mock response {d} to: {text_in}");
    let (i, o) = (tokens(&text_in) + 8, text.split_whitespace().count() as u64);
    let store = req["store"].as_bool().unwrap_or(true);
    let included = req["include"].as_array().into_iter().flatten();
    let logprobs: Vec<Value> = match included.filter_map(Value::as_str).any(|i| i == "message.output_text.logprobs") {
        true => crate::events::pieces(&text)
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                json!({"token": p, "logprob": -((i % 5) as f64 + 1.0) / 4.0, "bytes": p.as_bytes(),
                "top_logprobs": []})
            })
            .collect(),
        false => Vec::new(),
    };
    Ok(json!({
        "id": format!("resp_{d}"), "object": "response", "created_at": 1_764_000_000u64, "status": "completed",
        "model": model, "error": null, "incomplete_details": null, "instructions": null,
        "max_output_tokens": req["max_output_tokens"], "parallel_tool_calls": true, "previous_response_id":
        req["previous_response_id"], "store": store, "temperature": req["temperature"], "tool_choice": "auto",
        "tools": [], "top_p": 1.0, "truncation": "disabled", "text": {"format": {"type": "text"}},
        "output": [{"type": "message", "id": format!("msg_{d}"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}],
        "usage": {"input_tokens": i, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": o,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": i + o},
        "user": null, "metadata": {}
    }))
}

/// The typed events of a streamed response, as OpenAI sends them: created, in progress,
/// the message item added, its text part added, the text in deltas (each with its token's
/// log probabilities, when asked), the text done, the part done, the item done, completed;
/// each with its `event:` line and its `sequence_number` from 0.
pub fn response_events(r: &Value) -> Vec<String> {
    let item = &r["output"][0];
    let part = &item["content"][0];
    let text = part["text"].as_str().unwrap_or("").to_owned();
    let at = json!({"item_id": item["id"], "output_index": 0, "content_index": 0});
    let with = |mut v: Value, more: Value| {
        for (k, x) in more.as_object().into_iter().flatten().chain(at.as_object().into_iter().flatten()) {
            v[k] = x.clone();
        }
        v
    };
    let mut open = r.clone();
    open["status"] = json!("in_progress");
    open["output"] = json!([]);
    open["usage"] = Value::Null;
    let mut added = item.clone();
    added["status"] = json!("in_progress");
    added["content"] = json!([]);
    let mut empty = part.clone();
    empty["text"] = json!("");
    empty["logprobs"] = json!([]);
    let mut out = vec![
        json!({"type": "response.created", "response": open}),
        json!({"type": "response.in_progress", "response": open}),
        json!({"type": "response.output_item.added", "output_index": 0, "item": added}),
        with(json!({"type": "response.content_part.added"}), json!({"part": empty})),
    ];
    let logprobs = part["logprobs"].as_array().cloned().unwrap_or_default();
    for (i, delta) in crate::events::pieces(&text).into_iter().enumerate() {
        let lp: Vec<Value> = logprobs.get(i).cloned().into_iter().collect();
        out.push(with(json!({"type": "response.output_text.delta"}), json!({"delta": delta, "logprobs": lp})));
    }
    out.push(with(json!({"type": "response.output_text.done"}), json!({"text": text, "logprobs": logprobs})));
    out.push(with(json!({"type": "response.content_part.done"}), json!({"part": part})));
    out.push(json!({"type": "response.output_item.done", "output_index": 0, "item": item}));
    out.push(json!({"type": "response.completed", "response": r}));
    out.iter()
        .enumerate()
        .map(|(n, v)| {
            let mut v = v.clone();
            v["sequence_number"] = json!(n);
            format!("event: {}\ndata: {v}\n\n", v["type"].as_str().unwrap_or(""))
        })
        .collect()
}

impl Mock {
    /// `/v1/completions` and `/v1/responses` (see `apis`), with the key checked and the
    /// latency, JSON or streamed as asked; every answer billed.
    pub(crate) async fn api(
        self,
        path: &str,
        auth: Option<String>,
        body: &[u8],
    ) -> Result<Response<Body>, std::io::Error> {
        let req = serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
        let (fault, latency) = {
            let mut s = self.state();
            *s.api_calls.entry(path.to_owned()).or_default() += 1;
            s.last_authorization.clone_from(&auth);
            s.last_body = body.to_vec();
            (s.api_plan.pop_front().unwrap_or_default(), s.latency_ms)
        };
        if fault.hold {
            self.release.notified().await;
        }
        if let Some(early) = self.before_answer(&fault, latency, auth.as_deref()).await {
            return early;
        }
        // A continuation replays its stored response's context, billed as input.
        let previous = req["previous_response_id"].as_str().filter(|_| path == "/v1/responses");
        let context = match previous {
            Some(id) => match self.state().stored.get(id).copied() {
                Some(tokens) => tokens,
                None => {
                    let m = format!("Previous response with id '{id}' not found.");
                    let (kind, code) = ("invalid_request_error", "previous_response_not_found");
                    return Ok(error(StatusCode::NOT_FOUND, &m, kind, code, Some("previous_response_id")));
                }
            },
            None => 0,
        };
        let answer = if path == "/v1/completions" { completion(&req) } else { response(&req) };
        let mut answer = match answer {
            Ok(a) => a,
            Err(m) => return Ok(error(StatusCode::BAD_REQUEST, &m, "invalid_request_error", "invalid_value", None)),
        };
        if path == "/v1/responses" {
            let u = &mut answer["usage"];
            let input = u["input_tokens"].as_u64().unwrap_or(0) + context;
            let output = u["output_tokens"].as_u64().unwrap_or(0);
            u["input_tokens"] = input.into();
            u["total_tokens"] = (input + output).into();
            if answer["store"].as_bool() == Some(true) {
                let id = answer["id"].as_str().unwrap_or_default().to_owned();
                self.state().stored.insert(id, input + output);
            }
        }
        self.state().billed_at.push((path.to_owned(), answer["usage"].clone()));
        if req["stream"].as_bool() != Some(true) {
            return Ok(json_response(StatusCode::OK, &answer));
        }
        let mut events = if path == "/v1/completions" {
            completion_events(&answer, req["stream_options"]["include_usage"].as_bool() == Some(true))
        } else {
            response_events(&answer)
        };
        if let Some(n) = fault.drop_last_events {
            events.truncate(events.len().saturating_sub(n));
        }
        Ok(self.stream(events, &fault))
    }
}
