//! Mock HolySheep: an OpenAI-compatible chat-completions server for tests and the demo.
//!
//! Answers are deterministic (derived from the request), carry real `usage` numbers and
//! OpenAI's error shape. Control endpoints under `/mock/` inject faults and count calls.

use http_body_util::channel::Channel;
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

pub mod apis;
pub mod embeddings;

type Body = Either<Full<Bytes>, Channel<Bytes, std::io::Error>>;

/// One planned answer for the next chat-completion call.
#[derive(Debug, Clone, Default)]
pub struct Fault {
    pub status: Option<u16>,
    pub retry_after: Option<String>,
    /// Close the connection without answering.
    pub reset: bool,
    /// Work out the answer and bill it, then close the connection without sending it (a
    /// connection that drops on the way back: HolySheep billed what the edge never saw).
    pub reset_after_billing: bool,
    /// Wait this long before answering.
    pub delay_ms: u64,
    /// Send headers, then wait this long before the body.
    pub slow_body_ms: u64,
    /// Streams: after this many events, wait until `Mock::release` before the rest.
    pub hold_after_events: Option<usize>,
    /// Wait until `Mock::release` before answering at all.
    pub hold: bool,
    /// Streams: after this many events, reset the connection (the stream is cut off).
    pub cut_after_events: Option<usize>,
    /// Answer with this body (and `content_type`, `status` or 200) instead of a completion.
    pub body: Option<String>,
    pub content_type: Option<String>,
}

