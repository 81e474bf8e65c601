//! The CAS store the core runs on, with the exact contract of Envoy's proxy-wasm shared
//! data, and an in-memory model of it for tests.

use crate::core::wire::codec;

/// What a read returns. Envoy distinguishes a missing key (`cas: None`) from a key whose
/// value is empty (`value: None, cas: Some(_)`); there is no delete, so "empty" is how a
/// key is freed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Read {
    pub value: Option<Vec<u8>>,
    pub cas: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The key exists and its CAS is not the one given: someone wrote it since the read.
    CasMismatch,
    /// The host refused the call; the text is for logs.
    Host(String),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::CasMismatch => f.write_str("another write came first"),
            StoreError::Host(text) => f.write_str(text),
        }
    }
}

/// Shared data as Envoy implements it:
/// - every successful `set` gives the key a fresh CAS from one process-wide `u32` counter
///   (starting at 1, skipping 0 on wrap);
/// - `set` on an existing key with `cas = Some(c)` fails with `CasMismatch` unless `c` is
///   the key's current CAS; `cas = None` overwrites unconditionally;
/// - **`set` on a missing key inserts and ignores `cas`**, so a CAS set is not
///   create-if-absent (see [`crate::core::flight::lease`] for how acquire copes);
/// - there is no delete and no TTL: a key, once written, lives as long as the VM group.
pub trait CasStore {
    fn get(&self, key: &str) -> Result<Read, StoreError>;
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// The CAS a writer passes when its read found the key missing. A racer's insert got a
/// fresh counter value, which is this sentinel only once in 2^32 writes, so the second
/// writer gets `CasMismatch` and re-reads.
pub(crate) const ABSENT_CAS: u32 = u32::MAX;

/// Compare-and-swap races lost in a row before an update gives up (each loss means another
/// writer made progress): the one bound every record of the core shares.
pub(crate) const MAX_RACES: usize = 16;

/// The CAS to pass on a write that must not overwrite a change made since `read`.
pub(crate) fn cas_after(read: &Read) -> Option<u32> {
    Some(read.cas.unwrap_or(ABSENT_CAS))
}

/// The shared-data key of slot `n` of a table (`holysheep/cache/` + `17`), built without
/// the formatter: every request names a few.
pub(crate) fn slot_name(table: &str, n: u32) -> String {
    let digits = codec::decimal(u64::from(n));
    let mut name = String::with_capacity(table.len() + digits.as_str().len());
    name.push_str(table);
    name.push_str(digits.as_str());
    name
}

/// Creates `key` if it does not exist yet: `true` for the one caller that created it.
pub fn claim(store: &impl CasStore, key: &str, value: &[u8]) -> bool {
    match store.get(key) {
        Ok(read) if read.cas.is_none() => store.set(key, value, cas_after(&read)).is_ok(),
        _ => false,
    }
}

/// Envoy's CAS over a store whose compare-and-swap works on handles instead of numbers
/// (`wasi:keyvalue/atomics`: take a handle, read through it, swap; the swap fails if the
/// key changed since the handle was taken). Each value carries a 4-byte little-endian
/// version ahead of the payload, and the version is the `cas` the core sees. Unlike Envoy,
/// a write with `ABSENT_CAS` is a true create-if-absent.
pub mod versioned {
    use super::{Read, StoreError, ABSENT_CAS};

    const HEADER: usize = 4;

    /// The core's view of a stored value (`None`: the key is missing).
    pub fn read(raw: Option<&[u8]>) -> Read {
        match raw {
            None => Read::default(),
            Some(raw) => {
                let (version, payload) = split(raw);
                Read { value: (!payload.is_empty()).then(|| payload.to_vec()), cas: Some(version) }
            }
        }
    }

    fn split(raw: &[u8]) -> (u32, &[u8]) {
        match raw.split_first_chunk::<HEADER>() {
            Some((v, payload)) => (u32::from_le_bytes(*v), payload),
            None => (0, &[]),
        }
    }

    /// The bytes to swap in when the handle saw `current`, or `CasMismatch` when `cas`
    /// (the version the writer read; `None` or `Some(0)`: unconditional) no longer holds.
    pub fn next(current: Option<&[u8]>, cas: Option<u32>, value: &[u8]) -> Result<Vec<u8>, StoreError> {
        let version = current.map(|raw| split(raw).0);
        if let Some(expected) = cas.filter(|c| *c != 0) {
            if version.unwrap_or(ABSENT_CAS) != expected {
                return Err(StoreError::CasMismatch);
            }
        }
        let mut next = version.unwrap_or(0).wrapping_add(1);
        if next == 0 || next == ABSENT_CAS {
            next = 1;
        }
        let mut raw = Vec::with_capacity(HEADER + value.len());
        raw.extend_from_slice(&next.to_le_bytes());
        raw.extend_from_slice(value);
        Ok(raw)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn versions_advance_and_guard_writes() {
            let first = next(None, Some(ABSENT_CAS), b"a").unwrap();
            let r = read(Some(&first));
            assert_eq!((r.value.as_deref(), r.cas), (Some(&b"a"[..]), Some(1)));
            assert_eq!(next(Some(&first), Some(ABSENT_CAS), b"b"), Err(StoreError::CasMismatch));
            assert_eq!(next(Some(&first), Some(7), b"b"), Err(StoreError::CasMismatch));
            let second = next(Some(&first), Some(1), b"").unwrap();
            assert_eq!(read(Some(&second)), Read { value: None, cas: Some(2) });
            assert!(next(Some(&second), None, b"c").is_ok());
            assert_eq!(read(None), Read::default());
        }

        #[test]
        fn a_conditional_write_on_a_missing_key_is_refused() {
            assert_eq!(next(None, Some(3), b"x"), Err(StoreError::CasMismatch));
        }

        #[test]
        fn the_version_skips_zero_and_the_absent_sentinel() {
            let near = [(ABSENT_CAS - 1).to_le_bytes().to_vec(), b"v".to_vec()].concat();
            assert_eq!(read(Some(&next(Some(&near), None, b"w").unwrap())).cas, Some(1));
        }
    }
}

#[cfg(test)]
pub(crate) use model::{Counting, MemStore};

#[cfg(test)]
mod model {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// Envoy's shared data in memory: one lock, one global CAS counter.
    #[derive(Debug, Default)]
    pub(crate) struct MemStore {
        inner: Mutex<Inner>,
    }

