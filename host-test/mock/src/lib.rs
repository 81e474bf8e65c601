//! Mock HolySheep: an OpenAI-compatible server for tests and the demo.
//!
//! Answers are deterministic (derived from the request), carry real `usage` numbers and
//! OpenAI's error shape. Control endpoints under `/mock/` inject faults and count calls.
//! By concern: `server` (the connection loop, routes, control endpoints, what tests read),
//! `faults`, `chat` and its `events`, `apis` (completions and Responses), `embeddings`,
//! `reply` (OpenAI's shapes).

use http_body_util::channel::Channel;
use http_body_util::{Either, Full};
use hyper::body::Bytes;
use std::net::SocketAddr;
use tokio::net::TcpListener;

pub mod apis;
mod chat;
pub mod embeddings;
mod events;
mod faults;
mod limit;
mod reply;
mod server;

pub use chat::{RATE_LIMIT_REQUESTS, RATE_LIMIT_TOKENS};
pub use faults::Fault;
pub use reply::quoted;
pub use server::Mock;

type Body = Either<Full<Bytes>, Channel<Bytes, std::io::Error>>;

/// Binds `addr` and serves the mock on the current tokio runtime.
pub async fn start(addr: SocketAddr, mock: Mock) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(mock.serve(listener));
    Ok(local)
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
