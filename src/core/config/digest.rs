//! The fleet's configuration digest: what a node runs of the settings that decide keys,
//! scopes and prices. A forward node sends it on every hop, and an owner compares it with
//! its own (docs/fleet.md#configurations-that-must-agree): two configurations that
//! disagree on any of these key or charge the same request differently.

use crate::core::config::{Cache, Config, Scope, DEFAULT_COMPLETION_CAP};
use crate::core::wire::digest::sha256;
use crate::core::wire::sort;
use std::fmt::{Display, Write};

/// Hex digits of the digest carried (64 bits: a mismatch, not an attacker, is what it
/// finds; the hop itself is authenticated).
const DIGITS: usize = 16;

/// A digest a request carried, as the edge repeats it: hex digits only, at most 16.
pub(crate) fn shown(digest: &str) -> String {
    digest.chars().filter(char::is_ascii_hexdigit).take(16).collect()
}

/// The digest of `config`'s cache scope, models, tenants and semantic tier, as settled
/// (defaults filled in): two configurations that spell the same settings otherwise have
/// the same digest.
pub(crate) fn of(config: &Config) -> String {
    let digest = sha256(settled(config).0.into_bytes());
    digest.iter().take(DIGITS / 2).map(|b| format!("{b:02x}")).collect()
}

/// The settings the digest covers, written one after another without ambiguity (each text
/// prefixed by its length, maps in name order).
fn settled(config: &Config) -> Text {
    let mut t = Text(String::new());
    let Cache { scope, tenant_header, only_deterministic, require_tenant, .. } = &config.cache;
    t.number(Some(*scope == Scope::Tenant));
    t.text(&tenant_header.as_deref().unwrap_or_default().to_ascii_lowercase());
    t.number(Some(*only_deterministic));
    t.number(Some(*require_tenant));
    t.number(Some(config.models.len()));
    for (name, m) in &config.models {
        t.text(name);
        t.number(Some(m.priced()));
        t.float(Some(m.input_price()));
        t.float(Some(m.output_price()));
        t.float(Some(m.cached_input_price()));
        t.number(Some(m.max_completion_tokens.unwrap_or(DEFAULT_COMPLETION_CAP)));
        t.number(m.context_window);
        t.texts(Some(&m.fallback));
    }
    t.number(Some(config.tenants.len()));
    for (name, tenant) in &config.tenants {
        t.text(name);
        let mut keys: Vec<String> = tenant.keys_sha256.iter().map(|k| k.to_ascii_lowercase()).collect();
        sort::sort_by(&mut keys, |a, b| a < b);
        t.texts(Some(&keys));
        // A set: listed in any order.
        let mut models = tenant.models.clone();
        if let Some(m) = models.as_mut() {
            sort::sort_by(m, |a, b| a < b);
        }
        t.texts(models.as_deref());
        let caps = tenant.caps();
        t.number(caps.per_day);
        t.number(caps.per_month);
        t.number(tenant.requests_per_minute);
        t.number(tenant.tokens_per_minute);
        t.number(tenant.burst.or(tenant.requests_per_minute));
        t.text(tenant.priority.as_str());
    }
    // The semantic tier's settings only while it is on.
    let s = &config.semantic;
    t.number(Some(s.enabled));
    if s.enabled {
        t.text(&s.embedding_model);
        t.number(s.dimensions);
        t.float(Some(s.threshold));
        let mut models = s.models.clone();
        sort::sort_by(&mut models, |a, b| a < b);
        t.texts(Some(&models));
        t.number(Some(s.allow_tools));
    }
    t
}

/// The digest's input as it is written.
struct Text(String);

impl Text {
    /// A price or a threshold, by its bits (no float formatting compiled in for it).
    fn float(&mut self, x: Option<f64>) {
        self.number(x.map(f64::to_bits));
    }

    fn number(&mut self, n: Option<impl Display>) {
        let _ = match n {
            Some(n) => write!(self.0, "{n};"),
            None => write!(self.0, "-;"),
        };
    }

    fn text(&mut self, s: &str) {
        let _ = write!(self.0, "{}:{s};", s.len());
    }

    fn texts(&mut self, list: Option<&[String]>) {
        self.number(list.map(<[String]>::len));
        for s in list.unwrap_or_default() {
            self.text(s);
        }
    }
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
        // Defaults a setting falls back to, written out; a tenant's models in another
        // order; the semantic tier's settings while it is off.
        let two = base.replace(r#"{"gpt-4.1":"#, r#"{"o3":{"usd_per_mtok_input":1},"gpt-4.1":"#);
        let models = |list: &str| two.replace(r#""usd_per_day":5"#, &format!(r#""usd_per_day":5,"models":[{list}]"#));
        let priced = r#""usd_per_mtok_input":2,"usd_per_mtok_output":8"#;
        let defaults = [
            (models(r#""gpt-4.1","o3""#), models(r#""o3","gpt-4.1""#)),
            (
                base.clone(),
                base.replace(
                    priced,
                    &format!(r#"{priced},"usd_per_mtok_cached_input":2,"max_completion_tokens":4096"#),
                ),
            ),
            (
                base.replace(r#""usd_per_mtok_input":2,"#, ""),
                base.replace(r#""usd_per_mtok_input":2"#, r#""usd_per_mtok_input":0"#),
            ),
            (
                base.replace(r#""usd_per_day":5"#, r#""usd_per_day":5,"requests_per_minute":60"#),
                base.replace(r#""usd_per_day":5"#, r#""usd_per_day":5,"requests_per_minute":60,"burst":60"#),
            ),
            (base.clone(), base.replacen('{', r#"{"semantic":{"threshold":0.99},"#, 1)),
        ];
        for (one, other) in &defaults {
            assert_eq!(digest(one), digest(other), "{other}");
        }
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
