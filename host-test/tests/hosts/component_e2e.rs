//! The wasi:http component (wasm32-wasip2) held to what the Envoy plugin does, on the
//! wasmtime + wasmtime-wasi-http host with our keyvalue draft2, the mock HolySheep as its
//! upstream. Also: the component imports nothing outside `holysheep:edge/gateway`.

use host_test::client::{request, Resp};
use host_test::component_host::serve::{start, ComponentOptions, Serving};
use host_test::component_host::{imports, unversioned};
use host_test::envoy::{component_path, workspace_root};
use host_test::mock::{Fault, Running};
use host_test::stack::{burst_at, burst_held, count, prompt, prompt_for, sha256_hex, streamed, PATH};
use std::collections::BTreeSet;

fn serve(mock: &Running, config: &str) -> Serving {
    start(ComponentOptions {
        wasm: component_path(),
        listen: ([127, 0, 0, 1], 0).into(),
        upstream: mock.addr,
        env: vec![("HOLYSHEEP_CONFIG".to_owned(), config.to_owned())],
    })
    .expect("component serves")
}

/// The component with `config` and the operator's `key`, in front of `mock`.
fn serve_keyed(mock: &Running, config: &str, key: &str) -> Serving {
    start(ComponentOptions {
        wasm: component_path(),
        listen: ([127, 0, 0, 1], 0).into(),
        upstream: mock.addr,
        env: vec![("HOLYSHEEP_CONFIG".to_owned(), config.to_owned()), ("HOLYSHEEP_API_KEY".to_owned(), key.to_owned())],
    })
    .expect("component serves")
}

fn post(s: &Serving, body: &str, headers: &[(&str, &str)]) -> Resp {
    request(s.addr, "POST", PATH, headers, body.as_bytes()).expect("answer")
}

/// The interfaces the `gateway` world imports, from `wit/`, without versions.
fn gateway_world() -> BTreeSet<String> {
    let mut resolve = wit_parser::Resolve::default();
    resolve.features.insert("clocks-timezone".into());
    let (pkg, _) = resolve.push_dir(workspace_root().join("wit")).expect("wit/ parses");
    let world = resolve.select_world(&[pkg], Some("gateway")).expect("world gateway");
    resolve.worlds[world]
        .imports
        .keys()
        .filter_map(|k| match k {
            wit_parser::WorldKey::Interface(id) => resolve.id_of(*id),
            wit_parser::WorldKey::Name(_) => None,
        })
        .map(|name| unversioned(&name).to_owned())
        .collect()
}

#[test]
fn the_component_imports_only_the_gateway_world() {
    let allowed = gateway_world();
    assert!(allowed.contains("wasi:keyvalue/atomics") && allowed.contains("wasi:http/outgoing-handler"));
    let imported = imports(&component_path()).expect("component loads");
    println!("component imports: {imported:?}");
    let outside: Vec<&String> = imported.iter().filter(|i| !allowed.contains(unversioned(i))).collect();
    assert!(outside.is_empty(), "imports outside holysheep:edge/gateway: {outside:?}");
}

#[test]
fn the_vendored_wit_matches_its_lock() {
    let wit = workspace_root().join("wit");
    let lock = std::fs::read_to_string(wit.join("deps.lock")).expect("wit/deps.lock");
    let mut locked = 0;
    for line in lock.lines() {
        let (hash, path) = line.split_once("  ").expect("<sha256>  <path>");
        let text = std::fs::read(wit.join(path)).expect("a locked file exists");
        assert_eq!(sha256_hex(&text), hash, "{path} differs from wit/deps.lock");
        locked += 1;
    }
    let vendored = std::fs::read_dir(wit.join("deps"))
        .expect("wit/deps")
        .flat_map(|d| std::fs::read_dir(d.expect("entry").path()).expect("package dir"))
        .count();
    assert_eq!(locked, vendored, "every vendored file is in the lock");
}

