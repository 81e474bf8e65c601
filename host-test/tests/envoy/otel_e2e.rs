//! What a collector receives from the edge in real Envoy, over OTLP/gRPC: the spans of
//! Envoy's OpenTelemetry tracer and the records of its OpenTelemetry access logger, as
//! `envoy/production.yaml` configures them, on a receiver built on the official protocol
//! definitions.

use holysheep_otlp::{Attributes, Kind, Received, Receiver};
use host_test::client::{request, Conn};
use host_test::envoy::Shell;
use host_test::mock::Fault;
use host_test::stack::{key_digest, poll_until, prompt, streamed, Stack, PATH};
use std::time::Duration;

const OPERATOR: &str = "sk-operator-otel-41c2";
const SEARCH: &str = "hs-search-otel-9b0e";

/// The caller's trace and span ids of the `n`th request: a trace of its own each.
fn caller(n: u8) -> (String, String) {
    (
        format!("{:032x}", 0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_0000u128 + n as u128),
        format!("{:016x}", 0xf067_aa0b_a900 + n as u64),
    )
}

fn traceparent(n: u8) -> String {
    let (trace, span) = caller(n);
    format!("00-{trace}-{span}-01")
}

fn span_of(got: &Received, n: u8) -> Option<&holysheep_otlp::Span> {
    got.spans.iter().find(|s| s.trace_id == caller(n).0)
}

fn attr<'a>(a: &'a Attributes, name: &str) -> &'a str {
    a.get(name).map_or("(absent)", String::as_str)
}

/// The latest point of `gen_ai.client.token.usage` for chat calls of gpt-4.1 and this
/// token type: (count, sum).
fn token_usage(got: &Received, token_type: &str) -> Option<(u64, f64)> {
    let wanted = [
        ("gen_ai.request.model", "gpt-4.1"),
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.token.type", token_type),
        ("gen_ai.provider.name", "holysheep"),
    ];
    got.points
        .iter()
        .filter(|p| p.metric == "gen_ai.client.token.usage")
        .filter(|p| wanted.iter().all(|(k, v)| attr(&p.attributes, k) == *v))
        .filter_map(|p| match p.kind {
            Kind::Histogram { count, sum, .. } if count > 0 => Some((count, sum)),
            _ => None,
        })
        .next_back()
}

#[test]
fn a_collector_receives_a_miss_its_coalesced_waiters_and_a_hit_with_what_holysheep_billed() {
    a_collector_receives_what_holysheep_billed(Shell::Wasm);
}

#[test]
fn from_the_native_module_a_collector_receives_the_same() {
    a_collector_receives_what_holysheep_billed(Shell::Native);
}

