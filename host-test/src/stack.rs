//! A mock HolySheep and a real Envoy with the plugin in front of it, for end-to-end tests.

use crate::client::{request, Conn, Resp};
use crate::envoy::{Envoy, Options};
use crate::mock::Running;
use std::net::SocketAddr;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

pub const PATH: &str = "/v1/chat/completions";

pub struct Stack {
    pub mock: Running,
    pub envoy: Envoy,
}

impl Stack {
    /// Panics (this is test support) when the mock or Envoy cannot start.
    pub fn start(config: &str, latency_ms: u64) -> Stack {
        Self::start_with(config, latency_ms, None, None)
    }

    /// `mock_key`: the key the mock requires; `envoy_key`: `HOLYSHEEP_API_KEY` for Envoy.
    pub fn start_with(config: &str, latency_ms: u64, mock_key: Option<&str>, envoy_key: Option<&str>) -> Stack {
        Self::start_tuned(config, latency_ms, |opts| opts.api_key = envoy_key.map(str::to_owned), mock_key)
    }

    /// With Envoy's options adjusted by `tune` (workers, key, ...).
    pub fn start_tuned(
        config: &str,
        latency_ms: u64,
        tune: impl FnOnce(&mut Options),
        mock_key: Option<&str>,
    ) -> Stack {
        let mock = Running::start(mock_key, latency_ms).expect("mock starts");
        let mut opts = Options::new(config, mock.addr);
        tune(&mut opts);
        let envoy = Envoy::start(&opts).expect("envoy starts");
        Stack { mock, envoy }
    }

    /// Lines of Envoy's log that say a VM crashed (a panic, a V8 exception, a failed VM).
    pub fn crashes(&self) -> Vec<String> {
        self.envoy.crashes()
    }

    pub fn calls(&self) -> u64 {
        self.mock.mock.calls()
    }

    pub fn chat(&self, body: &str, headers: &[(&str, &str)]) -> Resp {
        request(self.envoy.edge, "POST", PATH, headers, body.as_bytes()).expect("edge answers")
    }

    /// One request per body, all released together; answers in the bodies' order.
    pub fn burst_of(&self, bodies: Vec<String>, auth: &str) -> Vec<Resp> {
        burst_at(self.envoy.edge, bodies, auth)
    }

    /// `n` identical requests released together.
    pub fn burst(&self, n: usize, body: &str, auth: &str) -> Vec<Resp> {
        self.burst_of(vec![body.to_owned(); n], auth)
    }

    /// Waits (on the mock's own counter, not on time) until `n` upstream calls arrived.
    pub fn await_calls(&self, n: u64) {
        poll_until(|| self.calls() >= n, &format!("upstream call {n} never arrived"));
    }
}

/// One chat request per body to `addr`, each on its own connection, all released together;
/// answers in the bodies' order.
pub fn burst_at(addr: SocketAddr, bodies: Vec<String>, auth: &str) -> Vec<Resp> {
    burst_to(addr, PATH, bodies, auth)
}

/// `n` callers of `body` at once (`burst_at`), the mock's first call held until the host
/// says it has taken in all of them (`taken_in`), then let go: each caller's time to reach
/// the flight is the mock's latency, not the time the host took to take it in.
pub fn burst_held(mock: &Running, addr: SocketAddr, body: &str, n: u64, taken_in: impl Fn() -> u64) -> Vec<Resp> {
    mock.mock.plan(vec![crate::mock::Fault { hold: true, ..Default::default() }]);
    let bodies = vec![body.to_owned(); n as usize];
    let burst = std::thread::spawn(move || burst_at(addr, bodies, "Bearer a"));
    poll_until(|| taken_in() == n, "the host took in every caller");
    mock.mock.release();
    burst.join().expect("burst")
}

/// `burst_at` on `path`.
pub fn burst_to(addr: SocketAddr, path: &'static str, bodies: Vec<String>, auth: &str) -> Vec<Resp> {
    let barrier = Arc::new(Barrier::new(bodies.len()));
    let handles: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let (b, auth) = (barrier.clone(), auth.to_owned());
            std::thread::spawn(move || {
                let mut conn = Conn::open(addr).expect("connect");
                b.wait();
                conn.request("POST", path, &[("authorization", &auth)], body.as_bytes()).expect("answer")
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("thread")).collect()
}

/// Runs a client script (an SDK driven through the edge) and reads the one JSON list it
/// prints; fails with its output when it fails.
pub fn results_of(command: &mut std::process::Command) -> Vec<serde_json::Value> {
    let out = command.output().expect("the client runs (make test installs the SDKs)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str::<serde_json::Value>(stdout.trim()).expect("json line").as_array().cloned().unwrap_or_default()
}

/// Waits for a condition no event announces (a counter, a log line), looking every few
/// milliseconds so the wait does not take the CPU from Envoy; fails after 30 s.
pub fn poll_until(mut done: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A chat-completion body for `gpt-4.1` at temperature 0.
pub fn prompt(text: &str) -> String {
    prompt_for("gpt-4.1", text)
}

pub fn prompt_for(model: &str, text: &str) -> String {
    format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"{text}"}}],"temperature":0}}"#)
}

/// `body` (a JSON object) asking for a stream.
pub fn streamed(body: &str) -> String {
    body.replacen('{', r#"{"stream":true,"#, 1)
}

/// A tenant token's SHA-256 in hex, as `tenants.<name>.keys_sha256` holds it.
pub fn key_digest(token: &str) -> String {
    sha256_hex(token.as_bytes())
}

/// SHA-256 of `bytes` in lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// How many answers carry this `x-holysheep-cache` value.
pub fn count(resps: &[Resp], cache: &str) -> usize {
    resps.iter().filter(|r| r.cache() == cache).count()
}
