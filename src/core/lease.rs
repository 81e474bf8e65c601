//! The single-flight lease: one leader per request key across every worker, built on the
//! CAS store. A lease lives in one of `lock.slots` fixed slots and holds the owner's nonce
//! and an expiry; a leader renews it while its call is in flight, so a dead leader is
//! replaced within one lease. When the call ends the owner writes the answer into the slot
//! (`Done`), where the waiters that saw its nonce read it; a `Done` slot is free to take.

use super::cache::Response;
use super::codec;
use super::config::Config;
use super::request::Key;
use super::store::{self, cas_after, CasStore, StoreError};

/// Held by the leader: enough to renew and to finish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub slot_key: String,
    pub key: Key,
    pub nonce: u64,
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
    },
    Done {
        key: String,
        nonce: u64,
        done_at_ms: u64,
        response: Response,
        /// A stale answer (served because every attempt failed), produced at this time.
        stale_from_ms: Option<u64>,
        /// The answer is the cache entry stored at `done_at_ms` (not repeated here:
        /// `response` has no body).
        in_cache: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// We lead.
    Acquired(Lease),
    /// A live leader holds this key in `slot_key`: wait for the flight with this nonce
    /// (`watched`: someone already does).
    Held { nonce: u64, slot_key: String, watched: bool },
    /// Every slot this key may use is leased to other keys (collisions).
    Busy,
    /// A flight on this key finished since the request arrived: its answer is this
    /// request's too (it read the cache just before that flight stored).
    Answered { response: Response, done_at_ms: u64, stale_from_ms: Option<u64>, in_cache: bool },
}

/// CAS races lost in a row before giving up; each loss means someone else made progress.
const MAX_RACES: usize = 16;

/// A key may lead from any of this many consecutive slots from its home slot, so a
/// collision with another prompt in flight does not send every identical request upstream
/// alone.
pub const WAYS: u32 = 4;

/// The slots `key` may lead from, home slot first.
pub fn slot_keys(config: &Config, key: &Key) -> Vec<String> {
    let n = config.lock.slots.max(1);
    let home = key.slot(n, 1);
    (0..WAYS.min(n)).map(|w| store::slot_name("holysheep/lease/", (home + w) % n)).collect()
}

pub fn read(store: &impl CasStore, slot_key: &str) -> Result<(State, Option<u32>), StoreError> {
    let r = store.get(slot_key)?;
    let state = r.value.as_deref().and_then(decode).unwrap_or(State::Free);
    Ok((state, r.cas))
}

/// Takes the lease if the slot is free, expired, or done; reports a live holder, or a
/// flight on this key done at or after `since_ms` (the request's arrival), otherwise.
pub fn acquire(
    store: &impl CasStore,
    config: &Config,
    key: &Key,
    nonce: u64,
    now_ms: u64,
    since_ms: u64,
) -> Result<Acquire, StoreError> {
    let slots = slot_keys(config, key);
    'race: for _ in 0..MAX_RACES {
        // Every way is read before one is taken: a live flight of this key, or its
        // answer, may be in any of them.
        let mut free = None;
        for slot in &slots {
            let r = store.get(slot)?;
            match r.value.as_deref().filter(|v| !is_others_answer(v, key)).and_then(decode) {
                Some(State::Leading { key: k, nonce: n, expires_ms, watched }) if expires_ms > now_ms => {
                    if key.is(&k) {
                        return Ok(Acquire::Held { nonce: n, slot_key: slot.clone(), watched });
                    }
                }
                Some(State::Done { key: k, done_at_ms, response, stale_from_ms, in_cache, .. })
                    if key.is(&k) && done_at_ms >= since_ms =>
                {
                    return Ok(Acquire::Answered { response, done_at_ms, stale_from_ms, in_cache });
                }
                _ => {
                    free.get_or_insert((slot, r));
                }
            }
        }
        let Some((slot, r)) = free else { return Ok(Acquire::Busy) };
        let value = leading(key, nonce, now_ms + config.lock.lease_ms, false);
        // A missing key is inserted whatever CAS we pass; `cas_after` makes the loser of
        // two concurrent inserts see a mismatch (see `store::ABSENT_CAS`). The test-only
        // `broken-lock` build writes without CAS, to prove the harness catches the race.
        let cas = if cfg!(feature = "broken-lock") { None } else { cas_after(&r) };
        match store.set(slot, &value, cas) {
            Ok(()) => {}
            Err(StoreError::CasMismatch) => continue 'race,
            Err(e) => return Err(e),
        }
        let lease = Lease { slot_key: slot.clone(), key: key.clone(), nonce };
        // Two racers may take different ways when a way frees up between their reads: the
        // one in the lower way leads; the other gives its slot back and waits on it.
        for earlier in slots.iter().take_while(|s| *s != slot) {
            if let Ok((State::Leading { key: k, nonce: n, expires_ms, watched }, _)) = read(store, earlier) {
                if key.is(&k) && n != nonce && expires_ms > now_ms {
                    let _ = release(store, &lease);
                    return Ok(Acquire::Held { nonce: n, slot_key: earlier.clone(), watched });
                }
            }
        }
        return Ok(Acquire::Acquired(lease));
    }
    Err(StoreError::CasMismatch)
}

