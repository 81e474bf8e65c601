//! Test and benchmark support for holysheep-edge: the wasmtime hosts (proxy-wasm and
//! wasi:http), a small HTTP/1.1 client, a real Envoy runner and a fleet of them, and the
//! mock HolySheep (its own crate, `holysheep-mock`, so the demos build it alone).

pub mod client;
pub mod component_host;
pub mod envoy;
pub mod etcd;
pub mod fleet;
pub mod limit;
pub mod ports;
pub mod proxy_host;
pub mod serve;
pub mod stack;

pub use holysheep_mock as mock;
