//! The wasi:http component on the wasmtime host: its HIT (measured alternating with the
//! plugin's, see `edge::hit_rows`), its followers by the host's clock, and its size.

use crate::report::Report;
use crate::rows::crowd::{follower_delay, Delays};
use crate::stats::Stats;
use host_test::component_host::serve::Serving;
use host_test::envoy::component_path;
use host_test::mock::Running;
use host_test::stack::prompt;

/// The component's HIT row and its ratio to the plugin's, then 200 identical requests on a
/// 300 ms upstream.
pub fn component_rows(
    r: &mut Report,
    component: &Serving,
    mock: &Running,
    (hit, over_plugin): (Stats, f64),
) -> std::io::Result<()> {
    println!();
    r.row("component HIT (wasmtime host)", hit);
    r.ratio("component HIT / Envoy plugin HIT", over_plugin, "goal >= 0.80");
    follower_rows(r, component, mock);
    r.note(format!("component size: {} bytes", std::fs::metadata(component_path())?.len()));
    Ok(())
}

/// 200 identical requests on a 300 ms upstream: how long after the leader each follower
/// was answered.
pub fn follower_rows(r: &mut Report, component: &Serving, mock: &Running) {
    let probe = prompt("component follower delay probe");
    let f = follower_delay(component.addr, mock, (200, &probe), |started| Some(component.answered_since(started)));
    let host = f.server.as_ref().map_or_else(|| "not recorded".to_owned(), Delays::line);
    r.note(format!(
        "component: 200 identical requests (300 ms upstream): {} upstream call(s), {} followers; answered after the leader by the host's clock: {host} (goal p99 <= 50 ms); as the clients saw it: {}",
        f.calls, f.client.followers, f.client.line()
    ));
    if let Some(host) = f.server {
        r.series.push(("component followers".into(), host.sorted_us));
    }
}