fn a_collector_receives_what_holysheep_billed(shell: Shell) {
    let otlp = Receiver::start().expect("the receiver starts");
    let config = format!(
        r#"{{"log_fields":true,"models":{{"gpt-4.1":{{"usd_per_mtok_input":2.0,"usd_per_mtok_output":8.0}}}},
            "tenants":{{"search":{{"keys_sha256":["{}"],"priority":"critical"}}}}}}"#,
        key_digest(SEARCH)
    );
    let s = Stack::start_tuned(
        &config,
        0,
        |o| {
            o.api_key = Some(OPERATOR.into());
            o.otel = Some(otlp.addr);
            o.shell = shell;
        },
        Some(OPERATOR),
    );
    let edge = s.envoy.edge;
    let body = prompt("what the collector receives");
    let send = move |n: u8, body: String| {
        std::thread::spawn(move || {
            let (auth, parent) = (format!("Bearer {SEARCH}"), traceparent(n));
            let headers = [("authorization", auth.as_str()), ("traceparent", parent.as_str())];
            request(edge, "POST", PATH, &headers, body.as_bytes()).expect("an answer")
        })
    };
    // The leader's call is held at HolySheep until five waiters have joined its flight.
    s.mock.mock.plan(vec![Fault { hold: true, ..Fault::default() }]);
    let leader = send(0, body.clone());
    s.await_calls(1);
    let waiters: Vec<_> = (1..=5).map(|n| send(n, body.clone())).collect();
    poll_until(|| s.envoy.stat("http.edge.downstream_rq_active") == 6, "the five waiters never arrived");
    s.mock.mock.release();
    let answers: Vec<_> = std::iter::once(leader).chain(waiters).map(|h| h.join().expect("a client")).collect();
    let caches: Vec<&str> = answers.iter().map(|r| r.cache()).collect();
    assert_eq!(caches, ["MISS", "COALESCED", "COALESCED", "COALESCED", "COALESCED", "COALESCED"]);
    let hit = send(6, body).join().expect("a client");
    assert_eq!(hit.cache(), "HIT");
    assert_eq!(s.calls(), 1);
    let sent = s.mock.mock.last_headers().into_iter().find(|(n, _)| n == "traceparent").map(|(_, v)| v);
    assert_eq!(sent, Some(traceparent(0)), "HolySheep's call joins the leader's caller's trace");

    let got = otlp.wait_for(Duration::from_secs(30), |g| (0..=6).all(|n| span_of(g, n).is_some()) && g.logs.len() >= 7);
    let billed = &s.mock.mock.billed()[0];
    let (input, output) =
        (billed["prompt_tokens"].as_u64().unwrap_or(0), billed["completion_tokens"].as_u64().unwrap_or(0));
    assert!(input > 0 && output > 0, "{billed}");
    let micro = input * 2 + output * 8;
    let cost = format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000);
    let key = hit.header("x-holysheep-key").expect("a key").to_owned();

    for n in 0..=6u8 {
        let span = span_of(&got, n).unwrap_or_else(|| panic!("no span of request {n}: {got:#?}"));
        assert_eq!(span.parent_span_id, caller(n).1, "the edge's span is a child of its caller's");
        assert_eq!(attr(&span.resource, "service.name"), "holysheep-edge");
        let a = &span.attributes;
        let (cache, spent, saved, attempts) = match n {
            0 => ("MISS", cost.as_str(), "(absent)", "1"),
            6 => ("HIT", "0.000000", cost.as_str(), "0"),
            _ => ("COALESCED", "0.000000", cost.as_str(), "0"),
        };
        let seen = |names: &[&str]| names.iter().map(|name| attr(a, name).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            seen(&["holysheep.cache", "holysheep.cost_usd", "holysheep.saved_usd", "holysheep.upstream_attempts"]),
            [cache, spent, saved, attempts],
            "request {n}: {a:#?}"
        );
        assert_eq!(
            seen(&[
                "gen_ai.operation.name",
                "gen_ai.provider.name",
                "gen_ai.request.model",
                "gen_ai.response.model",
                "gen_ai.usage.input_tokens",
                "gen_ai.usage.output_tokens",
                "gen_ai.usage.cache_read.input_tokens",
            ]),
            ["chat", "holysheep", "gpt-4.1", "gpt-4.1", &input.to_string(), &output.to_string(), "0"],
            "request {n}: what HolySheep billed for the one call"
        );
        assert_eq!(
            seen(&["holysheep.key", "holysheep.tenant", "holysheep.priority", "http.status_code"]),
            [key.as_str(), "search", "critical", "200"],
            "request {n}: the flight's key ties the waiters' and the HIT's spans to the leader's"
        );

        // The access logger's record of the same request: in the same trace, the same values.
        let log = got.logs.iter().find(|l| l.trace_id == caller(n).0).expect("its log record");
        assert_eq!(log.body, "POST /v1/chat/completions 200");
        for (name, value) in a.iter().filter(|(k, _)| k.starts_with("gen_ai.") || k.starts_with("holysheep.")) {
            assert_eq!(attr(&log.attributes, name), value, "request {n}'s log record: {name}");
        }
    }
    // The token histogram: HolySheep's one billed call, once, whatever the six answers.
    let tokens = |token_type: &str| {
        let got = otlp.wait_for(Duration::from_secs(30), |g| token_usage(g, token_type).is_some());
        token_usage(&got, token_type)
    };
    // Envoy's histograms keep two significant digits of each value: the sum is within half
    // a bucket (5%) of the tokens billed; the count is exact.
    for (token_type, billed) in [("input", input), ("output", output)] {
        let (count, sum) =
            tokens(token_type).unwrap_or_else(|| panic!("no {token_type} tokens: {:#?}", otlp.received()));
        assert_eq!(count, 1, "{token_type}: one billed call");
        assert!((sum - billed as f64).abs() <= billed as f64 * 0.05, "{token_type}: {sum} for {billed} billed");
    }
    // Beside it, the exact totals: the model's token counters, as the stats sink sends them,
    // the model a tag (and the tenant's copies under a name of their own).
    let counter = |name: &str, tag: (&str, &str)| {
        let got = otlp.received();
        got.points.iter().rev().find(|p| p.metric == name && attr(&p.attributes, tag.0) == tag.1).map(|p| p.kind)
    };
    for (name, billed) in [("prompt_tokens", input), ("completion_tokens", output)] {
        let sum = Some(Kind::Sum { value: billed as f64, monotonic: true, delta: false });
        let model = format!("wasmcustom.holysheep.{name}");
        assert_eq!(counter(&model, ("gen_ai.request.model", "gpt-4.1")), sum, "{model}");
        let tenant = format!("wasmcustom.holysheep.tenant.{name}");
        assert_eq!(counter(&tenant, ("holysheep.tenant", "search")), sum, "{tenant}");
    }
    // Everything the collector received by now: the spans, the log records and the metrics
    // (the counters above came with a flush of the stats sink).
    let all = otlp.received();
    assert!(all.points.iter().any(|p| p.metric == "wasmcustom.holysheep.tenant.prompt_tokens"), "metrics flushed");
    assert!(all.logs.len() >= 7 && (0..=6).all(|n| span_of(&all, n).is_some()), "spans and logs received");
    let text = format!("{all:?}");
    assert!(!text.contains(SEARCH) && !text.contains(OPERATOR), "no token or key leaves for the collector");
    // The ledger beside the spans: Envoy's counters of what the edge saved, per model and per
    // tenant, are the spans' sum.
    for counter in ["holysheep.gpt-4.1.cost_saved_microusd", "holysheep.tenant.search.cost_saved_microusd"] {
        assert_eq!(s.envoy.stat(&format!("wasmcustom.{counter}")), 6 * micro, "{counter}");
    }
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

