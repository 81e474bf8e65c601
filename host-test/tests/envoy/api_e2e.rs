//! One base URL for a tenant's whole OpenAI client, in real Envoy: embeddings, Responses
//! and legacy completions governed like chat (the tenant's key, the operator's upstream,
//! the cache, the single flight, the budget), a Responses call that keeps state never
//! shared, and every other path refused unless the operator lets it pass.

use host_test::client::{request, Resp};
use host_test::stack::key_digest;
use host_test::stack::{burst_to, results_of, Stack};
use serde_json::{json, Value};

const OPERATOR_KEY: &str = "sk-operator-77c1e5a9d3";
const TOKENS: [(&str, &str); 2] = [("apps", "hs-apps-5a4b3c2d1e"), ("index", "hs-index-9f8e7d6c5b")];
/// gpt-4.1 at $10 / $30 per million prompt / completion tokens; the embedding model at
/// $100 per million input tokens (100 micro-dollars a token, so every charge is a whole number).
const MODELS: &str = r#"{"gpt-4.1":{"usd_per_mtok_input":10,"usd_per_mtok_output":30},
    "text-embedding-3-small":{"usd_per_mtok_input":100}}"#;

fn bearer(tenant: &str) -> String {
    let (_, token) = TOKENS.iter().find(|(t, _)| *t == tenant).expect("a test tenant");
    format!("Bearer {token}")
}

