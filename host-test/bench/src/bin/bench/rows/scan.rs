//! The cache under a scan, in Envoy with the default configuration (4,096 slots): a hot set's
//! HITs after another tenant's scan, and a Zipf(1.1) workload's hit rate and upstream calls
//! with and without that scan before it. Counts, not rates per second: the same every run
//! up to the order in which concurrent requests reach the workers.

use crate::report::Report;
use host_test::client::{request, Conn};
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use host_test::stack::prompt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Connections each workload is spread over.
const CONNS: usize = 8;
/// The Zipf workload: requests per phase over this many distinct prompts.
const ZIPF_REQUESTS: usize = 10_000;
const ZIPF_PROMPTS: usize = 1_000;

/// One Envoy on its own mock (the mock's counters are this Envoy's calls alone).
struct Edge {
    mock: Running,
    envoy: Envoy,
}

impl Edge {
    fn start() -> std::io::Result<Edge> {
        let mock = Running::start(None, 0)?;
        let envoy = Envoy::start(&Options::new("{}", mock.addr))?;
        Ok(Edge { mock, envoy })
    }

    fn calls(&self) -> u64 {
        self.mock.mock.calls()
    }

    /// Every body once, over `CONNS` keep-alive connections; the answers' cache labels.
    fn send(&self, bodies: Vec<String>, auth: &str) -> Vec<String> {
        let (bodies, next) = (Arc::new(bodies), Arc::new(AtomicUsize::new(0)));
        let labels = Arc::new(Mutex::new(Vec::new()));
        let handles: Vec<_> = (0..CONNS)
            .map(|_| {
                let (bodies, next, labels, addr) = (bodies.clone(), next.clone(), labels.clone(), self.envoy.edge);
                let auth = auth.to_owned();
                std::thread::spawn(move || {
                    let mut conn = Conn::open(addr).expect("connect");
                    let mut mine = Vec::new();
                    while let Some(body) = bodies.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let r =
                            conn.request("POST", "/v1/chat/completions", &[("authorization", &auth)], body.as_bytes());
                        let r = r.expect("answer");
                        assert_eq!(r.status, 200, "{}", r.text());
                        mine.push(r.cache().to_owned());
                    }
                    labels.lock().expect("labels").extend(mine);
                })
            })
            .collect();
        for h in handles {
            h.join().expect("sender");
        }
        let labels = labels.lock().expect("labels").clone();
        labels
    }

    /// Another tenant's scan, more than the cache holds, every request of it new: two
    /// embeddings lists of 2,048 inputs and 1,500 one-off prompts.
    fn scan(&self, tag: &str) -> std::io::Result<()> {
        for list in 0..2 {
            let inputs: Vec<String> = (0..2_048).map(|i| format!("{tag}: item {list}-{i}")).collect();
            let body = serde_json::json!({"model": "text-embedding-3-small", "input": inputs, "dimensions": 8});
            let r = request(
                self.envoy.edge,
                "POST",
                "/v1/embeddings",
                &[("authorization", "Bearer beta")],
                body.to_string().as_bytes(),
            )?;
            assert_eq!(r.status, 200, "{}", r.text());
        }
        let once: Vec<String> = (0..1_500).map(|i| prompt(&format!("{tag}: one-off {i}"))).collect();
        let labels = self.send(once, "Bearer beta");
        assert!(labels.iter().all(|l| l == "MISS"), "every one-off prompt of the scan was a MISS");
        Ok(())
    }
}

fn count(labels: &[String], label: &str) -> usize {
    labels.iter().filter(|l| *l == label).count()
}

/// Zipf(1.1) over `ZIPF_PROMPTS` prompts: `ZIPF_REQUESTS` draws from a fixed seed (the same
/// draws for every Envoy).
fn zipf_draws(seed: u64) -> Vec<usize> {
    let weights: Vec<f64> = (1..=ZIPF_PROMPTS).map(|r| 1.0 / (r as f64).powf(1.1)).collect();
    let total: f64 = weights.iter().sum();
    let mut state = seed;
    (0..ZIPF_REQUESTS)
        .map(|_| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let mut u = (state >> 11) as f64 / (1u64 << 53) as f64 * total;
            weights
                .iter()
                .position(|w| {
                    u -= w;
                    u <= 0.0
                })
                .unwrap_or(ZIPF_PROMPTS - 1)
        })
        .collect()
}

