//! A request's key: the SHA-256 the request floor computes of (path, tenant scope,
//! canonical body), as the cache, the leases, the fleet's ring and the answers name it.

use crate::core::wire::bytes;
use crate::core::wire::codec;

/// SHA-256 of (path, tenant scope, canonical body), as 64 lowercase hex digits.
#[derive(Debug, Clone, Eq)]
pub struct Key(String);

/// Keys are compared on every request (waiters, lease and cache records), word-wise.
impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.is(&other.0)
    }
}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl Key {
    pub fn hex(&self) -> &str {
        &self.0
    }

    /// Whether `hex` spells this key (a record's key field).
    pub fn is(&self, hex: impl AsRef<[u8]>) -> bool {
        bytes::same(self.0.as_bytes(), hex.as_ref())
    }

    /// A digest the request floor computed (64 lowercase hex digits).
    pub(crate) fn digest(hex: String) -> Key {
        Key(hex)
    }

    pub fn from_hex(hex: &str) -> Option<Key> {
        let ok = hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        ok.then(|| Key(hex.to_owned()))
    }

    /// The key's last 16 hex digits (no table picks its slot with them): enough to tell
    /// the keys of one table's group apart before reading a whole record.
    pub fn tag(&self) -> &str {
        self.0.get(48..).unwrap_or_default()
    }

    /// A slot in a table of `n` slots; `salt` picks independent slots for different tables.
    pub fn slot(&self, n: u32, salt: usize) -> u32 {
        let start = (salt * 16) % 48;
        let v = self.0.get(start..start + 16).and_then(codec::hex_number).unwrap_or(0);
        (v % u64::from(n.max(1))) as u32
    }
}
