//! A fleet of real Envoys on one machine, rendered from `envoy/fleet.yaml.tmpl`: each node
//! has a public listener (filter role `forward`) and an owner listener (role `owner`), and
//! every node's `owners` ring holds every owner listener. In two tiers, edge nodes
//! (`envoy/edge.yaml.tmpl`, a public listener only) forward to such nodes as their shields.
//! One mock HolySheep behind them.

use crate::client::{self, Conn, Resp};
use crate::envoy::{wasm_path, workspace_root, Envoy};
use crate::limit::Slots;
use crate::mock::Running;
use crate::stack::{poll_until, PATH};
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::Duration;

/// The shared secret of the test fleet's internal calls.
pub const SECRET: &str = "fleet-secret-for-tests";

/// The test fleets' certificates, made once per process by `envoy/fleet-certs.sh`: the
/// fleet's CA and node certificate, `stranger.pem` (the same CA, another SAN), in `rogue/`
/// another CA with a node certificate of the fleet's SAN, and `expired.pem` (the fleet's CA
/// and SAN, expired a day before it was made).
pub fn certificates() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("holysheep-fleet-tls-{}", std::process::id()));
        let script = workspace_root().join("envoy/fleet-certs.sh");
        for (at, extra) in [(dir.clone(), vec!["stranger=spiffe://holysheep/stranger"]), (dir.join("rogue"), vec![])] {
            let made = std::process::Command::new(&script).arg(&at).args(extra).status();
            assert!(made.is_ok_and(|s| s.success()), "envoy/fleet-certs.sh {} failed", at.display());
        }
        let ext = "subjectAltName=URI:spiffe://holysheep/fleet\nextendedKeyUsage=serverAuth,clientAuth\n";
        std::fs::write(dir.join("expired.ext"), ext).expect("expired.ext");
        let openssl = |args: &[&str]| {
            let made = std::process::Command::new("openssl").args(args).current_dir(&dir).output();
            assert!(made.is_ok_and(|o| o.status.success()), "openssl {args:?} failed");
        };
        let key =
            ["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "expired-key.pem"];
        openssl(&[&key[..], &["-out", "expired.csr", "-subj", "/CN=expired"]].concat());
        openssl(&[
            "x509",
            "-req",
            "-in",
            "expired.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            "expired.pem",
            "-days",
            "-1",
            "-extfile",
            "expired.ext",
        ]);
        dir
    })
}

/// Mutual TLS between the nodes with the test certificates.
fn tls() -> envoy_render::Tls {
    envoy_render::Tls { dir: certificates().to_owned(), san: envoy_render::FLEET_SAN.to_owned() }
}

pub struct Node {
    pub envoy: Envoy,
    pub public: SocketAddr,
    pub owner: SocketAddr,
}

/// An edge node of two tiers: a public listener only.
pub struct EdgeNode {
    pub envoy: Envoy,
    pub public: SocketAddr,
}

pub struct Fleet {
    pub mock: Running,
    /// `None` once a node was killed. In two tiers, the shields.
    pub nodes: Vec<Option<Node>>,
    /// In two tiers, the edge nodes in front of the shields (clients come to them).
    pub edges: Vec<EdgeNode>,
    /// Each node's rendered configuration and its ports (admin, public, owner), to start it
    /// again; the operator's key.
    configs: Vec<(String, (u16, u16, u16))>,
    api_key: Option<String>,
    /// Slots of the process's limit ([`crate::limit`]) for all the nodes, released after
    /// they stopped.
    _slots: Slots,
}

/// One request per (address, body) with `authorization`, each on its own connection, all
/// released together.
pub fn spread(targets: Vec<(SocketAddr, String)>, authorization: &str) -> Vec<Resp> {
    spread_to(targets, PATH, authorization)
}

