//! Money that holds, in real Envoy (2 workers), tried as a careless or hostile tenant
//! would: worst cases that count every choice, only priced models for a budgeted tenant, no
//! token bucket one call can take, errors that cost nothing, a full line that keeps every
//! tenant's turn, prompt-cache prices, budgets that are used, not only held, and every
//! attempt HolySheep may have billed charged, retries on.

use host_test::client::{request, Conn, Resp};
use host_test::mock::{Fault, Running};
use host_test::stack::key_digest;
use host_test::stack::{burst_at, poll_until, prompt, prompt_for, Stack, PATH};
use std::thread::JoinHandle;

const OPERATOR_KEY: &str = "sk-operator-4b1d9e7c2a";
/// (tenant, token) of every test's tenants.
const TOKENS: [(&str, &str); 4] = [
    ("batch", "hs-batch-9c8b7a6f5e"),
    ("search", "hs-search-1d2c3b4a5f"),
    ("alpha", "hs-alpha-6e5d4c3b2a"),
    ("beta", "hs-beta-0f1e2d3c4b"),
];
/// gpt-4.1 at $10 / $30 per million prompt / completion tokens, $2.50 for cached prompt tokens.
const PRICES: &str = r#""usd_per_mtok_input":10,"usd_per_mtok_output":30,"usd_per_mtok_cached_input":2.5"#;

fn bearer(tenant: &str) -> String {
    let (_, token) = TOKENS.iter().find(|(t, _)| *t == tenant).expect("a test tenant");
    format!("Bearer {token}")
}

