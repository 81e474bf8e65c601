//! A process's calls to the spend store, sans-IO: which it makes and when (the reads calls
//! wait for, then once a round a write, or a read, of each budgeted tenant's record with no
//! call out), and what each answer means for it (`budget_store`'s reading of it). A shell
//! sends each call it is given, under the id it came with, and hands back its answer, or
//! says it could not send it.

use super::{Due, Flush, Found};
use crate::core::api::call::HttpCall;
use crate::core::api::note::Note;
use crate::core::config::Config;
use crate::core::store::CasStore;

/// What a call to the store asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Asked {
    /// The tenant's key.
    Read(String),
    /// A write of what was settled.
    Write(Flush),
    /// The read after a write whose answer was lost: did it land?
    Check(Flush),
}

impl Asked {
    /// The call to etcd's JSON gateway (`budget_store.cluster`) that asks it.
    pub fn call(&self, config: &Config) -> HttpCall {
        let call = match self {
            Asked::Read(tenant) => super::range(config, tenant),
            Asked::Write(f) => super::txn(config, &f.tenant, f.revision, &f.value),
            Asked::Check(f) => super::range(config, &f.tenant),
        };
        call.http(config)
    }

    /// The tenant whose key it asks about.
    pub fn tenant(&self) -> &str {
        match self {
            Asked::Read(tenant) => tenant,
            Asked::Write(f) | Asked::Check(f) => &f.tenant,
        }
    }
}

/// An answer as read: to a read (`range`: the key, or `None` for no answer) or to a write
/// (`txn`: written at a revision, refused with what the key holds, or `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heard {
    Range(Option<Found>),
    Txn(Option<Result<u64, Found>>),
}

/// What an answer (or a call that could not be sent) taught, for the shell's log and gauges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taught {
    /// The tenant whose key it was.
    pub tenant: String,
    /// Whether the store answers changed for the process (log it once): `Some(true)`, it
    /// answers again; `Some(false)`, it stopped.
    pub reached: Option<bool>,
    /// More processes than before keep the tenant's spend: how many now.
    pub sharing: Option<u32>,
    /// The next call to send (a check after a write whose answer was lost).
    pub next: Option<(u64, Asked)>,
}

impl Taught {
    /// What the log says of it: the store's silence or its return (once per change in
    /// the process), and more processes than `budget_store.replicas` writing the tenant's
    /// spend (each time their number grows, not per request).
    pub fn notes(&self, config: &Config) -> Vec<Note> {
        let mut notes = Vec::new();
        match self.reached {
            Some(true) => notes.push(Note::Info("holysheep: the spend store answers again".into())),
            Some(false) => notes.push(Note::Warn(
                "holysheep: the spend store (budget_store) does not answer: tenants' budgets are admitted from \
                 this node's share and settled spend waits to be written"
                    .into(),
            )),
            None => {}
        }
        if let Some(keepers) = self.sharing.filter(|n| *n > config.budget_store.replicas) {
            let why = if config.fleet.shared_limits() {
                "the fleet's ring gave the tenant to more than one owner, or another fleet shares the store \
                 without budget_store.replicas"
            } else {
                "other Envoys share the store: set budget_store.replicas to their number"
            };
            notes.push(Note::Warn(format!(
                "holysheep: tenant {}'s spend is written by {keepers} processes ({why}); each admits its share \
                 of what the store left while the others keep writing",
                self.tenant
            )));
        }
        notes
    }
}

/// The calls a process (in Envoy, one worker) has out, by id: at most one per tenant.
#[derive(Debug)]
pub struct Calls {
    out: Vec<(u64, Asked, u64)>,
    next_id: u64,
    /// Whether the store answered this one's last call (the process's flag is written only
    /// when that changes).
    reached: bool,
}

impl Default for Calls {
    fn default() -> Self {
        Calls { out: Vec::new(), next_id: 1, reached: true }
    }
}

