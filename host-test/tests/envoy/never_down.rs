//! Load the VM (and the native module) in real Envoy must survive: clients that leave
//! mid-flight against a fast upstream, and a crowd of identical requests. Each runs a few seconds at
//! most and fails on any sign of a crashed VM in Envoy's log.

use host_test::client::{Conn, Resp};
use host_test::envoy::Shell;
use host_test::stack::{count, prompt, Stack, PATH};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Long enough for any answer from a live VM; a dead VM's paused requests never answer.
const PATIENCE: Duration = Duration::from_secs(20);

/// How a load client ends one request.
fn leave_or_read(conn: &mut Conn, n: u64) -> Option<u16> {
    match n % 4 {
        // Leave at once: the reset can reach Envoy in the turn that brings the answer.
        0 => None,
        1 => {
            std::thread::sleep(Duration::from_micros(200 * (n % 7)));
            None
        }
        _ => Some(conn.read_response().map_or(0, |r| r.status)),
    }
}

#[test]
fn distinct_prompts_with_clients_leaving_mid_flight_never_crash_the_vm() {
    clients_leaving_mid_flight(Shell::Wasm);
}

#[test]
fn distinct_prompts_with_clients_leaving_mid_flight_never_crash_the_native_module() {
    clients_leaving_mid_flight(Shell::Native);
}

fn clients_leaving_mid_flight(shell: Shell) {
    let tune = |o: &mut host_test::envoy::Options| (o.concurrency, o.shell) = (1, shell);
    let s = Stack::start_tuned(r#"{"cache":{"scope":"global"}}"#, 0, tune, None);
    let (stop, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let (edge, stop, sent) = (s.envoy.edge, stop.clone(), sent.clone());
            std::thread::spawn(move || {
                let mut bad = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let n = sent.fetch_add(1, Ordering::Relaxed);
                    let Ok(mut conn) = Conn::open(edge).and_then(|c| c.read_timeout(PATIENCE)) else { continue };
                    let body = prompt(&format!("distinct {n}"));
                    if conn.send_only("POST", PATH, &[("authorization", "Bearer t")], body.as_bytes()).is_err() {
                        continue;
                    }
                    if let Some(status) = leave_or_read(&mut conn, n).filter(|s| *s != 200) {
                        bad.push(status);
                    }
                }
                bad
            })
        })
        .collect();
    // Bounded load: a few seconds of requests, not a threshold on anything.
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until && s.crashes().is_empty() {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let bad: Vec<u16> = clients.into_iter().flat_map(|h| h.join().expect("client")).collect();
    assert_eq!(s.crashes(), Vec::<String>::new(), "the VM crashed after {} requests", sent.load(Ordering::Relaxed));
    assert!(bad.is_empty(), "clients that stayed got {bad:?}");
    let after = s.chat(&prompt("after the load"), &[("authorization", "Bearer t")]);
    assert_eq!((after.status, after.cache()), (200, "MISS"), "the VM still serves");
}

/// `HOLYSHEEP_CROWD` overrides the crowd's size (to measure larger ones by hand).
fn crowd_size() -> usize {
    std::env::var("HOLYSHEEP_CROWD").ok().and_then(|n| n.parse().ok()).unwrap_or(2_000)
}

/// `bodies.len()` clients, connected first, then all sending at once; each gets its
/// answer or the error that ended it.
fn crowd(addr: SocketAddr, bodies: Vec<String>) -> Vec<Result<Resp, String>> {
    let barrier = Arc::new(Barrier::new(bodies.len()));
    let clients: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let conn = Conn::open(addr).and_then(|c| c.read_timeout(PATIENCE));
                barrier.wait();
                conn.and_then(|mut c| c.request("POST", PATH, &[("authorization", "Bearer t")], body.as_bytes()))
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    clients.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("client thread panicked".into()))).collect()
}

#[test]
fn a_crowd_of_identical_requests_over_two_workers_makes_one_call_and_all_get_200() {
    crowd_of_identical_requests(Shell::Wasm);
}

#[test]
fn a_crowd_of_identical_requests_on_the_native_module_makes_one_call_and_all_get_200() {
    crowd_of_identical_requests(Shell::Native);
}

fn crowd_of_identical_requests(shell: Shell) {
    let n = crowd_size();
    let s = Stack::start_tuned("{}", 1_500, |o| o.shell = shell, None);
    let results = crowd(s.envoy.edge, vec![prompt("the crowd's question"); n]);
    assert_eq!(s.crashes(), Vec::<String>::new(), "a VM crashed under a crowd of {n}");
    let outcomes = results.iter().fold(std::collections::BTreeMap::<String, usize>::new(), |mut m, r| {
        *m.entry(r.as_ref().map_or_else(Clone::clone, |r| r.status.to_string())).or_default() += 1;
        m
    });
    assert_eq!(outcomes, [("200".to_owned(), n)].into(), "a crowd of {n}");
    let resps: Vec<Resp> = results.into_iter().flatten().collect();
    assert_eq!(s.calls(), 1, "one upstream call for a crowd of {n}");
    let labels = ["MISS", "COALESCED", "HIT"].map(|l| (l, count(&resps, l)));
    eprintln!("a crowd of {n}: {labels:?}");
    assert_eq!(count(&resps, "MISS"), 1);
    assert!(resps.iter().all(|r| r.body == resps[0].body), "everyone gets the leader's answer");
}

#[test]
fn a_missing_allow_on_headers_stop_iteration_is_answered_not_a_hang() {
    let s = Stack::start_tuned("{}", 0, |o| o.allow_on_headers_stop_iteration = false, None);
    for _ in 0..2 {
        let mut conn = Conn::open(s.envoy.edge).and_then(|c| c.read_timeout(PATIENCE)).expect("connect");
        let r = conn
            .request("POST", PATH, &[("authorization", "Bearer t")], prompt("never read").as_bytes())
            .expect("an answer, not a hang");
        let v = r.json();
        assert_eq!((r.status, v["error"]["code"].as_str()), (500, Some("edge_misconfigured")), "{}", r.text());
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("allow_on_headers_stop_iteration")));
    }
    let logged = s.envoy.log().lines().filter(|l| l.contains("allow_on_headers_stop_iteration")).count();
    assert!((1..=2).contains(&logged), "logged once per worker that saw it: {logged}");
    assert_eq!(s.calls(), 0, "nothing reached HolySheep");
}

/// The watch for that setting fires on evidence, not on time alone: on a fresh VM (no body
/// seen yet), a client whose first body comes after the watch's window gets its answer.
#[test]
fn a_slow_first_body_on_a_fresh_vm_is_answered_not_called_a_misconfiguration() {
    let s = Stack::start_tuned("{}", 0, |o| o.concurrency = 1, None);
    let body = prompt("a slow first body");
    let head = format!(
        "POST {PATH} HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer t\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut conn = Conn::open(s.envoy.edge).and_then(|c| c.read_timeout(PATIENCE)).expect("connect");
    conn.send_raw_part(head.as_bytes()).expect("headers");
    // What is tested is time passing with no body: the watch's window (1 s) and more than
    // one tick of the VM (at most 500 ms) after it.
    std::thread::sleep(Duration::from_millis(2_000));
    let r = conn.raw(body.as_bytes()).expect("an answer");
    assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    assert!(!s.envoy.log().contains("allow_on_headers_stop_iteration"), "no false alarm in the log");
}
