//! A leader's look for a paraphrase before its flight: the question's embedding, asked of
//! HolySheep with the operator's key within `semantic.timeout_ms`, then the semantic index.
//! A close paraphrase's fresh answer ends the flight (SEMANTIC); anything else, a failed
//! or slow embedding included, lets the flight go upstream as the MISS it is.

use super::Root;
use crate::core::api::headers;
use crate::core::coalesce::engine::Call;
use crate::core::flight::look::{self, Answer, Begun, Looked, Outcome};
use crate::core::observe::log_fields::{Served, Spent};
use crate::core::observe::metrics;
use crate::core::semantic::EMBEDDINGS_PATH;
use crate::core::upstream::{Outbound, USER_AGENT};
use crate::proxy::abi as hostcalls;
use crate::proxy::host::{self, SharedData};
use crate::proxy::runs::{Callout, Probing};
use crate::proxy::types::{BufferType, LogLevel};
use crate::proxy::worker::Target;
use std::rc::Rc;
use std::time::Duration;

/// The most bytes of an embedding answer read (3 072 floats as JSON are about 60 KB).
const MAX_EMBEDDING_BYTES: usize = 1024 * 1024;

impl Root {
    /// A leader's call: it looks for a paraphrase first when `flight::look` says so, else
    /// its flight starts.
    pub(super) fn begin(&mut self, context_id: u32, call: Call, outbound: Rc<Outbound>) {
        let (config, bearer) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.bearer.clone())
        };
        // The operator's key pays for the embedding: none, no look.
        let bearer = bearer.unwrap_or_default();
        let (look, body) = match look::begin(&SharedData, &config, call, &outbound, !bearer.is_empty(), host::now_ms())
        {
            Begun::Embed(look, body) => (look, body),
            Begun::Go(call) => return self.start(context_id, call, outbound, None, Spent::default()),
        };
        let headers = vec![
            (":method", "POST"),
            (":path", EMBEDDINGS_PATH),
            (":authority", config.upstream.authority.as_str()),
            (headers::CONTENT_TYPE, "application/json"),
            (headers::ACCEPT, "application/json"),
            ("user-agent", USER_AGENT),
            (headers::AUTHORIZATION, bearer.as_str()),
        ];
        let timeout = Duration::from_millis(config.semantic.timeout_ms);
        match hostcalls::dispatch_http_call(&config.upstream.cluster, headers, Some(&body), timeout) {
            Ok(token) => {
                let probing = Callout::Embedding(Probing { context_id, look, outbound });
                self.worker.borrow_mut().runs.callouts.insert(token, probing);
            }
            Err(status) => {
                let cluster = &config.upstream.cluster;
                let why = format!("holysheep: embedding callout to cluster '{cluster}' refused: {status:?}");
                host::log(LogLevel::Error, &why);
                self.looked(Probing { context_id, look, outbound }, Answer::Unsent);
            }
        }
    }

    /// An embedding call answered (or failed).
    pub(super) fn on_embedding(&mut self, probing: Probing, num_headers: usize, body_size: usize) {
        let body =
            (body_size <= MAX_EMBEDDING_BYTES).then(|| host::buffer(BufferType::HttpCallResponseBody, body_size));
        let answer = match host::callout_status(num_headers) {
            Some(status) => Answer::Got { status, body: body.as_deref() },
            None => Answer::Lost,
        };
        self.looked(probing, answer);
    }

    /// The look ended: the leader is answered from a paraphrase, or its flight starts, with
    /// its question's vector to learn.
    fn looked(&mut self, probing: Probing, answer: Answer<'_>) {
        let Probing { context_id, look, outbound } = probing;
        let key = look.call.key.clone();
        let looked = look.answered(&self.worker.borrow().engine(), answer, host::now_ms());
        let Looked { outcome, settle, sent, tokens, near_miss, cost_micro_usd } = looked;
        {
            let mut w = self.worker.borrow_mut();
            w.fleet.outbox.extend(settle);
            let counted = metrics::for_embedding(&w.config, &outbound.model, sent, tokens, near_miss);
            w.counters.count(counted, outbound.tenant.as_deref());
        }
        let spent = Spent { cost_micro_usd, ..Spent::default() };
        match outcome {
            Outcome::Go(call, learned) => self.start(context_id, call, outbound, learned, spent),
            Outcome::Answered(ended) => {
                let served = Served { spent, wait_ms: 0 };
                self.worker.borrow_mut().respond(Target::Context(context_id), &ended.reply, &outbound, served);
                self.wake_waiters(&key, ended.watched);
            }
        }
    }
}
