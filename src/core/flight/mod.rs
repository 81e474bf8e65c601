//! One upstream flight's admission, calls, retries, failover and settlement. The highest
//! floor of the call path: it uses the limits, the tenants' holds, the fleet's owner
//! operations, the upstream request and the engine's `Call`.
//!
//! One upstream flight, sans-IO: admission through the model's buckets (holding the
//! request up to `rate_limit.max_wait_ms`), attempts with exponential backoff and full
//! jitter honouring the provider's `retry-after`, and failover to the model's fallbacks,
//! all within `upstream.timeout_ms`. The shell performs each `Action` and reports back.

use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::objects::Signer;
use crate::core::api::priority::{self, Class};
use crate::core::api::response::Response;
use crate::core::api::usage::{Billed, Usage};
use crate::core::cache::batch::Batch;
use crate::core::coalesce::engine::Call;
use crate::core::coalesce::lease;
use crate::core::config::Config;
use crate::core::limits::fleet::{self, Op, Verdict};
use crate::core::limits::line::{Who, POLL_CAP_MS};
use crate::core::limits::tenant_gate::{self, Ask, Refusal, Settlement, TenantHold};
use crate::core::limits::{self, duration, Denial, Kind, Limits};
use crate::core::store::CasStore;
use crate::core::upstream::Outbound;

pub use crate::core::limits::CONTENTION_RETRY_MS;

/// How often a request held for a concurrency slot looks again.
pub const CONCURRENCY_POLL_MS: u64 = 20;

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Call HolySheep for `model` (the body rewritten to it when it is a fallback).
    Send { model: String, timeout_ms: u64 },
    /// Ask the owner node of `bucket` to admit the call (then `on_verdict`, then `resume`).
    Ask { bucket: String, op: Op, timeout_ms: u64 },
    /// Come back (call `resume`) at this time.
    Sleep { until_ms: u64 },
    /// The flight is over: complete the call with this outcome (`None`: no answer).
    Finish(Option<Response>),
}

/// What happened, for metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    UpstreamCall {
        model: String,
    },
    Retry {
        model: String,
    },
    Failover {
        from: String,
        to: String,
    },
    RateLimited {
        model: String,
    },
    ProviderRateLimited {
        model: String,
    },
    Usage {
        model: String,
        usage: Usage,
    },
    /// The model's owner node was out of reach: this node admitted from its own share.
    LocalShare {
        model: String,
    },
    /// The flight took a place in a model's admission line (once per flight).
    Queued {
        class: Class,
    },
    /// The flight was admitted to its first call after waiting `waited_ms` since it began.
    Admitted {
        class: Class,
        waited_ms: u64,
    },
    /// The flight was refused for priority: the bucket's reserve (`full`: false) or a full
    /// admission line.
    Shed {
        model: String,
        class: Class,
        full: bool,
    },
}

/// How a stream forwarded along the route ended, as its shell saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamOutcome {
    /// The status of HolySheep's answer (`None`: no answer head came).
    pub status: Option<u16>,
    pub usage: Option<Usage>,
    /// The tokens a stream cut off before its usage may have cost (prompt and streamed).
    pub cut_off_tokens: u64,
    /// The attempts Envoy's router made (0: the request never left).
    pub attempts: u64,
}

/// Which bucket admitted the call, so that it is settled where it was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ticket {
    /// This node's bucket.
    Local(u64),
    /// The model owner node's bucket.
    Owner(u64),
    /// This node's share, the model owner being out of reach.
    Share(u64),
}

/// What reserving capacity for a call on one model came to.
enum Reservation {
    Reserved,
    Denied(Denial),
    /// The model owner node must be asked.
    Ask(String, Op),
}

#[derive(Debug, Clone)]
pub struct Flight {
    pub call: Call,
    models: Vec<String>,
    idx: usize,
    attempt: u32,
    deadline_ms: u64,
    hold_until_ms: u64,
    estimate: u64,
    /// This flight's identity in the buckets (its first nonce): place in line, slot.
    id: Option<u64>,
    ticket: Option<Ticket>,
    /// A reservation asked of a model owner: the model it was for and the denials before it.
    probe: Option<(usize, Vec<(usize, Denial)>)>,
    /// The model owner's answer (`Some(None)`: out of reach).
    verdict: Option<Option<Verdict>>,
    last: Option<Response>,
    /// The verified tenant the flight is for, and what it holds of that tenant's limits.
    tenant: Option<String>,
    tenant_hold: Option<TenantHold>,
    /// The tenant's share was taken (or it has none to take).
    tenant_taken: bool,
    /// The flight's last `Action::Ask` went to its tenant's owner node, whose answer ...
    asking_tenant: bool,
    /// ... is this (`Some(None)`: out of reach).
    tenant_verdict: Option<Option<Verdict>>,
    /// The most tokens the call can be billed (`Outbound::worst_tokens`).
    worst_tokens: u64,
    /// The flight's class, and its tenant's `priority::tenant_tag`, in the models' lines.
    class: Class,
    tenant_tag: u64,
    /// The buckets whose lines the flight stands in: the bucket, a model it stands there
    /// for, and where that line is.
    lined: Vec<(String, usize, Ticket)>,
    /// It has stood in a line; it has been admitted to a call.
    queued: bool,
    admitted: bool,
    pub events: Vec<Event>,
    /// Settlements for model owner nodes, sent by the shell without waiting.
    pub outbox: Vec<Op>,
    /// An embeddings list answered item by item: HolySheep's answer is completed with the
    /// cached items (`Batch::finish`).
    batch: Option<std::rc::Rc<Batch>>,
    /// Signs the response id of a verified tenant's Responses answer (`api::objects`).
    signer: Option<Signer>,
}

impl Flight {
    /// The flight for `outbound`'s call: its model, then the model's fallbacks that its
    /// tenant (if any) may call.
    pub fn new(config: &Config, call: Call, outbound: &Outbound) -> Flight {
        let (model, estimate) = (outbound.model.as_str(), outbound.estimate_tokens);
        let tenant = outbound.tenant.as_deref().and_then(|t| config.tenants.get(t));
        let mut models = vec![model.to_owned()];
        for f in config.model(model).map(|(_, m)| m.fallback.clone()).unwrap_or_default() {
            if !models.contains(&f) && tenant.is_none_or(|t| t.allows(&f)) {
                models.push(f);
            }
        }
        let started = call.started_ms;
        let events = Vec::new();
        Flight {
            call,
            models,
            idx: 0,
            attempt: 0,
            deadline_ms: started.saturating_add(config.upstream.timeout_ms),
            hold_until_ms: started.saturating_add(config.rate_limit.max_wait_ms),
            estimate,
            id: None,
            ticket: None,
            probe: None,
            verdict: None,
            last: None,
            tenant: outbound.tenant.clone(),
            tenant_hold: None,
            tenant_taken: false,
            asking_tenant: false,
            tenant_verdict: None,
            worst_tokens: outbound.worst_tokens(),
            class: outbound.class,
            tenant_tag: priority::tenant_tag(outbound.tenant.as_deref()),
            lined: Vec::new(),
            queued: false,
            admitted: false,
            events,
            outbox: Vec::new(),
            batch: outbound.batch.clone(),
            signer: config.signer(outbound.endpoint, outbound.tenant.as_deref()),
        }
    }

    /// The model the flight is on now.
    pub fn model(&self) -> &str {
        self.models.get(self.idx).map_or("", String::as_str)
    }

    /// Takes capacity from the first model (from the current one on) whose buckets admit
    /// the call; holds or answers 429 when none does. With fleet-wide limits a model owner
    /// is asked first (`Action::Ask`), and the probe goes on from its verdict.
    pub fn resume(&mut self, store: &impl CasStore, config: &Config, now_ms: u64, nonce: u64) -> Action {
        if now_ms >= self.deadline_ms {
            self.release_tenant_verdict(config, now_ms);
            let last = self.last.take();
            return self.end(store, config, last, now_ms);
        }
        if let Some(refused) = self.reserve_tenant(store, config, now_ms, nonce) {
            return refused;
        }
        self.raise_to_waiters(store);
        let (start, mut denials) = self.probe.take().unwrap_or((self.idx, Vec::new()));
        for i in start..self.models.len() {
            match self.reserve(store, config, i, now_ms, nonce) {
                Reservation::Reserved => {
                    if i != self.idx {
                        self.fail_over_to(i);
                    }
                    self.leave_lines(store, config, now_ms);
                    let model = self.model().to_owned();
                    if !std::mem::replace(&mut self.admitted, true) {
                        let waited_ms = now_ms.saturating_sub(self.call.started_ms);
                        self.events.push(Event::Admitted { class: self.class, waited_ms });
                    }
                    self.events.push(Event::UpstreamCall { model: model.clone() });
                    return Action::Send { model, timeout_ms: self.deadline_ms - now_ms };
                }
                Reservation::Denied(d) => denials.push((i, d)),
                Reservation::Ask(bucket, op) => {
                    self.probe = Some((i, denials));
                    let timeout_ms = config.fleet.timeout_ms.min(self.deadline_ms - now_ms);
                    return Action::Ask { bucket, op, timeout_ms };
                }
            }
        }
        // A refusal for priority is no reason to wait: only the other models' denials are.
        let waits = denials.iter().filter(|(_, d)| !is_final(d.kind));
        if let Some(soonest) =
            waits.clone().map(|(i, d)| d.wait_ms.unwrap_or_else(|| self.slot_poll(config, *i, d))).min()
        {
            let until = now_ms.saturating_add(soonest);
            // Contention is no refusal: it waits past `max_wait_ms` (within the deadline).
            let contended = waits.clone().any(|(_, d)| d.kind == Kind::Contended);
            if (until <= self.hold_until_ms || contended) && until < self.deadline_ms {
                // A place in line lapses unless its caller comes back in time.
                let poll = if self.lined.is_empty() { soonest } else { soonest.min(POLL_CAP_MS) };
                return Action::Sleep { until_ms: now_ms.saturating_add(poll) };
            }
        }
        let model = self.model().to_owned();
        // A call too large for one model but refused by another only for now is that one's
        // refusal (a 429 to come back with), not a 400.
        let denial = denials
            .iter()
            .map(|(_, d)| *d)
            .find(|d| d.kind != Kind::TooLarge)
            .or(denials.first().map(|(_, d)| *d))
            .unwrap_or(Denial::of(Kind::Requests, None));
        if denial.kind == Kind::TooLarge {
            let tpm = config.model(&model).and_then(|(_, m)| m.tokens_per_minute).unwrap_or(0);
            let refused = ApiError::too_many_tokens(&format!("model {model}"), self.estimate, tpm);
            let refused = Response::json(400, refused.body()).with_header(headers::MODEL, model);
            return self.end(store, config, Some(refused), now_ms);
        }
        self.events.push(Event::RateLimited { model: model.clone() });
        if matches!(denial.kind, Kind::Shed | Kind::QueueFull) {
            let full = denial.kind == Kind::QueueFull;
            self.events.push(Event::Shed { model: model.clone(), class: self.class, full });
        }
        let limited = self.rate_limited(config, &model, denial);
        self.end(store, config, Some(limited), now_ms)
    }

