//! The request and its key: a body's validation, the canonical form its key hashes
//! (`canonical`), the question and partition the semantic tier compares (`probe`), and the
//! request key scoped to its tenant. Uses `wire`, `api` and `config`.
//!
//! Governed requests (chat, completions, embeddings, Responses): validation, the
//! canonical form of every field that changes the answer, and the SHA-256 request key
//! scoped to the tenant and the endpoint.

pub(crate) mod canonical;
pub(crate) mod probe;
pub(crate) mod supplied;

use crate::core::api::endpoint::Endpoint;
use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::key::Key;
use crate::core::api::path::segments;
use crate::core::api::priority::Class;
use crate::core::api::usage::DEFAULT_COMPLETION_ESTIMATE;
use crate::core::config::{Config, Scope};
use crate::core::request::canonical::canonical_body;
use crate::core::request::probe::{probe, Probe};
use crate::core::wire::codec;
use crate::core::wire::digest::sha256;
use crate::core::wire::json;
use crate::core::wire::write;
use serde_json::{Map, Value};

/// The chat completions path, the first endpoint the edge governed.
pub(crate) const CHAT_PATH: &str = "/v1/chat/completions";

/// Longest `model` accepted (it is echoed in a response header).
pub(crate) const MAX_MODEL_LEN: usize = 256;
/// What a parsed request adds to a table of parsed requests beyond its raw bytes (its
/// key, model).
pub(crate) const PARSED_SIZE: usize = 128;

/// Whether a request path names chat completions as a server behind nginx would read it:
/// query and fragment dropped, unreserved percent-escapes decoded, repeated slashes merged,
/// `.` and `..` segments resolved, a trailing slash ignored. Every such variant is governed.
pub fn is_chat_path(path: &str) -> bool {
    segments(path) == ["v1", "chat", "completions"]
}

/// `/v1/models` in any spelling (the list, not one model).
pub(crate) fn is_models_path(path: &str) -> bool {
    segments(path) == ["v1", "models"]
}

/// The path of the fleet's internal calls (a key owner asking a model owner).
pub const PEER_PATH: &str = "/holysheep/peer/bucket";

/// Whether a path, in any spelling, is under `/holysheep/`: the fleet's own calls, never
/// accepted from a client on a public listener.
pub(crate) fn is_internal_path(path: &str) -> bool {
    segments(path).first().is_some_and(|s| s.eq_ignore_ascii_case("holysheep"))
}

/// serde_json refuses nesting deeper than 128; we refuse earlier, with a clear message.
pub(crate) const MAX_DEPTH: usize = 64;

/// What the client asked the cache to do (request `cache-control`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CacheControl {
    pub no_store: bool,
    pub no_cache: bool,
    pub max_age: Option<u64>,
}

impl CacheControl {
    pub fn parse(header: Option<&str>) -> CacheControl {
        let mut cc = CacheControl::default();
        let Some(header) = header else { return cc };
        for directive in header.split(',') {
            let d = directive.trim().to_ascii_lowercase();
            match d.split_once('=') {
                Some(("max-age", n)) => cc.max_age = n.trim().trim_matches('"').parse().ok(),
                _ if d == "no-store" => cc.no_store = true,
                _ if d == "no-cache" => cc.no_cache = true,
                _ => {}
            }
        }
        cc
    }
}

/// How this request may use the cache and the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Serve from the cache (entries no older than `max_age` seconds, if set).
    pub read: bool,
    pub max_age: Option<u64>,
    /// Share one upstream call with identical requests.
    pub coalesce: bool,
    /// Store a 200 answer.
    pub store: bool,
    /// The request's priority class: a waiter takes a flight's refusal for priority only
    /// if it was given at its own class or a higher one.
    pub class: Class,
}

/// A parsed, validated request to a governed endpoint.
#[derive(Debug, Clone)]
pub struct ApiRequest {
    pub key: Key,
    pub endpoint: Endpoint,
    /// It may be shared with other callers: cached and coalesced (see
    /// `Endpoint::shareable`; a stream only where the edge reassembles it).
    pub shared: bool,
    pub model: String,
    /// `stream: true`: answered as server-sent events (from the same cache entry).
    pub stream: bool,
    /// `stream_options.include_usage: true`: the client wants the usage event.
    pub include_usage: bool,
    /// temperature 0 or a seed, and one choice.
    pub deterministic: bool,
    /// Tokens reserved before the call: prompt ≈ body bytes / 4, plus the completion
    /// limit (`max_completion_tokens`, `max_tokens`, or a default) for each choice.
    pub estimate_tokens: u64,
    /// The verified tenant (with `tenants` configured).
    pub tenant: Option<String>,
    /// The completion tokens the request allows (its `max_completion_tokens` or
    /// `max_tokens`, the larger, for each choice); `None` when it sets neither.
    pub completion_limit: Option<u64>,
    /// The choices it asks for (`n`, 1 by default).
    pub choices: u64,
    /// It has a member `max_tokens` or `max_completion_tokens`, of any value (`null`
    /// included, which sets no limit).
    pub limit_named: bool,
    /// Its question and partition, when it takes part in the semantic tier.
    pub semantic: Option<Probe>,
    /// An embeddings request's items, keyed one by one (`batch::item_keys`).
    pub items: Option<Vec<Key>>,
    /// The first member naming input HolySheep supplies itself (`supplied::supplied_input`);
    /// this and the next three are read only with `tenants` configured, which they bind.
    pub supplied_input: Option<String>,
    /// The first hosted tool it enables (`supplied::hosted_tool`).
    pub hosted_tool: Option<String>,
    /// The Responses API's `previous_response_id`, as the client sent it.
    pub previous_response_id: Option<String>,
    /// The first stored object other than a response it names (`supplied::foreign_object`).
    pub foreign_object: Option<String>,
}