/// `spread` on another endpoint's `path`.
pub fn spread_to(targets: Vec<(SocketAddr, String)>, path: &'static str, authorization: &str) -> Vec<Resp> {
    let barrier = Arc::new(Barrier::new(targets.len()));
    let handles: Vec<_> = targets
        .into_iter()
        .map(|(addr, body)| {
            let (b, authorization) = (barrier.clone(), authorization.to_owned());
            std::thread::spawn(move || {
                let mut conn = Conn::open(addr).and_then(|c| c.read_timeout(Duration::from_secs(30))).expect("connect");
                b.wait();
                conn.request("POST", path, &[("authorization", &authorization)], body.as_bytes()).expect("answer")
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("thread")).collect()
}

/// `bodies` dealt over `publics` in turn.
pub fn round_robin(publics: &[SocketAddr], bodies: Vec<String>) -> Vec<(SocketAddr, String)> {
    bodies.into_iter().enumerate().map(|(i, b)| (publics[i % publics.len()], b)).collect()
}

/// What tells one answer from another: its id and its text.
pub fn content(r: &Resp) -> String {
    let v = r.json();
    format!("{} {}", v["id"], v["choices"][0]["message"]["content"])
}

/// The configurations of a node's two listeners (one meaning for the demo, the tests and
/// the bench: see `envoy_render`).
pub use envoy_render::listener_configs;
/// The SAN of the fleet's node certificates.
pub use envoy_render::FLEET_SAN;

/// `envoy/fleet.yaml.tmpl` for one node (`tls`: mutual TLS between the nodes; `forward`:
/// the public listener's own configuration, when it is not `config`).
pub fn render(
    ports: (u16, u16, u16),
    owners: &[u16],
    mock: u16,
    (config, forward): (&str, Option<&str>),
    tls: bool,
) -> io::Result<String> {
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
        tls: tls.then(self::tls),
        forward: forward.map(str::to_owned),
    }
    .render(&template)
    .map_err(io::Error::other)
}

/// `envoy/edge.yaml.tmpl` for an edge node in front of the shields' owner listeners.
pub fn render_edge(ports: (u16, u16), shields: &[u16], config: &str, tls: bool) -> io::Result<String> {
    let template = std::fs::read_to_string(workspace_root().join("envoy/edge.yaml.tmpl"))?;
    let (admin_port, public_port) = ports;
    let node = envoy_render::EdgeNode {
        admin_port,
        public_port,
        owner_ports: shields.to_vec(),
        wasm: wasm_path(),
        config: config.to_owned(),
        tls: tls.then(self::tls),
    };
    node.render(&template).map_err(io::Error::other)
}

/// Starts an Envoy with `--concurrency 2` and the fleet's secret on each rendered file, all
/// at once.
fn spawn_all(yamls: Vec<String>, api_key: Option<&str>) -> Vec<Envoy> {
    std::thread::scope(|scope| {
        let started: Vec<_> = yamls
            .into_iter()
            .map(|yaml| {
                scope.spawn(move || {
                    let dir = Envoy::new_dir().expect("dir");
                    let mut env = vec![("HOLYSHEEP_PEER_SECRET", SECRET.to_owned())];
                    env.extend(api_key.map(|k| ("HOLYSHEEP_API_KEY", k.to_owned())));
                    Envoy::spawn_in(Slots::none(), dir, &yaml, 2, &env).expect("envoy starts")
                })
            })
            .collect();
        started.into_iter().map(|h| h.join().expect("node thread")).collect()
    })
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

impl Fleet {
    /// `n` nodes with `--concurrency 2`, all up and seeing every owner healthy, mutual TLS
    /// between them. Panics (test support) when they cannot start.
    pub fn start(n: usize, config: &str, latency_ms: u64) -> Fleet {
        Fleet::tiers(0, n, config, latency_ms)
    }

    /// `start` without TLS between the nodes: their requests carry the fleet's secret.
    pub fn plain(n: usize, config: &str, latency_ms: u64) -> Fleet {
        Fleet::build(0, n, (config, None, latency_ms), None, "", false)
    }

    /// `start` with public listeners whose configuration is `forward`, not the owners'.
    pub fn disagreeing(n: usize, config: &str, forward: &str, latency_ms: u64) -> Fleet {
        Fleet::build(0, n, (config, Some(forward), latency_ms), None, "", true)
    }

    /// Two tiers: `edges` edge nodes in front of `shields` fleet nodes (one tier when
    /// `edges` is 0), every edge's ring holding the shields' owner listeners.
    pub fn tiers(edges: usize, shields: usize, config: &str, latency_ms: u64) -> Fleet {
        Fleet::keyed(edges, shields, config, latency_ms, None)
    }

    /// `tiers` with the operator's key `api_key` in every node's environment (and required
    /// by the mock).
    pub fn keyed(edges: usize, shields: usize, config: &str, latency_ms: u64, api_key: Option<&str>) -> Fleet {
        Fleet::with_clusters(edges, shields, config, latency_ms, api_key, "")
    }

    /// `keyed`, with `clusters` (YAML list items) added to every node's (a spend store's).
    pub fn with_clusters(
        edges: usize,
        shields: usize,
        config: &str,
        latency_ms: u64,
        api_key: Option<&str>,
        clusters: &str,
    ) -> Fleet {
        Fleet::build(edges, shields, (config, None, latency_ms), api_key, clusters, true)
    }

    fn build(
        edges: usize,
        shields: usize,
        (config, forward, latency_ms): (&str, Option<&str>, u64),
        api_key: Option<&str>,
        clusters: &str,
        tls: bool,
    ) -> Fleet {
        let slots = Slots::take(edges + shields);
        let mock = Running::start(api_key, latency_ms).expect("mock starts");
        // The nodes must know each other's ports beforehand.
        let free = crate::ports::free(3 * shields + 2 * edges).expect("free ports");
        let ports: Vec<(u16, u16, u16)> = free.chunks(3).take(shields).map(|p| (p[0], p[1], p[2])).collect();
        let edge_ports: Vec<(u16, u16)> = free[3 * shields..].chunks(2).map(|p| (p[0], p[1])).collect();
        let owners: Vec<u16> = ports.iter().map(|p| p.2).collect();
        let mut yamls: Vec<String> = ports
            .iter()
            .map(|&p| render(p, &owners, mock.addr.port(), (config, forward), tls).expect("template") + clusters)
            .collect();
        let configs = yamls.iter().cloned().zip(ports.iter().copied()).collect();
        yamls.extend(edge_ports.iter().map(|&p| render_edge(p, &owners, config, tls).expect("template")));
        let mut envoys = spawn_all(yamls, api_key).into_iter();
        let nodes = ports
            .iter()
            .zip(envoys.by_ref())
            .map(|(p, envoy)| Some(Node { envoy, public: addr(p.1), owner: addr(p.2) }))
            .collect();
        let edges = edge_ports.iter().zip(envoys).map(|(p, envoy)| EdgeNode { envoy, public: addr(p.1) }).collect();
        let api_key = api_key.map(str::to_owned);
        let fleet = Fleet { mock, nodes, edges, configs, api_key, _slots: slots };
        fleet.await_one_ring(shields);
        fleet
    }

    /// Waits until every live node's ring has `healthy` owners and the nodes agree on who
    /// owns what. Envoy reports a host healthy before every worker's ring has it (up to a
    /// health-check interval later): agreement is checked with probe prompts (upstream
    /// calls in a tenant of their own), each node naming the owner in `x-holysheep-owner`.
    pub fn await_one_ring(&self, healthy: usize) {
        for envoy in self.envoys() {
            poll_until(|| healthy_owners(envoy) == healthy, "the fleet's owners never became healthy");
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
        // The probes reach one worker each: another's ring may still lack a host for up to a
        // health-check interval (1 s), and its callouts (a model owner's verdict) then go to
        // another node. Nothing outside shows when every worker's ring has them all.
        std::thread::sleep(std::time::Duration::from_millis(1_200));
    }

    pub fn live(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().flatten()
    }

    /// The public listeners clients come to: the edge nodes', or else the live nodes'.
    pub fn publics(&self) -> Vec<SocketAddr> {
        if !self.edges.is_empty() {
            return self.edges.iter().map(|e| e.public).collect();
        }
        self.live().map(|n| n.public).collect()
    }

    /// Every running Envoy: the live nodes and the edge nodes.
    pub fn envoys(&self) -> impl Iterator<Item = &Envoy> {
        self.live().map(|n| &n.envoy).chain(self.edges.iter().map(|e| &e.envoy))
    }

    /// Chat requests the owner listeners answered (their filter's per-model request
    /// counters, of every cache status, summed over the owners; a tenant's counters count
    /// the same requests again).
    pub fn owner_requests(&self) -> u64 {
        let owner_counter = |name: &str| {
            name.contains(".requests_") && ![".edge.", ".tenant.", ".tenants."].iter().any(|l| name.contains(l))
        };
        let stats = self.live().flat_map(|n| n.envoy.stats("wasmcustom.holysheep."));
        stats.filter(|(name, _)| owner_counter(name)).map(|(_, v)| v).sum()
    }

    /// Starts node `i` again (after `kill`), on its ports and configuration, with nothing of
    /// its memory; waits until every node sees all `healthy` owners again.
    pub fn restart(&mut self, i: usize, healthy: usize) {
        let (yaml, p) = self.configs[i].clone();
        let envoy = spawn_all(vec![yaml], self.api_key.as_deref()).pop().expect("one node");
        self.nodes[i] = Some(Node { envoy, public: addr(p.1), owner: addr(p.2) });
        self.await_one_ring(healthy);
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
        self.envoys().flat_map(Envoy::crashes).collect()
    }

    /// A counter summed over every running Envoy.
    pub fn stat(&self, name: &str) -> u64 {
        self.envoys().map(|e| e.stat(name)).sum()
    }

    /// A stat every running Envoy must have, summed (`Envoy::counted`).
    pub fn counted(&self, name: &str) -> u64 {
        self.envoys().map(|e| e.counted(name)).sum()
    }
}

/// Owners an Envoy's ring sees healthy (from the admin `/clusters`).
pub fn healthy_owners(envoy: &Envoy) -> usize {
    let text = client::request(envoy.admin, "GET", "/clusters", &[], b"").map(|r| r.text()).unwrap_or_default();
    text.lines().filter(|l| l.starts_with("owners::") && l.ends_with("::health_flags::healthy")).count()
}
