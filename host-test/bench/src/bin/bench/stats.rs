//! Rounds into numbers: rows alternate round by round (the machine's noise hits all alike),
//! a row's line is its median round, and a ratio of two rows the median of their rounds'
//! ratios.

use holysheep_bench::profile::Split;

/// What a row measured.
pub struct Stats {
    pub requests: usize,
    pub rps: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub labels: Vec<String>,
    /// Envoy's CPU during the row, with BENCH_PROFILE=1.
    pub cpu: Option<Split>,
}

/// The `p` quantile of sorted values (0 when there are none).
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    let at = ((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(at).copied().unwrap_or(0)
}

/// Runs the rows one after another, `rounds` times over (the machine's noise hits all
/// alike); every row's rounds, in order.
pub fn alternate(rounds: usize, rows: &mut [&mut dyn FnMut() -> Stats]) -> Vec<Vec<Stats>> {
    let mut runs: Vec<Vec<Stats>> = rows.iter().map(|_| Vec::new()).collect();
    for _ in 0..rounds.max(1) {
        for (row, run) in rows.iter_mut().zip(&mut runs) {
            run.push(row());
        }
    }
    runs
}

/// `of(a, b)` for the two rows' rounds taken side by side (round i of one against round i
/// of the other, measured a few seconds apart), the median of those.
pub fn paired<T>(a: &[T], b: &[T], of: impl Fn(&T, &T) -> f64) -> f64 {
    let mut values: Vec<f64> = a.iter().zip(b).map(|(a, b)| of(a, b)).collect();
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

pub fn throughput(a: &Stats, b: &Stats) -> f64 {
    a.rps / b.rps.max(f64::MIN_POSITIVE)
}

/// The row's median round by throughput.
pub fn median(mut rounds: Vec<Stats>) -> Stats {
    rounds.sort_by(|x, y| x.rps.total_cmp(&y.rps));
    rounds.swap_remove(rounds.len() / 2)
}
