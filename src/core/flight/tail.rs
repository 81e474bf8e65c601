//! A leader's event stream shared live with its flight's followers. The leader appends
//! HolySheep's events to the flight's `Log` as they arrive, untouched; each follower reads
//! the log at its own pace through its own `Reader`, which rewrites the events as its own
//! client asked (the usage event, signed ids). A follower that joins mid-stream reads from
//! the first byte, then live. The log is bounded: past its bound it takes no more, a
//! follower that has begun gets a clean error event where it stops, and one that has not
//! waits for the flight's whole answer instead. The leader never waits for a follower:
//! what a follower has not read yet is the log's, shared, not a queue of its own. The log
//! keeps HolySheep's chunks as they came, each shared (`Arc`), so that a follower takes
//! what it has not read without copying it where the leader writes.

use super::tee::{Events, StreamLabel};
use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::reply::{stream_head, CacheStatus};
use crate::core::config::Config;
use crate::core::stream::Reassembler;
use crate::core::upstream::Outbound;
use std::sync::Arc;

/// How many bytes of events a log holds for each byte of the largest answer kept: events
/// carry several times the bytes of the answer they assemble into.
const EVENT_BYTES_PER_ANSWER_BYTE: usize = 8;

/// How a log ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailEnd {
    /// HolySheep's stream came to its end.
    Complete,
    /// It broke off: reset, timed out, or the leader's client left (its call goes with it).
    Cut,
    /// It outgrew the log's bound.
    Overflowed,
}

/// A leader's events as they came, for its followers.
#[derive(Debug)]
pub struct Log {
    /// The flight's lease (its nonce): a follower joins only the tail of the flight it
    /// waits for.
    nonce: u64,
    key: String,
    model: String,
    tenant: Option<String>,
    fresh_s: Option<u64>,
    chunks: Vec<Arc<[u8]>>,
    bytes: usize,
    limit: usize,
    end: Option<TailEnd>,
}

impl Log {
    /// The log of the stream `label` describes, for the flight whose lease is `nonce`,
    /// bounded by the configured largest answer (`Log::limit`).
    pub fn new(config: &Config, label: &StreamLabel, nonce: u64) -> Log {
        Log {
            nonce,
            key: label.key.clone(),
            model: label.model.clone(),
            tenant: label.tenant.clone(),
            fresh_s: label.fresh_s,
            chunks: Vec::new(),
            bytes: 0,
            limit: Log::limit(config),
            end: None,
        }
    }

    /// The most bytes of events one log holds.
    pub fn limit(config: &Config) -> usize {
        config.cache.max_entry_bytes.saturating_mul(EVENT_BYTES_PER_ANSWER_BYTE)
    }

    /// Whether a stream of this request is shared live with its flight's followers: a
    /// stream whose events the edge assembles, so that its followers are answered with it.
    pub fn shares(outbound: &Outbound) -> bool {
        outbound.stream && outbound.endpoint.streams_shared()
    }

    /// Appends a chunk as HolySheep sent it, or, past the bound, ends `Overflowed` and
    /// takes nothing more. The bytes it took.
    pub fn push(&mut self, chunk: &[u8]) -> usize {
        if self.end.is_some() || chunk.is_empty() {
            return 0;
        }
        if self.bytes.saturating_add(chunk.len()) > self.limit {
            self.end = Some(TailEnd::Overflowed);
            return 0;
        }
        self.bytes += chunk.len();
        self.chunks.push(chunk.into());
        chunk.len()
    }

    /// Takes nothing more: the host's room for logs is full (see `push`).
    pub fn overflow(&mut self) {
        self.end.get_or_insert(TailEnd::Overflowed);
    }

    /// The stream ended (`complete`: its last byte came); an end already there stands.
    pub fn end(&mut self, complete: bool) {
        self.end.get_or_insert(if complete { TailEnd::Complete } else { TailEnd::Cut });
    }

    pub fn ended(&self) -> Option<TailEnd> {
        self.end
    }

    /// The model that answers.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Bytes of events it holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether a follower of the flight `nonce` that has not begun may begin on it: one
    /// that is cut or overflowed would only give it an error, where the flight's end gives
    /// it an answer.
    pub fn joinable(&self, nonce: u64) -> bool {
        self.nonce == nonce && matches!(self.end, None | Some(TailEnd::Complete))
    }

    /// The chunks from the `at`th on, and the end if it came.
    pub fn since(&self, at: usize) -> (&[Arc<[u8]>], Option<TailEnd>) {
        (self.chunks.get(at..).unwrap_or_default(), self.end)
    }

