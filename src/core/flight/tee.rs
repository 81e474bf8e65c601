//! The tee of a leader's answer as it streams back: HolySheep's answer passes to the
//! leader's client while it is reassembled (events) or gathered (anything else) for the
//! cache and the flight's waiters. The head of that answer is decided here too: which of
//! its headers pass, which the edge sets, and how its body is read (`StreamLabel::answer`,
//! `Hop::answer`). A shell applies the `HeadEdit` and feeds the body through `Tee::pass`.

use super::StreamOutcome;
use crate::core::api::error::ApiError;
use crate::core::api::head::HeadEdit;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::key::Key;
use crate::core::api::objects::Signer;
use crate::core::api::reply::{stream_head, CacheStatus};
use crate::core::api::response::Response;
use crate::core::api::usage::{Billed, Usage};
use crate::core::cache::edge::{self, Origin};
use crate::core::cache::Fresh;
use crate::core::coalesce::engine::{Call, Ended, Engine};
use crate::core::config::Config;
use crate::core::request;
use crate::core::semantic;
use crate::core::store::CasStore;
use crate::core::stream::Reassembler;
use crate::core::upstream::{self, Outbound, Sent};
use std::rc::Rc;

/// Bytes of a streamed call's error answer kept for its waiters.
const ERROR_BODY_LIMIT: usize = 65_536;

/// What the tee keeps of a forwarded stream's answer.
pub struct Tee {
    /// Server-sent events (a 200): reassembled.
    events: Option<Events>,
    /// Anything else: the answer as its waiters get it, its body gathered as it passes
    /// (up to `limit`; a 200 cut there is no answer to share).
    other: Response,
    limit: usize,
    cut: bool,
    /// The client gets the edge's own error (`other`) in place of HolySheep's body (see
    /// `upstream::refused`) ...
    replace: bool,
    /// ... which has been written; HolySheep's own body and content type meanwhile (up to
    /// `limit`), for what it says was billed.
    written: bool,
    raw: Vec<u8>,
    content_type: String,
    /// HolySheep's status (`None`: Envoy's own answer, a timeout or a reset: not
    /// HolySheep's), the attempts Envoy's router made, and what HolySheep's answer said of
    /// its limits.
    status: Option<u16>,
    attempts: u64,
    hints: ProviderHints,
}

impl Tee {
    /// `events` for an event stream; `other`, the answer as far as its headers, for anything
    /// else, whose body is `replace`d by `other`'s when the edge refuses it.
    pub fn new(
        events: Option<Reassembler>,
        (other, content_type): (Response, String),
        replace: bool,
        (status, attempts): (Option<u16>, u64),
        hints: ProviderHints,
    ) -> Tee {
        Tee {
            events: events.map(Events::new),
            other,
            limit: ERROR_BODY_LIMIT,
            cut: false,
            replace,
            written: false,
            raw: Vec::new(),
            content_type,
            status,
            attempts,
            hints,
        }
    }

    /// The tee of a forward node's hop: the owner's answer passes untouched, and a body
    /// that is not events is gathered up to `limit` bytes (the largest answer kept).
    pub fn hop(events: Option<Reassembler>, other: Response, limit: usize) -> Tee {
        let (status, content_type) = (Some(other.status), other.content_type.clone());
        let tee = Tee::new(events, (other, content_type), false, (status, 1), ProviderHints::default());
        Tee { limit, ..tee }
    }

    pub fn end(mut self, complete: bool) -> StreamEnd {
        // An answer that is not events says what it was billed by its body: HolySheep's own
        // JSON error nothing, its `usage` that, anything else (cut, or not HolySheep's) its
        // worst case.
        if self.events.is_none() && !self.cut {
            let body = if self.replace { &self.raw } else { &self.other.body };
            let billed = Billed::of_answer(self.status.unwrap_or(0), &self.content_type, body);
            // Envoy's own reply (no upstream answered: no status of HolySheep's) may say the
            // request never left; its head said so when it was the circuit breaker's.
            let overloaded = self.hints.billed == Billed::Unsent;
            let envoys = |s| Billed::of_envoys_answer(s, overloaded, &self.content_type, body) == Billed::Unsent;
            self.hints.billed = match self.status {
                None if !matches!(billed, Billed::Known(_)) && envoys(self.other.status) => Billed::Unsent,
                _ => billed,
            };
        }
        if let Some(events) = self.events {
            return events.end(complete, (self.status, self.attempts), self.hints);
        }
        let outcome = match complete {
            false => None,
            true if self.cut && self.other.status == 200 => None,
            true => Some(self.other),
        };
        StreamEnd {
            outcome,
            usage: None,
            streamed_tokens: 0,
            status: self.status,
            attempts: self.attempts,
            hints: self.hints,
        }
    }

