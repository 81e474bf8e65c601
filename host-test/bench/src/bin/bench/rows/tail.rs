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
const DONE: &[u8] = b"data: [DONE]\n\n";

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
            if leader.len() != EVENTS {
                return Err(std::io::Error::other(format!(
                    "{name}: the leader got {} events, not {EVENTS}",
                    leader.len()
                )));
            }
            // A follower has the leader's event once it has as much of the answer: the
            // plugin's followers get the answer in other pieces.
            for &(content, first) in leader {
                let mut chunk = Vec::with_capacity(followers.len());
                for f in followers {
                    let at = had(f, content).ok_or_else(|| std::io::Error::other("a follower's answer is short"))?;
                    chunk.push(at.saturating_duration_since(first).as_micros() as u64);
                }
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
/// threads would fight the edge for the cores): each client's events as they arrived.
fn stream_crowd(addr: SocketAddr, mock: &Running, body: &str) -> Vec<Vec<(usize, Instant)>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!(
        "POST {PATH} HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer bench\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    runtime.block_on(async {
        let read = |mut c: tokio::net::TcpStream| async move {
            let mut got = Vec::new();
            // When each read came, and how many bytes there were then.
            let mut reads = Vec::new();
            let mut buf = [0u8; 8192];
            loop {
                let n = c.read(&mut buf).await.expect("the answer");
                assert!(n > 0, "the edge closed before the stream's end");
                let from = got.len().saturating_sub(DONE.len());
                got.extend_from_slice(&buf[..n]);
                reads.push((got.len(), Instant::now()));
                // `[DONE]` ends the stream (the plugin's followers get a whole local reply).
                if got[from..].windows(DONE.len()).any(|w| w == DONE) {
                    return arrivals(&got, &reads);
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

/// Each event of a stream read as `got` (whose reads came as `reads`): the content its
/// client had once it arrived (characters), and when.
fn arrivals(got: &[u8], reads: &[(usize, Instant)]) -> Vec<(usize, Instant)> {
    let text = String::from_utf8_lossy(got);
    let mut out = Vec::new();
    let mut content = 0;
    let mut at = 0;
    while let Some(start) = text[at..].find("data: {").map(|i| at + i) {
        let Some(end) = text[start..].find("\n\n").map(|i| start + i + 2) else { break };
        let event: serde_json::Value = serde_json::from_str(&text[start + 6..end - 2]).unwrap_or_default();
        content += event["choices"][0]["delta"]["content"].as_str().map_or(0, |c| c.chars().count());
        let arrived = reads.iter().find(|(len, _)| *len >= end).map(|(_, t)| *t);
        out.extend(arrived.map(|t| (content, t)));
        at = end;
    }
    out
}

/// When `client` first had at least `content` characters.
fn had(client: &[(usize, Instant)], content: usize) -> Option<Instant> {
    client.iter().find(|(c, _)| *c >= content).map(|(_, t)| *t)
}
