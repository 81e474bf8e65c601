//! Plugin configuration: JSON, every field optional, unknown fields and bad values rejected
//! with a message that names the field.

use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub upstream: Upstream,
    pub cache: Cache,
    pub lock: Lock,
    pub max_body_bytes: usize,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Upstream {
    /// Envoy cluster that reaches HolySheep.
    pub cluster: String,
    /// `:authority` of the callout.
    pub authority: String,
    /// Whole-callout timeout.
    pub timeout_ms: u64,
    /// Name of the VM environment variable that holds the HolySheep API key.
    pub api_key_env: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Tenant,
    Global,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Cache {
    pub ttl_seconds: u64,
    pub max_entries: u32,
    pub max_entry_bytes: usize,
    pub scope: Scope,
    pub tenant_header: Option<String>,
    pub only_deterministic: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Lock {
    pub lease_ms: u64,
    pub wait_timeout_ms: u64,
    /// Number of lease slots in shared data (the bound on concurrent distinct flights
    /// that can be coalesced; a busy slot makes a colliding request go upstream alone).
    pub slots: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            upstream: Upstream::default(),
            cache: Cache::default(),
            lock: Lock::default(),
            max_body_bytes: 1024 * 1024,
        }
    }
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            cluster: "holysheep".into(),
            authority: "api.holysheep.ai".into(),
            timeout_ms: 60_000,
            api_key_env: "HOLYSHEEP_API_KEY".into(),
        }
    }
}

impl Default for Cache {
    fn default() -> Self {
        Cache {
            ttl_seconds: 3600,
            max_entries: 4096,
            max_entry_bytes: 256 * 1024,
            scope: Scope::Tenant,
            tenant_header: None,
            only_deterministic: false,
        }
    }
}

impl Default for Lock {
    fn default() -> Self {
        Lock { lease_ms: 5000, wait_timeout_ms: 65_000, slots: 1024 }
    }
}

/// Why a configuration was refused; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid holysheep-edge configuration: {}", self.0)
    }
}

impl Config {
    /// Parses and validates. Empty input means all defaults.
    pub fn parse(raw: &[u8]) -> Result<Config, ConfigError> {
        if raw.iter().all(u8::is_ascii_whitespace) {
            return Ok(Config::default());
        }
        if raw.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ConfigError("the configuration must be a JSON object".into()));
        }
        let mut de = serde_json::Deserializer::from_slice(raw);
        let config: Config = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            ConfigError(format!("{path}: {}", e.inner()))
        })?;
        de.end().map_err(|e| ConfigError(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let checks: [(bool, &str, &str); 12] = [
            (self.upstream.cluster.is_empty(), "upstream.cluster", "must not be empty"),
            (self.upstream.authority.is_empty(), "upstream.authority", "must not be empty"),
            (self.upstream.timeout_ms == 0, "upstream.timeout_ms", "must be at least 1"),
            (self.upstream.api_key_env.is_empty(), "upstream.api_key_env", "must not be empty"),
            (self.cache.ttl_seconds == 0, "cache.ttl_seconds", "must be at least 1"),
            (!(1..=1_000_000).contains(&self.cache.max_entries), "cache.max_entries", "must be between 1 and 1000000"),
            (self.cache.max_entry_bytes == 0, "cache.max_entry_bytes", "must be at least 1"),
            (
                self.cache.tenant_header.as_deref().is_some_and(|h| !valid_header_name(h)),
                "cache.tenant_header",
                "must be a lowercase HTTP header name",
            ),
            (self.lock.lease_ms < 100, "lock.lease_ms", "must be at least 100"),
            (self.lock.wait_timeout_ms == 0, "lock.wait_timeout_ms", "must be at least 1"),
            (!(1..=65_536).contains(&self.lock.slots), "lock.slots", "must be between 1 and 65536"),
            (
                !(1..=64 * 1024 * 1024).contains(&self.max_body_bytes),
                "max_body_bytes",
                "must be between 1 and 67108864",
            ),
        ];
        match checks.iter().find(|(bad, _, _)| *bad) {
            Some((_, field, why)) => Err(ConfigError(format!("{field}: {why}"))),
            None => Ok(()),
        }
    }

    /// Tick period of each worker: the safety net for wake-ups and the lease renewal clock.
    pub fn tick_ms(&self) -> u64 {
        (self.lock.lease_ms / 4).clamp(25, 500)
    }
}

fn valid_header_name(h: &str) -> bool {
    !h.is_empty() && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_object_and_empty_input_are_defaults() {
        assert_eq!(Config::parse(b"{}").unwrap(), Config::default());
        assert_eq!(Config::parse(b"").unwrap(), Config::default());
        let c = Config::default();
        assert_eq!(c.upstream.cluster, "holysheep");
        assert_eq!(c.cache.max_entries, 4096);
        assert_eq!(c.lock.wait_timeout_ms, 65_000);
        assert_eq!(c.max_body_bytes, 1_048_576);
        assert_eq!(c.cache.scope, Scope::Tenant);
    }

    #[test]
    fn fields_override_defaults() {
        let c = Config::parse(
            br#"{"cache":{"scope":"global","ttl_seconds":5,"tenant_header":"x-tenant"},"lock":{"lease_ms":200}}"#,
        )
        .unwrap();
        assert_eq!(c.cache.scope, Scope::Global);
        assert_eq!(c.cache.ttl_seconds, 5);
        assert_eq!(c.cache.max_entries, 4096);
        assert_eq!(c.cache.tenant_header.as_deref(), Some("x-tenant"));
        assert_eq!(c.lock.lease_ms, 200);
        assert_eq!(c.tick_ms(), 50);
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = Config::parse(br#"{"cache":{"ttl":5}}"#).unwrap_err();
        assert!(e.0.contains("ttl"), "{e}");
        let e = Config::parse(br#"{"upstreams":{}}"#).unwrap_err();
        assert!(e.0.contains("upstreams"), "{e}");
    }

    #[test]
    fn bad_values_are_named() {
        for (raw, field) in [
            (r#"{"cache":{"max_entries":-1}}"#, "cache.max_entries"),
            (r#"{"cache":{"max_entries":0}}"#, "cache.max_entries"),
            (r#"{"cache":{"scope":"planet"}}"#, "cache.scope"),
            (r#"{"lock":{"lease_ms":"5s"}}"#, "lock.lease_ms"),
            (r#"{"lock":{"lease_ms":5}}"#, "lock.lease_ms"),
            (r#"{"upstream":{"cluster":""}}"#, "upstream.cluster"),
            (r#"{"cache":{"tenant_header":"X Tenant"}}"#, "cache.tenant_header"),
            (r#"{"max_body_bytes":0}"#, "max_body_bytes"),
        ] {
            let e = Config::parse(raw.as_bytes()).unwrap_err();
            assert!(e.0.contains(field), "{raw}: {e}");
        }
        assert!(Config::parse(b"{} {}").is_err());
        assert!(Config::parse(b"[]").is_err());
    }
}
