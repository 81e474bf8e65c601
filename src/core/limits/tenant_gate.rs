//! A flight's hold on its tenant's own limits: one request and the call's token estimate
//! from the tenant's buckets, and the call's worst-case cost from its dollar budgets, taken
//! before the model's buckets and settled once, when the flight ends, with what its
//! attempts used.

use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::response::Response;
use crate::core::api::usage::Billed;
use crate::core::config::tenants::Caps;
use crate::core::config::tenants::Tenant;
use crate::core::config::{Config, RateLimit};
use crate::core::limits::budget::{self, Backing, Exhausted, Hold, Refused};
use crate::core::limits::budget_store;
use crate::core::limits::line::Who;
use crate::core::limits::{self, duration, Denial, Kind, Limits};
use crate::core::store::CasStore;
use crate::core::wire::decimal;
use crate::core::wire::scan::Json;
use crate::core::wire::write::Object;

/// What a flight took from its tenant.
#[derive(Debug, Clone)]
pub(crate) struct TenantHold {
    tenant: String,
    id: u64,
    estimate: u64,
    dollars: Hold,
    /// One attempt's worst case (what was first reserved): an attempt of unknown cost is
    /// charged this, and each attempt must find it reserved before it is sent.
    worst_micro: u64,
    /// Until when the budget lists the reservation.
    until_ms: u64,
    /// Where it was taken: `None` on the tenant's owner node (settled by a message),
    /// else the ledger here (the tenant's own, or this node's share of it).
    here: Option<Ledger>,
    used_tokens: u64,
    used_micro: u64,
}

/// A tenant's limits as one node keeps them: the whole, or this node's share.
#[derive(Debug, Clone)]
struct Ledger {
    name: String,
    bucket: Option<Limits>,
    caps: Caps,
}

impl Ledger {
    /// How its budget is backed: by the spend store when one is configured, but for a
    /// node's share (kept here alone while the tenant's owner is out of reach).
    fn backing(&self, config: &Config) -> Backing {
        let store = config.budget_store.enabled() && !self.name.ends_with(SHARE);
        Backing::of(config, store)
    }

    /// `tenant`'s ledger (`share`: this node's part of it in a fleet of that many nodes,
    /// the tenant's owner node being out of reach).
    fn of(config: &Config, t: &Tenant, tenant: &str, share: Option<u32>) -> Ledger {
        let (bucket, caps) = (limits_of(t, &config.rate_limit), t.caps());
        match share {
            None => Ledger { name: tenant.to_owned(), bucket, caps },
            Some(nodes) => Ledger {
                name: format!("{tenant}{SHARE}"),
                bucket: bucket.map(|l| l.share(nodes)),
                caps: caps.share(nodes),
            },
        }
    }
}

/// The end of a node's share ledger's name.
const SHARE: &str = "#share";

/// A call's request of its tenant's limits, as a key owner sends it to the tenant's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub tenant: String,
    pub id: u64,
    pub estimate: u64,
    pub worst_micro: u64,
    pub hold_ms: u64,
}

/// How a call ended, for the tenant's owner node to settle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    pub tenant: String,
    pub id: u64,
    pub estimate: u64,
    pub tokens: u64,
    pub micro: u64,
    pub hold: Hold,
    /// The key owner never heard the owner's verdict (or gave up on it at its deadline):
    /// a reservation the owner may have made for the call is given back, nothing else.
    pub release: bool,
}

impl Ask {
    /// As the fleet's messages write it.
    pub(crate) fn to_json(&self) -> String {
        Object::new()
            .str("tenant", &self.tenant)
            .u64("id", self.id)
            .u64("estimate", self.estimate)
            .u64("worst_micro", self.worst_micro)
            .u64("hold_ms", self.hold_ms)
            .finish()
    }

