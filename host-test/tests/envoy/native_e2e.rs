//! The native module (`make native`) in real Envoy, in front of the mock: the same core as
//! the plugin, its store in the process's memory and its waiters woken through Envoy's
//! scheduler. What it serves so far is docs/native.md's list; each test here is one of it.

use host_test::client::Conn;
use host_test::envoy::{Envoy, Options, Shell};
use host_test::mock::Running;
use host_test::stack::{count, prompt, streamed, Stack, PATH};

const KEY: &str = "sk-operator";

/// The mock (which takes only the operator's key) and Envoy with the native module.
pub(crate) fn native(config: &str, latency_ms: u64) -> Stack {
    Stack::start_tuned(
        config,
        latency_ms,
        |o| {
            o.shell = Shell::Native;
            o.api_key = Some(KEY.into());
        },
        Some(KEY),
    )
}

#[test]
fn a_miss_then_a_hit_costs_one_call_with_the_operators_key() {
    let s = native(r#"{"cache":{"ttl_seconds":600}}"#, 0);
    let body = prompt("native: the first question");
    let miss = s.chat(&body, &[]);
    assert_eq!((miss.status, miss.cache()), (200, "MISS"), "{}", miss.text());
    assert_eq!(s.mock.mock.last_authorization().as_deref(), Some("Bearer sk-operator"));
    let hit = s.chat(&body, &[]);
    assert_eq!((hit.status, hit.cache()), (200, "HIT"));
    assert_eq!(hit.body, miss.body, "the stored answer, byte for byte");
    assert_eq!(hit.header("x-holysheep-key"), miss.header("x-holysheep-key"));
    assert_eq!(s.calls(), 1, "the HIT never reached HolySheep");
    assert_eq!(s.crashes(), Vec::<String>::new());
}

#[test]
fn a_crowd_over_two_workers_makes_one_call_and_everyone_gets_the_leaders_answer() {
    let s = native("{}", 300);
    let resps = s.burst(100, &prompt("native: the crowd's question"), "Bearer t");
    assert!(resps.iter().all(|r| r.status == 200), "{:?}", resps.iter().map(|r| r.status).collect::<Vec<_>>());
    assert_eq!(s.calls(), 1, "one upstream call for the crowd");
    assert_eq!(count(&resps, "MISS"), 1);
    assert_eq!(count(&resps, "MISS") + count(&resps, "COALESCED") + count(&resps, "HIT"), 100);
    assert!(count(&resps, "COALESCED") > 0, "waiters were woken by the leader's end");
    assert!(resps.iter().all(|r| r.body == resps[0].body), "everyone gets the leader's answer");
    assert_eq!(s.crashes(), Vec::<String>::new());
}

#[test]
fn a_streamed_miss_is_answered_as_events_and_stored_for_the_plain_form() {
    let s = native("{}", 0);
    let plain = prompt("native: stream me");
    let events = s.chat(&streamed(&plain), &[]);
    assert_eq!((events.status, events.cache()), (200, "MISS"));
    assert_eq!(events.header("content-type"), Some("text/event-stream"));
    let text = events.text();
    assert!(text.contains("chat.completion.chunk") && text.trim_end().ends_with("data: [DONE]"), "{text}");
    let hit = s.chat(&plain, &[]);
    assert_eq!((hit.status, hit.cache()), (200, "HIT"), "the stream was stored whole");
    let content = hit.json()["choices"][0]["message"]["content"].as_str().map(str::to_owned).unwrap_or_default();
    assert!(content.ends_with("to: native: stream me"), "{content}");
    assert_eq!(s.calls(), 1);
}

#[test]
fn bad_input_gets_an_openai_error_and_nothing_else_is_disturbed() {
    let s = native("{}", 0);
    let bad = s.chat("{not json", &[]);
    assert_eq!((bad.status, bad.error_code().as_str()), (400, "invalid_json"));
    let big = format!(r#"{{"model":"gpt-4.1","messages":[{{"role":"user","content":"{}"}}]}}"#, "x".repeat(2 << 20));
    assert_eq!(s.chat(&big, &[]).status, 413, "a body over max_body_bytes");
    let after = s.chat(&prompt("native: still serving"), &[]);
    assert_eq!((after.status, after.cache()), (200, "MISS"));
    assert_eq!(s.calls(), 1, "refused requests cost nothing");
    assert_eq!(s.crashes(), Vec::<String>::new());
}

#[test]
fn a_configuration_it_cannot_serve_yet_is_refused_at_load() {
    let mock = Running::start(None, 0).expect("mock starts");
    let mut opts = Options::new(r#"{"fleet":{"nodes":3}}"#, mock.addr);
    opts.shell = Shell::Native;
    let e = Envoy::start(&opts).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("'fleet' is not served by the native module yet"), "{e}");
}

#[test]
fn a_call_longer_than_the_lease_keeps_it_and_its_waiters_wait() {
    // A 200 ms lease, renewed every 50 ms while the 1.2 s call is out: without renewals the
    // waiters would take the expired lease over and call again.
    let s = native(r#"{"lock":{"lease_ms":200}}"#, 1_200);
    let resps = s.burst(8, &prompt("native: a slow answer"), "Bearer t");
    assert!(resps.iter().all(|r| r.status == 200), "{:?}", resps.iter().map(|r| r.status).collect::<Vec<_>>());
    assert_eq!(s.calls(), 1, "the lease held for the whole call");
    assert!(resps.iter().all(|r| r.body == resps[0].body));
}

#[test]
fn a_leader_whose_client_leaves_mid_call_gives_its_flight_up_at_once() {
    // A lease of a minute: without the leader giving it up, the waiters would wait that long
    // (past their 10 s of patience here).
    let s = native(r#"{"lock":{"lease_ms":60000}}"#, 0);
    s.mock.mock.plan(vec![host_test::mock::Fault { hold: true, ..Default::default() }]);
    let body = prompt("native: the leader leaves");
    let mut leader = Conn::open(s.envoy.edge).expect("connects");
    leader.send_only("POST", PATH, &[], body.as_bytes()).expect("sends");
    s.await_calls(1);
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let (edge, body) = (s.envoy.edge, body.clone());
            std::thread::spawn(move || {
                let conn = Conn::open(edge).and_then(|c| c.read_timeout(std::time::Duration::from_secs(10)));
                conn.and_then(|mut c| c.request("POST", PATH, &[], body.as_bytes())).map_err(|e| e.to_string())
            })
        })
        .collect();
    drop(leader);
    let resps: Vec<_> = waiters.into_iter().map(|w| w.join().expect("waiter")).collect();
    s.mock.mock.release();
    let statuses: Vec<_> = resps.iter().map(|r| r.as_ref().map(|r| r.status)).collect();
    assert!(statuses.iter().all(|s| *s == Ok(200)), "{statuses:?}");
    assert_eq!(s.calls(), 2, "one waiter led anew, the others waited for it");
    assert_eq!(s.crashes(), Vec::<String>::new());
}

/// A tenant `batch` whose token is `hs-batch-9c8b7a6f5e`, with `limits` (more fields), and
/// gpt-4.1 priced at $10 / $30 per million prompt / completion tokens.
fn tenants(limits: &str) -> String {
    let digest = host_test::stack::key_digest("hs-batch-9c8b7a6f5e");
    format!(
        r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30}}}},"retry":{{"max_attempts":1}},"tenants":{{"batch":{{"keys_sha256":["{digest}"]{limits}}}}}}}"#
    )
}

