//! The semantic tier: a deterministic request that missed the exact cache may take the
//! stored answer of a paraphrase. Everything that changes the answer except the last user
//! message's text must match exactly (its `partition`); that text is compared by the cosine
//! similarity of its embedding, which HolySheep's `/v1/embeddings` computes once per
//! flight. The vectors live in bounded shared data, and point at exact cache entries: a
//! semantic answer is never older, nor kept longer, than the exact answer it is.

mod index;
mod vector;

pub use crate::core::request::probe::Probe;
pub use index::{find, Found};
pub(crate) use index::{learn, Similar};
pub(crate) use vector::Vector;
pub use vector::{embedding_body, parse_embedding, Embedding};

use super::api::key::Key;
use super::config::Config;
use crate::core::store::CasStore;

/// The path of the embedding call.
pub const EMBEDDINGS_PATH: &str = "/v1/embeddings";

/// The most bytes of an embedding answer a shell reads (3 072 floats as JSON are about
/// 60 KB).
pub const MAX_EMBEDDING_BYTES: usize = 1024 * 1024;

/// What a flight that looked for a paraphrase keeps for its end: its partition and the
/// question's vector, which join the index once its answer is stored.
#[derive(Debug, Clone)]
pub struct Learned {
    pub partition: [u8; 32],
    pub vector: Vector,
}

/// What a forward node routes a call by (`x-holysheep-key`, hashed on the owners' ring):
/// a request that takes part in the semantic tier goes to its partition's owner, where its
/// paraphrases' vectors are; any other to its key's.
pub fn route(config: &Config, key: &Key, probe: Option<&Probe>) -> String {
    match probe.filter(|_| config.semantic.enabled) {
        Some(p) => p.partition.iter().map(|b| format!("{b:02x}")).collect(),
        None => key.hex().to_owned(),
    }
}

/// After a flight that looked for a paraphrase of its question and found none: the
/// question joins the index once its answer is `stored` under `key`
/// (`Reply::stored_answer`).
pub fn keep(store: &impl CasStore, config: &Config, learned: Option<&Learned>, stored: bool, key: &Key, now_ms: u64) {
    if let Some(l) = learned.filter(|_| stored) {
        learn(store, config, &l.partition, &l.vector, key, now_ms);
    }
}
