//! The built plugin and component on the wasmtime hosts, without Envoy: the proxy-wasm
//! harness (`host_test::proxy_host`), `host-test serve`, and the wasi:http component.

mod component_e2e;
mod races;
mod serve_e2e;
