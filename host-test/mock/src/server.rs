//! The server: one connection loop speaking HTTP/1.1 or HTTP/2, the routes, the key check,
//! the `/mock/` control endpoints, and what tests read back and plan.

use crate::faults::Fault;
use crate::reply::{error, json_response, models, quoted};
use crate::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) calls: u64,
    pub(crate) latency_ms: u64,
    pub(crate) plan: VecDeque<Fault>,
    pub(crate) last_authorization: Option<String>,
    /// How the last chat call framed its body: `content-length` or `transfer-encoding`.
    pub(crate) last_framing: Option<String>,
    /// Model and arrival time of every chat-completion call.
    pub(crate) log: Vec<(String, std::time::Instant)>,
    /// The last message's text of every chat-completion call, in arrival order.
    pub(crate) prompts: Vec<String>,
    pub(crate) in_flight: u64,
    pub(crate) max_in_flight: u64,
    /// Delay between a stream's events.
    pub(crate) event_delay_ms: u64,
    /// Stream events sent so far (all streams).
    pub(crate) events_sent: u64,
    /// The last body of a chat call.
    pub(crate) last_body: Vec<u8>,
    /// The path (with its query) and the headers of the last chat call.
    pub(crate) last_target: String,
    pub(crate) last_headers: Vec<(String, String)>,
    /// The HTTP version of the last chat call (`HTTP/1.1`, `HTTP/2.0`).
    pub(crate) last_version: String,
    /// Embedding calls received (including planned failures), their inputs, and the
    /// faults planned for the next ones.
    pub(crate) embeddings: u64,
    pub(crate) embedding_inputs: Vec<String>,
    /// How many inputs each embedding call carried.
    pub(crate) embedding_batches: Vec<usize>,
    pub(crate) embedding_plan: VecDeque<Fault>,
    /// The faults planned for the next `/v1/completions` and `/v1/responses` calls.
    pub(crate) api_plan: VecDeque<Fault>,
    /// The prompt prefixes (model and every message but the last) answered so far: a
    /// later prompt that starts with one is served partly from the prompt cache.
    pub(crate) prefixes: std::collections::HashSet<[u8; 32]>,
    /// The model and `usage` of every answer the mock produced (a stream's too, whether or
    /// not the client read it to the end): what the account was billed.
    pub(crate) billed: Vec<(String, Value)>,
    /// Calls to `/v1/completions` and `/v1/responses`, by path.
    pub(crate) api_calls: std::collections::HashMap<String, u64>,
    /// Stored responses (`store` true or absent): their id, and the tokens of context a
    /// continuation (`previous_response_id`) replays and is billed as input.
    pub(crate) stored: std::collections::HashMap<String, u64>,
    /// The path and `usage` of every answer to completions, Responses and embeddings.
    pub(crate) billed_at: Vec<(String, Value)>,
    /// The account's request limit on chat calls, when a test set one.
    pub(crate) limit: Option<crate::limit::RequestLimit>,
    /// The machines HolySheep's prompt cache is spread over (`prompt_cache_machines`).
    pub(crate) cache_machines: u32,
}

/// Counts a chat-completion call as in flight until dropped.
pub(crate) struct InFlight(Arc<Mutex<State>>);

impl InFlight {
    pub(crate) fn new(state: &Arc<Mutex<State>>) -> InFlight {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        s.in_flight += 1;
        s.max_in_flight = s.max_in_flight.max(s.in_flight);
        InFlight(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).in_flight -= 1;
    }
}

/// A running mock; dropping it does not stop the server (it lives with the runtime).
#[derive(Clone)]
pub struct Mock {
    pub(crate) state: Arc<Mutex<State>>,
    api_key: Option<String>,
    pub(crate) release: Arc<tokio::sync::Notify>,
}

impl Mock {
    /// `api_key`: when set, requests must carry `authorization: Bearer <api_key>`.
    pub fn new(api_key: Option<String>, latency_ms: u64) -> Mock {
        let state = State { latency_ms, ..State::default() };
        Mock { state: Arc::new(Mutex::new(state)), api_key, release: Arc::new(tokio::sync::Notify::new()) }
    }

