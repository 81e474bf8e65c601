//! What the semantic tier's embedding costs, and who admits it: the embedding is sent only
//! when the tenant's budget still holds the chat call's worst case beside the embedding's
//! (a tenant that cannot afford the call makes no embedding call) and the embedding model's
//! own bucket, when it has one, admits it; what it was billed is charged to the tenant.

use crate::core::api::hints::ProviderHints;
use crate::core::config::Config;
use crate::core::limits::budget::{self, Backing, Hold};
use crate::core::limits::line::Who;
use crate::core::limits::tenant_gate::{self, Settlement};
use crate::core::limits::{self, Limits};
use crate::core::request::Key;
use crate::core::store::CasStore;
use crate::core::upstream::Outbound;

use super::Probe;

/// The embedding of `probe`'s question as its admission sees it: the bucket id it takes
/// from the embedding model's bucket (one per flight), and its token estimate (a token is
/// at least one byte of text).
fn ticket(key: &Key, probe: &Probe) -> (u64, u64) {
    let id = key.hex().bytes().take(16).fold(0u64, |n, b| n.wrapping_mul(31).wrapping_add(u64::from(b)));
    (id, probe.text.len() as u64)
}

/// Whether the embedding for `outbound`'s call may be sent now: its tenant's budget (when it
/// has one, kept on this node) has room for the chat call's worst case and the
/// embedding's, and the embedding model's bucket (when it has limits, and they are this
/// node's) gives it its tokens. Takes from that bucket when it says yes.
pub fn admit(
    store: &impl CasStore,
    config: &Config,
    key: &Key,
    probe: &Probe,
    outbound: &Outbound,
    now_ms: u64,
) -> bool {
    let (id, estimate) = ticket(key, probe);
    if let Some(t) = outbound.tenant.as_deref().and_then(|t| config.tenants.get(t).map(|c| (t, c))) {
        let (name, tenant) = t;
        let shared = config.fleet.shared_limits();
        let caps = tenant.caps();
        if !shared && !caps.is_none() {
            let models = [outbound.model.clone()];
            let worst = tenant_gate::worst_micro(config, &models, outbound.worst_tokens())
                .saturating_add(super::cost_micro_usd(config, estimate));
            let backing = Backing::of(config, config.budget_store.enabled());
            if budget::check(store, name, (caps, backing), worst, now_ms).is_err() {
                return false;
            }
        }
    }
    match bucket(config) {
        Some((name, l)) => {
            let who = Who::standard(id, estimate);
            let hold_ms = config.semantic.timeout_ms.saturating_add(1_000);
            limits::take(store, name, &l, &who, now_ms, hold_ms, false).is_ok()
        }
        None => true,
    }
}

/// The embedding model's bucket, when it has limits kept on this node.
fn bucket(config: &Config) -> Option<(&str, Limits)> {
    let (name, m) = config.models.get_key_value(&config.semantic.embedding_model)?;
    let l = Limits::of(m, &config.rate_limit);
    let limited = l.rpm.is_some() || l.tpm.is_some() || l.max_in_flight.is_some();
    (limited && !config.fleet.shared_limits()).then_some((name.as_str(), l))
}

/// The embedding `admit` let go was billed `tokens` (`None`: it gave no answer with a
/// usage; it may have cost its estimate): the embedding model's bucket is settled, and the
/// tenant is charged what it cost, here or (the settlement returned) on its owner node.
pub fn charge(
    store: &impl CasStore,
    config: &Config,
    (key, probe): (&Key, &Probe),
    tenant: Option<&str>,
    tokens: Option<u64>,
    now_ms: u64,
) -> Option<Settlement> {
    let (id, estimate) = ticket(key, probe);
    let billed = tokens.unwrap_or(estimate);
    if let Some((name, l)) = bucket(config) {
        limits::settle(store, name, &l, id, estimate, Some(billed), &ProviderHints::default(), now_ms);
    }
    let tenant = tenant.filter(|t| tenant_gate::is_limited(config, t))?;
    let settlement = Settlement {
        tenant: tenant.to_owned(),
        id: 0,
        estimate: 0,
        tokens: billed,
        micro: super::cost_micro_usd(config, billed),
        hold: Hold::at(0, now_ms),
        release: false,
    };
    if config.fleet.shared_limits() {
        return Some(settlement);
    }
    tenant_gate::settle_reported(store, config, &settlement, now_ms);
    None
}