    /// Each time it looks again from its place in line, the flight looks for waiters of a
    /// higher class than its own, and then waits at the highest of theirs (and counts as
    /// queued in that class): a critical request coalesced on a sheddable leader does not
    /// wait behind the sheddable line.
    fn raise_to_waiters(&mut self, store: &impl CasStore) {
        // Not between a model owner's verdict and its reading: it was given at the class
        // the flight asked with.
        if self.lined.is_empty() || self.class == Class::Critical || self.probe.is_some() {
            return;
        }
        let Some(lease) = &self.call.lease else { return };
        if let Some(best) = lease::waiting_class(store, lease).filter(|b| *b < self.class) {
            (self.class, self.queued) = (best, true);
            self.events.push(Event::Queued { class: best });
        }
    }

    /// How soon a call refused a slot of model `i` looks again: every `CONCURRENCY_POLL_MS`
    /// near the head of the line, less often the more slots must free before its turn
    /// (every waiter reads the whole line when it looks).
    fn slot_poll(&self, config: &Config, i: usize, d: &Denial) -> u64 {
        let slots = self.models.get(i).and_then(|m| config.model(m)).and_then(|(_, m)| m.max_in_flight);
        let rounds = d.ahead / u64::from(slots.unwrap_or(1).max(1));
        CONCURRENCY_POLL_MS.saturating_mul(rounds.saturating_add(1)).min(POLL_CAP_MS)
    }

    /// Takes the call's share of its tenant's own limits, once per flight; `Some` when they
    /// refuse it (a wait for the bucket, or the 429).
    fn reserve_tenant(&mut self, store: &impl CasStore, config: &Config, now_ms: u64, nonce: u64) -> Option<Action> {
        let tenant = self.tenant.clone().filter(|t| !self.tenant_taken && tenant_gate::is_limited(config, t))?;
        let id = *self.id.get_or_insert(nonce);
        let hold_ms = self.deadline_ms.saturating_sub(now_ms) + 1_000;
        let worst_micro = tenant_gate::worst_micro(config, &self.models, self.worst_tokens);
        let ask = Ask { tenant: tenant.clone(), id, estimate: self.estimate, worst_micro, hold_ms };
        let taken = if !config.fleet.shared_limits() {
            tenant_gate::take(store, config, &ask, None, now_ms)
        } else {
            // The tenant's limits live on its owner node: asked first, as a model's are.
            match self.tenant_verdict.take() {
                None => {
                    self.asking_tenant = true;
                    let timeout_ms = config.fleet.timeout_ms.min(self.deadline_ms - now_ms);
                    return Some(Action::Ask {
                        bucket: tenant_gate::bucket(&tenant),
                        op: Op::TenantTake(ask),
                        timeout_ms,
                    });
                }
                Some(Some(v)) => match (v.result(), v.hold) {
                    (Ok(()), Some(dollars)) => Ok(Some(TenantHold::on_owner(&ask, dollars))),
                    (Ok(()), None) => Ok(None),
                    (Err(d), _) => Err(Refusal::of(config, &tenant, d)),
                },
                Some(None) => {
                    // The ask may have reached the owner all the same: what it reserved is
                    // given back, and this node admits from its share.
                    self.outbox.push(Op::TenantSettle(Settlement::release(&ask, now_ms)));
                    self.events.push(Event::LocalShare { model: self.model().to_owned() });
                    tenant_gate::take(store, config, &ask, Some(config.fleet.nodes), now_ms)
                }
            }
        };
        match taken {
            Ok(hold) => {
                (self.tenant_hold, self.tenant_taken) = (hold, true);
                None
            }
            Err(refusal) => {
                // A store the host does not know will not appear by waiting.
                if let Some(d) = match refusal {
                    Refusal::Bucket(d) if d.kind != Kind::StoreMissing => Some(d),
                    _ => None,
                } {
                    let until = now_ms.saturating_add(d.wait_ms.unwrap_or(CONCURRENCY_POLL_MS));
                    let contended = d.kind == Kind::Contended;
                    if (until <= self.hold_until_ms || contended) && until < self.deadline_ms {
                        return Some(Action::Sleep { until_ms: until });
                    }
                }
                let model = self.model().to_owned();
                if refusal != Refusal::TooLarge {
                    self.events.push(Event::RateLimited { model: model.clone() });
                }
                Some(Action::Finish(Some(tenant_gate::refused(config, &tenant, &model, refusal, self.estimate))))
            }
        }
    }

    /// The flight ends at its deadline with its tenant's owner's verdict unread: what the
    /// owner reserved is given back.
    fn release_tenant_verdict(&mut self, config: &Config, now_ms: u64) {
        let (Some(Some(v)), Some(tenant)) = (self.tenant_verdict.take(), self.tenant.clone()) else { return };
        if v.hold.is_some() {
            let worst_micro = tenant_gate::worst_micro(config, &self.models, self.worst_tokens);
            let ask = Ask { tenant, id: self.id.unwrap_or(0), estimate: self.estimate, worst_micro, hold_ms: 0 };
            self.outbox.push(Op::TenantSettle(Settlement::release(&ask, now_ms)));
        }
    }

    /// Whether the flight's last `Action::Ask` went to its tenant's owner node.
    pub fn asking_tenant(&self) -> bool {
        self.asking_tenant
    }

    /// The flight is over: what it holds of its tenant's limits is settled, here or (a
    /// settlement in the outbox) on the tenant's owner node.
    fn end_tenant(&mut self, store: &impl CasStore, now_ms: u64) {
        if let Some(settlement) = self.tenant_hold.take().and_then(|hold| hold.end(store, now_ms)) {
            self.outbox.push(Op::TenantSettle(settlement));
        }
    }

    /// What the current attempt is billed goes on the tenant's account.
    fn bill_tenant(&mut self, config: &Config, billed: Billed) {
        let model = self.model().to_owned();
        if let Some(hold) = &mut self.tenant_hold {
            hold.bill(config, &model, billed);
        }
    }

    /// The flight ends with `outcome`: what it holds of its tenant's limits is settled,
    /// and its places in line are given up.
    fn end(&mut self, store: &impl CasStore, config: &Config, outcome: Option<Response>, now_ms: u64) -> Action {
        self.end_tenant(store, now_ms);
        self.leave_lines(store, config, now_ms);
        Action::Finish(outcome)
    }

    /// The call for the current model ended (`None`: reset or timeout). `random` draws
    /// the backoff jitter and serves as the nonce of a fallback's admission.
    pub fn on_response(
        &mut self,
        store: &impl CasStore,
        config: &Config,
        outcome: Option<Response>,
        hints: &ProviderHints,
        now_ms: u64,
        random: u64,
    ) -> Action {
        let model = self.model().to_owned();
        // What HolySheep billed, as the shell read it from the answer (`upstream::response`);
        // no answer at all (a reset, a timeout) may have been billed its worst case.
        let billed = if outcome.is_some() { hints.billed } else { Billed::Unknown };
        let usage = match billed {
            Billed::Known(u) => Some(u),
            Billed::Nothing | Billed::Unknown => None,
        };
        self.bill_tenant(config, billed);
        // HolySheep's own 4xx used no tokens: the estimate goes back to the bucket.
        let rejected = billed == Billed::Nothing && outcome.as_ref().is_some_and(|r| (400..500).contains(&r.status));
        let actual = usage.map(|u| u.total()).or(rejected.then_some(0));
        self.settle(store, config, actual, 0, hints, now_ms);
        if let Some(usage) = usage {
            self.events.push(Event::Usage { model: model.clone(), usage });
        }
        if hints.throttled {
            self.events.push(Event::ProviderRateLimited { model: model.clone() });
        }
        let outcome = match (&self.batch, outcome) {
            (Some(batch), Some(r)) if r.status == 200 => Some(batch.finish(store, config, r, now_ms)),
            (_, outcome) => outcome,
        };
        let outcome = outcome.map(|r| self.signed(r).with_header(headers::MODEL, model.clone()));
        if !retryable(outcome.as_ref()) || hints.key_refused {
            return self.end(store, config, outcome, now_ms);
        }
        self.attempt += 1;
        self.last = outcome;
        if self.attempt < config.retry.max_attempts {
            if let Some(delay) = self.backoff(config, hints.retry_after_ms, random) {
                if now_ms.saturating_add(delay) < self.deadline_ms {
                    self.events.push(Event::Retry { model });
                    return Action::Sleep { until_ms: now_ms + delay };
                }
            }
        }
        if self.idx + 1 < self.models.len() {
            self.fail_over_to(self.idx + 1);
            return self.resume(store, config, now_ms, random);
        }
        let last = self.last.take();
        self.end(store, config, last, now_ms)
    }

