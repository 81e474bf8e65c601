//! Any bytes in a shared-data slot (a cache entry, a lease, a bucket, the queue registry):
//! reading them never panics.
#![no_main]

use holysheep_edge::core::config::Config;
use holysheep_edge::core::request::request_key;
use holysheep_edge::core::store::{CasStore, Read, StoreError};
use holysheep_edge::core::coalesce::{lease, wake};
use holysheep_edge::core::{cache, limits};
use libfuzzer_sys::fuzz_target;

/// Every key holds the fuzzer's bytes.
struct Garbage<'a>(&'a [u8]);

impl CasStore for Garbage<'_> {
    fn get(&self, _key: &str) -> Result<Read, StoreError> {
        Ok(Read { value: Some(self.0.to_vec()), cas: Some(7) })
    }
    fn set(&self, _key: &str, _value: &[u8], _cas: Option<u32>) -> Result<(), StoreError> {
        Err(StoreError::CasMismatch)
    }
}

fuzz_target!(|data: &[u8]| {
    let (store, config) = (Garbage(data), Config::default());
    let key = request_key("/v1/chat/completions", "s", b"{}");
    let _ = cache::get(&store, &config, &key);
    let (group, ways) = lease::group_of(&config, &key);
    for way in 0..=ways {
        let _ = lease::read(&store, &lease::Slot { group: group.clone(), way });
    }
    let _ = lease::acquire(&store, &config, &key, 1, 1_000, 1_000);
    let limits = limits::Limits::of(&Default::default(), &Default::default());
    let _ = limits::peek(&store, "gpt-4.1", &limits, 1_000);
    let _ = wake::live(&store, 1_000);
});
