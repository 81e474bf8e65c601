//! `host-test serve --wasm PATH [--config JSON] [--listen ADDR] [--cluster NAME=ADDR]...
//! [--workers N]`: runs the proxy-wasm plugin without Envoy, on the wasmtime host.
//! `host-test serve --component PATH [--config JSON] [--listen ADDR] [--upstream ADDR]`:
//! runs the wasi:http component (an instance serves one request at a time, and then the
//! next), outgoing requests to ADDR.
//! Both see the process environment variable `HOLYSHEEP_API_KEY` when it is set.

use host_test::component_host::serve::{start as start_component, ComponentOptions};
use host_test::serve::{start, ServeOptions};
use std::collections::HashMap;

fn usage() -> ! {
    eprintln!(
        "usage: host-test serve --wasm PATH [--config JSON] [--listen 127.0.0.1:10000] \
         [--cluster holysheep=127.0.0.1:18000]... [--workers 2]\n       \
         host-test serve --component PATH [--config JSON] [--listen 127.0.0.1:10000] \
         [--upstream 127.0.0.1:18000]"
    );
    std::process::exit(2)
}

fn main() {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() != Some("serve") {
        usage();
    }
    let mut opts = ServeOptions {
        wasm: "target/plugin/holysheep_edge.wasm".into(),
        config: "{}".into(),
        listen: ([127, 0, 0, 1], 10000).into(),
        clusters: HashMap::new(),
        workers: 2,
        env: std::env::var("HOLYSHEEP_API_KEY").map(|k| vec![("HOLYSHEEP_API_KEY".to_owned(), k)]).unwrap_or_default(),
    };
    let mut component = None;
    let mut upstream = None;
    while let Some(flag) = args.next() {
        let Some(value) = args.next() else { usage() };
        match flag.as_str() {
            "--component" => component = Some(value.into()),
            "--upstream" => upstream = Some(value.parse().unwrap_or_else(|_| usage())),
            "--wasm" => opts.wasm = value.into(),
            "--config" => opts.config = value,
            "--listen" => opts.listen = value.parse().unwrap_or_else(|_| usage()),
            "--workers" => opts.workers = value.parse().unwrap_or_else(|_| usage()),
            "--cluster" => {
                let Some((name, addr)) = value.split_once('=') else { usage() };
                opts.clusters.insert(name.to_owned(), addr.parse().unwrap_or_else(|_| usage()));
            }
            _ => usage(),
        }
    }
    opts.clusters.entry("holysheep".into()).or_insert(([127, 0, 0, 1], 18000).into());
    let started = match component {
        Some(wasm) => {
            let mut env = opts.env;
            env.push(("HOLYSHEEP_CONFIG".to_owned(), opts.config));
            let upstream = upstream.unwrap_or(([127, 0, 0, 1], 18000).into());
            start_component(ComponentOptions { wasm, listen: opts.listen, upstream, env })
                .map(|s| (s.addr, Box::new(s) as Box<dyn Send>))
        }
        None => start(opts).map(|s| (s.addr, Box::new(s) as Box<dyn Send>)),
    };
    match started {
        Ok((addr, serving)) => {
            println!("holysheep-edge on the wasmtime host: http://{addr}");
            std::thread::park();
            drop(serving);
        }
        Err(e) => {
            eprintln!("host-test serve: {e}");
            std::process::exit(1);
        }
    }
}
