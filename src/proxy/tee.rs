//! The tee of a stream forwarded along the route: HolySheep's answer passes to the leader's
//! client as it streams while it is reassembled (events) or gathered (anything else) for
//! the cache and the flight's waiters.

use super::runs::StreamEnd;
use crate::core::api::hints::ProviderHints;
use crate::core::api::response::Response;
use crate::core::api::usage::Billed;
use crate::core::stream::Reassembler;

/// Bytes of a streamed call's error answer kept for its waiters.
const ERROR_BODY_LIMIT: usize = 65_536;

/// What the tee keeps of a forwarded stream's answer.
pub struct Tee {
    /// Server-sent events (a 200): reassembled.
    events: Option<Reassembler>,
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
    /// Events from `[DONE]` on, held until the stream's end.
    held: Vec<u8>,
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
            events,
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
            held: Vec::new(),
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
        let streamed_tokens = self.events.as_ref().map_or(0, Reassembler::streamed_tokens_estimate);
        let usage = self.events.as_ref().and_then(Reassembler::usage);
        let outcome = match (&self.events, complete) {
            (_, false) => None,
            (Some(r), true) => r.completion(),
            (None, true) if self.cut && self.other.status == 200 => None,
            (None, true) => Some(self.other),
        };
        StreamEnd { outcome, usage, streamed_tokens, status: self.status, attempts: self.attempts, hints: self.hints }
    }

    /// The bytes the client gets for this chunk of HolySheep's answer (`None`: as they are).
    pub fn pass(&mut self, chunk: &[u8], end_of_stream: bool) -> Option<Vec<u8>> {
        if let Some(events) = &mut self.events {
            let mut out = events.push(chunk);
            if end_of_stream {
                out.extend(events.flush());
            }
            // From `[DONE]` on, the bytes wait for the stream's end, where the answer is
            // shared first: a client that stops reading at `[DONE]` (the SDKs do) sends its
            // next request only when that is a HIT.
            if events.done() && !end_of_stream {
                self.held.append(&mut out);
                return Some(Vec::new());
            }
            if !self.held.is_empty() {
                self.held.append(&mut out);
                return Some(std::mem::take(&mut self.held));
            }
            return (out != chunk).then_some(out);
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
