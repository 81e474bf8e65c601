//! A leader's whole life as one machine, sans-IO and the same on every host: from the call
//! the engine handed it (`engine::Step::Call`) to its answer shared with the flight's
//! waiters and its spend settled. It looks for a paraphrase first (`look`: the question's
//! embedding, admitted and charged at the limits' door), then flies (`Flight`: attempts,
//! retries, failover, owners' verdicts, sleeps), then ends: the answer stored and handed
//! to the waiters, the question learned by the semantic index.
//!
//! The shell carries out each `Do` and hands back what came of it (`on_embedding`,
//! `on_response`, `on_stream_end`, `on_verdict`, `on_timer`). After each step it drains
//! `events` (its counters) and `outbox` (settlements for owner nodes, sent without
//! waiting). `spent` is what the leader's request spent, for its access-log line.

use super::look::{self, Answer, Begun, Look, Outcome};
use super::tee::{StreamEnd, StreamLabel};
use super::{Action, Flight};
use crate::core::api::event::Event;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::key::Key;
use crate::core::api::response::Response;
use crate::core::cache::Fresh;
use crate::core::coalesce::engine::{Call, Ended, Engine};
use crate::core::config::Config;
use crate::core::limits::fleet::{Op, Verdict};
use crate::core::observe::log_fields::{Served, Spent};
use crate::core::semantic::{self, Learned};
use crate::core::store::CasStore;
use crate::core::upstream::Outbound;
use std::rc::Rc;

/// What the shell does next for a leader.
#[derive(Debug)]
pub enum Do {
    /// POST `body` to HolySheep's `/v1/embeddings` with the operator's key within
    /// `timeout_ms`, then `on_embedding`.
    Embed { body: Vec<u8>, timeout_ms: u64 },
    /// Call HolySheep for `model`: `Outbound::body_for(model)` with `Outbound::headers`,
    /// its answer to `on_response`; a stream along the route (`Flight::route_headers`),
    /// teed (`tee::StreamLabel::answer`), its end to `on_stream_end`.
    Send { model: String, timeout_ms: u64 },
    /// Ask the owner node of `bucket` to admit the call, then `on_verdict`.
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
    /// Settlements for owner nodes, sent without waiting.
    pub outbox: Vec<Op>,
}

impl Leader {
    /// A leader's first step. `keyed`: the operator's key is there to pay for an embedding.
    pub fn start<S: CasStore>(
        engine: &Engine<'_, S>,
        call: Call,
        outbound: Rc<Outbound>,
        keyed: bool,
        (now_ms, nonce): (u64, u64),
    ) -> (Leader, Do) {
        let begun = look::begin(engine.store, engine.config, call, &outbound, keyed, now_ms);
        let stage = Stage::Over(match &begun {
            Begun::Embed(look, _) => look.call.clone(),
            Begun::Go(call) => call.clone(),
        });
        let mut leader =
            Leader { outbound, stage, learned: None, spent: Spent::default(), events: Vec::new(), outbox: Vec::new() };
        let next = match begun {
            Begun::Embed(look, body) => {
                leader.stage = Stage::Looking(look);
                Do::Embed { body, timeout_ms: engine.config.semantic.timeout_ms }
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
    /// once it flies. `keyed`: its calls carry the operator's key.
    pub fn stream_label(&self, config: &Config, keyed: bool) -> Option<StreamLabel> {
        let flight = self.flight()?;
        let out = &self.outbound;
        Some(StreamLabel {
            cache: flight.call.label,
            key: flight.call.key.hex().to_owned(),
            model: flight.model().to_owned(),
            include_usage: out.include_usage,
            sent: out.sent(keyed),
            tenant: out.tenant.clone(),
            fresh_s: flight.call.store.then_some(config.cache.ttl_seconds),
            signer: config.signer(out.endpoint, out.tenant.as_deref()),
        })
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
            Action::Send { model, timeout_ms } => Do::Send { model, timeout_ms },
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
        let (mut leader, next) = Leader::start(&engine, call, outbound, true, (1_000, 7));
        let Do::Send { model, .. } = next else { panic!("no semantic tier: it calls at once: {next:?}") };
        assert_eq!(model, "gpt-4.1");
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
        let (mut leader, next) = Leader::start(&engine, call, outbound, true, (1_000, 7));
        assert!(matches!(next, Do::Send { .. }), "{next:?}");
        let label = leader.stream_label(&config, true).expect("a flying leader has a label");
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
        let (mut unkeyed, next) = Leader::start(&engine, call.clone(), outbound.clone(), false, (1_000, 7));
        assert!(matches!(next, Do::Send { .. }), "without the operator's key, no look: {next:?}");
        assert!(unkeyed.events.iter().all(|e| !matches!(e, Event::Embedded { .. })));
        unkeyed.events.clear();
        let (mut leader, next) = Leader::start(&engine, call, outbound, true, (1_000, 7));
        let Do::Embed { timeout_ms, .. } = next else { panic!("it looks for a paraphrase first: {next:?}") };
        assert_eq!(timeout_ms, config.semantic.timeout_ms);
        let next = leader.on_embedding(&engine, Answer::Unsent, (1_010, 8));
        assert!(matches!(next, Do::Send { .. }), "{next:?}");
        let embedded = Event::Embedded { model: "gpt-4.1".into(), sent: false, tokens: None, near_miss: false };
        assert!(leader.events.contains(&embedded), "{:?}", leader.events);
        assert_eq!(leader.spent.cost_micro_usd, 0, "an embedding that never left costs nothing");
    }
}
