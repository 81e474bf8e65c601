//! Live tails on the native module: the followers of a streamed MISS get each event as the
//! leader's own client does, whenever they join, while the mock holds the rest of the
//! stream back. What each test shows is docs/native.md's "Live tails".

use super::native_e2e::native;
use host_test::client::Conn;
use host_test::mock::Fault;
use host_test::stack::{poll_until, prompt, streamed, Stack, PATH};
use serde_json::Value;
use std::time::Duration;

const ROLE: &str = "\"role\":\"assistant\"";
const DONE: &str = "data: [DONE]";

/// A client of the stream `body` that has sent its request.
fn client(s: &Stack, body: &str) -> Conn {
    let mut c = Conn::open(s.envoy.edge).and_then(|c| c.read_timeout(Duration::from_secs(20))).expect("connects");
    c.send_only("POST", PATH, &[], body.as_bytes()).expect("sends");
    c
}

/// A leader of the stream `body` that has its first event, and `n` followers that began on
/// its tail.
fn begun(s: &Stack, body: &str, n: usize) -> (Conn, Vec<Conn>) {
    let mut leader = client(s, body);
    leader.read_until(ROLE).expect("the first event");
    let mut followers: Vec<Conn> = (0..n).map(|_| client(s, body)).collect();
    for f in &mut followers {
        f.read_until(ROLE).expect("a follower began");
    }
    (leader, followers)
}

/// `c`'s stream ends with the error event `code`, not `[DONE]`, and then ends.
fn ends_with_error(c: &mut Conn, code: &str) {
    let end = c.read_until(code).expect("the stream ends with an error event");
    assert!(!end.contains(DONE), "{end}");
    c.read_past_last_chunk().expect("and then ends");
}

/// The text the events of `raw` (a response read as it came) carry.
fn content(raw: &str) -> String {
    let data = raw.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| d.starts_with('{'));
    let events = data.filter_map(|d| serde_json::from_str::<Value>(d).ok());
    events.filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_owned)).collect()
}