    pub(crate) fn read(json: Json<'_>) -> Option<Ask> {
        let [tenant, id, estimate, worst_micro, hold_ms] =
            json.fields(["tenant", "id", "estimate", "worst_micro", "hold_ms"])?;
        Some(Ask {
            tenant: tenant?.as_str()?.into_owned(),
            id: id?.as_u64()?,
            estimate: estimate?.as_u64()?,
            worst_micro: worst_micro?.as_u64()?,
            hold_ms: hold_ms?.as_u64()?,
        })
    }
}

impl Settlement {
    /// As the fleet's messages write it.
    pub(crate) fn to_json(&self) -> String {
        Object::new()
            .str("tenant", &self.tenant)
            .u64("id", self.id)
            .u64("estimate", self.estimate)
            .u64("tokens", self.tokens)
            .u64("micro", self.micro)
            .raw("hold", &self.hold.to_json())
            .bool("release", self.release)
            .finish()
    }

    pub(crate) fn read(json: Json<'_>) -> Option<Settlement> {
        let names = ["tenant", "id", "estimate", "tokens", "micro", "hold", "release"];
        let [tenant, id, estimate, tokens, micro, hold, release] = json.fields(names)?;
        Some(Settlement {
            tenant: tenant?.as_str()?.into_owned(),
            id: id?.as_u64()?,
            estimate: estimate?.as_u64()?,
            tokens: tokens?.as_u64()?,
            micro: micro?.as_u64()?,
            hold: Hold::read(hold?)?,
            release: match release {
                Some(r) => r.as_bool()?,
                None => false,
            },
        })
    }

    /// Gives back what the tenant's owner may have reserved for `ask`.
    pub fn release(ask: &Ask, now_ms: u64) -> Settlement {
        Settlement {
            tenant: ask.tenant.clone(),
            id: ask.id,
            estimate: ask.estimate,
            tokens: 0,
            micro: 0,
            hold: Hold::at(ask.worst_micro, now_ms),
            release: true,
        }
    }
}

/// Why a tenant's limits refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Its bucket has no room now (it may wait, as for a model's).
    Bucket(Denial),
    /// Its budget for the day or the month is spent.
    Budget(Exhausted),
    /// Its token estimate is more than the tenant's token bucket holds: never admitted.
    TooLarge,
}

impl Refusal {
    /// As a model owner's verdict carries it.
    pub(crate) fn denial(self) -> Denial {
        match self {
            Refusal::Bucket(d) => d,
            Refusal::TooLarge => Denial::of(Kind::TooLarge, None),
            Refusal::Budget(x) => {
                let kind = if x.period == "month" { Kind::QuotaMonth } else { Kind::QuotaDay };
                Denial::of(kind, Some(x.retry_after_ms))
            }
        }
    }

    /// From a verdict's denial, for `tenant`.
    pub fn of(config: &Config, tenant: &str, d: Denial) -> Refusal {
        let caps = config.tenants.get(tenant).map(Tenant::caps).unwrap_or_default();
        let retry_after_ms = d.wait_ms.unwrap_or(1_000);
        match d.kind {
            Kind::QuotaDay => {
                Refusal::Budget(Exhausted { period: "day", cap_micro: caps.per_day.unwrap_or(0), retry_after_ms })
            }
            Kind::QuotaMonth => {
                Refusal::Budget(Exhausted { period: "month", cap_micro: caps.per_month.unwrap_or(0), retry_after_ms })
            }
            Kind::TooLarge => Refusal::TooLarge,
            _ => Refusal::Bucket(d),
        }
    }
}

/// The bucket name of a tenant's own limits (model names cannot start with `tenant.`):
/// also the name the fleet's ring places the tenant's owner node by, in a callout's
/// `:authority` (so nothing but a host name's characters).
pub(crate) fn bucket(tenant: &str) -> String {
    ["tenant.", tenant].concat()
}

/// The tenant's own buckets. Priority classes order the models' lines, not these: a
/// tenant's own limits are first come, first served, without a line or a reserve.
fn limits_of(t: &Tenant, rules: &RateLimit) -> Option<Limits> {
    let rpm = t.requests_per_minute.map(f64::from);
    (rpm.is_some() || t.tokens_per_minute.is_some()).then(|| Limits {
        rpm,
        tpm: t.tokens_per_minute.map(|n| n as f64),
        burst: t.burst.map(f64::from).or(rpm).unwrap_or(1.0),
        max_in_flight: None,
        reserve: 0.0,
        max_line: rules.max_queue,
        shared: false,
        among: 1,
    })
}

