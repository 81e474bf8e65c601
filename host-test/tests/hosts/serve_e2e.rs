//! `host-test serve` passes the same black-box checks as Envoy (coalescing, the cache,
//! refusals): the built plugin on the wasmtime host, behind a real HTTP server, with the
//! mock HolySheep as its cluster.

use host_test::client::{request, Resp};
use host_test::envoy::wasm_path;
use host_test::mock::Running;
use host_test::serve::{start, ServeOptions, Serving};
use host_test::stack::{burst_held, count, prompt, PATH};
use std::collections::HashMap;

fn serve(mock: &Running, config: &str) -> Serving {
    start(ServeOptions {
        wasm: wasm_path(),
        config: config.to_owned(),
        listen: ([127, 0, 0, 1], 0).into(),
        clusters: HashMap::from([("holysheep".to_owned(), mock.addr)]),
        workers: 2,
        env: Vec::new(),
    })
    .expect("serve starts")
}

fn post(s: &Serving, body: &str, headers: &[(&str, &str)]) -> Resp {
    request(s.addr, "POST", PATH, headers, body.as_bytes()).expect("answer")
}

#[test]
fn serve_coalesces_caches_and_rejects_like_envoy() {
    // The leader's call is held until the VMs have taken in all 50, with a lease no leader
    // starved of the CPU on a loaded machine outlives (a waiter would rightly take it for
    // a dead leader's).
    let mock = Running::start(None, 0).expect("mock");
    let s = serve(&mock, r#"{"lock":{"lease_ms":60000}}"#);
    let body = prompt("served by wasmtime");
    let resps = burst_held(&mock, s.addr, &body, 50, || s.fed());
    assert_eq!(mock.mock.calls(), 1, "one upstream call for 50 callers");
    assert!(resps.iter().all(|r| r.status == 200 && r.body == resps[0].body));
    assert_eq!((count(&resps, "MISS"), count(&resps, "COALESCED")), (1, 49));

    let hit = post(&s, &body, &[("authorization", "Bearer a")]);
    assert_eq!((hit.cache(), hit.header("age").is_some()), ("HIT", true));
    let reordered =
        r#"{"temperature":0,"messages":[{"content":"served by wasmtime","role":"user"}],"model":"gpt-4.1"}"#;
    assert_eq!(post(&s, reordered, &[("authorization", "Bearer a")]).cache(), "HIT");
    assert_eq!(post(&s, &body, &[("authorization", "Bearer b")]).cache(), "MISS");
    assert_eq!(post(&s, &body, &[("authorization", "Bearer a"), ("cache-control", "no-store")]).cache(), "BYPASS");

    for (bad, status) in [("{oops", 400), (r#"{"model":"gpt-4.1"}"#, 400), ("", 400)] {
        let r = post(&s, bad, &[]);
        assert_eq!(r.status, status, "{}", r.text());
        assert!(r.json()["error"]["message"].is_string());
    }
    let small = serve(&mock, r#"{"max_body_bytes":16}"#);
    assert_eq!(post(&small, &body, &[]).status, 413);
    let models = request(s.addr, "GET", "/v1/models", &[], b"").expect("models");
    assert_eq!((models.status, models.header("x-holysheep-cache")), (200, None), "other routes pass through");
    assert_eq!(mock.mock.calls(), 3);
}