/// A lease no starved leader outlives: on a loaded machine (the suites run side by side on
/// two cores) a leader can wait seconds for the CPU between two renewals, and a waiter
/// rightly takes a lease left that long for a dead leader's.
const PATIENT: &str = r#"{"lock":{"lease_ms":60000}}"#;

#[test]
fn fifty_identical_requests_make_one_upstream_call() {
    let mock = Running::start(None, 2000).expect("mock");
    let s = serve(&mock, PATIENT);
    let body = prompt("served by the component");
    let resps = burst_held(&mock, s.addr, &body, 50, || s.handling());
    assert_eq!(mock.mock.calls(), 1, "one upstream call for 50 callers");
    assert!(resps.iter().all(|r| r.status == 200 && r.body == resps[0].body), "{}", resps[0].text());
    assert_eq!((count(&resps, "MISS"), count(&resps, "COALESCED")), (1, 49));
    assert!(resps.iter().all(|r| r.header("x-holysheep-key") == resps[0].header("x-holysheep-key")));
    assert_eq!(s.failures(), 0, "no instance trapped");
}

/// On a store whose swap on a missing key is an upsert (Spin's default SQLite store), two
/// racing leaders would both "create" a lease: the single flight must not depend on it.
#[test]
fn the_single_flight_holds_on_a_store_whose_swap_on_a_missing_key_upserts() {
    let mock = Running::start(None, 2000).expect("mock");
    let s = serve(&mock, PATIENT);
    s.memory.upsert_missing_keys();
    let body = prompt("served on an upserting store");
    let resps = burst_held(&mock, s.addr, &body, 50, || s.handling());
    assert!(resps.iter().all(|r| r.status == 200 && r.body == resps[0].body), "{}", resps[0].text());
    assert_eq!(mock.mock.calls(), 1, "one upstream call for 50 callers");
    assert_eq!((count(&resps, "MISS"), count(&resps, "COALESCED")), (1, 49));
    assert_eq!(s.failures(), 0, "no instance trapped");
}

