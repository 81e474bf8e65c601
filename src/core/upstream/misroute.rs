//! A stream goes along the host's route with the operator's key only where that route
//! leads to `upstream.cluster`. When a stream's answer comes from another cluster (the
//! route for `upstream.authority` leads elsewhere), the edge refuses it and every stream
//! after it, on every worker, until the configuration changes: the store holds the
//! configuration it happened under.

use crate::core::api::error::ApiError;
use crate::core::api::note::Note;
use crate::core::config::Config;
use crate::core::store::CasStore;

/// Store key that holds the configuration streams are refused under.
const MISROUTED_KEY: &str = "holysheep/streams-misrouted";

/// What the store holds when streams are refused under `config`.
fn latch(config: &Config) -> String {
    format!("{} {}", config.upstream.cluster, config.upstream.authority)
}

/// Whether streams are refused: a stream's answer came from another cluster, on this
/// worker or another, under the same configuration.
pub fn latched(store: &impl CasStore, config: &Config) -> bool {
    store.get(MISROUTED_KEY).is_ok_and(|r| r.value.as_deref() == Some(latch(config).as_bytes()))
}

/// A stream's answer came along a route to another cluster: streams are refused from now
/// on. The line for the log, and the client's error.
pub fn refuse(store: &impl CasStore, config: &Config) -> (Note, ApiError) {
    let _ = store.set(MISROUTED_KEY, latch(config).as_bytes(), None);
    let line = format!(
        "holysheep: a stream went to another cluster than '{}' with the configured key: the route for \
         upstream.authority must lead to it; streams are refused until the configuration changes (or Envoy \
         restarts)",
        config.upstream.cluster
    );
    (Note::Error(line), ApiError::misdirected())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::store::MemStore;

    #[test]
    fn a_misrouted_stream_refuses_streams_until_the_configuration_changes() {
        let (store, config) = (MemStore::new(), Config::default());
        assert!(!latched(&store, &config));
        let (note, e) = refuse(&store, &config);
        assert!(matches!(note, Note::Error(l) if l.contains("'holysheep'")));
        assert_eq!(e.status, ApiError::misdirected().status);
        assert!(latched(&store, &config), "every worker refuses streams now");
        let moved = Config::parse(br#"{"upstream":{"cluster":"other"}}"#).unwrap();
        assert!(!latched(&store, &moved), "a configuration that changes the route ends it");
    }
}
