//! End-to-end: per-model buckets, retries, failover, stale-if-error, key check and metrics,
//! with the built plugin in real Envoy (2 workers) and the mock HolySheep.

use host_test::client::Resp;
use host_test::envoy::Shell;
use host_test::mock::Fault;
use host_test::stack::{count, poll_until, prompt, prompt_for, Stack};
use std::time::{Duration, Instant};

fn int(r: &Resp, header: &str) -> i64 {
    r.header(header).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{header} missing: {:?}", r.headers))
}

fn fault(status: u16) -> Fault {
    Fault { status: Some(status), ..Fault::default() }
}

#[test]
fn a_few_requests_per_minute_give_the_exact_429_sequence() {
    let s = Stack::start(
        r#"{"models":{"gpt-4.1":{"requests_per_minute":3,"usd_per_mtok_input":2.0,"usd_per_mtok_output":8.0}}}"#,
        0,
    );
    let mut remaining = Vec::new();
    for i in 0..3 {
        let r = s.chat(&prompt(&format!("question {i}")), &[]);
        assert_eq!((r.status, r.cache()), (200, "MISS"));
        assert_eq!(int(&r, "x-ratelimit-limit-requests"), 3);
        remaining.push(int(&r, "x-ratelimit-remaining-requests"));
        assert!(r.header("x-ratelimit-reset-requests").is_some());
    }
    assert_eq!(remaining, [2, 1, 0]);
    let limited = s.chat(&prompt("question 3"), &[]);
    assert_eq!(limited.status, 429, "{}", limited.text());
    let e = &limited.json()["error"];
    assert_eq!((e["code"].as_str(), e["type"].as_str()), (Some("rate_limit_exceeded"), Some("requests")));
    assert!(e["message"].as_str().unwrap_or("").contains("gpt-4.1"), "{e}");
    // 60 s / 3 requests: the first slot comes back 20 s after it was taken.
    let ms = int(&limited, "retry-after-ms");
    assert!((19_000..=20_000).contains(&ms), "retry-after-ms {ms}");
    assert_eq!(int(&limited, "retry-after"), (ms + 999) / 1000);
    assert_eq!(s.calls(), 3, "the 429 never reached HolySheep");
    // A HIT costs nothing and is still served.
    let hit = s.chat(&prompt("question 0"), &[]);
    assert_eq!(hit.cache(), "HIT");
    let usage = &hit.json()["usage"];
    let micro_usd = |u: &serde_json::Value| {
        u["prompt_tokens"].as_u64().unwrap_or(0) * 2 + u["completion_tokens"].as_u64().unwrap_or(0) * 8
    };
    let metrics = s.envoy.stats("holysheep.gpt-4.1");
    assert_eq!(metrics.get("wasmcustom.holysheep.gpt-4.1.cost_saved_microusd"), Some(&micro_usd(usage)));
    let billed: u64 = s.mock.mock.billed().iter().map(micro_usd).sum();
    assert_eq!(s.mock.mock.billed().len(), 3, "three answers billed");
    assert_eq!(metrics.get("wasmcustom.holysheep.gpt-4.1.cost_spent_microusd"), Some(&billed), "what HolySheep billed");
    // The limited request was a miss too (answered 429 instead of going upstream).
    assert_eq!(metrics.get("wasmcustom.holysheep.gpt-4.1.requests_miss"), Some(&4));
    assert_eq!(metrics.get("wasmcustom.holysheep.gpt-4.1.requests_hit"), Some(&1));
    assert_eq!(metrics.get("wasmcustom.holysheep.gpt-4.1.rate_limited"), Some(&1));
    assert_eq!(metrics.get("wasmcustom.holysheep.gpt-4.1.upstream_calls"), Some(&3));
    let prometheus = host_test::client::request(s.envoy.admin, "GET", "/stats/prometheus", &[], b"").unwrap().text();
    // The stats tags make the model and the cache status labels (Envoy prefixes the native
    // module's series; the shipped Prometheus configuration renames them).
    let prefix = Shell::of_run().prometheus_prefix();
    let hit = format!(r#"{prefix}holysheep_requests{{gen_ai_request_model="gpt-4.1",holysheep_cache="hit"}} 1"#);
    assert!(prometheus.lines().any(|l| l == hit), "{prometheus}");
}

#[test]
fn a_burst_of_distinct_prompts_never_passes_more_than_the_bucket_across_workers() {
    let s = Stack::start(r#"{"models":{"gpt-4.1":{"requests_per_minute":60,"burst":5}}}"#, 0);
    let t0 = Instant::now();
    let resps = s.burst_of((0..40).map(|i| prompt(&format!("burst {i}"))).collect(), "Bearer t");
    let refilled = t0.elapsed().as_secs() + 1; // 60 per minute: one per second
    let ok = resps.iter().filter(|r| r.status == 200).count() as u64;
    assert_eq!(ok, s.calls(), "every admitted call went upstream once");
    assert!(ok >= 5 && ok <= 5 + refilled, "{ok} calls through a bucket of 5 (+{refilled} refilled)");
    assert_eq!(resps.iter().filter(|r| r.status == 429).count() as u64, 40 - ok);
}

#[test]
fn usage_reconciles_the_reserved_estimate() {
    let s = Stack::start(
        r#"{"models":{"gpt-4.1":{"tokens_per_minute":600},"claude-sonnet-4":{"tokens_per_minute":600}}}"#,
        0,
    );
    // Estimate far above the real usage: the difference is refunded.
    let generous = prompt("refund me").replacen('{', r#"{"max_tokens":500,"#, 1);
    // Estimate below the real usage (max_tokens 1): the difference is charged.
    let stingy = prompt_for("claude-sonnet-4", "charge me more please").replacen('{', r#"{"max_tokens":1,"#, 1);
    for body in [generous, stingy] {
        let t0 = Instant::now();
        let r = s.chat(&body, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let used = r.json()["usage"]["total_tokens"].as_i64().expect("usage");
        // Read the bucket after the call settled, on a HIT (which costs nothing).
        let after = s.chat(&body, &[]);
        assert_eq!(after.cache(), "HIT");
        let remaining = int(&after, "x-ratelimit-remaining-tokens");
        // The bucket refills 10 tokens a second meanwhile.
        let refilled = (t0.elapsed().as_millis() / 100) as i64 + 1;
        assert!((600 - used..=600 - used + refilled).contains(&remaining), "used {used}, remaining {remaining}");
    }
}

#[test]
fn a_plan_of_two_503s_then_200_gives_one_200_after_three_calls() {
    let s = Stack::start(r#"{"retry":{"max_attempts":3,"base_delay_ms":20,"max_delay_ms":100}}"#, 0);
    s.mock.mock.plan(vec![fault(503), fault(503), fault(200)]);
    let resps = s.burst(5, &prompt("flaky"), "Bearer t");
    assert_eq!(s.calls(), 3);
    assert!(resps.iter().all(|r| r.status == 200), "waiters wait for the retries");
    assert_eq!((count(&resps, "MISS"), count(&resps, "COALESCED")), (1, 4));
    assert_eq!(s.envoy.stats("holysheep.other.retries").values().sum::<u64>(), 2);
}

#[test]
fn a_provider_429_with_retry_after_is_honoured() {
    let s = Stack::start(r#"{"retry":{"base_delay_ms":10,"max_delay_ms":2000}}"#, 0);
    s.mock.mock.plan(vec![Fault { status: Some(429), retry_after: Some("1".into()), ..Fault::default() }]);
    let r = s.chat(&prompt("throttled upstream"), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let log = s.mock.mock.log();
    assert_eq!(log.len(), 2);
    let gap = log[1].1 - log[0].1;
    assert!(gap >= Duration::from_millis(1000), "retried after {gap:?}, before the provider's retry-after");
}

#[test]
fn failover_reaches_the_fallback_and_says_so() {
    let s = Stack::start(
        r#"{"models":{"gpt-4.1":{"fallback":["deepseek-v3"]}},"retry":{"max_attempts":2,"base_delay_ms":10,"max_delay_ms":20}}"#,
        0,
    );
    s.mock.mock.plan(vec![fault(503), fault(503)]);
    let body = prompt("fail over");
    let r = s.chat(&body, &[]);
    assert_eq!((r.status, r.header("x-holysheep-model")), (200, Some("deepseek-v3")), "{}", r.text());
    assert_eq!(r.json()["model"], "deepseek-v3");
    let models: Vec<String> = s.mock.mock.log().into_iter().map(|(m, _)| m).collect();
    assert_eq!(models, ["gpt-4.1", "gpt-4.1", "deepseek-v3"]);
    let again = s.chat(&body, &[]);
    assert_eq!((again.cache(), again.header("x-holysheep-model")), ("MISS", Some("gpt-4.1")), "not stored");
    assert_eq!(s.envoy.stats("holysheep.gpt-4.1.failovers").values().sum::<u64>(), 1);
}

#[test]
fn stale_is_served_only_within_its_bound() {
    let s = Stack::start(r#"{"cache":{"ttl_seconds":1},"stale_if_error_seconds":2,"retry":{"max_attempts":1}}"#, 0);
    let body = prompt("stale ok?");
    let fresh = s.chat(&body, &[]);
    assert_eq!(fresh.cache(), "MISS");
    // Waiting for time itself: the entry must expire.
    std::thread::sleep(Duration::from_millis(1_100));
    s.mock.mock.plan(vec![fault(503)]);
    let stale = s.chat(&body, &[]);
    assert_eq!((stale.status, stale.cache()), (200, "STALE"));
    assert_eq!(stale.body, fresh.body);
    assert!(int(&stale, "age") >= 1);
    // The waiters of a flight that fell back to the stale entry get it as what it is.
    s.mock.mock.plan(vec![Fault { status: Some(503), delay_ms: 300, ..Fault::default() }]);
    let crowd = s.burst(6, &body, "");
    assert_eq!(s.calls(), 3);
    for r in &crowd {
        assert_eq!((r.status, r.cache()), (200, "STALE"), "a waiter is told the answer is stale");
        assert!(int(r, "age") >= 1, "with the stale answer's own age");
    }
    s.mock.mock.plan(vec![fault(503)]);
    let no_cache = s.chat(&body, &[("cache-control", "no-cache")]);
    assert_eq!((no_cache.status, no_cache.cache()), (503, "MISS"), "no-cache is never served stale");
    std::thread::sleep(Duration::from_millis(2_000));
    s.mock.mock.plan(vec![fault(503)]);
    let gone = s.chat(&body, &[]);
    assert_eq!((gone.status, gone.cache()), (503, "MISS"), "past ttl + stale_if_error_seconds");
}

#[test]
fn the_unmodified_openai_client_gets_rate_limit_error_with_retry_after() {
    let s = Stack::start(r#"{"models":{"gpt-4.1":{"requests_per_minute":1}}}"#, 0);
    let python = host_test::envoy::workspace_root().join(".venv/bin/python");
    let script = host_test::envoy::workspace_root().join("host-test/tests/openai_client.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .arg(format!("http://{}/v1", s.envoy.edge))
        .output()
        .expect("python from .venv (make test installs it)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("json line");
    assert_eq!(v["first"], "ok");
    assert_eq!(v["error"], "RateLimitError");
    assert_eq!(v["status"], 429);
    assert_eq!(v["code"], "rate_limit_exceeded");
    let ra: u64 = v["retry_after"].as_str().and_then(|r| r.parse().ok()).expect("retry-after");
    assert!((59..=60).contains(&ra), "retry-after {ra}");
}

#[test]
fn the_key_is_checked_once_per_process_and_a_bad_key_is_reported() {
    let s = Stack::start_with("{}", 0, Some("sk-right"), Some("sk-wrong-key-123"));
    // The first worker to tick claims the check; wait for its log line.
    poll_until(|| s.envoy.log().contains("REJECTED"), "no key-check line");
    // Let every worker run (and tick) before counting.
    for i in 0..4 {
        s.chat(&prompt(&format!("after the check {i}")), &[]);
    }
    let log = s.envoy.log();
    assert_eq!(log.matches("REJECTED").count(), 1, "once per process, not per worker");
    assert!(!log.contains("sk-wrong-key-123"), "the key is never logged");
    let good = Stack::start_with("{}", 0, Some("sk-right"), Some("sk-right"));
    poll_until(|| good.envoy.log().contains("accepted the key"), "no key-check line");
}

#[test]
fn max_in_flight_caps_concurrent_calls_across_workers() {
    let held = Stack::start(r#"{"models":{"gpt-4.1":{"max_in_flight":2}},"rate_limit":{"max_wait_ms":20000}}"#, 300);
    let resps = held.burst_of((0..8).map(|i| prompt(&format!("slot {i}"))).collect(), "Bearer t");
    assert!(resps.iter().all(|r| r.status == 200), "{:?}", resps.iter().map(Resp::text).collect::<Vec<_>>());
    assert_eq!(held.calls(), 8);
    assert_eq!(held.mock.mock.max_in_flight(), 2, "never more than 2 upstream calls at once");

    // A slow upstream keeps the first two calls in flight while the other four arrive.
    let refused = Stack::start(r#"{"models":{"gpt-4.1":{"max_in_flight":2}}}"#, 1500);
    let resps = refused.burst_of((0..6).map(|i| prompt(&format!("slot {i}"))).collect(), "Bearer t");
    assert_eq!(resps.iter().filter(|r| r.status == 200).count(), 2);
    let limited: Vec<&Resp> = resps.iter().filter(|r| r.status == 429).collect();
    assert_eq!(limited.len(), 4);
    assert!(limited.iter().all(|r| r.json()["error"]["message"].as_str().unwrap_or("").contains("in flight")));
}

#[test]
fn a_day_long_provider_retry_after_holds_the_bucket_only_for_the_configured_bound() {
    let config = r#"{"models":{"gpt-4.1":{"requests_per_minute":600}},"retry":{"max_attempts":1},
                    "rate_limit":{"max_provider_hold_ms":500}}"#;
    let s = Stack::start(config, 0);
    s.mock.mock.plan(vec![Fault { status: Some(429), retry_after: Some("86400".into()), ..Fault::default() }]);
    let limited = s.chat(&prompt("a day"), &[]);
    let answered = Instant::now();
    assert_eq!((limited.status, limited.header("retry-after")), (429, Some("86400")), "HolySheep's own 429");
    // The bucket is held for the configured bound, not for HolySheep's day: the edge's own
    // 429 says when it has room again.
    let held = s.chat(&prompt("within the hold"), &[]);
    assert_eq!((held.status, held.json()["error"]["code"].as_str()), (429, Some("rate_limit_exceeded")));
    let wait_ms: u64 = held.header("retry-after-ms").and_then(|v| v.parse().ok()).expect("retry-after-ms");
    assert!((1..=500).contains(&wait_ms), "held for at most max_provider_hold_ms: {wait_ms} ms");
    assert_eq!(held.header("retry-after"), Some("1"));
    let mut n = 0;
    poll_until(
        || {
            n += 1;
            s.chat(&prompt(&format!("after a day {n}")), &[]).status == 200
        },
        "the bucket stayed empty past max_provider_hold_ms",
    );
    // Free again within the bound (500 ms), give or take a worker's tick: a hold of
    // seconds fails here.
    let held_for = answered.elapsed();
    assert!(held_for < Duration::from_millis(1_500), "the bucket was held {held_for:?}, past max_provider_hold_ms");
}

/// HolySheep holds the account to 120 requests a minute (2 a second, 2 at once) and says so
/// in its `x-ratelimit-*` headers, where the edge was configured with 600. Under a load of
/// twice HolySheep's limit, the edge learns it from the first answer: no call after that
/// answer meets HolySheep's 429, every client is answered, and the edge's own headers show
/// the limit it learned.
#[test]
fn a_limit_holysheep_announces_below_the_configured_one_is_learned_before_a_429() {
    let config = r#"{"models":{"gpt-4.1":{"requests_per_minute":600}},"rate_limit":{"max_wait_ms":20000},
                     "retry":{"max_attempts":3,"base_delay_ms":10,"max_delay_ms":2000}}"#;
    let s = Stack::start(config, 0);
    s.mock.mock.limit_requests(120, 2);
    let edge = s.envoy.edge;
    let start = Instant::now();
    // 20 distinct requests, one every 250 ms: 4 a second.
    let clients: Vec<_> = (0..20u64)
        .map(|i| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(250 * i).saturating_sub(start.elapsed()));
                let body = prompt(&format!("paced {i}"));
                let r = host_test::client::request(edge, "POST", "/v1/chat/completions", &[], body.as_bytes());
                (r.expect("the edge answers"), Instant::now())
            })
        })
        .collect();
    let answers: Vec<(Resp, Instant)> = clients.into_iter().map(|c| c.join().expect("client")).collect();
    assert!(
        answers.iter().all(|(r, _)| r.status == 200),
        "{:?}",
        answers.iter().map(|(r, _)| r.status).collect::<Vec<_>>()
    );
    let first_answer = answers.iter().map(|(_, at)| *at).min().expect("answers");
    let calls = s.mock.mock.limited_calls();
    let turned_away_after: Vec<Duration> =
        calls.iter().filter(|(at, away)| *away && *at > first_answer).map(|(at, _)| at.duration_since(start)).collect();
    assert!(turned_away_after.is_empty(), "HolySheep's 429s after the first answer, at {turned_away_after:?}");
    assert_eq!(calls.iter().filter(|(_, away)| !away).count(), 20, "each answered by one call that passed");
    let last = answers.iter().max_by_key(|(_, at)| *at).map(|(r, _)| r).expect("answers");
    assert_eq!(int(last, "x-ratelimit-limit-requests"), 120, "the edge shows the limit it learned");
}