/// The request headers the core needs; the shell reads them from its host.
#[derive(Debug, Clone, Default)]
pub struct RequestMeta<'a> {
    pub authorization: Option<&'a str>,
    pub tenant: Option<&'a str>,
    pub cache_control: Option<&'a str>,
    /// The tenant whose key the request carries, verified (with `tenants` configured).
    pub verified: Option<&'a str>,
}

impl ApiRequest {
    pub fn parse(
        config: &Config,
        meta: &RequestMeta<'_>,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Result<ApiRequest, ApiError> {
        if body.len() > config.max_body_bytes {
            return Err(ApiError::too_large(config.max_body_bytes));
        }
        let value = parse_json(body)?;
        let Value::Object(map) = value else {
            return Err(ApiError::invalid("request body must be a JSON object", None, "invalid_type"));
        };
        validate(endpoint, &map)?;
        let model = map.get("model").and_then(Value::as_str).unwrap_or_default().to_owned();
        let stream = map.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let include_usage =
            map.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
        let deterministic = endpoint == Endpoint::Embeddings || is_deterministic(&map);
        let choices = choices(endpoint, &map);
        let completion_limit = completion_limit(endpoint, &map, choices);
        let estimate_tokens = estimate_tokens(endpoint, &map, body.len(), choices);
        let limit_named = endpoint.limit_fields().iter().any(|f| map.contains_key(*f));
        let shared = endpoint.shareable(&map) && (!stream || endpoint.streams_shared());
        let scope = scope(config, meta)?;
        let semantic = (config.semantic.enabled && endpoint == Endpoint::Chat)
            .then(|| probe(config, &map, (&scope, CHAT_PATH), deterministic))
            .flatten();
        // Only a list of two or more is answered item by item (`batch::plan`).
        let listed = map.get("input").and_then(Value::as_array).is_some_and(|a| a.len() >= 2);
        let items = (endpoint == Endpoint::Embeddings && listed).then(|| item_keys(&map, &scope)).flatten();
        // What only a tenant's call is held to: not looked for without `tenants`.
        let tenants = !config.keys.is_empty();
        let supplied_input = tenants.then(|| supplied::supplied_input(endpoint, &map)).flatten();
        let hosted_tool = tenants.then(|| supplied::hosted_tool(endpoint, &map)).flatten();
        let previous_response_id = (tenants && endpoint == Endpoint::Responses)
            .then(|| map.get("previous_response_id").and_then(Value::as_str).map(str::to_owned))
            .flatten();
        let foreign_object = tenants.then(|| supplied::foreign_object(endpoint, &map)).flatten();
        let canonical = canonical_body(map);
        Ok(ApiRequest {
            key: request_key(endpoint.path(), &scope, &canonical),
            endpoint,
            shared,
            model,
            stream,
            include_usage,
            deterministic,
            estimate_tokens,
            tenant: meta.verified.map(str::to_owned),
            completion_limit,
            choices,
            limit_named,
            semantic,
            items,
            supplied_input,
            hosted_tool,
            previous_response_id,
            foreign_object,
        })
    }

    /// What this parse adds to a table of parsed requests beyond the request's raw bytes:
    /// `PARSED_SIZE`, and the question it keeps for the semantic tier.
    pub fn kept_size(&self) -> usize {
        let items = self.items.as_ref().map_or(0, |k| k.len() * std::mem::size_of::<Key>() + k.len() * 64);
        PARSED_SIZE + self.semantic.as_ref().map_or(0, |p| p.text.len()) + items
    }

    pub(crate) fn policy(&self, config: &Config, cc: CacheControl) -> Policy {
        // A request that may not be shared is as one that asks `no-store`.
        let no_store = cc.no_store || !self.shared;
        Policy {
            read: !no_store && !cc.no_cache,
            max_age: cc.max_age,
            coalesce: !no_store,
            store: !no_store && (self.deterministic || !config.cache.only_deterministic),
            class: Class::Standard,
        }
    }
}

fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid("request body is empty", None, "invalid_json"));
    }
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::invalid("request body is not valid UTF-8", None, "invalid_json"))?;
    if too_deep(text) {
        return Err(ApiError::invalid(
            format!("request body nests deeper than {MAX_DEPTH} levels"),
            None,
            "invalid_json",
        ));
    }
    json::parse_strict(text).map_err(|e| {
        let what = if e.to_string().contains("out of range") { "a number is out of range" } else { "malformed JSON" };
        ApiError::invalid(format!("request body is not valid JSON ({what}: {e})"), None, "invalid_json")
    })
}

