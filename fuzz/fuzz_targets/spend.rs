//! Any answer from the spend store (etcd's JSON gateway, or whatever answers on its cluster)
//! to a read and to the write after it: reading them never panics, and neither a read nor a
//! write's answer loses what this node settled and has not written (today's spend never
//! drops below it), unless the answer says that very write landed (the key holds its tag,
//! as the last write or as its writer's last).
#![no_main]

#[path = "mem.rs"]
mod mem;
use holysheep_edge::core::config::Config;
use holysheep_edge::core::limits::budget_store::{self, Due, Found};
use holysheep_edge::core::limits::{budget, budget::Backing};
use libfuzzer_sys::fuzz_target;
use mem::Mem;

fn config() -> Config {
    let raw = format!(
        r#"{{"budget_store":{{"cluster":"etcd"}},
            "models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}},
            "tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":1}}}}}}"#,
        "a".repeat(64)
    );
    Config::parse(raw.as_bytes()).unwrap_or_default()
}

const DAY_MS: u64 = 86_400_000;

fuzz_target!(|data: &[u8]| {
    let (store, config) = (Mem::default(), config());
    let Some((&pick, body)) = data.split_first() else { return };
    let status = if pick & 1 == 0 { 200 } else { u16::from(pick) * 2 };
    let now_ms = DAY_MS * 20_000 + 1_000;
    let today = now_ms / DAY_MS;
    // The key read empty, then a call settled here: 4000 not yet written.
    budget_store::read(&store, "t", Some(Found { stored: None, revision: 1 }), now_ms);
    let Some(caps) = config.tenants.get("t").map(|t| t.caps()) else { return };
    let backing = Backing::of(&config, true);
    let reserved = budget::reserve(&store, "t", (caps, backing), (1, 5_000, now_ms + 60_000), now_ms);
    assert!(reserved.is_ok(), "{reserved:?}");
    budget::settle(&store, "t", caps, 1, 4_000, now_ms);
    assert_eq!(budget::spent(&store, "t", now_ms).0, 4_000);
    // Any answer to a read: what was settled here stays counted (an answer for a later
    // day moves the record's day on, which this target leaves aside).
    let found = budget_store::read_range(status, body);
    let later_day = found.as_ref().and_then(|f| f.stored.as_ref()).is_some_and(|s| s.day > today);
    budget_store::read(&store, "t", found, now_ms);
    if !later_day {
        assert!(budget::spent(&store, "t", now_ms).0 >= 4_000, "a read lost unwritten spend");
    }
    // The write of it, and any answer: what was not acknowledged stays counted.
    let Some(Due::Write(flush)) = budget_store::due(&store, &config, "t", now_ms, 7) else { return };
    let answer = budget_store::read_txn(status, body);
    // Landed: written, or refused with the key holding this write's tag (under others').
    let landed = match &answer {
        Some(Ok(_)) => true,
        Some(Err(now)) => now.stored.as_ref().is_some_and(|v| flush.value.write.is_some_and(|t| v.holds(t))),
        None => false,
    };
    budget_store::flushed(&store, &flush, answer, now_ms + 1);
    if !landed && !later_day && flush.value.day == today {
        assert!(budget::spent(&store, "t", now_ms + 1).0 >= 4_000, "an answer lost unwritten spend");
    }
});
