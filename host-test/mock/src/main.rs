//! `mock-holysheep [--listen ADDR] [--latency-ms N]`: the mock HolySheep upstream.
//! `MOCK_API_KEY`, when set, is the bearer key the mock requires.

use holysheep_mock::{start, Mock};

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut listen = "127.0.0.1:18000".to_owned();
    let mut latency_ms = 0;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--listen", Some(v)) => listen = v,
            ("--latency-ms", Some(v)) => latency_ms = v.parse().unwrap_or(0),
            _ => {
                eprintln!("usage: mock-holysheep [--listen ADDR] [--latency-ms N]");
                std::process::exit(2);
            }
        }
    }
    let addr = listen.parse().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mock = Mock::new(std::env::var("MOCK_API_KEY").ok().filter(|k| !k.is_empty()), latency_ms);
    let bound = start(addr, mock).await?;
    println!("mock HolySheep listening on http://{bound}");
    std::future::pending::<()>().await;
    Ok(())
}
