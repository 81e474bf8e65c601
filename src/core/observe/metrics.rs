//! Per-model counters: names, and what each event or answer adds to them. Models named in
//! the configuration get their own counters; every other model counts under `other`.

use crate::core::api::endpoint::Endpoint;
use crate::core::api::event::Event;
use crate::core::api::headers;
use crate::core::api::priority::Class;
use crate::core::api::reply::{CacheStatus, Reply};
use crate::core::api::usage::{self, Usage};
use crate::core::config::{Config, Role};
use crate::core::observe::log_fields::saved_micro_usd;
use crate::core::wire::bytes;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Counter {
    Requests(CacheStatus),
    UpstreamCalls,
    Retries,
    Failovers,
    RateLimited,
    ProviderRateLimited,
    PromptTokens,
    CompletionTokens,
    CostSpentMicroUsd,
    CostSavedMicroUsd,
    FleetLocalShare,
    WaitsLost,
    Unauthorized,
    ModelRefused,
    /// A forward node sent a request on to its key's owner.
    Hops,
    /// Storing an answer took the place of another key's answer that was still fresh.
    Evicted,
    /// The semantic tier's calls to `/v1/embeddings`, those that gave no vector (an
    /// error, a timeout), the tokens they were billed and what those cost.
    EmbeddingCalls,
    EmbeddingFailures,
    EmbeddingTokens,
    EmbeddingCostMicroUsd,
    /// A question's partition held stored questions, none close enough.
    SemanticNearMisses,
    /// Prompt tokens HolySheep served from its prompt cache (part of `PromptTokens`).
    CachedTokens,
    /// An owner listener that serves only the fleet refused a request no node sent.
    PeerRefused,
    /// A forward node's hop came back keyed otherwise by its owner (not shared).
    HopKeyMismatch,
    /// An owner took a hop from a node whose configuration digest differs from its own.
    ConfigMismatch,
    /// What tenants' dollar budgets were charged for the model's calls: what HolySheep
    /// billed, and the worst case of each attempt whose cost the edge could not read.
    BudgetChargedMicroUsd,
    /// HolySheep's `x-ratelimit-*` headers that were not believed, and so ignored.
    LimitHeadersIgnored,
    /// What HolySheep's prompt cache saved on calls whose `prompt_cache_key` the edge set.
    AffinitySavedMicroUsd,
    /// Records of the spend store's tenants table refused (`budget_store::tenants`), each
    /// once (its name is in the log).
    TenantRecordsRefused,
}

pub(crate) const COUNTERS: [Counter; 34] = [
    Counter::Requests(CacheStatus::Hit),
    Counter::Requests(CacheStatus::Miss),
    Counter::Requests(CacheStatus::Coalesced),
    Counter::Requests(CacheStatus::Bypass),
    Counter::Requests(CacheStatus::Stale),
    Counter::UpstreamCalls,
    Counter::Retries,
    Counter::Failovers,
    Counter::RateLimited,
    Counter::ProviderRateLimited,
    Counter::PromptTokens,
    Counter::CompletionTokens,
    Counter::CostSpentMicroUsd,
    Counter::CostSavedMicroUsd,
    Counter::FleetLocalShare,
    Counter::WaitsLost,
    Counter::Unauthorized,
    Counter::ModelRefused,
    Counter::Hops,
    Counter::Evicted,
    Counter::Requests(CacheStatus::Semantic),
    Counter::EmbeddingCalls,
    Counter::EmbeddingFailures,
    Counter::EmbeddingTokens,
    Counter::EmbeddingCostMicroUsd,
    Counter::SemanticNearMisses,
    Counter::CachedTokens,
    Counter::PeerRefused,
    Counter::HopKeyMismatch,
    Counter::ConfigMismatch,
    Counter::BudgetChargedMicroUsd,
    Counter::LimitHeadersIgnored,
    Counter::AffinitySavedMicroUsd,
    Counter::TenantRecordsRefused,
];

