//! Any answer from the spend store (etcd's JSON gateway, or whatever answers on its cluster)
//! and any record in a tenant's shared-data slot: reading them never panics, and a read
//! never lowers what the node counts as spent today.
#![no_main]

use holysheep_edge::core::config::Config;
use holysheep_edge::core::limits::{budget, budget_store};
#[path = "mem.rs"]
mod mem;
use mem::Mem;
use libfuzzer_sys::fuzz_target;

fn config() -> Config {
    let raw = format!(
        r#"{{"budget_store":{{"cluster":"etcd"}},
            "models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}},
            "tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":1}}}}}}"#,
        "a".repeat(64)
    );
    Config::parse(raw.as_bytes()).unwrap_or_default()
}

fuzz_target!(|data: &[u8]| {
    let (store, config) = (Mem::default(), config());
    let Some((&pick, body)) = data.split_first() else { return };
    let status = if pick & 1 == 0 { 200 } else { u16::from(pick) * 2 };
    let now_ms = 86_400_000 * 3 + 1_000;
    // Spend this node settled before the store answered.
    let caps = config.tenants["t"].caps();
    let backing = budget::Backing { store: true, nodes: 1, outage_micro: None, replicas: 1 };
    if budget::reserve(&store, "t", (caps, backing), (1, 5_000, now_ms + 60_000), now_ms).is_ok() {
        budget::settle(&store, "t", caps, 1, 4_000, now_ms);
    }
    let before = budget::spent(&store, "t", now_ms).0;
    let found = budget_store::read_range(status, body);
    let _ = budget_store::read_txn(status, body);
    budget_store::read(&store, "t", found, now_ms);
    assert!(budget::spent(&store, "t", now_ms).0 >= before, "a read lowered today's spend");
    if let Some(budget_store::Due::Write(flush)) = budget_store::due(&store, &config, "t", now_ms, 7) {
        budget_store::flushed(&store, &flush, budget_store::read_txn(status, body), now_ms + 1);
        assert!(budget::spent(&store, "t", now_ms + 1).0 >= before, "a flush lowered today's spend");
    }
});