    /// The head a follower's client gets: a 200 of events with the edge's labels, the
    /// follower's `extra` headers beside them (one of each name).
    pub fn head(&self, extra: Vec<(&'static str, String)>) -> Vec<(String, String)> {
        let mut head = vec![
            (":status".to_owned(), "200".to_owned()),
            (headers::CONTENT_TYPE.to_owned(), headers::EVENT_STREAM.to_owned()),
        ];
        let labels = stream_head(CacheStatus::Coalesced, &self.key, &self.model, self.tenant.as_deref(), self.fresh_s);
        for (name, value) in labels.into_iter().chain(extra) {
            if !head.iter().any(|(n, _)| n == name) {
                head.push((name.to_owned(), value));
            }
        }
        head
    }
}

/// One follower reading a log.
pub struct Reader {
    events: Events,
    at: usize,
    done: bool,
}

/// What a follower's client gets next.
#[derive(Debug, PartialEq, Eq)]
pub struct Read {
    pub bytes: Vec<u8>,
    /// Its stream ends with these bytes ...
    pub last: bool,
    /// ... as HolySheep's did (not cut off, nor past the bound).
    pub complete: bool,
}

impl Reader {
    /// A reader for the follower `outbound` (its own usage event, its own signed ids). It
    /// assembles nothing: the leader does.
    pub fn new(config: &Config, outbound: &Outbound) -> Reader {
        let signer = config.signer(outbound.endpoint, outbound.tenant.as_deref());
        let events = Reassembler::of(outbound.endpoint, outbound.include_usage).passing().signing(signer);
        Reader { events: Events::new(events), at: 0, done: false }
    }

    /// The `usage` its stream carried so far.
    pub fn usage(&self) -> Option<crate::core::api::usage::Usage> {
        self.events.usage()
    }

    /// How many of the log's chunks it has read.
    pub fn at(&self) -> usize {
        self.at
    }

