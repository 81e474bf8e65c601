//! nginx's `proxy_cache` (Debian's nginx) beside the native module's HIT, one worker each on
//! one mock, alternating in one run: the same cached answer to the same POST, from a cache
//! keyed by the request's body.

use crate::load::{expect_all, load, Prompts};
use crate::report::Report;
use crate::stats::{alternate, median, paired, throughput, Stats};
use host_test::client::request;
use host_test::envoy::{Envoy, Options, Shell};
use host_test::mock::Running;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

/// nginx, stopped when dropped.
struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// nginx with one worker in front of `mock`, caching 200s of any POST by its body.
fn nginx(dir: &Path, port: u16, mock: SocketAddr) -> std::io::Result<Nginx> {
    std::fs::create_dir_all(dir)?;
    let d = dir.display();
    let conf = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 1024; }}\nhttp {{\n  access_log off;\n  \
         keepalive_requests 100000000;\n  keepalive_timeout 300s;\n  \
         client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  \
         proxy_cache_path {d}/cache keys_zone=answers:10m;\n  \
         server {{\n    listen 127.0.0.1:{port};\n    client_body_buffer_size 64k;\n    \
         location / {{\n      proxy_pass http://{mock};\n      proxy_http_version 1.1;\n      \
         proxy_cache answers;\n      proxy_cache_methods POST;\n      \
         proxy_cache_key \"$request_uri|$request_body\";\n      proxy_cache_valid 200 10m;\n      \
         proxy_ignore_headers Cache-Control Expires Set-Cookie;\n    }}\n  }}\n}}\n"
    );
    std::fs::write(dir.join("nginx.conf"), conf)?;
    // Debian puts it in /usr/sbin, which a user's PATH may lack.
    let bin = if Path::new("/usr/sbin/nginx").exists() { "/usr/sbin/nginx" } else { "nginx" };
    let mut command = Command::new(bin);
    command.arg("-c").arg(dir.join("nginx.conf")).stdout(Stdio::null()).stderr(Stdio::null());
    let server = Nginx(command.spawn()?);
    host_test::stack::poll_until(|| TcpListener::bind(("127.0.0.1", port)).is_err(), "nginx never listened");
    Ok(server)
}

/// The rows (part of `BENCH_ONLY=native`).
pub fn nginx_rows(r: &mut Report, rounds: usize, (conns, secs): (usize, u64), hit_prompt: &str) -> std::io::Result<()> {
    let mock = Running::start(None, 0)?;
    let mut opts = Options::new("{}", mock.addr);
    (opts.shell, opts.concurrency) = (Shell::Native, 1);
    let native = Envoy::start(&opts)?;
    let port = host_test::ports::free(1)?[0];
    let dir = host_test::envoy::workspace_root().join(format!("target/bench/nginx-{}", std::process::id()));
    let _server = nginx(&dir, port, mock.addr)?;
    let cache = SocketAddr::from(([127, 0, 0, 1], port));
    let auth = [("authorization", "Bearer bench")];
    for addr in [native.edge, cache, cache] {
        request(addr, "POST", crate::load::PATH, &auth, hit_prompt.as_bytes())?;
    }
    let calls = mock.mock.calls();
    let body = hit_prompt.to_owned();
    let same: Prompts = Arc::new(move || body.clone());
    let rows: Vec<Vec<Stats>> = alternate(
        rounds,
        &mut [&mut || expect_all(load(native.edge, conns, secs, same.clone()), "HIT"), &mut || {
            load(cache, conns, secs, same.clone())
        }],
    );
    if mock.mock.calls() != calls {
        return Err(std::io::Error::other("nginx's cache let requests through to the mock"));
    }
    let [hit, nginx_hit] = &rows[..] else { unreachable!("two rows") };
    let ratio = paired(hit, nginx_hit, throughput);
    let names = ["HIT, native module, 1 worker", "HIT, nginx proxy_cache, 1 worker"];
    for (name, row) in names.into_iter().zip(rows.into_iter().map(median)) {
        r.row(name, row);
    }
    r.ratio("native HIT / nginx proxy_cache HIT (1 worker each)", ratio, "");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
