//! What a host remembers of the governed requests it saw, by their raw bytes (the tenant's
//! and the body, `cache::hot`): the HITs it answered, sent again without parsing, and the
//! parses of a crowd's requests, so that the rest of the crowd is not parsed, canonicalised
//! and hashed again. `Recall::admit` is the door every governed body goes through, on
//! every host: what it remembers, or `decide`, and what to remember of that.

use crate::core::api::error::ApiError;
use crate::core::api::key::Key;
use crate::core::cache::hot::{Hot, Seed, PARSED_BYTES};
use crate::core::coalesce::engine::{Engine, Step};
use crate::core::config::Config;
use crate::core::intake::kept::Kept;
use crate::core::intake::{decide, Decision, Head};
use crate::core::request::ApiRequest;
use crate::core::store::CasStore;
use crate::core::upstream::Outbound;
use std::rc::Rc;

/// A host's memory of requests by their raw bytes, bounded by `cache.hot_bytes`.
pub struct Recall {
    seed: Seed,
    /// HIT answers (none on a host that keeps no answers of its own).
    answers: Hot<Kept>,
    /// Requests parsed before: a HIT, and a request that waits for a flight.
    parsed: Hot<ApiRequest>,
}

/// A governed request admitted (`Recall::admit`). Made and taken apart once per request,
/// so its size costs one move, not a box.
#[allow(clippy::large_enum_variant)]
pub enum Admitted {
    /// A HIT this host answered before from the same bytes, to send again as it is.
    Kept(Rc<Kept>),
    /// Decided by the core (`intake::decide`).
    Decided(Decided),
}

/// What `decide` made of a request, once the host has remembered what it keeps.
pub struct Decided {
    pub step: Step,
    pub outbound: Outbound,
    /// A flight the decision ended at once (`Decision::ended`): its waiters are woken.
    pub ended: Option<(Key, bool)>,
}

impl Recall {
    /// An empty memory for `config`, hashing with `secret` (the host's own random number).
    /// A host that keeps no `answers` remembers parses alone: a HIT's parse stands in.
    pub fn new(config: &Config, secret: u64, answers: bool) -> Recall {
        let bytes = config.cache.hot_bytes;
        Recall {
            seed: Seed::new(secret),
            answers: Hot::new(if answers { bytes } else { 0 }),
            parsed: Hot::new(bytes.min(PARSED_BYTES)),
        }
    }