impl Counter {
    /// Its place in `COUNTERS`.
    pub(crate) fn index(self) -> usize {
        match self {
            Counter::Requests(CacheStatus::Hit) => 0,
            Counter::Requests(CacheStatus::Miss) => 1,
            Counter::Requests(CacheStatus::Coalesced) => 2,
            Counter::Requests(CacheStatus::Bypass) => 3,
            Counter::Requests(CacheStatus::Stale) => 4,
            Counter::UpstreamCalls => 5,
            Counter::Retries => 6,
            Counter::Failovers => 7,
            Counter::RateLimited => 8,
            Counter::ProviderRateLimited => 9,
            Counter::PromptTokens => 10,
            Counter::CompletionTokens => 11,
            Counter::CostSpentMicroUsd => 12,
            Counter::CostSavedMicroUsd => 13,
            Counter::FleetLocalShare => 14,
            Counter::WaitsLost => 15,
            Counter::Unauthorized => 16,
            Counter::ModelRefused => 17,
            Counter::Hops => 18,
            Counter::Evicted => 19,
            Counter::Requests(CacheStatus::Semantic) => 20,
            Counter::EmbeddingCalls => 21,
            Counter::EmbeddingFailures => 22,
            Counter::EmbeddingTokens => 23,
            Counter::EmbeddingCostMicroUsd => 24,
            Counter::SemanticNearMisses => 25,
            Counter::CachedTokens => 26,
            Counter::PeerRefused => 27,
            Counter::HopKeyMismatch => 28,
            Counter::ConfigMismatch => 29,
            Counter::BudgetChargedMicroUsd => 30,
            Counter::LimitHeadersIgnored => 31,
            Counter::AffinitySavedMicroUsd => 32,
            Counter::TenantRecordsRefused => 33,
        }
    }

    pub(crate) fn name(self) -> String {
        match self {
            Counter::Requests(s) => format!("requests_{}", s.as_str().to_ascii_lowercase()),
            Counter::UpstreamCalls => "upstream_calls".into(),
            Counter::Retries => "retries".into(),
            Counter::Failovers => "failovers".into(),
            Counter::RateLimited => "rate_limited".into(),
            Counter::ProviderRateLimited => "provider_rate_limited".into(),
            Counter::PromptTokens => "prompt_tokens".into(),
            Counter::CompletionTokens => "completion_tokens".into(),
            Counter::CostSpentMicroUsd => "cost_spent_microusd".into(),
            Counter::CostSavedMicroUsd => "cost_saved_microusd".into(),
            Counter::FleetLocalShare => "fleet_local_share".into(),
            Counter::WaitsLost => "waits_lost".into(),
            Counter::Unauthorized => "unauthorized".into(),
            Counter::ModelRefused => "model_refused".into(),
            Counter::Hops => "hops".into(),
            Counter::Evicted => "evicted".into(),
            Counter::EmbeddingCalls => "embedding_calls".into(),
            Counter::EmbeddingFailures => "embedding_failures".into(),
            Counter::EmbeddingTokens => "embedding_tokens".into(),
            Counter::EmbeddingCostMicroUsd => "embedding_cost_microusd".into(),
            Counter::SemanticNearMisses => "semantic_near_misses".into(),
            Counter::CachedTokens => "cached_tokens".into(),
            Counter::PeerRefused => "peer_refused".into(),
            Counter::HopKeyMismatch => "hop_key_mismatch".into(),
            Counter::ConfigMismatch => "config_mismatch".into(),
            Counter::BudgetChargedMicroUsd => "budget_charged_microusd".into(),
            Counter::LimitHeadersIgnored => "ratelimit_headers_ignored".into(),
            Counter::AffinitySavedMicroUsd => "affinity_saved_microusd".into(),
            Counter::TenantRecordsRefused => "tenant_records_refused".into(),
        }
    }
}

/// The label a model's counters carry.
pub fn label<'a>(config: &'a Config, model: &'a str) -> &'a str {
    if config.models.contains_key(model) {
        model
    } else {
        "other"
    }
}

/// Every label that can appear: the configured models, `other`, with tenants each
/// tenant's (`tenant.<name>`: every counter of a tenant's requests, whatever their model)
/// and `tenants` (the table as a whole: keys no tenant holds), and on a fleet's owner
/// listener, `fleet` (requests no node sent, hops from nodes that run other settings).
pub(crate) fn labels(config: &Config) -> Vec<String> {
    let models = config.models.keys().cloned().chain(std::iter::once("other".to_owned()));
    let tenants = config.tenants.keys().map(|t| format!("{TENANT_PREFIX}{t}"));
    let table = (!config.keys.is_empty()).then(|| TENANTS_LABEL.to_owned());
    let owner = config.role == Role::Owner && (config.fleet.internal || config.fleet.shared_limits());
    let fleet = owner.then(|| FLEET_LABEL.to_owned());
    models.chain(tenants).chain(table).chain(fleet).collect()
}

