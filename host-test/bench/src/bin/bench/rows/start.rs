//! What the plugin costs an Envoy's start: Envoy with `--concurrency 2` started again and
//! again, its edge listener running the plugin or the local-reply floor (the smallest
//! proxy-wasm filter), alternating, each timed from launch to the first answer on that
//! listener. The difference is the plugin's VM start: its module compiled and instantiated
//! for the main thread and each worker, and its configuration read.

use crate::load::PATH;
use crate::report::Report;
use host_test::client::request;
use host_test::envoy::{workspace_root, Envoy, Options};
use host_test::mock::Running;
use std::time::{Duration, Instant};

/// `rounds` starts of each, alternating; the medians and their difference.
pub fn start_rows(r: &mut Report, mock: &Running, rounds: usize, hit_prompt: &str) -> std::io::Result<()> {
    let floor = workspace_root().join("target/floors/wasm32-wasip1/release/floor_reply.wasm");
    let mut floor_opts = Options::new("{}", mock.addr);
    floor_opts.wasm_code = Some(format!("code: {{local: {{filename: \"{}\"}}}}", floor.display()));
    let plugin_opts = Options::new("{}", mock.addr);
    let start = |opts: &Options| -> std::io::Result<Duration> {
        let began = Instant::now();
        let envoy = Envoy::start(opts)?;
        let answer = request(envoy.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
        if answer.status != 200 {
            return Err(std::io::Error::other(format!("the first answer was {}", answer.status)));
        }
        Ok(began.elapsed())
    };
    let (mut plugin, mut floor) = (Vec::new(), Vec::new());
    for _ in 0..rounds.max(1) {
        plugin.push(start(&plugin_opts)?);
        floor.push(start(&floor_opts)?);
    }
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let (plugin, floor) = (median(plugin), median(floor));
    r.note(format!(
        "Envoy start to the first answer, median of {} starts: {:.0} ms with the plugin, {:.0} ms with the \
         local-reply floor: the plugin's VM start {:.0} ms (main thread and 2 workers)",
        rounds.max(1),
        ms(plugin),
        ms(floor),
        ms(plugin) - ms(floor)
    ));
    Ok(())
}
