//! A node's shared data as one of its workers meets it: Envoy's store (`MemStore`), where
//! another worker's write of the same key can come between a read and the compare-and-swap
//! that follows it. The core's read-modify-write loops then read again; in a storm every
//! such write loses, until the loops give up (`MAX_RACES`) and take their contended paths.

use super::rng::Rng;
use crate::core::store::{CasStore, MemStore, Read, StoreError};
use std::cell::{Cell, RefCell};

pub(crate) struct Shared {
    store: MemStore,
    /// The share of conditional writes of an existing key that another worker's write
    /// beats, in percent.
    races: u64,
    /// Every conditional write loses meanwhile.
    pub storm: Cell<bool>,
    rng: RefCell<Rng>,
    /// Writes that lost to another worker's.
    pub lost: Cell<u64>,
}

impl Shared {
    pub(crate) fn new(races: u64, seed: u64) -> Shared {
        Shared {
            store: MemStore::new(),
            races,
            storm: Cell::new(false),
            rng: RefCell::new(Rng::new(seed)),
            lost: Cell::new(0),
        }
    }

    /// Whether another worker wrote the key first: it wrote what it read (a write the core
    /// makes when nothing it counts changed), so the key's compare-and-swap value moves on.
    fn beaten(&self, key: &str) -> bool {
        let races = if self.storm.get() { 100 } else { self.races };
        if races == 0 || !self.rng.borrow_mut().chance(races) {
            return false;
        }
        match self.store.get(key) {
            Ok(Read { value: Some(v), .. }) => self.store.set(key, &v, None).is_ok(),
            _ => false,
        }
    }
}

impl CasStore for Shared {
    fn get(&self, key: &str) -> Result<Read, StoreError> {
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        if cas.is_some_and(|c| c != 0) && self.beaten(key) {
            self.lost.set(self.lost.get() + 1);
        }
        self.store.set(key, value, cas)
    }
}
