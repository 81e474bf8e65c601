//! Prompt-cache affinity (`BENCH_ONLY=affinity`): 20 tenants, each with a system prompt of
//! its own of about 2,300 tokens, ask 10 questions each under it, through an edge with
//! `prompt_cache_affinity` and through one without, one after the other. The mock spreads
//! its prompt cache over 8 machines (a call with a `prompt_cache_key` goes to its key's
//! machine, one without to a machine its whole body picks). What share of the input tokens
//! HolySheep served from its cache, and what the input cost, at $10 per million tokens
//! ($2.50 from the cache).

use crate::report::Report;
use host_test::client::request;
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use host_test::stack::key_digest;
use serde_json::json;

const TENANTS: usize = 20;
const QUESTIONS: usize = 10;
const MACHINES: u32 = 8;

fn token(tenant: usize) -> String {
    format!("hs-bench-affinity-{tenant:02}")
}

fn config(affinity: bool) -> String {
    let tenants: Vec<String> =
        (0..TENANTS).map(|t| format!(r#""t{t:02}":{{"keys_sha256":["{}"]}}"#, key_digest(&token(t)))).collect();
    format!(
        r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_cached_input":2.5,"usd_per_mtok_output":30,
              "prompt_cache_affinity":{affinity}}}}},"tenants":{{{}}}}}"#,
        tenants.join(",")
    )
}

/// Every tenant's questions through `envoy`: the prompt and cached tokens HolySheep billed.
fn pass(envoy: &Envoy, mock: &Running) -> std::io::Result<(u64, u64)> {
    mock.mock.prompt_cache_machines(MACHINES);
    let before = mock.mock.billed_for("gpt-4.1").len();
    for q in 0..QUESTIONS {
        for t in 0..TENANTS {
            // About 2,300 tokens (four characters a token), each tenant's own.
            let system = format!("Tenant {t:02}'s assistant. ").repeat(400);
            let body = json!({"model":"gpt-4.1","messages":[
                {"role":"system","content":system},{"role":"user","content":format!("question {q} of tenant {t}")}]});
            let auth = format!("Bearer {}", token(t));
            let r = request(
                envoy.edge,
                "POST",
                "/v1/chat/completions",
                &[("authorization", &auth)],
                body.to_string().as_bytes(),
            )?;
            if r.status != 200 {
                return Err(std::io::Error::other(format!("status {}: {}", r.status, r.text())));
            }
        }
    }
    let billed = mock.mock.billed_for("gpt-4.1");
    let (mut prompt, mut cached) = (0, 0);
    for u in &billed[before..] {
        prompt += u["prompt_tokens"].as_u64().unwrap_or(0);
        cached += u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    }
    Ok((prompt, cached))
}

/// The rows (`BENCH_ONLY=affinity`).
pub fn affinity_rows(r: &mut Report) -> std::io::Result<()> {
    let mock = Running::start(Some("sk-bench-affinity"), 0)?;
    let start = |affinity: bool| {
        let mut opts = Options::new(&config(affinity), mock.addr);
        opts.api_key = Some("sk-bench-affinity".into());
        Envoy::start(&opts)
    };
    let (on, off) = (start(true)?, start(false)?);
    println!();
    for (name, envoy) in [("without affinity", &off), ("with affinity", &on)] {
        let (prompt, cached) = pass(envoy, &mock)?;
        // Micro-dollars: $10 per million input tokens, $2.50 for a cached one.
        let cost = (prompt - cached) * 10 + cached * 25 / 10;
        let saved = envoy.stat("wasmcustom.holysheep.gpt-4.1.affinity_saved_microusd");
        r.note(format!(
            "{name}: {} calls, {prompt} input tokens, {cached} from HolySheep's cache ({:.1} %); input cost ${:.4}, \
             ${:.4} saved by the keys the edge set (affinity_saved_microusd)",
            TENANTS * QUESTIONS,
            cached as f64 * 100.0 / prompt.max(1) as f64,
            cost as f64 / 1e6,
            saved as f64 / 1e6,
        ));
    }
    Ok(())
}