/// What one Zipf phase cost: requests, answers without a call (HIT or COALESCED), upstream
/// calls, and prompts asked for the first time (the floor: one call each).
struct Phase {
    requests: usize,
    answered: usize,
    calls: u64,
    new: usize,
}

fn zipf_phase(edge: &Edge, draws: &[usize], asked: &mut std::collections::BTreeSet<usize>) -> Phase {
    let new = draws.iter().filter(|&&i| asked.insert(i)).count();
    let bodies = draws.iter().map(|i| prompt(&format!("zipf prompt {i}"))).collect();
    let before = edge.calls();
    let labels = edge.send(bodies, "Bearer alpha");
    Phase {
        requests: labels.len(),
        answered: count(&labels, "HIT") + count(&labels, "COALESCED"),
        calls: edge.calls() - before,
        new,
    }
}

pub fn scan_rows(r: &mut Report) -> std::io::Result<()> {
    println!();
    // The hot set: alpha asks 40 prompts three times, beta scans, alpha asks them again.
    let edge = Edge::start()?;
    let hot: Vec<String> = (0..40).map(|i| prompt(&format!("alpha's question {i}"))).collect();
    for _ in 0..3 {
        edge.send(hot.clone(), "Bearer alpha");
    }
    edge.scan("beta's scan")?;
    let after = edge.send(hot, "Bearer alpha");
    r.note(format!(
        "scan: alpha's 40 prompts (asked 3 times) after beta's scan (2 embeddings lists of 2,048 inputs, \
         1,500 one-off prompts; default cache of 4,096): {} of 40 HIT (goal >= 36)",
        count(&after, "HIT")
    ));
    r.ratio("hot set HITs after a scan / hot set", count(&after, "HIT") as f64 / 40.0, "goal >= 0.90");
    drop(edge);

    // Zipf: two phases of draws, with the scan between them on one Envoy and nothing
    // between them on the other.
    let (first, second) = (zipf_draws(7), zipf_draws(11));
    let mut rates = Vec::new();
    for scanned in [false, true] {
        let edge = Edge::start()?;
        let mut asked = std::collections::BTreeSet::new();
        let a = zipf_phase(&edge, &first, &mut asked);
        if scanned {
            edge.scan("a scan between")?;
        }
        let b = zipf_phase(&edge, &second, &mut asked);
        let how = if scanned { "with a scan between" } else { "without a scan" };
        for (name, p) in [("first", &a), ("second", &b)] {
            r.note(format!(
                "Zipf(1.1), {ZIPF_PROMPTS} prompts, {how}, {name} {} requests: {} answered without a call \
                 ({:.1} %), {} upstream calls for {} prompts asked for the first time (floor: one each)",
                p.requests,
                p.answered,
                100.0 * p.answered as f64 / p.requests.max(1) as f64,
                p.calls,
                p.new,
            ));
        }
        rates.push((b.answered as f64 / b.requests.max(1) as f64, b.calls as f64 / b.new.max(1) as f64));
        let floor = a.calls as f64 / a.new.max(1) as f64;
        r.ratio(&format!("Zipf calls / prompts asked first, first phase ({how})"), floor, "floor 1.00");
    }
    let ([without, with], [without_calls, with_calls]) = ([rates[0].0, rates[1].0], [rates[0].1, rates[1].1]);
    r.ratio("Zipf hit rate after a scan / without a scan", with / without.max(f64::MIN_POSITIVE), "goal >= 0.95");
    r.ratio("Zipf second phase calls / prompts asked first, without a scan", without_calls, "floor 1.00");
    r.ratio("Zipf second phase calls / prompts asked first, after a scan", with_calls, "");
    Ok(())
}