impl Calls {
    /// The node's tick: calls the host never answered are forgotten (it answers each by its
    /// timeout); then the reads calls wait for; then, when this round is due, a write (or
    /// a read) of each budgeted tenant's record that has no call out. `tag` gives each
    /// write its random tag.
    pub fn tick(
        &mut self,
        store: &impl CasStore,
        config: &Config,
        now_ms: u64,
        mut tag: impl FnMut() -> u64,
    ) -> Vec<(u64, Asked)> {
        if !config.budget_store.enabled() {
            return Vec::new();
        }
        let stale = config.budget_store.timeout_ms.saturating_mul(2) + 1_000;
        self.out.retain(|(_, _, sent)| now_ms.saturating_sub(*sent) <= stale);
        let mut asked = Vec::new();
        for tenant in super::take_wanted(store) {
            if !self.busy(&tenant) {
                asked.push(self.send(Asked::Read(tenant), now_ms));
            }
        }
        if !super::round_due(store, config, now_ms) {
            return asked;
        }
        for tenant in super::budgeted(config) {
            if self.busy(tenant) {
                continue;
            }
            match super::due(store, config, tenant, now_ms, tag()) {
                Some(Due::Write(flush)) => asked.push(self.send(Asked::Write(flush), now_ms)),
                Some(Due::Read) => asked.push(self.send(Asked::Read(tenant.to_owned()), now_ms)),
                None => {}
            }
        }
        asked
    }

    /// Whether a call about `tenant`'s key is out.
    fn busy(&self, tenant: &str) -> bool {
        self.out.iter().any(|(_, a, _)| a.tenant() == tenant)
    }

    fn send(&mut self, asked: Asked, now_ms: u64) -> (u64, Asked) {
        let id = self.next_id;
        self.next_id += 1;
        self.out.push((id, asked.clone(), now_ms));
        (id, asked)
    }

    /// The call `id` was answered with `answer` (its status and body; `None`: no answer
    /// within `budget_store.timeout_ms`). `None` when `id` is no call of these.
    pub fn answered(
        &mut self,
        store: &impl CasStore,
        id: u64,
        answer: Option<(u16, &[u8])>,
        now_ms: u64,
    ) -> Option<Taught> {
        let (_, asked, _) = self.out.iter().find(|(i, _, _)| *i == id)?;
        let heard = match asked {
            Asked::Write(_) => Heard::Txn(answer.and_then(|(s, b)| super::read_txn(s, b))),
            Asked::Read(_) | Asked::Check(_) => Heard::Range(answer.and_then(|(s, b)| super::read_range(s, b))),
        };
        self.heard(store, id, heard, now_ms)
    }

    /// The call `id` was answered, read as `heard`.
    pub fn heard(&mut self, store: &impl CasStore, id: u64, heard: Heard, now_ms: u64) -> Option<Taught> {
        let at = self.out.iter().position(|(i, _, _)| *i == id)?;
        let (_, asked, _) = self.out.swap_remove(at);
        let tenant = asked.tenant().to_owned();
        let (found, written) = match heard {
            Heard::Range(found) => (found, None),
            Heard::Txn(written) => (None, written),
        };
        let (reached, sharing, next) = match asked {
            Asked::Read(_) => {
                let learned = super::read(store, &tenant, found, now_ms);
                (learned.reached, learned.sharing, None)
            }
            Asked::Check(flush) => {
                let reached = found.is_some();
                (reached, super::flushed(store, &flush, found.map(Err), now_ms), None)
            }
            Asked::Write(flush) => match written {
                // It may have landed: the key says (a refusal that finds what was written
                // is taken as written).
                None => (false, None, Some(self.send(Asked::Check(flush), now_ms))),
                Some(written) => (true, super::flushed(store, &flush, Some(written), now_ms), None),
            },
        };
        let reached = self.reached(store, reached);
        Some(Taught { tenant, reached, sharing, next })
    }

