//! The one renderer of `envoy/*.yaml.tmpl`, for the demos (through the `envoy-render`
//! binary), the end-to-end tests and the bench. Each placeholder has one meaning:
//!
//! | placeholder | value |
//! |---|---|
//! | `@ADMIN_PORT@`, `@LISTEN_PORT@`, `@DIRECT_PORT@`, `@PLAIN_PORT@`, `@PUBLIC_PORT@`, `@OWNER_PORT@` | a port on 127.0.0.1 for that listener (0: Envoy picks one) |
//! | `@MOCK_PORT@` | the port of the mock HolySheep on 127.0.0.1 |
//! | `@WASM@` | the path of the plugin Envoy loads |
//! | `@DIRECT_BODY@` | the path of the file the `direct` listener answers with |
//! | `@CONFIG@`, `@FORWARD_CONFIG@`, `@OWNER_CONFIG@` | the plugin's JSON configuration, inside a single-quoted YAML string (each `'` doubled) |
//! | `@NODE@` | a fleet node's name in `x-holysheep-owner`: its owner listener's address, `127.0.0.1:PORT` |
//! | `@OWNER_ENDPOINTS@` | a line of its own: one endpoint line per owner listener of the fleet (of the shield tier, for an edge node) |
//! | `@OWNER_TLS@` | a line of its own: the owner listener's `transport_socket` (mutual TLS: a client certificate required, from the fleet's CA, with the fleet's SAN), or nothing for a fleet without TLS |
//! | `@OWNERS_TLS@` | a line of its own: the `owners` cluster's `transport_socket` (the node's certificate presented, the owner's checked the same way), or nothing |
//!
//! A placeholder left in the output (one the template has and the caller did not give) is
//! an error, so a template and its renderer cannot drift apart.

use serde_json::{json, Value};
use std::fmt;
use std::path::{Path, PathBuf};

/// A placeholder the template still holds after rendering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unfilled(pub String);

impl fmt::Display for Unfilled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the template's placeholder {} has no value", self.0)
    }
}

impl std::error::Error for Unfilled {}

/// `envoy/local.yaml.tmpl`: one Envoy with the `edge`, `direct` and `plain` listeners.
#[derive(Debug, Clone)]
pub struct Local {
    pub admin_port: u16,
    pub listen_port: u16,
    pub direct_port: u16,
    pub plain_port: u16,
    pub mock_port: u16,
    pub wasm: PathBuf,
    pub direct_body: PathBuf,
    /// The plugin configuration (JSON).
    pub config: String,
}

impl Local {
    pub fn render(&self, template: &str) -> Result<String, Unfilled> {
        fill(
            template,
            &[
                ("@ADMIN_PORT@", self.admin_port.to_string()),
                ("@LISTEN_PORT@", self.listen_port.to_string()),
                ("@DIRECT_PORT@", self.direct_port.to_string()),
                ("@PLAIN_PORT@", self.plain_port.to_string()),
                ("@MOCK_PORT@", self.mock_port.to_string()),
                ("@WASM@", path(&self.wasm)),
                ("@DIRECT_BODY@", path(&self.direct_body)),
                ("@CONFIG@", quoted(&self.config)),
            ],
        )
    }
}

/// The URI SAN of the certificate every node of a fleet presents (`envoy/fleet-certs.sh`).
pub const FLEET_SAN: &str = "spiffe://holysheep/fleet";

/// A fleet's mutual TLS between its nodes: the directory of its certificates (`ca.pem`,
/// the CA every node trusts; `node.pem` and `node-key.pem`, the certificate every node
/// presents as client and as server, as `envoy/fleet-certs.sh` makes them) and the URI SAN
/// that certificate carries.
#[derive(Debug, Clone)]
pub struct Tls {
    pub dir: PathBuf,
    pub san: String,
}

impl Tls {
    /// The certificate, the CA and the SAN check, at `indent`.
    fn context(&self, indent: &str) -> String {
        let d = path(&self.dir);
        [
            "common_tls_context:".to_owned(),
            "  tls_certificates:".to_owned(),
            format!("  - certificate_chain: {{filename: \"{d}/node.pem\"}}"),
            format!("    private_key: {{filename: \"{d}/node-key.pem\"}}"),
            "  validation_context:".to_owned(),
            format!("    trusted_ca: {{filename: \"{d}/ca.pem\"}}"),
            "    match_typed_subject_alt_names:".to_owned(),
            format!("    - {{san_type: URI, matcher: {{exact: \"{}\"}}}}", self.san),
        ]
        .iter()
        .map(|l| format!("{indent}{l}\n"))
        .collect()
    }

