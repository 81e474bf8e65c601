//! The benchmarks' support: where the time goes, from `perf` recordings.

pub mod profile;
