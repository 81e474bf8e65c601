//! The bounded response cache: `cache.max_entries` fixed slots in shared data. A key
//! digest picks the slot; the slot holds the full key, so a collision is a miss (and the
//! newer answer replaces the older). Nothing here creates a key per prompt.

use super::codec;
use super::config::Config;
use super::request::Key;
use super::store::CasStore;

/// An upstream answer as the edge keeps and replays it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: String,
    /// Headers replayed with the answer (`retry-after`, `x-holysheep-model`, ...).
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(status: u16, body: Vec<u8>) -> Response {
        Response { status, content_type: "application/json".into(), headers: Vec::new(), body }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn with_header(mut self, name: &str, value: String) -> Response {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        self.headers.push((name.to_owned(), value));
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: Key,
    pub stored_at_ms: u64,
    pub ttl_ms: u64,
    pub response: Response,
}

impl Entry {
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.stored_at_ms)
    }

    pub fn is_fresh(&self, now_ms: u64) -> bool {
        self.age_ms(now_ms) < self.ttl_ms
    }
}

pub fn slot_key(config: &Config, key: &Key) -> String {
    format!("holysheep/cache/{}", key.slot(config.cache.max_entries, 0))
}

/// The entry stored for `key`, fresh or not; `None` when the slot holds another key.
pub fn get(store: &impl CasStore, config: &Config, key: &Key) -> Option<Entry> {
    let raw = store.get(&slot_key(config, key)).ok()?.value?;
    let (f, body) = codec::decode(&raw, 6)?;
    if f[0] != "C" || f[1] != key.hex() {
        return None;
    }
    Some(Entry {
        key: key.clone(),
        stored_at_ms: f[2].parse().ok()?,
        ttl_ms: f[3].parse().ok()?,
        response: Response {
            status: 200,
            content_type: f[4].to_owned(),
            headers: codec::parse_headers(f[5]),
            body: body.to_vec(),
        },
    })
}

/// Stores a 200 answer unless it is larger than `cache.max_entry_bytes`. Last writer wins.
pub fn put(store: &impl CasStore, config: &Config, key: &Key, response: &Response, now_ms: u64) -> bool {
    if response.status != 200 || response.body.len() > config.cache.max_entry_bytes {
        return false;
    }
    let ttl_ms = config.cache.ttl_seconds.saturating_mul(1000);
    let value = codec::encode(
        &[
            "C",
            key.hex(),
            &now_ms.to_string(),
            &ttl_ms.to_string(),
            &codec::field(&response.content_type),
            &codec::headers_field(&response.headers),
        ],
        &response.body,
    );
    store.set(&slot_key(config, key), &value, None).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::request::request_key;
    use crate::core::store::MemStore;

    pub fn ok(body: &str) -> Response {
        Response::json(200, body.into()).with_header("x-holysheep-model", "m".into())
    }

    #[test]
    fn put_then_get_and_freshness() {
        let (s, c) = (MemStore::new(), Config::default());
        let k = request_key("/p", "s", b"1");
        assert!(get(&s, &c, &k).is_none());
        assert!(put(&s, &c, &k, &ok("{}"), 1000));
        let e = get(&s, &c, &k).unwrap();
        assert_eq!(e.response, ok("{}"));
        assert!(e.is_fresh(1000 + 3_599_999));
        assert!(!e.is_fresh(1000 + 3_600_000));
    }

    #[test]
    fn errors_and_oversized_bodies_are_not_stored() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.cache.max_entry_bytes = 4;
        let k = request_key("/p", "s", b"1");
        assert!(!put(&s, &c, &k, &ok("12345"), 0));
        let mut err = ok("{}");
        err.status = 500;
        assert!(!put(&s, &c, &k, &err, 0));
        assert_eq!(s.key_count(), 0);
    }

    #[test]
    fn the_table_never_exceeds_its_slots_and_collisions_miss() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.cache.max_entries = 8;
        let keys: Vec<Key> = (0..500).map(|i| request_key("/p", "s", format!("{i}").as_bytes())).collect();
        for k in &keys {
            assert!(put(&s, &c, k, &ok("{}"), 0));
        }
        assert!(s.key_count() <= 8);
        let found = keys.iter().filter(|k| get(&s, &c, k).is_some()).count();
        assert_eq!(found, s.key_count(), "each slot answers only for the key it holds");
    }
}
