//! Streams in real Envoy (2 workers) and in the wasi:http component, with the mock
//! HolySheep: live MISS, cached and coalesced in both forms, tool calls and usage through
//! the unmodified openai client, broken streams, and the buckets.

use host_test::client::{Conn, Resp};
use host_test::component_host::serve::{start, ComponentOptions, Serving};
use host_test::envoy::component_path;
use host_test::mock::{Fault, Running};
use host_test::stack::streamed;
use host_test::stack::{burst_at, count, poll_until, prompt, Stack, PATH};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;

/// The text and usage a client assembles from an event stream (or a JSON answer).
fn assembled(r: &Resp) -> (String, Value) {
    if r.header("content-type") != Some("text/event-stream") {
        let v = r.json();
        return (v["choices"][0]["message"]["content"].as_str().unwrap_or("").to_owned(), v["usage"].clone());
    }
    let (mut text, mut usage) = (String::new(), Value::Null);
    for data in r.text().split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
        let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (text, usage)
}

/// Runs `openai_stream.py` (the unmodified openai client) with these calls.
fn openai(s: &Stack, calls: Value) -> Vec<Value> {
    openai_at(s.envoy.edge, calls)
}

fn openai_at(edge: SocketAddr, calls: Value) -> Vec<Value> {
    let root = host_test::envoy::workspace_root();
    host_test::stack::results_of(
        std::process::Command::new(root.join(".venv/bin/python"))
            .arg(root.join("host-test/tests/openai_stream.py"))
            .arg(format!("http://{edge}/v1"))
            .arg(calls.to_string()),
    )
}

#[test]
fn a_streamed_miss_reaches_the_client_event_by_event_and_is_then_served_in_both_forms() {
    let s = Stack::start("{}", 0);
    s.mock.mock.plan(vec![Fault { hold_after_events: Some(3), ..Fault::default() }]);
    let body = streamed(&prompt("stream me live"));
    let mut conn = Conn::open(s.envoy.edge).and_then(|c| c.read_timeout(Duration::from_secs(20))).expect("connect");
    // The openai client below sends `Bearer sk-client`: the same tenant.
    conn.send_only("POST", PATH, &[("authorization", "Bearer sk-client")], body.as_bytes()).expect("send");
    // The mock holds the rest of the stream until released: the client can only have the
    // first event now if the edge passes events on as they come.
    let head = conn.read_until("\"role\":\"assistant\"").expect("the first event before the mock sent the rest");
    assert!(head.contains("x-holysheep-cache: MISS"), "{head}");
    s.mock.mock.release();
    let rest = conn.read_until("data: [DONE]").expect("the rest of the stream");
    assert!(!rest.contains("\"choices\":[]"), "no usage event for a client that did not ask: {rest}");
    let upstream: Value = serde_json::from_slice(&s.mock.mock.last_body()).expect("json");
    assert_eq!(upstream["stream_options"]["include_usage"], true, "the edge always asks for the usage");

    let results = openai(
        &s,
        json!([
            {"prompt": "stream me live", "stream": false},
            {"prompt": "stream me live", "stream": true, "include_usage": true},
            {"prompt": "stream me live", "stream": true, "include_usage": false},
        ]),
    );
    assert_eq!(s.calls(), 1, "both forms served from the one entry");
    let caches: Vec<&str> = results.iter().map(|r| r["cache"].as_str().unwrap_or("")).collect();
    assert_eq!(caches, ["HIT", "HIT", "HIT"]);
    assert!(results[0]["text"].as_str().is_some_and(|t| t.contains("stream me live")));
    assert!(results.iter().all(|r| r["text"] == results[0]["text"] && r["id"] == results[0]["id"]));
    assert_eq!(results[1]["usage"], results[0]["usage"], "the stored usage, streamed");
    assert!(results[1]["usage"]["total_tokens"].as_u64().is_some_and(|t| t > 0));
    assert!(results[2]["usage"].is_null(), "no usage event unless asked");
}