/// Pushes the expiry forward; `false` when the lease is no longer ours.
pub fn renew(store: &impl CasStore, config: &Config, lease: &Lease, now_ms: u64) -> Result<bool, StoreError> {
    let expires_ms = now_ms + config.lock.lease_ms;
    Ok(update_if_owner(store, lease, |watched| leading(&lease.key, lease.nonce, expires_ms, watched))?.is_some())
}

/// Publishes the flight's answer to its waiters and frees the slot. `None` when the lease
/// was lost (expired and taken over), in which case the new leader's flight stands;
/// otherwise whether anyone was waiting on it. `stale_from_ms`: the answer is a stale one,
/// produced then. `in_cache`: the answer was stored in the cache at `now_ms`; the record
/// then refers to it instead of repeating it.
pub fn finish(
    store: &impl CasStore,
    lease: &Lease,
    response: &Response,
    now_ms: u64,
    stale_from_ms: Option<u64>,
    in_cache: bool,
) -> Result<Option<bool>, StoreError> {
    let value = done(&lease.key, lease.nonce, now_ms, response, stale_from_ms, in_cache);
    update_if_owner(store, lease, |_| value.clone())
}

/// Gives the lease up without an answer (a stream that broke off): the slot reads as
/// expired, so a waiter takes it and leads a new flight. `None` when it was not ours.
pub fn release(store: &impl CasStore, lease: &Lease) -> Result<Option<bool>, StoreError> {
    update_if_owner(store, lease, |watched| leading(&lease.key, lease.nonce, 0, watched))
}

