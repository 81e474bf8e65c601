//! `envoy-render local OUT [--config JSON] [--admin-port 9901] [--listen-port 10000]
//! [--direct-port 10001] [--plain-port 10002] [--mock-port 18000] [--wasm PATH]
//! [--direct-body PATH] [--shell plugin|native]`: `envoy/local.yaml.tmpl` for the demo
//! (`--shell native`: the native module in place of the plugin, docs/native.md).
//! `envoy-render fleet OUT --admin-port P --public-port P --owner-port P --owner-ports P,P,...
//! [--config JSON] [--mock-port 18000] [--wasm PATH] [--tls-dir DIR [--peer-san SAN]]`:
//! `envoy/fleet.yaml.tmpl` for one node.
//! `envoy-render edge OUT --admin-port P --public-port P --owner-ports P,P,... [--config JSON]
//! [--wasm PATH] [--tls-dir DIR [--peer-san SAN]]`: `envoy/edge.yaml.tmpl` for an edge node in
//! front of a shield tier. `--tls-dir`: mutual TLS between the nodes with the certificates
//! `envoy/fleet-certs.sh DIR` made (`--peer-san`: their URI SAN, `spiffe://holysheep/fleet`).
//! `envoy-render production-native OUT [--from envoy/production.yaml]`: the production
//! configuration with the native module in place of the plugin (docs/native.md).
//! Run from the repository root (the templates and the default paths are relative to it);
//! `--wasm` defaults to `target/plugin/holysheep_edge.wasm`, `--direct-body` to
//! `.run/direct.json`. The placeholders' meanings are in the library's documentation.

use envoy_render::{EdgeNode, FleetNode, Local, Tls, FLEET_SAN};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn usage() -> ! {
    eprintln!(
        "usage: envoy-render local OUT [--config JSON] [--admin-port N] [--listen-port N] [--direct-port N] \
         [--plain-port N] [--mock-port N] [--wasm PATH] [--direct-body PATH] [--shell plugin|native]\n       \
         envoy-render fleet OUT --admin-port N --public-port N --owner-port N --owner-ports N,N,... \
         [--config JSON] [--mock-port N] [--wasm PATH] [--tls-dir DIR [--peer-san SAN]]\n       \
         envoy-render edge OUT --admin-port N --public-port N --owner-ports N,N,... [--config JSON] [--wasm PATH] \
         [--tls-dir DIR [--peer-san SAN]]\n       \
         envoy-render production-native OUT [--from PATH]"
    );
    std::process::exit(2)
}

fn fail(what: impl std::fmt::Display) -> ! {
    eprintln!("envoy-render: {what}");
    std::process::exit(1)
}

struct Flags(HashMap<String, String>);

impl Flags {
    fn port(&self, name: &str, default: Option<u16>) -> u16 {
        match self.0.get(name) {
            Some(v) => v.parse().unwrap_or_else(|_| fail(format!("--{name} {v} is not a port"))),
            None => default.unwrap_or_else(|| usage()),
        }
    }

    /// An absolute path (Envoy resolves relative paths against its own working directory).
    fn path(&self, name: &str, default: &str) -> PathBuf {
        let p = self.0.get(name).map_or(default, String::as_str);
        std::path::absolute(p).unwrap_or_else(|e| fail(format!("--{name} {p}: {e}")))
    }

    /// A comma-separated list of ports.
    fn ports(&self, name: &str) -> Vec<u16> {
        let list = self.0.get(name).unwrap_or_else(|| usage());
        list.split(',')
            .map(|p| p.trim().parse().unwrap_or_else(|_| fail(format!("--{name}: {p} is not a port"))))
            .collect()
    }

    /// Mutual TLS between the nodes, from `--tls-dir` (and `--peer-san`).
    fn tls(&self) -> Option<Tls> {
        self.0
            .contains_key("tls-dir")
            .then(|| Tls { dir: self.path("tls-dir", ""), san: self.text("peer-san", FLEET_SAN) })
    }

    fn text(&self, name: &str, default: &str) -> String {
        self.0.get(name).cloned().unwrap_or_else(|| default.to_owned())
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(kind), Some(out)) = (args.next(), args.next()) else { usage() };
    let mut flags = HashMap::new();
    while let Some(flag) = args.next() {
        let (Some(name), Some(value)) = (flag.strip_prefix("--"), args.next()) else { usage() };
        flags.insert(name.to_owned(), value);
    }
    let flags = Flags(flags);
    let template = |name: &str| {
        let path = Path::new("envoy").join(name);
        std::fs::read_to_string(&path).unwrap_or_else(|e| fail(format!("{}: {e}", path.display())))
    };
    let config = flags.text("config", "{}");
    let rendered = match kind.as_str() {
        "local" => Local {
            admin_port: flags.port("admin-port", Some(9901)),
            listen_port: flags.port("listen-port", Some(10000)),
            direct_port: flags.port("direct-port", Some(10001)),
            plain_port: flags.port("plain-port", Some(10002)),
            mock_port: flags.port("mock-port", Some(18000)),
            wasm: flags.path("wasm", "target/plugin/holysheep_edge.wasm"),
            direct_body: flags.path("direct-body", ".run/direct.json"),
            config: config.clone(),
        }
        .render(&template("local.yaml.tmpl"))
        .map_err(|e| e.to_string())
        .and_then(|yaml| match flags.text("shell", "plugin").as_str() {
            "plugin" => Ok(yaml),
            "native" => envoy_render::with_native_module(&yaml, &config),
            other => Err(format!("--shell {other}: plugin or native")),
        }),
        "fleet" => FleetNode {
            admin_port: flags.port("admin-port", None),
            public_port: flags.port("public-port", None),
            owner_port: flags.port("owner-port", None),
            owner_ports: flags.ports("owner-ports"),
            mock_port: flags.port("mock-port", Some(18000)),
            wasm: flags.path("wasm", "target/plugin/holysheep_edge.wasm"),
            config: flags.text("config", "{}"),
            tls: flags.tls(),
            forward: None,
        }
        .render(&template("fleet.yaml.tmpl"))
        .map_err(|e| e.to_string()),
        "edge" => EdgeNode {
            admin_port: flags.port("admin-port", None),
            public_port: flags.port("public-port", None),
            owner_ports: flags.ports("owner-ports"),
            wasm: flags.path("wasm", "target/plugin/holysheep_edge.wasm"),
            config: flags.text("config", "{}"),
            tls: flags.tls(),
        }
        .render(&template("edge.yaml.tmpl"))
        .map_err(|e| e.to_string()),
        "production-native" => {
            let from = flags.text("from", "envoy/production.yaml");
            let yaml = std::fs::read_to_string(&from).unwrap_or_else(|e| fail(format!("{from}: {e}")));
            envoy_render::production_native(&yaml)
        }
        _ => usage(),
    };
    let yaml = rendered.unwrap_or_else(|e| fail(e));
    if let Some(dir) = Path::new(&out).parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
    }
    std::fs::write(&out, yaml).unwrap_or_else(|e| fail(format!("{out}: {e}")));
}