/// Over HTTP/2 a request's body usually ends in the frame that carries it: the stream is
/// sent along its route from that very callback, and its rewritten body must go with it.
#[test]
fn a_streamed_miss_over_http2_reaches_holysheep_with_its_body() {
    let s = Stack::start("{}", 0);
    let body = streamed(&prompt("stream me over h2"));
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "--http2-prior-knowledge", "-i", "--data-binary", "@-"])
        .args(["-H", "content-type: application/json", "-H", "authorization: Bearer sk-client"])
        .arg(format!("http://{}{PATH}", s.envoy.edge))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(body.as_bytes())?;
            child.wait_with_output()
        })
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("HTTP/2 200"), "{text}");
    assert!(text.contains("x-holysheep-cache: MISS") && text.ends_with("data: [DONE]\n\n"), "{text}");
    let upstream: Value = serde_json::from_slice(&s.mock.mock.last_body()).expect("the body HolySheep got");
    assert!(upstream["messages"].to_string().contains("stream me over h2"), "{upstream}");
    assert_eq!(upstream["stream_options"]["include_usage"], true);
    assert_eq!(s.calls(), 1);
    assert_eq!(s.envoy.crashes(), Vec::<String>::new());
}

/// One request over HTTP/2 whose body ends with trailers (its last data frame does not end
/// the stream): the status, the `x-holysheep-cache` label and the body the client got.
fn h2_with_trailers(addr: SocketAddr, body: Vec<u8>) -> (u16, String, String) {
    use http_body_util::{channel::Channel, BodyExt};
    use hyper::body::Bytes;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await.expect("HTTP/2");
        tokio::spawn(conn);
        let (mut tx, rx) = Channel::<Bytes, std::convert::Infallible>::new(2);
        let request = hyper::Request::post(format!("http://{addr}{PATH}"))
            .header("content-type", "application/json")
            .header("authorization", "Bearer sk-client")
            .body(rx)
            .expect("a request");
        let answer = tokio::spawn(sender.send_request(request));
        tx.send_data(Bytes::from(body)).await.expect("the body sent");
        let mut trailers = hyper::HeaderMap::new();
        trailers.insert("x-checksum", hyper::header::HeaderValue::from_static("sent"));
        tx.send_trailers(trailers).await.expect("the trailers sent");
        drop(tx);
        let answer = tokio::time::timeout(Duration::from_secs(10), answer).await;
        let response = answer.expect("answered within 10 s").expect("the task").expect("a response");
        let status = response.status().as_u16();
        let cache = response.headers().get("x-holysheep-cache").and_then(|v| v.to_str().ok()).unwrap_or("");
        let cache = cache.to_owned();
        let whole = tokio::time::timeout(Duration::from_secs(10), response.into_body().collect()).await;
        let text = whole.expect("the whole body within 10 s").expect("a body").to_bytes();
        (status, cache, String::from_utf8_lossy(&text).into_owned())
    })
}

