//! The HolySheep request and response as both shells send and read them: the request a
//! flight's attempt makes (body, headers) and the `Response` + `ProviderHints` read back.

pub mod affinity;
pub mod misroute;

use crate::core::api::call::HttpCall;
use crate::core::api::endpoint::Endpoint;
use crate::core::api::error::ApiError;
use crate::core::api::head::HeadEdit;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::priority::Class;
use crate::core::api::reply::Reply;
use crate::core::api::response::Response;
use crate::core::api::trace::TraceContext;
use crate::core::api::usage::{Billed, Usage, DEFAULT_COMPLETION_ESTIMATE};
use crate::core::cache::batch::Batch;
use crate::core::cache::edge;
use crate::core::config::{Config, Role};
use crate::core::limits;
use crate::core::observe::log_fields::{self, Answered, Served};
use crate::core::request::probe::Probe;
use crate::core::request::{for_upstream, ApiRequest};
use crate::core::store::{claim, CasStore};
use crate::core::stream;
use crate::core::wire::scan;
use std::borrow::Cow;

/// What an upstream call needs from the client's request.
#[derive(Debug, Clone)]
pub struct Outbound {
    pub endpoint: Endpoint,
    pub body: Vec<u8>,
    pub client_authorization: Option<String>,
    pub model: String,
    pub estimate_tokens: u64,
    /// The client asked for a stream (`stream: true`) ...
    pub stream: bool,
    /// ... with the usage event (`stream_options.include_usage`).
    pub include_usage: bool,
    /// The verified tenant the call is made for.
    pub tenant: Option<String>,
    /// The completion tokens the request allows (see `ApiRequest::completion_limit`).
    pub completion_limit: Option<u64>,
    /// Set for a call that must stay within a tenant's budget but sets no completion
    /// limit: it is sent with `max_tokens` of this (for each choice).
    pub completion_cap: Option<u64>,
    /// Set for a budgeted tenant's call whose input HolySheep partly supplies itself: the
    /// model's context window, which bounds its prompt tokens instead of the body.
    pub supplied_ceiling: Option<u64>,
    /// The choices the request asks for (`n`).
    pub choices: u64,
    /// The request names a completion limit, of any value (`ApiRequest::limit_named`).
    pub limit_named: bool,
    /// The request's priority class, which orders the models' admission lines.
    pub class: Class,
    /// Its question and partition, when it takes part in the semantic tier.
    pub semantic: Option<Probe>,
    /// An embeddings list answered item by item: what the cache holds of it.
    pub batch: Option<std::rc::Rc<Batch>>,
    /// The caller's trace context, carried onto the call.
    pub trace: Option<TraceContext>,
    /// The edge set its `prompt_cache_key` (`affinity`): what HolySheep's prompt cache
    /// saves it is counted as affinity's.
    pub affinity: bool,
}

pub const USER_AGENT: &str = concat!("holysheep-edge/", env!("CARGO_PKG_VERSION"));

/// HolySheep's answer to a request passed with the operator's key (`passthrough_paths`)
/// passes as it is, unless it refuses the key: then the edge's 502 goes in its place (this
/// edit of its head, and `passed_refusal`'s body for its own, which may quote part of the
/// key).
pub fn passed_refused(status: u16) -> Option<HeadEdit> {
    let json = (headers::CONTENT_TYPE.to_owned(), "application/json".to_owned());
    let set = vec![json, (":status".to_owned(), "502".to_owned())];
    matches!(status, 401 | 403).then(|| HeadEdit { remove: vec![headers::CONTENT_LENGTH.to_owned()], set })
}

/// The edge's error in place of HolySheep's refusal (`status`) of the operator's key.
pub fn passed_refusal(status: u16) -> ApiError {
    refused(status, "application/json", Sent { operator_key: true, ..Default::default() })
        .unwrap_or_else(|| ApiError::upstream(502, "HolySheep refused the edge's API key", KEY_REFUSED))
}

/// Shared-data key claimed by the one worker per process that checks the operator's key.
const KEY_CHECK: &str = "holysheep/key-check";

