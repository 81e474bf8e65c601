//! The semantic tier in real Envoy (2 workers) with the plugin: a paraphrase of a stored
//! question is answered from it (SEMANTIC) only when everything else about the request is
//! the same; a question not close enough is an ordinary MISS; a failed or slow embedding
//! still answers; and the counters say what the mock saw.

use host_test::client::Resp;
use host_test::mock::embeddings::similarity;
use host_test::mock::Fault;
use host_test::stack::key_digest;
use host_test::stack::{count, Stack};
use serde_json::{json, Value};

const OPERATOR_KEY: &str = "sk-operator-semantic-41c7";
/// The embedding model's price in the tests' configurations: 100 micro-dollars a token.
const EMBEDDING_USD_PER_MTOK: u64 = 100;

fn config(extra: &str) -> String {
    format!(
        r#"{{"semantic":{{"enabled":true,"models":["gpt-4.1","deepseek-v3"]{extra}}},
            "models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}},
                       "text-embedding-3-small":{{"usd_per_mtok_input":{EMBEDDING_USD_PER_MTOK}}}}}}}"#
    )
}

fn stack(extra: &str) -> Stack {
    Stack::start_tuned(&config(extra), 0, |o| o.api_key = Some(OPERATOR_KEY.into()), Some(OPERATOR_KEY))
}

