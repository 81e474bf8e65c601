//! Request intake, the same in both shells: the request headers the edge reads, which
//! requests it governs (one `Endpoint` each), what it does with the others, a declared
//! length refused before the body is read, and the body parsed into a keyed request with
//! the cache policy its directives ask for, then decided (`decide`): the step the engine
//! takes and the call it would make.

pub mod door;
pub mod kept;
pub mod recall;

use crate::core::api::endpoint::Endpoint;
use crate::core::api::error::ApiError;
use crate::core::api::head::HeadEdit;
use crate::core::api::headers;
use crate::core::api::objects;
use crate::core::api::priority::Class;
use crate::core::api::reply::{CacheStatus, Reply};
use crate::core::api::response::Response;
use crate::core::api::trace::TraceContext;
use crate::core::cache::batch::{self, Plan};
use crate::core::cache::hot;
use crate::core::coalesce::engine::{Engine, Step};
use crate::core::config::digest;
use crate::core::config::tenants;
use crate::core::config::Config;
use crate::core::config::{Mismatch, Role};
use crate::core::limits::fleet;
use crate::core::request::{
    is_internal_path, is_models_path, ApiRequest, CacheControl, Policy, RequestMeta, PEER_PATH,
};
use crate::core::store::CasStore;
use crate::core::upstream::affinity::{self, Keyed};
use crate::core::upstream::Outbound;
use crate::core::wire::json;
use crate::core::wire::write;
use serde_json::Value;

/// The request headers the edge reads; the first of repeated headers counts, except that a
/// repeated tenant credential is remembered (`Head::check` refuses it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Head {
    pub method: String,
    pub path: String,
    /// The declared body length, when it is a number.
    pub content_length: Option<u64>,
    pub authorization: Option<String>,
    /// The value of the configured tenant header.
    pub tenant: Option<String>,
    pub cache_control: Option<String>,
    pub peer_secret: Option<String>,
    /// `x-holysheep-config`: the digest of the settings of the forward node that sent it.
    pub config_digest: Option<String>,
    /// The header the tenant scope is read from came more than once.
    pub repeated_tenant: bool,
    /// The tenant whose key `authorization` carries, set by `check` (with `tenants`).
    pub verified: Option<String>,
    /// `x-holysheep-priority`: the class the request asks for (it may only lower its own).
    pub priority: Option<String>,
    /// The caller's W3C trace context, as sent (checked when the call is made): a
    /// `traceparent` sent twice or not ASCII is kept empty (no valid one); `tracestate`
    /// headers are joined with commas, and one not ASCII drops them all.
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    pub tracestate_bad: bool,
}

/// What a request's connection says of its sender: the subject alternative names of a
/// client certificate Envoy verified (none on a plain connection), and the fleet's secrets
/// this node holds (the one it sends, and one more it accepts during a rotation).
#[derive(Debug, Default)]
pub struct Peer<'a> {
    pub sans: Vec<String>,
    pub secrets: [Option<&'a str>; 2],
}

impl Peer<'_> {
    /// Whether `offered` is one of the fleet's secrets.
    pub fn knows(&self, offered: Option<&str>) -> bool {
        self.secrets.iter().any(|s| fleet::secret_matches(*s, offered))
    }
}

/// What the edge does with a request, decided from its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST` to a governed endpoint's path, in any spelling.
    Governed(Endpoint),
    /// `/holysheep/...` in any spelling: the fleet's own calls, never a client's.
    Internal,
    /// Everything else: see `Head::ungoverned`.
    Other,
}

/// Request headers a passed-through request loses with the tenant's token: they would
/// choose an organization or project of the operator's account.
const NOT_PASSED_WITH_OPERATOR_KEY: [&str; 2] = ["openai-organization", "openai-project"];

/// The edit of a request passed with the operator's key (`Ungoverned::WithOperatorKey`):
/// the tenant's token taken off with the headers that would choose an organization or
/// project of the operator's account, and the operator's key (`bearer`) put on.
pub fn with_operator_key(bearer: Option<&str>) -> HeadEdit {
    let remove = [headers::AUTHORIZATION].iter().chain(&NOT_PASSED_WITH_OPERATOR_KEY).map(|n| (*n).to_owned());
    let set = bearer.map(|b| (headers::AUTHORIZATION.to_owned(), b.to_owned()));
    HeadEdit { remove: remove.collect(), set: set.into_iter().collect() }
}

/// What becomes of a request the edge does not govern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ungoverned {
    /// It passes untouched, with the client's own credentials (no `tenants`).
    Pass,
    /// It passes with the tenant's key taken off and the operator's put on: a path the
    /// operator lists in `passthrough_paths`, for a verified tenant.
    WithOperatorKey,
    /// The edge answers it: `GET /v1/models` for a tenant, or an error.
    Answer(Result<Response, ApiError>),
}

/// A chat request as the core takes it.
#[derive(Debug)]
pub struct Intake {
    pub request: ApiRequest,
    pub policy: Policy,
}

/// A governed request decided: its parse, the engine's step, and the call it makes if it
/// leads (or the form its answer takes if it waits or is answered).
#[derive(Debug)]
pub struct Decision {
    pub request: ApiRequest,
    pub step: Step,
    pub outbound: Outbound,
    pub keep: Keep,
    /// A flight this decision ended at once (an embeddings list wholly cached item by
    /// item): its key, and whether anyone waited on it (then every worker is woken).
    pub ended: Option<(crate::core::api::key::Key, bool)>,
}

/// What a shell keeps for the next request with the same bytes from the same tenant (it
/// finds them by `Head::scope_bytes` and the body). Only requests without directives are
/// kept: directives change what may be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Keep {
    /// The request was a HIT: the same bytes are likely a HIT again, so a shell that keeps
    /// answers in its own memory keeps this one.
    pub answer: bool,
    /// It was a HIT or waits for a flight (part of a crowd), and was parsed now: its parse
    /// saves the next identical request the parse, canonical form and hash.
    pub parse: bool,
}

