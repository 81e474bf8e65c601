//! What happened to a flight, as the shells count it (`observe::metrics`) and log it
//! (`observe::log_fields`): told by the flight (its calls, retries, failovers, usage) and by
//! its admission (`limits::admission`: lines, shedding, owners out of reach).

use crate::core::api::priority::Class;
use crate::core::api::usage::Usage;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    UpstreamCall {
        model: String,
    },
    Retry {
        model: String,
    },
    Failover {
        from: String,
        to: String,
    },
    RateLimited {
        model: String,
    },
    ProviderRateLimited {
        model: String,
    },
    /// HolySheep's answer on `model` carried `n` `x-ratelimit-*` headers not believed
    /// (`ProviderHints::ignored`).
    LimitHeadersIgnored {
        model: String,
        n: u64,
    },
    Usage {
        model: String,
        usage: Usage,
    },
    /// HolySheep served `tokens` of a call's prompt from its cache, on a call whose
    /// `prompt_cache_key` the edge set: `micro` micro-dollars saved against the input price.
    AffinitySaved {
        model: String,
        tokens: u64,
        micro: u64,
    },
    /// The model's owner node was out of reach: this node admitted from its own share.
    LocalShare {
        model: String,
    },
    /// The flight took a place in a model's admission line (once per flight).
    Queued {
        class: Class,
    },
    /// The flight was admitted to its first call after waiting `waited_ms` since it began.
    Admitted {
        class: Class,
        waited_ms: u64,
    },
    /// The flight was refused for priority: the bucket's reserve (`full`: false) or a full
    /// admission line.
    Shed {
        model: String,
        class: Class,
        full: bool,
    },
    /// An attempt on `model` was charged `micro` micro-dollars to its tenant's budget: what
    /// HolySheep billed, or the worst case of an attempt whose cost is unknown.
    BudgetCharged {
        model: String,
        micro: u64,
    },
    /// The flight settled its tenant's dollar budget in this process's record, which then
    /// stood at these micro-dollars spent (and reserved) today and this month, kept by
    /// `keepers` processes (the tenant's gauges, without reading the record again).
    BudgetStanding {
        tenant: String,
        spent: (u64, u64),
        keepers: u32,
    },
    /// A leader of `model` looked for a paraphrase: whether its question's embedding call
    /// left, the tokens its answer reported (`None`: no embedding), and whether the index
    /// held a paraphrase just below the threshold.
    Embedded {
        model: String,
        sent: bool,
        tokens: Option<u64>,
        near_miss: bool,
    },
}