    /// The bytes the client gets for this chunk of HolySheep's answer (`None`: as they are).
    pub fn pass(&mut self, chunk: &[u8], end_of_stream: bool) -> Option<Vec<u8>> {
        if let Some(events) = &mut self.events {
            return events.pass(chunk, end_of_stream);
        }
        let kept = if self.replace { &mut self.raw } else { &mut self.other.body };
        let room = self.limit.saturating_sub(kept.len());
        self.cut |= chunk.len() > room;
        kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if self.replace {
            let first = !std::mem::replace(&mut self.written, true);
            return Some(if first { self.other.body.clone() } else { Vec::new() });
        }
        None
    }
}

/// A leader's event stream as it passes to its client: reassembled, and from `[DONE]` on
/// held until the stream's end, where the answer is shared first: a client that stops
/// reading at `[DONE]` (the SDKs do) sends its next request only when that is a HIT.
pub struct Events {
    reassembler: Reassembler,
    held: Vec<u8>,
}

impl Events {
    pub fn new(reassembler: Reassembler) -> Events {
        Events { reassembler, held: Vec::new() }
    }

    /// The bytes the client gets for this chunk (`None`: as they are).
    pub fn pass(&mut self, chunk: &[u8], end_of_stream: bool) -> Option<Vec<u8>> {
        let mut out = self.reassembler.push(chunk);
        if end_of_stream {
            out.extend(self.reassembler.flush());
        }
        if self.reassembler.done() && !end_of_stream {
            self.held.append(&mut out);
            return Some(Vec::new());
        }
        if !self.held.is_empty() {
            self.held.append(&mut out);
            return Some(std::mem::take(&mut self.held));
        }
        (out != chunk).then_some(out)
    }

    /// The `usage` the stream reported so far.
    pub fn usage(&self) -> Option<Usage> {
        self.reassembler.usage()
    }

    /// How the stream ended (`complete`: its last byte came), with HolySheep's status and
    /// the attempts made, and what its head said of the limits.
    pub fn end(self, complete: bool, (status, attempts): (Option<u16>, u64), hints: ProviderHints) -> StreamEnd {
        let r = &self.reassembler;
        let outcome = if complete { r.completion() } else { None };
        StreamEnd { outcome, usage: r.usage(), streamed_tokens: r.streamed_tokens_estimate(), status, attempts, hints }
    }
}

/// How a stream forwarded along the route ended, as its tee saw it.
pub struct StreamEnd {
    /// The reassembled answer, or HolySheep's error; `None` when the stream broke off
    /// (reset, timeout, the client gone) before it finished.
    pub outcome: Option<Response>,
    pub usage: Option<Usage>,
    /// Completion tokens streamed before the end, estimated.
    pub streamed_tokens: u64,
    /// HolySheep's status (`None`: its answer's headers never came).
    pub status: Option<u16>,
    /// Attempts the host made (retries before the first byte); 0 when the request never
    /// left.
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

    /// What the flight is told of the stream (`Flight::on_stream_end`): a stream cut off
    /// may have cost its prompt (`prompt_estimate`) and what was streamed.
    pub(crate) fn outcome(&self, prompt_estimate: u64) -> StreamOutcome {
        let cut_off_tokens = prompt_estimate + self.streamed_tokens;
        StreamOutcome { status: self.status, usage: self.usage, cut_off_tokens, attempts: self.attempts }
    }
}

/// What the host knows of an answer's head beyond its headers.
#[derive(Debug, Clone, Copy, Default)]
pub struct Arrival {
    /// It came from HolySheep (not the host's own reply: a timeout, a reset, a breaker).
    pub via_upstream: bool,
    /// The attempts the host made for it.
    pub attempts: u64,
}