impl Head {
    /// From the request's header pairs as the host holds them (names in lower case). The
    /// shell sets `method` and `path` when its host keeps them outside the headers.
    pub fn read<'a>(pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>, tenant_header: Option<&str>) -> Head {
        let mut h = Head::default();
        // The tenant scope comes from the tenant header, or else from `authorization`.
        let credential = tenant_header.unwrap_or(headers::AUTHORIZATION).as_bytes();
        for (name, value) in pairs {
            let slot = match name {
                b":method" => {
                    h.method = text(value.to_vec());
                    continue;
                }
                b":path" => {
                    h.path = text(value.to_vec());
                    continue;
                }
                b"content-length" => {
                    let declared = std::str::from_utf8(value).ok().and_then(|l| l.trim().parse().ok());
                    h.content_length = h.content_length.or(declared);
                    continue;
                }
                b"authorization" => &mut h.authorization,
                b"cache-control" => &mut h.cache_control,
                n if n == headers::PRIORITY.as_bytes() => &mut h.priority,
                n if n == headers::PEER_SECRET.as_bytes() => &mut h.peer_secret,
                n if n == headers::CONFIG.as_bytes() => &mut h.config_digest,
                n if n == headers::TRACEPARENT.as_bytes() => {
                    let once = h.traceparent.is_none() && value.is_ascii();
                    h.traceparent = Some(if once { text(value.to_vec()) } else { String::new() });
                    continue;
                }
                n if n == headers::TRACESTATE.as_bytes() => {
                    h.tracestate_bad |= !value.is_ascii();
                    let more = text(value.to_vec());
                    h.tracestate = Some(match h.tracestate.take() {
                        Some(state) => format!("{state},{more}"),
                        None => more,
                    });
                    continue;
                }
                n if Some(n) == tenant_header.map(str::as_bytes) => &mut h.tenant,
                _ => continue,
            };
            if slot.is_none() {
                *slot = Some(text(value.to_vec()));
            } else if name == credential {
                h.repeated_tenant = true;
            }
            // Envoy joins a repeated `authorization` into one value with commas, which no
            // single credential holds (RFC 7235: one challenge response; a bearer token has
            // no comma).
            h.repeated_tenant |= name == credential && name == b"authorization" && value.contains(&b',');
        }
        h
    }

    /// On an owner listener that serves only the fleet (`fleet.internal`), an API request
    /// (governed, or under `/v1/` in any spelling) must come from a node: over a connection
    /// whose verified client certificate names one of `fleet.peer_sans`, or with the
    /// fleet's secret. Anything else is a 403 before any of it is read or served (a health
    /// check outside the API passes).
    pub fn from_fleet(&self, config: &Config, peer: &Peer<'_>) -> Result<(), ApiError> {
        let api = self.endpoint().is_some()
            || crate::core::api::path::segments(&self.path).first().is_some_and(|s| s.eq_ignore_ascii_case("v1"));
        if !config.fleet.internal || config.role != Role::Owner || !api {
            return Ok(());
        }
        if self.sent_by_node(config, peer) {
            return Ok(());
        }
        Err(ApiError {
            status: 403,
            message: "this listener serves the fleet's own nodes: the request came without a verified peer \
                      certificate or the fleet's secret"
                .into(),
            kind: "invalid_request_error",
            param: None,
            code: "peer_required",
        })
    }

    /// Whether a request to `/holysheep/...` (in any spelling, `Route::Internal`) is a
    /// model owner call this node serves: `POST` to the peer path with the fleet's secret
    /// (`peer` knows it), on an owner. Refused everywhere else: not found on a forward
    /// node and for any other method or path, forbidden without the secret.
    pub fn internal(&self, config: &Config, peer: &Peer<'_>) -> Result<(), ApiError> {
        let not_found = || ApiError::not_found(&self.method, &self.path);
        if config.role == Role::Forward {
            return Err(not_found());
        }
        if !peer.knows(self.peer_secret.as_deref()) {
            return Err(ApiError::forbidden("internal fleet call without the fleet's secret"));
        }
        if self.method != "POST" || self.path != PEER_PATH {
            return Err(not_found());
        }
        Ok(())
    }

    /// What of the request's head changes before it goes on, on the fleet's terms (`names`:
    /// the request's header names). An owner takes off the secret and the digest that proved
    /// this hop: nothing passed on from here carries them. A forward node takes off the
    /// client's fleet headers (`headers::stripped_on_the_hop`), then says who it is to the
    /// owners: the fleet's `secret`, where it has one (they know it by that where no verified
    /// certificate says so), and what it runs (`config::digest`).
    pub fn fleet_edit<'a>(
        &self,
        config: &Config,
        secret: Option<&str>,
        names: impl Iterator<Item = &'a str>,
    ) -> HeadEdit {
        let mut edit = HeadEdit::default();
        match config.role {
            Role::Owner => {
                let proofs = [(headers::PEER_SECRET, &self.peer_secret), (headers::CONFIG, &self.config_digest)];
                edit.remove = proofs.iter().filter(|(_, sent)| sent.is_some()).map(|(n, _)| (*n).to_owned()).collect();
            }
            Role::Forward => {
                edit.remove = names.filter(|n| headers::stripped_on_the_hop(n)).map(str::to_owned).collect();
                edit.set.extend(secret.map(|s| (headers::PEER_SECRET.to_owned(), s.to_owned())));
                edit.set.push((headers::CONFIG.to_owned(), config.digest.clone()));
            }
        }
        edit
    }

    /// The caller's trace context, if it sent a valid one (`TraceContext::of`).
    pub fn trace(&self) -> Option<TraceContext> {
        let state = self.tracestate.as_deref().filter(|_| !self.tracestate_bad);
        TraceContext::of(self.traceparent.as_deref(), state)
    }

    /// Whether a node of the fleet sent this request: its connection's verified client
    /// certificate names one of `fleet.peer_sans`, or it carries one of the fleet's secrets.
    fn sent_by_node(&self, config: &Config, peer: &Peer<'_>) -> bool {
        peer.sans.iter().any(|s| config.fleet.peer_sans.contains(s)) || peer.knows(self.peer_secret.as_deref())
    }

    /// The configuration digest a node of the fleet (`peer` proves it: a verified
    /// certificate that names one of `fleet.peer_sans`, or the fleet's secret) sent with this
    /// request, when it is not this owner's own: the two nodes run other settings of keys,
    /// scopes or prices (`config::digest`). A digest nothing proves is no node's, and is
    /// ignored. `Err`: the owner refuses such hops (`fleet.config_mismatch`).
    pub fn foreign_config(&self, config: &Config, peer: &Peer<'_>) -> Option<Result<&str, ApiError>> {
        let theirs = self.config_digest.as_deref().filter(|d| *d != config.digest && config.role == Role::Owner)?;
        if !self.sent_by_node(config, peer) {
            return None;
        }
        if config.fleet.config_mismatch == Mismatch::Count {
            return Some(Ok(theirs));
        }
        Some(Err(ApiError {
            status: 503,
            message: format!(
                "the edge node that passed this request on runs other settings (configuration digest {}) than \
                 the node that owns it: they would key, scope or price it differently, and this owner refuses \
                 such hops until every node runs one configuration",
                digest::shown(theirs)
            ),
            kind: "server_error",
            param: None,
            code: "fleet_config_mismatch",
        }))
    }

    pub fn route(&self) -> Route {
        match self.endpoint() {
            Some(e) if self.method == "POST" => Route::Governed(e),
            Some(_) => Route::Other,
            None if is_internal_path(&self.path) => Route::Internal,
            None => Route::Other,
        }
    }

    /// The governed endpoint its path names, whatever the method.
    pub fn endpoint(&self) -> Option<Endpoint> {
        Endpoint::of_path(&self.path)
    }

    /// What the edge does with a request it does not govern. Without `tenants` it passes
    /// as it came. With them the edge answers `GET /v1/models`; a path the operator
    /// lists in `passthrough_paths` passes for a verified tenant with the operator's key;
    /// any other request of the API (under `/v1/`) or with a tenant's key is refused here,
    /// so no tenant's call reaches HolySheep without a key or outside the edge's accounts.
    /// The rest (a health check, say) passes as it came.
    pub fn ungoverned(&self, config: &Config) -> Ungoverned {
        if config.keys.is_empty() {
            return Ungoverned::Pass;
        }
        if self.repeated_tenant {
            // Two credentials: the edge cannot say which one is the tenant's.
            return Ungoverned::Answer(Err(ambiguous_tenant(config)));
        }
        if let Some(answer) = models_answer(config, self) {
            return Ungoverned::Answer(answer);
        }
        let api = crate::core::api::path::segments(&self.path).first().is_some_and(|s| s.eq_ignore_ascii_case("v1"));
        if !api && config.keys.verify(self.authorization.as_deref()).is_err() {
            return Ungoverned::Pass;
        }
        if !config.passes_through(&self.path) {
            return Ungoverned::Answer(Err(ApiError::not_served(&self.method, &self.path)));
        }
        match config.keys.verify(self.authorization.as_deref()) {
            Ok(_) => Ungoverned::WithOperatorKey,
            Err(e) => Ungoverned::Answer(Err(e)),
        }
    }

    /// What the head alone refuses, before any of the body is read: a repeated tenant
    /// credential (an auth layer that appends a verified copy must not lose to the
    /// client's own), a key no tenant holds (with `tenants`: the tenant it names is then
    /// `verified`), and a body declared larger than `max_body_bytes`.
    pub fn check(&mut self, config: &Config) -> Result<(), ApiError> {
        if self.repeated_tenant {
            return Err(ambiguous_tenant(config));
        }
        if !config.keys.is_empty() {
            self.verified = Some(config.keys.verify(self.authorization.as_deref())?.to_owned());
        }
        match self.content_length {
            Some(declared) if declared > config.max_body_bytes as u64 => {
                Err(ApiError::too_large(config.max_body_bytes))
            }
            _ => Ok(()),
        }
    }

    /// Without directives (`cache-control`), which change what may be served: only such
    /// requests are answered from a shell's per-worker copies or their parses.
    pub fn plain(&self) -> bool {
        self.cache_control.is_none()
    }

    /// The bytes of the caller's scope, which with the body's make a request's raw bytes.
    /// The endpoint is part of them: one body sent to two endpoints is two requests.
    pub fn scope_bytes(&self) -> Vec<u8> {
        let mut bytes = hot::tenant_bytes(self.authorization.as_deref(), self.tenant.as_deref());
        bytes.push(self.endpoint().unwrap_or_default() as u8);
        bytes
    }

    pub fn meta(&self) -> RequestMeta<'_> {
        RequestMeta {
            authorization: self.authorization.as_deref(),
            tenant: self.tenant.as_deref(),
            cache_control: self.cache_control.as_deref(),
            verified: self.verified.as_deref(),
        }
    }
}

