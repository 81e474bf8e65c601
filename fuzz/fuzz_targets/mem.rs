//! Envoy's shared data in memory for the fuzz targets: one map, one global version counter.

use holysheep_edge::core::store::{CasStore, Read, StoreError};
use std::cell::RefCell;
use std::collections::HashMap;

#[derive(Default)]
pub struct Mem(RefCell<(HashMap<String, (Vec<u8>, u32)>, u32)>);

impl CasStore for Mem {
    fn get(&self, key: &str) -> Result<Read, StoreError> {
        let inner = self.0.borrow();
        Ok(match inner.0.get(key) {
            Some((v, cas)) => Read { value: Some(v.clone()), cas: Some(*cas) },
            None => Read::default(),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut inner = self.0.borrow_mut();
        let current = inner.0.get(key).map(|(_, c)| *c);
        if matches!((current, cas), (Some(now), Some(c)) if c != 0 && c != now) {
            return Err(StoreError::CasMismatch);
        }
        inner.1 = inner.1.wrapping_add(1).max(1);
        let version = inner.1;
        inner.0.insert(key.to_owned(), (value.to_vec(), version));
        Ok(())
    }
}
