//! The single-flight lease: one leader per request key across every worker, built on the
//! CAS store. Leases live in `lock.slots` ways, four to a shared-data record (a group): a
//! key may lead from any way of its group, so one read shows whether its flight is on and
//! one compare-and-swap takes a way. A way holds the owner's nonce and an expiry; a leader
//! renews it while its call is in flight, so a dead leader is replaced within one lease.
//! When the call ends the owner writes the answer into its way (`Done`), where the waiters
//! that saw its nonce read it; a `Done` way is free to take.

use crate::core::api::key::Key;
use crate::core::api::priority::{Class, CLASSES};
use crate::core::api::response::Response;
use crate::core::config::Config;
use crate::core::store::{self, cas_after, CasStore, Read, StoreError, MAX_RACES};
use crate::core::wire::codec;
use std::borrow::Cow;

/// Where a flight's lease lives: one way of a group record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// The group record's shared-data key.
    pub group: String,
    pub way: usize,
}

/// Held by the leader: enough to renew and to finish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub slot: Slot,
    pub key: Key,
    pub nonce: u64,
}

/// When a finished flight's answer was produced, if not when the flight ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Produced {
    /// By the flight, as it ended.
    #[default]
    AtEnd,
    /// A stale answer served in place of a failure, produced then.
    Stale(u64),
    /// A forward node's flight relayed its owner's answer, which the owner produced then
    /// (a HIT some seconds old, say).
    Relayed(u64),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Missing, empty, or unreadable: free to take.
    Free,
    Leading {
        key: String,
        nonce: u64,
        expires_ms: u64,
        /// A waiter is waiting on this flight (so its end must wake the other workers).
        watched: bool,
        /// The highest class among its waiters that are above `sheddable`.
        best: Option<Class>,
    },
    Done {
        key: String,
        nonce: u64,
        done_at_ms: u64,
        response: Response,
        /// A stale answer (served because every attempt failed), produced at this time.
        produced: Produced,
        /// The answer is the cache entry stored at `done_at_ms` (not repeated here:
        /// `response` has no body).
        in_cache: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// We lead.
    Acquired(Lease),
    /// A live leader holds this key in `slot`: wait for the flight with this nonce
    /// (`watched`: someone already does).
    Held { nonce: u64, slot: Slot, watched: bool, best: Option<Class> },
    /// Every way of this key's group is leased to other keys (collisions).
    Busy,
    /// A flight on this key finished since the request arrived: its answer is this
    /// request's too (it read the cache just before that flight stored).
    Answered { response: Response, done_at_ms: u64, produced: Produced, in_cache: bool },
}

/// The ways of a group: a key may lead from any of them, so a collision with another
/// prompt in flight does not send every identical request upstream alone.
pub(crate) const WAYS: u32 = 4;

/// How long a finished flight's answer stays in its way before another flight may take
/// the way: two ticks, by when every waiter has been woken and read it (a worker's waiters
/// are woken by the flight's end, or at the latest by the worker's next tick). A waiter
/// whose answer is gone past this looks again from the cache and may lead a new flight.
pub(crate) fn done_hold_ms(config: &Config) -> u64 {
    config.tick_ms().saturating_mul(2)
}

/// How far ahead of a node's clock another worker's may stamp a finished flight (Envoy's
/// clock advances per event-loop turn).
const DONE_CLOCK_SLACK_MS: u64 = 50;

/// The group record `key` leads from, and how many ways it has (`lock.slots` in groups of
/// four; fewer slots make one smaller group).
pub fn group_of(config: &Config, key: &Key) -> (String, usize) {
    let n = config.lock.slots.max(1);
    let ways = WAYS.min(n);
    (store::slot_name("holysheep/lease/", key.slot(n / ways, 1)), ways as usize)
}

/// The state of one way, and the group record's CAS.
pub fn read(store: &impl CasStore, slot: &Slot) -> Result<(State, Option<u32>), StoreError> {
    let r = store.get(&slot.group)?;
    let (ways, _) = split(r.value.as_deref().unwrap_or_default(), slot.way + 1);
    let state = ways.get(slot.way).and_then(|w| decode(w)).unwrap_or(State::Free);
    Ok((state, r.cas))
}

/// Takes the lease if a way of the key's group is free, expired, or done; reports a live
/// holder, or a flight on this key done at or after `since_ms` (the request's arrival),
/// otherwise.
pub fn acquire(
    store: &impl CasStore,
    config: &Config,
    key: &Key,
    nonce: u64,
    now_ms: u64,
    since_ms: u64,
) -> Result<Acquire, StoreError> {
    scan(store, config, key, Some(nonce), now_ms, since_ms)
}