/// The label of what a fleet's owner listener counts of the requests its nodes send (or
/// that no node sent).
pub const FLEET_LABEL: &str = "fleet";

/// The label of what no one tenant is counted for (a key no tenant holds).
pub(crate) const TENANTS_LABEL: &str = "tenants";

/// What a tenant's label starts with.
pub(crate) const TENANT_PREFIX: &str = "tenant.";

/// A value for each (label, counter) of a configuration (a host's metric ids), found
/// without hashing or allocating: labels are few and compared in place.
#[derive(Clone)]
pub(crate) struct PerCounter<T> {
    labels: Vec<String>,
    values: Vec<Option<T>>,
}

impl<T> Default for PerCounter<T> {
    fn default() -> Self {
        PerCounter { labels: Vec::new(), values: Vec::new() }
    }
}

impl<T: Copy> PerCounter<T> {
    pub(crate) fn new(config: &Config) -> PerCounter<T> {
        let labels = labels(config);
        let values = vec![None; labels.len() * COUNTERS.len()];
        PerCounter { labels, values }
    }

    pub(crate) fn labels(&self) -> &[String] {
        &self.labels
    }

    pub(crate) fn set(&mut self, label: &str, counter: Counter, value: T) {
        if let Some(slot) = self.slot(label, counter).and_then(|i| self.values.get_mut(i)) {
            *slot = Some(value);
        }
    }

    pub(crate) fn get(&self, label: &str, counter: Counter) -> Option<T> {
        self.values.get(self.slot(label, counter)?).copied().flatten()
    }

    /// The value for `tenant`'s label (`tenant.<name>`), found without building the label.
    pub(crate) fn get_tenant(&self, tenant: &str, counter: Counter) -> Option<T> {
        let l = self.labels.iter().position(|l| l.strip_prefix(TENANT_PREFIX) == Some(tenant))?;
        self.values.get(l * COUNTERS.len() + counter.index()).copied().flatten()
    }

    fn slot(&self, label: &str, counter: Counter) -> Option<usize> {
        let l = self.labels.iter().position(|l| l == label)?;
        Some(l * COUNTERS.len() + counter.index())
    }
}

/// Envoy stat name (Envoy adds the `wasmcustom.` prefix).
/// A counter's name in Envoy: `holysheep.<label>.<counter>` on an owner, and
/// `holysheep.edge.<label>.<counter>` on a forward node (whose VM shares the process's
/// stats with an owner's on the same Envoy).
pub(crate) fn metric_name(config: &Config, label: &str, counter: Counter) -> String {
    match config.role {
        Role::Owner => format!("holysheep.{label}.{}", counter.name()),
        Role::Forward => format!("holysheep.edge.{label}.{}", counter.name()),
    }
}

fn priced(config: &Config, model: &str) -> bool {
    config.model(model).is_some_and(|(_, m)| m.input_price() > 0.0 || m.output_price() > 0.0)
}

/// What one flight event adds, as (model label, counter, amount).
pub(crate) fn for_event<'a>(config: &'a Config, event: &'a Event) -> Vec<(&'a str, Counter, u64)> {
    let one = |m: &'a str, c| vec![(label(config, m), c, 1)];
    match event {
        Event::UpstreamCall { model } => one(model, Counter::UpstreamCalls),
        Event::Retry { model } => one(model, Counter::Retries),
        Event::Failover { from, .. } => one(from, Counter::Failovers),
        Event::RateLimited { model } => one(model, Counter::RateLimited),
        Event::ProviderRateLimited { model } => one(model, Counter::ProviderRateLimited),
        Event::LimitHeadersIgnored { model, n } => vec![(label(config, model), Counter::LimitHeadersIgnored, *n)],
        Event::AffinitySaved { model, micro, .. } => {
            vec![(label(config, model), Counter::AffinitySavedMicroUsd, *micro)]
        }
        Event::LocalShare { model } => one(model, Counter::FleetLocalShare),
        Event::BudgetCharged { model, micro } => vec![(label(config, model), Counter::BudgetChargedMicroUsd, *micro)],
        // Counted per class (`for_class`).
        Event::Queued { .. } | Event::Admitted { .. } | Event::Shed { .. } | Event::BudgetStanding { .. } => Vec::new(),
        Event::Embedded { model, sent, tokens, near_miss } => for_embedding(config, model, *sent, *tokens, *near_miss),
        Event::Usage { model, usage } => {
            let l = label(config, model);
            vec![
                (l, Counter::PromptTokens, usage.prompt),
                (l, Counter::CompletionTokens, usage.completion),
                (l, Counter::CachedTokens, usage.cached),
                (l, Counter::CostSpentMicroUsd, config.cost_micro_usd(model, usage)),
            ]
        }
    }
}

