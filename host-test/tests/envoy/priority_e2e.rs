//! Priority classes in real Envoy (2 workers): a model's admission line ordered by class,
//! then by turns between tenants; sheddable calls kept off the bucket's reserve; and
//! coalescing and HITs untouched by priority.

use host_test::client::{request, Conn, Resp};
use host_test::fleet::Fleet;
use host_test::mock::Fault;
use host_test::stack::{key_digest, streamed};
use host_test::stack::{poll_until, prompt, prompt_for, Stack, PATH};
use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;

const OPERATOR_KEY: &str = "sk-operator-77c1e0b2d4";
/// (tenant, token, class) of every test's tenants (`probe`: the fleet's ring probes).
const TENANTS: [(&str, &str, &str); 5] = [
    ("probe", "probe", "standard"),
    ("search", "hs-search-1f2e3d4c5b", "critical"),
    ("batch", "hs-batch-6a7b8c9d0e", "sheddable"),
    ("alpha", "hs-alpha-0a1b2c3d4e", "standard"),
    ("beta", "hs-beta-5f6a7b8c9d", "standard"),
];

fn token(tenant: &str) -> String {
    let (_, token, _) = TENANTS.iter().find(|(t, _, _)| *t == tenant).expect("a test tenant");
    format!("Bearer {token}")
}

