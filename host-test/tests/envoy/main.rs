//! The end-to-end tests in real Envoy (and, beside the streams', the component's streams):
//! one binary, one module per concern. The Envoys they start share the process's limit
//! (`HOLYSHEEP_TEST_ENVOYS`, `host_test::limit`).

mod access_log_e2e;
mod admin_e2e;
mod affinity_e2e;
mod api_e2e;
mod deploy_e2e;
mod edge_e2e;
mod envoy_e2e;
mod fleet_e2e;
mod hostile_e2e;
mod limits_e2e;
mod money_e2e;
mod native_e2e;
mod never_down;
mod otel_e2e;
mod priority_e2e;
mod production_e2e;
mod prometheus_e2e;
mod sdk_streams_e2e;
mod semantic_e2e;
mod store_e2e;
mod stream_e2e;
mod tail_e2e;
mod tenants_e2e;
mod trust_e2e;
