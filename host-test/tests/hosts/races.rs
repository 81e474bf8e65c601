//! Scenarios against the built plugin in the wasmtime host (`host_test::proxy_host`):
//! several worker VMs sharing Envoy-exact shared data and queues, a virtual clock, and a
//! seeded scheduler that interleaves VMs at every shared-state call.

use host_test::envoy::{wasm_path, workspace_root};
use host_test::proxy_host::state::{Clock, Headers, Shared};
use host_test::proxy_host::world::{Answer, Options, Plugin, ReqId, Upstream, UpstreamCall, World};
use host_test::stack::{key_digest, streamed};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

const PATH: &str = "/v1/chat/completions";
/// Seeds each race scenario explores.
const SEEDS: u64 = 200;

fn plugin() -> &'static Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN.get_or_init(|| Plugin::load(&wasm_path()).expect("built plugin (make test builds it)"))
}

fn broken_plugin() -> Plugin {
    let path = workspace_root().join("target/broken-lock/wasm32-wasip1/release/holysheep_edge.wasm");
    Plugin::load(&path).expect("broken-lock build (make test builds it)")
}

fn prompt(text: &str) -> String {
    format!(r#"{{"model":"gpt-4.1","messages":[{{"role":"user","content":"{text}"}}],"temperature":0}}"#)
}

/// A chat-completion answer naming the call (`n`) and echoing the request body.
fn answer(n: u64, status: u16, body: &[u8]) -> Option<(Headers, Vec<u8>)> {
    let echo = String::from_utf8_lossy(body).replace(['"', '\\'], "'");
    let body = format!(
        r#"{{"id":"call-{n}","object":"chat.completion","choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}},"echo":"{echo}"}}"#
    );
    let headers: Headers =
        vec![(":status".into(), status.to_string()), ("content-type".into(), "application/json".into())];
    Some((headers, body.into_bytes()))
}

/// How the upstream treats one call.
#[derive(Clone, Copy)]
enum Up {
    /// Answer with this status after this many (virtual) ms.
    Answer(u64, u16),
    /// Reset the connection after this many ms (the callout fails as (0, 0, 0)).
    Reset(u64),
    /// Never answer (the caller's worker dies first).
    Hang,
}

/// An upstream that answers every call after `latency_ms`, counting the calls.
fn upstream(latency_ms: u64, status: u16, calls: Arc<AtomicU64>) -> Upstream {
    scripted(calls, move |_| Up::Answer(latency_ms, status))
}

/// An upstream whose `n`-th call (from 1) is treated as `script(n)` says.
fn scripted(calls: Arc<AtomicU64>, script: impl Fn(u64) -> Up + Send + 'static) -> Upstream {
    Box::new(move |call| {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        match script(n) {
            Up::Answer(delay, status) => Some((delay, answer(n, status, &call.body))),
            Up::Reset(delay) => Some((delay, None)),
            Up::Hang => None,
        }
    })
}

fn world(plugin: &Plugin, config: &str, seed: u64, upstream: Upstream) -> World {
    World::start(plugin, Options::new(2, config, seed), upstream).expect("world starts")
}

/// `n` identical requests spread over the workers at the same instant.
fn burst(w: &mut World, n: usize, body: &str) -> Vec<ReqId> {
    (0..n).map(|i| w.request(i % 2, "POST", PATH, &[("authorization", "Bearer t")], body.as_bytes())).collect()
}

fn all_answered(ids: &[ReqId]) -> impl FnMut(&World) -> bool + '_ {
    move |w| ids.iter().all(|id| w.answer(*id).is_some())
}

fn labels(w: &World, ids: &[ReqId]) -> Vec<String> {
    ids.iter().map(|id| w.answer(*id).map_or("unanswered".to_owned(), |a| a.cache().to_owned())).collect()
}

#[test]
fn identical_requests_over_workers_make_one_callout_for_every_seed() {
    for seed in 0..SEEDS {
        let calls = Arc::new(AtomicU64::new(0));
        let mut w = world(plugin(), "{}", seed, upstream(200, 200, calls.clone()));
        let ids = burst(&mut w, 10, &prompt("same"));
        assert!(w.run_until(60_000, all_answered(&ids)), "seed {seed}: {:?}", labels(&w, &ids));
        let l = labels(&w, &ids);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "seed {seed}: {l:?}");
        assert_eq!(l.iter().filter(|c| *c == "MISS").count(), 1, "seed {seed}: {l:?}");
        assert_eq!(l.iter().filter(|c| *c == "COALESCED").count(), 9, "seed {seed}: {l:?}");
        assert!(w.traps.is_empty(), "seed {seed}: {:?}", w.traps);
    }
}

/// The host calls made since `before` (a copy of the counts), by name; those not made left out.
fn host_calls_since(
    w: &World,
    before: &std::collections::BTreeMap<&'static str, u64>,
) -> std::collections::BTreeMap<&'static str, u64> {
    let shared = w.shared();
    let made = shared.host_calls.iter().map(|(name, n)| (*name, n - before.get(name).copied().unwrap_or(0)));
    made.filter(|(_, n)| *n > 0).collect()
}

/// `body` asked on worker 0 and answered: its `x-holysheep-cache` label.
fn cache_label(w: &mut World, body: &str) -> String {
    let id = w.request(0, "POST", PATH, &[("authorization", "Bearer t")], body.as_bytes());
    assert!(w.run_until(1_000, |w| w.answer(id).is_some()));
    w.answer(id).map(|a| a.cache().to_owned()).unwrap_or_default()
}