    /// Reads `new`, the log's chunks from `at()` on, and its `end`: the events its client
    /// gets now, and whether its stream ends with them. After a cut or an overflow it ends
    /// with an error event, which OpenAI's SDKs raise.
    pub fn read(&mut self, new: &[Arc<[u8]>], end: Option<TailEnd>) -> Read {
        if self.done {
            return Read { bytes: Vec::new(), last: true, complete: false };
        }
        self.at = self.at.saturating_add(new.len());
        let complete = end == Some(TailEnd::Complete);
        let mut bytes = Vec::new();
        for (i, chunk) in new.iter().enumerate() {
            let last = complete && i + 1 == new.len();
            bytes.extend(self.events.pass(chunk, last).unwrap_or_else(|| chunk.to_vec()));
        }
        if complete && new.is_empty() {
            bytes.extend(self.events.pass(&[], true).unwrap_or_default());
        }
        self.done = end.is_some();
        match end {
            Some(TailEnd::Cut) => bytes.extend(cut_event()),
            Some(TailEnd::Overflowed) => bytes.extend(error_event(&ApiError::server(
                "the answer outgrew what the edge shares live; ask again",
                "stream_too_large",
            ))),
            _ => {}
        }
        Read { bytes, last: self.done, complete }
    }
}

/// The event that ends a stream which broke off before its end.
pub fn cut_event() -> Vec<u8> {
    error_event(&ApiError::server("the answer broke off before it ended; ask again", "stream_cut"))
}

/// `e` as a server-sent event.
fn error_event(e: &ApiError) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    out.extend(e.body());
    out.extend_from_slice(b"\n\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::api::endpoint::Endpoint;
    use crate::core::request::ApiRequest;
    use crate::core::upstream::Sent;

    fn label() -> StreamLabel {
        StreamLabel {
            cache: CacheStatus::Miss,
            key: "k1".into(),
            model: "gpt-4.1".into(),
            include_usage: true,
            sent: Sent { stream: true, operator_key: true, ..Sent::default() },
            tenant: Some("acme".into()),
            fresh_s: Some(60),
            signer: None,
        }
    }

    fn follower(include_usage: bool) -> Outbound {
        let body = format!(
            r#"{{"model":"gpt-4.1","messages":[{{"role":"user","content":"hi"}}],"stream":true,"stream_options":{{"include_usage":{include_usage}}}}}"#
        );
        let request = ApiRequest::parse(&Config::default(), &Default::default(), Endpoint::Chat, body.as_bytes());
        let request = request.unwrap_or_else(|e| panic!("{e:?}"));
        Outbound::of(&request, body.into_bytes(), None)
    }

    const ROLE: &[u8] = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";
    const WORD: &[u8] = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\n";
    const USAGE: &[u8] = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\n";
    const DONE: &[u8] = b"data: [DONE]\n\n";

    fn contains(hay: &[u8], needle: &[u8]) -> bool {
        hay.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn a_follower_that_joins_late_gets_what_was_sent_then_the_rest_in_its_own_form() {
        let config = Config::default();
        let mut log = Log::new(&config, &label(), 7);
        assert!(log.joinable(7) && !log.joinable(8), "only the followers of its own flight join");
        // The first event, split inside it as HolySheep may send it.
        log.push(&ROLE[..20]);
        log.push(&ROLE[20..]);
        let mut early = Reader::new(&config, &follower(false));
        let (new, end) = log.since(early.at());
        assert_eq!(
            early.read(new, end),
            Read { bytes: ROLE.to_vec(), last: false, complete: false },
            "live, whole events"
        );
        log.push(WORD);
        log.push(USAGE);
        // A follower joining now gets everything so far at once.
        let mut late = Reader::new(&config, &follower(true));
        let (new, end) = log.since(late.at());
        let got = late.read(new, end);
        assert!(!got.last);
        assert!(
            got.bytes.starts_with(ROLE) && contains(&got.bytes, USAGE),
            "from the first byte, usage asked for: {}",
            String::from_utf8_lossy(&got.bytes)
        );
        let (new, end) = log.since(early.at());
        let got = early.read(new, end);
        assert!(contains(&got.bytes, WORD) && !contains(&got.bytes, USAGE), "no usage event unless asked");
        log.push(DONE);
        let (new, end) = log.since(late.at());
        assert_eq!(
            late.read(new, end),
            Read { bytes: Vec::new(), last: false, complete: false },
            "[DONE] waits for the end"
        );
        log.end(true);
        for reader in [&mut early, &mut late] {
            let (new, end) = log.since(reader.at());
            assert_eq!(reader.read(new, end), Read { bytes: DONE.to_vec(), last: true, complete: true });
        }
    }

    #[test]
    fn a_cut_ends_each_follower_with_an_error_event_and_an_overflow_too() {
        let config = Config::default();
        let mut log = Log::new(&config, &label(), 7);
        log.push(ROLE);
        let mut reader = Reader::new(&config, &follower(false));
        let (new, end) = log.since(reader.at());
        reader.read(new, end);
        log.end(false);
        log.end(true);
        assert_eq!(log.ended(), Some(TailEnd::Cut), "the first end stands");
        assert!(!log.joinable(7), "a cut log takes no new follower");
        let (new, end) = log.since(reader.at());
        let got = reader.read(new, end);
        assert!(got.last && !got.complete);
        let text = String::from_utf8_lossy(&got.bytes).into_owned();
        assert!(
            text.starts_with("data: {\"error\":") && text.contains("stream_cut") && text.ends_with("\n\n"),
            "{text}"
        );

        let mut small = Config::default();
        small.cache.max_entry_bytes = 25;
        let mut log = Log::new(&small, &label(), 7);
        assert!(ROLE.len() <= 200 && ROLE.len() + WORD.len() > 200, "the test's bound falls in the second event");
        log.push(ROLE);
        log.push(WORD);
        log.push(DONE);
        assert_eq!(log.ended(), Some(TailEnd::Overflowed));
        assert_eq!(log.since(0).0.concat(), ROLE, "nothing past the bound is kept");
        let mut reader = Reader::new(&small, &follower(false));
        let (new, end) = log.since(reader.at());
        let got = reader.read(new, end);
        assert!(got.last && !got.complete && got.bytes.starts_with(ROLE));
        assert!(contains(&got.bytes, b"stream_too_large"));
    }

    #[test]
    fn a_followers_head_says_coalesced_with_its_own_headers_beside_once() {
        let log = Log::new(&Config::default(), &label(), 7);
        let head =
            log.head(vec![("x-holysheep-tenant", "acme".into()), ("x-ratelimit-remaining-requests", "9".into())]);
        let value = |n: &str| head.iter().filter(|(h, _)| h == n).map(|(_, v)| v.as_str()).collect::<Vec<_>>();
        assert_eq!(value(":status"), ["200"]);
        assert_eq!(value("content-type"), ["text/event-stream"]);
        assert_eq!(value("x-holysheep-cache"), ["COALESCED"]);
        assert_eq!(value("x-holysheep-key"), ["k1"]);
        assert_eq!(value("x-holysheep-tenant"), ["acme"], "once");
        assert_eq!(value("x-ratelimit-remaining-requests"), ["9"]);
        assert_eq!(value("cache-control"), ["max-age=60"]);
    }
}
