//! Plugin configuration: JSON, every field optional, unknown fields and bad values rejected
//! with a message that names the field; the tenant table and its keys (`tenants`). Uses
//! `wire` and `api`.

pub(crate) mod digest;
pub mod environment;
pub mod named;
pub(crate) mod read;
pub(crate) mod tenants;

use crate::core::api::endpoint::Endpoint;
use crate::core::api::headers;
use crate::core::api::objects::{ObjectKey, Signer};
use crate::core::api::priority::Class;
use crate::core::api::usage::Usage;
use crate::core::config::named::Named;
use crate::core::config::tenants::{Keys, Tenant};
use crate::core::wire::json;
use read::{choice, entries, flag, maybe, number, section, size, text, texts, whole, whole32, Read};
use serde_json::Value;

/// The most `passthrough_paths` a configuration lists.
pub(crate) const MAX_PASSTHROUGH: usize = 64;
/// The Responses API's conversations: never a passthrough path (`check_passthrough`).
const CONVERSATIONS: &str = "/v1/conversations";

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// What the filter does on this listener: govern the call (`owner`) or validate, key
    /// and pass it on to the key's owner node (`forward`).
    pub role: Role,
    pub fleet: Fleet,
    /// A forward node's near copies (read by `role: forward` only).
    pub edge: Edge,
    pub upstream: Upstream,
    pub cache: Cache,
    pub lock: Lock,
    pub max_body_bytes: usize,
    /// Per-model limits, fallbacks and prices; the entry `default` applies to models not listed.
    pub models: Named<Model>,
    pub rate_limit: RateLimit,
    pub retry: Retry,
    /// Serve an expired cache entry this much past its TTL when every attempt failed.
    pub stale_if_error_seconds: u64,
    /// Publish each governed answer's access-log values (`log_fields::NAMES`); off by
    /// default, as setting them costs host calls per answer (docs/operations.md#access-log).
    pub log_fields: bool,
    /// The semantic tier: a deterministic request that missed the exact cache may be
    /// answered with the stored answer of a close paraphrase (off by default).
    pub semantic: Semantic,
    /// The callers this edge knows, by name. When set, every governed request must carry
    /// one of their keys, and its tenant is its cache scope.
    pub tenants: Named<Tenant>,
    /// Where tenants' spend is kept beyond this process (docs/tenants.md#where-spend-is-kept).
    pub budget_store: BudgetStore,
    /// With `tenants`: the paths (and everything under them) a verified tenant's request
    /// may take to HolySheep ungoverned, with the operator's key. Every other path the
    /// edge does not govern is a 404 (docs/tenants.md#other-paths).
    pub passthrough_paths: Vec<String>,
    /// The tenants' key digests, collected from `tenants` when the configuration is read.
    pub keys: Keys,
    /// The key a tenant's response ids are signed with, derived by the shell from the
    /// operator's API key (`api::objects`); `None` without one.
    pub object_key: Option<ObjectKey>,
    /// The digest of the settings that decide keys, scopes and prices (`digest::of`), made
    /// when the configuration is read: a forward node sends it on every hop.
    pub digest: String,
}

/// The spend store: etcd (v3), reached through its JSON gateway by callouts to an Envoy
/// cluster. Tenants' settled spend is written behind, and read by a node before it admits
/// a tenant's first call.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetStore {
    /// The Envoy cluster that reaches etcd's client port (empty: spend is kept in this
    /// Envoy's memory only).
    pub cluster: String,
    /// `:authority` of the calls to etcd.
    pub authority: String,
    /// The etcd keys are `<prefix>/budget/<tenant>`.
    pub prefix: String,
    /// How often settled spend is written behind (the most a crash can lose, beside the
    /// calls in flight).
    pub flush_ms: u64,
    /// The longest a call to etcd may take.
    pub timeout_ms: u64,
    /// What one node may admit per tenant and period, in dollars, while the store has
    /// never answered it (`None`: one call's worst case, with nothing else held or
    /// settled beside it).
    pub outage_usd: Option<f64>,
    /// How many independent admitters share this store (Envoys without a fleet, or
    /// fleets): each admits from its share of what the store says remains.
    pub replicas: u32,
    /// The tenants table lives in the store (`<prefix>/tenants/<name>`), read every
    /// `tenants_poll_ms`: it replaces the configuration's `tenants` once read
    /// (`budget_store::tenants`).
    pub tenants: bool,
    pub tenants_poll_ms: u64,
    /// The most tenants the store's table may hold.
    pub max_tenants: u32,
}

impl Default for BudgetStore {
    fn default() -> Self {
        BudgetStore {
            cluster: String::new(),
            authority: "etcd".into(),
            prefix: "holysheep".into(),
            flush_ms: 1_000,
            timeout_ms: 1_000,
            outage_usd: None,
            replicas: 1,
            tenants: false,
            tenants_poll_ms: 1_000,
            max_tenants: 1_000,
        }
    }
}

impl BudgetStore {
    pub fn enabled(&self) -> bool {
        !self.cluster.is_empty()
    }

    /// `outage_usd` in micro-dollars.
    pub(crate) fn outage_micro(&self) -> Option<u64> {
        self.outage_usd.map(|usd| (usd * 1e6).round() as u64)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let plain = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b));
        let checks: [(bool, &str, &str); 8] = [
            (!plain(&self.prefix), "prefix", "1 or more of a-z, A-Z, 0-9, '-', '_', '.' and '/'"),
            (self.tenants && !self.enabled(), "tenants", "needs budget_store.cluster (the store that holds them)"),
            (!(100..=60_000).contains(&self.tenants_poll_ms), "tenants_poll_ms", "must be between 100 and 60000"),
            (!(1..=1_024).contains(&self.max_tenants), "max_tenants", "must be between 1 and 1024"),
            (self.authority.is_empty(), "authority", "must not be empty"),
            (!(50..=10_000).contains(&self.flush_ms), "flush_ms", "must be between 50 and 10000"),
            (!(1..=10_000).contains(&self.timeout_ms), "timeout_ms", "must be between 1 and 10000"),
            (!(1..=1_000).contains(&self.replicas), "replicas", "must be between 1 and 1000"),
        ];
        if self.outage_usd.is_some_and(|u| !u.is_finite() || !(0.0..=1e9).contains(&u)) {
            return Err(ConfigError("budget_store.outage_usd: must be between 0 and 1000000000".into()));
        }
        match checks.iter().find(|(bad, _, _)| *bad) {
            Some((_, field, why)) => Err(ConfigError(format!("budget_store.{field}: {why}"))),
            None => Ok(()),
        }
    }
}

/// The completion limit a call that sets none is sent with where a limit needs it
/// (`models.<name>.max_completion_tokens`), and the largest that may be configured.
pub(crate) const DEFAULT_COMPLETION_CAP: u64 = 4096;
pub(crate) const MAX_COMPLETION_CAP: u64 = 1_000_000;
/// The largest `models.<name>.context_window` that may be configured.
pub(crate) const MAX_CONTEXT_WINDOW: u64 = 100_000_000;

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Model {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    /// Request-bucket capacity; defaults to `requests_per_minute`.
    pub burst: Option<u32>,
    pub max_in_flight: Option<u32>,
    pub fallback: Vec<String>,
    /// Prices in dollars per million tokens: prompt tokens, completion tokens, and prompt
    /// tokens served from the provider's prompt cache (the input price when not set). A
    /// model with neither of the first two is unpriced: no budgeted tenant may reach it.
    pub usd_per_mtok_input: Option<f64>,
    pub usd_per_mtok_output: Option<f64>,
    pub usd_per_mtok_cached_input: Option<f64>,
    /// The completion limit (per choice) a call that sets none is sent with when a limit
    /// needs its worst case: its tenant's dollar budget, or this model's token bucket.
    /// Default 4096.
    pub max_completion_tokens: Option<u64>,
    /// The most input tokens the model takes: the ceiling a budgeted tenant's call is
    /// reserved at when HolySheep supplies part of its input (a stored response, a file, an
    /// image by URL). Without it such calls of a budgeted tenant are refused.
    pub context_window: Option<u64>,
    /// The edge sets a `prompt_cache_key` on this model's calls that carry none
    /// (`upstream::affinity`), so that HolySheep's prompt cache sees one prefix together.
    pub prompt_cache_affinity: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    #[default]
    Owner,
    Forward,
}