#[test]
fn hit_miss_bypass_tenant_scope_and_pass_through() {
    let mock = Running::start(None, 0).expect("mock");
    let s = serve(&mock, "{}");
    let body = prompt("component contract");
    assert_eq!(post(&s, &body, &[("authorization", "Bearer a")]).cache(), "MISS");
    let hit = post(&s, &body, &[("authorization", "Bearer a")]);
    assert_eq!((hit.status, hit.cache(), hit.header("age").is_some()), (200, "HIT", true));
    assert_eq!(hit.json()["object"], "chat.completion");
    let reordered =
        r#"{"temperature":0,"messages":[{"content":"component contract","role":"user"}],"model":"gpt-4.1"}"#;
    assert_eq!(post(&s, reordered, &[("authorization", "Bearer a")]).cache(), "HIT");
    assert_eq!(post(&s, &body, &[("authorization", "Bearer b")]).cache(), "MISS", "another tenant");
    let no_store = post(&s, &body, &[("authorization", "Bearer a"), ("cache-control", "no-store")]);
    assert_eq!(no_store.cache(), "BYPASS");
    assert_eq!(mock.mock.calls(), 3);

    let streamed = streamed(&prompt("component stream"));
    let sse = post(&s, &streamed, &[("authorization", "Bearer a")]);
    assert_eq!((sse.status, sse.cache(), sse.header("content-type")), (200, "MISS", Some("text/event-stream")));
    assert!(sse.text().ends_with("data: [DONE]\n\n"), "{}", sse.text());
    let plain = post(&s, &prompt("component stream"), &[("authorization", "Bearer a")]);
    assert_eq!((plain.cache(), plain.json()["object"].as_str()), ("HIT", Some("chat.completion")), "one entry");
    let again = post(&s, &streamed, &[("authorization", "Bearer a")]);
    assert_eq!((again.cache(), again.header("content-type")), ("HIT", Some("text/event-stream")));
    assert_eq!(mock.mock.calls(), 4);
    let models = request(s.addr, "GET", "/v1/models", &[("authorization", "Bearer a")], b"").expect("models");
    assert_eq!((models.status, models.header("x-holysheep-cache")), (200, None), "other routes pass through");
    assert!(models.json()["data"].is_array());

    let bounded = serve(&mock, r#"{"cache":{"max_entries":4},"lock":{"slots":2}}"#);
    for i in 0..20 {
        assert_eq!(post(&bounded, &prompt(&format!("distinct {i}")), &[]).status, 200);
    }
    assert_eq!((s.failures(), bounded.failures()), (0, 0), "no instance trapped, before or after answering");
    let keys = bounded.memory.key_count();
    // 4 entries, their index, their ghost record and 1 lease group, and the creation claims
    // of the three keys written by compare-and-swap (the index, the ghost record, the lease
    // group).
    assert_eq!(keys, 4 + 1 + 1 + 1 + 3, "20 prompts wrote {keys} keys");
}

#[test]
fn an_instance_serves_one_request_after_another() {
    let mock = Running::start(None, 0).expect("mock");
    let s = serve(&mock, "{}");
    let body = prompt("served again and again");
    assert_eq!(post(&s, &body, &[("authorization", "Bearer a")]).cache(), "MISS");
    for _ in 0..20 {
        assert_eq!(post(&s, &body, &[("authorization", "Bearer a")]).cache(), "HIT");
    }
    assert_eq!(post(&s, &body, &[("authorization", "Bearer b")]).cache(), "MISS", "another tenant, same bytes");
    assert_eq!(post(&s, "{", &[("authorization", "Bearer a")]).status, 400);
    assert_eq!(post(&s, &body, &[("authorization", "Bearer a")]).cache(), "HIT", "after a refused request");
    // One client at a time: an instance is created only when the last one has answered but
    // not yet returned from `handle`; most requests find one idle.
    assert!(s.instances() <= 12, "{} instances for 24 requests in a row", s.instances());
    assert_eq!((mock.mock.calls(), s.failures()), (2, 0));
}

#[test]
fn bad_input_gets_openai_shaped_4xx() {
    let mock = Running::start(None, 0).expect("mock");
    let s = serve(&mock, "{}");
    for (bad, status) in [("{oops", 400), (r#"{"model":"gpt-4.1"}"#, 400), ("", 400), ("[1]", 400)] {
        let r = post(&s, bad, &[]);
        assert_eq!(r.status, status, "{}", r.text());
        assert!(r.json()["error"]["message"].is_string(), "{}", r.text());
    }
    let small = serve(&mock, r#"{"max_body_bytes":16}"#);
    let r = post(&small, &prompt("too long for sixteen bytes"), &[]);
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (413, Some("request_too_large")));
    let broken = serve(&mock, r#"{"lock":{"lease_ms":1}}"#);
    let r = post(&broken, &prompt("x"), &[]);
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (500, Some("server_error")));
    assert!(r.text().contains("lock.lease_ms"), "{}", r.text());
    let leaky = serve(&mock, r#"{"upstream":{"timeout_ms":"sk-secret-value"}}"#);
    let r = post(&leaky, &prompt("x"), &[]);
    assert_eq!(r.status, 500);
    assert!(r.text().contains("upstream.timeout_ms"), "names the field: {}", r.text());
    assert!(!r.text().contains("sk-secret-value"), "never a configured value: {}", r.text());
    assert_eq!(mock.mock.calls(), 0, "nothing reached HolySheep");
    assert_eq!(s.failures() + small.failures() + broken.failures() + leaky.failures(), 0, "bad input never traps");
}

#[test]
fn retries_and_rate_limits_behave_as_in_envoy() {
    let mock = Running::start(None, 0).expect("mock");
    let s = serve(
        &mock,
        r#"{"retry":{"base_delay_ms":10,"max_delay_ms":20},"models":{"gpt-4.1":{"requests_per_minute":4}}}"#,
    );
    let fault = |status| Fault { status: Some(status), ..Fault::default() };
    mock.mock.plan(vec![fault(503), fault(503)]);
    let r = post(&s, &prompt("retried"), &[]);
    assert_eq!((r.status, r.cache(), mock.mock.calls()), (200, "MISS", 3), "{}", r.text());
    // Every attempt takes a request from the bucket: 3 of 4 are gone.
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("4"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("1"));
    let second = post(&s, &prompt("second"), &[]);
    assert_eq!(second.status, 200);
    let limited = post(&s, &prompt("third"), &[]);
    assert_eq!(limited.status, 429, "{}", limited.text());
    assert!(limited.header("retry-after").is_some());
    assert_eq!(limited.json()["error"]["code"], "rate_limit_exceeded");
    let other_model = post(&s, &prompt_for("deepseek-v3", "not limited"), &[]);
    assert_eq!(other_model.status, 200);
    assert_eq!(s.failures(), 0);
}

#[test]
fn a_slow_answer_body_keeps_the_lease_and_stays_within_the_timeout() {
    let mock = Running::start(None, 0).expect("mock");
    // The body takes three leases to come; the leader renews every quarter lease (500 ms), so
    // only a stall of three quarters of a lease on a loaded machine could let a waiter lead.
    let s = serve(&mock, r#"{"lock":{"lease_ms":2000}}"#);
    mock.mock.plan(vec![Fault { slow_body_ms: 6_000, ..Fault::default() }]);
    let resps = burst_at(s.addr, vec![prompt("slow body"); 6], "Bearer t");
    assert!(resps.iter().all(|r| r.status == 200));
    assert_eq!(mock.mock.calls(), 1, "the leader renewed its lease while the body came: no takeover");
    let timed = serve(&mock, r#"{"upstream":{"timeout_ms":300},"retry":{"max_attempts":1}}"#);
    mock.mock.plan(vec![Fault { slow_body_ms: 5_000, ..Fault::default() }]);
    let r = post(&timed, &prompt("slower body"), &[]);
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (504, Some("upstream_timeout")), "{}", r.text());
}

/// Routes the gateway does not govern carry the client's own credentials: the operator's
/// key is only for calls that go through the cache, the single flight and the buckets.
#[test]
fn the_operator_key_goes_only_on_governed_calls() {
    let mock = Running::start(Some("sk-operator"), 0).expect("mock");
    let s = start(ComponentOptions {
        wasm: component_path(),
        listen: ([127, 0, 0, 1], 0).into(),
        upstream: mock.addr,
        env: vec![
            ("HOLYSHEEP_CONFIG".to_owned(), "{}".to_owned()),
            ("HOLYSHEEP_API_KEY".to_owned(), "sk-operator".to_owned()),
        ],
    })
    .expect("component serves");
    let models = request(s.addr, "GET", "/v1/models", &[("authorization", "Bearer sk-client")], b"").expect("models");
    assert_eq!(models.status, 401, "passed through with the client's own key: {}", models.text());
    let anonymous = request(s.addr, "GET", "/v1/models", &[], b"").expect("models");
    assert_eq!(anonymous.status, 401, "and without one when the client sent none");
    let chat = post(&s, &prompt("governed"), &[("authorization", "Bearer sk-client")]);
    assert_eq!(chat.status, 200, "a governed call uses the operator's key");
    assert_eq!(mock.mock.last_authorization().as_deref(), Some("Bearer sk-operator"));
    let framing = mock.mock.last_framing().unwrap_or_default();
    assert!(framing.starts_with("content-length: "), "a body of known length says so, not chunked: {framing}");
    // The caller's trace context goes on the call; a malformed one does not.
    let sent = |name: &str| mock.mock.last_headers().into_iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let traced = post(&s, &prompt("traced"), &[("traceparent", parent), ("tracestate", "rojo=1")]);
    assert_eq!(traced.status, 200);
    assert_eq!((sent("traceparent").as_deref(), sent("tracestate").as_deref()), (Some(parent), Some("rojo=1")));
    let malformed = post(&s, &prompt("untraced"), &[("traceparent", "00-xyz"), ("tracestate", "rojo=1")]);
    assert_eq!(malformed.status, 200);
    assert_eq!((sent("traceparent"), sent("tracestate")), (None, None));
}

/// The trust boundaries of the Envoy shell hold in the component: only real answers are
/// stored, HolySheep's refusal of the operator's key is the edge's own 502, a repeated
/// tenant credential and a repeated JSON key are refused before anything is sent.
#[test]
fn the_component_trusts_nothing_a_caller_or_the_upstream_chooses() {
    let operator_key = "sk-operator-in-the-component-9f2e";
    let refusing = Running::start(Some("sk-another-key-0000"), 0).expect("mock");
    let s = start(ComponentOptions {
        wasm: component_path(),
        listen: ([127, 0, 0, 1], 0).into(),
        upstream: refusing.addr,
        env: vec![
            ("HOLYSHEEP_CONFIG".to_owned(), r#"{"retry":{"max_attempts":1}}"#.to_owned()),
            ("HOLYSHEEP_API_KEY".to_owned(), operator_key.to_owned()),
        ],
    })
    .expect("component serves");
    let streamed = streamed(&prompt("refused in the component"));
    for body in [prompt("refused in the component"), streamed] {
        let r = post(&s, &body, &[("authorization", "Bearer sk-client")]);
        assert_eq!((r.status, r.json()["error"]["code"].as_str()), (502, Some("upstream_auth_failed")), "{}", r.text());
        assert!(!r.text().contains(&operator_key[operator_key.len() - 4..]), "{}", r.text());
    }
    assert_eq!(refusing.mock.calls(), 2);

    let mock = Running::start(None, 0).expect("mock");
    let s = serve(&mock, r#"{"retry":{"max_attempts":1}}"#);
    let body = prompt("a portal page in the component");
    let html =
        Fault { body: Some("<html>portal</html>".into()), content_type: Some("text/html".into()), ..Fault::default() };
    mock.mock.plan(vec![html]);
    let first = post(&s, &body, &[("authorization", "Bearer a")]);
    assert_eq!((first.status, first.json()["error"]["code"].as_str()), (502, Some("upstream_invalid_answer")));
    assert_eq!(post(&s, &body, &[("authorization", "Bearer a")]).cache(), "MISS", "nothing was stored");
    let twice = [("authorization", "Bearer a"), ("authorization", "Bearer b")];
    let r = post(&s, &body, &twice);
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (400, Some("ambiguous_tenant")), "{}", r.text());
    let repeated = r#"{"model":"gpt-4.1","model":"deepseek-v3","messages":[{"role":"user","content":"hi"}]}"#;
    let r = post(&s, repeated, &[("authorization", "Bearer a")]);
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (400, Some("invalid_json")));
    assert_eq!(mock.mock.calls(), 2);
    assert_eq!(s.failures(), 0);
}

/// A creator that took a key's creation claim and died before writing the key (its
/// instance dropped between the two host calls) strands the claim: the claim is handed out
/// again, so the model's bucket and the lease group are created and requests are served.
#[test]
fn a_creation_claim_stranded_by_a_dead_creator_is_handed_out_again() {
    let mock = Running::start(None, 0).expect("mock");
    let s = serve(&mock, r#"{"lock":{"slots":4,"lease_ms":60000},"models":{"gpt-4.1":{"requests_per_minute":600}}}"#);
    for stranded in ["holysheep/bucket/gpt-4.1", "holysheep/lease/0"] {
        s.memory.put("default", &format!("holysheep/created/{stranded}"), 1i64.to_le_bytes().to_vec());
    }
    let resps: Vec<Resp> = (0..8).map(|i| post(&s, &prompt(&format!("stranded {i}")), &[])).collect();
    assert!(resps.iter().all(|r| r.status == 200), "{:?}", resps.iter().map(|r| r.status).collect::<Vec<_>>());
    mock.mock.set_latency_ms(500);
    let coalesced = burst_held(&mock, s.addr, &prompt("after the claims"), 10, || s.handling());
    assert_eq!((count(&coalesced, "MISS"), count(&coalesced, "COALESCED")), (1, 9), "the lease group exists again");
    assert_eq!(s.failures(), 0);
}

#[test]
fn the_component_knows_tenants_by_their_keys_as_the_plugin_does() {
    let mock = Running::start(Some("sk-operator-c0"), 0).expect("mock");
    let (a, b) = (sha256_hex(b"hs-a-1"), sha256_hex(b"hs-b-1"));
    let config = format!(
        r#"{{"tenants":{{"a":{{"keys_sha256":["{a}"],"models":["gpt-4.1"]}},"b":{{"keys_sha256":["{b}"]}}}}}}"#
    );
    let s = serve_keyed(&mock, &config, "sk-operator-c0");
    let body = prompt("tenants on the component");
    let unknown = post(&s, &body, &[("authorization", "Bearer hs-a-2")]);
    assert_eq!((unknown.status, unknown.json()["error"]["code"].as_str()), (401, Some("invalid_api_key")));
    let first = post(&s, &body, &[("authorization", "Bearer hs-a-1")]);
    assert_eq!((first.status, first.cache(), first.header("x-holysheep-tenant")), (200, "MISS", Some("a")));
    assert_eq!(mock.mock.last_authorization().as_deref(), Some("Bearer sk-operator-c0"));
    assert_eq!(post(&s, &body, &[("authorization", "Bearer hs-a-1")]).cache(), "HIT");
    assert_eq!(post(&s, &body, &[("authorization", "Bearer hs-b-1")]).cache(), "MISS", "another tenant's scope");
    let not_listed = post(&s, &prompt_for("deepseek-v3", "no"), &[("authorization", "Bearer hs-a-1")]);
    assert_eq!((not_listed.status, not_listed.json()["error"]["code"].as_str()), (404, Some("model_not_found")));
    let models = request(s.addr, "GET", "/v1/models", &[("authorization", "Bearer hs-a-1")], b"").expect("answer");
    assert_eq!(models.json()["data"][0]["id"], "gpt-4.1");
    assert_eq!(mock.mock.calls(), 2);
}

#[test]
fn the_component_holds_a_tenants_budget_as_the_plugin_does() {
    let mock = Running::start(Some("sk-operator-c1"), 0).expect("mock");
    let first = prompt("budgeted on the component").replacen('{', r#"{"max_tokens":20,"#, 1);
    // Room for one worst case (every body byte a token, and max_tokens, at $30 per million).
    let budget = ((first.len() as u64 + 20) * 30 + 100) as f64 / 1e6;
    let config = format!(
        r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30}}}},
            "tenants":{{"a":{{"keys_sha256":["{}"],"usd_per_day":{budget}}}}}}}"#,
        sha256_hex(b"hs-a-1")
    );
    let s = serve_keyed(&mock, &config, "sk-operator-c1");
    let auth = [("authorization", "Bearer hs-a-1")];
    assert_eq!(post(&s, &first, &auth).status, 200);
    let second = post(&s, &prompt("budgeted on the componenT").replacen('{', r#"{"max_tokens":20,"#, 1), &auth);
    assert_eq!((second.status, second.json()["error"]["code"].as_str()), (429, Some("insufficient_quota")));
    assert!(second.header("retry-after").is_some());
    assert_eq!(post(&s, &first, &auth).cache(), "HIT", "a HIT is free");
    assert_eq!(mock.mock.calls(), 1);
}

#[test]
fn the_component_keeps_the_reserve_from_sheddable_calls_as_the_plugin_does() {
    let mock = Running::start(None, 0).expect("mock");
    let config = r#"{"models":{"gpt-4.1":{"requests_per_minute":1,"burst":2}},"rate_limit":{"reserve":0.5}}"#;
    let s = serve(&mock, config);
    let lowered = [("authorization", "Bearer sk-c"), ("x-holysheep-priority", "sheddable")];
    assert_eq!(post(&s, &prompt("shed one"), &lowered).status, 200, "above the reserve");
    let shed = post(&s, &prompt("shed two"), &lowered);
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert_eq!(
        (shed.header("x-holysheep-shed"), shed.header("x-holysheep-priority")),
        (Some("priority"), Some("sheddable"))
    );
    assert_eq!(post(&s, &prompt("standard"), &[("authorization", "Bearer sk-c")]).status, 200, "the reserve is kept");
    let bad = post(&s, &prompt("typo"), &[("authorization", "Bearer sk-c"), ("x-holysheep-priority", "urgent")]);
    assert_eq!((bad.status, bad.json()["error"]["code"].as_str()), (400, Some("invalid_priority")));
    assert_eq!(mock.mock.calls(), 2);
}

#[test]
fn the_component_answers_a_paraphrase_from_its_question_and_a_failed_embedding_as_a_miss() {
    let key = "sk-operator-component-semantic";
    let mock = Running::start(Some(key), 0).expect("mock");
    let s = serve_keyed(&mock, r#"{"semantic":{"enabled":true}}"#, key);
    let ask =
        |q: &str| format!(r#"{{"model":"gpt-4.1","temperature":0,"messages":[{{"role":"user","content":"{q}"}}]}}"#);
    let first = post(&s, &ask("What is the capital of France?"), &[]);
    assert_eq!((first.status, first.cache()), (200, "MISS"), "{}", first.text());
    let same = post(&s, &ask("what is the capital of france"), &[]);
    assert_eq!((same.cache(), same.header("x-holysheep-similarity")), ("SEMANTIC", Some("1.0000")), "{}", same.text());
    assert_eq!(same.json()["choices"], first.json()["choices"]);
    let streamed = streamed(&ask("The capital of France is what?"));
    let events = post(&s, &streamed, &[]);
    assert_eq!(events.cache(), "SEMANTIC");
    assert!(events.text().ends_with("data: [DONE]\n\n"), "{}", events.text());
    mock.mock.plan_embeddings(vec![Fault { status: Some(500), ..Fault::default() }]);
    let failed = post(&s, &ask("Name the largest ocean."), &[]);
    assert_eq!((failed.status, failed.cache()), (200, "MISS"));
    assert_eq!((mock.mock.calls(), mock.mock.embeddings()), (2, 4));
}

/// The component's budget after an embedding HolySheep answered with `status`: whether the
/// next question of the same length is still embedded (the budget must hold that call's
/// worst case and its embedding's beside it, with 150 micro-dollars to spare).
fn embedded_again_after_an_embedding_answered(status: u16) -> bool {
    let key = "sk-operator-component-embedding";
    let mock = Running::start(Some(key), 0).expect("mock");
    let ask =
        |q: &str| format!(r#"{{"model":"gpt-4.1","temperature":0,"messages":[{{"role":"user","content":"{q}"}}]}}"#);
    let (first, second) = ("Which river is the longest? A", "Which river is the longest? B");
    // gpt-4.1 at $1 per million both ways: the call's worst case is its body's bytes and
    // 4096 completion tokens; the embedding at $100 per million, its question's bytes.
    let call_worst = ask(second).len() as u64 + 4096;
    let embedding_worst = second.len() as u64 * 100;
    let budget = call_worst + embedding_worst + 150;
    let config = format!(
        r#"{{"semantic":{{"enabled":true}},
            "models":{{"gpt-4.1":{{"usd_per_mtok_input":1,"usd_per_mtok_output":1}},
                       "text-embedding-3-small":{{"usd_per_mtok_input":100}}}},
            "tenants":{{"batch":{{"keys_sha256":["{}"],"usd_per_day":{}}}}}}}"#,
        sha256_hex(b"batch-key"),
        budget as f64 / 1e6
    );
    let s = serve_keyed(&mock, &config, key);
    mock.mock.plan_embeddings(vec![Fault { status: Some(status), ..Fault::default() }]);
    let auth = [("authorization", "Bearer batch-key")];
    let r = post(&s, &ask(first), &auth);
    assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    let usage = &r.json()["usage"];
    let cost = usage["prompt_tokens"].as_u64().unwrap_or(0) + usage["completion_tokens"].as_u64().unwrap_or(0);
    assert!(cost < 150, "the first call cost {cost}, more than the room beside the worst cases");
    assert_eq!(mock.mock.embeddings(), 1);
    let r = post(&s, &ask(second), &auth);
    assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    mock.mock.embeddings() == 2
}

#[test]
fn the_component_charges_an_embedding_holysheep_refused_nothing_and_a_failed_one_its_worst_case() {
    assert!(embedded_again_after_an_embedding_answered(400), "a 400 (nothing billed) took from the budget");
    assert!(!embedded_again_after_an_embedding_answered(503), "a 503 (maybe billed) was not charged its worst case");
}

#[test]
fn the_component_governs_embeddings_responses_and_completions_and_refuses_other_paths() {
    let mock = Running::start(Some("sk-operator"), 0).expect("mock");
    let token = "hs-component-tenant";
    let config = format!(r#"{{"tenants":{{"a":{{"keys_sha256":["{}"]}}}}}}"#, sha256_hex(token.as_bytes()));
    let c = serve_keyed(&mock, &config, "sk-operator");
    let auth = format!("Bearer {token}");
    let headers = [("authorization", auth.as_str())];
    let calls = [
        ("/v1/embeddings", r#"{"model":"text-embedding-3-small","input":["one","two"]}"#),
        ("/v1/responses", r#"{"model":"gpt-4.1","input":"hi","store":false,"temperature":0}"#),
        ("/v1/completions", r#"{"model":"gpt-4.1","prompt":"once","temperature":0}"#),
    ];
    for (path, body) in calls {
        let first = request(c.addr, "POST", path, &headers, body.as_bytes()).expect("answer");
        let again = request(c.addr, "POST", path, &headers, body.as_bytes()).expect("answer");
        assert_eq!((first.status, first.header("x-holysheep-cache")), (200, Some("MISS")), "{path}: {}", first.text());
        assert_eq!((again.header("x-holysheep-cache"), again.json()), (Some("HIT"), first.json()), "{path}");
        assert_eq!(first.header("x-holysheep-tenant"), Some("a"));
    }
    assert_eq!(
        (mock.mock.embeddings(), mock.mock.calls_to("/v1/responses"), mock.mock.calls_to("/v1/completions")),
        (1, 1, 1)
    );
    assert_eq!(mock.mock.last_authorization().as_deref(), Some("Bearer sk-operator"));
    let kept = r#"{"model":"gpt-4.1","input":"keep me"}"#;
    for _ in 0..2 {
        let r = request(c.addr, "POST", "/v1/responses", &headers, kept.as_bytes()).expect("answer");
        assert_eq!(r.header("x-holysheep-cache"), Some("BYPASS"), "store defaults to true");
    }
    assert_eq!(mock.mock.calls_to("/v1/responses"), 3);
    let files = request(c.addr, "GET", "/v1/files", &headers, b"").expect("answer");
    assert_eq!((files.status, files.json()["error"]["code"].as_str()), (404, Some("unknown_url")));
    assert_eq!(mock.mock.calls_to("/v1/files"), 0, "never reached HolySheep");
}
