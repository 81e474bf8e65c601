//! HolySheep as the simulator meets it: what one attempt is answered (or not), what
//! HolySheep billed for it, and what the edge must charge for it. The answers are built as
//! the shells build them (`upstream::response`, `ProviderHints::unsent`), so the core reads
//! them exactly as in production.

use super::rng::Rng;
use crate::core::api::hints::ProviderHints;
use crate::core::api::response::Response;
use crate::core::api::usage::Usage;
use crate::core::flight::tee::StreamEnd;
use crate::core::upstream::{self, Sent};

/// How the simulated calls go: through the edge's own Envoy, as the proxy's callouts do.
const ENVOY: Sent =
    Sent { endpoint: crate::core::api::endpoint::Endpoint::Chat, stream: false, operator_key: true, envoy: true };

/// What happens to one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The endpoint's answer, with its usage.
    Answer,
    /// HolySheep answered and billed, then the connection dropped: the edge sees no answer.
    BilledThenReset,
    /// A 200 that is not the endpoint's object, carrying `usage`.
    OtherObjectWithUsage,
    /// A 5xx carrying `usage`.
    ServerErrorWithUsage,
    /// HolySheep's own JSON 5xx: nothing billed.
    ServerError,
    /// HolySheep's 429 with `retry-after`: nothing billed.
    Throttled,
    /// The callout was refused at dispatch.
    DispatchRefused,
    /// Envoy could not connect (`reset reason: remote connection failure`).
    ConnectRefused,
    /// Envoy's circuit breaker turned it away (`x-envoy-overloaded`).
    Overflow,
    /// A hop on HolySheep's side (an Envoy of its own, timed by the edge's) answers with
    /// the circuit breaker's text and mark about its own last attempt: earlier attempts
    /// behind it may have been billed.
    RelayedOverflow { billed: bool },
    /// No answer within the deadline; HolySheep may or may not have billed it.
    Timeout { billed: bool },
    /// A proxy's HTML page on the way: HolySheep may or may not have billed it.
    Page { billed: bool },
    /// A stream cut off midway: HolySheep billed the prompt and what it streamed.
    Cut,
}

impl Fault {
    /// One fault, drawn with the scenario's weights (`faulty`: the share of attempts that
    /// do not get the plain answer, in percent).
    pub(crate) fn draw(rng: &mut Rng, faulty: u64, stream: bool) -> Fault {
        if rng.below(100) >= faulty {
            return Fault::Answer;
        }
        let kinds: &[Fault] = &[
            Fault::BilledThenReset,
            Fault::OtherObjectWithUsage,
            Fault::ServerErrorWithUsage,
            Fault::ServerError,
            Fault::Throttled,
            Fault::DispatchRefused,
            Fault::ConnectRefused,
            Fault::Overflow,
            Fault::RelayedOverflow { billed: true },
            Fault::RelayedOverflow { billed: false },
            Fault::Timeout { billed: true },
            Fault::Timeout { billed: false },
            Fault::Page { billed: true },
            Fault::Page { billed: false },
            Fault::Cut,
        ];
        let n = if stream { kinds.len() } else { kinds.len() - 1 };
        kinds[rng.below(n as u64) as usize]
    }
}

impl Fault {
    /// Whether Envoy's router retries a stream's attempt that met it, when the edge asks it
    /// to (`flight::STREAM_RETRY_ON`: resets, connect failures, 500, 502, 503, 504).
    pub(crate) fn router_retries(self) -> bool {
        matches!(
            self,
            Fault::BilledThenReset
                | Fault::ConnectRefused
                | Fault::ServerError
                | Fault::ServerErrorWithUsage
                | Fault::Page { .. }
                | Fault::RelayedOverflow { .. }
        )
    }
}

/// One attempt as HolySheep and the edge saw it.
#[derive(Debug, Clone)]
pub(crate) struct Attempt {
    /// What HolySheep billed (`None`: nothing).
    pub billed: Option<Usage>,
    /// What the edge must charge the tenant, in micro-dollars, given `worst_micro`.
    pub due_micro: u64,
    /// The answer and hints, as a call's shell hands them to `Flight::on_response`.
    pub outcome: Option<Response>,
    pub hints: ProviderHints,
    /// How long it took.
    pub latency_ms: u64,
}

