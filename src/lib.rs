//! holysheep-edge: a single-flight response cache for OpenAI-compatible chat completions.
//!
//! `core` is host-agnostic and tested natively; `proxy` is the Envoy proxy-wasm shell
//! (wasm32-wasip1) and `component` the `wasi:http` component shell (wasm32-wasip2).

pub mod core;

#[cfg(all(target_os = "wasi", target_env = "p1"))]
mod proxy;

#[cfg(all(target_os = "wasi", target_env = "p2"))]
mod component;
