//! `make profile`: where a request's time inside the wasm VM goes, for the plugin and the
//! bench floors (`host-test/bench/floors/`: a local reply, the same with a HIT's host calls, a
//! callout, the same with a MISS's host calls (and with its parsing and hashing), a verified
//! tenant's MISS without and with a dollar budget, 64 held requests released by the last,
//! beside the plugin's crowd of 64), run in the wasmtime host (`host_test::proxy_host`,
//! one worker) with a perf map, under `perf record` (cpu-clock). For each row: CPU in
//! compiled wasm per request, proxy-wasm host calls per request (counted by the host), and
//! the wasm functions that took the most samples. Envoy's V8 runs the same module; `make
//! bench` with BENCH_PROFILE=1 gives the same split inside Envoy, without function names
//! (Envoy is stripped and V8 writes no perf map there).
//!
//! Arguments: the plugin built with its names (`make profile` builds it with
//! `CARGO_PROFILE_RELEASE_STRIP=false` into target/profile/ and keeps them through wasm-opt),
//! the floors' directory and, optionally, another build of the plugin to compare (a HIT row
//! and a MISS row: fuel and host calls).
//! PROFILE_REQUESTS: requests per row (default 20000); PROFILE_TOP: functions listed per
//! row (default 12); PROFILE_ONLY: only the rows whose name contains it; TRACE_CROWD=1
//! also traces one batch of the crowd row (every request of it, interleaved). Writes
//! target/bench/profile.md.

use holysheep_bench::profile::{self, Samples, SAMPLE_US};
use host_test::envoy::workspace_root;
use host_test::proxy_host::state::Headers;
use host_test::proxy_host::world::{Options, Plugin, UpstreamCall, World};
use host_test::stack::{prompt, sha256_hex};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const PATH: &str = "/v1/chat/completions";
/// Requests before recording starts (caches warm, first-call paths taken).
const WARM_UP: u64 = 200;
/// Requests of the fuel-metered run (fuel counts are exact; a few suffice).
const FUEL_REQUESTS: u64 = 1_000;

/// An answer shaped like the mock's.
fn answer(n: u64) -> Option<(Headers, Vec<u8>)> {
    let body = format!(
        r#"{{"id":"chatcmpl-{n}","object":"chat.completion","created":1764489600,"model":"gpt-4.1","choices":[{{"index":0,"message":{{"role":"assistant","content":"A short answer of a few words."}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":12,"completion_tokens":9,"total_tokens":21}}}}"#
    );
    let headers: Headers = vec![(":status".into(), "200".into()), ("content-type".into(), "application/json".into())];
    Some((headers, body.into_bytes()))
}

struct Row {
    name: &'static str,
    wasm: PathBuf,
    config: String,
    /// Every request a new prompt (a MISS) or the same one (a HIT).
    distinct: bool,
    /// The `x-holysheep-cache` label every answer must carry (`None` for floors).
    label: Option<&'static str>,
    /// Identical requests sent at once (1: one at a time); in a crowd the first is the
    /// MISS and the others its COALESCED followers.
    crowd: u64,
    /// Shared data put in before the first request: `(key, value)`.
    seed: Option<(String, String)>,
}

struct Measured {
    name: &'static str,
    requests: u64,
    samples: Samples,
    host_calls: BTreeMap<&'static str, u64>,
    /// Fuel per request by export (a second run with a fuel-metering engine).
    fuel: BTreeMap<String, f64>,
    /// One more request's fuel between its host calls (see `spans`).
    trace: Vec<String>,
}

/// A world of one worker running `row`'s module, warmed up; `ask(w, i)` sends request `i`.
fn session(row: &Row, engine: &wasmtime::Config) -> World {
    let plugin = Plugin::load_with(&row.wasm, engine).expect("the module loads");
    let mut calls = 0;
    let upstream = Box::new(move |_: &UpstreamCall| {
        calls += 1;
        // A millisecond of virtual time: a crowd's followers are all waiting by then.
        Some((1, answer(calls)))
    });
    let mut options = Options::new(1, &row.config, 1);
    options.yields = false;
    let mut w = World::start(&plugin, options, upstream).expect("the world starts");
    if let Some((key, value)) = &row.seed {
        w.shared().data.insert(key.clone(), (value.clone().into_bytes(), 1));
    }
    // The first tick registers the worker's queue (the plugin's and the held floor's).
    w.run_until(50, |_| false);
    for i in 0..WARM_UP {
        ask(row, &mut w, i);
    }
    w
}