    /// A governed request's whole body, with its head: a HIT remembered for exactly these
    /// bytes, or decided (with a parse remembered for them, if any). What it decides is
    /// remembered for the next time: the answer of a HIT, and the parse of a HIT or a
    /// waiter. Requests with directives are never answered from memory, nor remembered:
    /// directives change what may be served. One that lowers its own priority is never
    /// answered from memory either (a kept answer is its tenant's class), though what it
    /// decides is remembered for others.
    /// `keep` makes a HIT's answer into what the host keeps (`Kept::of`, where the host
    /// keeps answers); `nonce` is drawn only for a request that is decided.
    pub fn admit<S: CasStore>(
        &mut self,
        engine: &Engine<'_, S>,
        keep: impl FnOnce(&ApiRequest) -> Option<Kept>,
        head: Head,
        body: &[u8],
        now_ms: u64,
        nonce: impl FnOnce() -> u64,
    ) -> Result<Admitted, ApiError> {
        let scope = head.scope_bytes();
        let raw = self.seed.raw(&scope, body);
        let plain = head.plain();
        if plain && head.priority.is_none() {
            if let Some(hit) = self.answers.get(&raw, now_ms) {
                return Ok(Admitted::Kept(hit));
            }
        }
        let known = if plain { self.parsed.get(&raw, now_ms) } else { None };
        let Decision { request, step, outbound, keep: remember, ended } =
            decide(engine, head, body, known.as_deref(), now_ms, nonce())?;
        if remember.answer && self.answers.keeps() {
            if let Some(kept) = keep(&request) {
                self.answers.put(&raw, kept.expires_ms, kept.size(), kept);
            }
        }
        if remember.parse {
            self.parsed.put(&raw, u64::MAX, request.kept_size(), request);
        }
        Ok(Admitted::Decided(Decided { step, outbound, ended }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::api::reply::CacheStatus;
    use crate::core::observe::meters::Meters;
    use crate::core::store::MemStore;

    const BODY: &[u8] = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"temperature":0}"#;

    fn head(cache_control: Option<&str>) -> Head {
        let mut pairs: Vec<(&[u8], &[u8])> = vec![(b":method", b"POST"), (b":path", b"/v1/chat/completions")];
        if let Some(c) = cache_control {
            pairs.push((b"cache-control", c.as_bytes()));
        }
        Head::read(pairs, None)
    }

    /// Stores the answer of `BODY`'s flight, as a leader would.
    fn answered(engine: &Engine<'_, MemStore>, recall: &mut Recall, meters: &mut Meters<()>) {
        let Ok(Admitted::Decided(Decided { step: Step::Call(call), .. })) = recall.admit(
            engine,
            |r| Kept::of(engine.store, engine.config, meters, r, 1_000),
            head(None),
            BODY,
            1_000,
            || 1,
        ) else {
            panic!("the first request leads");
        };
        let answer = crate::core::api::response::Response::json(200, br#"{"choices":[]}"#.to_vec());
        engine.complete(&call, Some(answer), 1_010);
    }

    #[test]
    fn a_hit_is_answered_again_from_memory_and_a_directive_is_not() {
        let (store, config) = (MemStore::default(), Config::default());
        let engine = Engine { store: &store, config: &config };
        let (mut recall, mut meters) = (Recall::new(&config, 7, true), Meters::<()>::default());
        answered(&engine, &mut recall, &mut meters);
        // The first HIT is decided, and its answer remembered.
        let keep = |r: &ApiRequest| Kept::of(&store, &config, &mut meters, r, 1_100);
        let first = recall.admit(&engine, keep, head(None), BODY, 1_100, || 2);
        assert!(matches!(first, Ok(Admitted::Decided(Decided { step: Step::Reply(ref r), .. }))
            if r.cache == Some(CacheStatus::Hit)));
        // Gone from the store, the same bytes are still answered from memory.
        let empty = MemStore::default();
        let engine = Engine { store: &empty, config: &config };
        assert!(matches!(recall.admit(&engine, |_| None, head(None), BODY, 1_200, || 3), Ok(Admitted::Kept(_))));
        // A directive takes the whole path: the store no longer has it.
        let fresh = recall.admit(&engine, |_| None, head(Some("no-cache")), BODY, 1_200, || 4);
        assert!(matches!(fresh, Ok(Admitted::Decided(Decided { step: Step::Call(_), .. }))));
        // So does a request that lowers its own priority (a kept answer is its tenant's class).
        let lowered = Head { priority: Some("batch".into()), ..head(None) };
        let lowered = recall.admit(&engine, |_| None, lowered, BODY, 1_200, || 5);
        assert!(matches!(lowered, Ok(Admitted::Decided(_)) | Err(_)), "never from memory");
    }

    /// Whether `recall` holds a parse for `BODY` from `head`'s scope.
    fn parsed(recall: &Recall) -> bool {
        let scope = head(None).scope_bytes();
        recall.parsed.get(&recall.seed.raw(&scope, BODY), 1_002).is_some()
    }

    #[test]
    fn a_crowds_parse_is_remembered_and_a_directives_is_not() {
        let (store, config) = (MemStore::default(), Config::default());
        let engine = Engine { store: &store, config: &config };
        let mut recall = Recall::new(&config, 7, true);
        let lead = recall.admit(&engine, |_| None, head(None), BODY, 1_000, || 1);
        assert!(matches!(lead, Ok(Admitted::Decided(Decided { step: Step::Call(_), .. }))));
        assert!(!parsed(&recall), "a leader's bytes are not likely to come again yet");
        let directed = recall.admit(&engine, |_| None, head(Some("max-age=60")), BODY, 1_001, || 2);
        assert!(matches!(directed, Ok(Admitted::Decided(Decided { step: Step::Wait(_), .. }))));
        assert!(!parsed(&recall), "directives change what may be served");
        let wait = recall.admit(&engine, |_| None, head(None), BODY, 1_001, || 3);
        assert!(matches!(wait, Ok(Admitted::Decided(Decided { step: Step::Wait(_), .. }))));
        assert!(parsed(&recall), "part of a crowd: the rest of it is not parsed again");
    }

    #[test]
    fn a_host_that_keeps_no_answers_decides_every_hit() {
        let (store, config) = (MemStore::default(), Config::default());
        let engine = Engine { store: &store, config: &config };
        let (mut recall, mut meters) = (Recall::new(&config, 7, false), Meters::<()>::default());
        answered(&engine, &mut recall, &mut meters);
        for nonce in 2..4 {
            let keep = |r: &ApiRequest| Kept::of(&store, &config, &mut meters, r, 1_100);
            let again = recall.admit(&engine, keep, head(None), BODY, 1_100, || nonce);
            assert!(matches!(again, Ok(Admitted::Decided(Decided { step: Step::Reply(_), .. }))));
        }
    }
}
