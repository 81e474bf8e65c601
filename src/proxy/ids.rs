//! Maps keyed by Envoy's context ids and callout tokens. Envoy assigns these (a client
//! cannot choose them), so they need no keyed hash: a multiply spreads them over the table
//! at a fraction of SipHash's cost, paid several times on every request.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

pub type IdMap<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;
pub type IdSet = HashSet<u32, BuildHasherDefault<IdHasher>>;

#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u32(&mut self, id: u32) {
        self.write_u64(u64::from(id));
    }

    /// Fibonacci hashing: the golden-ratio multiple fills the high bits hashbrown reads.
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}
