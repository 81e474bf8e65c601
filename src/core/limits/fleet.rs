//! Limits held fleet-wide. A model's buckets live on one node, the model's owner (the
//! node the fleet's consistent-hash ring gives the bucket's name); a key owner asks it to
//! take capacity before calling HolySheep and tells it how the call ended. These are the
//! messages and the model owner's side, over its own store.

use crate::core::api::call::HttpCall;
use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::priority::Class;
use crate::core::config::Config;
use crate::core::limits::budget::Hold;
use crate::core::limits::line::Who;
use crate::core::limits::tenant_gate::{self, Ask, Settlement};
use crate::core::limits::{self, Denial, Limits};
use crate::core::request::PEER_PATH;
use crate::core::store::CasStore;
use crate::core::wire::scan::{self, Json};
use crate::core::wire::write::Object;

/// What a key owner asks of a model owner.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Admit the call `id` (one request, `estimate` tokens, a slot held `hold_ms`) of
    /// `class` for the tenant `tenant` (`priority::tenant_tag`); refused, it keeps its
    /// place in the owner's line if it `waits`. The three are left out at their defaults
    /// (a take without them, from a node of the previous release, holds no place).
    Take { model: String, id: u64, estimate: u64, hold_ms: u64, class: Class, tenant: u64, waits: bool },
    /// The call `id` ended having used `actual` tokens, after `retries` requests beyond its
    /// first (a stream's router retries); what the provider said. `retries` is left out
    /// when 0, so nodes of the previous release still read the message.
    Settle { model: String, id: u64, estimate: u64, actual: Option<u64>, hints: ProviderHints, retries: u64 },
    /// Take a tenant's share for a call, on the tenant's owner node.
    TenantTake(Ask),
    /// A tenant's call ended: settle it on the tenant's owner node.
    TenantSettle(Settlement),
}

/// How long a settlement may take; nobody waits for it.
const SETTLE_TIMEOUT_MS: u64 = 5_000;

impl Op {
    /// A message as `to_json` writes it, or as a node of the previous release did: an
    /// object with one member, named by the operation. A take or a settle with a field
    /// it does not know is refused.
    pub fn parse(body: &[u8]) -> Result<Op, ApiError> {
        Op::read(body).ok_or_else(|| ApiError::invalid("not a holysheep peer operation", None, "invalid_json"))
    }

    fn read(body: &[u8]) -> Option<Op> {
        let mut members = scan::read(body).filter(|b| b.is_object())?.members();
        let (Some((name, value)), None) = (members.next(), members.next()) else { return None };
        match &*name {
            "take" => {
                let names = ["model", "id", "estimate", "hold_ms", "class", "tenant", "waits"];
                let [model, id, estimate, hold_ms, class, tenant, waits] = value.only_fields(names)?;
                Some(Op::Take {
                    model: model?.as_str()?.into_owned(),
                    id: id?.as_u64()?,
                    estimate: estimate?.as_u64()?,
                    hold_ms: hold_ms?.as_u64()?,
                    class: match class {
                        Some(c) => Class::named(&c.as_str()?)?,
                        None => Class::Standard,
                    },
                    tenant: match tenant {
                        Some(t) => t.as_u64()?,
                        None => 0,
                    },
                    waits: match waits {
                        Some(w) => w.as_bool()?,
                        None => false,
                    },
                })
            }
            "settle" => {
                let names = ["model", "id", "estimate", "actual", "hints", "retries"];
                let [model, id, estimate, actual, hints, retries] = value.only_fields(names)?;
                Some(Op::Settle {
                    model: model?.as_str()?.into_owned(),
                    id: id?.as_u64()?,
                    estimate: estimate?.as_u64()?,
                    actual: scan::opt(actual, Json::as_u64)?,
                    hints: ProviderHints::read(hints?)?,
                    retries: match retries {
                        Some(r) => r.as_u64()?,
                        None => 0,
                    },
                })
            }
            "tenant_take" => Ask::read(value).map(Op::TenantTake),
            "tenant_settle" => Settlement::read(value).map(Op::TenantSettle),
            _ => None,
        }
    }

