//! `make bench` (`cargo run --profile host -p holysheep-bench --bin bench`): numbers for holysheep-edge, all
//! measured in one run on this machine against baselines served by the same Envoy:
//! - HIT vs Envoy's own `direct_response` with the same body;
//! - MISS (distinct prompts) vs plain Envoy proxying to the mock;
//! - how long coalesced followers trail their leader;
//! - time to the first event of a streamed MISS through the edge vs plain proxying;
//! - a fleet node (`envoy/fleet.yaml.tmpl`, one node): HIT on the owner listener vs HIT
//!   from the forward listener's near copy vs HIT through the forward hop (a node without
//!   near copies), alternating;
//! - floors: minimal proxy-wasm filters (`host-test/bench/floors/`: a local reply, the same
//!   making the HIT's host calls and sending its headers, a callout, the same making the
//!   MISS's host calls and sending its headers, the same also parsing and hashing the
//!   request and parsing the answer as any governed MISS must) measured beside the plugin, with the
//!   goals (printed beside each) as ratios; and the followers' floor: a crowd of requests held until
//!   the last arrives, then released on every worker, alternating with the plugin's crowds;
//! - the wasi:http component on the wasmtime host (running beside Envoy): HIT, alternating
//!   with the plugin's HIT rounds, vs the Envoy plugin's HIT; its
//!   (polling) followers;
//! - a critical request's wait behind a backlog of sheddable ones (BENCH_BACKLOG, default
//!   1000), with priority classes and in one first-come line (every request standard);
//! - the semantic tier (its own Envoy beside one without it): a MISS with the tier on
//!   (embedding, lookup, learning) vs an exact MISS, and a SEMANTIC answer (a paraphrase:
//!   exact miss, embedding, lookup) vs an exact HIT, the lookup over a partition of one
//!   question vs a full page of 64;
//! - the cache under a scan (each on its own Envoy): a hot set's HITs after another tenant's
//!   scan, and a Zipf(1.1) workload's hit rate and calls with and without a scan before it;
//! - the plugin's and the component's sizes.
//!
//! Options (environment): BENCH_SECONDS (default 3), BENCH_CONNECTIONS (default 16),
//! BENCH_ROUNDS (default 5: floor and plugin rows alternate; a row's median round is its
//! line, and a ratio of two alternating rows is the median of their rounds' ratios),
//! BENCH_ONLY=<family> (only that family's rows, into target/bench/<family>/: priority,
//! budget, tenants, endpoints, semantic, scan, fleet, crowd, miss (the MISS against its
//! floors), start (the plugin's VM start: Envoy started with it and with the local-reply
//! floor, alternating), component (the wasi:http component's followers), and baseline: the HIT and
//! the MISS against another build of the plugin named by HOLYSHEEP_BASELINE_WASM, in its
//! own Envoy), native (the native module against the plugin, `direct_response` and a plain
//! proxy; then nginx's proxy_cache beside its HIT, also alone as nginx), tail (live tails: 100 followers of a streamed MISS, native module and plugin),
//! learned (HolySheep's limits learned from its headers: a load at twice the mock's limit
//! through the edge and through a plain proxy, HolySheep's 429s after its first answer),
//! affinity (prompt-cache affinity: 20 tenants' questions under their own long system
//! prompts with it and without it, the cached input share and the input's cost),
//! BENCH_CROWD (default 1000 identical requests for the follower delay), BENCH_CROWD_ROUNDS
//! (default 3 crowds for the plugin and as many for the floor, alternating), BENCH_PROFILE=1
//! (`perf record` on Envoy during each Envoy row: CPU per request in the filter's wasm code,
//! in Envoy itself and in the kernel; see `holysheep_bench::profile`).
//!
//! By job: `load` (connections sending requests), `stats` (rounds into medians and ratios),
//! `report` (printed and written), `floors` (the bench's Envoy), `rows/` (one file per
//! family of rows).

mod floors;
mod load;
mod report;
mod rows;
mod stats;

