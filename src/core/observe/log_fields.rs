//! What an access log can print for each governed request: the shell publishes these
//! values per request (in Envoy as filter state, `wasm.<name>`), named after the
//! OpenTelemetry GenAI semantic conventions where one exists and `holysheep.*` otherwise.

use crate::core::api::event::Event;
use crate::core::api::headers;
use crate::core::api::key::Key;
use crate::core::api::priority::Class;
use crate::core::api::reply::{CacheStatus, Reply};
use crate::core::api::usage::Usage;
use crate::core::config::Config;

/// The names, in the order they are published. (`gen_ai.provider.name` is `holysheep` for
/// every governed request: an access log writes it as text, no value needs setting.)
pub const NAMES: [&str; 15] = [
    "gen_ai.request.model",
    "gen_ai.response.model",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "holysheep.cache",
    "holysheep.key",
    "holysheep.tenant",
    "holysheep.cost_usd",
    "holysheep.upstream_attempts",
    "holysheep.wait_ms",
    "holysheep.priority",
    "gen_ai.usage.cache_read.input_tokens",
    "gen_ai.operation.name",
    "holysheep.saved_usd",
    "holysheep.affinity_saved_usd",
];

/// What a flight did for the request it answers: upstream attempts, the dollars they
/// cost, how long the call waited for its bucket before its first attempt, and what
/// HolySheep's prompt cache saved on a call whose `prompt_cache_key` the edge set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spent {
    pub attempts: u64,
    pub cost_micro_usd: u64,
    pub queued_ms: u64,
    pub affinity_saved_micro_usd: u64,
}

impl Spent {
    /// Adds what a flight's events say (calls, their usage's price, the admission wait).
    pub fn add(&mut self, events: &[Event], price: impl Fn(&str, &Usage) -> u64) {
        for e in events {
            match e {
                Event::UpstreamCall { .. } => self.attempts += 1,
                Event::Usage { model, usage } => {
                    self.cost_micro_usd += price(model, usage);
                }
                Event::Admitted { waited_ms, .. } => self.queued_ms += waited_ms,
                Event::AffinitySaved { micro, .. } => self.affinity_saved_micro_usd += micro,
                _ => {}
            }
        }
    }
}

/// How a request came to its answer: what its own flight spent, and how long it waited
/// (for its flight's answer, as a waiter; for its bucket, as a leader).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Served {
    pub spent: Spent,
    pub wait_ms: u64,
}

impl Served {
    /// A leader's: what its flight spent, and its wait for its bucket.
    pub fn by_flight(spent: Spent) -> Served {
        Served { spent, wait_ms: spent.queued_ms }
    }

    /// A waiter's, answered after `wait_ms`.
    pub fn waited(wait_ms: u64) -> Served {
        Served { spent: Spent::default(), wait_ms }
    }
}

/// One request's answer, as its access-log line shows it.
#[derive(Debug, Clone, Copy)]
pub struct Answered<'a> {
    pub cache: Option<CacheStatus>,
    pub key: Option<&'a Key>,
    /// The model that produced the answer (a 200's `x-holysheep-model`).
    pub response_model: Option<&'a str>,
    pub requested_model: &'a str,
    /// The endpoint's GenAI operation (`Endpoint::operation`).
    pub operation: &'static str,
    pub tenant: Option<&'a str>,
    pub class: Class,
    pub served: Served,
    /// The answer's usage, if it has one.
    pub usage: Option<Usage>,
    /// What an answer served without a call of its own avoided (`saved_micro_usd`).
    pub saved_micro_usd: Option<u64>,
}

impl Answered<'_> {
    /// With what it saved, priced by `config`.
    pub fn priced(self, config: &Config) -> Self {
        let saved = self.cache.zip(self.response_model).zip(self.usage);
        Answered { saved_micro_usd: saved.and_then(|((c, m), u)| saved_micro_usd(config, c, m, &u)), ..self }
    }
}

/// Micro-dollars an answer served without a call of its own (HIT, COALESCED, SEMANTIC)
/// avoided: its usage priced at the model that produced it, as the call it stands in for
/// would have cost. `None` for any other answer.
pub fn saved_micro_usd(config: &Config, status: CacheStatus, served_model: &str, usage: &Usage) -> Option<u64> {
    matches!(status, CacheStatus::Hit | CacheStatus::Coalesced | CacheStatus::Semantic)
        .then(|| config.cost_micro_usd(served_model, usage))
}