/// The HITs Envoy has counted for models without a label of their own.
fn hits(w: &World) -> i64 {
    w.shared().metrics.get("wasmcustom.holysheep.other.requests_hit").copied().unwrap_or(0)
}

/// Every host call is a crossing into Envoy (about 3 µs of its CPU each in `make profile`):
/// a repeated request is answered with the four a HIT needs (request headers, body, clock,
/// the reply), not more. Its counters reach Envoy on the worker's next tick, summed.
#[test]
fn a_repeated_request_is_answered_with_four_host_calls() {
    let calls = Arc::new(AtomicU64::new(0));
    let mut w = world(plugin(), "{}", 1, upstream(0, 200, calls.clone()));
    let body = prompt("asked again and again");
    let ask = |w: &mut World| cache_label(w, &body);
    assert_eq!(ask(&mut w), "MISS");
    assert_eq!(ask(&mut w), "HIT", "from the shared cache; the worker keeps a copy");
    assert!(w.run_until(1_000, |w| hits(w) == 1), "the first HIT counted: {}", hits(&w));
    let before = w.shared().host_calls.clone();
    assert_eq!(ask(&mut w), "HIT", "from the worker's copy");
    let made = host_calls_since(&w, &before);
    let expected = [
        ("proxy_get_buffer_bytes", 1),
        ("proxy_get_current_time_nanoseconds", 1),
        ("proxy_get_header_map_pairs", 1),
        ("proxy_send_local_response", 1),
    ];
    assert_eq!(made, expected.into_iter().collect(), "host calls of one HIT");
    assert_eq!(ask(&mut w), "HIT");
    assert!(w.run_until(1_000, |w| hits(w) == 3), "both HITs counted on a tick: {}", hits(&w));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A reload replaces each worker's root context: the HIT counts the old one held for its
/// tick reach Envoy as it is done, not lost with it.
#[test]
fn a_reload_hands_envoy_the_counts_the_old_root_context_held() {
    let calls = Arc::new(AtomicU64::new(0));
    let mut w = world(plugin(), "{}", 1, upstream(0, 200, calls.clone()));
    let body = prompt("counted across a reload");
    let ask = |w: &mut World| cache_label(w, &body);
    assert_eq!(ask(&mut w), "MISS");
    assert_eq!(ask(&mut w), "HIT");
    assert!(w.run_until(1_000, |w| hits(w) == 1), "the first HIT counted: {}", hits(&w));
    assert_eq!((ask(&mut w), ask(&mut w)), ("HIT".to_owned(), "HIT".to_owned()), "from the worker's copy");
    assert_eq!(hits(&w), 1, "two HITs held for the tick");
    // A changed configuration (Envoy keeps the root context of an unchanged one).
    w.reload(r#"{"lock":{"lease_ms":4000}}"#);
    w.settle();
    assert_eq!(hits(&w), 3, "handed to Envoy as the old root context was done");
    assert_eq!(ask(&mut w), "HIT", "the new root context answers");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(w.traps.is_empty(), "{:?}", w.traps);
}

/// A MISS leaves from the request's own VM call: the callout is made in the body callback
/// that handed it to the worker's root context, with no hop through the worker's queue.
#[test]
fn a_miss_is_dispatched_from_its_own_request_callback() {
    let calls = Arc::new(AtomicU64::new(0));
    let mut w = world(plugin(), "{}", 1, upstream(0, 200, calls.clone()));
    let ask = |w: &mut World, text: &str| cache_label(w, &prompt(text));
    assert_eq!(ask(&mut w, "a first prompt"), "MISS");
    let before = w.shared().host_calls.clone();
    assert_eq!(ask(&mut w, "another prompt"), "MISS");
    let made = host_calls_since(&w, &before);
    // No `proxy_enqueue_shared_queue` / `proxy_dequeue_shared_queue`: no hop. The clock is
    // read once in the request's VM call (its dispatch included) and once for the answer;
    // the answer's VM call names the request once, to reply.
    let expected = [
        ("proxy_get_buffer_bytes", 2),
        ("proxy_get_current_time_nanoseconds", 2),
        ("proxy_get_header_map_pairs", 2),
        ("proxy_get_shared_data", 3),
        ("proxy_http_call", 1),
        ("proxy_increment_metric", 4),
        ("proxy_record_metric", 3),
        ("proxy_send_local_response", 1),
        ("proxy_set_effective_context", 1),
        ("proxy_set_shared_data", 4),
    ];
    assert_eq!(made, expected.into_iter().collect(), "host calls of one MISS");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn waiters_on_other_workers_are_woken_when_the_flight_ends_not_by_the_next_tick() {
    // A 4 s lease: the safety-net tick comes every 500 ms; the answer takes 200 ms.
    for seed in 0..SEEDS {
        let calls = Arc::new(AtomicU64::new(0));
        let mut w = world(plugin(), r#"{"lock":{"lease_ms":4000}}"#, seed, upstream(200, 200, calls.clone()));
        let t0 = w.now();
        let ids = burst(&mut w, 10, &prompt("woken at once"));
        assert!(w.run_until(60_000, all_answered(&ids)), "seed {seed}: {:?}", labels(&w, &ids));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let last = w.now() - t0;
        assert!(last < 400, "seed {seed}: the last waiter was answered {last} ms after the burst");
    }
}

fn body_of(w: &World, id: ReqId) -> Vec<u8> {
    w.answer(id).map(|a| a.body.clone()).unwrap_or_default()
}

fn count(l: &[String], label: &str) -> usize {
    l.iter().filter(|c| *c == label).count()
}

#[test]
fn a_waiter_takes_over_when_the_leaders_worker_dies() {
    for seed in 0..SEEDS / 4 {
        let calls = Arc::new(AtomicU64::new(0));
        let script = scripted(calls.clone(), |n| if n == 1 { Up::Hang } else { Up::Answer(100, 200) });
        let mut w = world(plugin(), "{}", seed, script);
        let ids = burst(&mut w, 6, &prompt("orphan"));
        assert!(w.run_until(1_000, |_| calls.load(Ordering::SeqCst) == 1), "seed {seed}");
        let dead = w.upstream_calls[0].worker;
        w.kill(dead);
        let survivors: Vec<ReqId> =
            ids.iter().copied().enumerate().filter(|(i, _)| i % 2 != dead).map(|(_, id)| id).collect();
        assert!(w.run_until(60_000, all_answered(&survivors)), "seed {seed}: {:?}", labels(&w, &survivors));
        let l = labels(&w, &survivors);
        assert_eq!(calls.load(Ordering::SeqCst), 2, "seed {seed}: one takeover call {l:?}");
        assert_eq!((count(&l, "MISS"), count(&l, "COALESCED")), (1, 2), "seed {seed}: {l:?}");
        assert!(w.traps.is_empty(), "seed {seed}: {:?}", w.traps);
    }
}

#[test]
fn waiters_are_served_when_the_leaders_client_resets() {
    for seed in 0..SEEDS / 4 {
        let calls = Arc::new(AtomicU64::new(0));
        let mut w = world(plugin(), "{}", seed, upstream(500, 200, calls.clone()));
        let leader = w.request((seed % 2) as usize, "POST", PATH, &[], prompt("left").as_bytes());
        assert!(w.run_until(1_000, |_| calls.load(Ordering::SeqCst) == 1), "seed {seed}");
        let waiters: Vec<ReqId> =
            (0..5).map(|i| w.request(i % 2, "POST", PATH, &[], prompt("left").as_bytes())).collect();
        w.settle();
        w.reset(leader);
        assert!(w.run_until(60_000, all_answered(&waiters)), "seed {seed}: {:?}", labels(&w, &waiters));
        assert_eq!(count(&labels(&w, &waiters), "COALESCED"), 5, "seed {seed}: {:?}", labels(&w, &waiters));
        assert!(w.answer(leader).is_none(), "the leader's client is gone");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(w.traps.is_empty(), "seed {seed}: {:?}", w.traps);
    }
}

#[test]
fn a_failed_callout_reaches_every_waiter_and_is_not_cached() {
    for seed in 0..SEEDS / 4 {
        let calls = Arc::new(AtomicU64::new(0));
        let script = scripted(calls.clone(), |n| if n == 1 { Up::Reset(300) } else { Up::Answer(10, 200) });
        let mut w = world(plugin(), r#"{"retry":{"max_attempts":1}}"#, seed, script);
        let ids = burst(&mut w, 6, &prompt("fails"));
        assert!(w.run_until(60_000, all_answered(&ids)), "seed {seed}");
        for id in &ids {
            let a = w.answer(*id).expect("answered");
            let v: serde_json::Value = serde_json::from_slice(&a.body).expect("json");
            assert_eq!((a.status, v["error"]["code"].as_str()), (502, Some("upstream_unavailable")), "seed {seed}");
        }
        let again = w.request(0, "POST", PATH, &[], prompt("fails").as_bytes());
        assert!(w.run_until(60_000, all_answered(&[again])));
        assert_eq!((w.answer(again).map(|a| a.status), calls.load(Ordering::SeqCst)), (Some(200), 2), "seed {seed}");
    }
}

#[test]
fn a_waiter_past_its_wait_timeout_goes_alone_and_does_not_store() {
    let calls = Arc::new(AtomicU64::new(0));
    let script = scripted(calls.clone(), |n| if n == 1 { Up::Answer(5_000, 200) } else { Up::Answer(100, 200) });
    let mut w = world(plugin(), r#"{"lock":{"wait_timeout_ms":1000}}"#, 7, script);
    let leader = w.request(0, "POST", PATH, &[], prompt("slow").as_bytes());
    w.settle();
    let waiter = w.request(1, "POST", PATH, &[], prompt("slow").as_bytes());
    assert!(w.run_until(60_000, all_answered(&[leader, waiter])));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        (w.answer(waiter).map(Answer::cache), w.answer(leader).map(Answer::cache)),
        (Some("MISS"), Some("MISS"))
    );
    let later = w.request(1, "POST", PATH, &[], prompt("slow").as_bytes());
    assert!(w.run_until(60_000, all_answered(&[later])));
    assert_eq!(w.answer(later).map(Answer::cache), Some("HIT"));
    assert_eq!(body_of(&w, later), body_of(&w, leader), "the cache holds the leader's answer, not the waiter's");
}

#[test]
fn slot_collisions_never_mix_answers_and_shared_data_keys_stay_bounded() {
    let calls = Arc::new(AtomicU64::new(0));
    let mut w = world(plugin(), r#"{"cache":{"max_entries":8},"lock":{"slots":4}}"#, 11, upstream(50, 200, calls));
    let prompts: Vec<String> = (0..100).map(|i| prompt(&format!("prompt {i}"))).collect();
    let send = |w: &mut World| -> Vec<ReqId> {
        prompts.iter().enumerate().map(|(i, p)| w.request(i % 2, "POST", PATH, &[], p.as_bytes())).collect()
    };
    let first = send(&mut w);
    assert!(w.run_until(120_000, all_answered(&first)));
    let again = send(&mut w);
    assert!(w.run_until(120_000, all_answered(&again)));
    for (i, (a, b)) in first.iter().zip(&again).enumerate() {
        let echoes = |id: &ReqId| String::from_utf8_lossy(&body_of(&w, *id)).contains(&format!("prompt {i}'"));
        assert!(echoes(a) && echoes(b), "prompt {i} got another prompt's answer");
    }
    let hits = count(&labels(&w, &again), "HIT");
    assert!(hits > 0 && hits <= 8, "{hits} hits from 8 slots");
    let keys: Vec<String> = w.shared().data.keys().cloned().collect();
    // 8 entries, their 2 group indexes and 2 ghost records, 1 lease group of 4 ways, the
    // queue registry.
    assert!(keys.len() <= 8 + 2 + 2 + 1 + 1, "shared-data keys the plugin created: {keys:?}");
}

#[test]
fn the_lock_holds_with_the_cas_counter_about_to_wrap() {
    for seed in 0..SEEDS / 4 {
        let calls = Arc::new(AtomicU64::new(0));
        let mut options = Options::new(2, "{}", seed);
        options.shared = Shared::with_next_cas(u32::MAX - 3);
        let mut w = World::start(plugin(), options, upstream(200, 200, calls.clone())).expect("world");
        let ids = burst(&mut w, 8, &prompt("wrap"));
        assert!(w.run_until(60_000, all_answered(&ids)), "seed {seed}");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "seed {seed}: {:?}", labels(&w, &ids));
        assert!(w.shared().cas_counter < 1_000, "the counter wrapped");
    }
}

#[test]
fn hostile_inputs_never_trap_the_vm() {
    let calls = Arc::new(AtomicU64::new(0));
    let mut w = world(plugin(), r#"{"max_body_bytes":65536}"#, 3, upstream(10, 200, calls.clone()));
    let mut rng = 0x5eed_u64;
    let mut bodies: Vec<Vec<u8>> = (0..200u64)
        .map(|i| {
            (0..(i * 7 % 300))
                .map(|_| {
                    rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    (rng >> 33) as u8
                })
                .collect()
        })
        .collect();
    bodies.push("[".repeat(60_000).into_bytes());
    bodies.push(
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#, "x".repeat(70_000)).into_bytes(),
    );
    bodies.push(br#"{"model":"m","messages":[{"role":"user"}],"n":1e999}"#.to_vec());
    bodies.push(br#"{"model":"\ud800","messages":[{"role":"user"}]}"#.to_vec());
    bodies.push(b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xc3\x28\"}]}".to_vec());
    let headers = [("cache-control", "max-age=-1, no-store=1"), ("authorization", "\u{7f}\u{0}")];
    let ids: Vec<ReqId> = bodies.iter().enumerate().map(|(i, b)| w.request(i % 2, "POST", PATH, &headers, b)).collect();
    assert!(w.run_until(60_000, all_answered(&ids)));
    assert!(w.traps.is_empty(), "{:?}", w.traps);
    for id in &ids {
        let a = w.answer(*id).expect("answered");
        assert!(a.status == 400 || a.status == 413, "{} {}", a.status, String::from_utf8_lossy(&a.body));
        let v: serde_json::Value = serde_json::from_slice(&a.body).expect("OpenAI-shaped JSON");
        assert!(v["error"]["message"].is_string());
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "nothing reached HolySheep");
    let ok = w.request(0, "POST", PATH, &[], prompt("fine").as_bytes());
    assert!(w.run_until(60_000, all_answered(&[ok])));
    assert_eq!(w.answer(ok).map(|a| a.status), Some(200), "the VM still serves");
}

/// The same race scenario against a plugin whose lease is written without CAS: the
/// harness must find an interleaving with two leaders within the seeds it explores.
#[test]
fn the_race_scenarios_catch_a_broken_lock() {
    let broken = broken_plugin();
    let mut failing = Vec::new();
    for seed in 0..SEEDS {
        let calls = Arc::new(AtomicU64::new(0));
        let mut w = world(&broken, "{}", seed, upstream(200, 200, calls.clone()));
        let ids = burst(&mut w, 10, &prompt("same"));
        assert!(w.run_until(60_000, all_answered(&ids)), "seed {seed}");
        if calls.load(Ordering::SeqCst) > 1 {
            failing.push((seed, calls.load(Ordering::SeqCst)));
        }
    }
    eprintln!("broken lock: {} of {SEEDS} seeds made more than one call; first {:?}", failing.len(), failing.first());
    assert!(!failing.is_empty(), "no seed exposed the broken lock");
}

/// What the VM said when it died: the SDK's panic message, logged before the trap.
fn panics(w: &World) -> Vec<String> {
    w.logs().into_iter().filter(|l| l.contains("panicked")).take(3).collect()
}

/// A small deterministic generator for scenario choices.
fn pick(state: &mut u64, below: u64) -> u64 {
    *state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    (*state >> 33) % below
}

/// Clients that leave while their flight is in flight, some in the very event-loop turn
/// in which its answer arrives (their context still resolves until Envoy's deferred
/// delete): the VM must never answer a context after its `on_done`.
#[test]
fn clients_leaving_as_their_answer_arrives_never_crash_the_vm() {
    for seed in 0..SEEDS / 4 {
        let calls = Arc::new(AtomicU64::new(0));
        let mut rng = seed ^ 0x9e37_79b9;
        let latency: Vec<u64> = (0..64).map(|_| 10 * (1 + pick(&mut rng, 20))).collect();
        let script = scripted(calls.clone(), move |n| Up::Answer(latency[(n % 64) as usize], 200));
        let mut w = world(plugin(), r#"{"cache":{"scope":"global"}}"#, seed, script);
        let start = w.now();
        let mut stay = Vec::new();
        for i in 0..40 {
            let id = w.request(i % 2, "POST", PATH, &[], prompt(&format!("distinct {i}")).as_bytes());
            if pick(&mut rng, 2) == 0 {
                w.reset_at(id, start + 10 * (1 + pick(&mut rng, 20)));
            } else {
                stay.push(id);
            }
        }
        let answered = w.run_until(60_000, all_answered(&stay));
        assert!(w.traps.is_empty(), "seed {seed}: {:?}", panics(&w));
        assert!(answered, "seed {seed}: {:?}", labels(&w, &stay));
        assert!(stay.iter().all(|id| w.answer(*id).is_some_and(|a| a.status == 200)), "seed {seed}");
        let after = burst(&mut w, 2, &prompt("still serving"));
        assert!(w.run_until(60_000, all_answered(&after)), "seed {seed}: the VM still serves");
    }
}

/// A crowd of identical requests far larger than one VM call can answer with local
/// replies (Envoy sends each inside the previous one's response callback).
#[test]
fn a_crowd_of_two_thousand_identical_requests_makes_one_call_and_everyone_gets_200() {
    for seed in 0..3 {
        let calls = Arc::new(AtomicU64::new(0));
        let mut w = world(plugin(), "{}", seed, upstream(300, 200, calls.clone()));
        let ids = burst(&mut w, 2_000, &prompt("crowd"));
        let answered = w.run_until(60_000, all_answered(&ids));
        assert!(w.traps.is_empty(), "seed {seed}: {:?}", w.traps.first());
        assert!(answered, "seed {seed}");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "seed {seed}");
        assert!(ids.iter().all(|id| w.answer(*id).is_some_and(|a| a.status == 200)), "seed {seed}");
    }
}

/// Envoy without `allow_on_headers_stop_iteration` never hands the body to a filter that
/// paused on headers: requests must get a 500 naming the setting, not hang.
#[test]
fn a_missing_allow_on_headers_stop_iteration_is_named_not_a_hang() {
    let calls = Arc::new(AtomicU64::new(0));
    let mut options = Options::new(2, "{}", 5);
    options.allow_on_headers_stop_iteration = false;
    let mut w = World::start(plugin(), options, upstream(10, 200, calls.clone())).expect("world");
    let ids = burst(&mut w, 4, &prompt("never read"));
    assert!(w.run_until(10_000, all_answered(&ids)), "requests hang");
    for id in &ids {
        let a = w.answer(*id).expect("answered");
        let v: serde_json::Value = serde_json::from_slice(&a.body).expect("OpenAI-shaped JSON");
        assert_eq!((a.status, v["error"]["code"].as_str()), (500, Some("edge_misconfigured")));
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("allow_on_headers_stop_iteration")));
    }
    let logged = w.logs().iter().filter(|l| l.contains("allow_on_headers_stop_iteration")).count();
    assert_eq!(logged, 2, "logged once per worker VM");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(w.traps.is_empty(), "{:?}", w.traps);
}

/// The watch for that setting never fires where the setting is on: a request that waits
/// long for its answer has had its body.
#[test]
fn a_slow_upstream_is_not_mistaken_for_the_missing_setting() {
    let calls = Arc::new(AtomicU64::new(0));
    let mut w = world(plugin(), "{}", 9, upstream(2_000, 200, calls.clone()));
    let ids = burst(&mut w, 4, &prompt("slow upstream"));
    assert!(w.run_until(60_000, all_answered(&ids)));
    assert!(ids.iter().all(|id| w.answer(*id).is_some_and(|a| a.status == 200)));
    assert!(!w.logs().iter().any(|l| l.contains("allow_on_headers_stop_iteration")));
}

/// HolySheep's answer to a call: events for a stream (split anywhere by the harness), JSON
/// otherwise; the same content either way.
fn answer_in_form(n: u64, body: &[u8]) -> Option<(Headers, Vec<u8>)> {
    let req: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let content = format!("answer {n} to {}", req["messages"][0]["content"].as_str().unwrap_or(""));
    let usage = serde_json::json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7});
    if req["stream"] != true {
        let body = serde_json::json!({"id": format!("c{n}"), "object": "chat.completion", "created": 1, "model": "gpt-4.1",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": usage});
        return Some((vec![(":status".into(), "200".into())], body.to_string().into_bytes()));
    }
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
        serde_json::json!({"id": format!("c{n}"), "object": "chat.completion.chunk", "created": 1, "model": "gpt-4.1",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut events = vec![chunk(serde_json::json!({"role": "assistant", "content": ""}), serde_json::Value::Null)];
    events.extend(
        content.split_inclusive(' ').map(|w| chunk(serde_json::json!({"content": w}), serde_json::Value::Null)),
    );
    events.push(chunk(serde_json::json!({}), "stop".into()));
    if req["stream_options"]["include_usage"] == true {
        events.push(serde_json::json!({"id": format!("c{n}"), "object": "chat.completion.chunk", "created": 1,
            "model": "gpt-4.1", "choices": [], "usage": usage}));
    }
    let mut sse: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    sse.push_str("data: [DONE]\n\n");
    let headers = vec![(":status".into(), "200".into()), ("content-type".into(), "text/event-stream".into())];
    Some((headers, sse.into_bytes()))
}

fn text_of(a: &Answer) -> String {
    let body = String::from_utf8_lossy(&a.body).into_owned();
    if a.header("content-type") != Some("text/event-stream") {
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        return v["choices"][0]["message"]["content"].as_str().unwrap_or("").to_owned();
    }
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect()
}

/// An upstream answering each call in the form it asked for, after `latency_ms`.
fn in_form_after(latency_ms: u64, calls: Arc<AtomicU64>) -> Upstream {
    Box::new(move |call| {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        Some((latency_ms, answer_in_form(n, &call.body)))
    })
}

fn stream_body(text: &str) -> String {
    streamed(&prompt(text))
}

#[test]
fn streams_and_plain_requests_share_one_flight_in_their_own_forms() {
    for seed in 0..SEEDS / 10 {
        let calls = Arc::new(AtomicU64::new(0));
        let mut w = world(plugin(), "{}", seed, in_form_after(200, calls.clone()));
        let ids: Vec<ReqId> = (0..10)
            .map(|i| {
                let body = if i < 6 { stream_body("both forms") } else { prompt("both forms") };
                w.request(i % 2, "POST", PATH, &[], body.as_bytes())
            })
            .collect();
        assert!(w.run_until(60_000, all_answered(&ids)), "seed {seed}: {:?}", labels(&w, &ids));
        assert!(w.traps.is_empty(), "seed {seed}: {:?}", panics(&w));
        assert_eq!(calls.load(Ordering::SeqCst), 1, "seed {seed}: {:?}", labels(&w, &ids));
        let answers: Vec<&Answer> = ids.iter().filter_map(|id| w.answer(*id)).collect();
        assert!(answers.iter().all(|a| a.status == 200));
        for (i, a) in answers.iter().enumerate() {
            assert_eq!(a.header("content-type") == Some("text/event-stream"), i < 6, "seed {seed}: its own form");
            assert_eq!(text_of(a), "answer 1 to both forms", "seed {seed}");
        }
        let again = w.request(0, "POST", PATH, &[], prompt("both forms").as_bytes());
        assert!(w.run_until(60_000, all_answered(&[again])));
        assert_eq!(w.answer(again).map(Answer::cache), Some("HIT"), "seed {seed}: the stream was stored");
    }
}

#[test]
fn when_a_stream_leaders_client_leaves_a_waiter_leads_a_new_flight() {
    for seed in 0..SEEDS / 10 {
        let calls = Arc::new(AtomicU64::new(0));
        let mut w = world(plugin(), "{}", seed, in_form_after(300, calls.clone()));
        let leader = w.request(0, "POST", PATH, &[], stream_body("left early").as_bytes());
        assert!(w.run_until(1_000, |_| calls.load(Ordering::SeqCst) == 1), "seed {seed}");
        let waiters: Vec<ReqId> = (0..4)
            .map(|i| {
                let body = if i % 2 == 0 { stream_body("left early") } else { prompt("left early") };
                w.request(i % 2, "POST", PATH, &[], body.as_bytes())
            })
            .collect();
        w.settle();
        w.reset(leader);
        assert!(w.run_until(60_000, all_answered(&waiters)), "seed {seed}: {:?}", labels(&w, &waiters));
        assert!(w.traps.is_empty(), "seed {seed}: {:?}", panics(&w));
        assert_eq!(calls.load(Ordering::SeqCst), 2, "seed {seed}: one waiter led anew");
        for id in &waiters {
            let a = w.answer(*id).expect("answered");
            assert_eq!((a.status, text_of(a)), (200, "answer 2 to left early".to_owned()), "seed {seed}");
        }
    }
}

/// A body followed by trailers (HTTP/2 clients) ends at the trailers: it is validated and
/// governed like any other, never released along the route unread.
#[test]
fn a_body_that_ends_with_trailers_is_still_validated_and_governed() {
    let calls = Arc::new(AtomicU64::new(0));
    let mut w = world(plugin(), "{}", 13, upstream(10, 200, calls.clone()));
    let trailers: Headers = vec![("x-checksum".into(), "1".into())];
    let bad = w.request_with_trailers(0, "POST", PATH, &[], b"{not json", Some(trailers.clone()));
    let good = w.request_with_trailers(1, "POST", PATH, &[], prompt("trailed").as_bytes(), Some(trailers));
    assert!(w.run_until(60_000, all_answered(&[bad, good])));
    assert_eq!(w.answer(bad).map(|a| a.status), Some(400), "validated");
    assert_eq!(w.answer(good).map(|a| (a.status, a.cache().to_owned())), Some((200, "MISS".to_owned())));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(
        w.upstream_calls.iter().all(|c| c.cluster == "holysheep" && c.timeout_ms > 0),
        "callouts only, no pass-through"
    );
}

/// Envoy never frees a queue: configuration reloads must reuse the names (and queues) of
/// the VMs they replace, not add new ones every time.
#[test]
fn configuration_reloads_reuse_the_wake_queues() {
    let clock = Arc::new(AtomicU64::new(1_000_000));
    let mut shared = Shared::with_next_cas(1);
    let mut counts = Vec::new();
    for reload in 0..5u64 {
        let calls = Arc::new(AtomicU64::new(0));
        let mut options = Options::new(2, "{}", reload);
        options.clock = host_test::proxy_host::state::Clock::Virtual(clock.clone());
        options.shared = shared;
        let mut w = World::start(plugin(), options, upstream(50, 200, calls.clone())).expect("world");
        let ids = burst(&mut w, 6, &prompt(&format!("reload {reload}")));
        assert!(w.run_until(60_000, all_answered(&ids)), "reload {reload}");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "reload {reload}: the queues still wake the other worker");
        counts.push(w.shared().queues.len());
        shared = w.stop();
        // The old VMs' heartbeats age out before the next configuration's VMs start.
        clock.fetch_add(11_000, Ordering::SeqCst);
    }
    assert!(counts.iter().all(|c| *c == counts[0]), "queues after each reload: {counts:?}");
}

/// `max-age` and the TTL on the virtual clock: no test waits for wall-clock seconds.
#[test]
fn max_age_and_ttl_follow_the_clock() {
    let clock = Arc::new(AtomicU64::new(1_000_000));
    let calls = Arc::new(AtomicU64::new(0));
    let mut options = Options::new(2, r#"{"cache":{"ttl_seconds":30}}"#, 21);
    options.clock = host_test::proxy_host::state::Clock::Virtual(clock.clone());
    let mut w = World::start(plugin(), options, upstream(10, 200, calls.clone())).expect("world");
    let ask = |w: &mut World, cc: &str| {
        let id = w.request(0, "POST", PATH, &[("cache-control", cc)], prompt("aging").as_bytes());
        assert!(w.run_until(60_000, all_answered(&[id])));
        w.answer(id).map(|a| (a.cache().to_owned(), a.header("age").map(str::to_owned))).expect("answered")
    };
    assert_eq!(ask(&mut w, "").0, "MISS");
    clock.fetch_add(5_000, Ordering::SeqCst);
    assert_eq!(ask(&mut w, "max-age=10"), ("HIT".to_owned(), Some("5".to_owned())));
    assert_eq!(ask(&mut w, "max-age=2").0, "MISS", "older than the client accepts");
    clock.fetch_add(31_000, Ordering::SeqCst);
    assert_eq!(ask(&mut w, "").0, "MISS", "past the TTL");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// Host calls that fail with a status the proxy-wasm Rust SDK's wrappers do not expect
/// (they `panic!`, which kills the VM): the plugin takes every one as an error, whether they
/// fail from the VM's start or in the middle of its flights.
#[test]
fn host_calls_failing_with_unexpected_statuses_never_trap_the_vm() {
    const FAILING: [&str; 21] = [
        "proxy_set_effective_context",
        "proxy_get_buffer_bytes",
        "proxy_set_buffer_bytes",
        "proxy_get_header_map_value",
        "proxy_remove_header_map_value",
        "proxy_replace_header_map_value",
        "proxy_get_property",
        "proxy_get_shared_data",
        "proxy_set_shared_data",
        "proxy_register_shared_queue",
        "proxy_resolve_shared_queue",
        "proxy_enqueue_shared_queue",
        "proxy_dequeue_shared_queue",
        "proxy_continue_stream",
        "proxy_send_local_response",
        "proxy_http_call",
        "proxy_define_metric",
        "proxy_increment_metric",
        "proxy_get_current_time_nanoseconds",
        "proxy_set_tick_period_milliseconds",
        "proxy_log",
    ];
    let config = r#"{"models":{"gpt-4.1":{"requests_per_minute":600}}}"#;
    for from_the_start in [false, true] {
        let calls = Arc::new(AtomicU64::new(0));
        let mut options = Options::new(2, config, 21);
        if from_the_start {
            options.shared.failing_calls = FAILING.into();
        }
        let mut w = World::start(plugin(), options, upstream(50, 200, calls.clone())).expect("world");
        let streamed = streamed(&prompt("odd host, streamed"));
        let mut ids = burst(&mut w, 6, &prompt("odd host"));
        ids.extend(burst(&mut w, 4, &streamed));
        // Flights in the air (callouts sent, streams forwarded, waiters paused), then the
        // host's calls start failing.
        w.run_until(20, |_| false);
        w.shared().failing_calls = FAILING.into();
        ids.push(w.request(0, "POST", PATH, &[], b"{"));
        ids.push(w.request(1, "GET", "/v1/models", &[], b""));
        ids.extend(burst(&mut w, 4, &prompt("odd host, later")));
        w.run_until(5_000, all_answered(&ids));
        assert!(w.traps.is_empty(), "from the start {from_the_start}: a VM died: {:?}", w.traps.first());
    }
}

/// A leader waiting for the model owner's verdict longer than its lease keeps the lease
/// (it is renewed like a call in flight): no waiter takes over and calls HolySheep again.
#[test]
fn a_lease_is_renewed_while_its_flight_waits_for_the_model_owners_verdict() {
    let config = r#"{"fleet":{"cluster":"owners","nodes":2,"timeout_ms":1000,"internal":false},"lock":{"lease_ms":200},
                     "models":{"gpt-4.1":{"requests_per_minute":600}}}"#;
    let chat_calls = Arc::new(AtomicU64::new(0));
    let counted = chat_calls.clone();
    let upstream: Upstream = Box::new(move |call| {
        if call.cluster == "owners" {
            // The model owner answers after three lease periods.
            let verdict = br#"{"admitted":true,"denial":null}"#.to_vec();
            return Some((600, Some((vec![(":status".into(), "200".into())], verdict))));
        }
        let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
        Some((10, answer(n, 200, &call.body)))
    });
    let mut options = Options::new(2, config, 4);
    options.env = vec![("HOLYSHEEP_PEER_SECRET".into(), "fleet-secret".into())];
    let mut w = World::start(plugin(), options, upstream).expect("world");
    let ids = burst(&mut w, 6, &prompt("a slow verdict"));
    assert!(w.run_until(10_000, all_answered(&ids)), "{:?}", labels(&w, &ids));
    assert!(w.traps.is_empty(), "{:?}", w.traps);
    let statuses: Vec<u16> = ids.iter().filter_map(|id| w.answer(*id)).map(|a| a.status).collect();
    let first = w.answer(ids[0]).map(|a| String::from_utf8_lossy(&a.body).into_owned());
    assert_eq!(statuses, [200; 6], "{first:?}");
    assert_eq!(chat_calls.load(Ordering::SeqCst), 1, "one flight: {:?}", labels(&w, &ids));
}

/// A finished flight's way is kept for its waiters: a new prompt that finds no other way
/// right after the flight ended goes upstream alone rather than take that way while the
/// waiters (100 on the other worker: two batches, two VM calls) have yet to read it.
#[test]
fn a_finished_flights_answer_outlives_a_new_prompt_that_wants_its_way() {
    const WAITERS: usize = 100;
    for seed in 0..SEEDS / 4 {
        let calls = Arc::new(AtomicU64::new(0));
        // The failing prompt answers after 100 ms; three others hold the group's other ways.
        let script = Box::new({
            let calls = calls.clone();
            move |call: &UpstreamCall| {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let failing = String::from_utf8_lossy(&call.body).contains("fails once");
                let (delay, status) = if failing { (100, 503) } else { (5_000, 200) };
                Some((delay, answer(n, status, &call.body)))
            }
        });
        let config = r#"{"lock":{"slots":4,"lease_ms":10000},"retry":{"max_attempts":1}}"#;
        let clock = Arc::new(AtomicU64::new(1_000_000));
        let options = Options { clock: Clock::Virtual(clock.clone()), ..Options::new(2, config, seed) };
        let mut w = World::start(plugin(), options, script).expect("world starts");
        let auth = [("authorization", "Bearer t")];
        for other in ["holds way a", "holds way b", "holds way c"] {
            w.request(0, "POST", PATH, &auth, prompt(other).as_bytes());
        }
        let body = prompt("fails once");
        let leader = w.request(0, "POST", PATH, &auth, body.as_bytes());
        w.settle();
        let waiters: Vec<ReqId> = (0..WAITERS).map(|_| w.request(1, "POST", PATH, &auth, body.as_bytes())).collect();
        w.settle();
        // Step by step until the leader has its answer; then a new prompt arrives at once.
        let mut newcomer = None;
        while !waiters.iter().all(|id| w.answer(*id).is_some()) {
            if !w.step() {
                let Some(next) = w.next_due() else { break };
                clock.store(next.max(w.now()), Ordering::SeqCst);
                w.release_due();
                continue;
            }
            if newcomer.is_none() && w.answer(leader).is_some() {
                newcomer = Some(w.request(0, "POST", PATH, &auth, prompt("wants a way").as_bytes()));
            }
        }
        let failing_calls = w.upstream_calls.iter().filter(|c| String::from_utf8_lossy(&c.body).contains("fails once"));
        assert_eq!(
            failing_calls.count(),
            1,
            "seed {seed}: the waiters got the flight's answer, not calls of their own"
        );
        for id in &waiters {
            let a = w.answer(*id).expect("answered");
            assert_eq!((a.status, a.cache()), (503, "COALESCED"), "seed {seed}");
        }
        let lost = w.shared().metrics.get("wasmcustom.holysheep.other.waits_lost").copied().unwrap_or(0);
        assert_eq!(lost, 0, "seed {seed}");
        assert!(w.traps.is_empty(), "seed {seed}: {:?}", w.traps);
    }
}

/// A reload that rotates a tenant's key (the old one removed) refuses the old key at once
/// and keeps what the tenant spent: the budget is shared data, keyed by the tenant.
#[test]
fn a_reload_that_rotates_a_tenants_key_keeps_its_spend() {
    let body = prompt("spend once");
    // The call's worst case: every body byte a prompt token, and the 4096 completion tokens
    // it is sent with (it sets no limit), at $30 per million tokens.
    let worst = (body.len() as u64 + 4096) * 30;
    // Room for one worst case; the call then costs 3 * 10 + 2 * 30 = 90 micro-dollars.
    let budget = (worst + 50) as f64 / 1e6;
    let config = |key: &str| {
        format!(
            r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30}}}},
                "tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":{budget}}}}}}}"#,
            key_digest(key)
        )
    };
    let clock = Arc::new(AtomicU64::new(1_000_000));
    let calls = Arc::new(AtomicU64::new(0));
    let ask = |w: &mut World, token: &str, text: &str| {
        let auth = format!("Bearer {token}");
        let id = w.request(0, "POST", PATH, &[("authorization", &auth)], prompt(text).as_bytes());
        assert!(w.run_until(60_000, |w| w.answer(id).is_some()));
        let a = w.answer(id).expect("answered");
        let code = serde_json::from_slice::<serde_json::Value>(&a.body).ok().map(|v| v["error"]["code"].clone());
        (a.status, code.and_then(|c| c.as_str().map(str::to_owned)))
    };
    let mut options = Options::new(2, &config("hs-old"), 1);
    options.clock = Clock::Virtual(clock.clone());
    let mut w = World::start(plugin(), options, upstream(10, 200, calls.clone())).expect("world");
    assert_eq!(ask(&mut w, "hs-old", "spend once"), (200, None));
    let shared = w.stop();
    let mut options = Options::new(2, &config("hs-new"), 2);
    options.clock = Clock::Virtual(clock.clone());
    options.shared = shared;
    let mut w = World::start(plugin(), options, upstream(10, 200, calls.clone())).expect("world");
    assert_eq!(ask(&mut w, "hs-old", "spend twice"), (401, Some("invalid_api_key".into())), "removed: refused");
    assert_eq!(ask(&mut w, "hs-new", "spend twice"), (429, Some("insufficient_quota".into())), "the spend is kept");
    assert_eq!(ask(&mut w, "hs-new", "spend once").0, 200, "its cached answer is free");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(w.traps.is_empty(), "{:?}", w.traps);
}
