//! Everything that can refuse a call for what it would cost, behind one door
//! (`admission`): per-model token buckets in shared data (this module), the admission line of one bucket (`line`), tenants' dollar
//! budgets that reserve and settle (`budget`), the records of the spend store in etcd
//! (`budget_store`), a flight's hold on its tenant's own limits (`tenant_gate`) and the
//! operations a fleet's owner node serves for them (`fleet`). Uses `wire`, `api`, `store`
//! and `config`.
//!
//! Per-model token buckets in shared data, shared by every worker: a request bucket
//! (capacity `burst`, refilled at `requests_per_minute`) and a token bucket (capacity
//! `tokens_per_minute`, refilled per minute), plus the calls in flight for
//! `max_in_flight`. One key per configured model (unlisted models share `default`), updated
//! by compare-and-swap. Tokens are reserved from an estimate before a call and reconciled
//! with the answer's `usage`; the provider's own limit headers only ever lower the buckets.

pub mod admission;
pub mod budget;
pub mod budget_store;
pub mod embedding;
pub mod fleet;
pub mod learned;
pub mod line;
pub(crate) mod tenant_gate;

use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::config::{Config, Model, RateLimit};
use crate::core::limits::learned::Learned;
use crate::core::limits::line::{Full, Line, Who};
use crate::core::store::{cas_after, CasStore, StoreError, MAX_RACES};
use crate::core::wire::codec;
use crate::core::wire::scan::{self, Json};
use crate::core::wire::write::Object;

/// A model's configured limits (per minute; `req_per_ms`/`tok_per_ms` give the rates).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub rpm: Option<f64>,
    pub tpm: Option<f64>,
    pub burst: f64,
    pub max_in_flight: Option<usize>,
    /// The fraction of each bucket (and of the in-flight cap) kept for classes above
    /// `sheddable` (`rate_limit.reserve`).
    pub reserve: f64,
    /// The longest admission line (`rate_limit.max_queue`).
    pub max_line: usize,
    /// A bucket every caller shares (a model's): one call's usage beyond its estimate
    /// never drives it more than one estimate below empty (the caller's own tenant bucket
    /// takes the rest). A tenant's own bucket takes all of it.
    pub shared: bool,
    /// The nodes these limits are shared out among (1, but for a node's share of a fleet's
    /// limits): what HolySheep announces for the account is theirs to share alike.
    pub among: u32,
}

impl Limits {
    pub fn of(m: &Model, rules: &RateLimit) -> Limits {
        let rpm = m.requests_per_minute.map(f64::from);
        Limits {
            rpm,
            tpm: m.tokens_per_minute.map(|t| t as f64),
            burst: m.burst.map(f64::from).or(rpm).unwrap_or(1.0),
            max_in_flight: m.max_in_flight.map(|n| n as usize),
            reserve: rules.reserve,
            max_line: rules.max_queue,
            shared: true,
            among: 1,
        }
    }

    /// One node's share of the limits in a fleet of `nodes`: what a node admits on its own
    /// when the model's owner node cannot be reached (at least one request and one slot).
    pub fn share(&self, nodes: u32) -> Limits {
        let n = f64::from(nodes.max(1));
        Limits {
            rpm: self.rpm.map(|r| r / n),
            tpm: self.tpm.map(|t| t / n),
            burst: (self.burst / n).floor().max(1.0),
            max_in_flight: self.max_in_flight.map(|m| (m / nodes.max(1) as usize).max(1)),
            among: nodes.max(1),
            ..*self
        }
    }

    /// Whether nothing is limited (a model listed for its prices or fallbacks alone): its
    /// bucket would admit every call and hold nothing, so it is never read or written.
    pub(crate) fn unbounded(&self) -> bool {
        self.rpm.is_none() && self.tpm.is_none() && self.max_in_flight.is_none()
    }

    /// Whether a call of `estimate` tokens could ever be admitted: no more than the token
    /// bucket holds when full.
    pub(crate) fn fits(&self, estimate: u64) -> bool {
        self.tpm.is_none_or(|tpm| estimate as f64 <= tpm)
    }

    fn req_per_ms(&self) -> f64 {
        self.rpm.unwrap_or(0.0) / 60_000.0
    }

