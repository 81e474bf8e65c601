//! The cache and its near copies: the bounded cache in shared data (this module), a worker's
//! own copies of what it served (`hot`), the edge tier's declarations to forward nodes
//! (`edge`) and embeddings item by item (`batch`). Uses `wire`, `api`, `store`, `config` and
//! `request`'s key.
//!
//! The bounded response cache: `cache.max_entries` fixed slots in shared data, four to a
//! group. A key digest picks the group; the group's index record says which key (by its
//! tag) each way holds and until when, so a lookup reads the index and at most the one
//! entry that may be the key's, and an answer goes to the way the index says, written by
//! compare-and-swap. The entry holds the full key, so a stale index is a miss, never a
//! wrong answer. Nothing here creates a key per prompt.
//!
//! Admission keeps what is asked again over what is asked once: an answer whose group is
//! full of other keys' fresh answers is stored only when its key missed into that group
//! before. The first time, its tag goes into the group's ghost record (the last `GHOSTS`
//! keys turned away) and the answer is not stored, so a scan of one-off prompts passes
//! through a full cache without flushing it. Ghost records are read only then. An answer's
//! first HIT read from the store marks its way *asked again* in the index (one write per
//! answer), and a new answer displaces the ways never asked again before the others.

pub(crate) mod batch;
pub mod edge;
pub mod hot;

use crate::core::api::key::Key;
use crate::core::api::response::Response;
use crate::core::config::Config;
use crate::core::store::{self, cas_after, CasStore, Read, StoreError, MAX_RACES};
use crate::core::wire::codec;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: Key,
    pub stored_at_ms: u64,
    pub ttl_ms: u64,
    pub response: Response,
}

impl Entry {
    pub(crate) fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.stored_at_ms)
    }

    pub fn is_fresh(&self, now_ms: u64) -> bool {
        self.age_ms(now_ms) < self.ttl_ms
    }
}

/// The ways of a group: a key may live in any of them, so two hot prompts of one group
/// do not evict each other forever.
pub(crate) const WAYS: u32 = 4;

/// The group `key` lives in, and how many ways groups have (`cache.max_entries` in groups
/// of four; fewer entries make one smaller group).
pub(crate) fn group_of(config: &Config, key: &Key) -> (u32, u32) {
    let n = config.cache.max_entries.max(1);
    let ways = WAYS.min(n);
    (key.slot(n / ways, 0), ways)
}

/// An index record: per way, the tag of the key stored there and its entry's expiry, 16
/// hex digits each, then a newline, or `ASKED_AGAIN` in its place once the answer was asked
/// for again (a HIT, or a key the ghost record let in); a way never stored in is blank.
/// Fixed widths let a store patch one way in place. (A reader that takes the last byte for
/// a newline only ever checked the record's length.)
const WAY_BYTES: usize = 33;
const BLANK_WAY: &[u8; WAY_BYTES] = b"                                \n";
/// The last byte of a way whose answer was asked for again since it was stored.
const ASKED_AGAIN: u8 = b'+';

/// Where an answer for a key goes: a way of its group, and the group's index as read
/// (so that storing needs no second read unless someone stored in the group since).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    group: u32,
    ways: u32,
    way: usize,
    /// The index as read, `ways` ways long (blank where unreadable).
    index: Vec<u8>,
    /// The CAS that writes over the index as read (see `store::cas_after`).
    cas: Option<u32>,
}

impl Place {
    fn entry_name(&self) -> String {
        store::slot_name("holysheep/cache/", self.group * self.ways + self.way as u32)
    }

    /// Whether the index names `key` in this place's way.
    fn holds(&self, key: &Key) -> bool {
        let at = self.way * WAY_BYTES;
        self.index.get(at..at + 16) == Some(key.tag().as_bytes())
    }

    /// Whether this place's way's answer was asked for again since it was stored.
    fn asked_again(&self) -> bool {
        self.index.get((self.way + 1) * WAY_BYTES - 1) == Some(&ASKED_AGAIN)
    }

