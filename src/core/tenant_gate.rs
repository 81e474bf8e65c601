//! A flight's hold on its tenant's own limits: one request and the call's token estimate
//! from the tenant's buckets, and the call's worst-case cost from its dollar budgets, taken
//! before the model's buckets and settled once, when the flight ends, with what its
//! attempts used.

use super::budget::{self, Caps, Exhausted, Hold, Refused};
use super::cache::Response;
use super::config::Config;
use super::error::ApiError;
use super::limits::{self, duration, Denial, Kind, Limits, ProviderHints};
use super::store::CasStore;
use super::tenants::Tenant;

/// What a flight took from its tenant.
#[derive(Debug, Clone)]
pub struct TenantHold {
    tenant: String,
    id: u64,
    estimate: u64,
    bucket: Option<Limits>,
    caps: Caps,
    dollars: Hold,
    used_tokens: u64,
    used_micro: u64,
}

/// What one attempt is billed, as far as the edge can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Billed {
    /// HolySheep's `usage`: (prompt, completion) tokens.
    Known(u64, u64),
    /// An error answer: nothing.
    Nothing,
    /// No answer, a cut-off stream or an answer without `usage`: it may have cost its
    /// worst case, and is charged that.
    Unknown,
}

/// Why a tenant's limits refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its bucket has no room now (it may wait, as for a model's).
    Bucket(Denial),
    /// Its budget for the day or the month is spent.
    Budget(Exhausted),
}

/// The bucket name of a tenant's own limits (model names cannot start with `tenant:`).
pub fn bucket(tenant: &str) -> String {
    format!("tenant:{tenant}")
}

fn limits_of(t: &Tenant) -> Option<Limits> {
    let rpm = t.requests_per_minute.map(f64::from);
    (rpm.is_some() || t.tokens_per_minute.is_some()).then(|| Limits {
        rpm,
        tpm: t.tokens_per_minute.map(|n| n as f64),
        burst: t.burst.map(f64::from).or(rpm).unwrap_or(1.0),
        max_in_flight: None,
    })
}

/// The most `tokens` can cost on any of `models`: each token at the dearer of its input
/// and output prices.
fn worst_micro(config: &Config, models: &[String], tokens: u64) -> u64 {
    let price = |m: &String| config.model(m).map_or(0.0, |(_, m)| m.usd_per_mtok_input.max(m.usd_per_mtok_output));
    let dearest = models.iter().map(price).fold(0.0, f64::max);
    (tokens as f64 * dearest).ceil() as u64
}

/// Takes the call's share of `tenant`'s limits (`None`: it has none). The bucket is
/// given back when the budget refuses.
#[allow(clippy::too_many_arguments)]
pub fn reserve(
    store: &impl CasStore,
    config: &Config,
    tenant: &str,
    models: &[String],
    id: u64,
    (estimate, worst_tokens): (u64, u64),
    now_ms: u64,
    hold_ms: u64,
) -> Result<Option<TenantHold>, Refusal> {
    let Some(t) = config.tenants.get(tenant).filter(|t| t.is_limited()) else { return Ok(None) };
    let (bucket_limits, caps) = (limits_of(t), t.caps());
    if let Some(l) = &bucket_limits {
        limits::take(store, &bucket(tenant), l, id, estimate, now_ms, hold_ms).map_err(Refusal::Bucket)?;
    }
    let dollars = match budget::reserve(store, tenant, caps, worst_micro(config, models, worst_tokens), now_ms) {
        Ok(hold) => hold,
        Err(refused) => {
            if let Some(l) = &bucket_limits {
                limits::settle(store, &bucket(tenant), l, id, estimate, Some(0), &ProviderHints::default(), now_ms);
            }
            return Err(match refused {
                Refused::Exhausted(e) => Refusal::Budget(e),
                Refused::Contended => {
                    Refusal::Bucket(Denial { kind: Kind::Contended, wait_ms: Some(limits::CONTENTION_RETRY_MS) })
                }
            });
        }
    };
    let hold = TenantHold {
        tenant: tenant.to_owned(),
        id,
        estimate,
        bucket: bucket_limits,
        caps,
        dollars,
        used_tokens: 0,
        used_micro: 0,
    };
    Ok(Some(hold))
}

impl TenantHold {
    /// An attempt on `model` was billed `billed`.
    pub fn bill(&mut self, config: &Config, model: &str, billed: Billed) {
        let (tokens, micro) = match billed {
            Billed::Known(p, c) => (p.saturating_add(c), config.cost_micro_usd(model, p, c)),
            Billed::Nothing => (0, 0),
            Billed::Unknown => (self.estimate, self.dollars.micro),
        };
        self.used_tokens = self.used_tokens.saturating_add(tokens);
        self.used_micro = self.used_micro.saturating_add(micro);
    }

    /// The flight ended: its reservations become what its attempts used.
    pub fn settle(self, store: &impl CasStore, now_ms: u64) {
        if let Some(l) = &self.bucket {
            let hints = ProviderHints::default();
            let tokens = Some(self.used_tokens);
            limits::settle(store, &bucket(&self.tenant), l, self.id, self.estimate, tokens, &hints, now_ms);
        }
        budget::settle(store, &self.tenant, self.caps, &self.dollars, self.used_micro, now_ms);
    }
}

/// The 429 for a tenant's refusal, for a request on `model`.
pub fn refused(config: &Config, tenant: &str, model: &str, refusal: Refusal) -> Response {
    let (e, wait) = match refusal {
        Refusal::Bucket(d) => {
            let l = config.tenants.get(tenant).and_then(limits_of);
            let what = match (d.kind, l) {
                (Kind::Tokens, Some(l)) => {
                    format!("tokens per min (TPM): Limit {}", limits::whole(l.tpm.unwrap_or(0.0)))
                }
                (_, Some(l)) => format!("requests per min (RPM): Limit {}", limits::whole(l.rpm.unwrap_or(0.0))),
                (_, None) => "requests".to_owned(),
            };
            let wait = d.wait_ms.unwrap_or(1_000).max(1);
            let message =
                format!("Rate limit reached for tenant {tenant} on {what}. Please try again in {}.", duration(wait));
            (ApiError { status: 429, message, kind: d.kind.as_str(), param: None, code: "rate_limit_exceeded" }, wait)
        }
        Refusal::Budget(x) => {
            let wait = x.retry_after_ms.max(1);
            let message = format!(
                "Tenant {tenant} has spent its budget of ${:.2} per {}; it renews in {}.",
                x.cap_micro as f64 / 1e6,
                x.period,
                duration(wait)
            );
            let e =
                ApiError { status: 429, message, kind: "insufficient_quota", param: None, code: "insufficient_quota" };
            (e, wait)
        }
    };
    Response::json(429, e.body())
        .with_header("retry-after", wait.div_ceil(1000).to_string())
        .with_header("retry-after-ms", wait.to_string())
        .with_header("x-holysheep-model", model.to_owned())
}