#[test]
fn followers_get_each_event_as_the_leaders_client_does_whenever_they_join() {
    let s = native(r#"{"models":{"gpt-4.1":{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}"#, 0);
    // The answer's head comes after a second (followers that come meanwhile wait for it),
    // and the stream stops after three events until the test releases it.
    s.mock.mock.plan(vec![Fault { delay_ms: 1_000, hold_after_events: Some(3), ..Fault::default() }]);
    let body = streamed(&prompt("native: a live tail"));
    let mut leader = client(&s, &body);
    s.await_calls(1);
    let early: Vec<Conn> = (0..4).map(|_| client(&s, &body)).collect();
    let head = leader.read_until(ROLE).expect("the leader's client gets the first event live");
    assert!(head.contains("x-holysheep-cache: MISS"), "{head}");
    // Joining mid-stream: what was sent, at once, then the rest live.
    let late: Vec<Conn> = (0..4).map(|_| client(&s, &body)).collect();
    let usage_body = body.replacen('{', r#"{"stream_options":{"include_usage":true},"#, 1);
    let with_usage = client(&s, &usage_body);
    let mut all = vec![(head, leader)];
    for mut c in early.into_iter().chain(late).chain(std::iter::once(with_usage)) {
        let head = c.read_until(ROLE).expect("a follower gets the first event while the rest is held");
        assert!(head.contains("x-holysheep-cache: COALESCED"), "{head}");
        assert!(head.contains("content-type: text/event-stream"), "{head}");
        all.push((head, c));
    }
    // A follower that leaves costs the others nothing. (Envoy has seen it go before the
    // answer comes.)
    drop(all.remove(5));
    poll_until(
        || s.envoy.stat("http.edge.downstream_cx_destroy_remote_active_rq") >= 1,
        "Envoy never saw the follower leave",
    );
    s.mock.mock.release();
    for (text, c) in all.iter_mut() {
        text.push_str(&c.read_until(DONE).expect("the rest of the stream"));
    }
    let leaders = content(&all[0].0);
    assert!(leaders.ends_with("to: native: a live tail"), "{leaders}");
    for (text, _) in &all {
        assert_eq!(content(text), leaders, "every follower reads the leader's answer");
    }
    let usage = |t: &str| t.contains("\"choices\":[]");
    assert!(usage(&all[all.len() - 1].0), "the follower that asked gets the usage event");
    assert!(all[..all.len() - 1].iter().all(|(t, _)| !usage(t)), "no usage event unless asked");
    assert_eq!(s.calls(), 1, "one upstream call for the leader and its followers");
    let stat = |name: &str| s.envoy.stat(&format!("wasmcustom.holysheep.gpt-4.1.{name}"));
    assert_eq!((stat("requests_miss"), stat("requests_coalesced")), (1, 8), "the follower that left is not counted");
    let spent = stat("cost_spent_microusd");
    assert!(spent > 0, "the leader's call is priced");
    assert_eq!(stat("cost_saved_microusd"), 8 * spent, "each follower saved what the call cost");
    let hit = s.chat(&prompt("native: a live tail"), &[]);
    assert_eq!((hit.status, hit.cache()), (200, "HIT"), "the finished stream was stored");
    assert_eq!(s.crashes(), Vec::<String>::new());
}

#[test]
fn when_the_leaders_client_leaves_its_followers_get_an_error_event_and_nothing_is_stored() {
    let s = native("{}", 0);
    s.mock.mock.plan(vec![Fault { hold_after_events: Some(3), ..Fault::default() }]);
    let body = streamed(&prompt("native: the leader leaves its tail"));
    let (leader, mut followers) = begun(&s, &body, 3);
    drop(leader);
    for f in &mut followers {
        ends_with_error(f, "stream_cut");
    }
    let again = s.chat(&body, &[]);
    assert_eq!((again.status, again.cache()), (200, "MISS"), "nothing was stored of the cut stream");
    assert_eq!(s.calls(), 2);
    assert_eq!(s.crashes(), Vec::<String>::new());
}

#[test]
fn a_stream_past_the_tails_bound_ends_its_followers_with_an_error_and_its_leader_whole() {
    // Answers of at most 64 bytes kept: a tail holds 512 bytes of events.
    let s = native(r#"{"cache":{"max_entry_bytes":64}}"#, 0);
    s.mock.mock.plan(vec![Fault { hold_after_events: Some(1), ..Fault::default() }]);
    let body = streamed(&prompt("native: an answer longer than the tail may hold"));
    let (mut leader, mut followers) = begun(&s, &body, 1);
    s.mock.mock.release();
    let rest = leader.read_until(DONE).expect("the leader's client gets all of it");
    assert!(content(&rest).ends_with("may hold"), "{rest}");
    ends_with_error(&mut followers[0], "stream_too_large");
    assert_eq!(s.calls(), 1);
    assert_eq!(s.crashes(), Vec::<String>::new());
}

#[test]
fn an_upstream_reset_mid_stream_ends_the_leader_and_its_followers_with_an_error_event() {
    let s = native("{}", 0);
    s.mock.mock.plan(vec![Fault { hold_after_events: Some(2), cut_after_events: Some(4), ..Fault::default() }]);
    let body = streamed(&prompt("native: HolySheep cuts the stream"));
    let (mut leader, mut followers) = begun(&s, &body, 3);
    s.mock.mock.release();
    for c in std::iter::once(&mut leader).chain(followers.iter_mut()) {
        ends_with_error(c, "stream_cut");
    }
    let again = s.chat(&body, &[]);
    assert_eq!((again.status, again.cache()), (200, "MISS"), "nothing was stored of the cut stream");
    assert_eq!(s.calls(), 2);
    assert_eq!(s.crashes(), Vec::<String>::new());
}
