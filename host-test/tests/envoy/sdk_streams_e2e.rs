//! Streamed completions and Responses share the cache and the flight with their plain
//! form, proven through the unmodified OpenAI SDKs (Python and Node) in real Envoy: a
//! stream's MISS is stored and served plain and streamed, a plain answer is replayed as
//! the events the SDKs check one by one, a crowd of streams makes one call, and a stream
//! cut before its terminal event is never stored.

use host_test::client::{request, Resp};
use host_test::mock::Fault;
use host_test::stack::key_digest;
use host_test::stack::{burst_to, count, poll_until, results_of, Stack};
use serde_json::{json, Value};
use std::net::SocketAddr;

const OPERATOR_KEY: &str = "sk-operator-5d1c9e2b7a";
const TOKEN: &str = "hs-agents-8c7b6a5f4e";
/// gpt-4.1 at $10 / $30 per million input / output tokens: every charge a whole number of
/// micro-dollars.
const MODELS: &str = r#"{"gpt-4.1":{"usd_per_mtok_input":10,"usd_per_mtok_output":30}}"#;

/// One verified tenant, `agents`, with a day's budget (its Responses ids are signed).
fn start() -> Stack {
    let config = format!(
        r#"{{"models":{MODELS},"retry":{{"max_attempts":1}},
            "tenants":{{"agents":{{"keys_sha256":["{}"],"usd_per_day":5}}}}}}"#,
        key_digest(TOKEN)
    );
    Stack::start_with(&config, 0, Some(OPERATOR_KEY), Some(OPERATOR_KEY))
}

/// Runs an SDK's script (`python` or `node`) with these steps (see openai_streams.py).
fn sdk(edge: SocketAddr, which: &str, steps: Value) -> Vec<Value> {
    let root = host_test::envoy::workspace_root();
    let mut command = match which {
        "python" => {
            let mut c = std::process::Command::new(root.join(".venv/bin/python"));
            c.arg(root.join("host-test/tests/openai_streams.py"));
            c
        }
        _ => {
            let mut c = std::process::Command::new("node");
            c.arg(root.join("host-test/sdk-node/openai_streams.mjs"));
            c
        }
    };
    results_of(command.arg(format!("http://{edge}/v1")).arg(TOKEN).arg(steps.to_string()))
}

fn caches(r: &[Value]) -> Vec<&str> {
    r.iter().map(|x| x["cache"].as_str().unwrap_or("-")).collect()
}

fn call(api: &str, input: &str, stream: bool, logprobs: bool) -> Value {
    json!({"api": api, "input": input, "stream": stream, "logprobs": logprobs})
}

/// The events HolySheep streams for a one-message response, and the edge replays for it,
/// repeats collapsed.
const RESPONSE_EVENTS: [&str; 9] = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
];

