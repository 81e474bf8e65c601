//! A worker's own copies of answers it served, found by the request's raw bytes (the
//! tenant's credentials and the body exactly as they arrived): a repeated request skips
//! parsing, canonicalising, hashing and the copy out of the shared store. Cache entries
//! never change within their TTL, so a copy is as good as the entry until it expires. A
//! hit compares the bytes, never only their hash. Bounded by the bytes it holds.

use crate::core::wire::bytes;
use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::rc::Rc;

/// The most bytes a table of parsed requests holds (when `cache.hot_bytes` allows as much).
pub const PARSED_BYTES: usize = 1 << 20;

pub struct Hot<T> {
    max_bytes: usize,
    bytes: usize,
    slots: HashMap<u64, Slot<T>, BuildHasherDefault<Prehashed>>,
    /// Insertion order, for eviction (oldest first).
    order: VecDeque<u64>,
}

/// The slots' keys are already seeded hashes of the bytes: the table takes them as they are
/// instead of hashing them again.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A request's raw bytes (the tenant's, and the body) with their hash, taken once per
/// request for every table that keeps things by them.
pub struct Raw<'a> {
    pub tenant: &'a [u8],
    pub body: &'a [u8],
    hash: u64,
}

/// The secret every per-worker table of a worker (or an instance) hashes with, drawn once,
/// so that a client cannot aim requests at one slot.
pub struct Seed(u64);

impl Seed {
    pub fn new(secret: u64) -> Seed {
        Seed(secret)
    }

    pub fn raw<'a>(&self, tenant: &'a [u8], body: &'a [u8]) -> Raw<'a> {
        let mut hasher = DefaultHasher::new();
        hasher.write_u64(self.0);
        (tenant, body).hash(&mut hasher);
        Raw { tenant, body, hash: hasher.finish() }
    }
}

struct Slot<T> {
    tenant: Vec<u8>,
    body: Vec<u8>,
    expires_ms: u64,
    size: usize,
    value: Rc<T>,
}

/// The bytes that identify a caller's scope: `authorization` and the tenant header, each
/// present or not (an unambiguous encoding, so two different pairs never match).
pub(crate) fn tenant_bytes(authorization: Option<&str>, tenant: Option<&str>) -> Vec<u8> {
    let size = |v: Option<&str>| v.map_or(1, |s| 9 + s.len());
    let mut out = Vec::with_capacity(size(authorization) + size(tenant));
    for v in [authorization, tenant] {
        match v {
            None => out.push(0),
            Some(s) => {
                out.push(1);
                out.extend_from_slice(&(s.len() as u64).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
        }
    }
    out
}

impl<T> Hot<T> {
    /// `max_bytes` of requests and answers (0: keep nothing).
    pub fn new(max_bytes: usize) -> Hot<T> {
        Hot { max_bytes, bytes: 0, slots: HashMap::default(), order: VecDeque::new() }
    }

    /// Whether it keeps anything at all.
    pub fn keeps(&self) -> bool {
        self.max_bytes > 0
    }

    /// The copy kept for exactly these bytes, while it is fresh.
    pub fn get(&self, raw: &Raw<'_>, now_ms: u64) -> Option<Rc<T>> {
        let slot = self.slots.get(&raw.hash)?;
        let same =
            slot.expires_ms > now_ms && bytes::same(&slot.body, raw.body) && bytes::same(&slot.tenant, raw.tenant);
        same.then(|| slot.value.clone())
    }

    /// Keeps `value` for these bytes until `expires_ms`; `size` is what the value holds.
    /// The oldest copies make room; one larger than the whole bound is not kept.
    pub fn put(&mut self, raw: &Raw<'_>, expires_ms: u64, size: usize, value: T) {
        let size = size + raw.tenant.len() + raw.body.len();
        if size > self.max_bytes {
            return;
        }
        let h = raw.hash;
        self.remove(h);
        while self.bytes + size > self.max_bytes {
            let Some(old) = self.order.pop_front() else { break };
            self.forget(old);
        }
        let slot =
            Slot { tenant: raw.tenant.to_vec(), body: raw.body.to_vec(), expires_ms, size, value: Rc::new(value) };
        self.slots.insert(h, slot);
        self.order.push_back(h);
        self.bytes += size;
    }

    /// Drops the copy under `h`, wherever it stands in the eviction order.
    fn remove(&mut self, h: u64) {
        if self.forget(h) {
            self.order.retain(|o| *o != h);
        }
    }

    /// Drops the copy under `h` (already out of the eviction order, or about to be);
    /// whether there was one.
    fn forget(&mut self, h: u64) -> bool {
        let Some(old) = self.slots.remove(&h) else { return false };
        self.bytes -= old.size;
        true
    }

    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_bytes_of_the_same_tenant_match_and_only_while_fresh() {
        let (mut hot, seed) = (Hot::new(1 << 20), Seed::new(7));
        let (alice, bob) = (tenant_bytes(Some("Bearer alice"), None), tenant_bytes(Some("Bearer bob"), None));
        hot.put(&seed.raw(&alice, b"{\"a\":1}"), 100, 10, "answer");
        assert_eq!(hot.get(&seed.raw(&alice, b"{\"a\":1}"), 99).as_deref(), Some(&"answer"));
        assert_eq!(hot.get(&seed.raw(&alice, b"{\"a\":1}"), 100), None, "expired");
        assert_eq!(hot.get(&seed.raw(&alice, b"{\"a\": 1}"), 0), None, "other bytes");
        assert_eq!(hot.get(&seed.raw(&bob, b"{\"a\":1}"), 0), None, "other tenant");
        assert_ne!(tenant_bytes(Some(""), None), tenant_bytes(None, None));
        assert_ne!(tenant_bytes(Some("ab"), Some("c")), tenant_bytes(Some("a"), Some("bc")));
    }

    #[test]
    fn the_same_bytes_hash_apart_under_another_secret() {
        let t = tenant_bytes(None, None);
        assert_eq!(Seed::new(7).raw(&t, b"x").hash, Seed::new(7).raw(&t, b"x").hash);
        assert_ne!(Seed::new(7).raw(&t, b"x").hash, Seed::new(8).raw(&t, b"x").hash);
    }

    #[test]
    fn the_bytes_held_stay_within_the_bound() {
        let (mut hot, seed) = (Hot::new(1000), Seed::new(7));
        let t = tenant_bytes(None, None);
        for i in 0..100u32 {
            hot.put(&seed.raw(&t, &i.to_le_bytes()), u64::MAX, 90, i);
            assert!(hot.bytes() <= 1000, "{} bytes", hot.bytes());
        }
        assert_eq!(hot.get(&seed.raw(&t, &99u32.to_le_bytes()), 0).as_deref(), Some(&99), "the newest is kept");
        assert_eq!(hot.get(&seed.raw(&t, &0u32.to_le_bytes()), 0), None, "the oldest made room");
        hot.put(&seed.raw(&t, b"huge"), u64::MAX, 5000, 7);
        assert_eq!(hot.get(&seed.raw(&t, b"huge"), 0), None, "larger than the bound: not kept");
        let mut off = Hot::new(0);
        off.put(&seed.raw(&t, b"x"), u64::MAX, 0, 1);
        assert_eq!(off.get(&seed.raw(&t, b"x"), 0), None, "0 keeps nothing");
    }
}
