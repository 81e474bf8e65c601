//! The core's store (`CasStore`) in the process's own memory, shared by every worker, with
//! the contract of Envoy's shared data the core is written for: one process-wide counter
//! gives every write its CAS (skipping 0), a CAS write to a key written since fails, a
//! write to a missing key inserts, and nothing is deleted (the core frees a key by
//! emptying it, and keeps its own tables to a bounded set of keys). Keys are spread over
//! shards so that workers seldom wait on one lock.

use crate::core::store::{CasStore, Read, StoreError};
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

const SHARDS: usize = 64;

/// One shard: each key's value and CAS.
type Shard = HashMap<String, (Vec<u8>, u32)>;

struct Shards {
    hasher: RandomState,
    shards: Vec<Mutex<Shard>>,
    counter: AtomicU32,
}

fn shards() -> &'static Shards {
    static SHARED: OnceLock<Shards> = OnceLock::new();
    SHARED.get_or_init(|| Shards {
        hasher: RandomState::new(),
        shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        counter: AtomicU32::new(0),
    })
}

impl Shards {
    /// The shard of `key`, locked (a panic elsewhere never poisons the store for good).
    fn of(&self, key: &str) -> MutexGuard<'_, Shard> {
        let at = (self.hasher.hash_one(key) as usize) % SHARDS;
        self.shards[at].lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The next CAS: never 0.
    fn next_cas(&self) -> u32 {
        loop {
            let cas = self.counter.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
            if cas != 0 {
                return cas;
            }
        }
    }
}

/// The process's store.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessStore;

impl CasStore for ProcessStore {
    fn get(&self, key: &str) -> Result<Read, StoreError> {
        Ok(match shards().of(key).get(key) {
            None => Read::default(),
            Some((value, cas)) => Read { value: (!value.is_empty()).then(|| value.clone()), cas: Some(*cas) },
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let all = shards();
        let mut shard = all.of(key);
        if let (Some((_, current)), Some(c)) = (shard.get(key), cas) {
            if c != 0 && c != *current {
                return Err(StoreError::CasMismatch);
            }
        }
        let next = all.next_cas();
        match shard.get_mut(key) {
            Some(slot) => {
                slot.0.clear();
                slot.0.extend_from_slice(value);
                slot.1 = next;
            }
            None => {
                shard.insert(key.to_owned(), (value.to_vec(), next));
            }
        }
        Ok(())
    }
}
