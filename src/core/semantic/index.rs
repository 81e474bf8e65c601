//! The vectors, in shared data: `page_count` pages (`holysheep/semantic/<n>`) of at most
//! `WAYS` entries, `semantic.max_entries` in all. A partition lives in one page, chosen by
//! its hash, so a lookup is one read and one pass over at most `WAYS` vectors; a page that
//! is full gives its oldest entry's place to a new one. Each entry points at the exact
//! cache entry of the answer (the question's request key): a vector whose answer is gone
//! or stale is no match.
//!
//! A page: version (1 byte), dimensions (u16), entries (u16), then per entry the partition
//! (32 bytes), the request key (32 bytes), when it was stored (u64, ms), the quantized
//! vector's norm (f32) and its values (one byte per dimension): `76 + dimensions` bytes.

use super::vector::Vector;
use crate::core::api::key::Key;
use crate::core::config::Config;
use crate::core::store::{cas_after, slot_name, CasStore, StoreError};
use crate::core::wire::sort;

/// The most entries in one page, so in one partition.
pub(crate) const WAYS: u32 = 64;

const TABLE: &str = "holysheep/semantic/";
const VERSION: u8 = 1;
const HEADER: usize = 5;
/// An entry's bytes besides its values.
pub(crate) const ENTRY_FIXED: usize = 32 + 32 + 8 + 4;
/// Attempts at writing a page that others write too.
const WRITE_ATTEMPTS: usize = 4;

/// The pages of the index.
pub(crate) fn page_count(config: &Config) -> u32 {
    config.semantic.max_entries.div_ceil(WAYS)
}

/// The entries page `page` holds: `max_entries` spread over the pages.
fn capacity(config: &Config, page: u32) -> usize {
    let (max, pages) = (config.semantic.max_entries, page_count(config));
    (max / pages + u32::from(page < max % pages)) as usize
}

fn page_of(config: &Config, partition: &[u8; 32]) -> u32 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&partition[..8]);
    (u64::from_be_bytes(first) % u64::from(page_count(config))) as u32
}

/// A stored question close enough, and how close.
#[derive(Debug, Clone, PartialEq)]
pub struct Similar {
    pub key: Key,
    pub similarity: f32,
}

/// What a lookup found in the question's partition.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Found {
    /// The questions at or above the threshold, the closest first.
    pub matches: Vec<Similar>,
    /// The best similarity of any question in the partition (`None`: it holds none).
    pub best: Option<f32>,
}

impl Found {
    /// The partition held questions, none close enough.
    pub fn near_miss(&self) -> bool {
        self.matches.is_empty() && self.best.is_some()
    }
}

/// One entry, borrowed from a page's bytes.
#[derive(Clone, Copy)]
struct Entry<'a> {
    partition: &'a [u8],
    key: &'a [u8],
    stored_at_ms: u64,
    norm: f32,
    values: &'a [u8],
}

impl Entry<'_> {
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.partition);
        out.extend_from_slice(self.key);
        out.extend_from_slice(&self.stored_at_ms.to_le_bytes());
        out.extend_from_slice(&self.norm.to_le_bytes());
        out.extend_from_slice(self.values);
    }
}

/// A page's dimensions and entries (none for an empty, foreign or damaged page).
fn entries(raw: &[u8]) -> (usize, Vec<Entry<'_>>) {
    let header = match raw {
        [VERSION, d0, d1, n0, n1, ..] => {
            Some((usize::from(u16::from_le_bytes([*d0, *d1])), u16::from_le_bytes([*n0, *n1])))
        }
        _ => None,
    };
    let Some((dims, count)) = header else { return (0, Vec::new()) };
    let size = ENTRY_FIXED + dims;
    let body = raw.get(HEADER..).unwrap_or_default();
    if dims == 0 || body.len() != size * usize::from(count) {
        return (0, Vec::new());
    }
    let entries = body.chunks_exact(size).map(|e| {
        let (partition, rest) = e.split_at(32);
        let (key, rest) = rest.split_at(32);
        let (stamp, rest) = rest.split_at(8);
        let (norm, values) = rest.split_at(4);
        let stored_at_ms = u64::from_le_bytes(stamp.try_into().unwrap_or_default());
        let norm = f32::from_le_bytes(norm.try_into().unwrap_or_default());
        Entry { partition, key, stored_at_ms, norm, values }
    });
    (dims, entries.collect())
}