    /// The tenant a tenant's operation is about.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Op::TenantTake(Ask { tenant, .. }) | Op::TenantSettle(Settlement { tenant, .. }) => Some(tenant),
            Op::Take { .. } | Op::Settle { .. } => None,
        }
    }

    /// The bucket whose owner node this goes to (`None`: a model without limits).
    pub fn bucket(&self, config: &Config) -> Option<String> {
        match (self, self.tenant()) {
            (_, Some(tenant)) => Some(tenant_gate::bucket(tenant)),
            (Op::Take { model, .. } | Op::Settle { model, .. }, None) => config.model(model).map(|(b, _)| b.to_owned()),
            _ => None,
        }
    }

    /// The `:authority` of the internal call: the fleet's ring hashes it, so every node
    /// reaches the same owner for a bucket.
    pub(crate) fn authority(bucket: &str) -> String {
        ["bucket.", bucket, ".holysheep"].concat()
    }

    /// The call that tells a bucket's owner how a call ended, sent without waiting (`None`:
    /// a model without limits).
    pub fn settlement(&self, config: &Config, secret: &str) -> Option<HttpCall> {
        let bucket = self.bucket(config)?;
        Some(self.call(config, secret, &bucket, SETTLE_TIMEOUT_MS))
    }

    /// The call to the owner of `bucket`, with the fleet's `secret`: along the fleet's
    /// cluster, whose ring hashes the `:authority` that names the bucket.
    pub fn call(&self, config: &Config, secret: &str, bucket: &str, timeout_ms: u64) -> HttpCall {
        let headers = [(headers::CONTENT_TYPE, "application/json"), (headers::PEER_SECRET, secret)];
        let to = (config.fleet.cluster.as_str(), Op::authority(bucket));
        HttpCall::post((to.0, &to.1), PEER_PATH, headers, self.to_json(), timeout_ms)
    }

    /// The message: the defaults a node of the previous release did not know (a
    /// standard class, no tenant, no place in the line, no retries) are left out.
    pub fn to_json(&self) -> Vec<u8> {
        let (name, body) = match self {
            Op::Take { model, id, estimate, hold_ms, class, tenant, waits } => {
                let mut o = Object::new().str("model", model).u64("id", *id).u64("estimate", *estimate);
                o = o.u64("hold_ms", *hold_ms);
                if *class != Class::Standard {
                    o = o.str("class", class.as_str());
                }
                if *tenant != 0 {
                    o = o.u64("tenant", *tenant);
                }
                if *waits {
                    o = o.bool("waits", true);
                }
                ("take", o.finish())
            }
            Op::Settle { model, id, estimate, actual, hints, retries } => {
                let mut o = Object::new().str("model", model).u64("id", *id).u64("estimate", *estimate);
                o = o.opt_u64("actual", *actual).raw("hints", &hints.to_json());
                if *retries != 0 {
                    o = o.u64("retries", *retries);
                }
                ("settle", o.finish())
            }
            Op::TenantTake(ask) => ("tenant_take", ask.to_json()),
            Op::TenantSettle(settlement) => ("tenant_settle", settlement.to_json()),
        };
        Object::new().raw(name, &body).finish().into_bytes()
    }
}

/// A model owner's answer to `Take` (`Settle` is answered with an admitted verdict); to
/// `TenantTake`, also what the tenant's budget holds for the call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    pub admitted: bool,
    pub denial: Option<Denial>,
    pub hold: Option<Hold>,
}

impl Verdict {
    pub fn parse(body: &[u8]) -> Option<Verdict> {
        let [admitted, denial, hold] = scan::read_fields(body, ["admitted", "denial", "hold"])?;
        Some(Verdict {
            admitted: admitted?.as_bool()?,
            denial: scan::opt(denial, Denial::read)?,
            hold: scan::opt(hold, Hold::read)?,
        })
    }

    /// The answer's body (`hold` left out when there is none).
    pub fn to_json(&self) -> Vec<u8> {
        let denial = self.denial.map_or_else(|| "null".to_owned(), Denial::to_json);
        let o = Object::new().bool("admitted", self.admitted).raw("denial", &denial);
        match self.hold {
            Some(hold) => o.raw("hold", &hold.to_json()),
            None => o,
        }
        .finish()
        .into_bytes()
    }