#[test]
fn a_tenant_is_verified_and_its_token_never_reaches_holysheep() {
    let s = native(&tenants(""), 0);
    let stranger = s.chat(&prompt("native: who am I"), &[("authorization", "Bearer hs-nobody")]);
    assert_eq!((stranger.status, stranger.error_code().as_str()), (401, "invalid_api_key"));
    assert_eq!(s.calls(), 0, "refused before any call");
    let r = s.chat(&prompt("native: who am I"), &[("authorization", "Bearer hs-batch-9c8b7a6f5e")]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-holysheep-tenant"), Some("batch"));
    assert_eq!(s.mock.mock.last_authorization().as_deref(), Some("Bearer sk-operator"), "the operator's key, only");
}

#[test]
fn a_budgeted_call_is_reserved_at_its_worst_case_before_it_is_sent() {
    let s = native(&tenants(r#","usd_per_day":1"#), 0);
    let auth = [("authorization", "Bearer hs-batch-9c8b7a6f5e")];
    // 128 choices of up to 4096 tokens each at $30 per million: about $15.7, far past $1.
    let many = prompt("native: one hundred and twenty-eight answers").replacen('{', r#"{"n":128,"#, 1);
    let r = s.chat(&many, &auth);
    assert_eq!((r.status, r.error_code().as_str()), (429, "insufficient_quota"), "{}", r.text());
    assert_eq!(s.calls(), 0, "nothing reached HolySheep");
    // Two choices fit, and go with the model's cap per choice.
    let two = prompt("native: two answers").replacen('{', r#"{"n":2,"#, 1);
    let r = s.chat(&two, &auth);
    assert_eq!(r.status, 200, "{}", r.text());
    let sent: serde_json::Value = serde_json::from_slice(&s.mock.mock.last_body()).expect("json");
    assert_eq!((sent["max_tokens"].as_u64(), sent["n"].as_u64()), (Some(4096), Some(2)));
}
