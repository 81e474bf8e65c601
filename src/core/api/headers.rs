//! Every header name the edge speaks, in one place: the ones it reads from clients and
//! forward nodes, the ones it sets on its answers and on the calls it makes. docs/http.md
//! says what each carries.

// What the edge sets on its answers.
pub const CACHE: &str = "x-holysheep-cache";
pub const KEY: &str = "x-holysheep-key";
pub const MODEL: &str = "x-holysheep-model";
pub const TIER: &str = "x-holysheep-tier";
pub(crate) const SIMILARITY: &str = "x-holysheep-similarity";
pub(crate) const SHED: &str = "x-holysheep-shed";
/// `lost` on the 503 of a waiter that could not read its flight's answer.
pub(crate) const WAIT: &str = "x-holysheep-wait";
pub const AGE: &str = "age";
pub const CACHE_CONTROL: &str = "cache-control";
pub const RETRY_AFTER: &str = "retry-after";
/// Envoy's mark on its own 503 for a request its router never sent (circuit breaking,
/// maintenance mode), documented with the router's headers.
pub const ENVOY_OVERLOADED: &str = "x-envoy-overloaded";
/// Envoy's router adds it to every answer an upstream gave (its time in milliseconds): an
/// answer without it is Envoy's own reply.
pub const ENVOY_UPSTREAM_SERVICE_TIME: &str = "x-envoy-upstream-service-time";
pub(crate) const LIMIT_REQUESTS: &str = "x-ratelimit-limit-requests";
pub(crate) const LIMIT_TOKENS: &str = "x-ratelimit-limit-tokens";
pub(crate) const REMAINING_REQUESTS: &str = "x-ratelimit-remaining-requests";
pub(crate) const REMAINING_TOKENS: &str = "x-ratelimit-remaining-tokens";
pub(crate) const RESET_REQUESTS: &str = "x-ratelimit-reset-requests";
pub(crate) const RESET_TOKENS: &str = "x-ratelimit-reset-tokens";

pub const ACCEPT: &str = "accept";

/// The media type of a streamed answer.
pub const EVENT_STREAM: &str = "text/event-stream";

/// The value of the first header named `name` (in any case) among `pairs`.
pub(crate) fn value<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// What the edge's own header names begin with.
const EDGE_PREFIX: &str = "x-holysheep-";

/// Whether `name` (lowercase, as hosts hand header names) is one of the edge's own
/// headers: on an answer only the edge sets them (HolySheep's never pass), and a client's
/// are never trusted.
pub fn is_edges(name: &str) -> bool {
    name.starts_with(EDGE_PREFIX)
}

/// Whether a client's request header `name` is taken off before the request goes on to
/// an owner node: every one of the edge's own but `x-holysheep-priority` (which can only
/// lower the class the owner gives the verified tenant).
pub fn stripped_on_the_hop(name: &str) -> bool {
    is_edges(name) && name != PRIORITY
}

/// Envoy's router headers a stream sent along the route carries: how often, and on what,
/// it retries the stream before its first byte (`flight::Flight::route_headers`).
pub const ENVOY_MAX_RETRIES: &str = "x-envoy-max-retries";
pub const ENVOY_RETRY_ON: &str = "x-envoy-retry-on";
pub const ENVOY_RETRIABLE_STATUS_CODES: &str = "x-envoy-retriable-status-codes";

/// The `:status` among a host's header `pairs`, as a number.
pub fn status(pairs: &[(String, String)]) -> Option<u16> {
    pairs.iter().find(|(n, _)| n == ":status").and_then(|(_, v)| v.parse().ok())
}

/// Whether a `content-type` names an event stream (media types are case-insensitive).
pub fn is_event_stream(content_type: &str) -> bool {
    content_type.to_ascii_lowercase().contains(EVENT_STREAM)
}

// What the edge reads from a client (and forwards to an owner).
pub const PRIORITY: &str = "x-holysheep-priority";
pub const AUTHORIZATION: &str = "authorization";
pub const CONTENT_TYPE: &str = "content-type";
pub const CONTENT_LENGTH: &str = "content-length";
pub const TRANSFER_ENCODING: &str = "transfer-encoding";
pub const HOST: &str = "host";
/// The scheme a client came by, as a proxy in front says; Envoy 1.40 routes a rewritten
/// request only with it.
pub const FORWARDED_PROTO: &str = "x-forwarded-proto";
/// Envoy's id of a request, kept when the edge rewrites one.
pub const REQUEST_ID: &str = "x-request-id";
pub const USER_AGENT: &str = "user-agent";
/// W3C trace context, read from the client and sent on the call to HolySheep.
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

// Between the edge's own nodes.
pub(crate) const TENANT: &str = "x-holysheep-tenant";
pub const PEER_SECRET: &str = "x-holysheep-peer-secret";
/// A forward node's configuration digest, on every hop (`config::digest`).
pub const CONFIG: &str = "x-holysheep-config";