    /// The owner listener's filter chain's `transport_socket`: a client certificate required.
    fn downstream(&self) -> String {
        "      transport_socket:\n        name: envoy.transport_sockets.tls\n        typed_config:\n          \
         \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext\n          \
         require_client_certificate: true\n"
            .to_owned()
            + &self.context("          ")
    }

    /// The `owners` cluster's `transport_socket`: the node's certificate presented.
    fn upstream(&self) -> String {
        "    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \
         \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n"
            .to_owned()
            + &self.context("        ")
    }
}

/// `envoy/fleet.yaml.tmpl`: one node of a fleet, a public listener (filter role `forward`)
/// and an owner listener (role `owner`) on the ring of every node's owner listener.
#[derive(Debug, Clone)]
pub struct FleetNode {
    pub admin_port: u16,
    pub public_port: u16,
    pub owner_port: u16,
    /// Every node's owner port, this node's included: the `owners` ring.
    pub owner_ports: Vec<u16>,
    pub mock_port: u16,
    pub wasm: PathBuf,
    /// The plugin configuration both listeners start from (see [`listener_configs`]).
    pub config: String,
    /// Mutual TLS between the nodes (`None`: plaintext, the nodes known by the secret).
    pub tls: Option<Tls>,
    /// The public listener's configuration when it starts from another than `config` (a
    /// fleet whose listeners disagree, for the tests).
    pub forward: Option<String>,
}

impl FleetNode {
    pub fn render(&self, template: &str) -> Result<String, Unfilled> {
        let san = self.tls.as_ref().map(|t| t.san.as_str());
        let (forward, owner) = listener_configs(&self.config, self.owner_ports.len(), san);
        let forward = match &self.forward {
            Some(other) => listener_configs(other, self.owner_ports.len(), san).0,
            None => forward,
        };
        fill(
            template,
            &[
                ("@OWNER_ENDPOINTS@\n", endpoints(&self.owner_ports)),
                ("@OWNER_TLS@\n", self.tls.as_ref().map(Tls::downstream).unwrap_or_default()),
                ("@OWNERS_TLS@\n", self.tls.as_ref().map(Tls::upstream).unwrap_or_default()),
                ("@ADMIN_PORT@", self.admin_port.to_string()),
                ("@PUBLIC_PORT@", self.public_port.to_string()),
                ("@OWNER_PORT@", self.owner_port.to_string()),
                ("@NODE@", format!("127.0.0.1:{}", self.owner_port)),
                ("@MOCK_PORT@", self.mock_port.to_string()),
                ("@WASM@", path(&self.wasm)),
                ("@FORWARD_CONFIG@", quoted(&forward)),
                ("@OWNER_CONFIG@", quoted(&owner)),
            ],
        )
    }
}

/// `envoy/edge.yaml.tmpl`: an edge node of a two-tier fleet, a public listener only (filter
/// role `forward`) on the ring of the shield tier's owner listeners.
#[derive(Debug, Clone)]
pub struct EdgeNode {
    pub admin_port: u16,
    pub public_port: u16,
    /// Every shield's owner port: the `owners` ring.
    pub owner_ports: Vec<u16>,
    pub wasm: PathBuf,
    /// The plugin configuration the public listener's starts from (see [`listener_configs`]).
    pub config: String,
    /// Mutual TLS to the shields' owner listeners (`None`: plaintext).
    pub tls: Option<Tls>,
}

impl EdgeNode {
    pub fn render(&self, template: &str) -> Result<String, Unfilled> {
        let (forward, _) = listener_configs(&self.config, self.owner_ports.len(), None);
        fill(
            template,
            &[
                ("@OWNER_ENDPOINTS@\n", endpoints(&self.owner_ports)),
                ("@OWNERS_TLS@\n", self.tls.as_ref().map(Tls::upstream).unwrap_or_default()),
                ("@ADMIN_PORT@", self.admin_port.to_string()),
                ("@PUBLIC_PORT@", self.public_port.to_string()),
                ("@WASM@", path(&self.wasm)),
                ("@FORWARD_CONFIG@", quoted(&forward)),
            ],
        )
    }
}