/// What a leader's stream forwarded along the route answers with.
pub struct StreamLabel {
    pub cache: CacheStatus,
    pub key: String,
    pub model: String,
    pub include_usage: bool,
    pub sent: Sent,
    pub tenant: Option<String>,
    /// How long a whole answer stays fresh in the cache, when it is to be stored.
    pub fresh_s: Option<u64>,
    /// Signs the ids of a Responses answer (`Config::signer`).
    pub signer: Option<Signer>,
}

/// The head of a leader's answer, as the shell passes it on.
pub struct AnswerHead {
    pub edit: HeadEdit,
    pub tee: Tee,
    /// HolySheep refused the operator's key with this status.
    pub key_refused: Option<u16>,
}

impl StreamLabel {
    /// The head and the tee of a leader's event stream for a host that reads HolySheep's
    /// 200 event stream itself and relays it (the `wasi:http` component): the content type
    /// and the edge's labels, and the events reassembled (the usage event held unless asked
    /// for, ids signed).
    pub fn relayed(&self) -> (Vec<(String, String)>, Events) {
        let mut head = vec![(headers::CONTENT_TYPE.to_owned(), headers::EVENT_STREAM.to_owned())];
        let labels = stream_head(self.cache, &self.key, &self.model, self.tenant.as_deref(), self.fresh_s);
        head.extend(labels.into_iter().map(|(n, v)| (n.to_owned(), v)));
        let events = Reassembler::of(self.sent.endpoint, self.include_usage).signing(self.signer.clone());
        (head, Events::new(events))
    }

    /// The head of the leader's answer: none of HolySheep's `x-holysheep-*` headers pass,
    /// the edge's labels go on, and a refused answer (`misrouted`, or `upstream::refused`)
    /// becomes the edge's own error with only the edge's headers, `retry-after` and
    /// `cache-control`. The body is teed: events reassembled (the usage event taken out
    /// unless asked for, ids signed), anything else gathered for the waiters.
    pub fn answer(&self, head: &[(String, String)], arrival: Arrival, misrouted: Option<ApiError>) -> AnswerHead {
        let header = |n: &str| headers::value(head, n);
        let status = headers::status(head).unwrap_or(502);
        let content_type = header(headers::CONTENT_TYPE).unwrap_or_default().to_owned();
        let sse = status == 200 && headers::is_event_stream(&content_type);
        let mut edit = HeadEdit::default();
        edit.remove.extend(head.iter().filter(|(n, _)| headers::is_edges(n)).map(|(n, _)| n.clone()));
        let refusal = misrouted.or_else(|| upstream::refused(status, &content_type, self.sent));
        // The edge's word on how long the answer is kept, never HolySheep's.
        let stored = (sse && refusal.is_none()).then_some(self.fresh_s).flatten();
        let labels = stream_head(self.cache, &self.key, &self.model, self.tenant.as_deref(), stored);
        edit.set.extend(labels.into_iter().map(|(n, v)| (n.to_owned(), v)));
        // The edge's own answer: HolySheep's age means nothing here (a MISS is new).
        edit.remove.push(headers::AGE.to_owned());
        if (sse && (!self.include_usage || self.signer.is_some())) || refusal.is_some() {
            // The usage event is taken out, ids are signed, or the body replaced: the
            // length changes.
            edit.remove.push(headers::CONTENT_LENGTH.to_owned());
        }
        let retry_after = header(headers::RETRY_AFTER).map(|v| (headers::RETRY_AFTER.to_owned(), v.to_owned()));
        let other = match &refusal {
            Some(e) => {
                // The edge's own answer: none of what came with the body it replaces.
                let kept = |n: &str| {
                    n.starts_with(':')
                        || headers::is_edges(n)
                        || n == headers::RETRY_AFTER
                        || n == headers::CACHE_CONTROL
                };
                edit.remove.extend(head.iter().filter(|(n, _)| !kept(n)).map(|(n, _)| n.clone()));
                edit.set(":status", e.status.to_string());
                edit.set(headers::CONTENT_TYPE, "application/json");
                Response::json(e.status, e.body())
            }
            None => Response { status, content_type: content_type.clone(), headers: Vec::new(), body: Vec::new() },
        };
        let key_refused = refusal.as_ref().is_some_and(|e| e.code == upstream::KEY_REFUSED).then_some(status);
        let other = Response { headers: retry_after.into_iter().collect(), ..other };
        let events = (sse && refusal.is_none())
            .then(|| Reassembler::of(self.sent.endpoint, self.include_usage).signing(self.signer.clone()));
        let mut hints = ProviderHints::from_headers(status, head);
        let holysheeps = arrival.via_upstream.then_some(status);
        // The host's own 503 for a stream its circuit breaker turned away (the tee reads the
        // rest of its own replies from their text: `Billed::of_envoys_answer`).
        if holysheeps.is_none() && header(headers::ENVOY_OVERLOADED).is_some() {
            hints.billed = Billed::Unsent;
        }
        let tee = Tee::new(events, (other, content_type), refusal.is_some(), (holysheeps, arrival.attempts), hints);
        AnswerHead { edit, tee, key_refused }
    }
}

