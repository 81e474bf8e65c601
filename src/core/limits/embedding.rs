//! The semantic tier's embedding as a claim through admission: the embedding is sent only
//! when the tenant's budget still holds the chat call's worst case beside the embedding's,
//! whose worst case it then reserves until it is charged
//! (a tenant that cannot afford the call makes no embedding call; in a fleet, where the
//! budget lives on the tenant's owner node, a budgeted tenant makes none) and the embedding
//! model's own bucket (in a fleet, this node's share of it), when it has one, admits it;
//! what it was billed is charged to the tenant.

use crate::core::api::hints::ProviderHints;
use crate::core::api::key::Key;
use crate::core::config::Config;
use crate::core::limits::budget::{self, Backing, Hold};
use crate::core::limits::fleet::Op;
use crate::core::limits::line::Who;
use crate::core::limits::tenant_gate::{self, Settlement};
use crate::core::limits::{self, Limits};
use crate::core::request::probe::Probe;
use crate::core::store::CasStore;

/// The chat call an embedding is made for: its verified tenant, its model, and the most
/// tokens it can be billed (`Outbound::worst_tokens`).
#[derive(Debug, Clone, Copy)]
pub struct For<'a> {
    pub tenant: Option<&'a str>,
    pub model: &'a str,
    pub worst_tokens: u64,
}

/// The embedding of `probe`'s question as its admission sees it: the id it takes from the
/// embedding model's bucket and reserves in its tenant's budget under (one per flight: the
/// key and the flight's lease `nonce`), and its token estimate (a token is at least one
/// byte of text, so its worst case too).
fn ticket((key, nonce): (&Key, u64), probe: &Probe) -> (u64, u64) {
    let id = key.hex().bytes().take(16).fold(0u64, |n, b| n.wrapping_mul(31).wrapping_add(u64::from(b)));
    (id ^ nonce.rotate_left(29), probe.text.len() as u64)
}

/// Whether the embedding for the call `asked` (the flight of `key` whose lease carries
/// `nonce`) may be sent now: its tenant's budget (when it has one, kept on this node) has
/// room for the chat call's worst case and the embedding's, and the embedding model's
/// bucket (when it has limits) gives it its tokens. When it says yes, the embedding's worst
/// case is reserved in the budget and its tokens taken from the bucket, until `charge`.
pub fn admit(
    store: &impl CasStore,
    config: &Config,
    call: (&Key, u64),
    probe: &Probe,
    asked: For<'_>,
    now_ms: u64,
) -> bool {
    let (id, estimate) = ticket(call, probe);
    let hold_ms = config.semantic.timeout_ms.saturating_add(1_000);
    let mut reserved = None;
    if let Some(t) = asked.tenant.and_then(|t| config.tenants.get(t).map(|c| (t, c))) {
        let (name, tenant) = t;
        let shared = config.fleet.shared_limits();
        let caps = tenant.caps();
        // In a fleet the budget lives on the tenant's owner node, which this node cannot ask
        // before the embedding: a budgeted tenant's question makes none (it goes on as a
        // MISS), or a spent tenant would make an operator-paid embedding per question.
        if shared && !caps.is_none() {
            return false;
        }
        if !caps.is_none() {
            let models = [asked.model.to_owned()];
            let embedding = config.embedding_cost_micro_usd(estimate);
            let worst = tenant_gate::worst_micro(config, &models, asked.worst_tokens).saturating_add(embedding);
            let backed = (caps, Backing::of(config, config.budget_store.enabled()));
            if budget::check(store, name, backed, worst, now_ms).is_err() {
                return false;
            }
            // HolySheep may bill the embedding once it is sent: its worst case is held
            // until it is charged, as a call's is.
            let listed = (id, embedding, now_ms.saturating_add(hold_ms));
            if budget::reserve(store, name, backed, listed, now_ms).is_err() {
                return false;
            }
            reserved = Some((name, caps));
        }
    }
    let Some((bucket_name, l)) = bucket(config) else { return true };
    let who = Who::standard(id, estimate);
    if limits::take(store, &bucket_name, &l, &who, now_ms, hold_ms, false).is_ok() {
        return true;
    }
    if let Some((name, caps)) = reserved {
        budget::settle(store, name, caps, id, 0, now_ms);
    }
    false
}

/// The embedding model's bucket, when it has limits: this node's, or in a fleet whose
/// limits live on owner nodes, this node's share of them (embeddings are not asked of an
/// owner; each node keeps within its part).
fn bucket(config: &Config) -> Option<(String, Limits)> {
    let (name, m) = config.models.get_key_value(&config.semantic.embedding_model)?;
    let l = Limits::of(m, &config.rate_limit);
    let limited = l.rpm.is_some() || l.tpm.is_some() || l.max_in_flight.is_some();
    if !limited {
        return None;
    }
    if config.fleet.shared_limits() {
        return Some((limits::share_bucket(name), l.share(config.fleet.nodes)));
    }
    Some((name.clone(), l))
}

