//! Live tails: 100 followers join a streamed MISS whose answer arrives in 50 events, on the
//! native module and on the plugin (whose followers get the whole answer at its end), each
//! in its own Envoy (two workers) on one mock. For every event, how long after the leader's
//! client a follower's client read it.

use crate::load::PATH;
use crate::report::Report;
use host_test::envoy::{Envoy, Options, Shell};
use host_test::mock::Running;
use std::net::SocketAddr;
use std::time::Instant;

const FOLLOWERS: usize = 100;
/// The mock's answer: the role, 48 pieces of content, the finish.
const EVENTS: usize = 50;
/// Between two events of the mock's stream.
const EVENT_GAP_MS: u64 = 10;

/// The rows (`BENCH_ONLY=tail`).
pub fn tail_rows(r: &mut Report, rounds: usize) -> std::io::Result<()> {
    let mock = Running::start(None, 0)?;
    let plugin = Envoy::start(&Options::new("{}", mock.addr))?;
    let mut opts = Options::new("{}", mock.addr);
    opts.shell = Shell::Native;
    let native = Envoy::start(&opts)?;
    // The head comes after 300 ms: every follower has joined by then.
    mock.mock.set_latency_ms(300);
    mock.mock.set_event_delay_ms(EVENT_GAP_MS);
    println!();
    for (name, edge) in [("native module", native.edge), ("plugin", plugin.edge)] {
        let mut lags = Vec::new();
        let mut worst_chunk_p99 = 0u64;
        for round in 0..rounds {
            let calls = mock.mock.calls();
            let clients = stream_crowd(edge, &mock, &body(&format!("{name} round {round}")));
            if mock.mock.calls() != calls + 1 {
                return Err(std::io::Error::other(format!("{name}: the crowd made more than one call")));
            }
            let (leader, followers) = clients.split_first().ok_or_else(|| std::io::Error::other("no leader"))?;
            if leader.len() != EVENTS || followers.iter().any(|f| f.len() != EVENTS) {
                return Err(std::io::Error::other(format!("{name}: a client did not get {EVENTS} events")));
            }
            for i in 0..EVENTS {
                let mut chunk: Vec<u64> =
                    followers.iter().map(|f| f[i].saturating_duration_since(leader[i]).as_micros() as u64).collect();
                chunk.sort_unstable();
                worst_chunk_p99 = worst_chunk_p99.max(percentile(&chunk, 99));
                lags.extend(chunk);
            }
        }
        lags.sort_unstable();
        let ms = |us: u64| us as f64 / 1000.0;
        r.note(format!(
            "live tail, {name}: {FOLLOWERS} followers of a streamed MISS of {EVENTS} events {EVENT_GAP_MS} ms apart, \
             {rounds} rounds; lag behind the leader's client per event: p50 {:.2} ms, p99 {:.2} ms, \
             worst event's p99 {:.2} ms (goal p99 <= 5 ms)",
            ms(percentile(&lags, 50)),
            ms(percentile(&lags, 99)),
            ms(worst_chunk_p99),
        ));
    }
    mock.mock.set_latency_ms(0);
    mock.mock.set_event_delay_ms(0);
    Ok(())
}

fn percentile(sorted: &[u64], p: usize) -> u64 {
    match sorted.len() {
        0 => 0,
        n => sorted[(n * p / 100).min(n - 1)],
    }
}

/// A streamed request whose answer is `EVENTS` events (its content 48 pieces of 8).
fn body(tag: &str) -> String {
    // The mock answers "HolySheep mock answer <24 hex> to: <prompt>": 51 characters and the
    // prompt, here 330.
    let text = format!("{tag} {}", "x".repeat(330 - tag.len() - 1));
    format!(r#"{{"stream":true,"model":"gpt-4.1","messages":[{{"role":"user","content":"{text}"}}],"temperature":0}}"#)
}

/// The leader, then `FOLLOWERS` more once its call is out, all from one thread (101 client
/// threads would fight the edge for the cores): when each client read each event.
fn stream_crowd(addr: SocketAddr, mock: &Running, body: &str) -> Vec<Vec<Instant>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!(
        "POST {PATH} HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer bench\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    runtime.block_on(async {
        let read = |mut c: tokio::net::TcpStream| async move {
            let mut got = Vec::new();
            let mut seen = Vec::new();
            let (mut scanned, mut ended) = (0, 0);
            let mut buf = [0u8; 8192];
            loop {
                let n = c.read(&mut buf).await.expect("the answer");
                assert!(n > 0, "the edge closed before the stream's end");
                let at = Instant::now();
                got.extend_from_slice(&buf[..n]);
                // Each event ends with a blank line (the chunk framing uses CRLF).
                ended += got[scanned..].windows(2).filter(|w| w == b"\n\n").count();
                scanned = got.len().saturating_sub(1);
                seen.resize(ended, at);
                if got.ends_with(b"0\r\n\r\n") {
                    // Without `[DONE]`.
                    seen.truncate(ended.saturating_sub(1));
                    return seen;
                }
            }
        };
        let connect = || async {
            let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
            c.set_nodelay(true).expect("nodelay");
            c.write_all(request.as_bytes()).await.expect("send");
            c
        };
        let calls = mock.mock.calls();
        let leader = tokio::spawn(read(connect().await));
        while mock.mock.calls() == calls {
            tokio::task::yield_now().await;
        }
        let mut followers = Vec::with_capacity(FOLLOWERS);
        for _ in 0..FOLLOWERS {
            followers.push(tokio::spawn(read(connect().await)));
        }
        let mut all = vec![leader.await.expect("the leader")];
        for f in followers {
            all.push(f.await.expect("a follower"));
        }
        all
    })
}
