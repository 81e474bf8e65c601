//! The live tails of the flights whose leaders stream, in the process's memory: each is a
//! flight's `Log` (the core's), with the followers to wake when it grows. The leader holds
//! its tail as a `Publisher`, which ends it as cut if dropped unended (the leader's filter
//! gone, or a panic), so that no follower waits on a tail nobody writes. A follower holds
//! the tail it reads until its own stream ends; one that leaves is dropped at the next
//! write. The leader wakes a follower at most once per read it has not made yet. All tails
//! together hold at most `TAILS_PER_LIMIT` times one tail's bound: past that, a leader's
//! tail overflows and its followers that have not begun get the whole answer at its end.

use super::abi::EnvoyFilter;
use super::host;
use super::wake::{Waker, TAIL};
use crate::core::api::usage::Usage;
use crate::core::config::Config;
use crate::core::flight::tail::{Log, Read, Reader, TailEnd};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// Tails live at once, past which a new stream is not shared live (its followers get its
/// whole answer at its end instead).
const MAX_TAILS: usize = 1024;
/// Bytes all tails hold together, in bounds of one tail (`Log::limit`).
const TAILS_PER_LIMIT: usize = 32;

/// Bytes all tails hold now.
static HELD: AtomicUsize = AtomicUsize::new(0);

pub struct Tail {
    state: Mutex<State>,
}

impl Drop for Tail {
    /// Its bytes are the process's again.
    fn drop(&mut self) {
        let bytes = lock(&self.state).log.bytes();
        HELD.fetch_sub(bytes, Ordering::AcqRel);
    }
}

struct State {
    log: Log,
    followers: Vec<Follower>,
}

struct Follower {
    waker: Weak<Waker>,
    due: Arc<AtomicBool>,
}

fn tails() -> &'static Mutex<HashMap<String, Arc<Tail>>> {
    static TAILS: OnceLock<Mutex<HashMap<String, Arc<Tail>>>> = OnceLock::new();
    TAILS.get_or_init(Mutex::default)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `waker`'s filter begins following the live tail of the flight of `key` whose lease is
/// `nonce`, if there is one it may begin on (`Log::joinable`, checked as it joins): the
/// tail, and the flag set while a wake-up (`TAIL`, when it grows or ends) is on its way.
pub fn follow(key: &str, nonce: u64, waker: &Arc<Waker>) -> Option<(Arc<Tail>, Arc<AtomicBool>)> {
    let tail = lock(tails()).get(key).cloned()?;
    let due = Arc::new(AtomicBool::new(false));
    {
        let mut state = lock(&tail.state);
        if !state.log.joinable(nonce) {
            return None;
        }
        state.followers.push(Follower { waker: Arc::downgrade(waker), due: due.clone() });
    }
    Some((tail, due))
}

impl Tail {
    /// The chunks from the `at`th on (shared, not copied), and the end if it came.
    pub fn since(&self, at: usize) -> (Vec<Arc<[u8]>>, Option<TailEnd>) {
        let state = lock(&self.state);
        let (chunks, end) = state.log.since(at);
        (chunks.to_vec(), end)
    }

    /// The head a follower's client gets (see `Log::head`).
    pub fn head(&self, extra: Vec<(&'static str, String)>) -> Vec<(String, String)> {
        lock(&self.state).log.head(extra)
    }

    /// Writes under the lock, then wakes every follower not already due (outside it).
    fn write(&self, f: impl FnOnce(&mut Log)) {
        let woken: Vec<Arc<Waker>> = {
            let mut state = lock(&self.state);
            f(&mut state.log);
            state.followers.retain(|f| f.waker.strong_count() > 0);
            state
                .followers
                .iter()
                .filter(|f| !f.due.swap(true, Ordering::AcqRel))
                .filter_map(|f| f.waker.upgrade())
                .collect()
        };
        for waker in woken {
            waker.wake(TAIL);
        }
    }
}

/// The leader's hold on its flight's tail.
pub struct Publisher {
    key: String,
    tail: Arc<Tail>,
    /// Bytes all tails may hold together.
    room: usize,
    ended: bool,
}

impl Publisher {
    /// Opens the tail of the flight of `key` (in place of an ended one); `None` when as many
    /// tails as allowed are live.
    pub fn open(config: &Config, key: &str, log: Log) -> Option<Publisher> {
        let tail = Arc::new(Tail { state: Mutex::new(State { log, followers: Vec::new() }) });
        let mut all = lock(tails());
        if all.len() >= MAX_TAILS && !all.contains_key(key) {
            return None;
        }
        all.insert(key.to_owned(), tail.clone());
        let room = Log::limit(config).saturating_mul(TAILS_PER_LIMIT);
        Some(Publisher { key: key.to_owned(), tail, room, ended: false })
    }

    /// HolySheep's next chunk, as it came; past the room all tails share, the tail
    /// overflows.
    pub fn push(&self, chunk: &[u8]) {
        let room = self.room;
        self.tail.write(|log| {
            let held = HELD.fetch_add(chunk.len(), Ordering::AcqRel).saturating_add(chunk.len());
            let took = if held > room { 0 } else { log.push(chunk) };
            HELD.fetch_sub(chunk.len() - took, Ordering::AcqRel);
            if took == 0 && !chunk.is_empty() {
                log.overflow();
            }
        });
    }

    /// The stream ended (`complete`: its last byte came).
    pub fn end(mut self, complete: bool) {
        self.close(complete);
    }

    fn close(&mut self, complete: bool) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        self.tail.write(|log| log.end(complete));
        let mut all = lock(tails());
        if all.get(&self.key).is_some_and(|t| Arc::ptr_eq(t, &self.tail)) {
            all.remove(&self.key);
        }
    }
}

impl Drop for Publisher {
    /// A tail its leader let go of unended is cut (an end already there stands).
    fn drop(&mut self) {
        self.close(false);
    }
}

/// A follower reading its flight's tail to its own client.
pub struct Following {
    tail: Arc<Tail>,
    due: Arc<AtomicBool>,
    reader: Reader,
}

impl Following {
    /// Begins on `tail` (see `follow`): the client gets its head (a COALESCED 200 of
    /// events, `extra` beside), then what the tail holds so far.
    pub fn begin(
        envoy: EnvoyFilter,
        (tail, due): (Arc<Tail>, Arc<AtomicBool>),
        reader: Reader,
        extra: Vec<(&'static str, String)>,
    ) -> Following {
        host::send_head(envoy, &tail.head(extra));
        Following { tail, due, reader }
    }

    /// The model that answers its stream.
    pub fn served(&self) -> String {
        lock(&self.tail.state).log.model().to_owned()
    }

    /// The `usage` its stream carried so far.
    pub fn usage(&self) -> Option<Usage> {
        self.reader.usage()
    }

    /// What the client gets next of the tail past what it has (`cut`: its leader is gone
    /// without ending it, so it ends cut here); the caller sends it.
    pub fn next(&mut self, cut: bool) -> Read {
        self.due.store(false, Ordering::Release);
        let (new, end) = self.tail.since(self.reader.at());
        self.reader.read(&new, end.or(cut.then_some(TailEnd::Cut)))
    }
}