/// Many edge nodes as one: where the model owners are and how to reach them.
#[derive(Debug, Clone, PartialEq)]
pub struct Fleet {
    /// Envoy cluster of every node's owner listener, consistently hashed. Empty: limits are
    /// this node's own.
    pub cluster: String,
    /// Nodes in the fleet: a node that cannot reach a model's owner admits its share.
    pub nodes: u32,
    /// Environment variable holding the secret that internal calls carry (and a forward
    /// node's requests to its owners).
    pub peer_secret_env: String,
    /// Environment variable holding a second secret accepted (never sent), for a rotation.
    pub peer_secret_accepted_env: String,
    /// How long a key owner waits for a model owner's answer before admitting its share.
    pub timeout_ms: u64,
    /// An owner listener that serves only the fleet's own nodes: every API request must come
    /// over a connection whose client certificate Envoy verified and names one of
    /// `peer_sans`, or carry the fleet's secret. On by default on an owner of a fleet
    /// (`cluster` set); `false` opens it to clients.
    pub internal: bool,
    /// The subject alternative names (URI or DNS, the first of each kind) a node's client
    /// certificate may carry.
    pub peer_sans: Vec<String>,
    /// What an owner does with a hop from a node whose configuration digest differs from
    /// its own: count it and log it (`count`), or refuse it too (`refuse`).
    pub config_mismatch: Mismatch,
}

/// What an owner does with a hop from a node that runs other settings (`Fleet::config_mismatch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mismatch {
    /// Counted and logged; the request is served (a rolling change of the configuration
    /// passes through this state on every node).
    #[default]
    Count,
    /// Counted, logged and refused: 503 `fleet_config_mismatch`.
    Refuse,
}

impl Default for Fleet {
    fn default() -> Self {
        Fleet {
            cluster: String::new(),
            nodes: 1,
            peer_secret_env: "HOLYSHEEP_PEER_SECRET".into(),
            peer_secret_accepted_env: "HOLYSHEEP_PEER_SECRET_ACCEPTED".into(),
            timeout_ms: 250,
            internal: false,
            peer_sans: Vec::new(),
            config_mismatch: Mismatch::Count,
        }
    }
}

impl Fleet {
    /// Whether model buckets live on their owner nodes.
    pub fn shared_limits(&self) -> bool {
        !self.cluster.is_empty()
    }
}

/// A forward node's near copies: the answers it forwarded that their owner declared
/// storable (`cache-control: max-age`), kept in its own shared data.
#[derive(Debug, Clone, PartialEq)]
pub struct Edge {
    /// The longest a near copy is served after it was copied, however long its owner keeps
    /// the answer (0: no near copies; identical requests still share one hop).
    pub max_age_seconds: u64,
    /// Near copies a forward node keeps (its cache's slots in place of `cache.max_entries`).
    pub max_entries: u32,
}

impl Default for Edge {
    fn default() -> Self {
        Edge { max_age_seconds: 60, max_entries: 1024 }
    }
}

/// The semantic tier (docs/semantic.md): everything but the last user message's text must
/// match exactly; that text is compared by its embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Semantic {
    pub enabled: bool,
    /// The model HolySheep's `/v1/embeddings` embeds the last user message with.
    pub embedding_model: String,
    /// Sent as `dimensions` (text-embedding-3 models shorten their vectors); `None`: the
    /// model's own length.
    pub dimensions: Option<u32>,
    /// The least cosine similarity that serves a stored answer.
    pub threshold: f64,
    /// Vectors kept in shared data, all partitions together.
    pub max_entries: u32,
    /// Chat models whose requests take part (empty: every model).
    pub models: Vec<String>,
    /// Requests that offer tools take part too (their tools are part of the partition).
    pub allow_tools: bool,
    /// The longest the embedding call may take before the request goes on as a MISS.
    pub timeout_ms: u64,
}

impl Default for Semantic {
    fn default() -> Self {
        Semantic {
            enabled: false,
            embedding_model: "text-embedding-3-small".into(),
            dimensions: None,
            threshold: 0.95,
            max_entries: 4096,
            models: Vec::new(),
            allow_tools: false,
            timeout_ms: 500,
        }
    }
}

impl Semantic {
    /// Whether requests for `model` take part.
    pub(crate) fn covers(&self, model: &str) -> bool {
        self.enabled && (self.models.is_empty() || self.models.iter().any(|m| m == model))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let checks: [(bool, &str, &str); 5] = [
            (self.embedding_model.is_empty(), "embedding_model", "must not be empty"),
            (!(0.5..=1.0).contains(&self.threshold), "threshold", "must be between 0.5 and 1"),
            (!(1..=1_000_000).contains(&self.max_entries), "max_entries", "must be between 1 and 1000000"),
            (!(1..=10_000).contains(&self.timeout_ms), "timeout_ms", "must be between 1 and 10000"),
            (
                self.dimensions.is_some_and(|d| !(1..=MAX_DIMENSIONS).contains(&d)),
                "dimensions",
                "must be between 1 and 4096",
            ),
        ];
        match checks.iter().find(|(bad, _, _)| *bad) {
            Some((_, field, why)) => Err(ConfigError(format!("semantic.{field}: {why}"))),
            None => Ok(()),
        }
    }
}

/// The longest admission line a configuration may ask for (`rate_limit.max_queue`).
pub(crate) const MAX_LINE: usize = 4_096;
/// The longest vector the semantic tier keeps (`semantic.dimensions`; text-embedding-3-large
/// has 3 072).
pub(crate) const MAX_DIMENSIONS: u32 = 4096;

/// The longest duration in milliseconds any setting accepts: one day.
pub(crate) const MAX_MS: u64 = 86_400_000;
/// The longest duration in seconds any setting accepts: one year.
pub(crate) const MAX_SECONDS: u64 = 31_536_000;

#[derive(Debug, Clone, PartialEq)]
pub struct RateLimit {
    /// 0: answer 429 at once; otherwise hold a request up to this long for its bucket.
    pub max_wait_ms: u64,
    /// The longest a provider's 429 `retry-after` may empty a model's request bucket.
    pub max_provider_hold_ms: u64,
    /// The fraction of each bucket and of each in-flight cap that `sheddable` calls may not
    /// take (it is kept for `standard` and `critical` ones).
    pub reserve: f64,
    /// The most calls waiting in one bucket's admission line; a full line refuses its
    /// lowest class first.
    pub max_queue: usize,
}

