//! The spend store as the simulator meets it: etcd (one key per tenant, its revision, and a
//! compare-and-swap write) with its faults, and each node's side of it, carried out as the
//! proxy shell carries out `limits::budget_store` (`src/proxy/budget_store.rs`): reads of
//! the records calls wait for, a round of writes per `budget_store.flush_ms`, and a read
//! after a write whose answer was lost.

use super::rng::Rng;
use crate::core::config::Config;
use crate::core::limits::budget::Stored;
use crate::core::limits::budget_store::{self, Due, Flush, Found};
use crate::core::store::CasStore;
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

    /// The day's micro-dollars the key holds for `tenant`.
    pub(crate) fn day_micro(&self, tenant: &str) -> u64 {
        self.keys.get(tenant).map_or(0, |(s, _)| s.day_micro)
    }
}

/// A call to etcd on its way: what it asks.
#[derive(Debug, Clone)]
pub(crate) enum Asked {
    Read(String),
    Write(Flush),
    /// The read after a write whose answer was lost.
    Check(Flush),
}

/// What came back (`None`: no answer within `timeout_ms`).
#[derive(Debug, Clone)]
pub(crate) enum Answer {
    Read(String, Option<Found>),
    Write(Flush, Option<Result<u64, Found>>),
    Check(Flush, Option<Found>),
}

/// One node's calls to etcd that are out: the tenants whose keys are being read or written.
#[derive(Debug, Default)]
pub(crate) struct Side {
    busy: Vec<String>,
    tags: u64,
}

impl Side {
    /// The node's tick: the reads calls wait for, then, when its round is due, a write (or
    /// a read) of each budgeted tenant's record that has no call out.
    pub(crate) fn tick(&mut self, store: &impl CasStore, config: &Config, now_ms: u64, rng: &mut Rng) -> Vec<Asked> {
        let mut asked = Vec::new();
        for tenant in budget_store::take_wanted(store) {
            if !self.busy.contains(&tenant) {
                self.busy.push(tenant.clone());
                asked.push(Asked::Read(tenant));
            }
        }
        if !budget_store::round_due(store, config, now_ms) {
            return asked;
        }
        for tenant in budget_store::budgeted(config) {
            if self.busy.iter().any(|t| t == tenant) {
                continue;
            }
            self.tags += 1;
            let tag = rng.next() ^ self.tags;
            match budget_store::due(store, config, tenant, now_ms, tag) {
                Some(Due::Write(flush)) => {
                    self.busy.push(tenant.to_owned());
                    asked.push(Asked::Write(flush));
                }
                Some(Due::Read) => {
                    self.busy.push(tenant.to_owned());
                    asked.push(Asked::Read(tenant.to_owned()));
                }
                None => {}
            }
        }
        asked
    }

    /// An answer came back (or its time ran out): what it means is `budget_store`'s. A
    /// write without an answer is checked with a read (`Some`).
    pub(crate) fn answered(&mut self, store: &impl CasStore, answer: Answer, now_ms: u64) -> Option<Asked> {
        match answer {
            Answer::Read(tenant, found) => {
                self.busy.retain(|t| *t != tenant);
                budget_store::read(store, &tenant, found, now_ms);
                None
            }
            Answer::Check(flush, found) => {
                self.busy.retain(|t| *t != flush.tenant);
                budget_store::flushed(store, &flush, found.map(Err), now_ms);
                None
            }
            Answer::Write(flush, None) => Some(Asked::Check(flush)),
            Answer::Write(flush, written) => {
                self.busy.retain(|t| *t != flush.tenant);
                budget_store::flushed(store, &flush, written, now_ms);
                None
            }
        }
    }
}

/// What etcd does with `asked`, under `faults`: the answer the node gets (after
/// `timeout_ms` when none comes), and a write that lands only later (`late`).
pub(crate) fn serve(etcd: &mut Etcd, asked: Asked, faults: Faults, rng: &mut Rng) -> (Answer, Option<Flush>) {
    let down = rng.chance(faults.down);
    let lost = rng.chance(faults.lost);
    match asked {
        Asked::Read(tenant) => {
            let found = (!down && !lost).then(|| etcd.range(&tenant));
            (Answer::Read(tenant, found), None)
        }
        Asked::Check(flush) => {
            let found = (!down && !lost).then(|| etcd.range(&flush.tenant));
            (Answer::Check(flush, found), None)
        }
        Asked::Write(flush) if down && rng.chance(faults.late) => (Answer::Write(flush.clone(), None), Some(flush)),
        Asked::Write(flush) if down => (Answer::Write(flush, None), None),
        Asked::Write(flush) => {
            let written = etcd.txn(&flush);
            (Answer::Write(flush, (!lost).then_some(written)), None)
        }
    }
}
