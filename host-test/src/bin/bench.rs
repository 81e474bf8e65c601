//! `cargo run --release -p host-test --bin bench`: first numbers for holysheep-edge, all
//! measured in one run on this machine against baselines served by the same Envoy:
//! - HIT vs Envoy's own `direct_response` with the same body;
//! - MISS (distinct prompts) vs plain Envoy proxying to the mock;
//! - how long coalesced followers trail their leader;
//! - time to the first event of a streamed MISS through the edge vs plain proxying;
//! - a fleet node (`envoy/fleet.yaml.tmpl`, one node): HIT through the forward hop vs HIT
//!   on the owner listener;
//! - the wasi:http component on the wasmtime host: HIT vs the Envoy plugin's HIT, its
//!   (polling) followers;
//! - the plugin's and the component's sizes.
//!
//! Options (environment): BENCH_SECONDS (default 3), BENCH_CONNECTIONS (default 16).

use host_test::client::{request, Conn};
use host_test::component_host::serve::{start as start_component, ComponentOptions};
use host_test::envoy::{component_path, wasm_path, Envoy, Options};
use host_test::fleet::Fleet;
use host_test::mock::Running;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const PATH: &str = "/v1/chat/completions";

struct Stats {
    requests: usize,
    rps: f64,
    p50_us: u64,
    p99_us: u64,
    labels: Vec<String>,
}