/// The attempt of a call whose prompt is `prompt` tokens and whose completion may be up to
/// `max_completion` tokens, on a model priced by `cost`; `worst_micro` is what an attempt of
/// unknown cost is charged.
pub(crate) fn attempt(
    rng: &mut Rng,
    fault: Fault,
    (prompt, max_completion): (u64, u64),
    (cost, worst_micro): (impl Fn(&Usage) -> u64, u64),
    content: &str,
) -> Attempt {
    // Half the answers write until the completion limit, as a long answer does.
    let completion = if rng.chance(50) { max_completion } else { 1 + rng.below(max_completion.max(1)) };
    let usage = Usage::new(prompt, completion);
    let json = |status: u16, body: String, extra: &[(&str, &str)]| {
        let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
        headers.extend(extra.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())));
        let (r, h) = upstream::response(status, &headers, body.into_bytes(), ENVOY);
        (Some(r), h)
    };
    let usage_json =
        format!(r#""usage":{{"prompt_tokens":{},"completion_tokens":{}}}"#, usage.prompt, usage.completion);
    let error = r#""error":{"message":"sim","type":"server_error","param":null,"code":null}"#;
    let envoy = |reason: &str, overloaded: bool| {
        let mut headers = vec![("content-type".to_owned(), "text/plain".to_owned())];
        if overloaded {
            headers.push(("x-envoy-overloaded".to_owned(), "true".to_owned()));
        }
        let body = format!("upstream connect error or disconnect/reset before headers. reset reason: {reason}");
        let (r, h) = upstream::response(503, &headers, body.into_bytes(), ENVOY);
        (Some(r), h)
    };
    let latency_ms = 5 + rng.below(400);
    let (billed, due, (outcome, hints)) = match fault {
        Fault::Answer => {
            let choice = format!(
                r#"{{"index":0,"message":{{"role":"assistant","content":"{content}"}},"finish_reason":"stop"}}"#
            );
            let body = format!(r#"{{"object":"chat.completion","choices":[{choice}],{usage_json}}}"#);
            (Some(usage), cost(&usage), json(200, body, &[]))
        }
        Fault::BilledThenReset => (Some(usage), worst_micro, (None, ProviderHints::default())),
        Fault::OtherObjectWithUsage => {
            let body = format!(r#"{{"object":"list","data":[],{usage_json}}}"#);
            (Some(usage), cost(&usage), json(200, body, &[]))
        }
        Fault::ServerErrorWithUsage => (Some(usage), cost(&usage), json(500, format!("{{{error},{usage_json}}}"), &[])),
        Fault::ServerError => (None, 0, json(503, format!("{{{error}}}"), &[])),
        Fault::Throttled => (None, 0, json(429, format!("{{{error}}}"), &[("retry-after", "1")])),
        Fault::DispatchRefused => (None, 0, (None, ProviderHints::unsent())),
        Fault::ConnectRefused => (None, 0, envoy("remote connection failure", false)),
        Fault::Overflow => (None, 0, envoy("overflow", true)),
        Fault::RelayedOverflow { billed } => {
            let headers = [
                ("content-type".to_owned(), "text/plain".to_owned()),
                ("x-envoy-overloaded".to_owned(), "true".to_owned()),
                ("x-envoy-upstream-service-time".to_owned(), "3".to_owned()),
            ];
            let body = b"upstream connect error or disconnect/reset before headers. reset reason: overflow".to_vec();
            let (r, h) = upstream::response(503, &headers, body, ENVOY);
            (billed.then_some(usage), worst_micro, (Some(r), h))
        }
        Fault::Timeout { billed } => (billed.then_some(usage), worst_micro, (None, ProviderHints::default())),
        Fault::Page { billed } => {
            let headers = [("content-type".to_owned(), "text/html".to_owned())];
            let (r, h) = upstream::response(502, &headers, b"<html>bad gateway</html>".to_vec(), ENVOY);
            (billed.then_some(usage), worst_micro, (Some(r), h))
        }
        Fault::Cut => (Some(usage), worst_micro, (None, ProviderHints::default())),
    };
    Attempt { billed, due_micro: due, outcome, hints, latency_ms }
}

/// How a stream forwarded along the route ended, as its shell's tee tells the leader
/// (`Leader::on_stream_end`), after the router's earlier attempts (`retries`); a cut
/// stream's estimate counts its prompt (`prompt_estimate`) with what was streamed.
pub(crate) fn stream_end(fault: Fault, attempt: Attempt, retries: u64, prompt_estimate: u64) -> StreamEnd {
    // A stream refused before it left (its client gone, say) made no attempt at all.
    let attempts = if fault == Fault::DispatchRefused { 0 } else { retries + 1 };
    let (status, usage, cut_off_tokens) = match fault {
        Fault::Answer => (Some(200), attempt.billed, 0),
        Fault::Cut => (Some(200), None, attempt.billed.map_or(0, |u| u.total())),
        // Envoy's own replies: no status of HolySheep's.
        Fault::ConnectRefused | Fault::Overflow | Fault::BilledThenReset | Fault::Timeout { .. } => (None, None, 0),
        _ => (attempt.outcome.as_ref().map(|r| r.status), None, 0),
    };
    // A stream's answer that is not events is read whole by the tee, as a call's is.
    let hints = match fault {
        Fault::Answer | Fault::Cut | Fault::BilledThenReset | Fault::Timeout { .. } => ProviderHints::default(),
        _ => attempt.hints,
    };
    // The tee's answer: a whole stream's, or the error it read whole.
    let outcome = match fault {
        Fault::Answer => attempt.outcome.filter(|_| usage.is_some()),
        _ if status.is_some_and(|s| s != 200) => attempt.outcome,
        _ => None,
    };
    let streamed_tokens = cut_off_tokens.saturating_sub(prompt_estimate);
    StreamEnd { outcome, usage, streamed_tokens, status, attempts, hints }
}

/// What happens to an embedding call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EmbedFault {
    /// The embedding, with its `usage`.
    Answer,
    /// The embedding without a `usage`: HolySheep billed it, the answer does not say what.
    NoUsage,
    /// The host would not send it.
    Unsent,
    /// No answer: HolySheep may or may not have billed it.
    Lost { billed: bool },
    /// HolySheep's 4xx (its refusal): nothing billed.
    Refused,
    /// A 5xx: HolySheep may or may not have billed it.
    ServerError { billed: bool },
}

impl EmbedFault {
    pub(crate) fn draw(rng: &mut Rng) -> EmbedFault {
        match rng.below(20) {
            0 => EmbedFault::NoUsage,
            1 => EmbedFault::Unsent,
            2 => EmbedFault::Lost { billed: true },
            3 => EmbedFault::Lost { billed: false },
            4 => EmbedFault::Refused,
            5 => EmbedFault::ServerError { billed: true },
            6 => EmbedFault::ServerError { billed: false },
            _ => EmbedFault::Answer,
        }
    }

    /// Whether HolySheep billed it.
    pub(crate) fn billed(self) -> bool {
        match self {
            EmbedFault::Answer | EmbedFault::NoUsage => true,
            EmbedFault::Lost { billed } | EmbedFault::ServerError { billed } => billed,
            EmbedFault::Unsent | EmbedFault::Refused => false,
        }
    }

    /// The answer's body: an embedding billed `tokens`, whose vector is one of five (by
    /// the question's length: questions of a partition often land on the same vector, and
    /// one is answered with the other's answer, SEMANTIC); or an error.
    pub(crate) fn body(self, tokens: u64) -> Vec<u8> {
        let vector: Vec<String> = (0..8).map(|i| format!("{}", ((tokens % 5) * 7 + i) as f32 / 50.0 + 0.01)).collect();
        match self {
            EmbedFault::Answer => format!(
                r#"{{"object":"list","data":[{{"object":"embedding","index":0,"embedding":[{}]}}],"usage":{{"prompt_tokens":{tokens},"total_tokens":{tokens}}}}}"#,
                vector.join(",")
            )
            .into_bytes(),
            EmbedFault::NoUsage => {
                format!(r#"{{"object":"list","data":[{{"object":"embedding","index":0,"embedding":[{}]}}]}}"#, vector.join(","))
                    .into_bytes()
            }
            _ => br#"{"error":{"message":"sim","type":"server_error","param":null,"code":null}}"#.to_vec(),
        }
    }

    /// The answer as the shell hands it to the look.
    pub(crate) fn answer(self, body: &[u8]) -> crate::core::flight::look::Answer<'_> {
        use crate::core::flight::look::Answer;
        match self {
            EmbedFault::Answer | EmbedFault::NoUsage => Answer::Got { status: 200, body: Some(body) },
            EmbedFault::Unsent => Answer::Unsent,
            EmbedFault::Lost { .. } => Answer::Lost,
            EmbedFault::Refused => Answer::Got { status: 400, body: Some(body) },
            EmbedFault::ServerError { .. } => Answer::Got { status: 503, body: Some(body) },
        }
    }
}
