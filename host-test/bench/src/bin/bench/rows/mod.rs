//! One file per family of rows; each starts what it measures and adds its rows, ratios and
//! notes to the report.

pub mod affinity;
pub mod baseline;
pub mod budget;
pub mod component;
pub mod crowd;
pub mod edge;
pub mod endpoints;
pub mod fleet;
pub mod learned;
pub mod native;
pub mod nginx;
pub mod priority;
pub mod scan;
pub mod semantic;
pub mod start;
pub mod tail;
pub mod tenants;
pub mod tracing;