/// Trailers end a body whose last data frame did not: the request is handled when they
/// arrive, and the stream it is sent along carries the rewritten body.
#[test]
fn a_streamed_miss_whose_body_ends_with_trailers_reaches_holysheep_with_its_body() {
    let s = Stack::start("{}", 0);
    let body = streamed(&prompt("stream me, then trailers"));
    let (status, cache, text) = h2_with_trailers(s.envoy.edge, body.into_bytes());
    assert_eq!((status, cache.as_str()), (200, "MISS"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let upstream: Value = serde_json::from_slice(&s.mock.mock.last_body()).expect("the body HolySheep got");
    assert!(upstream["messages"].to_string().contains("stream me, then trailers"), "{upstream}");
    assert_eq!(upstream["stream_options"]["include_usage"], true, "the edge's rewrite went upstream");
    assert_eq!(s.calls(), 1);
    // The same request without a stream, ended by trailers too: answered from the cache
    // the stream filled.
    let plain = prompt("stream me, then trailers");
    let (status, cache, text) = h2_with_trailers(s.envoy.edge, plain.into_bytes());
    assert_eq!((status, cache.as_str()), (200, "HIT"), "{text}");
    assert!(
        serde_json::from_str::<Value>(&text).is_ok_and(|v| v["usage"]["total_tokens"].as_u64() > Some(0)),
        "{text}"
    );
    assert_eq!(s.calls(), 1);
    assert_eq!(s.envoy.crashes(), Vec::<String>::new());
}

#[test]
fn identical_streams_coalesce_and_mixed_forms_share_one_call() {
    let s = Stack::start("{}", 800);
    let body = prompt("thirty at once");
    let resps = burst_at(s.envoy.edge, vec![streamed(&body); 30], "Bearer t");
    assert_eq!(s.calls(), 1, "30 identical streams, one upstream call");
    assert!(resps.iter().all(|r| r.status == 200 && r.header("content-type") == Some("text/event-stream")));
    assert_eq!((count(&resps, "MISS"), count(&resps, "COALESCED")), (1, 29));
    let texts: Vec<String> = resps.iter().map(|r| assembled(r).0).collect();
    assert!(texts.iter().all(|t| t == &texts[0] && t.contains("thirty at once")), "{texts:?}");

    let body = prompt("ten and ten");
    let bodies: Vec<String> = (0..20).map(|i| if i % 2 == 0 { streamed(&body) } else { body.clone() }).collect();
    let resps = burst_at(s.envoy.edge, bodies, "Bearer t");
    assert_eq!(s.calls(), 2, "10 streamed + 10 plain identical requests, one upstream call");
    for (i, r) in resps.iter().enumerate() {
        let sse = r.header("content-type") == Some("text/event-stream");
        assert_eq!((r.status, sse), (200, i % 2 == 0), "each answered in its own form");
    }
    let texts: Vec<String> = resps.iter().map(|r| assembled(r).0).collect();
    assert!(texts.iter().all(|t| t == &texts[0] && t.contains("ten and ten")), "{texts:?}");
    // Streams count like any request: two leaders and their 48 followers, two calls.
    let stats = s.envoy.stats("wasmcustom.holysheep.other.");
    let stat = |name: &str| stats.get(&format!("wasmcustom.holysheep.other.{name}")).copied();
    let counted = ["requests_miss", "requests_coalesced", "requests_hit", "upstream_calls", "retries"].map(stat);
    assert_eq!(counted, [Some(2), Some(48), Some(0), Some(2), Some(0)], "{stats:?}");
    assert!(stat("completion_tokens").is_some_and(|t| t > 0), "the streams' usage is counted: {stats:?}");
}

#[test]
fn tool_calls_and_usage_survive_stream_to_plain_and_plain_to_stream() {
    let s = Stack::start("{}", 0);
    let results = openai(
        &s,
        json!([
            {"prompt": "please call a tool A", "tools": true, "stream": true, "include_usage": true},
            {"prompt": "please call a tool A", "tools": true, "stream": false},
            {"prompt": "please call a tool B", "tools": true, "stream": false},
            {"prompt": "please call a tool B", "tools": true, "stream": true, "include_usage": true},
        ]),
    );
    assert_eq!(s.calls(), 2);
    let caches: Vec<&str> = results.iter().map(|r| r["cache"].as_str().unwrap_or("")).collect();
    assert_eq!(caches, ["MISS", "HIT", "MISS", "HIT"]);
    for pair in results.chunks(2) {
        let tools = &pair[0]["tools"];
        assert_eq!(tools.as_array().map(Vec::len), Some(1), "{pair:?}");
        assert_eq!(tools[0]["name"], "lookup");
        assert!(tools[0]["id"].as_str().is_some_and(|id| id.starts_with("call_")));
        let args: Value = serde_json::from_str(tools[0]["arguments"].as_str().unwrap_or("")).expect("arguments");
        assert!(args["q"].as_str().is_some_and(|q| q.contains("call a tool")));
        assert_eq!(pair[1]["tools"], *tools, "the tool call survives the cache");
        assert_eq!(pair[1]["usage"], pair[0]["usage"]);
        assert!(pair[0]["usage"].is_object());
    }
}

#[test]
fn a_stream_cut_off_is_not_stored_and_its_waiters_are_served() {
    let s = Stack::start("{}", 300);
    s.mock.mock.set_event_delay_ms(20);
    s.mock.mock.plan(vec![Fault { cut_after_events: Some(4), ..Fault::default() }]);
    let body = prompt("cut me off");
    let mut leader = Conn::open(s.envoy.edge).expect("connect");
    leader.send_only("POST", PATH, &[("authorization", "Bearer t")], streamed(&body).as_bytes()).expect("send");
    s.await_calls(1);
    let bodies: Vec<String> = (0..6).map(|i| if i % 2 == 0 { streamed(&body) } else { body.clone() }).collect();
    let waiters = burst_at(s.envoy.edge, bodies, "Bearer t");
    let cut = leader.read_response().map(|r| r.text()).unwrap_or_default();
    assert!(!cut.contains("[DONE]"), "the leader's stream was cut: {cut}");
    assert!(waiters.iter().all(|r| r.status == 200), "{:?}", waiters.iter().map(|r| r.status).collect::<Vec<_>>());
    let texts: Vec<String> = waiters.iter().map(|r| assembled(r).0).collect();
    assert!(texts.iter().all(|t| t == &texts[0] && t.contains("cut me off")), "whole answers: {texts:?}");
    assert_eq!(s.calls(), 2, "one of the waiters led a new flight");
    let again = s.chat(&body, &[("authorization", "Bearer t")]);
    assert_eq!((again.cache(), assembled(&again).0), ("HIT", texts[0].clone()), "the whole answer was stored");
}

#[test]
fn streams_are_held_to_the_buckets_before_any_byte() {
    let s = Stack::start(r#"{"models":{"gpt-4.1":{"requests_per_minute":2}}}"#, 0);
    let resps: Vec<Resp> = (0..3).map(|i| s.chat(&streamed(&prompt(&format!("bucket {i}"))), &[])).collect();
    assert_eq!(resps.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 200, 429]);
    let limited = &resps[2];
    assert_eq!(limited.header("content-type"), Some("application/json"), "an error, not a stream");
    assert_eq!(limited.json()["error"]["code"], "rate_limit_exceeded");
    assert!(limited.header("retry-after").is_some());
    assert_eq!(s.calls(), 2);
    let stats = s.envoy.stats("holysheep.gpt-4.1.");
    assert_eq!(stats.get("wasmcustom.holysheep.gpt-4.1.requests_miss"), Some(&3));
    assert_eq!(stats.get("wasmcustom.holysheep.gpt-4.1.upstream_calls"), Some(&2));
    assert!(stats.get("wasmcustom.holysheep.gpt-4.1.completion_tokens").is_some_and(|t| *t > 0), "{stats:?}");
}

#[test]
fn a_stream_is_retried_by_the_route_before_its_first_byte_and_errors_reach_its_waiters() {
    let config = r#"{"models":{"gpt-4.1":{"requests_per_minute":6,"burst":100}},"retry":{"max_attempts":2}}"#;
    let s = Stack::start(config, 0);
    let stat = |name: &str| s.envoy.stat(&format!("wasmcustom.holysheep.gpt-4.1.{name}"));
    s.mock.mock.plan(vec![Fault { status: Some(503), ..Fault::default() }]);
    let retried = s.chat(&streamed(&prompt("retry me")), &[]);
    assert_eq!((retried.status, retried.cache()), (200, "MISS"));
    assert!(assembled(&retried).0.contains("retry me"));
    assert_eq!(s.calls(), 2, "one 503, then the retry");
    // The router's attempt is the edge's: counted, and charged to the bucket.
    assert_eq!((stat("upstream_calls"), stat("retries")), (2, 1));
    let hit = s.chat(&prompt("retry me"), &[]);
    assert_eq!(hit.cache(), "HIT");
    assert_eq!(hit.header("x-ratelimit-remaining-requests"), Some("98"), "two requests taken");
    // The edge's attempts, not the route's two retries: two 503s end it.
    s.mock.mock.plan(vec![Fault { status: Some(503), ..Fault::default() }; 3]);
    let failed = s.chat(&streamed(&prompt("fail me twice")), &[]);
    assert_eq!(failed.status, 503);
    assert_eq!(s.calls(), 4, "retry.max_attempts: 2, whatever the route's retry_policy says");
    assert_eq!((stat("upstream_calls"), stat("retries")), (4, 2));
    s.mock.mock.plan(Vec::new());

    let refused = Fault { status: Some(400), delay_ms: 300, ..Fault::default() };
    s.mock.mock.plan(vec![refused]);
    let resps = burst_at(s.envoy.edge, vec![streamed(&prompt("refuse me")); 4], "Bearer t");
    assert_eq!(s.calls(), 5, "a 400 is not retried, and the waiters share it");
    for r in &resps {
        assert_eq!((r.status, r.header("content-type")), (400, Some("application/json")), "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "mock_error");
    }
}

#[test]
fn the_shipped_route_does_not_retry_a_providers_429_on_a_stream() {
    let s = Stack::start(r#"{"retry":{"max_attempts":3}}"#, 0);
    s.mock.mock.plan(vec![Fault { status: Some(429), ..Fault::default() }]);
    let limited = s.chat(&streamed(&prompt("limited by the provider")), &[]);
    assert_eq!(limited.status, 429, "HolySheep's 429 reaches the client: {}", limited.text());
    assert_eq!(s.calls(), 1, "the chat route's retry_policy adds no 429 of its own");
}

#[test]
fn a_stream_whose_client_leaves_after_router_retries_counts_every_attempt() {
    let config = r#"{"models":{"gpt-4.1":{"requests_per_minute":6,"burst":100}},"retry":{"max_attempts":3}}"#;
    let s = Stack::start(config, 0);
    let stat = |name: &str| s.envoy.stat(&format!("wasmcustom.holysheep.gpt-4.1.{name}"));
    let hang = Fault { delay_ms: 10_000, ..Fault::default() };
    s.mock.mock.plan(vec![Fault { status: Some(503), ..Fault::default() }; 2].into_iter().chain([hang]).collect());
    let mut conn = Conn::open(s.envoy.edge).expect("connect");
    let body = streamed(&prompt("left during the third attempt"));
    conn.send_only("POST", PATH, &[("authorization", "Bearer t")], body.as_bytes()).expect("sent");
    s.await_calls(3);
    // The client leaves before any answer's headers came back.
    drop(conn);
    poll_until(|| stat("upstream_calls") == 3, "the three attempts were never counted");
    assert_eq!(stat("retries"), 2);
    let next = s.chat(&prompt("after the one that left"), &[]);
    assert_eq!(next.header("x-ratelimit-remaining-requests"), Some("96"), "three requests taken, then this one");
}

#[test]
fn a_provider_429_on_a_stream_holds_the_bucket_and_its_waiters_get_the_retry_after() {
    let config = r#"{"models":{"gpt-4.1":{"requests_per_minute":600}},"retry":{"max_attempts":1},
                    "rate_limit":{"max_provider_hold_ms":3000}}"#;
    let s = Stack::start(config, 0);
    s.mock.mock.plan(vec![Fault {
        status: Some(429),
        retry_after: Some("2".into()),
        delay_ms: 300,
        ..Fault::default()
    }]);
    let resps = burst_at(s.envoy.edge, vec![streamed(&prompt("limit me")); 4], "Bearer t");
    assert_eq!(s.calls(), 1, "a 429 is not retried by the router");
    for r in &resps {
        assert_eq!((r.status, r.header("retry-after")), (429, Some("2")), "leader and waiters: {}", r.text());
    }
    // The bucket holds for HolySheep's retry-after, as after a plain call's 429.
    let held = s.chat(&streamed(&prompt("right after")), &[]);
    assert_eq!((held.status, held.json()["error"]["code"].as_str()), (429, Some("rate_limit_exceeded")));
    assert_eq!(s.calls(), 1, "refused by the edge, not sent");
    assert_eq!(s.envoy.stat("wasmcustom.holysheep.gpt-4.1.provider_rate_limited"), 1);
}

fn component(mock: &Running) -> Serving {
    start(ComponentOptions {
        wasm: component_path(),
        listen: ([127, 0, 0, 1], 0).into(),
        upstream: mock.addr,
        env: vec![("HOLYSHEEP_CONFIG".to_owned(), "{}".to_owned())],
    })
    .expect("component serves")
}

#[test]
fn the_component_streams_a_miss_live_and_serves_every_form_from_one_entry() {
    let mock = Running::start(None, 0).expect("mock");
    let c = component(&mock);
    mock.mock.plan(vec![Fault { hold_after_events: Some(3), ..Fault::default() }]);
    let mut conn = Conn::open(c.addr).and_then(|c| c.read_timeout(Duration::from_secs(20))).expect("connect");
    let body = streamed(&prompt("component live"));
    conn.send_only("POST", PATH, &[("authorization", "Bearer sk-client")], body.as_bytes()).expect("send");
    let head = conn.read_until("\"role\":\"assistant\"").expect("the first event before the mock sent the rest");
    assert!(head.contains("x-holysheep-cache: MISS"), "{head}");
    assert!(head.contains("cache-control: max-age=3600"), "kept for the cache's TTL, as the plugin says: {head}");
    mock.mock.release();
    conn.read_until("data: [DONE]").expect("the rest of the stream");
    let results = openai_at(
        c.addr,
        json!([
            {"prompt": "component live", "stream": false},
            {"prompt": "component live", "stream": true, "include_usage": true},
            {"prompt": "please call a tool C", "tools": true, "stream": true, "include_usage": true},
            {"prompt": "please call a tool C", "tools": true, "stream": false},
        ]),
    );
    assert_eq!(mock.mock.calls(), 2);
    let caches: Vec<&str> = results.iter().map(|r| r["cache"].as_str().unwrap_or("")).collect();
    assert_eq!(caches, ["HIT", "HIT", "MISS", "HIT"]);
    assert_eq!(results[0]["text"], results[1]["text"]);
    assert_eq!(results[0]["usage"], results[1]["usage"]);
    assert_eq!(results[2]["tools"], results[3]["tools"]);
    assert_eq!(results[2]["tools"][0]["name"], "lookup");
    assert_eq!(results[2]["usage"], results[3]["usage"]);
}

#[test]
fn the_component_coalesces_streams_with_plain_requests_and_survives_a_cut() {
    let mock = Running::start(None, 600).expect("mock");
    let c = component(&mock);
    let body = prompt("component crowd");
    let bodies: Vec<String> = (0..20).map(|i| if i % 2 == 0 { streamed(&body) } else { body.clone() }).collect();
    // The mock holds the leader's call until the component handles all twenty (not a
    // race against its latency on a loaded machine).
    mock.mock.plan(vec![Fault { hold: true, ..Fault::default() }]);
    let addr = c.addr;
    let burst = std::thread::spawn(move || burst_at(addr, bodies, "Bearer t"));
    poll_until(|| c.handling() == 20, "the component never took in every caller");
    mock.mock.release();
    let resps = burst.join().expect("the crowd");
    assert_eq!(mock.mock.calls(), 1, "10 streamed + 10 plain identical requests, one upstream call");
    let texts: Vec<String> = resps.iter().map(|r| assembled(r).0).collect();
    assert!(texts.iter().all(|t| t == &texts[0] && t.contains("component crowd")), "{texts:?}");
    for (i, r) in resps.iter().enumerate() {
        assert_eq!(r.header("content-type") == Some("text/event-stream"), i % 2 == 0, "its own form");
    }

    mock.mock.set_event_delay_ms(20);
    mock.mock.plan(vec![Fault { cut_after_events: Some(4), ..Fault::default() }]);
    let body = prompt("component cut");
    let mut leader = Conn::open(c.addr).expect("connect");
    leader.send_only("POST", PATH, &[("authorization", "Bearer t")], streamed(&body).as_bytes()).expect("send");
    poll_until(|| mock.mock.calls() >= 2, "the cut stream never started");
    let waiters = burst_at(c.addr, vec![streamed(&body), body.clone(), streamed(&body), body.clone()], "Bearer t");
    let cut = leader.read_response().map(|r| r.text()).unwrap_or_default();
    assert!(!cut.contains("[DONE]"), "the leader's stream was cut: {cut}");
    assert!(waiters.iter().all(|r| r.status == 200));
    let texts: Vec<String> = waiters.iter().map(|r| assembled(r).0).collect();
    assert!(texts.iter().all(|t| t == &texts[0] && t.contains("component cut")), "{texts:?}");
    assert_eq!(mock.mock.calls(), 3, "one waiter led a new flight");
}
