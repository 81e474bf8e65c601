//! `/v1/chat/completions`: deterministic answers with real `usage` (prompt caching as
//! OpenAI bills it, `n`, tool calls, logprobs, "at length" answers cut at the limit),
//! planned faults, and OpenAI's rate-limit headers. What each answer billed is recorded.

use crate::events::pieces;
use crate::faults::{planned_body, planned_error, slow};
use crate::reply::{error, json_response};
use crate::server::{InFlight, State};
use crate::{Body, Mock};
use hyper::{Response, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

impl Mock {
    pub(crate) async fn chat(self, auth: Option<String>, body: &[u8]) -> Result<Response<Body>, std::io::Error> {
        let parsed = serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
        let model = parsed["model"].as_str().map(str::to_owned);
        let last = parsed["messages"].as_array().and_then(|m| m.last()).map(|m| m["content"].clone());
        let _in_flight = InFlight::new(&self.state);
        let (fault, latency, calls) = {
            let mut s = self.state();
            s.calls += 1;
            s.log.push((model.unwrap_or_default(), std::time::Instant::now()));
            s.prompts.push(last.and_then(|c| c.as_str().map(str::to_owned)).unwrap_or_default());
            s.last_authorization.clone_from(&auth);
            s.last_body = body.to_vec();
            if let Some(limit) = s.limit.as_mut() {
                if let Err(wait_ms) = limit.take() {
                    let mut resp = planned_error(429);
                    let mut pairs = limit.headers().to_vec();
                    pairs.push(("retry-after-ms", wait_ms.to_string()));
                    set_headers(&mut resp, &pairs);
                    return Ok(resp);
                }
            }
            (s.plan.pop_front().unwrap_or_default(), s.latency_ms, s.calls)
        };
        if fault.hold {
            self.release.notified().await;
        }
        if let Some(early) = self.before_answer(&fault, latency, auth.as_deref()).await {
            return early;
        }
        if fault.reset_after_billing {
            let _lost = answer(body, &mut self.state());
            return Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset after billing"));
        }
        let mut resp = match (fault.status.filter(|s| *s != 200), &fault.body) {
            (status, Some(raw)) => {
                // An answer HolySheep sends, whatever its shape, is billed by its `usage`.
                let usage = serde_json::from_str::<Value>(raw).ok().map(|v| v["usage"].clone());
                if let Some(u) = usage.filter(|u| u.is_object()) {
                    let model = parsed["model"].as_str().unwrap_or_default().to_owned();
                    self.state().billed.push((model, u));
                }
                planned_body(status.unwrap_or(200), raw, fault.content_type.as_deref())
            }
            (Some(status), None) => planned_error(status),
            (None, None) => {
                let answered = answer(body, &mut self.state());
                match answered {
                    Answer::Json(r) => r,
                    Answer::Events(events) => self.stream(events, &fault),
                }
            }
        };
        if resp.status() == StatusCode::OK {
            rate_limit_headers(&mut resp, calls);
            if let Some(limit) = self.state().limit.as_ref() {
                set_headers(&mut resp, &limit.headers());
            }
        }
        if let Some(r) = fault.retry_after {
            if let Ok(v) = r.parse() {
                resp.headers_mut().insert("retry-after", v);
            }
        }
        if fault.slow_body_ms > 0 {
            return Ok(slow(resp, fault.slow_body_ms));
        }
        Ok(resp)
    }
}

enum Answer {
    Json(Response<Body>),
    /// A `stream: true` answer: its server-sent events, in order.
    Events(Vec<String>),
}

/// The answer to a chat call, billed to `state`.
fn answer(body: &[u8], state: &mut State) -> Answer {
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let cached = cached_tokens(&req, &mut state.prefixes, state.cache_machines);
    let completion = completion(&req).map(|mut c| {
        c["usage"]["prompt_tokens_details"] = json!({"cached_tokens": cached, "audio_tokens": 0});
        state.billed.push((c["model"].as_str().unwrap_or_default().to_owned(), c["usage"].clone()));
        c
    });
    match completion {
        Err(e) => Answer::Json(*e),
        Ok(c) if req["stream"].as_bool() == Some(true) => Answer::Events(crate::events::chat_events(
            &c,
            req["stream_options"]["include_usage"].as_bool() == Some(true),
        )),
        Ok(c) => Answer::Json(json_response(StatusCode::OK, &c)),
    }
}

/// Prompt caching as OpenAI bills it: a prompt whose prefix (the model and every message
/// but the last) was answered before, and is at least 1024 tokens long, has that prefix
/// served from the cache in whole blocks of 128 tokens. Remembers the prefix.
fn cached_tokens(req: &Value, seen: &mut std::collections::HashSet<[u8; 32]>, machines: u32) -> u64 {
    let Some(messages) = req["messages"].as_array().filter(|m| m.len() > 1) else { return 0 };
    let prefix = &messages[..messages.len() - 1];
    let tokens = (prefix.iter().map(|m| m["content"].as_str().map_or(0, str::len) + 4).sum::<usize>() / 4) as u64;
    // With several machines (`Mock::prompt_cache_machines`), each keeps its own prefixes: a
    // call goes to its `prompt_cache_key`'s machine, else to one picked by its whole body.
    let machine = match machines {
        0 | 1 => 0,
        n => {
            let by = req.get("prompt_cache_key").map_or_else(|| req.to_string(), Value::to_string);
            let d: [u8; 32] = Sha256::digest(by.as_bytes()).into();
            u32::from_be_bytes([d[0], d[1], d[2], d[3]]) % n
        }
    };
    let digest: [u8; 32] = Sha256::digest(json!([machine, req["model"], prefix]).to_string().as_bytes()).into();
    let hit = !seen.insert(digest);
    if hit && tokens >= 1024 {
        tokens / 128 * 128
    } else {
        0
    }
}

/// The `chat.completion` the mock answers: deterministic content echoing the last message,
/// or, when the request offers `tools` and the last message asks to "call a tool", a call
/// of the first tool with the message as its argument.
fn completion(req: &Value) -> Result<Value, Box<Response<Body>>> {
    if !req.is_object() {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "We could not parse the JSON body of your request.",
            "invalid_request_error",
            "invalid_json",
            None,
        )));
    }
    let Some(model) = req["model"].as_str() else {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "you must provide a model parameter",
            "invalid_request_error",
            "missing_required_parameter",
            Some("model"),
        )));
    };
    let Some(messages) = req["messages"].as_array().filter(|m| !m.is_empty()) else {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "'messages' must be a non-empty array",
            "invalid_request_error",
            "invalid_value",
            Some("messages"),
        )));
    };
    let last = messages.iter().rev().find_map(|m| m["content"].as_str()).unwrap_or("");
    // The same answer whether streamed or not, and whatever the stream options.
    let mut keyed = req.clone();
    if let Some(o) = keyed.as_object_mut() {
        o.remove("stream");
        o.remove("stream_options");
    }
    let digest: String =
        Sha256::digest(keyed.to_string().as_bytes()).iter().take(12).map(|b| format!("{b:02x}")).collect();
    let content = format!("HolySheep mock answer {digest} to: {last}");
    let prompt_text: usize = messages.iter().map(|m| m["content"].as_str().map_or(0, str::len) + 4).sum();
    let prompt_tokens = prompt_text.div_ceil(4) as u64;
    // Asked to write "at length", the model writes until its limit stops it: the request's
    // completion limit, else 200,000 tokens (billed; the content shown stays short).
    let at_length = last.contains("at length");
    let limit = ["max_tokens", "max_completion_tokens"].iter().filter_map(|f| req[*f].as_u64()).max();
    let completion_tokens =
        if at_length { limit.unwrap_or(200_000) } else { content.split_whitespace().count() as u64 };
    let n = req["n"].as_u64().unwrap_or(1).clamp(1, 128);
    let tool = req["tools"][0]["function"]["name"].as_str().filter(|_| last.contains("call a tool"));
    let message = match tool {
        Some(name) => json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": [{
            "id": format!("call_{digest}"), "type": "function",
            "function": {"name": name, "arguments": json!({"q": last}).to_string()}}]}),
        None => json!({"role": "assistant", "content": content, "refusal": null}),
    };
    let finish = match (tool, at_length) {
        (Some(_), _) => "tool_calls",
        (None, true) => "length",
        (None, false) => "stop",
    };
    // With `logprobs`, one token per 8-character piece of the content (the pieces a stream
    // sends), each with its log probability.
    let logprobs = match (req["logprobs"].as_bool(), message["content"].as_str()) {
        (Some(true), Some(text)) => json!({"content": pieces(text).iter().enumerate().map(|(t, p)| token_logprob(t, p))
            .collect::<Vec<Value>>(), "refusal": null}),
        _ => Value::Null,
    };
    let choices: Vec<Value> = (0..n)
        .map(|i| json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}))
        .collect();
    Ok(json!({
        "id": format!("chatcmpl-{digest}"),
        "object": "chat.completion",
        "created": 1_764_000_000u64,
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens * n,
                  "total_tokens": prompt_tokens + completion_tokens * n},
        "system_fingerprint": "fp_mock",
    }))
}

