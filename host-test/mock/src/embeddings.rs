//! The mock's `/v1/embeddings`: deterministic vectors with a similarity tests can reason
//! about. A text is its set of words: lowercase runs of letters and digits (case,
//! punctuation, repetition and word order do not count). Each word adds ±1 on one
//! dimension chosen by its SHA-256, and the vector is scaled to unit length, so two texts
//! with word sets A and B have cosine similarity |A ∩ B| / √(|A| · |B|) (exactly, for words
//! on distinct dimensions; `similarity` computes it from the vectors themselves).
//! "What is the capital of France?" and "what is the capital of france" are 1.0 apart;
//! "What is the capital of France, please?" is 6/√42 ≈ 0.926 from both.

use crate::faults::{planned_body, planned_error};
use crate::reply::{error, json_response};
use crate::{Body, Mock};
use hyper::{Response, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// `text-embedding-3-small`'s length, for a request that names no `dimensions`.
pub const DEFAULT_DIMENSIONS: usize = 1536;

/// The distinct words of `text`, in order of first appearance.
pub fn words(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for w in text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()) {
        let w = w.to_lowercase();
        if !out.contains(&w) {
            out.push(w);
        }
    }
    out
}

/// The mock's embedding of `text` in `dims` dimensions.
pub fn embed(text: &str, dims: usize) -> Vec<f32> {
    let mut v = vec![0f32; dims.max(1)];
    for w in words(text) {
        let h = Sha256::digest(w.as_bytes());
        let at = (u64::from_be_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]]) % v.len() as u64) as usize;
        v[at] += if h[8] & 1 == 0 { 1.0 } else { -1.0 };
    }
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// The cosine similarity of two texts' embeddings, as the mock computes them.
pub fn similarity(a: &str, b: &str, dims: usize) -> f32 {
    embed(a, dims).iter().zip(embed(b, dims)).map(|(x, y)| x * y).sum()
}

/// The answer to an embeddings request: OpenAI's list shape, one token per distinct word
/// of each input (at least one) in `usage`; `Err` with a message for a request OpenAI would refuse (400).
pub fn answer(req: &Value) -> Result<Value, String> {
    let model = req["model"].as_str().ok_or("missing required parameter: 'model'")?;
    let inputs: Vec<&str> = match &req["input"] {
        Value::String(s) => vec![s.as_str()],
        Value::Array(items) => items.iter().filter_map(Value::as_str).collect(),
        _ => return Err("'input' must be a string or an array of strings".into()),
    };
    if inputs.is_empty() || inputs.iter().any(|s| s.is_empty()) {
        return Err("'input' must not be empty".into());
    }
    let dims = match req.get("dimensions").and_then(Value::as_u64) {
        Some(d) if (1..=3072).contains(&d) => d as usize,
        Some(_) => return Err("'dimensions' must be between 1 and 3072".into()),
        None if model.ends_with("-large") => 3072,
        None => DEFAULT_DIMENSIONS,
    };
    let tokens: usize = inputs.iter().map(|t| words(t).len().max(1)).sum();
    let base64 = req["encoding_format"].as_str() == Some("base64");
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let v = embed(t, dims);
            let embedding = if base64 { json!(base64_of(&v)) } else { json!(v) };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(json!({"object": "list", "data": data, "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))
}

/// A vector as OpenAI's `encoding_format: base64` sends it: its little-endian `f32`s in
/// standard base64 with padding.
fn base64_of(v: &[f32]) -> String {
    const DIGITS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            let digit = DIGITS[(n >> (18 - 6 * i) & 63) as usize] as char;
            out.push(if i <= chunk.len() { digit } else { '=' });
        }
    }
    out
}

impl Mock {
    /// `/v1/embeddings` (see `embeddings`), with the key checked, the latency and the
    /// planned faults (`status`, `delay_ms`, `reset`, `body`) as for chat calls.
    pub(crate) async fn embed(self, auth: Option<String>, body: &[u8]) -> Result<Response<Body>, std::io::Error> {
        let req = serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
        let (fault, latency) = {
            let mut s = self.state();
            s.embeddings += 1;
            s.embedding_inputs.push(req["input"].as_str().unwrap_or_default().to_owned());
            let count = req["input"].as_array().map_or(1, |a| if a.iter().all(Value::is_u64) { 1 } else { a.len() });
            s.embedding_batches.push(count);
            (s.embedding_plan.pop_front().unwrap_or_default(), s.latency_ms)
        };
        if let Some(early) = self.before_answer(&fault, latency, auth.as_deref()).await {
            return early;
        }
        Ok(match (fault.status.filter(|s| *s != 200), &fault.body) {
            (status, Some(raw)) => planned_body(status.unwrap_or(200), raw, fault.content_type.as_deref()),
            (Some(status), None) => planned_error(status),
            (None, None) => match answer(&req) {
                Ok(v) => {
                    self.state().billed_at.push(("/v1/embeddings".to_owned(), v["usage"].clone()));
                    json_response(StatusCode::OK, &v)
                }
                Err(m) => error(StatusCode::BAD_REQUEST, &m, "invalid_request_error", "invalid_value", Some("input")),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_similarities_hold() {
        let d = DEFAULT_DIMENSIONS;
        let s = |a, b| similarity(a, b, d);
        assert!((s("What is the capital of France?", "what is the capital of france") - 1.0).abs() < 1e-6);
        let please = s("What is the capital of France?", "What is the capital of France, please?");
        assert!((please - 6.0 / 42f32.sqrt()).abs() < 1e-6, "{please}");
        assert!(s("capital of France", "boiling point of water").abs() < 0.34);
        let a = answer(&json!({"model": "text-embedding-3-small", "input": "a b", "dimensions": 8})).unwrap();
        assert_eq!((a["data"][0]["embedding"].as_array().unwrap().len(), &a["usage"]["prompt_tokens"]), (8, &json!(2)));
        assert!(answer(&json!({"model": "m", "input": ""})).is_err());
        assert_eq!(base64_of(&[0.5, -2.0, 1.0]), "AAAAPwAAAMAAAIA/");
        assert_eq!(base64_of(&[]), "");
        let b = answer(&json!({"model": "m", "input": "a", "dimensions": 2, "encoding_format": "base64"})).unwrap();
        assert_eq!(b["data"][0]["embedding"].as_str().map(str::len), Some(12), "two f32s, padded");
    }
}