    fn tok_per_ms(&self) -> f64 {
        self.tpm.unwrap_or(0.0) / 60_000.0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Requests,
    Tokens,
    Concurrency,
    /// The bucket could not be read and written without losing every race: nothing was
    /// decided, look again at once.
    Contended,
    /// A tenant's dollar budget for the UTC day (or month) is spent.
    QuotaDay,
    QuotaMonth,
    /// A `sheddable` call would have taken from the bucket's reserve: refused at once.
    Shed,
    /// The admission line is full, and the call is of its lowest class.
    QueueFull,
    /// The call's token estimate is more than the bucket holds: it could never be admitted.
    TooLarge,
    /// A tenant's budget has room for the call only once its calls in flight settle.
    BudgetHeld,
    /// A tenant's spend store has never answered this node, and what the node admits
    /// meanwhile is used.
    StoreSilent,
    /// The spend store's cluster is none the host knows: nothing budgeted is admitted.
    StoreMissing,
}

impl Kind {
    const ALL: [Kind; 12] = [
        Kind::Requests,
        Kind::Tokens,
        Kind::Concurrency,
        Kind::Contended,
        Kind::QuotaDay,
        Kind::QuotaMonth,
        Kind::Shed,
        Kind::QueueFull,
        Kind::TooLarge,
        Kind::BudgetHeld,
        Kind::StoreSilent,
        Kind::StoreMissing,
    ];

    /// Its name in the fleet's messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Requests => "requests",
            Kind::Tokens => "tokens",
            Kind::Concurrency => "concurrency",
            Kind::Contended => "contended",
            Kind::QuotaDay => "quota_day",
            Kind::QuotaMonth => "quota_month",
            Kind::Shed => "shed",
            Kind::QueueFull => "queue_full",
            Kind::TooLarge => "too_large",
            Kind::BudgetHeld => "budget_held",
            Kind::StoreSilent => "store_silent",
            Kind::StoreMissing => "store_missing",
        }
    }

    fn named(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// OpenAI's error `type` for a rate-limit answer.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Requests
            | Kind::Concurrency
            | Kind::Contended
            | Kind::Shed
            | Kind::QueueFull
            | Kind::TooLarge
            | Kind::BudgetHeld => "requests",
            Kind::Tokens => "tokens",
            Kind::QuotaDay | Kind::QuotaMonth => "insufficient_quota",
            Kind::StoreSilent | Kind::StoreMissing => "server_error",
        }
    }
}

/// Why a bucket refused, and when it will have enough (`None`: when a call ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denial {
    pub kind: Kind,
    pub wait_ms: Option<u64>,
    /// The calls ahead of this one in the bucket's line (left out when none).
    pub ahead: u64,
}

impl Denial {
    pub fn of(kind: Kind, wait_ms: Option<u64>) -> Denial {
        Denial { kind, wait_ms, ahead: 0 }
    }

    /// As the fleet's messages write it.
    pub(crate) fn to_json(self) -> String {
        let o = Object::new().str("kind", self.kind.name()).opt_u64("wait_ms", self.wait_ms);
        if self.ahead == 0 { o } else { o.u64("ahead", self.ahead) }.finish()
    }