/// The check of the operator's key (`bearer`), once per process: `GET /v1/models` with it,
/// for the first worker to claim the check in `store` (`None` for every other).
/// `observe::notices::Notices::key_checked` says what its answer means.
pub fn key_check(store: &impl CasStore, config: &Config, bearer: &str) -> Option<HttpCall> {
    if !claim(store, KEY_CHECK, b"1") {
        return None;
    }
    let to = (config.upstream.cluster.as_str(), config.upstream.authority.as_str());
    let headers = [(headers::AUTHORIZATION, bearer)];
    Some(HttpCall::request("GET", to, "/v1/models", headers, Vec::new(), config.upstream.timeout_ms))
}

/// The headers of a leader's embedding call (`flight::look`), paid with the operator's key
/// (`bearer`).
pub fn embedding_headers(bearer: &str) -> [(&'static str, &str); 4] {
    [
        (headers::CONTENT_TYPE, "application/json"),
        (headers::ACCEPT, "application/json"),
        (headers::USER_AGENT, USER_AGENT),
        (headers::AUTHORIZATION, bearer),
    ]
}

impl Outbound {
    /// The call for `request`, whose body is `body`; `client_authorization` is sent only
    /// when no operator key is configured.
    pub fn of(request: &ApiRequest, body: Vec<u8>, client_authorization: Option<String>) -> Outbound {
        Outbound {
            endpoint: request.endpoint,
            body,
            client_authorization,
            model: request.model.clone(),
            estimate_tokens: request.estimate_tokens,
            stream: request.stream,
            include_usage: request.include_usage,
            tenant: request.tenant.clone(),
            completion_limit: request.completion_limit,
            completion_cap: None,
            supplied_ceiling: None,
            choices: request.choices,
            limit_named: request.limit_named,
            class: Class::Standard,
            semantic: request.semantic.clone(),
            batch: None,
            trace: None,
            affinity: false,
        }
    }

    /// The most tokens the call can be billed: every byte of the body a prompt token (a
    /// token is at least one byte of text; images aside), or the model's context window
    /// when HolySheep supplies part of the input, and the completion limit of every choice
    /// (the request's own, else the cap the edge sends it with).
    pub(crate) fn worst_tokens(&self) -> u64 {
        let per_choice = self.completion_cap.unwrap_or(DEFAULT_COMPLETION_ESTIMATE);
        let completion = self.completion_limit.unwrap_or(per_choice.saturating_mul(self.choices.max(1)));
        let prompt = (self.body.len() as u64).max(self.supplied_ceiling.unwrap_or(0));
        prompt.saturating_add(completion)
    }

    /// The body for an attempt on `model` (rewritten when it is a fallback, and for a
    /// stream to ask for the usage event).
    pub fn body_for(&self, model: &str) -> Cow<'_, [u8]> {
        let stream_usage = self.stream && self.endpoint.asks_stream_usage();
        let same = model == self.model && !stream_usage;
        let cap = self.completion_cap.zip(self.endpoint.cap_field()).map(|(cap, field)| (field, cap));
        match cap {
            None if same => Cow::Borrowed(&self.body),
            Some((field, cap)) if same && !self.limit_named => match with_cap(&self.body, field, cap) {
                Some(body) => Cow::Owned(body),
                None => Cow::Owned(for_upstream(&self.body, model, false, Some((field, cap)))),
            },
            _ => Cow::Owned(for_upstream(&self.body, model, stream_usage, cap)),
        }
    }

    /// `x-holysheep-tenant`, for a verified tenant's request.
    fn tenant_header(&self) -> Option<(&'static str, String)> {
        self.tenant.clone().map(|t| (headers::TENANT, t))
    }

    /// The headers an answer to this request carries beside its reply's own: the model's
    /// `x-ratelimit-*` (none for a model without limits, whose clock is then never read;
    /// none with fleet-wide limits, whose buckets live on their owner nodes, nor on a
    /// forward node, which has none), the verified tenant, and on a forward node's answers
    /// from the cache or a flight (`cached`) `x-holysheep-tier: edge`.
    pub fn answer_headers(
        &self,
        store: &impl CasStore,
        config: &Config,
        cached: bool,
        now_ms: impl FnOnce() -> u64,
    ) -> Vec<(&'static str, String)> {
        let forward = config.role == Role::Forward;
        let mut extra = match config.fleet.shared_limits() || forward {
            true => Vec::new(),
            false => limits::rate_headers(store, config, &self.model, now_ms),
        };
        extra.extend(self.tenant_header());
        extra.extend((forward && cached).then(|| (headers::TIER, edge::EDGE.to_owned())));
        extra
    }

    /// `reply` as this request's client gets it: in the form it asked for (a stream's
    /// events made from a whole answer, `stream::for_client`; any other as it is), with
    /// `answer_headers` beside its own.
    pub fn for_client<'r>(
        &self,
        store: &impl CasStore,
        config: &Config,
        reply: &'r Reply,
        now_ms: impl FnOnce() -> u64,
    ) -> (Cow<'r, Reply>, Vec<(&'static str, String)>) {
        let extra = self.answer_headers(store, config, reply.cache.is_some(), now_ms);
        if !self.stream {
            return (Cow::Borrowed(reply), extra);
        }
        let response = stream::for_client(reply.response.clone(), self.endpoint, true, self.include_usage);
        (Cow::Owned(Reply { response, ..reply.clone() }), extra)
    }

    /// What the access log shows of a request of this form answered with `reply` (its
    /// cache status, key and model), before it is priced (`Answered::priced`).
    pub fn answered<'a>(&'a self, reply: &'a Reply, served: Served, usage: Option<Usage>) -> Answered<'a> {
        Answered {
            cache: reply.cache,
            key: reply.key.as_ref(),
            response_model: log_fields::response_model(reply),
            requested_model: &self.model,
            operation: self.endpoint.operation(),
            tenant: self.tenant.as_deref(),
            class: self.class,
            served,
            usage,
            saved_micro_usd: None,
        }
    }

    /// How a call for this request goes, with the operator's key or not.
    pub fn sent(&self, operator_key: bool) -> Sent {
        Sent { endpoint: self.endpoint, stream: self.stream, operator_key, envoy: false }
    }

    /// Prompt tokens, estimated at four bytes of the request body a token.
    pub fn prompt_estimate(&self) -> u64 {
        (self.body.len() as u64).div_ceil(4)
    }

    /// The call to HolySheep for `model` (`bearer`: the operator's key), within
    /// `timeout_ms`; a stream's asks for events.
    pub fn call(&self, config: &Config, bearer: Option<&str>, model: &str, timeout_ms: u64) -> HttpCall {
        let mut headers = self.headers(bearer);
        if self.stream {
            headers.retain(|(n, _)| *n != headers::ACCEPT);
            headers.push((headers::ACCEPT, headers::EVENT_STREAM));
        }
        let to = (config.upstream.cluster.as_str(), config.upstream.authority.as_str());
        HttpCall::post(to, self.endpoint.path(), headers, self.body_for(model).into_owned(), timeout_ms)
    }

    /// The regular headers of the call: the configured key (`bearer`, `Bearer <key>`)
    /// wins over the client's own authorization.
    pub fn headers<'a>(&'a self, bearer: Option<&'a str>) -> Vec<(&'static str, &'a str)> {
        let mut headers = vec![
            (headers::CONTENT_TYPE, "application/json"),
            (headers::ACCEPT, "application/json"),
            (headers::USER_AGENT, USER_AGENT),
        ];
        if let Some(a) = bearer.or(self.client_authorization.as_deref()) {
            headers.push((headers::AUTHORIZATION, a));
        }
        headers.extend(self.trace.iter().flat_map(TraceContext::headers));
        headers
    }
}