/// The histograms of `gen_ai.client.token.usage`: per model label, one per operation and
/// token type (an embedding has no output tokens). Each billed call records its `usage`.
pub(crate) const TOKEN_USAGE: [(&str, &str); 7] = [
    ("chat", "input"),
    ("chat", "output"),
    ("text_completion", "input"),
    ("text_completion", "output"),
    ("embeddings", "input"),
    ("responses", "input"),
    ("responses", "output"),
];

/// The model labels that have token histograms: the configured models and `other`.
pub(crate) fn token_labels(config: &Config) -> Vec<&str> {
    config.models.keys().map(String::as_str).chain(["other"]).collect()
}

/// The name of the token histogram of `label`, `operation` and `token_type`
/// (`holysheep.<label>.token_usage.<operation>.<token type>`; Envoy's `stats_tags` in
/// `envoy/production.yaml` make the three parts tags).
pub(crate) fn token_usage_name(config: &Config, label: &str, (operation, token_type): (&str, &str)) -> String {
    match config.role {
        Role::Owner => format!("holysheep.{label}.token_usage.{operation}.{token_type}"),
        Role::Forward => format!("holysheep.edge.{label}.token_usage.{operation}.{token_type}"),
    }
}

/// What one flight event of an `operation` records in the token histograms: (model label,
/// index in `TOKEN_USAGE`, tokens).
pub(crate) fn token_usage<'a>(config: &'a Config, operation: &str, event: &'a Event) -> Vec<(&'a str, usize, u64)> {
    let Event::Usage { model, usage } = event else { return Vec::new() };
    let l = label(config, model);
    let at = |token_type: &str| TOKEN_USAGE.iter().position(|&(o, t)| o == operation && t == token_type);
    [(at("input"), usage.prompt), (at("output"), usage.completion)]
        .into_iter()
        .filter_map(|(i, n)| Some((l, i?, n)))
        .collect()
}

/// What a timing histogram measures, in milliseconds from the request's arrival in full:
/// to its answer's end (`gen_ai.client.operation.duration`), or for a stream, to the
/// first chunk of its answer (`gen_ai.client.operation.time_to_first_chunk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timing {
    Duration,
    FirstChunk,
}

impl Timing {
    pub(crate) const ALL: [Timing; 2] = [Timing::Duration, Timing::FirstChunk];

    fn stat(self) -> &'static str {
        match self {
            Timing::Duration => "operation_duration",
            Timing::FirstChunk => "time_to_first_chunk",
        }
    }
}

/// The name of the timing histogram of `label` and `endpoint`'s operation
/// (`holysheep.<label>.operation_duration.<operation>`, `….time_to_first_chunk.…`; the
/// `stats_tags` in `envoy/production.yaml` make the model and the operation tags).
pub(crate) fn timing_name(config: &Config, label: &str, timing: Timing, endpoint: Endpoint) -> String {
    let edge = if config.role == Role::Forward { "edge." } else { "" };
    format!("holysheep.{edge}{label}.{}.{}", timing.stat(), endpoint.operation())
}

/// What one look for a paraphrase adds to the counters of `model` (the chat model): the
/// embedding call when it was `sent`, the `tokens` it was billed (`None`: it gave no
/// vector) at the embedding model's prices (`semantic::cost_micro_usd`), and whether the
/// partition held only questions not close enough.
pub(crate) fn for_embedding<'a>(
    config: &'a Config,
    model: &'a str,
    sent: bool,
    tokens: Option<u64>,
    near_miss: bool,
) -> Vec<(&'a str, Counter, u64)> {
    let l = label(config, model);
    let mut out = Vec::with_capacity(3);
    if sent {
        out.push((l, Counter::EmbeddingCalls, 1));
    }
    match tokens {
        None => out.push((l, Counter::EmbeddingFailures, 1)),
        Some(t) => {
            let cost = config.embedding_cost_micro_usd(t);
            out.extend([(l, Counter::EmbeddingTokens, t), (l, Counter::EmbeddingCostMicroUsd, cost)]);
        }
    }
    if near_miss {
        out.push((l, Counter::SemanticNearMisses, 1));
    }
    out
}

