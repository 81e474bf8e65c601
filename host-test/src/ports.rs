//! Ports on 127.0.0.1 for servers a test configures before they start.
//!
//! They are taken below the system's ephemeral range (Linux: 32768 and up), where no
//! server that binds port 0 (the mock, the component host, a client's socket) can be
//! handed one between the moment it is chosen here and the moment Envoy or etcd binds it;
//! and each is handed out once per process.

use std::io;
use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

const FIRST: u32 = 20_000;
const SPAN: u32 = 12_000;

/// The next candidate; starts at a point of the span chosen by the process id, so two test
/// processes at once rarely try the same ports (a port one binds the other skips).
static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);

fn candidate() -> u16 {
    let _ = NEXT.compare_exchange(u32::MAX, (std::process::id() * 97) % SPAN, Ordering::SeqCst, Ordering::SeqCst);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    (FIRST + n % SPAN) as u16
}

/// `n` different ports free right now, none handed out before by this process.
pub fn free(n: usize) -> io::Result<Vec<u16>> {
    let mut ports = Vec::with_capacity(n);
    for _ in 0..SPAN {
        if ports.len() == n {
            return Ok(ports);
        }
        let port = candidate();
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            ports.push(port);
        }
    }
    Err(io::Error::other("no free port below the ephemeral range"))
}
