//! The edge tier: what an owner declares about the answers it serves, and what a forward
//! node keeps of them. Every governed answer says how long it stays fresh in the cache that
//! served or stored it (`cache-control: max-age=N`, or `no-store`); a forward node keeps
//! the answers its owner declared so, as near copies, for at most that long and at most
//! `edge.max_age_seconds`, like any layered HTTP cache.

use crate::core::api::headers;
use crate::core::api::key::Key;
use crate::core::cache::Fresh;
use crate::core::config::{Config, MAX_SECONDS};
use crate::core::request::CacheControl;

pub const EDGE: &str = "edge";
pub const OWNER: &str = "owner";

/// An owner's response headers a forward node keeps with its answer: they are replayed to
/// the requests that share it (the model that answered, a paraphrase's similarity, and
/// what a 429 says of its class and when to come back).
const KEPT: [&str; 5] = [headers::MODEL, headers::SIMILARITY, headers::RETRY_AFTER, headers::PRIORITY, headers::SHED];

/// The headers of an owner's answer a forward node keeps (see `KEPT`).
pub fn kept(headers: &[(String, String)]) -> Vec<(String, String)> {
    headers.iter().filter(|(n, _)| KEPT.iter().any(|k| n.eq_ignore_ascii_case(k))).cloned().collect()
}

/// Whether the owner keyed the request as this forward node did (`key`), by the answer's
/// `x-holysheep-key`: `None` when the answer names no key (Envoy's own 503 or 504, or an
/// owner's refusal before it keyed anything). An answer keyed otherwise is never shared
/// with the flight's waiters: an owner whose configuration scopes or keys requests
/// otherwise (another `cache.tenant_header`, say) may have answered for another tenant's
/// scope.
pub fn keyed_alike(key: &Key, headers: &[(String, String)]) -> Option<bool> {
    Some(headers::value(headers, headers::KEY)? == key.hex())
}

/// Whether a hop's answer (`status`, keyed alike or not as `keyed_alike` says) goes to the
/// flight's waiters: one keyed alike, or an error that names no key (the owner
/// unreachable, or refusing before it keyed anything: each waiter would meet the same),
/// never one keyed otherwise nor an unkeyed 200.
pub fn shared_with_waiters(keyed_alike: Option<bool>, status: u16) -> bool {
    keyed_alike.unwrap_or(status != 200)
}

/// When an owner produced the answer a hop brought back (its `age` before `now_ms`, capped
/// at a year), whether it was older than the hop (an `age` of a second or more: a HIT, or
/// a flight it joined) and whether it served it STALE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    pub produced_ms: u64,
    pub aged: bool,
    pub stale: bool,
}

impl Origin {
    pub fn of(pairs: &[(String, String)], now_ms: u64) -> Origin {
        let header = |name: &str| headers::value(pairs, name);
        let age_s = header(headers::AGE).and_then(|a| a.trim().parse::<u64>().ok()).unwrap_or(0).min(MAX_SECONDS);
        Origin {
            produced_ms: now_ms.saturating_sub(age_s.saturating_mul(1000)),
            aged: age_s > 0,
            stale: header(headers::CACHE) == Some("STALE"),
        }
    }
}

