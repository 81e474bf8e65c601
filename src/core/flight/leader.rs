//! A leader's whole life as one machine, sans-IO and the same on every host: from the call
//! the engine handed it (`engine::Step::Call`) to its answer shared with the flight's
//! waiters and its spend settled. It looks for a paraphrase first (`look`: the question's
//! embedding, admitted and charged at the limits' door), then flies (`Flight`: attempts,
//! retries, failover, owners' verdicts, sleeps), then ends: the answer stored and handed
//! to the waiters, the question learned by the semantic index.
//!
//! The shell carries out each `Do` (each call is ready to send: `api::call::HttpCall`) and
//! hands back what came of it (`on_embedding`,
//! `on_response`, `on_stream_end`, `on_verdict`, `on_timer`). After each step it drains
//! `events` (its counters) and `outbox` (settlements for owner nodes, sent without
//! waiting). `spent` is what the leader's request spent, for its access-log line.

use super::look::{self, Answer, Begun, Look, Outcome};
use super::tee::{StreamEnd, StreamLabel};
use super::{Action, Flight};
use crate::core::api::call::HttpCall;
use crate::core::api::event::Event;
use crate::core::api::head::HeadEdit;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::key::Key;
use crate::core::api::response::Response;
use crate::core::cache::Fresh;
use crate::core::coalesce::engine::{Call, Ended, Engine};
use crate::core::config::environment::Environment;
use crate::core::config::Config;
use crate::core::limits::fleet::{Op, Verdict};
use crate::core::observe::log_fields::{Served, Spent};
use crate::core::semantic::{self, Learned, EMBEDDINGS_PATH};
use crate::core::store::CasStore;
use crate::core::upstream::{self, Outbound, Sent};
use std::rc::Rc;

/// What the shell does next for a leader.
#[derive(Debug)]
pub enum Do {
    /// Make the call (the question's embedding, paid with the operator's key), reading at
    /// most `semantic::MAX_EMBEDDING_BYTES` of its answer, then `on_embedding`.
    Embed(HttpCall),
    /// Call HolySheep for `model`: make `call`, its answer to `on_response`. A host that
    /// streams along its route sends a stream there instead (`Leader::route_edit`), teed
    /// (`tee::StreamLabel::answer`), its end to `on_stream_end`.
    Send { model: String, call: HttpCall },
    /// Ask the owner node of `bucket` to admit the call: a host with a fleet makes
    /// `Leader::ask`'s call, then `on_verdict` (a host without one, or without the fleet's
    /// secret, hands back `None` at once).
    Ask { bucket: String, op: Op, timeout_ms: u64 },
    /// Come back (`on_timer`) at this time.
    Sleep { until_ms: u64 },
    /// The leader is done.
    Over(Over),
}

/// A leader's end.
#[derive(Debug)]
pub struct Over {
    /// How the flight ended: the leader's reply (already sent when it streamed), whether
    /// storing its answer evicted another. `None`: a stream that broke off, its lease given
    /// up.
    pub ended: Option<Ended>,
    /// The flight's key and whether anyone waited on it (wake the waiters; on every worker
    /// when watched). `None`: it held no lease.
    pub wake: Option<(Key, bool)>,
    /// What the leader's request spent and waited, for its access-log line.
    pub served: Served,
}

#[derive(Debug)]
enum Stage {
    Looking(Look),
    Flying(Box<Flight>),
    Over(Call),
}

/// A leader, wherever it stands.
#[derive(Debug)]
pub struct Leader {
    pub outbound: Rc<Outbound>,
    stage: Stage,
    /// Its question's vector, which joins the semantic index when its answer is stored.
    learned: Option<Learned>,
    /// What its request spent so far.
    pub spent: Spent,
    /// What happened since the shell last drained them.
    pub events: Vec<Event>,
    /// Settlements for owner nodes, sent without waiting (`Op::settlement`).
    pub outbox: Vec<Op>,
    /// The operator's key and the fleet's secret its calls carry.
    env: Rc<Environment>,
}

