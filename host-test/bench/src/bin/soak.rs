//! `make soak`: SOAK_SECONDS (default 600) of mixed traffic through Envoy (2 workers) with
//! the plugin (or, with `HOLYSHEEP_TEST_SHELL=native`, the native module) and the mock: repeated prompts (HITs), distinct prompts (MISSes), streams,
//! bad input, a crowd of identical prompts every 10 s, and the mock failing now and then
//! (503, 429 with retry-after, resets). Envoy's RSS is sampled every 10 s. It passes when,
//! after the first minute (warm-up), RSS stays within 10 % of its first sample, no VM
//! crashed (nor a hook panicked), and Envoy is still running. The cache holds 512 answers,
//! which the distinct prompts fill well within the warm-up on either shell: memory that
//! grows after it is not the cache reaching its bound. Not a test: it prints what it saw and exits non-zero on a failure.

use host_test::client::Conn;
use host_test::envoy::{Envoy, Options};
use host_test::mock::{Fault, Running};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PATH: &str = "/v1/chat/completions";
const CONFIG: &str = r#"{"cache":{"ttl_seconds":60,"max_entries":512},"models":{"gpt-4.1":{"requests_per_minute":60000,"tokens_per_minute":50000000}},"retry":{"max_attempts":2,"base_delay_ms":10,"max_delay_ms":100},"stale_if_error_seconds":60}"#;

fn prompt(text: &str, stream: bool) -> String {
    let s = if stream { r#""stream":true,"# } else { "" };
    format!(r#"{{{s}"model":"gpt-4.1","messages":[{{"role":"user","content":"{text}"}}],"temperature":0}}"#)
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap_or("");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn main() -> std::io::Result<()> {
    host_test::envoy::kill_envoys_on_panic();
    let secs: u64 = std::env::var("SOAK_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(600);
    let mock = Running::start(None, 20)?;
    let envoy = Envoy::start(&Options::new(CONFIG, mock.addr))?;
    let (edge, pid) = (envoy.edge, envoy.pid());
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut workers = Vec::new();
    for t in 0..8u64 {
        let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
        workers.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let body = match n % 20 {
                    0..=11 => prompt(&format!("repeated {}", n % 50), false),
                    12..=16 => prompt(&format!("distinct {t} {n}"), false),
                    17..=18 => prompt(&format!("repeated {}", n % 50), true),
                    _ => "{\"model\":".to_owned(),
                };
                let answered = Conn::open(edge)
                    .and_then(|c| c.read_timeout(Duration::from_secs(30)))
                    .and_then(|mut c| c.request("POST", PATH, &[("authorization", "Bearer soak")], body.as_bytes()));
                sent.fetch_add(1, Ordering::Relaxed);
                if !answered.is_ok_and(|r| r.status < 500 || r.status == 503 || r.status == 502) {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let start = Instant::now();
    let mut samples: Vec<(u64, u64)> = Vec::new();
    let mut tick = 0u64;
    while start.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(1));
        tick += 1;
        if tick.is_multiple_of(10) {
            let crowd: Vec<_> = (0..300)
                .map(|_| {
                    let body = prompt(&format!("crowd {tick}"), tick.is_multiple_of(20));
                    std::thread::spawn(move || {
                        Conn::open(edge).and_then(|mut c| c.request("POST", PATH, &[], body.as_bytes())).is_ok()
                    })
                })
                .collect();
            let lost = crowd.into_iter().map(|h| h.join().unwrap_or(false)).filter(|ok| !ok).count();
            failed.fetch_add(lost as u64, Ordering::Relaxed);
            samples.push((start.elapsed().as_secs(), rss_kib(pid)));
            println!(
                "t={:>4}s rss={:>7} KiB requests={} failed={}",
                start.elapsed().as_secs(),
                rss_kib(pid),
                sent.load(Ordering::Relaxed),
                failed.load(Ordering::Relaxed)
            );
        }
        if tick.is_multiple_of(15) {
            let fault = |status: Option<u16>, reset: bool| Fault {
                status,
                reset,
                retry_after: status.filter(|s| *s == 429).map(|_| "1".to_owned()),
                ..Fault::default()
            };
            mock.mock.plan(vec![fault(Some(503), false), fault(Some(429), false), fault(None, true)]);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    let after: Vec<u64> = samples.iter().filter(|(t, _)| *t >= 60).map(|(_, r)| *r).collect();
    let first = after.first().copied().unwrap_or(0).max(1);
    let worst = after.iter().map(|r| (*r as f64 / first as f64 - 1.0).abs()).fold(0.0, f64::max);
    let crashes = envoy.crashes();
    // A process that died (a zombie until reaped) has no resident memory.
    let alive = rss_kib(pid) > 0;
    println!(
        "soak: {secs}s, {} requests ({} failed), {} upstream calls; RSS after warm-up {first} KiB, largest deviation {:.1} %; {} VM crash lines",
        sent.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        mock.mock.calls(),
        worst * 100.0,
        crashes.len()
    );
    let ok = worst <= 0.10 && crashes.is_empty() && !after.is_empty() && alive;
    if !alive {
        println!("soak: Envoy is gone");
    }
    println!("soak: {}", if ok { "PASSED" } else { "FAILED" });
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
