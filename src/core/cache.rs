//! The bounded response cache: `cache.max_entries` fixed slots in shared data. A key
//! digest picks the slot; the slot holds the full key, so a collision is a miss (and the
//! newer answer replaces the older). Nothing here creates a key per prompt.

use super::codec;
use super::config::Config;
use super::request::Key;
use super::store::{self, CasStore};

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

/// A key may live in any of this many consecutive slots from its home slot, so two hot
/// prompts whose home slots collide do not evict each other forever.
pub const WAYS: u32 = 4;

/// The slots `key` may occupy, home slot first.
pub fn slot_keys(config: &Config, key: &Key) -> Vec<String> {
    let n = config.cache.max_entries.max(1);
    let home = key.slot(n, 0);
    (0..WAYS.min(n)).map(|w| store::slot_name("holysheep/cache/", (home + w) % n)).collect()
}

/// The entry stored for `key`, fresh or not; `None` when none of its slots holds it.
pub fn get(store: &impl CasStore, config: &Config, key: &Key) -> Option<Entry> {
    probe(store, config, key).entry
}

/// What one read of a key's slots found: its entry, and the slot a new answer for it
/// would go to (see `victim`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub entry: Option<Entry>,
    pub victim: String,
}

/// Reads `key`'s slots in order, up to the one that holds it or the first empty one (the
/// ways fill in order, so nothing lies beyond an empty one).
pub fn probe(store: &impl CasStore, config: &Config, key: &Key) -> Probe {
    let slots = slot_keys(config, key);
    let mut best: Option<(u64, &String)> = None;
    for slot in &slots {
        let raw = store.get(slot).ok().and_then(|r| r.value);
        let found = raw.as_deref().and_then(meta);
        let rank = match found {
            // Only the entry that holds this key is decoded whole (its body copied).
            Some((k, _)) if k == *key => {
                return Probe { entry: raw.as_deref().and_then(decode), victim: slot.clone() };
            }
            None => return Probe { entry: None, victim: slot.clone() },
            Some((_, expires_ms)) => expires_ms.max(1),
        };
        if best.is_none_or(|(r, _)| rank < r) {
            best = Some((rank, slot));
        }
    }
    let victim = best.map_or_else(|| slots.first().cloned().unwrap_or_default(), |(_, s)| s.clone());
    Probe { entry: None, victim }
}

/// An entry's key and expiry, without copying its body.
fn meta(raw: &[u8]) -> Option<(Key, u64)> {
    let (f, _) = codec::decode(raw, 4)?;
    if f[0] != "C" {
        return None;
    }
    let expires_ms = codec::number(f[2])?.saturating_add(codec::number(f[3])?);
    Some((Key::from_hex(f[1])?, expires_ms))
}

fn decode(raw: &[u8]) -> Option<Entry> {
    let (f, body) = codec::decode(raw, 6)?;
    if f[0] != "C" {
        return None;
    }
    let key = Key::from_hex(f[1])?;
    Some(Entry {
        key,
        stored_at_ms: codec::number(f[2])?,
        ttl_ms: codec::number(f[3])?,
        response: Response {
            status: 200,
            content_type: f[4].to_owned(),
            headers: codec::parse_headers(f[5]),
            body: body.to_vec(),
        },
    })
}

/// Stores a 200 answer unless it is larger than `cache.max_entry_bytes`, in `slot` when
/// the caller already probed for one (a MISS read the slots when it arrived), else where
/// `probe` says. Last writer wins.
pub fn put(
    store: &impl CasStore,
    config: &Config,
    key: &Key,
    response: &Response,
    now_ms: u64,
    slot: Option<&str>,
) -> bool {
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
    let victim = match slot {
        Some(s) => s.to_owned(),
        None => probe(store, config, key).victim,
    };
    store.set(&victim, &value, None).is_ok()
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
    fn keys_sharing_a_home_slot_are_both_kept_and_the_table_stays_bounded() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"cache":{"max_entries":8}}"#).unwrap());
        let keys: Vec<Key> = (0..64u32).map(|i| request_key("/p", "s", &i.to_le_bytes())).collect();
        let (a, b) = keys
            .iter()
            .enumerate()
            .find_map(|(i, a)| keys[i + 1..].iter().find(|b| b.slot(8, 0) == a.slot(8, 0)).map(|b| (a, b)))
            .expect("two keys with one home slot");
        assert!(put(&s, &c, a, &ok("a"), 0, None) && put(&s, &c, b, &ok("b"), 1, None));
        assert_eq!(get(&s, &c, a).map(|e| e.response.body), Some(b"a".to_vec()), "not evicted by its neighbour");
        assert_eq!(get(&s, &c, b).map(|e| e.response.body), Some(b"b".to_vec()));
        for (i, k) in keys.iter().enumerate() {
            put(&s, &c, k, &ok("x"), 10 + i as u64, None);
        }
        assert!(s.key_count() <= 8, "{} keys", s.key_count());
        assert_eq!(get(&s, &c, &keys[63]).map(|e| e.key), Some(keys[63].clone()), "the newest is there");
    }

    #[test]
    fn put_then_get_and_freshness() {
        let (s, c) = (MemStore::new(), Config::default());
        let k = request_key("/p", "s", b"1");
        assert!(get(&s, &c, &k).is_none());
        assert!(put(&s, &c, &k, &ok("{}"), 1000, None));
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
        assert!(!put(&s, &c, &k, &ok("12345"), 0, None));
        let mut err = ok("{}");
        err.status = 500;
        assert!(!put(&s, &c, &k, &err, 0, None));
        assert_eq!(s.key_count(), 0);
    }

    #[test]
    fn the_table_never_exceeds_its_slots_and_collisions_miss() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.cache.max_entries = 8;
        let keys: Vec<Key> = (0..500).map(|i| request_key("/p", "s", format!("{i}").as_bytes())).collect();
        for k in &keys {
            assert!(put(&s, &c, k, &ok("{}"), 0, None));
        }
        assert!(s.key_count() <= 8);
        let found = keys.iter().filter(|k| get(&s, &c, k).is_some()).count();
        assert_eq!(found, s.key_count(), "each slot answers only for the key it holds");
    }
}
