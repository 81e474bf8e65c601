//! The spend store, sans-IO: tenants' settled spend kept in etcd (v3, through its JSON
//! gateway), so that a restart, a deploy or an owner move does not reset it. A node reads a
//! tenant's record from the store before it admits the tenant's first call (calls wait,
//! `want`); what it settles is written behind, once per `budget_store.flush_ms`, as an
//! addition to what the store holds (compare-and-swap on the key's revision, so writers on
//! several nodes add up); a write that finds the key changed learns what others spent.
//! When the store cannot be read, a node admits from its share of the budget, and a round
//! of writes `UNREACHABLE_MS` on reads it again. The shells make the calls and report the
//! answers.

mod calls;
pub mod tenants;

pub use calls::{Asked, Calls, Heard, Taught};

use crate::core::api::call::HttpCall;
use crate::core::api::headers;
use crate::core::api::note::Note;
use crate::core::config::Config;
use crate::core::limits::budget::{self, Mark, Pending, Seen, Spend, Stored, KEEPERS_MS};
use crate::core::store::{cas_after, CasStore, StoreError, MAX_RACES};
use crate::core::wire::base64;
use crate::core::wire::write;
use crate::core::wire::{json, scan};
use serde_json::Value;

/// The tenants whose records wait to be read from the store (a list of names; bounded by
/// the tenants configured).
pub(crate) const WANTED_KEY: &str = "holysheep/budget-store/wanted";
/// When the last round of writes began (one worker of the process claims each round).
pub(crate) const ROUND_KEY: &str = "holysheep/budget-store/round";
/// Whether the store answered last, for the whole process (`1`, `0`): its silence is
/// logged once.
pub(crate) const REACHED_KEY: &str = "holysheep/budget-store/reached";
/// `1` while the store's cluster is none the host knows (its calls cannot be sent), for
/// the whole process: nothing budgeted is admitted then (`misconfigured`).
pub(crate) const MISCONFIGURED_KEY: &str = "holysheep/budget-store/misconfigured";
/// This process's name as a writer of the store's records (`Stored::writes`): a random
/// number, the same for all its workers.
pub(crate) const WRITER_KEY: &str = "holysheep/budget-store/writer";
/// How often a call waiting for its tenant's record to be read looks again.
pub(crate) const READ_POLL_MS: u64 = 20;
/// How long after the store could not be read a round of writes reads it again (the node
/// admits from its share meanwhile).
pub(crate) const UNREACHABLE_MS: u64 = 5_000;

/// How long a record with nothing to write goes without reading the store again.
pub(crate) const REFRESH_MS: u64 = 5_000;

/// A call to etcd's JSON gateway: `POST path` with `body`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EtcdCall {
    pub path: &'static str,
    pub body: Vec<u8>,
}

impl EtcdCall {
    /// The call along `budget_store.cluster`, within its `timeout_ms`.
    pub(crate) fn http(self, config: &Config) -> HttpCall {
        let store = &config.budget_store;
        let headers = [(headers::CONTENT_TYPE, "application/json")];
        HttpCall::post((&store.cluster, &store.authority), self.path, headers, self.body, store.timeout_ms)
    }
}

/// What etcd holds for a tenant: its spend (`None`: no key) at `revision` (0: no key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub stored: Option<Stored>,
    pub revision: u64,
}

/// The etcd key of `tenant`'s spend.
pub(crate) fn store_key(config: &Config, tenant: &str) -> String {
    format!("{}/budget/{tenant}", config.budget_store.prefix)
}

/// Reads `tenant`'s key.
pub(crate) fn range(config: &Config, tenant: &str) -> EtcdCall {
    let key = base64::encode(store_key(config, tenant).as_bytes());
    EtcdCall { path: "/v3/kv/range", body: write::value(&json::object([("key", Value::from(key))])) }
}

/// Writes `value` to `tenant`'s key if it is still at `revision` (0: absent); otherwise
/// reads it.
pub(crate) fn txn(config: &Config, tenant: &str, revision: u64, value: &Stored) -> EtcdCall {
    let key = base64::encode(store_key(config, tenant).as_bytes());
    let value = base64::encode(value.to_json().as_bytes());
    let compare = json::object([
        ("key", Value::from(key.as_str())),
        ("target", Value::from("MOD")),
        ("result", Value::from("EQUAL")),
        ("mod_revision", Value::from(revision.to_string())),
    ]);
    let put = json::object([("key", Value::from(key.as_str())), ("value", Value::from(value))]);
    let range = json::object([("key", Value::from(key))]);
    let body = json::object([
        ("compare", Value::Array(vec![compare])),
        ("success", Value::Array(vec![json::object([("request_put", put)])])),
        ("failure", Value::Array(vec![json::object([("request_range", range)])])),
    ]);
    EtcdCall { path: "/v3/kv/txn", body: write::value(&body) }
}

/// The answer to `range` (`None`: not etcd's answer).
pub fn read_range(status: u16, body: &[u8]) -> Option<Found> {
    let v: Value = json::parse(body).filter(|_| status == 200)?;
    found(&v)
}

/// The answer to `txn`: `Ok` with the key's new revision, or `Err` with what the key holds
/// now (`None`: not etcd's answer).
pub fn read_txn(status: u16, body: &[u8]) -> Option<Result<u64, Found>> {
    let v: Value = json::parse(body).filter(|_| status == 200)?;
    if v["succeeded"].as_bool() == Some(true) {
        return number(&v["header"]["revision"]).map(Ok);
    }
    found(&v["responses"][0]["response_range"]).map(Err)
}

/// A range response's key (etcd's JSON writes 64-bit numbers as strings).
fn found(v: &Value) -> Option<Found> {
    v.get("header")?;
    let Some(kv) = v["kvs"].get(0) else { return Some(Found { stored: None, revision: 0 }) };
    let raw = base64::decode(kv["value"].as_str()?)?;
    Some(Found { stored: Some(Stored::read(scan::read(&raw)?)?), revision: number(&kv["mod_revision"])? })
}

pub(super) fn number(v: &Value) -> Option<u64> {
    v.as_str().and_then(|s| s.parse().ok()).or_else(|| v.as_u64())
}

/// Whether the store's calls cannot be sent (its cluster is none the host knows).
pub(crate) fn misconfigured(store: &impl CasStore) -> bool {
    store.get(MISCONFIGURED_KEY).ok().and_then(|r| r.value).is_some_and(|v| v == b"1")
}

/// Records whether the store's calls can be sent; `true` when that changed.
pub(crate) fn set_misconfigured(store: &impl CasStore, missing: bool) -> bool {
    flip(store, MISCONFIGURED_KEY, missing, false)
}

/// A call to the store was sent, or refused by the host (`unknown_cluster`: as no cluster
/// it knows). Such a refusal marks the store misconfigured for the process: nothing
/// budgeted is admitted until a call can be sent again. A call that fails at once for
/// another reason (no healthy host, a full circuit breaker) is an outage, not that. The
/// line for the log when that changes.
pub fn sent(store: &impl CasStore, config: &Config, unknown_cluster: bool) -> Option<Note> {
    if !set_misconfigured(store, unknown_cluster) {
        return None;
    }
    Some(match unknown_cluster {
        true => Note::Critical(format!(
            "holysheep: budget_store.cluster '{}' is no cluster this Envoy knows: calls of tenants with a budget \
             are refused until it is",
            config.budget_store.cluster
        )),
        false => Note::Info("holysheep: the spend store's cluster can be called again".into()),
    })
}

