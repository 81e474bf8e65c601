//! The decisions of the filter, as values: for each request the core answers `Reply`
//! (serve this now), `Call` (go upstream, with or without the lease) or `Wait` (another
//! flight has the lease). The shell executes them and reports back; it decides nothing.

use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::key::Key;
use crate::core::api::reply::{error_response, CacheStatus, Reply};
use crate::core::api::response::Response;
use crate::core::cache::edge::Origin;
use crate::core::cache::{self, Evict, Fresh, Place};
use crate::core::coalesce::lease::{self, Acquire, Lease, Mark, Produced, Slot, State};
use crate::core::config::{Config, Role};
use crate::core::request::Policy;
use crate::core::semantic::{Probe, Similar};
use crate::core::store::CasStore;
use crate::core::wire::decimal;

/// How far a host's cached clock may lag the timer that fired (see `Engine::failure`).
pub(crate) const CLOCK_SLACK_MS: u64 = 50;

/// How long a waiter that no one can wake (the wasi:http component polls the store) sleeps
/// before its `polls`-th look: 2 ms, doubling, at most 8 ms (a look is one store read).
pub fn poll_delay_ms(polls: u32) -> u64 {
    (2u64 << polls.min(5)).min(8)
}

/// Errors that are not JSON (Envoy's own "upstream connect error", a proxy's HTML page)
/// are wrapped in OpenAI's error shape, keeping the status; JSON passes unchanged.
fn openai_shaped(r: Response) -> Response {
    if r.status == 200 || r.content_type.contains("json") {
        return r;
    }
    let text: String = String::from_utf8_lossy(&r.body).chars().take(200).collect();
    let e = ApiError::upstream(r.status, format!("HolySheep answered {}: {}", r.status, text.trim()), "upstream_error");
    Response { headers: r.headers, ..error_response(&e) }
}

/// The reply of a waiter that could not read its flight's outcome: COALESCED (it waited on
/// a flight), marked `x-holysheep-wait: lost`, and retryable at once.
fn lost_wait(key: &Key) -> Reply {
    let response = error_response(&ApiError::wait_lost())
        .with_header(headers::WAIT, "lost".to_owned())
        .with_header(headers::RETRY_AFTER, "0".to_owned());
    Reply { response, cache: Some(CacheStatus::Coalesced), key: Some(key.clone()), age_s: None, fresh_s: None }
}

/// Which answers of a same-key flight that ended since a request arrived the request takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TakeDone {
    /// None: it did not read the cache (`no-cache`), so it must not read around it either.
    None,
    /// Only one the cache holds: the request read the cache just before it was stored.
    Stored,
    /// Any: the request waited for that flight.
    Any,
}

/// An upstream call to make. With a lease it leads a flight that others wait on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub key: Key,
    pub lease: Option<Lease>,
    pub store: bool,
    pub label: CacheStatus,
    pub started_ms: u64,
    /// The request's cache directives (a stale answer must respect them too).
    pub policy: Policy,
    /// Where in the cache the answer goes, chosen when the request read the cache on
    /// arrival (`None`: look when storing).
    pub place: Option<Place>,
}

impl Call {
    /// Whether the call looks for a paraphrase before it goes upstream: the semantic tier
    /// is on, this node owns its answers, the call leads a flight of a MISS that read the
    /// cache and may store its answer, and the request takes part (`probe`).
    pub fn looks_for_paraphrase<'a>(&self, config: &Config, probe: Option<&'a Probe>) -> Option<&'a Probe> {
        let leads_a_miss = self.lease.is_some() && self.label == CacheStatus::Miss;
        let ok =
            config.semantic.enabled && config.role == Role::Owner && leads_a_miss && self.policy.read && self.store;
        probe.filter(|_| ok)
    }
}

/// Waiting for the flight whose lease carries `nonce`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wait {
    pub key: Key,
    /// The lease way the awaited flight leads from.
    pub slot: Slot,
    pub nonce: u64,
    pub since_ms: u64,
    pub policy: Policy,
}

/// How a flight ended: the caller's reply, whether anyone waited on the flight (whose end
/// must then wake every worker), and whether storing its answer evicted another fresh one.
#[derive(Debug, Clone)]
pub struct Ended {
    pub reply: Reply,
    pub watched: bool,
    pub evicted: bool,
}

/// A finished flight's answer, read once for all its waiters answered together (see
/// `Engine::poll_with`).
#[derive(Debug, Clone)]
pub(crate) struct Finished {
    slot: Slot,
    nonce: u64,
    key: Key,
    response: Response,
    done_at_ms: u64,
    produced: Produced,
    /// When the cache entry the answer is expires (`None`: it is in the flight's record).
    expires_ms: Option<u64>,
}

impl Finished {
    /// Whether it is the flight `wait` waits on.
    pub(crate) fn is_for(&self, wait: &Wait) -> bool {
        self.nonce == wait.nonce && self.slot == wait.slot && self.key == wait.key
    }
}

/// Finished flights a host keeps while it answers their waiters over several turns (a
/// batch of replies per turn): each waiter takes the answer from here, not from the
/// flight's lease record, which another flight may have taken by then. At most
/// `MAX_FINISHING`, the oldest going first.
#[derive(Debug, Default)]
pub struct Finishing(Vec<Finished>);

/// Finished flights a host keeps at most.
const MAX_FINISHING: usize = 16;

impl Finishing {
    /// A waiter looks at its flight again (`Engine::poll`), from a finished flight kept
    /// here when there is one; the flight it finds finished is kept for its other waiters.
    pub fn poll<S: CasStore>(&mut self, engine: &Engine<'_, S>, wait: &Wait, now_ms: u64, nonce: u64) -> Step {
        let at = self.0.iter().position(|f| f.is_for(wait));
        let mut seen = at.map(|at| self.0.swap_remove(at));
        let step = engine.poll_with(wait, now_ms, nonce, &mut seen);
        if let Some(finished) = seen {
            if self.0.len() >= MAX_FINISHING {
                self.0.remove(0);
            }
            self.0.push(finished);
        }
        step
    }

    /// Every waiter looked: a finished flight none of `waits` is for is forgotten.
    pub fn keep_for<'a>(&mut self, waits: impl Iterator<Item = &'a Wait> + Clone) {
        self.0.retain(|f| waits.clone().any(|w| f.is_for(w)));
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Reply(Reply),
    Call(Call),
    Wait(Wait),
}

pub struct Engine<'a, S> {
    pub store: &'a S,
    pub config: &'a Config,
}