/// One endpoint line per owner listener of the `owners` ring.
fn endpoints(ports: &[u16]) -> String {
    let line =
        |p| format!("        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}\n");
    ports.iter().map(line).collect()
}

/// The configurations of a fleet node's two listeners: `config` with `role: forward`, and
/// `config` with the fleet's ring of `nodes` owners for fleet-wide limits, serving only the
/// fleet's nodes (`fleet.internal`; with mutual TLS, those whose certificate carries
/// `peer_san`), unless it sets `fleet` itself. A `config` that is not a JSON object counts
/// as `{}`.
pub fn listener_configs(config: &str, nodes: usize, peer_san: Option<&str>) -> (String, String) {
    let base = match serde_json::from_str::<Value>(config) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    };
    let mut forward = base.clone();
    forward["role"] = json!("forward");
    let mut owner = base;
    if owner.get("fleet").is_none() {
        // The owner listener serves only the fleet's nodes.
        owner["fleet"] = json!({"cluster": "owners", "nodes": nodes, "internal": true});
        if let Some(san) = peer_san {
            owner["fleet"]["peer_sans"] = json!([san]);
        }
    }
    (forward.to_string(), owner.to_string())
}

/// `text` inside a single-quoted YAML string.
fn quoted(text: &str) -> String {
    text.replace('\'', "''")
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// Replaces each placeholder in turn, then checks that none is left. A value is inserted
/// as it is: no later replacement reads it.
fn fill(template: &str, values: &[(&str, String)]) -> Result<String, Unfilled> {
    let mut out = String::with_capacity(template.len() + 1024);
    let mut rest = template;
    while let Some(at) = rest.find('@') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        match values.iter().find(|(name, _)| rest.starts_with(name)) {
            Some((name, value)) => {
                out.push_str(value);
                rest = &rest[name.len()..];
            }
            None => {
                if let Some(name) = placeholder(rest) {
                    return Err(Unfilled(name.to_owned()));
                }
                out.push('@');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// The placeholder `text` starts with: `@`, upper-case letters and `_`, `@`.
fn placeholder(text: &str) -> Option<&str> {
    let end = text[1..].find(|c: char| !(c.is_ascii_uppercase() || c == '_'))? + 1;
    (end > 1 && text[end..].starts_with('@')).then(|| &text[..=end])
}

/// `yaml` (a rendered `local.yaml.tmpl`) with its edge listener's plugin replaced by the
/// native module (docs/native.md), configured with `config`: the plugin's own
/// configuration, as the module takes it.
pub fn with_native_module(yaml: &str, config: &str) -> Result<String, String> {
    let start = yaml.find("          - name: envoy.filters.http.wasm\n");
    let end = yaml.find("          - name: envoy.filters.http.router\n");
    let (Some(start), Some(end)) = (start, end) else {
        return Err("envoy/local.yaml.tmpl has no plugin before its router".to_owned());
    };
    let module = format!(
        "          - name: envoy.filters.http.dynamic_modules\n            typed_config:\n              \
         \"@type\": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter\n              \
         dynamic_module_config: {{name: holysheep_edge, do_not_close: true, metrics_namespace: wasmcustom}}\n              \
         filter_name: holysheep-edge\n              filter_config:\n                \
         \"@type\": type.googleapis.com/google.protobuf.StringValue\n                value: '{}'\n",
        config.replace('\'', "''")
    );
    Ok(format!("{}{module}{}", &yaml[..start], &yaml[end..]))
}

/// `envoy/production.yaml` (`yaml`) with the native module (docs/native.md) in place of the
/// plugin, configured as the plugin is.
pub fn production_native(yaml: &str) -> Result<String, String> {
    let start = yaml.find("          - name: envoy.filters.http.wasm\n").ok_or("production.yaml has no plugin")?;
    let value = yaml[start..].find("                  value: |\n").ok_or("the plugin has no configuration")? + start;
    let json_start = value + "                  value: |\n".len();
    let json_end =
        yaml[json_start..].find("                vm_config:").ok_or("the plugin has no vm_config")? + json_start;
    let config: Value = serde_json::from_str(&yaml[json_start..json_end]).map_err(|e| e.to_string())?;
    let header = "# envoy/production.yaml with the native module in place of the plugin (docs/native.md):\n\
                  #   envoy-render production-native OUT\n\
                  # Load it with ENVOY_DYNAMIC_MODULES_SEARCH_PATH naming the folder of\n\
                  # libholysheep_edge.so.\n";
    Ok(format!("{header}{}", with_native_module(yaml, &config.to_string())?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_inserted_once_and_quotes_doubled() {
        let local = Local {
            admin_port: 1,
            listen_port: 2,
            direct_port: 3,
            plain_port: 4,
            mock_port: 5,
            wasm: "/p.wasm".into(),
            direct_body: "/d.json".into(),
            config: r#"{"a":"it's @MOCK_PORT@ & #"}"#.into(),
        };
        let t = "\"@type\": x\n@ADMIN_PORT@ @LISTEN_PORT@ @DIRECT_PORT@ @PLAIN_PORT@ @MOCK_PORT@ @WASM@ @DIRECT_BODY@ '@CONFIG@'";
        assert_eq!(
            local.render(t),
            Ok(r#""@type": x
1 2 3 4 5 /p.wasm /d.json '{"a":"it''s @MOCK_PORT@ & #"}'"#
                .to_owned())
        );
        assert_eq!(local.render("@NODE@"), Err(Unfilled("@NODE@".into())));
    }

    #[test]
    fn a_fleet_node_is_named_by_its_owner_listener() {
        let node = FleetNode {
            admin_port: 9910,
            public_port: 10010,
            owner_port: 10020,
            owner_ports: vec![10020, 10021],
            mock_port: 18000,
            wasm: "/p.wasm".into(),
            config: "{}".into(),
            tls: None,
            forward: None,
        };
        let template =
            "@NODE@\n@OWNER_ENDPOINTS@\nend '@FORWARD_CONFIG@' '@OWNER_CONFIG@'\n@OWNER_TLS@\n@OWNERS_TLS@\n";
        let out = node.render(template).unwrap_or_default();
        assert!(out.starts_with("127.0.0.1:10020\n        - endpoint:"), "{out}");
        assert!(out.contains("port_value: 10021}}}\nend"), "{out}");
        assert!(out.contains(r#"end '{"role":"forward"}' '{"fleet":{"#), "{out}");
        assert!(out.contains(r#""nodes":2"#) && out.contains(r#""internal":true"#), "{out}");
        assert!(out.ends_with("'\n") && !out.contains("peer_sans"), "no TLS: {out}");
        // With mutual TLS: the listener requires the fleet's certificate, the cluster
        // presents it, and the owner's filter knows the nodes by its SAN.
        let tls = Tls { dir: "/certs".into(), san: FLEET_SAN.into() };
        let out = FleetNode { tls: Some(tls), ..node }.render(template).unwrap_or_default();
        assert!(out.contains(r#""peer_sans":["spiffe://holysheep/fleet"]"#), "{out}");
        let (listener, cluster) = out.split_once("\n    transport_socket:").expect("the cluster's");
        assert!(listener.contains("\n      transport_socket:\n") && listener.contains("DownstreamTlsContext"), "{out}");
        assert!(listener.contains("require_client_certificate: true"), "{out}");
        assert!(
            cluster.contains("UpstreamTlsContext") && cluster.contains(r#"trusted_ca: {filename: "/certs/ca.pem"}"#)
        );
        assert!(cluster.contains(r#"{san_type: URI, matcher: {exact: "spiffe://holysheep/fleet"}}"#), "{out}");
    }

    #[test]
    fn an_edge_node_has_only_the_forward_listener_on_the_shields_ring() {
        let node = EdgeNode {
            admin_port: 9930,
            public_port: 10030,
            owner_ports: vec![10020, 10021],
            wasm: "/p.wasm".into(),
            config: r#"{"edge":{"max_age_seconds":5}}"#.into(),
            tls: None,
        };
        let out = node.render("@PUBLIC_PORT@\n@OWNER_ENDPOINTS@\n'@FORWARD_CONFIG@'").unwrap_or_default();
        assert!(out.starts_with("10030\n        - endpoint:"), "{out}");
        assert!(
            out.ends_with(
                r#"port_value: 10021}}}
'{"edge":{"max_age_seconds":5},"role":"forward"}'"#
            ),
            "{out}"
        );
        assert_eq!(node.render("@OWNER_PORT@"), Err(Unfilled("@OWNER_PORT@".into())));
    }
}
