//! `wasi:keyvalue@0.2.0-draft2` store, atomics and batch, in memory, shared by every
//! request the host serves. A CAS handle remembers the version of the key it saw; `swap`
//! succeeds only if the key still has that version, and otherwise hands back a fresh
//! handle, as the draft asks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use wasmtime::component::{Resource, ResourceTable};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit/deps/keyvalue",
        world: "wasi:keyvalue/imports",
        with: {
            "wasi:keyvalue/store.bucket": super::Bucket,
            "wasi:keyvalue/atomics.cas": super::Cas,
        },
    });
}

use bindings::wasi::keyvalue::{atomics, batch, store};

/// Every bucket's keys, with a version per key that changes on every write.
#[derive(Default)]
pub struct Memory {
    inner: Mutex<Inner>,
    /// A swap through a handle taken on a missing key writes whatever is there by then (an
    /// upsert), as Spin's SQLite store does (`INSERT … ON CONFLICT DO UPDATE`), instead of
    /// failing when someone created the key meanwhile.
    swap_upserts: std::sync::atomic::AtomicBool,
    /// With `swap_upserts`: handles taken on a missing key, by key, and their rendezvous.
    missing_handles: Mutex<HashMap<String, usize>>,
    arrived: std::sync::Condvar,
}

#[derive(Default)]
struct Inner {
    map: HashMap<(String, String), (Vec<u8>, u64)>,
    next_version: u64,
}

impl Memory {
    pub fn new() -> Arc<Memory> {
        Arc::new(Memory::default())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many keys the component has written (all buckets).
    /// With `swap_upserts`, a handle taken on a missing key waits (up to 50 ms) for a second
    /// one on the same key: two racers then both hold a handle that saw it missing, the
    /// case an upserting swap gets wrong, instead of relying on the threads to interleave.
    fn meet_on_missing(&self, key: &str) {
        let mut handles = self.missing_handles.lock().unwrap_or_else(|e| e.into_inner());
        *handles.entry(key.to_owned()).or_default() += 1;
        self.arrived.notify_all();
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(50);
        while handles.get(key).is_some_and(|n| n % 2 == 1) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return;
            }
            handles = self.arrived.wait_timeout(handles, left).map_or_else(|e| e.into_inner().0, |(h, _)| h);
        }
    }

    /// Makes a swap on a missing key an upsert from now on (see `swap_upserts`).
    pub fn upsert_missing_keys(&self) {
        self.swap_upserts.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Writes `value` under `key` of `bucket` directly (a state some earlier instance left).
    pub fn put(&self, bucket: &str, key: &str, value: Vec<u8>) {
        self.lock().write(bucket, key, value);
    }

    pub fn key_count(&self) -> usize {
        self.lock().map.len()
    }
}

impl Inner {
    fn write(&mut self, bucket: &str, key: &str, value: Vec<u8>) {
        self.next_version += 1;
        self.map.insert((bucket.to_owned(), key.to_owned()), (value, self.next_version));
    }
}

pub struct Bucket {
    name: String,
}

pub struct Cas {
    bucket: String,
    key: String,
    seen: Option<(Vec<u8>, u64)>,
}

/// The keyvalue part of a request's store data.
pub struct KeyValue<'a> {
    pub memory: &'a Memory,
    pub table: &'a mut ResourceTable,
}

pub fn add_to_linker<T: Send + 'static>(
    linker: &mut wasmtime::component::Linker<T>,
    get: fn(&mut T) -> KeyValue<'_>,
) -> wasmtime::Result<()> {
    bindings::Imports::add_to_linker::<T, HasKeyValue>(linker, get)
}

struct HasKeyValue;

impl wasmtime::component::HasData for HasKeyValue {
    type Data<'a> = KeyValue<'a>;
}

fn other(e: impl std::fmt::Display) -> store::Error {
    store::Error::Other(e.to_string())
}

impl KeyValue<'_> {
    fn bucket(&self, b: &Resource<Bucket>) -> Result<String, store::Error> {
        self.table.get(b).map(|b| b.name.clone()).map_err(other)
    }

    fn snapshot(&mut self, bucket: String, key: String) -> Result<Resource<Cas>, store::Error> {
        let seen = self.memory.lock().map.get(&(bucket.clone(), key.clone())).cloned();
        if seen.is_none() && self.memory.swap_upserts.load(std::sync::atomic::Ordering::SeqCst) {
            self.memory.meet_on_missing(&key);
        }
        self.table.push(Cas { bucket, key, seen }).map_err(other)
    }
}

impl store::Host for KeyValue<'_> {
    fn open(&mut self, identifier: String) -> Result<Resource<Bucket>, store::Error> {
        self.table.push(Bucket { name: identifier }).map_err(other)
    }
}