/// A chat request: `system`, then `turns` (earlier user/assistant text), then `question`.
fn ask(model: &str, system: &str, turns: &[&str], question: &str) -> Value {
    let mut messages = vec![json!({"role": "system", "content": system})];
    for (i, t) in turns.iter().enumerate() {
        messages.push(json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": t}));
    }
    messages.push(json!({"role": "user", "content": question}));
    json!({"model": model, "temperature": 0, "messages": messages})
}

fn send(s: &Stack, body: &Value, tenant: &str) -> Resp {
    s.chat(&body.to_string(), &[("authorization", tenant)])
}

fn content(r: &Resp) -> String {
    r.json()["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned()
}

fn stat(s: &Stack, counter: &str) -> u64 {
    s.envoy.stat(&format!("wasmcustom.holysheep.gpt-4.1.{counter}"))
}

const SYSTEM: &str = "Answer in one word.";
const ASKED: &str = "What is the capital of France?";
const PARAPHRASE: &str = "what is the capital of france";

#[test]
fn a_paraphrase_is_semantic_and_the_same_paraphrase_in_any_other_request_is_not() {
    assert!((similarity(ASKED, PARAPHRASE, 1536) - 1.0).abs() < 1e-6, "the mock's paraphrase");
    let s = stack("");
    let first = send(&s, &ask("gpt-4.1", SYSTEM, &[], ASKED), "Bearer a");
    assert_eq!((first.status, first.cache()), (200, "MISS"), "{}", first.text());
    assert_eq!((s.calls(), s.mock.mock.embeddings()), (1, 1), "embedded once, after the exact miss");
    let same = send(&s, &ask("gpt-4.1", SYSTEM, &[], PARAPHRASE), "Bearer a");
    assert_eq!((same.status, same.cache()), (200, "SEMANTIC"), "{}", same.text());
    assert_eq!(same.header("x-holysheep-similarity"), Some("1.0000"));
    assert_eq!(same.header("cache-control"), Some("no-store"), "kept under no key of its own");
    assert_eq!(content(&same), content(&first), "the stored answer");
    assert_eq!(s.calls(), 1, "no chat call for it");
    // A stream of the paraphrase is served from the same answer, as events.
    let mut streamed = ask("gpt-4.1", SYSTEM, &[], PARAPHRASE);
    streamed["stream"] = json!(true);
    let events = send(&s, &streamed, "Bearer a");
    assert_eq!((events.cache(), events.header("content-type")), ("SEMANTIC", Some("text/event-stream")));
    assert!(events.text().ends_with("data: [DONE]\n\n"), "{}", events.text());
    // The same paraphrase anywhere else: another system prompt, model, tenant, earlier turn.
    let elsewhere = [
        ("another system prompt", ask("gpt-4.1", "Answer at length.", &[], PARAPHRASE), "Bearer a"),
        ("another model", ask("deepseek-v3", SYSTEM, &[], PARAPHRASE), "Bearer a"),
        ("another tenant", ask("gpt-4.1", SYSTEM, &[], PARAPHRASE), "Bearer b"),
        ("another earlier turn", ask("gpt-4.1", SYSTEM, &["Hi", "Hello!"], PARAPHRASE), "Bearer a"),
    ];
    for (what, body, tenant) in &elsewhere {
        let r = send(&s, body, tenant);
        assert_eq!((r.status, r.cache()), (200, "MISS"), "{what}: {}", r.text());
        assert!(r.header("x-holysheep-similarity").is_none(), "{what}");
    }
    let mut warm = ask("gpt-4.1", SYSTEM, &[], PARAPHRASE);
    warm["temperature"] = json!(0.9);
    let embedded = s.mock.mock.embeddings();
    assert_eq!(send(&s, &warm, "Bearer a").cache(), "MISS", "temperature 0.9 without a seed");
    assert_eq!(s.mock.mock.embeddings(), embedded, "not deterministic: not embedded");
    assert_eq!(s.calls(), 1 + elsewhere.len() as u64 + 1);
    // Counters match what the mock saw.
    assert_eq!(stat(&s, "requests_semantic"), 2);
    assert_eq!(
        stat(&s, "embedding_calls") + s.envoy.stat("wasmcustom.holysheep.other.embedding_calls"),
        s.mock.mock.embeddings()
    );
    assert_eq!(stat(&s, "upstream_calls") + s.envoy.stat("wasmcustom.holysheep.other.upstream_calls"), s.calls());
    let inputs = s.mock.mock.embedding_inputs();
    let words: u64 = inputs.iter().map(|t| host_test::mock::embeddings::words(t).len() as u64).sum();
    let tokens = stat(&s, "embedding_tokens") + s.envoy.stat("wasmcustom.holysheep.other.embedding_tokens");
    assert_eq!(tokens, words, "one token a word: {inputs:?}");
    let cost = stat(&s, "embedding_cost_microusd") + s.envoy.stat("wasmcustom.holysheep.other.embedding_cost_microusd");
    assert_eq!(cost, words * EMBEDDING_USD_PER_MTOK);
    assert_eq!(s.mock.mock.last_authorization().as_deref(), Some(format!("Bearer {OPERATOR_KEY}").as_str()));
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_question_below_the_threshold_is_a_miss_and_then_an_exact_hit() {
    let s = stack("");
    assert_eq!(send(&s, &ask("gpt-4.1", SYSTEM, &[], ASKED), "Bearer a").cache(), "MISS");
    let polite = "What is the capital of France, please?";
    assert!(similarity(ASKED, polite, 1536) < 0.95, "the mock puts it at 6/sqrt(42)");
    let near = send(&s, &ask("gpt-4.1", SYSTEM, &[], polite), "Bearer a");
    assert_eq!((near.status, near.cache()), (200, "MISS"), "{}", near.text());
    assert!(content(&near).contains("please"), "its own answer: {}", content(&near));
    assert_eq!(stat(&s, "semantic_near_misses"), 1);
    let again = send(&s, &ask("gpt-4.1", SYSTEM, &[], polite), "Bearer a");
    assert_eq!((again.cache(), content(&again)), ("HIT", content(&near)));
    assert_eq!((s.calls(), s.mock.mock.embeddings()), (2, 2), "a HIT embeds nothing");
    // Both questions are in the partition now: each paraphrase finds its own.
    let r = send(&s, &ask("gpt-4.1", SYSTEM, &[], "PLEASE: what is the capital of France"), "Bearer a");
    assert_eq!((r.cache(), content(&r)), ("SEMANTIC", content(&near)));
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_failed_or_slow_embedding_still_answers_as_a_miss_and_teaches_nothing() {
    let s = stack(r#","timeout_ms":200"#);
    s.mock.mock.plan_embeddings(vec![Fault { status: Some(503), ..Fault::default() }]);
    let failed = send(&s, &ask("gpt-4.1", SYSTEM, &[], ASKED), "Bearer a");
    assert_eq!((failed.status, failed.cache()), (200, "MISS"), "{}", failed.text());
    s.mock.mock.plan_embeddings(vec![Fault { delay_ms: 5_000, ..Fault::default() }]);
    let slow = send(&s, &ask("gpt-4.1", SYSTEM, &[], "Name the largest ocean."), "Bearer a");
    assert_eq!((slow.status, slow.cache()), (200, "MISS"), "{}", slow.text());
    assert_eq!(stat(&s, "embedding_failures"), 2);
    assert_eq!(stat(&s, "embedding_calls"), 2);
    // Neither question joined the index: their paraphrases are misses too.
    let r = send(&s, &ask("gpt-4.1", SYSTEM, &[], PARAPHRASE), "Bearer a");
    assert_eq!(r.cache(), "MISS");
    assert_eq!(s.calls(), 3);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn request_directives_are_honoured_and_a_crowd_embeds_once_per_flight() {
    let s = stack("");
    assert_eq!(send(&s, &ask("gpt-4.1", SYSTEM, &[], ASKED), "Bearer a").cache(), "MISS");
    let paraphrase = ask("gpt-4.1", SYSTEM, &[], PARAPHRASE).to_string();
    let embedded = s.mock.mock.embeddings();
    for (directive, want) in [("no-store", "BYPASS"), ("no-cache", "MISS")] {
        let r = s.chat(&paraphrase, &[("authorization", "Bearer a"), ("cache-control", directive)]);
        assert_eq!((r.status, r.cache()), (200, want), "{directive}");
    }
    assert_eq!(s.mock.mock.embeddings(), embedded, "a request that may not read the cache looks for no paraphrase");
    // A crowd of one new paraphrase: the flights' leaders embed, everyone else waits.
    s.mock.mock.plan_embeddings(vec![Fault { delay_ms: 150, ..Fault::default() }]);
    let before = s.mock.mock.embeddings();
    let crowd = s.burst(100, &ask("gpt-4.1", SYSTEM, &[], "The capital of France is what?").to_string(), "Bearer a");
    let led = count(&crowd, "SEMANTIC") as u64;
    assert_eq!(led + count(&crowd, "COALESCED") as u64, 100, "{:?}", crowd.iter().map(Resp::cache).collect::<Vec<_>>());
    assert_eq!(led, 1, "one flight for the crowd: {:?}", crowd.iter().map(Resp::cache).collect::<Vec<_>>());
    assert_eq!(s.mock.mock.embeddings() - before, led, "one embedding per flight");
    assert!(crowd.iter().all(|r| content(r) == content(&crowd[0])));
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn in_a_fleet_a_paraphrase_through_any_node_meets_its_question() {
    let fleet = host_test::fleet::Fleet::keyed(0, 3, &config(""), 0, Some(OPERATOR_KEY));
    let publics = fleet.publics();
    let calls = fleet.calls();
    let on = |i: usize, question: &str| {
        let body = ask("gpt-4.1", SYSTEM, &[], question).to_string();
        host_test::client::request(
            publics[i],
            "POST",
            host_test::stack::PATH,
            &[("authorization", "Bearer a")],
            body.as_bytes(),
        )
        .expect("answer")
    };
    let first = on(0, ASKED);
    assert_eq!((first.status, first.cache()), (200, "MISS"), "{}", first.text());
    // Each paraphrase has a key of its own, owned by any node: the partition routes them.
    for (i, paraphrase) in
        [(1, PARAPHRASE), (2, "The capital of France is what?"), (0, "WHAT IS THE CAPITAL OF FRANCE")]
    {
        let r = on(i, paraphrase);
        assert_eq!((r.cache(), content(&r)), ("SEMANTIC", content(&first)), "{paraphrase} through node {i}");
    }
    assert_eq!(fleet.calls() - calls, 1, "one chat call for the fleet");
    assert!(fleet.crashes().is_empty(), "{:?}", fleet.crashes());
}

#[test]
fn clients_that_leave_while_their_question_is_embedded_disturb_nothing() {
    let s = stack("");
    let leaving = 10;
    s.mock.mock.plan_embeddings(vec![Fault { delay_ms: 200, ..Fault::default() }; leaving]);
    for i in 0..leaving {
        let body = ask("gpt-4.1", SYSTEM, &[], &format!("Which river runs through city number {i}?")).to_string();
        let mut conn = host_test::client::Conn::open(s.envoy.edge).expect("connect");
        conn.send_only("POST", host_test::stack::PATH, &[("authorization", "Bearer a")], body.as_bytes())
            .expect("send");
        let embedded = i as u64 + 1;
        host_test::stack::poll_until(|| s.mock.mock.embeddings() >= embedded, "the question was never embedded");
        drop(conn);
    }
    // Each leader's flight outlives its client: its answer is stored and its question learned.
    s.await_calls(leaving as u64);
    let again = send(&s, &ask("gpt-4.1", SYSTEM, &[], "Which river runs through city number 3?"), "Bearer a");
    assert_eq!(again.cache(), "HIT");
    let paraphrase = send(&s, &ask("gpt-4.1", SYSTEM, &[], "which river runs through CITY number 7"), "Bearer a");
    assert_eq!(paraphrase.cache(), "SEMANTIC", "{}", paraphrase.text());
    assert_eq!(s.calls(), leaving as u64);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn embeddings_are_inside_the_tenants_budget_and_the_embedding_models_bucket() {
    // A question's worst case: every body byte a token at gpt-4.1's dearest price ($8 per
    // million) and 4096 completion tokens; its embedding's: its bytes at $100 per million.
    let body = ask("gpt-4.1", SYSTEM, &[], ASKED);
    let chat_worst = (body.to_string().len() as u64 + 4096) * 8;
    let embedding_worst = ASKED.len() as u64 * EMBEDDING_USD_PER_MTOK;
    // `batch` has room for both and a hundred micro-dollars; `poor` not even for the call.
    let budget = chat_worst + embedding_worst + 100;
    let raw = format!(
        r#"{{"semantic":{{"enabled":true}},
            "models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}},
                       "text-embedding-3-small":{{"usd_per_mtok_input":{EMBEDDING_USD_PER_MTOK},"requests_per_minute":60,"burst":1}}}},
            "tenants":{{"batch":{{"keys_sha256":["{}"],"usd_per_day":{}}},"poor":{{"keys_sha256":["{}"],"usd_per_day":{}}},
                        "free":{{"keys_sha256":["{}"]}}}}}}"#,
        key_digest("batch-key"),
        budget as f64 / 1e6,
        key_digest("poor-key"),
        (chat_worst / 2) as f64 / 1e6,
        key_digest("free-key")
    );
    let s = Stack::start_tuned(&raw, 0, |o| o.api_key = Some(OPERATOR_KEY.into()), Some(OPERATOR_KEY));
    let poor = send(&s, &body, "Bearer poor-key");
    assert_eq!((poor.status, poor.json()["error"]["code"].as_str()), (429, Some("insufficient_quota")));
    assert_eq!((s.calls(), s.mock.mock.embeddings()), (0, 0), "a tenant that cannot afford the call embeds nothing");
    let first = send(&s, &body, "Bearer batch-key");
    assert_eq!((first.status, first.cache()), (200, "MISS"), "{}", first.text());
    assert_eq!(s.mock.mock.embeddings(), 1);
    // The chat call and its embedding are both charged to the tenant.
    let usage = &first.json()["usage"];
    let chat = usage["prompt_tokens"].as_u64().unwrap_or(0) * 2 + usage["completion_tokens"].as_u64().unwrap_or(0) * 8;
    let embedded = stat(&s, "embedding_tokens") * EMBEDDING_USD_PER_MTOK;
    let left = s.envoy.stat("wasmcustom.holysheep.tenant.batch.budget_day_left_microusd");
    assert_eq!(left, budget - chat - embedded, "chat {chat} and embedding {embedded} of {budget}");
    assert!(chat + embedded > 100, "the first call spent more than the room beside the two worst cases");
    // What is left holds the next call's worst case, not its embedding's beside it: the call
    // goes on as an ordinary MISS, without an embedding.
    let again = send(&s, &ask("gpt-4.1", SYSTEM, &[], "What is the capital of Spain?"), "Bearer batch-key");
    assert_eq!((again.status, again.cache()), (200, "MISS"), "{}", again.text());
    assert_eq!(s.mock.mock.embeddings(), 1, "no embedding past the budget");
    // The embedding model's bucket (a burst of one) is spent: no embedding for anyone.
    let other = send(&s, &ask("gpt-4.1", SYSTEM, &[], "What is the capital of Italy?"), "Bearer free-key");
    assert_eq!((other.status, other.cache()), (200, "MISS"), "{}", other.text());
    assert_eq!(s.mock.mock.embeddings(), 1, "the embedding model's bucket admitted no second embedding");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn an_embedding_holysheep_refuses_costs_nothing_and_one_that_failed_its_worst_case() {
    let budget = 1_000_000;
    let raw = format!(
        r#"{{"semantic":{{"enabled":true}},
            "models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}},
                       "text-embedding-3-small":{{"usd_per_mtok_input":{EMBEDDING_USD_PER_MTOK}}}}},
            "tenants":{{"batch":{{"keys_sha256":["{}"],"usd_per_day":{}}}}}}}"#,
        key_digest("batch-key"),
        budget as f64 / 1e6
    );
    let s = Stack::start_tuned(&raw, 0, |o| o.api_key = Some(OPERATOR_KEY.into()), Some(OPERATOR_KEY));
    // HolySheep refuses the first embedding (400: nothing billed), and fails the second
    // with a 503 (what it billed, if anything, is unknown).
    s.mock.mock.plan_embeddings(vec![
        Fault { status: Some(400), ..Fault::default() },
        Fault { status: Some(503), ..Fault::default() },
    ]);
    let chat = |r: &Resp| {
        let usage = &r.json()["usage"];
        usage["prompt_tokens"].as_u64().unwrap_or(0) * 2 + usage["completion_tokens"].as_u64().unwrap_or(0) * 8
    };
    let left = || s.envoy.stat("wasmcustom.holysheep.tenant.batch.budget_day_left_microusd");
    let refused = send(&s, &ask("gpt-4.1", SYSTEM, &[], ASKED), "Bearer batch-key");
    assert_eq!((refused.status, refused.cache()), (200, "MISS"), "{}", refused.text());
    assert_eq!(left(), budget - chat(&refused), "the refused embedding cost nothing");
    let second = "Which river is the longest?";
    let failed = send(&s, &ask("gpt-4.1", SYSTEM, &[], second), "Bearer batch-key");
    assert_eq!((failed.status, failed.cache()), (200, "MISS"), "{}", failed.text());
    assert_eq!(s.mock.mock.embeddings(), 2);
    // The failed embedding is charged its worst case: every byte of the question a token.
    let worst = second.len() as u64 * EMBEDDING_USD_PER_MTOK;
    assert_eq!(left(), budget - chat(&refused) - chat(&failed) - worst, "the failed embedding's worst case");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn in_a_fleet_a_budgeted_tenant_makes_no_embedding_and_each_node_keeps_its_share_of_the_bucket() {
    // The embedding model allows 6 requests a minute, a burst of 6: a node's share is 2.
    let raw = format!(
        r#"{{"semantic":{{"enabled":true}},
            "models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}},
                       "text-embedding-3-small":{{"usd_per_mtok_input":{EMBEDDING_USD_PER_MTOK},"requests_per_minute":6,"burst":6}}}},
            "tenants":{{"paid":{{"keys_sha256":["{}"],"usd_per_day":100}},"free":{{"keys_sha256":["{}"]}},
                        "probe":{{"keys_sha256":["{}"]}}}}}}"#,
        key_digest("paid-key"),
        key_digest("free-key"),
        key_digest("probe")
    );
    let fleet = host_test::fleet::Fleet::keyed(0, 3, &raw, 0, Some(OPERATOR_KEY));
    let publics = fleet.publics();
    let on = |i: usize, key: &str, question: &str| {
        let body = ask("gpt-4.1", SYSTEM, &[], question).to_string();
        let auth = format!("Bearer {key}");
        host_test::client::request(
            publics[i],
            "POST",
            host_test::stack::PATH,
            &[("authorization", &auth)],
            body.as_bytes(),
        )
        .expect("answer")
    };
    // The tenant's budget lives on its owner node, which is not asked before an embedding:
    // its new questions, through every node, make none (each used to make one).
    for i in 0..6 {
        let r = on(i % 3, "paid-key", &format!("Which river runs through city number {i}?"));
        assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    }
    assert_eq!(fleet.mock.mock.embeddings(), 0, "no embedding for a budgeted tenant in a fleet");
    // A tenant without a budget: its questions share a partition, so one owner embeds them,
    // within its share of the embedding model's bucket (which took nothing in a fleet).
    for i in 0..3 {
        let r = on(i, "free-key", &format!("Which mountain stands over town number {i}?"));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(fleet.mock.mock.embeddings(), 2, "the owner's share of a burst of 6 over 3 nodes");
    assert!(fleet.crashes().is_empty(), "{:?}", fleet.crashes());
}