/// The body with `"<field>":cap` as the first member of its object, without parsing it
/// again: only for a request with no member of the endpoint's limit names, in any
/// spelling, so that none can follow and win (`ApiRequest::limit_named`); `None` for a
/// body that is not a non-empty object.
fn with_cap(body: &[u8], field: &str, cap: u64) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace()).filter(|&i| body[i] == b'{')?;
    let next = body[open + 1..].iter().find(|b| !b.is_ascii_whitespace())?;
    if *next == b'}' {
        return None;
    }
    let member = format!("\"{field}\":{cap},");
    let mut out = Vec::with_capacity(body.len() + member.len());
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(member.as_bytes());
    out.extend_from_slice(&body[open + 1..]);
    Some(out)
}

/// How a call was made, which decides what of its answer the edge may pass on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sent {
    /// The endpoint it went to, whose answers are of one kind.
    pub endpoint: Endpoint,
    /// It asked for a stream: only server-sent events are an answer.
    pub stream: bool,
    /// It carried the operator's key (not the client's own).
    pub operator_key: bool,
    /// It went through the edge's own Envoy (a callout), whose own replies say when a
    /// request never left (`Billed::of_envoys_answer`).
    pub envoy: bool,
}

/// HolySheep's answer as the core keeps it, and what it said about its limits.
/// `headers` are the response headers (names lower-case or not). An answer the edge must
/// not pass on (see `refused`, `Endpoint::is_answer`) is the edge's own error in its place.
pub fn response(status: u16, headers: &[(String, String)], body: Vec<u8>, sent: Sent) -> (Response, ProviderHints) {
    let header = |n: &str| headers::value(headers, n).map(str::to_owned);
    let mut hints = ProviderHints::from_headers(status, headers);
    let content_type = header(headers::CONTENT_TYPE).unwrap_or_else(|| "application/json".into());
    let retry_after =
        header(headers::RETRY_AFTER).map(|v| vec![(headers::RETRY_AFTER.to_owned(), v)]).unwrap_or_default();
    // One pass over a JSON body checks it and reads what both questions need: whether it
    // is the endpoint's answer, and what it was billed.
    let json = content_type.to_ascii_lowercase().contains("json");
    let members = json.then(|| scan::read_fields(&body, ANSWER_AND_BILL)).flatten();
    let is_answer = match members {
        Some([object, choices, data, output, ..]) => sent.endpoint.is_answer_of([object, choices, data, output]),
        // Not one JSON object, or one naming `usage` or `error` twice: asked of its shape
        // alone.
        None => json && scan::read_fields(&body, SHAPE).is_some_and(|shape| sent.endpoint.is_answer_of(shape)),
    };
    let refusal = refused(status, &content_type, sent)
        .or_else(|| (status == 200 && !is_answer).then(|| not_an_answer(&content_type, sent)));
    hints.key_refused = refusal.as_ref().is_some_and(|e| e.code == KEY_REFUSED);
    hints.billed = match members {
        Some([.., usage, error]) => Billed::of_members(status, usage, error),
        // Not one JSON object (or a name twice): its usage may still be found at its end.
        None => Billed::of_answer(status, &content_type, &body),
    };
    // The edge's own Envoy's reply (no upstream answered it) may say the request never left.
    let envoys = sent.envoy && header(headers::ENVOY_UPSTREAM_SERVICE_TIME).is_none();
    if envoys && !matches!(hints.billed, Billed::Known(_)) {
        let overloaded = header(headers::ENVOY_OVERLOADED).is_some();
        hints.billed = Billed::of_envoys_answer(status, overloaded, &content_type, &body);
    }
    let response = match refusal {
        Some(e) => Response { headers: retry_after, ..Response::json(e.status, e.body()) },
        None => Response { status, content_type, headers: retry_after, body },
    };
    (response, hints)
}