impl<S: CasStore> Engine<'_, S> {
    /// First look at a request: cache, then lease.
    pub fn admit(&self, key: &Key, policy: Policy, now_ms: u64, nonce: u64) -> Step {
        self.decide(key, policy, now_ms, nonce, None)
    }

    /// A waiter looks again (woken, or on the safety-net tick).
    pub fn poll(&self, wait: &Wait, now_ms: u64, nonce: u64) -> Step {
        self.poll_with(wait, now_ms, nonce, &mut None)
    }

    /// `poll` for one of many waiters answered together: the first to find its flight
    /// finished keeps the answer in `seen`, and the others of that flight take it from
    /// there instead of reading the lease record and the cache entry again (1000 waiters
    /// of one prompt are one read, not 1000).
    pub(crate) fn poll_with(&self, wait: &Wait, now_ms: u64, nonce: u64, seen: &mut Option<Finished>) -> Step {
        if let Some(f) = seen.as_ref().filter(|f| f.is_for(wait)) {
            let done = Done { at_ms: f.done_at_ms, produced: f.produced, expires_ms: f.expires_ms };
            return self.answer_waiter(wait, f.response.clone(), done, now_ms, nonce);
        }
        let state = lease::read(self.store, &wait.slot).map(|(s, _)| s);
        match state {
            Ok(State::Done { key, nonce: n, done_at_ms, response, produced, in_cache })
                if n == wait.nonce && wait.key.is(&key) =>
            {
                let Some((response, expires_ms)) = self.kept(&wait.key, response, in_cache, done_at_ms) else {
                    // The entry it refers to is gone already.
                    return self.after_lost_answer(wait, now_ms);
                };
                *seen = Some(Finished {
                    slot: wait.slot.clone(),
                    nonce: n,
                    key: wait.key.clone(),
                    response: response.clone(),
                    done_at_ms,
                    produced,
                    expires_ms,
                });
                let done = Done { at_ms: done_at_ms, produced, expires_ms };
                self.answer_waiter(wait, response, done, now_ms, nonce)
            }
            Ok(State::Leading { nonce: n, expires_ms, watched, best, .. })
                if n == wait.nonce && expires_ms > now_ms =>
            {
                self.keep_waiting(wait.clone(), Mark { watched, best }, now_ms, nonce)
            }
            // The flight ended without an answer (its leader gave the lease up, or is gone
            // and its lease expired), and its record says so: look again from the top,
            // remembering how long we have waited; one waiter leads anew.
            Ok(State::Leading { nonce: n, .. }) if n == wait.nonce => {
                self.decide(&wait.key, wait.policy, now_ms, nonce, Some(wait.since_ms))
            }
            // Another flight's record is in its way, or none is, or the store cannot say:
            // whatever this flight left there is gone.
            _ => self.after_lost_answer(wait, now_ms),
        }
    }

    /// A waiter that cannot read its flight's outcome (its way holds another flight by
    /// now, or the cache entry the record referred to was replaced) never leads: that
    /// flight may have been answered and billed, and a second call would be one nobody
    /// asked for. It takes what it may take without leading (the cache's answer, a live
    /// flight on its key, the answer of one that ended since it arrived), and otherwise
    /// gets the edge's retryable 503, counted as `waits_lost`.
    fn after_lost_answer(&self, wait: &Wait, now_ms: u64) -> Step {
        if let (Some(reply), _) = self.cached(&wait.key, wait.policy, now_ms, Some(wait.since_ms)) {
            return Step::Reply(reply);
        }
        match lease::look(self.store, self.config, &wait.key, now_ms, wait.since_ms) {
            Ok(Acquire::Held { nonce: n, slot, watched, best }) => {
                let again = Wait { slot, nonce: n, ..wait.clone() };
                let class = wait.policy.class;
                let marked = !Mark { watched, best }.lacks(class)
                    || lease::watch(self.store, &again.slot, n, class).unwrap_or(false);
                if marked {
                    return Step::Wait(again);
                }
            }
            Ok(Acquire::Answered { response, done_at_ms, produced, in_cache }) => {
                let kept = self.kept(&wait.key, response, in_cache, done_at_ms);
                let shared = kept.and_then(|(r, expires_ms)| {
                    let done = Done { at_ms: done_at_ms, produced, expires_ms };
                    shared(&wait.key, r, done, (wait.policy, wait.since_ms), now_ms)
                });
                if let Some(reply) = shared {
                    return Step::Reply(reply);
                }
            }
            _ => {}
        }
        Step::Reply(lost_wait(&wait.key))
    }

    /// The finished flight's answer for one of its waiters.
    fn answer_waiter(&self, wait: &Wait, response: Response, done: Done, now_ms: u64, nonce: u64) -> Step {
        match shared(&wait.key, response, done, (wait.policy, wait.since_ms), now_ms) {
            Some(reply) => Step::Reply(reply),
            // A stale answer this waiter's directives refuse: it looks again itself.
            None => self.take_lease(&wait.key, wait.policy, now_ms, nonce, now_ms, TakeDone::None),
        }
    }

    /// Renews the lease of an in-flight call; `false` when it was lost.
    pub fn renew(&self, call: &Call, now_ms: u64) -> bool {
        match &call.lease {
            Some(l) => lease::renew(self.store, self.config, l, now_ms).unwrap_or(false),
            None => true,
        }
    }

    /// The call ended (`None`: the callout failed). Stores what may be stored, hands the
    /// answer to the flight's waiters, and returns the caller's reply.
    pub fn complete(&self, call: &Call, outcome: Option<Response>, now_ms: u64) -> Reply {
        self.finish_flight(call, outcome, now_ms).0
    }

    /// `complete`, and whether anyone waited on the flight (whose end must then wake
    /// every worker).
    pub(crate) fn finish_flight(&self, call: &Call, outcome: Option<Response>, now_ms: u64) -> (Reply, bool) {
        let ended = self.end_flight(call, outcome, now_ms, Some(Fresh::of(self.config, now_ms)));
        (ended.reply, ended.watched)
    }

    /// `finish_flight` for an answer that, when stored, is `fresh` as given (`None`: it
    /// may not be stored), such as a forward node's near copy of its owner's answer.
    pub fn end_flight(&self, call: &Call, outcome: Option<Response>, now_ms: u64, fresh: Option<Fresh>) -> Ended {
        self.end_relayed(call, outcome, now_ms, fresh, None)
    }

    /// `end_flight` for a forward node's hop, whose answer its owner produced at `origin`
    /// (a HIT some seconds old, or STALE): the flight's waiters share it as of then, each
    /// under its own directives, as they would on the owner.
    pub fn end_relayed(
        &self,
        call: &Call,
        outcome: Option<Response>,
        now_ms: u64,
        fresh: Option<Fresh>,
        origin: Option<Origin>,
    ) -> Ended {
        let response = outcome.map_or_else(|| self.failure(call, now_ms), openai_shaped);
        if response.status == 429 || response.status >= 500 {
            if let Some((stale, produced_ms)) = self.stale(&call.key, now_ms) {
                let watched = self.finish_lease(call, &stale.response, now_ms, Produced::Stale(produced_ms), false);
                if stale_allowed(call.policy, stale.age_s.unwrap_or(0)) {
                    return Ended { reply: stale, watched, evicted: false };
                }
            }
        }
        let place = call.place.as_ref();
        // An answer whose freshness ran out on its way (a long stream) is not stored.
        let stored = fresh.filter(|f| call.store && f.expires_ms() > now_ms).and_then(|f| {
            let stored =
                cache::store_fresh(self.store, self.config, &call.key, &response, f, now_ms, place, Evict::Asked);
            stored.map(|s| (s, f))
        });
        // A relayed answer is dated when its owner produced it (STALE, when it was so).
        let produced = match origin {
            Some(o) if o.stale => Produced::Stale(o.produced_ms),
            Some(o) if o.aged => Produced::Relayed(o.produced_ms),
            _ => Produced::AtEnd,
        };
        // The flight's record refers to the entry only when it was stamped now (the record's
        // time names the entry); an answer dated back by its owner is repeated there.
        let by_reference = produced == Produced::AtEnd && stored.is_some_and(|(_, f)| f.stored_at_ms == now_ms);
        let watched = self.finish_lease(call, &response, now_ms, produced, by_reference);
        let fresh_s = stored.map(|(_, f)| f.expires_ms().saturating_sub(now_ms) / 1000);
        let reply = Reply { response, cache: Some(call.label), key: Some(call.key.clone()), age_s: None, fresh_s };
        Ended { reply, watched, evicted: stored.is_some_and(|(s, _)| s.evicted) }
    }

    /// A flight that found paraphrases of its question (`similar`, the closest first) ends
    /// with the answer of the first whose exact cache entry is still fresh and no older
    /// than the request allows: SEMANTIC, with its similarity, and stored under no key of
    /// its own (`cache-control: no-store`), so it is never kept past the answer it is. Its
    /// waiters share it. `None` when no such answer is left: the flight goes upstream.
    pub fn end_similar(&self, call: &Call, similar: &[Similar], now_ms: u64) -> Option<Ended> {
        let (entry, similarity) = similar.iter().find_map(|s| {
            let e = cache::get(self.store, self.config, &s.key).filter(|e| e.is_fresh(now_ms))?;
            let young = call.policy.max_age.is_none_or(|max| e.age_ms(now_ms) / 1000 <= max);
            young.then_some((e, s.similarity))
        })?;
        let age_s = Some(entry.age_ms(now_ms) / 1000);
        let response = entry.response.with_header(headers::SIMILARITY, decimal::similarity(similarity));
        // Dated when the answer was produced: a waiter's own directives may refuse it.
        let watched = self.finish_lease(call, &response, now_ms, Produced::Stale(entry.stored_at_ms), false);
        let cache = Some(CacheStatus::Semantic);
        let reply = Reply { response, cache, key: Some(call.key.clone()), age_s, fresh_s: None };
        Some(Ended { reply, watched, evicted: false })
    }

    /// Whether the flight `wait` is for still stands: its leader holds its lease (renewed,
    /// not expired), or it ended with an answer. Read only (a waiter that follows a live
    /// tail asks this to learn whether its leader is gone without ending the tail). A store
    /// that cannot say counts as standing.
    pub fn stands(&self, wait: &Wait, now_ms: u64) -> bool {
        match lease::read(self.store, &wait.slot).map(|(s, _)| s) {
            Ok(State::Leading { nonce, expires_ms, .. }) => nonce == wait.nonce && expires_ms > now_ms,
            Ok(State::Done { nonce, .. }) => nonce == wait.nonce,
            Ok(State::Free) => false,
            Err(_) => true,
        }
    }

    /// The call ended without an answer worth sharing (a stream cut off): its waiters look
    /// again, and one of them leads a new flight.
    /// Returns whether anyone waited on it (their workers must be woken).
    pub fn abandon(&self, call: &Call, now_ms: u64) -> bool {
        let Some(l) = &call.lease else { return false };
        lease::release(self.store, l, now_ms).map_or(true, |w| w.unwrap_or(true))
    }

    /// Whether the flight was watched (a lost lease, or a store failure, counts as
    /// watched: waking is the safe side).
    fn finish_lease(&self, call: &Call, response: &Response, now_ms: u64, produced: Produced, in_cache: bool) -> bool {
        let Some(l) = &call.lease else { return false };
        // A lost lease (we were presumed dead) leaves the new leader's flight alone.
        lease::finish(self.store, l, response, now_ms, produced, in_cache).map_or(true, |w| w.unwrap_or(true))
    }

    /// A finished flight's answer: the one in its record, or the cache entry the record
    /// refers to, with its expiry (`None` when that entry has been replaced since).
    fn kept(&self, key: &Key, response: Response, in_cache: bool, done_at_ms: u64) -> Option<(Response, Option<u64>)> {
        if !in_cache {
            return Some((response, None));
        }
        let entry = cache::get(self.store, self.config, key).filter(|e| e.stored_at_ms == done_at_ms)?;
        let expires_ms = entry.stored_at_ms.saturating_add(entry.ttl_ms);
        Some((entry.response, Some(expires_ms)))
    }

    /// An expired entry at most `stale_if_error_seconds` past its TTL, and when it was
    /// produced. (Whether a request may have it is `stale_allowed`'s to say.) A forward
    /// node has none: a near copy is never served past its owner's TTL.
    fn stale(&self, key: &Key, now_ms: u64) -> Option<(Reply, u64)> {
        if self.config.role == Role::Forward {
            return None;
        }
        let grace_ms = self.config.stale_if_error_seconds.saturating_mul(1000);
        let entry = cache::get(self.store, self.config, key)
            .filter(|e| grace_ms > 0 && e.age_ms(now_ms) < e.ttl_ms.saturating_add(grace_ms))?;
        let reply = Reply {
            age_s: Some(entry.age_ms(now_ms) / 1000),
            cache: Some(CacheStatus::Stale),
            key: Some(key.clone()),
            response: entry.response,
            fresh_s: None,
        };
        Some((reply, entry.stored_at_ms))
    }

    /// No answer: a timeout if the deadline has (about) passed, else a failed connection.
    /// Envoy's clock advances once per event-loop turn, so a failure reported within
    /// `CLOCK_SLACK_MS` of the deadline is the deadline.
    fn failure(&self, call: &Call, now_ms: u64) -> Response {
        let timeout = self.config.upstream.timeout_ms;
        let e = if now_ms.saturating_sub(call.started_ms) + CLOCK_SLACK_MS >= timeout {
            ApiError::upstream(504, format!("HolySheep did not answer within {timeout} ms"), "upstream_timeout")
        } else {
            ApiError::upstream(
                502,
                "HolySheep could not be reached (connection failed or reset)",
                "upstream_unavailable",
            )
        };
        error_response(&e)
    }

    fn decide(&self, key: &Key, policy: Policy, now_ms: u64, nonce: u64, waited_since: Option<u64>) -> Step {
        let (reply, place) = self.cached(key, policy, now_ms, waited_since);
        if let Some(reply) = reply {
            return Step::Reply(reply);
        }
        let step = if !policy.coalesce {
            Step::Call(self.call(key, None, policy, false, CacheStatus::Bypass, now_ms))
        } else {
            // A flight that ended since arrival answers a request that waited for it, and
            // one that read the cache just before it stored (so only with a stored answer);
            // not one that did not look (`no-cache`).
            let take = match (waited_since, policy.read) {
                (Some(_), _) => TakeDone::Any,
                (None, true) => TakeDone::Stored,
                (None, false) => TakeDone::None,
            };
            self.take_lease(key, policy, now_ms, nonce, waited_since.unwrap_or(now_ms), take)
        };
        match step {
            // The group was just read: the answer goes where its index said, without reading
            // it again (unless someone stores in the group meanwhile).
            Step::Call(call) => Step::Call(Call { place, ..call }),
            other => other,
        }
    }

    /// Takes the lease, waits on its holder, or takes the answer of a same-key flight done
    /// since `since_ms` when `take` allows it. A stale answer this request's directives
    /// refuse, or one `take` does not allow, makes it take the lease after all.
    fn take_lease(&self, key: &Key, policy: Policy, now_ms: u64, nonce: u64, since_ms: u64, take: TakeDone) -> Step {
        // A request that read the cache may also take a flight that ended (just) before it
        // arrived, as long as that flight's entry can still be fresh: the leader dates its
        // end before it writes, so a request whose cache read came just before the write may
        // have arrived after that date. The cache, read again, says whether it may have it.
        let done_since = match take {
            TakeDone::None => u64::MAX,
            TakeDone::Stored => since_ms.saturating_add(1).saturating_sub(self.config.longest_fresh_ms()),
            TakeDone::Any => since_ms,
        };
        match lease::acquire(self.store, self.config, key, nonce, now_ms, done_since) {
            Ok(Acquire::Acquired(l)) => {
                Step::Call(self.call(key, Some(l), policy, policy.store, CacheStatus::Miss, now_ms))
            }
            Ok(Acquire::Held { nonce: n, slot, watched, best }) => {
                let wait = Wait { key: key.clone(), slot, nonce: n, since_ms, policy };
                self.keep_waiting(wait, Mark { watched, best }, now_ms, nonce)
            }
            Ok(Acquire::Answered { in_cache: false, .. }) if take == TakeDone::Stored => {
                self.take_lease(key, policy, now_ms, nonce, now_ms, TakeDone::None)
            }
            Ok(Acquire::Answered { done_at_ms, .. }) if done_at_ms < since_ms => {
                match self.cached(key, policy, now_ms, None).0 {
                    Some(reply) => Step::Reply(reply),
                    None => self.take_lease(key, policy, now_ms, nonce, now_ms, TakeDone::None),
                }
            }
            Ok(Acquire::Answered { response, done_at_ms, produced, in_cache }) => {
                let kept = self.kept(key, response, in_cache, done_at_ms);
                let shared = kept.and_then(|(r, expires_ms)| {
                    shared(key, r, Done { at_ms: done_at_ms, produced, expires_ms }, (policy, since_ms), now_ms)
                });
                match shared {
                    Some(reply) => Step::Reply(reply),
                    None => self.take_lease(key, policy, now_ms, nonce, now_ms, TakeDone::None),
                }
            }
            // A slot collision or a store failure: go alone rather than wait on a stranger.
            Ok(Acquire::Busy) | Err(_) => {
                Step::Call(self.call(key, None, policy, policy.store, CacheStatus::Miss, now_ms))
            }
        }
    }

    /// Waits on a live flight, first marking it waited on (`mark` says whether someone
    /// already did, and the highest class of the waiters that said theirs), so that its end
    /// wakes every worker and its leader, waiting for its bucket, takes the class of its
    /// most urgent waiter; a flight that ended before the mark wakes no one, so the waiter
    /// looks again now (`nonce`: should it lead). Like
    /// nginx after `proxy_cache_lock_timeout`, a waiter that waited too long goes upstream
    /// itself, and its answer is not stored.
    fn keep_waiting(&self, wait: Wait, mark: Mark, now_ms: u64, nonce: u64) -> Step {
        let class = wait.policy.class;
        if mark.lacks(class) && !lease::watch(self.store, &wait.slot, wait.nonce, class).unwrap_or(true) {
            return self.after_flight(wait, now_ms, nonce);
        }
        if now_ms.saturating_sub(wait.since_ms) >= self.config.lock.wait_timeout_ms {
            Step::Call(self.call(&wait.key, None, wait.policy, false, CacheStatus::Miss, now_ms))
        } else {
            Step::Wait(wait)
        }
    }

    /// The flight a waiter was about to mark ended meanwhile: the waiter takes its answer
    /// from the flight's way (whatever the clocks of the two workers say), or looks again
    /// from the top when the way holds another flight by now. Should the way still hold
    /// that flight (the mark lost every race), it waits for the next look.
    fn after_flight(&self, wait: Wait, now_ms: u64, nonce: u64) -> Step {
        match lease::read(self.store, &wait.slot) {
            Ok((State::Leading { nonce: n, expires_ms, .. }, _)) if n == wait.nonce && expires_ms > now_ms => {
                Step::Wait(wait)
            }
            _ => self.poll_with(&wait, now_ms, nonce, &mut None),
        }
    }

    /// A fresh entry this request may be served. A waiter may take an entry stored since
    /// it began waiting even under `no-cache`: that is the flight it waited for.
    fn cached(
        &self,
        key: &Key,
        policy: Policy,
        now_ms: u64,
        waited_since: Option<u64>,
    ) -> (Option<Reply>, Option<Place>) {
        if !policy.read && waited_since.is_none() {
            return (None, None);
        }
        let probe = cache::probe(self.store, self.config, key);
        let Some(entry) = probe.entry.filter(|e| e.is_fresh(now_ms)) else { return (None, Some(probe.place)) };
        let age_ms = entry.age_ms(now_ms);
        let allowed = match waited_since {
            Some(since) => entry.stored_at_ms >= since || policy.read,
            None => true,
        } && policy.max_age.is_none_or(|max| age_ms / 1000 <= max);
        let fresh_s = entry.ttl_ms.saturating_sub(age_ms) / 1000;
        if allowed && waited_since.is_none() {
            // A HIT: its answer is one asked again, displaced after those that were not.
            cache::asked_again(self.store, &probe.place);
        }
        let reply = allowed.then(|| Reply {
            age_s: Some(age_ms / 1000),
            cache: Some(if waited_since.is_some() { CacheStatus::Coalesced } else { CacheStatus::Hit }),
            key: Some(key.clone()),
            response: entry.response,
            fresh_s: Some(fresh_s),
        });
        (reply, Some(probe.place))
    }

    fn call(
        &self,
        key: &Key,
        lease: Option<Lease>,
        policy: Policy,
        store: bool,
        label: CacheStatus,
        now_ms: u64,
    ) -> Call {
        Call { key: key.clone(), lease, store, label, started_ms: now_ms, policy, place: None }
    }
}