/// The whole body of a `Route::Governed` request: parsed, keyed (scoped to the tenant and
/// the endpoint), with its cache policy.
pub fn intake(config: &Config, head: &Head, body: &[u8]) -> Result<Intake, ApiError> {
    let meta = head.meta();
    let request = ApiRequest::parse(config, &meta, head.endpoint().unwrap_or_default(), body)?;
    allowed(config, &request)?;
    let class = Class::of(config.class_of(request.tenant.as_deref()), head.priority.as_deref())?;
    let policy = Policy { class, ..request.policy(config, CacheControl::parse(meta.cache_control)) };
    Ok(Intake { request, policy })
}

/// `intake`, or, for a request without directives, the parse a shell kept for exactly its
/// bytes from the same tenant (`known`: a per-worker or per-instance memo), which costs
/// nothing more than a clone. A request with `cache-control` is always parsed.
pub(crate) fn intake_or_known(
    config: &Config,
    head: &Head,
    body: &[u8],
    known: Option<&ApiRequest>,
) -> Result<Intake, ApiError> {
    match known.filter(|k| head.plain() && k.endpoint == head.endpoint().unwrap_or_default()) {
        Some(request) => {
            allowed(config, request)?;
            let class = Class::of(config.class_of(request.tenant.as_deref()), head.priority.as_deref())?;
            let request = request.clone();
            let policy = Policy { class, ..request.policy(config, CacheControl::default()) };
            Ok(Intake { request, policy })
        }
        None => intake(config, head, body),
    }
}

/// With `tenants`, `GET /v1/models` is the edge's to answer: the verified tenant's models
/// (so an SDK's `models.list()` tells the truth), or the 401 of a key no tenant holds.
/// `None` for any other request, or without tenants.
fn models_answer(config: &Config, head: &Head) -> Option<Result<Response, ApiError>> {
    let listing = head.method == "GET" && is_models_path(&head.path);
    if !listing || config.keys.is_empty() {
        return None;
    }
    let answer = config.keys.verify(head.authorization.as_deref()).map(|tenant| {
        let body = models_list(config, tenant);
        let mut response = Response::json(200, body);
        response.headers.push((headers::TENANT.to_owned(), tenant.to_owned()));
        response
    });
    Some(answer)
}

/// The body of `GET /v1/models` for `tenant`: its models, or else every model the
/// configuration names (not `default`), in OpenAI's list shape.
fn models_list(config: &Config, tenant: &str) -> Vec<u8> {
    let listed = config.tenants.get(tenant).and_then(|t| t.models.clone());
    let names = listed.unwrap_or_else(|| config.models.keys().filter(|m| *m != "default").cloned().collect());
    let data = names.iter().map(|id| {
        json::object([
            ("id", Value::from(id.as_str())),
            ("object", Value::from("model")),
            ("created", Value::from(0)),
            ("owned_by", Value::from("holysheep")),
        ])
    });
    write::value(&json::object([("object", Value::from("list")), ("data", Value::Array(data.collect()))]))
}

/// A verified tenant may call the models its configuration lists, and a tenant with a
/// dollar budget only models with a price (any other name is unknown to it).
/// A tenant verified under a configuration reloaded since (its body still arriving) is
/// held to the configuration now in force: gone, it is unknown.
fn allowed(config: &Config, request: &ApiRequest) -> Result<(), ApiError> {
    let Some(name) = request.tenant.as_deref() else { return Ok(()) };
    match config.tenants.get(name) {
        None => Err(ApiError::invalid_api_key()),
        Some(t) if !t.allows(&request.model) || !config.prices_for(t, &request.model) => {
            Err(tenants::model_not_found(&request.model))
        }
        Some(_) => Ok(()),
    }
}

