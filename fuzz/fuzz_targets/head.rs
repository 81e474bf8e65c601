//! Any request head (tenant tokens in `authorization`, the priority header, repeated names,
//! bytes that are not UTF-8; `fuzz/dicts/head.dict` seeds the tenant's token) and any body
//! after it: reading and checking it
//! never panics, only the one configured token verifies its tenant, a repeated credential
//! never verifies, and a request can only lower its tenant's priority class.
#![no_main]

use holysheep_edge::core::api::priority::Class;
use holysheep_edge::core::config::Config;
use holysheep_edge::core::intake::{self, Head};
use holysheep_edge::core::wire::digest::sha256;
use libfuzzer_sys::fuzz_target;

/// The token whose SHA-256 tenant `t` holds.
const TOKEN: &str = "hs-fuzz";
const NAMES: [&[u8]; 8] = [
    b":method",
    b":path",
    b"authorization",
    b"x-tenant-id",
    b"x-holysheep-priority",
    b"cache-control",
    b"content-length",
    b"x-holysheep-peer-secret",
];

fn config() -> Config {
    let digest: String = sha256(TOKEN.as_bytes().to_vec()).iter().map(|b| format!("{b:02x}")).collect();
    let raw = format!(
        r#"{{"tenants":{{"t":{{"keys_sha256":["{digest}"],"priority":"standard","usd_per_day":1}}}},
            "models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}}}}"#
    );
    Config::parse(raw.as_bytes()).unwrap_or_default()
}

fuzz_target!(|data: &[u8]| {
    let config = config();
    // Header lines up to the first empty one, each a name's index and its value; the body after.
    let mut parts = data.split(|b| *b == b'\n');
    let mut pairs = Vec::new();
    for line in parts.by_ref() {
        let Some((&which, value)) = line.split_first() else { break };
        pairs.push((NAMES[usize::from(which) % NAMES.len()], value));
    }
    let body: Vec<u8> = parts.collect::<Vec<_>>().join(&b'\n');
    // With `tenants` the tenant is the one its key names: no tenant header (refused at load).
    let mut head = Head::read(pairs.iter().copied(), config.cache.tenant_header.as_deref());
    let _ = head.route();
    let _ = head.ungoverned(&config);
    let _ = head.scope_bytes();
    let authorizations = pairs.iter().filter(|(n, _)| *n == b"authorization").count();
    if head.check(&config).is_ok() {
        assert_eq!(head.verified.as_deref(), Some("t"));
        assert_eq!(authorizations, 1, "a repeated credential verified");
        let token = head.authorization.as_deref().and_then(|a| a.trim().split_once(' ')).map(|(_, t)| t.trim());
        assert_eq!(token, Some(TOKEN), "another token verified");
    }
    if let Ok(class) = Class::of(Class::Standard, head.priority.as_deref()) {
        assert!(class >= Class::Standard, "a request raised its own class");
    }
    let _ = intake::intake(&config, &head, &body);
});
