//! The flights one worker leads, wherever each stands: decided and not yet dispatched, in
//! a callout, asleep (backoff, or held for its bucket), asking a model owner for a
//! verdict, streaming along the route, or (on a forward node) on their way to the owner.

use super::ids::IdMap;
use crate::core::api::hints::ProviderHints;
use crate::core::api::key::Key;
use crate::core::api::response::Response;
use crate::core::api::usage::Usage;
use crate::core::cache::edge::Origin;
use crate::core::cache::Fresh;
use crate::core::coalesce::engine::Call;
use crate::core::flight::look::Look;
use crate::core::flight::Flight;
use crate::core::observe::log_fields::Spent;
use crate::core::semantic::Learned;
use crate::core::upstream::Outbound;
use std::rc::Rc;

/// A flight on its way, with the request it answers.
pub struct Run {
    pub context_id: u32,
    pub flight: Flight,
    pub outbound: Rc<Outbound>,
    /// What the flight has spent so far, for its request's access-log line.
    pub spent: Spent,
    /// Its question's vector, which joins the semantic index when its answer is stored.
    pub learned: Option<Learned>,
}

/// A callout in the air: what its answer is for.
pub enum Callout {
    /// An attempt of a flight.
    Attempt(Run),
    /// A model's or a tenant's owner node asked to admit a flight's call.
    Verdict(Run),
    /// A leader's question's embedding.
    Embedding(Probing),
    /// The spend store's call of this id (`budget_store::Calls`).
    Store(u64),
    /// The API key's check.
    KeyCheck,
}

impl Callout {
    /// The flight a leader leads while this is out, if any.
    fn call(&self) -> Option<&Call> {
        match self {
            Callout::Attempt(r) | Callout::Verdict(r) => Some(&r.flight.call),
            Callout::Embedding(p) => Some(&p.look.call),
            Callout::Store(_) | Callout::KeyCheck => None,
        }
    }
}

/// A flight's leader waiting for its question's embedding before it goes upstream.
pub struct Probing {
    pub context_id: u32,
    pub look: Look,
    pub outbound: Rc<Outbound>,
}

/// A forward node's flight: its leader's request on its way to the key's owner along the
/// route, whose answer its http context tees for the near copy and the flight's waiters.
pub struct Hop {
    pub call: Call,
    pub outbound: Rc<Outbound>,
    /// How long the owner's answer may be kept, once its headers said (`None`: not at all).
    pub fresh: Option<Fresh>,
    /// The owner's headers its answer keeps for the flight's waiters (see `edge::kept`).
    pub kept: Vec<(String, String)>,
    /// Whether its answer is shared with the flight's waiters (`edge::shared_with_waiters`:
    /// keyed by the owner as by this node, or an error that names no key).
    pub shared: bool,
    /// When the owner produced its answer, and whether it was STALE: the waiters share it
    /// as of then.
    pub origin: Option<Origin>,
}

/// How a stream forwarded along the route ended, as its http context saw it.
pub struct StreamEnd {
    /// The reassembled `chat.completion`, or HolySheep's error; `None` when the stream
    /// broke off (reset, timeout, the client gone) before it finished.
    pub outcome: Option<Response>,
    pub usage: Option<Usage>,
    /// Completion tokens streamed before the end, estimated.
    pub streamed_tokens: u64,
    /// HolySheep's status (`None`: its answer's headers never came).
    pub status: Option<u16>,
    /// Attempts Envoy's router made (retries before the first byte); 0 when the request
    /// never left.
    pub attempts: u64,
    /// What HolySheep's answer said about its limits.
    pub hints: ProviderHints,
}

impl StreamEnd {
    /// A forwarded stream that never got its answer's headers (or never left).
    pub fn broken() -> StreamEnd {
        let hints = ProviderHints::default();
        StreamEnd { outcome: None, usage: None, streamed_tokens: 0, status: None, attempts: 1, hints }
    }

    /// A stream whose request never left (its client gone while it was held).
    pub fn never_sent() -> StreamEnd {
        StreamEnd { attempts: 0, ..StreamEnd::broken() }
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
        runs.map(|r| &r.flight.call).chain(calling).chain(waiting).chain(self.hops.values().map(|h| &h.call))
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