/// A forward node's flight: its leader's request on its way to the key's owner along the
/// route, whose answer is teed for the near copy and the flight's waiters.
pub struct Hop {
    pub call: Call,
    pub outbound: Rc<Outbound>,
    /// How long the owner's answer may be kept, once its headers said (`None`: not at all).
    fresh: Option<Fresh>,
    /// The owner's headers its answer keeps for the flight's waiters (see `edge::kept`).
    kept: Vec<(String, String)>,
    /// Whether its answer is shared with the flight's waiters (`edge::shared_with_waiters`:
    /// keyed by the owner as by this node, or an error that names no key).
    shared: bool,
    /// When the owner produced its answer, and whether it was STALE: the waiters share it
    /// as of then.
    origin: Option<Origin>,
}

impl Hop {
    pub fn new(call: Call, outbound: Rc<Outbound>) -> Hop {
        Hop { call, outbound, fresh: None, kept: Vec::new(), shared: false, origin: None }
    }

    /// The request as it goes on to the key's owner node (which recomputes the key; a
    /// request of the semantic tier goes to its partition's owner instead): keyed for the
    /// route, and a stream's body asking for the usage event so that a copy of it is
    /// whole (`answer`'s tee takes the event out again for a client that did not ask).
    /// Such a body is whole and of a known length: the client's framing goes (its
    /// trailers too, which the host takes off).
    pub fn request(&self, config: &Config) -> (HeadEdit, Option<Vec<u8>>) {
        let out = &self.outbound;
        let mut edit = HeadEdit::default();
        edit.set(headers::KEY, semantic::route(config, &self.call.key, out.semantic.as_ref()));
        if !out.stream || out.include_usage {
            return (edit, None);
        }
        let body = request::for_upstream(&out.body, &out.model, out.endpoint.asks_stream_usage(), None);
        edit.remove.push(headers::TRANSFER_ENCODING.to_owned());
        edit.set(headers::CONTENT_LENGTH, body.len().to_string());
        (edit, Some(body))
    }

    /// The hop ended (`end`, from its tee); the leader's client already has its answer.
    /// The owner's answer, with the headers its sharers need, is kept as a near copy when
    /// the owner declared it storable, and handed to the flight's waiters. After a hop that
    /// broke off, or an answer the owner keyed otherwise (the leader's alone), the lease is
    /// given up: the waiters look again, and one leads anew. The flight's end, if it
    /// shared one, and the key whose waiters should look again.
    pub fn end<S: CasStore>(
        self,
        engine: &Engine<'_, S>,
        end: StreamEnd,
        now_ms: u64,
    ) -> (Option<Ended>, Option<(Key, bool)>) {
        let (ended, watched) = match end.outcome.filter(|_| self.shared) {
            Some(outcome) => {
                let outcome = Response { headers: self.kept, ..outcome };
                let ended = engine.end_relayed(&self.call, Some(outcome), now_ms, self.fresh, self.origin);
                let watched = ended.watched;
                (Some(ended), watched)
            }
            None => (None, engine.abandon(&self.call, now_ms)),
        };
        (ended, self.call.lease.map(|l| (l.key, watched)))
    }

