//! Test and benchmark support for holysheep-edge: the mock HolySheep, a small HTTP/1.1
//! client, and a real Envoy runner.

pub mod client;
pub mod component_host;
pub mod envoy;
pub mod fleet;
pub mod mock;
pub mod profile;
pub mod proxy_host;
pub mod serve;
pub mod stack;