/// Micro-dollars as dollars with six decimals.
fn usd(micro: u64) -> String {
    format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

/// The model that produced `reply`, when it is an answer (a 200).
pub fn response_model(reply: &Reply) -> Option<&str> {
    reply.response.header(headers::MODEL).filter(|_| reply.response.status == 200)
}

/// The values of `NAMES` that one answer has: one that does not apply is left out (Envoy
/// prints `-` for it, `null` in a JSON format), so it costs no host call.
pub fn values(a: &Answered<'_>) -> Vec<(&'static str, String)> {
    let cost = a.served.spent.cost_micro_usd;
    let values = [
        Some(a.requested_model.to_owned()),
        a.response_model.map(str::to_owned),
        a.usage.map(|u| u.prompt.to_string()),
        a.usage.map(|u| u.completion.to_string()),
        a.cache.map(|c| CacheStatus::as_str(c).to_owned()),
        a.key.map(|k| k.hex().to_owned()),
        a.tenant.map(str::to_owned),
        Some(usd(cost)),
        Some(a.served.spent.attempts.to_string()),
        Some(a.served.wait_ms.to_string()),
        Some(a.class.as_str().to_owned()),
        a.usage.map(|u| u.cached.to_string()),
        Some(a.operation.to_owned()),
        a.saved_micro_usd.map(usd),
        Some(a.served.spent.affinity_saved_micro_usd).filter(|m| *m > 0).map(usd),
    ];
    NAMES.into_iter().zip(values).filter_map(|(n, v)| Some((n, v?))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::api::response::Response;
    use crate::core::request::request_key;

    #[test]
    fn a_miss_shows_its_models_tokens_cost_and_attempts() {
        let key = request_key("/p", "s", b"1");
        let response = Response::json(200, b"{}".to_vec()).with_header("x-holysheep-model", "deepseek-v3".into());
        let reply =
            Reply { response, cache: Some(CacheStatus::Miss), key: Some(key.clone()), age_s: None, fresh_s: None };
        let mut spent = Spent::default();
        let events = [
            Event::UpstreamCall { model: "gpt-4.1".into() },
            Event::UpstreamCall { model: "deepseek-v3".into() },
            Event::Admitted { class: Class::Standard, waited_ms: 40 },
            Event::AffinitySaved { model: "deepseek-v3".into(), tokens: 4, micro: 30 },
            Event::Usage { model: "deepseek-v3".into(), usage: Usage::new(10, 5) },
        ];
        spent.add(&events, |_, u| u.prompt * 1000 + u.completion);
        assert_eq!(spent, Spent { attempts: 2, cost_micro_usd: 10_005, queued_ms: 40, affinity_saved_micro_usd: 30 });
        let a = Answered {
            cache: reply.cache,
            key: reply.key.as_ref(),
            response_model: response_model(&reply),
            requested_model: "gpt-4.1",
            operation: "chat",
            tenant: Some("search"),
            class: Class::Critical,
            served: Served::by_flight(spent),
            usage: Some(Usage::new(10, 5).with_cached(4)),
            saved_micro_usd: None,
        };
        let v: Vec<String> = values(&a).iter().map(|(n, v)| format!("{n}={v}")).collect();
        assert_eq!(
            v,
            [
                "gen_ai.request.model=gpt-4.1",
                "gen_ai.response.model=deepseek-v3",
                "gen_ai.usage.input_tokens=10",
                "gen_ai.usage.output_tokens=5",
                "holysheep.cache=MISS",
                &format!("holysheep.key={}", key.hex()),
                "holysheep.tenant=search",
                "holysheep.cost_usd=0.010005",
                "holysheep.upstream_attempts=2",
                "holysheep.wait_ms=40",
                "holysheep.priority=critical",
                "gen_ai.usage.cache_read.input_tokens=4",
                "gen_ai.operation.name=chat",
                "holysheep.affinity_saved_usd=0.000030",
            ]
        );
    }

    #[test]
    fn an_edge_refusal_shows_no_answering_model_nor_tokens() {
        let reply = Reply::error(&crate::core::api::error::ApiError::invalid("x", None, "invalid_json"));
        let a = Answered {
            cache: reply.cache,
            key: reply.key.as_ref(),
            response_model: response_model(&reply),
            requested_model: "gpt-4.1",
            operation: "embeddings",
            tenant: None,
            class: Class::Standard,
            served: Served::default(),
            usage: None,
            saved_micro_usd: None,
        };
        let names: Vec<&str> = values(&a).iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "gen_ai.request.model",
                "holysheep.cost_usd",
                "holysheep.upstream_attempts",
                "holysheep.wait_ms",
                "holysheep.priority",
                "gen_ai.operation.name"
            ],
            "no answering model, tokens, cache status, key or tenant"
        );
    }

    #[test]
    fn an_answer_without_a_call_of_its_own_shows_what_that_call_would_have_cost() {
        let config = Config::parse(
            br#"{"models":{"gpt-4.1":{"usd_per_mtok_input":2.0,"usd_per_mtok_output":8.0},
                          "deepseek-v3":{"usd_per_mtok_input":0.25,"usd_per_mtok_output":1.0}}}"#,
        )
        .unwrap();
        let key = request_key("/p", "s", b"1");
        let answer = |cache| Answered {
            cache: Some(cache),
            key: Some(&key),
            response_model: Some("deepseek-v3"),
            requested_model: "gpt-4.1",
            operation: "chat",
            tenant: None,
            class: Class::Standard,
            served: Served::default(),
            usage: Some(Usage::new(1000, 500)),
            saved_micro_usd: None,
        };
        let saved = |cache| {
            let a = answer(cache).priced(&config);
            values(&a).into_iter().find(|(n, _)| *n == "holysheep.saved_usd").map(|(_, v)| v)
        };
        // 1000 × 0.25 + 500 × 1.0 micro-dollars, at the prices of the model that answered.
        for cache in [CacheStatus::Hit, CacheStatus::Coalesced, CacheStatus::Semantic] {
            assert_eq!(saved(cache).as_deref(), Some("0.000750"), "{cache:?}");
        }
        for cache in [CacheStatus::Miss, CacheStatus::Bypass, CacheStatus::Stale] {
            assert_eq!(saved(cache), None, "{cache:?}: it made a call, or stood in for none");
        }
    }
}
