//! Tenants: the callers an edge knows by their keys. A tenant's bearer tokens are
//! configured only as SHA-256 digests; a request's token is hashed and its digest looked
//! up among them (`Keys::verify` says why that leaks nothing), once per worker and token. The verified tenant's name is then the request's
//! cache scope, and its model list what it may call.

use crate::core::api::error::ApiError;
use crate::core::api::priority::Class;
use crate::core::api::priority::CLASSES;
use crate::core::config::named::Named;
use crate::core::config::read::{choice, flag, maybe, number, section, texts, whole, whole32, Read};
use crate::core::wire::digest::sha256;
use serde_json::Value;
use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

/// A tenant's caps, in micro-dollars (`None`: no cap for that period).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Caps {
    pub per_day: Option<u64>,
    pub per_month: Option<u64>,
}

impl Caps {
    pub fn is_none(&self) -> bool {
        self.per_day.is_none() && self.per_month.is_none()
    }

    /// One node's part of them, in a fleet of `nodes`.
    pub fn share(&self, nodes: u32) -> Caps {
        let part = |micro: Option<u64>| micro.map(|m| m / u64::from(nodes.max(1)));
        Caps { per_day: part(self.per_day), per_month: part(self.per_month) }
    }
}

/// The most tenants a configuration may name: per-tenant state (shared-data keys and
/// counters) is bounded by it.
pub(crate) const MAX_TENANTS: usize = 1024;
/// The most keys one tenant may have (rotation needs two).
pub(crate) const MAX_KEYS: usize = 16;

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tenant {
    /// SHA-256 digests (64 hex digits) of the tenant's bearer tokens.
    pub keys_sha256: Vec<String>,
    /// The models the tenant may call (`None`: any).
    pub models: Option<Vec<String>>,
    /// The tenant's own request and token buckets, beside each model's.
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    /// Request-bucket capacity; defaults to `requests_per_minute`.
    pub burst: Option<u32>,
    /// Dollars the tenant's upstream calls may cost per UTC day and per UTC month.
    pub usd_per_day: Option<f64>,
    pub usd_per_month: Option<f64>,
    /// The class of the tenant's requests (`standard` by default); a request may lower it.
    pub priority: Class,
    /// The edge sets a `prompt_cache_key` on the tenant's calls that carry none
    /// (`Config::affinity`).
    pub prompt_cache_affinity: bool,
}

impl Tenant {
    /// `tenants.<name>`, its fields over the defaults.
    pub(crate) fn read(path: &str, v: &Value) -> Read<Tenant> {
        let classes = CLASSES.map(|c| (c.as_str(), c));
        section(path, v, |t: &mut Tenant, name, v, p| {
            match name {
                "keys_sha256" => t.keys_sha256 = texts(p, v)?,
                "models" => t.models = maybe(p, v, texts)?,
                "requests_per_minute" => t.requests_per_minute = maybe(p, v, whole32)?,
                "tokens_per_minute" => t.tokens_per_minute = maybe(p, v, whole)?,
                "burst" => t.burst = maybe(p, v, whole32)?,
                "usd_per_day" => t.usd_per_day = maybe(p, v, number)?,
                "usd_per_month" => t.usd_per_month = maybe(p, v, number)?,
                "priority" => t.priority = choice(p, v, &classes)?,
                "prompt_cache_affinity" => t.prompt_cache_affinity = flag(p, v)?,
                _ => return Ok(false),
            }
            Ok(true)
        })
    }

    /// The dollar caps, in micro-dollars.
    pub fn caps(&self) -> Caps {
        let micro = |usd: Option<f64>| usd.map(|d| (d * 1e6).round() as u64);
        Caps { per_day: micro(self.usd_per_day), per_month: micro(self.usd_per_month) }
    }

    /// Whether the tenant has limits of its own (buckets or budgets).
    pub(crate) fn is_limited(&self) -> bool {
        self.requests_per_minute.is_some() || self.tokens_per_minute.is_some() || !self.caps().is_none()
    }

    /// Whether the tenant may call `model`.
    pub(crate) fn allows(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.iter().any(|a| a == model))
    }
}

/// Every configured digest with the tenant it belongs to, read once from the
/// configuration, and the tokens verified against them already.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Keys {
    /// Each configured digest, and the tenant it names, sorted by digest.
    digests: Vec<([u8; 32], String)>,
    known: Known,
    /// Every request must carry a tenant's key, even with no tenant listed (a table kept
    /// in the spend store, which may be empty: it never opens the edge).
    required: bool,
}

