//! What a seed chooses for its run, and the configuration the nodes run with.

use super::etcd::Faults;
use super::rng::Rng;
use crate::core::config::Config;

/// What one seed chose for its run.
#[derive(Debug, Clone)]
pub(crate) struct Scenario {
    pub nodes: u32,
    /// Each node's clock, ahead of (or behind) the fleet's, in milliseconds.
    pub skew_ms: Vec<i64>,
    /// Each tenant's budget for the day, in micro-dollars.
    pub caps: Vec<u64>,
    pub max_attempts: u32,
    /// The share of attempts HolySheep does not answer plainly, in percent.
    pub faulty: u64,
    /// The chance per step that an owner node stops answering for a while, in per mille.
    pub silence: u64,
    /// The chance that a settlement is lost on the way, in percent.
    pub lost: u64,
    /// The share of requests that are streams, in percent.
    pub streams: u64,
    /// The share of requests that ask a prompt asked before (by any tenant), in percent.
    pub repeats: u64,
    /// The semantic tier is on: a leader embeds its question first.
    pub semantic: bool,
    /// The spend store (etcd) keeps the budgets, written every `flush_ms`, with its faults.
    pub store: Option<(u64, Faults)>,
    /// The chance per step that a node is killed (its shared data gone, out of the ring
    /// until it starts again), in per ten thousand.
    pub crashes: u64,
    /// The share of a node's compare-and-swap writes that another worker's write beats,
    /// in percent, and the chance per step of a storm in which every one is beaten, in
    /// per mille.
    pub races: (u64, u64),
    /// gpt-4.1's `tokens_per_minute`, a bucket every tenant shares.
    pub tpm: Option<u64>,
}

impl Scenario {
    pub(crate) fn draw(rng: &mut Rng) -> Scenario {
        let nodes = 1 + rng.below(3) as u32;
        Scenario {
            nodes,
            skew_ms: (0..nodes).map(|_| rng.below(4_001) as i64 - 2_000).collect(),
            // One budget spent within seconds, one within the run, one that lasts.
            caps: vec![5_000 + rng.below(300_000), 300_000 + rng.below(3_000_000), 5_000_000 + rng.below(50_000_000)],
            max_attempts: 1 + rng.below(3) as u32,
            faulty: [0, 10, 40, 90][rng.below(4) as usize],
            silence: if nodes > 1 { rng.below(30) } else { 0 },
            lost: if nodes > 1 { rng.below(20) } else { 0 },
            streams: rng.below(50),
            repeats: rng.below(90),
            semantic: rng.chance(50),
            store: rng.chance(50).then(|| {
                let flush_ms = [50, 250, 1_000][rng.below(3) as usize];
                let faults = Faults { down: rng.below(30), lost: rng.below(30), late: rng.below(50) };
                (flush_ms, faults)
            }),
            crashes: [0, 0, 5, 20][rng.below(4) as usize],
            races: ([0, 0, 5, 30][rng.below(4) as usize], [0, 0, 2][rng.below(3) as usize]),
            tpm: [None, Some(60_000), Some(600_000)][rng.below(3) as usize],
        }
    }

    pub(crate) fn config(&self) -> Result<Config, String> {
        let mut tenants: Vec<String> = self
            .caps
            .iter()
            .enumerate()
            .map(|(i, cap)| {
                let digest = format!("{:064x}", i + 1);
                format!(r#""t{i}":{{"keys_sha256":["{digest}"],"usd_per_day":{}}}"#, *cap as f64 / 1e6)
            })
            .collect();
        // And one with buckets alone, after the budgeted ones: its streams keep the
        // router's retries.
        let n = self.caps.len();
        tenants.push(format!(r#""t{n}":{{"keys_sha256":["{:064x}"],"requests_per_minute":6000}}"#, n + 1));
        let fleet = if self.nodes > 1 {
            format!(r#","fleet":{{"cluster":"owners","nodes":{},"timeout_ms":200}}"#, self.nodes)
        } else {
            String::new()
        };
        let semantic = if self.semantic { r#""semantic":{"enabled":true,"models":["gpt-4.1"]},"# } else { "" };
        let store = match self.store {
            Some((flush_ms, _)) => {
                format!(r#""budget_store":{{"cluster":"etcd","flush_ms":{flush_ms},"timeout_ms":200}},"#)
            }
            None => String::new(),
        };
        let tpm = self.tpm.map_or(String::new(), |t| format!(r#""tokens_per_minute":{t},"#));
        let raw = format!(
            r#"{{{semantic}{store}"models":{{
                "gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8,"requests_per_minute":6000,{tpm}
                    "fallback":["deepseek-v3"]}},
                "deepseek-v3":{{"usd_per_mtok_input":0.27,"usd_per_mtok_output":1.1}},
                "text-embedding-3-small":{{"usd_per_mtok_input":20,"requests_per_minute":600}}}},
              "retry":{{"max_attempts":{},"base_delay_ms":50,"max_delay_ms":500}},
              "upstream":{{"timeout_ms":10000}},"rate_limit":{{"max_wait_ms":1000}},
              "tenants":{{{}}}{fleet}}}"#,
            self.max_attempts,
            tenants.join(",")
        );
        Config::parse(raw.as_bytes()).map_err(|e| format!("the simulator's configuration is refused: {e:?}"))
    }
}