/// Whether a request may be served a stale answer this old: not under `no-store` or
/// `no-cache`, and not past its `max-age`.
fn stale_allowed(policy: Policy, age_s: u64) -> bool {
    policy.read && policy.max_age.is_none_or(|max| age_s <= max)
}

/// When and how a finished flight's answer was produced, and until when the cache entry
/// it is (if it is one) stays fresh.
#[derive(Debug, Clone, Copy)]
struct Done {
    at_ms: u64,
    produced: Produced,
    expires_ms: Option<u64>,
}

/// A finished flight's answer for a request that shared it: COALESCED, or STALE with the
/// stale answer's own age (`None` when the request's directives refuse it). An answer the
/// flight did not produce (a stale one, or a paraphrase's, which carries its similarity) is
/// dated when it was, and is refused by `no-cache` and a `max-age` it exceeds; so is one a
/// forward node's flight relayed (dated when its owner produced it): under `no-cache` when
/// it is older than the request (`since_ms`), and past the request's `max-age`.
fn shared(key: &Key, response: Response, done: Done, (policy, since_ms): (Policy, u64), now_ms: u64) -> Option<Reply> {
    let paraphrase = response.header(headers::SIMILARITY).is_some();
    let (cache, produced_ms) = match done.produced {
        Produced::Stale(t) if paraphrase => (CacheStatus::Coalesced, t),
        Produced::Stale(t) => (CacheStatus::Stale, t),
        Produced::Relayed(t) => (CacheStatus::Coalesced, t),
        Produced::AtEnd => (CacheStatus::Coalesced, done.at_ms),
    };
    let age_s = now_ms.saturating_sub(produced_ms) / 1000;
    let stale = matches!(done.produced, Produced::Stale(_));
    if stale && !stale_allowed(policy, age_s) {
        return None;
    }
    // A relayed answer is held to the request's directives as on its owner; the flight's
    // own answer never is (it is the request's own, however late the waiter reads it or
    // however the workers' clocks disagree).
    let relayed = matches!(done.produced, Produced::Relayed(_));
    let older = produced_ms < since_ms && !policy.read;
    if relayed && (older || policy.max_age.is_some_and(|max| age_s > max)) {
        return None;
    }
    if !response.may_share(policy.class) {
        return None;
    }
    let fresh_s = done.expires_ms.filter(|_| !stale).map(|e| e.saturating_sub(now_ms) / 1000);
    Some(Reply { response, cache: Some(cache), key: Some(key.clone()), age_s: Some(age_s), fresh_s })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::request::{request_key, CacheControl};
    use crate::core::store::{Counting, MemStore};

    const READ: Policy = Policy {
        read: true,
        max_age: None,
        coalesce: true,
        store: true,
        class: crate::core::api::priority::Class::Standard,
    };

    fn ok(body: &str) -> Option<Response> {
        Some(Response::json(200, body.into()))
    }

    fn k(i: u8) -> Key {
        request_key("/p", "s", &[i])
    }

    fn expect_call(s: Step) -> Call {
        match s {
            Step::Call(c) => c,
            other => panic!("expected a call, got {other:?}"),
        }
    }

    fn expect_wait(s: Step) -> Wait {
        match s {
            Step::Wait(w) => w,
            other => panic!("expected a wait, got {other:?}"),
        }
    }

    fn expect_reply(s: Step) -> Reply {
        match s {
            Step::Reply(r) => r,
            other => panic!("expected a reply, got {other:?}"),
        }
    }

    #[test]
    fn a_miss_stores_where_its_arrival_read_said_without_reading_the_slots_again() {
        let (s, c) = (Counting::of_keys_starting("holysheep/cache/"), Config::default());
        let e = Engine { store: &s, config: &c };
        let call = expect_call(e.admit(&k(1), READ, 0, 1));
        assert!(call.place.is_some(), "the arrival read chose a place");
        let reads = s.reads();
        e.complete(&call, ok("{\"a\":1}"), 10);
        assert_eq!(s.reads(), reads, "storing read no cache slot");
        let hit = expect_reply(e.admit(&k(1), READ, 20, 2));
        assert_eq!((hit.cache, hit.response.body.as_slice()), (Some(CacheStatus::Hit), &b"{\"a\":1}"[..]));
    }

    /// A store whose cache slots read as empty once: a request that read the cache just
    /// before the leader stored.
    struct CacheReadTooEarly {
        inner: MemStore,
        seen: std::cell::Cell<bool>,
    }

    impl CasStore for CacheReadTooEarly {
        fn get(&self, key: &str) -> Result<crate::core::store::Read, crate::core::store::StoreError> {
            if key.starts_with("holysheep/cache/") && !self.seen.replace(true) {
                return Ok(crate::core::store::Read { value: None, cas: None });
            }
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), crate::core::store::StoreError> {
            self.inner.set(key, value, cas)
        }
    }

    /// A store that runs `then` once, right after the first read of a lease group: another
    /// worker acting between a request's read and its next write.
    struct AfterLeaseRead<'a> {
        inner: &'a MemStore,
        then: std::cell::RefCell<Option<Box<dyn FnOnce() + 'a>>>,
    }

    impl CasStore for AfterLeaseRead<'_> {
        fn get(&self, key: &str) -> Result<crate::core::store::Read, crate::core::store::StoreError> {
            let read = self.inner.get(key);
            if key.starts_with("holysheep/lease/") {
                if let Some(then) = self.then.borrow_mut().take() {
                    then();
                }
            }
            read
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), crate::core::store::StoreError> {
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn a_flight_that_ends_between_a_waiters_read_and_its_mark_answers_the_waiter_at_once() {
        let (store, config) = (MemStore::new(), Config::default());
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(4), READ, 1_000, 1));
        let body = r#"{"answer":4}"#;
        // The leader finishes after the waiter read its way and before the waiter marks it:
        // the flight was not watched, so its end wakes no other worker.
        let finish = || {
            let (_, watched) = e.finish_flight(&leader, ok(body), 1_010);
            assert!(!watched);
        };
        let racing = AfterLeaseRead { inner: &store, then: std::cell::RefCell::new(Some(Box::new(finish))) };
        let waiter = Engine { store: &racing, config: &config };
        let step = waiter.admit(&k(4), READ, 1_005, 2);
        let r = expect_reply(step);
        assert_eq!((r.cache, r.response.body.as_slice()), (Some(CacheStatus::Coalesced), body.as_bytes()));
    }

    #[test]
    fn a_flight_that_ends_before_the_mark_answers_its_waiter_whatever_the_clocks_say() {
        let (store, config) = (MemStore::new(), Config::default());
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(6), READ, 1_000, 1));
        // The leader's worker stamps its end (an error, not stored) 2 ms before the
        // waiter's clock says the waiter arrived.
        let finish = || {
            e.finish_flight(&leader, Some(Response::json(503, b"{}".to_vec())), 1_003);
        };
        let racing = AfterLeaseRead { inner: &store, then: std::cell::RefCell::new(Some(Box::new(finish))) };
        let waiter = Engine { store: &racing, config: &config };
        let r = expect_reply(waiter.admit(&k(6), READ, 1_005, 2));
        assert_eq!((r.response.status, r.cache), (503, Some(CacheStatus::Coalesced)), "no second flight");
    }

    #[test]
    fn a_flight_stands_while_its_leader_holds_the_lease_or_once_it_answered() {
        let (store, config) = (MemStore::new(), Config::default());
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(8), READ, 1_000, 1));
        let wait = expect_wait(e.admit(&k(8), READ, 1_001, 2));
        assert!(e.stands(&wait, 1_002));
        let expiry = 1_000 + config.lock.lease_ms;
        assert!(!e.stands(&wait, expiry + 1), "a leader that stopped renewing is gone");
        e.finish_flight(&leader, ok("{}"), 1_003);
        assert!(e.stands(&wait, expiry + 1), "an answered flight stands");
        let again = expect_call(e.admit(&k(9), READ, 2_000, 3));
        let waiting = expect_wait(e.admit(&k(9), READ, 2_001, 4));
        e.abandon(&again, 2_002);
        assert!(!e.stands(&waiting, 2_003), "a flight given up");
    }

    #[test]
    fn a_refusal_for_priority_answers_only_waiters_of_its_class_or_below() {
        use crate::core::api::priority::Class;
        let (store, config) = (MemStore::new(), Config::default());
        let e = Engine { store: &store, config: &config };
        let shedding = Policy { class: Class::Sheddable, ..READ };
        let leader = expect_call(e.admit(&k(7), shedding, 0, 1));
        let critical = expect_wait(e.admit(&k(7), Policy { class: Class::Critical, ..READ }, 1, 2));
        let sheddable = expect_wait(e.admit(&k(7), shedding, 1, 3));
        let shed = Response::json(429, b"{}".to_vec()).shed("priority", Class::Sheddable);
        e.complete(&leader, Some(shed), 2);
        let r = expect_reply(e.poll(&sheddable, 3, 4));
        assert_eq!((r.response.status, r.cache), (429, Some(CacheStatus::Coalesced)));
        let again = expect_call(e.poll(&critical, 3, 5));
        assert!(again.lease.is_some(), "the critical request leads a flight of its own");
    }

    #[test]
    fn a_waiter_whose_flights_way_another_flight_took_never_leads() {
        // One group of four ways. The crowd's flight fails (an answer the cache does not
        // keep); past the hold, other prompts take all four ways, the finished one last.
        let (store, config) = (MemStore::new(), Config::parse(br#"{"lock":{"slots":4}}"#).unwrap());
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(7), READ, 1_000, 1));
        let wait = expect_wait(e.admit(&k(7), READ, 1_001, 2));
        e.complete(&leader, Some(Response::json(503, b"{}".to_vec())), 1_010);
        let later = 1_010 + crate::core::coalesce::lease::done_hold_ms(&config) + 1;
        let others: Vec<Call> =
            (0..4).map(|i| expect_call(e.admit(&k(20 + i), READ, later, 10 + u64::from(i)))).collect();
        assert!(others.iter().all(|c| c.lease.is_some()), "the four ways, the finished one last");
        // Another prompt's flight leads in its way: the crowd's outcome is gone.
        let lost = expect_reply(e.poll(&wait, later + 1, 20));
        assert_eq!((lost.response.status, lost.cache), (503, Some(CacheStatus::Coalesced)));
        assert!(lost.lost_wait(), "the edge's own retryable 503, counted as waits_lost");
        assert_eq!(lost.response.header(headers::RETRY_AFTER), Some("0"));
        assert!(std::str::from_utf8(&lost.response.body).unwrap().contains(r#""code":"wait_lost""#));
        for c in &others {
            e.complete(c, ok("{}"), later + 2);
        }
        // Another prompt's finished flight there: still no lead, and nothing taken.
        let group = lease::group_of(&config, &k(7)).0;
        let before = store.get(&group).unwrap();
        assert!(expect_reply(e.poll(&wait, later + 3, 21)).lost_wait());
        assert_eq!(store.get(&group).unwrap(), before, "looked, wrote nothing");
    }

    #[test]
    fn a_new_crowd_takes_a_way_whose_waiters_read_the_cache_and_they_still_get_the_answer() {
        // One group of four ways, each holding a waited-on flight that just ended and stored
        // its answer. A new prompt within the hold leads from the oldest (it does not go
        // alone, once per request of its crowd), and that flight's waiter, woken late, gets
        // the answer from the cache.
        let (store, config) = (MemStore::new(), Config::parse(br#"{"lock":{"slots":4}}"#).unwrap());
        let e = Engine { store: &store, config: &config };
        let leaders: Vec<Call> =
            (0..4).map(|i| expect_call(e.admit(&k(30 + i), READ, 1_000, 1 + u64::from(i)))).collect();
        let waits: Vec<Wait> =
            (0..4).map(|i| expect_wait(e.admit(&k(30 + i), READ, 1_001, 10 + u64::from(i)))).collect();
        for (i, leader) in leaders.iter().enumerate() {
            e.complete(leader, ok(&format!(r#"{{"n":{i}}}"#)), 1_010 + i as u64);
        }
        let crowd = expect_call(e.admit(&k(40), READ, 1_020, 20));
        assert!(crowd.lease.is_some(), "the new prompt leads, so its crowd waits on it");
        assert_eq!(crowd.lease.as_ref().map(|l| l.slot.way), Some(leaders[0].lease.as_ref().unwrap().slot.way));
        let joined = expect_wait(e.admit(&k(40), READ, 1_021, 21));
        assert_eq!(joined.nonce, 20);
        let late = expect_reply(e.poll(&waits[0], 1_022, 22));
        assert_eq!((late.response.status, late.cache), (200, Some(CacheStatus::Coalesced)));
        assert_eq!(late.response.body, br#"{"n":0}"#.to_vec(), "its own flight's answer, from the cache");
        assert!(!late.lost_wait());
    }

    #[test]
    fn a_released_flights_waiters_lead_anew_though_other_prompts_want_its_way() {
        let (store, config) = (MemStore::new(), Config::parse(br#"{"lock":{"slots":4}}"#).unwrap());
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(7), READ, 1_000, 1));
        let wait = expect_wait(e.admit(&k(7), READ, 1_001, 2));
        assert!(e.abandon(&leader, 1_010), "watched");
        // Other prompts take the three free ways; the released one is left to its waiters.
        let others: Vec<Call> =
            (0..4).map(|i| expect_call(e.admit(&k(20 + i), READ, 1_011, 10 + u64::from(i)))).collect();
        assert_eq!(others.iter().filter(|c| c.lease.is_some()).count(), 3);
        let again = expect_call(e.poll(&wait, 1_012, 40));
        assert!(again.lease.is_some(), "a waiter leads anew");
        // Past the hold, the way is anyone's.
        let (store, config) = (MemStore::new(), Config::parse(br#"{"lock":{"slots":4}}"#).unwrap());
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(7), READ, 1_000, 1));
        expect_wait(e.admit(&k(7), READ, 1_001, 2));
        e.abandon(&leader, 1_010);
        let later = 1_010 + lease::done_hold_ms(&config) + 1;
        let others: Vec<Call> =
            (0..4).map(|i| expect_call(e.admit(&k(20 + i), READ, later, 10 + u64::from(i)))).collect();
        assert_eq!(others.iter().filter(|c| c.lease.is_some()).count(), 4);
    }

    #[test]
    fn a_waiter_whose_flights_record_is_gone_takes_what_it_may_without_leading() {
        let (store, config) = (MemStore::new(), Config::parse(br#"{"lock":{"slots":4}}"#).unwrap());
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(7), READ, 1_000, 1));
        let wait = expect_wait(e.admit(&k(7), READ, 1_001, 2));
        e.complete(&leader, Some(Response::json(503, b"{}".to_vec())), 1_010);
        let later = 1_010 + crate::core::coalesce::lease::done_hold_ms(&config) + 1;
        // Its way taken by another prompt; a new request of the crowd's prompt leads again.
        let fill: Vec<Call> =
            (0..4).map(|i| expect_call(e.admit(&k(20 + i), READ, later, 10 + u64::from(i)))).collect();
        e.complete(&fill[0], ok("{}"), later + 1);
        let again = expect_call(e.admit(&k(7), READ, later + 2, 30));
        assert!(again.lease.is_some());
        // The waiter joins that live flight rather than leading a third.
        let joined = expect_wait(e.poll(&wait, later + 3, 31));
        assert_eq!(joined.nonce, 30);
        e.complete(&again, ok(r#"{"a":7}"#), later + 4);
        let r = expect_reply(e.poll(&joined, later + 5, 32));
        assert_eq!((r.response.status, r.cache), (200, Some(CacheStatus::Coalesced)));
        // A waiter whose leader is merely gone (its lease expired, its record still there)
        // has no outcome to lose: one waiter leads anew.
        let store = MemStore::new();
        let e = Engine { store: &store, config: &config };
        let abandoned = expect_call(e.admit(&k(8), READ, 1_000, 40));
        let w = expect_wait(e.admit(&k(8), READ, 1_001, 41));
        let expired = 1_000 + config.lock.lease_ms + 1;
        assert!(expect_call(e.poll(&w, expired, 42)).lease.is_some(), "leads anew");
        drop(abandoned);
    }

    #[test]
    fn a_stored_answer_is_not_repeated_in_the_lease_record_and_waiters_still_get_it() {
        let (store, config) = (MemStore::new(), Config::default());
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(3), READ, 1_000, 1));
        let wait = expect_wait(e.admit(&k(3), READ, 1_001, 2));
        let body = format!(r#"{{"answer":"{}"}}"#, "x".repeat(10_000));
        e.complete(&leader, ok(&body), 1_100);
        let record = store.get(&wait.slot.group).unwrap().value.unwrap();
        assert!(record.len() < 1_000, "the lease refers to the cache entry: {} bytes", record.len());
        let r = expect_reply(e.poll(&wait, 1_200, 3));
        assert_eq!((r.cache, r.response.body), (Some(CacheStatus::Coalesced), body.into_bytes()));
    }

    #[test]
    fn waiters_answered_together_read_their_flight_once_and_all_get_its_answer() {
        let config = Config::default();
        let store = Counting::new();
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(5), READ, 1_000, 1));
        let waits: Vec<Wait> = (0..3).map(|i| expect_wait(e.admit(&k(5), READ, 1_001 + i, 2 + i))).collect();
        e.complete(&leader, ok(r#"{"a":5}"#), 1_100);
        let mut kept = Finishing::default();
        let before = store.reads();
        let first = expect_reply(kept.poll(&e, &waits[0], 1_200, 10));
        let one_poll = store.reads() - before;
        // The slot is taken by the next flight and the entry evicted before the others look:
        // they still get the answer they waited for.
        store.inner.set(&waits[0].slot.group, b"", None).unwrap();
        for cached in store.inner.keys().into_iter().filter(|k| k.starts_with("holysheep/cache/")) {
            store.inner.set(&cached, b"", None).unwrap();
        }
        for w in &waits[1..] {
            let r = expect_reply(kept.poll(&e, w, 1_200, 11));
            assert_eq!((r.cache, &r.response.body), (Some(CacheStatus::Coalesced), &first.response.body));
        }
        assert_eq!(store.reads() - before, one_poll, "the other waiters read nothing");
        // A waiter of another flight is not answered from it (its own record is gone).
        let other = Wait { nonce: 99, ..waits[1].clone() };
        assert!(expect_reply(kept.poll(&e, &other, 1_200, 12)).lost_wait());
        kept.keep_for(waits.iter());
        assert_eq!(kept.0.len(), 1, "kept while any of its waiters is left");
        kept.keep_for(std::iter::empty());
        assert!(kept.0.is_empty(), "forgotten once none is");
    }

    #[test]
    fn a_request_that_missed_the_store_by_a_hair_takes_the_finished_flight_not_a_new_one() {
        let config = Config::default();
        let store = CacheReadTooEarly { inner: MemStore::new(), seen: std::cell::Cell::new(true) };
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(1), READ, 1_000, 1));
        e.complete(&leader, ok(r#"{"a":1}"#), 1_200);
        store.seen.set(false);
        let r = expect_reply(e.admit(&k(1), READ, 1_200, 2));
        assert_eq!((r.cache, r.response.body.as_slice()), (Some(CacheStatus::Coalesced), br#"{"a":1}"#.as_slice()));
    }

    #[test]
    fn a_request_that_read_the_cache_just_before_a_leader_that_dated_its_end_earlier_wrote_takes_its_answer() {
        let config = Config::default();
        let store = CacheReadTooEarly { inner: MemStore::new(), seen: std::cell::Cell::new(true) };
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(1), READ, 1_000, 1));
        // The leader dates its end at 1 200 and writes after the request (arrived at 1 250)
        // read the cache: the request takes the stored answer, not a second call.
        e.complete(&leader, ok(r#"{"a":1}"#), 1_200);
        store.seen.set(false);
        let r = expect_reply(e.admit(&k(1), READ, 1_250, 2));
        assert_eq!((r.cache, r.response.body.as_slice()), (Some(CacheStatus::Hit), br#"{"a":1}"#.as_slice()));
        // A request whose max-age refuses the entry is not handed it this way either.
        store.seen.set(false);
        let strict = Policy { max_age: Some(0), ..READ };
        assert!(matches!(e.admit(&k(1), strict, 2_300, 3), Step::Call(_)), "max-age=0 refuses a 1 s old answer");
    }

    #[test]
    fn a_flight_whose_entry_can_no_longer_be_fresh_is_taken_over_without_reading_the_cache_again() {
        let config = Config::default();
        let store = Counting::of_keys_starting("holysheep/cache/");
        let e = Engine { store: &store, config: &config };
        let leader = expect_call(e.admit(&k(1), READ, 1_000, 1));
        e.complete(&leader, ok(r#"{"a":1}"#), 1_200);
        let later = 1_200 + config.longest_fresh_ms();
        let reads = store.reads();
        assert!(matches!(e.admit(&k(1), READ, later, 2), Step::Call(_)), "the entry has expired");
        assert_eq!(store.reads() - reads, 2, "the arrival's reads only (its group and the expired entry)");
    }

    #[test]
    fn a_polling_waiter_backs_off_to_eight_ms() {
        let delays: Vec<u64> = (0..5).map(poll_delay_ms).collect();
        assert_eq!(delays, [2, 4, 8, 8, 8]);
        assert_eq!(poll_delay_ms(u32::MAX), 8);
    }

    #[test]
    fn a_paraphrases_fresh_answer_ends_the_flight_as_semantic_and_is_stored_under_no_key() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let asked = expect_call(e.admit(&k(1), READ, 0, 1));
        e.complete(&asked, ok(r#"{"a":"Paris"}"#), 1_000);
        let paraphrase = expect_call(e.admit(&k(2), READ, 3_000, 2));
        let waiter = expect_wait(e.admit(&k(2), READ, 3_001, 3));
        let similar = [Similar { key: k(9), similarity: 0.99 }, Similar { key: k(1), similarity: 0.97 }];
        let ended = e.end_similar(&paraphrase, &similar, 3_500).expect("the second is fresh");
        let r = &ended.reply;
        assert_eq!((r.cache, r.age_s, r.fresh_s), (Some(CacheStatus::Semantic), Some(2), None));
        assert_eq!((r.key.as_ref(), r.response.body.as_slice()), (Some(&k(2)), br#"{"a":"Paris"}"#.as_slice()));
        assert_eq!(r.response.header(headers::SIMILARITY), Some("0.9700"));
        assert!(ended.watched);
        let shared = expect_reply(e.poll(&waiter, 3_600, 4));
        assert_eq!((shared.cache, &shared.response.body), (Some(CacheStatus::Coalesced), &r.response.body));
        assert_eq!(shared.age_s, Some(2), "the age of the answer it is");
        assert!(matches!(e.admit(&k(2), READ, 9_000, 5), Step::Call(_)), "the paraphrase's own key holds nothing");
    }

    #[test]
    fn a_waiter_whose_directives_refuse_a_paraphrases_answer_leads_its_own_flight() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let asked = expect_call(e.admit(&k(1), READ, 0, 1));
        e.complete(&asked, ok("{}"), 0);
        let paraphrase = expect_call(e.admit(&k(2), READ, 9_000, 2));
        let no_cache = expect_wait(e.admit(&k(2), Policy { read: false, ..READ }, 9_001, 3));
        let young = expect_wait(e.admit(&k(2), Policy { max_age: Some(5), ..READ }, 9_001, 4));
        let fine = expect_wait(e.admit(&k(2), READ, 9_001, 5));
        e.end_similar(&paraphrase, &[Similar { key: k(1), similarity: 0.96 }], 9_010).expect("fresh");
        assert!(expect_call(e.poll(&no_cache, 9_020, 6)).lease.is_some(), "no-cache: leads a flight of its own");
        assert_eq!(expect_wait(e.poll(&young, 9_020, 7)).nonce, 6, "max-age=5: waits for that flight instead");
        assert_eq!(expect_reply(e.poll(&fine, 9_020, 8)).age_s, Some(9));
    }

    #[test]
    fn a_waiter_takes_its_own_flights_answer_whenever_it_reads_it_and_whatever_the_clocks_say() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        // max-age=0, woken a second after the flight ended.
        let lead = expect_call(e.admit(&k(9), READ, 0, 1));
        let zero = expect_wait(e.admit(&k(9), Policy { max_age: Some(0), ..READ }, 100, 2));
        e.complete(&lead, ok("A"), 10_000);
        assert_eq!(expect_reply(e.poll(&zero, 11_200, 3)).cache, Some(CacheStatus::Coalesced));
        // no-cache, on a worker whose clock is ahead of the leader's.
        let lead = expect_call(e.admit(&k(8), READ, 1_000, 4));
        let no_cache = expect_wait(e.admit(&k(8), Policy { read: false, ..READ }, 1_005, 5));
        e.complete(&lead, ok("A"), 1_003);
        assert_eq!(expect_reply(e.poll(&no_cache, 1_006, 6)).cache, Some(CacheStatus::Coalesced));
    }

    #[test]
    fn a_forward_nodes_waiters_take_a_relayed_answer_as_of_when_its_owner_produced_it() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"role":"forward"}"#).unwrap());
        let e = Engine { store: &s, config: &c };
        // A hop leaves at 100 s; the waiters arrive after it; its owner answers a HIT it
        // produced at 70 s (`age: 30`).
        let hop = expect_call(e.admit(&k(1), READ, 100_000, 1));
        let plain = expect_wait(e.admit(&k(1), READ, 100_100, 2));
        let no_cache = expect_wait(e.admit(&k(1), Policy { read: false, ..READ }, 100_100, 3));
        let young = expect_wait(e.admit(&k(1), Policy { max_age: Some(10), ..READ }, 100_100, 4));
        let old_enough = expect_wait(e.admit(&k(1), Policy { max_age: Some(60), ..READ }, 100_100, 5));
        let origin = Origin { produced_ms: 70_000, aged: true, stale: false };
        e.end_relayed(&hop, ok("{}"), 100_200, None, Some(origin));
        let r = expect_reply(e.poll(&plain, 100_300, 6));
        assert_eq!((r.cache, r.age_s), (Some(CacheStatus::Coalesced), Some(30)), "its owner's age, not 0");
        assert_eq!(expect_reply(e.poll(&old_enough, 100_300, 7)).age_s, Some(30));
        // As on the owner: no-cache and max-age=10 refuse a 30-second-old answer, and the
        // first of them leads a hop of its own (the other waits on it).
        assert!(expect_call(e.poll(&no_cache, 100_300, 8)).lease.is_some(), "no-cache leads its own hop");
        assert_eq!(expect_wait(e.poll(&young, 100_300, 9)).nonce, 8, "max-age=10 waits on that hop");

        // A STALE answer the owner served in place of a failure: STALE for a plain waiter,
        // refused by no-cache.
        let hop = expect_call(e.admit(&k(2), READ, 200_000, 10));
        let plain = expect_wait(e.admit(&k(2), READ, 200_100, 11));
        let no_cache = expect_wait(e.admit(&k(2), Policy { read: false, ..READ }, 200_100, 12));
        e.end_relayed(&hop, ok("{}"), 200_200, None, Some(Origin { produced_ms: 150_000, aged: true, stale: true }));
        let r = expect_reply(e.poll(&plain, 200_300, 13));
        assert_eq!((r.cache, r.age_s), (Some(CacheStatus::Stale), Some(50)));
        assert!(expect_call(e.poll(&no_cache, 200_300, 14)).lease.is_some(), "no-cache refuses a stale answer");
    }

    #[test]
    fn a_paraphrase_whose_answer_is_gone_or_too_old_for_the_request_does_not_end_the_flight() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"cache":{"ttl_seconds":10}}"#).unwrap());
        let e = Engine { store: &s, config: &c };
        let asked = expect_call(e.admit(&k(1), READ, 0, 1));
        e.complete(&asked, ok("{}"), 0);
        let similar = [Similar { key: k(1), similarity: 1.0 }];
        let young = Policy { max_age: Some(5), ..READ };
        let picky = expect_call(e.admit(&k(2), young, 6_000, 2));
        assert!(e.end_similar(&picky, &similar, 6_000).is_none(), "older than max-age=5");
        let late = expect_call(e.admit(&k(3), READ, 10_001, 3));
        assert!(e.end_similar(&late, &similar, 10_001).is_none(), "expired");
    }

    #[test]
    fn miss_then_coalesced_then_hit() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        assert_eq!(lead.label, CacheStatus::Miss);
        assert!(lead.lease.is_some());
        let w = expect_wait(e.admit(&k(1), READ, 5, 2));
        assert_eq!(w.nonce, 1);
        expect_wait(e.poll(&w, 10, 3));
        let mine = e.complete(&lead, ok("A"), 1_000);
        assert_eq!((mine.cache, mine.fresh_s), (Some(CacheStatus::Miss), Some(3_600)), "stored for the TTL");
        let theirs = expect_reply(e.poll(&w, 1_500, 4));
        assert_eq!(theirs.cache, Some(CacheStatus::Coalesced));
        assert_eq!(theirs.response.body, b"A");
        assert_eq!((theirs.age_s, theirs.fresh_s), (Some(0), Some(3_599)));
        let hit = expect_reply(e.admit(&k(1), READ, 3_200, 5));
        assert_eq!(hit.cache, Some(CacheStatus::Hit));
        assert_eq!(hit.age_s, Some(2));
        let headers: Vec<_> = hit.headers().into_iter().map(|(n, v)| (n, v.into_owned())).collect();
        let names: Vec<_> = headers.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["content-type", "x-holysheep-cache", "cache-control", "x-holysheep-key", "age"]);
        assert_eq!(headers[2].1, "max-age=3597", "what is left of its TTL, in whole seconds");
    }

    #[test]
    fn an_answer_not_stored_says_so() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let bypass = Policy { read: false, coalesce: false, store: false, ..READ };
        let call = expect_call(e.admit(&k(1), bypass, 0, 1));
        let reply = e.complete(&call, ok("A"), 10);
        assert_eq!((reply.cache, reply.fresh_s), (Some(CacheStatus::Bypass), None));
        assert!(reply.headers().contains(&("cache-control", "no-store".into())));
        assert!(!Reply::plain(Response::json(404, vec![])).headers().iter().any(|(n, _)| *n == "cache-control"));
    }

    #[test]
    fn an_answer_dated_back_by_its_owner_is_kept_for_its_own_time_and_reaches_its_waiters() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"role":"forward"}"#).unwrap());
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 100_000, 1));
        let w = expect_wait(e.admit(&k(1), READ, 100_005, 2));
        // The owner produced it 30 s ago and keeps it 10 s more.
        let fresh = Fresh { stored_at_ms: 70_000, ttl_ms: 40_000 };
        let ended = e.end_flight(&lead, ok("A"), 100_010, Some(fresh));
        assert_eq!((ended.reply.fresh_s, ended.watched, ended.evicted), (Some(9), true, false));
        let theirs = expect_reply(e.poll(&w, 100_020, 3));
        assert_eq!((theirs.cache, theirs.response.body.as_slice()), (Some(CacheStatus::Coalesced), &b"A"[..]));
        let hit = expect_reply(e.admit(&k(1), READ, 105_000, 4));
        assert_eq!((hit.age_s, hit.fresh_s), (Some(35), Some(5)), "its age counts from the owner's answer");
        assert!(matches!(e.admit(&k(1), READ, 110_000, 5), Step::Call(_)), "gone when the owner's copy is");
        let lead = expect_call(e.admit(&k(2), READ, 0, 6));
        let ended = e.end_flight(&lead, ok("B"), 10, None);
        assert_eq!(ended.reply.fresh_s, None, "not declared storable: not kept");
        assert!(matches!(e.admit(&k(2), READ, 20, 7), Step::Call(_)));
        let lead = expect_call(e.admit(&k(3), READ, 0, 8));
        let ended = e.end_flight(&lead, ok("C"), 5_000, Some(Fresh { stored_at_ms: 0, ttl_ms: 5_000 }));
        assert_eq!(ended.reply.fresh_s, None, "fresh no more when it arrived: not stored");
    }

    #[test]
    fn a_forward_node_serves_no_copy_past_its_owners_ttl_when_the_owner_fails() {
        let (s, c) = (MemStore::new(), Config::parse(br#"{"role":"forward","stale_if_error_seconds":600}"#).unwrap());
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        e.end_flight(&lead, ok("A"), 0, Some(Fresh { stored_at_ms: 0, ttl_ms: 1_000 }));
        let lead = expect_call(e.admit(&k(1), READ, 2_000, 2));
        let mut failed = ok("{}").unwrap();
        failed.status = 503;
        let reply = e.end_flight(&lead, Some(failed), 2_010, None).reply;
        assert_eq!(
            (reply.response.status, reply.cache),
            (503, Some(CacheStatus::Miss)),
            "the owner's error, not STALE"
        );
    }

    #[test]
    fn a_failed_flight_reaches_its_waiters_and_is_not_cached() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        let w = expect_wait(e.admit(&k(1), READ, 0, 2));
        let mut err = ok("{\"error\":{}}").unwrap();
        err.status = 503;
        let err = err.with_header("retry-after", "2".into());
        assert_eq!(e.complete(&lead, Some(err.clone()), 10).response.status, 503);
        let theirs = expect_reply(e.poll(&w, 11, 3));
        assert_eq!(theirs.response, err);
        assert!(theirs.headers().contains(&("retry-after", "2".into())));
        // Nothing cached: the next request leads again.
        expect_call(e.admit(&k(1), READ, 12, 4));
    }

    #[test]
    fn non_json_upstream_errors_become_openai_errors() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        let text = Response {
            status: 503,
            content_type: "text/plain".into(),
            headers: vec![("retry-after".into(), "1".into())],
            body: b"upstream connect error or disconnect/reset before headers".to_vec(),
        };
        let r = e.complete(&lead, Some(text), 5);
        assert_eq!((r.response.status, r.response.content_type.as_str()), (503, "application/json"));
        assert_eq!(r.response.header("retry-after"), Some("1"));
        let v: serde_json::Value = serde_json::from_slice(&r.response.body).unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("upstream connect error"));
    }

    #[test]
    fn stale_if_error_serves_an_expired_entry_within_its_bound() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.cache.ttl_seconds = 10;
        c.stale_if_error_seconds = 5;
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        e.complete(&lead, ok("old"), 0);
        let lead = expect_call(e.admit(&k(1), READ, 12_000, 2));
        let w = expect_wait(e.admit(&k(1), READ, 12_000, 3));
        let r = e.complete(&lead, Some(Response::json(503, b"{}".to_vec())), 12_000);
        assert_eq!((r.cache, r.age_s, r.response.body.as_slice()), (Some(CacheStatus::Stale), Some(12), &b"old"[..]));
        assert_eq!(expect_reply(e.poll(&w, 12_001, 4)).response.body, b"old", "waiters get the stale answer too");
        let lead = expect_call(e.admit(&k(1), READ, 15_000, 5));
        assert_eq!(e.complete(&lead, None, 15_000).response.status, 502, "past ttl + stale bound");
    }

    #[test]
    fn callout_failure_is_502_or_504_by_elapsed_time() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        assert_eq!(e.complete(&lead, None, 10).response.status, 502);
        let lead = expect_call(e.admit(&k(1), READ, 100, 2));
        let r = e.complete(&lead, None, 100 + c.upstream.timeout_ms - CLOCK_SLACK_MS);
        assert_eq!(r.response.status, 504);
        let v: serde_json::Value = serde_json::from_slice(&r.response.body).unwrap();
        assert_eq!(v["error"]["code"], "upstream_timeout");
    }

    #[test]
    fn a_waiter_takes_over_an_expired_lease() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let dead = expect_call(e.admit(&k(1), READ, 0, 1));
        let w = expect_wait(e.admit(&k(1), READ, 0, 2));
        let takeover = expect_call(e.poll(&w, c.lock.lease_ms, 3));
        assert_eq!(takeover.lease.as_ref().map(|l| l.nonce), Some(3));
        assert!(takeover.store);
        // The dead leader, if it ever returns, does not clobber the new flight.
        assert!(!e.renew(&dead, c.lock.lease_ms + 1));
    }

    #[test]
    fn wait_timeout_goes_upstream_alone_without_storing() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        let w = expect_wait(e.admit(&k(1), READ, 0, 2));
        // Keep the leader alive past the wait timeout.
        let mut now = 0;
        while now < c.lock.wait_timeout_ms {
            now += 1_000;
            assert!(e.renew(&lead, now));
        }
        let solo = expect_call(e.poll(&w, now, 3));
        assert!(solo.lease.is_none() && !solo.store);
        e.complete(&solo, ok("solo"), now);
        assert!(cache::get(&s, &c, &k(1)).is_none());
    }

    #[test]
    fn cache_control_is_honoured() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        e.complete(&lead, ok("A"), 0);
        let policy = |h: &str| {
            let cc = CacheControl::parse(Some(h));
            Policy {
                read: !cc.no_store && !cc.no_cache,
                max_age: cc.max_age,
                coalesce: !cc.no_store,
                store: !cc.no_store,
                ..READ
            }
        };
        let bypass = expect_call(e.admit(&k(1), policy("no-store"), 1_000, 2));
        assert_eq!(bypass.label, CacheStatus::Bypass);
        assert!(bypass.lease.is_none() && !bypass.store);
        let fresh = expect_call(e.admit(&k(1), policy("no-cache"), 1_000, 3));
        assert!(fresh.lease.is_some() && fresh.store);
        e.complete(&fresh, ok("B"), 10_000);
        expect_call(e.admit(&k(1), policy("max-age=5"), 16_000, 4));
        let r = expect_reply(e.admit(&k(1), policy("max-age=10"), 16_000, 5));
        assert_eq!((r.response.body.as_slice(), r.age_s), (&b"B"[..], Some(6)));
    }

    /// Envoy's clock advances once per event-loop turn: a request may arrive in the very
    /// millisecond the last flight of its prompt ended.
    #[test]
    fn a_no_cache_request_in_the_millisecond_a_flight_ended_still_goes_upstream() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        e.complete(&lead, ok("A"), 5);
        let no_cache = Policy { read: false, ..READ };
        let fresh = expect_call(e.admit(&k(1), no_cache, 5, 2));
        assert_eq!((fresh.label, fresh.lease.is_some()), (CacheStatus::Miss, true), "not the finished flight's answer");
    }

    #[test]
    fn an_answer_not_stored_is_not_taken_by_a_request_that_arrived_as_it_ended() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let unstored = Policy { store: false, ..READ };
        let lead = expect_call(e.admit(&k(1), unstored, 0, 1));
        let w = expect_wait(e.admit(&k(1), READ, 1, 2));
        e.complete(&lead, ok("A"), 5);
        // The request that waited for it gets it.
        let r = expect_reply(e.poll(&w, 5, 3));
        assert_eq!((r.cache, r.response.body), (Some(CacheStatus::Coalesced), b"A".to_vec()));
        // One that arrived in the millisecond the flight ended (Envoy's clock moves per
        // event-loop turn) does not: the cache would not have had it either.
        let next = expect_call(e.admit(&k(1), READ, 5, 4));
        assert_eq!((next.label, next.lease.is_some()), (CacheStatus::Miss, true), "not the unstored answer");
    }

    #[test]
    fn a_no_cache_waiter_accepts_the_flight_it_waited_for_from_the_cache() {
        let (s, c) = (MemStore::new(), Config::default());
        let e = Engine { store: &s, config: &c };
        let no_cache = Policy { read: false, ..READ };
        let lead = expect_call(e.admit(&k(1), READ, 0, 1));
        let w = expect_wait(e.admit(&k(1), no_cache, 0, 2));
        e.complete(&lead, ok("A"), 10);
        // Someone else took the slot for a new flight before the waiter looked.
        expect_call(e.admit(&k(1), Policy { read: false, ..READ }, 11, 9));
        let r = expect_reply(e.poll(&w, 12, 3));
        assert_eq!(r.cache, Some(CacheStatus::Coalesced));
        assert_eq!(r.response.body, b"A");
    }

    #[test]
    fn shared_data_keys_are_bounded_by_the_tables() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.cache.max_entries = 16;
        c.lock.slots = 4;
        let e = Engine { store: &s, config: &c };
        for i in 0..=255u8 {
            if let Step::Call(call) = e.admit(&k(i), READ, u64::from(i), u64::from(i)) {
                e.complete(&call, ok("x"), u64::from(i));
            }
        }
        // 16 entries, an index and a ghost record per 4 of them, one lease group of 4 ways.
        assert!(s.key_count() <= 16 + 4 + 4 + 1, "{:?}", s.keys());
    }
}
