//! The edge tier in real Envoy (`--concurrency 2` each): forward nodes answer from near
//! copies of the answers their owners declared storable, and send one request per flight
//! to the owner. The same checks run on both topologies: three nodes that each forward and
//! own (`envoy/fleet.yaml.tmpl`), and three edge nodes that only forward, in front of two
//! shields (`envoy/edge.yaml.tmpl`).

use host_test::client::{request, Conn, Resp};
use host_test::fleet::{content, round_robin, spread, Fleet};
use host_test::mock::Fault;
use host_test::stack::{key_digest, streamed};
use host_test::stack::{poll_until, prompt, PATH};
use std::net::SocketAddr;
use std::time::Duration;

const ALICE: &str = "hs-alice-4f1e2d3c";
const BOB: &str = "hs-bob-9a8b7c6d";

/// Owners keep an answer 4 s, a near copy lives at most 1 s; two tenants (and the ring
/// probes' own).
fn config() -> String {
    format!(
        r#"{{"cache":{{"ttl_seconds":4}},"edge":{{"max_age_seconds":1}},
            "tenants":{{"alice":{{"keys_sha256":["{}"]}},"bob":{{"keys_sha256":["{}"]}},
                        "probe":{{"keys_sha256":["{}"]}}}}}}"#,
        key_digest(ALICE),
        key_digest(BOB),
        key_digest("probe")
    )
}

/// HolySheep's answer to the refresh, told apart from the first.
const REFRESHED: &str = r#"{"id":"chatcmpl-refreshed","object":"chat.completion","created":1,"model":"gpt-4.1",
  "choices":[{"index":0,"message":{"role":"assistant","content":"refreshed"},"finish_reason":"stop"}],
  "usage":{"prompt_tokens":6,"completion_tokens":1,"total_tokens":7}}"#;