/// MISS streamed, then HIT plain and streamed, for both APIs, and a plain MISS served
/// streamed: every object the SDK ends with is the same, whichever form made the entry.
fn one_entry_serves_both_forms(which: &'static str) {
    let s = start();
    let r = sdk(
        s.envoy.edge,
        which,
        json!([
            call("responses", "stream first", true, true),
            call("responses", "stream first", false, true),
            call("responses", "stream first", true, true),
            call("responses", "plain first", false, false),
            call("responses", "plain first", true, false),
            call("completions", "complete first", true, true),
            call("completions", "complete first", false, true),
            call("completions", "complete first", true, true),
        ]),
    );
    assert_eq!(caches(&r), ["MISS", "HIT", "HIT", "MISS", "HIT", "MISS", "HIT", "HIT"], "{r:#?}");
    assert!(r.iter().all(|x| x["status"] == 200), "{r:#?}");
    // Responses: HolySheep's stream, the stored answer and the edge's replay are one object.
    let response = &r[0]["object"];
    let text = response["output"][0]["content"][0]["text"].as_str().unwrap_or_default();
    assert!(text.ends_with("to: stream first"), "{response}");
    assert_eq!((&r[1]["object"], &r[2]["object"]), (response, response), "stored and replayed whole");
    assert!(response["id"].as_str().is_some_and(|id| id.contains("_hs")), "the tenant's id is signed: {response}");
    assert_eq!(r[3]["object"], r[4]["object"], "a plain answer streams as the same object");
    for x in [&r[0], &r[2], &r[4]] {
        assert_eq!(x["events"], json!(RESPONSE_EVENTS), "every event, in OpenAI's order: {x}");
        assert_eq!(x["sequence"], true, "sequence numbers from 0 without a gap: {x}");
        let whole = &x["object"]["output"][0]["content"][0];
        assert_eq!((&x["text"], &x["sdk_text"]), (&whole["text"], &whole["text"]), "the deltas make the text");
    }
    let logprobs = &response["output"][0]["content"][0]["logprobs"];
    assert!(logprobs.as_array().is_some_and(|l| l.len() > 3), "{logprobs}");
    assert_eq!((&r[0]["logprobs"], &r[2]["logprobs"]), (logprobs, logprobs), "the deltas carry every logprob");
    assert!(r[0]["object"]["usage"]["output_tokens"].as_u64().is_some_and(|n| n > 0));
    // Completions: the chunks a client accumulates are the plain answer, log probabilities too.
    let completion = &r[5]["object"];
    assert!(completion["choices"][0]["text"].as_str().is_some_and(|t| t.ends_with("of: complete first")));
    assert!(completion["choices"][0]["logprobs"]["tokens"].as_array().is_some_and(|t| t.len() > 3), "{completion}");
    assert_eq!((&r[6]["object"], &r[7]["object"]), (completion, completion), "{r:#?}");
    let m = &s.mock.mock;
    assert_eq!((m.calls_to("/v1/responses"), m.calls_to("/v1/completions")), (2, 1), "one call per entry");
    // What the tenant was charged is what HolySheep billed for those three calls.
    let billed: u64 = ["/v1/responses", "/v1/completions"]
        .iter()
        .flat_map(|p| m.billed_at(p))
        .map(|u| {
            let n = |names: [&str; 2]| names.iter().find_map(|f| u[*f].as_u64()).unwrap_or(0);
            n(["input_tokens", "prompt_tokens"]) * 10 + n(["output_tokens", "completion_tokens"]) * 30
        })
        .sum();
    assert!(billed > 0);
    assert_eq!(s.envoy.stat("wasmcustom.holysheep.tenant.agents.cost_spent_microusd"), billed);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn the_python_sdk_reads_one_entry_streamed_and_plain_for_completions_and_responses() {
    one_entry_serves_both_forms("python");
}

#[test]
fn the_node_sdk_reads_one_entry_streamed_and_plain_for_completions_and_responses() {
    one_entry_serves_both_forms("node");
}

/// Streamed and plain calls of both APIs at once, the mock holding its answers until all
/// are in: one call per API, and every client ends with the same object.
fn crowds_coalesce(which: &'static str) {
    let s = start();
    s.mock.mock.plan_api(vec![Fault { hold: true, ..Fault::default() }; 2]);
    let calls: Vec<Value> = (0..8)
        .map(|i| call(if i < 4 { "responses" } else { "completions" }, "all at once", i % 2 == 0, false))
        .collect();
    let (edge, steps) = (s.envoy.edge, json!([calls]));
    let crowd = std::thread::spawn(move || sdk(edge, which, steps));
    let m = &s.mock.mock;
    poll_until(|| m.calls_to("/v1/responses") == 1 && m.calls_to("/v1/completions") == 1, "both leaders called");
    poll_until(|| s.envoy.stat("http.edge.downstream_rq_active") == 8, "the six followers never arrived");
    m.release();
    m.release();
    let r = crowd.join().expect("the SDK's crowd");
    assert_eq!(caches(&r).iter().filter(|c| **c == "MISS").count(), 2, "{r:#?}");
    assert_eq!(caches(&r).iter().filter(|c| **c == "COALESCED").count(), 6, "{r:#?}");
    assert!(r[..4].iter().all(|x| x["object"] == r[0]["object"]), "{r:#?}");
    assert!(r[4..].iter().all(|x| x["object"] == r[4]["object"]), "{r:#?}");
    assert_eq!((m.calls_to("/v1/responses"), m.calls_to("/v1/completions")), (1, 1));
}

#[test]
fn python_sdk_crowds_of_streamed_and_plain_calls_coalesce() {
    crowds_coalesce("python");
}

#[test]
fn node_sdk_crowds_of_streamed_and_plain_calls_coalesce() {
    crowds_coalesce("node");
}

/// The `response` an event stream ends with (`response.completed`), and how many events
/// it carried.
fn completed(r: &Resp) -> (Value, usize) {
    let text = r.text();
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let last = events.iter().find(|e| e["type"] == "response.completed").map(|e| e["response"].clone());
    (last.unwrap_or(Value::Null), events.len())
}

fn responses_body(input: &str, stream: bool) -> String {
    json!({"model": "gpt-4.1", "input": input, "store": false, "temperature": 0, "stream": stream}).to_string()
}

#[test]
fn a_crowd_of_200_streamed_responses_makes_one_call_and_every_stream_is_the_plain_answer() {
    let s = start();
    s.mock.mock.plan_api(vec![Fault { hold: true, ..Fault::default() }]);
    let (edge, auth) = (s.envoy.edge, format!("Bearer {TOKEN}"));
    let crowd = std::thread::spawn(move || {
        burst_to(edge, "/v1/responses", vec![responses_body("two hundred at once", true); 200], &auth)
    });
    poll_until(|| s.envoy.stat("http.edge.downstream_rq_active") == 200, "the crowd never arrived whole");
    s.mock.mock.release();
    let streams = crowd.join().expect("the crowd");
    assert_eq!(s.mock.mock.calls_to("/v1/responses"), 1, "200 identical streams, one upstream call");
    assert_eq!((count(&streams, "MISS"), count(&streams, "COALESCED")), (1, 199));
    let auth = format!("Bearer {TOKEN}");
    let plain = request(
        edge,
        "POST",
        "/v1/responses",
        &[("authorization", &auth)],
        responses_body("two hundred at once", false).as_bytes(),
    )
    .expect("the plain answer");
    assert_eq!(plain.cache(), "HIT");
    let answer = plain.json();
    assert!(answer["output"][0]["content"][0]["text"].as_str().is_some_and(|t| t.ends_with("two hundred at once")));
    for r in &streams {
        assert_eq!((r.status, r.header("content-type")), (200, Some("text/event-stream")));
        let (object, events) = completed(r);
        assert_eq!(object, answer, "every client's stream ends with the plain answer");
        assert!(events >= RESPONSE_EVENTS.len(), "{events} events");
    }
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_responses_stream_that_ends_before_its_last_event_is_not_stored() {
    let s = start();
    // The stream ends cleanly, every event but `response.completed` sent.
    s.mock.mock.plan_api(vec![Fault { drop_last_events: Some(1), ..Fault::default() }]);
    let auth = format!("Bearer {TOKEN}");
    let send = || {
        request(
            s.envoy.edge,
            "POST",
            "/v1/responses",
            &[("authorization", &auth)],
            responses_body("cut short", true).as_bytes(),
        )
    };
    let cut = send().expect("the stream that ends early");
    assert_eq!(cut.cache(), "MISS");
    assert!(cut.text().contains("response.output_item.done"), "{}", cut.text());
    assert!(!cut.text().contains("response.completed"), "{}", cut.text());
    let again = send().expect("the second stream");
    assert_eq!(again.cache(), "MISS", "nothing was stored");
    assert!(completed(&again).0["output"].is_array());
    assert_eq!(s.mock.mock.calls_to("/v1/responses"), 2);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}
