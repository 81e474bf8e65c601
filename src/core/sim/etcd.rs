//! The spend store as the simulator meets it: etcd (one key per tenant, its revision, and a
//! compare-and-swap write) with its faults. Each node makes its calls as the shells do, by
//! `budget_store::Calls`.

use super::rng::Rng;
use crate::core::limits::budget::Stored;
use crate::core::limits::budget_store::{Asked, Flush, Found, Heard};
use crate::core::wire::scan;
use std::collections::BTreeMap;

/// How etcd misbehaves, in percent of calls.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Faults {
    /// No answer, nothing done.
    pub down: u64,
    /// Done, but the answer is lost.
    pub lost: u64,
    /// A write given up by its node that lands afterwards.
    pub late: u64,
}

/// etcd: each tenant's key and its revision.
#[derive(Debug, Default)]
pub(crate) struct Etcd {
    keys: BTreeMap<String, (Stored, u64)>,
    revision: u64,
    /// Records written that do not read back as a node reads them (a broken invariant).
    pub unreadable: Vec<String>,
}

impl Etcd {
    pub(crate) fn range(&self, tenant: &str) -> Found {
        match self.keys.get(tenant) {
            Some((stored, revision)) => Found { stored: Some(stored.clone()), revision: *revision },
            None => Found { stored: None, revision: 0 },
        }
    }

    /// A write of `flush` if the key is still at its revision; else what the key holds.
    pub(crate) fn txn(&mut self, flush: &Flush) -> Result<u64, Found> {
        let current = self.keys.get(&flush.tenant).map_or(0, |(_, r)| *r);
        if current != flush.revision {
            return Err(self.range(&flush.tenant));
        }
        self.revision += 1;
        // Kept as etcd keeps it: the JSON the node writes, read back as the node reads it.
        let json = flush.value.to_json();
        match scan::read(json.as_bytes()).and_then(Stored::read) {
            Some(value) => {
                self.keys.insert(flush.tenant.clone(), (value, self.revision));
            }
            None => self.unreadable.push(json),
        }
        Ok(self.revision)
    }

    /// Whether `tenant`'s key holds the write tagged `tag` (`Stored::holds`).
    pub(crate) fn holds(&self, tenant: &str, tag: u64) -> bool {
        self.keys.get(tenant).is_some_and(|(s, _)| s.holds(tag))
    }

    /// The day's micro-dollars the key holds for `tenant`.
    pub(crate) fn day_micro(&self, tenant: &str) -> u64 {
        self.keys.get(tenant).map_or(0, |(s, _)| s.day_micro)
    }
}

/// What etcd does with `asked`, under `faults`: the answer the node gets (after
/// `timeout_ms` when none comes), and a write that lands only later (`late`).
pub(crate) fn serve(etcd: &mut Etcd, asked: &Asked, faults: Faults, rng: &mut Rng) -> (Heard, Option<Flush>) {
    let down = rng.chance(faults.down);
    let lost = rng.chance(faults.lost);
    match asked {
        Asked::Read(tenant) => (Heard::Range((!down && !lost).then(|| etcd.range(tenant))), None),
        Asked::Check(flush) => (Heard::Range((!down && !lost).then(|| etcd.range(&flush.tenant))), None),
        Asked::Write(flush) if down && rng.chance(faults.late) => (Heard::Txn(None), Some(flush.clone())),
        Asked::Write(_) if down => (Heard::Txn(None), None),
        Asked::Write(flush) => {
            let written = etcd.txn(flush);
            (Heard::Txn((!lost).then_some(written)), None)
        }
    }
}