    /// The owner's answer arrives: it passes to the client as it is (marked
    /// `x-holysheep-tier: owner`), teed for the flight's waiters and, when the owner
    /// declared it storable, the near copy. Also whether the owner keyed the request
    /// otherwise than this node (the fleet's configurations disagree).
    pub fn answer(&mut self, config: &Config, head: &[(String, String)], now: u64) -> (HeadEdit, Tee, bool) {
        let status = headers::status(head).unwrap_or(502);
        let content_type = headers::value(head, headers::CONTENT_TYPE).unwrap_or_default().to_owned();
        let mut edit = HeadEdit::default();
        edit.set(headers::TIER, edge::OWNER);
        self.fresh = edge::declared(config, &self.call.key, status, head, now);
        self.origin = Some(edge::Origin::of(head, now));
        self.kept = edge::kept(head);
        let alike = edge::keyed_alike(&self.call.key, head);
        self.shared = edge::shared_with_waiters(alike, status);
        let sse = status == 200 && headers::is_event_stream(&content_type);
        if sse && !self.outbound.include_usage {
            // The usage event is taken out: the length changes.
            edit.remove.push(headers::CONTENT_LENGTH.to_owned());
        }
        let events = sse.then(|| Reassembler::of(self.outbound.endpoint, self.outbound.include_usage));
        let other = Response { status, content_type, headers: Vec::new(), body: Vec::new() };
        (edit, Tee::hop(events, other, config.cache.max_entry_bytes), alike == Some(false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forward node's hop for `body`, the first request of it (it leads the flight).
    fn hop(engine: &Engine<'_, crate::core::store::MemStore>, body: &[u8]) -> Hop {
        use crate::core::coalesce::engine::Step;
        use crate::core::intake::{decide, Decision, Head};
        let head = Head { authorization: Some("Bearer alice".into()), ..Head::default() };
        let Decision { step, outbound, .. } = decide(engine, head, body, None, 1_000, 1).unwrap();
        let Step::Call(call) = step else { panic!("the first request leads: {step:?}") };
        Hop::new(call, Rc::new(outbound))
    }

    #[test]
    fn a_hops_answer_keyed_alike_goes_to_the_waiters_and_a_broken_one_gives_the_lease_up() {
        use crate::core::config::Role;
        use crate::core::store::MemStore;
        let store = MemStore::new();
        let config = Config { role: Role::Forward, ..Config::default() };
        let engine = Engine { store: &store, config: &config };
        let body = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"temperature":0}"#;
        let mut shared = hop(&engine, body);
        let (edit, _) = shared.request(&config);
        let key = shared.call.key.hex().to_owned();
        assert_eq!(edit.set, [("x-holysheep-key".to_owned(), key.clone())], "keyed for the owners' ring");
        let head = [(":status", "200"), ("x-holysheep-key", key.as_str()), ("content-type", "application/json")];
        let head: Vec<(String, String)> = head.iter().map(|(n, v)| ((*n).into(), (*v).into())).collect();
        let (_, _, disagreed) = shared.answer(&config, &head, 1_010);
        assert!(!disagreed);
        let whole = StreamEnd { outcome: Some(Response::json(200, b"{}".to_vec())), ..StreamEnd::broken() };
        let (ended, wake) = shared.end(&engine, whole, 1_020);
        assert!(ended.is_some(), "the owner's answer is the flight's");
        assert_eq!(wake.map(|(k, _)| k.hex().to_owned()), Some(key));
        let broken = hop(&engine, br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"yo"}]}"#);
        let (ended, wake) = broken.end(&engine, StreamEnd::broken(), 1_030);
        assert!(ended.is_none() && wake.is_some(), "nothing shared: its waiters look again");
    }

    fn label(include_usage: bool) -> StreamLabel {
        StreamLabel {
            cache: CacheStatus::Miss,
            key: "k1".into(),
            model: "gpt-4.1".into(),
            include_usage,
            sent: Sent { stream: true, operator_key: true, envoy: true, ..Sent::default() },
            tenant: Some("acme".into()),
            fresh_s: Some(60),
            signer: None,
        }
    }

    fn head(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect()
    }

    fn from_holysheep() -> Arrival {
        Arrival { via_upstream: true, attempts: 1 }
    }