    /// A Responses answer as its tenant sees it: its response id signed for the tenant.
    fn signed(&self, r: Response) -> Response {
        let body = self.signer.as_ref().filter(|_| r.status == 200).and_then(|s| s.sign_answer(&r.body));
        match body {
            Some(body) => Response { body, ..r },
            None => r,
        }
    }

    /// A stream forwarded along the route ended: its bytes went to the client as they came,
    /// after `end.attempts` tries by Envoy's router before the first byte (on the edge's
    /// count of attempts: see `STREAM_RETRY_ON`). Every attempt counts as an upstream call
    /// and takes a request from the bucket; the bucket is settled from the stream's usage,
    /// or from `end.cut_off_tokens` (an estimate of what was streamed) when the stream never
    /// reported one, and adapts to what HolySheep's last answer said (`hints`). A stream
    /// HolySheep answered with an error, or one that never left, costs its tenant nothing.
    pub fn on_stream_end(
        &mut self,
        store: &impl CasStore,
        config: &Config,
        end: &StreamOutcome,
        hints: &ProviderHints,
        now_ms: u64,
    ) {
        let model = self.model().to_owned();
        let retries = end.attempts.saturating_sub(1);
        for _ in 0..retries {
            self.events.push(Event::UpstreamCall { model: model.clone() });
            self.events.push(Event::Retry { model: model.clone() });
        }
        self.charge_retries(store, config, retries, now_ms);
        // Each attempt Envoy's router made before the one that answered may have been
        // billed: its worst case, on the tenant's account.
        for _ in 0..retries {
            self.bill_tenant(config, Billed::Unknown);
        }
        // A 4xx, or a stream that never left, used no tokens; a 5xx keeps its estimate in
        // the bucket, as a call's does; an answer that is not HolySheep's (Envoy's own 504
        // or 503, `status: None`) may have been billed.
        let (billed, actual) = match (end.usage, end.attempts, end.status) {
            (Some(u), _, _) => (Billed::Known(u), Some(u.total())),
            (None, 0, _) => (Billed::Nothing, Some(0)),
            (None, _, Some(s)) if (400..500).contains(&s) => (Billed::Nothing, Some(0)),
            (None, _, Some(s)) if s != 200 => (Billed::Nothing, None),
            (None, _, _) => (Billed::Unknown, Some(end.cut_off_tokens)),
        };
        self.bill_tenant(config, billed);
        self.settle(store, config, actual, retries, hints, now_ms);
        if let Some(usage) = end.usage {
            self.events.push(Event::Usage { model: model.clone(), usage });
        }
        if hints.throttled {
            self.events.push(Event::ProviderRateLimited { model });
        }
        self.end_tenant(store, now_ms);
    }

    /// Takes `retries` more requests from the bucket the call was admitted from here (a
    /// model owner elsewhere in the fleet takes them when it settles the call).
    fn charge_retries(&self, store: &impl CasStore, config: &Config, retries: u64, now_ms: u64) {
        let Some((bucket, m)) = config.model(self.model()) else { return };
        let l = Limits::of(m, &config.rate_limit);
        match self.ticket {
            Some(Ticket::Local(_)) => limits::charge_requests(store, bucket, &l, retries, now_ms),
            Some(Ticket::Share(_)) => {
                let share = l.share(config.fleet.nodes);
                limits::charge_requests(store, &limits::share_bucket(bucket), &share, retries, now_ms);
            }
            Some(Ticket::Owner(_)) | None => {}
        }
    }

    /// A fallback's answer is not stored under the requested model's key.
    fn fail_over_to(&mut self, i: usize) {
        self.events.push(Event::Failover { from: self.model().to_owned(), to: self.models[i].clone() });
        self.idx = i;
        self.attempt = 0;
        self.call.store = false;
    }

    /// The model owner's answer to `Action::Ask` (`None`: no answer in time).
    pub fn on_verdict(&mut self, verdict: Option<Verdict>) {
        if std::mem::take(&mut self.asking_tenant) {
            self.tenant_verdict = Some(verdict);
        } else {
            self.verdict = Some(verdict);
        }
    }

    fn reserve(&mut self, store: &impl CasStore, config: &Config, i: usize, now_ms: u64, nonce: u64) -> Reservation {
        let name = self.models[i].clone();
        let Some((bucket, m)) = config.model(&name) else { return Reservation::Reserved };
        let l = Limits::of(m, &config.rate_limit);
        if !l.fits(self.estimate) {
            // Never: it must not wait at its place, nor take the whole bucket.
            return Reservation::Denied(Denial::of(Kind::TooLarge, None));
        }
        // A call holds its in-flight slot no longer than the flight can last.
        let hold = self.deadline_ms.saturating_sub(now_ms) + 1_000;
        let (estimate, id) = (self.estimate, *self.id.get_or_insert(nonce));
        let who = Who { id, estimate, class: self.class, tenant: self.tenant_tag };
        // A call that may still wait keeps a place in line while it is refused.
        let waits = now_ms < self.hold_until_ms;
        let (ticket, taken) = if !config.fleet.shared_limits() {
            (Ticket::Local(id), limits::take(store, bucket, &l, &who, now_ms, hold, waits))
        } else {
            match self.verdict.take() {
                None => {
                    let (model, class, tenant) = (self.models[i].clone(), self.class, self.tenant_tag);
                    let op = Op::Take { model, id, estimate, hold_ms: hold, class, tenant, waits };
                    return Reservation::Ask(bucket.to_owned(), op);
                }
                Some(Some(verdict)) => (Ticket::Owner(id), verdict.result()),
                Some(None) => {
                    self.events.push(Event::LocalShare { model: self.models[i].clone() });
                    let share = l.share(config.fleet.nodes);
                    (
                        Ticket::Share(id),
                        limits::take(store, &limits::share_bucket(bucket), &share, &who, now_ms, hold, waits),
                    )
                }
            }
        };
        // One place per bucket (fallbacks may share one): a place held elsewhere (the
        // owner's line, or this node's share) is given up there.
        if let Some(at) = self.lined.iter().position(|(b, _, _)| b == bucket) {
            let (_, j, held) = self.lined.swap_remove(at);
            if std::mem::discriminant(&held) != std::mem::discriminant(&ticket) {
                self.leave(store, config, j, held, now_ms);
            }
        }
        match taken {
            Ok(()) => {
                self.ticket = Some(ticket);
                Reservation::Reserved
            }
            Err(d) => {
                // A call that lost every race may hold a place from before: it is kept to leave.
                if waits && !is_final(d.kind) {
                    self.lined.push((bucket.to_owned(), i, ticket));
                    if d.kind != Kind::Contended && !std::mem::replace(&mut self.queued, true) {
                        self.events.push(Event::Queued { class: self.class });
                    }
                }
                Reservation::Denied(d)
            }
        }
    }

    /// Gives up the flight's places in the lines of models it was not admitted to.
    fn leave_lines(&mut self, store: &impl CasStore, config: &Config, now_ms: u64) {
        for (_, i, ticket) in std::mem::take(&mut self.lined) {
            self.leave(store, config, i, ticket, now_ms);
        }
    }

    /// Gives up the place `ticket` names in the line of model `i`'s bucket (settling a call
    /// that was never admitted frees its place).
    fn leave(&mut self, store: &impl CasStore, config: &Config, i: usize, ticket: Ticket, now_ms: u64) {
        self.settle_at(store, config, i, ticket, (None, ProviderHints::default(), 0), now_ms);
    }

    /// Settles the reservation with the tokens the call used (`None`: unknown); `retries`, requests made beyond
    /// the first (already taken here from a local bucket), go to a model owner with it.
    fn settle(
        &mut self,
        store: &impl CasStore,
        config: &Config,
        actual: Option<u64>,
        retries: u64,
        hints: &ProviderHints,
        now_ms: u64,
    ) {
        let Some(ticket) = self.ticket.take() else { return };
        let ended = (actual, fleet::capped(config, hints), retries);
        self.settle_at(store, config, self.idx, ticket, ended, now_ms);
    }

    /// Settles what `ticket` holds in model `i`'s bucket, where it was taken: the call used
    /// `actual` tokens (`None`: unknown, or it was never admitted and only leaves the line),
    /// the provider said `hints`, and `retries` more requests went to a model owner.
    fn settle_at(
        &mut self,
        store: &impl CasStore,
        config: &Config,
        i: usize,
        ticket: Ticket,
        (actual, hints, retries): (Option<u64>, ProviderHints, u64),
        now_ms: u64,
    ) {
        let Some(name) = self.models.get(i).cloned() else { return };
        let Some((bucket, m)) = config.model(&name) else { return };
        let (l, estimate) = (Limits::of(m, &config.rate_limit), self.estimate);
        match ticket {
            Ticket::Local(id) => limits::settle(store, bucket, &l, id, estimate, actual, &hints, now_ms),
            Ticket::Share(id) => {
                let share = l.share(config.fleet.nodes);
                limits::settle(store, &limits::share_bucket(bucket), &share, id, estimate, actual, &hints, now_ms);
            }
            Ticket::Owner(id) => self.outbox.push(Op::Settle { model: name, id, estimate, actual, hints, retries }),
        }
    }

