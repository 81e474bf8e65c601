//! A HIT and a MISS with `envoy/production.yaml`'s OpenTelemetry exporters (tracer, access
//! logger, stats sink) sending to a receiver, against the same Envoy configuration without
//! them, alternating in the same run; and with 1% of requests traced (every one still
//! logged). All publish the access-log values (`log_fields`), so the rows compare what
//! Envoy's exporters add. On the plugin, or with `HOLYSHEEP_TEST_SHELL=native` on the native
//! module.

use crate::load::{expect_all, load, unique_prompts, PATH};
use crate::report::Report;
use crate::stats::{alternate, median, paired, throughput};
use holysheep_otlp::Receiver;
use host_test::client::request;
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use std::sync::Arc;

pub fn tracing_rows(
    r: &mut Report,
    mock: &Running,
    rounds: usize,
    (conns, secs): (usize, u64),
    hit_prompt: &str,
) -> std::io::Result<()> {
    let receiver = Receiver::counting()?;
    let config = r#"{"log_fields":true}"#;
    let quiet = Envoy::start(&Options::new(config, mock.addr))?;
    let mut traced = Options::new(config, mock.addr);
    (traced.otel, traced.otel_batched) = (Some(receiver.addr), true);
    let mut sampled = Options::new(config, mock.addr);
    (sampled.otel, sampled.otel_batched, sampled.otel_sampling) = (Some(receiver.addr), true, Some(1.0));
    let traced = Envoy::start(&traced)?;
    let sampled = Envoy::start(&sampled)?;
    for envoy in [&quiet, &traced, &sampled] {
        request(envoy.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    }
    let repeat = |addr| {
        let same = hit_prompt.to_owned();
        expect_all(load(addr, conns, secs, Arc::new(move || same.clone())), "HIT")
    };
    let (quiet_prompts, traced_prompts) = (unique_prompts("untraced miss"), unique_prompts("traced miss"));
    let sampled_prompts = unique_prompts("sampled miss");
    println!();
    let all = alternate(
        rounds,
        &mut [
            &mut || repeat(quiet.edge),
            &mut || repeat(traced.edge),
            &mut || repeat(sampled.edge),
            &mut || expect_all(load(quiet.edge, conns, secs, quiet_prompts.clone()), "MISS"),
            &mut || expect_all(load(traced.edge, conns, secs, traced_prompts.clone()), "MISS"),
            &mut || expect_all(load(sampled.edge, conns, secs, sampled_prompts.clone()), "MISS"),
        ],
    );
    let [hit_r, traced_hit_r, sampled_hit_r, miss_r, traced_miss_r, sampled_miss_r] = &all[..] else {
        unreachable!("six rows")
    };
    let hit_ratio = paired(traced_hit_r, hit_r, throughput);
    let sampled_hit_ratio = paired(sampled_hit_r, hit_r, throughput);
    let miss_ratio = paired(traced_miss_r, miss_r, throughput);
    let sampled_miss_ratio = paired(sampled_miss_r, miss_r, throughput);
    let mut medians = all.into_iter().map(median);
    r.row("edge HIT, no exporters (paired)", medians.next().expect("a row"));
    r.row("edge HIT, OpenTelemetry on", medians.next().expect("a row"));
    r.row("edge HIT, OpenTelemetry on, 1% traced", medians.next().expect("a row"));
    r.row("edge MISS, no exporters (paired)", medians.next().expect("a row"));
    r.row("edge MISS, OpenTelemetry on", medians.next().expect("a row"));
    r.row("edge MISS, OpenTelemetry on, 1% traced", medians.next().expect("a row"));
    r.ratio("HIT with OpenTelemetry / HIT without", hit_ratio, "");
    r.ratio("HIT with OpenTelemetry, 1% traced / HIT without", sampled_hit_ratio, "");
    r.ratio("MISS with OpenTelemetry / MISS without", miss_ratio, "");
    r.ratio("MISS with OpenTelemetry, 1% traced / MISS without", sampled_miss_ratio, "");
    let got = receiver.received();
    r.note(format!(
        "OpenTelemetry rows on the {:?} shell: the receiver (in the bench's process) took {} spans, {} log records and {} \
         metric points in {} export requests",
        host_test::envoy::Shell::of_run(),
        got.counts[0],
        got.counts[1],
        got.counts[2],
        got.exports.iter().sum::<u64>()
    ));
    Ok(())
}