/// Whether `tenant` has limits of its own.
pub(crate) fn is_limited(config: &Config, tenant: &str) -> bool {
    config.tenants.get(tenant).is_some_and(Tenant::is_limited)
}

/// The most `tokens` can cost on any of `models`: each token at the dearer of its input
/// and output prices.
pub(crate) fn worst_micro(config: &Config, models: &[String], tokens: u64) -> u64 {
    let price = |m: &String| config.model(m).map_or(0.0, |(_, m)| m.dearest_price());
    let dearest = models.iter().map(price).fold(0.0, f64::max);
    (tokens as f64 * dearest).ceil() as u64
}

/// Takes the call's share of its tenant's limits from this node's store (`share`: this
/// node's part, in a fleet of that many nodes). `None`: the tenant has no limits. The
/// bucket is given back when the budget refuses.
pub(crate) fn take(
    store: &impl CasStore,
    config: &Config,
    ask: &Ask,
    share: Option<u32>,
    now_ms: u64,
) -> Result<Option<TenantHold>, Refusal> {
    let Some(t) = config.tenants.get(&ask.tenant).filter(|t| t.is_limited()) else { return Ok(None) };
    if limits_of(t, &config.rate_limit).is_some_and(|l| !l.fits(ask.estimate)) {
        return Err(Refusal::TooLarge);
    }
    let ledger = Ledger::of(config, t, &ask.tenant, share);
    let (id, estimate) = (ask.id, ask.estimate);
    // A call the budget refuses takes nothing from the buckets (a call waiting for other
    // calls' settlements looks again and again); without buckets, the reservation decides.
    let backed = (ledger.caps, ledger.backing(config));
    if backed.1.store && !backed.0.is_none() && budget_store::misconfigured(store) {
        return Err(Refusal::Bucket(Denial::of(Kind::StoreMissing, None)));
    }
    if ledger.bucket.is_some() {
        budget::check(store, &ledger.name, backed, ask.worst_micro, now_ms).map_err(|r| refusal(store, &ledger, r))?;
    }
    if let Some(l) = &ledger.bucket {
        let who = Who::standard(id, estimate);
        limits::take(store, &bucket(&ledger.name), l, &who, now_ms, ask.hold_ms, false).map_err(Refusal::Bucket)?;
    }
    let listed = (id, ask.worst_micro, now_ms.saturating_add(ask.hold_ms));
    let dollars = match budget::reserve(store, &ledger.name, backed, listed, now_ms) {
        Ok(hold) => hold,
        Err(refused) => {
            if let Some(l) = &ledger.bucket {
                limits::give_back(store, &bucket(&ledger.name), l, id, estimate, now_ms);
            }
            return Err(refusal(store, &ledger, refused));
        }
    };
    let hold = TenantHold {
        tenant: ask.tenant.clone(),
        id,
        estimate,
        dollars,
        worst_micro: dollars.micro,
        until_ms: listed.2,
        here: Some(ledger),
        used_tokens: 0,
        used_micro: 0,
    };
    Ok(Some(hold))
}

/// How a budget's refusal stands for the call. A record not read from the spend store yet
/// is asked for (`budget_store::want`), and the call looks again shortly.
fn refusal(store: &impl CasStore, ledger: &Ledger, refused: Refused) -> Refusal {
    match refused {
        Refused::Exhausted(e) => Refusal::Budget(e),
        Refused::Held => Refusal::Bucket(Denial::of(Kind::BudgetHeld, Some(BUDGET_POLL_MS))),
        Refused::Contended => Refusal::Bucket(Denial::of(Kind::Contended, Some(limits::CONTENTION_RETRY_MS))),
        Refused::Unread => {
            budget_store::want(store, &ledger.name);
            Refusal::Bucket(Denial::of(Kind::Contended, Some(budget_store::READ_POLL_MS)))
        }
        Refused::Outage => Refusal::Bucket(Denial::of(Kind::StoreSilent, Some(budget_store::UNREACHABLE_MS))),
    }
}