    pub fn result(&self) -> Result<(), Denial> {
        match (self.admitted, self.denial) {
            (false, Some(d)) => Err(d),
            _ => Ok(()),
        }
    }
}

/// Whether `offered` is the secret (compared in constant time); never with no secret.
pub(crate) fn secret_matches(secret: Option<&str>, offered: Option<&str>) -> bool {
    let (Some(secret), Some(offered)) = (secret, offered) else { return false };
    if secret.is_empty() || secret.len() != offered.len() {
        return false;
    }
    secret.bytes().zip(offered.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The model owner's side: applies `body` (an `Op`) to this node's buckets and answers.
pub fn serve(store: &impl CasStore, config: &Config, body: &[u8], now_ms: u64) -> Result<Verdict, ApiError> {
    Ok(serve_op(store, config, Op::parse(body)?, now_ms))
}

/// `serve` for an operation already read.
pub fn serve_op(store: &impl CasStore, config: &Config, op: Op, now_ms: u64) -> Verdict {
    let admitted = Verdict { admitted: true, denial: None, hold: None };
    let model = match &op {
        Op::Take { model, .. } | Op::Settle { model, .. } => model,
        Op::TenantTake(ask) => {
            let ask = Ask { hold_ms: ask.hold_ms.min(crate::core::config::MAX_MS), ..ask.clone() };
            return match tenant_gate::take(store, config, &ask, None, now_ms) {
                Ok(hold) => Verdict { hold: hold.map(|h| h.dollars()), ..admitted },
                Err(refusal) => Verdict { admitted: false, denial: Some(refusal.denial()), hold: None },
            };
        }
        Op::TenantSettle(s) => {
            tenant_gate::settle_reported(store, config, s, now_ms);
            return admitted;
        }
    };
    let Some((bucket, m)) = config.model(model) else { return admitted };
    let l = Limits::of(m, &config.rate_limit);
    let result = match op {
        Op::Take { id, estimate, hold_ms, class, tenant, waits, .. } => {
            let who = Who { id, estimate, class, tenant };
            limits::take(store, bucket, &l, &who, now_ms, hold_ms.min(crate::core::config::MAX_MS), waits)
        }
        Op::Settle { id, estimate, actual, hints, retries, .. } => {
            let hints = capped(config, &hints);
            limits::charge_requests(store, bucket, &l, retries, now_ms);
            limits::settle(store, bucket, &l, id, estimate, actual, &hints, now_ms);
            Ok(())
        }
        Op::TenantTake(_) | Op::TenantSettle(_) => Ok(()),
    };
    Verdict { admitted: result.is_ok(), denial: result.err(), hold: None }
}

/// A provider's word empties a bucket for `rate_limit.max_provider_hold_ms` at most.
pub(crate) fn capped(config: &Config, hints: &ProviderHints) -> ProviderHints {
    let hold = config.rate_limit.max_provider_hold_ms;
    // Only what the settlement message carries: what the attempt was billed settles here.
    let wire = ProviderHints { key_refused: false, billed: Default::default(), ..*hints };
    ProviderHints { retry_after_ms: hints.retry_after_ms.map(|ms| ms.min(hold)), ..wire }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::limits::Kind;
    use crate::core::store::MemStore;

    fn config() -> Config {
        Config::parse(br#"{"models":{"gpt-4.1":{"requests_per_minute":1,"burst":2}}}"#).unwrap()
    }

    fn take(model: &str, id: u64) -> Op {
        take_of(model, id, 10, 1000)
    }

    fn take_of(model: &str, id: u64, estimate: u64, hold_ms: u64) -> Op {
        let (class, tenant, waits) = (Class::Standard, 0, false);
        Op::Take { model: model.into(), id, estimate, hold_ms, class, tenant, waits }
    }

    fn take_json(id: u64) -> Vec<u8> {
        take("gpt-4.1", id).to_json()
    }

    #[test]
    fn a_model_owner_admits_up_to_the_burst_for_every_node_together() {
        let (s, c) = (MemStore::default(), config());
        assert!(serve(&s, &c, &take_json(1), 0).unwrap().admitted);
        assert!(serve(&s, &c, &take_json(2), 0).unwrap().admitted);
        let third = serve(&s, &c, &take_json(3), 0).unwrap();
        assert!(!third.admitted);
        assert_eq!(third.result().unwrap_err().kind, Kind::Requests);
        assert_eq!(third.result().unwrap_err().wait_ms, Some(60_000));
    }

    #[test]
    fn a_settlement_takes_the_streams_retries_and_reads_as_before_without_them() {
        let (s, c) = (MemStore::default(), config());
        assert!(serve(&s, &c, &take_json(1), 0).unwrap().admitted);
        let settle = |retries| Op::Settle {
            model: "gpt-4.1".into(),
            id: 1,
            estimate: 10,
            actual: Some(10),
            hints: ProviderHints::default(),
            retries,
        };
        assert!(
            !String::from_utf8(settle(0).to_json()).unwrap().contains("retries"),
            "as the previous release sends it"
        );
        let before = Op::parse(
            br#"{"settle":{"model":"gpt-4.1","id":1,"estimate":10,"actual":10,"hints":{"throttled":false}}}"#,
        )
        .unwrap();
        assert_eq!(before, settle(0));
        assert!(serve(&s, &c, &settle(1).to_json(), 0).unwrap().admitted);
        // A burst of 2: one for the call, one for its retry; none left.
        assert!(!serve(&s, &c, &take_json(2), 0).unwrap().admitted);
    }

    #[test]
    fn a_take_of_the_previous_release_holds_no_place_and_a_new_one_carries_its_class() {
        let before: Op = Op::parse(br#"{"take":{"model":"gpt-4.1","id":1,"estimate":10,"hold_ms":1000}}"#).unwrap();
        assert_eq!(before, take("gpt-4.1", 1));
        assert_eq!(
            String::from_utf8(take_json(1)).unwrap(),
            r#"{"take":{"model":"gpt-4.1","id":1,"estimate":10,"hold_ms":1000}}"#
        );
        let (class, tenant, waits) = (Class::Critical, 7, true);
        let critical = Op::Take { model: "gpt-4.1".into(), id: 1, estimate: 10, hold_ms: 1000, class, tenant, waits };
        assert_eq!(Op::parse(&critical.to_json()).unwrap(), critical);
    }

    #[test]
    fn a_model_owner_orders_every_nodes_waiting_calls_by_class() {
        let c = Config::parse(br#"{"models":{"m":{"max_in_flight":1}}}"#).unwrap();
        let s = MemStore::default();
        let take = |id: u64, class: Class, tenant: u64| {
            let op = Op::Take { model: "m".into(), id, estimate: 1, hold_ms: 60_000, class, tenant, waits: true };
            serve(&s, &c, &op.to_json(), 0).unwrap().admitted
        };
        assert!(take(1, Class::Standard, 1));
        assert!(!take(2, Class::Sheddable, 1), "node A's sheddable call waits");
        assert!(!take(3, Class::Critical, 2), "node B's critical call waits");
        let settle = Op::Settle {
            model: "m".into(),
            id: 1,
            estimate: 1,
            actual: None,
            hints: ProviderHints::default(),
            retries: 0,
        };
        assert!(serve(&s, &c, &settle.to_json(), 0).unwrap().admitted);
        assert!(!take(2, Class::Sheddable, 1), "it asked first, but the critical call is ahead");
        assert!(take(3, Class::Critical, 2));
    }

    #[test]
    fn every_message_is_written_byte_for_byte_as_the_previous_release_wrote_it() {
        // What the previous release's serde-derived writer sent for these values.
        let hints = ProviderHints {
            remaining_requests: Some(12.0),
            remaining_tokens: Some(0.5),
            throttled: true,
            retry_after_ms: Some(1500),
            ..ProviderHints::default()
        };
        let settlement = |release, at| Settlement {
            tenant: "acme".into(),
            id: 3,
            estimate: 4,
            tokens: 5,
            micro: 6,
            hold: Hold::at(7, at),
            release,
        };
        let take = |model: &str, class, tenant, waits| Op::Take {
            model: model.into(),
            id: 7,
            estimate: 10,
            hold_ms: 1000,
            class,
            tenant,
            waits,
        };
        let settle =
            |actual, hints, retries| Op::Settle { model: "m".into(), id: 1, estimate: 10, actual, hints, retries };
        let ops = [
            (
                take("gpt-\"4.1\"", Class::Standard, 0, false),
                r#"{"take":{"model":"gpt-\"4.1\"","id":7,"estimate":10,"hold_ms":1000}}"#,
            ),
            (
                take("m", Class::Sheddable, 99, true),
                r#"{"take":{"model":"m","id":7,"estimate":10,"hold_ms":1000,"class":"sheddable","tenant":99,"waits":true}}"#,
            ),
            (
                settle(None, ProviderHints::default(), 0),
                r#"{"settle":{"model":"m","id":1,"estimate":10,"actual":null,"hints":{"remaining_requests":null,"remaining_tokens":null,"throttled":false,"retry_after_ms":null}}}"#,
            ),
            (
                settle(Some(9), hints, 2),
                r#"{"settle":{"model":"m","id":1,"estimate":10,"actual":9,"hints":{"remaining_requests":12.0,"remaining_tokens":0.5,"throttled":true,"retry_after_ms":1500},"retries":2}}"#,
            ),
            (
                Op::TenantTake(Ask { tenant: "acme".into(), id: 3, estimate: 4, worst_micro: 5, hold_ms: 6 }),
                r#"{"tenant_take":{"tenant":"acme","id":3,"estimate":4,"worst_micro":5,"hold_ms":6}}"#,
            ),
            (
                Op::TenantSettle(settlement(false, 86_400_000 * 40)),
                r#"{"tenant_settle":{"tenant":"acme","id":3,"estimate":4,"tokens":5,"micro":6,"hold":{"micro":7,"day":40,"month":23641},"release":false}}"#,
            ),
            (
                Op::TenantSettle(settlement(true, 0)),
                r#"{"tenant_settle":{"tenant":"acme","id":3,"estimate":4,"tokens":5,"micro":6,"hold":{"micro":7,"day":0,"month":23640},"release":true}}"#,
            ),
        ];
        for (op, wire) in ops {
            assert_eq!(String::from_utf8(op.to_json()).unwrap(), wire);
            assert_eq!(Op::parse(wire.as_bytes()).unwrap(), op, "{wire}");
        }
        let denial = |kind, wait_ms, ahead| Some(Denial { kind, wait_ms, ahead });
        let verdicts = [
            (Verdict { admitted: true, denial: None, hold: None }, r#"{"admitted":true,"denial":null}"#),
            (
                Verdict { admitted: false, denial: denial(Kind::QueueFull, Some(5), 3), hold: Some(Hold::at(1, 0)) },
                r#"{"admitted":false,"denial":{"kind":"queue_full","wait_ms":5,"ahead":3},"hold":{"micro":1,"day":0,"month":23640}}"#,
            ),
            (
                Verdict { admitted: false, denial: denial(Kind::QuotaDay, None, 0), hold: None },
                r#"{"admitted":false,"denial":{"kind":"quota_day","wait_ms":null}}"#,
            ),
        ];
        for (v, wire) in verdicts {
            assert_eq!(String::from_utf8(v.to_json()).unwrap(), wire);
            assert_eq!(Verdict::parse(wire.as_bytes()), Some(v), "{wire}");
        }
    }

    #[test]
    fn a_message_that_is_not_one_operation_is_refused() {
        let take = r#""take":{"model":"m","id":7,"estimate":10,"hold_ms":1000}"#;
        for bad in [
            format!("{{{take},{take}}}"),
            r#"{"take":{"model":"m","id":7,"estimate":10,"hold_ms":1000,"extra":1}}"#.to_owned(),
            r#"{"take":{"model":"m","id":7,"estimate":10,"hold_ms":1000,"id":8}}"#.to_owned(),
            r#"{"take":{"model":"m","id":-7,"estimate":10,"hold_ms":1000}}"#.to_owned(),
            r#"{"take":{"model":"m","id":7,"estimate":10,"hold_ms":1000,"class":"Critical"}}"#.to_owned(),
            r#"{"steal":{}}"#.to_owned(),
            format!(r#"{{{take},"\ud800":0}}"#),
            r#"["take"]"#.to_owned(),
            format!("{{{take}}} trailing"),
        ] {
            assert!(Op::parse(bad.as_bytes()).is_err(), "{bad}");
        }
        assert!(Op::parse(format!(" {{ {take} }} ").as_bytes()).is_ok());
    }

    #[test]
    fn a_verdict_survives_the_wire() {
        let (s, c) = (MemStore::default(), config());
        for id in 1..=3 {
            let v = serve(&s, &c, &take_json(id), 0).unwrap();
            let wire = v.to_json();
            assert_eq!(Verdict::parse(&wire), Some(v));
        }
    }

    #[test]
    fn a_settle_reports_the_providers_hold_capped_by_the_configuration() {
        let c =
            Config::parse(br#"{"models":{"m":{"requests_per_minute":60}},"rate_limit":{"max_provider_hold_ms":1000}}"#)
                .unwrap();
        let s = MemStore::default();
        let hints = ProviderHints { throttled: true, retry_after_ms: Some(86_400_000), ..Default::default() };
        let op = Op::Settle { model: "m".into(), id: 1, estimate: 1, actual: None, hints, retries: 0 };
        assert!(serve(&s, &c, &op.to_json(), 0).unwrap().admitted);
        let refused = serve(&s, &c, &take_of("m", 2, 1, 1).to_json(), 0);
        let wait = refused.unwrap().result().unwrap_err().wait_ms.unwrap();
        assert!(wait <= 2_000, "held {wait} ms, not a day");
    }

    #[test]
    fn garbage_is_refused_and_unlisted_models_are_unlimited() {
        let (s, c) = (MemStore::default(), config());
        assert_eq!(serve(&s, &c, b"{\"op\":\"steal\"}", 0).unwrap_err().status, 400);
        let other = take_of("deepseek-v3", 1, 1, 1).to_json();
        assert!(serve(&s, &c, &other, 0).unwrap().admitted);
    }

    #[test]
    fn the_secret_must_match_exactly_and_exist() {
        assert!(secret_matches(Some("s3cret"), Some("s3cret")));
        assert!(!secret_matches(Some("s3cret"), Some("s3cres")));
        assert!(!secret_matches(Some("s3cret"), Some("s3cret ")));
        assert!(!secret_matches(Some("s3cret"), None));
        assert!(!secret_matches(None, Some("")));
        assert!(!secret_matches(Some(""), Some("")));
    }

    #[test]
    fn a_model_owner_learns_the_limit_a_key_owner_heard_for_the_whole_fleet() {
        let c = Config::parse(br#"{"models":{"gpt-4.1":{"requests_per_minute":600,"burst":600}}}"#).unwrap();
        let s = MemStore::default();
        assert!(serve(&s, &c, &take_json(1), 0).unwrap().admitted);
        // HolySheep told the key owner its limit is 2 a minute.
        let hints = ProviderHints { limit_requests: Some(2.0), remaining_requests: Some(1.0), ..Default::default() };
        let settle = Op::Settle { model: "gpt-4.1".into(), id: 1, estimate: 10, actual: Some(10), hints, retries: 0 };
        let json = settle.to_json();
        assert_eq!(Op::parse(&json).unwrap(), settle, "the settlement carries the limit");
        assert!(serve(&s, &c, &json, 10).unwrap().admitted);
        // The owner's bucket now holds every node to what is left of HolySheep's 2.
        assert!(serve(&s, &c, &take_json(2), 20).unwrap().admitted);
        let refused = serve(&s, &c, &take_json(3), 30).unwrap();
        assert!(!refused.admitted, "the fleet's third call in a minute waits for HolySheep's limit");
        // An earlier release's settlement (no limits) still reads, and an absurd limit is
        // left out rather than losing what the call cost.
        let absurd = br#"{"settle":{"model":"gpt-4.1","id":2,"estimate":10,"actual":10,"hints":{"throttled":false,"limit_requests":-5,"limit_tokens":"x"}}}"#;
        let Op::Settle { hints, actual, .. } = Op::parse(absurd).unwrap() else { panic!("a settle") };
        assert_eq!((hints.limit_requests, hints.limit_tokens, actual), (None, None, Some(10)));
    }
}
