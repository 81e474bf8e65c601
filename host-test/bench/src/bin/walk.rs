//! `make walk`: the walk of one budgeted MISS through the plugin's source files, from the
//! request's headers to the client's answer (the spend settled before it), in the
//! wasmtime host (one worker, no spend store).
//!
//! The plugin is a debug build (nothing inlined away), instrumented by Binaryen's
//! `--log-execution`: every function entry, loop header and return calls the host, which
//! notes the innermost frame that is the plugin crate's own (`Shared::walk`). Each noted
//! function maps to the file that defines it, and runs of the same file fold into one stay.
//! Printed for each build given, by file and again as the shell sees it (the core one room,
//! the shell's host bindings folded into their callers): stays, crossings (stays - 1),
//! re-entries (stays in a room already left before) by room, and the stays in order when
//! they are few.
//!
//! Arguments: one or more instrumented builds, each `NAME=PATH`, and the crate's `src/`
//! (where files are looked up) as `--src DIR` first.

use host_test::proxy_host::state::Headers;
use host_test::proxy_host::world::{Options, Plugin, UpstreamCall, World};
use host_test::stack::{prompt, sha256_hex};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const PATH: &str = "/v1/chat/completions";
/// MISSes sent before the one walked, so that first-call paths are taken before it.
const WARM_UP: u64 = 5;

fn answer(n: u64) -> Option<(Headers, Vec<u8>)> {
    let body = format!(
        r#"{{"id":"chatcmpl-{n}","object":"chat.completion","created":1764489600,"model":"gpt-4.1","choices":[{{"index":0,"message":{{"role":"assistant","content":"A short answer."}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":12,"completion_tokens":9,"total_tokens":21}}}}"#
    );
    Some((
        vec![(":status".into(), "200".into()), ("content-type".into(), "application/json".into())],
        body.into_bytes(),
    ))
}

/// The functions the plugin ran for one budgeted MISS, innermost crate frame at each point.
fn walk(wasm: &Path) -> Vec<String> {
    let plugin = Plugin::load(wasm).expect("the module loads");
    let mut calls = 0;
    let upstream = Box::new(move |_: &UpstreamCall| {
        calls += 1;
        Some((1, answer(calls)))
    });
    let config = format!(
        r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}},
            "tenants":{{"t":{{"keys_sha256":["{}"],"usd_per_day":1000000}}}}}}"#,
        sha256_hex(b"walk")
    );
    let mut options = Options::new(1, &config, 1);
    options.yields = false;
    let mut w = World::start(&plugin, options, upstream).expect("the world starts");
    w.run_until(50, |_| false);
    let send = |w: &mut World, i: u64, walked: bool| {
        if walked {
            w.shared().walk = Some(Vec::new());
        }
        let body = prompt(&format!("walk {i}"));
        let id = w.request(0, "POST", PATH, &[("authorization", "Bearer walk")], body.as_bytes());
        assert!(w.run_until(60_000, |w| w.answer(id).is_some()), "request {i} answered");
        let a = w.take_answer(id).expect("answered");
        assert!(a.status == 200 && a.cache() == "MISS", "request {i}: {} {}", a.status, a.text());
        w.shared().walk.take().unwrap_or_default()
    };
    for i in 0..WARM_UP {
        send(&mut w, i, false);
    }
    send(&mut w, WARM_UP, true)
}

/// The file under `src` that defines the function `name` (a name-section name), if it is
/// the crate's: the longest module path of it that is a file.
fn file_of(src: &Path, name: &str) -> Option<String> {
    let demangled = format!("{:#}", rustc_demangle::demangle(name));
    let at = demangled.find("holysheep_edge::")?;
    let path = &demangled[at + "holysheep_edge::".len()..];
    let mut segments = Vec::new();
    let mut found = None;
    for segment in path.split("::") {
        let segment: String = segment.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if segment.is_empty() {
            break;
        }
        segments.push(segment);
        let joined = segments.join("/");
        for candidate in [format!("{joined}.rs"), format!("{joined}/mod.rs")] {
            if src.join(&candidate).is_file() {
                found = Some(candidate);
            }
        }
    }
    found.or_else(|| Some("lib.rs".to_owned()))
}

/// The proxy shell's bindings to the host: a stay there is folded into its caller's.
const BINDINGS: [&str; 4] = ["proxy/abi.rs", "proxy/host.rs", "proxy/ids.rs", "proxy/types.rs"];

/// Stays in order (runs of one room folded), crossings and re-entries by room.
fn report(title: &str, rooms: impl Iterator<Item = String>) {
    let mut stays: Vec<String> = Vec::new();
    for room in rooms {
        if stays.last() != Some(&room) {
            stays.push(room);
        }
    }
    let mut left = std::collections::BTreeSet::new();
    let mut reentries: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, room) in stays.iter().enumerate() {
        if left.contains(room.as_str()) {
            *reentries.entry(room.as_str()).or_default() += 1;
        }
        if let Some(before) = i.checked_sub(1).map(|b| stays[b].as_str()) {
            left.insert(before);
        }
    }
    let total: usize = reentries.values().sum();
    println!("### {title}\n");
    println!(
        "{} stays; {} crossings; {} re-entries into a room already left\n",
        stays.len(),
        stays.len().saturating_sub(1),
        total
    );
    let mut by_count: Vec<_> = reentries.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    println!("| room | re-entries |\n|---|---|");
    for (room, n) in by_count {
        println!("| {room} | {n} |");
    }
    if stays.len() <= 400 {
        println!("\nstays: {}", stays.join(" > "));
    }
    println!();
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (src, builds) = match args.as_slice() {
        [flag, src, builds @ ..] if flag == "--src" && !builds.is_empty() => (PathBuf::from(src), builds),
        _ => panic!("usage: walk --src SRC_DIR NAME=PLUGIN.wasm ..."),
    };
    for build in builds {
        let (name, wasm) = build.split_once('=').expect("NAME=PATH");
        let functions = walk(Path::new(wasm));
        let files: Vec<String> = functions.iter().filter_map(|f| file_of(&src, f)).collect();
        println!("## {name}: {} points logged\n", functions.len());
        report("by file", files.iter().cloned());
        // The shell's view: the core one room, the host bindings folded into their callers.
        let shell = files.iter().filter(|f| !BINDINGS.contains(&f.as_str()));
        report(
            "the shell's files, the core as one room",
            shell.map(|f| if f.starts_with("core/") { "core".to_owned() } else { f.clone() }),
        );
    }
}