/// The members that say whether an answer is its endpoint's (`Endpoint::is_answer_of`).
const SHAPE: [&str; 4] = ["object", "choices", "data", "output"];
/// `SHAPE`, then the members that say what an answer was billed (`Billed::of_members`).
const ANSWER_AND_BILL: [&str; 6] = ["object", "choices", "data", "output", "usage", "error"];

/// The code of the edge's answer when HolySheep refuses the operator's key.
pub const KEY_REFUSED: &str = "upstream_auth_failed";

/// The edge's own error in place of an answer it must not pass on, as far as the head of
/// the answer tells: HolySheep refusing the operator's key (401, 403; OpenAI-style bodies
/// quote part of the key they were sent), or a 200 to a stream request that is not a
/// stream of events.
pub fn refused(status: u16, content_type: &str, sent: Sent) -> Option<ApiError> {
    if sent.operator_key && matches!(status, 401 | 403) {
        return Some(ApiError::upstream(
            502,
            format!("HolySheep refused the edge's API key ({status}): the edge's operator must renew it"),
            KEY_REFUSED,
        ));
    }
    (sent.stream && status == 200 && !headers::is_event_stream(content_type)).then(|| not_an_answer(content_type, sent))
}

fn not_an_answer(content_type: &str, sent: Sent) -> ApiError {
    let shown: String = content_type.chars().filter(|c| !c.is_control()).take(64).collect();
    let wanted = if sent.stream { "an event stream" } else { sent.endpoint.object() };
    ApiError::upstream(502, format!("HolySheep answered 200 with '{shown}', not {wanted}"), "upstream_invalid_answer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_gets_its_answer_in_the_form_it_asked_for() {
        let (store, config) = (crate::core::store::MemStore::new(), Config::default());
        let answer = br#"{"id":"c","object":"chat.completion","created":1,"model":"gpt-4.1","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
        let reply = Reply::plain(Response::json(200, answer.to_vec()));
        let plain = outbound();
        let (as_is, _) = plain.for_client(&store, &config, &reply, || 0);
        assert!(matches!(as_is, Cow::Borrowed(_)), "a plain answer goes without a copy");
        let streamed = Outbound { stream: true, ..plain };
        let (events, _) = streamed.for_client(&store, &config, &reply, || 0);
        let text = String::from_utf8_lossy(&events.response.body).into_owned();
        assert!(text.contains("chat.completion.chunk") && text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
    use crate::core::config::Config;

    #[test]
    fn an_answer_is_the_object_its_endpoint_makes() {
        let passes = |endpoint, content_type: &str, body: &[u8]| {
            let headers = [("content-type".to_owned(), content_type.to_owned())];
            let sent = Sent { endpoint, stream: false, operator_key: true, envoy: false };
            response(200, &headers, body.to_vec(), sent).0.status == 200
        };
        let json = "application/json";
        assert!(passes(Endpoint::Embeddings, json, br#"{"object":"list","data":[],"model":"m"}"#));
        assert!(!passes(Endpoint::Embeddings, json, br#"{"object":"chat.completion","choices":[]}"#));
        assert!(passes(Endpoint::Responses, json, br#"{"id":"r","object":"response","output":[]}"#));
        assert!(!passes(Endpoint::Responses, json, br#"{"object":"response"}"#), "without its output");
        assert!(passes(Endpoint::Completions, json, br#"{"object":"text_completion","choices":[]}"#));
        assert!(passes(Endpoint::Chat, "Application/JSON", br#"{"object":"chat.completion","choices":[]}"#));
        assert!(!passes(Endpoint::Chat, "text/html", br#"{"object":"chat.completion","choices":[]}"#));
        assert!(!passes(Endpoint::Chat, json, br#"{"object":"chat.completion","choices":{}}"#), "not an array");
        assert!(!passes(Endpoint::Chat, json, br#"{"object":"chat.completion","choices":[]"#), "not JSON");
    }

    #[test]
    fn what_an_answer_was_billed_is_read_in_the_pass_that_checks_it() {
        use crate::core::api::usage::Usage;
        let sent = Sent { endpoint: Endpoint::Chat, stream: false, operator_key: true, envoy: false };
        let billed = |status, content_type: &str, body: &str| {
            let headers = [("content-type".to_owned(), content_type.to_owned())];
            let (_, hints) = response(status, &headers, body.as_bytes().to_vec(), sent);
            (hints.billed, hints.billed == Billed::of_answer(status, content_type, body.as_bytes()))
        };
        let usage = r#""usage":{"prompt_tokens":3,"completion_tokens":4}"#;
        let known = Billed::Known(Usage::new(3, 4));
        let json = "application/json";
        // Usage first or last, in an answer, in one the edge refuses, or in a body that is
        // not JSON at all but ends with it: what the stream reader would say.
        for body in [
            format!(r#"{{"object":"chat.completion","choices":[],{usage}}}"#),
            format!(r#"{{{usage},"object":"chat.completion","choices":[]}}"#),
            format!(r#"{{"object":"list",{usage}}}"#),
            format!(r#"not json {{{usage}}}"#),
        ] {
            assert_eq!(billed(200, json, &body), (known, true), "{body}");
        }
        assert_eq!(billed(200, "text/plain", &format!("{{{usage}}}")), (known, true));
        let error = r#"{"error":{"message":"no","type":"invalid_request_error"}}"#;
        assert_eq!(billed(400, json, error), (Billed::Nothing, true), "HolySheep's own error costs nothing");
        assert_eq!(billed(200, json, error), (Billed::Unknown, true), "a 200 is no error");
        assert_eq!(billed(400, "text/plain", error), (Billed::Unknown, true), "not said to be JSON");
        assert_eq!(billed(503, "text/plain", "upstream connect error"), (Billed::Unknown, true));
        let twice = format!(r#"{{{usage},"object":"chat.completion","choices":[],{usage}}}"#);
        assert_eq!(billed(200, json, &twice), (known, true), "a name twice: read as the stream reader reads it");
        let headers = [("content-type".to_owned(), json.to_owned())];
        let passed = response(200, &headers, twice.into_bytes(), sent).0;
        assert_eq!(passed.status, 200, "an answer naming its usage twice is still the endpoint's");
        // A member named `x"usage` is not the usage.
        let escaped =
            r#"{"object":"chat.completion","choices":[],"x\"usage":{"prompt_tokens":9,"completion_tokens":9}}"#;
        assert_eq!(billed(200, json, escaped), (Billed::Unknown, true));
    }

    #[test]
    fn an_answer_carries_its_models_limits_its_tenant_and_on_a_forward_node_its_tier() {
        let store = crate::core::store::MemStore::new();
        let limited = r#""models":{"gpt-4.1":{"requests_per_minute":60}}"#;
        let owner = Config::parse(format!("{{{limited}}}").as_bytes()).unwrap();
        let fleet = Config::parse(format!(r#"{{{limited},"fleet":{{"cluster":"owners","nodes":3}}}}"#).as_bytes());
        let forward = Config::parse(format!(r#"{{{limited},"role":"forward"}}"#).as_bytes()).unwrap();
        let out = Outbound { tenant: Some("acme".into()), ..outbound() };
        let names = |c: &Config, cached| -> Vec<&'static str> {
            out.answer_headers(&store, c, cached, || 1_000).into_iter().map(|(n, _)| n).collect()
        };
        let owned = names(&owner, true);
        assert!(owned.contains(&"x-ratelimit-limit-requests") && owned.contains(&headers::TENANT), "{owned:?}");
        assert!(!owned.contains(&headers::TIER), "an owner's answers name no tier");
        let shared = names(&fleet.unwrap(), true);
        assert!(!shared.contains(&"x-ratelimit-limit-requests"), "fleet-wide buckets live on their owners");
        assert_eq!(names(&forward, true), [headers::TENANT, headers::TIER]);
        assert_eq!(names(&forward, false), [headers::TENANT], "an answer of no cache passes the owner's tier");
    }

    fn outbound() -> Outbound {
        Outbound {
            endpoint: Endpoint::Chat,
            body: br#"{"model":"gpt-4.1","messages":[]}"#.to_vec(),
            client_authorization: Some("Bearer client".into()),
            model: "gpt-4.1".into(),
            estimate_tokens: 10,
            stream: false,
            include_usage: false,
            tenant: None,
            completion_limit: None,
            completion_cap: None,
            supplied_ceiling: None,
            choices: 1,
            limit_named: false,
            class: Default::default(),
            semantic: None,
            batch: None,
            trace: None,
            affinity: false,
        }
    }

    #[test]
    fn configured_key_wins_over_the_clients() {
        let o = outbound();
        let auth = |h: Vec<(&str, &str)>| h.iter().find(|(n, _)| *n == "authorization").map(|(_, v)| v.to_string());
        assert_eq!(auth(o.headers(Some("Bearer edge"))).as_deref(), Some("Bearer edge"));
        assert_eq!(auth(o.headers(None)).as_deref(), Some("Bearer client"));
    }

    #[test]
    fn the_edges_completion_cap_is_added_without_a_rewrite_and_never_loses_to_the_clients() {
        let config = Config::default();
        let capped = |body: &str| {
            let request = ApiRequest::parse(&config, &Default::default(), Endpoint::Chat, body.as_bytes()).unwrap();
            Outbound { completion_cap: Some(7), ..Outbound::of(&request, body.as_bytes().to_vec(), None) }
        };
        let fast = capped(r#" {"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}]}"#);
        assert_eq!(
            &*fast.body_for("gpt-4.1"),
            br#" {"max_tokens":7,"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}]}"#
        );
        // A member of that name in any spelling (a null one is no limit): parsed and rewritten,
        // so that the cap is the only limit sent.
        for named in [r#""max_tokens":null"#, r#""max\u005ftokens":null"#, r#""max_completion_tokens":null"#] {
            let body = format!(r#"{{"model":"gpt-4.1","messages":[{{"role":"user","content":"hi"}}],{named}}}"#);
            let v: serde_json::Value = serde_json::from_slice(&capped(&body).body_for("gpt-4.1")).unwrap();
            assert_eq!((v["max_tokens"].as_u64(), v.get("max_completion_tokens")), (Some(7), None), "{named}");
        }
        let v: serde_json::Value = serde_json::from_slice(&fast.body_for("deepseek-v3")).unwrap();
        assert_eq!((v["max_tokens"].as_u64(), v["model"].as_str()), (Some(7), Some("deepseek-v3")), "a fallback too");
    }

    #[test]
    fn a_fallback_attempt_rewrites_only_the_model() {
        let o = outbound();
        assert_eq!(&*o.body_for("gpt-4.1"), o.body.as_slice());
        let v: serde_json::Value = serde_json::from_slice(&o.body_for("deepseek-v3")).unwrap();
        assert_eq!(v["model"], "deepseek-v3");
    }

    #[test]
    fn a_stream_always_asks_for_the_usage_event() {
        let o = Outbound {
            body: br#"{"model":"gpt-4.1","messages":[],"stream":true,"stream_options":{"x":1}}"#.to_vec(),
            stream: true,
            ..outbound()
        };
        let v: serde_json::Value = serde_json::from_slice(&o.body_for("gpt-4.1")).unwrap();
        assert_eq!(
            (v["stream_options"]["include_usage"].as_bool(), v["stream_options"]["x"].as_u64()),
            (Some(true), Some(1))
        );
        assert_eq!(v["stream"], true);
    }

    const COMPLETION: &[u8] = br#"{"id":"c","object":"chat.completion","choices":[{"index":0}],"usage":{}}"#;

    fn answer(status: u16, content_type: &str, body: &[u8], sent: Sent) -> Response {
        response(status, &[("content-type".to_owned(), content_type.to_owned())], body.to_vec(), sent).0
    }

    fn code(r: &Response) -> String {
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        v["error"]["code"].as_str().unwrap_or_default().to_owned()
    }

    #[test]
    fn only_a_chat_completion_is_a_200_answer() {
        let plain = Sent::default();
        assert_eq!(answer(200, "application/json; charset=utf-8", COMPLETION, plain).body, COMPLETION);
        let no_choices = br#"{"object":"chat.completion","choices":[]}"#;
        assert_eq!(answer(200, "application/json", no_choices, plain).body, no_choices, "an empty list is a list");
        for (ct, body) in [
            ("text/html", &b"<html>portal</html>"[..]),
            ("text/html", COMPLETION),
            ("application/json", br#"{"error":{"message":"overloaded"}}"#),
            ("application/json", br#"{"object":"chat.completion","choices":{}}"#),
            ("application/json", br#"{"object":"chat.completion"}"#),
            ("application/json", br#"{"object":"list","choices":[{}]}"#),
            ("application/json", b"[1]"),
        ] {
            let r = answer(200, ct, body, plain);
            assert_eq!((r.status, code(&r)), (502, "upstream_invalid_answer".to_owned()), "{ct} {body:?}");
        }
        let r =
            answer(200, "application/json", COMPLETION, Sent { stream: true, operator_key: false, ..Sent::default() });
        assert_eq!((r.status, code(&r)), (502, "upstream_invalid_answer".to_owned()), "a stream asked for events");
        assert_eq!(answer(500, "text/html", b"<html>", plain).body, b"<html>", "errors stay errors");
    }

    #[test]
    fn the_operators_key_refused_is_the_edges_own_502_without_holysheeps_body() {
        let body = br#"{"error":{"message":"Incorrect API key provided: sk-live-****cret","code":"invalid_api_key"}}"#;
        let with_key = Sent { stream: false, operator_key: true, ..Sent::default() };
        for status in [401, 403] {
            let (r, hints) =
                response(status, &[("content-type".into(), "application/json".into())], body.to_vec(), with_key);
            assert_eq!((r.status, code(&r)), (502, KEY_REFUSED.to_owned()));
            assert!(!String::from_utf8_lossy(&r.body).contains("cret"), "no fragment of the key");
            assert!(hints.key_refused);
        }
        let own = answer(401, "application/json", body, Sent::default());
        assert_eq!((own.status, own.body.as_slice()), (401, &body[..]), "the client's own key: its own answer");
    }

    #[test]
    fn response_keeps_retry_after_and_reads_hints() {
        let headers = vec![
            ("Content-Type".to_owned(), "application/json".to_owned()),
            ("Retry-After".to_owned(), "2".to_owned()),
            ("x-ratelimit-remaining-requests".to_owned(), "7".to_owned()),
        ];
        let (r, hints) = response(429, &headers, b"{}".to_vec(), Sent::default());
        assert_eq!(r.header("retry-after"), Some("2"));
        assert!(hints.throttled);
        assert_eq!(hints.retry_after_ms, Some(2000));
        assert_eq!(hints.remaining_requests, Some(7.0));
    }
}
