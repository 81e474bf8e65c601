//! One upstream flight, sans-IO: its calls, retries and failover, each call admitted and
//! settled at one door (`limits::admission`). The highest floor of the call path: it uses
//! the limits' door, the upstream request and the engine's `Call`.
//!
//! Attempts go with exponential backoff and full jitter honouring the provider's
//! `retry-after`, then fail over to the model's fallbacks, all within `upstream.timeout_ms`.
//! The shell performs each `Action` and reports back.

pub mod leader;
pub mod look;
pub mod tail;
pub mod tee;

use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::objects::Signer;
use crate::core::api::response::Response;
use crate::core::api::usage::{Billed, Usage};
use crate::core::cache::batch::Batch;
use crate::core::coalesce::engine::Call;
use crate::core::coalesce::lease;
use crate::core::config::Config;
use crate::core::limits::admission::{Admission, Claim, Standing};
use crate::core::limits::fleet::{Op, Verdict};
use crate::core::store::CasStore;
use crate::core::upstream::Outbound;

use crate::core::api::event::Event;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Call HolySheep for `model` (the body rewritten to it when it is a fallback).
    Send { model: String, timeout_ms: u64 },
    /// Ask the owner node of `bucket` to admit the call (then `on_verdict`, then `resume`).
    Ask { bucket: String, op: Op, timeout_ms: u64 },
    /// Come back (call `resume`) at this time.
    Sleep { until_ms: u64 },
    /// The flight is over: complete the call with this outcome (`None`: no answer).
    Finish(Option<Response>),
}

/// How a stream forwarded along the route ended, as its shell saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct StreamOutcome {
    /// The status of HolySheep's answer (`None`: no answer head came).
    pub status: Option<u16>,
    pub usage: Option<Usage>,
    /// The tokens a stream cut off before its usage may have cost (prompt and streamed).
    pub cut_off_tokens: u64,
    /// The attempts Envoy's router made (0: the request never left).
    pub attempts: u64,
}

/// A flight: its call, the model it is on and the attempts there, and its standing with
/// the limits (`limits::admission`), which admits each attempt and settles it.
#[derive(Debug, Clone)]
pub struct Flight {
    pub call: Call,
    standing: Standing,
    idx: usize,
    attempt: u32,
    last: Option<Response>,
    pub events: Vec<Event>,
    /// Settlements for owner nodes, sent by the shell without waiting.
    pub outbox: Vec<Op>,
    /// An embeddings list answered item by item: HolySheep's answer is completed with the
    /// cached items (`Batch::finish`).
    batch: Option<std::rc::Rc<Batch>>,
    /// Signs the response id of a verified tenant's Responses answer (`api::objects`).
    signer: Option<Signer>,
    /// The edge set the call's `prompt_cache_key` (`Outbound::affinity`).
    affinity: bool,
}

impl Flight {
    /// The flight for `outbound`'s call: its model, then the model's fallbacks that its
    /// tenant (if any) may call.
    pub(crate) fn new(config: &Config, call: Call, outbound: &Outbound) -> Flight {
        let claim = Claim {
            model: &outbound.model,
            tenant: outbound.tenant.as_deref(),
            class: outbound.class,
            estimate: outbound.estimate_tokens,
            worst_tokens: outbound.worst_tokens(),
            started_ms: call.started_ms,
        };
        Flight {
            standing: Standing::new(config, &claim),
            call,
            idx: 0,
            attempt: 0,
            last: None,
            events: Vec::new(),
            outbox: Vec::new(),
            batch: outbound.batch.clone(),
            signer: config.signer(outbound.endpoint, outbound.tenant.as_deref()),
            affinity: outbound.affinity,
        }
    }

    /// The answer's `usage` on `model`, and what HolySheep's prompt cache saved where the
    /// edge set the call's key.
    fn used(&mut self, config: &Config, model: &str, usage: Usage) {
        if self.affinity && usage.cached > 0 {
            let micro = config.cache_saving_micro_usd(model, usage.cached);
            self.events.push(Event::AffinitySaved { model: model.to_owned(), tokens: usage.cached, micro });
        }
        self.events.push(Event::Usage { model: model.to_owned(), usage });
    }