/// Records whether the store answered last; `true` when that changed (for the process:
/// its workers share the flag, so the change is logged once).
pub(crate) fn set_reached(store: &impl CasStore, reached: bool) -> bool {
    flip(store, REACHED_KEY, reached, true)
}

/// Sets the process-wide flag `key` (`absent`: what a flag never set says) to `on`;
/// `true` only for the one caller that changed it.
fn flip(store: &impl CasStore, key: &str, on: bool, absent: bool) -> bool {
    let Ok(read) = store.get(key) else { return false };
    let was = read.value.as_deref().map_or(absent, |v| v == b"1");
    let flag: &[u8] = if on { b"1" } else { b"0" };
    was != on && store.set(key, flag, cas_after(&read)).is_ok()
}

/// `tenant`'s record must be read from the store before its calls are admitted.
pub(crate) fn want(store: &impl CasStore, tenant: &str) {
    let _ = update_wanted(store, |names| {
        let known = names.iter().any(|n| n == tenant);
        if !known {
            names.push(tenant.to_owned());
        }
        !known
    });
}

/// Takes every name off the wanted list: the records this worker reads now.
pub(crate) fn take_wanted(store: &impl CasStore) -> Vec<String> {
    let mut taken = Vec::new();
    let _ = update_wanted(store, |names| {
        taken = std::mem::take(names);
        !taken.is_empty()
    });
    taken
}

fn update_wanted(store: &impl CasStore, mut f: impl FnMut(&mut Vec<String>) -> bool) -> Result<(), StoreError> {
    for _ in 0..MAX_RACES {
        let read = store.get(WANTED_KEY)?;
        let text = read.value.as_deref().map(String::from_utf8_lossy).unwrap_or_default();
        let mut names: Vec<String> = text.split(' ').filter(|n| !n.is_empty()).map(str::to_owned).collect();
        if !f(&mut names) {
            return Ok(());
        }
        match store.set(WANTED_KEY, names.join(" ").as_bytes(), cas_after(&read)) {
            Err(StoreError::CasMismatch) => continue,
            other => return other,
        }
    }
    Err(StoreError::CasMismatch)
}

/// What reading `tenant`'s key came to (`None`: the store could not be reached): the
/// record takes what the store holds beside what was settled here and not yet written (a
/// record read before learns what other nodes spent since; an answer older than what it
/// knows is dropped); a record never read, unreachable, admits from this node's share for
/// a while (one read before keeps deciding from what it knows).
pub fn read(store: &impl CasStore, tenant: &str, found: Option<Found>, now_ms: u64) -> Learned {
    let reached = found.is_some();
    let me = me(store);
    let mut sharing = None;
    let updated = budget::update(store, tenant, now_ms, |s| {
        sharing = None;
        match (s.mark, &found) {
            // An answer older than what is known is dropped; a write out past its deadline
            // is given up all the same (the next write's compare-and-swap learns the key),
            // unsure.
            (Mark::Read { revision }, Some(f)) if f.revision < revision => {
                let expired = s.pending.filter(|p| now_ms >= p.until_ms);
                if let Some(p) = expired {
                    s.pending = None;
                    s.unsure_of(p, revision);
                }
                expired.is_some()
            }
            (_, Some(f)) => {
                sharing = learn(s, f.clone(), now_ms, me);
                true
            }
            (Mark::Read { .. }, None) => false,
            (_, None) => {
                s.mark = Mark::Unreachable { until_ms: now_ms.saturating_add(UNREACHABLE_MS) };
                true
            }
        }
    });
    Learned { reached, sharing: sharing.filter(|_| updated.is_some()) }
}

/// What a read or a write of a tenant's key taught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Learned {
    /// The store answered.
    pub reached: bool,
    /// More processes were seen writing the tenant's spend than before: how many keep it
    /// now (this one counted). Each admits its share until the others stop.
    pub sharing: Option<u32>,
}

/// This process's writer name, if it has written.
fn me(store: &impl CasStore) -> Option<u64> {
    writer_name(&store.get(WRITER_KEY).ok()?.value?)
}

/// A writer name as `WRITER_KEY` holds it.
fn writer_name(raw: &[u8]) -> Option<u64> {
    std::str::from_utf8(raw).ok()?.parse().ok()
}

/// Learns what the store holds; `Some(keepers)` when more processes were seen keeping the
/// spend than before (how many now, this one counted).
fn learn(s: &mut Spend, f: Found, now_ms: u64, me: Option<u64>) -> Option<u32> {
    // A write out whose tag the store holds landed (its answer was lost), even when other
    // writers wrote over it since: what it sent is no longer unsent. One past its deadline
    // that did not land is given up: unsure while the key has not moved past the revision
    // this node knew (it may land yet), and the key's next revision decides it.
    if let Some(p) = s.pending {
        if f.stored.as_ref().is_some_and(|v| v.holds(p.tag)) {
            s.landed(&p);
            s.pending = None;
            s.forget_lapsed();
        } else if now_ms >= p.until_ms {
            s.pending = None;
            if let Mark::Read { revision } = s.mark {
                s.unsure_of(p, revision);
            }
        }
    }
    s.settle_unsure(f.stored.as_ref(), f.revision);
    let stored = f.stored.unwrap_or_default();
    // Other writers that wrote since this process last learned the key keep the tenant
    // too. Read first, the record cannot tell a keeper still at work from one gone (a
    // restart, the ring's last owner): its latest other writer then counts until the next
    // read would have seen it write again.
    let before = s.keepers.writing_at(now_ms);
    let mut others = stored.writes.iter().filter(|(w, _)| Some(*w) != me);
    if s.learned_ms == 0 {
        if let Some(&(writer, _)) = others.next_back() {
            let until_ms = now_ms.saturating_add(REFRESH_MS);
            s.keepers.saw(Seen { writer, until_ms, writing: false }, now_ms);
        }
    } else {
        let new: Vec<u64> = others.filter(|e| !s.stored.writes.contains(e)).map(|(w, _)| *w).collect();
        for writer in new {
            let until_ms = now_ms.saturating_add(KEEPERS_MS);
            s.keepers.saw(Seen { writer, until_ms, writing: true }, now_ms);
        }
    }
    s.stored = stored;
    s.mark = Mark::Read { revision: f.revision };
    s.learned_ms = now_ms;
    s.recharge();
    let after = s.keepers.writing_at(now_ms);
    (after > before).then_some(after)
}

/// A write behind of what a node settled for a tenant: the store's value at `revision`
/// with what was settled added (what it sent, and for which periods, is the record's
/// `Pending`, kept until the write is answered).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flush {
    pub tenant: String,
    pub revision: u64,
    pub value: Stored,
}

/// What a round of writes does for a tenant's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Due {
    /// Write what was settled and not yet written.
    Write(Flush),
    /// Read the key again: it could not be read before (calls are admitted from the node's
    /// share meanwhile, and what they settle is written once it is read), or it was not
    /// read for `REFRESH_MS`.
    Read,
}