    /// Whether this place's way holds another key's answer, fresh at `now_ms`.
    fn holds_fresh_other(&self, key: &Key, now_ms: u64) -> bool {
        let at = self.way * WAY_BYTES;
        let Some(way) = self.index.get(at..at + 32) else { return false };
        way[..16] != *key.tag().as_bytes() && codec::hex_number(&way[16..32]).is_some_and(|e| e > now_ms)
    }

    /// The index with `key` in this place's way, marked asked again when `asked_again` or
    /// when the way held `key` so marked already.
    fn with(&self, key: &Key, expires_ms: u64, asked_again: bool) -> Vec<u8> {
        let again = asked_again || (self.holds(key) && self.asked_again());
        let mut index = self.index.clone();
        if let Some(w) = index.get_mut(self.way * WAY_BYTES..(self.way + 1) * WAY_BYTES) {
            w[..16].copy_from_slice(key.tag().as_bytes().get(..16).unwrap_or(&[b' '; 16]));
            w[16..32].copy_from_slice(&codec::hex_fixed(expires_ms));
            w[32] = if again { ASKED_AGAIN } else { b'\n' };
        }
        index
    }
}

fn index_name(group: u32) -> String {
    store::slot_name("holysheep/cache/index/", group)
}

/// Keys a group remembers turning away: enough that a prompt asked again soon after a scan
/// through its group is still known.
const GHOSTS: usize = 8;
/// Bytes of a key's tag in the index and in a ghost record.
const TAG_BYTES: usize = 16;

fn ghost_name(group: u32) -> String {
    store::slot_name("holysheep/cache/ghost/", group)
}

/// Whether `key` was turned away from `group` before. Either way the record learns it: a key
/// it names is taken out (it is admitted now), another goes in first, the oldest out. A write
/// lost to a race is not retried: the ghost record is a hint, and losing one only turns a
/// key away once more.
fn asked_before(store: &impl CasStore, group: u32, key: &Key) -> bool {
    let name = ghost_name(group);
    let r = store.get(&name).unwrap_or(Read { value: None, cas: None });
    let tag = key.tag().as_bytes().get(..TAG_BYTES).unwrap_or_default();
    let old = r.value.as_deref().unwrap_or_default();
    let tags = old.chunks_exact(TAG_BYTES).filter(|t| *t != tag);
    let known = old.chunks_exact(TAG_BYTES).any(|t| t == tag);
    let mut next = Vec::with_capacity(GHOSTS * TAG_BYTES);
    if !known {
        next.extend_from_slice(tag);
    }
    for t in tags.take(GHOSTS - usize::from(!known)) {
        next.extend_from_slice(t);
    }
    let _ = store.set(&name, &next, cas_after(&r));
    known
}

/// Whether an answer may take the way of another key's fresh answer (see the module's
/// admission): `Asked` for a flight's answer, `Never` for an item of a list that has already
/// displaced its share of the cache (`batch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Evict {
    Asked,
    Never,
}

/// Reads the index of `key`'s group and picks the way its answer goes to: the way that
/// holds it, else the first empty one, else the one that expires first.
fn place(store: &impl CasStore, config: &Config, key: &Key) -> Place {
    let (group, ways) = group_of(config, key);
    let r = store.get(&index_name(group)).unwrap_or(Read { value: None, cas: None });
    let size = ways as usize * WAY_BYTES;
    let index = match r.value.as_deref() {
        Some(v) if v.len() == size => v.to_vec(),
        _ => BLANK_WAY.repeat(ways as usize),
    };
    // Read for a lookup, the time does not matter: only the way that holds the key does.
    let way = choose(&index, ways as usize, key.tag().as_bytes(), 0);
    Place { group, ways, way, index, cas: cas_after(&r) }
}