impl Leader {
    /// A leader's first step, its calls made with the secrets of `env` (without the
    /// operator's key, no embedding is paid for).
    pub fn start<S: CasStore>(
        engine: &Engine<'_, S>,
        call: Call,
        outbound: Rc<Outbound>,
        env: Rc<Environment>,
        (now_ms, nonce): (u64, u64),
    ) -> (Leader, Do) {
        let keyed = env.bearer.is_some();
        let begun = look::begin(engine.store, engine.config, call, &outbound, keyed, now_ms);
        let stage = Stage::Over(match &begun {
            Begun::Embed(look, _) => look.call.clone(),
            Begun::Go(call) => call.clone(),
        });
        let (learned, spent, events, outbox) = (None, Spent::default(), Vec::new(), Vec::new());
        let mut leader = Leader { outbound, stage, learned, spent, events, outbox, env };
        let next = match begun {
            Begun::Embed(look, body) => {
                leader.stage = Stage::Looking(look);
                let config = engine.config;
                let to = (config.upstream.cluster.as_str(), config.upstream.authority.as_str());
                let headers = upstream::embedding_headers(leader.env.bearer.as_deref().unwrap_or_default());
                Do::Embed(HttpCall::post(to, EMBEDDINGS_PATH, headers, body, config.semantic.timeout_ms))
            }
            Begun::Go(call) => leader.fly(engine, call, (now_ms, nonce)),
        };
        (leader, next)
    }

    /// The call the leader leads (for its lease renewals).
    pub fn call(&self) -> &Call {
        match &self.stage {
            Stage::Looking(look) => &look.call,
            Stage::Flying(flight) => &flight.call,
            Stage::Over(call) => call,
        }
    }

    /// What its stream's answer carries and how it is read (`tee::StreamLabel::answer`),
    /// once it flies.
    pub fn stream_label(&self, config: &Config) -> Option<StreamLabel> {
        let flight = self.flight()?;
        let out = &self.outbound;
        Some(StreamLabel {
            cache: flight.call.label,
            key: flight.call.key.hex().to_owned(),
            model: flight.model().to_owned(),
            include_usage: out.include_usage,
            sent: self.sent(),
            tenant: out.tenant.clone(),
            fresh_s: flight.call.store.then_some(config.cache.ttl_seconds),
            signer: config.signer(out.endpoint, out.tenant.as_deref()),
        })
    }

    /// The call of a `Do::Ask` to the owner of `bucket`, with the fleet's secret (`None`:
    /// this node has none, and so no verdict).
    pub fn ask(&self, config: &Config, bucket: &str, op: &Op, timeout_ms: u64) -> Option<HttpCall> {
        let secret = self.env.fleet_secret.as_deref()?;
        Some(op.call(config, secret, bucket, timeout_ms))
    }

    /// A stream's `call` as it goes along the host's route in place of the client's request,
    /// whose headers are `head`: every header of the client's but the pseudo-headers and
    /// `x-request-id` taken out, then the call's own set with its body's length, the
    /// scheme the client came by (the route needs it) and the router's retry terms for the
    /// flight (`Flight::route_headers`). `None` before it flies.
    pub fn route_edit(&self, config: &Config, call: &HttpCall, head: &[(String, String)]) -> Option<HeadEdit> {
        let flight = self.flight()?;
        let value = |name: &str| head.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        let scheme = value(":scheme").or_else(|| value(headers::FORWARDED_PROTO)).unwrap_or_else(|| "http".into());
        let stays = |n: &str| n.starts_with(':') || n == headers::REQUEST_ID;
        let remove = head.iter().map(|(n, _)| n.clone()).filter(|n| !stays(n)).collect();
        let mut set: Vec<(String, String)> =
            call.headers.iter().filter(|(n, _)| *n != ":method").map(|(n, v)| ((*n).to_owned(), v.clone())).collect();
        set.push((headers::FORWARDED_PROTO.to_owned(), scheme));
        set.push((headers::CONTENT_LENGTH.to_owned(), call.body.len().to_string()));
        set.extend(flight.route_headers(config).into_iter().map(|(n, v)| (n.to_owned(), v)));
        Some(HeadEdit { remove, set })
    }

    /// How its calls to HolySheep are made: with the operator's key it holds, or the
    /// client's own; what its answers may pass on follows from that (`upstream::response`).
    pub fn sent(&self) -> Sent {
        self.outbound.sent(self.env.bearer.is_some())
    }

    /// Its flight, once it flies.
    pub fn flight(&self) -> Option<&Flight> {
        match &self.stage {
            Stage::Flying(flight) => Some(flight),
            _ => None,
        }
    }