impl Fault {
    fn from_json(v: &Value) -> Fault {
        Fault {
            status: v["status"].as_u64().map(|s| s as u16),
            retry_after: v["retry_after"]
                .as_str()
                .map(str::to_owned)
                .or_else(|| v["retry_after"].as_u64().map(|n| n.to_string())),
            reset: v["reset"].as_bool().unwrap_or(false),
            reset_after_billing: v["reset_after_billing"].as_bool().unwrap_or(false),
            delay_ms: v["delay_ms"].as_u64().unwrap_or(0),
            slow_body_ms: v["slow_body_ms"].as_u64().unwrap_or(0),
            hold_after_events: v["hold_after_events"].as_u64().map(|n| n as usize),
            hold: v["hold"].as_bool().unwrap_or(false),
            cut_after_events: v["cut_after_events"].as_u64().map(|n| n as usize),
            body: v["body"].as_str().map(str::to_owned),
            content_type: v["content_type"].as_str().map(str::to_owned),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    calls: u64,
    latency_ms: u64,
    plan: VecDeque<Fault>,
    last_authorization: Option<String>,
    /// How the last chat call framed its body: `content-length` or `transfer-encoding`.
    last_framing: Option<String>,
    /// Model and arrival time of every chat-completion call.
    log: Vec<(String, std::time::Instant)>,
    /// The last message's text of every chat-completion call, in arrival order.
    prompts: Vec<String>,
    in_flight: u64,
    max_in_flight: u64,
    /// Delay between a stream's events.
    event_delay_ms: u64,
    /// Stream events sent so far (all streams).
    events_sent: u64,
    /// The last body of a chat call.
    last_body: Vec<u8>,
    /// The path (with its query) and the headers of the last chat call.
    last_target: String,
    last_headers: Vec<(String, String)>,
    /// The HTTP version of the last chat call (`HTTP/1.1`, `HTTP/2.0`).
    last_version: String,
    /// Embedding calls received (including planned failures), their inputs, and the
    /// faults planned for the next ones.
    embeddings: u64,
    embedding_inputs: Vec<String>,
    /// How many inputs each embedding call carried.
    embedding_batches: Vec<usize>,
    embedding_plan: VecDeque<Fault>,
    /// The prompt prefixes (model and every message but the last) answered so far: a
    /// later prompt that starts with one is served partly from the prompt cache.
    prefixes: std::collections::HashSet<[u8; 32]>,
    /// The model and `usage` of every answer the mock produced (a stream's too, whether or
    /// not the client read it to the end): what the account was billed.
    billed: Vec<(String, Value)>,
    /// Calls to `/v1/completions` and `/v1/responses`, by path.
    api_calls: std::collections::HashMap<String, u64>,
    /// Stored responses (`store` true or absent): their id, and the tokens of context a
    /// continuation (`previous_response_id`) replays and is billed as input.
    stored: std::collections::HashMap<String, u64>,
    /// The path and `usage` of every answer to completions, Responses and embeddings.
    billed_at: Vec<(String, Value)>,
}

/// Counts a chat-completion call as in flight until dropped.
struct InFlight(Arc<Mutex<State>>);

impl InFlight {
    fn new(state: &Arc<Mutex<State>>) -> InFlight {
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
    state: Arc<Mutex<State>>,
    api_key: Option<String>,
    release: Arc<tokio::sync::Notify>,
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

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
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
    async fn before_answer(
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

    async fn chat(self, auth: Option<String>, body: &[u8]) -> Result<Response<Body>, std::io::Error> {
        let parsed = serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
        let model = parsed["model"].as_str().map(str::to_owned);
        let last = parsed["messages"].as_array().and_then(|m| m.last()).map(|m| m["content"].clone());
        let _in_flight = InFlight::new(&self.state);
        let (fault, latency, calls) = {
            let mut s = self.state();
            s.calls += 1;
            s.log.push((model.unwrap_or_default(), std::time::Instant::now()));
            s.prompts.push(last.and_then(|c| c.as_str().map(str::to_owned)).unwrap_or_default());
            s.last_authorization.clone_from(&auth);
            s.last_body = body.to_vec();
            (s.plan.pop_front().unwrap_or_default(), s.latency_ms, s.calls)
        };
        if fault.hold {
            self.release.notified().await;
        }
        if let Some(early) = self.before_answer(&fault, latency, auth.as_deref()).await {
            return early;
        }
        if fault.reset_after_billing {
            let _lost = answer(body, &mut self.state());
            return Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset after billing"));
        }
        let mut resp = match (fault.status.filter(|s| *s != 200), &fault.body) {
            (status, Some(raw)) => {
                // An answer HolySheep sends, whatever its shape, is billed by its `usage`.
                let usage = serde_json::from_str::<Value>(raw).ok().map(|v| v["usage"].clone());
                if let Some(u) = usage.filter(|u| u.is_object()) {
                    let model = parsed["model"].as_str().unwrap_or_default().to_owned();
                    self.state().billed.push((model, u));
                }
                planned_body(status.unwrap_or(200), raw, fault.content_type.as_deref())
            }
            (Some(status), None) => planned_error(status),
            (None, None) => {
                let answered = answer(body, &mut self.state());
                match answered {
                    Answer::Json(r) => r,
                    Answer::Events(events) => self.stream(events, &fault),
                }
            }
        };
        if resp.status() == StatusCode::OK {
            rate_limit_headers(&mut resp, calls);
        }
        if let Some(r) = fault.retry_after {
            if let Ok(v) = r.parse() {
                resp.headers_mut().insert("retry-after", v);
            }
        }
        if fault.slow_body_ms > 0 {
            return Ok(slow(resp, fault.slow_body_ms));
        }
        Ok(resp)
    }
}

impl Mock {
    /// `/v1/embeddings` (see `embeddings`), with the key checked, the latency and the
    /// planned faults (`status`, `delay_ms`, `reset`, `body`) as for chat calls.
    async fn embed(self, auth: Option<String>, body: &[u8]) -> Result<Response<Body>, std::io::Error> {
        let req = serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
        let (fault, latency) = {
            let mut s = self.state();
            s.embeddings += 1;
            s.embedding_inputs.push(req["input"].as_str().unwrap_or_default().to_owned());
            let count = req["input"].as_array().map_or(1, |a| if a.iter().all(Value::is_u64) { 1 } else { a.len() });
            s.embedding_batches.push(count);
            (s.embedding_plan.pop_front().unwrap_or_default(), s.latency_ms)
        };
        if let Some(early) = self.before_answer(&fault, latency, auth.as_deref()).await {
            return early;
        }
        Ok(match (fault.status.filter(|s| *s != 200), &fault.body) {
            (status, Some(raw)) => planned_body(status.unwrap_or(200), raw, fault.content_type.as_deref()),
            (Some(status), None) => planned_error(status),
            (None, None) => match embeddings::answer(&req) {
                Ok(v) => {
                    self.state().billed_at.push(("/v1/embeddings".to_owned(), v["usage"].clone()));
                    json_response(StatusCode::OK, &v)
                }
                Err(m) => error(StatusCode::BAD_REQUEST, &m, "invalid_request_error", "invalid_value", Some("input")),
            },
        })
    }
}

impl Mock {
    /// `/v1/completions` and `/v1/responses` (see `apis`), with the key checked and the
    /// latency, JSON or streamed as asked; every answer billed.
    async fn api(self, path: &str, auth: Option<String>, body: &[u8]) -> Result<Response<Body>, std::io::Error> {
        let req = serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
        let latency = {
            let mut s = self.state();
            *s.api_calls.entry(path.to_owned()).or_default() += 1;
            s.last_authorization.clone_from(&auth);
            s.last_body = body.to_vec();
            s.latency_ms
        };
        if let Some(early) = self.before_answer(&Fault::default(), latency, auth.as_deref()).await {
            return early;
        }
        // A continuation replays its stored response's context, billed as input.
        let previous = req["previous_response_id"].as_str().filter(|_| path == "/v1/responses");
        let context = match previous {
            Some(id) => match self.state().stored.get(id).copied() {
                Some(tokens) => tokens,
                None => {
                    let m = format!("Previous response with id '{id}' not found.");
                    let (kind, code) = ("invalid_request_error", "previous_response_not_found");
                    return Ok(error(StatusCode::NOT_FOUND, &m, kind, code, Some("previous_response_id")));
                }
            },
            None => 0,
        };
        let answer = if path == "/v1/completions" { apis::completion(&req) } else { apis::response(&req) };
        let mut answer = match answer {
            Ok(a) => a,
            Err(m) => return Ok(error(StatusCode::BAD_REQUEST, &m, "invalid_request_error", "invalid_value", None)),
        };
        if path == "/v1/responses" {
            let u = &mut answer["usage"];
            let input = u["input_tokens"].as_u64().unwrap_or(0) + context;
            let output = u["output_tokens"].as_u64().unwrap_or(0);
            u["input_tokens"] = input.into();
            u["total_tokens"] = (input + output).into();
            if answer["store"].as_bool() == Some(true) {
                let id = answer["id"].as_str().unwrap_or_default().to_owned();
                self.state().stored.insert(id, input + output);
            }
        }
        self.state().billed_at.push((path.to_owned(), answer["usage"].clone()));
        if req["stream"].as_bool() != Some(true) {
            return Ok(json_response(StatusCode::OK, &answer));
        }
        let events = if path == "/v1/completions" {
            apis::completion_events(&answer, req["stream_options"]["include_usage"].as_bool() == Some(true))
        } else {
            apis::response_events(&answer)
        };
        Ok(self.stream(events, &Fault::default()))
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

/// A key as OpenAI's 401 quotes it: its first three and last four characters.
pub fn quoted(key: &str) -> String {
    let chars: Vec<char> = key.chars().collect();
    if chars.len() <= 8 {
        return "*".repeat(chars.len());
    }
    let (head, tail): (String, String) = (chars[..3].iter().collect(), chars[chars.len() - 4..].iter().collect());
    format!("{head}{}{tail}", "*".repeat(chars.len() - 7))
}

fn slow(resp: Response<Body>, ms: u64) -> Response<Body> {
    let (parts, body) = resp.into_parts();
    let Either::Left(full) = body else { return Response::from_parts(parts, body) };
    let (mut tx, channel) = Channel::<Bytes, std::io::Error>::new(1);
    tokio::spawn(async move {
        let bytes = full.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let _ = tx.send_data(bytes).await;
    });
    Response::from_parts(parts, Either::Right(channel))
}

enum Answer {
    Json(Response<Body>),
    /// A `stream: true` answer: its server-sent events, in order.
    Events(Vec<String>),
}

impl Mock {
    /// Sends `events` one by one, `event_delay_ms` apart, each in two writes split inside
    /// the event (so a reader sees partial events), holding or cutting as `fault` says.
    fn stream(&self, events: Vec<String>, fault: &Fault) -> Response<Body> {
        let (mut tx, channel) = Channel::<Bytes, std::io::Error>::new(4);
        let (mock, hold, cut) = (self.clone(), fault.hold_after_events, fault.cut_after_events);
        tokio::spawn(async move {
            for (i, event) in events.into_iter().enumerate() {
                if hold == Some(i) {
                    mock.release.notified().await;
                }
                if cut == Some(i) {
                    tx.abort(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "planned cut"));
                    return;
                }
                let delay = mock.state().event_delay_ms;
                if delay > 0 && i > 0 {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                let bytes = Bytes::from(event);
                let mid = bytes.len() / 2;
                if tx.send_data(bytes.slice(..mid)).await.is_err() {
                    return;
                }
                tokio::task::yield_now().await;
                if tx.send_data(bytes.slice(mid..)).await.is_err() {
                    return;
                }
                mock.state().events_sent += 1;
            }
        });
        let mut r = Response::new(Either::Right(channel));
        r.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("text/event-stream"));
        r
    }
}

/// The answer to a chat call, billed to `state`.
fn answer(body: &[u8], state: &mut State) -> Answer {
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let cached = cached_tokens(&req, &mut state.prefixes);
    let completion = completion(&req).map(|mut c| {
        c["usage"]["prompt_tokens_details"] = json!({"cached_tokens": cached, "audio_tokens": 0});
        state.billed.push((c["model"].as_str().unwrap_or_default().to_owned(), c["usage"].clone()));
        c
    });
    match completion {
        Err(e) => Answer::Json(*e),
        Ok(c) if req["stream"].as_bool() == Some(true) => {
            Answer::Events(events(&c, req["stream_options"]["include_usage"].as_bool() == Some(true)))
        }
        Ok(c) => Answer::Json(json_response(StatusCode::OK, &c)),
    }
}

/// Prompt caching as OpenAI bills it: a prompt whose prefix (the model and every message
/// but the last) was answered before, and is at least 1024 tokens long, has that prefix
/// served from the cache in whole blocks of 128 tokens. Remembers the prefix.
fn cached_tokens(req: &Value, seen: &mut std::collections::HashSet<[u8; 32]>) -> u64 {
    let Some(messages) = req["messages"].as_array().filter(|m| m.len() > 1) else { return 0 };
    let prefix = &messages[..messages.len() - 1];
    let tokens = (prefix.iter().map(|m| m["content"].as_str().map_or(0, str::len) + 4).sum::<usize>() / 4) as u64;
    let digest: [u8; 32] = Sha256::digest(json!([req["model"], prefix]).to_string().as_bytes()).into();
    let hit = !seen.insert(digest);
    if hit && tokens >= 1024 {
        tokens / 128 * 128
    } else {
        0
    }
}

/// The `chat.completion` the mock answers: deterministic content echoing the last message,
/// or, when the request offers `tools` and the last message asks to "call a tool", a call
/// of the first tool with the message as its argument.
fn completion(req: &Value) -> Result<Value, Box<Response<Body>>> {
    if !req.is_object() {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "We could not parse the JSON body of your request.",
            "invalid_request_error",
            "invalid_json",
            None,
        )));
    }
    let Some(model) = req["model"].as_str() else {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "you must provide a model parameter",
            "invalid_request_error",
            "missing_required_parameter",
            Some("model"),
        )));
    };
    let Some(messages) = req["messages"].as_array().filter(|m| !m.is_empty()) else {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "'messages' must be a non-empty array",
            "invalid_request_error",
            "invalid_value",
            Some("messages"),
        )));
    };
    let last = messages.iter().rev().find_map(|m| m["content"].as_str()).unwrap_or("");
    // The same answer whether streamed or not, and whatever the stream options.
    let mut keyed = req.clone();
    if let Some(o) = keyed.as_object_mut() {
        o.remove("stream");
        o.remove("stream_options");
    }
    let digest: String =
        Sha256::digest(keyed.to_string().as_bytes()).iter().take(12).map(|b| format!("{b:02x}")).collect();
    let content = format!("HolySheep mock answer {digest} to: {last}");
    let prompt_text: usize = messages.iter().map(|m| m["content"].as_str().map_or(0, str::len) + 4).sum();
    let prompt_tokens = prompt_text.div_ceil(4) as u64;
    // Asked to write "at length", the model writes until its limit stops it: the request's
    // completion limit, else 200,000 tokens (billed; the content shown stays short).
    let at_length = last.contains("at length");
    let limit = ["max_tokens", "max_completion_tokens"].iter().filter_map(|f| req[*f].as_u64()).max();
    let completion_tokens =
        if at_length { limit.unwrap_or(200_000) } else { content.split_whitespace().count() as u64 };
    let n = req["n"].as_u64().unwrap_or(1).clamp(1, 128);
    let tool = req["tools"][0]["function"]["name"].as_str().filter(|_| last.contains("call a tool"));
    let message = match tool {
        Some(name) => json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": [{
            "id": format!("call_{digest}"), "type": "function",
            "function": {"name": name, "arguments": json!({"q": last}).to_string()}}]}),
        None => json!({"role": "assistant", "content": content, "refusal": null}),
    };
    let finish = match (tool, at_length) {
        (Some(_), _) => "tool_calls",
        (None, true) => "length",
        (None, false) => "stop",
    };
    // With `logprobs`, one token per 8-character piece of the content (the pieces a stream
    // sends), each with its log probability.
    let logprobs = match (req["logprobs"].as_bool(), message["content"].as_str()) {
        (Some(true), Some(text)) => json!({"content": pieces(text).iter().enumerate().map(|(t, p)| token_logprob(t, p))
            .collect::<Vec<Value>>(), "refusal": null}),
        _ => Value::Null,
    };
    let choices: Vec<Value> = (0..n)
        .map(|i| json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}))
        .collect();
    Ok(json!({
        "id": format!("chatcmpl-{digest}"),
        "object": "chat.completion",
        "created": 1_764_000_000u64,
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens * n,
                  "total_tokens": prompt_tokens + completion_tokens * n},
        "system_fingerprint": "fp_mock",
    }))
}

