//! The native module against the plugin and Envoy's own floors, each shell in its own Envoy
//! (two workers) on one mock, alternating in one run: a HIT against `direct_response` with
//! the same body, a MISS against a plain proxy to the same mock; then nginx's
//! `proxy_cache` beside the native HIT (`nginx`).

use crate::load::{expect_all, load, unique_prompts, Prompts, PATH};
use crate::report::Report;
use crate::stats::Stats;
use crate::stats::{alternate, median, paired, throughput};
use host_test::client::request;
use host_test::envoy::{Envoy, Options, Shell};
use host_test::mock::Running;
use std::net::SocketAddr;
use std::sync::Arc;

/// The rows (`BENCH_ONLY=native`).
pub fn native_rows(
    r: &mut Report,
    rounds: usize,
    (conns, secs): (usize, u64),
    hit_prompt: &str,
) -> std::io::Result<()> {
    let mock = Running::start(None, 0)?;
    let plugin = Envoy::start(&Options::new("{}", mock.addr))?;
    let auth = [("authorization", "Bearer bench")];
    // The direct_response floor answers with the HIT's own body.
    let answer = request(plugin.edge, "POST", PATH, &auth, hit_prompt.as_bytes())?.body;
    let mut opts = Options::new("{}", mock.addr);
    (opts.shell, opts.direct_body) = (Shell::Native, answer);
    let native = Envoy::start(&opts)?;
    request(native.edge, "POST", PATH, &auth, hit_prompt.as_bytes())?;
    let run = |addr: SocketAddr, body: Prompts, label: &'static str| expect_all(load(addr, conns, secs, body), label);
    // Envoy's own floors label nothing.
    let floor = |addr: SocketAddr, body: Prompts| load(addr, conns, secs, body);
    let same = |body: &str| -> Prompts {
        let body = body.to_owned();
        Arc::new(move || body.clone())
    };
    let misses = [unique_prompts("native miss"), unique_prompts("plugin miss"), unique_prompts("plain")];
    println!();
    let rows: Vec<Vec<Stats>> = alternate(
        rounds,
        &mut [
            &mut || floor(native.direct, same(hit_prompt)),
            &mut || run(native.edge, same(hit_prompt), "HIT"),
            &mut || run(plugin.edge, same(hit_prompt), "HIT"),
            &mut || floor(native.plain, misses[2].clone()),
            &mut || run(native.edge, misses[0].clone(), "MISS"),
            &mut || run(plugin.edge, misses[1].clone(), "MISS"),
        ],
    );
    let [direct, hit, hit_plugin, plain, miss, miss_plugin] = &rows[..] else { unreachable!("six rows") };
    let ratios = [
        ("native HIT / direct_response", paired(hit, direct, throughput)),
        ("plugin HIT / direct_response", paired(hit_plugin, direct, throughput)),
        ("native HIT / plugin HIT", paired(hit, hit_plugin, throughput)),
        ("native MISS / plain proxy", paired(miss, plain, throughput)),
        ("plugin MISS / plain proxy", paired(miss_plugin, plain, throughput)),
        ("native MISS / plugin MISS", paired(miss, miss_plugin, throughput)),
    ];
    let names = [
        "Envoy direct_response (floor)",
        "HIT, native module",
        "HIT, plugin",
        "plain proxy to the mock (floor)",
        "MISS, native module",
        "MISS, plugin",
    ];
    for (name, row) in names.into_iter().zip(rows.into_iter().map(median)) {
        r.row(name, row);
    }
    println!();
    for (what, value) in ratios {
        r.ratio(what, value, "");
    }
    super::nginx::nginx_rows(r, rounds, (conns, secs), hit_prompt)
}