/// gpt-4.1 with `limits` and the tenants above; `rate_limit` the section of that name.
fn start(limits: &str, rate_limit: &str) -> Stack {
    let config = tenants_config(&format!(r#"{{"gpt-4.1":{limits}}}"#), rate_limit);
    Stack::start_with(&config, 0, Some(OPERATOR_KEY), Some(OPERATOR_KEY))
}

/// Sends a chat request from `tenant` on its own thread.
fn send(s: &Stack, tenant: &str, text: &str, headers: &[(&str, &str)]) -> JoinHandle<Resp> {
    let (edge, body, auth) = (s.envoy.edge, prompt(text), token(tenant));
    let mut headers: Vec<(String, String)> = headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    headers.push(("authorization".into(), auth));
    std::thread::spawn(move || {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        request(edge, "POST", PATH, &h, body.as_bytes()).expect("edge answers")
    })
}

fn stat(s: &Stack, class: &str, name: &str) -> u64 {
    s.envoy.stat(&format!("wasmcustom.holysheep.priority.{class}.{name}"))
}

/// Waits until `n` calls of `class` have stood in the model's line.
fn await_queued(s: &Stack, class: &str, n: u64) {
    poll_until(|| stat(s, class, "queued") >= n, &format!("{n} {class} calls never stood in line"));
}

/// With the first call held upstream, `n` requests of `tenant` (prompts `<tag> <i>`): one
/// call in flight, the other `n - 1` of `class` waiting in line.
fn queue_behind_a_held_call(s: &Stack, tenant: &str, class: &str, tag: &str, n: usize) -> Vec<JoinHandle<Resp>> {
    s.mock.mock.plan(vec![Fault { hold: true, ..Fault::default() }]);
    let handles = (0..n).map(|i| send(s, tenant, &format!("{tag} {i}"), &[])).collect();
    s.await_calls(1);
    await_queued(s, class, n as u64 - 1);
    handles
}

fn join(handles: Vec<JoinHandle<Resp>>) -> Vec<Resp> {
    handles.into_iter().map(|h| h.join().expect("thread")).collect()
}

#[test]
fn a_critical_request_is_the_next_call_after_ten_queued_sheddable_ones() {
    let s = start(r#"{"max_in_flight":1}"#, r#"{"max_wait_ms":30000}"#);
    let mut handles = queue_behind_a_held_call(&s, "batch", "sheddable", "batch", 10);
    handles.push(send(&s, "search", "search now", &[]));
    await_queued(&s, "critical", 1);
    s.mock.mock.release();
    let answers = join(handles);
    assert!(answers.iter().all(|r| r.status == 200), "{:?}", answers.iter().map(|r| r.status).collect::<Vec<_>>());
    let prompts = s.mock.mock.prompts();
    assert_eq!(prompts.len(), 11);
    assert!(prompts[0].starts_with("batch"), "{prompts:?}");
    assert_eq!(prompts[1], "search now", "the critical call went next: {prompts:?}");
    assert_eq!(s.mock.mock.max_in_flight(), 1);
    assert_eq!(
        s.envoy.counted("wasmcustom.holysheep.priority.sheddable.shed"),
        0,
        "no reserve in a cap of one: they waited"
    );
    // Histograms reach the admin endpoint at Envoy's next stats flush.
    let prefix = host_test::envoy::Shell::of_run().prometheus_prefix();
    let series = format!(r#"{prefix}holysheep_priority_admission_wait_ms_count{{holysheep_priority="critical"}}"#);
    poll_until(|| prometheus_has(&s, &series), "the critical wait was never recorded");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

fn prometheus_has(s: &Stack, series: &str) -> bool {
    let text = request(s.envoy.admin, "GET", "/stats/prometheus", &[], b"").map(|r| r.text()).unwrap_or_default();
    text.lines().any(|l| l.starts_with(series) && !l.ends_with(" 0"))
}

#[test]
fn a_tenant_with_two_requests_is_not_stuck_behind_another_tenants_ten() {
    let s = start(r#"{"max_in_flight":1}"#, r#"{"max_wait_ms":30000}"#);
    let mut handles = queue_behind_a_held_call(&s, "alpha", "standard", "alpha", 10);
    handles.extend((0..2).map(|i| send(&s, "beta", &format!("beta {i}"), &[])));
    await_queued(&s, "standard", 11);
    s.mock.mock.release();
    assert!(join(handles).iter().all(|r| r.status == 200));
    let prompts = s.mock.mock.prompts();
    let first_five: Vec<&String> = prompts.iter().take(5).collect();
    assert_eq!(first_five.iter().filter(|p| p.starts_with("beta")).count(), 2, "{prompts:?}");
}

#[test]
fn sheddable_calls_are_refused_at_once_above_the_reserve_and_critical_ones_get_it() {
    let s = start(r#"{"requests_per_minute":60,"burst":10}"#, r#"{"reserve":0.5,"max_wait_ms":30000}"#);
    let batch = join((0..10).map(|i| send(&s, "batch", &format!("bulk {i}"), &[])).collect());
    let admitted = batch.iter().filter(|r| r.status == 200).count();
    // Ten tokens, half of them the reserve: exactly five sheddable calls fit above it.
    assert_eq!(admitted, 5, "{admitted} sheddable calls admitted above a reserve of five");
    for r in batch.iter().filter(|r| r.status != 200) {
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.header("x-holysheep-shed"), Some("priority"));
        assert_eq!(r.header("x-holysheep-priority"), Some("sheddable"));
        assert!(r.header("retry-after").is_some() && r.header("retry-after-ms").is_some());
        assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    }
    assert_eq!(stat(&s, "sheddable", "shed"), (10 - admitted) as u64);
    assert_eq!(s.envoy.counted("wasmcustom.holysheep.priority.sheddable.queued"), 0, "none of them waited");
    let critical = join((0..5).map(|i| send(&s, "search", &format!("urgent {i}"), &[])).collect());
    assert!(critical.iter().all(|r| r.status == 200), "{:?}", critical.iter().map(Resp::text).collect::<Vec<_>>());
    assert_eq!(s.calls(), admitted as u64 + 5, "a shed call never reached HolySheep");
}

#[test]
fn a_full_line_refuses_its_lowest_class_first() {
    let s = start(r#"{"max_in_flight":1}"#, r#"{"max_wait_ms":30000,"max_queue":3}"#);
    let mut handles = queue_behind_a_held_call(&s, "batch", "sheddable", "line", 4);
    // The line is full: another sheddable call is refused at once ...
    let refused = send(&s, "batch", "one too many", &[]).join().expect("thread");
    assert_eq!((refused.status, refused.header("x-holysheep-shed")), (429, Some("queue-full")), "{}", refused.text());
    assert_eq!(refused.header("x-holysheep-priority"), Some("sheddable"));
    // ... and a critical one takes the last sheddable place, whose caller is refused.
    handles.push(send(&s, "search", "important", &[]));
    await_queued(&s, "critical", 1);
    poll_until(|| stat(&s, "sheddable", "queue_full") >= 2, "the displaced call was never refused");
    s.mock.mock.release();
    let answers = join(handles);
    assert_eq!(answers.iter().filter(|r| r.status == 200).count(), 4, "the held call, two queued, the critical one");
    let displaced: Vec<&Resp> = answers.iter().filter(|r| r.status == 429).collect();
    assert_eq!(displaced.len(), 1);
    assert_eq!(displaced[0].header("x-holysheep-shed"), Some("queue-full"));
    assert_eq!(s.mock.mock.prompts()[1], "important");
    assert_eq!(stat(&s, "sheddable", "queue_full"), 2);
}

#[test]
fn a_request_may_lower_its_class_but_not_raise_it() {
    // The whole bucket is the reserve: no sheddable call is admitted.
    let s = start(r#"{"requests_per_minute":60,"burst":1}"#, r#"{"reserve":1.0}"#);
    // batch is sheddable: asking for critical changes nothing.
    let raised =
        s.chat(&prompt("raise me"), &[("authorization", &token("batch")), ("x-holysheep-priority", "critical")]);
    assert_eq!(raised.status, 429, "{}", raised.text());
    assert_eq!(raised.header("x-holysheep-priority"), Some("sheddable"));
    // search is critical and may lower itself: then it is shed like any sheddable call.
    let lowered =
        s.chat(&prompt("lower me"), &[("authorization", &token("search")), ("x-holysheep-priority", "sheddable")]);
    assert_eq!((lowered.status, lowered.header("x-holysheep-shed")), (429, Some("priority")));
    let bad = s.chat(&prompt("typo"), &[("authorization", &token("search")), ("x-holysheep-priority", "urgent")]);
    assert_eq!((bad.status, bad.json()["error"]["code"].as_str()), (400, Some("invalid_priority")));
    assert_eq!(s.calls(), 0);
    assert_eq!(s.chat(&prompt("as is"), &[("authorization", &token("search"))]).status, 200);
}

#[test]
fn a_critical_request_coalesced_on_a_queued_sheddable_leader_takes_it_to_the_front() {
    let s = start(r#"{"max_in_flight":1}"#, r#"{"max_wait_ms":30000}"#);
    let mut handles = queue_behind_a_held_call(&s, "batch", "sheddable", "queued", 5);
    // search asks as sheddable: its call waits last in line ...
    handles.push(send(&s, "search", "the question", &[("x-holysheep-priority", "sheddable")]));
    await_queued(&s, "sheddable", 5);
    // ... until the same question comes from search as critical, and waits on that call.
    let critical = send(&s, "search", "the question", &[]);
    // The leader takes its waiter's class the next time it looks from its place.
    await_queued(&s, "critical", 1);
    s.mock.mock.release();
    let critical = critical.join().expect("thread");
    assert_eq!((critical.status, critical.cache()), (200, "COALESCED"), "{}", critical.text());
    assert!(join(handles).iter().all(|r| r.status == 200));
    let prompts = s.mock.mock.prompts();
    assert_eq!(prompts[1], "the question", "the coalesced call went next: {prompts:?}");
    assert_eq!(prompts.len(), 6);
}

/// Reads a stream's first event: the request is then on its way (a leader's call, or a
/// waiter attached to one).
fn open_stream(s: &Stack, tenant: &str, text: &str, headers: &[(&str, &str)]) -> (Conn, String) {
    let body = streamed(&prompt(text));
    let auth = token(tenant);
    let mut h = vec![("authorization", auth.as_str())];
    h.extend_from_slice(headers);
    let mut conn = Conn::open(s.envoy.edge).and_then(|c| c.read_timeout(Duration::from_secs(20))).expect("connect");
    conn.send_only("POST", PATH, &h, body.as_bytes()).expect("send");
    let head = conn.read_until("\"role\":\"assistant\"").expect("the first event");
    (conn, head)
}

#[test]
fn a_sheddable_request_identical_to_a_critical_one_in_flight_is_coalesced_and_a_hit_is_never_shed() {
    // Two slots, one kept from sheddable calls: with one call in flight a sheddable call
    // would be shed.
    let s = start(r#"{"max_in_flight":2}"#, r#"{"reserve":0.5,"max_wait_ms":30000}"#);
    s.mock.mock.plan(vec![Fault { hold_after_events: Some(2), ..Fault::default() }]);
    let (mut leader, head) = open_stream(&s, "search", "the same question", &[]);
    assert!(head.contains("x-holysheep-cache: MISS"), "{head}");
    let lowered = [("x-holysheep-priority", "sheddable")];
    // In Envoy a stream's waiter gets its answer whole when the leader's stream ends; it
    // is waiting once Envoy holds its request beside the leader's.
    let follower = send(&s, "search", "the same question", &lowered);
    poll_until(|| s.envoy.stat("http.edge.downstream_rq_active") >= 2, "the follower never arrived");
    let other = s.chat(&prompt("another question"), &[("authorization", &token("search")), lowered[0]]);
    assert_eq!((other.status, other.header("x-holysheep-shed")), (429, Some("priority")), "the slot is reserved");
    s.mock.mock.release();
    leader.read_until("data: [DONE]").expect("the leader's stream");
    let follower = follower.join().expect("thread");
    assert_eq!((follower.status, follower.cache()), (200, "COALESCED"), "{}", follower.text());
    // The answer is cached: a sheddable request for it is a HIT, whatever the buckets say.
    s.mock.mock.plan(vec![Fault { hold_after_events: Some(2), ..Fault::default() }]);
    let (mut busy, _) = open_stream(&s, "search", "something else", &[]);
    let hit = s.chat(&prompt("the same question"), &[("authorization", &token("search")), lowered[0]]);
    assert_eq!((hit.status, hit.cache()), (200, "HIT"), "{}", hit.text());
    s.mock.mock.release();
    busy.read_until("data: [DONE]").expect("the other stream");
    assert_eq!(s.calls(), 2);
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}

/// The tenants above and `models` as one configuration (no operator key: the mock asks for
/// none).
fn tenants_config(models: &str, rate_limit: &str) -> String {
    let tenants: Vec<String> = TENANTS
        .iter()
        .map(|(name, token, class)| {
            let digest = key_digest(token);
            format!(r#""{name}":{{"keys_sha256":["{digest}"],"priority":"{class}"}}"#)
        })
        .collect();
    format!(r#"{{"models":{models},"rate_limit":{rate_limit},"tenants":{{{}}}}}"#, tenants.join(","))
}

#[test]
fn a_fleets_model_owner_orders_every_nodes_waiting_calls_and_a_forward_node_passes_the_class_on() {
    let models = r#"{"gpt-4.1":{"max_in_flight":1},"deepseek-v3":{"requests_per_minute":1,"burst":2}}"#;
    let fleet = Fleet::start(3, &tenants_config(models, r#"{"reserve":0.5,"max_wait_ms":30000}"#), 0);
    let publics = fleet.publics();
    let probes = fleet.calls();
    let queued = |class: &str| fleet.stat(&format!("wasmcustom.holysheep.priority.{class}.queued"));
    let chat = |public: SocketAddr, tenant: &str, body: String, lowered: bool| {
        let auth = token(tenant);
        std::thread::spawn(move || {
            let mut h = vec![("authorization", auth.as_str())];
            if lowered {
                h.push(("x-holysheep-priority", "sheddable"));
            }
            request(public, "POST", PATH, &h, body.as_bytes()).expect("edge answers")
        })
    };
    // Six sheddable calls through every node's public listener (their keys have different
    // owners), the first held upstream; then one critical call.
    fleet.mock.mock.plan(vec![Fault { hold: true, ..Fault::default() }]);
    let mut handles = vec![chat(publics[0], "batch", prompt("fleet batch 0"), false)];
    poll_until(|| fleet.calls() > probes, "the first call never reached HolySheep");
    handles.extend((1..6).map(|i| chat(publics[i % 3], "batch", prompt(&format!("fleet batch {i}")), false)));
    poll_until(|| queued("sheddable") >= 5, "the sheddable calls never stood in line");
    handles.push(chat(publics[1], "search", prompt("fleet search"), false));
    poll_until(|| queued("critical") >= 1, "the critical call never stood in line");
    fleet.mock.mock.release();
    assert!(join(handles).iter().all(|r| r.status == 200));
    let prompts: Vec<String> = fleet.mock.mock.prompts().into_iter().filter(|p| p.starts_with("fleet")).collect();
    assert_eq!(prompts.len(), 7, "{prompts:?}");
    assert_eq!(prompts[1], "fleet search", "the owner's line put it first: {prompts:?}");
    assert_eq!(fleet.counted("wasmcustom.holysheep.gpt-4.1.fleet_local_share"), 0, "the model owner was reached");

    // A burst of 2 with half kept: a request that lowered itself on a forward node is
    // sheddable on the owner; the first is admitted, the second shed.
    let lowered = |i: usize| chat(publics[2], "search", prompt_for("deepseek-v3", &format!("lowered {i}")), true);
    let first = lowered(0).join().expect("thread");
    assert_eq!(first.status, 200, "{}", first.text());
    let second = lowered(1).join().expect("thread");
    assert_eq!((second.status, second.header("x-holysheep-shed")), (429, Some("priority")), "{}", second.text());
    assert_eq!(second.header("x-holysheep-priority"), Some("sheddable"));
    assert!(fleet.crashes().is_empty(), "{:?}", fleet.crashes());
}
