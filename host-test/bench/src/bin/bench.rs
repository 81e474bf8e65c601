//! `make bench` (`cargo run --profile host -p holysheep-bench --bin bench`): numbers for holysheep-edge, all
//! measured in one run on this machine against baselines served by the same Envoy:
//! - HIT vs Envoy's own `direct_response` with the same body;
//! - MISS (distinct prompts) vs plain Envoy proxying to the mock;
//! - how long coalesced followers trail their leader;
//! - time to the first event of a streamed MISS through the edge vs plain proxying;
//! - a fleet node (`envoy/fleet.yaml.tmpl`, one node): HIT on the owner listener vs HIT
//!   from the forward listener's near copy vs HIT through the forward hop (a node without
//!   near copies), alternating;
//! - floors: minimal proxy-wasm filters (`host-test/bench/floors/`: a local reply, the same
//!   making the HIT's host calls and sending its headers, a callout, the same making the
//!   MISS's host calls and sending its headers, the same also parsing and hashing the
//!   request and parsing the answer as any governed MISS must) measured beside the plugin, with the
//!   goals (printed beside each) as ratios; and the followers' floor: a crowd of requests held until
//!   the last arrives, then released on every worker, alternating with the plugin's crowds;
//! - the wasi:http component on the wasmtime host (running beside Envoy): HIT, alternating
//!   with the plugin's HIT rounds, vs the Envoy plugin's HIT; its
//!   (polling) followers;
//! - a critical request's wait behind a backlog of sheddable ones (BENCH_BACKLOG, default
//!   1000), with priority classes and in one first-come line (every request standard);
//! - the semantic tier (its own Envoy beside one without it): a MISS with the tier on
//!   (embedding, lookup, learning) vs an exact MISS, and a SEMANTIC answer (a paraphrase:
//!   exact miss, embedding, lookup) vs an exact HIT, the lookup over a partition of one
//!   question vs a full page of 64;
//! - the plugin's and the component's sizes.
//!
//! Options (environment): BENCH_SECONDS (default 3), BENCH_CONNECTIONS (default 16),
//! BENCH_ROUNDS (default 5: floor and plugin rows alternate; a row's median round is its
//! line, and a ratio of two alternating rows is the median of their rounds' ratios),
//! BENCH_ONLY=priority (only the backlog rows, into target/bench/priority/), BENCH_ONLY=semantic
//! (only the semantic tier's rows, into target/bench/semantic/), BENCH_ONLY=crowd
//! (only the followers' rows, into target/bench/crowd/), BENCH_ONLY=fleet (only the fleet
//! node's rows, into target/bench/fleet/),
//! BENCH_CROWD (default 1000 identical requests for the follower delay), BENCH_CROWD_ROUNDS
//! (default 3 crowds for the plugin and as many for the floor, alternating), BENCH_PROFILE=1
//! (`perf record` on Envoy during each Envoy row: CPU per request in the filter's wasm code,
//! in Envoy itself and in the kernel; see `holysheep_bench::profile`).

use holysheep_bench::profile::{self, Split};
use host_test::client::{request, Conn};
use host_test::component_host::serve::{start as start_component, ComponentOptions};
use host_test::envoy::{access_log as access_log_yaml, component_path, wasm_path, workspace_root, Envoy, Options};
use host_test::fleet::Fleet;
use host_test::mock::Running;
use host_test::stack::prompt;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const PATH: &str = "/v1/chat/completions";

struct Stats {
    requests: usize,
    rps: f64,
    p50_us: u64,
    p90_us: u64,
    p99_us: u64,
    p999_us: u64,
    labels: Vec<String>,
    /// Envoy's CPU during the row, with BENCH_PROFILE=1.
    cpu: Option<Split>,
}

