//! Mock HolySheep: an OpenAI-compatible chat-completions server for tests and the demo.
//!
//! Answers are deterministic (derived from the request), carry real `usage` numbers and
//! OpenAI's error shape. Control endpoints under `/mock/` inject faults and count calls.

use http_body_util::channel::Channel;
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

type Body = Either<Full<Bytes>, Channel<Bytes>>;

/// One planned answer for the next chat-completion call.
#[derive(Debug, Clone, Default)]
pub struct Fault {
    pub status: Option<u16>,
    pub retry_after: Option<String>,
    /// Close the connection without answering.
    pub reset: bool,
    /// Wait this long before answering.
    pub delay_ms: u64,
    /// Send headers, then wait this long before the body.
    pub slow_body_ms: u64,
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
            delay_ms: v["delay_ms"].as_u64().unwrap_or(0),
            slow_body_ms: v["slow_body_ms"].as_u64().unwrap_or(0),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    calls: u64,
    latency_ms: u64,
    plan: VecDeque<Fault>,
    last_authorization: Option<String>,
    /// Model and arrival time of every chat-completion call.
    log: Vec<(String, std::time::Instant)>,
    in_flight: u64,
    max_in_flight: u64,
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
}

impl Mock {
    /// `api_key`: when set, requests must carry `authorization: Bearer <api_key>`.
    pub fn new(api_key: Option<String>, latency_ms: u64) -> Mock {
        let state = State { latency_ms, ..State::default() };
        Mock { state: Arc::new(Mutex::new(state)), api_key }
    }

    /// Serves on `listener` until the runtime stops.
    pub async fn serve(self, listener: TcpListener) {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let mock = self.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| mock.clone().handle(req));
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
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
        Ok(match (parts.method, path.as_str()) {
            (Method::POST, "/v1/chat/completions") => return self.chat(auth, &body).await,
            (Method::GET, "/v1/models") => match self.check_key(auth.as_deref()) {
                Some(denied) => denied,
                None => json_response(StatusCode::OK, &models()),
            },
            (Method::GET, "/mock/calls") => {
                let s = self.state();
                json_response(StatusCode::OK, &json!({"calls": s.calls, "last_authorization": s.last_authorization}))
            }
            (Method::POST, "/mock/plan") => {
                let plan: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let faults = plan.as_array().map(|a| a.iter().map(Fault::from_json).collect()).unwrap_or_default();
                self.state().plan = faults;
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
                s.log.clear();
                s.plan.clear();
                s.last_authorization = None;
                json_response(StatusCode::OK, &json!({"ok": true}))
            }
            _ => error(StatusCode::NOT_FOUND, "Unknown request URL", "invalid_request_error", "unknown_url", None),
        })
    }

    fn check_key(&self, auth: Option<&str>) -> Option<Response<Body>> {
        let want = self.api_key.as_deref()?;
        let ok = auth.and_then(|a| a.strip_prefix("Bearer ")) == Some(want);
        (!ok).then(|| {
            error(
                StatusCode::UNAUTHORIZED,
                "Incorrect API key provided",
                "invalid_request_error",
                "invalid_api_key",
                None,
            )
        })
    }

    async fn chat(self, auth: Option<String>, body: &[u8]) -> Result<Response<Body>, std::io::Error> {
        let model = serde_json::from_slice::<Value>(body).ok().and_then(|v| v["model"].as_str().map(str::to_owned));
        let _in_flight = InFlight::new(&self.state);
        let (fault, latency) = {
            let mut s = self.state();
            s.calls += 1;
            s.log.push((model.unwrap_or_default(), std::time::Instant::now()));
            s.last_authorization.clone_from(&auth);
            (s.plan.pop_front().unwrap_or_default(), s.latency_ms)
        };
        let delay = latency + fault.delay_ms;
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if fault.reset {
            return Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "planned reset"));
        }
        if let Some(denied) = self.check_key(auth.as_deref()) {
            return Ok(denied);
        }
        let mut resp = match fault.status.filter(|s| *s != 200) {
            Some(status) => planned_error(status),
            None => answer(body),
        };
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

fn slow(resp: Response<Body>, ms: u64) -> Response<Body> {
    let (parts, body) = resp.into_parts();
    let Either::Left(full) = body else { return Response::from_parts(parts, body) };
    let (mut tx, channel) = Channel::<Bytes>::new(1);
    tokio::spawn(async move {
        let bytes = full.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let _ = tx.send_data(bytes).await;
    });
    Response::from_parts(parts, Either::Right(channel))
}

fn answer(body: &[u8]) -> Response<Body> {
    let req: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "We could not parse the JSON body of your request.",
                "invalid_request_error",
                "invalid_json",
                None,
            )
        }
    };
    let Some(model) = req["model"].as_str() else {
        return error(
            StatusCode::BAD_REQUEST,
            "you must provide a model parameter",
            "invalid_request_error",
            "missing_required_parameter",
            Some("model"),
        );
    };
    let Some(messages) = req["messages"].as_array().filter(|m| !m.is_empty()) else {
        return error(
            StatusCode::BAD_REQUEST,
            "'messages' must be a non-empty array",
            "invalid_request_error",
            "invalid_value",
            Some("messages"),
        );
    };
    let last = messages.iter().rev().find_map(|m| m["content"].as_str()).unwrap_or("");
    let digest: String = Sha256::digest(body).iter().take(12).map(|b| format!("{b:02x}")).collect();
    let content = format!("HolySheep mock answer {digest} to: {last}");
    let prompt_text: usize = messages.iter().map(|m| m["content"].as_str().map_or(0, str::len) + 4).sum();
    let prompt_tokens = prompt_text.div_ceil(4) as u64;
    let completion_tokens = content.split_whitespace().count() as u64;
    let n = req["n"].as_u64().unwrap_or(1).clamp(1, 128);
    if req["stream"].as_bool() == Some(true) {
        return stream(model, &digest, &content);
    }
    let choices: Vec<Value> = (0..n)
        .map(|i| {
            json!({"index": i, "message": {"role": "assistant", "content": content, "refusal": null},
                        "logprobs": null, "finish_reason": "stop"})
        })
        .collect();
    json_response(
        StatusCode::OK,
        &json!({
            "id": format!("chatcmpl-{digest}"),
            "object": "chat.completion",
            "created": 1_764_000_000u64,
            "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens * n,
                      "total_tokens": prompt_tokens + completion_tokens * n},
            "system_fingerprint": "fp_mock",
        }),
    )
}

fn stream(model: &str, digest: &str, content: &str) -> Response<Body> {
    let chunk = |delta: Value, finish: Value| {
        json!({"id": format!("chatcmpl-{digest}"), "object": "chat.completion.chunk", "created": 1_764_000_000u64,
               "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut sse = String::new();
    for part in [chunk(json!({"role": "assistant", "content": content}), Value::Null), chunk(json!({}), json!("stop"))]
    {
        sse.push_str(&format!("data: {part}\n\n"));
    }
    sse.push_str("data: [DONE]\n\n");
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(sse))));
    r.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("text/event-stream"));
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

    pub fn last_authorization(&self) -> Option<String> {
        self.state().last_authorization.clone()
    }

    /// The next calls answer with these faults, one each, in order.
    pub fn plan(&self, faults: Vec<Fault>) {
        self.state().plan = faults.into();
    }

    pub fn set_latency_ms(&self, ms: u64) {
        self.state().latency_ms = ms;
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
