//! Answers in OpenAI's shapes: JSON, the error object, the model list, a key as a 401
//! quotes it.

use crate::Body;
use http_body_util::{Either, Full};
use hyper::body::Bytes;
use hyper::{Response, StatusCode};
use serde_json::{json, Value};

/// A key as OpenAI's 401 quotes it: its first three and last four characters.
pub fn quoted(key: &str) -> String {
    let chars: Vec<char> = key.chars().collect();
    if chars.len() <= 8 {
        return "*".repeat(chars.len());
    }
    let (head, tail): (String, String) = (chars[..3].iter().collect(), chars[chars.len() - 4..].iter().collect());
    format!("{head}{}{tail}", "*".repeat(chars.len() - 7))
}

pub(crate) fn models() -> Value {
    let ids = ["gpt-4.1", "claude-sonnet-4", "gemini-2.5-flash", "deepseek-v3"];
    let data: Vec<Value> = ids
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": 1_764_000_000u64, "owned_by": "holysheep"}))
        .collect();
    json!({"object": "list", "data": data})
}

pub(crate) fn error(status: StatusCode, message: &str, kind: &str, code: &str, param: Option<&str>) -> Response<Body> {
    json_response(status, &json!({"error": {"message": message, "type": kind, "param": param, "code": code}}))
}

pub(crate) fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(v.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("application/json"));
    r
}
