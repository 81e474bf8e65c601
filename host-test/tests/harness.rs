//! Scenarios against the built plugin in the wasmtime host (`host_test::proxy_host`):
//! several worker VMs sharing Envoy-exact shared data and queues, a virtual clock, and a
//! seeded scheduler that interleaves VMs at every shared-state call.

use host_test::envoy::{wasm_path, workspace_root};
use host_test::proxy_host::state::{Headers, Shared};
use host_test::proxy_host::world::{Options, Plugin, ReqId, Upstream, World};
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

/// An upstream that answers every chat completion after `latency_ms` (virtual), counting
/// the calls in `calls`.
fn upstream(latency_ms: u64, status: u16, calls: Arc<AtomicU64>) -> Upstream {
    Box::new(move |call| {
        calls.fetch_add(1, Ordering::SeqCst);
        let body = format!(
            r#"{{"id":"c{}","object":"chat.completion","choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}},"echo":{}}}"#,
            call.token,
            call.body.len()
        );
        let headers: Headers =
            vec![(":status".into(), status.to_string()), ("content-type".into(), "application/json".into())];
        Some((latency_ms, Some((headers, body.into_bytes()))))
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