/// A governed request's whole body, with its head: parsed (or taken from `known`, the parse
/// a shell kept for the same bytes), admitted by the engine at `now_ms`, and made into the
/// call a leader sends, carrying the client's own `authorization` for when no operator key
/// is configured.
pub fn decide<S: CasStore>(
    engine: &Engine<'_, S>,
    head: Head,
    body: &[u8],
    known: Option<&ApiRequest>,
    now_ms: u64,
    nonce: u64,
) -> Result<Decision, ApiError> {
    let Intake { request, policy } = intake_or_known(engine.config, &head, body, known)?;
    // Everything that refuses the request is decided before it takes a lease.
    let unsigned = tenants_objects(engine.config, &request)?;
    let budgeted =
        request.tenant.as_deref().and_then(|t| engine.config.tenants.get(t)).is_some_and(|t| !t.caps().is_none());
    let supplied_ceiling = if budgeted { unseen_input(engine.config, &request)? } else { None };
    let step = engine.admit(&request.key, policy, now_ms, nonce);
    let (step, batch, ended) = match step {
        Step::Call(call) => by_item(engine, &request, call, body, now_ms),
        step => (step, None, None),
    };
    let hit = matches!(&step, Step::Reply(r) if r.cache == Some(CacheStatus::Hit));
    let plain = head.plain();
    let keep = Keep { answer: plain && hit, parse: plain && known.is_none() && (hit || matches!(step, Step::Wait(_))) };
    // A reply needs the request's form, not its body; a call (now, or a waiter's later)
    // sends it.
    let body = match (&step, &batch) {
        (Step::Reply(_), _) => Vec::new(),
        (_, Some(Plan::Call(_, Some(fewer)))) => fewer.clone(),
        _ => match &unsigned {
            // HolySheep gets its own id back, without the tenant's signature.
            Some(id) => objects::unsign_in(body, id),
            None => body.to_vec(),
        },
    };
    // HolySheep's prompt cache: the key the call goes with (`upstream::affinity`), in the
    // tenant's scope (verified, else the trusted header's). A forward node passes the body
    // on as it came: its owner keys it.
    let (body, affinity) = match engine.config.role {
        Role::Owner => {
            let scope = request.tenant.as_deref().or(head.tenant.as_deref());
            let on = engine.config.affinity(&request.model, request.tenant.as_deref());
            match affinity::keyed(&body, request.endpoint, &request.model, scope, on) {
                Keyed::Set(keyed) => (keyed, true),
                Keyed::Scoped(keyed) => (keyed, false),
                Keyed::Unchanged => (body, false),
            }
        }
        Role::Forward => (body, false),
    };
    // A tenant's token is the edge's to check, never HolySheep's to see.
    let trace = head.trace();
    let client_authorization = head.authorization.filter(|_| request.tenant.is_none());
    let mut outbound =
        Outbound { class: policy.class, trace, affinity, ..Outbound::of(&request, body, client_authorization) };
    if let Some(Plan::Call(batch, fewer)) = batch {
        if fewer.is_some() {
            // Only the items the cache does not hold are sent, estimated, and billed.
            outbound.estimate_tokens = outbound.prompt_estimate();
        }
        outbound.batch = Some(batch);
    }
    // A call whose worst case a limit needs (its tenant's dollar budget, or the model's
    // token bucket, which every caller shares) is bounded: without a completion limit of
    // its own it is sent with the model's cap, and estimated with it.
    outbound.supplied_ceiling = supplied_ceiling;
    if request.completion_limit.is_none() && request.endpoint.cap_field().is_some() {
        if let Some(cap) = engine.config.completion_cap(&request.model, budgeted) {
            outbound.completion_cap = Some(cap);
            if outbound.batch.is_none() {
                let completion = cap.saturating_mul(request.choices.max(1));
                outbound.estimate_tokens = outbound.prompt_estimate().saturating_add(completion);
            }
        }
    }
    Ok(Decision { request, step, outbound, keep, ended })
}

/// A verified tenant's call may name only stored objects its own calls made: a
/// `previous_response_id` signed for it (HolySheep's own id is returned, to send in its
/// place), and no conversation, stored item or file by id, whose owner the edge cannot
/// tell. Anything else is a 404, as for an object that does not exist, before any call.
/// Checked on the owner node (a forward node passes the request on as it came).
fn tenants_objects(config: &Config, request: &ApiRequest) -> Result<Option<String>, ApiError> {
    if request.tenant.is_none() || config.role != Role::Owner {
        return Ok(None);
    }
    if let Some(param) = &request.foreign_object {
        return Err(ApiError {
            status: 404,
            message: format!("'{param}' names a stored object this edge cannot tell is yours; it is not served"),
            kind: "invalid_request_error",
            param: Some(param.clone()),
            code: "not_found",
        });
    }
    let (Some(tenant), Some(signed)) = (&request.tenant, &request.previous_response_id) else { return Ok(None) };
    let id = config.object_key.as_ref().and_then(|k| k.verify(tenant, signed));
    match id {
        Some(id) => Ok(Some(id.to_owned())),
        None => Err(objects::not_found("previous_response_id", signed)),
    }
}

/// For a budgeted tenant's call, input HolySheep bills that the edge cannot see: a hosted
/// tool (billed per call) is refused; input HolySheep supplies itself (a stored response,
/// a file, an image by URL) is reserved at the model's `context_window`, or refused when
/// none is configured. Each refusal names the field.
fn unseen_input(config: &Config, request: &ApiRequest) -> Result<Option<u64>, ApiError> {
    if let Some(param) = &request.hosted_tool {
        return Err(ApiError::invalid(
            format!("'{param}' is a hosted tool HolySheep bills per call; a tenant with a dollar budget cannot use it"),
            Some(param),
            "unsupported_parameter",
        ));
    }
    let Some(param) = &request.supplied_input else { return Ok(None) };
    match config.model(&request.model).and_then(|(_, m)| m.context_window) {
        Some(window) => Ok(Some(window)),
        None => Err(ApiError::invalid(
            format!(
                "'{param}' makes HolySheep bill input the edge cannot see; a tenant with a dollar budget may use it \
                 only on a model with a configured context_window"
            ),
            Some(param),
            "unsupported_parameter",
        )),
    }
}

/// The 400 of a request whose tenant credential came more than once.
fn ambiguous_tenant(config: &Config) -> ApiError {
    let named = config.cache.tenant_header.as_deref().unwrap_or(headers::AUTHORIZATION);
    ApiError::invalid(
        format!("the '{named}' header, which names the tenant, must appear once"),
        None,
        "ambiguous_tenant",
    )
}

/// A leader of an embeddings list: answered from the cached items when they make the
/// whole answer exactly (the flight ends at once, a HIT), else the call it makes embeds
/// only the items the cache does not hold (`batch::plan`). Only on a model owner, for a
/// model without fallbacks (another model's vectors would not mix with these).
fn by_item<S: CasStore>(
    engine: &Engine<'_, S>,
    request: &ApiRequest,
    call: crate::core::coalesce::engine::Call,
    body: &[u8],
    now_ms: u64,
) -> (Step, Option<Plan>, Option<(crate::core::api::key::Key, bool)>) {
    let config = engine.config;
    let alone = config.model(&request.model).is_none_or(|(_, m)| m.fallback.is_empty());
    let Some(keys) = request.items.as_ref().filter(|_| alone && config.role == Role::Owner) else {
        return (Step::Call(call), None, None);
    };
    let using = batch::Use { read: call.policy.read, max_age_s: call.policy.max_age, learn: call.store };
    match batch::plan(engine.store, config, keys, body, using, now_ms) {
        Some(Plan::Answered(answer, fresh)) => {
            let answer = answer.with_header(headers::MODEL, request.model.clone());
            let ended = engine.end_flight(&call, Some(answer), now_ms, Some(fresh));
            let age_s = Some(now_ms.saturating_sub(fresh.stored_at_ms) / 1000);
            let reply = Reply { cache: Some(CacheStatus::Hit), age_s, ..ended.reply };
            (Step::Reply(reply), None, Some((call.key, ended.watched)))
        }
        plan => (Step::Call(call), plan, None),
    }
}

