//! The edge on the bench's Envoy against its baselines and floors: the HIT, the MISS, a
//! streamed MISS's first event, and a HIT publishing the access-log values.

use crate::floors::Stage;
use crate::load::{expect_all, load, profiled, unique_prompts, Prompts, PATH};
use crate::report::Report;
use crate::stats::Stats;
use crate::stats::{alternate, median, paired, throughput};
use host_test::client::{request, Conn};
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use host_test::stack::{prompt, streamed};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// How each row loads the edge: connections, seconds, and `perf` on Envoy (`pid`) or not.
#[derive(Clone, Copy)]
pub struct Load {
    pub conns: usize,
    pub secs: u64,
    pub pid: Option<u32>,
}

impl Load {
    /// The same prompt again and again.
    fn repeat(self, addr: SocketAddr, body: &str) -> Stats {
        let same = body.to_owned();
        profiled(self.pid, move || load(addr, self.conns, self.secs, Arc::new(move || same.clone())))
    }

    /// A new prompt from `prompts` at every request.
    fn distinct(self, addr: SocketAddr, prompts: &Prompts) -> Stats {
        let prompts = prompts.clone();
        profiled(self.pid, move || load(addr, self.conns, self.secs, prompts))
    }
}

/// The HIT against `direct_response`, the local-reply floor and the floor making the HIT's
/// host calls, alternating with the component's HIT (`component`, not under `perf`), whose
/// median round and ratio to the plugin's HIT it returns.
pub fn hit_rows(
    r: &mut Report,
    stage: &Stage,
    component: SocketAddr,
    (rounds, l): (usize, Load),
    hit_prompt: &str,
) -> (Stats, f64) {
    let direct = r.row("direct_response (baseline)", l.repeat(stage.envoy.direct, hit_prompt));
    let hit_rounds = alternate(
        rounds,
        &mut [
            &mut || l.repeat(stage.floor_reply, hit_prompt),
            &mut || l.repeat(stage.floor_hit_calls, hit_prompt),
            &mut || expect_all(l.repeat(stage.envoy.edge, hit_prompt), "HIT"),
            // Not under perf (BENCH_PROFILE attaches to Envoy only).
            &mut || expect_all(Load { pid: None, ..l }.repeat(component, hit_prompt), "HIT"),
        ],
    );
    let [floor_hit_r, calls_r, hit_r, component_r] = &hit_rounds[..] else { unreachable!("four rows") };
    let hit_over_floor = paired(hit_r, floor_hit_r, throughput);
    let p99_added = paired(hit_r, floor_hit_r, |a, b| (a.p99_us as f64 - b.p99_us as f64) / 1000.0);
    let hit_over_calls = paired(hit_r, calls_r, throughput);
    let calls_over_floor = paired(calls_r, floor_hit_r, throughput);
    let component_over_hit = paired(component_r, hit_r, throughput);
    let mut medians = hit_rounds.into_iter().map(median);
    let floor_hit = r.row("floor: wasm local reply", medians.next().expect("a row"));
    let hit_calls = r.row("floor + the HIT's host calls", medians.next().expect("a row"));
    let hit = r.row("edge HIT", medians.next().expect("a row"));
    let component_stats = medians.next().expect("a row");
    // The floors' ratios pair each round with the other rows' same round (see `paired`).
    println!();
    r.ratio("HIT throughput / local-reply floor", hit_over_floor, "goal >= 0.90");
    r.ratio("HIT p99 added over the floor (ms)", p99_added, "goal <= 0.20");
    r.ratio("HIT throughput / floor with the HIT's host calls", hit_over_calls, "");
    r.ratio("floor with the HIT's host calls / local-reply floor", calls_over_floor, "");
    r.ratio("HIT throughput / direct_response", r.rps(hit) / r.rps(direct), "");
    r.ratio("local-reply floor / direct_response", r.rps(floor_hit) / r.rps(direct), "the ABI's cost");
    r.compare_functions(hit, hit_calls);
    (component_stats, component_over_hit)
}

