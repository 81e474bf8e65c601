//! Ports on 127.0.0.1 for servers a test configures before they start.

use std::io;
use std::net::TcpListener;

/// `n` different ports free right now (each asked of the system in turn, a repeat asked
/// again).
pub fn free(n: usize) -> io::Result<Vec<u16>> {
    let mut ports = Vec::with_capacity(n);
    while ports.len() < n {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    Ok(ports)
}