    pub(crate) fn read(json: Json<'_>) -> Option<Denial> {
        let [kind, wait_ms, ahead] = json.fields(["kind", "wait_ms", "ahead"])?;
        Some(Denial {
            kind: Kind::named(&kind?.as_str()?)?,
            wait_ms: scan::opt(wait_ms, Json::as_u64)?,
            ahead: scan::opt(ahead, Json::as_u64)?.unwrap_or(0),
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    pub requests: f64,
    pub tokens: f64,
    pub at_ms: u64,
    /// (nonce, expiry) of calls in flight; expiry bounds a call whose worker died.
    pub in_flight: Vec<(u64, u64)>,
    /// The calls waiting for this bucket, in the order they are admitted.
    pub line: Line,
    /// What HolySheep's headers taught (`learned`): every limit below is `l` lowered by it.
    pub learned: Learned,
}

impl Bucket {
    pub fn full(l: &Limits, now_ms: u64) -> Bucket {
        Bucket {
            requests: l.burst,
            tokens: l.tpm.unwrap_or(0.0),
            at_ms: now_ms,
            in_flight: Vec::new(),
            line: Line::default(),
            learned: Learned::default(),
        }
    }

    /// Adds what accrued since `at_ms`, at the rates learned where they are lower than
    /// `l`'s. A clock that went backwards adds nothing.
    pub(crate) fn refill(&mut self, l: &Limits, now_ms: u64) {
        self.learned.lapse(now_ms);
        let l = &self.learned.lower(l, now_ms);
        if now_ms > self.at_ms {
            let dt = (now_ms - self.at_ms) as f64;
            self.requests = (self.requests + dt * l.req_per_ms()).min(l.burst);
            self.tokens = (self.tokens + dt * l.tok_per_ms()).min(l.tpm.unwrap_or(0.0));
            self.at_ms = now_ms;
        }
        self.in_flight.retain(|(_, expires)| *expires > now_ms);
        self.line.lapse(now_ms);
    }

    /// Takes one request and `who.estimate` tokens for the call `who.id`, its slot held at
    /// most `hold_ms`, if the bucket has them after every call ahead of it in line (and,
    /// for a `sheddable` call, above the reserve). Otherwise a call that `waits` takes (or
    /// keeps) its place in line. Also says whether the bucket changed (must be written).
    pub fn take(
        &mut self,
        l: &Limits,
        who: &Who,
        now_ms: u64,
        hold_ms: u64,
        waits: bool,
    ) -> (Result<(), Denial>, bool) {
        self.refill(l, now_ms);
        let l = &self.learned.lower(l, now_ms);
        let place = self.line.place_of(who, now_ms);
        let ahead = self.line.ahead(&place, l.tpm.unwrap_or(f64::INFINITY));
        let lacks = self.lacks(l, who, ahead.calls, ahead.tokens);
        match lacks.map(|(d, kept)| (Denial { ahead: ahead.calls as u64, ..d }, kept)) {
            None => {
                self.charge(l, who, now_ms, hold_ms);
                self.line.leave(who.id, Some(who.class));
                (Ok(()), true)
            }
            Some((d, true)) => {
                let left = self.line.leave(who.id, None);
                (Err(Denial { kind: Kind::Shed, ..d }), left)
            }
            Some((d, false)) if !waits => (Err(d), self.line.leave(who.id, None)),
            Some((d, false)) => match self.line.stand(place, l.max_line, now_ms) {
                Ok(changed) => (Err(d), changed),
                Err(Full) => (Err(Denial::of(Kind::QueueFull, None)), false),
            },
        }
    }

    /// What the bucket lacks for `who` behind `calls` calls asking for `tokens` in all, and
    /// whether what it lacks is the reserve kept for higher classes.
    fn lacks(&self, l: &Limits, who: &Who, calls: usize, tokens: f64) -> Option<(Denial, bool)> {
        let keeps = who.class.keeps_reserve();
        if let Some(max) = l.max_in_flight {
            let kept = if keeps { (l.reserve * max as f64).floor() as usize } else { 0 };
            if self.in_flight.len() + calls + 1 + kept > max {
                return Some((Denial::of(Kind::Concurrency, None), kept > 0));
            }
        }
        if l.rpm.is_some() {
            let kept = if keeps { (l.reserve * l.burst).floor() } else { 0.0 };
            let need = calls as f64 + 1.0 + kept;
            if self.requests < need {
                let wait = ((need - self.requests) / l.req_per_ms()).ceil() as u64;
                return Some((Denial::of(Kind::Requests, Some(wait.max(1))), kept > 0.0));
            }
        }
        if let Some(tpm) = l.tpm {
            let kept = if keeps { l.reserve * tpm } else { 0.0 };
            // A call larger than what lies above the reserve waits for all of it (it is
            // charged its estimate, as any call is).
            let own = self.estimate_within_capacity(l, who.estimate).min((tpm - kept).max(1.0));
            let need = tokens + own + kept;
            if self.tokens < need {
                let wait = ((need - self.tokens) / l.tok_per_ms()).ceil() as u64;
                return Some((Denial::of(Kind::Tokens, Some(wait.max(1))), kept > 0.0));
            }
        }
        None
    }

    fn charge(&mut self, l: &Limits, who: &Who, now_ms: u64, hold_ms: u64) {
        if l.rpm.is_some() {
            self.requests -= 1.0;
        }
        let tokens = if l.tpm.is_some() { self.estimate_within_capacity(l, who.estimate) } else { 0.0 };
        self.tokens -= tokens;
        // A model's bucket (which HolySheep's answers speak of) remembers the call.
        if l.shared && (l.rpm.is_some() || l.tpm.is_some()) {
            self.learned.charge(who.id, tokens, now_ms, now_ms.saturating_add(hold_ms));
        }
        if l.max_in_flight.is_some() {
            self.in_flight.push((who.id, now_ms.saturating_add(hold_ms)));
        }
    }

    /// An estimate larger than the bucket could never pass; it is charged as a full bucket.
    fn estimate_within_capacity(&self, l: &Limits, estimate: u64) -> f64 {
        (estimate as f64).min(l.tpm.unwrap_or(f64::INFINITY))
    }

    /// The call ended: free its slot (or its place in line, if it was never admitted) and
    /// replace the estimate by the real usage (a refund, or a charge that may leave the
    /// bucket in debt).
    pub fn settle(&mut self, l: &Limits, nonce: u64, estimate: u64, actual: Option<u64>, now_ms: u64) {
        self.refill(l, now_ms);
        self.in_flight.retain(|(n, _)| *n != nonce);
        self.line.leave(nonce, None);
        if let (Some(actual), Some(cap)) = (actual, l.tpm) {
            let held = self.estimate_within_capacity(l, estimate);
            // The bucket as if the call had never taken from it.
            let without = self.tokens + held;
            // A shared bucket is never left more than one estimate below empty by a call
            // (and a call is charged at least its estimate beyond debt already there).
            let floor = if l.shared { (-held).min(without - held) } else { f64::NEG_INFINITY };
            self.tokens = (without - actual as f64).max(floor).min(cap);
        }
    }

    /// Lowers the buckets to what the provider reports of the call `id`: the remainder it
    /// reports, brought to now (`Learned::left`), and its limits learned
    /// (`Learned::learn`); a provider 429 empties the request bucket
    /// until its `retry-after` (or one request's refill) has passed. `l` is as configured.
    pub(crate) fn adapt(&mut self, l: &Limits, hints: &ProviderHints, id: u64, now_ms: u64) {
        self.learned.learn(l, hints, now_ms);
        self.refill(l, now_ms);
        let l = &self.learned.lower(l, now_ms);
        let said = (hints.remaining_requests, hints.remaining_tokens);
        // A call not remembered (a tenant's bucket, one past `MAX_SENT`): what was said.
        let (requests, tokens) = match self.learned.left(id, l, said, now_ms) {
            (None, None) => said,
            left => left,
        };
        if let (Some(r), Some(_)) = (requests, l.rpm) {
            self.requests = self.requests.min(r);
        }
        if let (Some(t), Some(_)) = (tokens, l.tpm) {
            self.tokens = self.tokens.min(t);
        }
        if hints.throttled && l.rpm.is_some() {
            let hold = hints.retry_after_ms.map_or(0.0, |ms| ms as f64 * l.req_per_ms());
            self.requests = self.requests.min(1.0 - hold.max(1.0));
        }
    }

    /// OpenAI's `x-ratelimit-*` headers for this bucket.
    pub fn headers(&self, l: &Limits) -> Vec<(&'static str, String)> {
        let mut h = Vec::new();
        if let Some(rpm) = l.rpm {
            let reset = ((l.burst - self.requests).max(0.0) / l.req_per_ms()).ceil() as u64;
            h.push((headers::LIMIT_REQUESTS, whole(rpm)));
            h.push((headers::REMAINING_REQUESTS, whole(self.requests)));
            h.push((headers::RESET_REQUESTS, duration(reset)));
        }
        if let Some(tpm) = l.tpm {
            let reset = ((tpm - self.tokens).max(0.0) / l.tok_per_ms()).ceil() as u64;
            h.push((headers::LIMIT_TOKENS, whole(tpm)));
            h.push((headers::REMAINING_TOKENS, whole(self.tokens)));
            h.push((headers::RESET_TOKENS, duration(reset)));
        }
        h
    }

    fn encode(&self) -> Vec<u8> {
        let mut flights: String = self.in_flight.iter().map(|(n, e)| format!("f {n} {e}\n")).collect();
        self.learned.encode(&mut flights);
        let mut body = flights.into_bytes();
        if self.line != Line::default() {
            body.extend_from_slice(LINE_MARK);
            self.line.encode(&mut body);
        }
        codec::encode(&["B", &bits(self.requests), &bits(self.tokens), &self.at_ms.to_string()], &body)
    }

    fn decode(raw: &[u8]) -> Option<Bucket> {
        let (f, rest) = codec::decode::<4>(raw)?;
        if f[0] != "B" {
            return None;
        }
        // The calls in flight, a line each, then (after `LINE_MARK`) the line in binary.
        let (mut in_flight, mut line, mut learned, mut at) = (Vec::new(), Line::default(), Learned::default(), 0);
        while at < rest.len() {
            if rest[at..].starts_with(LINE_MARK) {
                // A torn line is no reason to forget the calls in flight.
                line = Line::decode(&rest[at + LINE_MARK.len()..]).unwrap_or_default();
                break;
            }
            let end = rest[at..].iter().position(|&b| b == b'\n').map_or(rest.len(), |n| at + n);
            let mut parts = rest[at..end].split(|&b| b == b' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(b"f"), Some(n), Some(e)) => {
                    if let (Some(n), Some(e)) = (codec::number(n), codec::number(e)) {
                        in_flight.push((n, e));
                    }
                }
                // The learning's own lines (`Learned::encode`).
                _ => learned.decode_line(rest[at..end].split(|&b| b == b' ')),
            }
            at = end + 1;
        }
        let requests = f64::from_bits(codec::hex_number(f[1])?);
        let tokens = f64::from_bits(codec::hex_number(f[2])?);
        (requests.is_finite() && tokens.is_finite()).then_some(Bucket {
            requests,
            tokens,
            at_ms: codec::number(f[3])?,
            in_flight,
            line,
            learned,
        })
    }
}

/// Where a bucket record's admission line begins (a line of its own after the calls in
/// flight; the line itself is binary).
const LINE_MARK: &[u8] = b"L\n";

/// `250ms`, `20s`, `1.5s`, `6m0s`: the form OpenAI uses in `x-ratelimit-reset-*`.
pub(crate) fn duration(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 if ms.is_multiple_of(1000) => format!("{}s", ms / 1000),
        1_000..=59_999 => format!("{}.{}s", ms / 1000, format!("{:03}", ms % 1000).trim_end_matches('0')),
        _ => format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000),
    }
}