/// The MISS (distinct prompts) against a plain proxy, the callout floor, the floor making
/// the MISS's host calls and the one also parsing and hashing as a governed MISS must.
pub fn miss_rows(r: &mut Report, stage: &Stage, (rounds, l): (usize, Load)) {
    let plain = r.row("plain proxy to mock (baseline)", l.distinct(stage.envoy.plain, &unique_prompts("plain")));
    // One prompt sequence each for all rounds: a later round must not repeat a prompt.
    let (floor_prompts, miss_prompts) = (unique_prompts("floor"), unique_prompts("miss"));
    let (calls_prompts, work_prompts) = (unique_prompts("floor calls"), unique_prompts("floor work"));
    let miss_rounds = alternate(
        rounds,
        &mut [
            &mut || l.distinct(stage.floor_callout, &floor_prompts),
            &mut || l.distinct(stage.floor_miss_calls, &calls_prompts),
            &mut || l.distinct(stage.floor_miss_work, &work_prompts),
            &mut || expect_all(l.distinct(stage.envoy.edge, &miss_prompts), "MISS"),
        ],
    );
    let [callout_r, miss_calls_r, miss_work_r, miss_r] = &miss_rounds[..] else { unreachable!("four rows") };
    let miss_over_floor = paired(miss_r, callout_r, throughput);
    let miss_over_calls = paired(miss_r, miss_calls_r, throughput);
    let miss_calls_over_floor = paired(miss_calls_r, callout_r, throughput);
    let miss_over_work = paired(miss_r, miss_work_r, throughput);
    let work_over_calls = paired(miss_work_r, miss_calls_r, throughput);
    let mut medians = miss_rounds.into_iter().map(median);
    r.row("floor: wasm callout", medians.next().expect("a row"));
    let miss_calls = r.row("floor + the MISS's host calls", medians.next().expect("a row"));
    let miss_work = r.row("floor + the MISS's calls, parse and hash", medians.next().expect("a row"));
    let miss = r.row("edge MISS (distinct prompts)", medians.next().expect("a row"));
    println!();
    r.ratio("MISS throughput / callout floor", miss_over_floor, "goal >= 0.90");
    r.ratio("MISS throughput / floor with the MISS's host calls", miss_over_calls, "");
    r.ratio("floor with the MISS's host calls / callout floor", miss_calls_over_floor, "");
    r.ratio("MISS throughput / floor with the MISS's calls, parse and hash", miss_over_work, "");
    r.ratio("floor with the calls, parse and hash / floor with the calls", work_over_calls, "");
    r.ratio("MISS throughput / plain proxy", r.rps(miss) / r.rps(plain), "");
    for (a, b) in [(miss, miss_calls), (miss_work, miss_calls), (miss, miss_work)] {
        r.compare_functions(a, b);
    }
}

/// A streamed MISS's first event and whole stream, through the edge and plain proxying,
/// the mock 5 ms between events.
pub fn stream_rows(r: &mut Report, stage: &Stage, mock: &Running) {
    mock.mock.set_event_delay_ms(5);
    let (edge_first, edge_whole) = first_event(stage.envoy.edge, "stream miss", 40);
    let (plain_first, plain_whole) = first_event(stage.envoy.plain, "stream plain", 40);
    mock.mock.set_event_delay_ms(0);
    r.note(format!(
        "streamed MISS, first event (p50): edge {edge_first} us, plain proxy {plain_first} us, ratio {:.2}",
        edge_first as f64 / plain_first.max(1) as f64
    ));
    r.note(format!(
        "streamed MISS, whole stream (p50): edge {edge_whole} us, plain proxy {plain_whole} us (5 ms between events)"
    ));
}

/// HIT publishing the access-log values (`log_fields: true`) against HIT without,
/// alternating in the same run.
pub fn log_field_rows(
    r: &mut Report,
    stage: &Stage,
    mock: &Running,
    (rounds, l): (usize, Load),
    hit_prompt: &str,
) -> std::io::Result<()> {
    let logging = Envoy::start(&Options::new(r#"{"log_fields":true}"#, mock.addr))?;
    request(logging.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    println!();
    let log_rounds = alternate(
        rounds,
        &mut [&mut || expect_all(l.repeat(stage.envoy.edge, hit_prompt), "HIT"), &mut || {
            expect_all(l.repeat(logging.edge, hit_prompt), "HIT")
        }],
    );
    let [quiet_r, logged_r] = &log_rounds[..] else { unreachable!("two rows") };
    let logged_over_quiet = paired(logged_r, quiet_r, throughput);
    let mut medians = log_rounds.into_iter().map(median);
    r.row("edge HIT, no log fields (paired)", medians.next().expect("a row"));
    r.row("edge HIT, log_fields: true", medians.next().expect("a row"));
    r.ratio("HIT with log fields / HIT without", logged_over_quiet, "");
    Ok(())
}

/// `n` distinct streamed prompts one after another to `addr`: the median time from sending
/// the request to the first event, and to the end of the stream, in microseconds.
fn first_event(addr: SocketAddr, tag: &str, n: usize) -> (u64, u64) {
    let (mut first, mut whole) = (Vec::new(), Vec::new());
    for i in 0..n {
        let body = streamed(&prompt(&format!("{tag} {i}")));
        let mut conn = Conn::open(addr).expect("connect");
        let t = Instant::now();
        conn.send_only("POST", PATH, &[("authorization", "Bearer bench")], body.as_bytes()).expect("send");
        conn.read_until("data: ").expect("a first event");
        first.push(t.elapsed().as_micros() as u64);
        conn.read_past_last_chunk().expect("the whole stream");
        whole.push(t.elapsed().as_micros() as u64);
    }
    first.sort_unstable();
    whole.sort_unstable();
    (first[n / 2], whole[n / 2])
}
