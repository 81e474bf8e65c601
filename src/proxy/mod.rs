//! The proxy-wasm shell (Envoy, wasm32-wasip1): translates host callbacks into core calls.

mod abi;
mod body_watch;
mod budget_store;
mod counters;
mod entry;
mod host;
mod http;
mod ids;
mod root;
mod runs;
mod types;
mod wake;
mod worker;
