//! Trust boundaries in real Envoy (2 workers) with the plugin: nothing a caller or an
//! upstream chooses decides where the operator's key goes, what is cached or which tenant a
//! request belongs to.

use host_test::client::{Conn, Resp};
use host_test::mock::{quoted, Fault, Running};
use host_test::stack::{burst_at, poll_until, prompt, prompt_for, Stack, PATH};
use host_test::stack::{key_digest, streamed};
use serde_json::Value;

const OPERATOR_KEY: &str = "sk-operator-7f3c9a1e5b2d";

/// A chat request with these extra header lines (each ending in CRLF) and this `host`.
fn raw_chat(host: &str, path: &str, extra: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nhost: {host}\r\n{extra}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Envoy with the operator's key (which the mock requires), its options tuned.
fn with_operator_key(config: &str, tune: impl FnOnce(&mut host_test::envoy::Options)) -> Stack {
    Stack::start_tuned(
        config,
        0,
        |o| {
            o.api_key = Some(OPERATOR_KEY.into());
            tune(o);
        },
        Some(OPERATOR_KEY),
    )
}

fn send_raw(s: &Stack, request: &[u8]) -> Resp {
    Conn::open(s.envoy.edge).and_then(|mut c| c.raw(request)).expect("edge answers")
}

#[test]
fn a_stream_whose_route_leads_elsewhere_is_refused_and_never_carries_the_key() {
    let internal = Running::start(None, 0).expect("internal service");
    let s = with_operator_key("{}", |o| o.internal_upstream = Some(internal.addr));
    let body = streamed(&prompt("route me elsewhere"));
    let r = send_raw(&s, &raw_chat("internal.example", PATH, "authorization: Bearer sk-client\r\n", &body));
    assert_eq!((r.status, r.error_code()), (421, "misdirected_request".to_owned()), "{}", r.text());
    assert_eq!(internal.mock.calls(), 0, "the other route's service got nothing");
    assert_eq!(internal.mock.last_authorization(), None);
    assert_eq!(s.calls(), 0, "nor HolySheep");
    // The same request on HolySheep's own route streams.
    let r = send_raw(&s, &raw_chat("edge", PATH, "authorization: Bearer sk-client\r\n", &body));
    assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    // A plain request is a callout to `upstream.cluster` whatever its host: answered.
    let plain = prompt("plain to elsewhere");
    let r = send_raw(&s, &raw_chat("internal.example", PATH, "authorization: Bearer sk-client\r\n", &plain));
    assert_eq!((r.status, r.cache()), (200, "MISS"));
    assert_eq!(internal.mock.calls(), 0);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

/// A path in `passthrough_paths` goes on with the operator's key only along a route to
/// HolySheep's cluster: on another host's route it is refused, and the service there never
/// sees the key.
#[test]
fn a_passed_path_whose_route_leads_elsewhere_is_refused_and_never_carries_the_key() {
    let internal = Running::start(None, 0).expect("internal service");
    let token = "hs-files-3e2d1c0b9a";
    let config = format!(
        r#"{{"tenants":{{"files":{{"keys_sha256":["{}"]}}}},"passthrough_paths":["/v1/files"]}}"#,
        key_digest(token)
    );
    let s = with_operator_key(&config, |o| o.internal_upstream = Some(internal.addr));
    let get = |host: &str| {
        format!("GET /v1/files HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\ncontent-length: 0\r\n\r\n")
            .into_bytes()
    };
    let r = send_raw(&s, &get("internal.example"));
    assert_eq!((r.status, r.error_code()), (421, "misdirected_request".to_owned()), "{}", r.text());
    assert_eq!(internal.mock.calls_to("/v1/files"), 0, "the other route's service got nothing");
    assert_eq!(internal.mock.last_authorization(), None);
    assert_eq!(s.mock.mock.calls_to("/v1/files"), 0, "nor HolySheep");
    // The same request on HolySheep's own route goes, with the operator's key.
    let r = send_raw(&s, &get("edge"));
    assert_eq!(s.mock.mock.calls_to("/v1/files"), 1, "{}", r.text());
    assert_eq!(s.mock.mock.last_authorization().as_deref(), Some(format!("Bearer {OPERATOR_KEY}").as_str()));
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_forwarded_stream_carries_no_query_string_and_no_client_header() {
    let s = Stack::start_with("{}", 0, Some(OPERATOR_KEY), Some(OPERATOR_KEY));
    let body = streamed(&prompt("strip my extras"));
    let extra = "authorization: Bearer sk-client\r\ncookie: session=secret\r\nx-internal-debug: 1\r\n\
                 openai-organization: org-client\r\naccept-encoding: gzip\r\n";
    let r = send_raw(&s, &raw_chat("edge", "/v1/chat/completions?api-version=1&debug=1", extra, &body));
    assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    assert_eq!(s.mock.mock.last_target(), PATH, "no query string reaches HolySheep");
    let names: Vec<String> = s.mock.mock.last_headers().into_iter().map(|(n, _)| n).collect();
    for gone in ["cookie", "x-internal-debug", "openai-organization", "accept-encoding"] {
        assert!(!names.iter().any(|n| n == gone), "{gone} reached HolySheep: {names:?}");
    }
    assert_eq!(s.mock.mock.last_authorization().as_deref(), Some(format!("Bearer {OPERATOR_KEY}").as_str()));
}

#[test]
fn only_answers_that_are_what_they_claim_are_stored() {
    let s = Stack::start(r#"{"retry":{"max_attempts":1}}"#, 0);
    let cases = [
        ("text/html", "<html><body>captive portal</body></html>"),
        ("application/json", r#"{"error":{"message":"overloaded","type":"server_error"}}"#),
    ];
    for (i, (content_type, raw)) in cases.iter().enumerate() {
        let body = prompt(&format!("an answer that is not one {i}"));
        let fault = Fault { body: Some((*raw).into()), content_type: Some((*content_type).into()), ..Fault::default() };
        s.mock.mock.plan(vec![fault]);
        let first = s.chat(&body, &[("authorization", "Bearer sk-a")]);
        assert_eq!((first.status, first.error_code()), (502, "upstream_invalid_answer".to_owned()), "{}", first.text());
        let again = s.chat(&body, &[("authorization", "Bearer sk-a")]);
        assert_eq!((again.status, again.cache()), (200, "MISS"), "{content_type}: not served from the cache");
        assert_eq!(again.json()["object"], "chat.completion");
    }
    assert_eq!(s.calls(), 4);
    // A stream request answered with a JSON 200 is no stream: not stored, not replayed.
    let body = streamed(&prompt("a stream answered in JSON"));
    let json = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"j"},"finish_reason":"stop"}]}"#;
    s.mock.mock.plan(vec![Fault {
        body: Some(json.into()),
        content_type: Some("application/json".into()),
        ..Fault::default()
    }]);
    let first = s.chat(&body, &[("authorization", "Bearer sk-a")]);
    assert_eq!((first.status, first.error_code()), (502, "upstream_invalid_answer".to_owned()), "{}", first.text());
    let again = s.chat(&body, &[("authorization", "Bearer sk-a")]);
    assert_eq!((again.status, again.cache()), (200, "MISS"));
    assert_eq!(again.header("content-type"), Some("text/event-stream"));
    assert_eq!(s.calls(), 6);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn holysheep_refusing_the_operators_key_is_the_edges_502_without_any_of_the_key() {
    // HolySheep accepts another key: it refuses the edge's, quoting part of it.
    let s = Stack::start_with("{}", 0, Some("sk-the-right-key-0000"), Some(OPERATOR_KEY));
    let fragment = quoted(OPERATOR_KEY);
    let tail = &OPERATOR_KEY[OPERATOR_KEY.len() - 4..];
    for body in [prompt("refused key plain"), streamed(&prompt("refused key stream"))] {
        let r = s.chat(&body, &[("authorization", "Bearer sk-client")]);
        assert_eq!((r.status, r.error_code()), (502, "upstream_auth_failed".to_owned()), "{}", r.text());
        assert!(!r.text().contains(tail) && !r.text().contains(&fragment), "{}", r.text());
        assert_eq!(r.header("content-type"), Some("application/json"));
    }
    assert_eq!(s.calls(), 2, "no retry or failover can do better with the same key");
    let log = s.envoy.log();
    assert!(log.contains("refused the key from $HOLYSHEEP_API_KEY (status 401)"), "{log}");
    assert!(!log.contains(tail), "the log holds no fragment of the key");
}

#[test]
fn a_repeated_tenant_credential_is_refused_before_anything_else() {
    let s = Stack::start(r#"{"cache":{"tenant_header":"x-tenant"}}"#, 0);
    let body = prompt("who am i");
    let twice = "x-tenant: verified-by-auth\r\nx-tenant: chosen-by-client\r\n";
    let r = send_raw(&s, &raw_chat("edge", PATH, twice, &body));
    assert_eq!((r.status, r.error_code()), (400, "ambiguous_tenant".to_owned()), "{}", r.text());
    // Served once under one tenant, a repeat with a second copy is still refused (no hot
    // copy or cache answers it).
    let once = s.chat(&body, &[("x-tenant", "verified-by-auth")]);
    assert_eq!(once.cache(), "MISS");
    let r = send_raw(&s, &raw_chat("edge", PATH, twice, &body));
    assert_eq!((r.status, r.error_code()), (400, "ambiguous_tenant".to_owned()));
    assert_eq!(s.calls(), 1);

    // Without a tenant header, `authorization` is the tenant.
    let s = Stack::start("{}", 0);
    let r = send_raw(&s, &raw_chat("edge", PATH, "authorization: Bearer a\r\nauthorization: Bearer b\r\n", &body));
    assert_eq!((r.status, r.error_code()), (400, "ambiguous_tenant".to_owned()), "{}", r.text());
    assert_eq!(s.calls(), 0);
}

#[test]
fn a_body_with_a_repeated_key_is_invalid_json_and_never_sent() {
    let s = Stack::start("{}", 0);
    for body in [
        r#"{"model":"gpt-4.1","model":"deepseek-v3","messages":[{"role":"user","content":"hi"}]}"#,
        r#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi","content":"other"}]}"#,
    ] {
        let r = s.chat(body, &[("authorization", "Bearer sk-a")]);
        assert_eq!((r.status, r.error_code()), (400, "invalid_json".to_owned()), "{body}: {}", r.text());
        assert!(r.json()["error"]["message"].as_str().is_some_and(|m| m.contains("appears twice")));
    }
    assert_eq!(s.calls(), 0);
}

#[test]
fn a_streamed_answer_keeps_its_logprobs_for_later_requests_in_both_forms() {
    let s = Stack::start("{}", 0);
    let plain = prompt("with logprobs").replacen('{', r#"{"logprobs":true,"#, 1);
    let expected = {
        let direct = host_test::client::request(s.mock.addr, "POST", PATH, &[], plain.as_bytes()).expect("mock");
        direct.json()["choices"][0]["logprobs"].clone()
    };
    assert!(expected["content"].as_array().is_some_and(|t| t.len() > 3), "the mock sends logprobs: {expected}");
    let calls = s.calls();
    let first = s.chat(&streamed(&plain), &[("authorization", "Bearer sk-a")]);
    assert_eq!((first.status, first.cache()), (200, "MISS"));
    let hit = s.chat(&plain, &[("authorization", "Bearer sk-a")]);
    assert_eq!(hit.cache(), "HIT");
    assert_eq!(hit.json()["choices"][0]["logprobs"], expected, "the reassembled answer kept them");
    let replayed = s.chat(&streamed(&plain), &[("authorization", "Bearer sk-a")]);
    assert_eq!(replayed.cache(), "HIT");
    let tokens: Vec<Value> = replayed
        .text()
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .flat_map(|v| v["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(Value::Array(tokens), expected["content"], "and the replayed stream sends them again");
    assert_eq!(s.calls(), calls + 1);
}

#[test]
fn over_http2_as_in_production_answers_keys_and_errors_are_the_same() {
    let s = with_operator_key(r#"{"retry":{"max_attempts":1}}"#, |o| o.upstream_h2 = true);
    let plain = s.chat(&prompt("over h2"), &[("authorization", "Bearer sk-client")]);
    assert_eq!((plain.status, plain.cache()), (200, "MISS"), "{}", plain.text());
    assert_eq!(s.mock.mock.last_version(), "HTTP/2.0");
    let stream = s.chat(&streamed(&prompt("over h2 streamed")), &[("authorization", "Bearer sk-client")]);
    assert_eq!((stream.status, stream.cache()), (200, "MISS"));
    assert!(stream.text().ends_with("data: [DONE]\n\n"));
    assert_eq!(s.mock.mock.last_version(), "HTTP/2.0");
    assert_eq!(s.chat(&prompt("over h2"), &[("authorization", "Bearer sk-client")]).cache(), "HIT");
    s.mock.mock.plan(vec![Fault { status: Some(429), retry_after: Some("7".into()), ..Fault::default() }]);
    let limited = s.chat(&prompt("limited over h2"), &[("cache-control", "no-store")]);
    assert_eq!((limited.status, limited.header("retry-after")), (429, Some("7")));
    assert_eq!(s.calls(), 3);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn every_waiter_of_a_failed_flight_gets_its_error_while_other_prompts_take_the_ways() {
    // One group of four lease ways, each call slow: other prompts' flights hold the other
    // three ways when the crowd's flight fails (an answer the cache does not hold). The
    // crowd's call is held until all 600 wait on it, however slowly they arrive.
    let s = Stack::start(r#"{"lock":{"slots":4},"retry":{"max_attempts":1}}"#, 300);
    s.mock.mock.plan(vec![Fault { status: Some(503), hold: true, ..Fault::default() }]);
    let crowd_body = prompt_for("deepseek-v3", "a crowd whose flight fails");
    let edge = s.envoy.edge;
    let crowd = std::thread::spawn(move || burst_at(edge, vec![crowd_body; 600], "Bearer a"));
    s.await_calls(1);
    poll_until(|| s.envoy.stat("http.edge.downstream_rq_active") == 600, "the crowd never arrived whole");
    // Meanwhile, a dense flow of other prompts: 32 clients, each one prompt after another.
    let others: Vec<_> = (0..32)
        .map(|c| {
            std::thread::spawn(move || {
                (0..6)
                    .map(|i| {
                        let body = prompt(&format!("another prompt {c}-{i}"));
                        host_test::client::request(
                            edge,
                            "POST",
                            PATH,
                            &[("authorization", "Bearer b")],
                            body.as_bytes(),
                        )
                        .expect("answer")
                    })
                    .collect::<Vec<Resp>>()
            })
        })
        .collect();
    // Other prompts' flights are in the air: the crowd's flight fails now.
    s.await_calls(4);
    s.mock.mock.release();
    let crowd = crowd.join().expect("crowd");
    let others: Vec<Resp> = others.into_iter().flat_map(|t| t.join().expect("others")).collect();
    let statuses: std::collections::BTreeMap<(u16, String), usize> =
        crowd.iter().fold(Default::default(), |mut m, r| {
            *m.entry((r.status, r.cache().to_owned())).or_default() += 1;
            m
        });
    assert_eq!(statuses.values().sum::<usize>(), 600);
    assert!(crowd.iter().all(|r| r.status == 503), "every waiter gets the flight's error: {statuses:?}");
    let crowd_calls = s.mock.mock.log().iter().filter(|(model, _)| model == "deepseek-v3").count();
    assert_eq!(crowd_calls, 1, "no waiter led a second flight: {statuses:?}");
    let lost = s.envoy.stats("waits_lost");
    assert_eq!(lost.get("wasmcustom.holysheep.other.waits_lost"), Some(&0), "no waiter found its answer gone");
    assert!(others.iter().all(|r| r.status == 200));
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_tenant_header_under_x_holysheep_is_refused_at_configuration() {
    let mock = Running::start(None, 0).expect("mock");
    let opts = host_test::envoy::Options::new(r#"{"cache":{"tenant_header":"x-holysheep-tenant"}}"#, mock.addr);
    let refused = host_test::envoy::Envoy::start(&opts).err().expect("Envoy refuses the filter's configuration");
    let log = refused.to_string();
    assert!(log.contains("cache.tenant_header: must not start with x-holysheep-"), "{log}");
}

#[test]
fn a_forwarded_stream_is_routed_by_nothing_the_client_sent_and_a_route_elsewhere_is_latched() {
    // HolySheep's route needs `x-tier: gold`. A client that sends it passes the first check,
    // but the stream that leaves carries none of the client's headers: Envoy routes it to
    // `internal`, which the operator's configuration chose for such requests. The edge sees
    // the answer come from there, refuses it and every stream after it.
    let internal = Running::start(None, 0).expect("internal service");
    let s = with_operator_key("{}", |o| o.gold_only_upstream = Some(internal.addr));
    let gold = "x-tier: gold\r\nauthorization: Bearer sk-client\r\n";
    let r = send_raw(&s, &raw_chat("edge", PATH, gold, &streamed(&prompt("gold, then not"))));
    assert_eq!((r.status, r.error_code()), (421, "misdirected_request".to_owned()), "{}", r.text());
    assert_eq!(internal.mock.calls(), 1, "the configuration's route for the edge's own streams");
    let headers: Vec<String> = internal.mock.last_headers().into_iter().map(|(n, _)| n).collect();
    assert!(!headers.iter().any(|n| n == "x-tier"), "nothing of the client's: {headers:?}");
    assert!(s.envoy.log().contains("streams are refused until the configuration changes"));
    // The latch is the process's, not one worker's: streams after it, each on a fresh
    // connection, until each of Envoy's two workers has taken at least one.
    // Connections each worker accepted (the only listener that takes any here is the edge's;
    // Envoy names a listener's stats by the address it was given, port 0 for these).
    let accepted = |w: u32| {
        let ends = format!(".worker_{w}.downstream_cx_total");
        let stats = s.envoy.stats(&ends);
        let mine: Vec<u64> = stats.iter().filter(|(n, _)| n.starts_with("listener.")).map(|(_, v)| *v).collect();
        assert!(!mine.is_empty(), "Envoy has no listener stat ending {ends}");
        mine.iter().sum::<u64>()
    };
    let before = [accepted(0), accepted(1)];
    let mut n = 0;
    while accepted(0) == before[0] || accepted(1) == before[1] {
        n += 1;
        assert!(n <= 64, "64 connections never reached both workers");
        let again = send_raw(&s, &raw_chat("edge", PATH, gold, &streamed(&prompt(&format!("gold again {n}")))));
        assert_eq!((again.status, again.error_code()), (421, "misdirected_request".to_owned()));
    }
    assert_eq!(internal.mock.calls(), 1, "latched on every worker: no stream leaves any more");
    assert_eq!(s.calls(), 0);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn the_call_to_holysheep_carries_the_callers_trace_context_and_only_a_valid_one() {
    let s = Stack::start_with("{}", 0, Some(OPERATOR_KEY), Some(OPERATOR_KEY));
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let state = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";
    let sent = |name: &str| s.mock.mock.last_headers().into_iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let extra = format!("traceparent: {parent}\r\ntracestate: {state}\r\n");
    for body in [prompt("traced answer"), streamed(&prompt("traced stream"))] {
        let r = send_raw(&s, &raw_chat("edge", PATH, &extra, &body));
        assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
        assert_eq!(sent("traceparent").as_deref(), Some(parent), "HolySheep's spans join the caller's trace");
        assert_eq!(sent("tracestate").as_deref(), Some(state));
    }
    // A malformed trace context is no error: the call goes without one.
    for bad in ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", "not a trace", "ff-00-00-00"] {
        let extra = format!("traceparent: {bad}\r\ntracestate: {state}\r\n");
        for body in [prompt(&format!("untraced {bad}")), streamed(&prompt(&format!("untraced stream {bad}")))] {
            let r = send_raw(&s, &raw_chat("edge", PATH, &extra, &body));
            assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
            assert_eq!((sent("traceparent"), sent("tracestate")), (None, None), "{bad}");
        }
    }
    assert_eq!(s.envoy.crashes(), Vec::<String>::new());
}
