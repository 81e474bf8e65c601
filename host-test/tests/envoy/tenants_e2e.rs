//! Tenants in real Envoy (2 workers): callers known by their keys' digests, each tenant its
//! own cache scope and its own models, the operator's key the only one HolySheep sees.

use host_test::client::{request, Resp};
use host_test::mock::Fault;
use host_test::stack::{burst_at, poll_until, prompt, prompt_for, Stack};
use host_test::stack::{key_digest, streamed};

const OPERATOR_KEY: &str = "sk-operator-5e1d7c3b9a";
const SEARCH_OLD: &str = "hs-search-0d4c2a9e1f";
const SEARCH_NEW: &str = "hs-search-8b7f6e5d4c";
const BATCH: &str = "hs-batch-3a2b1c0d9e";

/// `search` (two keys, one model) and `batch` (any model); `extra` more top-level fields.
fn config(extra: &str) -> String {
    format!(
        r#"{{"models":{{"gpt-4.1":{{"fallback":["deepseek-v3"]}},"deepseek-v3":{{}}}},
            "tenants":{{"search":{{"keys_sha256":["{}","{}"],"models":["gpt-4.1"]}},
                        "batch":{{"keys_sha256":["{}"]}}}}{extra}}}"#,
        key_digest(SEARCH_OLD),
        key_digest(SEARCH_NEW),
        key_digest(BATCH)
    )
}

fn start(extra: &str) -> Stack {
    Stack::start_with(&config(extra), 0, Some(OPERATOR_KEY), Some(OPERATOR_KEY))
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
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
        assert_eq!((r.status, r.error_code().as_str()), (401, "invalid_api_key"), "{}", r.text());
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
        assert!(!r.text().contains("hs-search") && !r.text().contains("sk-"), "no key quoted: {}", r.text());
        assert_eq!(r.header("x-holysheep-tenant"), None);
    }
    assert_eq!(s.calls(), 0, "nothing reached HolySheep");
    assert_eq!(s.envoy.stat("wasmcustom.holysheep.tenants.unauthorized"), 4, "each counted");
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
    let streamed = s.chat(&streamed(&body), &[("authorization", &bearer(SEARCH_NEW))]);
    assert_eq!((streamed.cache(), streamed.header("x-holysheep-tenant")), ("HIT", Some("search")));
    assert_eq!(s.calls(), 2);
    // Each tenant's counters: its answers by cache status and its calls.
    let stat = |tenant: &str, name: &str| s.envoy.stat(&format!("wasmcustom.holysheep.tenant.{tenant}.{name}"));
    let counted = |t: &str| (stat(t, "requests_miss"), stat(t, "requests_hit"), stat(t, "upstream_calls"));
    // A HIT from a worker's copy is counted on the worker's next tick.
    poll_until(|| counted("search") == (1, 2, 1) && counted("batch") == (1, 1, 1), "each tenant's counters");
}

