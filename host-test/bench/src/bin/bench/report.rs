//! What one run measured, printed as it goes and written to `target/bench/`.

use crate::stats::Stats;
use holysheep_bench::profile;
use std::path::Path;

pub fn row(name: &str, s: &Stats) {
    println!("{name:<34} {:>9} {:>11.0} {:>10} {:>10}", s.requests, s.rps, s.p50_us, s.p99_us);
    if let Some(cpu) = &s.cpu {
        let [wasm, envoy, kernel, libs, total] = cpu.per_request_us(s.requests);
        println!("{:<34} Envoy CPU/request: wasm {wasm:.1} us, envoy {envoy:.1}, kernel {kernel:.1}, libs {libs:.1}, total {total:.1}", "");
    }
}

/// What one run measured, printed as it goes and written to `target/bench/`.
#[derive(Default)]
pub struct Report {
    pub rows: Vec<(String, Stats)>,
    pub ratios: Vec<(String, f64, String)>,
    pub notes: Vec<String>,
    pub series: Vec<(String, Vec<u64>)>,
}

impl Report {
    pub fn row(&mut self, name: &str, s: Stats) -> usize {
        row(name, &s);
        self.rows.push((name.to_owned(), s));
        self.rows.len() - 1
    }

    pub fn ratio(&mut self, what: &str, value: f64, goal: &str) {
        println!("{what:<44} {value:>6.2}   {goal}");
        self.ratios.push((what.to_owned(), value, goal.to_owned()));
    }

    pub fn note(&mut self, line: String) {
        println!("{line}");
        self.notes.push(line);
    }

    /// With BENCH_PROFILE=1: how each of Envoy's own functions cost per request in row `a`
    /// against row `b` (see `profile::function_ratios`).
    pub fn compare_functions(&mut self, a: usize, b: usize) {
        let ((a_name, a), (b_name, b)) = (&self.rows[a], &self.rows[b]);
        let (Some(a_cpu), Some(b_cpu)) = (&a.cpu, &b.cpu) else { return };
        let (n, [q1, median, q3]) = profile::function_ratios(a_cpu, a.requests, b_cpu, b.requests, 0.25);
        let line = format!(
            "Envoy's own functions, {a_name} / {b_name}: per-request CPU ratio median {median:.2} \
             (quartiles {q1:.2}, {q3:.2}) over the {n} functions costing the second row >= 0.25 us"
        );
        self.note(line);
    }

    pub fn rps(&self, i: usize) -> f64 {
        self.rows[i].1.rps
    }

    /// Envoy's CPU per request by where it went, for the rows recorded (BENCH_PROFILE=1).
    pub fn profile_table(&self) -> String {
        let mut md = String::new();
        for (name, s) in &self.rows {
            let Some(cpu) = &s.cpu else { continue };
            if md.is_empty() {
                md += "\nEnvoy CPU per request (µs), `perf record` on Envoy during the row:\n\n";
                md += "| scenario | wasm code | Envoy + V8 runtime | kernel | libs | total |\n|---|---:|---:|---:|---:|---:|\n";
            }
            let [wasm, envoy, kernel, libs, total] = cpu.per_request_us(s.requests);
            md += &format!("| {name} | {wasm:.1} | {envoy:.1} | {kernel:.1} | {libs:.1} | {total:.1} |\n");
        }
        md
    }

    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut md = String::from("| scenario | requests | req/s | p50 µs | p99 µs |\n|---|---:|---:|---:|---:|\n");
        for (name, s) in &self.rows {
            md += &format!("| {name} | {} | {:.0} | {} | {} |\n", s.requests, s.rps, s.p50_us, s.p99_us);
        }
        md += &self.profile_table();
        md += "\n| ratio | value | goal |\n|---|---:|---|\n";
        for (what, v, goal) in &self.ratios {
            md += &format!("| {what} | {v:.2} | {goal} |\n");
        }
        md += "\n";
        for n in &self.notes {
            md += &format!("- {n}\n");
        }
        std::fs::write(dir.join("results.md"), md)?;
        let json = serde_json::json!({
            "rows": self.rows.iter().map(|(n, s)| serde_json::json!({
                "name": n, "requests": s.requests, "rps": s.rps, "p50_us": s.p50_us, "p90_us": s.p90_us,
                "p99_us": s.p99_us, "p999_us": s.p999_us,
                "cpu_us_per_request": s.cpu.as_ref().map(|c| c.per_request_us(s.requests)),
            })).collect::<Vec<_>>(),
            "ratios": self.ratios.iter().map(|(w, v, g)| serde_json::json!({"what": w, "value": v, "goal": g})).collect::<Vec<_>>(),
            "series": self.series.iter().map(|(n, d)| serde_json::json!({"name": n, "delays_us": d})).collect::<Vec<_>>(),
        });
        std::fs::write(dir.join("results.json"), serde_json::to_vec_pretty(&json).unwrap_or_default())
    }
}