/// The tokens this worker (or instance) verified already, so that a tenant's next request
/// skips SHA-256 (one block of it is most of what verifying adds to a HIT). A token is kept
/// as a 128-bit SipHash of it, never as itself, and only once a configured digest matched
/// it: a token no tenant holds is hashed every time and cannot fill this. Passing for a
/// kept token takes another whose hash is the same, and finding one needs that hash, which
/// needs the token (the hash is also keyed with the configured digests, which a client does
/// not know). At most one entry per configured digest; a new configuration starts with
/// none, so a key taken out of it stops working at once. (No random key: the component's
/// hosts need not offer WASI's random seed, and the argument above does not rest on one.)
#[derive(Default)]
struct Known {
    /// SHA-256 of every configured digest, in order.
    secret: [u8; 32],
    /// Tokens' hashes, each with the index of its digest in `Keys::digests`, sorted.
    tags: Mutex<Vec<(u128, usize)>>,
}

impl Known {
    fn of(digests: &[([u8; 32], String)]) -> Known {
        let secret = sha256(digests.iter().flat_map(|(d, _)| d.iter().copied()).collect());
        Known { secret, tags: Mutex::default() }
    }

    fn tag(&self, token: &str) -> u128 {
        let half = |domain: u8| {
            let mut h = DefaultHasher::new();
            (self.secret, domain, token).hash(&mut h);
            u128::from(h.finish())
        };
        half(0) << 64 | half(1)
    }

    fn get(&self, tag: u128) -> Option<usize> {
        let tags = self.tags.try_lock().ok()?;
        tags.binary_search_by_key(&tag, |(t, _)| *t).ok().and_then(|at| tags.get(at)).map(|(_, index)| *index)
    }

    /// Remembers `tag` as the digest at `index`, while fewer than `bound` are kept.
    fn keep(&self, tag: u128, index: usize, bound: usize) {
        if let Ok(mut tags) = self.tags.try_lock() {
            if let Err(at) = tags.binary_search_by_key(&tag, |(t, _)| *t) {
                if tags.len() < bound {
                    tags.insert(at, (tag, index));
                }
            }
        }
    }
}

/// A copy of the configuration verifies its tokens anew.
impl Clone for Known {
    fn clone(&self) -> Known {
        Known { secret: self.secret, tags: Mutex::default() }
    }
}

/// What was verified already is no part of what a configuration says.
impl PartialEq for Known {
    fn eq(&self, _: &Known) -> bool {
        true
    }
}

impl std::fmt::Debug for Known {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Known({} tokens)", self.tags.try_lock().map_or(0, |t| t.len()))
    }
}

impl Keys {
    /// Checks the tenants' configuration and collects their digests.
    pub fn of(tenants: &Named<Tenant>) -> Result<Keys, String> {
        if tenants.len() > MAX_TENANTS {
            return Err(format!("tenants: at most {MAX_TENANTS} entries"));
        }
        let mut digests: BTreeMap<[u8; 32], String> = BTreeMap::new();
        for (name, tenant) in tenants {
            let field = |f: &str| format!("tenants.{name}.{f}");
            if !valid_name(name) {
                return Err(format!(
                    "tenants.{}: a name is 1 to 64 of a-z, A-Z, 0-9, '-' and '_'",
                    name.chars().take(64).collect::<String>()
                ));
            }
            // Prometheus names turn '-' into '_' (and are compared as written): two
            // tenants must not share one.
            let stat = |n: &str| n.to_ascii_lowercase().replace('-', "_");
            if let Some(other) = tenants.keys().find(|o| *o != name && stat(o) == stat(name)) {
                return Err(format!("tenants.{name}: its counters would be {other}'s"));
            }
            if !(1..=MAX_KEYS).contains(&tenant.keys_sha256.len()) {
                return Err(format!("{}: between 1 and {MAX_KEYS} digests", field("keys_sha256")));
            }
            let counts = [
                ("requests_per_minute", tenant.requests_per_minute.map(u64::from)),
                ("tokens_per_minute", tenant.tokens_per_minute),
                ("burst", tenant.burst.map(u64::from)),
            ];
            if let Some((f, _)) = counts.iter().find(|(_, v)| *v == Some(0)) {
                return Err(format!("{}: must be at least 1", field(f)));
            }
            for (f, usd) in [("usd_per_day", tenant.usd_per_day), ("usd_per_month", tenant.usd_per_month)] {
                if usd.is_some_and(|d| !d.is_finite() || !(0.0..=1e9).contains(&d)) {
                    return Err(format!("{}: dollars, between 0 and 1000000000", field(f)));
                }
            }
            if tenant.models.as_ref().is_some_and(|m| m.is_empty() || m.iter().any(String::is_empty)) {
                return Err(format!("{}: model names, at least one", field("models")));
            }
            for hex in &tenant.keys_sha256 {
                let Some(digest) = digest_of_hex(hex) else {
                    return Err(format!(
                        "{}: each is a SHA-256 digest, 64 hex digits (the token itself never goes here)",
                        field("keys_sha256")
                    ));
                };
                if digests.insert(digest, name.clone()).is_some() {
                    return Err(format!("{}: a digest appears twice", field("keys_sha256")));
                }
            }
        }
        let digests: Vec<([u8; 32], String)> = digests.into_iter().collect();
        Ok(Keys { known: Known::of(&digests), digests, required: false })
    }