/// A count as a whole number (floored, never negative), without float formatting (which
/// costs the plugin kilobytes).
pub(crate) fn whole(x: f64) -> String {
    (x.max(0.0).floor() as u64).to_string()
}

/// An exact, compact text form of a float for the store.
fn bits(x: f64) -> String {
    format!("{:x}", x.to_bits())
}

pub(crate) fn bucket_key(bucket: &str) -> String {
    ["holysheep/bucket/", bucket].concat()
}

/// Reads the bucket, applies `f`, and writes the result back with compare-and-swap
/// (re-reading on a lost race). `f` returns its result and whether to write.
pub(crate) fn update<R>(
    store: &impl CasStore,
    bucket: &str,
    l: &Limits,
    now_ms: u64,
    mut f: impl FnMut(&mut Bucket) -> (R, bool),
) -> Result<R, StoreError> {
    let key = bucket_key(bucket);
    for _ in 0..MAX_RACES {
        let read = store.get(&key)?;
        let mut b = read.value.as_deref().and_then(Bucket::decode).unwrap_or_else(|| Bucket::full(l, now_ms));
        let (result, write) = f(&mut b);
        if !write {
            return Ok(result);
        }
        match store.set(&key, &b.encode(), cas_after(&read)) {
            Ok(()) => return Ok(result),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// Takes one request and `who.estimate` tokens from the bucket for the call `who.id` (see
/// `Bucket::take`). A refused call that `waits` keeps its place in line.
pub(crate) fn take(
    store: &impl CasStore,
    bucket: &str,
    l: &Limits,
    who: &Who,
    now_ms: u64,
    hold_ms: u64,
    waits: bool,
) -> Result<(), Denial> {
    let taken = update(store, bucket, l, now_ms, |b| b.take(l, who, now_ms, hold_ms, waits));
    match taken {
        Ok(admitted) => admitted,
        // Races lost to other workers all along: nothing was taken, so nothing is
        // admitted; look again shortly (the contention is the moment limits matter).
        Err(StoreError::CasMismatch) => Err(Denial::of(Kind::Contended, Some(CONTENTION_RETRY_MS))),
        // A broken store admits, uncharged: the limiter must not take the edge down with it.
        Err(StoreError::Host(_)) => Ok(()),
    }
}

/// How soon a call whose admission lost every race looks again.
pub(crate) const CONTENTION_RETRY_MS: u64 = 5;

/// The call `id` ended: frees its slot, reconciles its estimate with `actual` tokens and
/// applies what the provider said about its limits.
#[allow(clippy::too_many_arguments)]
pub(crate) fn settle(
    store: &impl CasStore,
    bucket: &str,
    l: &Limits,
    id: u64,
    estimate: u64,
    actual: Option<u64>,
    hints: &ProviderHints,
    now_ms: u64,
) {
    let _ = update(store, bucket, l, now_ms, |b| {
        let lowered = b.learned.lower(l, now_ms);
        b.settle(&lowered, id, estimate, actual, now_ms);
        b.adapt(l, hints, id, now_ms);
        b.learned.forget(id);
        ((), true)
    });
}

/// A call admitted by the bucket, then refused before it left (its tenant's budget had no
/// room): its slot, its token estimate and its request go back, as if it had never come.
pub(crate) fn give_back(store: &impl CasStore, bucket: &str, l: &Limits, id: u64, estimate: u64, now_ms: u64) {
    let _ = update(store, bucket, l, now_ms, |b| {
        let l = &b.learned.lower(l, now_ms);
        b.settle(l, id, estimate, Some(0), now_ms);
        b.learned.forget(id);
        if l.rpm.is_some() {
            b.requests = (b.requests + 1.0).min(l.burst);
        }
        ((), true)
    });
}

/// `n` more requests made for a call already admitted (a stream's attempts beyond its first,
/// which Envoy's router made): taken from the request bucket, which may go below empty.
pub(crate) fn charge_requests(store: &impl CasStore, bucket: &str, l: &Limits, n: u64, now_ms: u64) {
    if n == 0 || l.rpm.is_none() {
        return;
    }
    let _ = update(store, bucket, l, now_ms, |b| {
        b.refill(l, now_ms);
        b.requests -= n as f64;
        b.learned.more_requests(n);
        ((), true)
    });
}

/// The bucket a node admits its share from when the model's owner node is out of reach
/// (one more key per configured model).
pub(crate) fn share_bucket(bucket: &str) -> String {
    [bucket, "#share"].concat()
}

/// The bucket as it stands now, without writing.
pub fn peek(store: &impl CasStore, bucket: &str, l: &Limits, now_ms: u64) -> Bucket {
    let raw = store.get(&bucket_key(bucket)).ok().and_then(|r| r.value);
    let mut b = raw.as_deref().and_then(Bucket::decode).unwrap_or_else(|| Bucket::full(l, now_ms));
    b.refill(l, now_ms);
    b
}

/// The `x-ratelimit-*` headers of `model`'s bucket as it stands now: none, and neither the
/// clock nor the bucket read, for a model without request or token limits (one configured
/// only with prices, say).
pub(crate) fn rate_headers(
    store: &impl CasStore,
    config: &Config,
    model: &str,
    now_ms: impl FnOnce() -> u64,
) -> Vec<(&'static str, String)> {
    let Some((bucket, m)) = config.model(model) else { return Vec::new() };
    let l = Limits::of(m, &config.rate_limit);
    if l.rpm.is_none() && l.tpm.is_none() {
        return Vec::new();
    }
    let now = now_ms();
    let b = peek(store, bucket, &l, now);
    b.headers(&b.learned.lower(&l, now))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::store::Counting;
    use crate::core::store::MemStore;

    fn take_one(b: &mut Bucket, l: &Limits, id: u64, estimate: u64, now_ms: u64, hold_ms: u64) -> Result<(), Denial> {
        b.take(l, &Who::standard(id, estimate), now_ms, hold_ms, true).0
    }

    fn limits(rpm: u32, tpm: u64, burst: Option<u32>, inflight: Option<u32>) -> Limits {
        Limits::of(
            &Model {
                requests_per_minute: Some(rpm),
                tokens_per_minute: Some(tpm),
                burst,
                max_in_flight: inflight,
                ..Model::default()
            },
            &RateLimit::default(),
        )
    }

    #[test]
    fn requests_per_minute_gives_an_exact_sequence_and_wait() {
        let l = limits(3, 1_000_000, None, None);
        let mut b = Bucket::full(&l, 0);
        for i in 0..3 {
            assert!(take_one(&mut b, &l, i, 10, 0, 60_000).is_ok());
        }
        assert_eq!(take_one(&mut b, &l, 9, 10, 0, 60_000), Err(Denial::of(Kind::Requests, Some(20_000))));
        assert_eq!(take_one(&mut b, &l, 9, 10, 15_000, 60_000).unwrap_err().wait_ms, Some(5_000));
        assert!(take_one(&mut b, &l, 9, 10, 20_000, 60_000).is_ok());
    }

    #[test]
    fn refill_never_exceeds_capacity_and_ignores_a_clock_going_backwards() {
        let l = limits(60, 600, Some(5), None);
        let mut b = Bucket::full(&l, 1_000_000);
        b.refill(&l, 9_000_000);
        assert_eq!((b.requests, b.tokens), (5.0, 600.0));
        take_one(&mut b, &l, 1, 100, 9_000_000, 1).unwrap();
        b.refill(&l, 1_000);
        assert_eq!((b.requests, b.tokens, b.at_ms), (4.0, 500.0, 9_000_000));
    }

    #[test]
    fn tokens_are_reserved_then_reconciled() {
        let l = limits(1000, 1000, None, None);
        let mut b = Bucket::full(&l, 0);
        take_one(&mut b, &l, 1, 600, 0, 1).unwrap();
        assert_eq!(take_one(&mut b, &l, 2, 600, 0, 1).unwrap_err().kind, Kind::Tokens);
        b.settle(&l, 1, 600, Some(100), 0);
        assert_eq!(b.tokens, 900.0, "refunded the difference");
        // 1 200 tokens past its estimate of 100: a tenant's own bucket takes all of it ...
        let own = Limits { shared: false, ..l };
        let mut mine = b.clone();
        take_one(&mut mine, &own, 2, 100, 0, 1).unwrap();
        mine.settle(&own, 2, 100, Some(1_300), 0);
        assert_eq!(mine.tokens, -400.0, "charged the difference: a debt");
        assert_eq!(take_one(&mut mine, &own, 3, 1, 0, 1).unwrap_err().wait_ms, Some(24_060));
        // ... a model's bucket, which every caller shares, one estimate below empty at most.
        take_one(&mut b, &l, 2, 100, 0, 1).unwrap();
        b.settle(&l, 2, 100, Some(1_300), 0);
        assert_eq!(b.tokens, -100.0, "one estimate below empty");
        assert_eq!(take_one(&mut b, &l, 3, 1, 0, 1).unwrap_err().wait_ms, Some(6_060));
        // Debt already there (a provider's word) is not forgiven: a call pays its estimate.
        b.tokens = -5_000.0;
        take_one(&mut b, &l, 4, 100, 0, 1).unwrap_err();
        b.in_flight.push((4, 100));
        b.tokens -= 100.0;
        b.settle(&l, 4, 100, Some(9_999), 0);
        assert_eq!(b.tokens, -5_100.0);
    }

    #[test]
    fn a_call_given_back_leaves_the_bucket_as_if_it_never_came() {
        let s = MemStore::new();
        let l = limits(60, 1000, Some(2), Some(1));
        let who = Who::standard(1, 300);
        take(&s, "t", &l, &who, 0, 0, false).unwrap();
        let b = peek(&s, "t", &l, 0);
        assert_eq!((b.requests, b.tokens), (1.0, 700.0));
        give_back(&s, "t", &l, 1, 300, 0);
        let b = peek(&s, "t", &l, 0);
        assert_eq!((b.requests, b.tokens), (2.0, 1000.0), "the request and the tokens back");
    }

    #[test]
    fn an_estimate_over_capacity_is_charged_as_a_full_bucket() {
        let l = limits(1000, 100, None, None);
        let mut b = Bucket::full(&l, 0);
        assert!(take_one(&mut b, &l, 1, 5_000, 0, 1).is_ok());
        assert_eq!(b.tokens, 0.0);
    }

    #[test]
    fn in_flight_is_capped_and_expires() {
        let l = limits(1000, 1_000_000, None, Some(2));
        let mut b = Bucket::full(&l, 0);
        take_one(&mut b, &l, 1, 1, 0, 100).unwrap();
        take_one(&mut b, &l, 2, 1, 0, 10_000).unwrap();
        assert_eq!(take_one(&mut b, &l, 3, 1, 0, 100).unwrap_err().kind, Kind::Concurrency);
        b.settle(&l, 2, 1, None, 1);
        assert!(take_one(&mut b, &l, 3, 1, 1, 100).is_ok());
        assert!(take_one(&mut b, &l, 4, 1, 1, 100).is_err());
        assert!(take_one(&mut b, &l, 4, 1, 100, 100).is_ok(), "call 1's worker is presumed dead after its hold");
    }

    #[test]
    fn in_flight_slots_go_first_come_first_served() {
        let l = limits(1000, 1_000_000, None, Some(1));
        let mut b = Bucket::full(&l, 0);
        take_one(&mut b, &l, 1, 1, 0, 60_000).unwrap();
        assert!(take_one(&mut b, &l, 2, 1, 0, 60_000).is_err(), "2 stands in line");
        assert!(take_one(&mut b, &l, 3, 1, 1, 60_000).is_err(), "3 behind 2");
        b.settle(&l, 1, 1, None, 2);
        assert!(take_one(&mut b, &l, 3, 1, 3, 60_000).is_err(), "3 may not overtake 2");
        assert!(take_one(&mut b, &l, 2, 1, 4, 60_000).is_ok());
        b.settle(&l, 2, 1, None, 5);
        assert!(take_one(&mut b, &l, 3, 1, 6, 60_000).is_ok());
        // A place not renewed lapses: 5 is not blocked by 4, whose worker went away.
        b.settle(&l, 3, 1, None, 7);
        take_one(&mut b, &l, 9, 1, 7, 60_000).unwrap();
        assert!(take_one(&mut b, &l, 4, 1, 8, 60_000).is_err());
        b.settle(&l, 9, 1, None, 9);
        assert!(take_one(&mut b, &l, 5, 1, 9 + crate::core::limits::line::LINE_HOLD_MS, 60_000).is_ok());
        let round_trip = Bucket::decode(&b.encode()).unwrap();
        assert_eq!(round_trip, b);
    }

    #[test]
    fn a_limit_holysheep_announces_below_the_configured_one_paces_the_bucket() {
        // Configured: 600 a minute. HolySheep: 120 a minute (2 a second), 1 left.
        let l = limits(600, 1_000_000, None, None);
        let mut b = Bucket::full(&l, 0);
        for id in 1..=3 {
            take_one(&mut b, &l, id, 10, 0, 60_000).unwrap();
        }
        let said = ProviderHints {
            limit_requests: Some(120.0),
            remaining_requests: Some(1.0),
            reset_requests_ms: Some(500),
            ..Default::default()
        };
        // The answer to call 1: the 2 calls sent after it were not counted by HolySheep yet.
        b.adapt(&l, &said, 1, 0);
        assert_eq!(b.requests, -1.0, "1 left, less the 2 sent after it");
        // It refills at HolySheep's 2 a second, not the configured 10.
        assert!(take_one(&mut b, &l, 4, 10, 999, 60_000).is_err());
        assert!(take_one(&mut b, &l, 4, 10, 1_000, 60_000).is_ok());
        assert_eq!(b.headers(&b.learned.lower(&l, 1_000))[0], (headers::LIMIT_REQUESTS, "120".to_owned()));
        // The answer to call 2, read 10 s after it was sent (a long stream's): what
        // HolySheep refilled meanwhile counts, and the bucket is not driven below what is left.
        b.adapt(&l, &ProviderHints { remaining_requests: Some(0.0), ..said }, 2, 10_000);
        assert_eq!(b.requests.floor(), 18.0, "0 left then, less 2 sent after, plus 20 refilled");
        // A minute without an announcement: the configured limit again, burst and all.
        b.refill(&l, 10_000 + learned::LEARN_MS + 60_000);
        assert_eq!(b.requests, 600.0);
        // The record keeps what was learned and charged.
        b.adapt(&l, &said, 4, 200_000);
        assert_eq!(Bucket::decode(&b.encode()).unwrap(), b);
    }

    #[test]
    fn the_provider_only_lowers_the_buckets() {
        let l = limits(60, 6000, Some(10), None);
        let mut b = Bucket::full(&l, 0);
        b.adapt(
            &l,
            &ProviderHints { remaining_requests: Some(2.0), remaining_tokens: Some(99_999.0), ..Default::default() },
            1,
            0,
        );
        assert_eq!((b.requests, b.tokens), (2.0, 6000.0));
        b.adapt(&l, &ProviderHints { throttled: true, retry_after_ms: Some(3_000), ..Default::default() }, 1, 0);
        assert_eq!(take_one(&mut b, &l, 1, 1, 0, 1).unwrap_err().wait_ms, Some(3_000));
        assert!(take_one(&mut b, &l, 1, 1, 3_000, 1).is_ok());
    }

    #[test]
    fn headers_and_durations() {
        let l = limits(3, 1000, None, None);
        let mut b = Bucket::full(&l, 0);
        take_one(&mut b, &l, 1, 250, 0, 1).unwrap();
        let h = b.headers(&l);
        assert_eq!(h[0], ("x-ratelimit-limit-requests", "3".into()));
        assert_eq!(h[1], ("x-ratelimit-remaining-requests", "2".into()));
        assert_eq!(h[2], ("x-ratelimit-reset-requests", "20s".into()));
        assert_eq!(h[4], ("x-ratelimit-remaining-tokens", "750".into()));
        assert_eq!(h[5], ("x-ratelimit-reset-tokens", "15s".into()));
        assert_eq!(duration(250), "250ms");
        assert_eq!(duration(1_500), "1.5s");
        assert_eq!(duration(360_000), "6m0s");
    }

    /// Many threads take from one bucket in shared data: never more than its capacity.
    #[test]
    fn concurrent_takes_never_exceed_the_bucket() {
        let s = std::sync::Arc::new(MemStore::new());
        let l = limits(10, 1_000_000, Some(5), None);
        let handles: Vec<_> = (0..8u64)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    (0..10u64)
                        .filter(|i| {
                            update(&*s, "m", &l, 0, |b| match take_one(b, &l, t * 100 + i, 1, 0, 1) {
                                Ok(()) => (true, true),
                                Err(_) => (false, false),
                            })
                            .unwrap()
                        })
                        .count()
                })
            })
            .collect();
        let admitted: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(admitted, 5);
        assert_eq!(s.key_count(), 1);
    }

    #[test]
    fn rate_headers_only_for_a_model_with_limits_and_only_then_a_read() {
        let config =
            Config::parse(br#"{"models":{"priced":{"usd_per_mtok_input":2.0},"limited":{"requests_per_minute":60}}}"#)
                .unwrap();
        let store = Counting::new();
        let unread = || -> u64 { panic!("the clock was read") };
        assert!(rate_headers(&store, &config, "priced", unread).is_empty());
        assert!(rate_headers(&store, &config, "unknown", unread).is_empty());
        assert_eq!(store.reads(), 0, "no bucket read without limits");
        let h = rate_headers(&store, &config, "limited", || 1_000);
        assert_eq!(h.iter().find(|(n, _)| *n == "x-ratelimit-limit-requests").map(|(_, v)| v.as_str()), Some("60"));
        assert_eq!(store.reads(), 1);
    }
}
