//! Followers: how long after their leader a crowd of identical requests is answered, by
//! Envoy's access log, against a floor of held requests released at once.

use crate::env_or;
use crate::floors::Stage;
use crate::load::PATH;
use crate::report::Report;
use crate::stats::{paired, percentile};
use host_test::mock::Running;
use host_test::stack::prompt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long after their leader a crowd of `crowd` identical requests is answered, alternating
/// with the followers' floor (`floor_held`), by Envoy's access logs.
pub fn crowd_rows(r: &mut Report, stage: &Stage, mock: &Running, (crowd, hit_prompt): (usize, &str)) {
    let (envoy, log, held_log) = (&stage.envoy, stage.edge_log.as_path(), stage.held_log.as_path());
    let logged = envoy.listener("edge_logged").expect("edge_logged listener");
    let floor_held = envoy.listener("floor_held").expect("floor_held listener");
    let (mut floor_rounds, mut edge_rounds) = (Vec::new(), Vec::new());
    let crowd_rounds = env_or("BENCH_CROWD_ROUNDS", 3);
    for round in 0..crowd_rounds {
        let before = access_log(held_log).len();
        let floor = follower_delay(floor_held, mock, (crowd, hit_prompt), |_| {
            Some(edge_ends(&logged_after(held_log, before, crowd)))
        });
        let before = access_log(log).len();
        let probe = prompt(&format!("follower delay probe {round}"));
        let edge =
            follower_delay(logged, mock, (crowd, &probe), |_| Some(edge_ends(&logged_after(log, before, crowd))));
        assert_eq!(edge.calls, 1, "a crowd of identical requests makes one upstream call");
        floor_rounds.push(floor.server.expect("the floor's access log"));
        edge_rounds.push(edge.server.expect("the edge's access log"));
    }
    let p99_ratio = paired(&edge_rounds, &floor_rounds, |e, f| e.p99_us as f64 / f.p99_us.max(1) as f64);
    let (floor, edge) = (median_p99(floor_rounds), median_p99(edge_rounds));
    // Envoy's own clock: the one client thread reads 1000 answers one after another, so
    // its timestamps trail the edge's by up to the time that takes.
    r.note(format!(
        "{crowd} identical requests (300 ms upstream, 1 upstream call each), {} followers; last byte sent after the leader's (Envoy's access log), median round of {}: edge {} (goal p99 <= 5 ms); floor of {crowd} held requests released by the last: {}",
        edge.followers,
        crowd_rounds,
        edge.line(),
        floor.line()
    ));
    r.ratio("Envoy followers p99 / held-requests floor p99", p99_ratio, "");
    r.series.push(("Envoy followers".into(), edge.sorted_us));
    r.series.push(("floor: held requests".into(), floor.sorted_us));
    for l in [log, held_log] {
        let _ = std::fs::remove_file(l);
    }
}

/// `n` identical requests at once with a slow upstream: how long after the leader's
/// answer do the followers get theirs? As the clients saw it, and by the server's own
/// clock (`server(start)`: each answer's time and label since the crowd started, if the
/// server keeps them).
pub fn follower_delay(
    edge: SocketAddr,
    mock: &Running,
    (n, body): (usize, &str),
    server: impl FnOnce(Instant) -> Option<Vec<(u64, String)>>,
) -> Followers {
    mock.mock.set_latency_ms(300);
    let calls_before = mock.mock.calls();
    let started = Instant::now();
    let done = crowd(edge, n, body);
    mock.mock.set_latency_ms(0);
    let seen: Vec<(u64, String)> =
        done.iter().map(|(t, c)| (t.saturating_duration_since(started).as_micros() as u64, c.clone())).collect();
    Followers {
        client: Delays::of(&after_leader(seen)),
        server: server(started).map(|answers| Delays::of(&after_leader(answers))),
        calls: mock.mock.calls() - calls_before,
    }
}

/// Times made relative to the leader's (the MISS); none without a leader.
pub fn after_leader(answers: Vec<(u64, String)>) -> Vec<(u64, String)> {
    let Some(leader) = answers.iter().find(|(_, c)| c == "MISS").map(|(t, _)| *t) else { return Vec::new() };
    answers.into_iter().map(|(t, c)| (t.saturating_sub(leader), c)).collect()
}