#[test]
fn a_model_outside_the_tenants_list_is_a_404_and_its_fallback_is_skipped() {
    let s = start(r#","retry":{"max_attempts":1}"#);
    let not_listed = s.chat(&prompt_for("deepseek-v3", "not yours"), &[("authorization", &bearer(SEARCH_OLD))]);
    assert_eq!(
        (not_listed.status, not_listed.error_code().as_str()),
        (404, "model_not_found"),
        "{}",
        not_listed.text()
    );
    assert_eq!(not_listed.json()["error"]["param"], "model");
    assert_eq!(s.calls(), 0);
    assert_eq!(s.envoy.stat("wasmcustom.holysheep.tenant.search.model_refused"), 1);
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
    assert_eq!((unknown.status, unknown.error_code().as_str()), (401, "invalid_api_key"));
    let slash =
        request(s.envoy.edge, "GET", "/v1//models/", &[("authorization", &bearer(BATCH))], b"").expect("answer");
    assert_eq!(ids(&slash), ["deepseek-v3", "gpt-4.1"], "in any spelling");
    assert_eq!(s.calls(), 0, "answered by the edge");
}

#[test]
fn a_request_the_edge_does_not_govern_never_carries_the_tenants_key_on() {
    let s = start("");
    let other = [("authorization", bearer(BATCH)), ("x-other", "kept".to_owned())];
    let headers: Vec<(&str, &str)> = other.iter().map(|(n, v)| (*n, v.as_str())).collect();
    // Another method on a governed path is no governed request: the edge answers it.
    let refused = request(s.envoy.edge, "GET", "/v1/chat/completions", &headers, b"").expect("answer");
    assert_eq!((refused.status, refused.json()["error"]["code"].as_str()), (404, Some("unknown_url")));
    assert_eq!(s.mock.mock.calls_to("/v1/chat/completions"), 0, "it never reached HolySheep");
    assert_eq!(s.mock.mock.last_authorization(), None);
    // Outside the API with a tenant's key, whatever the method: the edge answers it, and the
    // token (the edge's credential) never travels on.
    for (method, path, body) in [("GET", "/status", &b""[..]), ("POST", "/internal/report", &b"{}"[..])] {
        let r = request(s.envoy.edge, method, path, &headers, body).expect("answer");
        assert_eq!((r.status, r.json()["error"]["code"].as_str()), (404, Some("unknown_url")), "{method} {path}");
        assert_eq!(s.mock.mock.calls_to(path), 0, "{method} {path} reached HolySheep");
    }
    assert_eq!(s.mock.mock.last_authorization(), None, "no request with the tenant's token left");
    // Outside the API and without a tenant's key (a health check, say), a request passes
    // untouched.
    let probe = request(s.envoy.edge, "GET", "/status", &[("x-other", "kept")], b"").expect("answer");
    assert_eq!(probe.status, 401, "HolySheep's own answer, to no key: {}", probe.text());
    assert_eq!(s.mock.mock.calls_to("/status"), 1);
    let seen = s.mock.mock.last_headers();
    assert!(seen.iter().any(|(n, v)| n == "x-other" && v == "kept"), "the rest passes untouched: {seen:?}");
}

/// gpt-4.1 at $10 / $30 per million prompt / completion tokens.
const PRICES: &str = r#""usd_per_mtok_input":10,"usd_per_mtok_output":30"#;

/// What an answer cost at `PRICES`, from the mock's own `usage`, in micro-dollars.
fn cost_micro(r: &Resp) -> u64 {
    let u = &r.json()["usage"];
    u["prompt_tokens"].as_u64().unwrap_or(0) * 10 + u["completion_tokens"].as_u64().unwrap_or(0) * 30
}

fn budgeted(body: &str, max_tokens: u64) -> String {
    body.replacen('{', &format!(r#"{{"max_tokens":{max_tokens},"#), 1)
}

#[test]
fn concurrent_calls_of_a_tenant_never_spend_more_than_its_daily_budget() {
    let max_tokens = 20;
    let bodies: Vec<String> = (0..50).map(|i| budgeted(&prompt(&format!("budget {i:02}")), max_tokens)).collect();
    // Each call's worst case: every body byte a prompt token, and max_tokens, at the dearer
    // price, $30 per million.
    let worst_micro = bodies[0].len() as u64 + max_tokens;
    let worst_micro = worst_micro * 30;
    // Room for eight worst cases and a half.
    let budget_micro = 8 * worst_micro + worst_micro / 2;
    let config = format!(
        r#"{{"models":{{"gpt-4.1":{{{PRICES}}}}},
            "tenants":{{"batch":{{"keys_sha256":["{}"],"usd_per_day":{}}}}}}}"#,
        key_digest(BATCH),
        budget_micro as f64 / 1e6
    );
    let s = Stack::start_with(&config, 300, Some(OPERATOR_KEY), Some(OPERATOR_KEY));
    let answers = burst_at(s.envoy.edge, bodies.clone(), &bearer(BATCH));
    let served: Vec<&Resp> = answers.iter().filter(|r| r.status == 200).collect();
    let spent: u64 = served.iter().map(|r| cost_micro(r)).sum();
    assert_eq!(served.len(), 8, "eight worst cases fit in the budget at once");
    assert_eq!(s.calls(), 8);
    assert!(spent <= budget_micro, "spent {spent} of {budget_micro} micro-dollars");
    for r in answers.iter().filter(|r| r.status != 200) {
        // Nothing was settled yet: the budget has room once the eight settle.
        assert_eq!((r.status, r.error_code().as_str()), (429, "rate_limit_exceeded"), "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("1"), "come back when the calls in flight settle");
    }
    assert_eq!(s.envoy.stat("wasmcustom.holysheep.gpt-4.1.cost_spent_microusd"), spent, "the counter agrees");
    let stat = |name: &str| s.envoy.stat(&format!("wasmcustom.holysheep.tenant.batch.{name}"));
    assert_eq!((stat("cost_spent_microusd"), stat("upstream_calls"), stat("rate_limited")), (spent, 8, 42));

    // Its answers are still served from the cache: a HIT costs nothing.
    let first_served = answers.iter().position(|r| r.status == 200).expect("one served");
    let hit = s.chat(&bodies[first_served], &[("authorization", &bearer(BATCH))]);
    assert_eq!((hit.status, hit.cache()), (200, "HIT"));
    assert_eq!(s.calls(), 8);
    // The settled calls left room for one more; sent alone, the gauge then says exactly
    // what is left of the day.
    let late = s.chat(&budgeted(&prompt("budget 50"), max_tokens), &[("authorization", &bearer(BATCH))]);
    assert_eq!((late.status, s.calls()), (200, 9), "{}", late.text());
    let late_cost = cost_micro(&late);
    let stat = |name: &str| s.envoy.stat(&format!("wasmcustom.holysheep.tenant.batch.{name}"));
    assert_eq!(stat("budget_day_left_microusd"), budget_micro - spent - late_cost);
}

#[test]
fn over_three_nodes_a_tenants_budget_is_one_budget() {
    use host_test::client::Conn;
    use host_test::fleet::Fleet;
    use std::sync::{Arc, Barrier};
    let max_tokens = 20;
    let bodies: Vec<String> = (0..48).map(|i| budgeted(&prompt(&format!("fleet budget {i:02}")), max_tokens)).collect();
    let worst_micro = (bodies[0].len() as u64 + max_tokens) * 30;
    let budget_micro = 8 * worst_micro + worst_micro / 2;
    // `probe`: the key the fleet's start-up probes of its ring carry.
    let config = format!(
        r#"{{"models":{{"gpt-4.1":{{{PRICES}}}}},
            "tenants":{{"batch":{{"keys_sha256":["{}"],"usd_per_day":{}}},"probe":{{"keys_sha256":["{}"]}}}}}}"#,
        key_digest(BATCH),
        budget_micro as f64 / 1e6,
        key_digest("probe")
    );
    let fleet = Fleet::start(3, &config, 300);
    let publics = fleet.publics();
    let probes = fleet.calls();
    // Sixteen prompts on each node's public listener, all released together.
    let barrier = Arc::new(Barrier::new(bodies.len()));
    let handles: Vec<_> = bodies
        .into_iter()
        .enumerate()
        .map(|(i, body)| {
            let (addr, b) = (publics[i % publics.len()], barrier.clone());
            std::thread::spawn(move || {
                let mut conn = Conn::open(addr).expect("connect");
                b.wait();
                conn.request("POST", host_test::stack::PATH, &[("authorization", &bearer(BATCH))], body.as_bytes())
                    .expect("answer")
            })
        })
        .collect();
    let answers: Vec<Resp> = handles.into_iter().map(|h| h.join().expect("thread")).collect();
    let served: Vec<&Resp> = answers.iter().filter(|r| r.status == 200).collect();
    assert_eq!(served.len(), 8, "one budget for the fleet: {:?}", answers.iter().map(|r| r.status).collect::<Vec<_>>());
    assert_eq!(fleet.calls() - probes, 8);
    let spent: u64 = served.iter().map(|r| cost_micro(r)).sum();
    assert!(spent <= budget_micro, "spent {spent} of {budget_micro} micro-dollars");
    for r in answers.iter().filter(|r| r.status != 200) {
        assert_eq!(
            (r.status, r.error_code().as_str()),
            (429, "rate_limit_exceeded"),
            "held by calls in flight: {}",
            r.text()
        );
    }
    assert_eq!(
        fleet.counted("wasmcustom.holysheep.tenant.batch.fleet_local_share"),
        0,
        "the tenant's owner was reached"
    );
    assert_eq!(fleet.stat("wasmcustom.holysheep.tenant.batch.upstream_calls"), 8);
}

