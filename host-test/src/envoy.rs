//! Runs a real Envoy (from the project's `.venv`) with the built plugin, rendered from
//! `envoy/local.yaml.tmpl` (by `envoy_render`), and stops it on drop. At most
//! `HOLYSHEEP_TEST_ENVOYS` run at once ([`crate::limit`]).

use crate::client;
use crate::limit::Slots;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `HOLYSHEEP_ENVOY`, or the Envoy that `envoy/setup.sh` installs.
pub fn envoy_bin() -> PathBuf {
    std::env::var_os("HOLYSHEEP_ENVOY").map_or_else(|| workspace_root().join(".venv/bin/envoy"), PathBuf::from)
}

/// `HOLYSHEEP_WASM`, or the plugin as it ships (`target/plugin/`, made by `envoy/setup.sh`).
pub fn wasm_path() -> PathBuf {
    std::env::var_os("HOLYSHEEP_WASM")
        .map_or_else(|| workspace_root().join("target/plugin/holysheep_edge.wasm"), PathBuf::from)
}

/// The folder of the built native module, `libholysheep_edge.so` (`HOLYSHEEP_NATIVE_DIR`
/// overrides).
pub fn native_dir() -> PathBuf {
    std::env::var_os("HOLYSHEEP_NATIVE_DIR").map_or_else(|| workspace_root().join("target/native"), PathBuf::from)
}

/// Which of the edge's Envoy shells the edge listener runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Shell {
    /// The proxy-wasm plugin.
    #[default]
    Wasm,
    /// The native dynamic module (`make native`).
    Native,
}

impl Shell {
    /// What Envoy's Prometheus format puts before the edge's series on this shell: nothing
    /// on the plugin (Envoy strips its stats namespace), `envoy_wasmcustom_` on the native
    /// module (the shipped Prometheus configuration renames those).
    pub fn prometheus_prefix(self) -> &'static str {
        match self {
            Shell::Wasm => "",
            Shell::Native => "envoy_wasmcustom_",
        }
    }

    /// The shell a test runs on unless it names one: `HOLYSHEEP_TEST_SHELL=native` runs the
    /// suite on the native module, anything else on the plugin.
    pub fn of_run() -> Shell {
        match std::env::var("HOLYSHEEP_TEST_SHELL").as_deref() {
            Ok("native") => Shell::Native,
            _ => Shell::Wasm,
        }
    }
}

/// The built wasi:http component (`HOLYSHEEP_COMPONENT` overrides).
pub fn component_path() -> PathBuf {
    std::env::var_os("HOLYSHEEP_COMPONENT")
        .map_or_else(|| workspace_root().join("target/wasm32-wasip2/release/holysheep_edge.wasm"), PathBuf::from)
}

pub struct Options {
    /// The plugin configuration (JSON).
    pub config: String,
    pub upstream: SocketAddr,
    pub concurrency: u32,
    /// Value of `HOLYSHEEP_API_KEY` in Envoy's environment (unset when `None`).
    pub api_key: Option<String>,
    /// Body served by the `direct` listener.
    pub direct_body: Vec<u8>,
    /// Keep the wasm filter's required `allow_on_headers_stop_iteration: true` (tests of
    /// the misconfiguration drop it).
    pub allow_on_headers_stop_iteration: bool,
    /// More listeners (YAML list items), added to the template's (the bench's floors).
    pub extra_listeners: String,
    /// A second edge listener, `edge_logged` (the same filter, sharing the edge's VM), with
    /// an access log at this path: one line per request, `START TOOK CACHE` with the
    /// request's arrival in microseconds since the epoch, the microseconds until its last
    /// byte was sent, and its `x-holysheep-cache` label (the bench times followers there;
    /// the other listeners log nothing, so their rows do not pay for it).
    pub edge_access_log: Option<PathBuf>,
    /// The edge listener logs as `envoy/production.yaml` does (its JSON access log), to
    /// this path instead of stdout.
    pub shipped_access_log: Option<PathBuf>,
    /// The edge listener exports as `envoy/production.yaml` does (its OpenTelemetry access
    /// logger, tracer and stats sink, with its stats tags), to an OTLP/gRPC receiver at this
    /// address, flushing spans every 100 ms and stats every second.
    pub otel: Option<SocketAddr>,
    /// With `otel`: Envoy's own flush of spans (every 5 s or 5 spans), as in production,
    /// rather than every 100 ms.
    pub otel_batched: bool,
    /// With `otel`: the share of requests traced, in percent, in place of the shipped 100.
    pub otel_sampling: Option<f64>,
    /// The wasm filter's `code` (YAML, from its `code:` line on) in place of the local file.
    pub wasm_code: Option<String>,
    /// More clusters (YAML list items), added to the template's.
    pub extra_clusters: String,
    /// A second virtual host on the edge listener, `internal.example`, routed to a
    /// cluster `internal` at this address (another service behind the same listener).
    pub internal_upstream: Option<SocketAddr>,
    /// Envoy speaks HTTP/2 to the mock (as the production config does to HolySheep).
    pub upstream_h2: bool,
    /// The HolySheep cluster's circuit breaker lets this many requests through at once: over
    /// HTTP/2 (`upstream_h2`) Envoy answers any more 503 `x-envoy-overloaded`.
    pub upstream_max_requests: Option<u32>,
    /// The edge's routes send a request to HolySheep only when it carries `x-tier: gold`,
    /// and everything else to a cluster `internal` at this address.
    pub gold_only_upstream: Option<SocketAddr>,
    /// The edge listener comes from a file Envoy watches (`lds.yaml`, dynamic resources),
    /// so that `Envoy::reconfigure` reloads the filter's configuration in the running
    /// process, as an operator's xDS update does.
    pub edge_by_lds: bool,
    /// The shell in front: the plugin, or the native module with the same configuration.
    pub shell: Shell,
}