/// `n` connections send the same request at once and read their answers, all from one
/// thread (1000 client threads would fight the edge for the cores just when it answers):
/// when each answer was read, and its cache label.
pub fn crowd(addr: SocketAddr, n: usize, body: &str) -> Vec<(Instant, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!(
        "POST {PATH} HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer bench\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().build().expect("a runtime");
    runtime.block_on(async {
        let mut conns = Vec::with_capacity(n);
        for _ in 0..n {
            let c = tokio::net::TcpStream::connect(addr).await.expect("connect");
            c.set_nodelay(true).expect("nodelay");
            conns.push(c);
        }
        for c in &mut conns {
            c.write_all(request.as_bytes()).await.expect("send");
        }
        let answers = conns.into_iter().map(|mut c| async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let read = c.read(&mut buf).await.expect("answer");
                assert!(read > 0, "the edge closed before answering");
                got.extend_from_slice(&buf[..read]);
                if let Some(label) = complete(&got) {
                    return (Instant::now(), label);
                }
            }
        });
        let tasks: Vec<_> = answers.map(tokio::spawn).collect();
        let mut done = Vec::with_capacity(n);
        for t in tasks {
            done.push(t.await.expect("a crowd task"));
        }
        done
    })
}

/// The cache label of a whole HTTP/1.1 answer (with a `content-length`, or chunked);
/// `None` until it is all there.
pub fn complete(got: &[u8]) -> Option<String> {
    let end = got.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
    let value = |name: &str| head.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned());
    let whole = match value("content-length:") {
        Some(length) => got.len() >= end + length.parse::<usize>().ok()?,
        None => got.ends_with(b"0\r\n\r\n"),
    };
    whole.then(|| value("x-holysheep-cache:").unwrap_or_else(|| "-".into()).to_ascii_uppercase())
}

/// The access log's lines (`START TOOK CACHE`, see `host_test::envoy::Options`).
pub fn access_log(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_owned).collect()
}

/// The `n` lines logged after the first `skip`, once Envoy has flushed them (it writes its
/// access logs about once a second).
pub fn logged_after(path: &Path, skip: usize, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines = access_log(path);
        if lines.len() >= skip + n || Instant::now() > deadline {
            return lines.into_iter().skip(skip).collect();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Each logged request's last byte sent by Envoy (microseconds since the epoch), with its
/// label.
pub fn edge_ends(lines: &[String]) -> Vec<(u64, String)> {
    lines
        .iter()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let start: u64 = f.next()?.parse().ok()?;
            let took: u64 = f.next()?.parse().ok()?;
            Some((start + took, f.next()?.to_owned()))
        })
        .collect()
}

/// How long the followers (COALESCED) trailed their leader, in microseconds.
pub struct Delays {
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    pub followers: usize,
    pub sorted_us: Vec<u64>,
}

impl Delays {
    pub fn of(answers: &[(u64, String)]) -> Delays {
        let mut d: Vec<u64> = answers.iter().filter(|(_, c)| c == "COALESCED").map(|(t, _)| *t).collect();
        d.sort_unstable();
        Delays {
            p50_us: percentile(&d, 0.5),
            p99_us: percentile(&d, 0.99),
            max_us: d.last().copied().unwrap_or(0),
            followers: d.len(),
            sorted_us: d,
        }
    }

    pub fn line(&self) -> String {
        format!("p50 {} us, p99 {} us, max {} us", self.p50_us, self.p99_us, self.max_us)
    }
}

pub struct Followers {
    /// As the clients saw them (their thread shares the cores with the server).
    pub client: Delays,
    /// By the server's own clock (Envoy's access log, the component host's record).
    pub server: Option<Delays>,
    pub calls: u64,
}

/// The crowd round with the median p99 delay.
pub fn median_p99(mut rounds: Vec<Delays>) -> Delays {
    rounds.sort_by_key(|d| d.p99_us);
    rounds.swap_remove(rounds.len() / 2)
}
