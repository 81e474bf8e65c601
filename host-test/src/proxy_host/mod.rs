//! A wasmtime host of the proxy-wasm ABI that behaves like Envoy where it matters, for
//! deterministic race tests and for running the plugin without Envoy (`serve`).

pub mod abi;
pub mod state;
pub mod world;
