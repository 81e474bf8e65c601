//! Embeddings: the request HolySheep's `/v1/embeddings` takes, its answer read, and vectors
//! quantized to one signed byte per dimension, compared by cosine similarity.

use crate::core::config::Config;
use crate::core::wire::json;
use crate::core::wire::scan::{self, Json};
use crate::core::wire::write;
use serde_json::Value;

use crate::core::config::MAX_DIMENSIONS;

/// A unit direction quantized to `i8` per dimension (its largest component at ±127), with
/// the length of the quantized vector. Cosine similarity ignores scale, so the quantized
/// vectors compare as the originals do, to within about 1% of a unit's worth.
#[derive(Debug, Clone, PartialEq)]
pub struct Vector {
    values: Vec<i8>,
    norm: f32,
}

impl Vector {
    /// `None` for an empty, over-long, all-zero or non-finite vector.
    pub(crate) fn quantize(x: &[f32]) -> Option<Vector> {
        if x.is_empty() || x.len() > MAX_DIMENSIONS as usize || x.iter().any(|v| !v.is_finite()) {
            return None;
        }
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        if max == 0.0 {
            return None;
        }
        let values: Vec<i8> = x.iter().map(|v| (v / max * 127.0).round().clamp(-127.0, 127.0) as i8).collect();
        Some(Vector::of(values))
    }

    /// Quantized values as stored.
    pub fn of(values: Vec<i8>) -> Vector {
        let norm = (values.iter().map(|&v| i32::from(v) * i32::from(v)).sum::<i32>() as f32).sqrt();
        Vector { values, norm }
    }

    pub fn values(&self) -> &[i8] {
        &self.values
    }

    /// The values as stored, one byte each.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.values.iter().map(|&v| v as u8).collect()
    }

    pub(crate) fn norm(&self) -> f32 {
        self.norm
    }

    /// Cosine similarity with stored values (`to_bytes`) of the same length and their norm.
    pub(crate) fn cosine(&self, stored: &[u8], norm: f32) -> f32 {
        if stored.len() != self.values.len() || norm == 0.0 || self.norm == 0.0 {
            return 0.0;
        }
        // At most 4096 · 127² (6.6e7): an i32 holds it.
        let dot: i32 = self.values.iter().zip(stored).map(|(&a, &b)| i32::from(a) * i32::from(b as i8)).sum();
        dot as f32 / (self.norm * norm)
    }
}

/// The body of the embedding call for `text`. The vector comes back as base64 of
/// little-endian `f32`s (OpenAI's `encoding_format: base64`, which its SDKs ask for):
/// a quarter of the bytes of the JSON numbers, and no float parsing.
pub fn embedding_body(config: &Config, text: &str) -> Vec<u8> {
    let s = &config.semantic;
    let mut body = json::object([
        ("model", Value::from(s.embedding_model.as_str())),
        ("input", Value::from(text)),
        ("encoding_format", Value::from("base64")),
    ]);
    if let (Some(d), Some(members)) = (s.dimensions, body.as_object_mut()) {
        members.insert("dimensions".into(), Value::from(d));
    }
    write::value(&body)
}

/// An embedding call's answer: the question's vector and the tokens it was billed.
#[derive(Debug, Clone, PartialEq)]
pub struct Embedding {
    pub vector: Vector,
    /// The tokens its `usage` reports (`None`: the answer says nothing of what it cost).
    pub tokens: Option<u64>,
}

/// A vector as JSON numbers, or as base64 of little-endian `f32`s.
fn floats(values: Json<'_>) -> Option<Vec<f32>> {
    if values.is_array() {
        return values.items().map(|v| v.as_f64().map(|v| v as f32)).collect();
    }
    let bytes = crate::core::wire::base64::decode(&values.as_str()?)?;
    let floats = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    (bytes.len() % 4 == 0).then(|| floats.collect())
}