/// The way of an index for the key tagged `tag`: the way that holds it, else the first
/// blank (or unreadable) one, else the one whose answer expired first by `now_ms`, else the
/// fresh one that expires first among those never asked again, else among the others. One
/// pass, nothing copied.
fn choose(index: &[u8], ways: usize, tag: &[u8], now_ms: u64) -> usize {
    let (mut blank, mut first) = (None, None::<((u8, u64), usize)>);
    for (i, way) in index.chunks_exact(WAY_BYTES).take(ways).enumerate() {
        if &way[..16] == tag {
            return i;
        }
        match codec::hex_number(&way[16..32]) {
            None => {
                blank.get_or_insert(i);
            }
            Some(expires_ms) => {
                let rank = match (expires_ms <= now_ms, way[32] == ASKED_AGAIN) {
                    (true, _) => 0,
                    (false, false) => 1,
                    (false, true) => 2,
                };
                if first.is_none_or(|(r, _)| (rank, expires_ms) < r) {
                    first = Some(((rank, expires_ms), i));
                }
            }
        }
    }
    blank.or(first.map(|(_, i)| i)).unwrap_or(0)
}

/// Marks the way `place` found its key in as asked again (its answer was a HIT), unless it
/// is already: one write per answer, on its first HIT read from the store. A write lost to a
/// race is not retried: the mark only orders what is displaced first.
pub(crate) fn asked_again(store: &impl CasStore, place: &Place) {
    if place.asked_again() {
        return;
    }
    let mut index = place.index.clone();
    if let Some(last) = index.get_mut((place.way + 1) * WAY_BYTES - 1) {
        *last = ASKED_AGAIN;
        let _ = store.set(&index_name(place.group), &index, place.cas);
    }
}

/// The entry stored for `key`, fresh or not; `None` when none of its slots holds it.
pub fn get(store: &impl CasStore, config: &Config, key: &Key) -> Option<Entry> {
    probe(store, config, key).entry
}

/// What one look at a key's group found: its entry, and where a new answer for it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Probe {
    pub entry: Option<Entry>,
    pub place: Place,
}

/// Reads `key`'s group index and, when the index names it, its entry.
pub(crate) fn probe(store: &impl CasStore, config: &Config, key: &Key) -> Probe {
    let place = place(store, config, key);
    let entry = if place.holds(key) {
        store.get(&place.entry_name()).ok().and_then(|r| r.value).and_then(|raw| decode(&raw)).filter(|e| e.key == *key)
    } else {
        None
    };
    Probe { entry, place }
}

fn decode(raw: &[u8]) -> Option<Entry> {
    let (f, body) = codec::decode::<6>(raw)?;
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

/// When an answer stored in the cache was produced, and how long it is fresh from then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fresh {
    pub stored_at_ms: u64,
    pub ttl_ms: u64,
}

impl Fresh {
    /// The cache's own: produced now, fresh for `cache.ttl_seconds`.
    pub fn of(config: &Config, now_ms: u64) -> Fresh {
        Fresh { stored_at_ms: now_ms, ttl_ms: config.cache.ttl_seconds.saturating_mul(1000) }
    }

    pub fn expires_ms(self) -> u64 {
        self.stored_at_ms.saturating_add(self.ttl_ms)
    }
}

/// An answer was stored; `evicted`: over another key's answer that was still fresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stored {
    pub evicted: bool,
}

/// Stores a 200 answer produced now, fresh for `cache.ttl_seconds` (see `store_fresh`).
pub(crate) fn put(
    store: &impl CasStore,
    config: &Config,
    key: &Key,
    response: &Response,
    now_ms: u64,
    evict: Evict,
) -> Option<Stored> {
    store_fresh(store, config, key, response, Fresh::of(config, now_ms), now_ms, None, evict)
}

