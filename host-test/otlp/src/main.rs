//! `otlp-receiver [ADDR]`: an OTLP/gRPC receiver (traces, logs, metrics) on ADDR
//! (127.0.0.1:4317 by default) that prints each span, log record and metric point as one JSON
//! line as it arrives (`make otel-demo`).

use std::time::Duration;

fn main() -> std::io::Result<()> {
    let at = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:4317".to_owned());
    let receiver = holysheep_otlp::Receiver::start_on(at.parse().map_err(std::io::Error::other)?)?;
    eprintln!("otlp-receiver: listening on {} (OTLP/gRPC)", receiver.addr);
    let mut seen = (0, 0, 0);
    loop {
        let got =
            receiver.wait_for(Duration::from_secs(3600), |g| (g.spans.len(), g.logs.len(), g.points.len()) != seen);
        for s in &got.spans[seen.0..] {
            println!("{}", s.to_json());
        }
        for l in &got.logs[seen.1..] {
            println!("{}", l.to_json());
        }
        for p in &got.points[seen.2..] {
            println!("{}", p.to_json());
        }
        seen = (got.spans.len(), got.logs.len(), got.points.len());
    }
}