    fn set<'a>(edit: &'a HeadEdit, name: &str) -> Option<&'a str> {
        edit.set.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_streamed_answer_passes_with_the_edges_labels_and_none_of_holysheeps() {
        let h = head(&[
            (":status", "200"),
            ("content-type", "text/event-stream"),
            ("content-length", "120"),
            ("x-holysheep-cache", "HIT"),
            ("age", "30"),
            ("x-request-id", "r"),
        ]);
        let AnswerHead { edit, tee: _, key_refused } = label(false).answer(&h, from_holysheep(), None);
        assert_eq!(key_refused, None);
        assert!(edit.remove.contains(&"x-holysheep-cache".to_owned()), "HolySheep's label goes");
        assert!(edit.remove.contains(&"age".to_owned()));
        assert!(edit.remove.contains(&"content-length".to_owned()), "the usage event is taken out");
        assert!(!edit.remove.contains(&"x-request-id".to_owned()), "the rest passes");
        assert_eq!(set(&edit, headers::CACHE), Some("MISS"));
        assert_eq!(set(&edit, headers::TENANT), Some("acme"));
        assert_eq!(set(&edit, headers::CACHE_CONTROL), Some("max-age=60"), "the edge's word on keeping it");
        // With the usage event asked for, the length stands.
        let edit = label(true).answer(&h, from_holysheep(), None).edit;
        assert!(!edit.remove.contains(&"content-length".to_owned()));
    }

    #[test]
    fn a_refused_operator_key_becomes_the_edges_error_with_only_its_own_headers() {
        let h = head(&[
            (":status", "401"),
            ("content-type", "application/json"),
            ("retry-after", "3"),
            ("x-leak", "part of the key"),
        ]);
        let AnswerHead { edit, mut tee, key_refused } = label(false).answer(&h, from_holysheep(), None);
        assert_eq!(key_refused, Some(401));
        assert_eq!(set(&edit, ":status"), Some("502"));
        assert_eq!(set(&edit, headers::CACHE_CONTROL), Some("no-store"), "a refusal is never kept");
        assert!(edit.remove.contains(&"x-leak".to_owned()));
        assert!(!edit.remove.contains(&"retry-after".to_owned()));
        // The body is replaced by the edge's error, once, whatever HolySheep sends.
        let first = tee.pass(br#"{"error":{"message":"bad key sk-12"}}"#, false).unwrap_or_default();
        assert!(String::from_utf8_lossy(&first).contains("renew"), "{}", String::from_utf8_lossy(&first));
        assert_eq!(tee.pass(b"more", true), Some(Vec::new()));
        let end = tee.end(true);
        assert_eq!(end.outcome.map(|r| (r.status, r.headers)), Some((502, vec![("retry-after".into(), "3".into())])));
    }

    #[test]
    fn the_hosts_own_overload_reply_says_the_call_never_left() {
        let h = head(&[(":status", "503"), ("content-type", "text/plain"), ("x-envoy-overloaded", "true")]);
        let AnswerHead { mut tee, .. } = label(false).answer(&h, Arrival { via_upstream: false, attempts: 0 }, None);
        assert_eq!(tee.pass(b"upstream connect error", true), None, "passed as it is");
        assert_eq!(tee.end(true).hints.billed, Billed::Unsent);
        let h = head(&[(":status", "503"), ("content-type", "application/json")]);
        let AnswerHead { mut tee, .. } = label(false).answer(&h, from_holysheep(), None);
        tee.pass(br#"{"error":{"message":"busy"}}"#, true);
        assert_eq!(tee.end(true).hints.billed, Billed::Nothing, "HolySheep's own error billed nothing");
    }

    #[test]
    fn events_from_done_on_wait_for_the_streams_end() {
        let mut tee = Events::new(Reassembler::of(Default::default(), true));
        let chunk = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\n";
        assert_eq!(tee.pass(chunk, false), None, "passed as it came");
        assert_eq!(tee.pass(b"data: [DONE]\n\n", false), Some(Vec::new()), "held");
        assert_eq!(tee.pass(&[], true), Some(b"data: [DONE]\n\n".to_vec()), "given at the end");
        let end = tee.end(true, (Some(200), 1), ProviderHints::default());
        assert_eq!(end.outcome(10).cut_off_tokens, 10 + end.streamed_tokens);
        assert!(end.outcome.is_some_and(|r| r.status == 200 && r.body.windows(2).any(|w| w == b"hi")));
    }
}
