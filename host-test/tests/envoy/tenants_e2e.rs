//! Tenants in real Envoy (2 workers): callers known by their keys' digests, each tenant its
//! own cache scope and its own models, the operator's key the only one HolySheep sees.

use host_test::client::{request, Resp};
use host_test::mock::Fault;
use host_test::stack::{prompt, prompt_for, Stack};
use sha2::{Digest, Sha256};

const OPERATOR_KEY: &str = "sk-operator-5e1d7c3b9a";
const SEARCH_OLD: &str = "hs-search-0d4c2a9e1f";
const SEARCH_NEW: &str = "hs-search-8b7f6e5d4c";
const BATCH: &str = "hs-batch-3a2b1c0d9e";

fn digest(token: &str) -> String {
    Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// `search` (two keys, one model) and `batch` (any model); `extra` more top-level fields.
fn config(extra: &str) -> String {
    format!(
        r#"{{"models":{{"gpt-4.1":{{"fallback":["deepseek-v3"]}},"deepseek-v3":{{}}}},
            "tenants":{{"search":{{"keys_sha256":["{}","{}"],"models":["gpt-4.1"]}},
                        "batch":{{"keys_sha256":["{}"]}}}}{extra}}}"#,
        digest(SEARCH_OLD),
        digest(SEARCH_NEW),
        digest(BATCH)
    )
}

fn start(extra: &str) -> Stack {
    Stack::start_with(&config(extra), 0, Some(OPERATOR_KEY), Some(OPERATOR_KEY))
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

fn code(r: &Resp) -> String {
    r.json()["error"]["code"].as_str().unwrap_or("-").to_owned()
}

#[test]
fn an_unknown_or_missing_key_is_a_401_and_nothing_goes_upstream() {
    let s = start("");
    let body = prompt("who are you");
    let refused = [
        s.chat(&body, &[]),
        s.chat(&body, &[("authorization", "Bearer hs-search-0d4c2a9e1")]),
        s.chat(&body, &[("authorization", &format!("Basic {SEARCH_OLD}"))]),
        s.chat(&body, &[("authorization", &bearer(OPERATOR_KEY))]),
    ];
    for r in &refused {
        assert_eq!((r.status, code(r).as_str()), (401, "invalid_api_key"), "{}", r.text());
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
        assert!(!r.text().contains("hs-search") && !r.text().contains("sk-"), "no key quoted: {}", r.text());
        assert_eq!(r.header("x-holysheep-tenant"), None);
    }
    assert_eq!(s.calls(), 0, "nothing reached HolySheep");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn keys_of_one_tenant_share_its_answers_and_two_tenants_never_do() {
    let s = start("");
    let body = prompt("the capital of France");
    let first = s.chat(&body, &[("authorization", &bearer(SEARCH_OLD))]);
    assert_eq!((first.status, first.cache(), first.header("x-holysheep-tenant")), (200, "MISS", Some("search")));
    assert_eq!(s.mock.mock.last_authorization().as_deref(), Some(bearer(OPERATOR_KEY).as_str()), "never the token");
    let rotated = s.chat(&body, &[("authorization", &bearer(SEARCH_NEW))]);
    assert_eq!(
        (rotated.cache(), rotated.header("x-holysheep-tenant")),
        ("HIT", Some("search")),
        "one tenant, one scope"
    );
    let other = s.chat(&body, &[("authorization", &bearer(BATCH))]);
    assert_eq!((other.cache(), other.header("x-holysheep-tenant")), ("MISS", Some("batch")), "two tenants, two scopes");
    assert_eq!(s.calls(), 2);
    let again = s.chat(&body, &[("authorization", &bearer(BATCH))]);
    assert_eq!((again.cache(), again.header("x-holysheep-tenant")), ("HIT", Some("batch")), "from the worker's copy");
    let streamed = s.chat(&body.replacen('{', r#"{"stream":true,"#, 1), &[("authorization", &bearer(SEARCH_NEW))]);
    assert_eq!((streamed.cache(), streamed.header("x-holysheep-tenant")), ("HIT", Some("search")));
    assert_eq!(s.calls(), 2);
}

#[test]
fn a_model_outside_the_tenants_list_is_a_404_and_its_fallback_is_skipped() {
    let s = start(r#","retry":{"max_attempts":1}"#);
    let not_listed = s.chat(&prompt_for("deepseek-v3", "not yours"), &[("authorization", &bearer(SEARCH_OLD))]);
    assert_eq!((not_listed.status, code(&not_listed).as_str()), (404, "model_not_found"), "{}", not_listed.text());
    assert_eq!(not_listed.json()["error"]["param"], "model");
    assert_eq!(s.calls(), 0);
    // gpt-4.1 fails: batch may fail over to deepseek-v3, search may not.
    s.mock.mock.plan(vec![Fault { status: Some(503), ..Fault::default() }; 2]);
    let search = s.chat(&prompt("fails for search"), &[("authorization", &bearer(SEARCH_OLD))]);
    assert_eq!(search.status, 503, "no fallback outside its models: {}", search.text());
    assert_eq!(s.calls(), 1);
    let batch = s.chat(&prompt("fails for batch"), &[("authorization", &bearer(BATCH))]);
    assert_eq!((batch.status, batch.header("x-holysheep-model")), (200, Some("deepseek-v3")), "{}", batch.text());
    assert_eq!(s.calls(), 3);
}

#[test]
fn the_models_list_is_the_tenants_own() {
    let s = start("");
    let list = |token: &str| {
        request(s.envoy.edge, "GET", "/v1/models", &[("authorization", &bearer(token))], b"").expect("answer")
    };
    let ids = |r: &Resp| -> Vec<String> {
        r.json()["data"]
            .as_array()
            .map(|d| d.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect())
            .unwrap_or_default()
    };
    let search = list(SEARCH_OLD);
    assert_eq!((search.status, search.json()["object"].as_str()), (200, Some("list")), "{}", search.text());
    assert_eq!(ids(&search), ["gpt-4.1"]);
    assert_eq!(search.header("x-holysheep-tenant"), Some("search"));
    assert_eq!(ids(&list(BATCH)), ["deepseek-v3", "gpt-4.1"], "every configured model");
    let unknown = list("hs-nobody");
    assert_eq!((unknown.status, code(&unknown).as_str()), (401, "invalid_api_key"));
    assert_eq!(s.calls(), 0, "answered by the edge");
}
