//! `host-test serve --component PATH`: the gateway component behind a real HTTP/1.1 server
//! (hyper). An instance serves one request at a time; when its `handle` call returns it
//! waits, idle, for the next request, up to `REUSES` requests (an instance that trapped is
//! dropped). Every store shares one keyvalue memory; every outgoing request is sent to
//! `upstream` over plain HTTP, keeping its path and `host` header.

use super::keyvalue::{self, KeyValue, Memory};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::net::TcpListener;
use wasmtime::component::{Linker, ResourceTable};
use wasmtime::Store;
use wasmtime_wasi::cli::{WasiCli, WasiCliView};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};
use wasmtime_wasi_http::p2::bindings::http::types::Scheme;
use wasmtime_wasi_http::p2::bindings::{Proxy, ProxyPre};
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView};

/// Requests one instance serves, one after another, before it is dropped (its memory
/// returns to the pool allocator clean).
pub const REUSES: u32 = 1_000;
/// The most instances kept idle between requests.
const IDLE: usize = 64;
/// The most answers `Serving::answered_since` remembers.
const ANSWERS_KEPT: usize = 100_000;

pub struct ComponentOptions {
    pub wasm: PathBuf,
    pub listen: SocketAddr,
    pub upstream: SocketAddr,
    /// The component's environment: `HOLYSHEEP_CONFIG`, `HOLYSHEEP_API_KEY`, ...
    pub env: Vec<(String, String)>,
}

/// A running server; it lives as long as the process (or the test) does.
pub struct Serving {
    pub addr: SocketAddr,
    /// The keyvalue memory every request shares.
    pub memory: Arc<Memory>,
    host: Arc<Host>,
    _runtime: tokio::runtime::Runtime,
}

impl Serving {
    /// Requests whose component instance trapped or failed (also after answering).
    pub fn failures(&self) -> u64 {
        self.host.failures.load(Ordering::SeqCst)
    }

    /// Instances created so far.
    pub fn instances(&self) -> u64 {
        self.host.instances.load(Ordering::SeqCst)
    }

    /// Requests an instance is handling now.
    pub fn handling(&self) -> u64 {
        self.host.handling.load(Ordering::SeqCst)
    }

    /// The answers the component gave since `t` (the host's clock: when it handed each
    /// response to the HTTP server), each with its `x-holysheep-cache` label, in
    /// microseconds after `t`.
    pub fn answered_since(&self, t: Instant) -> Vec<(u64, String)> {
        let answered = self.host.answered.lock().unwrap_or_else(|e| e.into_inner());
        let since = answered.iter().filter_map(|(at, label)| Some((at.checked_duration_since(t)?, label)));
        since.map(|(d, label)| (d.as_micros() as u64, label.clone())).collect()
    }
}

struct Host {
    pre: ProxyPre<State>,
    failures: AtomicU64,
    instances: AtomicU64,
    handling: AtomicU64,
    idle: Mutex<Vec<Ready>>,
    /// When each response was handed to the server, with its cache label (the newest).
    answered: Mutex<VecDeque<(Instant, String)>>,
    memory: Arc<Memory>,
    upstream: SocketAddr,
    env: Vec<(String, String)>,
}

/// Where the component's response goes.
type Answer = tokio::sync::oneshot::Sender<
    Result<hyper::Response<HyperOutgoingBody>, wasmtime_wasi_http::p2::bindings::http::types::ErrorCode>,
>;

/// An instance between requests, with its store.
struct Ready {
    store: Store<State>,
    proxy: Proxy,
    served: u32,
}

struct State {
    table: ResourceTable,
    wasi: WasiCtx,
    http: WasiHttpCtx,
    hooks: Redirect,
    memory: Arc<Memory>,
}

/// Sends every outgoing request to one address, like an Envoy cluster.
struct Redirect {
    upstream: SocketAddr,
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl WasiHttpView for State {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView { ctx: &mut self.http, table: &mut self.table, hooks: &mut self.hooks }
    }
}

impl WasiHttpHooks for Redirect {
    fn send_request(
        &mut self,
        mut request: hyper::Request<wasmtime_wasi_http::WasiBody>,
        options: Option<wasmtime_wasi_http::RequestOptions>,
        fut: Box<dyn std::future::Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>,
    ) -> Box<
        dyn std::future::Future<
                Output = Result<
                    (
                        hyper::Response<wasmtime_wasi_http::WasiBody>,
                        Box<dyn std::future::Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>,
                    ),
                    wasmtime_wasi_http::Error,
                >,
            > + Send,
    > {
        let path = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned();
        if let Ok(uri) = format!("http://{}{path}", self.upstream).parse() {
            *request.uri_mut() = uri;
        }
        let _ = fut;
        Box::new(async move {
            use http_body_util::BodyExt;
            let (response, io) = wasmtime_wasi_http::default_send_request(request, options).await?;
            Ok((response.map(BodyExt::boxed_unsync), Box::new(io) as Box<dyn std::future::Future<Output = _> + Send>))
        })
    }
}