/// The `p` quantile of sorted values (0 when there are none).
fn percentile(sorted: &[u64], p: f64) -> u64 {
    let at = ((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(at).copied().unwrap_or(0)
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// `conns` keep-alive connections, each sending `body(i)` back to back for `secs`.
fn load(addr: SocketAddr, conns: usize, secs: u64, body: Arc<dyn Fn() -> String + Send + Sync>) -> Stats {
    load_on(addr, PATH, conns, secs, body)
}

/// `load` on another endpoint's `path`.
fn load_on(
    addr: SocketAddr,
    path: &'static str,
    conns: usize,
    secs: u64,
    body: Arc<dyn Fn() -> String + Send + Sync>,
) -> Stats {
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
                        conn.request("POST", path, &[("authorization", "Bearer bench")], b.as_bytes()).expect("answer");
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

/// Runs a row under `perf record` on Envoy (`pid`), when profiling.
fn profiled(pid: Option<u32>, run: impl FnOnce() -> Stats) -> Stats {
    let Some(pid) = pid else { return run() };
    let recording = profile::record(pid, std::env::temp_dir().join(format!("holysheep-bench-{pid}.perf")));
    let mut stats = run();
    stats.cpu = recording.and_then(profile::Recording::finish).map(|s| s.split);
    stats
}

fn row(name: &str, s: &Stats) {
    println!("{name:<34} {:>9} {:>11.0} {:>10} {:>10}", s.requests, s.rps, s.p50_us, s.p99_us);
    if let Some(cpu) = &s.cpu {
        let [wasm, envoy, kernel, libs, total] = cpu.per_request_us(s.requests);
        println!("{:<34} Envoy CPU/request: wasm {wasm:.1} us, envoy {envoy:.1}, kernel {kernel:.1}, libs {libs:.1}, total {total:.1}", "");
    }
}

fn unique_prompts(tag: &'static str) -> Arc<dyn Fn() -> String + Send + Sync> {
    let n = Arc::new(AtomicU64::new(0));
    Arc::new(move || prompt(&format!("{tag} {}", n.fetch_add(1, Ordering::Relaxed))))
}

/// `n` identical requests at once with a slow upstream: how long after the leader's
/// answer do the followers get theirs? As the clients saw it, and by the server's own
/// clock (`server(start)`: each answer's time and label since the crowd started, if the
/// server keeps them).
fn follower_delay(
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
fn after_leader(answers: Vec<(u64, String)>) -> Vec<(u64, String)> {
    let Some(leader) = answers.iter().find(|(_, c)| c == "MISS").map(|(t, _)| *t) else { return Vec::new() };
    answers.into_iter().map(|(t, c)| (t.saturating_sub(leader), c)).collect()
}

/// `n` connections send the same request at once and read their answers, all from one
/// thread (1000 client threads would fight the edge for the cores just when it answers):
/// when each answer was read, and its cache label.
fn crowd(addr: SocketAddr, n: usize, body: &str) -> Vec<(Instant, String)> {
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
fn complete(got: &[u8]) -> Option<String> {
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
fn access_log(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_owned).collect()
}

/// The `n` lines logged after the first `skip`, once Envoy has flushed them (it writes its
/// access logs about once a second).
fn logged_after(path: &Path, skip: usize, n: usize) -> Vec<String> {
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
fn edge_ends(lines: &[String]) -> Vec<(u64, String)> {
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
struct Delays {
    p50_us: u64,
    p99_us: u64,
    max_us: u64,
    followers: usize,
    sorted_us: Vec<u64>,
}

impl Delays {
    fn of(answers: &[(u64, String)]) -> Delays {
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

    fn line(&self) -> String {
        format!("p50 {} us, p99 {} us, max {} us", self.p50_us, self.p99_us, self.max_us)
    }
}

struct Followers {
    /// As the clients saw them (their thread shares the cores with the server).
    client: Delays,
    /// By the server's own clock (Envoy's access log, the component host's record).
    server: Option<Delays>,
    calls: u64,
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

/// Runs the rows one after another, `rounds` times over (the machine's noise hits all
/// alike); every row's rounds, in order.
fn alternate(rounds: usize, rows: &mut [&mut dyn FnMut() -> Stats]) -> Vec<Vec<Stats>> {
    let mut runs: Vec<Vec<Stats>> = rows.iter().map(|_| Vec::new()).collect();
    for _ in 0..rounds.max(1) {
        for (row, run) in rows.iter_mut().zip(&mut runs) {
            run.push(row());
        }
    }
    runs
}

/// `of(a, b)` for the two rows' rounds taken side by side (round i of one against round i
/// of the other, measured a few seconds apart), the median of those.
fn paired<T>(a: &[T], b: &[T], of: impl Fn(&T, &T) -> f64) -> f64 {
    let mut values: Vec<f64> = a.iter().zip(b).map(|(a, b)| of(a, b)).collect();
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn throughput(a: &Stats, b: &Stats) -> f64 {
    a.rps / b.rps.max(f64::MIN_POSITIVE)
}

/// The row's median round by throughput.
fn median(mut rounds: Vec<Stats>) -> Stats {
    rounds.sort_by(|x, y| x.rps.total_cmp(&y.rps));
    rounds.swap_remove(rounds.len() / 2)
}

/// The crowd round with the median p99 delay.
fn median_p99(mut rounds: Vec<Delays>) -> Delays {
    rounds.sort_by_key(|d| d.p99_us);
    rounds.swap_remove(rounds.len() / 2)
}

/// Fails the bench unless every answer of the row carried this cache label.
fn expect_all(s: Stats, label: &str) -> Stats {
    let other = s.labels.iter().find(|l| *l != label);
    assert!(other.is_none(), "every answer of the row was a {label}, not {other:?}");
    s
}

/// A floor filter's listener (`host-test/bench/floors/`), added to the bench's Envoy.
fn floor_listener(name: &str, wasm: &Path, configuration: &str) -> String {
    format!(
        r#"  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: {name}
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: holysheep, timeout: 120s}}
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: {name}
                root_id: {name}
                allow_on_headers_stop_iteration: true
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{configuration}'
                vm_config:
                  vm_id: {name}
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{wasm}"}}}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
        wasm = wasm.display(),
        configuration = configuration.replace('\'', "''"),
    )
}

/// A floor's listener with an access log at `path` (as the edge's `edge_logged`).
fn logged_floor(listener: String, path: &Path) -> String {
    let prefix = listener.lines().find(|l| l.trim_start().starts_with("stat_prefix:")).unwrap_or_default().to_owned();
    listener.replacen(&format!("{prefix}\n"), &format!("{prefix}\n{}", access_log_yaml(path)), 1)
}

/// What one run measured, printed as it goes and written to `target/bench/`.
#[derive(Default)]
struct Report {
    rows: Vec<(String, Stats)>,
    ratios: Vec<(String, f64, String)>,
    notes: Vec<String>,
    series: Vec<(String, Vec<u64>)>,
}

impl Report {
    fn row(&mut self, name: &str, s: Stats) -> usize {
        row(name, &s);
        self.rows.push((name.to_owned(), s));
        self.rows.len() - 1
    }

    fn ratio(&mut self, what: &str, value: f64, goal: &str) {
        println!("{what:<44} {value:>6.2}   {goal}");
        self.ratios.push((what.to_owned(), value, goal.to_owned()));
    }

    fn note(&mut self, line: String) {
        println!("{line}");
        self.notes.push(line);
    }

    /// With BENCH_PROFILE=1: how each of Envoy's own functions cost per request in row `a`
    /// against row `b` (see `profile::function_ratios`).
    fn compare_functions(&mut self, a: usize, b: usize) {
        let ((a_name, a), (b_name, b)) = (&self.rows[a], &self.rows[b]);
        let (Some(a_cpu), Some(b_cpu)) = (&a.cpu, &b.cpu) else { return };
        let (n, [q1, median, q3]) = profile::function_ratios(a_cpu, a.requests, b_cpu, b.requests, 0.25);
        let line = format!(
            "Envoy's own functions, {a_name} / {b_name}: per-request CPU ratio median {median:.2} \
             (quartiles {q1:.2}, {q3:.2}) over the {n} functions costing the second row >= 0.25 us"
        );
        self.note(line);
    }

    fn rps(&self, i: usize) -> f64 {
        self.rows[i].1.rps
    }

    /// Envoy's CPU per request by where it went, for the rows recorded (BENCH_PROFILE=1).
    fn profile_table(&self) -> String {
        let mut md = String::new();
        for (name, s) in &self.rows {
            let Some(cpu) = &s.cpu else { continue };
            if md.is_empty() {
                md += "\nEnvoy CPU per request (µs), `perf record` on Envoy during the row:\n\n";
                md += "| scenario | wasm code | Envoy + V8 runtime | kernel | libs | total |\n|---|---:|---:|---:|---:|---:|\n";
            }
            let [wasm, envoy, kernel, libs, total] = cpu.per_request_us(s.requests);
            md += &format!("| {name} | {wasm:.1} | {envoy:.1} | {kernel:.1} | {libs:.1} | {total:.1} |\n");
        }
        md
    }

    fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut md = String::from("| scenario | requests | req/s | p50 µs | p99 µs |\n|---|---:|---:|---:|---:|\n");
        for (name, s) in &self.rows {
            md += &format!("| {name} | {} | {:.0} | {} | {} |\n", s.requests, s.rps, s.p50_us, s.p99_us);
        }
        md += &self.profile_table();
        md += "\n| ratio | value | goal |\n|---|---:|---|\n";
        for (what, v, goal) in &self.ratios {
            md += &format!("| {what} | {v:.2} | {goal} |\n");
        }
        md += "\n";
        for n in &self.notes {
            md += &format!("- {n}\n");
        }
        std::fs::write(dir.join("results.md"), md)?;
        let json = serde_json::json!({
            "rows": self.rows.iter().map(|(n, s)| serde_json::json!({
                "name": n, "requests": s.requests, "rps": s.rps, "p50_us": s.p50_us, "p90_us": s.p90_us,
                "p99_us": s.p99_us, "p999_us": s.p999_us,
                "cpu_us_per_request": s.cpu.as_ref().map(|c| c.per_request_us(s.requests)),
            })).collect::<Vec<_>>(),
            "ratios": self.ratios.iter().map(|(w, v, g)| serde_json::json!({"what": w, "value": v, "goal": g})).collect::<Vec<_>>(),
            "series": self.series.iter().map(|(n, d)| serde_json::json!({"name": n, "delays_us": d})).collect::<Vec<_>>(),
        });
        std::fs::write(dir.join("results.json"), serde_json::to_vec_pretty(&json).unwrap_or_default())
    }
}

fn main() -> std::io::Result<()> {
    host_test::envoy::kill_envoys_on_panic();
    let secs = env_or("BENCH_SECONDS", 3);
    let conns = env_or("BENCH_CONNECTIONS", 16) as usize;
    let crowd = env_or("BENCH_CROWD", 1000) as usize;
    let rounds = env_or("BENCH_ROUNDS", 5) as usize;
    if std::env::var("BENCH_ONLY").as_deref() == Ok("priority") {
        let mut r = Report::default();
        backlog_rows(&mut r)?;
        return r.write(&workspace_root().join("target/bench/priority"));
    }
    if std::env::var("BENCH_ONLY").as_deref() == Ok("budget") {
        let mut r = Report::default();
        let mock = Running::start(None, 0)?;
        budget_rows(&mut r, &mock, rounds, (conns, secs), &prompt("bench: a budgeted HIT"))?;
        return r.write(&workspace_root().join("target/bench/budget"));
    }
    if std::env::var("BENCH_ONLY").as_deref() == Ok("tenants") {
        let mut r = Report::default();
        let mock = Running::start(None, 0)?;
        tenant_rows(&mut r, &mock, rounds, (conns, secs), &prompt("bench: a tenant's HIT"))?;
        return r.write(&workspace_root().join("target/bench/tenants"));
    }
    if std::env::var("BENCH_ONLY").as_deref() == Ok("endpoints") {
        let mut r = Report::default();
        let mock = Running::start(None, 0)?;
        endpoint_rows(&mut r, &mock, rounds, (conns, secs))?;
        return r.write(&workspace_root().join("target/bench/endpoints"));
    }
    if std::env::var("BENCH_ONLY").as_deref() == Ok("semantic") {
        let mut r = Report::default();
        semantic_rows(&mut r, rounds, (conns, secs))?;
        return r.write(&workspace_root().join("target/bench/semantic"));
    }
    if std::env::var("BENCH_ONLY").as_deref() == Ok("fleet") {
        let mut r = Report::default();
        fleet_rows(&mut r, rounds, (conns, secs), &prompt("benchmark prompt"))?;
        return r.write(&workspace_root().join("target/bench/fleet"));
    }
    let wasm_bytes = std::fs::metadata(wasm_path())?.len();
    let mock = Running::start(None, 0)?;
    let hit_prompt = prompt("benchmark prompt");
    // The direct_response baseline and the local-reply floor serve exactly the body a HIT serves.
    let hit_body = request(mock.addr, "POST", PATH, &[], hit_prompt.as_bytes())?.body;
    let floors = workspace_root().join("target/floors/wasm32-wasip1/release");
    let mut opts = Options::new("{}", mock.addr);
    opts.direct_body = hit_body.clone();
    opts.edge_access_log = Some(std::env::temp_dir().join(format!("holysheep-bench-{}.log", std::process::id())));
    let held_log = std::env::temp_dir().join(format!("holysheep-bench-held-{}.log", std::process::id()));
    opts.extra_listeners =
        floor_listener("floor_reply", &floors.join("floor_reply.wasm"), &String::from_utf8_lossy(&hit_body))
            + &floor_listener(
                "floor_hit_calls",
                &floors.join("floor_reply.wasm"),
                &format!("hit-calls:{}", String::from_utf8_lossy(&hit_body)),
            )
            + &logged_floor(
                floor_listener(
                    "floor_held",
                    &floors.join("floor_reply.wasm"),
                    &format!("held:{crowd}:{}", String::from_utf8_lossy(&hit_body)),
                ),
                &held_log,
            )
            + &floor_listener("floor_callout", &floors.join("floor_callout.wasm"), "{}")
            + &floor_listener("floor_miss_calls", &floors.join("floor_callout.wasm"), "miss-calls")
            + &floor_listener("floor_miss_work", &floors.join("floor_callout.wasm"), "miss-work");
    let envoy = Envoy::start(&opts)?;
    let floor_reply = envoy.listener("floor_reply").expect("floor_reply listener");
    let floor_callout = envoy.listener("floor_callout").expect("floor_callout listener");
    let warm = request(envoy.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    assert_eq!(warm.body, hit_body, "the edge serves the mock's answer");
    let floor = request(floor_reply, "POST", PATH, &[], hit_prompt.as_bytes())?;
    assert_eq!(floor.body, hit_body, "the local-reply floor serves the same body");
    let floor_hit_calls = envoy.listener("floor_hit_calls").expect("floor_hit_calls listener");
    let hit = request(envoy.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    let like = request(floor_hit_calls, "POST", PATH, &[], hit_prompt.as_bytes())?;
    let names = |r: &host_test::client::Resp| {
        let mut n: Vec<String> = r.headers.iter().map(|(n, v)| format!("{n}:{}", v.len())).collect();
        n.sort();
        n
    };
    assert_eq!(names(&like), names(&hit), "the floor with the HIT's host calls sends the HIT's headers");
    let floor_miss_calls = envoy.listener("floor_miss_calls").expect("floor_miss_calls listener");
    let miss_prompt = prompt("bench: the MISS's headers");
    let miss = request(envoy.edge, "POST", PATH, &[("authorization", "Bearer bench")], miss_prompt.as_bytes())?;
    // Its queue is registered on its first tick (20 ms), as the plugin's is; until then it
    // answers as the plain callout floor.
    let deadline = Instant::now() + Duration::from_secs(10);
    let like = loop {
        let like = request(floor_miss_calls, "POST", PATH, &[], miss_prompt.as_bytes())?;
        if like.header("x-holysheep-cache").is_some() || Instant::now() > deadline {
            break like;
        }
    };
    assert_eq!((miss.cache(), like.body == miss.body), ("MISS", true), "the floor with the MISS's calls answers alike");
    assert_eq!(names(&like), names(&miss), "the floor with the MISS's host calls sends the MISS's headers");

    if std::env::var("BENCH_ONLY").as_deref() == Ok("crowd") {
        let mut r = Report::default();
        crowd_rows(&mut r, &envoy, &mock, (log_of(&opts), &held_log), (crowd, &hit_prompt));
        return r.write(&workspace_root().join("target/bench/crowd"));
    }
    // The component host runs beside Envoy (idle while the other is measured), so that its
    // HIT alternates with the plugin's in the same rounds.
    let component = start_component(ComponentOptions {
        wasm: component_path(),
        listen: ([127, 0, 0, 1], 0).into(),
        upstream: mock.addr,
        env: vec![("HOLYSHEEP_CONFIG".to_owned(), "{}".to_owned())],
    })?;
    request(component.addr, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;

    let mut r = Report::default();
    println!(
        "holysheep-edge bench: Envoy 1.40 --concurrency 2, {conns} keep-alive connections, {secs}s per row; \
         floors and the plugin alternate, median of {rounds} rounds"
    );
    println!("{:<34} {:>9} {:>11} {:>10} {:>10}", "scenario", "requests", "req/s", "p50 us", "p99 us");
    let pid = (env_or("BENCH_PROFILE", 0) == 1).then(|| envoy.pid());
    let repeat = |addr: SocketAddr| {
        let same = hit_prompt.clone();
        profiled(pid, move || load(addr, conns, secs, Arc::new(move || same.clone())))
    };
    let direct = r.row("direct_response (baseline)", repeat(envoy.direct));
    let hit_rounds = alternate(
        rounds,
        &mut [
            &mut || repeat(floor_reply),
            &mut || repeat(floor_hit_calls),
            &mut || expect_all(repeat(envoy.edge), "HIT"),
            // Not under perf (BENCH_PROFILE attaches to Envoy only).
            &mut || {
                let same = hit_prompt.clone();
                expect_all(load(component.addr, conns, secs, Arc::new(move || same.clone())), "HIT")
            },
        ],
    );
    let [floor_hit_r, calls_r, hit_r, component_r] = &hit_rounds[..] else { unreachable!("four rows") };
    let hit_over_floor = paired(hit_r, floor_hit_r, throughput);
    let p99_added = paired(hit_r, floor_hit_r, |a, b| (a.p99_us as f64 - b.p99_us as f64) / 1000.0);
    let hit_over_calls = paired(hit_r, calls_r, throughput);
    let calls_over_floor = paired(calls_r, floor_hit_r, throughput);
    let component_over_hit = paired(component_r, hit_r, throughput);
    let mut medians = hit_rounds.into_iter().map(median);
    let floor_hit = r.row("floor: wasm local reply", medians.next().expect("a row"));
    let hit_calls = r.row("floor + the HIT's host calls", medians.next().expect("a row"));
    let hit = r.row("edge HIT", medians.next().expect("a row"));
    let component_stats = medians.next().expect("a row");
    let distinct = |addr: SocketAddr, prompts: &Arc<dyn Fn() -> String + Send + Sync>| {
        let prompts = prompts.clone();
        profiled(pid, move || load(addr, conns, secs, prompts))
    };
    let plain = r.row("plain proxy to mock (baseline)", distinct(envoy.plain, &unique_prompts("plain")));
    // One prompt sequence each for all rounds: a later round must not repeat a prompt.
    let (floor_prompts, miss_prompts) = (unique_prompts("floor"), unique_prompts("miss"));
    let (calls_prompts, work_prompts) = (unique_prompts("floor calls"), unique_prompts("floor work"));
    let floor_miss_work = envoy.listener("floor_miss_work").expect("floor_miss_work listener");
    let miss_rounds = alternate(
        rounds,
        &mut [
            &mut || distinct(floor_callout, &floor_prompts),
            &mut || distinct(floor_miss_calls, &calls_prompts),
            &mut || distinct(floor_miss_work, &work_prompts),
            &mut || expect_all(distinct(envoy.edge, &miss_prompts), "MISS"),
        ],
    );
    let [callout_r, miss_calls_r, miss_work_r, miss_r] = &miss_rounds[..] else { unreachable!("four rows") };
    let miss_over_floor = paired(miss_r, callout_r, throughput);
    let miss_over_calls = paired(miss_r, miss_calls_r, throughput);
    let miss_calls_over_floor = paired(miss_calls_r, callout_r, throughput);
    let miss_over_work = paired(miss_r, miss_work_r, throughput);
    let work_over_calls = paired(miss_work_r, miss_calls_r, throughput);
    let mut medians = miss_rounds.into_iter().map(median);
    r.row("floor: wasm callout", medians.next().expect("a row"));
    let miss_calls = r.row("floor + the MISS's host calls", medians.next().expect("a row"));
    let miss_work = r.row("floor + the MISS's calls, parse and hash", medians.next().expect("a row"));
    let miss = r.row("edge MISS (distinct prompts)", medians.next().expect("a row"));

    // The floors' ratios pair each round with the other rows' same round (see `paired`).
    println!();
    r.ratio("HIT throughput / local-reply floor", hit_over_floor, "goal >= 0.90");
    r.ratio("HIT p99 added over the floor (ms)", p99_added, "goal <= 0.20");
    r.ratio("HIT throughput / floor with the HIT's host calls", hit_over_calls, "");
    r.ratio("floor with the HIT's host calls / local-reply floor", calls_over_floor, "");
    r.ratio("HIT throughput / direct_response", r.rps(hit) / r.rps(direct), "");
    r.ratio("local-reply floor / direct_response", r.rps(floor_hit) / r.rps(direct), "the ABI's cost");
    r.ratio("MISS throughput / callout floor", miss_over_floor, "goal >= 0.90");
    r.ratio("MISS throughput / floor with the MISS's host calls", miss_over_calls, "");
    r.ratio("floor with the MISS's host calls / callout floor", miss_calls_over_floor, "");
    r.ratio("MISS throughput / floor with the MISS's calls, parse and hash", miss_over_work, "");
    r.ratio("floor with the calls, parse and hash / floor with the calls", work_over_calls, "");
    r.ratio("MISS throughput / plain proxy", r.rps(miss) / r.rps(plain), "");
    for (a, b) in [(hit, hit_calls), (miss, miss_calls), (miss_work, miss_calls), (miss, miss_work)] {
        r.compare_functions(a, b);
    }
    crowd_rows(&mut r, &envoy, &mock, (log_of(&opts), &held_log), (crowd, &hit_prompt));
    r.note(format!("plugin size: {wasm_bytes} bytes (goal <= 524288)"));

    mock.mock.set_event_delay_ms(5);
    let (edge_first, edge_whole) = first_event(envoy.edge, "stream miss", 40);
    let (plain_first, plain_whole) = first_event(envoy.plain, "stream plain", 40);
    mock.mock.set_event_delay_ms(0);
    r.note(format!(
        "streamed MISS, first event (p50): edge {edge_first} us, plain proxy {plain_first} us, ratio {:.2}",
        edge_first as f64 / plain_first.max(1) as f64
    ));
    r.note(format!(
        "streamed MISS, whole stream (p50): edge {edge_whole} us, plain proxy {plain_whole} us (5 ms between events)"
    ));

    tenant_rows(&mut r, &mock, rounds, (conns, secs), &hit_prompt)?;

    // HIT publishing the access-log values (`log_fields: true`) against HIT without,
    // alternating in the same run.
    let logging = Envoy::start(&Options::new(r#"{"log_fields":true}"#, mock.addr))?;
    request(logging.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    println!();
    let log_rounds = alternate(
        rounds,
        &mut [&mut || expect_all(repeat(envoy.edge), "HIT"), &mut || expect_all(repeat(logging.edge), "HIT")],
    );
    let [quiet_r, logged_r] = &log_rounds[..] else { unreachable!("two rows") };
    let logged_over_quiet = paired(logged_r, quiet_r, throughput);
    let mut medians = log_rounds.into_iter().map(median);
    r.row("edge HIT, no log fields (paired)", medians.next().expect("a row"));
    r.row("edge HIT, log_fields: true", medians.next().expect("a row"));
    r.ratio("HIT with log fields / HIT without", logged_over_quiet, "");
    drop(logging);

    budget_rows(&mut r, &mock, rounds, (conns, secs), &hit_prompt)?;
    endpoint_rows(&mut r, &mock, rounds, (conns, secs))?;
    backlog_rows(&mut r)?;

    drop(envoy);
    semantic_rows(&mut r, rounds, (conns, secs))?;
    fleet_rows(&mut r, rounds, (conns, secs), &hit_prompt)?;

    println!();
    r.row("component HIT (wasmtime host)", component_stats);
    r.ratio("component HIT / Envoy plugin HIT", component_over_hit, "goal >= 0.80");
    let probe = prompt("component follower delay probe");
    let f = follower_delay(component.addr, &mock, (200, &probe), |started| Some(component.answered_since(started)));
    let host = f.server.as_ref().map_or_else(|| "not recorded".to_owned(), Delays::line);
    r.note(format!(
        "component: 200 identical requests (300 ms upstream): {} upstream call(s), {} followers; answered after the leader by the host's clock: {host} (goal p99 <= 50 ms); as the clients saw it: {}",
        f.calls, f.client.followers, f.client.line()
    ));
    if let Some(host) = f.server {
        r.series.push(("component followers".into(), host.sorted_us));
    }
    r.note(format!("component size: {} bytes", std::fs::metadata(component_path())?.len()));
    let dir = workspace_root().join("target/bench");
    r.write(&dir)?;
    println!("\nwritten: {}/results.md, results.json", dir.display());
    Ok(())
}

/// The same prompt again and again, from `conns` connections for `secs`.
fn repeat_at(addr: SocketAddr, conns: usize, secs: u64, prompt: &str) -> Stats {
    let same = prompt.to_owned();
    load(addr, conns, secs, Arc::new(move || same.clone()))
}

/// A HIT with 100 and with 1,000 tenants configured (the key's digest looked up on every
/// request, the tenant's counters counted) against a HIT without tenants, alternating in
/// one run. The load's `Bearer bench` is the first tenant's key.
fn tenant_rows(
    r: &mut Report,
    mock: &Running,
    rounds: usize,
    load: (usize, u64),
    hit_prompt: &str,
) -> std::io::Result<()> {
    let (conns, secs) = load;
    let with = |n: usize| {
        let tenants: Vec<String> = (0..n)
            .map(|i| {
                let token = if i == 0 { "bench".to_owned() } else { format!("bench-tenant-{i}") };
                format!(r#""t{i}":{{"keys_sha256":["{}"]}}"#, sha256_hex(token.as_bytes()))
            })
            .collect();
        Envoy::start(&Options::new(&format!(r#"{{"tenants":{{{}}}}}"#, tenants.join(",")), mock.addr))
    };
    let (none, hundred, thousand) = (Envoy::start(&Options::new("{}", mock.addr))?, with(100)?, with(1000)?);
    for e in [&none, &hundred, &thousand] {
        request(e.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    }
    println!();
    let hit = |addr: SocketAddr| expect_all(repeat_at(addr, conns, secs, hit_prompt), "HIT");
    let rows = alternate(rounds, &mut [&mut || hit(none.edge), &mut || hit(hundred.edge), &mut || hit(thousand.edge)]);
    let [none_r, hundred_r, thousand_r] = &rows[..] else { unreachable!("three rows") };
    let (hundred_ratio, thousand_ratio) =
        (paired(hundred_r, none_r, throughput), paired(thousand_r, none_r, throughput));
    let mut medians = rows.into_iter().map(median);
    r.row("edge HIT, no tenants (paired)", medians.next().expect("a row"));
    r.row("edge HIT, 100 tenants", medians.next().expect("a row"));
    r.row("edge HIT, 1,000 tenants", medians.next().expect("a row"));
    r.ratio("HIT with 100 tenants / HIT without", hundred_ratio, "");
    r.ratio("HIT with 1,000 tenants / HIT without", thousand_ratio, "goal >= 0.95");
    Ok(())
}

/// What a budget kept in etcd costs, alternating in one run: the load's tenant (`Bearer
/// bench`) without a budget on one Envoy, and with a dollar budget whose spend the spend
/// store (a real etcd) keeps on another. A HIT never touches the budget nor the store; a
/// MISS reserves and settles in shared data, and its spend is written behind once a round.
fn budget_rows(
    r: &mut Report,
    mock: &Running,
    rounds: usize,
    (conns, secs): (usize, u64),
    hit_prompt: &str,
) -> std::io::Result<()> {
    let etcd = host_test::etcd::Etcd::start()?;
    let tenant = |budget: &str, store: &str| {
        format!(
            r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}},{store}
                "tenants":{{"t":{{"keys_sha256":["{}"]{budget}}}}}}}"#,
            sha256_hex(b"bench")
        )
    };
    let budget = r#","usd_per_day":1000000"#;
    let plain = Envoy::start(&Options::new(&tenant("", ""), mock.addr))?;
    let in_memory = Envoy::start(&Options::new(&tenant(budget, ""), mock.addr))?;
    let mut opts = Options::new(&tenant(budget, r#""budget_store":{"cluster":"etcd"},"#), mock.addr);
    opts.extra_clusters = etcd.cluster();
    let budgeted = Envoy::start(&opts)?;
    for e in [&plain, &in_memory, &budgeted] {
        request(e.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    }
    println!();
    let hits = alternate(
        rounds,
        &mut [&mut || expect_all(repeat_at(plain.edge, conns, secs, hit_prompt), "HIT"), &mut || {
            expect_all(repeat_at(budgeted.edge, conns, secs, hit_prompt), "HIT")
        }],
    );
    let [plain_hit, budget_hit] = &hits[..] else { unreachable!("two rows") };
    let hit_ratio = paired(budget_hit, plain_hit, throughput);
    let (plain_prompts, memory_prompts) = (unique_prompts("unbudgeted"), unique_prompts("in memory"));
    let budget_prompts = unique_prompts("budgeted");
    let misses = alternate(
        rounds,
        &mut [
            &mut || expect_all(load(plain.edge, conns, secs, plain_prompts.clone()), "MISS"),
            &mut || expect_all(load(in_memory.edge, conns, secs, memory_prompts.clone()), "MISS"),
            &mut || expect_all(load(budgeted.edge, conns, secs, budget_prompts.clone()), "MISS"),
        ],
    );
    let [plain_miss, memory_miss, budget_miss] = &misses[..] else { unreachable!("three rows") };
    let miss_ratio = paired(budget_miss, plain_miss, throughput);
    let memory_ratio = paired(memory_miss, plain_miss, throughput);
    let store_ratio = paired(budget_miss, memory_miss, throughput);
    let mut medians = hits.into_iter().map(median);
    r.row("edge HIT, tenant without a budget", medians.next().expect("a row"));
    r.row("edge HIT, budgeted tenant, spend in etcd", medians.next().expect("a row"));
    let mut medians = misses.into_iter().map(median);
    r.row("edge MISS, tenant without a budget", medians.next().expect("a row"));
    r.row("edge MISS, budgeted tenant, spend per process", medians.next().expect("a row"));
    r.row("edge MISS, budgeted tenant, spend in etcd", medians.next().expect("a row"));
    r.ratio("budgeted HIT (spend store) / unbudgeted HIT", hit_ratio, "no store call on a HIT");
    r.ratio("budgeted MISS (spend store) / unbudgeted MISS", miss_ratio, "goal >= 0.95");
    r.ratio("budgeted MISS (per process) / unbudgeted MISS", memory_ratio, "the budget's own cost");
    r.ratio("budgeted MISS (spend store) / budgeted MISS (per process)", store_ratio, "the store's cost");
    let stored = etcd.get("holysheep/budget/t").unwrap_or_default();
    r.note(format!("spend store after the budgeted rows: {stored}"));
    Ok(())
}

/// Embeddings beside chat, alternating in one run on one Envoy: a HIT of each (the same
/// request again), then a MISS of each (distinct requests, the mock answering at once).
fn endpoint_rows(r: &mut Report, mock: &Running, rounds: usize, (conns, secs): (usize, u64)) -> std::io::Result<()> {
    const EMBEDDINGS: &str = "/v1/embeddings";
    let envoy = Envoy::start(&Options::new("{}", mock.addr))?;
    let embedding = |text: String| format!(r#"{{"model":"text-embedding-3-small","input":"{text}"}}"#);
    let (chat_hit, embedding_hit) = (prompt("bench: a chat HIT"), embedding("bench: an embeddings HIT".into()));
    request(envoy.edge, "POST", PATH, &[("authorization", "Bearer bench")], chat_hit.as_bytes())?;
    request(envoy.edge, "POST", EMBEDDINGS, &[("authorization", "Bearer bench")], embedding_hit.as_bytes())?;
    let same = |body: &str| -> Arc<dyn Fn() -> String + Send + Sync> {
        let body = body.to_owned();
        Arc::new(move || body.clone())
    };
    let n = Arc::new(AtomicU64::new(0));
    let distinct: Arc<dyn Fn() -> String + Send + Sync> =
        Arc::new(move || embedding(format!("bench embeddings miss {}", n.fetch_add(1, Ordering::Relaxed))));
    let chat_misses = unique_prompts("endpoint rows");
    println!();
    let rows = alternate(
        rounds,
        &mut [
            &mut || expect_all(load(envoy.edge, conns, secs, same(&chat_hit)), "HIT"),
            &mut || expect_all(load_on(envoy.edge, EMBEDDINGS, conns, secs, same(&embedding_hit)), "HIT"),
            &mut || expect_all(load(envoy.edge, conns, secs, chat_misses.clone()), "MISS"),
            &mut || expect_all(load_on(envoy.edge, EMBEDDINGS, conns, secs, distinct.clone()), "MISS"),
        ],
    );
    let [chat_h, emb_h, chat_m, emb_m] = &rows[..] else { unreachable!("four rows") };
    let (hit_ratio, miss_ratio) = (paired(emb_h, chat_h, throughput), paired(emb_m, chat_m, throughput));
    let mut medians = rows.into_iter().map(median);
    r.row("edge HIT, chat completions (paired)", medians.next().expect("a row"));
    r.row("edge HIT, embeddings", medians.next().expect("a row"));
    r.row("edge MISS, chat completions (paired)", medians.next().expect("a row"));
    r.row("edge MISS, embeddings", medians.next().expect("a row"));
    r.ratio("embeddings HIT / chat HIT", hit_ratio, "one intake for every endpoint");
    r.ratio("embeddings MISS / chat MISS", miss_ratio, "the mock's embedding is larger than its chat answer");
    Ok(())
}

/// A fleet node's HIT three ways, alternating in one run: on the owner listener, through
/// the forward listener from its near copy, and through the forward listener of a node
/// without near copies (one hop to the owner listener).
fn fleet_rows(r: &mut Report, rounds: usize, (conns, secs): (usize, u64), hit_prompt: &str) -> std::io::Result<()> {
    let near = Fleet::start(1, "{}", 0);
    let hop = Fleet::start(1, r#"{"edge":{"max_age_seconds":0}}"#, 0);
    let (near, hop) = (near.live().next().expect("a node"), hop.live().next().expect("a node"));
    for public in [near.public, hop.public] {
        request(public, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    }
    let hit = |addr: SocketAddr| {
        let same = hit_prompt.to_owned();
        load(addr, conns, secs, Arc::new(move || same.clone()))
    };
    // Without near copies, the forward node's concurrent repeats share one hop: the owner's
    // HIT reaches one of them and the others are COALESCED there.
    let hop_hit = || {
        let s = hit(hop.public);
        assert!(s.labels.iter().all(|l| l == "HIT" || l == "COALESCED"), "every answer was the owner's HIT");
        s
    };
    println!();
    let rows = alternate(
        rounds,
        &mut [&mut || expect_all(hit(near.owner), "HIT"), &mut || expect_all(hit(near.public), "HIT"), &mut || {
            hop_hit()
        }],
    );
    let [owner_r, near_r, hop_r] = &rows[..] else { unreachable!("three rows") };
    let (near_over_owner, hop_over_owner) = (paired(near_r, owner_r, throughput), paired(hop_r, owner_r, throughput));
    let mut medians = rows.into_iter().map(median);
    let owner_hit = r.row("fleet HIT on the owner listener", medians.next().expect("a row"));
    let near_hit = r.row("fleet HIT from a near copy (forward listener)", medians.next().expect("a row"));
    let hop_hit = r.row("fleet HIT through a forward hop", medians.next().expect("a row"));
    r.ratio("near-copy HIT / owner HIT throughput", near_over_owner, "goal >= 0.90");
    r.ratio("forward hop HIT / owner HIT throughput", hop_over_owner, "");
    let p50 = |row: usize| r.rows[row].1.p50_us as f64;
    let (near_p50, hop_p50) = (p50(near_hit) / p50(owner_hit).max(1.0), p50(hop_hit) / p50(owner_hit).max(1.0));
    r.ratio("near-copy HIT / owner HIT p50", near_p50, "");
    r.ratio("forward hop HIT / owner HIT p50", hop_p50, "");
    Ok(())
}

/// A chat body asking `question` under `system`, at temperature 0.
fn asked(system: &str, question: &str) -> String {
    serde_json::json!({"model": "gpt-4.1", "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    .to_string()
}

/// A new question at each call, sharing no word with any other (the mock's embedding puts
/// each word on one of its dimensions: questions that share a word or two can collide).
fn unrelated_questions() -> Arc<dyn Fn() -> String + Send + Sync> {
    let n = Arc::new(AtomicU64::new(0));
    Arc::new(move || {
        let i = n.fetch_add(1, Ordering::Relaxed);
        prompt(&format!("q{i}a q{i}b q{i}c q{i}d q{i}e q{i}f"))
    })
}

/// A new paraphrase of "what is the capital of france" at each call: the same words (the
/// mock's embedding ignores case), capitalised after the bits of a counter.
fn paraphrases(system: &'static str) -> Arc<dyn Fn() -> String + Send + Sync> {
    let n = Arc::new(AtomicU64::new(1));
    Arc::new(move || {
        let bits = n.fetch_add(1, Ordering::Relaxed);
        let mut letter = 0;
        let text: String = "what is the capital of france"
            .chars()
            .map(|c| {
                if !c.is_alphabetic() {
                    return c;
                }
                letter += 1;
                if bits >> (letter - 1) & 1 == 1 {
                    c.to_ascii_uppercase()
                } else {
                    c
                }
            })
            .collect();
        asked(system, &text)
    })
}

/// The semantic tier, alternating in one run with an Envoy without it (same mock, the
/// embedding model's own 1536 dimensions): MISS with the tier vs exact MISS, SEMANTIC vs
/// exact HIT, and SEMANTIC in a partition of one question vs in one of a full page.
fn semantic_rows(r: &mut Report, rounds: usize, (conns, secs): (usize, u64)) -> std::io::Result<()> {
    let mock = Running::start(None, 0)?;
    // Room for every MISS of the rows: no answer a HIT or SEMANTIC row needs is evicted.
    let cache = r#""cache":{"max_entries":400000}"#;
    let plain = Envoy::start(&Options::new(&format!("{{{cache}}}"), mock.addr))?;
    // An embedding slower than the default bound on two busy cores would make a MISS.
    let semantic = r#""semantic":{"enabled":true,"timeout_ms":5000}"#;
    let mut opts = Options::new(&format!("{{{cache},{semantic}}}"), mock.addr);
    opts.api_key = Some("sk-bench-semantic".into());
    let tier = Envoy::start(&opts)?;
    let (one, full) = ("One question here.", "A full page here.");
    let question = "What is the capital of France?";
    // The questions the HIT and SEMANTIC rows are answered from, asked before each round;
    // a paraphrase then checks that the partition still finds them (a page shared with
    // the MISS row's partition would have let them go: the bench stops and says so).
    let warm = |e: &Envoy, system: &str, n: usize| -> std::io::Result<()> {
        for i in 0..n {
            let other = if i == 0 { question.to_owned() } else { format!("Question number {i} about something else?") };
            request(e.edge, "POST", PATH, &[("authorization", "Bearer bench")], asked(system, &other).as_bytes())?;
        }
        Ok(())
    };
    let found = |e: &Envoy, system: &str| {
        let check = asked(system, "WHAT is the capital of France");
        let r = request(e.edge, "POST", PATH, &[("authorization", "Bearer bench")], check.as_bytes()).expect("answer");
        assert_eq!(r.cache(), "SEMANTIC", "the partition of '{system}' lost its question");
    };
    // One sequence of paraphrases per partition for all rounds: each request a new one.
    let (one_paraphrases, full_paraphrases) = (paraphrases(one), paraphrases(full));
    let run = |addr: SocketAddr, body: Arc<dyn Fn() -> String + Send + Sync>, label: &'static str| {
        expect_all(load(addr, conns, secs, body), label)
    };
    // One sequence of new questions for all rounds: a later round's are new too.
    let (exact_misses, tier_misses) = (unique_prompts("exact miss"), unrelated_questions());
    println!();
    let rows = alternate(
        rounds,
        &mut [
            &mut || run(plain.edge, exact_misses.clone(), "MISS"),
            &mut || run(tier.edge, tier_misses.clone(), "MISS"),
            &mut || {
                warm(&plain, one, 1).expect("warm");
                let same = asked(one, question);
                run(plain.edge, Arc::new(move || same.clone()), "HIT")
            },
            &mut || {
                warm(&tier, one, 1).expect("warm");
                found(&tier, one);
                run(tier.edge, one_paraphrases.clone(), "SEMANTIC")
            },
            &mut || {
                warm(&tier, full, SEMANTIC_PAGE).expect("warm");
                found(&tier, full);
                run(tier.edge, full_paraphrases.clone(), "SEMANTIC")
            },
        ],
    );
    let [exact_miss, tier_miss, hit, semantic, semantic_full] = &rows[..] else { unreachable!("five rows") };
    let ratios = [
        ("MISS with the semantic tier / exact MISS throughput", paired(tier_miss, exact_miss, throughput)),
        ("SEMANTIC / exact HIT throughput", paired(semantic, hit, throughput)),
        ("SEMANTIC, full page / one question throughput", paired(semantic_full, semantic, throughput)),
    ];
    let mut medians = rows.into_iter().map(median);
    for name in [
        "exact MISS (tier off)",
        "MISS with the semantic tier",
        "exact HIT (tier off)",
        "SEMANTIC, partition of one question",
        "SEMANTIC, partition of 64 questions",
    ] {
        r.row(name, medians.next().expect("a row"));
    }
    for (what, value) in ratios {
        r.ratio(what, value, "");
    }
    r.note(format!("semantic tier: mock embeddings answered {}", mock.mock.embeddings()));
    Ok(())
}

/// Questions a full page of the semantic index holds (`semantic::WAYS`).
const SEMANTIC_PAGE: usize = 64;

/// The edge's access log (the bench's options always set one).
fn log_of(opts: &Options) -> &Path {
    opts.edge_access_log.as_deref().expect("the edge's access log")
}

/// How long after their leader a crowd of `crowd` identical requests is answered, alternating
/// with the followers' floor (`floor_held`), by Envoy's access logs (`log`, `held_log`).
fn crowd_rows(
    r: &mut Report,
    envoy: &Envoy,
    mock: &Running,
    (log, held_log): (&Path, &Path),
    (crowd, hit_prompt): (usize, &str),
) {
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

/// A critical request's wait behind a backlog of sheddable ones, against the first-come
/// line (every request standard), in the same run.
fn backlog_rows(r: &mut Report) -> std::io::Result<()> {
    println!();
    let backlog = env_or("BENCH_BACKLOG", 1000) as usize;
    for (name, classes) in [("priority classes", true), ("one first-come line", false)] {
        let waits = backlog_waits(backlog, classes)?;
        let (p50, p99) = (percentile(&waits, 0.50), percentile(&waits, 0.99));
        r.note(format!(
            "{name}: {} urgent requests behind {backlog} queued ones (max_in_flight 8, 10 ms upstream), \
             answered after capacity returned: p50 {} ms, p99 {} ms",
            waits.len(),
            p50 / 1000,
            p99 / 1000
        ));
        r.series.push((format!("critical waits, {name}"), waits));
    }
    Ok(())
}

/// Queues `backlog` requests of a sheddable tenant behind 8 held calls (`max_in_flight: 8`),
/// then 20 of a critical tenant (`classes: false`: 20 more of the backlog's tenant, every
/// request standard: one first-come line, plain arrival order); releases the held calls and returns, sorted, how long after the release
/// each critical request was answered (µs).
fn backlog_waits(backlog: usize, classes: bool) -> std::io::Result<Vec<u64>> {
    const SLOTS: usize = 8;
    const CRITICAL: usize = 20;
    let mock = Running::start(None, 10)?;
    let (low, high) = if classes { ("sheddable", "critical") } else { ("standard", "standard") };
    let config = format!(
        r#"{{"models":{{"gpt-4.1":{{"max_in_flight":{SLOTS}}}}},"upstream":{{"timeout_ms":120000}},
            "rate_limit":{{"max_wait_ms":120000,"reserve":0,"max_queue":4096}},
            "tenants":{{"batch":{{"keys_sha256":["{}"],"priority":"{low}"}},
                        "search":{{"keys_sha256":["{}"],"priority":"{high}"}}}}}}"#,
        sha256_hex(b"bench-batch"),
        sha256_hex(b"bench-search")
    );
    let envoy = Envoy::start(&Options::new(&config, mock.addr))?;
    let held = host_test::mock::Fault { hold: true, ..Default::default() };
    mock.mock.plan(vec![held; SLOTS]);
    let queued = |class: &str| envoy.stat(&format!("wasmcustom.holysheep.priority.{class}.queued"));
    let send = |tenant: &'static str, text: String| {
        let edge = envoy.edge;
        std::thread::Builder::new().stack_size(64 * 1024).spawn(move || {
            let auth = format!("Bearer bench-{tenant}");
            let r = request(edge, "POST", PATH, &[("authorization", &auth)], prompt(&text).as_bytes());
            let at = Instant::now();
            match r {
                Ok(r) if r.status == 200 => (200, at),
                Ok(r) => panic!("{tenant}: {} {}", r.status, r.text()),
                Err(e) => panic!("{tenant}: {e}"),
            }
        })
    };
    let batch: Vec<_> = (0..backlog).map(|i| send("batch", format!("backlog {i}"))).collect::<Result<_, _>>()?;
    let until = |done: &dyn Fn() -> bool| {
        while !done() {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    until(&|| mock.mock.calls() >= SLOTS as u64 && queued(low) >= (backlog - SLOTS) as u64);
    // Without classes the urgent requests come from the backlog's own tenant: one line in
    // arrival order, in plain arrival order.
    let urgent = if classes { "search" } else { "batch" };
    let critical: Vec<_> = (0..CRITICAL).map(|i| send(urgent, format!("urgent {i}"))).collect::<Result<_, _>>()?;
    until(&|| queued(high) >= (CRITICAL + if classes { 0 } else { backlog - SLOTS }) as u64);
    let released = Instant::now();
    for _ in 0..SLOTS {
        mock.mock.release();
    }
    let mut waits = Vec::new();
    for h in critical {
        let (status, at) = h.join().map_err(|_| std::io::Error::other("a client thread panicked"))?;
        assert_eq!(status, 200, "a critical request was answered");
        waits.push(at.duration_since(released).as_micros() as u64);
    }
    for h in batch {
        let (status, _) = h.join().map_err(|_| std::io::Error::other("a client thread panicked"))?;
        assert_eq!(status, 200, "a backlog request was answered");
    }
    waits.sort_unstable();
    Ok(waits)
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}