    /// The embedding answered (or failed): charged, then the index is searched; a close
    /// paraphrase's answer ends the leader, anything else lets it fly.
    pub fn on_embedding<S: CasStore>(
        &mut self,
        engine: &Engine<'_, S>,
        answer: Answer<'_>,
        (now_ms, nonce): (u64, u64),
    ) -> Do {
        let over = Stage::Over(self.call().clone());
        let Stage::Looking(look) = std::mem::replace(&mut self.stage, over) else {
            return Do::Over(self.over(engine, None, now_ms));
        };
        let key = look.call.key.clone();
        let looked = look.answered(engine, answer, now_ms);
        self.outbox.extend(looked.settle);
        self.spent.cost_micro_usd += looked.cost_micro_usd;
        self.events.push(Event::Embedded {
            model: self.outbound.model.clone(),
            sent: looked.sent,
            tokens: looked.tokens,
            near_miss: looked.near_miss,
        });
        match looked.outcome {
            Outcome::Go(call, learned) => {
                self.learned = learned;
                self.fly(engine, call, (now_ms, nonce))
            }
            Outcome::Answered(ended) => {
                let wake = Some((key, ended.watched));
                Do::Over(Over { ended: Some(ended), wake, served: Served { spent: self.spent, wait_ms: 0 } })
            }
        }
    }

    /// HolySheep's answer to an attempt (`None`: none came), with what it said of its
    /// limits.
    pub fn on_response<S: CasStore>(
        &mut self,
        engine: &Engine<'_, S>,
        outcome: Option<Response>,
        hints: &ProviderHints,
        (now_ms, nonce): (u64, u64),
    ) -> Do {
        let Stage::Flying(flight) = &mut self.stage else { return Do::Over(self.over(engine, None, now_ms)) };
        let action = flight.on_response(engine.store, engine.config, outcome, hints, now_ms, nonce);
        self.act(engine, action, now_ms)
    }

    /// An owner's verdict (`None`: none came in time).
    pub fn on_verdict<S: CasStore>(
        &mut self,
        engine: &Engine<'_, S>,
        verdict: Option<Verdict>,
        (now_ms, nonce): (u64, u64),
    ) -> Do {
        if let Stage::Flying(flight) = &mut self.stage {
            flight.on_verdict(verdict);
        }
        self.on_timer(engine, (now_ms, nonce))
    }

    /// The time a `Do::Sleep` named has come (or an ask was answered).
    pub fn on_timer<S: CasStore>(&mut self, engine: &Engine<'_, S>, (now_ms, nonce): (u64, u64)) -> Do {
        let Stage::Flying(flight) = &mut self.stage else { return Do::Over(self.over(engine, None, now_ms)) };
        let action = flight.resume(engine.store, engine.config, now_ms, nonce);
        self.act(engine, action, now_ms)
    }

    /// The leader's stream ended (its client already has what came): charged what it
    /// was billed; a whole answer is stored and handed to the waiters, and after a stream
    /// that broke off the lease is given up so that a waiter leads anew.
    pub fn on_stream_end<S: CasStore>(&mut self, engine: &Engine<'_, S>, end: StreamEnd, now_ms: u64) -> Over {
        let outcome = end.outcome(self.outbound.prompt_estimate());
        let Stage::Flying(flight) = &mut self.stage else { return self.over(engine, None, now_ms) };
        flight.on_stream_end(engine.store, engine.config, &outcome, &end.hints, now_ms);
        let (model, call) = (flight.model().to_owned(), flight.call.clone());
        self.take_flights(engine);
        self.stage = Stage::Over(call.clone());
        let served = Served::by_flight(self.spent);
        match end.outcome {
            Some(outcome) => {
                let outcome = outcome.with_header(headers::MODEL, model);
                let ended = self.end(engine, &call, Some(outcome), now_ms);
                let wake = call.lease.as_ref().map(|l| (l.key.clone(), ended.watched));
                Over { ended: Some(ended), wake, served }
            }
            None => {
                let watched = engine.abandon(&call, now_ms);
                Over { ended: None, wake: call.lease.as_ref().map(|l| (l.key.clone(), watched)), served }
            }
        }
    }

    fn fly<S: CasStore>(&mut self, engine: &Engine<'_, S>, call: Call, (now_ms, nonce): (u64, u64)) -> Do {
        let mut flight = Flight::new(engine.config, call, &self.outbound);
        let action = flight.resume(engine.store, engine.config, now_ms, nonce);
        self.stage = Stage::Flying(Box::new(flight));
        self.act(engine, action, now_ms)
    }

    /// What a flight's action asks of the shell, after taking what it left.
    fn act<S: CasStore>(&mut self, engine: &Engine<'_, S>, action: Action, now_ms: u64) -> Do {
        self.take_flights(engine);
        match action {
            Action::Send { model, timeout_ms } => {
                let call = self.outbound.call(engine.config, self.env.bearer.as_deref(), &model, timeout_ms);
                Do::Send { model, call }
            }
            Action::Ask { bucket, op, timeout_ms } => Do::Ask { bucket, op, timeout_ms },
            Action::Sleep { until_ms } => Do::Sleep { until_ms },
            Action::Finish(outcome) => Do::Over(self.over(engine, outcome, now_ms)),
        }
    }