/// The interfaces of the `holysheep:edge/gateway` world and nothing else, so a component
/// that imports more does not instantiate.
fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<State>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi_http::p2::add_to_linker_async(&mut linker)?;
    wasmtime_wasi::p2::bindings::cli::environment::add_to_linker::<State, WasiCli>(&mut linker, State::cli)?;
    keyvalue::add_to_linker(&mut linker, |s: &mut State| KeyValue { memory: &s.memory, table: &mut s.table })?;
    Ok(linker)
}

/// Loads the component, starts the HTTP server; returns the bound address.
pub fn start(opts: ComponentOptions) -> std::io::Result<Serving> {
    let io = |e: wasmtime::Error| std::io::Error::other(format!("{e:?}"));
    let (engine, component) = super::load(&opts.wasm).map_err(io)?;
    let pre = linker(&engine).and_then(|l| l.instantiate_pre(&component)).and_then(ProxyPre::new).map_err(io)?;
    let memory = Memory::new();
    let host = Arc::new(Host {
        pre,
        failures: AtomicU64::new(0),
        instances: AtomicU64::new(0),
        handling: AtomicU64::new(0),
        idle: Mutex::new(Vec::new()),
        answered: Mutex::new(VecDeque::new()),
        memory: memory.clone(),
        upstream: opts.upstream,
        env: opts.env,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let listener = runtime.block_on(TcpListener::bind(opts.listen))?;
    let addr = listener.local_addr()?;
    let serving = host.clone();
    runtime.spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let host = host.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let host = host.clone();
                    async move { host.handle(req).await }
                });
                let _ = http1::Builder::new().keep_alive(true).serve_connection(TokioIo::new(conn), service).await;
            });
        }
    });
    Ok(Serving { addr, memory, host: serving, _runtime: runtime })
}

impl Host {
    async fn handle(
        self: Arc<Self>,
        req: hyper::Request<hyper::body::Incoming>,
    ) -> wasmtime::Result<hyper::Response<HyperOutgoingBody>> {
        let (sender, receiver) = tokio::sync::oneshot::channel();
        let host = self.clone();
        let task = tokio::spawn(async move {
            let result = host.serve(req, sender).await;
            if let Err(e) = &result {
                host.failures.fetch_add(1, Ordering::SeqCst);
                eprintln!("host-test serve --component: the component failed: {e:?}");
            }
            result
        });
        match receiver.await {
            Ok(Ok(resp)) => {
                self.note_answer(&resp);
                Ok(resp)
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => match task.await {
                Ok(Ok(())) => Err(wasmtime::Error::msg("the component never set a response")),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(e.into()),
            },
        }
    }

    fn note_answer(&self, resp: &hyper::Response<HyperOutgoingBody>) {
        let label = resp.headers().get("x-holysheep-cache").and_then(|v| v.to_str().ok()).unwrap_or("-");
        let mut answered = self.answered.lock().unwrap_or_else(|e| e.into_inner());
        if answered.len() == ANSWERS_KEPT {
            answered.pop_front();
        }
        answered.push_back((Instant::now(), label.to_owned()));
    }

    /// One `handle` call on an idle instance (or a new one), which goes back idle after it.
    async fn serve(&self, req: hyper::Request<hyper::body::Incoming>, sender: Answer) -> wasmtime::Result<()> {
        let mut ready = match self.take_idle() {
            Some(r) => r,
            None => self.instantiate().await?,
        };
        let req = ready.store.data_mut().http().new_incoming_request(Scheme::Http, req)?;
        let out = ready.store.data_mut().http().new_response_outparam(sender)?;
        self.handling.fetch_add(1, Ordering::SeqCst);
        let handled = ready.proxy.wasi_http_incoming_handler().call_handle(&mut ready.store, req, out).await;
        self.handling.fetch_sub(1, Ordering::SeqCst);
        handled?;
        ready.served += 1;
        self.give_back(ready);
        Ok(())
    }

    fn take_idle(&self) -> Option<Ready> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    /// Keeps the instance for the next request, unless it served its share or enough wait
    /// already (then it is dropped, outside the lock: that frees its pool slot).
    fn give_back(&self, ready: Ready) {
        let refused = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            if ready.served < REUSES && idle.len() < IDLE {
                idle.push(ready);
                None
            } else {
                Some(ready)
            }
        };
        drop(refused);
    }

    async fn instantiate(&self) -> wasmtime::Result<Ready> {
        let mut wasi = WasiCtx::builder();
        wasi.inherit_stderr();
        for (k, v) in &self.env {
            wasi.env(k, v);
        }
        let state = State {
            table: ResourceTable::new(),
            wasi: wasi.build(),
            http: WasiHttpCtx::new(),
            hooks: Redirect { upstream: self.upstream },
            memory: self.memory.clone(),
        };
        let mut store = Store::new(self.pre.engine(), state);
        let proxy = self.pre.instantiate_async(&mut store).await?;
        self.instances.fetch_add(1, Ordering::SeqCst);
        Ok(Ready { store, proxy, served: 0 })
    }
}
