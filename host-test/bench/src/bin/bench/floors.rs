//! The bench's Envoy: the edge, its baselines (`direct_response`, a plain proxy) and the
//! floors (`host-test/bench/floors/`: minimal proxy-wasm filters measured beside the plugin).

use crate::load::PATH;
use host_test::client::{request, Resp};
use host_test::envoy::{access_log as access_log_yaml, workspace_root, Envoy, Options};
use host_test::mock::Running;
use host_test::stack::prompt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A floor filter's listener (`host-test/bench/floors/`), added to the bench's Envoy.
pub fn floor_listener(name: &str, wasm: &Path, configuration: &str) -> String {
    format!(
        r#"  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: {name}
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: holysheep, timeout: 120s}}
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: {name}
                root_id: {name}
                allow_on_headers_stop_iteration: true
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{configuration}'
                vm_config:
                  vm_id: {name}
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{wasm}"}}}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
        wasm = wasm.display(),
        configuration = configuration.replace('\'', "''"),
    )
}

/// A floor's listener with an access log at `path` (as the edge's `edge_logged`).
pub fn logged_floor(listener: String, path: &Path) -> String {
    let prefix = listener.lines().find(|l| l.trim_start().starts_with("stat_prefix:")).unwrap_or_default().to_owned();
    listener.replacen(&format!("{prefix}\n"), &format!("{prefix}\n{}", access_log_yaml(path)), 1)
}

/// The bench's Envoy with every floor's listener, checked to answer as the edge does.
pub struct Stage {
    pub envoy: Envoy,
    /// The edge's access log (`START TOOK CACHE`) and the held-requests floor's.
    pub edge_log: PathBuf,
    pub held_log: PathBuf,
    pub floor_reply: SocketAddr,
    pub floor_hit_calls: SocketAddr,
    pub floor_callout: SocketAddr,
    pub floor_miss_calls: SocketAddr,
    pub floor_miss_work: SocketAddr,
}

impl Stage {
    /// Starts the Envoy (its floors' crowds held until `crowd` arrive) and checks that the
    /// HIT's floors serve the HIT's body and headers, and the MISS's floor the MISS's.
    pub fn start(mock: &Running, crowd: usize, hit_prompt: &str) -> std::io::Result<Stage> {
        // The direct_response baseline and the local-reply floor serve exactly the body a HIT serves.
        let hit_body = request(mock.addr, "POST", PATH, &[], hit_prompt.as_bytes())?.body;
        let hit_text = String::from_utf8_lossy(&hit_body).into_owned();
        let floors = workspace_root().join("target/floors/wasm32-wasip1/release");
        let (reply, callout) = (floors.join("floor_reply.wasm"), floors.join("floor_callout.wasm"));
        let edge_log = std::env::temp_dir().join(format!("holysheep-bench-{}.log", std::process::id()));
        let held_log = std::env::temp_dir().join(format!("holysheep-bench-held-{}.log", std::process::id()));
        let mut opts = Options::new("{}", mock.addr);
        opts.direct_body = hit_body.clone();
        opts.edge_access_log = Some(edge_log.clone());
        opts.extra_listeners = floor_listener("floor_reply", &reply, &hit_text)
            + &floor_listener("floor_hit_calls", &reply, &format!("hit-calls:{hit_text}"))
            + &logged_floor(floor_listener("floor_held", &reply, &format!("held:{crowd}:{hit_text}")), &held_log)
            + &floor_listener("floor_callout", &callout, "{}")
            + &floor_listener("floor_miss_calls", &callout, "miss-calls")
            + &floor_listener("floor_miss_work", &callout, "miss-work");
        let envoy = Envoy::start(&opts)?;
        let listener = |name: &str| envoy.listener(name).ok_or_else(|| std::io::Error::other(format!("no {name}")));
        let stage = Stage {
            floor_reply: listener("floor_reply")?,
            floor_hit_calls: listener("floor_hit_calls")?,
            floor_callout: listener("floor_callout")?,
            floor_miss_calls: listener("floor_miss_calls")?,
            floor_miss_work: listener("floor_miss_work")?,
            envoy,
            edge_log,
            held_log,
        };
        let edge =
            |body: &str| request(stage.envoy.edge, "POST", PATH, &[("authorization", "Bearer bench")], body.as_bytes());
        let warm = edge(hit_prompt)?;
        assert_eq!(warm.body, hit_body, "the edge serves the mock's answer");
        let floor = request(stage.floor_reply, "POST", PATH, &[], hit_prompt.as_bytes())?;
        assert_eq!(floor.body, hit_body, "the local-reply floor serves the same body");
        let hit = edge(hit_prompt)?;
        let like = request(stage.floor_hit_calls, "POST", PATH, &[], hit_prompt.as_bytes())?;
        assert_eq!(names(&like), names(&hit), "the floor with the HIT's host calls sends the HIT's headers");
        let miss_prompt = prompt("bench: the MISS's headers");
        let miss = edge(&miss_prompt)?;
        // Its queue is registered on its first tick (20 ms), as the plugin's is; until then it
        // answers as the plain callout floor.
        let deadline = Instant::now() + Duration::from_secs(10);
        let like = loop {
            let like = request(stage.floor_miss_calls, "POST", PATH, &[], miss_prompt.as_bytes())?;
            if like.header("x-holysheep-cache").is_some() || Instant::now() > deadline {
                break like;
            }
        };
        assert_eq!(
            (miss.cache(), like.body == miss.body),
            ("MISS", true),
            "the floor with the MISS's calls answers alike"
        );
        assert_eq!(names(&like), names(&miss), "the floor with the MISS's host calls sends the MISS's headers");
        Ok(stage)
    }
}

/// An answer's header names with their values' lengths, sorted.
fn names(r: &Resp) -> Vec<String> {
    let mut n: Vec<String> = r.headers.iter().map(|(n, v)| format!("{n}:{}", v.len())).collect();
    n.sort();
    n
}
