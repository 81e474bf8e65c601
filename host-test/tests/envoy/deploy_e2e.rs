//! The deployment paths with real parts: the plugin as a Wasm OCI image pushed to a real
//! registry (Debian's `docker-registry`) with a real client (`skopeo`) and pulled back, and
//! Envoy loading the plugin over HTTP with the `sha256` of `deploy/envoy/remote-code.yaml`
//! (and refusing a wrong one).

use host_test::client::Resp;
use host_test::envoy::{wasm_path, workspace_root, Envoy, Options};
use host_test::mock::Running;
use host_test::stack::{poll_until, prompt, sha256_hex as hex};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

fn free_port() -> u16 {
    host_test::ports::free(1).expect("a port")[0]
}

/// A child process killed when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = workspace_root().join("target/e2e").join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("the tool runs");
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// `deploy/oci/pack.py` (what `make oci` runs) into `dir`: its manifest digest.
fn pack(dir: &Path, tag: &str) -> String {
    let out = run(Command::new("python3")
        .arg(workspace_root().join("deploy/oci/pack.py"))
        .arg(wasm_path())
        .arg(dir)
        .arg(tag));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines().find_map(|l| l.strip_prefix("manifest ")).expect("the manifest digest").to_owned()
}

#[test]
fn the_oci_image_round_trips_through_a_registry_with_its_digest() {
    let dir = scratch("oci");
    let port = free_port();
    let config = format!(
        "version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
        dir.join("registry").display()
    );
    std::fs::write(dir.join("registry.yml"), config).expect("registry config");
    let _registry = Process(
        Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("registry.yml"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("docker-registry starts (Debian's docker-registry; envoy/setup.sh installs it)"),
    );
    poll_until(|| TcpListener::bind(("127.0.0.1", port)).is_err(), "the registry never listened");
    let digest = pack(&dir.join("image"), "test");
    assert_eq!(pack(&dir.join("again"), "test"), digest, "the same plugin packs to the same digest");
    let image = format!("docker://127.0.0.1:{port}/holysheep-edge:test");
    let layout = format!("oci:{}:test", dir.join("image").display());
    run(Command::new("skopeo").args(["copy", "--dest-tls-verify=false", &layout, &image]));
    let raw = run(Command::new("skopeo").args(["inspect", "--raw", "--tls-verify=false", &image])).stdout;
    assert_eq!(format!("sha256:{}", hex(&raw)), digest, "the registry holds the manifest as packed");
    let manifest: serde_json::Value = serde_json::from_slice(&raw).expect("manifest JSON");
    assert_eq!(manifest["layers"][0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip");
    let pulled = dir.join("pulled");
    run(Command::new("skopeo").args([
        "copy",
        "--src-tls-verify=false",
        &image,
        &format!("oci:{}:test", pulled.display()),
    ]));
    let layer = manifest["layers"][0]["digest"].as_str().expect("a layer").trim_start_matches("sha256:").to_owned();
    let blob = pulled.join("blobs/sha256").join(&layer);
    run(Command::new("tar").arg("-xzf").arg(&blob).arg("-C").arg(&dir));
    let plugin = std::fs::read(dir.join("plugin.wasm")).expect("plugin.wasm in the layer");
    assert_eq!(hex(&plugin), hex(&std::fs::read(wasm_path()).expect("the plugin")), "the plugin, byte for byte");
}

/// The `code` and `plugin_server` cluster of `deploy/envoy/remote-code.yaml`, pointed at
/// `server` and expecting `sha256`.
fn remote(server: SocketAddr, sha256: &str) -> (String, String) {
    let shipped = std::fs::read_to_string(workspace_root().join("deploy/envoy/remote-code.yaml")).expect("file");
    let body = shipped.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>().join("\n");
    let (code, cluster) = body.split_once("plugin_server:\n").expect("two parts");
    let digest = code.lines().find_map(|l| l.trim().strip_prefix("sha256: ")).expect("a sha256").to_owned();
    let code =
        code.replacen("http://plugins.internal:8080/", &format!("http://{server}/"), 1).replacen(&digest, sha256, 1);
    let cluster = cluster
        .replacen(
            "address: plugins.internal, port_value: 8080",
            &format!("address: 127.0.0.1, port_value: {}", server.port()),
            1,
        )
        .replacen("type: STRICT_DNS", "type: STATIC", 1);
    let cluster: String = cluster
        .lines()
        .enumerate()
        .map(|(i, l)| if i == 0 { format!("  - {}\n", l.trim_start()) } else { format!("  {l}\n") })
        .collect();
    (code, cluster)
}

fn serve_plugin(dir: &Path) -> (Process, SocketAddr) {
    std::fs::copy(wasm_path(), dir.join("holysheep_edge.wasm")).expect("copy");
    let port = free_port();
    let child = Command::new("python3")
        .args(["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1", "--directory"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 -m http.server");
    poll_until(|| TcpListener::bind(("127.0.0.1", port)).is_err(), "the plugin server never listened");
    (Process(child), SocketAddr::from(([127, 0, 0, 1], port)))
}

fn chat(envoy: &Envoy, body: &str) -> Resp {
    host_test::client::request(
        envoy.edge,
        "POST",
        host_test::stack::PATH,
        &[("authorization", "Bearer sk-remote")],
        body.as_bytes(),
    )
    .expect("an answer")
}

#[test]
fn envoy_loads_the_plugin_over_http_with_its_sha256_and_refuses_another() {
    let dir = scratch("remote");
    let (_server, server) = serve_plugin(&dir);
    let mock = Running::start(None, 0).expect("mock");
    let digest = hex(&std::fs::read(wasm_path()).expect("the plugin"));

    let (code, cluster) = remote(server, &digest);
    let mut opts = Options::new("{}", mock.addr);
    (opts.wasm_code, opts.extra_clusters) = (Some(code), cluster);
    let envoy = Envoy::start(&opts).expect("envoy starts with the remote plugin");
    let body = prompt("loaded over http");
    assert_eq!(chat(&envoy, &body).cache(), "MISS");
    assert_eq!(chat(&envoy, &body).cache(), "HIT", "the plugin governs the listener");
    drop(envoy);

    let wrong = hex(b"not the plugin");
    let (code, cluster) = remote(server, &wrong);
    let mut opts = Options::new("{}", mock.addr);
    (opts.wasm_code, opts.extra_clusters) = (Some(code), cluster);
    let refused = Envoy::start(&opts).expect("Envoy starts; the filter fails closed");
    poll_until(|| refused.log().contains("Plugin holysheep-edge failed to load"), "Envoy never refused the plugin");
    let r = chat(&refused, &body);
    assert_eq!(
        (r.status, r.header("x-holysheep-cache")),
        (503, None),
        "a plugin of another digest never runs: {}",
        r.text()
    );
    assert!(refused.log().contains("Retry limit exceeded for fetching data from remote data source"));
    assert_eq!(mock.mock.calls(), 1, "nothing went upstream around the plugin");
}