    #[derive(Debug, Default)]
    struct Inner {
        map: HashMap<String, (Vec<u8>, u32)>,
        counter: u32,
    }

    impl MemStore {
        pub(crate) fn new() -> Self {
            Self::default()
        }

        /// A store whose next CAS will be `next` (to test wrap-around).
        pub(crate) fn with_next_cas(next: u32) -> Self {
            let s = Self::default();
            s.inner.lock().unwrap().counter = next.wrapping_sub(1);
            s
        }

        pub(crate) fn key_count(&self) -> usize {
            self.inner.lock().unwrap().map.len()
        }

        pub(crate) fn keys(&self) -> Vec<String> {
            self.inner.lock().unwrap().map.keys().cloned().collect()
        }
    }

    impl CasStore for MemStore {
        fn get(&self, key: &str) -> Result<Read, StoreError> {
            let inner = self.inner.lock().unwrap();
            Ok(match inner.map.get(key) {
                None => Read::default(),
                Some((v, cas)) => Read { value: if v.is_empty() { None } else { Some(v.clone()) }, cas: Some(*cas) },
            })
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            let mut inner = self.inner.lock().unwrap();
            if let (Some((_, current)), Some(c)) = (inner.map.get(key), cas) {
                if c != 0 && c != *current {
                    return Err(StoreError::CasMismatch);
                }
            }
            inner.counter = inner.counter.wrapping_add(1);
            if inner.counter == 0 {
                inner.counter = 1;
            }
            let next = inner.counter;
            inner.map.insert(key.to_owned(), (value.to_vec(), next));
            Ok(())
        }
    }

    /// A `MemStore` that counts the reads and writes of the keys that start with a prefix
    /// (every key by default), to show what an operation costs the store.
    #[derive(Default)]
    pub(crate) struct Counting {
        pub inner: MemStore,
        prefix: &'static str,
        reads: std::cell::Cell<usize>,
        writes: std::cell::Cell<usize>,
    }

    impl Counting {
        pub(crate) fn new() -> Self {
            Self::default()
        }

        pub(crate) fn of_keys_starting(prefix: &'static str) -> Self {
            Counting { prefix, ..Self::default() }
        }

        pub(crate) fn reads(&self) -> usize {
            self.reads.get()
        }

        pub(crate) fn writes(&self) -> usize {
            self.writes.get()
        }

        /// Reads and writes counted so far.
        pub(crate) fn calls(&self) -> (usize, usize) {
            (self.reads(), self.writes())
        }

        pub(crate) fn reset(&self) {
            self.reads.set(0);
            self.writes.set(0);
        }
    }

    impl CasStore for Counting {
        fn get(&self, key: &str) -> Result<Read, StoreError> {
            if key.starts_with(self.prefix) {
                self.reads.set(self.reads.get() + 1);
            }
            self.inner.get(key)
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if key.starts_with(self.prefix) {
                self.writes.set(self.writes.get() + 1);
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn counting_counts_only_its_prefix() {
        let s = Counting::of_keys_starting("a/");
        s.set("a/1", b"x", None).unwrap();
        s.set("b/1", b"x", None).unwrap();
        s.get("a/1").unwrap();
        s.get("b/1").unwrap();
        assert_eq!(s.calls(), (1, 1));
        s.reset();
        assert_eq!(Counting::new().calls(), s.calls());
    }

    #[test]
    fn models_envoy_semantics() {
        let s = MemStore::new();
        assert_eq!(s.get("k").unwrap(), Read::default());
        // Insert ignores the CAS.
        s.set("k", b"a", Some(77)).unwrap();
        let r = s.get("k").unwrap();
        assert_eq!(r.value.as_deref(), Some(&b"a"[..]));
        assert_eq!(s.set("k", b"b", Some(r.cas.unwrap() + 1)), Err(StoreError::CasMismatch));
        s.set("k", b"b", r.cas).unwrap();
        s.set("k", b"", None).unwrap();
        let r = s.get("k").unwrap();
        assert_eq!(r.value, None);
        assert!(r.cas.is_some());
    }

    #[test]
    fn slot_names_are_decimal() {
        for n in [0, 7, 10, 4095, u32::MAX] {
            assert_eq!(slot_name("holysheep/cache/", n), format!("holysheep/cache/{n}"));
        }
    }

    #[test]
    fn claim_succeeds_once() {
        let s = MemStore::new();
        assert!(claim(&s, "once", b"1"));
        assert!(!claim(&s, "once", b"1"));
    }

    #[test]
    fn counter_skips_zero_on_wrap() {
        let s = MemStore::with_next_cas(u32::MAX);
        s.set("a", b"1", None).unwrap();
        assert_eq!(s.get("a").unwrap().cas, Some(u32::MAX));
        s.set("b", b"1", None).unwrap();
        assert_eq!(s.get("b").unwrap().cas, Some(1));
    }
}
