//! A HIT a worker keeps in its own memory by the request's raw bytes (`cache::hot`), sent
//! again without parsing, canonicalising or hashing the request: the reply, the request's
//! form, and the counters it adds, resolved once to the host's metric ids.

use crate::core::api::headers;
use crate::core::api::reply::{self, CacheStatus, Reply};
use crate::core::api::usage::{self, Usage};
use crate::core::cache;
use crate::core::config::Config;
use crate::core::observe::log_fields::{Answered, Served};
use crate::core::observe::meters::{Meter, Meters};
use crate::core::request::ApiRequest;
use crate::core::store::CasStore;
use crate::core::upstream::Outbound;
use crate::core::wire::codec::{self, Decimal};
use std::borrow::Cow;

/// A kept HIT's labels as sent at one time (`Kept::labels`).
pub struct Labels {
    directive: Cow<'static, str>,
    age: Decimal,
}

impl Labels {
    /// The labels as header pairs.
    pub fn pairs(&self) -> [(&'static str, &str); 3] {
        [
            (headers::CACHE, CacheStatus::Hit.as_str()),
            (headers::CACHE_CONTROL, self.directive.as_ref()),
            (headers::AGE, self.age.as_str()),
        ]
    }
}

/// A kept HIT.
pub struct Kept {
    /// The reply, without a cache status of its own: `age` and `cache-control` are set
    /// when it is sent.
    pub reply: Reply,
    stored_at_ms: u64,
    /// Until when it is fresh.
    pub expires_ms: u64,
    /// The answer's usage, for the access log.
    usage: Option<Usage>,
    /// The form of the requests it answers (a stream's gets events).
    pub outbound: Outbound,
    /// What a HIT of it adds to the counters (`Meters::hold`).
    pub counters: Vec<(u32, i64)>,
}

impl Kept {
    /// The entry `request` was just served from, while it is fresh.
    pub fn of<H: Meter>(
        store: &impl CasStore,
        config: &Config,
        meters: &mut Meters<H>,
        request: &ApiRequest,
        now: u64,
    ) -> Option<Kept> {
        let entry = cache::get(store, config, &request.key).filter(|e| e.is_fresh(now))?;
        let expires_ms = entry.stored_at_ms.saturating_add(entry.ttl_ms);
        let (cache, key) = (Some(CacheStatus::Hit), Some(entry.key));
        let hit = Reply { response: entry.response, cache, key, age_s: None, fresh_s: None };
        let counters = meters.ids_for_reply(config, &request.model, &hit, request.tenant.as_deref());
        // The class of its tenant (a request that lowers its own is never answered from here).
        let class = config.class_of(request.tenant.as_deref());
        let outbound = Outbound { class, ..Outbound::of(request, Vec::new(), None) };
        let reply = Reply { cache: None, ..hit };
        let usage = config.log_fields.then(|| usage::of_answer(&reply.response.body)).flatten();
        Some(Kept { reply, stored_at_ms: entry.stored_at_ms, expires_ms, usage, outbound, counters })
    }

    /// The bytes it holds, as the worker's table counts them.
    pub fn size(&self) -> usize {
        self.reply.response.body.len()
    }

    /// The reply as sent at `now`: a HIT of its age, fresh for what is left.
    pub fn reply_at(&self, now: u64) -> Reply {
        let (age_s, fresh_s) = (Some(self.age_s(now)), Some(self.fresh_s(now)));
        Reply { age_s, fresh_s, cache: Some(CacheStatus::Hit), ..self.reply.clone() }
    }

    /// The labels a JSON answer sends at `now` beside the reply's own (so that the reply
    /// goes without a copy): the HIT, `cache-control` and `age`, made without allocating.
    /// The answer's other headers are `Outbound::answer_headers`.
    pub fn labels(&self, now: u64) -> Labels {
        Labels { directive: reply::directive(Some(self.fresh_s(now))), age: codec::decimal(self.age_s(now)) }
    }

    /// What the access log shows of a request it answers.
    pub fn answered(&self, config: &Config) -> Answered<'_> {
        let served = self.outbound.answered(&self.reply, Served::default(), self.usage);
        Answered { cache: Some(CacheStatus::Hit), ..served }.priced(config)
    }

    fn age_s(&self, now: u64) -> u64 {
        now.saturating_sub(self.stored_at_ms) / 1000
    }

    fn fresh_s(&self, now: u64) -> u64 {
        self.expires_ms.saturating_sub(now) / 1000
    }
}