/// `models` and `rate_limit` as given, and the tenants with `limits.<tenant>` (more fields).
fn config(models: &str, rate_limit: &str, limits: &[(&str, &str)]) -> String {
    let tenants: Vec<String> = TOKENS
        .iter()
        .map(|(t, token)| {
            let extra = limits.iter().find(|(n, _)| n == t).map_or(String::new(), |(_, e)| format!(",{e}"));
            format!(r#""{t}":{{"keys_sha256":["{}"]{extra}}}"#, key_digest(token))
        })
        .collect();
    format!(
        r#"{{"models":{models},"rate_limit":{rate_limit},"retry":{{"max_attempts":1}},"tenants":{{{}}}}}"#,
        tenants.join(",")
    )
}

fn start(config: &str, latency_ms: u64) -> Stack {
    Stack::start_with(config, latency_ms, Some(OPERATOR_KEY), Some(OPERATOR_KEY))
}

fn chat(s: &Stack, tenant: &str, body: &str) -> Resp {
    s.chat(body, &[("authorization", &bearer(tenant))])
}

/// `body` with these fields first.
fn with(body: &str, fields: &str) -> String {
    body.replacen('{', &format!("{{{fields},"), 1)
}

/// What HolySheep billed for one `usage`, in micro-dollars, at `PRICES`: 10 per fresh prompt
/// token, 2.5 per cached one, 30 per completion token (as the edge rounds it).
fn billed_micro(u: &serde_json::Value) -> u64 {
    let prompt = u["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    let completion = u["completion_tokens"].as_u64().unwrap_or(0);
    ((prompt - cached) as f64 * 10.0 + cached as f64 * 2.5 + completion as f64 * 30.0).round() as u64
}

/// Everything the mock billed so far, in micro-dollars.
fn mock_billed(s: &Stack) -> u64 {
    s.mock.mock.billed().iter().map(billed_micro).sum()
}

fn tenant_stat(s: &Stack, tenant: &str, name: &str) -> u64 {
    s.envoy.stat(&format!("wasmcustom.holysheep.tenant.{tenant}.{name}"))
}

#[test]
fn a_budgeted_call_reserves_the_completion_cap_of_every_choice() {
    let s = start(&config(&format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#), "{}", &[("batch", r#""usd_per_day":1"#)]), 0);
    // 128 choices of up to 4096 tokens each at $30 per million: about $15.7, far past $1.
    let many = with(&prompt("one hundred and twenty-eight answers"), r#""n":128"#);
    let r = chat(&s, "batch", &many);
    assert_eq!((r.status, r.error_code().as_str()), (429, "insufficient_quota"), "{}", r.text());
    assert_eq!(s.calls(), 0, "nothing reached HolySheep");
    // Two choices: (body + 2 × 4096) tokens at $30 per million fit in $1.
    let two = with(&prompt("two answers"), r#""n":2"#);
    let r = chat(&s, "batch", &two);
    assert_eq!(r.status, 200, "{}", r.text());
    let sent: serde_json::Value = serde_json::from_slice(&s.mock.mock.last_body()).expect("json");
    assert_eq!((sent["max_tokens"].as_u64(), sent["n"].as_u64()), (Some(4096), Some(2)), "the cap, per choice");
    assert_eq!(tenant_stat(&s, "batch", "cost_spent_microusd"), mock_billed(&s));
    assert_eq!(tenant_stat(&s, "batch", "budget_day_left_microusd"), 1_000_000 - mock_billed(&s));
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_budgeted_tenant_reaches_only_priced_models() {
    let mock = Running::start(None, 0).expect("mock");
    // Nothing prices deepseek-v3 (no entry, no default), and the budgeted tenant reaches it
    // as gpt-4.1's fallback.
    let unpriced = config(
        &format!(r#"{{"gpt-4.1":{{{PRICES},"fallback":["deepseek-v3"]}}}}"#),
        "{}",
        &[("batch", r#""usd_per_day":1"#)],
    );
    let refused = host_test::envoy::Envoy::start(&host_test::envoy::Options::new(&unpriced, mock.addr))
        .err()
        .expect("Envoy refuses the filter's configuration");
    let log = refused.to_string();
    assert!(log.contains("tenants.batch") && log.contains("deepseek-v3 it can reach has no price"), "{log}");

    // Without `default`, a name the configuration does not list has no price: unknown to a
    // budgeted tenant, callable by one without a budget.
    let s = start(&config(&format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#), "{}", &[("batch", r#""usd_per_day":1"#)]), 0);
    let other = prompt_for("claude-sonnet-4", "priced by nothing");
    let r = chat(&s, "batch", &other);
    assert_eq!((r.status, r.error_code().as_str()), (404, "model_not_found"), "{}", r.text());
    assert_eq!(s.calls(), 0);
    assert_eq!(chat(&s, "search", &other).status, 200, "no budget, no price needed");
    assert_eq!(chat(&s, "batch", &prompt("priced")).status, 200);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());

    // A priced `default` prices only what a tenant's own list names: not o1-pro for a
    // budgeted tenant without a list, at default's rate.
    let models = format!(r#"{{"gpt-4.1":{{{PRICES}}},"default":{{"usd_per_mtok_input":1,"usd_per_mtok_output":1}}}}"#);
    let limits = [("batch", r#""usd_per_day":1"#), ("alpha", r#""usd_per_day":1,"models":["o1-pro"]"#)];
    let s = start(&config(&models, "{}", &limits), 0);
    let dear = prompt_for("o1-pro", "priced by default");
    let r = chat(&s, "batch", &dear);
    assert_eq!((r.status, r.error_code().as_str()), (404, "model_not_found"), "{}", r.text());
    assert_eq!(s.calls(), 0);
    assert_eq!(chat(&s, "alpha", &dear).status, 200, "the operator listed it for alpha");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn no_call_can_take_a_models_or_a_tenants_token_bucket() {
    let models = format!(r#"{{"gpt-4.1":{{"tokens_per_minute":10000,{PRICES}}}}}"#);
    let s = start(&config(&models, r#"{"max_wait_ms":2000}"#, &[("alpha", r#""tokens_per_minute":1000"#)]), 0);
    let huge = with(&prompt("as long as it likes"), r#""max_tokens":1000000000"#);
    let r = chat(&s, "batch", &huge);
    assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some("max_tokens")), "{}", r.text());
    assert!(r.json()["error"]["message"].as_str().unwrap_or("").contains("10000 tokens per minute model gpt-4.1"));
    assert_eq!(s.calls(), 0, "refused at once, never sent");
    // HolySheep refuses a call of 8000 tokens (no tokens used): its estimate goes back, so
    // the next one of 8000 is admitted at once (the bucket refills only 167 a second).
    s.mock.mock.plan(vec![Fault { status: Some(400), ..Fault::default() }]);
    let big = |text: &str| with(&prompt(text), r#""max_tokens":8000"#);
    assert_eq!(chat(&s, "batch", &big("refused by HolySheep")).status, 400);
    let r = chat(&s, "batch", &big("after the refusal"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.calls(), 2);
    // A tenant's own bucket: 1000 tokens a minute can never hold a call of 2000.
    let r = chat(&s, "alpha", &with(&prompt("past the tenant's bucket"), r#""max_tokens":2000"#));
    assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some("max_tokens")), "{}", r.text());
    assert!(r.json()["error"]["message"].as_str().unwrap_or("").contains("tenant alpha"), "{}", r.text());
    assert_eq!(s.calls(), 2);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

fn streamed(body: &str) -> String {
    with(body, r#""stream":true"#)
}

#[test]
fn holysheeps_errors_to_streams_and_streams_never_sent_cost_nothing_and_pages_their_worst_case() {
    let models = format!(r#"{{"gpt-4.1":{{"max_in_flight":1,{PRICES}}}}}"#);
    let s = start(&config(&models, r#"{"max_wait_ms":30000}"#, &[("batch", r#""usd_per_day":1"#)]), 0);
    let left = || tenant_stat(&s, "batch", "budget_day_left_microusd");
    for status in [400, 503] {
        s.mock.mock.plan(vec![Fault { status: Some(status), ..Fault::default() }]);
        let r = chat(&s, "batch", &streamed(&prompt(&format!("a stream HolySheep answers {status}"))));
        assert_eq!(r.status, status, "{}", r.text());
        assert_eq!(left(), 1_000_000, "an error to a stream costs nothing");
    }
    // A page that is not HolySheep's JSON error (a proxy's 502 on the way) is no proof of
    // nothing billed: the call is charged its worst case (every body byte a token, and
    // 4096, at $30).
    let html = Some("text/html".to_owned());
    let page = Some("<html><body>502 Bad Gateway</body></html>".to_owned());
    s.mock.mock.plan(vec![Fault { status: Some(502), body: page, content_type: html, ..Fault::default() }]);
    let paged = streamed(&prompt("a stream answered with a page"));
    let r = chat(&s, "batch", &paged);
    assert_eq!(r.status, 502, "{}", r.text());
    let paged_worst = (paged.len() as u64 + 4096) * 30;
    assert_eq!(left(), 1_000_000 - paged_worst, "a page is no proof of nothing billed");
    // A reset before any answer is Envoy's 503, not HolySheep's: the call may have been
    // billed, and is charged its worst case too.
    s.mock.mock.plan(vec![Fault { reset: true, ..Fault::default() }]);
    let reset = streamed(&prompt("a stream whose connection resets"));
    let r = chat(&s, "batch", &reset);
    assert_eq!(r.status, 503, "{}", r.text());
    let worst = paged_worst + (reset.len() as u64 + 4096) * 30;
    assert_eq!(left(), 1_000_000 - worst, "Envoy's own error is no proof of nothing billed");
    // A stream that waits for the only slot, whose client leaves before it gets it.
    s.mock.mock.plan(vec![Fault { hold: true, ..Fault::default() }]);
    let held = std::thread::spawn({
        let (edge, auth) = (s.envoy.edge, bearer("batch"));
        move || request(edge, "POST", PATH, &[("authorization", &auth)], prompt("held").as_bytes()).expect("answer")
    });
    s.await_calls(5);
    let mut leaving = Conn::open(s.envoy.edge).expect("connect");
    let body = streamed(&prompt("a stream whose client leaves"));
    leaving.send_only("POST", PATH, &[("authorization", &bearer("batch"))], body.as_bytes()).expect("sent");
    poll_until(|| s.envoy.stat("wasmcustom.holysheep.priority.standard.queued") >= 1, "the stream never stood in line");
    drop(leaving);
    s.mock.mock.release();
    let held = held.join().expect("thread");
    assert_eq!(held.status, 200);
    // The stream in line finds its client gone when its turn comes: it never leaves. A call
    // that joins the line after it is served after the stream's turn, so its settlement
    // reads the record once the stream's is in: the figure then is final.
    let spent = billed_micro(&held.json()["usage"]);
    let after = chat(&s, "batch", &prompt("a call in line behind the stream"));
    assert_eq!(after.status, 200, "{}", after.text());
    let after_spent = billed_micro(&after.json()["usage"]);
    assert_eq!(left(), 1_000_000 - worst - spent - after_spent, "the stream that never left was charged");
    assert_eq!(s.calls(), 6, "the stream was never sent");
    assert_eq!(tenant_stat(&s, "batch", "cost_spent_microusd"), spent + after_spent);
    assert_eq!(tenant_stat(&s, "batch", "budget_charged_microusd"), worst + spent + after_spent);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_call_without_a_limit_leaves_the_models_bucket_to_the_next_tenant() {
    // gpt-4.1's 60,000 tokens a minute, shared by every tenant; nobody waits for tokens.
    let models = format!(r#"{{"gpt-4.1":{{"tokens_per_minute":60000,{PRICES}}}}}"#);
    let s = start(&config(&models, r#"{"max_wait_ms":0}"#, &[]), 0);
    // Alpha names no limit and asks for a long answer: it is sent with the model's cap,
    // and HolySheep writes up to it (without one, 200,000 tokens).
    let r = chat(&s, "alpha", &prompt("write at length about everything"));
    assert_eq!(r.status, 200, "{}", r.text());
    let sent: serde_json::Value = serde_json::from_slice(&s.mock.mock.last_body()).expect("json");
    assert_eq!(sent["max_tokens"].as_u64(), Some(4096), "the model's cap");
    assert_eq!(r.json()["usage"]["completion_tokens"].as_u64(), Some(4096));
    // Beta's small call right after is admitted at once.
    let r = chat(&s, "beta", &with(&prompt("a short question"), r#""max_tokens":16"#));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.calls(), 2);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_stored_response_continued_at_once_is_never_billed_past_the_budget() {
    // $10 per million tokens in and out; a context of at most 2,000 tokens; $0.10 a day.
    let models = r#"{"gpt-4.1":{"usd_per_mtok_input":10,"usd_per_mtok_output":10,"context_window":2000}}"#;
    let s = start(&config(models, r#"{"max_wait_ms":20000}"#, &[("batch", r#""usd_per_day":0.1"#)]), 50);
    let ask = |body: String| {
        let (edge, auth) = (s.envoy.edge, bearer("batch"));
        std::thread::spawn(move || request(edge, "POST", "/v1/responses", &[("authorization", &auth)], body.as_bytes()))
    };
    // A long first input, stored by HolySheep (`store` is on by default).
    let first = format!(r#"{{"model":"gpt-4.1","input":"{}","max_output_tokens":16}}"#, "x".repeat(6000));
    let r = ask(first).join().expect("thread").expect("answer");
    assert_eq!(r.status, 200, "{}", r.text());
    let id = r.json()["id"].as_str().expect("an id").to_owned();
    // Eight continuations at once: each makes HolySheep replay the stored context, which
    // the edge cannot see, so each is reserved at the model's context window.
    let answers: Vec<Resp> = (0..8)
        .map(|i| {
            let body = format!(
                r#"{{"model":"gpt-4.1","input":"go on {i}","previous_response_id":"{id}","max_output_tokens":16}}"#
            );
            ask(body)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().expect("thread").expect("answer"))
        .collect();
    let billed: u64 = s
        .mock
        .mock
        .billed_at("/v1/responses")
        .iter()
        .map(|u| (u["input_tokens"].as_u64().unwrap_or(0) + u["output_tokens"].as_u64().unwrap_or(0)) * 10)
        .sum();
    let served = answers.iter().filter(|r| r.status == 200).count();
    assert!(served >= 2, "{:?}", answers.iter().map(Resp::text).collect::<Vec<_>>());
    for r in answers.iter().filter(|r| r.status != 200) {
        assert_eq!((r.status, r.error_code().as_str()), (429, "insufficient_quota"), "{}", r.text());
    }
    assert!(billed <= 100_000, "HolySheep billed {billed} of a 100,000 budget");
    let spent = 100_000 - tenant_stat(&s, "batch", "budget_day_left_microusd");
    assert_eq!(spent, billed, "every continuation charged what HolySheep billed");
    // Without a context window, a budgeted tenant's call on a stored prompt is refused,
    // naming the field.
    let s = start(&config(&format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#), "{}", &[("batch", r#""usd_per_day":1"#)]), 0);
    let body = r#"{"model":"gpt-4.1","input":"go on","prompt":{"id":"pmpt_1","version":"2"}}"#;
    let r = request(s.envoy.edge, "POST", "/v1/responses", &[("authorization", &bearer("batch"))], body.as_bytes())
        .expect("answer");
    assert_eq!((r.status, r.error_code().as_str()), (400, "unsupported_parameter"), "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "prompt");
    assert_eq!(s.mock.mock.calls_to("/v1/responses"), 0);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

/// `config` with retries on: three attempts, short backoffs.
fn retries_on(config: &str) -> String {
    config
        .replace(r#""retry":{"max_attempts":1}"#, r#""retry":{"max_attempts":3,"base_delay_ms":10,"max_delay_ms":50}"#)
}

#[test]
fn attempts_holysheep_billed_are_charged_when_their_answer_is_lost_or_refused() {
    let models = format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#);
    let s = start(&retries_on(&config(&models, "{}", &[("batch", r#""usd_per_day":1"#)])), 0);
    let spent = || 1_000_000 - tenant_stat(&s, "batch", "budget_day_left_microusd");
    // Three attempts whose connections drop after HolySheep billed them: Envoy's own 503
    // is no proof of nothing billed, so each costs the call's worst case (every body byte
    // a token, and the 4096 completion tokens it is sent with, at $30 per million).
    let lost = Fault { reset_after_billing: true, ..Fault::default() };
    s.mock.mock.plan(vec![lost.clone(), lost.clone(), lost]);
    let body = prompt("three attempts whose answers are lost");
    let r = chat(&s, "batch", &body);
    assert!(r.status >= 500, "{}", r.text());
    assert_eq!(s.calls(), 3, "retried");
    let worst = (body.len() as u64 + 4096) * 30;
    assert_eq!(spent(), 3 * worst, "three worst cases");
    assert!(spent() >= mock_billed(&s) && mock_billed(&s) > 0, "at least what HolySheep billed");
    // A 200 the edge refuses to pass on (not a chat.completion) is charged its `usage`; a
    // captive portal's page, which says nothing of cost, its worst case; then the answer.
    let not_chat =
        r#"{"object":"list","data":[],"usage":{"prompt_tokens":11,"completion_tokens":0,"total_tokens":11}}"#;
    s.mock.mock.plan(vec![
        Fault { body: Some(not_chat.into()), content_type: Some("application/json".into()), ..Fault::default() },
        Fault { body: Some("<html>portal</html>".into()), content_type: Some("text/html".into()), ..Fault::default() },
    ]);
    let body = prompt("a refused answer, a portal, then the answer");
    let r = chat(&s, "batch", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.calls(), 6);
    let answer = billed_micro(&r.json()["usage"]);
    let worst_again = (body.len() as u64 + 4096) * 30;
    assert_eq!(spent(), 3 * worst + 110 + worst_again + answer);
    assert!(spent() >= mock_billed(&s));
    // HolySheep's own JSON errors prove their attempts free.
    s.mock.mock.plan(vec![Fault { status: Some(503), ..Fault::default() }; 3]);
    let before = spent();
    let r = chat(&s, "batch", &prompt("three errors of HolySheep's own"));
    assert_eq!((r.status, s.calls()), (503, 9), "{}", r.text());
    assert_eq!(spent(), before, "free");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_retry_is_sent_only_when_the_budget_holds_its_worst_case_beside_what_was_billed() {
    let models = format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#);
    let body = with(&prompt("three answers that are not chat completions"), r#""max_tokens":100"#);
    // The call's worst case: every body byte a token and its 100 completion tokens, at $30.
    let worst = (body.len() as u64 + 100) * 30;
    // Each answer is another object that says it used the whole body and 100 tokens:
    // $10 and $30 per million, about half the worst case. The day holds one worst case and
    // a little, not one answer's cost and another worst case.
    let prompt_tokens = body.len() as u64;
    let cost = prompt_tokens * 10 + 100 * 30;
    let budget = worst + 1_000;
    assert!(cost + worst > budget && 3 * cost > budget, "the figures: {cost} {worst} {budget}");
    let limits = format!(r#""usd_per_day":{}"#, budget as f64 / 1e6);
    let s = start(&retries_on(&config(&models, "{}", &[("batch", &limits)])), 0);
    let other = format!(
        r#"{{"object":"list","data":[],"usage":{{"prompt_tokens":{prompt_tokens},"completion_tokens":100,"total_tokens":{}}}}}"#,
        prompt_tokens + 100
    );
    let not_chat = Fault { body: Some(other), content_type: Some("application/json".into()), ..Fault::default() };
    s.mock.mock.plan(vec![not_chat; 3]);
    let r = chat(&s, "batch", &body);
    assert_eq!((r.status, r.error_code().as_str()), (502, "upstream_invalid_answer"), "{}", r.text());
    // Each such answer was billed; three used to go under one reservation, past the budget.
    assert_eq!(s.calls(), 1, "no retry the budget could not hold");
    assert_eq!(tenant_stat(&s, "batch", "budget_charged_microusd"), cost);
    assert_eq!(tenant_stat(&s, "batch", "budget_day_left_microusd"), budget - cost);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

/// A port nothing listens on.
fn closed_port() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address")
}

#[test]
fn an_unreachable_holysheep_costs_the_tenant_nothing() {
    let models = format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#);
    let config = retries_on(&config(&models, "{}", &[("batch", r#""usd_per_day":10"#)]));
    let to_nowhere = |o: &mut host_test::envoy::Options| {
        o.api_key = Some(OPERATOR_KEY.to_owned());
        o.upstream = closed_port();
    };
    let s = Stack::start_tuned(&config, 0, to_nowhere, Some(OPERATOR_KEY));
    let left = || tenant_stat(&s, "batch", "budget_day_left_microusd");
    // Every connection is refused: Envoy's own 503 says its reset reason, `remote
    // connection failure`. Three attempts, none reached HolySheep, none charged (each used
    // to cost the worst case: (body + 2000) tokens at $30 per million).
    let r = chat(&s, "batch", &with(&prompt("HolySheep is down"), r#""max_tokens":2000"#));
    assert!(r.status >= 500, "{}", r.text());
    assert_eq!(s.envoy.stat("wasmcustom.holysheep.gpt-4.1.upstream_calls"), 3, "retried");
    assert_eq!(left(), 10_000_000, "three attempts that never left, charged nothing");
    assert_eq!(s.envoy.counted("wasmcustom.holysheep.tenant.batch.budget_charged_microusd"), 0);
    // A stream is charged nothing either. Its settlement comes as its answer ends: the calls
    // after it settle later and read it in the record, until the gauge shows it.
    let r = chat(&s, "batch", &streamed(&prompt("a stream while HolySheep is down")));
    assert!(r.status >= 500, "{}", r.text());
    let mut tries = 0;
    while left() != 10_000_000 && tries < 20 {
        chat(&s, "batch", &prompt(&format!("a call after the stream {tries}")));
        tries += 1;
    }
    assert_eq!(left(), 10_000_000, "the stream that never reached HolySheep was charged");
    assert_eq!(s.envoy.counted("wasmcustom.holysheep.tenant.batch.budget_charged_microusd"), 0);
    assert_eq!(s.calls(), 0, "nothing reached the mock");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn envoys_words_in_an_answer_holysheeps_side_gave_are_no_proof_of_nothing_billed() {
    let models = format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#);
    let s = start(&retries_on(&config(&models, "{}", &[("batch", r#""usd_per_day":10"#)])), 0);
    // A hop on HolySheep's side (an Envoy of its own) answers with the text Envoy writes
    // for a request it never sent: it speaks of its own last attempt, and the edge's Envoy
    // timed the answer (`x-envoy-upstream-service-time`), so it is charged as unknown.
    let text = "upstream connect error or disconnect/reset before headers. reset reason: overflow";
    let relayed = Fault {
        status: Some(503),
        body: Some(text.to_owned()),
        content_type: Some("text/plain".to_owned()),
        ..Fault::default()
    };
    s.mock.mock.plan(vec![relayed; 3]);
    let body = prompt("three answers relayed from HolySheep's side");
    let r = chat(&s, "batch", &body);
    assert_eq!((r.status, s.calls()), (503, 3), "{}", r.text());
    let worst = (body.len() as u64 + 4096) * 30;
    assert_eq!(tenant_stat(&s, "batch", "budget_charged_microusd"), 3 * worst, "three worst cases");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn envoys_circuit_breaker_turning_a_call_away_costs_its_tenant_nothing() {
    let models = format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#);
    let config = retries_on(&config(&models, "{}", &[("batch", r#""usd_per_day":10"#)]));
    let one_at_a_time = |o: &mut host_test::envoy::Options| {
        o.api_key = Some(OPERATOR_KEY.to_owned());
        o.upstream_max_requests = Some(1);
        // Over HTTP/2, as in production: a request circuit breaker (over HTTP/1.1 the
        // connections' breaker governs, and a request waits for one).
        o.upstream_h2 = true;
    };
    let s = Stack::start_tuned(&config, 0, one_at_a_time, Some(OPERATOR_KEY));
    // Another tenant's slow call holds the cluster's only request.
    s.mock.mock.plan(vec![Fault { hold: true, ..Fault::default() }]);
    let held = send(&s, "alpha", "a slow call that holds the cluster");
    s.await_calls(1);
    // Envoy answers each attempt 503 `x-envoy-overloaded` (`reset reason: overflow`).
    let r = chat(&s, "batch", &with(&prompt("turned away by the breaker"), r#""max_tokens":2000"#));
    assert!(r.status >= 500, "{}", r.text());
    assert_eq!(tenant_stat(&s, "batch", "budget_day_left_microusd"), 10_000_000, "never sent, never charged");
    assert_eq!(s.envoy.counted("wasmcustom.holysheep.tenant.batch.budget_charged_microusd"), 0);
    // The tenant's own counts: another request to the cluster may meet the breaker too.
    assert_eq!(tenant_stat(&s, "batch", "upstream_calls"), 3, "three attempts");
    assert_eq!(tenant_stat(&s, "batch", "retries"), 2);
    assert!(s.envoy.stat("cluster.holysheep.upstream_rq_active_overflow") >= 3, "each turned away by the breaker");
    s.mock.mock.release();
    assert_eq!(held.join().expect("thread").status, 200);
    assert_eq!(s.calls(), 1);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn a_budgeted_tenants_stream_is_not_retried_by_the_router_beyond_its_reservation() {
    let models = format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#);
    let s = start(&retries_on(&config(&models, "{}", &[("batch", r#""usd_per_day":10"#)])), 0);
    let error = Fault { status: Some(503), ..Fault::default() };
    // A tenant without a budget: Envoy's router retries the 503 before the first byte.
    s.mock.mock.plan(vec![error.clone()]);
    let r = chat(&s, "alpha", &streamed(&prompt("a stream retried by the router")));
    assert_eq!((r.status, s.calls()), (200, 2), "{}", r.text());
    // A budgeted tenant's reservation holds one attempt's worst case: no router retry.
    s.mock.mock.plan(vec![error]);
    let r = chat(&s, "batch", &streamed(&prompt("a budgeted stream")));
    assert_eq!((r.status, s.calls()), (503, 3), "{}", r.text());
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

fn send(s: &Stack, tenant: &str, text: &str) -> JoinHandle<Resp> {
    let (edge, body, auth) = (s.envoy.edge, prompt(text), bearer(tenant));
    std::thread::spawn(move || {
        request(edge, "POST", PATH, &[("authorization", &auth)], body.as_bytes()).expect("answer")
    })
}

#[test]
fn a_full_line_gives_its_last_place_to_another_tenant_whose_turn_comes_first() {
    let models = r#"{"gpt-4.1":{"max_in_flight":1}}"#;
    let s = start(&config(models, r#"{"max_wait_ms":30000,"max_queue":2}"#, &[]), 0);
    let queued = || s.envoy.stat("wasmcustom.holysheep.priority.standard.queued");
    s.mock.mock.plan(vec![Fault { hold: true, ..Fault::default() }]);
    let mut alpha = vec![send(&s, "alpha", "alpha 0")];
    s.await_calls(1);
    for i in 1..3 {
        alpha.push(send(&s, "alpha", &format!("alpha {i}")));
        poll_until(|| queued() >= i, "alpha's call never stood in line");
    }
    // The line is full of alpha's turns 1 and 2; beta's first turn orders before alpha's 2nd.
    let beta = send(&s, "beta", "beta 0");
    poll_until(|| queued() >= 3, "beta never stood in line");
    // Alpha's second turn lost its place: it finds the line full when it looks again.
    let full = || s.envoy.stat("wasmcustom.holysheep.priority.standard.queue_full");
    poll_until(|| full() == 1, "alpha's last turn was never refused");
    s.mock.mock.release();
    let beta = beta.join().expect("thread");
    assert_eq!(beta.status, 200, "a place, not a refusal: {}", beta.text());
    let alpha: Vec<Resp> = alpha.into_iter().map(|h| h.join().expect("thread")).collect();
    let statuses: Vec<u16> = alpha.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200, 200, 429], "alpha's last turn gave way");
    assert_eq!(alpha[2].header("x-holysheep-shed"), Some("queue-full"));
    assert_eq!(s.calls(), 3);
    assert_eq!(s.mock.mock.prompts(), ["alpha 0", "alpha 1", "beta 0"], "turn 1 of each, by arrival");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

#[test]
fn prompt_tokens_served_from_the_providers_cache_are_priced_as_cached() {
    let s = start(&config(&format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#), "{}", &[("batch", r#""usd_per_day":5"#)]), 0);
    // An agent's long system prompt (about 1500 tokens), then two different questions.
    let system = "You are a careful agent. ".repeat(240);
    let turn = |q: &str| {
        format!(
            r#"{{"model":"gpt-4.1","max_tokens":50,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{q}"}}]}}"#
        )
    };
    for q in ["first question", "second question"] {
        assert_eq!(chat(&s, "batch", &turn(q)).status, 200);
    }
    let billed = s.mock.mock.billed();
    let cached: Vec<u64> =
        billed.iter().map(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)).collect();
    assert_eq!(cached, [0, 1408], "the second prompt's prefix came from the cache: {billed:?}");
    let stat = |n: &str| s.envoy.stat(&format!("wasmcustom.holysheep.gpt-4.1.{n}"));
    assert_eq!(stat("cached_tokens"), 1408);
    assert_eq!(tenant_stat(&s, "batch", "cached_tokens"), 1408);
    assert_eq!(stat("cost_spent_microusd"), mock_billed(&s), "cached tokens at $2.50, not $10");
    assert_eq!(tenant_stat(&s, "batch", "budget_day_left_microusd"), 5_000_000 - mock_billed(&s));
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

/// Fifty different prompts of equal length and cost, and a budget that holds ten and a half
/// of their worst cases (less than the fifty cost): (bodies, worst case, budget) in
/// micro-dollars.
fn burst_of_fifty(tag: &str) -> (Vec<String>, u64, u64) {
    let words: String = (0..100).map(|w| format!("w{w:02} ")).collect();
    let bodies: Vec<String> =
        (0..50).map(|i| with(&prompt(&format!("{tag} {i:02} {}", words.trim_end())), r#""max_tokens":150"#)).collect();
    // Every body byte a prompt token and max_tokens, at the dearest price, $30 per million.
    let worst = (bodies[0].len() as u64 + 150) * 30;
    (bodies, worst, 10 * worst + worst / 2)
}

fn budget_config(budget_micro: u64, max_wait_ms: u64) -> String {
    let budget = format!(r#""usd_per_day":{}"#, budget_micro as f64 / 1e6);
    config(
        &format!(r#"{{"gpt-4.1":{{{PRICES}}}}}"#),
        &format!(r#"{{"max_wait_ms":{max_wait_ms}}}"#),
        &[("batch", &budget)],
    )
}

#[test]
fn a_burst_spends_its_budget_and_is_never_told_it_has_none_while_it_has() {
    let (bodies, worst, budget) = burst_of_fifty("burst");
    // Held while others settle: the burst uses the budget, and never passes it.
    let s = start(&budget_config(budget, 20_000), 100);
    let answers = burst_at(s.envoy.edge, bodies.clone(), &bearer("batch"));
    let spent = mock_billed(&s);
    let one = billed_micro(&s.mock.mock.billed()[0]);
    assert!(50 * one > budget, "the burst asks for more than the budget: {one} a call, {budget} in all");
    assert!(spent <= budget, "spent {spent} of {budget}");
    assert!(spent * 10 >= budget * 9, "spent {spent} of {budget}: less than 90 %");
    let served = answers.iter().filter(|r| r.status == 200).count() as u64;
    assert_eq!(s.calls(), served);
    for r in answers.iter().filter(|r| r.status != 200) {
        assert_eq!((r.status, r.error_code().as_str()), (429, "insufficient_quota"), "{}", r.text());
    }
    // Refused only once what was settled left no room for a worst case.
    assert!(budget - spent < worst, "{spent} of {budget}");
    assert_eq!(tenant_stat(&s, "batch", "cost_spent_microusd"), spent);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());

    // Not held: ten worst cases fit at once, and the others are told to come back (a
    // retryable 429), never that the budget is spent: nothing is settled yet.
    let s = start(&budget_config(budget, 0), 300);
    let answers = burst_at(s.envoy.edge, bodies, &bearer("batch"));
    assert_eq!(answers.iter().filter(|r| r.status == 200).count(), 10);
    for r in answers.iter().filter(|r| r.status != 200) {
        assert_eq!((r.status, r.error_code().as_str()), (429, "rate_limit_exceeded"), "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    assert!(mock_billed(&s) <= budget);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}