fn ask(row: &Row, w: &mut World, i: u64) {
    let body = if row.distinct { prompt(&format!("distinct {i}")) } else { prompt("the same prompt") };
    let ids: Vec<_> = (0..row.crowd)
        .map(|_| w.request(0, "POST", PATH, &[("authorization", "Bearer profile")], body.as_bytes()))
        .collect();
    assert!(w.run_until(60_000, |w| ids.iter().all(|id| w.answer(*id).is_some())), "{}: batch {i} answered", row.name);
    for (n, id) in ids.into_iter().enumerate() {
        let a = w.take_answer(id).expect("answered");
        assert_eq!(a.status, 200, "{}: {}", row.name, a.text());
        let label = match row.label {
            Some(_) if row.crowd > 1 && n > 0 => Some("COALESCED"),
            label => label,
        };
        if let Some(label) = label {
            assert!(i < WARM_UP || a.cache() == label, "{}: request {i} was a {}", row.name, a.cache());
        }
    }
}

fn run(row: &Row, requests: u64) -> Measured {
    let mut engine = wasmtime::Config::new();
    engine.profiler(wasmtime::ProfilingStrategy::PerfMap);
    let mut w = session(row, &engine);
    let before = w.shared().host_calls.clone();
    let file = std::env::temp_dir().join(format!("holysheep-wasm-profile-{}.perf", std::process::id()));
    let recording = profile::record(std::process::id(), file).expect("perf record runs (make profile needs perf)");
    let batches = (requests / row.crowd).max(1);
    for i in WARM_UP..WARM_UP + batches {
        ask(row, &mut w, i);
    }
    let samples = recording.finish().expect("perf recorded samples");
    let host_calls = w.shared().host_calls.iter().map(|(n, c)| (*n, c - before.get(n).copied().unwrap_or(0))).collect();

    let mut metered = wasmtime::Config::new();
    metered.consume_fuel(true);
    let mut w = session(row, &metered);
    let before = w.shared().fuel.clone();
    let n = (requests.min(FUEL_REQUESTS) / row.crowd).max(1);
    for i in WARM_UP..WARM_UP + n {
        ask(row, &mut w, i);
    }
    let burnt = w.shared().fuel.clone();
    let per_request = burnt.into_iter().map(|(e, f)| (f.saturating_sub(before.get(&e).copied().unwrap_or(0)), e));
    let answered = (n * row.crowd) as f64;
    let fuel = per_request.map(|(f, e)| (e, f as f64 / answered)).filter(|(_, f)| *f >= 1.0).collect();
    // One request's trace (a crowd's would interleave them all).
    let mut trace = Vec::new();
    if row.crowd == 1 || std::env::var_os("TRACE_CROWD").is_some() {
        w.shared().fuel_trace = Some(Vec::new());
        ask(row, &mut w, WARM_UP + n);
        trace = spans(&w.shared().fuel_trace.take().unwrap_or_default());
    }
    Measured { name: row.name, requests: batches * row.crowd, samples, host_calls, fuel, trace }
}

