//! etcd's v3 JSON gateway, as far as the command line needs it: reads of a key or a
//! prefix, and a write that lands only if a key is still at the revision read (with a
//! second write beside it, the audit record). Plain HTTP/1.0 over TCP: one request per
//! connection, the answer read to its end.

use holysheep_edge::core::wire::base64;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// An etcd client URL, `http://host:port`.
pub struct Etcd {
    host: String,
}

/// One key as etcd holds it.
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: u64,
}

impl Etcd {
    pub fn new(url: &str) -> Result<Etcd, String> {
        let host = url.strip_prefix("http://").ok_or_else(|| format!("{url}: an etcd URL is http://host:port"))?;
        Ok(Etcd { host: host.trim_end_matches('/').to_owned() })
    }

    /// `POST path` with a JSON body; the JSON answer.
    fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        let body = body.to_string();
        let mut conn = TcpStream::connect(&self.host).map_err(|e| format!("etcd at {}: {e}", self.host))?;
        conn.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
        let head = format!(
            "POST {path} HTTP/1.0\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.host,
            body.len()
        );
        conn.write_all(head.as_bytes()).and_then(|()| conn.write_all(body.as_bytes())).map_err(|e| e.to_string())?;
        let mut answer = Vec::new();
        conn.read_to_end(&mut answer).map_err(|e| format!("etcd at {}: {e}", self.host))?;
        let text = String::from_utf8_lossy(&answer);
        let (head, body) = text.split_once("\r\n\r\n").ok_or("etcd's answer has no body")?;
        let status = head.split_whitespace().nth(1).unwrap_or_default();
        if status != "200" {
            return Err(format!("etcd answered {status}: {}", body.trim()));
        }
        serde_json::from_str(body).map_err(|e| format!("etcd's answer is not JSON: {e}"))
    }

    /// The key, if etcd holds it.
    pub fn get(&self, key: &str) -> Result<Option<Kv>, String> {
        Ok(self.range(key, None, 1)?.pop())
    }

    /// Every key under `prefix`, at most `limit`, in key order.
    pub fn list(&self, prefix: &str, limit: u64) -> Result<Vec<Kv>, String> {
        let end = next_prefix(prefix);
        self.range(prefix, Some(&end), limit)
    }

    /// The last `limit` keys under `prefix`, the last first.
    pub fn latest(&self, prefix: &str, limit: u64) -> Result<Vec<Kv>, String> {
        let end = next_prefix(prefix);
        self.range_sorted(prefix, Some(&end), limit, true)
    }

    fn range(&self, key: &str, end: Option<&str>, limit: u64) -> Result<Vec<Kv>, String> {
        self.range_sorted(key, end, limit, false)
    }

    fn range_sorted(&self, key: &str, end: Option<&str>, limit: u64, last_first: bool) -> Result<Vec<Kv>, String> {
        let mut body = json!({"key": base64::encode(key.as_bytes()), "limit": limit.to_string()});
        if let Some(end) = end {
            body["range_end"] = Value::from(base64::encode(end.as_bytes()));
        }
        if last_first {
            body["sort_order"] = Value::from("DESCEND");
            body["sort_target"] = Value::from("KEY");
        }
        let answer = self.post("/v3/kv/range", &body)?;
        let kvs = answer["kvs"].as_array().cloned().unwrap_or_default();
        kvs.iter().map(kv).collect()
    }

    /// Writes `puts` if `key` is still at `mod_revision` (0: absent), in one transaction;
    /// `false` when it changed meanwhile.
    pub fn put_if(&self, key: &str, mod_revision: u64, puts: &[(String, Vec<u8>)]) -> Result<bool, String> {
        let compare = json!({"key": base64::encode(key.as_bytes()), "target": "MOD", "result": "EQUAL",
            "mod_revision": mod_revision.to_string()});
        let success: Vec<Value> = puts
            .iter()
            .map(|(k, v)| json!({"request_put": {"key": base64::encode(k.as_bytes()), "value": base64::encode(v)}}))
            .collect();
        let answer = self.post("/v3/kv/txn", &json!({"compare": [compare], "success": success}))?;
        Ok(answer["succeeded"].as_bool() == Some(true))
    }

    /// Deletes `key` if it is still at `mod_revision`, and writes `puts` beside; `false`
    /// when it changed meanwhile.
    pub fn delete_if(&self, key: &str, mod_revision: u64, puts: &[(String, Vec<u8>)]) -> Result<bool, String> {
        let k = base64::encode(key.as_bytes());
        let compare = json!({"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision.to_string()});
        let mut success = vec![json!({"request_delete_range": {"key": k}})];
        success.extend(
            puts.iter().map(
                |(k, v)| json!({"request_put": {"key": base64::encode(k.as_bytes()), "value": base64::encode(v)}}),
            ),
        );
        let answer = self.post("/v3/kv/txn", &json!({"compare": [compare], "success": success}))?;
        Ok(answer["succeeded"].as_bool() == Some(true))
    }
}

fn kv(v: &Value) -> Result<Kv, String> {
    let decode = |f: &str| v[f].as_str().and_then(base64::decode).ok_or_else(|| format!("etcd's {f} is not base64"));
    let number = |f: &str| v[f].as_str().and_then(|s| s.parse().ok()).or_else(|| v[f].as_u64()).unwrap_or(0);
    let key = String::from_utf8(decode("key")?).map_err(|_| "a key that is not UTF-8".to_owned())?;
    let value = if v["value"].is_null() { Vec::new() } else { decode("value")? };
    Ok(Kv { key, value, mod_revision: number("mod_revision") })
}

/// The first key past every key that starts with `prefix` (its last byte plus one).
fn next_prefix(prefix: &str) -> String {
    let mut bytes = prefix.as_bytes().to_vec();
    if let Some(last) = bytes.last_mut() {
        *last = last.saturating_add(1);
    }
    String::from_utf8(bytes).unwrap_or_default()
}
