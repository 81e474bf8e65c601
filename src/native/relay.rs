//! A leader's streaming call as its answer comes in parts. A 200 of events goes to the
//! leader's own client as it arrives, rewritten as the core says (`StreamLabel::relayed`),
//! and, untouched, to the flight's live tail for its followers; anything else is gathered
//! whole and read like a one-shot callout's answer (a retry or a failover may follow).
//! The call does not wait for its client: a client that falls behind by more than a
//! tail's bound (`Log::limit`) while Envoy holds more than its buffer for it is sent an
//! error event and nothing more, and the call goes on for the cache and the followers.

use super::abi::EnvoyFilter;
use super::host;
use super::tails::Publisher;
use super::wake;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::usage::Usage;
use crate::core::coalesce::engine::Engine;
use crate::core::config::Config;
use crate::core::flight::leader::{Leader, Over};
use crate::core::flight::tail::{cut_event, Log};
use crate::core::flight::tee::Events;
use crate::core::store::CasStore;

/// Bytes of an answer that is not a 200 of events kept (HolySheep's errors are small).
const WHOLE_BODY_LIMIT: usize = 1 << 20;

/// A streaming call's answer, as far as it came.
pub enum Answer {
    /// Not a 200 of events: gathered, for the core to read when it ends.
    Whole { headers: Vec<(String, String)>, body: Vec<u8> },
    /// A 200 of events, relayed as it comes.
    Live(Box<Live>),
}

/// How a relayed stream ended: the flight's end, the usage the stream carried, and the
/// client's last events (`None`: it fell too far behind, and was sent its end already).
pub struct Finished {
    pub over: Over,
    pub usage: Option<Usage>,
    pub last: Option<Vec<u8>>,
}

pub struct Live {
    events: Events,
    hints: ProviderHints,
    tail: Option<Publisher>,
    /// Bytes sent to the client since Envoy last held less than its buffer for it, and the
    /// most it may fall behind; `None` once it fell further (it is sent nothing more).
    behind: Option<usize>,
    limit: usize,
}

impl Answer {
    /// The answer's head arrived: a 200 of events starts the client's answer (and the
    /// flight's tail, when it has followers to share with); anything else is gathered.
    pub fn begin(envoy: EnvoyFilter, config: &Config, leader: &Leader, headers: Vec<(String, String)>) -> Answer {
        let status = headers::status(&headers);
        let events = headers::value(&headers, headers::CONTENT_TYPE).is_some_and(headers::is_event_stream);
        let label = leader.stream_label(config).filter(|_| status == Some(200) && events);
        let Some(label) = label else { return Answer::Whole { headers, body: Vec::new() } };
        let hints = ProviderHints::from_headers(200, &headers);
        let (head, events) = label.relayed();
        let mut sent = vec![(":status".to_owned(), "200".to_owned())];
        sent.extend(head);
        host::send_head(envoy, &sent);
        let nonce = leader.call().lease.as_ref().map(|l| l.nonce).filter(|_| Log::shares(&leader.outbound));
        let tail = nonce.and_then(|n| Publisher::open(config, &label.key, Log::new(config, &label, n)));
        if tail.is_some() {
            wake::tail_began(&label.key);
        }
        Answer::Live(Box::new(Live { events, hints, tail, behind: Some(0), limit: Log::limit(config) }))
    }

    /// The next part of its body (`pressure`: Envoy holds more than its buffer for the
    /// client).
    pub fn pass(&mut self, envoy: EnvoyFilter, chunk: Vec<u8>, pressure: bool) {
        match self {
            Answer::Whole { body, .. } => {
                let room = WHOLE_BODY_LIMIT.saturating_sub(body.len());
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Answer::Live(live) => {
                if let Some(tail) = &live.tail {
                    tail.push(&chunk);
                }
                let out = live.events.pass(&chunk, false).unwrap_or(chunk);
                let Some(behind) = live.behind.as_mut() else { return };
                *behind = if pressure { behind.saturating_add(out.len()) } else { 0 };
                if *behind > live.limit {
                    live.behind = None;
                    host::send_data(envoy, &cut_event(), true);
                } else if !out.is_empty() {
                    host::send_data(envoy, &out, false);
                }
            }
        }
    }
}

impl Live {
    /// The stream ended (`complete`: its last byte came). The answer is shared first (the
    /// cache, the flight's waiters, the tail's end); the client's last events, for the
    /// caller to send once it has counted and published the answer: a client that stops
    /// reading at `[DONE]` asks again only once that is a HIT. A stream that broke off ends
    /// with an error event.
    pub fn finish<S: CasStore>(
        self: Box<Self>,
        engine: &Engine<'_, S>,
        leader: &mut Leader,
        complete: bool,
    ) -> Finished {
        let Live { mut events, hints, tail, behind, .. } = *self;
        let last = match complete {
            true => events.pass(&[], true).unwrap_or_default(),
            false => cut_event(),
        };
        let end = events.end(complete, (Some(200), 1), hints);
        let usage = end.usage;
        let over = leader.on_stream_end(engine, end, wake::now_ms());
        if let Some(tail) = tail {
            tail.end(complete);
        }
        Finished { over, usage, last: behind.map(|_| last) }
    }

    /// The leader's client left mid-stream: how far the stream got, for what it is charged
    /// (its tail is cut as it is dropped).
    pub fn abandon(self: Box<Self>) -> crate::core::flight::tee::StreamEnd {
        self.events.end(false, (Some(200), 1), self.hints)
    }
}