    /// With a tenant's key required of every request (`required`), even with none listed.
    pub fn required(self, required: bool) -> Keys {
        Keys { required, ..self }
    }

    /// No tenant is configured, nor required: requests are not held to tenants' keys.
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty() && !self.required
    }

    /// The tenant whose key `authorization` (`Bearer <token>`) carries: a token verified
    /// before is found by its hash (`Known`); any other is hashed with SHA-256 and its
    /// digest looked up among the configured ones, one hash and a binary search whatever the
    /// number of tenants. The search's time depends only on how the guess's digest compares
    /// with the stored ones, and SHA-256 being preimage-resistant, knowing that tells nothing
    /// of any token that has a stored digest; whether a token was found by its hash
    /// tells its sender only that it holds a valid key, which a 200 tells as well.
    pub fn verify(&self, authorization: Option<&str>) -> Result<&str, ApiError> {
        let token = authorization.and_then(bearer_token).ok_or_else(ApiError::invalid_api_key)?;
        let tag = self.known.tag(token);
        let index = match self.known.get(tag) {
            Some(index) => index,
            None => {
                let digest = sha256(token.as_bytes().to_vec());
                let index =
                    self.digests.binary_search_by(|(d, _)| d.cmp(&digest)).map_err(|_| ApiError::invalid_api_key())?;
                self.known.keep(tag, index, self.digests.len());
                index
            }
        };
        self.digests.get(index).map(|(_, tenant)| tenant.as_str()).ok_or_else(ApiError::invalid_api_key)
    }
}

/// The token of `Bearer <token>` (the scheme in any case, RFC 7235).
fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

fn digest_of_hex(hex: &str) -> Option<[u8; 32]> {
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut digest = [0; 32];
    for (out, pair) in digest.iter_mut().zip(bytes.chunks_exact(2)) {
        let digit = |b: u8| char::from(b).to_digit(16);
        *out = u8::try_from(digit(pair[0])? * 16 + digit(pair[1])?).ok()?;
    }
    Some(digest)
}

/// Whether `name` may name a tenant: 1 to 64 of a-z, A-Z, 0-9, '-' and '_' (it goes into
/// metric names).
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
}