impl Options {
    pub fn new(config: &str, upstream: SocketAddr) -> Options {
        Options {
            config: config.to_owned(),
            upstream,
            concurrency: 2,
            api_key: None,
            direct_body: b"{}".to_vec(),
            allow_on_headers_stop_iteration: true,
            extra_listeners: String::new(),
            edge_access_log: None,
            shipped_access_log: None,
            otel: None,
            otel_batched: false,
            otel_sampling: None,
            wasm_code: None,
            extra_clusters: String::new(),
            internal_upstream: None,
            upstream_h2: false,
            upstream_max_requests: None,
            gold_only_upstream: None,
            edge_by_lds: false,
            shell: Shell::of_run(),
        }
    }
}

pub struct Envoy {
    child: Child,
    pub edge: SocketAddr,
    pub direct: SocketAddr,
    pub plain: SocketAddr,
    pub admin: SocketAddr,
    pub dir: PathBuf,
    /// The admin `/listeners` answer.
    listeners: serde_json::Value,
    /// Released after the drop has stopped Envoy.
    _slots: Slots,
}

/// The edge listener of `yaml` again as `edge_logged`, with an access log at `path` (see
/// `Options::edge_access_log`).
fn logged_edge(yaml: &str, path: &Path) -> String {
    let start = yaml.find("  - name: edge\n").unwrap_or(0);
    let end = yaml[start..].find("  - name: direct\n").map_or(start, |e| start + e);
    yaml[start..end].replacen("  - name: edge\n", "  - name: edge_logged\n", 1).replacen(
        "stat_prefix: edge\n",
        &format!("stat_prefix: edge_logged\n{}", access_log(path)),
        1,
    )
}

/// The lines of `envoy/production.yaml` from `# NAME: begin` to `# NAME: end`.
fn shipped_block(name: &str) -> io::Result<String> {
    let production = std::fs::read_to_string(workspace_root().join("envoy/production.yaml"))?;
    let missing = || io::Error::other(format!("envoy/production.yaml has no {name} block"));
    let (_, rest) = production.split_once(&format!("# {name}: begin\n")).ok_or_else(missing)?;
    let end = rest.find(&format!("# {name}: end")).ok_or_else(missing)?;
    Ok(rest[..rest[..end].rfind('\n').map_or(0, |i| i + 1)].to_owned())
}

/// The access log of `envoy/production.yaml` (its `access-log` block), writing to `path`
/// instead of stdout.
pub fn shipped_access_log(path: &Path) -> io::Result<String> {
    let block = shipped_block("access-log")?;
    Ok(block.replacen("path: /dev/stdout", &format!("path: \"{}\"", path.display()), 1))
}

/// What the edge's connection manager gets of `envoy/production.yaml`: its file access log
/// (to `log`), its OpenTelemetry access logger and its tracer (with `otel`).
fn shipped_observability(log: Option<&Path>, otel: bool) -> io::Result<String> {
    let mut yaml = match log {
        Some(path) => shipped_access_log(path)?,
        None if otel => "          access_log:\n".to_owned(),
        None => String::new(),
    };
    if otel {
        yaml += &shipped_block("otel-access-log")?;
        yaml += &shipped_block("tracing")?;
    }
    Ok(yaml)
}

