//! The fleet's configuration digest: what a node runs of the settings that decide keys,
//! scopes and prices. A forward node sends it on every hop, and an owner compares it with
//! its own (docs/fleet.md#configurations-that-must-agree): two configurations that
//! disagree on any of these key or charge the same request differently.

use crate::core::config::{Cache, Config, Scope};
use crate::core::wire::digest::sha256;
use serde_json::{json, Value};

/// Hex digits of the digest carried (64 bits: a mismatch, not an attacker, is what it
/// finds; the hop itself is authenticated).
const DIGITS: usize = 16;

/// The digest of `config`'s cache scope, models, tenants and semantic tier, as settled
/// (defaults filled in): two configurations that spell the same settings otherwise have
/// the same digest.
pub(crate) fn of(config: &Config) -> String {
    let text = settled(config).to_string();
    let digest = sha256(text.into_bytes());
    digest.iter().take(DIGITS / 2).map(|b| format!("{b:02x}")).collect()
}

/// The settings the digest covers, as one JSON value (its maps sorted by name).
fn settled(config: &Config) -> Value {
    let Cache { scope, tenant_header, only_deterministic, require_tenant, .. } = &config.cache;
    let models: serde_json::Map<String, Value> = config
        .models
        .iter()
        .map(|(name, m)| {
            let model = json!([
                m.usd_per_mtok_input,
                m.usd_per_mtok_output,
                m.usd_per_mtok_cached_input,
                m.max_completion_tokens,
                m.context_window,
                m.fallback,
            ]);
            (name.clone(), model)
        })
        .collect();
    let tenants: serde_json::Map<String, Value> = config
        .tenants
        .iter()
        .map(|(name, t)| {
            let mut keys: Vec<String> = t.keys_sha256.iter().map(|k| k.to_ascii_lowercase()).collect();
            keys.sort();
            let caps = t.caps();
            let tenant = json!([
                keys,
                t.models,
                caps.per_day,
                caps.per_month,
                t.requests_per_minute,
                t.tokens_per_minute,
                t.burst,
                t.priority.as_str(),
            ]);
            (name.clone(), tenant)
        })
        .collect();
    let s = &config.semantic;
    let semantic = json!([s.enabled, s.embedding_model, s.dimensions, s.threshold, s.models, s.allow_tools]);
    json!({
        "cache": [*scope == Scope::Tenant, tenant_header.as_deref().map(str::to_ascii_lowercase), only_deterministic, require_tenant],
        "models": models,
        "tenants": tenants,
        "semantic": semantic,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(raw: &str) -> String {
        Config::parse(raw.as_bytes()).unwrap().digest
    }

    const DIGEST: &str = "8e6f1b5e3c1f0c8d42a9a4c2b2f9a7e0d3c0b1a2f3e4d5c6b7a8998877665544";

    #[test]
    fn settings_spelled_otherwise_have_one_digest_and_any_change_of_key_scope_or_price_another() {
        let tenants = format!(r#""tenants":{{"a":{{"keys_sha256":["{DIGEST}"],"usd_per_day":5}}}}"#);
        let base =
            format!(r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}},{tenants}}}"#);
        let d = digest(&base);
        assert_eq!(d.len(), DIGITS);
        // Defaults written out, other members, another order, a forward role: the same.
        let spelled = format!(
            r#"{{"role":"forward","cache":{{"scope":"tenant","ttl_seconds":60}},{tenants},
               "models":{{"gpt-4.1":{{"usd_per_mtok_output":8.0,"usd_per_mtok_input":2,"requests_per_minute":60}}}}}}"#
        );
        assert_eq!(digest(&spelled), d);
        let changed = [
            base.replace(r#""usd_per_mtok_output":8"#, r#""usd_per_mtok_output":9"#),
            base.replace(r#""usd_per_day":5"#, r#""usd_per_day":6"#),
            base.replace(&DIGEST[..8], "00000000"),
            base.replacen('{', r#"{"semantic":{"enabled":true,"embedding_model":"gpt-4.1"},"#, 1),
            base.replace(r#""usd_per_day":5"#, r#""usd_per_day":5,"models":["gpt-4.1"]"#),
        ];
        for c in &changed {
            assert_ne!(digest(c), d, "{c}");
        }
        // Without tenants, the scope.
        assert_eq!(digest(""), digest("{}"), "all defaults");
        for scope in [r#"{"cache":{"tenant_header":"x-tenant-id"}}"#, r#"{"cache":{"scope":"global"}}"#] {
            assert_ne!(digest(scope), digest("{}"), "{scope}");
        }
    }
}