/// `s` in pieces of 8 characters.
fn pieces(s: &str) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    chars.chunks(8).map(|p| p.iter().collect()).collect()
}

/// The mock's `t`-th token of an answer, with a log probability that is exact in binary.
fn token_logprob(t: usize, token: &str) -> Value {
    let logprob = -((t % 8) as f64) / 4.0;
    json!({"token": token, "logprob": logprob, "bytes": token.as_bytes(), "top_logprobs": []})
}

/// The events OpenAI streams for `c`: the role, the content 8 characters at a time, tool
/// calls (id, type and name first, then argument pieces), the finish reason; the usage
/// event when asked for; `[DONE]`.
fn events(c: &Value, include_usage: bool) -> Vec<String> {
    let chunk = |choices: Value| {
        let mut v = json!({"id": c["id"], "object": "chat.completion.chunk", "created": c["created"],
                           "model": c["model"], "system_fingerprint": c["system_fingerprint"], "choices": choices});
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    };
    let piece = pieces;
    let mut out = Vec::new();
    for choice in c["choices"].as_array().into_iter().flatten() {
        let i = &choice["index"];
        let delta = |d: Value| chunk(json!([{"index": i, "delta": d, "logprobs": null, "finish_reason": null}]));
        out.push(delta(json!({"role": "assistant", "content": "", "refusal": null})));
        let tokens = choice["logprobs"]["content"].as_array();
        for (t, p) in piece(choice["message"]["content"].as_str().unwrap_or("")).into_iter().enumerate() {
            // The piece's own token, as OpenAI sends the logprobs of a chunk's tokens with it.
            let logprobs = tokens.and_then(|all| all.get(t)).map(|tok| json!({"content": [tok], "refusal": null}));
            out.push(chunk(
                json!([{"index": i, "delta": {"content": p}, "logprobs": logprobs, "finish_reason": null}]),
            ));
        }
        for (t, call) in choice["message"]["tool_calls"].as_array().into_iter().flatten().enumerate() {
            out.push(delta(json!({"tool_calls": [{"index": t, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}]})));
            for p in piece(call["function"]["arguments"].as_str().unwrap_or("")) {
                out.push(delta(json!({"tool_calls": [{"index": t, "function": {"arguments": p}}]})));
            }
        }
        out.push(chunk(json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": choice["finish_reason"]}])));
    }
    let usage = include_usage.then(|| chunk(json!([])));
    crate::data_events(out, usage, &c["usage"])
}

/// `chunks` as `data:` events, then the usage event (`usage_chunk` carrying `usage`) when
/// the client asked for it, then `[DONE]`.
pub(crate) fn data_events(mut chunks: Vec<Value>, usage_chunk: Option<Value>, usage: &Value) -> Vec<String> {
    if let Some(mut u) = usage_chunk {
        u["usage"] = usage.clone();
        chunks.push(u);
    }
    let mut events: Vec<String> = chunks.iter().map(|v| format!("data: {v}\n\n")).collect();
    events.push("data: [DONE]\n\n".to_owned());
    events
}

/// Requests and tokens per minute the mock's account has, as its `x-ratelimit-*` say.
pub const RATE_LIMIT_REQUESTS: u64 = 30_000;
pub const RATE_LIMIT_TOKENS: u64 = 150_000_000;

/// OpenAI's rate-limit headers on an answer: the account's limits, and what is left after
/// `calls` calls (each counted as 1,000 tokens).
fn rate_limit_headers(resp: &mut Response<Body>, calls: u64) {
    let h = resp.headers_mut();
    let pairs = [
        ("x-ratelimit-limit-requests", RATE_LIMIT_REQUESTS.to_string()),
        ("x-ratelimit-remaining-requests", RATE_LIMIT_REQUESTS.saturating_sub(calls).to_string()),
        ("x-ratelimit-reset-requests", "2ms".to_owned()),
        ("x-ratelimit-limit-tokens", RATE_LIMIT_TOKENS.to_string()),
        ("x-ratelimit-remaining-tokens", RATE_LIMIT_TOKENS.saturating_sub(calls * 1000).to_string()),
        ("x-ratelimit-reset-tokens", "0s".to_owned()),
    ];
    for (name, value) in pairs {
        if let Ok(v) = hyper::header::HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    }
}

fn planned_body(status: u16, body: &str, content_type: Option<&str>) -> Response<Body> {
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(body.to_owned()))));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    if let Some(v) = content_type.and_then(|t| hyper::header::HeaderValue::from_str(t).ok()) {
        r.headers_mut().insert("content-type", v);
    }
    r
}

