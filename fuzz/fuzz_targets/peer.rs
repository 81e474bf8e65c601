//! Any body on the fleet's internal path (a model's or a tenant's operation, from a node
//! or from anyone who reaches the owner listener): serving it never panics, an operation
//! read is written back as one on the same bucket, and any verdict body reads without
//! panicking.
#![no_main]

use holysheep_edge::core::config::Config;
use holysheep_edge::core::limits::fleet::{self, Op, Verdict};
#[path = "mem.rs"]
mod mem;
use mem::Mem;
use libfuzzer_sys::fuzz_target;

fn config() -> Config {
    let raw = format!(
        r#"{{"fleet":{{"cluster":"owners","nodes":3}},
            "models":{{"gpt-4.1":{{"requests_per_minute":60,"tokens_per_minute":10000,"max_in_flight":4,
                                  "usd_per_mtok_input":2,"usd_per_mtok_output":8}}}},
            "tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":1,"tokens_per_minute":5000}}}}}}"#,
        "a".repeat(64)
    );
    Config::parse(raw.as_bytes()).unwrap_or_default()
}

fuzz_target!(|data: &[u8]| {
    let (store, config) = (Mem::default(), config());
    let _ = Verdict::parse(data);
    // One operation or several, each served on the same owner's store.
    for (i, body) in data.split(|b| *b == 0).enumerate() {
        let now_ms = 1_000 * i as u64;
        if let Ok(op) = Op::parse(body) {
            // Written and read back it is the same operation on the same bucket (its
            // provider hints are floats, which may come back a last digit off).
            let Ok(back) = Op::parse(&op.to_json()) else { panic!("an operation written is not read back") };
            assert_eq!((back.bucket(&config), back.tenant()), (op.bucket(&config), op.tenant()));
        }
        let _ = fleet::serve(&store, &config, body, now_ms);
    }
});