/// `acquire` without taking anything: a live holder of the key, or a flight on it done at
/// or after `since_ms`; `Busy` where `acquire` would have taken a way. For a waiter whose
/// flight's record is gone, which may join or take what is there but never lead.
pub(crate) fn look(
    store: &impl CasStore,
    config: &Config,
    key: &Key,
    now_ms: u64,
    since_ms: u64,
) -> Result<Acquire, StoreError> {
    scan(store, config, key, None, now_ms, since_ms)
}

/// `acquire` (with the nonce to lead under) or `look` (without).
fn scan(
    store: &impl CasStore,
    config: &Config,
    key: &Key,
    nonce: Option<u64>,
    now_ms: u64,
    since_ms: u64,
) -> Result<Acquire, StoreError> {
    let (group, n) = group_of(config, key);
    for _ in 0..MAX_RACES {
        let r = store.get(&group)?;
        let (ways, n) = split(r.value.as_deref().unwrap_or_default(), n);
        // Every way is looked at before one is taken: a live flight of this key, or its
        // answer, may be in any of them. Other keys' records are read in place. A way is
        // taken in this order: free (never written, garbage, an expired leader); this key's
        // own finished flight (its waiters that have not read it look again and wait on the
        // new one); another key's finished flight nobody waited on (`d`); another key's
        // waited-on flight past `done_hold_ms`, oldest first; last, a younger one whose
        // answer is in the cache, oldest first. Any other younger one is still being read by
        // its waiters (one dated in the future, by a clock stepped back, is not protected).
        let (hold_from, hold_until) = (now_ms.saturating_sub(done_hold_ms(config)), now_ms + DONE_CLOCK_SLACK_MS);
        let mut free: Option<((u8, u64), usize)> = None;
        let mut offer = |way: usize, rank: (u8, u64)| {
            if free.is_none_or(|(r, _)| rank < r) {
                free = Some((rank, way));
            }
        };
        for (way, record) in ways[..n].iter().enumerate() {
            // Kind and key first: another key's finished flight needs nothing more.
            let (kind, ours) = match codec::fields::<2>(record) {
                Some(([kind, k], _)) => (kind, key.is(k)),
                None => (&b""[..], false),
            };
            match (kind, ours) {
                (b"L", _) => match peek(record) {
                    Some(p) if p.time > now_ms && ours => {
                        let slot = Slot { group, way };
                        let Mark { watched, best } = Mark::of(p.rest);
                        return Ok(Acquire::Held { nonce: p.nonce, slot, watched, best });
                    }
                    // Another key's live flight.
                    Some(p) if p.time > now_ms => {}
                    // Another key's waited-on flight that ended without an answer (given up,
                    // or its leader gone) lately: its waiters are yet to look and lead anew.
                    Some(p) if !ours && Mark::of(p.rest).watched && p.time > hold_from && p.time <= hold_until => {}
                    _ => offer(way, (0, 0)),
                },
                (b"D" | b"d", true) => match decode(record) {
                    Some(State::Done { response, done_at_ms, produced, in_cache, .. }) if done_at_ms >= since_ms => {
                        return Ok(Acquire::Answered { response, done_at_ms, produced, in_cache });
                    }
                    Some(State::Done { done_at_ms, .. }) => offer(way, (1, done_at_ms)),
                    _ => offer(way, (0, 0)),
                },
                (b"D", false) => match peek(record) {
                    // Still being read by its waiters. One whose answer is in the cache is
                    // the last resort before this key's crowd goes upstream one call each:
                    // a waiter that finds the way taken reads the cache entry instead.
                    Some(p) if p.time > hold_from && p.time <= hold_until => {
                        if refers_to_cache(record) {
                            offer(way, (3, p.time));
                        }
                    }
                    Some(p) => offer(way, (2, p.time)),
                    None => offer(way, (0, 0)),
                },
                // Another key's flight that nobody waited on: as good as free.
                (b"d", false) => offer(way, (0, 0)),
                _ => offer(way, (0, 0)),
            }
        }
        let free = free.map(|(_, way)| way);
        let (Some(way), Some(nonce)) = (free, nonce) else { return Ok(Acquire::Busy) };
        let value = join(&ways[..n], way, &leading(key.hex(), nonce, now_ms + config.lock.lease_ms, b""));
        // The whole group is written by CAS: whoever changed any way since our read makes
        // us read again, so two racers can never both take a way for one key. The
        // test-only `broken-lock` build writes without CAS, to prove the harness catches
        // the race.
        match write(store, &group, &value, &r) {
            Ok(()) => return Ok(Acquire::Acquired(Lease { slot: Slot { group, way }, key: key.clone(), nonce })),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// Sets a group record read as `r`. A missing key is inserted whatever CAS we pass;
/// `cas_after` makes the loser of two concurrent inserts see a mismatch (see
/// `store::ABSENT_CAS`).
fn write(store: &impl CasStore, group: &str, value: &[u8], r: &Read) -> Result<(), StoreError> {
    let cas = if cfg!(feature = "broken-lock") { None } else { cas_after(r) };
    store.set(group, value, cas)
}

/// Pushes the expiry forward; `false` when the lease is no longer ours.
pub(crate) fn renew(store: &impl CasStore, config: &Config, lease: &Lease, now_ms: u64) -> Result<bool, StoreError> {
    let expires_ms = now_ms + config.lock.lease_ms;
    let record = |mark: &[u8]| Cow::Owned(leading(lease.key.hex(), lease.nonce, expires_ms, mark));
    Ok(update_if_owner(store, lease, record)?.is_some())
}

/// Publishes the flight's answer to its waiters and frees the way. `None` when the lease
/// was lost (expired and taken over), in which case the new leader's flight stands;
/// otherwise whether anyone was waiting on it. `produced`: when the answer was produced, if
/// not when the flight ended (a stale one, or one a forward node relayed). `in_cache`: the answer was stored in the cache at `now_ms`; the record
/// then refers to it instead of repeating it.
pub(crate) fn finish(
    store: &impl CasStore,
    lease: &Lease,
    response: &Response,
    now_ms: u64,
    produced: Produced,
    in_cache: bool,
) -> Result<Option<bool>, StoreError> {
    let value = done(&lease.key, lease.nonce, now_ms, response, produced, in_cache);
    // A flight nobody waited on is marked so (`d`): no waiter needs its way kept.
    update_if_owner(store, lease, |mark| match Mark::of(mark).watched {
        true => Cow::Borrowed(&value[..]),
        false => Cow::Owned([&b"d"[..], value.get(1..).unwrap_or_default()].concat()),
    })
}

/// Gives the lease up without an answer (a stream that broke off) at `now_ms`: the way
/// reads as expired from then, so a waiter takes it and leads a new flight (another key's
/// flight leaves a waited-on way alone for `done_hold_ms`, as a finished one). `None` when
/// it was not ours.
pub(crate) fn release(store: &impl CasStore, lease: &Lease, now_ms: u64) -> Result<Option<bool>, StoreError> {
    update_if_owner(store, lease, |mark| Cow::Owned(leading(lease.key.hex(), lease.nonce, now_ms, mark)))
}

/// Marks the flight `nonce` in `slot` as waited on, so that its end wakes every worker, by
/// a waiter of `class` (a leader waiting for its bucket takes the highest class of its
/// waiters); a no-op once marked so. `false` when the flight is no longer in flight there
/// (it ended between the waiter's read and this mark, so no wake-up will come for it).
pub(crate) fn watch(store: &impl CasStore, slot: &Slot, nonce: u64, class: Class) -> Result<bool, StoreError> {
    rewrite_leader(store, slot, nonce, |p| {
        let mark = Mark::of(p.rest);
        let key = std::str::from_utf8(p.key).ok().filter(|_| mark.lacks(class))?;
        Some(Cow::Owned(leading(key, nonce, p.time, &mark.with(class).bytes())))
    })
    .map(|leading| leading.is_some())
}

/// The highest class among the waiters of the flight `lease` leads, above `sheddable`.
pub(crate) fn waiting_class(store: &impl CasStore, lease: &Lease) -> Option<Class> {
    let r = store.get(&lease.slot.group).ok()?;
    let (ways, _) = split(r.value.as_deref().unwrap_or_default(), lease.slot.way + 1);
    let p = ways.get(lease.slot.way).and_then(|w| peek(w)).filter(|p| p.kind == b'L' && p.nonce == lease.nonce)?;
    Mark::of(p.rest).best
}

/// Who waits on a leading flight, as its record's body says: `w` once anyone does,
/// followed by the rank of the highest class above `sheddable` among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Mark {
    pub watched: bool,
    pub best: Option<Class>,
}

impl Mark {
    fn of(rest: &[u8]) -> Mark {
        let best = rest.get(1).and_then(|d| CLASSES.get(usize::from(d.wrapping_sub(b'0')))).copied();
        Mark { watched: rest.first() == Some(&b'w'), best }
    }

    fn bytes(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2);
        if self.watched {
            out.push(b'w');
            if let Some(c) = self.best {
                out.push(b'0' + c.rank() as u8);
            }
        }
        out
    }

    /// Whether a waiter of `class` has something to write: the mark, or a higher class.
    pub fn lacks(self, class: Class) -> bool {
        !self.watched || (class < Class::Sheddable && self.best.is_none_or(|b| class < b))
    }

    fn with(self, class: Class) -> Mark {
        let best = if class < Class::Sheddable { Some(self.best.map_or(class, |b| b.min(class))) } else { self.best };
        Mark { watched: true, best }
    }
}

/// Writes `record(watched)` into the lease's way if the lease is still ours; `None` when
/// it is not, else whether the flight was watched.
fn update_if_owner<'a>(
    store: &impl CasStore,
    lease: &Lease,
    record: impl Fn(&[u8]) -> Cow<'a, [u8]>,
) -> Result<Option<bool>, StoreError> {
    rewrite_leader(store, &lease.slot, lease.nonce, |p| Some(record(p.rest)))
}

