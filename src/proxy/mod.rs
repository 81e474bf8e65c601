//! The proxy-wasm shell (Envoy, wasm32-wasip1): translates host callbacks into core calls.

mod abi;
mod body_watch;
mod budget_store;
mod counters;
mod fleet;
mod host;
mod http;
mod ids;
mod key_check;
mod root;
mod runs;
mod tee;
mod wake;
mod worker;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(root::Root::new()));
}}
