//! holysheep-edge: a single-flight response cache for OpenAI-compatible chat completions.
//!
//! `core` is host-agnostic and tested natively; `proxy` is the Envoy proxy-wasm shell
//! (wasm32-wasip1), `component` the `wasi:http` component shell (wasm32-wasip2) and
//! `native` the Envoy dynamic module (a Linux shared object, the `native` feature).

pub mod core;

#[cfg(all(target_os = "wasi", target_env = "p1"))]
mod proxy;

#[cfg(all(target_os = "wasi", target_env = "p2"))]
mod component;

#[cfg(all(feature = "native", target_os = "linux"))]
mod native;