fn page_bytes(dims: usize, entries: &[Entry<'_>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + entries.len() * (ENTRY_FIXED + dims));
    out.push(VERSION);
    out.extend_from_slice(&(dims as u16).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    for e in entries {
        e.write(&mut out);
    }
    out
}

/// The questions of `partition` at least `semantic.threshold` close to `vector`.
pub fn find(store: &impl CasStore, config: &Config, partition: &[u8; 32], vector: &Vector) -> Found {
    let name = slot_name(TABLE, page_of(config, partition));
    let Ok(Some(raw)) = store.get(&name).map(|r| r.value) else { return Found::default() };
    let threshold = config.semantic.threshold as f32;
    let mut found = Found::default();
    let (dims, entries) = entries(&raw);
    if dims != vector.values().len() {
        return found;
    }
    for e in entries.iter().filter(|e| e.partition == partition.as_slice()) {
        let similarity = vector.cosine(e.values, e.norm);
        found.best = Some(found.best.map_or(similarity, |b| b.max(similarity)));
        if similarity >= threshold {
            if let Some(key) = key_of(e.key) {
                found.matches.push(Similar { key, similarity });
            }
        }
    }
    sort::sort_by(&mut found.matches, |a, b| a.similarity.total_cmp(&b.similarity).is_gt());
    found
}

/// Adds the question of `key` to its partition (in place of its own older entry, or of the
/// page's oldest when the page is full). `false` when the page could not be written.
pub(crate) fn learn(
    store: &impl CasStore,
    config: &Config,
    partition: &[u8; 32],
    vector: &Vector,
    key: &Key,
    now_ms: u64,
) -> bool {
    let page = page_of(config, partition);
    let (name, cap) = (slot_name(TABLE, page), capacity(config, page));
    let (Some(key_bytes), values) = (key_bytes(key), vector.to_bytes()) else { return false };
    let new = Entry { partition, key: &key_bytes, stored_at_ms: now_ms, norm: vector.norm(), values: &values };
    for _ in 0..WRITE_ATTEMPTS {
        let Ok(read) = store.get(&name) else { return false };
        let raw = read.value.clone().unwrap_or_default();
        let (dims, mut kept) = entries(&raw);
        // Vectors of another length (the embedding model changed) make way.
        if dims != values.len() {
            kept.clear();
        }
        kept.retain(|e| e.key != key_bytes.as_slice());
        while kept.len() >= cap {
            let oldest = kept.iter().enumerate().min_by_key(|(_, e)| e.stored_at_ms).map(|(i, _)| i);
            if let Some(i) = oldest {
                kept.remove(i);
            }
        }
        kept.push(new);
        match store.set(&name, &page_bytes(values.len(), &kept), cas_after(&read)) {
            Ok(()) => return true,
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Host(_)) => return false,
        }
    }
    false
}

fn key_bytes(key: &Key) -> Option<[u8; 32]> {
    let hex = key.hex().as_bytes();
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        *byte = u8::try_from(crate::core::wire::codec::hex_number(pair)?).ok()?;
    }
    (hex.len() == 64).then_some(out)
}