use floors::Stage;
use host_test::client::request;
use host_test::component_host::serve::{start as start_component, ComponentOptions};
use host_test::envoy::{component_path, wasm_path, workspace_root};
use host_test::mock::Running;
use host_test::stack::prompt;
use load::PATH;
use report::Report;
use rows::edge::Load;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> std::io::Result<()> {
    host_test::envoy::kill_envoys_on_panic();
    let secs = env_or("BENCH_SECONDS", 3);
    let conns = env_or("BENCH_CONNECTIONS", 16) as usize;
    let crowd = env_or("BENCH_CROWD", 1000) as usize;
    let rounds = env_or("BENCH_ROUNDS", 5) as usize;
    let only = std::env::var("BENCH_ONLY").ok();
    if let Some(family) = only.as_deref().filter(|f| !["crowd", "miss"].contains(f)) {
        let mut r = Report::default();
        let mock = Running::start(None, 0)?;
        match family {
            "priority" => rows::priority::backlog_rows(&mut r)?,
            "budget" => {
                rows::budget::budget_rows(&mut r, &mock, rounds, (conns, secs), &prompt("bench: a budgeted HIT"))?
            }
            "tenants" => {
                rows::tenants::tenant_rows(&mut r, &mock, rounds, (conns, secs), &prompt("bench: a tenant's HIT"))?
            }
            "endpoints" => rows::endpoints::endpoint_rows(&mut r, &mock, rounds, (conns, secs))?,
            "semantic" => rows::semantic::semantic_rows(&mut r, rounds, (conns, secs))?,
            "fleet" => rows::fleet::fleet_rows(&mut r, rounds, (conns, secs), &prompt("benchmark prompt"))?,
            "component" => {
                let component = start_component(ComponentOptions {
                    wasm: component_path(),
                    listen: ([127, 0, 0, 1], 0).into(),
                    upstream: mock.addr,
                    env: vec![("HOLYSHEEP_CONFIG".to_owned(), "{}".to_owned())],
                })?;
                rows::component::follower_rows(&mut r, &component, &mock);
            }
            "baseline" => rows::baseline::baseline_rows(&mut r, rounds, (conns, secs), &prompt("benchmark prompt"))?,
            "native" => rows::native::native_rows(&mut r, rounds, (conns, secs), &prompt("benchmark prompt"))?,
            "start" => rows::start::start_rows(&mut r, &mock, rounds, &prompt("benchmark prompt"))?,
            "tail" => rows::tail::tail_rows(&mut r, rounds)?,
            "learned" => rows::learned::learned_rows(&mut r)?,
            "affinity" => rows::affinity::affinity_rows(&mut r)?,
            "nginx" => rows::nginx::nginx_rows(&mut r, rounds, (conns, secs), &prompt("benchmark prompt"))?,
            "scan" => rows::scan::scan_rows(&mut r)?,
            "tracing" => {
                rows::tracing::tracing_rows(&mut r, &mock, rounds, (conns, secs), &prompt("benchmark prompt"))?
            }
            other => return Err(std::io::Error::other(format!("BENCH_ONLY={other}: no such family of rows"))),
        }
        return r.write(&workspace_root().join("target/bench").join(family));
    }
    let wasm_bytes = std::fs::metadata(wasm_path())?.len();
    let mock = Running::start(None, 0)?;
    let hit_prompt = prompt("benchmark prompt");
    let stage = Stage::start(&mock, crowd, &hit_prompt)?;
    if only.as_deref() == Some("miss") {
        let mut r = Report::default();
        let pid = (env_or("BENCH_PROFILE", 0) == 1).then(|| stage.envoy.pid());
        rows::edge::miss_rows(&mut r, &stage, (rounds, Load { conns, secs, pid }));
        return r.write(&workspace_root().join("target/bench/miss"));
    }
    if only.is_some() {
        let mut r = Report::default();
        rows::crowd::crowd_rows(&mut r, &stage, &mock, (crowd, &hit_prompt));
        return r.write(&workspace_root().join("target/bench/crowd"));
    }
    // The component host runs beside Envoy (idle while the other is measured), so that its
    // HIT alternates with the plugin's in the same rounds.
    let component = start_component(ComponentOptions {
        wasm: component_path(),
        listen: ([127, 0, 0, 1], 0).into(),
        upstream: mock.addr,
        env: vec![("HOLYSHEEP_CONFIG".to_owned(), "{}".to_owned())],
    })?;
    request(component.addr, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;

    let mut r = Report::default();
    println!(
        "holysheep-edge bench: Envoy 1.40 --concurrency 2, {conns} keep-alive connections, {secs}s per row; \
         floors and the plugin alternate, median of {rounds} rounds"
    );
    println!("{:<34} {:>9} {:>11} {:>10} {:>10}", "scenario", "requests", "req/s", "p50 us", "p99 us");
    let pid = (env_or("BENCH_PROFILE", 0) == 1).then(|| stage.envoy.pid());
    let l = Load { conns, secs, pid };
    let component_hit = rows::edge::hit_rows(&mut r, &stage, component.addr, (rounds, l), &hit_prompt);
    rows::edge::miss_rows(&mut r, &stage, (rounds, l));
    rows::crowd::crowd_rows(&mut r, &stage, &mock, (crowd, &hit_prompt));
    r.note(format!("plugin size: {wasm_bytes} bytes (goal <= 614400, 600 KiB)"));
    rows::edge::stream_rows(&mut r, &stage, &mock);
    rows::tenants::tenant_rows(&mut r, &mock, rounds, (conns, secs), &hit_prompt)?;
    rows::edge::log_field_rows(&mut r, &stage, &mock, (rounds, l), &hit_prompt)?;
    rows::tracing::tracing_rows(&mut r, &mock, rounds, (conns, secs), &hit_prompt)?;
    rows::budget::budget_rows(&mut r, &mock, rounds, (conns, secs), &hit_prompt)?;
    rows::endpoints::endpoint_rows(&mut r, &mock, rounds, (conns, secs))?;
    rows::priority::backlog_rows(&mut r)?;
    drop(stage);
    rows::scan::scan_rows(&mut r)?;
    rows::semantic::semantic_rows(&mut r, rounds, (conns, secs))?;
    rows::fleet::fleet_rows(&mut r, rounds, (conns, secs), &hit_prompt)?;
    rows::component::component_rows(&mut r, &component, &mock, component_hit)?;
    rows::start::start_rows(&mut r, &mock, rounds, &hit_prompt)?;
    rows::native::native_rows(&mut r, rounds, (conns, secs), &hit_prompt)?;
    rows::tail::tail_rows(&mut r, rounds)?;
    let dir = workspace_root().join("target/bench");
    r.write(&dir)?;
    println!("\nwritten: {}/results.md, results.json", dir.display());
    Ok(())
}