    /// The model the flight is on now.
    pub fn model(&self) -> &str {
        self.standing.models().get(self.idx).map_or("", String::as_str)
    }

    /// Passes the door (`Standing::admit`) to the current model or a later one, and calls
    /// it, waits, asks an owner node, or ends with the door's refusal.
    pub(crate) fn resume(&mut self, store: &impl CasStore, config: &Config, now_ms: u64, nonce: u64) -> Action {
        let deadline_ms = self.standing.deadline_ms();
        if now_ms >= deadline_ms {
            let last = self.last.take();
            return self.end(store, config, last, now_ms);
        }
        self.raise_to_waiters(store);
        let admission = self.standing.admit(store, config, self.idx, now_ms, nonce);
        self.take_trail();
        match admission {
            Admission::Admitted { index } => {
                if index != self.idx {
                    self.fail_over_to(index);
                }
                let model = self.model().to_owned();
                self.events.push(Event::UpstreamCall { model: model.clone() });
                Action::Send { model, timeout_ms: deadline_ms - now_ms }
            }
            Admission::Wait { until_ms } => Action::Sleep { until_ms },
            Admission::AskOwner { bucket, op, timeout_ms } => Action::Ask { bucket, op, timeout_ms },
            Admission::Denied(refused) => self.end(store, config, Some(refused), now_ms),
        }
    }

    /// The door's events and settlements join the flight's, in the order they happened.
    fn take_trail(&mut self) {
        self.events.append(&mut self.standing.events);
        self.outbox.append(&mut self.standing.outbox);
    }

    /// Each time it looks again from its place in line, the flight looks for waiters of a
    /// higher class than its own, and then waits at the highest of theirs (and counts as
    /// queued in that class): a critical request coalesced on a sheddable leader does not
    /// wait behind the sheddable line.
    fn raise_to_waiters(&mut self, store: &impl CasStore) {
        if !self.standing.may_raise() {
            return;
        }
        let Some(lease) = &self.call.lease else { return };
        if let Some(best) = lease::waiting_class(store, lease) {
            self.standing.raise_to(best);
        }
    }

    /// Whether the flight's last `Action::Ask` went to its tenant's owner node.
    pub fn asking_tenant(&self) -> bool {
        self.standing.asking_tenant()
    }

    /// The owner's answer to `Action::Ask` (`None`: no answer in time).
    pub(crate) fn on_verdict(&mut self, verdict: Option<Verdict>) {
        self.standing.on_verdict(verdict);
    }

    /// The flight ends with `outcome`: the door settles what it holds.
    fn end(&mut self, store: &impl CasStore, config: &Config, outcome: Option<Response>, now_ms: u64) -> Action {
        self.standing.close(store, config, now_ms);
        self.take_trail();
        Action::Finish(outcome)
    }

