//! A critical request's wait behind a backlog of sheddable ones, against one first-come
//! line.

use crate::env_or;
use crate::load::PATH;
use crate::report::Report;
use crate::stats::percentile;
use host_test::client::request;
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use host_test::stack::{prompt, sha256_hex};
use std::time::{Duration, Instant};

/// A critical request's wait behind a backlog of sheddable ones, against the first-come
/// line (every request standard), in the same run.
pub fn backlog_rows(r: &mut Report) -> std::io::Result<()> {
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
pub fn backlog_waits(backlog: usize, classes: bool) -> std::io::Result<Vec<u64>> {
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