/// Whether the body nests deeper than `MAX_DEPTH`; runs before any recursion. A body with
/// no more opening brackets than that cannot, and counting them is cheaper than following
/// strings.
fn too_deep(text: &str) -> bool {
    let opening = text.bytes().filter(|&b| b == b'{' || b == b'[').count();
    opening > MAX_DEPTH && nesting_depth(text) > MAX_DEPTH
}

/// Deepest bracket nesting outside strings.
fn nesting_depth(text: &str) -> usize {
    let (mut depth, mut max, mut in_str, mut escaped) = (0usize, 0usize, false, false);
    for b in text.bytes() {
        if in_str {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'{' | b'[' => {
                depth += 1;
                max = max.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

type Check = fn(&Value) -> bool;

/// Known fields and the JSON types they must have (OpenAI's contract).
const FIELD_TYPES: [(&str, &str, Check); 21] = [
    ("best_of", "an integer between 1 and 20", |v| v.as_u64().is_some_and(|n| (1..=20).contains(&n))),
    ("max_output_tokens", "a positive integer", |v| v.as_u64().is_some_and(|n| n >= 1)),
    ("dimensions", "a positive integer", |v| v.as_u64().is_some_and(|n| n >= 1)),
    ("encoding_format", "'float' or 'base64'", |v| matches!(v.as_str(), Some("float" | "base64"))),
    ("store", "a boolean", Value::is_boolean),
    ("background", "a boolean", Value::is_boolean),
    ("previous_response_id", "a string", Value::is_string),
    ("temperature", "a number between 0 and 2", |v| v.as_f64().is_some_and(|t| (0.0..=2.0).contains(&t))),
    ("top_p", "a number between 0 and 1", |v| v.as_f64().is_some_and(|t| (0.0..=1.0).contains(&t))),
    ("n", "an integer between 1 and 128", |v| v.as_u64().is_some_and(|n| (1..=128).contains(&n))),
    ("max_tokens", "a positive integer", |v| v.as_u64().is_some_and(|n| n >= 1)),
    ("max_completion_tokens", "a positive integer", |v| v.as_u64().is_some_and(|n| n >= 1)),
    ("seed", "an integer", |v| v.is_i64() || v.is_u64()),
    ("presence_penalty", "a number between -2 and 2", |v| v.as_f64().is_some_and(|t| (-2.0..=2.0).contains(&t))),
    ("frequency_penalty", "a number between -2 and 2", |v| v.as_f64().is_some_and(|t| (-2.0..=2.0).contains(&t))),
    ("stream", "a boolean", Value::is_boolean),
    ("stop", "a string or an array of strings", |v| {
        v.is_string() || v.as_array().is_some_and(|a| a.iter().all(Value::is_string))
    }),
    ("tools", "an array", Value::is_array),
    ("tool_choice", "a string or an object", |v| v.is_string() || v.is_object()),
    ("response_format", "an object", Value::is_object),
    ("logit_bias", "an object", Value::is_object),
];

fn validate(endpoint: Endpoint, map: &Map<String, Value>) -> Result<(), ApiError> {
    match map.get("model") {
        None => {
            return Err(ApiError::invalid(
                "missing required parameter: 'model'",
                Some("model"),
                "missing_required_parameter",
            ))
        }
        Some(Value::String(m)) if m.len() > MAX_MODEL_LEN || m.chars().any(char::is_control) => {
            return Err(ApiError::invalid(
                format!("'model' must be at most {MAX_MODEL_LEN} bytes without control characters"),
                Some("model"),
                "invalid_value",
            ))
        }
        Some(Value::String(m)) if !m.trim().is_empty() => {}
        Some(_) => return Err(wrong_type("model", "a non-empty string")),
    }
    if endpoint == Endpoint::Chat {
        validate_messages(map)?;
    }
    if let Some((name, expected, ok)) = endpoint.required() {
        match map.get(name) {
            None => {
                return Err(ApiError::invalid(
                    format!("missing required parameter: '{name}'"),
                    Some(name),
                    "missing_required_parameter",
                ))
            }
            Some(v) if !ok(v) => return Err(wrong_type(name, expected)),
            Some(_) => {}
        }
    }
    // One pass over the body's fields (a handful) rather than a map lookup per known field.
    for (field, v) in map {
        let Some((name, expected, ok)) = FIELD_TYPES.iter().find(|(name, ..)| name == field) else { continue };
        if !v.is_null() && !ok(v) {
            return Err(wrong_type(name, expected));
        }
    }
    Ok(())
}

fn validate_messages(map: &Map<String, Value>) -> Result<(), ApiError> {
    match map.get("messages") {
        None => {
            return Err(ApiError::invalid(
                "missing required parameter: 'messages'",
                Some("messages"),
                "missing_required_parameter",
            ))
        }
        Some(Value::Array(msgs)) if !msgs.is_empty() => {
            for (i, m) in msgs.iter().enumerate() {
                if !m.get("role").is_some_and(Value::is_string) {
                    return Err(wrong_type(&format!("messages[{i}]"), "an object with a string 'role'"));
                }
            }
        }
        Some(_) => return Err(wrong_type("messages", "a non-empty array")),
    }
    Ok(())
}

fn wrong_type(param: &str, expected: &str) -> ApiError {
    ApiError::invalid(format!("invalid value for '{param}': expected {expected}"), Some(param), "invalid_type")
}

fn is_deterministic(map: &Map<String, Value>) -> bool {
    let one_choice = map.get("n").and_then(Value::as_u64).unwrap_or(1) <= 1;
    let cold = map.get("temperature").and_then(Value::as_f64) == Some(0.0);
    let seeded = map.get("seed").is_some_and(|s| !s.is_null());
    one_choice && (cold || seeded)
}

/// Prompt tokens at four bytes of the body a token, plus each choice's completion limit
/// (the largest of the endpoint's limit fields the request sets, or a default) for an
/// endpoint that completes.
fn estimate_tokens(endpoint: Endpoint, map: &Map<String, Value>, body_len: usize, choices: u64) -> u64 {
    let prompt = (body_len as u64).div_ceil(4);
    if !endpoint.completes() {
        return prompt;
    }
    let completion = endpoint
        .limit_fields()
        .iter()
        .filter_map(|f| map.get(*f).and_then(Value::as_u64))
        .max()
        .unwrap_or(DEFAULT_COMPLETION_ESTIMATE);
    prompt.saturating_add(completion.saturating_mul(choices))
}

/// The largest of the endpoint's limit fields, for each choice; an endpoint that
/// completes nothing is limited to none.
fn completion_limit(endpoint: Endpoint, map: &Map<String, Value>, choices: u64) -> Option<u64> {
    if !endpoint.completes() {
        return Some(0);
    }
    let set = endpoint.limit_fields().iter().filter_map(|f| map.get(*f).and_then(Value::as_u64));
    set.max().map(|limit| limit.saturating_mul(choices))
}

/// The completions HolySheep generates: `n` (validated: 1 to 128); for completions
/// `best_of` when larger (each is billed), for each prompt of a list.
fn choices(endpoint: Endpoint, map: &Map<String, Value>) -> u64 {
    let n = |f: &str| map.get(f).and_then(Value::as_u64).unwrap_or(1).max(1);
    match endpoint {
        Endpoint::Chat => n("n"),
        Endpoint::Completions => n("n").max(n("best_of")).saturating_mul(prompts(map)),
        Endpoint::Embeddings | Endpoint::Responses => 1,
    }
}

/// The prompts of a completions request: one for a string or a list of token numbers,
/// else one per item of the list (strings, or lists of token numbers).
fn prompts(map: &Map<String, Value>) -> u64 {
    match map.get("prompt") {
        Some(Value::Array(items)) if !items.iter().all(Value::is_u64) => items.len().max(1) as u64,
        _ => 1,
    }
}

/// The same request for another model (failover): the body with `model` replaced.
#[cfg(test)]
pub(crate) fn with_model(body: &[u8], model: &str) -> Vec<u8> {
    for_upstream(body, model, false, None)
}

/// The body an upstream call sends: the client's, on `model`; with
/// `stream_options.include_usage: true` when `stream_usage` (a stream of an endpoint that
/// asks for it), so the edge always learns the usage; and with `cap` (the endpoint's limit
/// member and its value) when set, for a budgeted call without a limit.
pub fn for_upstream(body: &[u8], model: &str, stream_usage: bool, cap: Option<(&str, u64)>) -> Vec<u8> {
    match json::parse(body) {
        Some(Value::Object(mut map)) => {
            map.insert("model".into(), Value::String(model.to_owned()));
            if let Some((field, cap)) = cap {
                // The cap is the call's only limit (a null `max_completion_tokens` sets none).
                map.remove("max_completion_tokens");
                map.insert(field.into(), Value::from(cap));
            }
            if stream_usage {
                let options = map.entry("stream_options").or_insert_with(|| Value::Object(Map::new()));
                if !options.is_object() {
                    *options = Value::Object(Map::new());
                }
                if let Some(o) = options.as_object_mut() {
                    o.insert("include_usage".into(), Value::Bool(true));
                }
            }
            write::value(&Value::Object(map))
        }
        _ => body.to_vec(),
    }
}

/// The path items are keyed under (never a request's own).
pub(crate) const ITEM_PATH: &str = "/v1/embeddings#item";

/// The most items of one list the edge keys one by one (OpenAI takes 2048).
pub(crate) const MAX_ITEMS: usize = 2048;

/// The keys of a request's items, in order: each is the key of the request with that item
/// alone as its `input`. `None` for an `input` that is no list of items.
pub(crate) fn item_keys(map: &Map<String, Value>, scope: &str) -> Option<Vec<Key>> {
    let items = items(map.get("input")?)?;
    let mut rest = map.clone();
    rest.remove("input");
    let keys = items
        .iter()
        .map(|item| {
            let mut one = rest.clone();
            one.insert("input".into(), (*item).clone());
            request_key(ITEM_PATH, scope, &canonical_body(one))
        })
        .collect();
    Some(keys)
}

/// An `input`'s items: a string or a list of token numbers is one; a list of strings or
/// of token lists is one per member.
fn items(input: &Value) -> Option<Vec<&Value>> {
    match input {
        Value::String(_) => Some(vec![input]),
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_u64) => Some(vec![input]),
        Value::Array(a) if (1..=MAX_ITEMS).contains(&a.len()) && a.iter().all(|i| i.is_string() || i.is_array()) => {
            Some(a.iter().collect())
        }
        _ => None,
    }
}

/// The tenant scope of the key: the credential itself, hashed only as part of the key (one
/// SHA-256 per request, not two); it is never stored. Without `cache.require_tenant`,
/// every caller without a credential shares one anonymous scope.
fn scope(config: &Config, meta: &RequestMeta<'_>) -> Result<String, ApiError> {
    if !config.keys.is_empty() {
        // A verified tenant's own scope, apart from every credential's (`tenant:`).
        let tenant = meta.verified.ok_or_else(ApiError::invalid_api_key)?;
        return Ok(format!("verified:{tenant}"));
    }
    let (credential, named) = match &config.cache.tenant_header {
        Some(h) => (meta.tenant, h.as_str()),
        None => (meta.authorization, headers::AUTHORIZATION),
    };
    let credential = credential.filter(|c| !c.trim().is_empty());
    if config.cache.require_tenant && credential.is_none() {
        return Err(ApiError {
            status: 401,
            message: format!("This edge requires a tenant credential: send the '{named}' header."),
            kind: "invalid_request_error",
            param: None,
            code: "missing_tenant",
        });
    }
    Ok(match config.cache.scope {
        Scope::Global => "global".to_owned(),
        Scope::Tenant => format!("tenant:{}", credential.unwrap_or("")),
    })
}

pub fn request_key(path: &str, scope: &str, canonical: &[u8]) -> Key {
    let mut message = Vec::with_capacity(24 + path.len() + scope.len() + canonical.len() + 72);
    for part in [path.as_bytes(), scope.as_bytes(), canonical] {
        message.extend_from_slice(&(part.len() as u64).to_be_bytes());
        message.extend_from_slice(part);
    }
    Key::digest(hex(&sha256(message)))
}

fn hex(bytes: &[u8]) -> String {
    let mut digits = vec![0; 2 * bytes.len()];
    for (pair, &b) in digits.chunks_exact_mut(2).zip(bytes) {
        pair[0] = codec::HEX_DIGITS[usize::from(b >> 4)];
        pair[1] = codec::HEX_DIGITS[usize::from(b & 0xf)];
    }
    String::from_utf8(digits).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::api::endpoint::Endpoint;
    use serde_json::Number;

    #[test]
    fn every_spelling_of_the_chat_path_is_governed() {
        for p in [
            "/v1/chat/completions",
            "/v1/chat/completions?x=1",
            "/v1/chat/completions/",
            "//v1/chat/completions",
            "/v1/chat//completions",
            "/v1/./chat/completions",
            "/v1/x/../chat/completions",
            "/v1/chat/%63ompletions",
            "/v1%2Fchat/completions",
            "/v1/chat/completions#frag",
        ] {
            assert!(is_chat_path(p), "{p}");
        }
        for p in ["/v1/chat/completion", "/v1/embeddings", "/v2/chat/completions", "/v1/chat/completions/x", "/"] {
            assert!(!is_chat_path(p), "{p}");
        }
    }

    #[test]
    fn a_model_that_could_break_a_header_is_refused() {
        let c = Config::default();
        let meta = RequestMeta::default();
        for model in [r"a\u0000b", r"a\r\nx-evil: 1", &"m".repeat(MAX_MODEL_LEN + 1)] {
            let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"x"}}]}}"#);
            let e = ApiRequest::parse(&c, &meta, Endpoint::Chat, body.as_bytes()).expect_err(model);
            assert_eq!((e.status, e.param.as_deref()), (400, Some("model")), "{model}");
        }
    }

    const AUTH_A: RequestMeta<'static> =
        RequestMeta { authorization: Some("Bearer a"), tenant: None, cache_control: None, verified: None };

    fn key(body: &str) -> Key {
        key_with(&Config::default(), &AUTH_A, body)
    }

    fn key_with(c: &Config, meta: &RequestMeta<'_>, body: &str) -> Key {
        ApiRequest::parse(c, meta, Endpoint::Chat, body.as_bytes()).unwrap().key
    }

    fn err(body: &[u8]) -> ApiError {
        ApiRequest::parse(&Config::default(), &AUTH_A, Endpoint::Chat, body).unwrap_err()
    }

    const BASE: &str = r#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"temperature":0}"#;

    #[test]
    fn field_order_and_whitespace_do_not_change_the_key() {
        let reordered = r#"{ "temperature": 0.0, "messages": [ {"content":"hi", "role":"user"} ],
                            "model": "gpt-4.1" }"#;
        assert_eq!(key(BASE), key(reordered));
        assert_eq!(key(BASE).hex().len(), 64);
    }

    #[test]
    fn excluded_fields_do_not_change_the_key() {
        let with = r#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"temperature":0,
                       "stream":false,"user":"u-17","stream_options":{"include_usage":true}}"#;
        assert_eq!(key(BASE), key(with));
    }

    #[test]
    fn every_parameter_changes_the_key() {
        let base = key(BASE);
        for extra in [
            r#""top_p":0.9"#,
            r#""seed":1"#,
            r#""max_tokens":10"#,
            r#""max_completion_tokens":10"#,
            r#""stop":["x"]"#,
            r#""n":2"#,
            r#""presence_penalty":1"#,
            r#""frequency_penalty":1"#,
            r#""logit_bias":{"1":1}"#,
            r#""tools":[]"#,
            r#""tool_choice":"none""#,
            r#""response_format":{"type":"json_object"}"#,
            r#""some_future_field":true"#,
        ] {
            let body = BASE.replacen('{', &format!("{{{extra},"), 1);
            assert_ne!(key(&body), base, "{extra}");
        }
        assert_ne!(key(&BASE.replace(r#""temperature":0"#, r#""temperature":0.5"#)), base);
        assert_ne!(key(&BASE.replace("gpt-4.1", "deepseek-v3")), base);
        assert_ne!(key(&BASE.replace("hi", "hello")), base);
        let system = BASE.replace("[{", r#"[{"role":"system","content":"be brief"},{"#);
        assert_ne!(key(&system), base);
    }

    #[test]
    fn tenant_scope_separates_credentials_and_global_does_not() {
        let b = RequestMeta { authorization: Some("Bearer b"), ..AUTH_A };
        assert_ne!(key(BASE), key_with(&Config::default(), &b, BASE));
        let mut global = Config::default();
        global.cache.scope = Scope::Global;
        assert_eq!(key_with(&global, &AUTH_A, BASE), key_with(&global, &b, BASE));
        let mut by_header = Config::default();
        by_header.cache.tenant_header = Some("x-tenant".into());
        let t1 = RequestMeta { tenant: Some("t1"), ..AUTH_A };
        let t1_other_auth = RequestMeta { tenant: Some("t1"), ..b };
        let t2 = RequestMeta { tenant: Some("t2"), ..AUTH_A };
        assert_eq!(key_with(&by_header, &t1, BASE), key_with(&by_header, &t1_other_auth, BASE));
        assert_ne!(key_with(&by_header, &t1, BASE), key_with(&by_header, &t2, BASE));
    }

    #[test]
    fn bad_input_gets_a_400_naming_the_problem() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        for (body, param) in [
            (&b""[..], None),
            (b"   ", None),
            (b"{", None),
            (b"[1]", None),
            (b"\xff\xfe", None),
            (deep.as_bytes(), None),
            (br#"{"model":"m","messages":[{"role":"user"}],"temperature":1e400}"#, None),
            (br#"{"messages":[{"role":"user"}]}"#, Some("model")),
            (br#"{"model":7,"messages":[{"role":"user"}]}"#, Some("model")),
            (br#"{"model":"m"}"#, Some("messages")),
            (br#"{"model":"m","messages":[]}"#, Some("messages")),
            (br#"{"model":"m","messages":[1]}"#, Some("messages[0]")),
            (br#"{"model":"m","messages":[{"role":"user"}],"temperature":"hot"}"#, Some("temperature")),
            (br#"{"model":"m","messages":[{"role":"user"}],"n":0}"#, Some("n")),
            (br#"{"model":"m","messages":[{"role":"user"}],"stream":"yes"}"#, Some("stream")),
        ] {
            let e = err(body);
            assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(body));
            assert_eq!(e.param.as_deref(), param, "{}", String::from_utf8_lossy(body));
        }
        let small = Config { max_body_bytes: 10, ..Config::default() };
        assert_eq!(ApiRequest::parse(&small, &AUTH_A, Endpoint::Chat, BASE.as_bytes()).unwrap_err().status, 413);
    }

    #[test]
    fn token_estimate_and_model_rewrite() {
        let r = ApiRequest::parse(&Config::default(), &AUTH_A, Endpoint::Chat, BASE.as_bytes()).unwrap();
        assert_eq!(r.estimate_tokens, (BASE.len() as u64).div_ceil(4) + 256);
        let capped = BASE.replacen('{', r#"{"max_tokens":10,"n":3,"#, 1);
        let r = ApiRequest::parse(&Config::default(), &AUTH_A, Endpoint::Chat, capped.as_bytes()).unwrap();
        assert_eq!(r.estimate_tokens, (capped.len() as u64).div_ceil(4) + 30);
        let v: Value = serde_json::from_slice(&with_model(BASE.as_bytes(), "deepseek-v3")).unwrap();
        assert_eq!((v["model"].as_str(), v["temperature"].as_i64()), (Some("deepseek-v3"), Some(0)));
    }

    /// The canonical form is the bytes serde_json writes for the value with integral floats
    /// made integers (keys stay what they were before it was written by hand).
    #[test]
    fn the_canonical_form_is_serde_jsons_compact_form() {
        fn reference(mut v: Value) -> Vec<u8> {
            fn normalise(v: &mut Value) {
                match v {
                    Value::Number(n) if n.is_f64() => {
                        let f = n.as_f64().unwrap();
                        if f.fract() == 0.0 && f.abs() < 9.0e15 {
                            *n = Number::from(f as i64);
                        }
                    }
                    Value::Array(a) => a.iter_mut().for_each(normalise),
                    Value::Object(o) => o.values_mut().for_each(normalise),
                    _ => {}
                }
            }
            normalise(&mut v);
            serde_json::to_vec(&v).unwrap()
        }
        let controls: String = (0u8..0x20).map(char::from).collect();
        let texts = [controls.as_str(), "\"quoted\" \\ back\\slash /", "é ü 中文 🦀 \u{2028}\u{7f}", "", "plain"];
        let numbers = [
            serde_json::json!(1),
            serde_json::json!(-7),
            serde_json::json!(1.0),
            serde_json::json!(-0.0),
            serde_json::json!(2.5),
            serde_json::json!(1e20),
            serde_json::json!(9.5e15),
            serde_json::json!(1.0e-7),
            serde_json::json!(u64::MAX),
            serde_json::json!(i64::MIN),
        ];
        for text in texts {
            let body = serde_json::json!({
                "model": text,
                text: [text, null, true, false, {"nested": {"b": numbers, "a": [[], {}]}}],
                "temperature": 0.0,
            });
            let Value::Object(map) = body.clone() else { unreachable!() };
            assert_eq!(canonical_body(map), reference(body), "{text:?}");
        }
    }

    /// Random request bodies (seeded): writing the same object with its keys in another
    /// order gives the same key; changing any one leaf gives another.
    #[test]
    fn canonical_keys_hold_for_random_bodies() {
        struct Lcg(u64);
        impl Lcg {
            fn next(&mut self, n: u64) -> u64 {
                self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                (self.0 >> 33) % n
            }
        }
        fn value(r: &mut Lcg, depth: u32) -> Value {
            match r.next(if depth > 2 { 4 } else { 6 }) {
                0 => Value::from(r.next(1000)),
                1 => Value::from(r.next(1000) as f64 / 8.0),
                2 => Value::from(format!("s{}", r.next(50))),
                3 => Value::from(r.next(2) == 0),
                4 => Value::Array((0..r.next(4)).map(|_| value(r, depth + 1)).collect()),
                _ => Value::Object((0..r.next(4)).map(|i| (format!("k{i}"), value(r, depth + 1))).collect()),
            }
        }
        /// Serialises with object keys in reverse order (serde_json would sort them).
        fn reversed(v: &Value) -> String {
            match v {
                Value::Object(m) => {
                    let fields: Vec<String> =
                        m.iter().rev().map(|(k, v)| format!("{}:{}", Value::from(k.as_str()), reversed(v))).collect();
                    format!("{{{}}}", fields.join(","))
                }
                Value::Array(a) => format!("[{}]", a.iter().map(reversed).collect::<Vec<_>>().join(",")),
                other => other.to_string(),
            }
        }
        fn leaves(v: &mut Value) -> Vec<&mut Value> {
            match v {
                Value::Object(m) => m.values_mut().flat_map(leaves).collect(),
                Value::Array(a) => a.iter_mut().flat_map(leaves).collect(),
                leaf => vec![leaf],
            }
        }
        let mut r = Lcg(42);
        for _ in 0..500 {
            let mut body = serde_json::json!({"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}]});
            for i in 0..r.next(5) {
                body[format!("x{i}")] = value(&mut r, 0);
            }
            let (sorted, shuffled) = (body.to_string(), reversed(&body));
            assert_eq!(key(&sorted), key(&shuffled), "{shuffled}");
            let before = key(&sorted);
            let mut changed = body.clone();
            let mut all = leaves(&mut changed);
            let n = all.len() as u64;
            let leaf = &mut all[r.next(n) as usize];
            **leaf = match &**leaf {
                Value::String(s) => Value::from(format!("{s}!")),
                Value::Number(x) => Value::from(x.as_f64().unwrap_or(0.0) + 1.5),
                Value::Bool(b) => Value::from(!b),
                _ => Value::from("now a string"),
            };
            assert_ne!(key(&changed.to_string()), before, "{changed}");
        }
    }

    #[test]
    fn nesting_depth_ignores_brackets_in_strings() {
        assert_eq!(nesting_depth(r#"{"a":"[[[[\"{{{{"}"#), 1);
        assert_eq!(nesting_depth("[[[]]]"), 3);
    }

    #[test]
    fn only_real_nesting_is_too_deep() {
        let c = Config::default();
        let deep = BASE.replace(r#""temperature":0"#, &format!(r#""x":{}1{}"#, "[".repeat(65), "]".repeat(65)));
        let e = ApiRequest::parse(&c, &AUTH_A, Endpoint::Chat, deep.as_bytes()).unwrap_err();
        assert_eq!((e.status, e.message.as_str()), (400, "request body nests deeper than 64 levels"));
        // Many brackets side by side (more than the limit, so they are followed) nest two deep.
        let wide = BASE.replace(r#""temperature":0"#, &format!(r#""x":[{}[]]"#, "[],".repeat(100)));
        assert!(ApiRequest::parse(&c, &AUTH_A, Endpoint::Chat, wide.as_bytes()).is_ok());
        assert!(!too_deep(&"{".repeat(64)) && too_deep(&"[".repeat(65)));
    }

    #[test]
    fn cache_control_and_policy() {
        let cc = CacheControl::parse(Some("No-Cache, max-age=30"));
        assert!(cc.no_cache && !cc.no_store);
        assert_eq!(cc.max_age, Some(30));
        assert!(CacheControl::parse(Some("no-store")).no_store);
        let req = ApiRequest::parse(&Config::default(), &AUTH_A, Endpoint::Chat, BASE.as_bytes()).unwrap();
        assert!(req.deterministic);
        let c = Config::default();
        let p = req.policy(&c, CacheControl::parse(Some("no-store")));
        assert!(!p.read && !p.coalesce && !p.store);
        let p = req.policy(&c, CacheControl::parse(Some("no-cache")));
        assert!(!p.read && p.coalesce && p.store);

        let hot = BASE.replace(r#""temperature":0"#, r#""temperature":0.7"#);
        let hot = ApiRequest::parse(&c, &AUTH_A, Endpoint::Chat, hot.as_bytes()).unwrap();
        assert!(!hot.deterministic);
        assert!(hot.policy(&c, CacheControl::default()).store);
        let mut only = Config::default();
        only.cache.only_deterministic = true;
        let p = hot.policy(&only, CacheControl::default());
        assert!(p.coalesce && !p.store);
    }

    #[test]
    fn slots_are_in_range_and_independent_per_salt() {
        let k = key(BASE);
        assert!(k.slot(7, 0) < 7);
        assert_eq!(k.slot(1, 1), 0);
        assert!(Key::from_hex(k.hex()).is_some());
        assert!(Key::from_hex("xyz").is_none());
        // FIPS 180-2's "abc" example, in lowercase hex.
        assert_eq!(hex(&sha256(b"abc".to_vec())), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        // Keys that share a cache group (salt 0) spread over the lease groups (salt 1):
        // the two tables collide independently.
        let keys: Vec<Key> = (0..4096u32).map(|i| request_key("/p", "s", &i.to_le_bytes())).collect();
        let in_slot_0: Vec<&Key> = keys.iter().filter(|k| k.slot(16, 0) == 0).collect();
        let lease_slots: std::collections::HashSet<u32> = in_slot_0.iter().map(|k| k.slot(16, 1)).collect();
        assert!(in_slot_0.len() > 100 && lease_slots.len() == 16, "{} keys over {lease_slots:?}", in_slot_0.len());
    }

    #[test]
    fn sha256_pads_every_length_as_the_streaming_hasher_does() {
        use sha2::Digest;
        // Around every padding edge: 55/56 bytes (the length spills into a second block), 64.
        for len in 0..=200 {
            let message: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            assert_eq!(sha256(message.clone()), <[u8; 32]>::from(sha2::Sha256::digest(&message)), "length {len}");
        }
    }

    #[test]
    fn a_completions_worst_case_counts_every_choice_of_every_prompt() {
        let parse = |body: &str| ApiRequest::parse(&Config::default(), &AUTH_A, Endpoint::Completions, body.as_bytes());
        let many = parse(r#"{"model":"m","prompt":["a","b","c"],"max_tokens":10,"n":2}"#).unwrap();
        assert_eq!((many.choices, many.completion_limit), (6, Some(60)), "three prompts, two choices each");
        let best = parse(r#"{"model":"m","prompt":"a","max_tokens":10,"n":2,"best_of":5}"#).unwrap();
        assert_eq!(best.completion_limit, Some(50), "best_of are all billed");
        let tokens = parse(r#"{"model":"m","prompt":[1,2,3],"max_tokens":10}"#).unwrap();
        assert_eq!(tokens.completion_limit, Some(10), "a list of token numbers is one prompt");
        assert_eq!(parse(r#"{"model":"m"}"#).unwrap_err().code, "missing_required_parameter");
        let e = ApiRequest::parse(&Config::default(), &AUTH_A, Endpoint::Embeddings, br#"{"model":"m","input":[]}"#);
        assert_eq!(e.unwrap_err().param.as_deref(), Some("input"), "an empty list embeds nothing");
        let emb = ApiRequest::parse(&Config::default(), &AUTH_A, Endpoint::Embeddings, br#"{"model":"m","input":"x"}"#)
            .unwrap();
        assert_eq!((emb.completion_limit, emb.deterministic, emb.shared), (Some(0), true, true));
    }
}