/// The tenants (`extra.<tenant>`: more of its fields) and `more` top-level members.
fn config(extra: &[(&str, &str)], more: &str) -> String {
    let tenants: Vec<String> = TOKENS
        .iter()
        .map(|(t, token)| {
            let e = extra.iter().find(|(n, _)| n == t).map_or(String::new(), |(_, e)| format!(",{e}"));
            format!(r#""{t}":{{"keys_sha256":["{}"]{e}}}"#, key_digest(token))
        })
        .collect();
    format!(r#"{{"models":{MODELS},"retry":{{"max_attempts":1}},"tenants":{{{}}}{more}}}"#, tenants.join(","))
}

fn start(config: &str) -> Stack {
    Stack::start_with(config, 0, Some(OPERATOR_KEY), Some(OPERATOR_KEY))
}

fn post(s: &Stack, path: &str, tenant: &str, body: &Value) -> Resp {
    let auth = bearer(tenant);
    request(s.envoy.edge, "POST", path, &[("authorization", &auth)], body.to_string().as_bytes()).expect("edge answers")
}

fn tenant_stat(s: &Stack, tenant: &str, name: &str) -> u64 {
    s.envoy.stat(&format!("wasmcustom.holysheep.tenant.{tenant}.{name}"))
}

/// What the mock billed on `path`, in micro-dollars at `MODELS`' prices.
fn billed(s: &Stack, path: &str) -> u64 {
    let usage = s.mock.mock.billed_at(path);
    let tokens = |u: &Value, names: [&str; 2]| names.iter().find_map(|n| u[*n].as_u64()).unwrap_or(0);
    let price = |u: &Value| match path {
        "/v1/embeddings" => tokens(u, ["prompt_tokens", "input_tokens"]) * 100,
        _ => tokens(u, ["prompt_tokens", "input_tokens"]) * 10 + tokens(u, ["completion_tokens", "output_tokens"]) * 30,
    };
    usage.iter().map(price).sum()
}

/// The official `openai` Python client, with `tenant`'s key, making `calls`.
fn sdk(s: &Stack, tenant: &str, calls: Value) -> Vec<Value> {
    let root = host_test::envoy::workspace_root();
    let (_, token) = TOKENS.iter().find(|(t, _)| *t == tenant).expect("a test tenant");
    results_of(
        std::process::Command::new(root.join(".venv/bin/python"))
            .arg(root.join("host-test/tests/openai_api.py"))
            .arg(format!("http://{}/v1", s.envoy.edge))
            .arg(token)
            .arg(calls.to_string()),
    )
}

fn caches(results: &[Value]) -> Vec<&str> {
    results.iter().map(|r| r["cache"].as_str().unwrap_or("-")).collect()
}

#[test]
fn the_openai_sdk_embeds_responds_and_completes_through_the_edge_with_a_tenants_key() {
    let s = start(&config(&[("apps", r#""usd_per_day":5"#)], ""));
    let r = sdk(
        &s,
        "apps",
        json!([
            {"kind": "embeddings", "input": "the quick brown fox"},
            {"kind": "embeddings", "input": "the quick brown fox"},
            {"kind": "responses", "input": "say hello"},
            {"kind": "responses", "input": "say hello"},
            {"kind": "responses_stream", "input": "stream hello"},
            {"kind": "completions", "input": "once upon a time"},
            {"kind": "completions", "input": "once upon a time"},
        ]),
    );
    assert_eq!(caches(&r), ["MISS", "HIT", "MISS", "HIT", "MISS", "MISS", "HIT"], "{r:#?}");
    assert!(r.iter().all(|x| x["tenant"] == "apps"), "{r:#?}");
    // What the SDK read is what HolySheep answered: 1536 dimensions, one token per word.
    assert_eq!((r[0]["vectors"].clone(), r[0]["usage"]["prompt_tokens"].clone()), (json!([1536]), json!(4)));
    assert_eq!(r[0]["first"], r[1]["first"]);
    assert!(r[2]["text"].as_str().is_some_and(|t| t.ends_with("to: say hello")), "{}", r[2]);
    assert_eq!((r[2]["id"].clone(), r[2]["usage"].clone()), (r[3]["id"].clone(), r[3]["usage"].clone()));
    assert!(r[4]["text"].as_str().is_some_and(|t| t.ends_with("to: stream hello")), "{}", r[4]);
    assert!(r[4]["usage"]["output_tokens"].as_u64().is_some_and(|n| n > 0), "the stream's usage: {}", r[4]);
    assert!(r[5]["text"].as_str().is_some_and(|t| t.ends_with("of: once upon a time")), "{}", r[5]);
    assert_eq!(
        (s.mock.mock.embeddings(), s.mock.mock.calls_to("/v1/responses"), s.mock.mock.calls_to("/v1/completions")),
        (1, 2, 1),
        "one call per distinct request; the stream's own"
    );
    assert_eq!(s.mock.mock.last_authorization().as_deref(), Some(format!("Bearer {OPERATOR_KEY}").as_str()));
    // Every endpoint's answer is charged to the tenant at what HolySheep billed.
    let spent: u64 = ["/v1/embeddings", "/v1/responses", "/v1/completions"].iter().map(|p| billed(&s, p)).sum();
    assert!(spent > 0);
    assert_eq!(tenant_stat(&s, "apps", "cost_spent_microusd"), spent);
    assert_eq!(tenant_stat(&s, "apps", "budget_day_left_microusd"), 5_000_000 - spent);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_crowd_of_fifty_identical_embeddings_makes_one_upstream_call() {
    let s = Stack::start_with(&config(&[], ""), 300, Some(OPERATOR_KEY), Some(OPERATOR_KEY));
    let body = json!({"model": "text-embedding-3-small", "input": ["a crowd of", "identical inputs"]}).to_string();
    let answers = burst_to(s.envoy.edge, "/v1/embeddings", vec![body; 50], &bearer("index"));
    assert!(answers.iter().all(|a| a.status == 200), "{:?}", answers.iter().map(|a| a.status).collect::<Vec<_>>());
    assert_eq!(s.mock.mock.embeddings(), 1, "one upstream call for the crowd");
    let labels: Vec<&str> = answers.iter().filter_map(|a| a.header("x-holysheep-cache")).collect();
    assert_eq!(labels.iter().filter(|l| **l == "MISS").count(), 1, "{labels:?}");
    assert!(labels.iter().all(|l| ["MISS", "COALESCED", "HIT"].contains(l)), "{labels:?}");
    let bodies: Vec<Value> = answers.iter().map(Resp::json).collect();
    assert!(bodies.iter().all(|b| b == &bodies[0] && b["data"].as_array().map(Vec::len) == Some(2)));
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn over_three_nodes_a_crowd_of_identical_embeddings_makes_one_upstream_call() {
    let fleet = host_test::fleet::Fleet::start(3, r#"{"edge":{"max_age_seconds":0}}"#, 300);
    let body = json!({"model": "text-embedding-3-small", "input": "one owner for every node"}).to_string();
    let targets = host_test::fleet::round_robin(&fleet.publics(), vec![body; 90]);
    let answers = host_test::fleet::spread_to(targets, "/v1/embeddings", "Bearer sk-fleet");
    assert!(answers.iter().all(|a| a.status == 200), "{:?}", answers.iter().map(|a| a.status).collect::<Vec<_>>());
    assert_eq!(fleet.mock.mock.embeddings(), 1, "one upstream call for the fleet");
    let bodies: Vec<Value> = answers.iter().map(Resp::json).collect();
    assert!(bodies.iter().all(|b| b == &bodies[0]), "the same answer on every node");
    assert_eq!(fleet.crashes(), Vec::<String>::new());
}

#[test]
fn a_list_of_a_hundred_inputs_of_which_ninety_were_embedded_before_makes_one_call_for_ten() {
    let s = start(&config(&[("index", r#""usd_per_day":5"#)], ""));
    let ninety: Vec<String> = (0..90).map(|i| format!("paragraph {i} of the handbook")).collect();
    let indexed = post(&s, "/v1/embeddings", "index", &json!({"model": "text-embedding-3-small", "input": ninety}));
    assert_eq!((indexed.status, indexed.header("x-holysheep-cache")), (200, Some("MISS")), "{}", indexed.text());
    // The corpus again, with ten new paragraphs among the ninety.
    let mut hundred = ninety.clone();
    for i in 0..10 {
        hundred.insert(i * 11, format!("new paragraph {i}"));
    }
    let request = json!({"model": "text-embedding-3-small", "input": hundred});
    let reindexed = post(&s, "/v1/embeddings", "index", &request);
    assert_eq!((reindexed.status, reindexed.header("x-holysheep-cache")), (200, Some("MISS")));
    assert_eq!(s.mock.mock.embedding_batches(), [90, 10], "one call, for the ten new items only");
    // The tenant pays what HolySheep billed: the ninety once, the ten once.
    let billed_now = billed(&s, "/v1/embeddings");
    assert_eq!(tenant_stat(&s, "index", "cost_spent_microusd"), billed_now);
    let again = post(&s, "/v1/embeddings", "index", &request);
    assert_eq!((again.header("x-holysheep-cache"), again.json()), (Some("HIT"), reindexed.json()));
    // What HolySheep itself answers the whole list: the same vectors at the same indices,
    // and the same usage.
    // The same hundred in another order: a list never seen, every item cached by whole
    // calls, so a HIT with no call at all.
    let mut reversed = hundred.clone();
    reversed.reverse();
    let shuffled = json!({"model": "text-embedding-3-small", "input": reversed});
    let assembled = post(&s, "/v1/embeddings", "index", &shuffled);
    assert_eq!((assembled.status, assembled.header("x-holysheep-cache")), (200, Some("HIT")), "{}", assembled.text());
    assert_eq!(s.mock.mock.embedding_batches(), [90, 10], "no call");
    assert_eq!(tenant_stat(&s, "index", "cost_spent_microusd"), billed_now, "a HIT costs nothing");
    // What HolySheep itself answers each whole list: the same vectors at the same
    // indices, and the same usage.
    let auth = format!("Bearer {OPERATOR_KEY}");
    for (edge, asked) in [(reindexed.json(), &request), (assembled.json(), &shuffled)] {
        let holysheep = request_direct(&s, &auth, asked).json();
        assert_eq!(edge["data"], holysheep["data"]);
        assert_eq!((&edge["usage"], &edge["model"]), (&holysheep["usage"], &holysheep["model"]));
    }
}

fn request_direct(s: &Stack, auth: &str, body: &Value) -> Resp {
    request(s.mock.addr, "POST", "/v1/embeddings", &[("authorization", auth)], body.to_string().as_bytes())
        .expect("the mock answers")
}

#[test]
fn a_tenants_budget_binds_on_embeddings() {
    // $0.01 a day; a call's worst case is every byte of its body a token, at 100 µ$ each.
    let s = start(&config(&[("index", r#""usd_per_day":0.01"#)], ""));
    let left = || tenant_stat(&s, "index", "budget_day_left_microusd");
    let mut admitted = 0;
    for i in 0..40 {
        let body = json!({"model": "text-embedding-3-small", "input": format!("document number {i} of the corpus")});
        let worst = body.to_string().len() as u64 * 100;
        let before = if i == 0 { 10_000 } else { left() };
        let r = post(&s, "/v1/embeddings", "index", &body);
        if r.status == 429 {
            assert_eq!(r.json()["error"]["code"], "insufficient_quota", "{}", r.text());
            assert!(before < worst, "refused only without room: {before} left for a worst case of {worst}");
            break;
        }
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(before >= worst, "admitted with room: {before} for {worst}");
        admitted += 1;
    }
    assert!(admitted > 0 && admitted < 40, "the budget bound after {admitted} calls");
    assert_eq!(s.mock.mock.embeddings(), admitted, "the refused call never reached HolySheep");
    assert_eq!(tenant_stat(&s, "index", "cost_spent_microusd"), billed(&s, "/v1/embeddings"));
    assert_eq!(left(), 10_000 - billed(&s, "/v1/embeddings"));
}

#[test]
fn a_responses_call_that_keeps_state_is_never_served_to_another_caller() {
    let s = start(&config(&[], ""));
    let kept = json!({"model": "gpt-4.1", "input": "remember this", "temperature": 0});
    let first = post(&s, "/v1/responses", "apps", &kept);
    let second = post(&s, "/v1/responses", "apps", &kept);
    assert_eq!((first.status, second.status), (200, 200));
    assert_eq!(
        (first.header("x-holysheep-cache"), second.header("x-holysheep-cache")),
        (Some("BYPASS"), Some("BYPASS")),
        "store defaults to true: each call is its own"
    );
    assert_eq!(first.header("cache-control"), Some("no-store"));
    let crowd = burst_to(s.envoy.edge, "/v1/responses", vec![kept.to_string(); 5], &bearer("apps"));
    assert!(crowd.iter().all(|r| r.header("x-holysheep-cache") == Some("BYPASS")));
    assert_eq!(s.mock.mock.calls_to("/v1/responses"), 7, "never coalesced either");
    // A continuation of the tenant's own stored response (its id as the edge handed it).
    let id = first.json()["id"].as_str().expect("an id").to_owned();
    let chained = json!({"model": "gpt-4.1", "input": "and then?", "store": false, "previous_response_id": id});
    post(&s, "/v1/responses", "apps", &chained);
    post(&s, "/v1/responses", "apps", &chained);
    assert_eq!(s.mock.mock.calls_to("/v1/responses"), 9, "a chained call is its caller's own");
    let unkept = json!({"model": "gpt-4.1", "input": "forget this", "store": false, "temperature": 0});
    let a = post(&s, "/v1/responses", "apps", &unkept);
    let b = post(&s, "/v1/responses", "apps", &unkept);
    assert_eq!((a.header("x-holysheep-cache"), b.header("x-holysheep-cache")), (Some("MISS"), Some("HIT")));
    assert_eq!(s.mock.mock.calls_to("/v1/responses"), 10);
}

#[test]
fn a_path_the_edge_does_not_serve_is_refused_without_an_upstream_call_unless_listed() {
    let s = start(&config(&[], ""));
    let auth = bearer("apps");
    for (method, path) in [("GET", "/v1/files"), ("POST", "/v1/batches"), ("POST", "/v1/images/generations")] {
        let r = request(s.envoy.edge, method, path, &[("authorization", &auth)], b"{}").expect("edge answers");
        assert_eq!((r.status, r.json()["error"]["code"].as_str()), (404, Some("unknown_url")), "{path}");
        let message = r.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains(path) && message.contains("not served through this edge"), "{message}");
        assert_eq!(s.mock.mock.calls_to(path), 0, "{path} reached HolySheep");
    }
    assert_eq!(s.mock.mock.last_authorization(), None, "nothing reached HolySheep");
    let listed = start(&config(&[], r#","passthrough_paths":["/v1/files"]"#));
    let org = [("authorization", auth.as_str()), ("openai-organization", "org-other"), ("x-trace", "kept")];
    let r = request(listed.envoy.edge, "GET", "/v1/files/file-1", &org, b"").expect("answers");
    assert_eq!(r.status, 404, "the mock's own answer: {}", r.text());
    assert_eq!(listed.mock.mock.calls_to("/v1/files/file-1"), 1);
    let sent = listed.mock.mock.last_authorization();
    assert_eq!(
        sent.as_deref(),
        Some(format!("Bearer {OPERATOR_KEY}").as_str()),
        "the operator's key, not the tenant's"
    );
    let seen = listed.mock.mock.last_headers();
    assert!(seen.iter().any(|(n, v)| n == "x-trace" && v == "kept"), "{seen:?}");
    assert!(!seen.iter().any(|(n, _)| n == "openai-organization"), "no tenant picks the operator's organization");
    let unknown =
        request(listed.envoy.edge, "GET", "/v1/files", &[("authorization", "Bearer hs-nobody")], b"").expect("answers");
    assert_eq!(unknown.status, 401, "a listed path still needs a tenant's key");
    assert_eq!(listed.mock.mock.calls_to("/v1/files"), 0);
    // HolySheep refusing the operator's key on a passed request: the edge's 502, without
    // the 401's quote of the key.
    let stale_key = "sk-operator-revoked-0042";
    let passthrough = config(&[], r#","passthrough_paths":["/v1/files"]"#);
    let refused = Stack::start_with(&passthrough, 0, Some(OPERATOR_KEY), Some(stale_key));
    let r = request(refused.envoy.edge, "GET", "/v1/files", &[("authorization", &auth)], b"").expect("answers");
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (502, Some("upstream_auth_failed")), "{}", r.text());
    assert!(!r.text().contains("0042") && !r.text().contains("sk-"), "no fragment of the key: {}", r.text());
}

#[test]
fn the_openai_node_sdk_embeds_responds_and_completes_through_the_edge_too() {
    let s = start(&config(&[], ""));
    let root = host_test::envoy::workspace_root();
    let (_, token) = TOKENS[0];
    let r = results_of(
        std::process::Command::new("node")
            .arg(root.join("host-test/sdk-node/openai_api.mjs"))
            .arg(format!("http://{}/v1", s.envoy.edge))
            .arg(token),
    );
    assert_eq!(caches(&r), ["MISS", "HIT", "MISS", "HIT", "MISS", "MISS", "HIT"], "{r:#?}");
    assert_eq!(r[0]["vectors"], json!([1536]));
    assert!(r[2]["text"].as_str().is_some_and(|t| t.ends_with("to: node says hello")), "{}", r[2]);
    assert_eq!(r[2]["usage"], r[3]["usage"]);
    assert!(r[4]["text"].as_str().is_some_and(|t| t.ends_with("to: node streams")), "{}", r[4]);
    assert!(r[5]["text"].as_str().is_some_and(|t| t.ends_with("of: node completes")), "{}", r[5]);
    assert_eq!(
        (s.mock.mock.embeddings(), s.mock.mock.calls_to("/v1/responses"), s.mock.mock.calls_to("/v1/completions")),
        (1, 2, 1)
    );
}
