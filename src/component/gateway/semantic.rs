//! A leader's look for a paraphrase before its flight (`flight::look`, as in the Envoy
//! shell): the question's embedding, sent by `Gateway::embed`, then what the look came to.

use super::calls::Failed;
use super::instance::Gateway;
use crate::component::host;
use crate::core::api::reply::Reply;
use crate::core::coalesce::engine::Call;
use crate::core::flight::look::{self, Answer, Begun, Outcome};
use crate::core::semantic::Learned;
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
        let bearer = self.bearer.as_deref().unwrap_or_default();
        let (look, body) = match look::begin(&self.kv, &self.config, call, outbound, !bearer.is_empty(), host::now_ms())
        {
            Begun::Embed(look, body) => (look, body),
            Begun::Go(call) => return Looked::Go(call, None),
        };
        let sent = self.embed(&look.call, &body, bearer);
        let answer = match &sent {
            Ok((status, body)) => Answer::Got { status: *status, body: body.as_deref() },
            Err(Failed::Unsent) => Answer::Unsent,
            Err(Failed::Unknown) => Answer::Lost,
        };
        // The component's tenants are its own (no fleet): the charge is made here.
        match look.answered(&self.engine(), answer, host::now_ms()).outcome {
            Outcome::Answered(ended) => Looked::Answered(ended.reply),
            Outcome::Go(call, learned) => Looked::Go(call, learned),
        }
    }
}