/// The fuel one request burnt between consecutive host calls, callback by callback:
/// `export: from -> to fuel`.
fn spans(trace: &[(String, &'static str, u64)]) -> Vec<String> {
    trace
        .windows(2)
        .filter(|w| w[0].0 == w[1].0 && w[1].1 != "(called)")
        .map(|w| {
            let export = w[0].0.trim_start_matches("proxy_on_");
            format!(
                "{export}: {} -> {}: {}",
                w[0].1.trim_start_matches("proxy_"),
                w[1].1.trim_start_matches("proxy_"),
                w[0].2.saturating_sub(w[1].2)
            )
        })
        .collect()
}

fn report(rows: &[Measured]) -> String {
    let mut md = String::from(
        "Per request in the wasmtime host (one worker; CPU from cpu-clock samples of 100 µs; fuel is \
         wasmtime's count of wasm operators executed, exact):\n\n\
         | scenario | wasm CPU µs | wasm fuel | fuel by callback | host calls | host calls by name |\n\
         |---|---:|---:|---|---:|---|\n",
    );
    for m in rows {
        let n = m.requests as f64;
        let wasm_us = (m.samples.split.wasm * SAMPLE_US) as f64 / n;
        let total: u64 = m.host_calls.values().sum();
        let by_name: Vec<String> = m
            .host_calls
            .iter()
            .filter(|(_, c)| **c as f64 / n >= 0.05)
            .map(|(name, c)| format!("{} {:.1}", name.trim_start_matches("proxy_"), *c as f64 / n))
            .collect();
        let fuel: f64 = m.fuel.values().sum();
        let by_callback: Vec<String> =
            m.fuel.iter().map(|(e, f)| format!("{} {f:.0}", e.trim_start_matches("proxy_on_"))).collect();
        let _ = writeln!(
            md,
            "| {} | {wasm_us:.1} | {fuel:.0} | {} | {:.1} | {} |",
            m.name,
            by_callback.join(", "),
            total as f64 / n,
            by_name.join(", ")
        );
    }
    let top = std::env::var("PROFILE_TOP").ok().and_then(|v| v.parse().ok()).unwrap_or(12);
    for m in rows {
        let wasm = m.samples.split.wasm.max(1) as f64;
        let _ = write!(md, "\n{}: the wasm functions with the most samples (share of its wasm time)\n\n", m.name);
        for (f, c) in m.samples.wasm_functions.iter().take(top) {
            let _ = writeln!(md, "- {:.1} % `{}`", 100.0 * *c as f64 / wasm, short(f));
        }
    }
    for m in rows {
        let _ = write!(md, "\n{}: one request's fuel between its host calls (callback: from -> to: fuel)\n\n", m.name);
        for span in &m.trace {
            let _ = writeln!(md, "- {span}");
        }
    }
    md
}

/// A tenant's budget record (as the edge writes it without a spend store) listing `n`
/// reservations of other calls, of the host's first day and month, that stay in flight
/// past the run: what a tenant's record holds while it has `n` other calls out.
fn in_flight(n: u64) -> String {
    // The host's clock starts at 1970-01-01: day 0, month 1970 * 12.
    let entries: Vec<String> = (1..=n).map(|id| format!("{}:100:0:23640:9000000000", id * 7_919_000_003)).collect();
    format!("0 {0} 23640 {0}|{1}", n * 100, entries.join(","))
}

/// A symbol without its hash suffix, at most 100 characters.
fn short(symbol: &str) -> String {
    let s = match symbol.rsplit_once("::h") {
        Some((front, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => front,
        _ => symbol,
    };
    s.chars().take(100).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (plugin, floors, other) = match args.as_slice() {
        [_, plugin, floors] => (PathBuf::from(plugin), PathBuf::from(floors), None),
        [_, plugin, floors, other] => (PathBuf::from(plugin), PathBuf::from(floors), Some(PathBuf::from(other))),
        _ => panic!("usage: wasm_profile PLUGIN.wasm FLOORS_DIR [OTHER_BUILD.wasm]"),
    };
    let requests = std::env::var("PROFILE_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let body = answer(0).map(|(_, b)| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    // The load's tenant (`Bearer profile`), without a budget and with one (spend kept per
    // process), as the bench's budget rows.
    let tenant = |budget: &str| {
        format!(
            r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}},
                "tenants":{{"t":{{"keys_sha256":["{}"]{budget}}}}}}}"#,
            sha256_hex(b"profile")
        )
    };
    // The bench's tenants row: the load's key is the first of 1,000 tenants'.
    let thousand_tenants = || {
        let tenants: Vec<String> = (0..1000)
            .map(|i| {
                let token = if i == 0 { "profile".to_owned() } else { format!("profile-tenant-{i}") };
                format!(r#""t{i}":{{"keys_sha256":["{}"]}}"#, sha256_hex(token.as_bytes()))
            })
            .collect();
        format!(r#"{{"tenants":{{{}}}}}"#, tenants.join(","))
    };
    let mut rows = vec![
        Row {
            name: "floor: wasm local reply",
            wasm: floors.join("floor_reply.wasm"),
            config: body.clone(),
            distinct: false,
            label: None,
            crowd: 1,
            seed: None,
        },
        Row {
            name: "floor + the HIT's host calls",
            wasm: floors.join("floor_reply.wasm"),
            config: format!("hit-calls:{body}"),
            distinct: false,
            label: Some("HIT"),
            crowd: 1,
            seed: None,
        },
        Row {
            name: "edge HIT",
            wasm: plugin.clone(),
            config: "{}".into(),
            distinct: false,
            label: Some("HIT"),
            crowd: 1,
            seed: None,
        },
        Row {
            name: "edge HIT, verified tenant among 1,000",
            wasm: plugin.clone(),
            config: thousand_tenants(),
            distinct: false,
            label: Some("HIT"),
            crowd: 1,
            seed: None,
        },
        Row {
            name: "floor: wasm callout",
            wasm: floors.join("floor_callout.wasm"),
            config: "{}".into(),
            distinct: true,
            label: None,
            crowd: 1,
            seed: None,
        },
        Row {
            name: "floor + the MISS's host calls",
            wasm: floors.join("floor_callout.wasm"),
            config: "miss-calls".into(),
            distinct: true,
            label: Some("MISS"),
            crowd: 1,
            seed: None,
        },
        Row {
            name: "floor + the MISS's calls, parse and hash",
            wasm: floors.join("floor_callout.wasm"),
            config: "miss-work".into(),
            distinct: true,
            label: Some("MISS"),
            crowd: 1,
            seed: None,
        },
        Row {
            name: "edge MISS (distinct prompts)",
            wasm: plugin.clone(),
            config: "{}".into(),
            distinct: true,
            label: Some("MISS"),
            crowd: 1,
            seed: None,
        },
        Row {
            name: "edge MISS, tenant without a budget",
            wasm: plugin.clone(),
            config: tenant(""),
            distinct: true,
            label: Some("MISS"),
            crowd: 1,
            seed: None,
        },
        Row {
            name: "edge MISS, budgeted tenant",
            wasm: plugin.clone(),
            config: tenant(r#","usd_per_day":1000000"#),
            distinct: true,
            label: Some("MISS"),
            crowd: 1,
            seed: None,
        },
        Row {
            name: "edge MISS, budgeted tenant, 15 other calls in flight",
            wasm: plugin.clone(),
            config: tenant(r#","usd_per_day":1000000"#),
            distinct: true,
            label: Some("MISS"),
            crowd: 1,
            seed: Some(("holysheep/budget/t".into(), in_flight(15))),
        },
        Row {
            name: "floor: 64 held, released by the last",
            wasm: floors.join("floor_reply.wasm"),
            config: format!("held:64:{body}"),
            distinct: true,
            label: None,
            crowd: 64,
            seed: None,
        },
        Row {
            name: "edge crowd of 64 (1 MISS, 63 COALESCED)",
            wasm: plugin,
            config: "{}".into(),
            distinct: true,
            label: Some("MISS"),
            crowd: 64,
            seed: None,
        },
    ];
    if let Some(other) = other {
        for (name, distinct, label) in
            [("edge HIT, other build", false, "HIT"), ("edge MISS, other build", true, "MISS")]
        {
            let config = "{}".into();
            rows.push(Row { name, wasm: other.clone(), config, distinct, label: Some(label), crowd: 1, seed: None });
        }
    }
    if let Ok(only) = std::env::var("PROFILE_ONLY") {
        rows.retain(|r| r.name.contains(only.as_str()));
    }
    let measured: Vec<Measured> = rows.iter().map(|r| run(r, requests)).collect();
    let md = report(&measured);
    print!("{md}");
    let dir = workspace_root().join("target/bench");
    std::fs::create_dir_all(&dir).expect("target/bench");
    std::fs::write(dir.join("profile.md"), md).expect("profile.md written");
    println!("\nwritten: {}", Path::new(&dir).join("profile.md").display());
}