    /// Serves on `listener` until the runtime stops.
    pub async fn serve(self, listener: TcpListener) {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            // Events leave as they are written (no Nagle delay on small writes).
            let _ = stream.set_nodelay(true);
            let mock = self.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| mock.clone().handle(req));
                // HTTP/1.1 or HTTP/2 with prior knowledge, whichever the client speaks.
                let _ = auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), service).await;
            });
        }
    }

    pub(crate) fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn handle(self, req: Request<Incoming>) -> Result<Response<Body>, std::io::Error> {
        let (parts, body) = req.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let path = parts.uri.path().to_owned();
        let auth = parts.headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let framing = ["content-length", "transfer-encoding"]
            .into_iter()
            .find_map(|h| parts.headers.get(h).and_then(|v| v.to_str().ok()).map(|v| format!("{h}: {v}")));
        if path == "/v1/chat/completions" {
            let mut s = self.state();
            s.last_framing = framing;
            s.last_version = format!("{:?}", parts.version);
            s.last_target = parts.uri.path_and_query().map(|p| p.as_str().to_owned()).unwrap_or_default();
            s.last_headers = parts
                .headers
                .iter()
                .map(|(n, v)| (n.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                .collect();
        }
        Ok(match (parts.method, path.as_str()) {
            (Method::POST, "/v1/chat/completions") => return self.chat(auth, &body).await,
            (Method::POST, "/v1/embeddings") => return self.embed(auth, &body).await,
            (Method::POST, "/v1/completions" | "/v1/responses") => return self.api(&path, auth, &body).await,
            (Method::GET, "/v1/models") => match self.check_key(auth.as_deref()) {
                Some(denied) => denied,
                None => json_response(StatusCode::OK, &models()),
            },
            (Method::GET, "/mock/calls") => {
                let s = self.state();
                let body =
                    json!({"calls": s.calls, "embeddings": s.embeddings, "last_authorization": s.last_authorization});
                json_response(StatusCode::OK, &body)
            }
            (Method::POST, "/mock/plan") => {
                let plan: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let faults = plan.as_array().map(|a| a.iter().map(Fault::from_json).collect()).unwrap_or_default();
                self.state().plan = faults;
                json_response(StatusCode::OK, &json!({"ok": true}))
            }
            (Method::POST, "/mock/embeddings/plan") => {
                let plan: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let faults = plan.as_array().map(|a| a.iter().map(Fault::from_json).collect()).unwrap_or_default();
                self.state().embedding_plan = faults;
                json_response(StatusCode::OK, &json!({"ok": true}))
            }
            (Method::POST, "/mock/latency") => {
                let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                self.state().latency_ms = v["ms"].as_u64().unwrap_or(0);
                json_response(StatusCode::OK, &json!({"ok": true}))
            }
            (Method::POST, "/mock/reset") => {
                let mut s = self.state();
                s.calls = 0;
                s.billed.clear();
                s.prefixes.clear();
                s.embeddings = 0;
                s.embedding_inputs.clear();
                s.embedding_batches.clear();
                s.embedding_plan.clear();
                s.api_plan.clear();
                s.api_calls.clear();
                s.billed_at.clear();
                s.log.clear();
                s.prompts.clear();
                s.plan.clear();
                s.last_authorization = None;
                json_response(StatusCode::OK, &json!({"ok": true}))
            }
            _ => {
                let mut s = self.state();
                *s.api_calls.entry(path.clone()).or_default() += 1;
                s.last_authorization.clone_from(&auth);
                s.last_headers = parts
                    .headers
                    .iter()
                    .map(|(n, v)| (n.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                    .collect();
                drop(s);
                // As OpenAI does: the key is checked before the path.
                match self.check_key(auth.as_deref()) {
                    Some(denied) => denied,
                    None => error(
                        StatusCode::NOT_FOUND,
                        "Unknown request URL",
                        "invalid_request_error",
                        "unknown_url",
                        None,
                    ),
                }
            }
        })
    }

    /// OpenAI's 401 for a wrong key, which quotes part of the key it was sent.
    fn check_key(&self, auth: Option<&str>) -> Option<Response<Body>> {
        let want = self.api_key.as_deref()?;
        let sent = auth.and_then(|a| a.strip_prefix("Bearer "));
        (sent != Some(want)).then(|| {
            let message = match sent {
                Some(key) => format!(
                    "Incorrect API key provided: {}. You can find your API key at https://www.holysheep.ai/keys.",
                    quoted(key)
                ),
                None => "You didn't provide an API key.".to_owned(),
            };
            error(StatusCode::UNAUTHORIZED, &message, "invalid_request_error", "invalid_api_key", None)
        })
    }

    /// What every call goes through before its answer: the latency and the planned delay,
    /// then a planned reset or the key's refusal (`Some`: the call ends with that).
    pub(crate) async fn before_answer(
        &self,
        fault: &Fault,
        latency: u64,
        auth: Option<&str>,
    ) -> Option<Result<Response<Body>, std::io::Error>> {
        let delay = latency + fault.delay_ms;
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if fault.reset {
            return Some(Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "planned reset")));
        }
        self.check_key(auth).map(Ok)
    }
}

/// What tests read back and plan.
impl Mock {
    /// Chat-completion calls received (including planned failures).
    pub fn calls(&self) -> u64 {
        self.state().calls
    }

    /// The most chat-completion calls ever answered at once.
    pub fn max_in_flight(&self) -> u64 {
        self.state().max_in_flight
    }

    /// Model and arrival time of every chat-completion call so far.
    pub fn log(&self) -> Vec<(String, std::time::Instant)> {
        self.state().log.clone()
    }

    /// From now on, chat calls are held to `per_minute` requests, at most `burst` at once
    /// (`limit::RequestLimit`): one over it is a 429, and every answer says the limit.
    pub fn limit_requests(&self, per_minute: u32, burst: u32) {
        self.state().limit = Some(crate::limit::RequestLimit::new(per_minute, burst));
    }

    /// HolySheep's prompt cache spread over `n` machines, each with the prefixes it served:
    /// a chat call with a `prompt_cache_key` goes to that key's machine, one without to a
    /// machine its whole body picks. Its prompt is served from the cache only when its
    /// machine served the same prefix before. (By default one machine: any repeat.)
    pub fn prompt_cache_machines(&self, n: u32) {
        let mut s = self.state();
        s.cache_machines = n;
        s.prefixes.clear();
    }

    /// Each chat call since `limit_requests`: when it arrived, and whether the limit turned
    /// it away (a 429).
    pub fn limited_calls(&self) -> Vec<(std::time::Instant, bool)> {
        self.state().limit.as_ref().map(|l| l.calls.clone()).unwrap_or_default()
    }

    /// The last message's text of every chat-completion call so far, in arrival order.
    pub fn prompts(&self) -> Vec<String> {
        self.state().prompts.clone()
    }

    pub fn last_authorization(&self) -> Option<String> {
        self.state().last_authorization.clone()
    }

    /// How the last chat call framed its body (`content-length: N` or
    /// `transfer-encoding: chunked`).
    pub fn last_framing(&self) -> Option<String> {
        self.state().last_framing.clone()
    }

    /// Embedding calls received (including planned failures).
    pub fn embeddings(&self) -> u64 {
        self.state().embeddings
    }

    /// The `input` of every embedding call so far, in arrival order.
    pub fn embedding_inputs(&self) -> Vec<String> {
        self.state().embedding_inputs.clone()
    }

    /// The next embedding calls answer with these faults, one each, in order.
    pub fn plan_embeddings(&self, faults: Vec<Fault>) {
        self.state().embedding_plan = faults.into();
    }

    /// The next `/v1/completions` and `/v1/responses` calls answer with these faults (a
    /// hold, a delay, a reset, a stream held or cut after some events), one each, in order.
    pub fn plan_api(&self, faults: Vec<Fault>) {
        self.state().api_plan = faults.into();
    }

    /// The next calls answer with these faults, one each, in order.
    pub fn plan(&self, faults: Vec<Fault>) {
        self.state().plan = faults.into();
    }

    pub fn set_latency_ms(&self, ms: u64) {
        self.state().latency_ms = ms;
    }

    /// The delay between a stream's events.
    pub fn set_event_delay_ms(&self, ms: u64) {
        self.state().event_delay_ms = ms;
    }

    /// Lets one answer held by `Fault::hold` or `Fault::hold_after_events` go on (or the
    /// next one to hold).
    pub fn release(&self) {
        self.release.notify_one();
    }

    /// Stream events sent so far, over all streams.
    pub fn events_sent(&self) -> u64 {
        self.state().events_sent
    }

    /// The path and query of the last chat call.
    pub fn last_target(&self) -> String {
        self.state().last_target.clone()
    }

    /// The HTTP version of the last chat call, as `HTTP/1.1` or `HTTP/2.0`.
    pub fn last_version(&self) -> String {
        self.state().last_version.clone()
    }

    /// The header names and values of the last chat call.
    pub fn last_headers(&self) -> Vec<(String, String)> {
        self.state().last_headers.clone()
    }

    /// The body of the last chat call.
    pub fn last_body(&self) -> Vec<u8> {
        self.state().last_body.clone()
    }

    /// The `usage` of every chat answer produced so far (what HolySheep billed), in order.
    pub fn billed(&self) -> Vec<Value> {
        self.state().billed.iter().map(|(_, u)| u.clone()).collect()
    }

    /// The same for the answers of `model` only.
    pub fn billed_for(&self, model: &str) -> Vec<Value> {
        self.state().billed.iter().filter(|(m, _)| m == model).map(|(_, u)| u.clone()).collect()
    }

    /// How many inputs each embedding call carried, in order.
    pub fn embedding_batches(&self) -> Vec<usize> {
        self.state().embedding_batches.clone()
    }

    /// Calls to `/v1/completions`, `/v1/responses`, or a path the mock does not serve.
    pub fn calls_to(&self, path: &str) -> u64 {
        self.state().api_calls.get(path).copied().unwrap_or(0)
    }

    /// The `usage` of every answer to `path` (completions, Responses, embeddings).
    pub fn billed_at(&self, path: &str) -> Vec<Value> {
        self.state().billed_at.iter().filter(|(p, _)| p == path).map(|(_, u)| u.clone()).collect()
    }
}
