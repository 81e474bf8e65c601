//! `envoy/production.yaml` run for real, not only validated: its HolySheep cluster's TLS
//! (a test CA in place of the system's, the SAN `api.holysheep.ai` checked, HTTP/2) to a
//! real TLS server (Debian's nginx, HTTP/2, in front of the mock), the only substitutions
//! being addresses, ports, file paths and the CA. A certificate for another name is refused.

use host_test::client::request;
use host_test::envoy::{native_dir, wasm_path, workspace_root, Envoy, Shell};
use host_test::mock::Running;
use host_test::stack::streamed;
use host_test::stack::{poll_until, prompt, PATH};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const KEY: &str = "sk-production-e2e-41f3";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("openssl runs");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A test CA, and a server certificate it signed for `name` (as its only SAN).
fn certificates(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=holysheep test CA",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    std::fs::write(dir.join("san.ext"), format!("subjectAltName=DNS:{name}\n")).expect("ext");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ],
    );
}

/// nginx on `port` with TLS (the certificate in `dir`) and HTTP/2, proxying to the mock, its
/// access log (`$server_protocol` per request) in `dir/access.log`.
struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn nginx(dir: &Path, port: u16, mock: SocketAddr) -> Nginx {
    let d = dir.display();
    let conf = format!(
        "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\nevents {{}}\nhttp {{\n  \
         access_log {d}/access.log;\n  log_format p '$server_protocol $request_uri';\n  \
         client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  \
         server {{\n    listen 127.0.0.1:{port} ssl http2;\n    access_log {d}/access.log p;\n    \
         ssl_certificate {d}/server.pem;\n    ssl_certificate_key {d}/server.key;\n    \
         location / {{\n      proxy_pass http://{mock};\n      proxy_http_version 1.1;\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    std::fs::write(dir.join("nginx.conf"), conf).expect("nginx.conf");
    // Debian puts it in /usr/sbin, which a user's PATH may lack.
    let bin = if Path::new("/usr/sbin/nginx").exists() { "/usr/sbin/nginx" } else { "nginx" };
    let child = Command::new(bin)
        .arg("-c")
        .arg(dir.join("nginx.conf"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nginx starts (Debian's nginx; envoy/setup.sh installs it)");
    poll_until(|| TcpListener::bind(("127.0.0.1", port)).is_err(), "nginx never listened");
    Nginx(child)
}

/// `envoy/production.yaml` with only its addresses, ports, paths and CA replaced.
fn production(dir: &Path, listen: u16, admin: u16, tls: u16) -> String {
    let shipped = std::fs::read_to_string(workspace_root().join("envoy/production.yaml")).expect("production.yaml");
    let subs = [
        ("port_value: 9901", format!("port_value: {admin}")),
        ("address: 0.0.0.0, port_value: 10000", format!("address: 127.0.0.1, port_value: {listen}")),
        ("address: api.holysheep.ai, port_value: 443", format!("address: 127.0.0.1, port_value: {tls}")),
        ("/etc/ssl/certs/ca-certificates.crt", dir.join("ca.pem").display().to_string()),
        ("/etc/envoy/holysheep_edge.wasm", wasm_path().display().to_string()),
        ("path: /dev/stdout", format!("path: {}", dir.join("envoy-access.log").display())),
    ];
    subs.iter().fold(shipped, |yaml, (from, to)| {
        assert!(yaml.contains(from), "production.yaml no longer has {from}");
        yaml.replacen(from, to, 1)
    })
}

fn scratch(name: &str) -> PathBuf {
    let dir = workspace_root().join("target/e2e").join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

fn start(dir: &Path, name: &str, mock: &Running) -> (Envoy, Nginx, SocketAddr) {
    start_shell(dir, name, mock, Shell::Wasm)
}

/// `start` on `shell`: the native module's is `envoy-render production-native`'s variant.
fn start_shell(dir: &Path, name: &str, mock: &Running, shell: Shell) -> (Envoy, Nginx, SocketAddr) {
    certificates(dir, name);
    let [tls, listen, admin] = host_test::ports::free(3).expect("ports")[..] else { unreachable!("three ports") };
    let server = nginx(dir, tls, mock.addr);
    let mut yaml = production(dir, listen, admin, tls);
    let mut env = vec![("HOLYSHEEP_API_KEY", KEY.to_owned())];
    if shell == Shell::Native {
        yaml = envoy_render::production_native(&yaml).expect("the native variant");
        env.push(("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", native_dir().display().to_string()));
    }
    let envoy = Envoy::spawn(dir.join("envoy"), &yaml, 2, &env).expect("envoy starts");
    (envoy, server, SocketAddr::from(([127, 0, 0, 1], listen)))
}

#[test]
fn the_production_transport_speaks_tls_and_http2_and_checks_the_name() {
    let mock = Running::start(Some(KEY), 0).expect("mock");
    let dir = scratch("production");
    std::fs::create_dir_all(dir.join("envoy")).expect("dir");
    let (envoy, _nginx, edge) = start(&dir, "api.holysheep.ai", &mock);
    let auth = [("authorization", "Bearer client")];
    let body = prompt("over tls");
    let miss = request(edge, "POST", PATH, &auth, body.as_bytes()).expect("answer");
    assert_eq!((miss.status, miss.cache()), (200, "MISS"), "{}", miss.text());
    assert_eq!(request(edge, "POST", PATH, &auth, body.as_bytes()).expect("answer").cache(), "HIT");
    let stream = streamed(&body);
    let streamed =
        request(edge, "POST", PATH, &auth, streamed(&prompt("a stream over tls")).as_bytes()).expect("answer");
    assert_eq!(streamed.status, 200);
    assert!(streamed.text().contains("data: [DONE]"), "{}", streamed.text());
    assert!(request(edge, "POST", PATH, &auth, stream.as_bytes()).expect("answer").text().contains("data: [DONE]"));
    assert_eq!(mock.mock.calls(), 2, "the MISS and the stream reached the mock through TLS");
    let log = std::fs::read_to_string(dir.join("access.log")).unwrap_or_default();
    assert!(log.lines().count() >= 2 && log.lines().all(|l| l.starts_with("HTTP/2.0 ")), "HTTP/2 to HolySheep: {log}");
    assert!(envoy.stat("cluster.holysheep.ssl.handshake") >= 1);
    drop(envoy);

    let wrong_dir = scratch("production-wrong-name");
    std::fs::create_dir_all(wrong_dir.join("envoy")).expect("dir");
    let calls = mock.mock.calls();
    let (envoy, _nginx, edge) = start(&wrong_dir, "wrong.example", &mock);
    let refused = request(edge, "POST", PATH, &auth, prompt("to the wrong name").as_bytes()).expect("answer");
    assert_eq!(refused.status, 503, "a certificate for another name is refused: {}", refused.text());
    assert_eq!(refused.json()["error"]["code"], "upstream_error", "an OpenAI-shaped error: {}", refused.text());
    assert_eq!(mock.mock.calls(), calls, "nothing reached the server with the wrong name");
    assert!(envoy.stat("cluster.holysheep.ssl.fail_verify_san") >= 1, "the SAN check refused it");
    assert!(envoy.crashes().is_empty());
}

/// The production configuration's native variant (`envoy-render production-native`), run
/// for real: a MISS, a HIT and a stream over TLS and HTTP/2, and the access log's fields.
#[test]
fn the_production_configurations_native_variant_serves_over_tls() {
    let mock = Running::start(Some(KEY), 0).expect("mock");
    let dir = scratch("production-native");
    std::fs::create_dir_all(dir.join("envoy")).expect("dir");
    let (envoy, _nginx, edge) = start_shell(&dir, "api.holysheep.ai", &mock, Shell::Native);
    let auth = [("authorization", "Bearer client")];
    let body = prompt("over tls, natively");
    let miss = request(edge, "POST", PATH, &auth, body.as_bytes()).expect("answer");
    assert_eq!((miss.status, miss.cache()), (200, "MISS"), "{}", miss.text());
    assert_eq!(request(edge, "POST", PATH, &auth, body.as_bytes()).expect("answer").cache(), "HIT");
    let stream = request(edge, "POST", PATH, &auth, streamed(&prompt("a native stream")).as_bytes()).expect("answer");
    assert!(stream.text().contains("data: [DONE]"), "{}", stream.text());
    assert_eq!(mock.mock.calls(), 2);
    let log = std::fs::read_to_string(dir.join("access.log")).unwrap_or_default();
    assert!(log.lines().count() >= 2 && log.lines().all(|l| l.starts_with("HTTP/2.0 ")), "HTTP/2 to HolySheep: {log}");
    poll_until(
        || std::fs::read_to_string(dir.join("envoy-access.log")).is_ok_and(|l| l.lines().count() >= 3),
        "the access log never had the three requests",
    );
    let access = std::fs::read_to_string(dir.join("envoy-access.log")).unwrap_or_default();
    let hit = access.lines().find(|l| l.contains(r#""holysheep.cache":"HIT""#));
    assert!(hit.is_some_and(|l| l.contains(r#""gen_ai.request.model":"gpt-4.1""#)), "{access}");
    assert!(envoy.crashes().is_empty());
}