/// This process's writer name (`WRITER_KEY`), taking `nonce` when it has none yet.
fn writer(store: &impl CasStore, nonce: u64) -> Option<u64> {
    for _ in 0..MAX_RACES {
        let read = store.get(WRITER_KEY).ok()?;
        if let Some(id) = read.value.as_deref().and_then(writer_name) {
            return Some(id);
        }
        match store.set(WRITER_KEY, nonce.to_string().as_bytes(), cas_after(&read)) {
            Ok(()) => return Some(nonce),
            Err(StoreError::CasMismatch) => continue,
            Err(_) => return None,
        }
    }
    None
}

/// What `tenant`'s record is due in a round, if anything; a write is tagged `write` (a
/// random number, unique to it), names this process as its writer, and is recorded as
/// out, so that no other is sent until it is answered or its deadline passes (then the key
/// is read first, to learn whether it landed).
pub fn due(store: &impl CasStore, config: &Config, tenant: &str, now_ms: u64, write: u64) -> Option<Due> {
    let raw = store.get(&budget::key(tenant)).ok()?.value?;
    let s = Spend::decode(&raw)?.at(now_ms);
    // A keeper among several writes (nothing, under its own tag) while it admits, so that
    // the others keep seeing it.
    // One refused (another keeper wrote first) is tried again next round.
    let heartbeat =
        s.keepers.shared_and_busy(now_ms, s.in_flight()) && now_ms.saturating_sub(s.keepers.wrote_ms) >= REFRESH_MS;
    match (s.mark, s.pending) {
        (Mark::Read { .. }, Some(p)) if now_ms < p.until_ms => None,
        (Mark::Read { .. }, Some(_)) => Some(Due::Read),
        (Mark::Read { .. }, None) if s.unsent != (0, 0) || heartbeat => {
            let until_ms =
                now_ms.saturating_add(config.budget_store.timeout_ms.saturating_mul(2)).saturating_add(1_000);
            let writer = writer(store, write)?;
            // Recorded as out first, from the record as it is when written: a round of
            // another worker sends nothing beside it.
            let mut flush = None;
            let recorded = budget::update(store, tenant, now_ms, |r| {
                flush = None;
                let Mark::Read { revision } = r.mark else { return false };
                if r.pending.is_some() || (r.unsent == (0, 0) && !heartbeat) {
                    return false;
                }
                r.pending = Some(Pending { tag: write, sent: r.unsent, day: r.day, month: r.month, until_ms });
                flush = Some(Flush {
                    tenant: tenant.to_owned(),
                    revision,
                    value: r.stored.plus(r.day, r.month, r.unsent, (writer, write)),
                });
                true
            });
            recorded.filter(|r| r.pending.is_some_and(|p| p.tag == write))?;
            flush.map(Due::Write)
        }
        // Nothing to write, and not learned for a while: read again, for what other nodes
        // spent (the tenant may have been theirs meanwhile).
        (Mark::Read { .. }, None) => (now_ms.saturating_sub(s.learned_ms) >= REFRESH_MS).then_some(Due::Read),
        (Mark::Unreachable { until_ms }, _) if now_ms >= until_ms => Some(Due::Read),
        (Mark::Unreachable { .. } | Mark::Unread, _) => None,
    }
}

/// `flush` could not be sent: it is not out.
pub(crate) fn not_sent(store: &impl CasStore, flush: &Flush, now_ms: u64) {
    let _ = budget::update(store, &flush.tenant, now_ms, |s| {
        let ours = s.pending.is_some_and(|p| Some(p.tag) == flush.value.write);
        if ours {
            s.pending = None;
        }
        ours
    });
}

/// What writing `flush` came to (`None`: no answer; it is tried again next round): written,
/// the record's store value is the one written and what was sent is no longer unsent;
/// refused (the key changed), the record learns what the store holds now, others' spend
/// included, and writes again next round. `Some(keepers)`: as `Learned::sharing`.
pub fn flushed(store: &impl CasStore, flush: &Flush, answer: Option<Result<u64, Found>>, now_ms: u64) -> Option<u32> {
    let answer = answer?;
    let me = me(store);
    let mut sharing = None;
    // A refusal that finds the key holding this write's tag (as the last write, or as its
    // writer's last under others' since) says it landed and its answer was lost. Another
    // worker's round may have sent the same sums under another tag: that one is not this
    // write, and counts once.
    let tag = flush.value.write;
    let (landed, now) = match answer {
        Ok(revision) => (true, Found { stored: Some(flush.value.clone()), revision }),
        Err(now) => (tag.is_some_and(|t| now.stored.as_ref().is_some_and(|v| v.holds(t))), now),
    };
    let updated = budget::update(store, &flush.tenant, now_ms, |s| {
        sharing = None;
        // Answered: the write is no longer out, whatever the answer. An answer that found
        // the key still at the revision the write was sent against, without it (a read
        // after a lost answer), leaves it unsure: it may land yet.
        let out = s.pending.filter(|p| Some(p.tag) == tag);
        let answered = out.is_some();
        if let Some(p) = out {
            s.pending = None;
            if !landed && now.revision == flush.revision {
                s.unsure_of(p, flush.revision);
            }
        }
        let Mark::Read { revision: known } = s.mark else { return answered };
        match landed {
            // Written: what was sent is no longer unsent, and the store holds the value
            // written (or, learned since by a read, a later one that includes it).
            true if known == flush.revision || known >= now.revision => {
                // What was sent is taken out once: here, unless a read since learned, by
                // the write's tag, that it landed (and took it out then).
                if let Some(p) = out {
                    s.landed(&p);
                }
                s.keepers.wrote_ms = now_ms;
                if known == flush.revision {
                    sharing = learn(s, now.clone(), now_ms, me);
                } else {
                    s.recharge();
                }
                // The worst cases of lapsed reservations are in the store now: a call that
                // settles late can no longer take them back (`budget::settle`).
                s.forget_lapsed();
                true
            }
            false if known == flush.revision => {
                sharing = learn(s, now.clone(), now_ms, me);
                true
            }
            _ => answered,
        }
    });
    sharing.filter(|_| updated.is_some())
}

/// Whether this worker runs the round of writes due at `now_ms` (at most one a
/// `budget_store.flush_ms` per process).
pub(crate) fn round_due(store: &impl CasStore, config: &Config, now_ms: u64) -> bool {
    claim_period(store, ROUND_KEY, config.budget_store.flush_ms, now_ms)
}

/// Whether this worker claims the period due at `now_ms` of the work whose last start
/// `key` holds (at most one start a `period_ms` per process).
pub(crate) fn claim_period(store: &impl CasStore, key: &str, period_ms: u64, now_ms: u64) -> bool {
    let Ok(read) = store.get(key) else { return false };
    let last = read.value.as_deref().and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok()).unwrap_or(0);
    now_ms.saturating_sub(last) >= period_ms && store.set(key, now_ms.to_string().as_bytes(), cas_after(&read)).is_ok()
}

