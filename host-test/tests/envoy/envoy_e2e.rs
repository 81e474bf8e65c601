//! End-to-end: the built plugin in real Envoy (2 workers) in front of the mock HolySheep.

use host_test::client::{request, Conn, Resp};
use host_test::mock::Fault;
use host_test::stack::{count, prompt, Stack, PATH};

#[test]
fn two_hundred_identical_requests_make_one_upstream_call() {
    let s = Stack::start("{}", 1500);
    let body = prompt("what is a sheep?");
    let resps = s.burst(200, &body, "Bearer tenant-a");
    assert_eq!(s.mock.mock.calls(), 1, "one upstream call for 200 callers");
    assert!(resps.iter().all(|r| r.status == 200));
    assert_eq!(count(&resps, "MISS"), 1);
    assert_eq!(count(&resps, "COALESCED"), 199);
    assert!(resps.iter().all(|r| r.body == resps[0].body), "every caller gets the same answer");
    assert!(resps.iter().all(|r| r.header("x-holysheep-key") == resps[0].header("x-holysheep-key")));
    assert!(resps.iter().filter(|r| r.cache() == "COALESCED").all(|r| r.header("age").is_some()));
    // Both workers took connections: coalescing crossed threads.
    let per_worker: Vec<u64> = (0..2)
        // Only the edge listener has taken connections in this test.
        .map(|w| s.envoy.stats(&format!(".worker_{w}.downstream_cx_total")).values().sum())
        .collect();
    assert!(per_worker.iter().all(|&n| n > 0), "connections per worker: {per_worker:?}");

    let again = s.chat(&body, &[("authorization", "Bearer tenant-a")]);
    assert_eq!((again.cache(), again.body.clone()), ("HIT", resps[0].body.clone()));
    assert!(again.header("age").and_then(|a| a.parse::<u64>().ok()).is_some());

    let reordered =
        r#"{"temperature":0.0,"messages":[{"content":"what is a sheep?","role":"user"}],"model":"gpt-4.1"}"#;
    assert_eq!(s.chat(reordered, &[("authorization", "Bearer tenant-a")]).cache(), "HIT");
    assert_eq!(s.mock.mock.calls(), 1);

    let other_tenant = s.chat(&body, &[("authorization", "Bearer tenant-b")]);
    let warmer =
        s.chat(&body.replace(r#""temperature":0"#, r#""temperature":0.3"#), &[("authorization", "Bearer tenant-a")]);
    let system = body.replace("[{", r#"[{"role":"system","content":"answer in French"},{"#);
    let with_system = s.chat(&system, &[("authorization", "Bearer tenant-a")]);
    for r in [&other_tenant, &warmer, &with_system] {
        assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    }
    assert_eq!(s.mock.mock.calls(), 4);
}

#[test]
fn waiters_are_answered_when_the_leader_disconnects() {
    let s = Stack::start("{}", 1500);
    let body = prompt("leader leaves");
    let mut leader = Conn::open(s.envoy.edge).unwrap();
    leader.send_only("POST", PATH, &[("authorization", "Bearer t")], body.as_bytes()).unwrap();
    s.await_calls(1);
    let waiters: Vec<_> = (0..6)
        .map(|_| {
            let (edge, body) = (s.envoy.edge, body.clone());
            std::thread::spawn(move || {
                request(edge, "POST", PATH, &[("authorization", "Bearer t")], body.as_bytes()).unwrap()
            })
        })
        .collect();
    drop(leader);
    let resps: Vec<Resp> = waiters.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        resps.iter().all(|r| r.status == 200 && r.cache() == "COALESCED"),
        "{:?}",
        resps.iter().map(Resp::cache).collect::<Vec<_>>()
    );
    assert_eq!(s.mock.mock.calls(), 1);
    assert_eq!(s.chat(&body, &[("authorization", "Bearer t")]).cache(), "HIT");
}

#[test]
fn an_upstream_error_reaches_every_waiter_and_is_not_cached() {
    let s = Stack::start(r#"{"retry":{"max_attempts":1}}"#, 0);
    s.mock.mock.plan(vec![Fault {
        status: Some(503),
        retry_after: Some("7".into()),
        delay_ms: 1500,
        ..Fault::default()
    }]);
    let body = prompt("error please");
    let resps = s.burst(20, &body, "Bearer t");
    assert_eq!(s.mock.mock.calls(), 1);
    assert!(resps.iter().all(|r| r.status == 503), "{:?}", resps.iter().map(|r| r.status).collect::<Vec<_>>());
    assert!(resps.iter().all(|r| r.header("retry-after") == Some("7")));
    assert!(resps.iter().all(|r| r.json()["error"]["message"].is_string()));
    assert_eq!((count(&resps, "MISS"), count(&resps, "COALESCED")), (1, 19));
    let after = s.chat(&body, &[("authorization", "Bearer t")]);
    assert_eq!((after.status, after.cache()), (200, "MISS"), "the error was not cached");

    // A reset connection (Envoy answers the callout with its own text 503) becomes an
    // OpenAI-shaped error for the leader and its waiters.
    s.mock.mock.plan(vec![Fault { reset: true, delay_ms: 1000, ..Fault::default() }]);
    let resps = s.burst(5, &prompt("reset please"), "Bearer t");
    assert_eq!(s.mock.mock.calls(), 3);
    assert!(resps.iter().all(|r| r.status == 503), "{:?}", resps.iter().map(|r| r.status).collect::<Vec<_>>());
    assert!(resps.iter().all(|r| r.json()["error"]["type"] == "upstream_error"), "{}", resps[0].text());
    assert!(resps.iter().all(|r| r.header("content-type") == Some("application/json")));
}

#[test]
fn bad_input_gets_openai_errors_and_nothing_reaches_holysheep() {
    let s = Stack::start(r#"{"max_body_bytes": 4096}"#, 0);
    let deep =
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":{}1{}}}]}}"#, "[".repeat(100), "]".repeat(100));
    let cases: Vec<(Vec<u8>, u16, Option<&str>)> = vec![
        (b"".to_vec(), 400, None),
        (b"{not json".to_vec(), 400, None),
        (b"\xff\xfe\xfd".to_vec(), 400, None),
        (br#"{"messages":[{"role":"user","content":"x"}]}"#.to_vec(), 400, Some("model")),
        (br#"{"model":"gpt-4.1"}"#.to_vec(), 400, Some("messages")),
        (br#"{"model":"gpt-4.1","messages":"hi"}"#.to_vec(), 400, Some("messages")),
        (
            br#"{"model":"gpt-4.1","messages":[{"role":"user"}],"temperature":"warm"}"#.to_vec(),
            400,
            Some("temperature"),
        ),
        (br#"{"model":"gpt-4.1","messages":[{"role":"user"}],"max_tokens":1e999}"#.to_vec(), 400, None),
        (deep.into_bytes(), 400, None),
        (vec![b' '; 5000], 413, None),
    ];
    for (body, status, param) in &cases {
        let r = request(s.envoy.edge, "POST", PATH, &[], body).unwrap();
        let e = &r.json()["error"];
        assert_eq!(
            r.status,
            *status,
            "{}: {}",
            String::from_utf8_lossy(body).chars().take(60).collect::<String>(),
            r.text()
        );
        assert!(e["message"].is_string() && e["type"].is_string() && e.get("code").is_some(), "{}", r.text());
        assert_eq!(e["param"].as_str(), *param, "{}", r.text());
    }
    // A declared length over the limit is refused before any of the body is sent.
    let mut raw = std::net::TcpStream::connect(s.envoy.edge).unwrap();
    std::io::Write::write_all(
        &mut raw,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-length: 999999\r\n\r\n",
    )
    .unwrap();
    let mut answer = String::new();
    let _ = std::io::Read::read_to_string(&mut raw, &mut answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("request_too_large"), "{answer}");
    assert_eq!(s.mock.mock.calls(), 0, "nothing reached HolySheep");
    assert_eq!(s.chat(&prompt("still alive?"), &[]).status, 200, "Envoy still serves");
    let models = request(s.envoy.edge, "GET", "/v1/models", &[], b"").unwrap();
    assert_eq!(models.status, 200);
    assert!(models.header("x-holysheep-cache").is_none(), "other routes pass through untouched");
}

#[test]
fn the_api_key_replaces_client_auth_and_never_leaks() {
    const KEY: &str = "sk-holysheep-secret-4b1d";
    let s = Stack::start_with("{}", 0, Some(KEY), Some(KEY));
    let r = s.chat(&prompt("with key"), &[("authorization", "Bearer client-token")]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.mock.mock.last_authorization().as_deref(), Some(&*format!("Bearer {KEY}")));
    let hit = s.chat(&prompt("with key"), &[("authorization", "Bearer client-token")]);
    assert_eq!(hit.cache(), "HIT");
    for resp in [&r, &hit] {
        assert!(!resp.text().contains(KEY) && resp.headers.iter().all(|(_, v)| !v.contains(KEY)));
    }
    let log = s.envoy.log();
    assert!(log.contains("upstream key from environment"), "the plugin saw the key");
    assert!(!log.contains(KEY), "the key appears in Envoy's log");
}

#[test]
fn cache_control_directives_and_a_stream_of_a_cached_answer() {
    let s = Stack::start("{}", 0);
    let body = prompt("bypass me");
    let first = s.chat(&body, &[("cache-control", "no-store")]);
    assert_eq!((first.status, first.cache()), (200, "BYPASS"));
    assert_eq!(s.chat(&body, &[]).cache(), "MISS", "no-store stored nothing");
    assert_eq!(s.chat(&body, &[]).cache(), "HIT");
    assert_eq!(s.chat(&body, &[("cache-control", "no-cache")]).cache(), "MISS");
    assert_eq!(s.chat(&body, &[("cache-control", "max-age=3600")]).cache(), "HIT", "young enough");
    let stream = s.chat(&body.replace(r#""temperature":0"#, r#""temperature":0,"stream":true"#), &[]);
    assert_eq!((stream.status, stream.cache()), (200, "HIT"), "one entry serves both forms");
    assert_eq!(stream.header("content-type"), Some("text/event-stream"));
    assert!(stream.text().ends_with("data: [DONE]\n\n"), "{}", stream.text());
    assert_eq!(s.mock.mock.calls(), 3);
}

#[test]
fn the_production_config_is_accepted_by_envoy() {
    use host_test::envoy::{envoy_bin, wasm_path, workspace_root};
    let yaml = std::fs::read_to_string(workspace_root().join("envoy/production.yaml")).unwrap();
    let yaml = yaml.replace("/etc/envoy/holysheep_edge.wasm", &wasm_path().display().to_string());
    let dir = workspace_root().join("target/e2e");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("production-{}.yaml", std::process::id()));
    std::fs::write(&path, yaml).unwrap();
    let out = std::process::Command::new(envoy_bin())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&path)
        .env("HOLYSHEEP_API_KEY", "sk-validate")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && log.contains("OK"), "{log}");
    assert!(log.contains("upstream key from environment"), "{log}");
}

#[test]
fn a_slow_upstream_times_out_as_an_openai_504_for_every_waiter() {
    let s = Stack::start(r#"{"upstream":{"timeout_ms":400}}"#, 0);
    s.mock.mock.plan(vec![Fault { slow_body_ms: 3000, ..Fault::default() }]);
    let resps = s.burst(4, &prompt("too slow"), "Bearer t");
    assert_eq!(s.mock.mock.calls(), 1);
    assert!(resps.iter().all(|r| r.status == 504), "{:?}", resps.iter().map(Resp::text).collect::<Vec<_>>());
    assert!(resps.iter().all(|r| r.json()["error"]["code"] == "upstream_timeout"));
    let after = s.chat(&prompt("too slow"), &[("authorization", "Bearer t")]);
    assert_eq!((after.status, after.cache()), (200, "MISS"), "the timeout was not cached");
}

/// A server behind nginx serves these paths as chat completions: each is validated,
/// cached and coalesced like the canonical one, never passed through.
#[test]
fn every_spelling_of_the_chat_path_is_governed_and_a_model_cannot_inject_headers() {
    let s = Stack::start("{}", 0);
    let auth = [("authorization", "Bearer t")];
    let body = prompt("path variants");
    assert_eq!(s.chat(&body, &auth).cache(), "MISS");
    for path in ["/v1/chat/completions/", "//v1/chat/completions", "/v1/chat//completions", "/v1/chat/%63ompletions"] {
        let r = request(s.envoy.edge, "POST", path, &auth, body.as_bytes()).expect("answer");
        assert_eq!((r.status, r.cache()), (200, "HIT"), "{path}");
        let bad = request(s.envoy.edge, "POST", path, &auth, b"{not json").expect("answer");
        assert_eq!((bad.status, bad.json()["error"]["code"].as_str()), (400, Some("invalid_json")), "{path}");
    }
    let long = "m".repeat(5_000);
    for model in [r"gpt\u0000x", r"gpt\r\nx-evil: 1", long.as_str()] {
        let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"x"}}]}}"#);
        let r = s.chat(&body, &auth);
        assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some("model")), "{}", r.text());
        assert!(r.header("x-holysheep-model").is_none());
    }
    assert_eq!(s.calls(), 1, "nothing else reached HolySheep");
}

#[test]
fn anonymous_callers_are_refused_when_a_tenant_is_required() {
    let s = Stack::start(r#"{"cache":{"require_tenant":true}}"#, 0);
    let body = prompt("who are you");
    for headers in [vec![], vec![("authorization", " ")]] {
        let r = s.chat(&body, &headers);
        assert_eq!((r.status, r.json()["error"]["code"].as_str()), (401, Some("missing_tenant")), "{}", r.text());
    }
    assert_eq!(s.calls(), 0, "nothing reached HolySheep");
    assert_eq!(s.chat(&body, &[("authorization", "Bearer t")]).status, 200);
}

/// Two prompts in flight whose keys share a lease group (`lock.slots: 2` is one group of
/// two ways): the second still coalesces (it leads from the other way) instead of sending
/// every identical request upstream alone.
#[test]
fn prompts_sharing_a_lease_group_still_coalesce() {
    let s = Stack::start(r#"{"lock":{"slots":2}}"#, 0);
    let (a, b) = (prompt("collide a"), prompt("collide b"));
    let before = s.calls();
    s.mock.mock.set_latency_ms(800);
    let edge = s.envoy.edge;
    let leader = std::thread::spawn(move || {
        request(edge, "POST", PATH, &[("authorization", "Bearer t"), ("cache-control", "no-cache")], a.as_bytes())
    });
    s.await_calls(before + 1);
    let mut crowd: Vec<std::thread::JoinHandle<std::io::Result<Resp>>> = Vec::new();
    for _ in 0..10 {
        let b = b.clone();
        crowd.push(std::thread::spawn(move || {
            request(edge, "POST", PATH, &[("authorization", "Bearer t"), ("cache-control", "no-cache")], b.as_bytes())
        }));
    }
    let answers: Vec<Resp> = crowd.into_iter().map(|h| h.join().expect("thread").expect("answer")).collect();
    assert!(leader.join().expect("thread").expect("answer").status == 200);
    assert!(answers.iter().all(|r| r.status == 200));
    assert_eq!(s.calls(), before + 2, "one call per prompt, not one per request");
}

/// One tenant asks 40 prompts three times each; another then sends two embeddings lists of
/// 2,048 new inputs and 1,500 one-off prompts, more than the default cache's 4,096 slots
/// can hold. The first tenant's 40 are all still HITs: what is asked once passes through a
/// full cache without displacing what is asked again.
#[test]
fn a_scan_through_a_full_cache_leaves_the_prompts_asked_again() {
    let s = Stack::start("{}", 0);
    let hot: Vec<String> = (0..40).map(|i| prompt(&format!("alpha's question {i}"))).collect();
    for round in 0..3 {
        let answers = s.burst_of(hot.clone(), "Bearer alpha");
        let expected = if round == 0 { "MISS" } else { "HIT" };
        assert_eq!(count(&answers, expected), 40, "round {round}");
    }
    assert_eq!(s.calls(), 40);
    for list in 0..2 {
        let inputs: Vec<String> = (0..2_048).map(|i| format!("beta's item {list}-{i}")).collect();
        let body = serde_json::json!({"model": "text-embedding-3-small", "input": inputs, "dimensions": 8});
        let r = request(
            s.envoy.edge,
            "POST",
            "/v1/embeddings",
            &[("authorization", "Bearer beta")],
            &body.to_string().into_bytes(),
        )
        .expect("edge answers");
        assert_eq!((r.status, r.json()["data"].as_array().map(Vec::len)), (200, Some(2_048)), "{}", r.text());
    }
    for chunk in 0..15 {
        let once: Vec<String> = (0..100).map(|i| prompt(&format!("beta's one-off {chunk}-{i}"))).collect();
        assert_eq!(count(&s.burst_of(once, "Bearer beta"), "MISS"), 100);
    }
    let upstream = || (s.calls(), s.mock.mock.embeddings());
    assert_eq!(upstream(), (40 + 1_500, 2), "the scan itself went upstream");
    let after = s.burst_of(hot, "Bearer alpha");
    assert_eq!(count(&after, "HIT"), 40, "alpha's prompts after the scan");
    assert_eq!(upstream(), (40 + 1_500, 2), "and cost no call");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}
