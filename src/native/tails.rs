//! The live tails of the flights whose leaders stream, in the process's memory: each is a
//! flight's `Log` (the core's), with the followers to wake when it grows. The leader holds
//! its tail as a `Publisher`, which ends it as cut if dropped unended (the leader's filter
//! gone, or a panic), so that no follower waits on a tail nobody writes. A follower holds
//! the tail it reads until its own stream ends; one that leaves is dropped at the next
//! write. The leader wakes a follower at most once per read it has not made yet.

use super::abi::EnvoyFilter;
use super::host;
use super::wake::{Waker, TAIL};
use crate::core::flight::tail::{Log, Read, Reader, TailEnd};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// Tails live at once, past which a new stream is not shared live (its followers get its
/// whole answer at its end instead).
const MAX_TAILS: usize = 1024;

pub struct Tail {
    state: Mutex<State>,
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

/// The live tail of the flight of `key`, when a follower may begin on it.
pub fn find(key: &str) -> Option<Arc<Tail>> {
    let tail = lock(tails()).get(key).cloned()?;
    let joinable = lock(&tail.state).log.joinable();
    joinable.then_some(tail)
}

impl Tail {
    /// `waker`'s filter follows the tail: woken with `TAIL` when it grows or ends. Its
    /// `due` flag is set while such a wake-up is on its way.
    pub fn follow(&self, waker: &Arc<Waker>) -> Arc<AtomicBool> {
        let due = Arc::new(AtomicBool::new(false));
        lock(&self.state).followers.push(Follower { waker: Arc::downgrade(waker), due: due.clone() });
        due
    }

    /// What was written from `at` on (copied), and the end if it came.
    pub fn since(&self, at: usize) -> (Vec<u8>, Option<TailEnd>) {
        let state = lock(&self.state);
        let (bytes, end) = state.log.since(at);
        (bytes.to_vec(), end)
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
    ended: bool,
}

impl Publisher {
    /// Opens the tail of the flight of `key` (in place of an ended one); `None` when as many
    /// tails as allowed are live.
    pub fn open(key: &str, log: Log) -> Option<Publisher> {
        let tail = Arc::new(Tail { state: Mutex::new(State { log, followers: Vec::new() }) });
        let mut all = lock(tails());
        if all.len() >= MAX_TAILS && !all.contains_key(key) {
            return None;
        }
        all.insert(key.to_owned(), tail.clone());
        Some(Publisher { key: key.to_owned(), tail, ended: false })
    }

    /// HolySheep's next chunk, as it came.
    pub fn push(&self, chunk: &[u8]) {
        self.tail.write(|log| log.push(chunk));
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
    /// Begins: the client gets its head (a COALESCED 200 of events, `extra` beside), then
    /// what the tail holds so far.
    pub fn begin(
        envoy: EnvoyFilter,
        tail: Arc<Tail>,
        waker: &Arc<Waker>,
        reader: Reader,
        extra: Vec<(&'static str, String)>,
    ) -> Following {
        let due = tail.follow(waker);
        host::send_head(envoy, &tail.head(extra));
        Following { tail, due, reader }
    }

    /// Sends the client what the tail holds past what it has; `true` once its stream ended.
    pub fn pump(&mut self, envoy: EnvoyFilter) -> bool {
        self.due.store(false, Ordering::Release);
        let (new, end) = self.tail.since(self.reader.at());
        let Read { bytes, last } = self.reader.read(&new, end);
        if !bytes.is_empty() || last {
            host::send_data(envoy, &bytes, last);
        }
        last
    }
}
