//! The flights one worker leads, wherever each stands: decided and not yet dispatched, in
//! a callout, asleep (backoff, or held for its bucket), asking a model owner for a
//! verdict, streaming along the route, or (on a forward node) on their way to the owner.

use super::ids::IdMap;
use crate::core::api::key::Key;
use crate::core::coalesce::engine::Call;
use crate::core::flight::leader::Leader;
use crate::core::flight::tee::Hop;
use crate::core::upstream::Outbound;
use std::rc::Rc;

/// A leader on its way (`flight::leader`), with the request it answers.
pub struct Run {
    pub context_id: u32,
    pub leader: Leader,
}

/// A callout in the air: what its answer is for.
pub enum Callout {
    /// A leader's question's embedding.
    Embedding(Run),
    /// An attempt of a leader's flight.
    Attempt(Run),
    /// A model's or a tenant's owner node asked to admit a leader's call.
    Verdict(Run),
    /// The spend store's call of this id (`budget_store::Calls`).
    Store(u64),
    /// The API key's check.
    KeyCheck,
    /// The read of the spend store's tenants table.
    Tenants,
}

impl Callout {
    /// The flight a leader leads while this is out, if any.
    fn call(&self) -> Option<&Call> {
        match self {
            Callout::Embedding(r) | Callout::Attempt(r) | Callout::Verdict(r) => Some(r.leader.call()),
            Callout::Store(_) | Callout::KeyCheck | Callout::Tenants => None,
        }
    }
}

#[derive(Default)]
pub struct Runs {
    /// Calls decided in an http context, dispatched from the root on the next queue event.
    pub pending: Vec<(u32, Call, Rc<Outbound>)>,
    /// Every callout in the air, by its token: what its answer is for.
    pub callouts: IdMap<Callout>,
    /// Asleep until the time each carries.
    pub sleeping: Vec<(u64, Run)>,
    /// Stream flights forwarded along the route, by http context.
    pub streaming: IdMap<Run>,
    /// A forward node's flights on their way to their owners, by http context.
    pub hops: IdMap<Hop>,
    /// Keys of stream flights that ended, whose waiters the root wakes (here, and on every
    /// worker when the flight was watched).
    pub ended: Vec<(Key, bool)>,
}

impl Runs {
    /// The calls of every flight this worker leads, for their lease renewals.
    pub fn calls(&self) -> impl Iterator<Item = &Call> {
        let runs = self.sleeping.iter().map(|(_, r)| r).chain(self.streaming.values());
        let calling = self.callouts.values().filter_map(Callout::call);
        let waiting = self.pending.iter().map(|(_, c, _)| c);
        runs.map(|r| r.leader.call()).chain(calling).chain(waiting).chain(self.hops.values().map(|h| &h.call))
    }

    /// The spend store's calls sent (`BudgetStore::tick`, `BudgetStore::answered`), each
    /// under its callout's token.
    pub fn store_calls(&mut self, sent: Vec<(u32, u64)>) {
        self.callouts.extend(sent.into_iter().map(|(token, id)| (token, Callout::Store(id))));
    }

    /// A sleeping flight whose time has come.
    pub fn take_due(&mut self, now: u64) -> Option<Run> {
        let at = self.sleeping.iter().position(|(until, _)| *until <= now)?;
        Some(self.sleeping.swap_remove(at).1)
    }

    /// The next pending call, in the order they came.
    pub fn next_pending(&mut self) -> Option<(u32, Call, Rc<Outbound>)> {
        (!self.pending.is_empty()).then(|| self.pending.remove(0))
    }
}