fn key_of(bytes: &[u8]) -> Option<Key> {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Key::from_hex(&hex)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::request::request_key;
    use crate::core::store::MemStore;

    fn config(max_entries: u32) -> Config {
        let raw = format!(r#"{{"semantic":{{"enabled":true,"max_entries":{max_entries},"threshold":0.9}}}}"#);
        Config::parse(raw.as_bytes()).unwrap()
    }

    fn v(x: &[f32]) -> Vector {
        Vector::quantize(x).unwrap()
    }

    fn k(i: u8) -> Key {
        request_key("/p", "s", &[i])
    }

    #[test]
    fn a_close_question_of_the_same_partition_is_found_and_others_are_not() {
        let (s, c) = (MemStore::new(), config(64));
        let p = [1u8; 32];
        assert!(learn(&s, &c, &p, &v(&[1.0, 0.0, 0.0]), &k(1), 10));
        assert!(learn(&s, &c, &p, &v(&[0.0, 1.0, 0.0]), &k(2), 11));
        let found = find(&s, &c, &p, &v(&[0.99, 0.1, 0.0]));
        assert_eq!(found.matches.len(), 1);
        assert_eq!(found.matches[0].key, k(1));
        assert!(found.matches[0].similarity > 0.99);
        let far = find(&s, &c, &p, &v(&[0.0, 0.0, 1.0]));
        assert!(far.near_miss() && far.best == Some(0.0));
        let other = find(&s, &c, &[2u8; 32], &v(&[1.0, 0.0, 0.0]));
        assert_eq!(other, Found::default(), "another partition, even in the same page, holds nothing");
    }

    #[test]
    fn the_index_holds_max_entries_and_a_full_page_drops_its_oldest() {
        let (s, c) = (MemStore::new(), config(130));
        assert_eq!((page_count(&c), capacity(&c, 0), capacity(&c, 2)), (3, 44, 43));
        let p = [0u8; 32];
        for i in 0..60u8 {
            let x: Vec<f32> = (0..8).map(|d| if d == usize::from(i % 8) { 1.0 } else { 0.01 * f32::from(i) }).collect();
            assert!(learn(&s, &c, &p, &v(&x), &k(i), u64::from(i)));
        }
        let page = s.get(&slot_name(TABLE, page_of(&c, &p))).unwrap().value.unwrap();
        let (dims, kept) = entries(&page);
        assert_eq!((dims, kept.len()), (8, capacity(&c, page_of(&c, &p))));
        assert_eq!(page.len(), HEADER + kept.len() * (ENTRY_FIXED + 8), "the documented size");
        let oldest = kept.iter().map(|e| e.stored_at_ms).min().unwrap();
        assert_eq!(oldest, 60 - kept.len() as u64, "the oldest made way");
        assert_eq!(s.key_count(), 1, "one page written");
    }

    #[test]
    fn a_question_learned_again_replaces_its_entry_and_another_length_clears_the_page() {
        let (s, c) = (MemStore::new(), config(64));
        let p = [3u8; 32];
        learn(&s, &c, &p, &v(&[1.0, 0.0]), &k(1), 1);
        learn(&s, &c, &p, &v(&[1.0, 0.0]), &k(1), 2);
        assert_eq!(entries(&s.get(&slot_name(TABLE, 0)).unwrap().value.unwrap()).1.len(), 1);
        learn(&s, &c, &p, &v(&[1.0, 0.0, 0.0]), &k(2), 3);
        let page = s.get(&slot_name(TABLE, 0)).unwrap().value.unwrap();
        assert_eq!(entries(&page).0, 3);
        assert_eq!(find(&s, &c, &p, &v(&[1.0, 0.0])).best, None, "a vector of another length matches nothing");
        assert_eq!(key_of(&key_bytes(&k(9)).unwrap()), Some(k(9)));
    }

    #[test]
    fn a_damaged_page_reads_as_empty_and_is_rewritten() {
        let (s, c) = (MemStore::new(), config(64));
        s.set(&slot_name(TABLE, 0), &[VERSION, 3, 0, 9, 0, 1, 2], None).unwrap();
        assert_eq!(find(&s, &c, &[0u8; 32], &v(&[1.0, 0.0, 0.0])), Found::default());
        assert!(learn(&s, &c, &[0u8; 32], &v(&[1.0, 0.0, 0.0]), &k(1), 1));
        assert_eq!(find(&s, &c, &[0u8; 32], &v(&[1.0, 0.0, 0.0])).matches.len(), 1);
    }
}
