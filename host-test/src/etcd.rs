//! A real etcd (Debian's `etcd-server`, 3.4) on free ports for the tests that keep spend in
//! it: one member, its data in a directory of its own, stopped (killed) when dropped.

use crate::client::request;
use crate::envoy::Envoy;
use holysheep_edge::core::wire::base64::{decode, encode};
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    child: Child,
    /// The client port (the v3 JSON gateway).
    pub addr: SocketAddr,
    pub dir: PathBuf,
}

/// `ETCD_BIN`, or Debian's.
fn etcd_bin() -> PathBuf {
    std::env::var_os("ETCD_BIN").map_or_else(|| PathBuf::from("/usr/bin/etcd"), PathBuf::from)
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub fn start() -> io::Result<Etcd> {
        let dir = Envoy::new_dir()?;
        let ports = crate::ports::free(2)?;
        let client = format!("http://127.0.0.1:{}", ports[0]);
        let peer = format!("http://127.0.0.1:{}", ports[1]);
        let log = std::fs::File::create(dir.join("etcd.log"))?;
        let child = Command::new(etcd_bin())
            .args(["--name", "test", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let etcd = Etcd { child, addr: SocketAddr::from(([127, 0, 0, 1], ports[0])), dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while request(etcd.addr, "POST", "/v3/kv/range", &[], br#"{"key":"AA=="}"#).map(|r| r.status).ok() != Some(200)
        {
            if Instant::now() > deadline {
                return Err(io::Error::other(format!("etcd never answered: {}", etcd.log())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(etcd)
    }

    /// Kills the member (an outage): nothing answers on its port until the test ends.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    /// What the key `key` holds, as text (`None`: no such key).
    pub fn get(&self, key: &str) -> Option<String> {
        let body = serde_json::json!({ "key": encode(key.as_bytes()) }).to_string();
        let r = request(self.addr, "POST", "/v3/kv/range", &[], body.as_bytes()).ok()?;
        let value = r.json()["kvs"][0]["value"].as_str()?.to_owned();
        String::from_utf8(decode(&value)?).ok()
    }

    /// Writes `value` at `key`, whatever it held.
    pub fn put(&self, key: &str, value: &str) -> bool {
        let body = serde_json::json!({ "key": encode(key.as_bytes()), "value": encode(value.as_bytes()) }).to_string();
        request(self.addr, "POST", "/v3/kv/put", &[], body.as_bytes()).is_ok_and(|r| r.status == 200)
    }

    /// An Envoy cluster named `etcd` at this member, as YAML under `clusters`.
    pub fn cluster(&self) -> String {
        crate::envoy::static_cluster("etcd", self.addr.port(), "1s")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
