//! HolySheep's limits learned from its `x-ratelimit-*` headers (`BENCH_ONLY=learned`): the
//! mock holds chat calls to 600 a minute (10 a second, 10 at once) and says so, where the
//! edge is configured with 6,000. The same paced load, twice that limit, goes through the
//! edge and through a plain Envoy proxy to the same mock, one after the other: HolySheep's
//! 429s after its first answer, the answers served, and how long clients waited.

use crate::report::Report;
use host_test::client::request;
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use host_test::stack::prompt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// HolySheep's limit in the mock: requests a minute, and at once.
const LIMIT: (u32, u32) = (600, 10);
/// The load: twice the limit, for this long.
const PER_SECOND: u64 = 20;
const SECONDS: u64 = 10;

/// What one pass of the load saw.
struct Pass {
    served: usize,
    /// HolySheep's 429s after its first answer, and in all.
    throttled_after_first: usize,
    throttled: usize,
    /// Clients' waits, in milliseconds, sorted.
    waits_ms: Vec<u64>,
}

/// The paced load against `addr`, the mock's limit set anew first.
fn pass(addr: SocketAddr, mock: &Running, tag: &str) -> Pass {
    mock.mock.limit_requests(LIMIT.0, LIMIT.1);
    let start = Instant::now();
    let clients: Vec<_> = (0..PER_SECOND * SECONDS)
        .map(|i| {
            let body = prompt(&format!("{tag} {i}"));
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(1000 * i / PER_SECOND).saturating_sub(start.elapsed()));
                let sent = Instant::now();
                let r = request(addr, "POST", "/v1/chat/completions", &[], body.as_bytes());
                (r.map(|r| r.status).unwrap_or(0), sent, Instant::now())
            })
        })
        .collect();
    let done: Vec<(u16, Instant, Instant)> = clients.into_iter().filter_map(|c| c.join().ok()).collect();
    let first = done.iter().filter(|(s, _, _)| *s == 200).map(|(_, _, at)| *at).min();
    let calls = mock.mock.limited_calls();
    let throttled_after_first =
        calls.iter().filter(|(at, away)| *away && first.is_some_and(|first| *at > first)).count();
    let mut waits_ms: Vec<u64> = done.iter().map(|(_, sent, at)| at.duration_since(*sent).as_millis() as u64).collect();
    waits_ms.sort_unstable();
    Pass {
        served: done.iter().filter(|(s, _, _)| *s == 200).count(),
        throttled_after_first,
        throttled: calls.iter().filter(|(_, away)| *away).count(),
        waits_ms,
    }
}

fn quantile(sorted: &[u64], q: f64) -> u64 {
    sorted.get(((sorted.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0)
}

/// The rows (`BENCH_ONLY=learned`).
pub fn learned_rows(r: &mut Report) -> std::io::Result<()> {
    let mock = Running::start(None, 0)?;
    let config = r#"{"models":{"gpt-4.1":{"requests_per_minute":6000}},"rate_limit":{"max_wait_ms":30000},
                     "retry":{"max_attempts":3,"base_delay_ms":10,"max_delay_ms":2000}}"#;
    let envoy = Envoy::start(&Options::new(config, mock.addr))?;
    println!();
    let sent = PER_SECOND * SECONDS;
    for (name, addr, tag) in [("plain Envoy proxy", envoy.plain, "plain"), ("edge", envoy.edge, "edge")] {
        let p = pass(addr, &mock, tag);
        r.note(format!(
            "{name}: {sent} requests at {PER_SECOND}/s against HolySheep's {}/min ({} at once): {} answered 200; \
             HolySheep's 429s {} in all, {} after its first answer; client wait p50 {} ms, p99 {} ms",
            LIMIT.0,
            LIMIT.1,
            p.served,
            p.throttled,
            p.throttled_after_first,
            quantile(&p.waits_ms, 0.5),
            quantile(&p.waits_ms, 0.99),
        ));
    }
    Ok(())
}