/// How often a call that waits for its tenant's calls in flight to settle looks again.
pub(crate) const BUDGET_POLL_MS: u64 = 50;

/// The tenant's owner node settles a call that a key owner reports ended.
pub(crate) fn settle_reported(store: &impl CasStore, config: &Config, s: &Settlement, now_ms: u64) {
    let Some(t) = config.tenants.get(&s.tenant) else { return };
    if s.release {
        // Only the dollars are listed by call; the bucket refills on its own.
        budget::settle(store, &s.tenant, t.caps(), s.id, 0, now_ms);
        return;
    }
    let hold = TenantHold {
        tenant: s.tenant.clone(),
        id: s.id,
        estimate: s.estimate,
        dollars: s.hold,
        worst_micro: s.hold.micro,
        until_ms: now_ms,
        here: Some(Ledger::of(config, t, &s.tenant, None)),
        used_tokens: s.tokens,
        used_micro: s.micro,
    };
    let _ = hold.end(store, now_ms);
}

impl TenantHold {
    /// What the tenant's owner node took for `ask` (its verdict's `hold`).
    pub(crate) fn on_owner(ask: &Ask, dollars: Hold) -> TenantHold {
        TenantHold {
            tenant: ask.tenant.clone(),
            id: ask.id,
            estimate: ask.estimate,
            dollars,
            worst_micro: dollars.micro,
            until_ms: 0,
            here: None,
            used_tokens: 0,
            used_micro: 0,
        }
    }

    pub(crate) fn dollars(&self) -> Hold {
        self.dollars
    }

    /// An attempt on `model` was billed `billed`: what it is charged, in micro-dollars.
    pub fn bill(&mut self, config: &Config, model: &str, billed: Billed) -> u64 {
        let (tokens, micro) = match billed {
            Billed::Known(u) => (u.total(), config.cost_micro_usd(model, &u)),
            Billed::Nothing | Billed::Unsent => (0, 0),
            Billed::Unknown => (self.estimate, self.worst_micro),
        };
        self.used_tokens = self.used_tokens.saturating_add(tokens);
        self.used_micro = self.used_micro.saturating_add(micro);
        micro
    }

    /// Whether one more attempt, which may be billed its worst case, is covered by what
    /// the call reserved beside what its attempts were billed so far. When it is not, the
    /// reservation grows to cover it where the budget is kept here, if the budget has room;
    /// a hold on the tenant's owner node cannot grow, and the attempt is not made.
    pub fn cover_next(&mut self, store: &impl CasStore, config: &Config, now_ms: u64) -> bool {
        let need = self.used_micro.saturating_add(self.worst_micro);
        if !self.budgeted(config) || need <= self.dollars.micro {
            return true;
        }
        let Some(ledger) = &self.here else { return false };
        let backed = (ledger.caps, ledger.backing(config));
        let until_ms = self.until_ms.max(now_ms);
        match budget::reserve(store, &ledger.name, backed, (self.id, need, until_ms), now_ms) {
            Ok(hold) => {
                self.dollars = hold;
                true
            }
            Err(_) => false,
        }
    }

    /// Whether the tenant has a dollar budget (a tenant with buckets alone holds a worst
    /// case that nothing is charged against).
    pub(crate) fn budgeted(&self, config: &Config) -> bool {
        config.tenants.get(&self.tenant).is_some_and(|t| !t.caps().is_none())
    }