/// A priority class's stats: counters of flights that stood in a line, were shed (the
/// reserve) or refused (a full line), and a histogram of the time flights waited for
/// admission, from their start to their first call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClassStat {
    Queued,
    Shed,
    QueueFull,
    AdmissionWaitMs,
}

pub(crate) const CLASS_STATS: [ClassStat; 4] =
    [ClassStat::Queued, ClassStat::Shed, ClassStat::QueueFull, ClassStat::AdmissionWaitMs];

impl ClassStat {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ClassStat::Queued => "queued",
            ClassStat::Shed => "shed",
            ClassStat::QueueFull => "queue_full",
            ClassStat::AdmissionWaitMs => "admission_wait_ms",
        }
    }

    /// A histogram (a recorded value), not a counter.
    pub(crate) fn is_histogram(self) -> bool {
        self == ClassStat::AdmissionWaitMs
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Envoy stat name (Envoy adds the `wasmcustom.` prefix).
    pub(crate) fn metric_name(self, class: Class) -> String {
        format!("holysheep.priority.{}.{}", class.as_str(), self.name())
    }
}

/// What one flight event adds to its class's stats: (class, stat, amount or value).
pub(crate) fn for_class(event: &Event) -> Option<(Class, ClassStat, u64)> {
    match event {
        Event::Queued { class } => Some((*class, ClassStat::Queued, 1)),
        Event::Shed { class, full: false, .. } => Some((*class, ClassStat::Shed, 1)),
        Event::Shed { class, full: true, .. } => Some((*class, ClassStat::QueueFull, 1)),
        Event::Admitted { class, waited_ms } => Some((*class, ClassStat::AdmissionWaitMs, *waited_ms)),
        _ => None,
    }
}

/// The `usage` of the answer looked at last, kept with its exact bytes: the followers of
/// one flight are answered one after another with the same body, parsed once for them all.
#[derive(Default, Clone)]
pub struct LastUsage {
    body: Vec<u8>,
    usage: Option<Usage>,
}

impl LastUsage {
    pub fn of(&mut self, body: &[u8]) -> Option<Usage> {
        if !bytes::same(&self.body, body) {
            self.usage = usage::of_answer(body);
            self.body = body.to_vec();
        }
        self.usage
    }
}

/// What one answer to a client adds: its cache status, and for HIT, COALESCED and SEMANTIC
/// answers the cost of the original usage, saved.
/// What a follower of a live tail adds: a COALESCED request for `requested_model`, and
/// what the usage its stream carried (of `served`) saved.
pub(crate) fn for_followed<'a>(
    config: &'a Config,
    requested_model: &'a str,
    served: &str,
    usage: Option<Usage>,
) -> Vec<(&'a str, Counter, u64)> {
    let l = label(config, requested_model);
    let mut out = vec![(l, Counter::Requests(CacheStatus::Coalesced), 1)];
    let saved = usage.filter(|_| priced(config, served));
    if let Some(saved) = saved.and_then(|u| saved_micro_usd(config, CacheStatus::Coalesced, served, &u)) {
        out.push((l, Counter::CostSavedMicroUsd, saved));
    }
    out.retain(|(_, _, n)| *n > 0);
    out
}