/// The vector of a 200 answer of one embedding (`None`: an error, or no usable vector).
/// Its length must be `dimensions` when that is configured.
pub fn parse_embedding(config: &Config, status: u16, body: &[u8]) -> Option<Embedding> {
    if status != 200 {
        return None;
    }
    let [data, usage] = scan::read_fields(body, ["data", "usage"])?;
    let data = data.filter(|d| d.is_array())?;
    let mut items = data.items();
    let (Some(item), None) = (items.next(), items.next()) else { return None };
    let [embedding] = item.fields(["embedding"])?;
    let values = floats(embedding?)?;
    let tokens = match usage {
        None => None,
        Some(usage) => match usage.fields(["prompt_tokens"])? {
            [None] => None,
            [Some(tokens)] => Some(tokens.as_u64()?),
        },
    };
    let wanted = config.semantic.dimensions.map(|d| d as usize);
    if wanted.is_some_and(|d| d != values.len()) {
        return None;
    }
    Some(Embedding { vector: Vector::quantize(&values)?, tokens })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cos(a: &[f32], b: &[f32]) -> f32 {
        let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        dot / (n(a) * n(b))
    }

    #[test]
    fn quantized_vectors_compare_as_the_originals_do() {
        // Deterministic pseudo-random vectors of 1536 dimensions, and a near copy of each.
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        for _ in 0..20 {
            let a: Vec<f32> = (0..1536).map(|_| next()).collect();
            let b: Vec<f32> = a.iter().map(|x| x + 0.1 * next()).collect();
            let (qa, qb) = (Vector::quantize(&a).unwrap(), Vector::quantize(&b).unwrap());
            let (exact, quantized) = (cos(&a, &b), qa.cosine(&qb.to_bytes(), qb.norm()));
            assert!((exact - quantized).abs() < 0.01, "{exact} vs {quantized}");
        }
        let v = Vector::quantize(&[0.5, -0.5, 0.0]).unwrap();
        assert_eq!(v.values(), [127, -127, 0]);
        assert!((v.cosine(&v.to_bytes(), v.norm()) - 1.0).abs() < 1e-6);
        assert_eq!(v.cosine(&[1, 2], 2.2), 0.0, "another length is no match");
    }

    #[test]
    fn unusable_vectors_are_refused() {
        assert!(Vector::quantize(&[]).is_none());
        assert!(Vector::quantize(&[0.0, 0.0]).is_none());
        assert!(Vector::quantize(&[f32::NAN]).is_none());
        assert!(Vector::quantize(&vec![0.1; 4097]).is_none());
    }

    #[test]
    fn an_embedding_answer_is_read_and_checked() {
        let c = Config::parse(br#"{"semantic":{"dimensions":3}}"#).unwrap();
        let ok = br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2,0.3]}],
            "model":"text-embedding-3-small","usage":{"prompt_tokens":5,"total_tokens":5}}"#;
        let e = parse_embedding(&c, 200, ok).unwrap();
        assert_eq!((e.tokens, e.vector.values().len()), (Some(5), 3));
        assert!(parse_embedding(&c, 429, ok).is_none());
        assert!(parse_embedding(&c, 200, br#"{"data":[{"embedding":[0.1,0.2]}]}"#).is_none(), "wrong length");
        assert!(parse_embedding(&c, 200, br#"{"data":[]}"#).is_none());
        assert!(parse_embedding(&c, 200, b"<html>").is_none());
        let body: serde_json::Value = serde_json::from_slice(&embedding_body(&c, "hi")).unwrap();
        assert_eq!(
            body,
            json!({"model": "text-embedding-3-small", "input": "hi", "encoding_format": "base64",
            "dimensions": 3})
        );
        // [0.5, -2.0, 1.0] as little-endian f32s, in base64 (as OpenAI sends them).
        let b64 = br#"{"data":[{"embedding":"AAAAPwAAAMAAAIA/"}],"usage":{"prompt_tokens":1}}"#;
        let e = parse_embedding(&c, 200, b64).unwrap();
        assert_eq!(e.vector.values(), [32, -127, 64]);
        for bad in ["AAAAPwAAAMAAAIA", "AAAA*wAAAMAAAIA/", "AAAAPwAAAMA"] {
            let body = format!(r#"{{"data":[{{"embedding":"{bad}"}}]}}"#);
            assert!(parse_embedding(&c, 200, body.as_bytes()).is_none(), "{bad}");
        }
    }
}
