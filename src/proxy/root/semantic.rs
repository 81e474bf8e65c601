//! A leader's look for a paraphrase before its flight: the question's embedding, asked of
//! HolySheep with the operator's key within `semantic.timeout_ms`, then the semantic index.
//! A close paraphrase's fresh answer ends the flight (SEMANTIC); anything else, a failed
//! or slow embedding included, lets the flight go upstream as the MISS it is.

use super::Root;
use crate::core::api::headers;
use crate::core::observe::log_fields::{Served, Spent};
use crate::core::observe::metrics;
use crate::core::semantic::{self, spend, Embedding, Learned, EMBEDDINGS_PATH};
use crate::core::upstream::USER_AGENT;
use crate::proxy::abi as hostcalls;
use crate::proxy::host::{self, SharedData};
use crate::proxy::runs::Probing;
use crate::proxy::types::{BufferType, LogLevel, MapType};
use crate::proxy::worker::Target;
use std::time::Duration;

/// The most bytes of an embedding answer read (3 072 floats as JSON are about 60 KB).
const MAX_EMBEDDING_BYTES: usize = 1024 * 1024;

impl Root {
    /// A leader's call: it looks for a paraphrase first when the semantic tier wants it
    /// (and the operator's key is there to pay for the embedding), else its flight starts.
    pub(super) fn begin(&mut self, probing: Probing) {
        let (config, bearer) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.bearer.clone())
        };
        let probe = probing.call.looks_for_paraphrase(&config, probing.outbound.semantic.as_ref());
        let (Some(probe), Some(bearer)) = (probe.cloned(), bearer) else {
            return self.start(probing, None, Spent::default());
        };
        // Within the tenant's budget and the embedding model's bucket, or not at all.
        let call = (&probing.call.key, probing.call.lease.as_ref().map_or(0, |l| l.nonce));
        if !spend::admit(&SharedData, &config, call, &probe, &probing.outbound, host::now_ms()) {
            return self.start(probing, None, Spent::default());
        }
        let body = semantic::embedding_body(&config, &probe.text);
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
                self.worker.borrow_mut().runs.probing.insert(token, probing);
            }
            Err(status) => {
                let cluster = &config.upstream.cluster;
                let why = format!("holysheep: embedding callout to cluster '{cluster}' refused: {status:?}");
                host::log(LogLevel::Error, &why);
                self.charge_embedding(&probing, &probe, Some(0));
                self.count_embedding(&probing, false, None, false);
                self.start(probing, None, Spent::default());
            }
        }
    }

    /// An embedding call answered (or failed): the leader is answered from a paraphrase,
    /// or its flight starts, with its question's vector to learn. `false` when `token` was
    /// not an embedding call.
    pub(super) fn on_embedding(&mut self, token: u32, num_headers: usize, body_size: usize) -> bool {
        let Some(mut probing) = self.worker.borrow_mut().runs.probing.remove(&token) else { return false };
        let config = self.worker.borrow().config.clone();
        let embedding = embedding_answer(&config, num_headers, body_size);
        if let Some(probe) = probing.outbound.semantic.clone() {
            // HolySheep's refusal (a 4xx) costs nothing; no answer, a 5xx (Envoy's own 504
            // after the call went out among them), or a 200 the edge cannot read, may have
            // cost its estimate.
            let status = host::header(MapType::HttpCallResponseHeaders, ":status").filter(|_| num_headers > 0);
            let error = status.is_some_and(|s| s.starts_with('4'));
            let billed = embedding.as_ref().map(|e| e.tokens).or(error.then_some(0));
            self.charge_embedding(&probing, &probe, billed);
        }
        let now = host::now_ms();
        // The flight's own time (its deadline, its wait for a bucket) starts now.
        probing.call.started_ms = now;
        let (Some(probe), Some(Embedding { vector, tokens })) = (probing.outbound.semantic.as_ref(), embedding) else {
            self.count_embedding(&probing, true, None, false);
            self.start(probing, None, Spent::default());
            return true;
        };
        let found = semantic::find(&SharedData, &config, &probe.partition, &vector);
        self.count_embedding(&probing, true, Some(tokens), found.near_miss());
        let cost = semantic::cost_micro_usd(&config, tokens);
        let spent = Spent { cost_micro_usd: cost, ..Spent::default() };
        let ended = self.worker.borrow().engine().end_similar(&probing.call, &found.matches, now);
        let Some(ended) = ended else {
            let learned = Learned { partition: probe.partition, vector };
            self.start(probing, Some(learned), spent);
            return true;
        };
        let served = Served { spent, wait_ms: 0 };
        self.worker.borrow_mut().respond(Target::Context(probing.context_id), &ended.reply, &probing.outbound, served);
        self.wake_waiters(&probing.call.key, ended.watched);
        true
    }

    /// What an embedding was billed goes on the embedding model's bucket and the tenant's
    /// budget (on its owner node, in a fleet).
    fn charge_embedding(&self, probing: &Probing, probe: &semantic::Probe, tokens: Option<u64>) {
        let mut w = self.worker.borrow_mut();
        let config = w.config.clone();
        let tenant = probing.outbound.tenant.as_deref();
        let call = (&probing.call.key, probing.call.lease.as_ref().map_or(0, |l| l.nonce));
        if let Some(s) = spend::charge(&SharedData, &config, (call, probe), tenant, tokens, host::now_ms()) {
            w.fleet.outbox.push(crate::core::limits::fleet::Op::TenantSettle(s));
        }
    }

    /// Counts an embedding call (`sent`, or refused by the host) for the request's model
    /// (and tenant).
    fn count_embedding(&self, probing: &Probing, sent: bool, tokens: Option<u64>, near_miss: bool) {
        let w = self.worker.borrow();
        let (out, config) = (&probing.outbound, &w.config);
        w.counters.count(metrics::for_embedding(config, &out.model, sent, tokens, near_miss), out.tenant.as_deref());
    }
}

/// The embedding in a callout's answer (`None`: no answer, an error, or an unusable one).
fn embedding_answer(config: &crate::core::config::Config, num_headers: usize, body_size: usize) -> Option<Embedding> {
    if num_headers == 0 || body_size > MAX_EMBEDDING_BYTES {
        return None;
    }
    let headers = host::headers(MapType::HttpCallResponseHeaders);
    let status = headers.iter().find(|(k, _)| k == ":status").and_then(|(_, v)| v.parse().ok())?;
    let body = host::buffer(BufferType::HttpCallResponseBody, body_size);
    semantic::parse_embedding(config, status, &body)
}