    /// The call for the current model ended (`None`: reset or timeout). `random` draws
    /// the backoff jitter and serves as the nonce of a fallback's admission.
    pub(crate) fn on_response(
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
        // An attempt the shell knows never reached HolySheep (refused at dispatch, its
        // connection never made) was billed nothing, answer or not.
        let billed = if outcome.is_some() || hints.billed == Billed::Unsent { hints.billed } else { Billed::Unknown };
        let usage = match billed {
            Billed::Known(u) => Some(u),
            Billed::Nothing | Billed::Unknown | Billed::Unsent => None,
        };
        self.standing.bill(config, self.idx, billed);
        // HolySheep's own 4xx used no tokens, nor did an attempt that never reached it: the
        // estimate goes back to the bucket.
        let rejected = billed == Billed::Unsent
            || billed == Billed::Nothing && outcome.as_ref().is_some_and(|r| (400..500).contains(&r.status));
        let actual = usage.map(|u| u.total()).or(rejected.then_some(0));
        self.standing.settle(store, config, self.idx, (actual, 0), hints, now_ms);
        self.take_trail();
        if let Some(usage) = usage {
            self.used(config, &model, usage);
        }
        if hints.throttled {
            self.events.push(Event::ProviderRateLimited { model: model.clone() });
        }
        if hints.ignored > 0 {
            self.events.push(Event::LimitHeadersIgnored { model: model.clone(), n: u64::from(hints.ignored) });
        }
        let outcome = match (&self.batch, outcome) {
            (Some(batch), Some(r)) if r.status == 200 => Some(batch.finish(store, config, r, now_ms)),
            (_, outcome) => outcome,
        };
        let outcome = outcome.map(|r| self.signed(r).with_header(headers::MODEL, model.clone()));
        // Another attempt goes only where the tenant's budget holds its worst case beside
        // what this one was billed.
        if !retryable(outcome.as_ref()) || hints.key_refused || !self.standing.cover_next(store, config, now_ms) {
            return self.end(store, config, outcome, now_ms);
        }
        self.attempt += 1;
        self.last = outcome;
        if self.attempt < config.retry.max_attempts {
            if let Some(delay) = self.backoff(config, hints.retry_after_ms, random) {
                if now_ms.saturating_add(delay) < self.standing.deadline_ms() {
                    self.events.push(Event::Retry { model });
                    return Action::Sleep { until_ms: now_ms + delay };
                }
            }
        }
        if self.idx + 1 < self.standing.models().len() {
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
    /// HolySheep answered with its own JSON error (`hints.billed`), or one that never left,
    /// costs its tenant nothing.
    pub(crate) fn on_stream_end(
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
        self.standing.charge_retries(store, config, self.idx, retries, now_ms);
        // Each attempt Envoy's router made before the one that answered may have been
        // billed: its worst case, on the tenant's account.
        for _ in 0..retries {
            self.standing.bill(config, self.idx, Billed::Unknown);
        }
        // A stream that never left used nothing. HolySheep's answer that is not a stream
        // says by its body (`hints.billed`) what it was billed: its own JSON error nothing (a
        // 4xx used no tokens, a 5xx keeps its estimate in the bucket, as a call's does),
        // its `usage` that; anything else, and an answer that is not HolySheep's (Envoy's
        // own 504 or 503, `status: None`), may have been billed its worst case.
        let (billed, actual) = match (end.usage, end.attempts, end.status) {
            (Some(u), _, _) => (Billed::Known(u), Some(u.total())),
            (None, 0, _) => (Billed::Nothing, Some(0)),
            // Envoy's own answer that says the request never left (`Billed::Unsent`).
            (None, _, _) if hints.billed == Billed::Unsent => (Billed::Unsent, Some(0)),
            // (a 200 the edge refused to pass on as not a stream says it too)
            (None, _, Some(s)) if s != 200 || hints.billed != Billed::Unknown => match hints.billed {
                Billed::Nothing => (Billed::Nothing, (400..500).contains(&s).then_some(0)),
                Billed::Known(u) => (Billed::Known(u), Some(u.total())),
                Billed::Unknown => (Billed::Unknown, Some(end.cut_off_tokens)),
                Billed::Unsent => (Billed::Unsent, Some(0)),
            },
            (None, _, _) => (Billed::Unknown, Some(end.cut_off_tokens)),
        };
        self.standing.bill(config, self.idx, billed);
        self.standing.settle(store, config, self.idx, (actual, retries), hints, now_ms);
        self.take_trail();
        if let Some(usage) = end.usage {
            self.used(config, &model, usage);
        }
        if hints.ignored > 0 {
            self.events.push(Event::LimitHeadersIgnored { model: model.clone(), n: u64::from(hints.ignored) });
        }
        if hints.throttled {
            self.events.push(Event::ProviderRateLimited { model });
        }
        self.standing.close(store, config, now_ms);
        self.take_trail();
    }

    /// The retries Envoy's router may make of a stream before its first byte: none when
    /// the call holds its tenant's dollars, whose reservation covers one attempt's worst
    /// case (each retry may be billed as much, and is charged so).
    pub(crate) fn stream_retries(&self, config: &Config) -> u32 {
        if self.standing.holds_dollars(config) {
            return 0;
        }
        config.retry.max_attempts.saturating_sub(1)
    }

    /// The router headers of a stream sent along the route: Envoy retries it before its
    /// first byte on the edge's terms (`stream_retries`), and says how many attempts it
    /// made, each counted and charged.
    pub fn route_headers(&self, config: &Config) -> [(&'static str, String); 3] {
        [
            (headers::ENVOY_MAX_RETRIES, self.stream_retries(config).to_string()),
            (headers::ENVOY_RETRY_ON, STREAM_RETRY_ON.to_owned()),
            (headers::ENVOY_RETRIABLE_STATUS_CODES, STREAM_RETRIABLE_STATUSES.to_owned()),
        ]
    }

    /// A fallback's answer is not stored under the requested model's key.
    fn fail_over_to(&mut self, i: usize) {
        let to = self.standing.models().get(i).cloned().unwrap_or_default();
        self.events.push(Event::Failover { from: self.model().to_owned(), to });
        self.idx = i;
        self.attempt = 0;
        self.call.store = false;
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
}

fn retryable(outcome: Option<&Response>) -> bool {
    outcome.is_none_or(|r| matches!(r.status, 429 | 500 | 502 | 503 | 504))
}

/// How Envoy's router may retry a stream leader before its first byte (set on the request
/// as `x-envoy-retry-on` and `x-envoy-retriable-status-codes`, with `x-envoy-max-retries`
/// from `retry.max_attempts`): what `retryable` retries, but for 429, which goes back to the
/// flight so that the bucket adapts and the client and waiters get HolySheep's
/// `retry-after`.
pub(crate) const STREAM_RETRY_ON: &str = "reset,connect-failure,retriable-status-codes";
pub(crate) const STREAM_RETRIABLE_STATUSES: &str = "500,502,503,504";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::api::priority::Class;
    use crate::core::api::reply::CacheStatus;
    use crate::core::limits::line::POLL_CAP_MS;
    use crate::core::limits::tenant_gate::Settlement;
    use crate::core::limits::{self, fleet, tenant_gate, Denial, Kind, Limits};
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
            trace: None,
            affinity: false,
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
        let l = Limits::of(c.models.get("gpt-4.1").unwrap(), &c.rate_limit);
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
            trace: None,
            affinity: false,
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
    fn a_stream_answered_with_anything_but_holysheeps_json_error_is_charged() {
        // Worst case 3000 micro-dollars a call; HolySheep answered each stream once.
        let (s, c) = (MemStore::new(), tenant_config(r#","usd_per_day":1"#, ""));
        let spent = |now| crate::core::limits::budget::spent(&s, "t", now).0;
        let end = |status: u16, content_type: &str, body: &str, now: u64| {
            let mut f = tenant_flight(&c);
            send(f.resume(&s, &c, now, now + 1));
            let hints = ProviderHints {
                billed: Billed::of_answer(status, content_type, body.as_bytes()),
                ..ProviderHints::default()
            };
            f.on_stream_end(&s, &c, &StreamOutcome { status: Some(status), ..streamed(None, 0, 1) }, &hints, now);
        };
        end(429, "application/json", r#"{"error":{"message":"slow down","type":"requests","code":null}}"#, 10);
        end(500, "application/json", r#"{"error":{"message":"oops","type":"server_error"}}"#, 20);
        assert_eq!(spent(21), 0, "HolySheep's own JSON errors are free");
        end(502, "text/html", "<html>Bad gateway</html>", 30);
        assert_eq!(spent(31), 3000, "a page that is not HolySheep's error may have been billed");
        end(
            500,
            "application/json",
            r#"{"error":{"message":"late"},"usage":{"prompt_tokens":7,"completion_tokens":5}}"#,
            40,
        );
        assert_eq!(spent(41), 3000 + 220, "an error that carries usage is charged it");
        // A 200 that is not a stream (refused: the client gets the edge's 502) with usage.
        let refused = r#"{"object":"chat.completion","usage":{"prompt_tokens":7,"completion_tokens":5}}"#;
        end(200, "application/json", refused, 50);
        assert_eq!(spent(51), 3000 + 2 * 220, "a refused 200 is charged its usage");
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
        // charged the call's worst case, and a retry is sent only once the budget holds its
        // worst case beside what was charged.
        let none = ProviderHints::default();
        assert!(matches!(again.on_response(&s, &c, None, &none, 8, 0), Action::Sleep { .. }), "retried");
        assert_eq!(
            crate::core::limits::budget::spent(&s, "t", 8),
            (220 + 6000, 220 + 6000),
            "the first attempt's worst case charged, the retry's reserved"
        );
        send(again.resume(&s, &c, 9_000, 5));
        // A third worst case does not fit the day's $0.007: the call ends with what it got.
        assert!(matches!(again.on_response(&s, &c, None, &none, 9_001, 0), Action::Finish(None)));
        assert_eq!(
            crate::core::limits::budget::spent(&s, "t", 9_002),
            (220 + 6000, 220 + 6000),
            "two unknown attempts, two worst cases, within the budget"
        );
    }

    #[test]
    fn attempts_that_never_reached_holysheep_cost_nothing_however_often_they_are_retried() {
        // Worst case 3000 micro-dollars; the day allows 7000.
        let (s, c) = (MemStore::new(), tenant_config(r#","usd_per_day":0.007"#, ""));
        let mut f = tenant_flight(&c);
        send(f.resume(&s, &c, 0, 1));
        // Refused at dispatch (no answer, the shell says it never left) ...
        assert!(matches!(f.on_response(&s, &c, None, &ProviderHints::unsent(), 1, 0), Action::Sleep { .. }));
        send(f.resume(&s, &c, 5_000, 2));
        // ... then Envoy's own 503 for a connection it could not make (a callout's answer
        // without `x-envoy-upstream-service-time`: no upstream gave it) ...
        let refused =
            "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";
        let envoys = crate::core::upstream::Sent { envoy: true, ..Default::default() };
        let text = [("content-type".to_owned(), "text/plain".to_owned())];
        let (r, h) = crate::core::upstream::response(503, &text, refused.as_bytes().to_vec(), envoys);
        assert_eq!(h.billed, Billed::Unsent);
        let r = Some(r);
        // (The same text from a hop on HolySheep's side, which Envoy timed, may have cost.)
        let timed = [text[0].clone(), ("x-envoy-upstream-service-time".to_owned(), "12".to_owned())];
        let (_, relayed) = crate::core::upstream::response(503, &timed, refused.as_bytes().to_vec(), envoys);
        assert_eq!(relayed.billed, Billed::Unknown);
        assert!(matches!(f.on_response(&s, &c, r, &h, 5_001, 0), Action::Sleep { .. }));
        send(f.resume(&s, &c, 15_000, 3));
        // ... and its circuit breaker's, marked `x-envoy-overloaded`.
        let headers = [
            ("content-type".to_owned(), "text/plain".to_owned()),
            ("x-envoy-overloaded".to_owned(), "true".to_owned()),
        ];
        let (r, h) = crate::core::upstream::response(503, &headers, b"overloaded".to_vec(), envoys);
        assert_eq!(h.billed, Billed::Unsent);
        assert!(matches!(f.on_response(&s, &c, Some(r), &h, 15_001, 0), Action::Finish(Some(_))));
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 15_002), (0, 0), "three attempts, none charged");
        assert!(!f.events.iter().any(|e| matches!(e, Event::BudgetCharged { .. })), "{:?}", f.events);
    }

    #[test]
    fn a_retry_of_an_attempt_that_billed_needs_its_own_worst_case_reserved() {
        // Worst case 3000 micro-dollars; the day allows 5000: one worst case, not two.
        let (s, c) = (MemStore::new(), tenant_config(r#","usd_per_day":0.005"#, ""));
        let mut f = tenant_flight(&c);
        send(f.resume(&s, &c, 0, 1));
        // A 200 that is not a chat completion but carries usage: 7 + 5 tokens, 220 micro-dollars.
        let body = r#"{"object":"list","data":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}"#;
        let (r, h) = read(200, "application/json", body);
        assert_eq!(r.as_ref().map(|r| r.status), Some(502), "not passed on");
        assert!(matches!(f.on_response(&s, &c, r, &h, 1, 0), Action::Sleep { .. }), "220 + 3000 fits 5000");
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 1), (3220, 3220));
        send(f.resume(&s, &c, 5_000, 2));
        // A 5xx with usage: 60 completion tokens, 1800 more, and no room for a third attempt
        // (2020 + 3000 > 5000).
        let body = r#"{"error":{"message":"late"},"usage":{"prompt_tokens":0,"completion_tokens":60}}"#;
        let (r, h) = read(500, "application/json", body);
        assert!(matches!(f.on_response(&s, &c, r, &h, 5_001, 0), Action::Finish(Some(_))));
        let charged: u64 = f
            .events
            .iter()
            .filter_map(|e| if let Event::BudgetCharged { micro, .. } = e { Some(*micro) } else { None })
            .sum();
        assert_eq!(charged, 220 + 1800, "each attempt's bill counted as charged");
        assert_eq!(crate::core::limits::budget::spent(&s, "t", 5_002), (2020, 2020), "what was billed, within $0.005");
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

    /// A fleet of 4 nodes, gpt-4.1 at $10/$30 per Mtok with a request bucket (kept by its owner
    /// node), and tenant `t` with `usd_per_day`.
    fn fleet_tenant_config(usd_per_day: f64) -> Config {
        config(&format!(
            r#"{{"fleet":{{"cluster":"owners","nodes":4}},
                "models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30,"requests_per_minute":600}}}},
                "tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":{usd_per_day}}}}}}}"#,
            "a".repeat(64)
        ))
    }

    #[test]
    fn only_a_tenant_with_a_dollar_budget_gives_up_the_routers_stream_retries() {
        let retries = |tenant: &str| {
            let c = tenant_config(tenant, "");
            let mut f = tenant_flight(&c);
            send(f.resume(&MemStore::new(), &c, 0, 1));
            (f.stream_retries(&c), c.retry.max_attempts - 1)
        };
        let (budgeted, _) = retries(r#","usd_per_day":1"#);
        assert_eq!(budgeted, 0);
        let (limited, all) = retries(r#","requests_per_minute":100"#);
        assert_eq!(limited, all, "buckets alone hold no dollars");
        assert!(all > 0);
    }

    #[test]
    fn in_a_fleet_a_hold_on_the_tenants_owner_covers_one_attempt_that_may_have_billed() {
        let c = fleet_tenant_config(1.0);
        let (here, owner) = (MemStore::new(), MemStore::new());
        let mut f = tenant_flight(&c);
        for now in [0, 1] {
            let Action::Ask { op, .. } = f.resume(&here, &c, now, 1) else { panic!("asks an owner") };
            f.on_verdict(Some(fleet::serve(&owner, &c, &op.to_json(), now).unwrap()));
        }
        assert_eq!(send(f.resume(&here, &c, 1, 1)), "gpt-4.1");
        // No answer: charged its worst case, which is all the owner reserved. The hold there
        // cannot grow from here, so no second attempt is sent.
        assert!(matches!(f.on_response(&here, &c, None, &ProviderHints::default(), 2, 0), Action::Finish(None)));
        let settled = f.outbox.iter().find_map(|op| if let Op::TenantSettle(s) = op { Some(s.micro) } else { None });
        assert_eq!(settled, Some(3000), "one worst case");
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
        assert_eq!(a, Action::Sleep { until_ms: crate::core::limits::CONTENTION_RETRY_MS }, "held, not sent uncharged");
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
        let l = Limits::of(c.models.get("m").unwrap(), &c.rate_limit);
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
        let default = Limits::of(c.models.get("default").unwrap(), &c.rate_limit);
        assert_eq!(limits::peek(&s, "default", &default, 0).line.len(), 1, "one place for both fallbacks");
        other.on_response(&s, &c, None, &ProviderHints::default(), 1, 0);
        assert_eq!(send(f.resume(&s, &c, 2, 3)), "deepseek-v3");
        let b = limits::peek(&s, "default", &default, 2);
        assert_eq!((b.in_flight.len(), b.line.len()), (1, 0), "the slot it took is still held");
        let gpt = Limits::of(c.models.get("gpt-4.1").unwrap(), &c.rate_limit);
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
        let l = Limits::of(c.models.get("m").unwrap(), &c.rate_limit);
        assert_eq!(limits::peek(&s, "m", &l, 0).tokens, 900.0);
        f.on_response(&s, &c, status(200), &hints(200), 0, 0);
        assert_eq!(limits::peek(&s, "m", &l, 0).tokens, 988.0, "charged 12 real tokens, not 100");
    }
}
