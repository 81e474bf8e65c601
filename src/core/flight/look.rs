//! A leader's look for a paraphrase before its flight, sans-IO and the same on every host:
//! whether it embeds its question (the semantic tier wants it, the operator's key is there
//! to pay, and the embedding passes admission: `limits::embedding`), what the embedding's
//! answer was billed and is charged, and then the semantic index: a close paraphrase's
//! fresh answer ends the flight (SEMANTIC); anything else, a failed or slow embedding
//! included, lets the flight go upstream as the MISS it is.
//!
//! The shell sends the embedding (`Begun::Embed`) with the operator's key within
//! `semantic.timeout_ms`, and hands its answer back (`Look::answered`).

use crate::core::coalesce::engine::{Call, Ended, Engine};
use crate::core::config::Config;
use crate::core::limits::embedding::{self, For};
use crate::core::limits::fleet::Op;
use crate::core::semantic::{self, Embedding, Learned, Probe};
use crate::core::store::CasStore;
use crate::core::upstream::Outbound;

/// A leader whose question is being embedded.
#[derive(Debug, Clone)]
pub(crate) struct Look {
    pub call: Call,
    probe: Probe,
    tenant: Option<String>,
}

/// What a leader does first.
#[derive(Debug)]
pub(crate) enum Begun {
    /// Send this embedding request's body to HolySheep's `/v1/embeddings`, then
    /// `Look::answered`.
    Embed(Look, Vec<u8>),
    /// No look: the flight goes upstream now.
    Go(Call),
}

/// The embedding call's answer, as the shell got it.
#[derive(Debug, Clone, Copy)]
pub enum Answer<'a> {
    /// The host refused to send it: it never left.
    Unsent,
    /// No answer (a reset, a timeout): it may have been billed.
    Lost,
    /// HolySheep's status and its body (`None`: larger than the edge reads).
    Got { status: u16, body: Option<&'a [u8]> },
}

/// What the look came to.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// A paraphrase's answer ended the flight (answer the leader, wake its waiters).
    Answered(Ended),
    /// The flight goes upstream, with the question's vector when it was embedded.
    Go(Call, Option<Learned>),
}

/// The look's end, with what the shell reports of it.
#[derive(Debug)]
pub(crate) struct Looked {
    pub outcome: Outcome,
    /// A settlement for the tenant's owner node (in a fleet), sent without waiting.
    pub settle: Option<Op>,
    /// Whether the embedding call left, the tokens its answer reported, and whether the
    /// index held a paraphrase just below the threshold (`metrics::for_embedding`).
    pub sent: bool,
    pub tokens: Option<u64>,
    pub near_miss: bool,
    /// What the embedding cost at the embedding model's prices (for the request's log).
    pub cost_micro_usd: u64,
}

/// A leader's first step: embed its question, or go. `keyed`: the operator's key is there
/// to pay for the embedding.
pub(crate) fn begin(
    store: &impl CasStore,
    config: &Config,
    call: Call,
    outbound: &Outbound,
    keyed: bool,
    now_ms: u64,
) -> Begun {
    let probe = call.looks_for_paraphrase(config, outbound.semantic.as_ref()).filter(|_| keyed).cloned();
    let Some(probe) = probe else { return Begun::Go(call) };
    let asked =
        For { tenant: outbound.tenant.as_deref(), model: &outbound.model, worst_tokens: outbound.worst_tokens() };
    // Within the tenant's budget and the embedding model's bucket, or not at all.
    if !embedding::admit(store, config, ticket(&call), &probe, asked, now_ms) {
        return Begun::Go(call);
    }
    let body = semantic::embedding_body(config, &probe.text);
    Begun::Embed(Look { call, probe, tenant: outbound.tenant.clone() }, body)
}

/// The embedding's admission ticket: the flight's key and its lease's nonce.
fn ticket(call: &Call) -> (&crate::core::api::key::Key, u64) {
    (&call.key, call.lease.as_ref().map_or(0, |l| l.nonce))
}

impl Look {
    /// The embedding call ended with `answer`: it is charged what it was billed (nothing
    /// when it never left or HolySheep refused it with a 4xx; its worst case when its cost
    /// is unknown), then the index is searched with its vector.
    pub(crate) fn answered<S: CasStore>(self, engine: &Engine<'_, S>, answer: Answer<'_>, now_ms: u64) -> Looked {
        let (store, config) = (engine.store, engine.config);
        let embedding = match answer {
            Answer::Got { status, body: Some(body) } => semantic::parse_embedding(config, status, body),
            _ => None,
        };
        let billed = match (&embedding, answer) {
            // An answer that says nothing of its cost may have cost its worst case.
            (Some(e), _) => e.tokens,
            (None, Answer::Unsent) => Some(0),
            (None, Answer::Got { status: 400..=499, .. }) => Some(0),
            (None, _) => None,
        };
        let tenant = self.tenant.as_deref();
        let settle = embedding::charge(store, config, (ticket(&self.call), &self.probe), tenant, billed, now_ms);
        // The flight's own time (its deadline, its wait for a bucket) starts now.
        let call = Call { started_ms: now_ms, ..self.call };
        let sent = !matches!(answer, Answer::Unsent);
        let Some(Embedding { vector, tokens }) = embedding else {
            let outcome = Outcome::Go(call, None);
            return Looked { outcome, settle, sent, tokens: None, near_miss: false, cost_micro_usd: 0 };
        };
        let found = semantic::find(store, config, &self.probe.partition, &vector);
        let outcome = match engine.end_similar(&call, &found.matches, now_ms) {
            Some(ended) => Outcome::Answered(ended),
            None => Outcome::Go(call, Some(Learned { partition: self.probe.partition, vector })),
        };
        let cost_micro_usd = config.embedding_cost_micro_usd(billed.unwrap_or(0));
        Looked { outcome, settle, sent, tokens, near_miss: found.near_miss(), cost_micro_usd }
    }
}