/// The tenants whose spend the store keeps: those with a budget.
pub(crate) fn budgeted(config: &Config) -> impl Iterator<Item = &str> {
    config.tenants.iter().filter(|(_, t)| !t.caps().is_none()).map(|(n, _)| n.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::tenants::Caps;
    use crate::core::limits::budget::{reserve, settle, spent, Backing, Hold, Refused};
    use crate::core::store::MemStore;

    const DEC_1: u64 = 1_796_083_200_000;
    const BACKED: Backing = Backing { store: true, nodes: 2, outage_micro: None, replicas: 1 };

    fn config() -> Config {
        Config::parse(br#"{"budget_store":{"cluster":"etcd","prefix":"edge/prod"}}"#).unwrap()
    }

    fn caps() -> (Caps, Backing) {
        (Caps { per_day: Some(1_000), per_month: None }, BACKED)
    }

    #[test]
    fn the_calls_are_etcds_and_its_answers_are_read() {
        let c = config();
        let r = range(&c, "t");
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(
            (r.path, base64::decode(v["key"].as_str().unwrap()).unwrap()),
            ("/v3/kv/range", b"edge/prod/budget/t".to_vec())
        );
        let t = txn(&c, "t", 7, &Stored { day: 1, day_micro: 2, month: 3, month_micro: 4, ..Stored::default() });
        let v: Value = serde_json::from_slice(&t.body).unwrap();
        assert_eq!(v["compare"][0]["mod_revision"], "7");
        let value = base64::decode(v["success"][0]["request_put"]["value"].as_str().unwrap()).unwrap();
        assert_eq!(Stored::read(scan::read(&value).unwrap()).unwrap().month_micro, 4);
        let none = br#"{"header":{"revision":"1"}}"#;
        assert_eq!(read_range(200, none), Some(Found { stored: None, revision: 0 }));
        let kv = format!(
            r#"{{"header":{{"revision":"9"}},"kvs":[{{"key":"x","mod_revision":"8","value":"{}"}}],"count":"1"}}"#,
            base64::encode(br#"{"day":1,"day_micro":5,"month":2,"month_micro":6}"#)
        );
        let found = read_range(200, kv.as_bytes()).unwrap();
        assert_eq!((found.revision, found.stored.as_ref().map(|s| s.day_micro)), (8, Some(5)));
        assert_eq!(read_range(503, kv.as_bytes()), None);
        assert_eq!(read_range(200, b"<html>"), None);
        assert_eq!(read_txn(200, br#"{"header":{"revision":"12"},"succeeded":true}"#), Some(Ok(12)));
        let refused = format!(r#"{{"header":{{"revision":"9"}},"responses":[{{"response_range":{kv}}}]}}"#);
        assert_eq!(read_txn(200, refused.as_bytes()), Some(Err(found)));
    }

    #[test]
    fn no_call_is_admitted_before_the_record_is_read_then_the_stores_spend_counts() {
        let s = MemStore::new();
        assert_eq!(reserve(&s, "t", caps(), (1, 100, DEC_1 + 9_000), DEC_1), Err(Refused::Unread));
        want(&s, "t");
        want(&s, "t");
        assert_eq!(take_wanted(&s), ["t"], "asked for once");
        assert!(take_wanted(&s).is_empty());
        // The store holds 800 of today's 1000 (spent before a restart).
        let held = Stored { day: DEC_1 / 86_400_000, day_micro: 800, month: 0, month_micro: 0, ..Stored::default() };
        assert!(read(&s, "t", Some(Found { stored: Some(held.clone()), revision: 4 }), DEC_1).reached);
        assert_eq!(spent(&s, "t", DEC_1).0, 800);
        let over = reserve(&s, "t", caps(), (1, 300, DEC_1 + 9_000), DEC_1);
        assert!(matches!(over, Err(Refused::Exhausted(_))), "800 + 300 > 1000: {over:?}");
        reserve(&s, "t", caps(), (2, 150, DEC_1 + 9_000), DEC_1).unwrap();
        settle(&s, "t", caps().0, 2, 40, DEC_1 + 1);
        assert_eq!(spent(&s, "t", DEC_1 + 1).0, 840);
        // Written behind: 800 + 40, at the revision read.
        let flush = write_due(&s, DEC_1 + 2).unwrap();
        assert_eq!((flush.revision, flush.value.day_micro), (4, 840));
        settle(&s, "t", caps().0, 3, 10, DEC_1 + 3);
        flushed(&s, &flush, Some(Ok(5)), DEC_1 + 4);
        assert_eq!(spent(&s, "t", DEC_1 + 4).0, 850, "the 10 settled meanwhile is still counted");
        let next = write_due(&s, DEC_1 + 5).unwrap();
        assert_eq!((next.revision, next.value.day_micro), (5, 850));
        // Another node wrote meanwhile: the write is refused and the record learns its spend.
        let elsewhere = Stored { day_micro: 900, ..held.clone() };
        flushed(&s, &next, Some(Err(Found { stored: Some(elsewhere), revision: 6 })), DEC_1 + 6);
        assert_eq!(spent(&s, "t", DEC_1 + 6).0, 910, "900 in the store and 10 not yet written");
        assert_eq!(write_due(&s, DEC_1 + 7).map(|f| (f.revision, f.value.day_micro)), Some((6, 910)));
    }

    /// The write due for `t`, if a write is.
    fn write_due(s: &MemStore, now_ms: u64) -> Option<Flush> {
        match due(s, &config(), "t", now_ms, now_ms) {
            Some(Due::Write(f)) => Some(f),
            _ => None,
        }
    }

    #[test]
    fn a_store_that_never_answered_admits_one_call_or_the_outage_allowance_then_refuses() {
        let s = MemStore::new();
        assert!(!read(&s, "t", None, DEC_1).reached);
        // Nothing is known of what was spent: one call alone, within the node's share.
        assert_eq!(reserve(&s, "t", caps(), (1, 600, DEC_1 + 9_000), DEC_1), Err(Refused::Outage), "past the share");
        reserve(&s, "t", caps(), (2, 400, DEC_1 + 9_000), DEC_1).expect("one call");
        assert_eq!(reserve(&s, "t", caps(), (3, 1, DEC_1 + 9_000), DEC_1), Err(Refused::Outage), "not a second");
        settle(&s, "t", caps().0, 2, 100, DEC_1 + 1);
        assert_eq!(reserve(&s, "t", caps(), (4, 1, DEC_1 + 9_000), DEC_1 + 1), Err(Refused::Outage), "nor after it");
        assert_eq!(due(&s, &config(), "t", DEC_1 + 2, 1), None, "nothing is written before the store is read");
        let later = DEC_1 + UNREACHABLE_MS;
        assert_eq!(due(&s, &config(), "t", later, 1), Some(Due::Read), "a round reads it again");
        assert!(read(&s, "t", Some(Found { stored: None, revision: 0 }), later).reached);
        assert_eq!(spent(&s, "t", later).0, 100, "what was settled meanwhile is kept");
        reserve(&s, "t", caps(), (5, 400, later + 9_000), later).expect("read: the budget decides again");
        assert_eq!(write_due(&s, later).map(|f| (f.revision, f.value.day_micro)), Some((0, 100)));
        // A configured allowance: that much per node and period, within the share.
        let s = MemStore::new();
        let allowed = (caps().0, Backing { outage_micro: Some(450), ..BACKED });
        read(&s, "t", None, DEC_1);
        reserve(&s, "t", allowed, (1, 300, DEC_1 + 9_000), DEC_1).unwrap();
        reserve(&s, "t", allowed, (2, 150, DEC_1 + 9_000), DEC_1).unwrap();
        assert_eq!(reserve(&s, "t", allowed, (3, 1, DEC_1 + 9_000), DEC_1), Err(Refused::Outage));
    }

    #[test]
    fn replicas_sharing_a_store_each_admit_their_share_of_what_it_left() {
        // Two Envoys without a fleet on one store that holds 200 of today's 1000: each may
        // have 400 in flight or unwritten, so together they never pass the budget.
        let two = (caps().0, Backing { replicas: 2, ..BACKED });
        let today = DEC_1 / 86_400_000;
        let stored = Stored { day: today, day_micro: 200, month: 0, month_micro: 0, ..Stored::default() };
        let (a, b) = (MemStore::new(), MemStore::new());
        for s in [&a, &b] {
            read(s, "t", Some(Found { stored: Some(stored.clone()), revision: 4 }), DEC_1);
            reserve(s, "t", two, (1, 300, DEC_1 + 9_000), DEC_1).expect("300 of its 400");
            assert_eq!(reserve(s, "t", two, (2, 200, DEC_1 + 9_000), DEC_1), Err(Refused::Held), "300 + 200 > 400");
        }
        // Alone, either would have taken both (200 + 300 + 200 <= 1000): the budget's
        // worst cases in flight over both replicas stay within what the store left.
        assert_eq!(reserve(&a, "t", caps(), (2, 200, DEC_1 + 9_000), DEC_1), Ok(Hold::at(200, DEC_1)));
        // A call past a replica's whole share is refused for the day, not held.
        let c = MemStore::new();
        read(&c, "t", Some(Found { stored: Some(stored.clone()), revision: 4 }), DEC_1);
        let Err(Refused::Exhausted(x)) = reserve(&c, "t", two, (1, 401, DEC_1 + 9_000), DEC_1) else {
            panic!("past the share")
        };
        assert_eq!(x.period, "day");
        // Past the share for good, though the day is only held by calls in flight: refused.
        reserve(&c, "t", two, (2, 350, DEC_1 + 9_000), DEC_1).expect("350 of its 400");
        let late = reserve(&c, "t", two, (3, 500, DEC_1 + 9_000), DEC_1);
        assert!(matches!(late, Err(Refused::Exhausted(_))), "500 > its share of 400: {late:?}");
        // B's call settles at 100 and is written; A reads the store: 300 now, so A's share
        // is 350 and its 300 in flight leave no room for 100 more.
        settle(&b, "t", caps().0, 1, 100, DEC_1 + 1);
        let flush = write_due(&b, DEC_1 + 2).unwrap();
        flushed(&b, &flush, Some(Ok(5)), DEC_1 + 3);
        read(&a, "t", Some(Found { stored: Some(flush.value.clone()), revision: 5 }), DEC_1 + 4);
        settle(&a, "t", caps().0, 2, 0, DEC_1 + 4);
        assert_eq!(reserve(&a, "t", two, (3, 100, DEC_1 + 9_000), DEC_1 + 5), Err(Refused::Held));
        assert!(reserve(&a, "t", two, (3, 50, DEC_1 + 9_000), DEC_1 + 5).is_ok(), "300 + 50 <= 350");
    }

    #[test]
    fn two_keepers_of_a_tenant_each_admit_their_share_once_each_has_seen_the_other() {
        // The store holds 200 of today's 1000. Node a keeps the tenant alone, spends and
        // writes; then the ring gives the tenant to node b too.
        let today = DEC_1 / 86_400_000;
        let mut etcd = Key(4, Stored { day: today, day_micro: 200, ..Stored::default() });
        let (a, b) = (MemStore::new(), MemStore::new());
        assert_eq!(read(&a, "t", etcd.found(), DEC_1).sharing, None, "no one else wrote it");
        reserve(&a, "t", caps(), (1, 300, DEC_1 + 9_000), DEC_1).expect("alone: the whole of what is left");
        settle(&a, "t", caps().0, 1, 100, DEC_1);
        let Some(Due::Write(first)) = due(&a, &config(), "t", DEC_1, 11) else { panic!("a write is due") };
        assert_eq!(flushed(&a, &first, Some(etcd.txn(&first)), DEC_1), None, "its own write");
        // b reads a record another process wrote: until its next read could tell whether
        // that one still writes, b admits half of the 700 left (not logged: a restart
        // reads its own previous life so).
        assert_eq!(read(&b, "t", etcd.found(), DEC_1 + 1).sharing, None);
        assert_eq!(budget::keepers(&b, "t", DEC_1 + 1), 2);
        reserve(&b, "t", caps(), (2, 300, DEC_1 + 9_000), DEC_1 + 1).expect("300 of its 350");
        assert_eq!(reserve(&b, "t", caps(), (3, 100, DEC_1 + 9_000), DEC_1 + 1), Err(Refused::Held), "300 + 100");
        // A call past the share alone waits for the other keeper to go: not the day's end.
        assert_eq!(reserve(&b, "t", caps(), (3, 400, DEC_1 + 9_000), DEC_1 + 1), Err(Refused::Held));
        // Until a sees b's write, a admits from the whole: what remains past the budget
        // is what it admits before then (here 300 + 600 in flight over 700 left).
        reserve(&a, "t", caps(), (4, 600, DEC_1 + 9_000), DEC_1 + 1).expect("a has not seen b");
        settle(&b, "t", caps().0, 2, 50, DEC_1 + 2);
        let Some(Due::Write(by_b)) = due(&b, &config(), "t", DEC_1 + 2, 22) else { panic!("a write is due") };
        assert_eq!(flushed(&b, &by_b, Some(etcd.txn(&by_b)), DEC_1 + 2), None, "nothing new to b");
        // a's next write is refused: the key holds b's write, and a learns b keeps it too.
        settle(&a, "t", caps().0, 4, 200, DEC_1 + 3);
        let Some(Due::Write(second)) = due(&a, &config(), "t", DEC_1 + 3, 12) else { panic!("a write is due") };
        assert_eq!(flushed(&a, &second, Some(etcd.txn(&second)), DEC_1 + 3), Some(2));
        // Stored 350, a's 200 not yet written: a's share of the 650 left is 325.
        assert_eq!(reserve(&a, "t", caps(), (5, 200, DEC_1 + 9_000), DEC_1 + 3), Err(Refused::Held), "200 + 200");
        reserve(&a, "t", caps(), (5, 100, DEC_1 + 9_000), DEC_1 + 3).expect("200 + 100 <= 325");
        let Some(Due::Write(third)) = due(&a, &config(), "t", DEC_1 + 4, 13) else { panic!("a write is due") };
        flushed(&a, &third, Some(etcd.txn(&third)), DEC_1 + 4);
        // With nothing left to write, a keeper among several that admits writes anyway
        // (nothing, under a new tag) every `REFRESH_MS`: b sees a go on.
        let beat = DEC_1 + 4 + REFRESH_MS;
        let Some(Due::Write(heartbeat)) = due(&a, &config(), "t", beat, 14) else { panic!("a heartbeat") };
        assert_eq!(heartbeat.value.day_micro, etcd.1.day_micro, "it adds nothing");
        flushed(&a, &heartbeat, Some(etcd.txn(&heartbeat)), beat);
        assert_eq!(budget::keepers(&b, "t", DEC_1 + 1 + REFRESH_MS), 1, "b's first sight of a is over");
        assert_eq!(read(&b, "t", etcd.found(), beat).sharing, Some(2), "a's writes since");
        // A third process writes: both see three keepers.
        let c = MemStore::new();
        read(&c, "t", etcd.found(), beat);
        settle(&c, "t", caps().0, 9, 10, beat);
        let Some(Due::Write(by_c)) = due(&c, &config(), "t", beat, 33) else { panic!("a write is due") };
        flushed(&c, &by_c, Some(etcd.txn(&by_c)), beat);
        assert_eq!(read(&a, "t", etcd.found(), beat + 1).sharing, Some(3));
        assert_eq!(read(&b, "t", etcd.found(), beat + 1).sharing, Some(3));
        // b and c write no more (the ring settled on a): a stops counting each
        // `KEEPERS_MS` after it saw it write last (b at DEC_1 + 3, c at beat + 1), admits
        // from the whole again, and, alone, writes no more heartbeats.
        let later = beat + 1 + KEEPERS_MS;
        assert_eq!(budget::keepers(&a, "t", DEC_1 + 3 + KEEPERS_MS - 1), 3);
        assert_eq!(budget::keepers(&a, "t", later - 1), 2);
        assert_eq!(budget::keepers(&a, "t", later), 1);
        reserve(&a, "t", caps(), (6, 300, later + 9_000), later).expect("alone again");
        settle(&a, "t", caps().0, 6, 0, later);
        settle(&a, "t", caps().0, 5, 0, later);
        assert_eq!(due(&a, &config(), "t", later + REFRESH_MS, 15), Some(Due::Read), "a read, not a write");
    }

    #[test]
    fn a_keepers_refused_heartbeat_goes_again_next_round() {
        // a and b keep the tenant, each with a call in flight and nothing settled: both
        // write a heartbeat in the same round, b's after a's, and b's is refused.
        let today = DEC_1 / 86_400_000;
        let mut etcd = Key(4, Stored { day: today, writes: vec![(7, 70)], ..Stored::default() });
        let (a, b) = (MemStore::new(), MemStore::new());
        for (node, id) in [(&a, 1), (&b, 2)] {
            read(node, "t", etcd.found(), DEC_1);
            reserve(node, "t", caps(), (id, 10, DEC_1 + 600_000), DEC_1).expect("a call in flight");
        }
        let beat = |node: &MemStore, now: u64, tag: u64| match due(node, &config(), "t", now, tag) {
            Some(Due::Write(f)) => Some(f),
            _ => None,
        };
        let (first_a, first_b) = (beat(&a, DEC_1, 11).expect("a beats"), beat(&b, DEC_1, 22).expect("b beats"));
        flushed(&a, &first_a, Some(etcd.txn(&first_a)), DEC_1);
        assert!(etcd.txn(&first_b).is_err(), "a wrote first");
        flushed(&b, &first_b, Some(etcd.txn(&first_b)), DEC_1);
        // b tries again at its next round, not five seconds on; a waits its five seconds.
        let again = beat(&b, DEC_1 + 50, 23).expect("b beats again");
        assert_eq!(flushed(&b, &again, Some(etcd.txn(&again)), DEC_1 + 50), None);
        assert!(beat(&a, DEC_1 + 50, 12).is_none());
        assert_eq!(etcd.1.day_micro, 0, "heartbeats add nothing");
        // a sees b write: both count each other (and, for their first five seconds, the
        // writer their first read named).
        assert_eq!(read(&a, "t", etcd.found(), DEC_1 + 60).sharing, Some(2));
        assert_eq!(budget::keepers(&b, "t", DEC_1 + 60), 3);
        for node in [&a, &b] {
            assert_eq!(budget::keepers(node, "t", DEC_1 + REFRESH_MS), 2);
        }
    }

    /// etcd's key in a test: a revision and a value, written by compare-and-swap.
    struct Key(u64, Stored);

    impl Key {
        fn txn(&mut self, f: &Flush) -> Result<u64, Found> {
            if f.revision != self.0 {
                return Err(Found { stored: Some(self.1.clone()), revision: self.0 });
            }
            (self.0, self.1) = (self.0 + 1, f.value.clone());
            Ok(self.0)
        }

        fn found(&self) -> Option<Found> {
            Some(Found { stored: Some(self.1.clone()), revision: self.0 })
        }
    }

    #[test]
    fn a_write_whose_answer_was_lost_counts_once_after_another_node_wrote_over_it() {
        let today = DEC_1 / 86_400_000;
        let mut etcd = Key(4, Stored { day: today, day_micro: 100, ..Stored::default() });
        let (a, b) = (MemStore::new(), MemStore::new());
        for node in [&a, &b] {
            read(node, "t", etcd.found(), DEC_1);
        }
        // Node a's write lands, and its answer is lost on the way back.
        settle(&a, "t", caps().0, 1, 20, DEC_1);
        let Some(Due::Write(lost)) = due(&a, &config(), "t", DEC_1, 11) else { panic!("a write is due") };
        assert_eq!(etcd.txn(&lost), Ok(5));
        // Node b's write is refused, learns a's, and lands over it.
        settle(&b, "t", caps().0, 2, 30, DEC_1);
        let Some(Due::Write(first)) = due(&b, &config(), "t", DEC_1, 22) else { panic!("a write is due") };
        flushed(&b, &first, Some(etcd.txn(&first)), DEC_1 + 1);
        let Some(Due::Write(again)) = due(&b, &config(), "t", DEC_1 + 1, 23) else { panic!("a write is due") };
        flushed(&b, &again, Some(etcd.txn(&again)), DEC_1 + 2);
        assert_eq!((etcd.0, etcd.1.day_micro), (6, 150));
        // Past its deadline, node a reads the key: its tag is there under b's, so the 20 is
        // in the store and is not written again.
        let late = DEC_1 + 10_000;
        assert_eq!(due(&a, &config(), "t", late, 12), Some(Due::Read));
        read(&a, "t", etcd.found(), late);
        assert_eq!((spent(&a, "t", late).0, spent(&b, "t", late).0), (150, 150));
        assert_eq!(due(&a, &config(), "t", late, 13), None, "nothing left to write");
        // And so when a's answer comes after all: a refusal that holds its tag.
        settle(&a, "t", caps().0, 3, 5, late);
        let Some(Due::Write(next)) = due(&a, &config(), "t", late, 14) else { panic!("a write is due") };
        etcd.txn(&next).expect("lands");
        settle(&b, "t", caps().0, 4, 1, late);
        let Some(Due::Write(other)) = due(&b, &config(), "t", late, 24) else { panic!("a write is due") };
        flushed(&b, &other, Some(etcd.txn(&other)), late + 1);
        let Some(Due::Write(b_again)) = due(&b, &config(), "t", late + 1, 25) else { panic!("a write is due") };
        flushed(&b, &b_again, Some(etcd.txn(&b_again)), late + 2);
        assert_eq!(etcd.1.day_micro, 156, "150, a's 5 and b's 1");
        flushed(&a, &next, Some(Err(etcd.found().unwrap())), late + 3);
        assert_eq!((spent(&a, "t", late + 3).0, due(&a, &config(), "t", late + 3, 15)), (156, None));
    }

    #[test]
    fn a_write_that_lands_after_its_answer_and_check_were_lost_counts_once() {
        let today = DEC_1 / 86_400_000;
        let mut etcd = Key(4, Stored { day: today, day_micro: 100, ..Stored::default() });
        let a = MemStore::new();
        read(&a, "t", etcd.found(), DEC_1);
        settle(&a, "t", caps().0, 1, 20, DEC_1);
        let Some(Due::Write(slow)) = due(&a, &config(), "t", DEC_1, 11) else { panic!("a write is due") };
        // Its answer is lost, and the check read finds the key as it was: the write is
        // given up, unsure; then etcd applies it after all.
        flushed(&a, &slow, etcd.found().map(Err), DEC_1 + 1_000);
        assert_eq!(etcd.txn(&slow), Ok(5));
        // The next write, sent against the revision the node knew, is refused by the key
        // that holds the slow one: its 20 is known written, and not written again.
        let Some(Due::Write(next)) = due(&a, &config(), "t", DEC_1 + 2_000, 12) else { panic!("a write is due") };
        assert_eq!(next.value.day_micro, 120, "sent again while unsure");
        flushed(&a, &next, Some(etcd.txn(&next)), DEC_1 + 2_001);
        assert_eq!((spent(&a, "t", DEC_1 + 2_001).0, due(&a, &config(), "t", DEC_1 + 3_000, 13)), (120, None));
        assert_eq!(etcd.1.day_micro, 120, "100 stored and 20 spent, once");
        // Had it not landed, the next write lands in its place and the unsure one is
        // decided by the key's next revision: counted once either way.
        let mut etcd = Key(4, Stored { day: today, day_micro: 100, ..Stored::default() });
        let b = MemStore::new();
        read(&b, "t", etcd.found(), DEC_1);
        settle(&b, "t", caps().0, 1, 20, DEC_1);
        let Some(Due::Write(lost)) = due(&b, &config(), "t", DEC_1, 21) else { panic!("a write is due") };
        flushed(&b, &lost, etcd.found().map(Err), DEC_1 + 1_000);
        let Some(Due::Write(next)) = due(&b, &config(), "t", DEC_1 + 2_000, 22) else { panic!("a write is due") };
        flushed(&b, &next, Some(etcd.txn(&next)), DEC_1 + 2_001);
        assert_eq!(etcd.txn(&lost).map_err(|f| f.revision), Err(5), "the lost one can no longer land");
        assert_eq!((spent(&b, "t", DEC_1 + 2_001).0, etcd.1.day_micro), (120, 120));
        assert_eq!(due(&b, &config(), "t", DEC_1 + 3_000, 23), None);
    }

    #[test]
    fn a_write_counts_once_whatever_order_its_answers_and_reads_come_in() {
        let s = MemStore::new();
        let today = DEC_1 / 86_400_000;
        let base = Stored { day: today, day_micro: 100, month: 0, month_micro: 0, ..Stored::default() };
        read(&s, "t", Some(Found { stored: Some(base.clone()), revision: 3 }), DEC_1);
        settle(&s, "t", caps().0, 1, 20, DEC_1);
        let flush = write_due(&s, DEC_1).unwrap();
        // The answer was lost; the key holds what was written: it landed.
        flushed(&s, &flush, Some(Err(Found { stored: Some(flush.value.clone()), revision: 4 })), DEC_1 + 1);
        assert_eq!((spent(&s, "t", DEC_1 + 1).0, write_due(&s, DEC_1 + 1)), (120, None), "counted once");
        // A read that learned the write before its answer came knows it by its tag: what was
        // sent is taken out then, and the answer takes nothing out again.
        settle(&s, "t", caps().0, 2, 5, DEC_1 + 2);
        let flush = write_due(&s, DEC_1 + 2).unwrap();
        read(&s, "t", Some(Found { stored: Some(flush.value.clone()), revision: 5 }), DEC_1 + 3);
        assert_eq!(spent(&s, "t", DEC_1 + 3).0, 125, "landed, by its tag");
        settle(&s, "t", caps().0, 3, 7, DEC_1 + 3);
        flushed(&s, &flush, Some(Ok(5)), DEC_1 + 4);
        assert_eq!(spent(&s, "t", DEC_1 + 4).0, 132, "the 7 settled since is kept");
        assert_eq!(write_due(&s, DEC_1 + 4).map(|f| f.value.day_micro), Some(132));
        // Not learned for a while: read again, and what another node spent counts here.
        assert_eq!(due(&s, &config(), "t", DEC_1 + 4 + REFRESH_MS, 1), Some(Due::Read));
        let elsewhere = Stored { day_micro: 400, ..base.clone() };
        read(&s, "t", Some(Found { stored: Some(elsewhere), revision: 9 }), DEC_1 + 5 + REFRESH_MS);
        assert_eq!(spent(&s, "t", DEC_1 + 5 + REFRESH_MS).0, 407, "and the 7 still to write");
        read(&s, "t", Some(Found { stored: Some(base.clone()), revision: 8 }), DEC_1 + 6 + REFRESH_MS);
        assert_eq!(spent(&s, "t", DEC_1 + 6 + REFRESH_MS).0, 407, "an older answer is dropped");
    }

    #[test]
    fn two_rounds_that_send_the_same_sums_count_once_and_lose_nothing_settled_between() {
        let s = MemStore::new();
        let today = DEC_1 / 86_400_000;
        let base = Stored { day: today, day_micro: 100, month: 0, month_micro: 0, ..Stored::default() };
        read(&s, "t", Some(Found { stored: Some(base.clone()), revision: 3 }), DEC_1);
        settle(&s, "t", caps().0, 1, 20, DEC_1);
        // etcd is slower than a round: while one write is out, another worker's round sends
        // none beside it.
        let Some(Due::Write(a)) = due(&s, &config(), "t", DEC_1, 11) else { panic!("a write due") };
        assert_eq!(due(&s, &config(), "t", DEC_1 + 1, 12), None, "one write out at a time");
        // Should the same sums be sent all the same (a record written by an older build),
        // their tags tell them apart.
        let b = Flush { value: Stored { write: Some(12), ..a.value.clone() }, ..a.clone() };
        assert_eq!((a.value.day_micro, b.value.day_micro), (120, 120));
        settle(&s, "t", caps().0, 2, 7, DEC_1 + 1);
        // The first lands; the second is refused and finds the first there.
        flushed(&s, &a, Some(Ok(4)), DEC_1 + 2);
        flushed(&s, &b, Some(Err(Found { stored: Some(a.value.clone()), revision: 4 })), DEC_1 + 3);
        assert_eq!(spent(&s, "t", DEC_1 + 3).0, 127, "the 7 settled between is still here");
        let next = write_due(&s, DEC_1 + 4).unwrap();
        assert_eq!((next.revision, next.value.day_micro), (4, 127), "and written next");
    }

    #[test]
    fn a_call_that_settles_after_its_worst_case_was_written_is_never_charged_below_it() {
        let s = MemStore::new();
        read(&s, "t", Some(Found { stored: None, revision: 0 }), DEC_1);
        // A stream outlives its deadline: its worst case is charged and written.
        reserve(&s, "t", caps(), (1, 300, DEC_1 + 10), DEC_1).unwrap();
        let flush = write_due(&s, DEC_1 + 20).unwrap();
        assert_eq!(flush.value.day_micro, 300);
        flushed(&s, &flush, Some(Ok(1)), DEC_1 + 21);
        // Another call settles 200; then the stream ends costing 40: the 300 written stays,
        // and the 200 is still to be written.
        reserve(&s, "t", caps(), (2, 200, DEC_1 + 9_000), DEC_1 + 25).unwrap();
        settle(&s, "t", caps().0, 2, 200, DEC_1 + 26);
        settle(&s, "t", caps().0, 1, 40, DEC_1 + 30);
        assert_eq!(spent(&s, "t", DEC_1 + 30).0, 500);
        assert_eq!(write_due(&s, DEC_1 + 31).map(|f| f.value.day_micro), Some(500));
    }

    #[test]
    fn a_write_whose_answer_and_check_are_both_lost_is_not_written_again() {
        let s = MemStore::new();
        read(&s, "t", Some(Found { stored: None, revision: 0 }), DEC_1);
        settle(&s, "t", caps().0, 1, 100, DEC_1);
        let f1 = write_due(&s, DEC_1).unwrap();
        // It lands (etcd holds it, at revision 1); its answer and the read after are lost.
        flushed(&s, &f1, None, DEC_1 + 1);
        assert_eq!(due(&s, &config(), "t", DEC_1 + 2, 2), None, "nothing more is sent while it may be out");
        // Past its deadline, the key is read first, and its tag says it landed.
        let later = DEC_1 + 4_000;
        assert_eq!(due(&s, &config(), "t", later, 3), Some(Due::Read));
        read(&s, "t", Some(Found { stored: Some(f1.value), revision: 1 }), later);
        assert_eq!((spent(&s, "t", later).0, write_due(&s, later + 1)), (100, None), "written once");
    }

    #[test]
    fn a_write_never_sent_or_a_key_reset_does_not_block_a_tenants_writes() {
        let s = MemStore::new();
        read(&s, "t", Some(Found { stored: None, revision: 5 }), DEC_1);
        settle(&s, "t", caps().0, 1, 100, DEC_1);
        // The callout could not be sent: the write is not out, the next round sends one.
        let f = write_due(&s, DEC_1).unwrap();
        not_sent(&s, &f, DEC_1);
        let f = write_due(&s, DEC_1 + 1).expect("not blocked");
        // Sent, unanswered; etcd is rebuilt meanwhile (its revisions start again).
        flushed(&s, &f, None, DEC_1 + 2);
        let later = DEC_1 + 4_000;
        assert_eq!(due(&s, &config(), "t", later, 9), Some(Due::Read));
        read(&s, "t", Some(Found { stored: None, revision: 1 }), later);
        let again = write_due(&s, later + 1).expect("writes again");
        assert_eq!(again.value.day_micro, 100);
    }

    #[test]
    fn the_log_says_when_the_stores_cluster_is_unknown_and_when_it_is_known_again() {
        let (s, config) = (MemStore::new(), Config::parse(br#"{"budget_store":{"cluster":"etdc"}}"#).unwrap());
        assert_eq!(sent(&s, &config, false), None, "a call sent: nothing to say");
        let Some(Note::Critical(line)) = sent(&s, &config, true) else { panic!("critical") };
        assert!(line.contains("budget_store.cluster 'etdc' is no cluster this Envoy knows"), "{line}");
        assert!(misconfigured(&s) && sent(&s, &config, true).is_none(), "once per process");
        assert!(matches!(sent(&s, &config, false), Some(Note::Info(_))));
        let taught = |reached, sharing| Taught { tenant: "t".into(), reached, sharing, next: None };
        assert!(taught(None, Some(1)).notes(&config).is_empty(), "one keeper is the configured number");
        let notes = taught(Some(false), Some(2)).notes(&config);
        assert!(
            matches!(notes.as_slice(), [Note::Warn(a), Note::Warn(b)] if a.contains("does not answer") && b.contains("written by 2 processes")),
            "{notes:?}"
        );
    }

    #[test]
    fn the_process_flags_change_once_for_whoever_changes_them() {
        let s = MemStore::new();
        assert!(!set_reached(&s, true), "a store never heard from is taken as answering");
        assert!(set_reached(&s, false));
        assert!(!set_reached(&s, false), "once, not per worker");
        assert!(set_reached(&s, true));
        assert!(!misconfigured(&s) && !set_misconfigured(&s, false));
        assert!(set_misconfigured(&s, true) && misconfigured(&s));
        assert!(!set_misconfigured(&s, true));
    }

    #[test]
    fn a_node_whose_clock_lags_adds_to_the_stores_newer_day_never_resets_it() {
        let s = MemStore::new();
        let today = DEC_1 / 86_400_000;
        // Another node already writes tomorrow's spend.
        let ahead = Stored { day: today + 1, day_micro: 50, month: 0, month_micro: 0, ..Stored::default() };
        read(&s, "t", Some(Found { stored: Some(ahead), revision: 3 }), DEC_1);
        settle(&s, "t", caps().0, 1, 20, DEC_1);
        let flush = write_due(&s, DEC_1 + 1).unwrap();
        assert_eq!((flush.value.day, flush.value.day_micro), (today + 1, 70));
    }

    #[test]
    fn reservations_past_the_list_and_a_previous_releases_spend_are_written_not_lost() {
        let s = MemStore::new();
        let open = (Caps { per_day: Some(u64::MAX), per_month: None }, BACKED);
        read(&s, "t", Some(Found { stored: None, revision: 0 }), DEC_1);
        for id in 0..crate::core::limits::budget::MAX_IN_FLIGHT as u64 + 2 {
            reserve(&s, "t", open, (id, 10, DEC_1 + 9_000), DEC_1).unwrap();
        }
        let flush = write_due(&s, DEC_1).unwrap();
        assert_eq!(flush.value.day_micro, 20, "the two no longer listed, as settled at their worst case");
        flushed(&s, &flush, Some(Ok(1)), DEC_1);
        assert_eq!(
            spent(&s, "t", DEC_1).0,
            10 * (crate::core::limits::budget::MAX_IN_FLIGHT as u64 + 2),
            "still charged"
        );
        // A record written before the store: its settled spend is the store's to be told.
        let (day, month) = (DEC_1 / 86_400_000, 2026 * 12 + 11);
        s.set(&crate::core::limits::budget::key("old"), format!("{day} 70 {month} 90|").as_bytes(), None).unwrap();
        read(&s, "old", Some(Found { stored: None, revision: 0 }), DEC_1);
        assert_eq!(spent(&s, "old", DEC_1), (70, 90));
    }

    #[test]
    fn one_worker_a_round() {
        let (s, c) = (MemStore::new(), config());
        assert!(round_due(&s, &c, DEC_1));
        assert!(!round_due(&s, &c, DEC_1 + 999));
        assert!(round_due(&s, &c, DEC_1 + 1_000));
    }
}