/// Stores a 200 answer unless it is larger than `cache.max_entry_bytes`, or its group is full
/// of fresh answers and it may not take one's way (the module's admission), at `place` when
/// the caller already read the group (a MISS read it when it arrived), else where the
/// index says now. The index is written first, by CAS (a lost race reads it again and
/// picks again), then the entry. Last writer wins.
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_fresh(
    store: &impl CasStore,
    config: &Config,
    key: &Key,
    response: &Response,
    fresh: Fresh,
    now_ms: u64,
    place: Option<&Place>,
    evict: Evict,
) -> Option<Stored> {
    if response.status != 200 || response.body.len() > config.cache.max_entry_bytes {
        return None;
    }
    let value = codec::encode(
        &[
            "C",
            key.hex(),
            codec::decimal(fresh.stored_at_ms).as_str(),
            codec::decimal(fresh.ttl_ms).as_str(),
            &codec::field(&response.content_type),
            &codec::headers_field(&response.headers),
        ],
        &response.body,
    );
    let mut at = place.cloned().unwrap_or_else(|| self::place(store, config, key));
    // Asked of the ghost record once (asking takes the key out of it).
    let mut admitted = None;
    for _ in 0..MAX_RACES {
        at.way = choose(&at.index, at.ways as usize, key.tag().as_bytes(), now_ms);
        let evicted = at.holds_fresh_other(key, now_ms);
        if evicted && !*admitted.get_or_insert_with(|| evict == Evict::Asked && asked_before(store, at.group, key)) {
            return None;
        }
        let index = at.with(key, fresh.expires_ms(), admitted == Some(true));
        match store.set(&index_name(at.group), &index, at.cas) {
            Ok(()) => return store.set(&at.entry_name(), &value, None).is_ok().then_some(Stored { evicted }),
            Err(StoreError::CasMismatch) => at = self::place(store, config, key),
            Err(_) => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::request::request_key;
    use crate::core::store::{Counting, MemStore};

    /// Stores a flight's answer produced at `now_ms`: whether it was stored.
    fn keep(s: &impl CasStore, c: &Config, k: &Key, r: &Response, now_ms: u64, place: Option<&Place>) -> bool {
        store_fresh(s, c, k, r, Fresh::of(c, now_ms), now_ms, place, Evict::Asked).is_some()
    }

    /// Cache entries in `s`: its keys but the group indexes and ghost records.
    pub(crate) fn entries(s: &MemStore) -> usize {
        s.keys().iter().filter(|k| !k.contains("/index/") && !k.contains("/ghost/")).count()
    }

    pub(crate) fn ok(body: &str) -> Response {
        Response::json(200, body.into()).with_header("x-holysheep-model", "m".into())
    }

    #[test]
    fn keys_sharing_a_home_slot_are_both_kept_and_the_table_stays_bounded() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"cache":{"max_entries":8}}"#).unwrap());
        let keys: Vec<Key> = (0..64u32).map(|i| request_key("/p", "s", &i.to_le_bytes())).collect();
        let (a, b) = keys
            .iter()
            .enumerate()
            .find_map(|(i, a)| keys[i + 1..].iter().find(|b| group_of(&c, b) == group_of(&c, a)).map(|b| (a, b)))
            .expect("two keys with one group");
        assert!(keep(&s, &c, a, &ok("a"), 0, None) && keep(&s, &c, b, &ok("b"), 1, None));
        assert_eq!(get(&s, &c, a).map(|e| e.response.body), Some(b"a".to_vec()), "not evicted by its neighbour");
        assert_eq!(get(&s, &c, b).map(|e| e.response.body), Some(b"b".to_vec()));
        for (i, k) in keys.iter().enumerate() {
            keep(&s, &c, k, &ok("x"), 10 + i as u64, None);
        }
        assert!(s.key_count() <= 8 + 2 + 2, "8 entries, 2 group indexes, 2 ghost records: {:?}", s.keys());
        assert!(keep(&s, &c, &keys[63], &ok("x"), 100, None), "asked again, the newest is stored");
        assert_eq!(get(&s, &c, &keys[63]).map(|e| e.key), Some(keys[63].clone()));
    }

    /// Fills the group of `keys` with the first four: answer `"i"` stored at `i` ms.
    fn fill(s: &impl CasStore, c: &Config, keys: &[Key]) {
        for (i, k) in keys.iter().take(4).enumerate() {
            assert!(keep(s, c, k, &ok(&format!("{i}")), i as u64, None));
        }
    }

    /// Keys that share `config`'s group with the first.
    fn one_group(c: &Config, n: usize) -> Vec<Key> {
        let keys: Vec<Key> = (0..400u32).map(|i| request_key("/p", "s", &i.to_le_bytes())).collect();
        keys.iter().filter(|k| group_of(c, k) == group_of(c, &keys[0])).take(n).cloned().collect()
    }

    #[test]
    fn a_lookup_in_a_full_group_reads_its_index_and_at_most_one_entry() {
        let (s, c) = (Counting::new(), Config::parse(br#"{"cache":{"max_entries":64}}"#).unwrap());
        let keys = one_group(&c, 5);
        fill(&s, &c, &keys);
        s.reset();
        assert_eq!(get(&s, &c, &keys[4]), None);
        assert_eq!(s.reads(), 1, "a key the group does not hold: its index only");
        for (i, k) in keys.iter().take(4).enumerate() {
            s.reset();
            assert_eq!(get(&s, &c, k).map(|e| e.response.body), Some(format!("{i}").into_bytes()));
            assert_eq!(s.reads(), 2, "way {i}: the index and the entry");
        }
    }

    #[test]
    fn two_answers_placed_from_one_read_of_the_index_both_stay() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"cache":{"max_entries":64}}"#).unwrap());
        let keys = one_group(&c, 2);
        let (a, b) = (probe(&s, &c, &keys[0]).place, probe(&s, &c, &keys[1]).place);
        assert!(keep(&s, &c, &keys[0], &ok("a"), 0, Some(&a)));
        assert!(keep(&s, &c, &keys[1], &ok("b"), 0, Some(&b)), "the second re-reads the index");
        assert_eq!(get(&s, &c, &keys[0]).map(|e| e.response.body), Some(b"a".to_vec()));
        assert_eq!(get(&s, &c, &keys[1]).map(|e| e.response.body), Some(b"b".to_vec()));
    }

    #[test]
    fn an_index_that_names_a_key_its_way_no_longer_holds_is_a_miss() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"cache":{"max_entries":64}}"#).unwrap());
        let keys = one_group(&c, 2);
        assert!(keep(&s, &c, &keys[0], &ok("a"), 0, None));
        let entry = s.keys().into_iter().find(|k| !k.contains("/index/")).unwrap();
        let other = s.get(&entry).unwrap().value.unwrap();
        let other = String::from_utf8(other).unwrap().replace(keys[0].hex(), keys[1].hex());
        s.set(&entry, other.as_bytes(), None).unwrap();
        assert_eq!(get(&s, &c, &keys[0]), None, "never another key's answer");
    }

    #[test]
    fn put_then_get_and_freshness() {
        let (s, c) = (MemStore::new(), Config::default());
        let k = request_key("/p", "s", b"1");
        assert!(get(&s, &c, &k).is_none());
        assert!(keep(&s, &c, &k, &ok("{}"), 1000, None));
        let e = get(&s, &c, &k).unwrap();
        assert_eq!(e.response, ok("{}"));
        assert!(e.is_fresh(1000 + 3_599_999));
        assert!(!e.is_fresh(1000 + 3_600_000));
    }

    #[test]
    fn an_answer_keeps_the_freshness_it_was_given_and_evicting_a_fresh_one_is_told() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"cache":{"max_entries":1}}"#).unwrap());
        let (a, b) = (request_key("/p", "s", b"a"), request_key("/p", "s", b"b"));
        let fresh = Fresh { stored_at_ms: 400, ttl_ms: 1_600 };
        assert_eq!(
            store_fresh(&s, &c, &a, &ok("a"), fresh, 1_000, None, Evict::Asked),
            Some(Stored { evicted: false })
        );
        let e = get(&s, &c, &a).unwrap();
        assert_eq!((e.stored_at_ms, e.ttl_ms, e.age_ms(1_000)), (400, 1_600, 600), "produced before it was stored");
        assert!(e.is_fresh(1_999) && !e.is_fresh(2_000));
        assert_eq!(
            store_fresh(&s, &c, &a, &ok("a2"), fresh, 1_500, None, Evict::Asked),
            Some(Stored { evicted: false }),
            "itself"
        );
        let later = Fresh { stored_at_ms: 1_900, ttl_ms: 1_000 };
        assert_eq!(
            store_fresh(&s, &c, &b, &ok("b"), later, 1_900, None, Evict::Asked),
            None,
            "asked once: turned away"
        );
        assert_eq!(store_fresh(&s, &c, &b, &ok("b"), later, 1_900, None, Evict::Asked), Some(Stored { evicted: true }));
        assert_eq!(
            store_fresh(&s, &c, &a, &ok("a"), fresh, 3_000, None, Evict::Asked),
            Some(Stored { evicted: false }),
            "b expired"
        );
    }

    #[test]
    fn a_scan_of_prompts_asked_once_leaves_every_answer_asked_again() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"cache":{"max_entries":64}}"#).unwrap());
        let key = |i: u32| request_key("/p", "s", &i.to_le_bytes());
        let hot: Vec<Key> = (0..16).map(key).collect();
        for k in &hot {
            assert!(keep(&s, &c, k, &ok("hot"), 0, None));
        }
        for i in 1_000..3_000 {
            keep(&s, &c, &key(i), &ok("once"), 10, None);
        }
        let entries = entries(&s);
        assert_eq!(entries, 64, "the scan filled every free way");
        assert_eq!(hot.iter().filter(|k| get(&s, &c, k).is_some()).count(), 16, "and displaced no answer asked again");
        let ghosts = s.keys().iter().filter(|k| k.contains("/ghost/")).count();
        assert_eq!(ghosts, 16, "one ghost record per group, bounded");
    }

    /// Zipf(1.1) over 1,000 prompts, 10,000 requests, the default cache: the MISSes (each a
    /// call upstream) before and after a scan of 6,000 one-off prompts through it.
    #[test]
    fn a_zipf_workload_misses_once_per_prompt_and_a_scan_between_costs_it_nothing() {
        let (s, c) = (MemStore::new(), Config::default());
        let weights: Vec<f64> = (1..=1_000).map(|r| 1.0 / f64::from(r).powf(1.1)).collect();
        let total: f64 = weights.iter().sum();
        let mut seed = 7_u64;
        let mut draw = || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let mut u = (seed >> 11) as f64 / (1u64 << 53) as f64 * total;
            weights
                .iter()
                .position(|w| {
                    u -= w;
                    u <= 0.0
                })
                .unwrap_or(999) as u32
        };
        let key = |i: u32| request_key("/p", "s", &i.to_le_bytes());
        let mut asked = std::collections::BTreeSet::new();
        // (MISSes, prompts asked for the first time) of 10,000 requests.
        let mut phase = |now: u64| {
            let (mut misses, mut new) = (0, 0);
            for _ in 0..10_000 {
                let i = draw();
                new += usize::from(asked.insert(i));
                // As the engine does: a HIT marks its answer asked again.
                let found = probe(&s, &c, &key(i));
                if found.entry.is_some() {
                    asked_again(&s, &found.place);
                } else {
                    misses += 1;
                    keep(&s, &c, &key(i), &ok("a"), now, None);
                }
            }
            (misses, new)
        };
        let (misses, new) = phase(0);
        assert_eq!(misses, new, "one call per prompt");
        for i in 10_000..16_000 {
            keep(&s, &c, &key(i), &ok("once"), 1, None);
        }
        // The scan filled every free slot: a prompt asked for the first time now is kept only
        // when asked again, over the slot that expires first among answers never asked
        // again, which holds the scan's or an older prompt asked once. 49 of the 847 asked
        // before miss again, all of them asked once before the scan; 80 did while a HIT
        // marked nothing, 657 when any answer displaced the one that expires first.
        let (misses, new) = phase(2);
        assert_eq!((misses, new), (154, 105), "MISSes after the scan, and prompts asked for the first time");
    }

    #[test]
    fn an_answer_asked_again_is_displaced_after_those_that_were_not_and_expired_ones_first() {
        let (s, c) = (Counting::new(), Config::parse(br#"{"cache":{"max_entries":64}}"#).unwrap());
        let keys = one_group(&c, 6);
        fill(&s, &c, &keys);
        // keys[0] expires first, but is a HIT: marked once, with one write.
        let found = probe(&s, &c, &keys[0]);
        assert!(found.entry.is_some());
        s.reset();
        asked_again(&s, &found.place);
        asked_again(&s, &probe(&s, &c, &keys[0]).place);
        assert_eq!(s.writes(), 1, "one mark, then nothing");
        assert!(!keep(&s, &c, &keys[4], &ok("4"), 10, None) && keep(&s, &c, &keys[4], &ok("4"), 11, None));
        assert!(get(&s, &c, &keys[0]).is_some(), "asked again: kept");
        assert_eq!(get(&s, &c, &keys[1]), None, "the first to expire of those asked once");
        assert!(keep(&s, &c, &keys[0], &ok("0"), 12, None), "stored again in its way");
        assert!(probe(&s, &c, &keys[0]).place.asked_again(), "and still marked");
        // Once keys[2]'s answer (stored at 2, fresh for an hour) expired, its way goes first,
        // marked or not; the others are fresh.
        asked_again(&s, &probe(&s, &c, &keys[2]).place);
        assert!(keep(&s, &c, &keys[5], &ok("5"), 3_600_002, None), "a way whose answer expired is free");
        assert_eq!(get(&s, &c, &keys[2]), None);
        assert!([0, 3, 4].iter().all(|&i| get(&s, &c, &keys[i]).is_some()));
    }

    #[test]
    fn a_key_turned_away_takes_the_way_that_expires_first_when_asked_again() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"cache":{"max_entries":64}}"#).unwrap());
        let keys = one_group(&c, 6);
        fill(&s, &c, &keys);
        assert!(!keep(&s, &c, &keys[4], &ok("4"), 10, None), "a full group turns a new key away");
        assert!(!keep(&s, &c, &keys[5], &ok("5"), 11, None));
        assert!(keep(&s, &c, &keys[4], &ok("4"), 12, None), "asked again, it is stored");
        assert_eq!(get(&s, &c, &keys[0]), None, "over the answer that expires first");
        assert!(keys[1..5].iter().all(|k| get(&s, &c, k).is_some()));
        assert!(keep(&s, &c, &keys[4], &ok("4"), 13, None), "its own way: refreshed, nothing displaced");
        assert!(keep(&s, &c, &keys[5], &ok("5"), 14, None), "the other ghost is still known");
        let evicted = store_fresh(&s, &c, &keys[0], &ok("0"), Fresh::of(&c, 15), 15, None, Evict::Never);
        assert_eq!(evicted, None, "a list past its share never displaces, asked before or not");
    }

    #[test]
    fn errors_and_oversized_bodies_are_not_stored() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.cache.max_entry_bytes = 4;
        let k = request_key("/p", "s", b"1");
        assert!(!keep(&s, &c, &k, &ok("12345"), 0, None));
        let mut err = ok("{}");
        err.status = 500;
        assert!(!keep(&s, &c, &k, &err, 0, None));
        assert_eq!(s.key_count(), 0);
    }

    #[test]
    fn the_table_never_exceeds_its_slots_and_collisions_miss() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.cache.max_entries = 8;
        let keys: Vec<Key> = (0..500).map(|i| request_key("/p", "s", format!("{i}").as_bytes())).collect();
        for k in &keys {
            keep(&s, &c, k, &ok("{}"), 0, None);
            keep(&s, &c, k, &ok("{}"), 0, None);
        }
        let entries = entries(&s);
        assert!(entries <= 8 && s.key_count() <= 8 + 2 + 2, "{:?}", s.keys());
        let found = keys.iter().filter(|k| get(&s, &c, k).is_some()).count();
        assert_eq!(found, entries, "each slot answers only for the key it holds");
    }
}