#[test]
fn a_reload_in_envoy_that_rotates_a_key_keeps_the_spend() {
    use host_test::envoy::{Envoy, Options};
    use host_test::mock::Running;
    let body = budgeted(&prompt("spent before the reload"), 20);
    // Room for one worst case (every body byte a token, and max_tokens, at $30 per million).
    let budget_micro = (body.len() as u64 + 20) * 30 + 100;
    let config = |key: &str| {
        format!(
            r#"{{"models":{{"gpt-4.1":{{{PRICES}}}}},"tenants":{{"batch":{{"keys_sha256":["{}"],"usd_per_day":{}}}}}}}"#,
            key_digest(key),
            budget_micro as f64 / 1e6
        )
    };
    let mock = Running::start(Some(OPERATOR_KEY), 0).expect("mock");
    let mut opts = Options::new(&config(BATCH), mock.addr);
    opts.api_key = Some(OPERATOR_KEY.into());
    opts.edge_by_lds = true;
    let envoy = Envoy::start(&opts).expect("envoy starts");
    let chat = |token: &str, body: &str| {
        request(envoy.edge, "POST", host_test::stack::PATH, &[("authorization", &bearer(token))], body.as_bytes())
            .expect("answer")
    };
    assert_eq!(chat(BATCH, &body).status, 200);
    // The key rotated: the old one removed, a new one added, the budget unchanged.
    const ROTATED: &str = "hs-batch-rotated-7c6b5a";
    envoy.reconfigure(&config(BATCH), &config(ROTATED)).expect("reconfigured");
    // A connection keeps the listener that accepted it, and each worker takes the new
    // listener at its own moment: the rest goes over one connection the new one accepted.
    let spend_after = budgeted(&prompt("spent after the reload"), 20);
    let mut after = None;
    poll_until(
        || {
            let mut conn = host_test::client::Conn::open(envoy.edge).expect("connect");
            let r = conn.request(
                "POST",
                host_test::stack::PATH,
                &[("authorization", &bearer(ROTATED))],
                spend_after.as_bytes(),
            );
            let taken = r.as_ref().is_ok_and(|r| r.status != 401);
            after = taken.then(|| (conn, r.expect("an answer")));
            taken
        },
        "the reload never took effect",
    );
    let (mut conn, after) = after.expect("the new listener answered");
    assert_eq!(
        (after.status, after.error_code().as_str()),
        (429, "insufficient_quota"),
        "the spend is kept: {}",
        after.text()
    );
    let cached = conn
        .request("POST", host_test::stack::PATH, &[("authorization", &bearer(ROTATED))], body.as_bytes())
        .expect("answer");
    assert_eq!((cached.status, cached.cache()), (200, "HIT"), "the tenant's answers too");
    let old = conn.request("POST", host_test::stack::PATH, &[("authorization", &bearer(BATCH))], body.as_bytes());
    assert_eq!(old.expect("answer").status, 401, "the old key is gone");
    assert_eq!(mock.mock.calls(), 1);
    assert!(envoy.crashes().is_empty(), "{:?}", envoy.crashes());
}

