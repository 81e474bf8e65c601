//! Coalescing: one leader per request key across workers. The lease in shared data
//! (`lease`), each worker's wake-up queues (`wake`), and the decision for every request as a
//! value (`engine`): answer now from the cache, call upstream as the leader, or wait for the
//! leader's answer. Uses the cache, the request key and the semantic tier.

pub mod engine;
pub mod lease;
pub mod wake;
