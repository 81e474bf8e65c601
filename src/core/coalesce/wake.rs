//! The registry of per-worker wake queues, one bounded shared-data key. Each worker
//! claims a queue name here and keeps a heartbeat; a finished flight wakes every live
//! name. Names come from a fixed set of `MAX_QUEUES`, so a configuration reload reuses the
//! names (and Envoy's queues) of VMs that are gone, which age out: Envoy never frees a
//! queue, and random names would leak one per worker per reload.

use crate::core::store::{cas_after, CasStore, StoreError, MAX_RACES};
use crate::core::wire::{codec, sort};

pub(crate) const REGISTRY_KEY: &str = "holysheep/queues";
/// At most this many names are kept (newest heartbeats first).
pub(crate) const MAX_QUEUES: usize = 64;
/// A worker refreshes its heartbeat this often…
pub const HEARTBEAT_MS: u64 = 1_000;
/// …and a name whose heartbeat is older than this is not woken.
pub(crate) const STALE_MS: u64 = 10_000;

/// Upserts `name` with heartbeat `now_ms`, dropping stale names and the oldest beyond
/// `MAX_QUEUES`.
pub fn publish(store: &impl CasStore, name: &str, now_ms: u64) -> Result<(), StoreError> {
    for _ in 0..MAX_RACES {
        let read = store.get(REGISTRY_KEY)?;
        let mut entries: Vec<(String, u64)> = parse(read.value.as_deref().unwrap_or_default())
            .into_iter()
            .filter(|(n, beat)| n != name && now_ms.saturating_sub(*beat) < STALE_MS)
            .collect();
        entries.push((name.to_owned(), now_ms));
        sort::sort_by(&mut entries, |a, b| a.1 > b.1);
        entries.truncate(MAX_QUEUES);
        let value: String = entries.iter().map(|(n, b)| format!("{n} {b}\n")).collect();
        match store.set(REGISTRY_KEY, value.as_bytes(), cas_after(&read)) {
            Ok(()) => return Ok(()),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// The queue name of slot `i`.
pub(crate) fn name(i: usize) -> String {
    format!("holysheep-wake-{i}")
}

/// Claims the first name no live VM holds, with heartbeat `now_ms`; `None` when all
/// `MAX_QUEUES` names are live.
pub fn claim(store: &impl CasStore, now_ms: u64) -> Result<Option<String>, StoreError> {
    for _ in 0..MAX_RACES {
        let read = store.get(REGISTRY_KEY)?;
        let mut live: Vec<(String, u64)> = parse(read.value.as_deref().unwrap_or_default())
            .into_iter()
            .filter(|(_, beat)| now_ms.saturating_sub(*beat) < STALE_MS)
            .collect();
        let Some(free) = (0..MAX_QUEUES).map(name).find(|n| live.iter().all(|(l, _)| l != n)) else {
            return Ok(None);
        };
        live.push((free.clone(), now_ms));
        let value: String = live.iter().map(|(n, b)| format!("{n} {b}\n")).collect();
        match store.set(REGISTRY_KEY, value.as_bytes(), cas_after(&read)) {
            Ok(()) => return Ok(Some(free)),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// Names with a recent heartbeat.
pub fn live(store: &impl CasStore, now_ms: u64) -> Vec<String> {
    let raw = store.get(REGISTRY_KEY).ok().and_then(|r| r.value).unwrap_or_default();
    parse(&raw).into_iter().filter(|(_, beat)| now_ms.saturating_sub(*beat) < STALE_MS).map(|(n, _)| n).collect()
}

fn parse(raw: &[u8]) -> Vec<(String, u64)> {
    let text = std::str::from_utf8(raw).unwrap_or("");
    text.lines()
        .filter_map(|l| {
            let (n, b) = l.split_once(' ')?;
            Some((n.to_owned(), codec::number(b)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::store::MemStore;

    #[test]
    fn claimed_names_come_from_a_fixed_set_and_are_reused_once_their_vm_is_gone() {
        let s = MemStore::new();
        let first: Vec<String> = (0..3).map(|_| claim(&s, 0).unwrap().unwrap()).collect();
        assert_eq!(first, [name(0), name(1), name(2)], "live names are never handed out twice");
        publish(&s, &name(1), STALE_MS).unwrap();
        // A reload: the old VMs stop beating; the new ones take the freed names again.
        let later = STALE_MS + 1;
        assert_eq!(claim(&s, later).unwrap(), Some(name(0)));
        assert_eq!(claim(&s, later).unwrap(), Some(name(2)));
        assert_eq!(claim(&s, later).unwrap(), Some(name(3)));
        for _ in 4..MAX_QUEUES {
            assert!(claim(&s, later).unwrap().is_some());
        }
        assert_eq!(claim(&s, later).unwrap(), None, "never more than MAX_QUEUES names");
    }

    #[test]
    fn names_are_upserted_aged_out_and_bounded() {
        let s = MemStore::new();
        publish(&s, "a", 0).unwrap();
        publish(&s, "b", 100).unwrap();
        publish(&s, "a", 200).unwrap();
        let mut names = live(&s, 300);
        names.sort();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(live(&s, 100 + STALE_MS), ["a"]);
        for i in 0..200 {
            publish(&s, &format!("q{i}"), 1_000 + i).unwrap();
        }
        let names = live(&s, 1_300);
        assert_eq!(names.len(), MAX_QUEUES);
        assert!(names.contains(&"q199".to_owned()));
        assert_eq!(s.key_count(), 1);
    }
}