/// The `otel` cluster at `addr` (HTTP/2, as OTLP/gRPC needs), and a runtime that flushes
/// the tracer's spans every 100 ms (Envoy's default is 5 s or 5 spans).
fn otel_cluster(addr: SocketAddr) -> String {
    let options = "    typed_extension_protocol_options:\n      \
                   envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \
                   \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        \
                   explicit_http_config: {http2_protocol_options: {}}\n";
    format!("{}{options}", static_cluster("otel", addr.port(), "1s"))
}

const OTEL_RUNTIME: &str = "layered_runtime:\n  layers:\n  - name: static\n    static_layer:\n      \
                            tracing.opentelemetry.flush_interval_ms: 100\n      \
                            tracing.opentelemetry.min_flush_spans: 1\n";

/// `yaml` with the wasm filter's `code: {local: ...}` line replaced by `code` (YAML starting
/// at `code:`), indented as that line was.
fn with_code(yaml: &str, code: &str) -> String {
    let Some(at) = yaml.find("code: {local: {filename:") else { return yaml.to_owned() };
    let line_start = yaml[..at].rfind('\n').map_or(0, |i| i + 1);
    let indent = &yaml[line_start..at];
    let end = yaml[at..].find('\n').map_or(yaml.len(), |i| at + i);
    let block: Vec<String> = code.trim_end().lines().map(|l| format!("{indent}{l}")).collect();
    format!("{}{}{}", &yaml[..line_start], block.join("\n"), &yaml[end..])
}

/// A file access log, as YAML under a connection manager.
pub fn access_log(path: &Path) -> String {
    format!(
        r#"          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: "{}"
              log_format:
                text_format_source:
                  inline_string: "%START_TIME(%s%6f)% %COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)% %RESP(X-HOLYSHEEP-CACHE)%\n"
"#,
        path.display()
    )
}

/// The edge listener's routes with a virtual host `internal.example` first, routed to a
/// cluster `internal` at `addr`.
fn with_internal_vhost(yaml: &str, addr: SocketAddr) -> String {
    let vhost = "            - name: internal\n              domains: [\"internal.example\"]\n              \
                 routes: [{match: {prefix: \"/\"}, route: {cluster: internal}}]\n";
    let cluster = internal_cluster(addr);
    let edge = "            - name: holysheep\n";
    let yaml = yaml.replacen(edge, &format!("{vhost}{edge}"), 1);
    format!("{yaml}{cluster}")
}

/// A cluster `internal` at `addr`, as YAML under `clusters`.
fn internal_cluster(addr: SocketAddr) -> String {
    static_cluster("internal", addr.port(), "2s")
}

/// A cluster `name` at `port` on 127.0.0.1, connecting within `connect_timeout` (`1s`), as a
/// YAML list item under `clusters`.
pub fn static_cluster(name: &str, port: u16, connect_timeout: &str) -> String {
    format!(
        "  - name: {name}\n    type: STATIC\n    connect_timeout: {connect_timeout}\n    load_assignment:\n      \
         cluster_name: {name}\n      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: \
         {{address: 127.0.0.1, port_value: {port}}}}}}}}}]}}]\n"
    )
}

/// The edge's HolySheep route matched only with `x-tier: gold`, every other request routed
/// to a cluster `internal` at `addr`.
fn with_gold_only_route(yaml: &str, addr: SocketAddr) -> String {
    let gold = "              - match: {prefix: \"/\", headers: [{name: x-tier, string_match: {exact: gold}}]}\n";
    let rest = "              - match: {prefix: \"/\"}\n                route: {cluster: internal}\n";
    let first =
        "              - match: {prefix: \"/\"}\n                route:\n                  cluster: holysheep\n";
    let routed = yaml.replacen(first, &first.replacen("              - match: {prefix: \"/\"}\n", gold, 1), 1);
    let governed = "{safe_regex: {regex: \"/v1/(chat/completions|completions|embeddings|responses)\"}";
    let chat = format!("              - match: {governed}}}\n");
    let gold_chat =
        format!("              - match: {governed}, headers: [{{name: x-tier, string_match: {{exact: gold}}}}]}}\n");
    assert!(routed.contains(&chat), "the template's route for governed endpoints changed");
    let routed = routed.replacen(&chat, &gold_chat, 1);
    let end = "          http_filters:\n";
    let routed = routed.replacen(end, &format!("{rest}{end}"), 1);
    let cluster = internal_cluster(addr);
    format!("{routed}{cluster}")
}