pub(crate) fn for_reply<'a>(
    config: &'a Config,
    requested_model: &'a str,
    reply: &Reply,
    last: &mut LastUsage,
) -> Vec<(&'a str, Counter, u64)> {
    let Some(status) = reply.cache else { return Vec::new() };
    let l = label(config, requested_model);
    let mut out = vec![(l, Counter::Requests(status), 1)];
    if reply.lost_wait() {
        out.push((l, Counter::WaitsLost, 1));
    }
    if matches!(status, CacheStatus::Hit | CacheStatus::Coalesced | CacheStatus::Semantic)
        && reply.response.status == 200
    {
        let served = reply.response.header(headers::MODEL).unwrap_or(requested_model);
        // Parsing the answer is the only cost on a HIT; skip it when nothing is priced.
        if priced(config, served) {
            if let Some(saved) = last.of(&reply.response.body).and_then(|u| saved_micro_usd(config, status, served, &u))
            {
                out.push((l, Counter::CostSavedMicroUsd, saved));
            }
        }
    }
    out.retain(|(_, _, n)| *n > 0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::api::response::Response;

    #[test]
    fn a_follower_of_a_live_tail_counts_coalesced_with_what_its_usage_saved() {
        let config = Config::parse(br#"{"models":{"gpt-4.1":{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        let coalesced = Counter::Requests(CacheStatus::Coalesced);
        let got = for_followed(&config, "gpt-4.1", "gpt-4.1", Some(Usage::new(1_000, 500)));
        assert_eq!(got, vec![("gpt-4.1", coalesced, 1), ("gpt-4.1", Counter::CostSavedMicroUsd, 6_000)]);
        let unpriced = for_followed(&config, "deepseek-v3", "deepseek-v3", Some(Usage::new(1_000, 500)));
        assert_eq!(unpriced, vec![("other", coalesced, 1)], "nothing saved where nothing is priced");
        assert_eq!(for_followed(&config, "gpt-4.1", "gpt-4.1", None), vec![("gpt-4.1", coalesced, 1)]);
    }

    #[test]
    fn the_last_usage_is_kept_only_for_the_same_bytes() {
        let body = |p: u64| format!(r#"{{"usage":{{"prompt_tokens":{p},"completion_tokens":2}}}}"#).into_bytes();
        let mut last = LastUsage::default();
        assert_eq!(last.of(b""), None);
        let u = |p| Some(Usage::new(p, 2));
        assert_eq!(last.of(&body(10)), u(10));
        assert_eq!(last.of(&body(10)), u(10));
        // Same length, other bytes: parsed again, never the kept answer's usage.
        assert_eq!(last.of(&body(11)), u(11));
        assert_eq!(last.of(b"{}"), None);
        assert_eq!(last.of(&body(10)), u(10));
    }

    #[test]
    fn events_and_replies_become_counters() {
        let c =
            Config::parse(br#"{"models":{"gpt-4.1":{"usd_per_mtok_input":2.0,"usd_per_mtok_output":8.0}}}"#).unwrap();
        assert_eq!(labels(&c), ["gpt-4.1", "other"]);
        assert_eq!(metric_name(&c, "gpt-4.1", Counter::Requests(CacheStatus::Hit)), "holysheep.gpt-4.1.requests_hit");
        let forward = Config::parse(br#"{"role":"forward"}"#).unwrap();
        assert_eq!(metric_name(&forward, "other", Counter::Hops), "holysheep.edge.other.hops");
        let usage = Event::Usage { model: "gpt-4.1".into(), usage: Usage::new(1000, 500) };
        assert!(for_event(&c, &usage).contains(&("gpt-4.1", Counter::CostSpentMicroUsd, 6000)));
        assert_eq!(for_event(&c, &Event::Retry { model: "unknown".into() }), [("other", Counter::Retries, 1)]);
        let body = br#"{"usage":{"prompt_tokens":1000,"completion_tokens":500}}"#.to_vec();
        let (cache, age_s) = (Some(CacheStatus::Hit), Some(1));
        let hit = Reply { response: Response::json(200, body), cache, key: None, age_s, fresh_s: Some(5) };
        assert_eq!(
            for_reply(&c, "gpt-4.1", &hit, &mut LastUsage::default()),
            [("gpt-4.1", Counter::Requests(CacheStatus::Hit), 1), ("gpt-4.1", Counter::CostSavedMicroUsd, 6000)]
        );
        let names: Vec<String> = COUNTERS.iter().map(|c| c.name()).collect();
        let documented = [
            "requests_hit",
            "requests_miss",
            "requests_coalesced",
            "requests_bypass",
            "requests_stale",
            "upstream_calls",
            "retries",
            "failovers",
            "rate_limited",
            "provider_rate_limited",
            "prompt_tokens",
            "completion_tokens",
            "cost_spent_microusd",
            "cost_saved_microusd",
            "fleet_local_share",
            "waits_lost",
            "unauthorized",
            "model_refused",
            "hops",
            "evicted",
            "requests_semantic",
            "embedding_calls",
            "embedding_failures",
            "embedding_tokens",
            "embedding_cost_microusd",
            "semantic_near_misses",
            "cached_tokens",
            "peer_refused",
            "hop_key_mismatch",
            "config_mismatch",
            "budget_charged_microusd",
            "ratelimit_headers_ignored",
            "affinity_saved_microusd",
            "tenant_records_refused",
        ];
        assert_eq!(names, documented, "the counter names docs/operations.md lists, each once");
        assert!(COUNTERS.iter().enumerate().all(|(i, c)| c.index() == i), "index is the place in COUNTERS");
    }

    #[test]
    fn each_tenant_has_its_own_labels_found_without_building_them() {
        let c = Config::parse(
            format!(
                r#"{{"models":{{"gpt-4.1":{{}}}},"tenants":{{"search":{{"keys_sha256":["{}"]}}}}}}"#,
                "b".repeat(64)
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(labels(&c), ["gpt-4.1", "other", "tenant.search", "tenants"]);
        let mut ids = PerCounter::new(&c);
        ids.set("tenant.search", Counter::UpstreamCalls, 7u32);
        assert_eq!(ids.get_tenant("search", Counter::UpstreamCalls), Some(7));
        assert_eq!(ids.get_tenant("search", Counter::Retries), None);
        assert_eq!(ids.get_tenant("gpt-4.1", Counter::UpstreamCalls), None, "a model is no tenant");
    }

    #[test]
    fn each_label_and_counter_keeps_its_own_value() {
        let c = Config::parse(br#"{"models":{"gpt-4.1":{},"deepseek-v3":{}}}"#).unwrap();
        let mut ids = PerCounter::new(&c);
        for (l, label) in labels(&c).iter().enumerate() {
            for (i, counter) in COUNTERS.iter().enumerate() {
                ids.set(label, *counter, l * 100 + i);
            }
        }
        assert_eq!(
            ids.get("gpt-4.1", Counter::Retries),
            Some(6 + 100 * labels(&c).iter().position(|l| l == "gpt-4.1").unwrap())
        );
        assert_eq!(ids.get("other", Counter::FleetLocalShare), Some(214));
        assert_eq!(ids.get("gpt-5", Counter::Retries), None, "a label the configuration does not have");
        ids.set("gpt-5", Counter::Retries, 1);
        assert_eq!(ids.get("gpt-5", Counter::Retries), None);
    }

    #[test]
    fn a_billed_calls_usage_goes_to_its_models_token_histograms_by_operation() {
        let c = Config::parse(br#"{"models":{"gpt-4.1":{}}}"#).unwrap();
        assert_eq!(token_labels(&c), ["gpt-4.1", "other"]);
        let usage = |model: &str| Event::Usage { model: model.into(), usage: Usage::new(12, 7) };
        let chat = usage("gpt-4.1");
        assert_eq!(token_usage(&c, "chat", &chat), [("gpt-4.1", 0, 12), ("gpt-4.1", 1, 7)]);
        let embedding = usage("text-embedding-3-small");
        assert_eq!(token_usage(&c, "embeddings", &embedding), [("other", 4, 12)], "no output tokens");
        assert_eq!(token_usage(&c, "chat", &Event::Retry { model: "gpt-4.1".into() }), []);
        assert_eq!(token_usage_name(&c, "gpt-4.1", TOKEN_USAGE[6]), "holysheep.gpt-4.1.token_usage.responses.output");
        let forward = Config::parse(br#"{"role":"forward"}"#).unwrap();
        assert_eq!(token_usage_name(&forward, "other", TOKEN_USAGE[0]), "holysheep.edge.other.token_usage.chat.input");
    }

    #[test]
    fn timing_histograms_are_named_by_model_label_and_operation() {
        let c = Config::parse(br#"{"models":{"gpt-4.1":{}}}"#).unwrap();
        assert_eq!(
            timing_name(&c, "gpt-4.1", Timing::Duration, Endpoint::Chat),
            "holysheep.gpt-4.1.operation_duration.chat"
        );
        let forward = Config::parse(br#"{"role":"forward"}"#).unwrap();
        assert_eq!(
            timing_name(&forward, "other", Timing::FirstChunk, Endpoint::Responses),
            "holysheep.edge.other.time_to_first_chunk.responses"
        );
    }
}
