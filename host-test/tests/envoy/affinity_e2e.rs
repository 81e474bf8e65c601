//! HolySheep's prompt cache kept warm (`prompt_cache_affinity`), in real Envoy with the
//! mock's prompt cache spread over 8 machines: a call without a `prompt_cache_key` goes to
//! a machine its whole body picks, one with a key to that key's machine.

use host_test::client::{request, Resp};
use host_test::stack::{key_digest, poll_until, Stack, PATH};
use serde_json::{json, Value};
use std::path::Path;

const TOKENS: [(&str, &str); 2] = [("a", "hs-affinity-a-4c3b2a19"), ("b", "hs-affinity-b-8d7e6f50")];

/// gpt-4.1 at $10 per million prompt tokens, $2.50 from the prompt cache, $30 completion;
/// `affinity` on the model or not; two tenants.
fn config(affinity: bool) -> String {
    let tenants: Vec<String> =
        TOKENS.iter().map(|(t, token)| format!(r#""{t}":{{"keys_sha256":["{}"]}}"#, key_digest(token))).collect();
    format!(
        r#"{{"log_fields":true,"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_cached_input":2.5,"usd_per_mtok_output":30,
              "prompt_cache_affinity":{affinity}}}}},"tenants":{{{}}}}}"#,
        tenants.join(",")
    )
}

/// A tenant's question under a long shared system prompt (over 1,024 tokens, so that the
/// prompt cache serves it).
fn ask(s: &Stack, tenant: &str, question: &str, extra: Option<(&str, &str)>) -> Resp {
    let system = "You answer questions about the HolySheep edge. ".repeat(100);
    let mut body = json!({"model":"gpt-4.1","messages":[
        {"role":"system","content":system},{"role":"user","content":question}]});
    if let Some((name, value)) = extra {
        body[name] = json!(value);
    }
    let (_, token) = TOKENS.iter().find(|(t, _)| *t == tenant).expect("a tenant");
    let auth = format!("Bearer {token}");
    let r = request(s.envoy.edge, "POST", PATH, &[("authorization", &auth)], body.to_string().as_bytes());
    r.expect("the edge answers")
}

/// Six questions of tenant `a`, logged by the shipped access log to `log`: how many calls
/// HolySheep served partly from its cache, and the cached tokens of each.
fn six_questions(affinity: bool, log: &Path) -> (Stack, Vec<u64>) {
    let _ = std::fs::remove_file(log);
    let operator = Some("sk-operator-affinity");
    let s = Stack::start_tuned(
        &config(affinity),
        0,
        |o| {
            o.api_key = operator.map(str::to_owned);
            o.shipped_access_log = Some(log.to_path_buf());
        },
        operator,
    );
    s.mock.mock.prompt_cache_machines(8);
    for i in 0..6 {
        let r = ask(&s, "a", &format!("question number {i}"), None);
        assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    }
    let cached = s
        .mock
        .mock
        .billed_for("gpt-4.1")
        .iter()
        .map(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
        .collect();
    (s, cached)
}

#[test]
fn a_tenants_calls_that_share_a_prefix_meet_it_in_holysheeps_cache_and_the_saving_is_counted() {
    let log = std::env::temp_dir().join(format!("holysheep-affinity-{}.log", std::process::id()));
    let (on, cached) = six_questions(true, &log);
    assert_eq!(cached[0], 0, "the first call warms the prefix: {cached:?}");
    assert!(cached[1..].iter().all(|c| *c >= 1024), "each later call is served from the cache: {cached:?}");
    let sent: Value = serde_json::from_slice(&on.mock.mock.last_body()).expect("json");
    let key = sent["prompt_cache_key"].as_str().unwrap_or_default().to_owned();
    assert!(key.starts_with("hs-"), "the edge set the key: {sent}");
    // $10 - $2.50 per million: 7.5 micro-dollars saved per cached token.
    let saved = cached.iter().sum::<u64>() * 75 / 10;
    assert_eq!(on.envoy.stat("wasmcustom.holysheep.gpt-4.1.affinity_saved_microusd"), saved);
    assert_eq!(on.envoy.stat("wasmcustom.holysheep.tenant.a.affinity_saved_microusd"), saved, "per tenant too");
    // Each call's access-log line says what it saved: nothing on the first, its share after.
    let logged = |n: usize| {
        poll_until(|| log_lines(&log).len() >= n, "the access-log lines never came");
        log_lines(&log)
    };
    let lines = logged(6);
    let per_call: Vec<Option<u64>> = lines
        .iter()
        .map(|l| {
            l["holysheep.affinity_saved_usd"]
                .as_str()
                .map(|usd| (usd.parse::<f64>().unwrap_or(0.0) * 1e6).round() as u64)
        })
        .collect();
    let expected: Vec<Option<u64>> = cached.iter().map(|c| (*c > 0).then_some(c * 75 / 10)).collect();
    assert_eq!(per_call, expected, "{lines:#?}");

    let (off, cached_off) = six_questions(false, &log);
    let hits = |c: &[u64]| c.iter().filter(|c| **c > 0).count();
    assert!(hits(&cached_off) < hits(&cached), "without affinity {cached_off:?}, with {cached:?}");
    let sent: Value = serde_json::from_slice(&off.mock.mock.last_body()).expect("json");
    assert!(sent.get("prompt_cache_key").is_none(), "no key unless turned on: {sent}");
    assert_eq!(off.envoy.counted("wasmcustom.holysheep.gpt-4.1.affinity_saved_microusd"), 0);
    assert!(logged(6).iter().all(|l| l["holysheep.affinity_saved_usd"].is_null()), "no saving of the edge's logged");
}

/// The access log's JSON lines.
fn log_lines(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

#[test]
fn a_tenants_own_key_is_kept_scoped_to_it_and_two_tenants_never_share_one() {
    let s = Stack::start_with(&config(false), 0, Some("sk-operator-affinity"), Some("sk-operator-affinity"));
    let key_sent = |tenant: &str, n: u32| {
        let question = format!("{tenant} asks with its own key, {n}");
        let r = ask(&s, tenant, &question, Some(("prompt_cache_key", "team-cache")));
        assert_eq!(r.status, 200, "{}", r.text());
        let sent: Value = serde_json::from_slice(&s.mock.mock.last_body()).expect("json");
        sent["prompt_cache_key"].as_str().unwrap_or_default().to_owned()
    };
    let (a, b) = (key_sent("a", 1), key_sent("b", 1));
    assert!(a.starts_with("hs-") && b.starts_with("hs-"), "scoped: {a}, {b}");
    assert_ne!(a, b, "the same key of two tenants is two keys at HolySheep");
    assert_eq!(key_sent("a", 2), a, "the same tenant's key stays its own");
}