    /// Takes the events and settlements the flight left: added to what the request spent.
    fn take_flights<S: CasStore>(&mut self, engine: &Engine<'_, S>) {
        let Stage::Flying(flight) = &mut self.stage else { return };
        let config = engine.config;
        self.spent.add(&flight.events, |m, u| config.cost_micro_usd(m, u));
        self.events.append(&mut flight.events);
        self.outbox.append(&mut flight.outbox);
    }

    /// The flight ended with `outcome`: its answer stored and handed to its waiters.
    fn over<S: CasStore>(&mut self, engine: &Engine<'_, S>, outcome: Option<Response>, now_ms: u64) -> Over {
        let call = self.call().clone();
        self.stage = Stage::Over(call.clone());
        // A leader that never called (refused for its bucket, perhaps after waiting in
        // line) waited all its time.
        let served = match self.spent.attempts {
            0 => Served { spent: self.spent, wait_ms: now_ms.saturating_sub(call.started_ms) },
            _ => Served::by_flight(self.spent),
        };
        let ended = self.end(engine, &call, outcome, now_ms);
        let wake = call.lease.is_some().then(|| (call.key.clone(), ended.watched));
        Over { ended: Some(ended), wake, served }
    }

    fn end<S: CasStore>(&self, engine: &Engine<'_, S>, call: &Call, outcome: Option<Response>, now_ms: u64) -> Ended {
        let ended = engine.end_flight(call, outcome, now_ms, Some(Fresh::of(engine.config, now_ms)));
        // A question whose answer is stored joins the semantic index.
        let stored = ended.reply.stored_answer();
        semantic::keep(engine.store, engine.config, self.learned.as_ref(), stored, &call.key, now_ms);
        ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::api::reply::CacheStatus;
    use crate::core::coalesce::engine::Step;
    use crate::core::intake::{decide, Decision, Head};
    use crate::core::store::MemStore;

    const BODY: &[u8] = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"temperature":0}"#;

    /// A leader's call and its outbound, and a waiter's step on the same request.
    fn lead(engine: &Engine<'_, MemStore>, body: &[u8]) -> (Call, Rc<Outbound>) {
        let head = Head { authorization: Some("Bearer alice".into()), ..Head::default() };
        let Decision { step, outbound, .. } = decide(engine, head, body, None, 1_000, 1).unwrap();
        let Step::Call(call) = step else { panic!("the first request leads: {step:?}") };
        (call, Rc::new(outbound))
    }

    /// A node's secrets, with the operator's key or without.
    fn env(keyed: bool) -> Rc<Environment> {
        let bearer = keyed.then(|| "Bearer sk-operator".to_owned());
        Rc::new(Environment { bearer, fleet_secret: Some("fleet".into()), fleet_secret_accepted: None })
    }

    fn answer(usage: (u64, u64)) -> Response {
        let body = format!(
            r#"{{"id":"c","object":"chat.completion","model":"gpt-4.1","choices":[],"usage":{{"prompt_tokens":{},"completion_tokens":{}}}}}"#,
            usage.0, usage.1
        );
        Response::json(200, body.into_bytes())
    }

    #[test]
    fn a_leader_calls_then_shares_its_answer_and_says_whom_to_wake() {
        let (store, config) = (MemStore::new(), Config::default());
        let engine = Engine { store: &store, config: &config };
        let (call, outbound) = lead(&engine, BODY);
        let (mut leader, next) = Leader::start(&engine, call, outbound, env(true), (1_000, 7));
        let Do::Send { model, call } = next else { panic!("no semantic tier: it calls at once: {next:?}") };
        assert_eq!(model, "gpt-4.1");
        // The call is ready to send: where it goes and every header it carries.
        assert_eq!((call.cluster.as_str(), call.timeout_ms), ("holysheep", config.upstream.timeout_ms));
        assert_eq!(call.header(":path"), Some("/v1/chat/completions"));
        assert_eq!(call.header(":authority"), Some(config.upstream.authority.as_str()));
        assert_eq!(call.header("authorization"), Some("Bearer sk-operator"), "the operator's key, not alice's");
        assert_eq!(call.header("accept"), Some("application/json"));
        let Do::Over(over) = leader.on_response(&engine, Some(answer((12, 5))), &ProviderHints::default(), (1_050, 8))
        else {
            panic!("one answer ends it")
        };
        let ended = over.ended.expect("ended with the answer");
        assert_eq!(ended.reply.cache, Some(CacheStatus::Miss));
        let (key, _) = over.wake.expect("it held the flight's lease: its waiters are woken");
        assert_eq!(&key, &leader.call().key);
        assert_eq!(over.served.spent.attempts, 1);
        assert!(leader.events.contains(&Event::UpstreamCall { model: "gpt-4.1".into() }));
        // Its answer is stored: the next identical request is a HIT.
        let head = Head { authorization: Some("Bearer alice".into()), ..Head::default() };
        let hit = decide(&engine, head, BODY, None, 1_060, 9).unwrap();
        assert!(matches!(&hit.step, Step::Reply(r) if r.cache == Some(CacheStatus::Hit)), "{:?}", hit.step);
    }

