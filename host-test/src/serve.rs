//! `host-test serve`: the plugin on the wasmtime host behind a real HTTP/1.1 server, with
//! callouts sent to named cluster addresses. Worker VMs keep their own event queues and are
//! interleaved on one host thread with the real clock; HTTP runs on tokio.

use crate::proxy_host::state::{Clock, Headers, Shared};
use crate::proxy_host::world::{Answer, Options, Plugin, ReqId, UpstreamCall, World};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

pub struct ServeOptions {
    pub wasm: PathBuf,
    pub config: String,
    pub listen: SocketAddr,
    pub clusters: HashMap<String, SocketAddr>,
    pub workers: usize,
    /// Environment of the VMs (e.g. `HOLYSHEEP_API_KEY`).
    pub env: Vec<(String, String)>,
}

enum Inbound {
    Request { headers: Headers, body: Vec<u8>, reply: oneshot::Sender<Answer> },
    Callout { worker: usize, token: u32, response: Option<(Headers, Vec<u8>)> },
}

/// A running server; it lives as long as the process (or the test) does.
pub struct Serving {
    pub addr: SocketAddr,
    fed: Arc<AtomicU64>,
    _runtime: tokio::runtime::Runtime,
}

impl Serving {
    /// Requests the VMs have taken in so far (their request callbacks have run).
    pub fn fed(&self) -> u64 {
        self.fed.load(Ordering::SeqCst)
    }
}

/// Loads the plugin, starts the VMs and the HTTP server; returns the bound address.
pub fn start(opts: ServeOptions) -> std::io::Result<Serving> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let plugin = Plugin::load(&opts.wasm).map_err(|e| std::io::Error::other(format!("{e:?}")))?;
    let (tx, rx) = mpsc::channel::<Inbound>();
    let (handle, clusters, callout_tx) = (runtime.handle().clone(), opts.clusters.clone(), tx.clone());
    let upstream = Box::new(move |call: &UpstreamCall| {
        let (tx, call, clusters) = (callout_tx.clone(), call.clone(), clusters.clone());
        handle.spawn(async move {
            let response = match clusters.get(&call.cluster) {
                Some(addr) => forward(*addr, &call).await,
                None => None,
            };
            let _ = tx.send(Inbound::Callout { worker: call.worker, token: call.token, response });
        });
        None
    });
    let mut options = Options::new(opts.workers.max(1), &opts.config, seed());
    options.clock = Clock::Real;
    options.yields = false;
    options.env = opts.env;
    options.shared = Shared::with_next_cas(1);
    let world = World::start(&plugin, options, upstream).map_err(|e| std::io::Error::other(format!("{e:?}")))?;
    let fed = Arc::new(AtomicU64::new(0));
    let counted = fed.clone();
    std::thread::spawn(move || run_world(world, rx, &counted));
    let listener = runtime.block_on(TcpListener::bind(opts.listen))?;
    let addr = listener.local_addr()?;
    runtime.spawn(accept(listener, tx));
    Ok(Serving { addr, fed, _runtime: runtime })
}

fn seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
}

/// The host thread: feeds requests and callout answers to the VMs, runs what is due,
/// and hands answers back.
fn run_world(mut world: World, rx: mpsc::Receiver<Inbound>, fed: &AtomicU64) {
    let mut waiting: HashMap<ReqId, oneshot::Sender<Answer>> = HashMap::new();
    let mut next_worker = 0usize;
    loop {
        let wait = world.next_due().map_or(1_000, |t| t.saturating_sub(world.now())).clamp(1, 1_000);
        let first = match rx.recv_timeout(Duration::from_millis(wait)) {
            Ok(m) => Some(m),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let mut handed = 0;
        for message in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
            match message {
                Inbound::Request { headers, body, reply } => {
                    let pick =
                        |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).unwrap_or_default();
                    let (method, path) = (pick(":method"), pick(":path"));
                    let rest: Vec<(&str, &str)> = headers
                        .iter()
                        .filter(|(k, _)| !k.starts_with(':'))
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    let id = world.request(next_worker, &method, &path, &rest, &body);
                    next_worker = (next_worker + 1) % world.workers();
                    waiting.insert(id, reply);
                    handed += 1;
                }
                Inbound::Callout { worker, token, response } => world.callout_done(worker, token, response),
            }
        }
        world.release_due();
        world.settle();
        fed.fetch_add(handed, Ordering::SeqCst);
        let done: Vec<ReqId> = waiting.keys().copied().filter(|id| world.answer(*id).is_some()).collect();
        for id in done {
            if let (Some(reply), Some(answer)) = (waiting.remove(&id), world.take_answer(id)) {
                let _ = reply.send(answer);
            }
        }
        for line in std::mem::take(&mut world.shared().logs) {
            eprintln!("{line}");
        }
    }
}

async fn accept(listener: TcpListener, tx: mpsc::Sender<Inbound>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let tx = tx.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| handle(req, tx.clone()));
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

async fn handle(req: Request<Incoming>, tx: mpsc::Sender<Inbound>) -> Result<Response<Full<Bytes>>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes().to_vec()).unwrap_or_default();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let mut headers: Headers = vec![(":method".into(), parts.method.to_string()), (":path".into(), path)];
    for (k, v) in &parts.headers {
        if k != "host" && k != "content-length" {
            headers.push((k.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()));
        }
    }
    let (reply, answer) = oneshot::channel();
    tx.send(Inbound::Request { headers, body, reply }).map_err(|_| std::io::Error::other("host stopped"))?;
    let answer = answer.await.map_err(|_| std::io::Error::other("no answer"))?;
    let mut response = Response::new(Full::new(Bytes::from(answer.body)));
    *response.status_mut() = hyper::StatusCode::from_u16(answer.status).unwrap_or(hyper::StatusCode::BAD_GATEWAY);
    for (k, v) in answer.headers {
        if let (Ok(k), Ok(v)) = (hyper::header::HeaderName::try_from(k), hyper::header::HeaderValue::try_from(v)) {
            response.headers_mut().append(k, v);
        }
    }
    Ok(response)
}

/// Sends a callout (or a passed-through request) to `addr`; `None` on failure or timeout.
async fn forward(addr: SocketAddr, call: &UpstreamCall) -> Option<(Headers, Vec<u8>)> {
    let work = async {
        let stream = TcpStream::connect(addr).await.ok()?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.ok()?;
        tokio::spawn(conn);
        let pick = |n: &str| call.headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).unwrap_or_default();
        let mut req =
            Request::builder().method(pick(":method").as_str()).uri(pick(":path")).header("host", pick(":authority"));
        for (k, v) in call.headers.iter().filter(|(k, _)| !k.starts_with(':') && k != "content-length") {
            req = req.header(k, v);
        }
        let req = req.body(Full::new(Bytes::from(call.body.clone()))).ok()?;
        let resp = sender.send_request(req).await.ok()?;
        let mut headers: Headers = vec![(":status".into(), resp.status().as_u16().to_string())];
        for (k, v) in resp.headers() {
            headers.push((k.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()));
        }
        let body = resp.into_body().collect().await.ok()?.to_bytes().to_vec();
        Some((headers, body))
    };
    match call.timeout_ms {
        0 => work.await,
        ms => tokio::time::timeout(Duration::from_millis(ms), work).await.ok().flatten(),
    }
}
