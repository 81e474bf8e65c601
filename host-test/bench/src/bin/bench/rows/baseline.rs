//! The plugin against another build of itself (`HOLYSHEEP_BASELINE_WASM`, e.g. the previous
//! commit's `target/plugin/holysheep_edge.wasm`), each in its own Envoy on the same mock,
//! alternating in one run: what a change costs a HIT and a MISS.

use crate::load::{expect_all, load, unique_prompts, Prompts, PATH};
use crate::report::Report;
use crate::stats::Stats;
use crate::stats::{alternate, median, paired, throughput};
use host_test::client::request;
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use std::net::SocketAddr;
use std::sync::Arc;

/// The HIT and the MISS of this build against the baseline's. The MISS rows send new prompts
/// throughout, far more than the default cache's 4,096 slots: most of them find their group
/// full, so they measure a MISS into a full cache as much as one into a cache with room.
pub fn baseline_rows(
    r: &mut Report,
    rounds: usize,
    (conns, secs): (usize, u64),
    hit_prompt: &str,
) -> std::io::Result<()> {
    let Some(baseline) = std::env::var_os("HOLYSHEEP_BASELINE_WASM") else {
        return Err(std::io::Error::other(
            "BENCH_ONLY=baseline needs HOLYSHEEP_BASELINE_WASM: the build to compare with",
        ));
    };
    let mock = Running::start(None, 0)?;
    let config = std::env::var("BENCH_BASELINE_CONFIG").unwrap_or_else(|_| "{}".to_owned());
    let this = Envoy::start(&Options::new(&config, mock.addr))?;
    let mut opts = Options::new(&config, mock.addr);
    opts.wasm_code = Some(format!("code: {{local: {{filename: \"{}\"}}}}", baseline.to_string_lossy()));
    let before = Envoy::start(&opts)?;
    for e in [&this, &before] {
        request(e.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    }
    let run = |addr: SocketAddr, body: Prompts, label: &'static str| expect_all(load(addr, conns, secs, body), label);
    let same = |body: &str| -> Prompts {
        let body = body.to_owned();
        Arc::new(move || body.clone())
    };
    let (these, those) = (unique_prompts("this build's miss"), unique_prompts("the baseline's miss"));
    println!();
    let rows: Vec<Vec<Stats>> = alternate(
        rounds,
        &mut [
            &mut || run(this.edge, same(hit_prompt), "HIT"),
            &mut || run(before.edge, same(hit_prompt), "HIT"),
            &mut || run(this.edge, these.clone(), "MISS"),
            &mut || run(before.edge, those.clone(), "MISS"),
        ],
    );
    let [hit, hit_before, miss, miss_before] = &rows[..] else { unreachable!("four rows") };
    let hit_ratio = paired(hit, hit_before, throughput);
    let miss_ratio = paired(miss, miss_before, throughput);
    let mut medians = rows.into_iter().map(median);
    for name in ["HIT, this build", "HIT, baseline build", "MISS, this build", "MISS, baseline build"] {
        r.row(name, medians.next().expect("a row"));
    }
    println!();
    r.ratio("HIT throughput / baseline build's", hit_ratio, "");
    r.ratio("MISS throughput / baseline build's", miss_ratio, "");
    r.note(format!("baseline build: {}", baseline.to_string_lossy()));
    Ok(())
}