/// The latest point of a timing histogram for chat calls of gpt-4.1: (count, how many
/// values were at most `bound` milliseconds).
fn timing(got: &Received, metric: &str, bound: f64) -> Option<(u64, u64)> {
    let wanted = [("gen_ai.request.model", "gpt-4.1"), ("gen_ai.operation.name", "chat")];
    got.points
        .iter()
        .filter(|p| p.metric == metric && wanted.iter().all(|(k, v)| attr(&p.attributes, k) == *v))
        .filter_map(|p| match p.kind {
            Kind::Histogram { count, .. } if count > 0 => {
                let at_most = p.buckets.iter().filter(|(b, _)| *b <= bound).map(|(_, n)| n).sum();
                Some((count, at_most))
            }
            _ => None,
        })
        .next_back()
}

#[test]
fn each_answers_duration_and_a_streams_first_chunk_reach_the_collector_in_milliseconds() {
    each_answers_duration_reaches_the_collector(Shell::Wasm);
}

#[test]
fn the_native_modules_durations_reach_the_collector_alike() {
    each_answers_duration_reaches_the_collector(Shell::Native);
}

fn each_answers_duration_reaches_the_collector(shell: Shell) {
    // HolySheep takes a second before it answers: a MISS lasts longer than 640 ms (a
    // bucket bound), a HIT far less.
    let otlp = Receiver::start().expect("the receiver starts");
    let config = r#"{"log_fields":true,"models":{"gpt-4.1":{}}}"#;
    let s = Stack::start_tuned(
        config,
        1_000,
        |o| {
            o.otel = Some(otlp.addr);
            o.shell = shell;
        },
        None,
    );
    let stream = s.chat(&streamed(&prompt("timed stream")), &[]);
    assert_eq!((stream.status, stream.cache()), (200, "MISS"));
    assert_eq!(s.chat(&prompt("timed answer"), &[]).cache(), "MISS");
    // Four HITs on one connection (one worker): after the first, its own kept copy answers.
    let mut conn = Conn::open(s.envoy.edge).expect("a connection");
    for _ in 0..4 {
        let hit = conn.request("POST", PATH, &[], prompt("timed answer").as_bytes()).expect("an answer");
        assert_eq!(hit.cache(), "HIT");
    }
    let arrived = |metric: &'static str, count: u64| {
        let got = otlp.wait_for(Duration::from_secs(30), |g| timing(g, metric, 640.0).is_some_and(|(c, _)| c == count));
        timing(&got, metric, 640.0)
    };
    assert_eq!(
        arrived("gen_ai.client.operation.duration", 6),
        Some((6, 4)),
        "six answers, of which only the four HITs within 640 ms"
    );
    assert_eq!(
        arrived("gen_ai.client.operation.time_to_first_chunk", 1),
        Some((1, 0)),
        "the stream alone, its first chunk after HolySheep's second"
    );
    let got = otlp.received();
    let mut provider = got.points.iter().filter(|p| p.metric == "gen_ai.client.operation.duration");
    assert!(
        provider.clone().count() > 0 && provider.all(|p| attr(&p.attributes, "gen_ai.provider.name") == "holysheep")
    );
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_forward_nodes_durations_carry_its_role() {
    // A forward node times the requests it serves under its own stats; the sink sends them
    // under the same GenAI name as an owner's, told apart by `holysheep.role`.
    let otlp = Receiver::start().expect("the receiver starts");
    let config = r#"{"role":"forward","log_fields":true,"models":{"gpt-4.1":{}}}"#;
    let s = Stack::start_tuned(config, 0, |o| o.otel = Some(otlp.addr), None);
    let answer = s.chat(&prompt("timed on a forward node"), &[]);
    assert_eq!(answer.status, 200, "{}", answer.text());
    let forward = |g: &Received| {
        g.points.iter().any(|p| {
            p.metric == "gen_ai.client.operation.duration"
                && attr(&p.attributes, "holysheep.role") == "forward"
                && attr(&p.attributes, "gen_ai.request.model") == "gpt-4.1"
                && matches!(p.kind, Kind::Histogram { count: 1, .. })
        })
    };
    let got = otlp.wait_for(Duration::from_secs(30), forward);
    assert!(forward(&got), "{:#?}", got.points.iter().filter(|p| p.metric.starts_with("gen_ai")).collect::<Vec<_>>());
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_malformed_traceparent_is_no_error_and_its_request_is_still_logged() {
    let otlp = Receiver::start().expect("the receiver starts");
    let s = Stack::start_tuned(
        r#"{"log_fields":true}"#,
        0,
        |o| {
            o.api_key = Some(OPERATOR.into());
            o.otel = Some(otlp.addr);
        },
        Some(OPERATOR),
    );
    let bad = "00-00000000000000000000000000000000-00f067aa0ba902b7-01";
    let r = s.chat(&prompt("a bad trace"), &[("traceparent", bad)]);
    assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    let good = s.chat(&prompt("a good trace"), &[("traceparent", &traceparent(7))]);
    assert_eq!((good.status, good.cache()), (200, "MISS"), "{}", good.text());
    let sent = s.mock.mock.last_headers().into_iter().find(|(n, _)| n == "traceparent").map(|(_, v)| v);
    assert_eq!(sent, Some(traceparent(7)));
    let got = otlp.wait_for(Duration::from_secs(30), |g| g.logs.len() >= 2 && span_of(g, 7).is_some());
    assert_eq!(got.logs.len(), 2, "{got:#?}");
    let untraced = got.logs.iter().find(|l| l.trace_id != caller(7).0).expect("the bad one's record");
    assert_eq!(attr(&untraced.attributes, "holysheep.cache"), "MISS");
    // Envoy's tracer records no span for a trace context it cannot parse (its choice, made
    // before any filter runs); the traced request's span arrives, and only it.
    assert_eq!(got.spans.len(), 1, "{got:#?}");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}
