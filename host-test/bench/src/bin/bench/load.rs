//! Load: keep-alive connections sending requests back to back for a row's seconds, and
//! what a row measured (`Stats`).

use crate::stats::{percentile, Stats};
use holysheep_bench::profile;
use host_test::client::Conn;
use host_test::stack::prompt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// A request body at each call (a new one, or the same again).
pub type Prompts = Arc<dyn Fn() -> String + Send + Sync>;

/// What every row asks for, unless it says otherwise.
pub const PATH: &str = "/v1/chat/completions";

/// `conns` keep-alive connections, each sending `body(i)` back to back for `secs`.
pub fn load(addr: SocketAddr, conns: usize, secs: u64, body: Prompts) -> Stats {
    load_on(addr, PATH, conns, secs, body)
}

/// `load` on another endpoint's `path`.
pub fn load_on(addr: SocketAddr, path: &'static str, conns: usize, secs: u64, body: Prompts) -> Stats {
    load_as(addr, (path, &[]), conns, secs, body)
}

/// `load_on` with `headers` beside the bench's own `authorization`.
pub fn load_as(
    addr: SocketAddr,
    (path, headers): (&'static str, &'static [(&'static str, &'static str)]),
    conns: usize,
    secs: u64,
    body: Prompts,
) -> Stats {
    let start = Arc::new(Barrier::new(conns + 1));
    let handles: Vec<_> = (0..conns)
        .map(|_| {
            let (start, body) = (start.clone(), body.clone());
            std::thread::spawn(move || {
                let mut conn = Conn::open(addr).expect("connect");
                let mut sent = vec![("authorization", "Bearer bench")];
                sent.extend_from_slice(headers);
                let (mut lat, mut labels) = (Vec::new(), Vec::new());
                start.wait();
                let deadline = Instant::now() + Duration::from_secs(secs);
                while Instant::now() < deadline {
                    let b = body();
                    let t = Instant::now();
                    let r = conn.request("POST", path, &sent, b.as_bytes()).expect("answer");
                    lat.push(t.elapsed().as_micros() as u64);
                    assert_eq!(r.status, 200, "{}", r.text());
                    labels.push(r.cache().to_owned());
                }
                (lat, labels)
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    let (mut lat, mut labels) = (Vec::new(), Vec::new());
    for h in handles {
        let (l, s) = h.join().expect("load thread");
        lat.extend(l);
        labels.extend(s);
    }
    let elapsed = t0.elapsed().as_secs_f64();
    lat.sort_unstable();
    let pct = |p: f64| percentile(&lat, p);
    Stats {
        requests: lat.len(),
        rps: lat.len() as f64 / elapsed,
        p50_us: pct(0.50),
        p90_us: pct(0.90),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
        labels,
        cpu: None,
    }
}

/// The same prompt again and again, from `conns` connections for `secs`.
pub fn repeat_at(addr: SocketAddr, conns: usize, secs: u64, prompt: &str) -> Stats {
    let same = prompt.to_owned();
    load(addr, conns, secs, Arc::new(move || same.clone()))
}

pub fn unique_prompts(tag: &'static str) -> Prompts {
    let n = Arc::new(AtomicU64::new(0));
    Arc::new(move || prompt(&format!("{tag} {}", n.fetch_add(1, Ordering::Relaxed))))
}

/// Runs a row under `perf record` on Envoy (`pid`), when profiling.
pub fn profiled(pid: Option<u32>, run: impl FnOnce() -> Stats) -> Stats {
    let Some(pid) = pid else { return run() };
    let recording = profile::record(pid, std::env::temp_dir().join(format!("holysheep-bench-{pid}.perf")));
    let mut stats = run();
    stats.cpu = recording.and_then(profile::Recording::finish).map(|s| s.split);
    stats
}

/// Fails the bench unless every answer of the row carried this cache label.
pub fn expect_all(s: Stats, label: &str) -> Stats {
    let other = s.labels.iter().find(|l| *l != label);
    assert!(other.is_none(), "every answer of the row was a {label}, not {other:?}");
    s
}