/// A header value as text. Envoy lets bytes that are not UTF-8 through (obs-text); they
/// are kept as `%XX` escapes, so no reader of headers can fail on them.
pub fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| {
        e.as_bytes()
            .iter()
            .map(|&b| if b.is_ascii() { char::from(b).to_string() } else { format!("%{b:02X}") })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::api::objects::ObjectKey;

    fn head(pairs: &[(&str, &[u8])], tenant: Option<&str>) -> Head {
        Head::read(pairs.iter().map(|(n, v)| (n.as_bytes(), *v)), tenant)
    }

    #[test]
    fn a_request_passed_with_the_operators_key_loses_the_tenants_and_its_account_choices() {
        let edit = with_operator_key(Some("Bearer sk-op"));
        assert_eq!(edit.remove, ["authorization", "openai-organization", "openai-project"]);
        assert_eq!(edit.set, [("authorization".to_owned(), "Bearer sk-op".to_owned())]);
        assert!(
            with_operator_key(None).set.is_empty(),
            "no operator key: none is put on (the tenant's is taken off all the same)"
        );
    }

    #[test]
    fn an_internal_call_is_served_only_on_an_owner_with_the_fleets_secret_and_its_path() {
        let owner = Config::default();
        let node = Peer { sans: Vec::new(), secrets: [Some("s"), None] };
        let call = |method: &str, secret: Option<&str>| Head {
            method: method.into(),
            path: PEER_PATH.into(),
            peer_secret: secret.map(str::to_owned),
            ..Head::default()
        };
        assert_eq!(call("POST", Some("s")).internal(&owner, &node), Ok(()));
        assert_eq!(call("POST", Some("x")).internal(&owner, &node).map_err(|e| e.status), Err(403));
        assert_eq!(call("GET", Some("s")).internal(&owner, &node).map_err(|e| e.status), Err(404));
        let forward = Config { role: Role::Forward, ..Config::default() };
        assert_eq!(call("POST", Some("s")).internal(&forward, &node).map_err(|e| e.status), Err(404));
    }

    #[test]
    fn an_owner_takes_off_the_hops_proofs_and_a_forward_node_says_who_it_is() {
        let owner = Config::default();
        let head = Head { peer_secret: Some("s".into()), ..Head::default() };
        let names = ["x-holysheep-key", "x-holysheep-priority", "x-holysheep-peer-secret", "cookie"];
        let edit = head.fleet_edit(&owner, Some("s"), names.into_iter());
        assert_eq!(edit.remove, ["x-holysheep-peer-secret"], "the digest was not sent: nothing to take off");
        assert!(edit.set.is_empty());
        let forward = Config { role: Role::Forward, ..Config::default() };
        let edit = Head::default().fleet_edit(&forward, Some("s"), names.into_iter());
        assert_eq!(edit.remove, ["x-holysheep-key", "x-holysheep-peer-secret"], "the client's priority goes on");
        let digest = forward.digest.clone();
        assert_eq!(edit.set, [("x-holysheep-peer-secret".into(), "s".into()), ("x-holysheep-config".into(), digest)]);
        let edit = Head::default().fleet_edit(&forward, None, names.into_iter());
        assert_eq!(edit.set.len(), 1, "no secret to send, but what it runs: {:?}", edit.set);
    }

    #[test]
    fn a_trace_context_sent_twice_or_not_ascii_is_no_trace_context() {
        let parent: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let trace = |pairs: &[(&str, &[u8])]| {
            head(pairs, None).trace().map(|t| t.headers().map(|(_, v)| v.to_owned()).collect::<Vec<_>>())
        };
        let good = String::from_utf8(parent.to_vec()).unwrap();
        assert_eq!(
            trace(&[("traceparent", parent), ("tracestate", b"a=1"), ("tracestate", b"b=2")]),
            Some(vec![good.clone(), "a=1,b=2".into()]),
            "tracestate headers join"
        );
        assert_eq!(trace(&[("traceparent", parent), ("traceparent", parent)]), None, "twice is none");
        assert_eq!(trace(&[("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\xff")]), None);
        assert_eq!(
            trace(&[("traceparent", parent), ("tracestate", b"a=1"), ("tracestate", b"b=\xff")]),
            Some(vec![good]),
            "not ASCII: no tracestate"
        );
    }

    #[test]
    fn the_first_of_repeated_headers_counts_and_odd_bytes_become_escapes() {
        let h = head(
            &[
                (":method", b"POST"),
                (":path", b"/v1/chat/completions"),
                ("authorization", b"Bearer \xff"),
                ("authorization", b"Bearer second"),
                ("x-tenant", b"acme"),
                ("content-length", b" 12 "),
                ("content-length", b"99"),
                ("cache-control", b""),
                ("cache-control", b"no-store"),
            ],
            Some("x-tenant"),
        );
        assert_eq!(h.authorization.as_deref(), Some("Bearer %FF"));
        assert_eq!(h.tenant.as_deref(), Some("acme"));
        assert_eq!(h.content_length, Some(12));
        assert_eq!(h.cache_control.as_deref(), Some(""), "present, if empty");
        assert_eq!(h.peer_secret, None);
        assert_eq!(head(&[("x-tenant", b"acme")], None).tenant, None, "no tenant header configured");
        assert!(!h.repeated_tenant, "authorization is not the tenant when a tenant header is configured");
    }

    #[test]
    fn a_repeated_tenant_credential_is_refused_before_the_body() {
        let config = Config::default();
        let mut twice = head(&[("authorization", b"Bearer a"), ("authorization", b"Bearer b")], None);
        let e = twice.check(&config).unwrap_err();
        assert_eq!((e.status, e.code), (400, "ambiguous_tenant"));
        let mut joined = head(&[("authorization", b"Bearer a,Bearer b")], None);
        assert_eq!(joined.check(&config).map_err(|e| e.code), Err("ambiguous_tenant"), "as Envoy joins them");
        assert!(head(&[("authorization", b"Bearer a.b_c-d~e+f/g=")], None).check(&config).is_ok());
        let tenant = Config {
            cache: crate::core::config::Cache { tenant_header: Some("x-tenant".into()), ..Config::default().cache },
            ..Config::default()
        };
        let mut by_header =
            head(&[("x-tenant", b"a"), ("authorization", b"Bearer a"), ("x-tenant", b"a")], Some("x-tenant"));
        assert_eq!(by_header.check(&tenant).map_err(|e| e.code), Err("ambiguous_tenant"), "even the same value twice");
        assert!(head(&[("x-tenant", b"a"), ("authorization", b"x"), ("authorization", b"y")], Some("x-tenant"))
            .check(&tenant)
            .is_ok());
    }

    #[test]
    fn routes_chat_in_any_spelling_and_internal_paths_before_methods() {
        let route =
            |method: &str, path: &str| Head { method: method.into(), path: path.into(), ..Head::default() }.route();
        assert_eq!(route("POST", "/v1/chat/completions"), Route::Governed(Endpoint::Chat));
        assert_eq!(route("POST", "//v1/./chat/%63ompletions?x=1"), Route::Governed(Endpoint::Chat));
        assert_eq!(route("GET", "/v1/chat/completions"), Route::Other);
        assert_eq!(route("POST", "/v1/models"), Route::Other);
        assert_eq!(route("GET", "/HolySheep/peer/bucket"), Route::Internal);
        assert_eq!(route("POST", "/v1/../holysheep/x"), Route::Internal);
    }

    #[test]
    fn an_owner_tells_a_hop_from_a_node_that_runs_other_settings() {
        let owner = Config::parse(
            br#"{"models":{"gpt-4.1":{"usd_per_mtok_input":2}},"fleet":{"peer_sans":["spiffe://fleet/node"]}}"#,
        )
        .unwrap();
        let hop = |digest: Option<&str>| Head {
            config_digest: digest.map(str::to_owned),
            peer_secret: Some("s3cret".into()),
            ..Head::default()
        };
        let node = Peer { sans: vec![], secrets: [Some("s3cret"), None] };
        assert_eq!(hop(None).foreign_config(&owner, &node), None, "a client's request says nothing");
        assert_eq!(hop(Some(&owner.digest)).foreign_config(&owner, &node), None, "the same settings");
        let other = Config::parse(br#"{"models":{"gpt-4.1":{"usd_per_mtok_input":3}}}"#).unwrap();
        assert_eq!(hop(Some(&other.digest)).foreign_config(&owner, &node), Some(Ok(other.digest.as_str())));
        // Only a node's word counts: its secret, or a verified certificate of the fleet.
        let stranger = Peer { sans: vec!["spiffe://other".into()], secrets: [Some("another"), None] };
        assert_eq!(hop(Some(&other.digest)).foreign_config(&owner, &stranger), None, "no node sent it");
        let certified = Peer { sans: vec!["spiffe://fleet/node".into()], secrets: [None, None] };
        let unsigned = Head { peer_secret: None, ..hop(Some(&other.digest)) };
        assert_eq!(unsigned.foreign_config(&owner, &certified), Some(Ok(other.digest.as_str())));
        let strict = Config::parse(br#"{"fleet":{"config_mismatch":"refuse"}}"#).unwrap();
        let Some(Err(e)) = hop(Some("<b>0123</b>")).foreign_config(&strict, &node) else { panic!("refused") };
        assert_eq!((e.status, e.kind, e.code), (503, "server_error", "fleet_config_mismatch"));
        assert!(e.message.contains("digest b0123b)") && !e.message.contains(&strict.digest), "{}", e.message);
        let forward = Config { role: Role::Forward, ..strict.clone() };
        assert_eq!(hop(Some("0123")).foreign_config(&forward, &node), None, "only an owner compares");
    }

    #[test]
    fn an_internal_owner_listener_serves_only_requests_a_node_sent() {
        let config = Config::parse(br#"{"fleet":{"internal":true,"peer_sans":["spiffe://fleet/node"]}}"#).unwrap();
        let head = |path: &str, secret: Option<&str>| Head {
            method: "POST".into(),
            path: path.into(),
            peer_secret: secret.map(str::to_owned),
            ..Head::default()
        };
        let peer = |sans: &[&str]| Peer {
            sans: sans.iter().map(|s| (*s).to_owned()).collect(),
            secrets: [Some("s3cret"), Some("next-one")],
        };
        let chat = "/v1/chat/completions";
        let code = |r: Result<(), ApiError>| r.map_err(|e| (e.status, e.code));
        assert_eq!(code(head(chat, None).from_fleet(&config, &peer(&[]))), Err((403, "peer_required")));
        assert_eq!(code(head(chat, None).from_fleet(&config, &peer(&["spiffe://fleet/node"]))), Ok(()));
        let other = peer(&["spiffe://elsewhere/node"]);
        assert_eq!(code(head(chat, None).from_fleet(&config, &other)), Err((403, "peer_required")), "another SAN");
        assert_eq!(code(head(chat, Some("s3cret")).from_fleet(&config, &peer(&[]))), Ok(()), "the secret");
        assert_eq!(code(head(chat, Some("next-one")).from_fleet(&config, &peer(&[]))), Ok(()), "the accepted one");
        assert_eq!(code(head(chat, Some("s3cre")).from_fleet(&config, &peer(&[]))), Err((403, "peer_required")));
        assert_eq!(code(head("/V1/models", None).from_fleet(&config, &peer(&[]))), Err((403, "peer_required")));
        assert_eq!(code(head("/healthz", None).from_fleet(&config, &peer(&[]))), Ok(()), "outside the API");
        // Not internal (a standalone edge serves its clients), or a forward node: no check.
        assert_eq!(code(head(chat, None).from_fleet(&Config::default(), &peer(&[]))), Ok(()));
        let forward = Config::parse(br#"{"role":"forward","fleet":{"internal":true}}"#).unwrap_err();
        assert!(forward.to_string().contains("fleet.internal"), "{forward}");
    }

    #[test]
    fn with_tenants_only_listed_paths_pass_and_with_the_operators_key() {
        let token = "hs-t";
        let digest: String =
            crate::core::wire::digest::sha256(token.as_bytes().to_vec()).iter().map(|b| format!("{b:02x}")).collect();
        let raw = format!(r#"{{"tenants":{{"t":{{"keys_sha256":["{digest}"]}}}},"passthrough_paths":["/v1/files"]}}"#);
        let config = Config::parse(raw.as_bytes()).unwrap();
        let head = |method: &str, path: &str, auth: Option<&str>| Head {
            method: method.into(),
            path: path.into(),
            authorization: auth.map(str::to_owned),
            ..Head::default()
        };
        let tenant = Some("Bearer hs-t");
        let refused = |h: Head| match h.ungoverned(&config) {
            Ungoverned::Answer(Err(e)) => (e.status, e.code),
            other => panic!("{other:?}"),
        };
        assert_eq!(refused(head("GET", "/v1/batches", tenant)), (404, "unknown_url"));
        assert_eq!(refused(head("POST", "/v1/images/generations", None)), (404, "unknown_url"), "the API, any key");
        assert_eq!(refused(head("GET", "/metrics", tenant)), (404, "unknown_url"), "a tenant's key never travels");
        assert_eq!(head("GET", "/v1//files/file-1", tenant).ungoverned(&config), Ungoverned::WithOperatorKey);
        assert_eq!(refused(head("GET", "/v1/files", Some("Bearer other"))), (401, "invalid_api_key"));
        assert_eq!(head("GET", "/healthz", None).ungoverned(&config), Ungoverned::Pass, "not the API, no tenant");
        assert_eq!(refused(head("GET", "/V1/Files", None)), (404, "unknown_url"), "the API in any case");
        let twice = Head { repeated_tenant: true, ..head("GET", "/healthz", Some("Bearer x,Bearer hs-t")) };
        assert_eq!(refused(twice), (400, "ambiguous_tenant"), "a tenant's key may hide second");
        assert!(matches!(head("GET", "/v1/models", tenant).ungoverned(&config), Ungoverned::Answer(Ok(_))));
        let open = Config::default();
        assert_eq!(head("GET", "/v1/files", Some("Bearer sk-own")).ungoverned(&open), Ungoverned::Pass);
    }

    #[test]
    fn no_path_that_holds_a_tenants_call_state_can_pass_through() {
        for (path, said) in [
            ("/v1/responses/resp_1", "is under /v1/responses"),
            ("/v1/responses/resp_1/input_items", "is under /v1/responses"),
            ("/v1/chat/completions/chatcmpl-1", "is under /v1/chat/completions"),
            ("/v1/conversations", "is under /v1/conversations"),
            ("/v1/conversations/conv_1/items", "is under /v1/conversations"),
            ("/v1/chat", "not a governed endpoint's"),
            ("/v1/responses", "not a governed endpoint's"),
        ] {
            let raw = format!(r#"{{"passthrough_paths":["{path}"]}}"#);
            let e = Config::parse(raw.as_bytes()).expect_err(path);
            assert!(e.0.contains(said), "{path}: {}", e.0);
        }
        // A path beside one is not under it.
        assert!(Config::parse(br#"{"passthrough_paths":["/v1/responsesx","/v1/files"]}"#).is_ok());
    }

    #[test]
    fn a_declared_length_over_the_limit_is_refused_before_the_body() {
        let config = Config { max_body_bytes: 10, ..Config::default() };
        let declared = |n| Head { content_length: n, ..Head::default() }.check(&config);
        assert_eq!(declared(Some(11)).map_err(|e| e.status), Err(413));
        assert!(declared(Some(10)).is_ok());
        assert!(declared(None).is_ok());
    }

    #[test]
    fn intake_keys_by_tenant_and_follows_the_directives() {
        let config = Config::default();
        let body = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"temperature":0}"#;
        let alice = Head { authorization: Some("Bearer alice".into()), ..Head::default() };
        let bob = Head { authorization: Some("Bearer bob".into()), ..Head::default() };
        let a = intake(&config, &alice, body).unwrap();
        assert_ne!(a.request.key, intake(&config, &bob, body).unwrap().request.key, "scoped to the tenant");
        assert!(a.policy.read && a.policy.store);
        let no_store = Head { cache_control: Some("no-store".into()), ..alice };
        let p = intake(&config, &no_store, body).unwrap().policy;
        assert!(!p.read && !p.store && !p.coalesce);
        assert_eq!(intake(&config, &bob, b"{").map_err(|e| e.status).err(), Some(400));
    }

    #[test]
    fn a_kept_parse_serves_only_a_request_without_directives() {
        let config = Config::default();
        let body = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"temperature":0}"#;
        let alice = Head { authorization: Some("Bearer alice".into()), ..Head::default() };
        let kept = intake(&config, &alice, body).unwrap().request;
        let again = intake_or_known(&config, &alice, b"not parsed", Some(&kept)).unwrap();
        assert_eq!(
            (again.request.key, again.policy),
            (kept.key.clone(), kept.policy(&config, CacheControl::default()))
        );
        let no_store = Head { cache_control: Some("no-store".into()), ..alice };
        let p = intake_or_known(&config, &no_store, body, Some(&kept)).unwrap().policy;
        assert!(!p.read && !p.store, "directives are read from the request, not the memo");
    }

    #[test]
    fn a_call_on_a_model_with_a_token_bucket_is_sent_with_its_cap_and_estimated_with_it() {
        let raw = br#"{"models":{"gpt-4.1":{"tokens_per_minute":60000,"max_completion_tokens":1000},
                       "deepseek-v3":{"tokens_per_minute":60000},"claude-sonnet-4":{"requests_per_minute":9}}}"#;
        let config = Config::parse(raw).unwrap();
        let store = crate::core::store::MemStore::new();
        let engine = Engine { store: &store, config: &config };
        let body = |model: &str, extra: &str| {
            format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#).into_bytes()
        };
        let open = body("gpt-4.1", r#","n":2"#);
        let d = decide(&engine, Head::default(), &open, None, 0, 1).unwrap();
        let sent: serde_json::Value = serde_json::from_slice(&d.outbound.body_for("gpt-4.1")).unwrap();
        assert_eq!(sent["max_tokens"], 1000, "the model's cap, per choice");
        assert_eq!(d.outbound.estimate_tokens, (open.len() as u64).div_ceil(4) + 2 * 1000);
        let d = decide(&engine, Head::default(), &body("deepseek-v3", ""), None, 0, 2).unwrap();
        assert_eq!(d.outbound.completion_cap, Some(crate::core::config::DEFAULT_COMPLETION_CAP));
        // No token bucket and no budget: nothing needs its worst case, it goes as it came.
        let plain = body("claude-sonnet-4", "");
        let d = decide(&engine, Head::default(), &plain, None, 0, 3).unwrap();
        assert_eq!((d.outbound.completion_cap, &d.outbound.body_for("claude-sonnet-4")[..]), (None, &plain[..]));
        // The estimate takes the largest limit the request names, not the first.
        let both = body("gpt-4.1", r#","max_tokens":10,"max_completion_tokens":3000"#);
        let d = decide(&engine, Head::default(), &both, None, 0, 4).unwrap();
        assert_eq!(d.outbound.estimate_tokens, (both.len() as u64).div_ceil(4) + 3000);
    }

    #[test]
    fn a_budgeted_tenants_input_holysheep_supplies_is_reserved_at_the_context_window_or_refused() {
        let (t, u) = ("c".repeat(64), "d".repeat(64));
        let raw = format!(
            r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"context_window":50000}},"o3":{{"usd_per_mtok_input":2}}}},
                "tenants":{{"t":{{"keys_sha256":["{t}"],"usd_per_day":1}},"u":{{"keys_sha256":["{u}"]}}}}}}"#
        );
        let mut config = Config::parse(raw.as_bytes()).unwrap();
        config.object_key = Some(ObjectKey::of_operator_key("sk-op"));
        let signed = ObjectKey::of_operator_key("sk-op").sign("t", "resp_1");
        let store = crate::core::store::MemStore::new();
        let engine = Engine { store: &store, config: &config };
        let head = |t: &str| Head { verified: Some(t.into()), path: "/v1/responses".into(), ..Head::default() };
        let resp = |model: &str, extra: &str| {
            format!(r#"{{"model":"{model}","input":"go on","max_output_tokens":10{extra}}}"#).into_bytes()
        };
        let go_on = resp("gpt-4.1", &format!(r#","previous_response_id":"{signed}""#));
        let d = decide(&engine, head("t"), &go_on, None, 0, 1).unwrap();
        assert_eq!(d.outbound.worst_tokens(), 50_000 + 10, "the context window, not the body");
        let plain = resp("gpt-4.1", "");
        assert_eq!(
            decide(&engine, head("t"), &plain, None, 0, 2).unwrap().outbound.worst_tokens(),
            plain.len() as u64 + 10
        );
        let e = decide(&engine, head("t"), &resp("o3", r#","prompt":{"id":"pmpt_1"}"#), None, 0, 3).unwrap_err();
        assert_eq!((e.status, e.code, e.param.as_deref()), (400, "unsupported_parameter", Some("prompt")));
        let tool = resp("gpt-4.1", r#","store":false,"tools":[{"type":"web_search"}]"#);
        let fresh = crate::core::store::MemStore::new();
        let e = decide(&Engine { store: &fresh, config: &config }, head("t"), &tool, None, 0, 4).unwrap_err();
        assert_eq!((e.status, e.code, e.param.as_deref()), (400, "unsupported_parameter", Some("tools[0]")));
        assert!(fresh.keys().is_empty(), "refused before it took a lease: {:?}", fresh.keys());
        // A tenant without a budget is not bounded by one.
        assert!(decide(&engine, head("u"), &tool, None, 0, 5).is_ok());
        let go_on_u = resp(
            "gpt-4.1",
            &format!(r#","previous_response_id":"{}""#, config.object_key.as_ref().unwrap().sign("u", "resp_2")),
        );
        assert_eq!(decide(&engine, head("u"), &go_on_u, None, 0, 6).unwrap().outbound.supplied_ceiling, None);
    }

    #[test]
    fn a_priced_default_prices_for_a_budgeted_tenant_only_the_models_its_list_names() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let raw = format!(
            r#"{{"models":{{"default":{{"usd_per_mtok_input":1,"usd_per_mtok_output":2}},"gpt-4.1":{{"usd_per_mtok_input":2}}}},
                "tenants":{{"open":{{"keys_sha256":["{a}"],"usd_per_day":1}},
                            "listed":{{"keys_sha256":["{b}"],"usd_per_day":1,"models":["o1-pro"]}}}}}}"#
        );
        let config = Config::parse(raw.as_bytes()).unwrap();
        let store = crate::core::store::MemStore::new();
        let engine = Engine { store: &store, config: &config };
        let head = |t: &str| Head { verified: Some(t.into()), ..Head::default() };
        let chat = |m: &str| format!(r#"{{"model":"{m}","messages":[{{"role":"user","content":"hi"}}]}}"#).into_bytes();
        let e = decide(&engine, head("open"), &chat("o1-pro"), None, 0, 1).unwrap_err();
        assert_eq!((e.status, e.code), (404, "model_not_found"), "not at default's rate");
        assert!(decide(&engine, head("open"), &chat("gpt-4.1"), None, 0, 2).is_ok(), "its own price");
        assert!(decide(&engine, head("listed"), &chat("o1-pro"), None, 0, 3).is_ok(), "the operator listed it");
    }

    #[test]
    fn a_tenant_continues_only_the_responses_it_was_handed() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let raw = format!(r#"{{"tenants":{{"alpha":{{"keys_sha256":["{a}"]}},"beta":{{"keys_sha256":["{b}"]}}}}}}"#);
        let mut config = Config::parse(raw.as_bytes()).unwrap();
        let key = ObjectKey::of_operator_key("sk-op");
        config.object_key = Some(key.clone());
        let store = crate::core::store::MemStore::new();
        let engine = Engine { store: &store, config: &config };
        let head = |t: &str| Head { verified: Some(t.into()), path: "/v1/responses".into(), ..Head::default() };
        let go_on = |id: &str| format!(r#"{{"model":"m","input":"go on","previous_response_id":"{id}"}}"#).into_bytes();
        let alphas = key.sign("alpha", "resp_7");
        // Alpha's own: HolySheep gets its own id back.
        let d = decide(&engine, head("alpha"), &go_on(&alphas), None, 0, 1).unwrap();
        assert_eq!(d.outbound.body_for("m").into_owned(), go_on("resp_7"));
        // Beta with alpha's id, the bare id, or a forged one: as if it did not exist.
        for id in [alphas.as_str(), "resp_7", "resp_7_hs0000000000000000"] {
            let e = decide(&engine, head("beta"), &go_on(id), None, 0, 2).unwrap_err();
            assert_eq!(
                (e.status, e.code, e.param.as_deref()),
                (404, "previous_response_not_found", Some("previous_response_id"))
            );
        }
        // A conversation, a stored item or a file by id: no tenant's call made it here.
        let conv = br#"{"model":"m","input":"hi","conversation":"conv_1"}"#;
        let e = decide(&engine, head("alpha"), conv, None, 0, 3).unwrap_err();
        assert_eq!((e.status, e.code, e.param.as_deref()), (404, "not_found", Some("conversation")));
        // Without an operator key nothing can be verified: refused alike.
        let mut keyless = config.clone();
        keyless.object_key = None;
        let engine = Engine { store: &store, config: &keyless };
        assert_eq!(decide(&engine, head("alpha"), &go_on(&alphas), None, 0, 4).unwrap_err().status, 404);
        // Without tenants, ids are the caller's own business.
        let open = Config::default();
        let engine = Engine { store: &store, config: &open };
        let plain = Head { path: "/v1/responses".into(), ..Head::default() };
        assert!(decide(&engine, plain, &go_on("resp_7"), None, 0, 5).is_ok());
    }

    #[test]
    fn a_budgeted_tenants_call_without_a_completion_limit_is_sent_with_one() {
        let (t, u) = ("c".repeat(64), "d".repeat(64));
        let raw = format!(
            r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":2}}}},
                "tenants":{{"t":{{"keys_sha256":["{t}"],"usd_per_day":1}},"u":{{"keys_sha256":["{u}"]}}}}}}"#
        );
        let config = Config::parse(raw.as_bytes()).unwrap();
        let store = crate::core::store::MemStore::new();
        let engine = Engine { store: &store, config: &config };
        let head = |t: &str| Head { verified: Some(t.into()), ..Head::default() };
        let open = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}]}"#;
        let d = decide(&engine, head("t"), open, None, 0, 1).unwrap();
        assert_eq!(d.outbound.completion_cap, Some(crate::core::config::DEFAULT_COMPLETION_CAP));
        let sent: serde_json::Value = serde_json::from_slice(&d.outbound.body_for("gpt-4.1")).unwrap();
        assert_eq!(sent["max_tokens"], 4096);
        assert_eq!(d.outbound.worst_tokens(), open.len() as u64 + 4096);
        let many = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"n":128}"#;
        let d = decide(&engine, head("t"), many, None, 0, 5).unwrap();
        let sent: serde_json::Value = serde_json::from_slice(&d.outbound.body_for("gpt-4.1")).unwrap();
        assert_eq!(sent["max_tokens"], 4096, "per choice");
        assert_eq!(d.outbound.worst_tokens(), many.len() as u64 + 128 * 4096, "every choice's cap");
        let limited = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"max_tokens":9,"max_completion_tokens":20,"n":2}"#;
        let d = decide(&engine, head("t"), limited, None, 0, 2).unwrap();
        assert_eq!(
            (d.outbound.completion_cap, d.outbound.completion_limit),
            (None, Some(40)),
            "the larger, per choice"
        );
        assert_eq!(&d.outbound.body_for("gpt-4.1")[..], &limited[..], "sent as it came");
        assert_eq!(decide(&engine, head("u"), open, None, 0, 3).unwrap().outbound.completion_cap, None, "no budget");
        let gone = decide(&engine, head("gone"), open, None, 0, 4).unwrap_err();
        assert_eq!((gone.status, gone.code), (401, "invalid_api_key"), "a tenant removed by a reload");
        let unpriced = br#"{"model":"deepseek-v3","messages":[{"role":"user","content":"hi"}]}"#;
        let e = decide(&engine, head("t"), unpriced, None, 0, 6).unwrap_err();
        assert_eq!((e.status, e.code), (404, "model_not_found"), "nothing prices it: a budget could not hold it");
        assert!(decide(&engine, head("u"), unpriced, None, 0, 7).is_ok(), "a tenant without a budget may call it");
    }

    #[test]
    fn one_decision_says_what_leads_waits_or_hits_and_what_a_shell_keeps() {
        let (store, config) = (crate::core::store::MemStore::new(), Config::default());
        let engine = Engine { store: &store, config: &config };
        let body = br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"temperature":0}"#;
        let alice = || Head { authorization: Some("Bearer alice".into()), ..Head::default() };
        let lead = decide(&engine, alice(), body, None, 1_000, 1).unwrap();
        let Step::Call(call) = &lead.step else { panic!("the first request leads: {:?}", lead.step) };
        assert_eq!(lead.keep, Keep::default(), "a leader's bytes are not likely to come again yet");
        assert_eq!(
            (
                lead.outbound.body.as_slice(),
                lead.outbound.client_authorization.as_deref(),
                lead.outbound.model.as_str()
            ),
            (&body[..], Some("Bearer alice"), "gpt-4.1")
        );
        let wait = decide(&engine, alice(), body, None, 1_001, 2).unwrap();
        assert!(matches!(wait.step, Step::Wait(_)));
        assert_eq!(wait.keep, Keep { answer: false, parse: true }, "part of a crowd: its parse is kept");
        let known = decide(&engine, alice(), body, Some(&wait.request), 1_002, 3).unwrap();
        assert_eq!(known.keep, Keep::default(), "a known parse is not kept twice");
        engine.complete(call, Some(crate::core::api::response::Response::json(200, b"{}".to_vec())), 1_010);
        let hit = decide(&engine, alice(), body, None, 1_020, 4).unwrap();
        assert!(matches!(&hit.step, Step::Reply(r) if r.cache == Some(CacheStatus::Hit)));
        assert_eq!(hit.keep, Keep { answer: true, parse: true });
        let directed = Head { cache_control: Some("max-age=60".into()), ..alice() };
        assert_eq!(decide(&engine, directed, body, None, 1_030, 5).unwrap().keep, Keep::default(), "directives");
        let e = decide(&engine, alice(), b"{", None, 1_040, 6).unwrap_err();
        assert_eq!((e.status, e.code), (400, "invalid_json"));
    }
}