impl Default for RateLimit {
    fn default() -> Self {
        RateLimit { max_wait_ms: 0, max_provider_hold_ms: 60_000, reserve: 0.2, max_queue: 1_024 }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    pub max_attempts: u32,
    pub base_delay_ms: u64,
    pub max_delay_ms: u64,
}

impl Default for Retry {
    fn default() -> Self {
        Retry { max_attempts: 3, base_delay_ms: 250, max_delay_ms: 8000 }
    }
}

/// The most models a configuration may name (each holds one shared-data key).
pub(crate) const MAX_MODELS: usize = 256;

#[derive(Debug, Clone, PartialEq)]
pub struct Upstream {
    /// Envoy cluster that reaches HolySheep.
    pub cluster: String,
    /// `:authority` of the callout.
    pub authority: String,
    /// Scheme of the call from the wasi:http component (`https` or `http`); Envoy takes
    /// the transport from the cluster instead.
    pub scheme: String,
    /// Whole-callout timeout.
    pub timeout_ms: u64,
    /// Name of the VM environment variable that holds the HolySheep API key.
    pub api_key_env: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Tenant,
    Global,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Cache {
    pub ttl_seconds: u64,
    pub max_entries: u32,
    pub max_entry_bytes: usize,
    pub scope: Scope,
    pub tenant_header: Option<String>,
    pub only_deterministic: bool,
    /// Refuse (401) a request without its tenant's credential (the tenant header, or
    /// `authorization`) instead of scoping it with every other anonymous caller.
    pub require_tenant: bool,
    /// Bytes of recent requests and their answers each worker keeps in its own memory,
    /// so that a repeated request is answered without parsing it (0: off).
    pub hot_bytes: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Lock {
    pub lease_ms: u64,
    pub wait_timeout_ms: u64,
    /// Number of lease ways in shared data, four to a group record (the bound on
    /// concurrent distinct flights that can be coalesced; a group whose ways are all busy
    /// makes a colliding request go upstream alone).
    pub slots: u32,
}

impl Default for Config {
    fn default() -> Self {
        let mut config = Config {
            role: Role::default(),
            fleet: Fleet::default(),
            edge: Edge::default(),
            upstream: Upstream::default(),
            cache: Cache::default(),
            lock: Lock::default(),
            max_body_bytes: 1024 * 1024,
            models: Named::default(),
            rate_limit: RateLimit::default(),
            retry: Retry::default(),
            stale_if_error_seconds: 0,
            log_fields: false,
            semantic: Semantic::default(),
            tenants: Named::default(),
            budget_store: BudgetStore::default(),
            passthrough_paths: Vec::new(),
            keys: Keys::default(),
            object_key: None,
            digest: String::new(),
        };
        config.digest = digest::of(&config);
        config
    }
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            cluster: "holysheep".into(),
            authority: "api.holysheep.ai".into(),
            scheme: "https".into(),
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
            require_tenant: false,
            hot_bytes: 8 * 1024 * 1024,
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

impl ConfigError {
    /// The setting at fault, without the value or the parser's words (which can quote
    /// configuration values): what may be shown to a client.
    pub fn field(&self) -> &str {
        self.0.split_once(": ").map_or("(the configuration itself)", |(f, _)| f)
    }
}

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
        let text = std::str::from_utf8(raw).map_err(|_| ConfigError("the configuration is not UTF-8".into()))?;
        let value = json::read(text).map_err(|e| ConfigError(e.to_string()))?;
        let mut config = Config::read(&value)?;
        // A fleet's owner serves only the fleet unless its configuration says otherwise: one
        // forgotten line must not leave an owner listener open to clients.
        let said = value.get("fleet").is_some_and(|f| f.get("internal").is_some());
        if !said && config.role == Role::Owner && !config.fleet.cluster.is_empty() {
            config.fleet.internal = true;
        }
        config.validate()?;
        if config.role == Role::Forward {
            // A forward node's cache holds its near copies.
            config.cache.max_entries = config.edge.max_entries;
        }
        config.keys = Keys::of(&config.tenants).map_err(ConfigError)?.required(config.budget_store.tenants);
        config.digest = digest::of(&config);
        Ok(config)
    }

    /// This configuration with `tenants` (a `tenants` section: name to tenant) in place of
    /// its own, read, checked and keyed as `parse` does (the spend store's table,
    /// `budget_store::tenants`).
    /// Its digest stays this configuration's: nodes take a change of the table each at its
    /// own time, which is no difference of configuration between a fleet's nodes.
    pub fn with_tenants(&self, tenants: &Value) -> Result<Config, ConfigError> {
        let mut config = Config { tenants: entries("tenants", tenants, Tenant::read)?, ..self.clone() };
        config.validate()?;
        config.keys = Keys::of(&config.tenants).map_err(ConfigError)?.required(config.budget_store.tenants);
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let checks: [(bool, &str, &str); 22] = [
            (self.cache.hot_bytes > 1 << 30, "cache.hot_bytes", "must be at most 1073741824"),
            (!(1..=1024).contains(&self.fleet.nodes), "fleet.nodes", "must be between 1 and 1024"),
            (self.fleet.peer_secret_env.is_empty(), "fleet.peer_secret_env", "must not be empty"),
            (self.fleet.peer_secret_accepted_env.is_empty(), "fleet.peer_secret_accepted_env", "must not be empty"),
            (
                self.fleet.internal && self.role == Role::Forward,
                "fleet.internal",
                "is for an owner listener (a forward node serves clients)",
            ),
            (self.fleet.timeout_ms == 0, "fleet.timeout_ms", "must be at least 1"),
            (self.upstream.cluster.is_empty(), "upstream.cluster", "must not be empty"),
            (self.upstream.authority.is_empty(), "upstream.authority", "must not be empty"),
            (!["https", "http"].contains(&self.upstream.scheme.as_str()), "upstream.scheme", "must be https or http"),
            (self.upstream.timeout_ms == 0, "upstream.timeout_ms", "must be at least 1"),
            (self.upstream.api_key_env.is_empty(), "upstream.api_key_env", "must not be empty"),
            (self.cache.ttl_seconds == 0, "cache.ttl_seconds", "must be at least 1"),
            (!(1..=1_000_000).contains(&self.cache.max_entries), "cache.max_entries", "must be between 1 and 1000000"),
            (!(1..=1_000_000).contains(&self.edge.max_entries), "edge.max_entries", "must be between 1 and 1000000"),
            (self.cache.max_entry_bytes == 0, "cache.max_entry_bytes", "must be at least 1"),
            (
                self.cache.tenant_header.as_deref().is_some_and(|h| !valid_header_name(h)),
                "cache.tenant_header",
                "must be a lowercase HTTP header name",
            ),
            (
                // Forward nodes strip the fleet's own headers: owners would see no tenant.
                self.cache.tenant_header.as_deref().is_some_and(|h| h.starts_with("x-holysheep-")),
                "cache.tenant_header",
                "must not start with x-holysheep- (the edge's own headers, removed from clients' requests)",
            ),
            (
                // Headers the edge reads for another purpose: the tenant would never be set.
                self.cache.tenant_header.as_deref().is_some_and(|h| {
                    [headers::AUTHORIZATION, headers::CACHE_CONTROL, headers::CONTENT_LENGTH].contains(&h)
                }),
                "cache.tenant_header",
                "must not be authorization (the default scope), cache-control or content-length",
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
        if let Some((_, field, why)) = checks.iter().find(|(bad, _, _)| *bad) {
            return Err(ConfigError(format!("{field}: {why}")));
        }
        self.check_passthrough()?;
        if self.rate_limit.max_provider_hold_ms == 0 {
            return Err(ConfigError("rate_limit.max_provider_hold_ms: must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.rate_limit.reserve) {
            return Err(ConfigError("rate_limit.reserve: a fraction, between 0 and 1".into()));
        }
        if !(1..=MAX_LINE).contains(&self.rate_limit.max_queue) {
            let max = MAX_LINE;
            return Err(ConfigError(format!("rate_limit.max_queue: must be between 1 and {max}")));
        }
        // Every duration is bounded, so no `now + duration` can overflow.
        let durations: [(u64, &str, u64); 11] = [
            (self.fleet.timeout_ms, "fleet.timeout_ms", MAX_MS),
            (self.upstream.timeout_ms, "upstream.timeout_ms", MAX_MS),
            (self.lock.lease_ms, "lock.lease_ms", MAX_MS),
            (self.lock.wait_timeout_ms, "lock.wait_timeout_ms", MAX_MS),
            (self.rate_limit.max_wait_ms, "rate_limit.max_wait_ms", MAX_MS),
            (self.rate_limit.max_provider_hold_ms, "rate_limit.max_provider_hold_ms", MAX_MS),
            (self.retry.base_delay_ms, "retry.base_delay_ms", MAX_MS),
            (self.retry.max_delay_ms, "retry.max_delay_ms", MAX_MS),
            (self.cache.ttl_seconds, "cache.ttl_seconds", MAX_SECONDS),
            (self.stale_if_error_seconds, "stale_if_error_seconds", MAX_SECONDS),
            (self.edge.max_age_seconds, "edge.max_age_seconds", MAX_SECONDS),
        ];
        if let Some((_, field, max)) = durations.iter().find(|(v, _, max)| v > max) {
            return Err(ConfigError(format!("{field}: must be at most {max}")));
        }
        let retry: [(bool, &str, &str); 3] = [
            (!(1..=10).contains(&self.retry.max_attempts), "retry.max_attempts", "must be between 1 and 10"),
            (self.retry.base_delay_ms == 0, "retry.base_delay_ms", "must be at least 1"),
            (
                self.retry.max_delay_ms < self.retry.base_delay_ms,
                "retry.max_delay_ms",
                "must be at least retry.base_delay_ms",
            ),
        ];
        if let Some((_, field, why)) = retry.iter().find(|(bad, _, _)| *bad) {
            return Err(ConfigError(format!("{field}: {why}")));
        }
        let tenants = !self.tenants.is_empty() || self.budget_store.tenants;
        if tenants && (self.cache.scope == Scope::Global || self.cache.tenant_header.is_some()) {
            return Err(ConfigError(
                "tenants: the verified tenant is the cache scope; cache.scope global and cache.tenant_header \
                 do not go with it"
                    .into(),
            ));
        }
        if self.models.keys().any(|m| ["tenant", "edge", "priority", "fleet"].iter().any(|p| m.starts_with(p))) {
            return Err(ConfigError(
                "models: a model name does not start with tenant, edge, priority or fleet (the names of tenants' \
                 own buckets and counters, and of forward nodes', priority classes' and the fleet's counters)"
                    .into(),
            ));
        }
        self.semantic.validate()?;
        self.budget_store.validate()?;
        self.tenants.iter().try_for_each(|(name, t)| self.priced_for(name, t))?;
        if self.models.len() > MAX_MODELS {
            return Err(ConfigError(format!("models: at most {MAX_MODELS} entries")));
        }
        self.models.iter().try_for_each(|(name, m)| m.validate(name))
    }

    /// A tenant with a dollar budget reaches only priced models: each model it lists (or,
    /// listing none, `default`, which answers for every name not listed), and each of their
    /// fallbacks it may call.
    fn priced_for(&self, name: &str, t: &Tenant) -> Result<(), ConfigError> {
        if t.caps().is_none() {
            return Ok(());
        }
        // Listing no model, it may call any that is priced: with none priced, every call
        // it makes would be refused (a forward node's configuration without the owners'
        // `models`, say).
        // (`default` prices only names a tenant's own list holds: `prices_for`.)
        if t.models.is_none() && !self.models.iter().any(|(m, e)| m != "default" && e.priced()) {
            return Err(ConfigError(format!(
                "tenants.{name}: it has a dollar budget and lists no models, and no model has a price of \
                 its own (models.<name>.usd_per_mtok_input / usd_per_mtok_output): every call it makes \
                 would be refused 404 model_not_found"
            )));
        }
        let listed: Vec<&str> = match &t.models {
            Some(models) => models.iter().map(String::as_str).collect(),
            None => self.models.keys().map(String::as_str).collect(),
        };
        // (model, whether the tenant reaches it whatever the request names): a name the
        // request itself names that nothing prices is refused at the request (404), but a
        // model the tenant lists, or a fallback, must have a price.
        let mut reached: Vec<(&str, bool)> = Vec::new();
        for m in listed {
            let fallbacks = self.model(m).map(|(_, e)| e.fallback.as_slice()).unwrap_or_default();
            let allowed = fallbacks.iter().map(String::as_str).filter(|f| t.allows(f));
            reached.push((m, t.models.is_some()));
            reached.extend(allowed.map(|f| (f, true)));
        }
        let mut unpriced = reached.into_iter().find(|(m, surely)| match self.model(m) {
            Some((_, entry)) => !entry.priced(),
            None => *surely,
        });
        // The semantic tier's embeddings are charged to the tenant too, at the embedding
        // model's own prices (never `default`'s, a chat model's).
        let embedding = self.semantic.embedding_model.as_str();
        if self.semantic.enabled && !self.models.get(embedding).is_some_and(Model::priced) {
            unpriced = unpriced.or(Some((embedding, true)));
        }
        match unpriced.map(|(m, _)| m) {
            Some(m) => Err(ConfigError(format!(
                "tenants.{name}: it has a dollar budget, and the model {m} it can reach has no price \
                 (models.{m}.usd_per_mtok_input / usd_per_mtok_output{})",
                if self.models.contains_key(m) { "" } else { ", or a priced models.default" }
            ))),
            None => Ok(()),
        }
    }

    /// Whether a tenant may call `model` at a price the edge knows: always, unless the
    /// tenant has a dollar budget and nothing prices the model.
    /// A model priced by its own entry; one priced only by `default` only when the tenant's
    /// own `models` list names it (the operator chose it): else a budgeted tenant could
    /// name any model, o1-pro say, and be held to `default`'s rates.
    pub(crate) fn prices_for(&self, tenant: &Tenant, model: &str) -> bool {
        if tenant.caps().is_none() {
            return true;
        }
        match self.models.get(model) {
            Some(m) => m.priced(),
            None => tenant.models.is_some() && self.models.get("default").is_some_and(Model::priced),
        }
    }

    /// The class a request of `tenant` is granted (`None`: not verified, `standard`); a
    /// request may lower it (`Class::of`).
    pub fn class_of(&self, tenant: Option<&str>) -> Class {
        tenant.and_then(|t| self.tenants.get(t)).map_or(Class::Standard, |t| t.priority)
    }

    /// The configuration entry that governs `model`: its own, else `default`, else none
    /// (no limits, no prices). The name returned is the bucket's name.
    pub fn model<'a>(&'a self, model: &'a str) -> Option<(&'a str, &'a Model)> {
        self.models.get_key_value(model).or_else(|| self.models.get_key_value("default")).map(|(k, v)| (k.as_str(), v))
    }

    /// Whether the edge sets a `prompt_cache_key` for a call on `model` by `tenant`: turned
    /// on for the model (its own entry, else `default`) or for the tenant.
    pub fn affinity(&self, model: &str, tenant: Option<&str>) -> bool {
        self.model(model).is_some_and(|(_, m)| m.prompt_cache_affinity)
            || tenant.and_then(|t| self.tenants.get(t)).is_some_and(|t| t.prompt_cache_affinity)
    }

    /// Micro-dollars `cached` prompt tokens on `model` cost less from the prompt cache than
    /// at the input price.
    pub fn cache_saving_micro_usd(&self, model: &str, cached: u64) -> u64 {
        self.model(model)
            .map_or(0, |(_, m)| ((m.input_price() - m.cached_input_price()).max(0.0) * cached as f64).round() as u64)
    }

    /// Micro-dollars an answer's `usage` costs on `model` at its configured prices (a
    /// price per million tokens is a price in micro-dollars per token).
    pub fn cost_micro_usd(&self, model: &str, usage: &Usage) -> u64 {
        self.model(model).map_or(0, |(_, m)| m.cost_micro_usd(usage))
    }

    /// Micro-dollars an embedding call billed `tokens` costs: at the embedding model's own
    /// prices in `models`, and nothing when it is not listed there (`models.default` holds a
    /// chat model's prices, no embedding model's).
    pub fn embedding_cost_micro_usd(&self, tokens: u64) -> u64 {
        let model = &self.semantic.embedding_model;
        self.models.get(model).map_or(0, |m| m.cost_micro_usd(&Usage::new(tokens, 0)))
    }

    /// The signer of the response ids a verified tenant's Responses call is handed, on an
    /// owner node (a forward node passes its owner's answer on as it came).
    pub fn signer(&self, endpoint: Endpoint, tenant: Option<&str>) -> Option<Signer> {
        let key = self.object_key.clone().filter(|_| endpoint == Endpoint::Responses && self.role == Role::Owner)?;
        Some(Signer { key, tenant: tenant?.to_owned() })
    }

    /// The completion cap a call of `model` that sets no limit of its own is sent with, when
    /// its tenant's budget (`budgeted`) or the model's token bucket needs its worst case.
    pub(crate) fn completion_cap(&self, model: &str, budgeted: bool) -> Option<u64> {
        let m = self.model(model).map(|(_, m)| m);
        let bucketed = m.is_some_and(|m| m.tokens_per_minute.is_some());
        (budgeted || bucketed).then(|| m.and_then(|m| m.max_completion_tokens).unwrap_or(DEFAULT_COMPLETION_CAP))
    }

    /// Whether `path` (in any spelling) is one of `passthrough_paths` or under one.
    pub(crate) fn passes_through(&self, path: &str) -> bool {
        let segments = crate::core::api::path::segments(path);
        self.passthrough_paths.iter().any(|p| {
            let listed: Vec<&str> = p.split('/').filter(|s| !s.is_empty()).collect();
            segments.len() >= listed.len() && listed.iter().zip(&segments).all(|(a, b)| a == b)
        })
    }

    /// At most `MAX_PASSTHROUGH` paths under `/v1/`, none spelled other than as it is read,
    /// none a governed endpoint's or above one (it would pass around the edge), and none
    /// under one or under `/v1/conversations`: those hold the state of a tenant's calls
    /// (stored responses, stored completions, conversations), which the edge keeps with
    /// its tenant and a path passed with the operator's key would open to every tenant.
    fn check_passthrough(&self) -> Result<(), ConfigError> {
        if self.passthrough_paths.len() > MAX_PASSTHROUGH {
            return Err(ConfigError(format!("passthrough_paths: at most {MAX_PASSTHROUGH} paths")));
        }
        for p in &self.passthrough_paths {
            let segments = crate::core::api::path::segments(p);
            let canonical = format!("/{}", segments.join("/"));
            let related = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}/"));
            let governed = crate::core::api::endpoint::ALL.iter().any(|e| related(e.path(), &canonical));
            if !p.starts_with("/v1/") || canonical != *p || segments.len() < 2 || governed {
                return Err(ConfigError(format!(
                    "passthrough_paths: '{p}' must be a path under /v1/ as written (no query, no trailing slash), \
                     not a governed endpoint's"
                )));
            }
            let state = crate::core::api::endpoint::ALL.iter().map(|e| e.path()).chain([CONVERSATIONS]);
            if let Some(owner) = state.into_iter().find(|s| related(&canonical, s)) {
                return Err(ConfigError(format!(
                    "passthrough_paths: '{p}' is under {owner}, whose objects the edge keeps with the tenant that \
                     made them: passed with the operator's key, any tenant could read them"
                )));
            }
        }
        Ok(())
    }

    /// The longest an answer stays fresh after it is stored: the cache's TTL, or on a
    /// forward node the longest a near copy is kept.
    pub(crate) fn longest_fresh_ms(&self) -> u64 {
        self.cache.ttl_seconds.max(self.edge.max_age_seconds).saturating_mul(1000)
    }

    /// Tick period of each worker: the safety net for wake-ups and the lease renewal clock.
    pub fn tick_ms(&self) -> u64 {
        (self.lock.lease_ms / 4).clamp(25, 500)
    }
}

impl Config {
    /// The configuration's fields over the defaults (`read`).
    fn read(root: &Value) -> Read<Config> {
        section("", root, |c: &mut Config, name, v, p| {
            match name {
                "role" => c.role = choice(p, v, &[("owner", Role::Owner), ("forward", Role::Forward)])?,
                "fleet" => c.fleet = Fleet::read(p, v)?,
                "edge" => c.edge = Edge::read(p, v)?,
                "upstream" => c.upstream = Upstream::read(p, v)?,
                "cache" => c.cache = Cache::read(p, v)?,
                "lock" => c.lock = Lock::read(p, v)?,
                "max_body_bytes" => c.max_body_bytes = size(p, v)?,
                "models" => c.models = entries(p, v, Model::read)?,
                "rate_limit" => c.rate_limit = RateLimit::read(p, v)?,
                "retry" => c.retry = Retry::read(p, v)?,
                "stale_if_error_seconds" => c.stale_if_error_seconds = whole(p, v)?,
                "log_fields" => c.log_fields = flag(p, v)?,
                "semantic" => c.semantic = Semantic::read(p, v)?,
                "tenants" => c.tenants = entries(p, v, Tenant::read)?,
                "budget_store" => c.budget_store = BudgetStore::read(p, v)?,
                "passthrough_paths" => c.passthrough_paths = texts(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl BudgetStore {
    fn read(path: &str, v: &Value) -> Read<BudgetStore> {
        section(path, v, |b: &mut BudgetStore, name, v, p| {
            match name {
                "cluster" => b.cluster = text(p, v)?,
                "authority" => b.authority = text(p, v)?,
                "prefix" => b.prefix = text(p, v)?,
                "flush_ms" => b.flush_ms = whole(p, v)?,
                "timeout_ms" => b.timeout_ms = whole(p, v)?,
                "outage_usd" => b.outage_usd = maybe(p, v, number)?,
                "replicas" => b.replicas = whole32(p, v)?,
                "tenants" => b.tenants = flag(p, v)?,
                "tenants_poll_ms" => b.tenants_poll_ms = whole(p, v)?,
                "max_tenants" => b.max_tenants = whole32(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl Fleet {
    fn read(path: &str, v: &Value) -> Read<Fleet> {
        section(path, v, |f: &mut Fleet, name, v, p| {
            match name {
                "cluster" => f.cluster = text(p, v)?,
                "nodes" => f.nodes = whole32(p, v)?,
                "peer_secret_env" => f.peer_secret_env = text(p, v)?,
                "peer_secret_accepted_env" => f.peer_secret_accepted_env = text(p, v)?,
                "timeout_ms" => f.timeout_ms = whole(p, v)?,
                "internal" => f.internal = flag(p, v)?,
                "peer_sans" => f.peer_sans = texts(p, v)?,
                "config_mismatch" => {
                    f.config_mismatch = choice(p, v, &[("count", Mismatch::Count), ("refuse", Mismatch::Refuse)])?
                }
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl Edge {
    fn read(path: &str, v: &Value) -> Read<Edge> {
        section(path, v, |e: &mut Edge, name, v, p| {
            match name {
                "max_age_seconds" => e.max_age_seconds = whole(p, v)?,
                "max_entries" => e.max_entries = whole32(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl Semantic {
    fn read(path: &str, v: &Value) -> Read<Semantic> {
        section(path, v, |s: &mut Semantic, name, v, p| {
            match name {
                "enabled" => s.enabled = flag(p, v)?,
                "embedding_model" => s.embedding_model = text(p, v)?,
                "dimensions" => s.dimensions = maybe(p, v, whole32)?,
                "threshold" => s.threshold = number(p, v)?,
                "max_entries" => s.max_entries = whole32(p, v)?,
                "models" => s.models = texts(p, v)?,
                "allow_tools" => s.allow_tools = flag(p, v)?,
                "timeout_ms" => s.timeout_ms = whole(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl RateLimit {
    fn read(path: &str, v: &Value) -> Read<RateLimit> {
        section(path, v, |r: &mut RateLimit, name, v, p| {
            match name {
                "max_wait_ms" => r.max_wait_ms = whole(p, v)?,
                "max_provider_hold_ms" => r.max_provider_hold_ms = whole(p, v)?,
                "reserve" => r.reserve = number(p, v)?,
                "max_queue" => r.max_queue = size(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl Retry {
    fn read(path: &str, v: &Value) -> Read<Retry> {
        section(path, v, |r: &mut Retry, name, v, p| {
            match name {
                "max_attempts" => r.max_attempts = whole32(p, v)?,
                "base_delay_ms" => r.base_delay_ms = whole(p, v)?,
                "max_delay_ms" => r.max_delay_ms = whole(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl Upstream {
    fn read(path: &str, v: &Value) -> Read<Upstream> {
        section(path, v, |u: &mut Upstream, name, v, p| {
            match name {
                "cluster" => u.cluster = text(p, v)?,
                "authority" => u.authority = text(p, v)?,
                "scheme" => u.scheme = text(p, v)?,
                "timeout_ms" => u.timeout_ms = whole(p, v)?,
                "api_key_env" => u.api_key_env = text(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl Cache {
    fn read(path: &str, v: &Value) -> Read<Cache> {
        section(path, v, |c: &mut Cache, name, v, p| {
            match name {
                "ttl_seconds" => c.ttl_seconds = whole(p, v)?,
                "max_entries" => c.max_entries = whole32(p, v)?,
                "max_entry_bytes" => c.max_entry_bytes = size(p, v)?,
                "scope" => c.scope = choice(p, v, &[("tenant", Scope::Tenant), ("global", Scope::Global)])?,
                "tenant_header" => c.tenant_header = maybe(p, v, text)?,
                "only_deterministic" => c.only_deterministic = flag(p, v)?,
                "require_tenant" => c.require_tenant = flag(p, v)?,
                "hot_bytes" => c.hot_bytes = size(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl Lock {
    fn read(path: &str, v: &Value) -> Read<Lock> {
        section(path, v, |l: &mut Lock, name, v, p| {
            match name {
                "lease_ms" => l.lease_ms = whole(p, v)?,
                "wait_timeout_ms" => l.wait_timeout_ms = whole(p, v)?,
                "slots" => l.slots = whole32(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl Model {
    fn read(path: &str, v: &Value) -> Read<Model> {
        section(path, v, |m: &mut Model, name, v, p| {
            match name {
                "requests_per_minute" => m.requests_per_minute = maybe(p, v, whole32)?,
                "tokens_per_minute" => m.tokens_per_minute = maybe(p, v, whole)?,
                "burst" => m.burst = maybe(p, v, whole32)?,
                "max_in_flight" => m.max_in_flight = maybe(p, v, whole32)?,
                "fallback" => m.fallback = texts(p, v)?,
                "usd_per_mtok_input" => m.usd_per_mtok_input = maybe(p, v, number)?,
                "usd_per_mtok_output" => m.usd_per_mtok_output = maybe(p, v, number)?,
                "usd_per_mtok_cached_input" => m.usd_per_mtok_cached_input = maybe(p, v, number)?,
                "max_completion_tokens" => m.max_completion_tokens = maybe(p, v, whole)?,
                "context_window" => m.context_window = maybe(p, v, whole)?,
                "prompt_cache_affinity" => m.prompt_cache_affinity = flag(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }
}

impl Model {
    /// Whether the model has a price (for prompt or completion tokens).
    pub(crate) fn priced(&self) -> bool {
        self.usd_per_mtok_input.is_some() || self.usd_per_mtok_output.is_some()
    }

    pub(crate) fn input_price(&self) -> f64 {
        self.usd_per_mtok_input.unwrap_or(0.0)
    }

    pub(crate) fn output_price(&self) -> f64 {
        self.usd_per_mtok_output.unwrap_or(0.0)
    }

    /// The price of a prompt token served from the provider's prompt cache.
    pub(crate) fn cached_input_price(&self) -> f64 {
        self.usd_per_mtok_cached_input.unwrap_or(self.input_price())
    }

    /// The dearest any token can be billed.
    pub(crate) fn dearest_price(&self) -> f64 {
        self.input_price().max(self.output_price()).max(self.cached_input_price())
    }

    /// Micro-dollars `usage` costs at this model's prices.
    pub fn cost_micro_usd(&self, u: &Usage) -> u64 {
        let fresh = u.fresh_prompt() as f64 * self.input_price();
        let cached = u.cached as f64 * self.cached_input_price();
        (fresh + cached + u.completion as f64 * self.output_price()).round() as u64
    }

    fn validate(&self, name: &str) -> Result<(), ConfigError> {
        let field = |f: &str| format!("models.{name}.{f}");
        let positive = [
            ("requests_per_minute", self.requests_per_minute.map(u64::from)),
            ("tokens_per_minute", self.tokens_per_minute),
            ("max_completion_tokens", self.max_completion_tokens),
            ("context_window", self.context_window),
            ("burst", self.burst.map(u64::from)),
            ("max_in_flight", self.max_in_flight.map(u64::from)),
        ];
        if let Some((f, _)) = positive.iter().find(|(_, v)| *v == Some(0)) {
            return Err(ConfigError(format!("{}: must be at least 1", field(f))));
        }
        if self.max_in_flight.is_some_and(|m| m > 10_000) {
            return Err(ConfigError(format!("{}: must be at most 10000", field("max_in_flight"))));
        }
        if self.context_window.is_some_and(|m| m > MAX_CONTEXT_WINDOW) {
            return Err(ConfigError(format!("{}: must be at most {MAX_CONTEXT_WINDOW}", field("context_window"))));
        }
        if self.max_completion_tokens.is_some_and(|m| m > MAX_COMPLETION_CAP) {
            return Err(ConfigError(format!(
                "{}: must be at most {MAX_COMPLETION_CAP}",
                field("max_completion_tokens")
            )));
        }
        for (f, price) in [
            ("usd_per_mtok_input", self.usd_per_mtok_input),
            ("usd_per_mtok_output", self.usd_per_mtok_output),
            ("usd_per_mtok_cached_input", self.usd_per_mtok_cached_input),
        ] {
            if price.is_some_and(|p| !p.is_finite() || p < 0.0) {
                return Err(ConfigError(format!("{}: must be a price of at least 0", field(f))));
            }
        }
        if self.fallback.iter().any(|f| f.is_empty() || f == name) {
            return Err(ConfigError(format!(
                "{}: names must be non-empty and not the model itself",
                field("fallback")
            )));
        }
        Ok(())
    }
}

fn valid_header_name(h: &str) -> bool {
    !h.is_empty() && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_duration_is_bounded() {
        for (json, field) in [
            (r#"{"lock":{"lease_ms":18446744073709551615}}"#, "lock.lease_ms"),
            (r#"{"upstream":{"timeout_ms":86400001}}"#, "upstream.timeout_ms"),
            (r#"{"cache":{"ttl_seconds":31536001}}"#, "cache.ttl_seconds"),
            (r#"{"rate_limit":{"max_wait_ms":86400001}}"#, "rate_limit.max_wait_ms"),
            (r#"{"stale_if_error_seconds":31536001}"#, "stale_if_error_seconds"),
        ] {
            let e = Config::parse(json.as_bytes()).expect_err(json).to_string();
            assert!(e.contains(field), "{json}: {e}");
        }
        assert!(Config::parse(br#"{"lock":{"lease_ms":86400000},"cache":{"ttl_seconds":31536000}}"#).is_ok());
    }

    #[test]
    fn role_and_fleet_are_read_and_checked() {
        let c = Config::parse(br#"{"role":"forward","fleet":{"cluster":"owners","nodes":3}}"#).unwrap();
        assert_eq!((c.role, c.fleet.nodes, c.fleet.shared_limits()), (Role::Forward, 3, true));
        assert_eq!(Config::default().role, Role::Owner, "a single node changes nothing");
        assert!(!Config::default().fleet.shared_limits());
        for (json, field) in [
            (r#"{"role":"edge"}"#, "role"),
            (r#"{"fleet":{"nodes":0}}"#, "fleet.nodes"),
            (r#"{"fleet":{"timeout_ms":0}}"#, "fleet.timeout_ms"),
            (r#"{"fleet":{"peer_secret_env":""}}"#, "fleet.peer_secret_env"),
        ] {
            let e = Config::parse(json.as_bytes()).expect_err(json);
            assert_eq!(e.field(), field, "{json}: {e}");
        }
    }

    #[test]
    fn a_forward_nodes_cache_is_bounded_by_its_near_copies() {
        let json = br#"{"role":"forward","cache":{"max_entries":9000},"edge":{"max_entries":64,"max_age_seconds":5}}"#;
        let c = Config::parse(json).unwrap();
        assert_eq!((c.cache.max_entries, c.edge.max_age_seconds), (64, 5));
        let owner = Config::parse(br#"{"cache":{"max_entries":9000},"edge":{"max_entries":64}}"#).unwrap();
        assert_eq!(owner.cache.max_entries, 9000, "an owner keeps its own bound");
        assert_eq!((Config::default().edge.max_age_seconds, Config::default().edge.max_entries), (60, 1024));
        for (json, field) in [
            (r#"{"edge":{"max_entries":0}}"#, "edge.max_entries"),
            (r#"{"edge":{"max_age_seconds":31536001}}"#, "edge.max_age_seconds"),
            (r#"{"edge":{"ttl":1}}"#, "edge"),
        ] {
            let e = Config::parse(json.as_bytes()).expect_err(json);
            assert!(e.field().starts_with(field), "{json}: {e}");
        }
    }

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
    fn models_resolve_to_their_entry_then_default() {
        let c = Config::parse(
            br#"{"models":{"gpt-4.1":{"requests_per_minute":500,"tokens_per_minute":150000,"burst":50,
                 "max_in_flight":10,"fallback":["deepseek-v3"],"usd_per_mtok_input":2.0,"usd_per_mtok_output":8.0},
                 "default":{"requests_per_minute":600,"tokens_per_minute":200000}},
                 "rate_limit":{"max_wait_ms":0},"retry":{"max_attempts":3,"base_delay_ms":250,"max_delay_ms":8000},
                 "stale_if_error_seconds":0}"#,
        )
        .unwrap();
        assert_eq!(c.model("gpt-4.1").map(|(n, m)| (n, m.burst)), Some(("gpt-4.1", Some(50))));
        assert_eq!(c.model("claude-sonnet-4").map(|(n, _)| n), Some("default"));
        assert!(Config::default().model("gpt-4.1").is_none());
        assert_eq!(Config::default().retry, Retry { max_attempts: 3, base_delay_ms: 250, max_delay_ms: 8000 });
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = Config::parse(br#"{"cache":{"ttl":5}}"#).unwrap_err();
        assert!(e.0.contains("ttl"), "{e}");
        let e = Config::parse(br#"{"upstreams":{}}"#).unwrap_err();
        assert!(e.0.contains("upstreams"), "{e}");
    }

    #[test]
    fn the_parser_names_the_exact_setting_it_refused() {
        for (raw, field) in [
            (r#"{"cache":{"ttl":5}}"#, "cache.ttl"),
            (r#"{"upstreams":{}}"#, "upstreams"),
            (r#"{"lock":{"lease_ms":"5s"}}"#, "lock.lease_ms"),
            (r#"{"models":{"gpt-4.1":{"burst":"x"}}}"#, "models.gpt-4.1.burst"),
            (r#"{"models":{"gpt-4.1":{"rpm":5}}}"#, "models.gpt-4.1.rpm"),
            (r#"{"models":{"gpt-4.1":7}}"#, "models.gpt-4.1"),
            (r#"{"models":[]}"#, "models"),
            (r#"{"fleet":{"nodes":-1}}"#, "fleet.nodes"),
            (r#"{"role":"edge"}"#, "role"),
        ] {
            let e = Config::parse(raw.as_bytes()).unwrap_err();
            assert_eq!(e.field(), field, "{raw}: {e}");
        }
    }

    #[test]
    fn a_fleets_owner_serves_only_the_fleet_unless_told_otherwise() {
        let internal = |raw: &str| Config::parse(raw.as_bytes()).map(|c| c.fleet.internal);
        assert_eq!(internal(r#"{"fleet":{"cluster":"owners","nodes":3}}"#), Ok(true), "a fleet's owner");
        assert_eq!(internal(r#"{"fleet":{"cluster":"owners","internal":false}}"#), Ok(false), "opened on purpose");
        assert_eq!(internal(r#"{"fleet":{"nodes":1}}"#), Ok(false), "no fleet: its clients come to it");
        assert_eq!(internal(r#"{}"#), Ok(false));
        assert_eq!(internal(r#"{"role":"forward","fleet":{"cluster":"owners"}}"#), Ok(false), "a forward node");
    }

    /// Every field of every section is read: a configuration setting each one away from
    /// its default equals the same settings written out (a struct literal, so a field added
    /// to a section and not to this test fails to compile).
    #[test]
    fn every_field_is_read() {
        let key = "e".repeat(64);
        let raw = format!(
            r#"{{"role":"forward","log_fields":true,"max_body_bytes":2048,"stale_if_error_seconds":7,
            "fleet":{{"cluster":"owners","nodes":3,"peer_secret_env":"A","peer_secret_accepted_env":"B",
              "timeout_ms":9,"internal":false,"peer_sans":["spiffe://x"],"config_mismatch":"refuse"}},
            "edge":{{"max_age_seconds":5,"max_entries":64}},
            "upstream":{{"cluster":"hs","authority":"a.example","scheme":"http","timeout_ms":11,"api_key_env":"K"}},
            "cache":{{"ttl_seconds":12,"max_entries":128,"max_entry_bytes":4096,"scope":"tenant",
              "tenant_header":null,"only_deterministic":true,"require_tenant":true,"hot_bytes":0}},
            "lock":{{"lease_ms":200,"wait_timeout_ms":300,"slots":64}},
            "models":{{"m":{{"requests_per_minute":1,"tokens_per_minute":2,"burst":3,"max_in_flight":4,
              "fallback":["n"],"usd_per_mtok_input":1.5,"usd_per_mtok_output":2.5,"usd_per_mtok_cached_input":0.5,
              "max_completion_tokens":5,"context_window":6,"prompt_cache_affinity":true}},
              "n":{{"usd_per_mtok_input":1}},"text-embedding-3-large":{{"usd_per_mtok_input":1}}}},
            "rate_limit":{{"max_wait_ms":13,"max_provider_hold_ms":14,"reserve":0.5,"max_queue":15}},
            "retry":{{"max_attempts":2,"base_delay_ms":16,"max_delay_ms":17}},
            "semantic":{{"enabled":true,"embedding_model":"text-embedding-3-large","dimensions":256,
              "threshold":0.9,"max_entries":18,"models":["m"],"allow_tools":true,"timeout_ms":19}},
            "tenants":{{"t":{{"keys_sha256":["{key}"],"models":["m"],"requests_per_minute":20,
              "tokens_per_minute":21,"burst":22,"usd_per_day":1.25,"usd_per_month":30,"priority":"critical",
              "prompt_cache_affinity":true}}}},
            "budget_store":{{"cluster":"etcd","authority":"e","prefix":"p/q","flush_ms":500,"timeout_ms":23,
              "outage_usd":0.75,"replicas":2,"tenants":true,"tenants_poll_ms":2000,"max_tenants":50}},
            "passthrough_paths":["/v1/models"]}}"#
        );
        let c = Config::parse(raw.as_bytes()).unwrap();
        let model = |input: f64| Model { usd_per_mtok_input: Some(input), ..Model::default() };
        let expected = Config {
            role: Role::Forward,
            fleet: Fleet {
                cluster: "owners".into(),
                nodes: 3,
                peer_secret_env: "A".into(),
                peer_secret_accepted_env: "B".into(),
                timeout_ms: 9,
                internal: false,
                peer_sans: vec!["spiffe://x".into()],
                config_mismatch: Mismatch::Refuse,
            },
            edge: Edge { max_age_seconds: 5, max_entries: 64 },
            upstream: Upstream {
                cluster: "hs".into(),
                authority: "a.example".into(),
                scheme: "http".into(),
                timeout_ms: 11,
                api_key_env: "K".into(),
            },
            // A forward node's cache holds its near copies (`edge.max_entries`).
            cache: Cache {
                ttl_seconds: 12,
                max_entries: 64,
                max_entry_bytes: 4096,
                scope: Scope::Tenant,
                tenant_header: None,
                only_deterministic: true,
                require_tenant: true,
                hot_bytes: 0,
            },
            lock: Lock { lease_ms: 200, wait_timeout_ms: 300, slots: 64 },
            max_body_bytes: 2048,
            models: Named::from([
                (
                    "m".to_owned(),
                    Model {
                        requests_per_minute: Some(1),
                        tokens_per_minute: Some(2),
                        burst: Some(3),
                        max_in_flight: Some(4),
                        fallback: vec!["n".into()],
                        usd_per_mtok_input: Some(1.5),
                        usd_per_mtok_output: Some(2.5),
                        usd_per_mtok_cached_input: Some(0.5),
                        max_completion_tokens: Some(5),
                        context_window: Some(6),
                        prompt_cache_affinity: true,
                    },
                ),
                ("n".to_owned(), model(1.0)),
                ("text-embedding-3-large".to_owned(), model(1.0)),
            ]),
            rate_limit: RateLimit { max_wait_ms: 13, max_provider_hold_ms: 14, reserve: 0.5, max_queue: 15 },
            retry: Retry { max_attempts: 2, base_delay_ms: 16, max_delay_ms: 17 },
            stale_if_error_seconds: 7,
            log_fields: true,
            semantic: Semantic {
                enabled: true,
                embedding_model: "text-embedding-3-large".into(),
                dimensions: Some(256),
                threshold: 0.9,
                max_entries: 18,
                models: vec!["m".into()],
                allow_tools: true,
                timeout_ms: 19,
            },
            tenants: Named::from([(
                "t".to_owned(),
                Tenant {
                    keys_sha256: vec![key.clone()],
                    models: Some(vec!["m".into()]),
                    requests_per_minute: Some(20),
                    tokens_per_minute: Some(21),
                    burst: Some(22),
                    usd_per_day: Some(1.25),
                    usd_per_month: Some(30.0),
                    priority: Class::Critical,
                    prompt_cache_affinity: true,
                },
            )]),
            budget_store: BudgetStore {
                cluster: "etcd".into(),
                authority: "e".into(),
                prefix: "p/q".into(),
                flush_ms: 500,
                timeout_ms: 23,
                outage_usd: Some(0.75),
                replicas: 2,
                tenants: true,
                tenants_poll_ms: 2_000,
                max_tenants: 50,
            },
            passthrough_paths: vec!["/v1/models".into()],
            keys: c.keys.clone(),
            object_key: None,
            digest: c.digest.clone(),
        };
        assert_eq!(c, expected);
        assert!(!c.keys.is_empty(), "the tenant's key digest was collected");
    }

    #[test]
    fn a_tenants_fields_and_kinds_are_named_when_refused() {
        for (raw, field) in [
            (r#"{"tenants":{"t":{"priority":"urgent"}}}"#, "tenants.t.priority"),
            (r#"{"tenants":{"t":{"keys":[]}}}"#, "tenants.t.keys"),
            (r#"{"tenants":{"t":{"usd_per_day":"5"}}}"#, "tenants.t.usd_per_day"),
            (r#"{"tenants":{"t":[]}}"#, "tenants.t"),
            (r#"{"budget_store":{"replicas":4294967296}}"#, "budget_store.replicas"),
            (r#"{"semantic":{"models":["m",1]}}"#, "semantic.models"),
            (r#"{"log_fields":"yes"}"#, "log_fields"),
            (r#"{"cache":{"tenant_header":5}}"#, "cache.tenant_header"),
        ] {
            let e = Config::parse(raw.as_bytes()).unwrap_err();
            assert_eq!(e.field(), field, "{raw}: {e}");
        }
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
            (r#"{"cache":{"tenant_header":"x-holysheep-tenant"}}"#, "x-holysheep-"),
            (r#"{"cache":{"tenant_header":"authorization"}}"#, "must not be authorization"),
            (r#"{"cache":{"tenant_header":"cache-control"}}"#, "must not be authorization"),
            (r#"{"max_body_bytes":0}"#, "max_body_bytes"),
        ] {
            let e = Config::parse(raw.as_bytes()).unwrap_err();
            assert!(e.0.contains(field), "{raw}: {e}");
        }
        for (raw, field) in [
            (r#"{"models":{"gpt-4.1":{"requests_per_minute":0}}}"#, "models.gpt-4.1.requests_per_minute"),
            (r#"{"models":{"gpt-4.1":{"rpm":5}}}"#, "rpm"),
            (r#"{"models":{"gpt-4.1":{"fallback":["gpt-4.1"]}}}"#, "models.gpt-4.1.fallback"),
            (r#"{"models":{"m":{"usd_per_mtok_input":-1}}}"#, "models.m.usd_per_mtok_input"),
            (r#"{"retry":{"max_attempts":0}}"#, "retry.max_attempts"),
            (r#"{"retry":{"base_delay_ms":500,"max_delay_ms":100}}"#, "retry.max_delay_ms"),
            (r#"{"stale_if_error_seconds":-3}"#, "stale_if_error_seconds"),
        ] {
            let e = Config::parse(raw.as_bytes()).unwrap_err();
            assert!(e.0.contains(field), "{raw}: {e}");
        }
        assert!(Config::parse(b"{} {}").is_err());
        assert!(Config::parse(b"[]").is_err());
    }

    #[test]
    fn a_budgeted_tenant_reaches_only_priced_models() {
        let key = "e".repeat(64);
        let with = |models: &str, tenant: &str| {
            Config::parse(
                format!(
                    r#"{{"models":{models},"tenants":{{"t":{{"keys_sha256":["{key}"],"usd_per_day":1{tenant}}}}}}}"#
                )
                .as_bytes(),
            )
        };
        let priced = r#""usd_per_mtok_input":1"#;
        for (models, tenant, unpriced) in [
            (format!(r#"{{"a":{{{priced}}},"b":{{}}}}"#), "", "b"),
            (format!(r#"{{"a":{{{priced}}},"default":{{"requests_per_minute":5}}}}"#), "", "default"),
            (format!(r#"{{"a":{{{priced},"fallback":["c"]}}}}"#), "", "c"),
            (format!(r#"{{"a":{{{priced}}}}}"#), r#","models":["a","d"]"#, "d"),
        ] {
            let e = with(&models, tenant).expect_err(&models).to_string();
            assert!(e.contains("tenants.t:") && e.contains(&format!("model {unpriced} it can reach")), "{models}: {e}");
        }
        // Listing no model, with none priced (a forward node without the owners' models):
        // every call would be refused, and the load says so.
        for models in ["{}", r#"{"a":{"requests_per_minute":5}}"#, r#"{"default":{"usd_per_mtok_output":3}}"#] {
            let e = with(models, "").expect_err(models).to_string();
            assert!(e.contains("tenants.t:") && e.contains("no model has a price"), "{models}: {e}");
        }
        for (models, tenant) in [
            (format!(r#"{{"a":{{{priced},"fallback":["b"]}},"b":{{}}}}"#), r#","models":["a"]"#),
            (format!(r#"{{"a":{{{priced}}}}}"#), ""),
            (r#"{"default":{"usd_per_mtok_output":3}}"#.to_owned(), r#","models":["a"]"#),
        ] {
            assert!(with(&models, tenant).is_ok(), "{models} {tenant}: a fallback it may not call, a name not listed");
        }
        let free = Config::parse(br#"{"models":{"b":{}},"tenants":{"t":{"keys_sha256":["eeee"]}}}"#);
        assert!(free.is_err_and(|e| !e.0.contains("price")), "no budget: no price needed (the digest is refused)");
    }

    /// The configurations the docs show (```json blocks, and the filter's `value: '...'` in
    /// ```yaml blocks), with where each stands.
    fn documented_configurations() -> Vec<(String, String)> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut pages = vec![root.join("README.md")];
        let docs = std::fs::read_dir(root.join("docs")).unwrap();
        pages.extend(docs.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "md")));
        let mut found = Vec::new();
        for page in pages {
            let text = std::fs::read_to_string(&page).unwrap();
            let mut lang: Option<(String, usize, String)> = None;
            for (n, line) in text.lines().enumerate() {
                let fence = line.trim_start().strip_prefix("```");
                match (fence, lang.take()) {
                    (Some(l), None) => lang = Some((l.trim().to_owned(), n + 1, String::new())),
                    (Some(_), Some((l, start, block))) if l == "json" => {
                        found.push((format!("{}:{start}", page.display()), block));
                    }
                    (Some(_), Some(_)) => {}
                    (None, Some((l, start, mut block))) => {
                        let value = line.trim().strip_prefix("value: '").and_then(|v| v.strip_suffix('\''));
                        match value {
                            Some(v) if l == "yaml" => found.push((format!("{}:{}", page.display(), n + 1), v.into())),
                            _ => block.push_str(line),
                        }
                        lang = Some((l, start, block));
                    }
                    (None, None) => {}
                }
            }
        }
        found
    }

    #[test]
    fn a_model_is_never_named_as_a_label_the_counters_reserve() {
        for model in ["tenant-x", "tenants", "edge", "priority-high", "fleet", "fleet-v2"] {
            let json = format!(r#"{{"models":{{"{model}":{{}}}}}}"#);
            let e = Config::parse(json.as_bytes()).expect_err(model);
            assert!(e.0.contains("tenant, edge, priority or fleet"), "{model}: {e:?}");
        }
        assert!(Config::parse(br#"{"models":{"gpt-4.1":{},"deepseek-v3":{}}}"#).is_ok());
    }

    #[test]
    fn every_configuration_the_docs_show_is_accepted() {
        let shown = documented_configurations();
        assert!(shown.len() >= 5, "the docs show configurations: {shown:?}");
        for (at, json) in shown {
            if let Err(e) = Config::parse(json.as_bytes()) {
                panic!("{at}: {e}");
            }
        }
    }
}
