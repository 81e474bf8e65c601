//! A leader's look for a paraphrase before its flight, as in the Envoy shell: the
//! question's embedding (`Gateway::embed`), then the semantic index; a close paraphrase's
//! fresh answer ends the flight (SEMANTIC), anything else lets it go upstream.

use super::instance::Gateway;
use crate::component::host;
use crate::core::api::reply::Reply;
use crate::core::coalesce::engine::Call;
use crate::core::semantic::{self, spend, Learned};
use crate::core::upstream::Outbound;

/// What the look came to.
pub(super) enum Looked {
    /// A paraphrase's answer.
    Answered(Reply),
    /// The call goes upstream, with the question's vector when it was embedded.
    Go(Call, Option<Learned>),
}

impl Gateway {
    pub(super) fn look_for_paraphrase(&self, call: Call, outbound: &Outbound) -> Looked {
        let probe = call.looks_for_paraphrase(&self.config, outbound.semantic.as_ref());
        let (Some(probe), Some(bearer)) = (probe, self.bearer.as_deref()) else { return Looked::Go(call, None) };
        // Within the tenant's budget and the embedding model's bucket, or not at all.
        let nonce = call.lease.as_ref().map_or(0, |l| l.nonce);
        if !spend::admit(&self.kv, &self.config, (&call.key, nonce), probe, outbound, host::now_ms()) {
            return Looked::Go(call, None);
        }
        let embedding = self.embed(&call, &probe.text, bearer);
        // The component's tenants are its own (no fleet): the charge is made here.
        let tokens = embedding.as_ref().map(|e| e.tokens);
        let _ = spend::charge(
            &self.kv,
            &self.config,
            ((&call.key, nonce), probe),
            outbound.tenant.as_deref(),
            tokens,
            host::now_ms(),
        );
        // The flight's own time (its deadline, its wait for a bucket) starts now.
        let call = Call { started_ms: host::now_ms(), ..call };
        let Some(embedding) = embedding else { return Looked::Go(call, None) };
        let found = semantic::find(&self.kv, &self.config, &probe.partition, &embedding.vector);
        match self.engine().end_similar(&call, &found.matches, host::now_ms()) {
            Some(ended) => Looked::Answered(ended.reply),
            None => Looked::Go(call, Some(Learned { partition: probe.partition, vector: embedding.vector })),
        }
    }
}