fn planned_error(status: u16) -> Response<Body> {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let (kind, c) = match status {
        429 => ("requests", "rate_limit_exceeded"),
        400..=499 => ("invalid_request_error", "mock_error"),
        _ => ("server_error", "mock_error"),
    };
    error(code, &format!("The mock was told to answer {status}"), kind, c, None)
}

fn models() -> Value {
    let ids = ["gpt-4.1", "claude-sonnet-4", "gemini-2.5-flash", "deepseek-v3"];
    let data: Vec<Value> = ids
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": 1_764_000_000u64, "owned_by": "holysheep"}))
        .collect();
    json!({"object": "list", "data": data})
}

fn error(status: StatusCode, message: &str, kind: &str, code: &str, param: Option<&str>) -> Response<Body> {
    json_response(status, &json!({"error": {"message": message, "type": kind, "param": param, "code": code}}))
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(v.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("application/json"));
    r
}

/// Binds `addr` and serves the mock on the current tokio runtime.
pub async fn start(addr: SocketAddr, mock: Mock) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(mock.serve(listener));
    Ok(local)
}

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
}

/// A mock running on its own tokio runtime (for blocking tests and benchmarks).
pub struct Running {
    pub addr: SocketAddr,
    pub mock: Mock,
    _runtime: tokio::runtime::Runtime,
}

impl Running {
    pub fn start(api_key: Option<&str>, latency_ms: u64) -> std::io::Result<Running> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let mock = Mock::new(api_key.map(str::to_owned), latency_ms);
        let addr = runtime.block_on(start(([127, 0, 0, 1], 0).into(), mock.clone()))?;
        Ok(Running { addr, mock, _runtime: runtime })
    }
}
