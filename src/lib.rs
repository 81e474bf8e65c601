//! holysheep-edge: a single-flight response cache for OpenAI-compatible chat completions.
//!
//! `core` is host-agnostic and tested natively; `proxy` is the Envoy proxy-wasm shell.

pub mod core;

#[cfg(all(target_os = "wasi", target_env = "p1"))]
mod proxy;
