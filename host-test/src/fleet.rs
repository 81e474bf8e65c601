//! A fleet of real Envoys on one machine, rendered from `envoy/fleet.yaml.tmpl`: each node
//! has a public listener (filter role `forward`) and an owner listener (role `owner`), and
//! every node's `owners` ring holds every owner listener. One mock HolySheep behind them.

use crate::client;
use crate::envoy::{wasm_path, workspace_root, Envoy};
use crate::limit::Slots;
use crate::mock::Running;
use crate::stack::poll_until;
use std::io;
use std::net::{SocketAddr, TcpListener};

/// The shared secret of the test fleet's internal calls.
pub const SECRET: &str = "fleet-secret-for-tests";

pub struct Node {
    pub envoy: Envoy,
    pub public: SocketAddr,
    pub owner: SocketAddr,
}

pub struct Fleet {
    pub mock: Running,
    /// `None` once a node was killed.
    pub nodes: Vec<Option<Node>>,
    /// Slots of the process's limit ([`crate::limit`]) for all the nodes, released after
    /// they stopped.
    _slots: Slots,
}

/// A port free right now (the fleet's nodes must know each other's ports beforehand).
fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The configurations of a node's two listeners (one meaning for the demo, the tests and
/// the bench: see `envoy_render`).
pub use envoy_render::listener_configs;

/// `envoy/fleet.yaml.tmpl` for one node.
pub fn render(ports: (u16, u16, u16), owners: &[u16], mock: u16, config: &str) -> io::Result<String> {
    let (admin, public, owner) = ports;
    let template = std::fs::read_to_string(workspace_root().join("envoy/fleet.yaml.tmpl"))?;
    envoy_render::FleetNode {
        admin_port: admin,
        public_port: public,
        owner_port: owner,
        owner_ports: owners.to_vec(),
        mock_port: mock,
        wasm: wasm_path(),
        config: config.to_owned(),
    }
    .render(&template)
    .map_err(io::Error::other)
}

impl Fleet {
    /// `n` nodes with `--concurrency 2`, all up and seeing every owner healthy. Panics
    /// (test support) when they cannot start.
    pub fn start(n: usize, config: &str, latency_ms: u64) -> Fleet {
        let slots = Slots::take(n);
        let mock = Running::start(None, latency_ms).expect("mock starts");
        let ports: Vec<(u16, u16, u16)> = (0..n)
            .map(|_| Ok((free_port()?, free_port()?, free_port()?)))
            .collect::<io::Result<_>>()
            .expect("free ports");
        let owners: Vec<u16> = ports.iter().map(|p| p.2).collect();
        let nodes = std::thread::scope(|scope| {
            let started: Vec<_> = ports
                .iter()
                .map(|&p| {
                    let yaml = render(p, &owners, mock.addr.port(), config).expect("template");
                    scope.spawn(move || {
                        let dir = Envoy::new_dir().expect("dir");
                        let envoy = Envoy::spawn_in(
                            Slots::none(),
                            dir,
                            &yaml,
                            2,
                            &[("HOLYSHEEP_PEER_SECRET", SECRET.to_owned())],
                        )
                        .expect("envoy starts");
                        let addr = |port| SocketAddr::from(([127, 0, 0, 1], port));
                        Some(Node { envoy, public: addr(p.1), owner: addr(p.2) })
                    })
                })
                .collect();
            started.into_iter().map(|h| h.join().expect("node thread")).collect()
        });
        let fleet = Fleet { mock, nodes, _slots: slots };
        fleet.await_one_ring(n);
        fleet
    }

    /// Waits until every live node's ring has `healthy` owners and the nodes agree on who
    /// owns what. Envoy reports a host healthy before every worker's ring has it (up to a
    /// health-check interval later): agreement is checked with probe prompts (upstream
    /// calls in a tenant of their own), each node naming the owner in `x-holysheep-owner`.
    pub fn await_one_ring(&self, healthy: usize) {
        for node in self.live() {
            poll_until(|| node.healthy_owners() == healthy, "the fleet's owners never became healthy");
        }
        let mut agreed = 0;
        let mut probe = 0;
        poll_until(
            || {
                probe += 1;
                let body =
                    format!(r#"{{"model":"probe","messages":[{{"role":"user","content":"ring probe {probe}"}}]}}"#);
                let owners: Vec<Option<String>> = self
                    .publics()
                    .into_iter()
                    .map(|p| {
                        let r = client::request(
                            p,
                            "POST",
                            "/v1/chat/completions",
                            &[("authorization", "Bearer probe")],
                            body.as_bytes(),
                        );
                        r.ok().and_then(|r| r.header("x-holysheep-owner").map(str::to_owned))
                    })
                    .collect();
                let same = owners.iter().all(|o| o.is_some() && *o == owners[0]);
                agreed = if same { agreed + 1 } else { 0 };
                agreed >= 8
            },
            "the fleet's nodes never agreed on the owners",
        );
    }

    pub fn live(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().flatten()
    }

    /// The public listeners of the live nodes.
    pub fn publics(&self) -> Vec<SocketAddr> {
        self.live().map(|n| n.public).collect()
    }

    /// Kills node `i` with SIGKILL.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut node) = self.nodes.get_mut(i).and_then(Option::take) {
            node.envoy.kill();
        }
    }

    pub fn calls(&self) -> u64 {
        self.mock.mock.calls()
    }

    /// Log lines of any node that say a VM crashed.
    pub fn crashes(&self) -> Vec<String> {
        self.live().flat_map(|n| n.envoy.crashes()).collect()
    }

    /// A counter summed over the live nodes.
    pub fn stat(&self, name: &str) -> u64 {
        self.live().map(|n| n.envoy.stat(name)).sum()
    }
}

impl Node {
    /// Owners this node's ring sees healthy (from the admin `/clusters`).
    pub fn healthy_owners(&self) -> usize {
        let text =
            client::request(self.envoy.admin, "GET", "/clusters", &[], b"").map(|r| r.text()).unwrap_or_default();
        text.lines().filter(|l| l.starts_with("owners::") && l.ends_with("::health_flags::healthy")).count()
    }
}
