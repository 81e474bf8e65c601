//! Embeddings beside chat completions, HIT and MISS.

use crate::load::load_on;
use crate::load::{expect_all, load, unique_prompts, Prompts, PATH};
use crate::report::Report;
use crate::stats::{alternate, median, paired, throughput};
use host_test::client::request;
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use host_test::stack::prompt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Embeddings beside chat, alternating in one run on one Envoy: a HIT of each (the same
/// request again), then a MISS of each (distinct requests, the mock answering at once).
pub fn endpoint_rows(
    r: &mut Report,
    mock: &Running,
    rounds: usize,
    (conns, secs): (usize, u64),
) -> std::io::Result<()> {
    const EMBEDDINGS: &str = "/v1/embeddings";
    let envoy = Envoy::start(&Options::new("{}", mock.addr))?;
    let embedding = |text: String| format!(r#"{{"model":"text-embedding-3-small","input":"{text}"}}"#);
    let (chat_hit, embedding_hit) = (prompt("bench: a chat HIT"), embedding("bench: an embeddings HIT".into()));
    request(envoy.edge, "POST", PATH, &[("authorization", "Bearer bench")], chat_hit.as_bytes())?;
    request(envoy.edge, "POST", EMBEDDINGS, &[("authorization", "Bearer bench")], embedding_hit.as_bytes())?;
    let same = |body: &str| -> Prompts {
        let body = body.to_owned();
        Arc::new(move || body.clone())
    };
    let n = Arc::new(AtomicU64::new(0));
    let distinct: Prompts =
        Arc::new(move || embedding(format!("bench embeddings miss {}", n.fetch_add(1, Ordering::Relaxed))));
    let chat_misses = unique_prompts("endpoint rows");
    println!();
    let rows = alternate(
        rounds,
        &mut [
            &mut || expect_all(load(envoy.edge, conns, secs, same(&chat_hit)), "HIT"),
            &mut || expect_all(load_on(envoy.edge, EMBEDDINGS, conns, secs, same(&embedding_hit)), "HIT"),
            &mut || expect_all(load(envoy.edge, conns, secs, chat_misses.clone()), "MISS"),
            &mut || expect_all(load_on(envoy.edge, EMBEDDINGS, conns, secs, distinct.clone()), "MISS"),
        ],
    );
    let [chat_h, emb_h, chat_m, emb_m] = &rows[..] else { unreachable!("four rows") };
    let (hit_ratio, miss_ratio) = (paired(emb_h, chat_h, throughput), paired(emb_m, chat_m, throughput));
    let mut medians = rows.into_iter().map(median);
    r.row("edge HIT, chat completions (paired)", medians.next().expect("a row"));
    r.row("edge HIT, embeddings", medians.next().expect("a row"));
    r.row("edge MISS, chat completions (paired)", medians.next().expect("a row"));
    r.row("edge MISS, embeddings", medians.next().expect("a row"));
    r.ratio("embeddings HIT / chat HIT", hit_ratio, "one intake for every endpoint");
    r.ratio("embeddings MISS / chat MISS", miss_ratio, "the mock's embedding is larger than its chat answer");
    Ok(())
}