    /// The flight ended: its reservations become what its attempts used, here, or (the
    /// `Settlement` returned) on the tenant's owner node.
    pub fn end(self, store: &impl CasStore, now_ms: u64) -> Ended {
        let Some(ledger) = &self.here else {
            return Ended::Owner(Settlement {
                tenant: self.tenant,
                id: self.id,
                estimate: self.estimate,
                tokens: self.used_tokens,
                micro: self.used_micro,
                hold: self.dollars,
                release: false,
            });
        };
        if let Some(l) = &ledger.bucket {
            let (hints, tokens) = (ProviderHints::default(), Some(self.used_tokens));
            limits::settle(store, &bucket(&ledger.name), l, self.id, self.estimate, tokens, &hints, now_ms);
        }
        Ended::Here(budget::settle(store, &ledger.name, ledger.caps, self.id, self.used_micro, now_ms))
    }
}

/// Where a tenant's hold was settled when its call ended.
#[derive(Debug)]
pub enum Ended {
    /// In this process's record, which then stood so (`None`: no budget, or the store
    /// was out of reach).
    Here(Option<budget::Standing>),
    /// On the tenant's owner node, which is to be told.
    Owner(Settlement),
}

/// The answer to a tenant's refusal of a call of `estimate` tokens on `model`: a 429, or
/// the 400 of a call its bucket could never admit.
pub(crate) fn refused(config: &Config, tenant: &str, model: &str, refusal: Refusal, estimate: u64) -> Response {
    let (e, wait) = match refusal {
        Refusal::Bucket(d) if d.kind == Kind::StoreMissing => {
            let cluster = &config.budget_store.cluster;
            let message = format!(
                "The edge is misconfigured: budget_store.cluster '{cluster}' is no cluster this Envoy knows, so \
                 tenant {tenant}'s spend cannot be kept; its calls are refused until the configuration is fixed."
            );
            let e = ApiError::server(message, "edge_misconfigured");
            return Response::json(500, e.body()).with_header(headers::MODEL, model.to_owned());
        }
        Refusal::Bucket(d) if d.kind == Kind::StoreSilent => {
            let wait = d.wait_ms.unwrap_or(budget_store::UNREACHABLE_MS).max(1_000);
            let message = format!(
                "Tenant {tenant}'s spend is kept in the spend store, which has not answered this node yet; what it \
                 admits meanwhile is used. Please try again in {}.",
                duration(wait)
            );
            let e =
                ApiError { status: 503, message, kind: "server_error", param: None, code: "budget_store_unavailable" };
            return Response::json(503, e.body())
                .with_header(headers::RETRY_AFTER, wait.div_ceil(1000).to_string())
                .with_header(headers::MODEL, model.to_owned());
        }
        Refusal::Bucket(d) if d.kind == Kind::BudgetHeld => {
            let wait = d.wait_ms.unwrap_or(BUDGET_POLL_MS).max(1_000);
            let message = format!(
                "Tenant {tenant}'s budget is held by its calls in flight; it has room for this call once they \
                 settle. Please try again in {}.",
                duration(wait)
            );
            (ApiError { status: 429, message, kind: "requests", param: None, code: "rate_limit_exceeded" }, wait)
        }
        Refusal::TooLarge => {
            let tpm = config.tenants.get(tenant).and_then(|t| t.tokens_per_minute).unwrap_or(0);
            let e = ApiError::too_many_tokens(&format!("tenant {tenant}"), estimate, tpm);
            return Response::json(400, e.body()).with_header(headers::MODEL, model.to_owned());
        }
        Refusal::Bucket(d) => {
            let l = config.tenants.get(tenant).and_then(|t| limits_of(t, &config.rate_limit));
            let d = Denial { kind: if d.kind == Kind::Tokens { Kind::Tokens } else { Kind::Requests }, ..d };
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
                "Tenant {tenant} has spent its budget of ${} per {}; it renews in {}.",
                decimal::fixed(x.cap_micro, 6, 2),
                x.period,
                duration(wait)
            );
            let e =
                ApiError { status: 429, message, kind: "insufficient_quota", param: None, code: "insufficient_quota" };
            (e, wait)
        }
    };
    Response::json(429, e.body())
        .with_header(headers::RETRY_AFTER, wait.div_ceil(1000).to_string())
        .with_header("retry-after-ms", wait.to_string())
        .with_header(headers::MODEL, model.to_owned())
}