fn prompt(text: &str) -> String {
    format!(r#"{{"model":"gpt-4.1","messages":[{{"role":"user","content":"{text}"}}],"temperature":0}}"#)
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// `conns` keep-alive connections, each sending `body(i)` back to back for `secs`.
fn load(addr: SocketAddr, conns: usize, secs: u64, body: Arc<dyn Fn() -> String + Send + Sync>) -> Stats {
    let start = Arc::new(Barrier::new(conns + 1));
    let handles: Vec<_> = (0..conns)
        .map(|_| {
            let (start, body) = (start.clone(), body.clone());
            std::thread::spawn(move || {
                let mut conn = Conn::open(addr).expect("connect");
                let (mut lat, mut labels) = (Vec::new(), Vec::new());
                start.wait();
                let deadline = Instant::now() + Duration::from_secs(secs);
                while Instant::now() < deadline {
                    let b = body();
                    let t = Instant::now();
                    let r =
                        conn.request("POST", PATH, &[("authorization", "Bearer bench")], b.as_bytes()).expect("answer");
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
    let pct =
        |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied().unwrap_or(0);
    Stats { requests: lat.len(), rps: lat.len() as f64 / elapsed, p50_us: pct(0.50), p99_us: pct(0.99), labels }
}

fn row(name: &str, s: &Stats) {
    println!("{name:<34} {:>9} {:>11.0} {:>10} {:>10}", s.requests, s.rps, s.p50_us, s.p99_us);
}

fn unique_prompts(tag: &'static str) -> Arc<dyn Fn() -> String + Send + Sync> {
    let n = Arc::new(AtomicU64::new(0));
    Arc::new(move || prompt(&format!("{tag} {}", n.fetch_add(1, Ordering::Relaxed))))
}

/// `n` identical requests at once with a slow upstream: how long after the leader's
/// answer do the followers get theirs?
fn follower_delay(edge: SocketAddr, mock: &Running, n: usize) -> (u64, u64, u64, usize) {
    mock.mock.set_latency_ms(300);
    let calls_before = mock.mock.calls();
    let body = prompt("follower delay probe");
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (b, body) = (barrier.clone(), body.clone());
            std::thread::spawn(move || {
                let mut conn = Conn::open(edge).expect("connect");
                b.wait();
                let r =
                    conn.request("POST", PATH, &[("authorization", "Bearer bench")], body.as_bytes()).expect("answer");
                (Instant::now(), r.cache().to_owned())
            })
        })
        .collect();
    let done: Vec<(Instant, String)> = handles.into_iter().map(|h| h.join().expect("thread")).collect();
    mock.mock.set_latency_ms(0);
    let leader = done.iter().find(|(_, c)| c == "MISS").map(|(t, _)| *t).expect("one leader");
    let mut delays: Vec<u64> = done
        .iter()
        .filter(|(_, c)| c == "COALESCED")
        .map(|(t, _)| t.saturating_duration_since(leader).as_micros() as u64)
        .collect();
    delays.sort_unstable();
    let p50 = delays.get(delays.len() / 2).copied().unwrap_or(0);
    let max = delays.last().copied().unwrap_or(0);
    (p50, max, mock.mock.calls() - calls_before, delays.len())
}

/// `n` distinct streamed prompts one after another to `addr`: the median time from sending
/// the request to the first event, and to the end of the stream, in microseconds.
fn first_event(addr: SocketAddr, tag: &str, n: usize) -> (u64, u64) {
    let (mut first, mut whole) = (Vec::new(), Vec::new());
    for i in 0..n {
        let body = prompt(&format!("{tag} {i}")).replacen('{', r#"{"stream":true,"#, 1);
        let mut conn = Conn::open(addr).expect("connect");
        let t = Instant::now();
        conn.send_only("POST", PATH, &[("authorization", "Bearer bench")], body.as_bytes()).expect("send");
        conn.read_until("data: ").expect("a first event");
        first.push(t.elapsed().as_micros() as u64);
        conn.read_past_last_chunk().expect("the whole stream");
        whole.push(t.elapsed().as_micros() as u64);
    }
    first.sort_unstable();
    whole.sort_unstable();
    (first[n / 2], whole[n / 2])
}

fn main() -> std::io::Result<()> {
    let secs = env_or("BENCH_SECONDS", 3);
    let conns = env_or("BENCH_CONNECTIONS", 16) as usize;
    let wasm_bytes = std::fs::metadata(wasm_path())?.len();
    let mock = Running::start(None, 0)?;
    let hit_prompt = prompt("benchmark prompt");
    // The direct_response baseline serves exactly the body a HIT serves.
    let hit_body = request(mock.addr, "POST", PATH, &[], hit_prompt.as_bytes())?.body;
    let mut opts = Options::new("{}", mock.addr);
    opts.direct_body = hit_body.clone();
    let envoy = Envoy::start(&opts)?;
    let warm = request(envoy.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    assert_eq!(warm.body, hit_body, "the edge serves the mock's answer");

    println!("holysheep-edge bench: Envoy 1.40 --concurrency 2, {conns} keep-alive connections, {secs}s per row");
    println!("{:<34} {:>9} {:>11} {:>10} {:>10}", "scenario", "requests", "req/s", "p50 us", "p99 us");
    let same = hit_prompt.clone();
    let direct = load(envoy.direct, conns, secs, Arc::new(move || same.clone()));
    row("direct_response (baseline)", &direct);
    let same = hit_prompt.clone();
    let hit = load(envoy.edge, conns, secs, Arc::new(move || same.clone()));
    row("edge HIT", &hit);
    let plain = load(envoy.plain, conns, secs, unique_prompts("plain"));
    row("plain proxy to mock (baseline)", &plain);
    let miss = load(envoy.edge, conns, secs, unique_prompts("miss"));
    row("edge MISS (distinct prompts)", &miss);
    assert!(hit.labels.iter().all(|l| l == "HIT"), "every HIT-row answer was a HIT");
    assert!(miss.labels.iter().all(|l| l == "MISS"), "every MISS-row answer was a MISS");

    let (p50, max, calls, followers) = follower_delay(envoy.edge, &mock, 50);
    println!();
    println!("HIT throughput / direct_response:   {:.2}", hit.rps / direct.rps);
    println!("HIT p50 / direct_response p50:      {:.2}", hit.p50_us as f64 / direct.p50_us.max(1) as f64);
    println!("HIT p99 / direct_response p99:      {:.2}", hit.p99_us as f64 / direct.p99_us.max(1) as f64);
    println!("MISS throughput / plain proxy:      {:.2}", miss.rps / plain.rps);
    println!("MISS p50 / plain proxy p50:         {:.2}", miss.p50_us as f64 / plain.p50_us.max(1) as f64);
    println!("MISS p99 / plain proxy p99:         {:.2}", miss.p99_us as f64 / plain.p99_us.max(1) as f64);
    println!("50 identical requests (300 ms upstream): {calls} upstream call(s), {followers} followers");
    println!("follower delay after the leader:    p50 {p50} us, max {max} us");
    println!("plugin size:                        {wasm_bytes} bytes");

    mock.mock.set_event_delay_ms(5);
    let (edge_first, edge_whole) = first_event(envoy.edge, "stream miss", 40);
    let (plain_first, plain_whole) = first_event(envoy.plain, "stream plain", 40);
    mock.mock.set_event_delay_ms(0);
    println!(
        "streamed MISS, first event (p50):   edge {edge_first} us, plain proxy {plain_first} us, ratio {:.2}",
        edge_first as f64 / plain_first.max(1) as f64
    );
    println!(
        "streamed MISS, whole stream (p50):  edge {edge_whole} us, plain proxy {plain_whole} us (5 ms between events)"
    );

    drop(envoy);
    let fleet = Fleet::start(1, "{}", 0);
    let node = fleet.live().next().expect("the fleet's node");
    request(node.public, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    println!();
    let same = hit_prompt.clone();
    let owner_hit = load(node.owner, conns, secs, Arc::new(move || same.clone()));
    row("fleet HIT on the owner listener", &owner_hit);
    let same = hit_prompt.clone();
    let hop_hit = load(node.public, conns, secs, Arc::new(move || same.clone()));
    row("fleet HIT through a forward hop", &hop_hit);
    assert!(owner_hit.labels.iter().chain(&hop_hit.labels).all(|l| l == "HIT"), "every fleet-row answer was a HIT");
    println!("forward hop HIT throughput / owner HIT: {:.2}", hop_hit.rps / owner_hit.rps);
    println!("forward hop HIT p50 / owner HIT p50:    {:.2}", hop_hit.p50_us as f64 / owner_hit.p50_us.max(1) as f64);
    drop(fleet);

    let component = start_component(ComponentOptions {
        wasm: component_path(),
        listen: ([127, 0, 0, 1], 0).into(),
        upstream: mock.addr,
        env: vec![("HOLYSHEEP_CONFIG".to_owned(), "{}".to_owned())],
    })?;
    request(component.addr, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    println!();
    let same = hit_prompt.clone();
    let component_hit = load(component.addr, conns, secs, Arc::new(move || same.clone()));
    row("component HIT (wasmtime host)", &component_hit);
    assert!(component_hit.labels.iter().all(|l| l == "HIT"), "every component HIT-row answer was a HIT");
    let (p50, max, calls, followers) = follower_delay(component.addr, &mock, 50);
    println!("component HIT throughput / edge HIT: {:.2}", component_hit.rps / hit.rps);
    println!("component: 50 identical requests (300 ms upstream): {calls} upstream call(s), {followers} followers");
    println!("component follower delay (polling): p50 {p50} us, max {max} us");
    println!("component size:                     {} bytes", std::fs::metadata(component_path())?.len());
    Ok(())
}