    /// Full jitter between `base_delay_ms` and the doubled cap; the provider's
    /// `retry-after` wins when it fits within `max_delay_ms`, else this model is spent.
    fn backoff(&self, config: &Config, retry_after_ms: Option<u64>, random: u64) -> Option<u64> {
        let r = &config.retry;
        let cap = r.base_delay_ms.saturating_mul(1u64 << (self.attempt.saturating_sub(1)).min(20)).min(r.max_delay_ms);
        let jitter = r.base_delay_ms + random % (cap - r.base_delay_ms + 1);
        match retry_after_ms {
            Some(ra) if ra > r.max_delay_ms => None,
            Some(ra) => Some(jitter.max(ra)),
            None => Some(jitter),
        }
    }

    fn rate_limited(&self, config: &Config, model: &str, d: Denial) -> Response {
        let l = config.model(model).map(|(_, m)| Limits::of(m, &config.rate_limit));
        let what = match (d.kind, l) {
            (Kind::Requests, Some(l)) => {
                format!("requests per min (RPM): Limit {}", limits::whole(l.rpm.unwrap_or(0.0)))
            }
            (Kind::Tokens, Some(l)) => format!("tokens per min (TPM): Limit {}", limits::whole(l.tpm.unwrap_or(0.0))),
            (Kind::Concurrency, Some(l)) => format!("requests in flight: Limit {}", l.max_in_flight.unwrap_or(0)),
            (Kind::Shed, _) => format!("{} requests: the rest is kept for higher priorities", self.class.as_str()),
            (Kind::QueueFull, _) => format!("{} requests: the waiting line is full", self.class.as_str()),
            _ => "requests".to_owned(),
        };
        let wait = d.wait_ms.unwrap_or(1_000).max(1);
        let shed = match d.kind {
            Kind::Shed => Some("priority"),
            Kind::QueueFull => Some("queue-full"),
            _ => None,
        };
        let e = ApiError {
            status: 429,
            message: format!("Rate limit reached for {model} on {what}. Please try again in {}.", duration(wait)),
            kind: d.kind.as_str(),
            param: None,
            code: "rate_limit_exceeded",
        };
        let limited = Response::json(429, e.body())
            .with_header("retry-after", wait.div_ceil(1000).to_string())
            .with_header("retry-after-ms", wait.to_string())
            .with_header(headers::MODEL, model.to_owned());
        // Marked with its class: a waiter of a higher class does not take it as its answer.
        match shed {
            Some(why) => limited.shed(why, self.class),
            None => limited.with_header(headers::PRIORITY, self.class.as_str().to_owned()),
        }
    }
}

/// A refusal for priority, or for a call larger than the bucket: final, never waited out.
fn is_final(kind: Kind) -> bool {
    matches!(kind, Kind::Shed | Kind::QueueFull | Kind::TooLarge)
}

fn retryable(outcome: Option<&Response>) -> bool {
    outcome.is_none_or(|r| matches!(r.status, 429 | 500 | 502 | 503 | 504))
}