    /// The call `id` could not be sent: a write was never out (its spend is sent again);
    /// a read is as unanswered.
    pub fn unsent(&mut self, store: &impl CasStore, id: u64, now_ms: u64) -> Option<Taught> {
        let at = self.out.iter().position(|(i, _, _)| *i == id)?;
        match &self.out[at].1 {
            Asked::Write(flush) => {
                let flush = flush.clone();
                self.out.swap_remove(at);
                super::not_sent(store, &flush, now_ms);
                Some(Taught { tenant: flush.tenant, reached: None, sharing: None, next: None })
            }
            Asked::Read(_) | Asked::Check(_) => self.heard(store, id, Heard::Range(None), now_ms),
        }
    }

    /// Whether the store answering (or not) is news for the process.
    fn reached(&mut self, store: &impl CasStore, reached: bool) -> Option<bool> {
        if std::mem::replace(&mut self.reached, reached) == reached && reached {
            return None;
        }
        super::set_reached(store, reached).then_some(reached)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::tenants::Caps;
    use crate::core::limits::budget::{self, Backing, Stored};
    use crate::core::store::MemStore;

    /// 2026-12-01, 00:00 UTC.
    const DEC_1: u64 = 1_796_083_200_000;

    /// Tenant `t` with a budget of 1000 micro-dollars a day, its spend kept in etcd.
    fn config() -> Config {
        let raw = format!(
            r#"{{"budget_store":{{"cluster":"etcd"}},"models":{{"m":{{"usd_per_mtok_input":1}}}},"tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":0.001}}}}}}"#,
            "a".repeat(64)
        );
        Config::parse(raw.as_bytes()).unwrap()
    }

    #[test]
    fn a_write_never_sent_is_sent_again_and_one_whose_answer_is_lost_is_checked() {
        let (s, config) = (MemStore::new(), config());
        let mut calls = Calls::default();
        // A call waits for the tenant's key: it is read first.
        super::super::want(&s, "t");
        let asked = calls.tick(&s, &config, DEC_1, || 7);
        let [(id, Asked::Read(tenant))] = asked.as_slice() else { panic!("{asked:?}") };
        assert_eq!(tenant, "t");
        calls.heard(&s, *id, Heard::Range(Some(Found { stored: None, revision: 0 })), DEC_1).unwrap();
        // 40 micro-dollars settled, to be written behind.
        let caps = (Caps { per_day: Some(1_000), per_month: None }, Backing::of(&config, true));
        budget::reserve(&s, "t", caps, (1, 100, DEC_1 + 9_000), DEC_1).unwrap();
        budget::settle(&s, "t", caps.0, 1, 40, DEC_1 + 1);
        let writes = calls.tick(&s, &config, DEC_1 + 2_000, || 7);
        let [(id, Asked::Write(flush))] = writes.as_slice() else { panic!("{writes:?}") };
        assert_eq!(flush.value.day_micro, 40);
        // The host would not send it: it was never out, and the next round sends it again.
        calls.unsent(&s, *id, DEC_1 + 2_001).unwrap();
        let again = calls.tick(&s, &config, DEC_1 + 4_000, || 8);
        let [(id, Asked::Write(flush))] = again.as_slice() else { panic!("{again:?}") };
        assert_eq!(flush.value.day_micro, 40, "the same spend, once");
        // Its answer lost: the key is read to learn whether it landed, and nothing else of
        // the tenant's is sent while that read is out.
        let taught = calls.answered(&s, *id, None, DEC_1 + 4_100).unwrap();
        assert_eq!(taught.reached, Some(false), "the store's silence is news once");
        let Some((check, Asked::Check(_))) = taught.next else { panic!("{taught:?}") };
        assert!(calls.tick(&s, &config, DEC_1 + 6_000, || 9).is_empty());
        // The check finds the write landed: the store answers again, and nothing is left to write.
        let landed = Stored { day: DEC_1 / 86_400_000, day_micro: 40, write: Some(8), ..Stored::default() };
        let taught =
            calls.heard(&s, check, Heard::Range(Some(Found { stored: Some(landed), revision: 1 })), DEC_1 + 6_100);
        assert_eq!(taught.map(|t| t.reached), Some(Some(true)));
        assert_eq!(budget::spent(&s, "t", DEC_1 + 6_200).0, 40);
    }
}