/// How long a forward node may keep the owner's answer to the request keyed `key`, from
/// the answer's headers (`None`: not at all). Only a 200 that the owner served as a cached
/// answer for exactly this key (its own `x-holysheep-key` and cache status) and declared
/// fresh for some seconds more is kept: for the seconds it declared, at most
/// `edge.max_age_seconds`. Its `age` dates the copy back to when the owner produced it
/// (capped at a year, the longest any cache keeps an answer).
pub fn declared(config: &Config, key: &Key, status: u16, headers: &[(String, String)], now_ms: u64) -> Option<Fresh> {
    let header = |name: &str| headers::value(headers, name);
    let served = ["HIT", "MISS", "COALESCED"].map(Some).contains(&header(headers::CACHE));
    if status != 200 || !served || header(headers::KEY) != Some(key.hex()) {
        return None;
    }
    let cc = CacheControl::parse(header(headers::CACHE_CONTROL));
    if cc.no_store || cc.no_cache {
        return None;
    }
    let resident_s = cc.max_age?.min(config.edge.max_age_seconds);
    if resident_s == 0 {
        return None;
    }
    let stored_at_ms = Origin::of(headers, now_ms).produced_ms;
    let age_ms = now_ms.saturating_sub(stored_at_ms);
    Some(Fresh { stored_at_ms, ttl_ms: age_ms.saturating_add(resident_s.saturating_mul(1000)) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::request::request_key;

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect()
    }

    fn owner(key: &Key, cache: &str, cc: &str, age: Option<&str>) -> Vec<(String, String)> {
        let mut h = headers(&[("x-holysheep-key", key.hex()), ("x-holysheep-cache", cache), ("cache-control", cc)]);
        h.extend(age.map(|a| ("age".to_owned(), a.to_owned())));
        h
    }

    #[test]
    fn a_copy_lives_for_what_the_owner_declared_at_most_the_edges_bound() {
        let c = Config::parse(br#"{"role":"forward","edge":{"max_age_seconds":60}}"#).unwrap();
        let k = request_key("/p", "s", b"1");
        let f = declared(&c, &k, 200, &owner(&k, "MISS", "max-age=600", None), 10_000).unwrap();
        assert_eq!((f.stored_at_ms, f.expires_ms()), (10_000, 70_000), "the edge's bound");
        let f = declared(&c, &k, 200, &owner(&k, "HIT", "max-age=7", Some("593")), 1_000_000).unwrap();
        assert_eq!((f.stored_at_ms, f.expires_ms()), (407_000, 1_007_000), "the owner's rest, dated back by age");
        assert_eq!(declared(&c, &k, 200, &owner(&k, "HIT", "max-age=0", Some("600")), 1_000_000), None);
    }

    #[test]
    fn only_an_answer_keyed_alike_is_shared() {
        let (k, other) = (request_key("/p", "s", b"1"), request_key("/p", "s", b"2"));
        assert_eq!(keyed_alike(&k, &owner(&k, "MISS", "no-store", None)), Some(true));
        assert_eq!(keyed_alike(&k, &owner(&other, "MISS", "max-age=60", None)), Some(false), "another scope");
        assert_eq!(keyed_alike(&k, &headers(&[("X-HolySheep-Key", k.hex())])), Some(true), "any case");
        assert_eq!(keyed_alike(&k, &headers(&[("content-type", "application/json")])), None, "not keyed");
        let unkeyed = keyed_alike(&k, &headers(&[("content-type", "application/json")]));
        assert!(shared_with_waiters(unkeyed, 503), "Envoy's own 503: every waiter would meet it");
        assert!(!shared_with_waiters(unkeyed, 200), "an unkeyed 200 is no owner's answer");
        let otherwise = keyed_alike(&k, &owner(&other, "MISS", "no-store", None));
        assert!(!shared_with_waiters(otherwise, 404), "keyed otherwise");
    }

    #[test]
    fn nothing_else_is_kept() {
        let c = Config::parse(br#"{"role":"forward"}"#).unwrap();
        let (k, other) = (request_key("/p", "s", b"1"), request_key("/p", "s", b"2"));
        for (status, h) in [
            (200, owner(&k, "MISS", "no-store", None)),
            (200, owner(&k, "MISS", "max-age=60, no-cache", None)),
            (200, owner(&k, "BYPASS", "max-age=60", None)),
            (200, owner(&k, "STALE", "max-age=60", None)),
            (200, owner(&other, "MISS", "max-age=60", None)),
            (200, headers(&[("cache-control", "max-age=60")])),
            (429, owner(&k, "MISS", "max-age=60", None)),
            (200, owner(&k, "MISS", "public", None)),
        ] {
            assert_eq!(declared(&c, &k, status, &h, 0), None, "{status} {h:?}");
        }
        let off = Config::parse(br#"{"role":"forward","edge":{"max_age_seconds":0}}"#).unwrap();
        assert_eq!(declared(&off, &k, 200, &owner(&k, "MISS", "max-age=60", None), 0), None, "near copies off");
    }

    #[test]
    fn a_copy_keeps_the_headers_its_sharers_need() {
        let h = headers(&[
            ("x-holysheep-model", "gpt-4.1"),
            ("retry-after", "3"),
            ("x-holysheep-priority", "sheddable"),
            ("set-cookie", "x"),
            ("x-holysheep-owner", "n1"),
            ("cache-control", "max-age=60"),
        ]);
        let names: Vec<String> = kept(&h).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["x-holysheep-model", "retry-after", "x-holysheep-priority"]);
    }
}