/// How Envoy's router may retry a stream leader before its first byte (set on the request
/// as `x-envoy-retry-on` and `x-envoy-retriable-status-codes`, with `x-envoy-max-retries`
/// from `retry.max_attempts`): what `retryable` retries, but for 429, which goes back to the
/// flight so that the bucket adapts and the client and waiters get HolySheep's
/// `retry-after`.
pub const STREAM_RETRY_ON: &str = "reset,connect-failure,retriable-status-codes";
pub const STREAM_RETRIABLE_STATUSES: &str = "500,502,503,504";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::coalesce::engine::CacheStatus;
    use crate::core::request::request_key;
    use crate::core::store::MemStore;
    use crate::core::store::StoreError;

    fn config(raw: &str) -> Config {
        Config::parse(raw.as_bytes()).unwrap()
    }

    fn flight(c: &Config, model: &str) -> Flight {
        let call = Call {
            key: request_key("/p", "s", b"x"),
            lease: None,
            store: true,
            label: CacheStatus::Miss,
            started_ms: 0,
            policy: crate::core::request::Policy {
                read: true,
                max_age: None,
                coalesce: true,
                store: true,
                class: Class::Standard,
            },
            place: None,
        };
        Flight::new(c, call, &outbound(model, None, Class::Standard))
    }

    /// The call a flight on `model` makes, for `tenant`, of `class`.
    fn outbound(model: &str, tenant: Option<&str>, class: Class) -> Outbound {
        Outbound {
            endpoint: Default::default(),
            body: Vec::new(),
            client_authorization: None,
            model: model.into(),
            estimate_tokens: 100,
            stream: false,
            include_usage: false,
            tenant: tenant.map(str::to_owned),
            completion_limit: None,
            completion_cap: None,
            supplied_ceiling: None,
            choices: 1,
            limit_named: false,
            class,
            semantic: None,
            batch: None,
        }
    }

    /// A stream that HolySheep answered 200, ending with `usage` (or cut off).
    fn streamed(usage: Option<(u64, u64)>, cut_off_tokens: u64, attempts: u64) -> StreamOutcome {
        let usage = usage.map(|(p, c)| Usage::new(p, c));
        StreamOutcome { status: Some(200), usage, cut_off_tokens, attempts }
    }

    /// HolySheep's answer with `s`: a 200 with its usage, else its JSON error.
    fn status(s: u16) -> Option<Response> {
        let body = if s == 200 {
            r#"{"usage":{"prompt_tokens":7,"completion_tokens":5}}"#
        } else {
            r#"{"error":{"message":"no","type":"server_error","param":null,"code":null}}"#
        };
        Some(Response::json(s, body.into()))
    }

    /// What the shell reads from that answer beside it (no limit headers).
    fn hints(s: u16) -> ProviderHints {
        let r = status(s).unwrap();
        ProviderHints { billed: Billed::of_answer(r.status, &r.content_type, &r.body), ..ProviderHints::default() }
    }

    fn send(a: Action) -> String {
        match a {
            Action::Send { model, .. } => model,
            other => panic!("expected a send, got {other:?}"),
        }
    }

    #[test]
    fn retries_with_backoff_then_succeeds() {
        let (s, c) =
            (MemStore::new(), config(r#"{"retry":{"max_attempts":3,"base_delay_ms":100,"max_delay_ms":1000}}"#));
        let mut f = flight(&c, "gpt-4.1");
        assert_eq!(send(f.resume(&s, &c, 0, 1)), "gpt-4.1");
        let a = f.on_response(&s, &c, status(503), &hints(503), 10, 7);
        let Action::Sleep { until_ms } = a else { panic!("{a:?}") };
        assert!((110..=110).contains(&until_ms), "first backoff is base: {until_ms}");
        send(f.resume(&s, &c, until_ms, 3));
        let a = f.on_response(&s, &c, status(502), &hints(502), 200, 7);
        let Action::Sleep { until_ms } = a else { panic!("{a:?}") };
        assert!((300..=400).contains(&until_ms), "second backoff within [base, 2*base]: {until_ms}");
        send(f.resume(&s, &c, until_ms, 5));
        let a = f.on_response(&s, &c, status(200), &hints(200), 500, 7);
        let Action::Finish(Some(r)) = a else { panic!("{a:?}") };
        assert_eq!((r.status, r.header("x-holysheep-model")), (200, Some("gpt-4.1")));
        assert_eq!(f.events.iter().filter(|e| matches!(e, Event::Retry { .. })).count(), 2);
        assert!(f.events.contains(&Event::Usage { model: "gpt-4.1".into(), usage: Usage::new(7, 5) }));
    }

    #[test]
    fn a_streams_attempts_by_the_router_are_counted_and_charged_and_its_429_holds_the_bucket() {
        let (s, c) = (MemStore::new(), config(r#"{"models":{"gpt-4.1":{"requests_per_minute":60,"burst":10}}}"#));
        let l = Limits::of(&c.models["gpt-4.1"], &c.rate_limit);
        let mut f = flight(&c, "gpt-4.1");
        send(f.resume(&s, &c, 0, 1));
        f.on_stream_end(&s, &c, &streamed(Some((7, 5)), 0, 3), &ProviderHints::default(), 0);
        let count = |f: &Flight, e: fn(&Event) -> bool| f.events.iter().filter(|x| e(x)).count();
        assert_eq!(count(&f, |e| matches!(e, Event::UpstreamCall { .. })), 3, "the first and two router retries");
        assert_eq!(count(&f, |e| matches!(e, Event::Retry { .. })), 2);
        assert_eq!(limits::peek(&s, "gpt-4.1", &l, 0).requests, 7.0, "10 - 3 attempts");

        let mut g = flight(&c, "gpt-4.1");
        send(g.resume(&s, &c, 0, 2));
        let throttled = ProviderHints { throttled: true, retry_after_ms: Some(5_000), ..Default::default() };
        g.on_stream_end(&s, &c, &StreamOutcome { status: Some(429), ..streamed(None, 0, 1) }, &throttled, 0);
        assert!(g.events.contains(&Event::ProviderRateLimited { model: "gpt-4.1".into() }));
        assert!(limits::peek(&s, "gpt-4.1", &l, 0).requests < 1.0, "held like a plain call's 429");
    }

    #[test]
    fn client_errors_are_not_retried() {
        let (s, c) = (MemStore::new(), Config::default());
        for code in [400, 401, 403, 404, 422] {
            let mut f = flight(&c, "m");
            send(f.resume(&s, &c, 0, 1));
            let a = f.on_response(&s, &c, status(code), &hints(code), 1, 0);
            assert!(matches!(a, Action::Finish(Some(ref r)) if r.status == code), "{code}: {a:?}");
        }
    }

    #[test]
    fn retry_after_is_honoured_when_it_fits_and_fails_over_when_not() {
        let (s, c) = (
            MemStore::new(),
            config(
                r#"{"models":{"gpt-4.1":{"fallback":["deepseek-v3"]}},"retry":{"base_delay_ms":10,"max_delay_ms":2000}}"#,
            ),
        );
        let mut f = flight(&c, "gpt-4.1");
        send(f.resume(&s, &c, 0, 1));
        let hint = ProviderHints { throttled: true, retry_after_ms: Some(1_000), ..Default::default() };
        assert_eq!(f.on_response(&s, &c, status(429), &hint, 0, 0), Action::Sleep { until_ms: 1_000 });
        send(f.resume(&s, &c, 1_000, 3));
        let too_long = ProviderHints { throttled: true, retry_after_ms: Some(60_000), ..Default::default() };
        let next = f.on_response(&s, &c, status(429), &too_long, 1_000, 0);
        assert_eq!(send(next), "deepseek-v3");
        assert!(!f.call.store, "a fallback answer is not stored under the requested key");
        assert!(f.events.contains(&Event::Failover { from: "gpt-4.1".into(), to: "deepseek-v3".into() }));
    }

    /// A flight of tenant `t` (whose limits are `tenant`) on gpt-4.1 at $10/$30 per Mtok.
    fn tenant_flight(c: &Config) -> Flight {
        let call = flight(c, "gpt-4.1").call;
        let outbound = Outbound {
            endpoint: Default::default(),
            body: Vec::new(),
            client_authorization: None,
            model: "gpt-4.1".into(),
            estimate_tokens: 100,
            stream: false,
            include_usage: false,
            tenant: Some("t".into()),
            completion_limit: Some(100),
            completion_cap: None,
            supplied_ceiling: None,
            choices: 1,
            limit_named: false,
            class: Default::default(),
            semantic: None,
            batch: None,
        };
        Flight::new(c, call, &outbound)
    }

    fn tenant_config(tenant: &str, model: &str) -> Config {
        config(&format!(
            r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30{model}}}}},
                "tenants":{{"t":{{"keys_sha256":["{}"]{tenant}}}}}}}"#,
            "a".repeat(64)
        ))
    }

    #[test]
    fn a_call_that_fits_once_others_settle_waits_for_them_and_one_that_never_fits_is_refused() {
        // Worst case 3000 micro-dollars a call; the day allows 7000.
        let raw = r#","usd_per_day":0.007"#;
        let c = config(&format!(
            r#"{{"rate_limit":{{"max_wait_ms":5000}},"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30}}}},
                "tenants":{{"t":{{"keys_sha256":["{}"]{raw}}}}}}}"#,
            "a".repeat(64)
        ));
        let s = MemStore::new();
        let mut flights: Vec<Flight> = (0..4).map(|_| tenant_flight(&c)).collect();
        send(flights[0].resume(&s, &c, 0, 1));
        send(flights[1].resume(&s, &c, 0, 2));
        let Action::Sleep { until_ms } = flights[2].resume(&s, &c, 0, 3) else { panic!("it waits") };
        assert_eq!(until_ms, tenant_gate::BUDGET_POLL_MS);
        flights[0].on_response(&s, &c, status(200), &hints(200), 10, 0);
        assert_eq!(send(flights[2].resume(&s, &c, 60, 3)), "gpt-4.1", "the first settled at 220: room");
        // Settled 220 + 3000 held twice: 220 + 3000 fits, so the fourth waits too ...
        assert!(matches!(flights[3].resume(&s, &c, 70, 4), Action::Sleep { .. }));
        for (f, at) in [(1, 80), (2, 90)] {
            flights[f].on_response(&s, &c, status(200), &hints(200), at, 0);
        }
        assert_eq!(send(flights[3].resume(&s, &c, 120, 4)), "gpt-4.1");
        // ... and a call past what is settled is told so at once, not held.
        let spent = crate::core::limits::budget::spent(&s, "t", 120).0;
        assert_eq!(spent, 3 * 220 + 3000);
        flights[3].on_response(&s, &c, status(200), &hints(200), 130, 0);
        let mut many = (0..20).map(|_| tenant_flight(&c)).collect::<Vec<_>>();
        let ends: Vec<String> = many
            .iter_mut()
            .enumerate()
            .map(|(i, f)| match f.resume(&s, &c, 140, 10 + i as u64) {
                Action::Send { .. } => {
                    f.on_response(&s, &c, status(200), &hints(200), 141, 0);
                    "served".to_owned()
                }
                Action::Finish(Some(r)) => {
                    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
                    v["error"]["code"].as_str().unwrap_or_default().to_owned()
                }
                other => panic!("{other:?}"),
            })
            .collect();
        // Admitted while 880 settled + 220 each leaves room for a 3000 worst case: 15 more.
        assert_eq!(ends.iter().filter(|e| *e == "served").count(), 15);
        assert!(ends[15..].iter().all(|e| e == "insufficient_quota"), "{ends:?}");
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 150).0, 19 * 220);
    }

    /// An answer as the shell reads it (`upstream::response`) for a call of the flight's
    /// form: the response the flight gets, and what the attempt was billed beside it.
    fn read(status: u16, content_type: &str, body: &str) -> (Option<Response>, ProviderHints) {
        let headers = vec![("content-type".to_owned(), content_type.to_owned())];
        let sent = crate::core::upstream::Sent::default();
        let (r, h) = crate::core::upstream::response(status, &headers, body.as_bytes().to_vec(), sent);
        (Some(r), h)
    }

    #[test]
    fn a_spend_store_that_cannot_be_called_or_never_answered_bounds_what_is_admitted() {
        let raw = format!(
            r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30}}}},
                "budget_store":{{"cluster":"etcd"}},"rate_limit":{{"max_wait_ms":0}},
                "tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":1}}}}}}"#,
            "a".repeat(64)
        );
        let c = config(&raw);
        let finish = |a: Action| match a {
            Action::Finish(Some(r)) => r,
            other => panic!("expected an answer, got {other:?}"),
        };
        // A cluster Envoy does not know: every budgeted call is the edge's 500, naming it.
        let s = MemStore::new();
        crate::core::limits::budget_store::set_misconfigured(&s, true);
        let r = finish(tenant_flight(&c).resume(&s, &c, 0, 1));
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((r.status, v["error"]["code"].as_str()), (500, Some("edge_misconfigured")));
        assert!(v["error"]["message"].as_str().unwrap().contains("budget_store.cluster 'etcd'"));
        // A store that never answered (down when Envoy started): one call, then a
        // retryable 503, never a fresh day.
        let s = MemStore::new();
        crate::core::limits::budget_store::read(&s, "t", None, 0);
        let mut first = tenant_flight(&c);
        assert_eq!(send(first.resume(&s, &c, 0, 1)), "gpt-4.1", "one call");
        let r = finish(tenant_flight(&c).resume(&s, &c, 1, 2));
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((r.status, v["error"]["code"].as_str()), (503, Some("budget_store_unavailable")));
        assert_eq!(r.header("retry-after"), Some("5"));
    }

    #[test]
    fn a_streams_attempts_before_the_one_that_answered_are_charged_their_worst_case() {
        let (s, c) = (MemStore::new(), tenant_config(r#","usd_per_day":1"#, ""));
        let mut f = tenant_flight(&c);
        send(f.resume(&s, &c, 0, 1));
        // Envoy's router tried three times; the third answered, with its usage.
        f.on_stream_end(&s, &c, &streamed(Some((7, 5)), 0, 3), &ProviderHints::default(), 10);
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 11).0, 2 * 3000 + 220);
    }

    #[test]
    fn every_attempt_holysheep_may_have_billed_is_charged_and_only_its_json_error_is_free() {
        // Worst case 3000 micro-dollars a call; three attempts; a day of $1.
        let (s, c) = (MemStore::new(), tenant_config(r#","usd_per_day":1"#, ""));
        let spent = |now| crate::core::limits::budget::spent(&s, "t", now).0;
        // Envoy's own 503 after the request left (a reset): not HolySheep's answer, so it
        // may have been billed; each of three such attempts costs its worst case.
        let reset = "upstream connect error or disconnect/reset before headers. reset reason: connection termination";
        let mut f = tenant_flight(&c);
        let mut now = 0;
        send(f.resume(&s, &c, now, 1));
        for attempt in 1..=3 {
            let (r, h) = read(503, "text/plain", reset);
            assert_eq!(h.billed, Billed::Unknown);
            match f.on_response(&s, &c, r, &h, now + 1, 0) {
                Action::Sleep { until_ms } if attempt < 3 => now = until_ms,
                Action::Finish(Some(r)) if attempt == 3 => assert_eq!(r.status, 503),
                other => panic!("attempt {attempt}: {other:?}"),
            }
            if attempt < 3 {
                send(f.resume(&s, &c, now, 1 + attempt));
            }
        }
        assert_eq!(spent(now + 2), 3 * 3000, "three resets, three worst cases");
        // A 200 the edge refuses to pass on (not a chat.completion) that carries `usage`
        // is charged that usage; one without is charged its worst case.
        let mut f = tenant_flight(&c);
        let start = now + 10;
        send(f.resume(&s, &c, start, 9));
        let (r, h) =
            read(200, "application/json", r#"{"object":"list","usage":{"prompt_tokens":7,"completion_tokens":5}}"#);
        assert_eq!(r.as_ref().unwrap().status, 502, "refused: the edge's 502 in its place");
        assert_eq!(h.billed, Billed::Known(Usage::new(7, 5)));
        let Action::Sleep { until_ms } = f.on_response(&s, &c, r, &h, start + 1, 0) else {
            panic!("retried like a 5xx")
        };
        send(f.resume(&s, &c, until_ms, 10));
        let (r, h) = read(200, "text/html", "<html>captive portal</html>");
        let Action::Sleep { until_ms } = f.on_response(&s, &c, r, &h, until_ms + 1, 0) else { panic!("retried") };
        now = until_ms;
        send(f.resume(&s, &c, now, 11));
        // HolySheep's own JSON error proves the last attempt free.
        let (r, h) = read(503, "application/json", r#"{"error":{"message":"overloaded","type":"server_error"}}"#);
        assert_eq!(h.billed, Billed::Nothing);
        assert!(matches!(f.on_response(&s, &c, r, &h, now + 1, 0), Action::Finish(_)));
        assert_eq!(spent(now + 2), 3 * 3000 + 220 + 3000, "its usage, then a worst case, then nothing");
    }

    #[test]
    fn a_tenants_budget_holds_the_worst_case_of_every_call_in_flight_and_keeps_what_was_spent() {
        // Worst case: 100 tokens at $30/Mtok = 3000 micro-dollars; the day allows 7000.
        let (s, c) = (MemStore::new(), tenant_config(r#","usd_per_day":0.007"#, ""));
        let mut flights: Vec<Flight> = (0..3).map(|_| tenant_flight(&c)).collect();
        assert_eq!(send(flights[0].resume(&s, &c, 0, 1)), "gpt-4.1");
        assert_eq!(send(flights[1].resume(&s, &c, 0, 2)), "gpt-4.1");
        // Nothing is settled yet: the third fits once the others settle, so it is told to
        // come back (a retryable 429), never that the budget is spent.
        let Action::Finish(Some(r)) = flights[2].resume(&s, &c, 0, 3) else { panic!("refused") };
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((r.status, v["error"]["code"].as_str()), (429, Some("rate_limit_exceeded")));
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 0), (6000, 6000), "two worst cases held");
        // The first ends: 7 prompt and 5 completion tokens cost 70 + 150 micro-dollars.
        assert!(matches!(flights[0].on_response(&s, &c, status(200), &hints(200), 5, 0), Action::Finish(_)));
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 5), (3220, 3220));
        let mut again = tenant_flight(&c);
        assert_eq!(send(again.resume(&s, &c, 6, 4)), "gpt-4.1", "room again");
        // An error costs nothing: its hold is given back.
        assert!(matches!(flights[1].on_response(&s, &c, status(400), &hints(400), 7, 0), Action::Finish(_)));
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 7), (3220, 3220));
        // No answer at all (a reset, a timeout) may have been billed: each such attempt is
        // charged the call's worst case.
        let none = ProviderHints::default();
        assert!(matches!(again.on_response(&s, &c, None, &none, 8, 0), Action::Sleep { .. }), "retried");
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 8), (3220, 3220), "its hold stays while it retries");
        send(again.resume(&s, &c, 9_000, 5));
        assert!(matches!(again.on_response(&s, &c, None, &none, 9_001, 0), Action::Sleep { .. }));
        send(again.resume(&s, &c, 20_000, 6));
        assert!(matches!(again.on_response(&s, &c, None, &none, 20_001, 0), Action::Finish(_)));
        assert_eq!(
            crate::core::limits::budget::spent(&s, "t", 20_002),
            (220 + 9000, 220 + 9000),
            "three unknown attempts, three worst cases"
        );
    }

    #[test]
    fn a_tenants_own_bucket_refuses_before_the_models_and_a_refused_model_gives_the_tenant_back() {
        let (s, c) = (MemStore::new(), tenant_config(r#","requests_per_minute":1"#, ""));
        let mut first = tenant_flight(&c);
        assert_eq!(send(first.resume(&s, &c, 0, 1)), "gpt-4.1");
        let Action::Finish(Some(r)) = tenant_flight(&c).resume(&s, &c, 1, 2) else { panic!("refused") };
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((r.status, v["error"]["code"].as_str()), (429, Some("rate_limit_exceeded")));
        assert!(v["error"]["message"].as_str().unwrap().contains("tenant t"), "{v}");
        // The model's bucket refuses: the tenant's budget is given back at once.
        let (s, c) = (MemStore::new(), tenant_config(r#","usd_per_day":1"#, r#","requests_per_minute":1,"burst":1"#));
        send(tenant_flight(&c).resume(&s, &c, 0, 1));
        let Action::Finish(Some(r)) = tenant_flight(&c).resume(&s, &c, 1, 2) else { panic!("refused") };
        assert_eq!(r.status, 429);
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 1), (3000, 3000), "only the call that left holds");
    }

    /// A fleet of 4 nodes, gpt-4.1 at $10/$30 per Mtok, and tenant `t` with `usd_per_day`.
    fn fleet_tenant_config(usd_per_day: f64) -> Config {
        config(&format!(
            r#"{{"fleet":{{"cluster":"owners","nodes":4}},
                "models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30}}}},
                "tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":{usd_per_day}}}}}}}"#,
            "a".repeat(64)
        ))
    }

    #[test]
    fn in_a_fleet_a_tenants_share_is_taken_and_settled_on_its_owner_node() {
        let c = fleet_tenant_config(0.003);
        let (here, owner) = (MemStore::new(), MemStore::new());
        let mut f = tenant_flight(&c);
        let Action::Ask { bucket, op, .. } = f.resume(&here, &c, 0, 1) else { panic!("asks the tenant's owner") };
        assert_eq!(bucket, "tenant.t");
        let verdict = fleet::serve(&owner, &c, &op.to_json(), 0).unwrap();
        assert_eq!(crate::core::limits::budget::spent(&owner, "t", 0), (3000, 3000), "held on the owner");
        f.on_verdict(Some(verdict));
        // Then the model's owner, as without tenants.
        let Action::Ask { op, .. } = f.resume(&here, &c, 1, 1) else { panic!("asks the model's owner") };
        assert!(matches!(op, Op::Take { .. }));
        f.on_verdict(Some(fleet::serve(&owner, &c, &op.to_json(), 1).unwrap()));
        assert_eq!(send(f.resume(&here, &c, 1, 1)), "gpt-4.1");
        assert!(matches!(f.on_response(&here, &c, status(200), &hints(200), 5, 0), Action::Finish(_)));
        let [Op::Settle { .. }, settle @ Op::TenantSettle(s)] = f.outbox.as_slice() else {
            panic!("the model's and the tenant's settlements: {:?}", f.outbox)
        };
        assert_eq!(s.micro, 220);
        fleet::serve(&owner, &c, &settle.to_json(), 6).unwrap();
        assert_eq!(crate::core::limits::budget::spent(&owner, "t", 6), (220, 220), "settled on the owner");
        assert_eq!(crate::core::limits::budget::spent(&here, "t", 6), (0, 0), "nothing here");
        // A second call the owner refuses (220 + 3000 > 3000) is a 429 with nothing held.
        let mut g = tenant_flight(&c);
        let Action::Ask { op, .. } = g.resume(&here, &c, 7, 2) else { panic!("asks") };
        g.on_verdict(Some(fleet::serve(&owner, &c, &op.to_json(), 7).unwrap()));
        let Action::Finish(Some(r)) = g.resume(&here, &c, 8, 2) else { panic!("refused") };
        assert_eq!((r.status, r.header("retry-after").is_some()), (429, true));
        assert!(String::from_utf8_lossy(&r.body).contains("insufficient_quota"));
        assert!(g.outbox.is_empty());
        // The owner out of reach: this node's share of the budget (750 of 3000) cannot hold it.
        let mut h = tenant_flight(&c);
        assert!(matches!(h.resume(&here, &c, 9, 3), Action::Ask { .. }));
        h.on_verdict(None);
        let Action::Finish(Some(r)) = h.resume(&here, &c, 10, 3) else { panic!("the share is too small") };
        assert_eq!(r.status, 429);
        assert!(h.events.contains(&Event::LocalShare { model: "gpt-4.1".into() }));
    }

    #[test]
    fn a_tenant_owners_late_verdict_is_given_back_and_its_repeat_takes_nothing() {
        let c = fleet_tenant_config(0.01);
        let (here, owner) = (MemStore::new(), MemStore::new());
        let mut h = tenant_flight(&c);
        let Action::Ask { op, .. } = h.resume(&here, &c, 0, 1) else { panic!("asks") };
        assert!(fleet::serve(&owner, &c, &op.to_json(), 0).unwrap().admitted);
        assert_eq!(crate::core::limits::budget::spent(&owner, "t", 0), (3000, 3000), "reserved on the owner");
        // Its verdict came too late: this node takes its share (2500 of 10000: too small).
        h.on_verdict(None);
        let Action::Finish(Some(r)) = h.resume(&here, &c, 1, 1) else { panic!("the share is too small") };
        assert_eq!(r.status, 429);
        let [release @ Op::TenantSettle(Settlement { release: true, .. })] = h.outbox.as_slice() else {
            panic!("a release for the owner: {:?}", h.outbox)
        };
        fleet::serve(&owner, &c, &release.to_json(), 2).unwrap();
        assert_eq!(crate::core::limits::budget::spent(&owner, "t", 2), (0, 0), "the late reservation is given back");
        fleet::serve(&owner, &c, &release.to_json(), 3).unwrap();
        assert_eq!(crate::core::limits::budget::spent(&owner, "t", 3), (0, 0), "twice changes nothing");
    }

    fn fleet(extra: &str) -> Config {
        config(&format!(
            r#"{{"fleet":{{"cluster":"owners","nodes":3}},"models":{{"gpt-4.1":{{"requests_per_minute":1,"burst":6{extra}}}}}}}"#
        ))
    }

    fn ask(a: Action) -> Op {
        match a {
            Action::Ask { bucket, op, .. } => {
                assert_eq!(bucket, "gpt-4.1");
                op
            }
            other => panic!("expected to ask the model owner, got {other:?}"),
        }
    }

    #[test]
    fn with_fleet_limits_the_model_owner_admits_and_is_told_the_usage() {
        let (s, c) = (MemStore::new(), fleet(""));
        let mut f = flight(&c, "gpt-4.1");
        let Op::Take { id, estimate, .. } = ask(f.resume(&s, &c, 0, 9)) else { panic!("a take") };
        assert_eq!((id, estimate), (9, 100));
        f.on_verdict(Some(Verdict { admitted: true, denial: None, hold: None }));
        assert_eq!(send(f.resume(&s, &c, 1, 10)), "gpt-4.1");
        assert!(matches!(f.on_response(&s, &c, status(200), &hints(200), 5, 0), Action::Finish(_)));
        let settle = Op::Settle {
            model: "gpt-4.1".into(),
            id: 9,
            estimate: 100,
            actual: Some(12),
            hints: ProviderHints::default(),
            retries: 0,
        };
        assert_eq!(f.outbox, [settle], "settled on the model owner, not here");
        assert_eq!(s.get(&limits::bucket_key("gpt-4.1")).unwrap().value, None, "this node's bucket untouched");
    }

    #[test]
    fn a_streams_router_retries_go_to_the_model_owner_with_its_settlement() {
        let (s, c) = (MemStore::new(), fleet(""));
        let mut f = flight(&c, "gpt-4.1");
        ask(f.resume(&s, &c, 0, 9));
        f.on_verdict(Some(Verdict { admitted: true, denial: None, hold: None }));
        send(f.resume(&s, &c, 1, 10));
        f.on_stream_end(&s, &c, &streamed(Some((10, 2)), 0, 3), &ProviderHints::default(), 5);
        let [Op::Settle { retries, actual, .. }] = f.outbox.as_slice() else {
            panic!("one settlement: {:?}", f.outbox)
        };
        assert_eq!((*retries, *actual), (2, Some(12)), "three attempts: two beyond the first");
        assert_eq!(s.get(&limits::bucket_key("gpt-4.1")).unwrap().value, None, "this node's bucket untouched");
    }

    #[test]
    fn a_model_owner_that_refuses_gives_a_429_and_nothing_to_settle() {
        let (s, c) = (MemStore::new(), fleet(""));
        let mut f = flight(&c, "gpt-4.1");
        ask(f.resume(&s, &c, 0, 1));
        f.on_verdict(Some(Verdict {
            admitted: false,
            denial: Some(Denial::of(Kind::Requests, Some(9_000))),
            hold: None,
        }));
        let Action::Finish(Some(r)) = f.resume(&s, &c, 1, 2) else { panic!("a 429") };
        assert_eq!((r.status, r.header("retry-after")), (429, Some("9")));
        f.on_response(&s, &c, None, &ProviderHints::default(), 2, 0);
        assert!(f.outbox.is_empty());
    }

    #[test]
    fn a_model_owner_out_of_reach_leaves_this_node_its_share_of_the_burst() {
        let (s, c) = (MemStore::new(), fleet(""));
        let mut sent = 0;
        for n in 0..5 {
            let mut f = flight(&c, "gpt-4.1");
            ask(f.resume(&s, &c, 0, n));
            f.on_verdict(None);
            match f.resume(&s, &c, 0, n) {
                Action::Send { .. } => sent += 1,
                Action::Finish(Some(r)) => assert_eq!(r.status, 429),
                other => panic!("{other:?}"),
            }
            assert!(f.events.contains(&Event::LocalShare { model: "gpt-4.1".into() }));
            assert!(f.outbox.is_empty(), "a share is settled here");
        }
        assert_eq!(sent, 2, "burst 6 over 3 nodes");
    }

    #[test]
    fn a_model_owner_refusal_fails_over_to_the_fallback_through_its_own_owner() {
        let c = config(
            r#"{"fleet":{"cluster":"owners"},"models":{"gpt-4.1":{"requests_per_minute":1,"fallback":["deepseek-v3"]},
                "deepseek-v3":{"requests_per_minute":1}}}"#,
        );
        let s = MemStore::new();
        let mut f = flight(&c, "gpt-4.1");
        ask(f.resume(&s, &c, 0, 1));
        f.on_verdict(Some(Verdict {
            admitted: false,
            denial: Some(Denial::of(Kind::Requests, Some(60_000))),
            hold: None,
        }));
        let Action::Ask { bucket, .. } = f.resume(&s, &c, 0, 2) else { panic!("asks the fallback's owner") };
        assert_eq!(bucket, "deepseek-v3");
        f.on_verdict(Some(Verdict { admitted: true, denial: None, hold: None }));
        assert_eq!(send(f.resume(&s, &c, 0, 3)), "deepseek-v3");
    }

    /// A store where every write to a bucket loses its race (other workers always win).
    struct Contended(MemStore);

    impl CasStore for Contended {
        fn get(&self, key: &str) -> Result<crate::core::store::Read, StoreError> {
            self.0.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if key.contains("bucket") {
                return Err(StoreError::CasMismatch);
            }
            self.0.set(key, value, cas)
        }
    }

    #[test]
    fn admission_that_loses_every_race_is_not_an_admission_and_credits_nothing() {
        let c = config(r#"{"models":{"gpt-4.1":{"requests_per_minute":60,"tokens_per_minute":1000}}}"#);
        let s = Contended(MemStore::new());
        let mut f = flight(&c, "gpt-4.1");
        let a = f.resume(&s, &c, 0, 1);
        assert_eq!(a, Action::Sleep { until_ms: CONTENTION_RETRY_MS }, "held, not sent uncharged");
        let before = limits::peek(&s, "gpt-4.1", &Limits::of(c.model("gpt-4.1").unwrap().1, &c.rate_limit), 10);
        f.on_response(&s, &c, status(200), &hints(200), 10, 0);
        let after = limits::peek(&s, "gpt-4.1", &Limits::of(c.model("gpt-4.1").unwrap().1, &c.rate_limit), 10);
        assert_eq!(before, after, "no refund for what was never taken");
    }

    #[test]
    fn a_day_long_provider_retry_after_empties_the_bucket_for_the_configured_bound_only() {
        let c = config(
            r#"{"models":{"gpt-4.1":{"requests_per_minute":600}},"retry":{"max_attempts":1},
                "rate_limit":{"max_provider_hold_ms":2000}}"#,
        );
        let s = MemStore::new();
        let mut f = flight(&c, "gpt-4.1");
        send(f.resume(&s, &c, 0, 1));
        let day = ProviderHints { throttled: true, retry_after_ms: Some(86_400_000), ..Default::default() };
        assert!(matches!(f.on_response(&s, &c, status(429), &day, 0, 0), Action::Finish(_)));
        let mut g = flight(&c, "gpt-4.1");
        assert!(matches!(g.resume(&s, &c, 1_000, 2), Action::Finish(Some(ref r)) if r.status == 429), "held");
        let mut h = flight(&c, "gpt-4.1");
        assert_eq!(send(h.resume(&s, &c, 2_200, 3)), "gpt-4.1", "free again after the bound, not a day");
    }

    #[test]
    fn attempts_spent_on_every_model_return_the_last_error() {
        let (s, c) = (
            MemStore::new(),
            config(
                r#"{"models":{"a":{"fallback":["b"]}},"retry":{"max_attempts":2,"base_delay_ms":1,"max_delay_ms":1}}"#,
            ),
        );
        let mut f = flight(&c, "a");
        let mut now = 0;
        let mut sent = vec![send(f.resume(&s, &c, now, 0))];
        loop {
            now += 5;
            match f.on_response(&s, &c, status(503), &hints(503), now, 0) {
                Action::Send { model, .. } => sent.push(model),
                Action::Sleep { until_ms } => sent.push(send(f.resume(&s, &c, until_ms, until_ms))),
                Action::Ask { .. } => panic!("no fleet configured"),
                Action::Finish(r) => {
                    assert_eq!(
                        r.map(|r| (r.status, r.header("x-holysheep-model").map(str::to_owned))),
                        Some((503, Some("b".into())))
                    );
                    break;
                }
            }
        }
        assert_eq!(sent, ["a", "a", "b", "b"]);
    }

    #[test]
    fn an_empty_bucket_answers_429_or_holds() {
        let s = MemStore::new();
        let c = config(r#"{"models":{"gpt-4.1":{"requests_per_minute":1}}}"#);
        send(flight(&c, "gpt-4.1").resume(&s, &c, 0, 1));
        let mut f = flight(&c, "gpt-4.1");
        let Action::Finish(Some(r)) = f.resume(&s, &c, 0, 2) else { panic!() };
        assert_eq!((r.status, r.header("retry-after"), r.header("retry-after-ms")), (429, Some("60"), Some("60000")));
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(
            (v["error"]["code"].as_str(), v["error"]["type"].as_str()),
            (Some("rate_limit_exceeded"), Some("requests"))
        );
        assert!(v["error"]["message"].as_str().unwrap().contains("gpt-4.1"));

        let held = config(
            r#"{"models":{"gpt-4.1":{"requests_per_minute":1}},"rate_limit":{"max_wait_ms":61000},"upstream":{"timeout_ms":120000}}"#,
        );
        let mut f = flight(&held, "gpt-4.1");
        // It comes back often enough to keep its place in line.
        assert_eq!(f.resume(&s, &held, 0, 3), Action::Sleep { until_ms: POLL_CAP_MS });
        assert_eq!(f.resume(&s, &held, 59_800, 3), Action::Sleep { until_ms: 60_000 });
        assert_eq!(send(f.resume(&s, &held, 60_000, 3)), "gpt-4.1");
    }

    /// A flight of `class` for tenant `tenant` on `model`.
    fn classed(c: &Config, model: &str, class: Class, tenant: &str) -> Flight {
        Flight::new(c, flight(c, model).call, &outbound(model, Some(tenant), class))
    }

    /// `n` flights of `class` for `tenant` on `model`, each refused and standing in line.
    fn standing(s: &MemStore, c: &Config, n: u64, class: Class, tenant: &str) -> Vec<Flight> {
        let mut flights: Vec<Flight> = (0..n).map(|_| classed(c, "m", class, tenant)).collect();
        for (i, f) in flights.iter_mut().enumerate() {
            assert!(matches!(f.resume(s, c, 1, 10 + i as u64), Action::Sleep { .. }));
        }
        flights
    }

    #[test]
    fn a_critical_call_is_admitted_before_a_queue_of_sheddable_ones() {
        let s = MemStore::new();
        let c = config(r#"{"models":{"m":{"max_in_flight":1}},"rate_limit":{"max_wait_ms":10000}}"#);
        let mut first = classed(&c, "m", Class::Sheddable, "batch");
        send(first.resume(&s, &c, 0, 1));
        let mut queued = standing(&s, &c, 10, Class::Sheddable, "batch");
        assert!(queued.iter().all(|f| f.events.contains(&Event::Queued { class: Class::Sheddable })));
        let mut critical = classed(&c, "m", Class::Critical, "search");
        assert!(matches!(critical.resume(&s, &c, 2, 99), Action::Sleep { .. }));
        first.on_response(&s, &c, None, &ProviderHints::default(), 3, 0);
        // Every sheddable call looks before the critical one does: none is admitted.
        for (i, f) in queued.iter_mut().enumerate() {
            assert!(matches!(f.resume(&s, &c, 4, 10 + i as u64), Action::Sleep { .. }));
        }
        assert_eq!(send(critical.resume(&s, &c, 5, 99)), "m");
        assert!(critical.events.contains(&Event::Admitted { class: Class::Critical, waited_ms: 5 }));
    }

    #[test]
    fn a_leader_in_line_takes_the_class_of_its_most_urgent_waiter() {
        use crate::core::coalesce::engine::{Engine, Step};
        let s = MemStore::new();
        let c = config(r#"{"models":{"m":{"max_in_flight":1}},"rate_limit":{"max_wait_ms":10000}}"#);
        let mut busy = classed(&c, "m", Class::Standard, "a");
        send(busy.resume(&s, &c, 0, 1));
        let mut backlog = standing(&s, &c, 3, Class::Sheddable, "batch");
        // A sheddable leader with a lease, last in line.
        let e = Engine { store: &s, config: &c };
        let key = request_key("/p", "s", b"the same");
        let policy = |class| crate::core::request::Policy { class, ..flight(&c, "m").call.policy };
        let Step::Call(call) = e.admit(&key, policy(Class::Sheddable), 2, 50) else { panic!("leads") };
        let mut leader = Flight { call, ..classed(&c, "m", Class::Sheddable, "search") };
        assert!(matches!(leader.resume(&s, &c, 2, 60), Action::Sleep { .. }));
        // A critical request for the same answer waits on it, and says so.
        assert!(matches!(e.admit(&key, policy(Class::Critical), 3, 70), Step::Wait(_)));
        busy.on_response(&s, &c, None, &ProviderHints::default(), 4, 0);
        assert!(matches!(leader.resume(&s, &c, 600, 60), Action::Send { .. }), "ahead of the sheddable line");
        for (i, f) in backlog.iter_mut().enumerate() {
            assert!(matches!(f.resume(&s, &c, 601, 10 + i as u64), Action::Sleep { .. }));
        }
    }

    #[test]
    fn a_sheddable_call_is_refused_at_once_where_the_reserve_begins() {
        let s = MemStore::new();
        let c = config(
            r#"{"models":{"m":{"requests_per_minute":60,"burst":10}},"rate_limit":{"reserve":0.5,"max_wait_ms":10000}}"#,
        );
        let outcomes: Vec<Action> =
            (0..10).map(|i| classed(&c, "m", Class::Sheddable, "batch").resume(&s, &c, 0, i)).collect();
        assert_eq!(outcomes.iter().filter(|a| matches!(a, Action::Send { .. })).count(), 5);
        let Some(Action::Finish(Some(shed))) = outcomes.last() else { panic!("{outcomes:?}") };
        assert_eq!(shed.status, 429);
        assert_eq!(
            (shed.header("x-holysheep-shed"), shed.header("x-holysheep-priority")),
            (Some("priority"), Some("sheddable"))
        );
        // One request a second: the sixth is above the reserve again in one second.
        assert_eq!(shed.header("retry-after-ms"), Some("1000"));
        let critical: Vec<Action> =
            (0..5).map(|i| classed(&c, "m", Class::Critical, "search").resume(&s, &c, 0, 100 + i)).collect();
        assert!(critical.iter().all(|a| matches!(a, Action::Send { .. })), "{critical:?}");
    }

    #[test]
    fn a_flight_that_gives_up_or_fails_over_leaves_the_line() {
        let s = MemStore::new();
        let c = config(
            r#"{"models":{"m":{"max_in_flight":1,"fallback":["f"]},"f":{"max_in_flight":1}},"rate_limit":{"max_wait_ms":100}}"#,
        );
        send(classed(&c, "m", Class::Standard, "a").resume(&s, &c, 0, 1));
        send(classed(&c, "f", Class::Standard, "a").resume(&s, &c, 0, 2));
        let mut waiting = classed(&c, "m", Class::Standard, "a");
        assert!(matches!(waiting.resume(&s, &c, 0, 3), Action::Sleep { .. }));
        let l = Limits::of(&c.models["m"], &c.rate_limit);
        assert_eq!(limits::peek(&s, "m", &l, 0).line.len(), 1);
        assert!(matches!(waiting.resume(&s, &c, 200, 3), Action::Finish(Some(_))), "past max_wait_ms");
        assert!(limits::peek(&s, "m", &l, 200).line.is_empty(), "its place is given up at once");
        assert!(limits::peek(&s, "f", &l, 200).line.is_empty());
    }

    #[test]
    fn fallbacks_that_share_a_bucket_hold_one_place_and_keep_the_slot_they_take() {
        let s = MemStore::new();
        let c = config(
            r#"{"models":{"gpt-4.1":{"max_in_flight":1,"fallback":["deepseek-v3","qwen"]},"default":{"max_in_flight":1}},
                "rate_limit":{"max_wait_ms":10000}}"#,
        );
        send(classed(&c, "gpt-4.1", Class::Standard, "a").resume(&s, &c, 0, 1));
        let mut other = classed(&c, "qwen", Class::Standard, "a");
        send(other.resume(&s, &c, 0, 2));
        let mut f = classed(&c, "gpt-4.1", Class::Standard, "a");
        assert!(matches!(f.resume(&s, &c, 0, 3), Action::Sleep { .. }));
        let default = Limits::of(&c.models["default"], &c.rate_limit);
        assert_eq!(limits::peek(&s, "default", &default, 0).line.len(), 1, "one place for both fallbacks");
        other.on_response(&s, &c, None, &ProviderHints::default(), 1, 0);
        assert_eq!(send(f.resume(&s, &c, 2, 3)), "deepseek-v3");
        let b = limits::peek(&s, "default", &default, 2);
        assert_eq!((b.in_flight.len(), b.line.len()), (1, 0), "the slot it took is still held");
        let gpt = Limits::of(&c.models["gpt-4.1"], &c.rate_limit);
        assert!(limits::peek(&s, "gpt-4.1", &gpt, 2).line.is_empty(), "its first model's place is given up");
    }

    #[test]
    fn an_empty_bucket_fails_over_to_a_fallback_with_room() {
        let s = MemStore::new();
        let c = config(r#"{"models":{"gpt-4.1":{"requests_per_minute":1,"fallback":["deepseek-v3"]}}}"#);
        send(flight(&c, "gpt-4.1").resume(&s, &c, 0, 1));
        let mut f = flight(&c, "gpt-4.1");
        assert_eq!(send(f.resume(&s, &c, 0, 2)), "deepseek-v3");
        assert!(!f.call.store);
    }

    #[test]
    fn reconciliation_refunds_the_estimate() {
        let s = MemStore::new();
        let c = config(r#"{"models":{"m":{"tokens_per_minute":1000}}}"#);
        let mut f = flight(&c, "m");
        send(f.resume(&s, &c, 0, 1));
        let l = Limits::of(&c.models["m"], &c.rate_limit);
        assert_eq!(limits::peek(&s, "m", &l, 0).tokens, 900.0);
        f.on_response(&s, &c, status(200), &hints(200), 0, 0);
        assert_eq!(limits::peek(&s, "m", &l, 0).tokens, 988.0, "charged 12 real tokens, not 100");
    }
}
