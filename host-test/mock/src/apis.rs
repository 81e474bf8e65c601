//! `/v1/completions` and `/v1/responses` as HolySheep answers them: deterministic text
//! echoing the prompt, OpenAI's shapes and `usage` (completions: `prompt_tokens`,
//! `completion_tokens`; Responses: `input_tokens`, `output_tokens`, their details), and
//! their event streams (completions: `text_completion` chunks, the usage chunk when asked,
//! `[DONE]`; Responses: typed events ending in `response.completed`).

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
    let choices: Vec<Value> =
        (0..n).map(|i| json!({"text": text, "index": i, "logprobs": null, "finish_reason": "stop"})).collect();
    Ok(json!({"id": format!("cmpl-{d}"), "object": "text_completion", "created": 1_764_000_000u64, "model": model,
        "choices": choices, "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}))
}

/// The events of a streamed completion: the text 8 characters at a time per choice, the
/// finish, the usage chunk when asked, `[DONE]`.
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
        let text: Vec<char> = choice["text"].as_str().unwrap_or("").chars().collect();
        for piece in text.chunks(8) {
            let piece: String = piece.iter().collect();
            out.push(chunk(
                json!([{"text": piece, "index": choice["index"], "logprobs": null, "finish_reason": null}]),
            ));
        }
        out.push(chunk(json!([{"text": "", "index": choice["index"], "logprobs": null, "finish_reason": "stop"}])));
    }
    let usage = include_usage.then(|| chunk(json!([])));
    crate::data_events(out, usage, &c["usage"])
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
    Ok(json!({
        "id": format!("resp_{d}"), "object": "response", "created_at": 1_764_000_000u64, "status": "completed",
        "model": model, "error": null, "incomplete_details": null, "instructions": null,
        "max_output_tokens": req["max_output_tokens"], "parallel_tool_calls": true, "previous_response_id":
        req["previous_response_id"], "store": store, "temperature": req["temperature"], "tool_choice": "auto",
        "tools": [], "top_p": 1.0, "truncation": "disabled", "text": {"format": {"type": "text"}},
        "output": [{"type": "message", "id": format!("msg_{d}"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": {"input_tokens": i, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": o,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": i + o},
        "user": null, "metadata": {}
    }))
}

/// The typed events of a streamed response: created, the text in deltas, done, completed.
pub fn response_events(r: &Value) -> Vec<String> {
    let text = r["output"][0]["content"][0]["text"].as_str().unwrap_or("").to_owned();
    let item_id = r["output"][0]["id"].clone();
    let mut open = r.clone();
    open["status"] = json!("in_progress");
    open["output"] = json!([]);
    open["usage"] = Value::Null;
    let mut out = vec![json!({"type": "response.created", "sequence_number": 0, "response": open})];
    let chars: Vec<char> = text.chars().collect();
    for piece in chars.chunks(8) {
        let delta: String = piece.iter().collect();
        out.push(json!({"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
            "content_index": 0, "delta": delta, "logprobs": []}));
    }
    out.push(json!({"type": "response.output_text.done", "item_id": item_id, "output_index": 0, "content_index": 0,
        "text": text, "logprobs": []}));
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