fn ask(at: SocketAddr, token: &str, body: &str, extra: &[(&str, &str)]) -> Resp {
    let auth = format!("Bearer {token}");
    let mut headers = vec![("authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    request(at, "POST", PATH, &headers, body.as_bytes()).expect("answer")
}

fn tier(r: &Resp) -> &str {
    r.header("x-holysheep-tier").unwrap_or("-")
}

fn seconds(r: &Resp, name: &str) -> u64 {
    r.header(name).and_then(|v| v.trim_start_matches("max-age=").parse().ok()).unwrap_or(u64::MAX)
}

/// A repeat through the same forward node is a near HIT, and no owner sees it; another
/// tenant's identical request, a key no tenant holds, `no-store` and `no-cache` all behave
/// at the forward node as on an owner.
fn a_repeat_is_answered_at_the_edge(f: &Fleet) {
    let a = f.publics()[0];
    let body = prompt("near copies at the edge");
    let first = ask(a, ALICE, &body, &[]);
    assert_eq!((first.status, first.cache(), tier(&first)), (200, "MISS", "owner"), "{}", first.text());
    assert!(first.header("cache-control").is_some_and(|c| c.starts_with("max-age=")), "the owner declares it");
    let (owners, calls, hops) = (f.owner_requests(), f.calls(), f.stat("wasmcustom.holysheep.edge.other.hops"));
    let again = ask(a, ALICE, &body, &[]);
    assert_eq!((again.status, again.cache(), tier(&again)), (200, "HIT", "edge"));
    assert_eq!((content(&again), again.header("x-holysheep-tenant")), (content(&first), Some("alice")));
    assert_eq!(again.header("x-holysheep-owner"), None, "no owner answered it");
    assert!(seconds(&again, "cache-control") <= 1, "at most edge.max_age_seconds: {:?}", again.header("cache-control"));
    assert_eq!((f.owner_requests(), f.calls()), (owners, calls), "no owner counter moved");
    assert_eq!(f.stat("wasmcustom.holysheep.edge.other.hops"), hops, "no hop");
    assert!(f.stat("wasmcustom.holysheep.edge.tenant.alice.requests_hit") >= 1, "the edge counts its near hits");

    let bob = ask(a, BOB, &body, &[]);
    assert_eq!((bob.cache(), tier(&bob)), ("MISS", "owner"), "not alice's copy");
    let refused = ask(a, "hs-nobody-0000", &body, &[]);
    assert_eq!((refused.status, refused.json()["error"]["code"].as_str()), (401, Some("invalid_api_key")));
    assert_eq!(f.owner_requests(), owners + 1, "bob's request only: the unknown key never left the edge");

    let bypass = ask(a, ALICE, &body, &[("cache-control", "no-store")]);
    assert_eq!((bypass.cache(), tier(&bypass)), ("BYPASS", "owner"));
    f.mock.mock.plan(vec![Fault { body: Some(REFRESHED.into()), ..Fault::default() }]);
    let refreshed = ask(a, ALICE, &body, &[("cache-control", "no-cache")]);
    assert_eq!((refreshed.cache(), tier(&refreshed)), ("MISS", "owner"), "no-cache goes to the owner");
    let after = ask(a, ALICE, &body, &[]);
    assert_eq!((after.cache(), tier(&after)), ("HIT", "edge"));
    assert_eq!(after.json()["choices"][0]["message"]["content"], "refreshed", "the copy is the refreshed answer");
    assert_eq!(f.calls(), calls + 3, "bob's, the bypass and the refresh");
}

/// A stream crosses the hop (the client that did not ask for the usage event does not get
/// it), and its near copy answers the JSON form and a stream with usage, whole.
fn a_streams_copy_is_whole(f: &Fleet) {
    let a = f.publics()[1];
    let plain = prompt("a stream's near copy");
    let stream = streamed(&plain);
    let with_usage = plain.replacen('{', r#"{"stream":true,"stream_options":{"include_usage":true},"#, 1);
    let first = ask(a, ALICE, &stream, &[]);
    assert_eq!((first.status, first.cache(), tier(&first)), (200, "MISS", "owner"));
    assert!(first.text().contains("data: [DONE]") && !first.text().contains("\"usage\":{"), "{}", first.text());
    let calls = f.calls();
    let json = ask(a, ALICE, &plain, &[]);
    assert_eq!((json.cache(), tier(&json)), ("HIT", "edge"));
    assert!(json.json()["usage"]["completion_tokens"].as_u64().is_some_and(|n| n > 0), "{}", json.text());
    let events = ask(a, ALICE, &with_usage, &[]);
    assert_eq!((events.cache(), tier(&events)), ("HIT", "edge"));
    assert!(events.text().contains("\"usage\":{") && events.text().contains("data: [DONE]"), "{}", events.text());
    assert_eq!(f.calls(), calls);
    let bypass = ask(a, ALICE, &stream, &[("cache-control", "no-store")]);
    assert_eq!((bypass.cache(), tier(&bypass)), ("BYPASS", "owner"));
    assert!(bypass.text().contains("data: [DONE]") && !bypass.text().contains("\"usage\":{"), "{}", bypass.text());
}

/// 300 identical concurrent requests over the public listeners: one upstream call, at most
/// one request per forward node at the owners, everyone the same answer.
fn a_crowd_makes_one_hop_per_node(f: &Fleet) {
    let body = prompt("a crowd at the edge");
    let (owners, calls) = (f.owner_requests(), f.calls());
    let answers = spread(round_robin(&f.publics(), vec![body; 300]), &format!("Bearer {ALICE}"));
    assert!(answers.iter().all(|r| r.status == 200), "{:?}", answers.iter().map(|r| r.status).collect::<Vec<_>>());
    assert!(answers.iter().all(|r| content(r) == content(&answers[0])), "one answer");
    assert_eq!(f.calls() - calls, 1, "one upstream call");
    let at_owners = f.owner_requests() - owners;
    assert!((1..=3).contains(&at_owners), "{at_owners} requests reached the owners");
    let at_edge = answers.iter().filter(|r| tier(r) == "edge").count() as u64;
    assert_eq!(at_edge, 300 - at_owners, "the rest waited at their forward node");
}

/// A near copy lives no longer than the owner keeps the answer (4 s), and at most
/// `edge.max_age_seconds` (1 s) after it was copied: a forward node asks again, the owner
/// answers from its cache until its own copy expires, then HolySheep is called again.
fn a_near_copy_expires_with_its_owner(f: &Fleet) {
    let a = f.publics()[2];
    let body = prompt("near copies expire");
    let first = ask(a, ALICE, &body, &[]);
    assert_eq!(first.cache(), "MISS");
    let calls = f.calls();
    let mut seen = Vec::new();
    poll_until(
        || {
            std::thread::sleep(Duration::from_millis(20));
            let r = ask(a, ALICE, &body, &[]);
            let miss = r.cache() == "MISS";
            seen.push(r);
            miss
        },
        "the owner's answer never expired",
    );
    assert_eq!(f.calls(), calls + 1, "HolySheep again only once the owner's copy expired");
    let near: Vec<&Resp> = seen.iter().filter(|r| tier(r) == "edge").collect();
    let owner_hits = seen.iter().filter(|r| tier(r) == "owner" && r.cache() == "HIT").count();
    assert!(!near.is_empty() && owner_hits > 0, "near {} owner hits {owner_hits}", near.len());
    for r in near {
        assert_eq!(r.cache(), "HIT");
        assert!(seconds(r, "age") < 4, "a near copy past the owner's TTL: age {:?}", r.header("age"));
        assert!(seconds(r, "cache-control") <= 1, "{:?}", r.header("cache-control"));
    }
}

fn edge_checks(f: &Fleet) {
    a_repeat_is_answered_at_the_edge(f);
    a_streams_copy_is_whole(f);
    a_crowd_makes_one_hop_per_node(f);
    a_near_copy_expires_with_its_owner(f);
    assert_eq!(f.crashes(), Vec::<String>::new());
}

#[test]
fn every_node_forwarding_and_owning_keeps_near_copies() {
    edge_checks(&Fleet::start(3, &config(), 500));
}

#[test]
fn edge_nodes_in_front_of_a_shield_tier_keep_near_copies() {
    let f = Fleet::tiers(3, 2, &config(), 500);
    assert_eq!(f.publics().len(), 3);
    edge_checks(&f);
}

/// The leader's client goes away while its hop is in flight: a request that waited for it
/// on the forward node leads a new hop (to the owner, whose own flight it joins), never a
/// call of its own to HolySheep.
#[test]
fn a_waiter_that_comes_to_lead_hops_to_the_owner() {
    let f = Fleet::start(1, &config(), 0);
    let public = f.publics()[0];
    let body = prompt("the leader leaves");
    let calls = f.calls();
    f.mock.mock.plan(vec![Fault { hold: true, ..Fault::default() }]);
    let mut leader = Conn::open(public).expect("connect");
    leader.send_only("POST", PATH, &[("authorization", &format!("Bearer {ALICE}"))], body.as_bytes()).expect("send");
    poll_until(|| f.calls() == calls + 1, "the leader's call never reached HolySheep");
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || ask(public, ALICE, &body, &[]))
        })
        .collect();
    let node = &f.live().next().expect("the node").envoy;
    poll_until(|| node.stat("http.public.downstream_rq_active") == 3, "the waiters never arrived");
    // The hops sent along the owners' route so far (the ring's health probes are not
    // routed requests, so they never count here): the ring probes' and the leader's.
    let sent = || node.counted("cluster.owners.upstream_rq_total");
    let before = sent();
    assert!(before >= 1, "the leader's hop went to the owner");
    drop(leader);
    poll_until(|| node.stat("http.public.downstream_rq_active") == 2, "the leader never left");
    // The new hop reaches the owner while its flight (the first hop's) is still held there.
    let arrived = || sent() > before && node.stat("http.owner.downstream_rq_active") >= 1;
    poll_until(arrived, "the new hop never reached the owner");
    f.mock.mock.release();
    let answers: Vec<Resp> = waiters.into_iter().map(|w| w.join().expect("waiter")).collect();
    assert!(answers.iter().all(|r| r.status == 200), "{:?}", answers.iter().map(Resp::text).collect::<Vec<_>>());
    let mut tiers: Vec<(&str, &str)> = answers.iter().map(|r| (r.cache(), tier(r))).collect();
    tiers.sort_unstable();
    assert_eq!(tiers, [("COALESCED", "edge"), ("COALESCED", "owner")], "one new hop, to the owner's flight");
    assert_eq!(f.calls(), calls + 1, "no call of the forward node's own");
    assert_eq!(f.crashes(), Vec::<String>::new());
}