/// Rewrites `slot` with `record(leader)` while it holds the leader of flight `nonce`
/// (`record` may decline: nothing is written). `None` when the way holds another flight
/// or the races run out, else whether the flight was watched.
fn rewrite_leader<'a>(
    store: &impl CasStore,
    slot: &Slot,
    nonce: u64,
    record: impl Fn(&Peek<'_>) -> Option<Cow<'a, [u8]>>,
) -> Result<Option<bool>, StoreError> {
    for _ in 0..MAX_RACES {
        let r = store.get(&slot.group)?;
        let (ways, n) = split(r.value.as_deref().unwrap_or_default(), slot.way + 1);
        let Some(p) = ways.get(slot.way).and_then(|w| peek(w)).filter(|p| p.kind == b'L' && p.nonce == nonce) else {
            return Ok(None);
        };
        let watched = Mark::of(p.rest).watched;
        let Some(record) = record(&p) else { return Ok(Some(watched)) };
        // Only the owner writes a Leading value with this nonce, but a waiter may take the
        // way over (or mark it watched), or another key change its own way, between our
        // read and write: the CAS turns that into a re-read.
        match store.set(&slot.group, &join(&ways[..n], slot.way, &record), cas_after(&r)) {
            Ok(()) => return Ok(Some(watched)),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// The most ways a group record holds.
const MAX_WAYS: usize = WAYS as usize;

/// A group record's ways, and how many there are (at least `n`; a way never written is
/// empty): one line with each way's length, comma-separated, then the ways' records one
/// after another. Anything malformed reads as every way free.
fn split(raw: &[u8], n: usize) -> ([&[u8]; MAX_WAYS], usize) {
    let mut ways: [&[u8]; MAX_WAYS] = [b""; MAX_WAYS];
    let mut read = || {
        let ([lengths], mut rest) = codec::fields::<1>(raw)?;
        let mut count = 0;
        for len in lengths.split(|&b| b == b',').filter(|l| !l.is_empty()) {
            let len = usize::try_from(codec::number(len)?).ok()?;
            *ways.get_mut(count)? = rest.get(..len)?;
            rest = rest.get(len..)?;
            count += 1;
        }
        Some(count)
    };
    match read() {
        Some(count) => (ways, count.max(n).min(MAX_WAYS)),
        None => ([b""; MAX_WAYS], n.min(MAX_WAYS)),
    }
}

/// The group record with way `at` replaced by `record`.
fn join(ways: &[&[u8]], at: usize, record: &[u8]) -> Vec<u8> {
    let way = |i: usize| if i == at { record } else { ways.get(i).copied().unwrap_or_default() };
    let count = ways.len().max(at + 1);
    let mut out = Vec::with_capacity(16 + ways.iter().map(|w| w.len()).sum::<usize>() + record.len());
    for i in 0..count {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(codec::decimal(way(i).len() as u64).as_str().as_bytes());
    }
    out.push(b'\n');
    for i in 0..count {
        out.extend_from_slice(way(i));
    }
    out
}

/// A leader's record; its body is its `Mark` (empty until someone waits).
fn leading(key_hex: &str, nonce: u64, expires_ms: u64, mark: &[u8]) -> Vec<u8> {
    codec::encode(&["L", key_hex, codec::decimal(nonce).as_str(), codec::decimal(expires_ms).as_str()], mark)
}

/// A way's record read in place, without copying: its kind (`L` leading, `D` done), key,
/// nonce, time (a leader's expiry, or when a flight was done), and what follows (`w` for a
/// watched leader).
struct Peek<'a> {
    kind: u8,
    key: &'a [u8],
    nonce: u64,
    time: u64,
    rest: &'a [u8],
}

fn peek(raw: &[u8]) -> Option<Peek<'_>> {
    let ([kind, key, nonce, time], rest) = codec::fields::<4>(raw)?;
    let kind = match kind {
        b"L" => b'L',
        b"D" | b"d" => b'D',
        _ => return None,
    };
    Some(Peek { kind, key, nonce: codec::number(nonce)?, time: codec::number(time)?, rest })
}

/// A finished flight's freshness field when its record refers to its answer's cache entry
/// rather than holding the answer itself.
const CACHED: &str = "cached";

/// Whether a finished flight's record refers to its answer's cache entry.
fn refers_to_cache(raw: &[u8]) -> bool {
    codec::fields::<8>(raw).is_some_and(|(f, _)| f[7] == CACHED.as_bytes())
}

fn done(key: &Key, nonce: u64, now_ms: u64, r: &Response, produced: Produced, in_cache: bool) -> Vec<u8> {
    let freshness: Cow<'_, str> = match (produced, in_cache) {
        (Produced::Stale(t), _) => Cow::Owned(format!("stale:{t}")),
        (Produced::Relayed(t), _) => Cow::Owned(format!("relayed:{t}")),
        (Produced::AtEnd, true) => Cow::Borrowed(CACHED),
        (Produced::AtEnd, false) => Cow::Borrowed("fresh"),
    };
    // An answer that refers to its cache entry repeats none of it.
    let refers = in_cache && produced == Produced::AtEnd;
    let (content_type, headers, body) = if refers {
        (Cow::Borrowed(""), String::new(), &[][..])
    } else {
        (codec::field(&r.content_type), codec::headers_field(&r.headers), &r.body[..])
    };
    codec::encode(
        &[
            "D",
            key.hex(),
            codec::decimal(nonce).as_str(),
            codec::decimal(now_ms).as_str(),
            codec::decimal(u64::from(r.status)).as_str(),
            &content_type,
            &headers,
            &freshness,
        ],
        body,
    )
}