/// OpenAI's 404 for a model the caller may not use.
pub(crate) fn model_not_found(model: &str) -> ApiError {
    let model: String = model.chars().take(128).collect();
    ApiError {
        status: 404,
        message: format!("The model `{model}` does not exist or you do not have access to it."),
        kind: "invalid_request_error",
        param: Some("model".into()),
        code: "model_not_found",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex_of(token: &str) -> String {
        sha256(token.as_bytes().to_vec()).iter().map(|b| format!("{b:02x}")).collect()
    }

    fn tenants(pairs: &[(&str, &[&str])]) -> Named<Tenant> {
        pairs
            .iter()
            .map(|(name, tokens)| {
                let keys_sha256 = tokens.iter().map(|t| hex_of(t)).collect();
                (name.to_string(), Tenant { keys_sha256, ..Tenant::default() })
            })
            .collect()
    }

    #[test]
    fn a_token_is_known_by_its_digest_only() {
        let keys = Keys::of(&tenants(&[("search", &["s-old", "s-new"]), ("batch", &["b-1"])])).unwrap();
        assert_eq!(keys.verify(Some("Bearer s-old")), Ok("search"));
        assert_eq!(keys.verify(Some("bearer  s-new ")), Ok("search"), "the scheme in any case");
        assert_eq!(keys.verify(Some("Bearer b-1")), Ok("batch"));
        for refused in [None, Some(""), Some("Bearer "), Some("Bearer s-ol"), Some("Basic s-old"), Some("s-old")] {
            let e = keys.verify(refused).unwrap_err();
            assert_eq!((e.status, e.code), (401, "invalid_api_key"), "{refused:?}");
            assert!(!e.message.contains("s-ol"), "the token is never quoted");
        }
        let upper = hex_of("u").to_uppercase();
        let keys = Keys::of(&Named::from([("u".into(), Tenant { keys_sha256: vec![upper], ..Tenant::default() })]));
        assert_eq!(keys.unwrap().verify(Some("Bearer u")), Ok("u"), "hex in either case");
    }

    #[test]
    fn a_token_is_hashed_once_per_configuration_and_only_when_valid() {
        let keys = Keys::of(&tenants(&[("search", &["s-old", "s-new"]), ("batch", &["b-1"])])).unwrap();
        let known = |k: &Keys| k.known.tags.try_lock().map(|t| t.len()).unwrap();
        for _ in 0..3 {
            assert_eq!(keys.verify(Some("Bearer s-old")), Ok("search"));
            assert_eq!(keys.verify(Some("Bearer b-1")), Ok("batch"));
        }
        assert_eq!(known(&keys), 2, "one entry per token, kept after its first verification");
        // Known again in another spelling of the header: the token is what is kept.
        assert_eq!(keys.verify(Some("bearer  b-1 ")), Ok("batch"));
        for n in 0..100 {
            assert!(keys.verify(Some(&format!("Bearer guess-{n}"))).is_err());
        }
        assert!(keys.verify(Some("Bearer s-ol")).is_err(), "a prefix of a known token");
        assert_eq!(known(&keys), 2, "a token no tenant holds is not kept");
        assert_eq!(keys.verify(Some("Bearer s-new")), Ok("search"));
        assert_eq!(known(&keys), 3, "at most one per configured digest");

        // The next configuration (its own copy, or one read anew) starts with nothing
        // known: a key taken out of it is refused at once.
        assert_eq!(known(&keys.clone()), 0);
        let next = Keys::of(&tenants(&[("search", &["s-new"]), ("batch", &["b-1"])])).unwrap();
        assert!(next.verify(Some("Bearer s-old")).is_err());
        assert_eq!(next.verify(Some("Bearer s-new")), Ok("search"));
    }

    #[test]
    fn the_tenants_configuration_is_checked() {
        let refused = |t: Named<Tenant>| Keys::of(&t).unwrap_err();
        assert!(refused(tenants(&[("a b", &["x"])])).starts_with("tenants.a b:"));
        assert!(refused(tenants(&[("a.b", &["x"])])).starts_with("tenants.a.b:"), "a dot would split its counters");
        assert!(refused(tenants(&[("a-b", &["x"]), ("a_b", &["y"])])).contains("counters would be"));
        assert!(refused(tenants(&[("a", &[])])).starts_with("tenants.a.keys_sha256:"));
        assert!(refused(tenants(&[("a", &["x"]), ("b", &["x"])])).contains("twice"));
        let clear =
            Named::from([("a".into(), Tenant { keys_sha256: vec!["sk-live-123".into()], ..Tenant::default() })]);
        assert!(refused(clear).contains("never goes here"));
        let no_models = Named::from([(
            "a".into(),
            Tenant { keys_sha256: vec![hex_of("x")], models: Some(Vec::new()), ..Tenant::default() },
        )]);
        assert!(refused(no_models).starts_with("tenants.a.models:"));
        assert!(Keys::of(&Named::default()).unwrap().is_empty());
    }

    #[test]
    fn a_tenant_may_call_its_models_only() {
        let t = Tenant { models: Some(vec!["gpt-4.1".into()]), ..Tenant::default() };
        assert!(t.allows("gpt-4.1") && !t.allows("deepseek-v3"));
        assert!(Tenant::default().allows("anything"));
        let e = model_not_found("deepseek-v3");
        assert_eq!((e.status, e.code, e.param.as_deref()), (404, "model_not_found", Some("model")));
    }
}