/// Marks the flight `nonce` in `slot_key` as waited on, so that its end wakes every
/// worker; a no-op once marked or once the flight is over.
pub fn watch(store: &impl CasStore, slot_key: &str, nonce: u64) -> Result<(), StoreError> {
    for _ in 0..MAX_RACES {
        let r = store.get(slot_key)?;
        let (key, expires_ms) = match r.value.as_deref().and_then(decode) {
            Some(State::Leading { key, nonce: n, expires_ms, watched: false }) if n == nonce => (key, expires_ms),
            _ => return Ok(()),
        };
        let Some(key) = Key::from_hex(&key) else { return Ok(()) };
        match store.set(slot_key, &leading(&key, nonce, expires_ms, true), cas_after(&r)) {
            Ok(()) => return Ok(()),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `value(watched)` if the lease is still ours; `None` when it is not, else
/// whether the flight was watched.
fn update_if_owner(
    store: &impl CasStore,
    lease: &Lease,
    value: impl Fn(bool) -> Vec<u8>,
) -> Result<Option<bool>, StoreError> {
    for _ in 0..MAX_RACES {
        let r = store.get(&lease.slot_key)?;
        let watched = match r.value.as_deref().and_then(decode) {
            Some(State::Leading { nonce, watched, .. }) if nonce == lease.nonce => watched,
            _ => return Ok(None),
        };
        // Only the owner writes a Leading value with this nonce, but a waiter may take the
        // slot over (or mark it watched) between our read and write: the CAS turns that
        // into a re-read.
        match store.set(&lease.slot_key, &value(watched), cas_after(&r)) {
            Ok(()) => return Ok(Some(watched)),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// A leader's record; a watched flight has the body `w`.
fn leading(key: &Key, nonce: u64, expires_ms: u64, watched: bool) -> Vec<u8> {
    let body: &[u8] = if watched { b"w" } else { b"" };
    codec::encode(&["L", key.hex(), &nonce.to_string(), &expires_ms.to_string()], body)
}

fn done(key: &Key, nonce: u64, now_ms: u64, r: &Response, stale_from_ms: Option<u64>, in_cache: bool) -> Vec<u8> {
    let freshness = match (stale_from_ms, in_cache) {
        (Some(t), _) => format!("stale:{t}"),
        (None, true) => "cached".to_owned(),
        (None, false) => "fresh".to_owned(),
    };
    let body: &[u8] = if in_cache && stale_from_ms.is_none() { b"" } else { &r.body };
    codec::encode(
        &[
            "D",
            key.hex(),
            &nonce.to_string(),
            &now_ms.to_string(),
            &r.status.to_string(),
            &codec::field(&r.content_type),
            &codec::headers_field(&r.headers),
            &freshness,
        ],
        body,
    )
}

/// A finished flight of another key: its way is free, and its answer is not decoded.
fn is_others_answer(raw: &[u8], key: &Key) -> bool {
    codec::decode(raw, 2).is_some_and(|(f, _)| f[0] == "D" && !key.is(f[1]))
}

fn decode(raw: &[u8]) -> Option<State> {
    match raw.first()? {
        b'L' => {
            let (f, body) = codec::decode(raw, 4)?;
            Some(State::Leading {
                key: f[1].to_owned(),
                nonce: codec::number(f[2])?,
                expires_ms: codec::number(f[3])?,
                watched: body == b"w",
            })
        }
        b'D' => {
            let (f, body) = codec::decode(raw, 8)?;
            let (stale_from_ms, in_cache) = match f[7].strip_prefix("stale:") {
                Some(t) => (Some(codec::number(t)?), false),
                None if f[7] == "fresh" => (None, false),
                None if f[7] == "cached" => (None, true),
                None => return None,
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
                stale_from_ms,
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
    use crate::core::store::MemStore;
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
        assert_eq!(finish(&s, &lease, &resp(503), 20, None, false).unwrap(), Some(false), "ours, unwatched");
        let (state, _) = read(&s, &lease.slot_key).unwrap();
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
        let Acquire::Held { slot_key, watched: false, .. } = acquire(&s, &c, &key(1), 22, 1, 1).unwrap() else {
            panic!("unwatched at first")
        };
        watch(&s, &slot_key, 11).unwrap();
        assert!(matches!(acquire(&s, &c, &key(1), 33, 2, 2).unwrap(), Acquire::Held { watched: true, .. }));
        assert!(renew(&s, &c, &lease, 3).unwrap());
        assert!(matches!(acquire(&s, &c, &key(1), 44, 4, 4).unwrap(), Acquire::Held { watched: true, .. }));
        watch(&s, &slot_key, 99).unwrap();
        assert_eq!(finish(&s, &lease, &resp(200), 5, None, false).unwrap(), Some(true), "the leader learns it");
        watch(&s, &slot_key, 11).unwrap();
        assert!(matches!(read(&s, &slot_key).unwrap().0, State::Done { .. }), "a finished flight stays finished");
    }

    #[test]
    fn expired_lease_is_taken_over_and_the_old_owner_cannot_finish() {
        let (s, c) = (MemStore::new(), Config::default());
        let Acquire::Acquired(old) = acquire(&s, &c, &key(1), 1, 0, 0).unwrap() else { panic!() };
        assert!(matches!(acquire(&s, &c, &key(1), 2, 4_999, 4_999).unwrap(), Acquire::Held { nonce: 1, .. }));
        let Acquire::Acquired(new) = acquire(&s, &c, &key(1), 2, 5_000, 5_000).unwrap() else { panic!() };
        assert!(!renew(&s, &c, &old, 5_001).unwrap());
        assert_eq!(finish(&s, &old, &resp(200), 5_002, None, false).unwrap(), None, "not ours any more");
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
        let home = keys[0].slot(8, 1);
        let colliding: Vec<&Key> = keys.iter().filter(|k| k.slot(8, 1) == home).take(5).collect();
        assert_eq!(colliding.len(), 5);
        let mut slots = std::collections::HashSet::new();
        for (i, k) in colliding.iter().take(4).enumerate() {
            let Acquire::Acquired(l) = acquire(&s, &c, k, i as u64 + 1, 0, 0).unwrap() else { panic!("way {i}") };
            slots.insert(l.slot_key);
            assert!(
                matches!(acquire(&s, &c, k, 99, 1, 1).unwrap(), Acquire::Held { nonce, .. } if nonce == i as u64 + 1)
            );
        }
        assert_eq!(slots.len(), 4, "four ways");
        assert_eq!(acquire(&s, &c, colliding[4], 5, 0, 0).unwrap(), Acquire::Busy, "all ways taken");
        assert!(s.key_count() <= 8);
    }

    #[test]
    fn a_finished_flight_answers_its_own_key_and_frees_the_way_for_others() {
        let (s, mut c) = (MemStore::new(), Config::default());
        c.lock.slots = 1;
        let Acquire::Acquired(lease) = acquire(&s, &c, &key(1), 1, 0, 0).unwrap() else { panic!() };
        finish(&s, &lease, &resp(200), 10, None, false).unwrap();
        let shared = acquire(&s, &c, &key(1), 2, 11, 5).unwrap();
        assert!(matches!(shared, Acquire::Answered { done_at_ms: 10, .. }), "{shared:?}");
        assert!(matches!(acquire(&s, &c, &key(2), 3, 12, 12).unwrap(), Acquire::Acquired(_)));
    }

    #[test]
    fn garbage_in_a_slot_counts_as_free() {
        let (s, c) = (MemStore::new(), Config::default());
        s.set(&slot_keys(&c, &key(1))[0], b"L\nnot-a-number", None).unwrap();
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