fn decode(raw: &[u8]) -> Option<State> {
    match raw.first()? {
        b'L' => {
            let (f, body) = codec::decode::<4>(raw)?;
            Some(State::Leading {
                key: f[1].to_owned(),
                nonce: codec::number(f[2])?,
                expires_ms: codec::number(f[3])?,
                watched: Mark::of(body).watched,
                best: Mark::of(body).best,
            })
        }
        b'D' | b'd' => {
            let (f, body) = codec::decode::<8>(raw)?;
            let (produced, in_cache) = match (f[7].strip_prefix("stale:"), f[7].strip_prefix("relayed:")) {
                (Some(t), _) => (Produced::Stale(codec::number(t)?), false),
                (_, Some(t)) => (Produced::Relayed(codec::number(t)?), false),
                _ if f[7] == "fresh" => (Produced::AtEnd, false),
                _ if f[7] == CACHED => (Produced::AtEnd, true),
                _ => return None,
            };
            Some(State::Done {
                key: f[1].to_owned(),
                nonce: codec::number(f[2])?,
                done_at_ms: codec::number(f[3])?,
                response: Response {
                    status: f[4].parse().ok()?,
                    content_type: f[5].to_owned(),
                    headers: codec::parse_headers(f[6]),
                    body: body.to_vec(),
                },
                produced,
                in_cache,
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::request::request_key;
    use crate::core::store::{Counting, MemStore};
    use std::sync::{Arc, Barrier};

    fn key(i: u32) -> Key {
        request_key("/p", "s", &i.to_be_bytes())
    }

    fn resp(status: u16) -> Response {
        Response::json(status, b"{}".to_vec()).with_header("retry-after", "3".into())
    }

    #[test]
    fn second_caller_waits_on_the_first() {
        let (s, c) = (MemStore::new(), Config::default());
        let Acquire::Acquired(lease) = acquire(&s, &c, &key(1), 11, 0, 0).unwrap() else { panic!() };
        assert!(matches!(acquire(&s, &c, &key(1), 22, 10, 10).unwrap(), Acquire::Held { nonce: 11, .. }));
        assert_eq!(finish(&s, &lease, &resp(503), 20, Produced::AtEnd, false).unwrap(), Some(false), "ours, unwatched");
        let (state, _) = read(&s, &lease.slot).unwrap();
        let State::Done { nonce, response, .. } = state else { panic!("{state:?}") };
        assert_eq!(nonce, 11);
        assert_eq!(response, resp(503));
        // A done slot is free again.
        assert!(matches!(acquire(&s, &c, &key(1), 33, 30, 30).unwrap(), Acquire::Acquired(_)));
    }

    #[test]
    fn a_waiter_marks_the_flight_and_the_mark_survives_renewal_until_the_leader_finishes() {
        let (s, c) = (MemStore::new(), Config::default());
        let Acquire::Acquired(lease) = acquire(&s, &c, &key(1), 11, 0, 0).unwrap() else { panic!() };
        let Acquire::Held { slot, watched: false, .. } = acquire(&s, &c, &key(1), 22, 1, 1).unwrap() else {
            panic!("unwatched at first")
        };
        assert!(watch(&s, &slot, 11, Class::Sheddable).unwrap());
        assert!(matches!(acquire(&s, &c, &key(1), 33, 2, 2).unwrap(), Acquire::Held { watched: true, .. }));
        assert!(renew(&s, &c, &lease, 3).unwrap());
        assert!(matches!(acquire(&s, &c, &key(1), 44, 4, 4).unwrap(), Acquire::Held { watched: true, .. }));
        assert!(!watch(&s, &slot, 99, Class::Sheddable).unwrap(), "not that flight");
        assert_eq!(
            finish(&s, &lease, &resp(200), 5, Produced::AtEnd, false).unwrap(),
            Some(true),
            "the leader learns it"
        );
        assert!(!watch(&s, &slot, 11, Class::Sheddable).unwrap(), "over: no wake-up will come");
        assert!(matches!(read(&s, &slot).unwrap().0, State::Done { .. }), "a finished flight stays finished");
    }

    #[test]
    fn a_leaders_mark_keeps_its_most_urgent_waiters_class_through_renewals() {
        let (s, c) = (MemStore::new(), Config::default());
        let Acquire::Acquired(lease) = acquire(&s, &c, &key(1), 11, 0, 0).unwrap() else { panic!() };
        let Acquire::Held { slot, .. } = acquire(&s, &c, &key(1), 22, 1, 1).unwrap() else { panic!() };
        assert!(watch(&s, &slot, 11, Class::Sheddable).unwrap());
        assert_eq!(waiting_class(&s, &lease), None, "a sheddable waiter raises nothing");
        assert!(watch(&s, &slot, 11, Class::Standard).unwrap());
        assert!(watch(&s, &slot, 11, Class::Critical).unwrap());
        assert!(watch(&s, &slot, 11, Class::Standard).unwrap());
        assert!(renew(&s, &c, &lease, 3).unwrap());
        assert_eq!(waiting_class(&s, &lease), Some(Class::Critical));
        let Acquire::Held { watched, best, .. } = acquire(&s, &c, &key(1), 33, 4, 4).unwrap() else { panic!() };
        assert_eq!((watched, best), (true, Some(Class::Critical)));
    }

    #[test]
    fn expired_lease_is_taken_over_and_the_old_owner_cannot_finish() {
        let (s, c) = (MemStore::new(), Config::default());
        let Acquire::Acquired(old) = acquire(&s, &c, &key(1), 1, 0, 0).unwrap() else { panic!() };
        assert!(matches!(acquire(&s, &c, &key(1), 2, 4_999, 4_999).unwrap(), Acquire::Held { nonce: 1, .. }));
        let Acquire::Acquired(new) = acquire(&s, &c, &key(1), 2, 5_000, 5_000).unwrap() else { panic!() };
        assert!(!renew(&s, &c, &old, 5_001).unwrap());
        assert_eq!(finish(&s, &old, &resp(200), 5_002, Produced::AtEnd, false).unwrap(), None, "not ours any more");
        assert!(renew(&s, &c, &new, 5_003).unwrap());
        // Renewal pushes expiry: still held well after the first expiry.
        assert!(matches!(acquire(&s, &c, &key(1), 3, 9_000, 9_000).unwrap(), Acquire::Held { nonce: 2, .. }));
    }

    #[test]
    fn another_key_in_the_same_slot_is_busy() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.lock.slots = 1;
        assert!(matches!(acquire(&s, &c, &key(1), 1, 0, 0).unwrap(), Acquire::Acquired(_)));
        assert_eq!(acquire(&s, &c, &key(2), 2, 0, 0).unwrap(), Acquire::Busy);
        assert_eq!(s.key_count(), 1);
    }

    #[test]
    fn colliding_keys_lead_from_other_ways_until_every_way_is_taken() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.lock.slots = 8;
        let keys: Vec<Key> = (0..200u32).map(key).collect();
        let home = group_of(&c, &keys[0]).0;
        let colliding: Vec<&Key> = keys.iter().filter(|k| group_of(&c, k).0 == home).take(5).collect();
        assert_eq!(colliding.len(), 5);
        let mut slots = std::collections::HashSet::new();
        for (i, k) in colliding.iter().take(4).enumerate() {
            let Acquire::Acquired(l) = acquire(&s, &c, k, i as u64 + 1, 0, 0).unwrap() else { panic!("way {i}") };
            slots.insert(l.slot.way);
            assert!(
                matches!(acquire(&s, &c, k, 99, 1, 1).unwrap(), Acquire::Held { nonce, .. } if nonce == i as u64 + 1)
            );
        }
        assert_eq!(slots.len(), 4, "four ways");
        assert_eq!(acquire(&s, &c, colliding[4], 5, 0, 0).unwrap(), Acquire::Busy, "all ways taken");
        assert_eq!(s.key_count(), 1, "one record for the group");
    }

    #[test]
    fn a_finished_flight_answers_its_own_key_and_frees_the_way_for_others() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.lock.slots = 1;
        let Acquire::Acquired(lease) = acquire(&s, &c, &key(1), 1, 0, 0).unwrap() else { panic!() };
        assert!(watch(&s, &lease.slot, 1, Class::Sheddable).unwrap(), "someone waits on it");
        finish(&s, &lease, &resp(200), 10, Produced::AtEnd, false).unwrap();
        let shared = acquire(&s, &c, &key(1), 2, 11, 5).unwrap();
        assert!(matches!(shared, Acquire::Answered { done_at_ms: 10, .. }), "{shared:?}");
        let held_until = 10 + done_hold_ms(&c);
        let before = held_until - 1;
        assert_eq!(acquire(&s, &c, &key(2), 3, before, before).unwrap(), Acquire::Busy, "still being read");
        assert!(matches!(acquire(&s, &c, &key(2), 3, held_until, held_until).unwrap(), Acquire::Acquired(_)));
    }

    #[test]
    fn a_crowd_takes_a_way_whose_waiters_can_read_the_cache_rather_than_go_alone() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.lock.slots = 4;
        let keys: Vec<Key> = (0..400u32).map(key).collect();
        let home = group_of(&c, &keys[0]).0;
        let group: Vec<&Key> = keys.iter().filter(|k| group_of(&c, k).0 == home).take(6).collect();
        // Four waited-on flights end within the hold: three stored their answers in the
        // cache (at 10, 20 and 30), one (at 5) could not.
        for (i, (at, in_cache)) in [(5, false), (10, true), (20, true), (30, true)].into_iter().enumerate() {
            let n = i as u64 + 1;
            let Acquire::Acquired(l) = acquire(&s, &c, group[i], n, 0, 0).unwrap() else { panic!() };
            watch(&s, &l.slot, n, Class::Sheddable).unwrap();
            finish(&s, &l, &resp(200), at, Produced::AtEnd, in_cache).unwrap();
        }
        // A new prompt leads from the oldest way whose answer is in the cache.
        let Acquire::Acquired(fifth) = acquire(&s, &c, group[4], 5, 40, 40).unwrap() else { panic!() };
        assert_eq!(fifth.slot.way, 1, "the answer stored at 10, not the uncached one at 5");
        let Acquire::Acquired(_) = acquire(&s, &c, group[5], 6, 40, 40).unwrap() else { panic!() };
        // Once only the uncached answer and live flights are left, a crowd goes alone.
        let seventh = keys.iter().find(|k| group_of(&c, k).0 == home && !group.contains(k)).unwrap();
        let Acquire::Acquired(_) = acquire(&s, &c, seventh, 7, 40, 40).unwrap() else { panic!() };
        let eighth = keys.iter().filter(|k| group_of(&c, k).0 == home && !group.contains(k)).nth(1).unwrap();
        assert_eq!(acquire(&s, &c, eighth, 8, 40, 40).unwrap(), Acquire::Busy, "the uncached answer is kept");
    }

    #[test]
    fn a_finished_flight_nobody_waited_on_frees_its_way_at_once() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.lock.slots = 1;
        let Acquire::Acquired(lease) = acquire(&s, &c, &key(1), 1, 0, 0).unwrap() else { panic!() };
        finish(&s, &lease, &resp(200), 10, Produced::AtEnd, false).unwrap();
        assert!(matches!(read(&s, &lease.slot).unwrap().0, State::Done { nonce: 1, .. }), "still its answer");
        assert!(matches!(acquire(&s, &c, &key(2), 2, 11, 11).unwrap(), Acquire::Acquired(_)));
    }

    #[test]
    fn a_key_whose_answers_are_not_stored_reuses_its_own_finished_way_instead_of_going_alone() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.lock.slots = 4;
        // One key's flights fail fast, one after another: four ways fill with its answers.
        for i in 0..8u64 {
            let now = i * 10;
            match acquire(&s, &c, &key(1), i + 1, now, now).unwrap() {
                Acquire::Acquired(l) => {
                    watch(&s, &l.slot, i + 1, Class::Sheddable).unwrap();
                    finish(&s, &l, &resp(503), now + 5, Produced::AtEnd, false).unwrap()
                }
                other => panic!("flight {i}: {other:?}"),
            };
        }
        // Another key still finds no way to spare while those answers are young.
        let keys: Vec<Key> = (0..400u32).map(key).collect();
        let home = group_of(&c, &key(1)).0;
        let other = keys.iter().find(|k| group_of(&c, k).0 == home && **k != key(1)).unwrap();
        assert_eq!(acquire(&s, &c, other, 99, 80, 80).unwrap(), Acquire::Busy);
    }

    #[test]
    fn a_finished_flight_dated_in_the_future_is_not_protected() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.lock.slots = 1;
        let Acquire::Acquired(l) = acquire(&s, &c, &key(1), 1, 0, 0).unwrap() else { panic!() };
        // Stamped by a clock an hour ahead (this node's clock was stepped back).
        finish(&s, &l, &resp(200), 3_600_000, Produced::AtEnd, false).unwrap();
        assert!(matches!(acquire(&s, &c, &key(2), 2, 10, 10).unwrap(), Acquire::Acquired(_)));
    }

    #[test]
    fn free_ways_are_taken_before_finished_ones_and_the_oldest_finished_first() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.lock.slots = 4;
        let keys: Vec<Key> = (0..400u32).map(key).collect();
        let home = group_of(&c, &keys[0]).0;
        let group: Vec<&Key> = keys.iter().filter(|k| group_of(&c, k).0 == home).take(6).collect();
        // Two flights finish (at 10 and 20): a third prompt takes a never-used way.
        for (i, at) in [(0, 20), (1, 10)] {
            let Acquire::Acquired(l) = acquire(&s, &c, group[i], i as u64 + 1, 0, 0).unwrap() else { panic!() };
            watch(&s, &l.slot, i as u64 + 1, Class::Sheddable).unwrap();
            finish(&s, &l, &resp(200), at, Produced::AtEnd, false).unwrap();
        }
        let Acquire::Acquired(third) = acquire(&s, &c, group[2], 3, 30, 30).unwrap() else { panic!() };
        let Acquire::Acquired(fourth) = acquire(&s, &c, group[3], 4, 30, 30).unwrap() else { panic!() };
        assert!(third.slot.way >= 2 && fourth.slot.way >= 2, "the finished ways are kept while others are free");
        // Every way is taken or finished: past the hold, the older answer (10) goes first.
        let late = 20 + done_hold_ms(&c) + 1;
        let Acquire::Acquired(fifth) = acquire(&s, &c, group[4], 5, late, late).unwrap() else { panic!() };
        assert!(matches!(read(&s, &fifth.slot).unwrap().0, State::Leading { nonce: 5, .. }));
        let answered = acquire(&s, &c, group[0], 6, late, 0).unwrap();
        assert!(matches!(answered, Acquire::Answered { done_at_ms: 20, .. }), "the younger answer stays: {answered:?}");
    }

    #[test]
    fn a_new_flight_costs_one_read_and_one_write_and_leaves_the_other_ways_alone() {
        let s = Counting::new();
        let mut c = Config::default();
        c.lock.slots = 4;
        let leases: Vec<Lease> = (0..3u32)
            .map(|i| match acquire(&s, &c, &key(i), u64::from(i) + 1, 0, 0).unwrap() {
                Acquire::Acquired(l) => l,
                other => panic!("{other:?}"),
            })
            .collect();
        s.reset();
        let Acquire::Acquired(fourth) = acquire(&s, &c, &key(3), 4, 1, 1).unwrap() else { panic!() };
        assert_eq!(s.calls(), (1, 1), "(reads, writes) to lead with three ways taken");
        s.reset();
        assert!(matches!(acquire(&s, &c, &key(3), 5, 2, 2).unwrap(), Acquire::Held { nonce: 4, .. }));
        assert_eq!(s.calls(), (1, 0), "one read finds the flight");
        assert_eq!(finish(&s, &leases[1], &resp(200), 3, Produced::AtEnd, false).unwrap(), Some(false));
        assert!(renew(&s, &c, &fourth, 3).unwrap());
        for (i, l) in leases.iter().enumerate().filter(|(i, _)| *i != 1) {
            let held = acquire(&s, &c, &key(i as u32), 99, 4, 4).unwrap();
            assert!(matches!(held, Acquire::Held { nonce, .. } if nonce == l.nonce), "way {i}: {held:?}");
        }
        assert!(matches!(read(&s, &leases[1].slot).unwrap().0, State::Done { nonce: 2, .. }));
        assert_eq!(s.inner.key_count(), 1);
    }

    #[test]
    fn garbage_in_a_slot_counts_as_free() {
        let (s, c) = (MemStore::new(), Config::default());
        s.set(&group_of(&c, &key(1)).0, b"L\nnot-a-number", None).unwrap();
        assert!(matches!(acquire(&s, &c, &key(1), 1, 0, 0).unwrap(), Acquire::Acquired(_)));
    }

    /// Many threads race for the same missing, then expired, slot: exactly one wins each
    /// round, including when the CAS counter wraps through the sentinel's neighbourhood.
    #[test]
    fn concurrent_acquire_has_exactly_one_winner() {
        for start in [1, u32::MAX - 40, u32::MAX - 3] {
            let s = Arc::new(MemStore::with_next_cas(start));
            let c = Arc::new(Config::default());
            for round in 0..20u64 {
                let now = round * 10_000; // every round finds the previous lease expired
                let barrier = Arc::new(Barrier::new(8));
                let handles: Vec<_> = (0..8u64)
                    .map(|t| {
                        let (s, c, b) = (s.clone(), c.clone(), barrier.clone());
                        std::thread::spawn(move || {
                            b.wait();
                            acquire(&*s, &c, &key(7), round * 100 + t, now, now).unwrap()
                        })
                    })
                    .collect();
                let results: Vec<Acquire> = handles.into_iter().map(|h| h.join().unwrap()).collect();
                let winners: Vec<u64> = results
                    .iter()
                    .filter_map(|r| match r {
                        Acquire::Acquired(l) => Some(l.nonce),
                        _ => None,
                    })
                    .collect();
                assert_eq!(winners.len(), 1, "start {start} round {round}: {results:?}");
                for r in &results {
                    if let Acquire::Held { nonce, .. } = r {
                        assert_eq!(*nonce, winners[0]);
                    }
                }
            }
        }
    }
}