/// The mock's `t`-th token of an answer, with a log probability that is exact in binary.
fn token_logprob(t: usize, token: &str) -> Value {
    let logprob = -((t % 8) as f64) / 4.0;
    json!({"token": token, "logprob": logprob, "bytes": token.as_bytes(), "top_logprobs": []})
}

/// Requests and tokens per minute the mock's account has, as its `x-ratelimit-*` say.
pub const RATE_LIMIT_REQUESTS: u64 = 30_000;
pub const RATE_LIMIT_TOKENS: u64 = 150_000_000;

/// OpenAI's rate-limit headers on an answer: the account's limits, and what is left after
/// `calls` calls (each counted as 1,000 tokens).
fn rate_limit_headers(resp: &mut Response<Body>, calls: u64) {
    let h = resp.headers_mut();
    let pairs = [
        ("x-ratelimit-limit-requests", RATE_LIMIT_REQUESTS.to_string()),
        ("x-ratelimit-remaining-requests", RATE_LIMIT_REQUESTS.saturating_sub(calls).to_string()),
        ("x-ratelimit-reset-requests", "2ms".to_owned()),
        ("x-ratelimit-limit-tokens", RATE_LIMIT_TOKENS.to_string()),
        ("x-ratelimit-remaining-tokens", RATE_LIMIT_TOKENS.saturating_sub(calls * 1000).to_string()),
        ("x-ratelimit-reset-tokens", "0s".to_owned()),
    ];
    for (name, value) in pairs {
        if let Ok(v) = hyper::header::HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    }
}

/// Sets each of `pairs` on `resp`, in place of any before.
fn set_headers(resp: &mut Response<Body>, pairs: &[(&'static str, String)]) {
    for (name, value) in pairs {
        if let Ok(v) = hyper::header::HeaderValue::from_str(value) {
            resp.headers_mut().insert(*name, v);
        }
    }
}