/// The bootstrap `yaml` with its edge listener moved to `dir/lds.yaml`, which Envoy reads
/// as a listener discovery response and watches.
fn with_edge_by_lds(yaml: &str, dir: &Path) -> io::Result<String> {
    let start = yaml.find("  - name: edge\n").ok_or_else(|| io::Error::other("no edge listener"))?;
    let end = yaml[start..].find("  - name: direct\n").map_or(yaml.len(), |e| start + e);
    let listener: String =
        yaml[start..end].lines().map(|l| l.strip_prefix("  ").unwrap_or(l)).collect::<Vec<_>>().join("\n").replacen(
            "- name: edge",
            "- \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n  name: edge",
            1,
        );
    std::fs::write(dir.join("lds.yaml"), format!("resources:\n{listener}\n"))?;
    let lds = format!(
        "node: {{id: edge, cluster: edge}}\ndynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    \
         path_config_source: {{path: \"{}\"}}\n",
        dir.join("lds.yaml").display()
    );
    Ok(format!("{lds}{}{}", &yaml[..start], &yaml[end..]))
}

/// The `holysheep` cluster speaking HTTP/2 (prior knowledge) to the mock.
fn with_h2_upstream(yaml: &str) -> String {
    let options = "    typed_extension_protocol_options:\n      \
                   envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \
                   \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        \
                   explicit_http_config: {http2_protocol_options: {}}\n";
    let cluster = "  - name: holysheep\n    type: STATIC\n";
    yaml.replacen(cluster, &format!("{cluster}{options}"), 1)
}

fn with_upstream_breaker(yaml: &str, max: u32) -> String {
    let breaker = format!(
        "    circuit_breakers:\n      thresholds:\n      \
         - {{max_connections: {max}, max_pending_requests: 1, max_requests: {max}, max_retries: 100}}\n"
    );
    let cluster = "  - name: holysheep\n    type: STATIC\n";
    yaml.replacen(cluster, &format!("{cluster}{breaker}"), 1)
}