    #[test]
    fn a_stream_that_broke_off_gives_its_lease_up_and_stores_nothing() {
        let (store, config) = (MemStore::new(), Config::default());
        let engine = Engine { store: &store, config: &config };
        let body = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
        let (call, outbound) = lead(&engine, body);
        let (mut leader, next) = Leader::start(&engine, call, outbound, env(true), (1_000, 7));
        assert!(matches!(next, Do::Send { .. }), "{next:?}");
        let Do::Send { call, .. } = &next else { unreachable!() };
        assert_eq!(call.header("accept"), Some("text/event-stream"), "a stream asks for events");
        // Along the route: the client's headers go but the pseudo-headers and its id, the
        // call's own come with the scheme, the body's length and the router's terms.
        let client =
            [(":scheme", "https"), (":path", "/v1//chat/completions"), ("x-request-id", "r1"), ("cookie", "c")];
        let client: Vec<(String, String)> = client.iter().map(|(n, v)| ((*n).into(), (*v).into())).collect();
        let edit = leader.route_edit(&config, call, &client).expect("it flies");
        assert_eq!(edit.remove, ["cookie"]);
        let set = |name: &str| edit.set.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        assert_eq!(set(":path"), Some("/v1/chat/completions"));
        assert_eq!(set("x-forwarded-proto"), Some("https"));
        assert_eq!(set("content-length"), Some(call.body.len().to_string().as_str()));
        assert_eq!(set("authorization"), Some("Bearer sk-operator"));
        assert!(set("x-envoy-max-retries").is_some(), "{:?}", edit.set);
        assert_eq!(set(":method"), None, "the method stays the client's POST");
        let label = leader.stream_label(&config).expect("a flying leader has a label");
        assert_eq!((label.cache, label.model.as_str()), (CacheStatus::Miss, "gpt-4.1"));
        let over = leader.on_stream_end(&engine, StreamEnd { status: Some(200), ..StreamEnd::broken() }, 1_100);
        assert!(over.ended.is_none(), "nothing to share");
        assert!(over.wake.is_some(), "its waiters look again, and one leads anew");
        let head = Head { authorization: Some("Bearer alice".into()), ..Head::default() };
        let next = decide(&engine, head, body, None, 1_110, 9).unwrap();
        assert!(matches!(next.step, Step::Call(_)), "the lease was given up: {:?}", next.step);
    }

    #[test]
    fn a_look_whose_embedding_never_left_flies_and_is_counted() {
        let store = MemStore::new();
        let config = Config::parse(br#"{"semantic":{"enabled":true}}"#).unwrap();
        let engine = Engine { store: &store, config: &config };
        let (call, outbound) = lead(&engine, BODY);
        let (mut unkeyed, next) = Leader::start(&engine, call.clone(), outbound.clone(), env(false), (1_000, 7));
        assert!(matches!(next, Do::Send { .. }), "without the operator's key, no look: {next:?}");
        assert!(unkeyed.events.iter().all(|e| !matches!(e, Event::Embedded { .. })));
        unkeyed.events.clear();
        let (mut leader, next) = Leader::start(&engine, call, outbound, env(true), (1_000, 7));
        let Do::Embed(embed) = next else { panic!("it looks for a paraphrase first: {next:?}") };
        assert_eq!(embed.timeout_ms, config.semantic.timeout_ms);
        assert_eq!(embed.header(":path"), Some("/v1/embeddings"));
        assert_eq!(embed.header("authorization"), Some("Bearer sk-operator"), "paid with the operator's key");
        let next = leader.on_embedding(&engine, Answer::Unsent, (1_010, 8));
        assert!(matches!(next, Do::Send { .. }), "{next:?}");
        let embedded = Event::Embedded { model: "gpt-4.1".into(), sent: false, tokens: None, near_miss: false };
        assert!(leader.events.contains(&embedded), "{:?}", leader.events);
        assert_eq!(leader.spent.cost_micro_usd, 0, "an embedding that never left costs nothing");
    }
}
