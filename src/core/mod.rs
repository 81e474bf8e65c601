//! The host-agnostic core: request keys, cache, lease and the decisions built on them.
//! Nothing here knows proxy-wasm or WASI; time and nonces are passed in.

pub mod base64;
pub mod batch;
pub mod budget;
pub mod budget_store;
pub mod bytes;
pub mod cache;
pub mod canonical;
pub mod codec;
pub mod config;
pub mod digest;
pub mod edge;
pub mod endpoint;
pub mod engine;
pub mod error;
pub mod flight;
pub mod hot;
pub mod intake;
pub mod json;
pub mod lease;
pub mod limits;
pub mod line;
pub mod log_fields;
pub mod metrics;
pub mod pairs;
pub mod peer;
pub mod priority;
pub mod request;
pub mod semantic;
pub mod store;
pub mod stream;
pub mod tenant_gate;
pub mod tenants;
pub mod upstream;
pub mod usage;
pub mod wake;