/// The embedding `admit` let go was billed `tokens` (`None`: it gave no answer with a
/// usage; it may have cost its estimate): the embedding model's bucket is settled, and the
/// tenant is charged what it cost, here or (the message returned, for its owner node) there.
pub fn charge(
    store: &impl CasStore,
    config: &Config,
    (call, probe): ((&Key, u64), &Probe),
    tenant: Option<&str>,
    tokens: Option<u64>,
    now_ms: u64,
) -> Option<Op> {
    let (id, estimate) = ticket(call, probe);
    let billed = tokens.unwrap_or(estimate);
    if let Some((name, l)) = bucket(config) {
        limits::settle(store, &name, &l, id, estimate, Some(billed), &ProviderHints::default(), now_ms);
    }
    let tenant = tenant.filter(|t| tenant_gate::is_limited(config, t))?;
    // Settled under the id `admit` reserved it with: the reservation gives way to the cost
    // in one write.
    let settlement = Settlement {
        tenant: tenant.to_owned(),
        id,
        estimate: 0,
        tokens: billed,
        micro: config.embedding_cost_micro_usd(billed),
        hold: Hold::at(0, now_ms),
        release: false,
    };
    if config.fleet.shared_limits() {
        return Some(Op::TenantSettle(settlement));
    }
    tenant_gate::settle_reported(store, config, &settlement, now_ms);
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::limits::budget;
    use crate::core::request::request_key;
    use crate::core::store::MemStore;
    use crate::core::upstream::Outbound;

    /// A fleet of 2 nodes whose limits live on owners, `text-embedding-3-small` limited to 4
    /// requests a minute, tenant `paid` with a day's budget and `free` without one.
    fn fleet() -> Config {
        let digest = |c: char| c.to_string().repeat(64);
        Config::parse(
            format!(
                r#"{{"fleet":{{"cluster":"owners","nodes":2}},
                "semantic":{{"enabled":true,"models":["gpt-4.1"]}},
                "models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30,"requests_per_minute":600}},
                    "text-embedding-3-small":{{"usd_per_mtok_input":0.02,"requests_per_minute":4,"burst":4}}}},
                "tenants":{{"paid":{{"keys_sha256":["{}"],"usd_per_day":100}},"free":{{"keys_sha256":["{}"]}}}}}}"#,
                digest('a'),
                digest('b')
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn outbound(tenant: &str) -> Outbound {
        let request = crate::core::request::ApiRequest::parse(
            &Config::default(),
            &Default::default(),
            crate::core::api::endpoint::Endpoint::Chat,
            br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"temperature":0}"#,
        )
        .unwrap();
        Outbound { tenant: Some(tenant.to_owned()), ..Outbound::of(&request, b"{}".to_vec(), None) }
    }

    /// The chat call of `outbound(tenant)` as the embedding's admission sees it.
    fn asked(tenant: &str) -> For<'_> {
        For { tenant: Some(tenant), model: "gpt-4.1", worst_tokens: outbound(tenant).worst_tokens() }
    }

    #[test]
    fn an_embedding_holds_its_worst_case_in_the_budget_until_it_is_charged() {
        // One node: `paid`'s budget is kept here. The embedding model costs $20 per million.
        let config = Config::parse(
            format!(
                r#"{{"semantic":{{"enabled":true,"models":["gpt-4.1"]}},
                "models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30}},
                    "text-embedding-3-small":{{"usd_per_mtok_input":20}}}},
                "tenants":{{"paid":{{"keys_sha256":["{}"],"usd_per_day":100}}}}}}"#,
                "a".repeat(64)
            )
            .as_bytes(),
        )
        .unwrap();
        let store = MemStore::new();
        let probe = Probe { partition: [7; 32], text: "x".repeat(500) };
        let key = request_key("/v1/chat/completions", "paid", b"q");
        assert!(admit(&store, &config, (&key, 7), &probe, asked("paid"), 1_000));
        // Its worst case: 500 bytes, 500 tokens at $20 per million.
        assert_eq!(budget::spent(&store, "paid", 1_000), (10_000, 10_000), "held while it is out");
        // It was billed 120 tokens: 2400 micro-dollars, in place of what was held.
        assert_eq!(charge(&store, &config, ((&key, 7), &probe), Some("paid"), Some(120), 1_100), None);
        assert_eq!(budget::spent(&store, "paid", 1_100), (2_400, 2_400));
    }

    #[test]
    fn in_a_fleet_a_budgeted_tenant_makes_no_embedding_and_each_node_keeps_its_share_of_the_bucket() {
        let (store, config) = (MemStore::new(), fleet());
        let probe = Probe { partition: [7; 32], text: "What is the capital of France?".into() };
        let admit = |tenant: &str, i: u8| {
            let key = request_key("/v1/chat/completions", tenant, &[i]);
            admit(&store, &config, (&key, 7), &probe, asked(tenant), 1_000)
        };
        assert!(!admit("paid", 0), "its budget lives on its owner node, which is not asked first");
        // This node's share of the embedding model's 4 requests a minute is 2.
        let free: Vec<bool> = (1..=3).map(|i| admit("free", i)).collect();
        assert_eq!(free, [true, true, false]);
    }
}