impl Envoy {
    pub fn start(opts: &Options) -> io::Result<Envoy> {
        let (bin, wasm) = (envoy_bin(), wasm_path());
        for p in [&bin, &wasm] {
            if !p.exists() {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{} is missing: run `make test`", p.display()),
                ));
            }
        }
        let dir = Envoy::new_dir()?;
        let direct_body = dir.join("direct.json");
        std::fs::write(&direct_body, &opts.direct_body)?;
        // Port 0 everywhere: Envoy binds and reports its ports, so parallel tests never race
        // for a port someone else just took.
        let template = std::fs::read_to_string(workspace_root().join("envoy/local.yaml.tmpl"))?;
        let yaml = envoy_render::Local {
            admin_port: 0,
            listen_port: 0,
            direct_port: 0,
            plain_port: 0,
            mock_port: opts.upstream.port(),
            wasm,
            direct_body,
            config: opts.config.clone(),
        }
        .render(&template)
        .map_err(io::Error::other)?;
        let logged = opts.edge_access_log.as_deref().map(|path| logged_edge(&yaml, path)).unwrap_or_default();
        let observe = shipped_observability(opts.shipped_access_log.as_deref(), opts.otel.is_some())?;
        let observe = match opts.otel_sampling {
            Some(percent) => {
                let shipped = "random_sampling: {value: 100}";
                if !observe.contains(shipped) {
                    return Err(io::Error::other(format!("envoy/production.yaml's tracing block lost `{shipped}`")));
                }
                observe.replacen(shipped, &format!("random_sampling: {{value: {percent}}}"), 1)
            }
            None => observe,
        };
        let yaml = yaml.replacen("stat_prefix: edge\n", &format!("stat_prefix: edge\n{observe}"), 1);
        let clusters = format!("{}{}", opts.extra_clusters, opts.otel.map(otel_cluster).unwrap_or_default());
        let yaml = yaml.replace("  clusters:\n", &format!("{}{logged}  clusters:\n{clusters}", opts.extra_listeners));
        let yaml = match opts.otel {
            Some(_) => {
                let stats =
                    shipped_block("otel-stats")?.replacen("stats_flush_interval: 10s", "stats_flush_interval: 1s", 1);
                let runtime = if opts.otel_batched { "" } else { OTEL_RUNTIME };
                format!("{runtime}{stats}{yaml}")
            }
            None => yaml,
        };
        let yaml = match &opts.wasm_code {
            Some(code) => with_code(&yaml, code),
            None => yaml,
        };
        let yaml = match opts.internal_upstream {
            Some(addr) => with_internal_vhost(&yaml, addr),
            None => yaml,
        };
        let yaml = if opts.upstream_h2 { with_h2_upstream(&yaml) } else { yaml };
        let yaml = match opts.upstream_max_requests {
            Some(n) => with_upstream_breaker(&yaml, n),
            None => yaml,
        };
        let yaml = match opts.gold_only_upstream {
            Some(addr) => with_gold_only_route(&yaml, addr),
            None => yaml,
        };
        let yaml = if opts.allow_on_headers_stop_iteration {
            yaml
        } else {
            yaml.replace("allow_on_headers_stop_iteration: true", "")
        };
        let yaml = if opts.edge_by_lds { with_edge_by_lds(&yaml, &dir)? } else { yaml };
        let mut env: Vec<(&str, String)> = opts.api_key.iter().map(|k| ("HOLYSHEEP_API_KEY", k.clone())).collect();
        let yaml = match opts.shell {
            Shell::Wasm => yaml,
            Shell::Native => {
                let module = native_dir().join("libholysheep_edge.so");
                if !module.exists() {
                    let missing = format!("{} is missing: run `make native`", module.display());
                    return Err(io::Error::new(io::ErrorKind::NotFound, missing));
                }
                env.push(("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", native_dir().display().to_string()));
                envoy_render::with_native_module(&yaml, &opts.config).map_err(io::Error::other)?
            }
        };
        Envoy::spawn(dir, &yaml, opts.concurrency, &env)
    }

    /// A fresh directory for one Envoy's files under `target/e2e`.
    pub fn new_dir() -> io::Result<PathBuf> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = workspace_root().join("target/e2e").join(format!(
            "{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(dir)
    }

    /// Starts Envoy on `yaml` in `dir` with `env` (and no `HOLYSHEEP_*` from the test's own
    /// environment), and waits until it is ready. It holds a slot of the process's limit
    /// ([`crate::limit`]) until dropped: this may wait for another test's Envoy to stop.
    pub fn spawn(dir: PathBuf, yaml: &str, concurrency: u32, env: &[(&str, String)]) -> io::Result<Envoy> {
        Envoy::spawn_in(Slots::take(1), dir, yaml, concurrency, env)
    }

    /// [`Envoy::spawn`] with `slots` already taken (none for a fleet's node: the fleet holds them).
    pub(crate) fn spawn_in(
        slots: Slots,
        dir: PathBuf,
        yaml: &str,
        concurrency: u32,
        env: &[(&str, String)],
    ) -> io::Result<Envoy> {
        let config_path = dir.join("envoy.yaml");
        std::fs::write(&config_path, yaml)?;
        let mut cmd = Command::new(envoy_bin());
        cmd.arg("-c")
            .arg(&config_path)
            .args(["--concurrency", &concurrency.to_string(), "--disable-hot-restart", "-l", "info"])
            .arg("--admin-address-path")
            .arg(dir.join("admin.address"))
            .env_remove("HOLYSHEEP_API_KEY")
            .env_remove("HOLYSHEEP_PEER_SECRET")
            .stdout(Stdio::null())
            // stderr, not --log-path: the log file is flushed only every few seconds.
            .stderr(std::fs::File::create(dir.join("envoy.log"))?);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let unbound = SocketAddr::from(([127, 0, 0, 1], 0));
        let child = cmd.spawn()?;
        running().push(child.id());
        let mut envoy = Envoy {
            child,
            admin: unbound,
            edge: unbound,
            direct: unbound,
            plain: unbound,
            dir,
            listeners: serde_json::Value::Null,
            _slots: slots,
        };
        envoy.wait_ready()?;
        Ok(envoy)
    }

    /// Replaces the plugin configuration `old` by `new` in the edge listener Envoy watches
    /// (`Options::edge_by_lds`): written beside it and moved into place, as Envoy expects.
    pub fn reconfigure(&self, old: &str, new: &str) -> io::Result<()> {
        let quoted = |c: &str| format!("'{}'", c.replace('\'', "''"));
        let lds = std::fs::read_to_string(self.dir.join("lds.yaml"))?;
        if !lds.contains(&quoted(old)) {
            return Err(io::Error::other("the edge listener does not carry that configuration"));
        }
        std::fs::write(self.dir.join("lds.next.yaml"), lds.replacen(&quoted(old), &quoted(new), 1))?;
        std::fs::rename(self.dir.join("lds.next.yaml"), self.dir.join("lds.yaml"))
    }

    /// Envoy's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills Envoy at once (SIGKILL), as a lost node.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits until the admin endpoint reports LIVE (workers started, listeners bound), then
    /// reads the ports Envoy bound.
    fn wait_ready(&mut self) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Err(io::Error::other(format!("envoy exited ({status}):\n{}", self.log())));
            }
            let written = std::fs::read_to_string(self.dir.join("admin.address")).unwrap_or_default();
            if let Ok(admin) = written.trim().parse() {
                self.admin = admin;
                if client::request(admin, "GET", "/ready", &[], b"").is_ok_and(|r| r.status == 200) {
                    return self.read_listeners();
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(io::Error::other(format!("envoy did not become ready:\n{}", self.log())))
    }

    fn read_listeners(&mut self) -> io::Result<()> {
        let listeners = client::request(self.admin, "GET", "/listeners?format=json", &[], b"")?.json();
        let port = |name: &str| -> io::Result<SocketAddr> {
            let statuses = listeners["listener_statuses"].as_array().cloned().unwrap_or_default();
            let found = statuses.iter().find(|l| l["name"] == name);
            let port = found.and_then(|l| l["local_address"]["socket_address"]["port_value"].as_u64());
            port.map(|p| SocketAddr::from(([127, 0, 0, 1], p as u16)))
                .ok_or_else(|| io::Error::other(format!("listener {name} not found in {listeners}")))
        };
        // A fleet node's listeners have other names (and ports chosen beforehand).
        if let (Ok(edge), Ok(direct), Ok(plain)) = (port("edge"), port("direct"), port("plain")) {
            (self.edge, self.direct, self.plain) = (edge, direct, plain);
        }
        self.listeners = listeners;
        Ok(())
    }

    /// The address of the listener called `name`.
    pub fn listener(&self, name: &str) -> Option<SocketAddr> {
        let statuses = self.listeners["listener_statuses"].as_array()?;
        let found = statuses.iter().find(|l| l["name"] == name)?;
        let port = found["local_address"]["socket_address"]["port_value"].as_u64()?;
        Some(SocketAddr::from(([127, 0, 0, 1], port as u16)))
    }

    /// Lines of Envoy's log that say a VM crashed (a panic, a V8 exception such as
    /// `RangeError: Maximum call stack size exceeded`, a failed VM).
    pub fn crashes(&self) -> Vec<String> {
        let signs = ["panicked", "Uncaught", "RangeError", "VM failed", "wasm_vm_failed", "a panic was caught"];
        self.log().lines().filter(|l| signs.iter().any(|s| l.contains(s))).map(str::to_owned).collect()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// A counter or gauge from the admin `/stats` endpoint (0 when absent).
    pub fn stat(&self, name: &str) -> u64 {
        self.stats(name).get(name).copied().unwrap_or(0)
    }

    /// A stat that must exist, for a check that it reads 0: `stat` reads 0 for a name
    /// Envoy does not have as well (misspelt, or never defined). The plugin defines its
    /// counters when it starts, so a counter that counted nothing is there at 0.
    pub fn counted(&self, name: &str) -> u64 {
        let value = self.stats(name).get(name).copied();
        value.unwrap_or_else(|| panic!("Envoy has no stat {name}"))
    }

    /// Every stat whose name contains `filter`, by name.
    pub fn stats(&self, filter: &str) -> std::collections::BTreeMap<String, u64> {
        let text = client::request(self.admin, "GET", "/stats", &[], b"").map(|r| r.text()).unwrap_or_default();
        text.lines()
            .filter(|l| l.contains(filter))
            .filter_map(|l| l.split_once(": "))
            .filter_map(|(n, v)| Some((n.to_owned(), v.trim().parse().ok()?)))
            .collect()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let pid = self.child.id();
        running().retain(|p| *p != pid);
    }
}

/// The Envoys this process started and has not dropped.
fn running() -> std::sync::MutexGuard<'static, Vec<u32>> {
    static RUNNING: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());
    RUNNING.lock().unwrap_or_else(|e| e.into_inner())
}

/// For the bench and soak binaries, built with `panic = "abort"`: a panic there runs no
/// destructor, so without this hook the Envoys they started would outlive them.
pub fn kill_envoys_on_panic() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        for pid in running().iter() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        previous(info);
    }));
}
