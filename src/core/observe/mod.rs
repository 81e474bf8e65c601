//! What the edge tells its operator: per-model counters and what each event adds to them
//! (`metrics`), the same resolved to a host's metric ids (`meters`), and the per-request
//! fields an access log prints (`log_fields`), and what the log says once of what a node
//! sees change (`notices`). The top
//! floor: it reads every decision below it and decides nothing.

pub mod log_fields;
pub mod meters;
pub mod metrics;
pub mod notices;