#[test]
fn a_tenant_continues_its_own_stored_responses_and_no_other_tenants() {
    let s = start("");
    let ask = |token: &str, body: &str| {
        request(s.envoy.edge, "POST", "/v1/responses", &[("authorization", &bearer(token))], body.as_bytes())
            .expect("answer")
    };
    let go_on = |id: &str| format!(r#"{{"model":"gpt-4.1","input":"go on","previous_response_id":"{id}"}}"#);
    // Batch's stored response: handed to it with its id signed for batch.
    let r = ask(BATCH, r#"{"model":"gpt-4.1","input":"remember the number 7"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    let id = r.json()["id"].as_str().expect("an id").to_owned();
    let (bare, _) = id.rsplit_once("_hs").expect("signed");
    let calls = s.mock.mock.calls_to("/v1/responses");
    // Search holds batch's id (or HolySheep's bare one, or a forged one): as if none existed,
    // and HolySheep never sees it.
    for other in [id.clone(), bare.to_owned(), format!("{bare}_hs0123456789abcdef")] {
        let r = ask(SEARCH_OLD, &go_on(&other));
        assert_eq!((r.status, r.error_code()), (404, "previous_response_not_found".to_owned()), "{}", r.text());
        assert_eq!(r.json()["error"]["param"], "previous_response_id");
    }
    assert_eq!(s.mock.mock.calls_to("/v1/responses"), calls, "no call for another tenant's id");
    // Batch continues its own: HolySheep gets its own id back, and batch the new one signed.
    let r = ask(BATCH, &go_on(&id));
    assert_eq!(r.status, 200, "{}", r.text());
    let sent: serde_json::Value = serde_json::from_slice(&s.mock.mock.last_body()).expect("json");
    assert_eq!(sent["previous_response_id"], bare, "HolySheep's own id");
    assert_eq!(r.json()["previous_response_id"], id.as_str());
    let next = r.json()["id"].as_str().expect("an id").to_owned();
    assert!(next.contains("_hs") && next != id);
    // Its id written with JSON escapes is the same id: HolySheep gets its own back.
    let escaped = next.replacen('_', "\\u005f", 1);
    let r = ask(BATCH, &go_on(&escaped));
    assert_eq!(r.status, 200, "{}", r.text());
    let sent: serde_json::Value = serde_json::from_slice(&s.mock.mock.last_body()).expect("json");
    assert_eq!(sent["previous_response_id"], next.rsplit_once("_hs").expect("signed").0, "HolySheep's own id");
    // Streamed: every event that names the response names it signed, and it continues too.
    let streamed = r#"{"model":"gpt-4.1","input":"remember the number 8","stream":true}"#;
    let r = ask(BATCH, streamed);
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    let created = text.lines().find_map(|l| l.strip_prefix("data: ")).expect("an event");
    let sid = serde_json::from_str::<serde_json::Value>(created).expect("json")["response"]["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    assert!(sid.contains("_hs"), "{text}");
    assert!(!text.contains(&format!("\"{}\"", sid.rsplit_once("_hs").unwrap().0)), "no bare id: {text}");
    assert_eq!(ask(BATCH, &go_on(&sid)).status, 200);
    assert_eq!(ask(SEARCH_NEW, &go_on(&sid)).status, 404);
    // A conversation lives in the operator's account: no tenant's call made it here.
    let r = ask(BATCH, r#"{"model":"gpt-4.1","input":"hi","conversation":"conv_1"}"#);
    assert_eq!((r.status, r.error_code()), (404, "not_found".to_owned()), "{}", r.text());
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}