impl store::HostBucket for KeyValue<'_> {
    fn get(&mut self, b: Resource<Bucket>, key: String) -> Result<Option<Vec<u8>>, store::Error> {
        let name = self.bucket(&b)?;
        Ok(self.memory.lock().map.get(&(name, key)).map(|(v, _)| v.clone()))
    }

    fn set(&mut self, b: Resource<Bucket>, key: String, value: Vec<u8>) -> Result<(), store::Error> {
        let name = self.bucket(&b)?;
        self.memory.lock().write(&name, &key, value);
        Ok(())
    }

    fn delete(&mut self, b: Resource<Bucket>, key: String) -> Result<(), store::Error> {
        let name = self.bucket(&b)?;
        self.memory.lock().map.remove(&(name, key));
        Ok(())
    }

    fn exists(&mut self, b: Resource<Bucket>, key: String) -> Result<bool, store::Error> {
        let name = self.bucket(&b)?;
        Ok(self.memory.lock().map.contains_key(&(name, key)))
    }

    fn list_keys(&mut self, b: Resource<Bucket>, _cursor: Option<String>) -> Result<store::KeyResponse, store::Error> {
        let name = self.bucket(&b)?;
        let keys = self.memory.lock().map.keys().filter(|(n, _)| *n == name).map(|(_, k)| k.clone()).collect();
        Ok(store::KeyResponse { keys, cursor: None })
    }

    fn drop(&mut self, b: Resource<Bucket>) -> wasmtime::Result<()> {
        self.table.delete(b)?;
        Ok(())
    }
}

impl atomics::HostCas for KeyValue<'_> {
    fn new(&mut self, b: Resource<Bucket>, key: String) -> Result<Resource<Cas>, store::Error> {
        let name = self.bucket(&b)?;
        self.snapshot(name, key)
    }

    fn current(&mut self, cas: Resource<Cas>) -> Result<Option<Vec<u8>>, store::Error> {
        Ok(self.table.get(&cas).map_err(other)?.seen.as_ref().map(|(v, _)| v.clone()))
    }

    fn drop(&mut self, cas: Resource<Cas>) -> wasmtime::Result<()> {
        self.table.delete(cas)?;
        Ok(())
    }
}

impl atomics::Host for KeyValue<'_> {
    fn increment(&mut self, b: Resource<Bucket>, key: String, delta: i64) -> Result<i64, store::Error> {
        let name = self.bucket(&b)?;
        let mut inner = self.memory.lock();
        let current = match inner.map.get(&(name.clone(), key.clone())) {
            None => 0,
            Some((v, _)) => {
                let bytes: [u8; 8] = v.as_slice().try_into().map_err(|_| other("the value is not an s64"))?;
                i64::from_le_bytes(bytes)
            }
        };
        let next = current.checked_add(delta).ok_or_else(|| other("increment overflows"))?;
        inner.write(&name, &key, next.to_le_bytes().to_vec());
        Ok(next)
    }

    fn swap(&mut self, cas: Resource<Cas>, value: Vec<u8>) -> Result<(), atomics::CasError> {
        let cas = self.table.delete(cas).map_err(|e| atomics::CasError::StoreError(other(e)))?;
        {
            let mut inner = self.memory.lock();
            let now = inner.map.get(&(cas.bucket.clone(), cas.key.clone())).map(|(_, version)| *version);
            let upsert = cas.seen.is_none() && self.memory.swap_upserts.load(std::sync::atomic::Ordering::SeqCst);
            if upsert || now == cas.seen.as_ref().map(|(_, version)| *version) {
                inner.write(&cas.bucket, &cas.key, value);
                return Ok(());
            }
        }
        let fresh = self.snapshot(cas.bucket, cas.key).map_err(atomics::CasError::StoreError)?;
        Err(atomics::CasError::CasFailed(fresh))
    }
}

impl batch::Host for KeyValue<'_> {
    fn get_many(
        &mut self,
        b: Resource<Bucket>,
        keys: Vec<String>,
    ) -> Result<Vec<Option<(String, Vec<u8>)>>, store::Error> {
        let name = self.bucket(&b)?;
        let inner = self.memory.lock();
        Ok(keys.into_iter().map(|k| inner.map.get(&(name.clone(), k.clone())).map(|(v, _)| (k, v.clone()))).collect())
    }

    fn set_many(&mut self, b: Resource<Bucket>, key_values: Vec<(String, Vec<u8>)>) -> Result<(), store::Error> {
        let name = self.bucket(&b)?;
        let mut inner = self.memory.lock();
        for (k, v) in key_values {
            inner.write(&name, &k, v);
        }
        Ok(())
    }

    fn delete_many(&mut self, b: Resource<Bucket>, keys: Vec<String>) -> Result<(), store::Error> {
        let name = self.bucket(&b)?;
        let mut inner = self.memory.lock();
        for k in keys {
            inner.map.remove(&(name.clone(), k));
        }
        Ok(())
    }
}
