//! A tiny blocking HTTP/1.1 client for tests and benchmarks: one request per call, or a
//! keep-alive connection. Enough of HTTP/1.1 for Envoy's and the mock's answers.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn cache(&self) -> &str {
        self.header("x-holysheep-cache").unwrap_or("-")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `error.code` of an OpenAI-shaped error (`-` when there is none).
    pub fn error_code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap_or("-").to_owned()
    }
}

/// A keep-alive connection.
pub struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> io::Result<Conn> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(120)))?;
        Ok(Conn { reader: BufReader::new(stream) })
    }

    /// How long a read may wait (120 s unless set).
    pub fn read_timeout(self, timeout: Duration) -> io::Result<Conn> {
        self.reader.get_ref().set_read_timeout(Some(timeout))?;
        Ok(self)
    }

    /// Writes a request without reading the answer (to test clients that go away).
    pub fn send_only(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<()> {
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: edge\r\ncontent-length: {}\r\n", body.len());
        for (n, v) in headers {
            req.push_str(&format!("{n}: {v}\r\n"));
        }
        req.push_str("\r\n");
        let stream = self.reader.get_mut();
        stream.write_all(req.as_bytes())?;
        stream.write_all(body)
    }

    /// Writes part of a hand-made request (the rest follows later).
    pub fn send_raw_part(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.reader.get_mut().write_all(bytes)
    }

    /// Writes `bytes` as they are (a hand-made, possibly malformed, request) and reads
    /// the answer.
    pub fn raw(&mut self, bytes: &[u8]) -> io::Result<Resp> {
        self.reader.get_mut().write_all(bytes)?;
        self.read_response()
    }

    pub fn request(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<Resp> {
        self.send_only(method, path, headers, body)?;
        self.read_response()
    }

    pub fn read_response(&mut self) -> io::Result<Resp> {
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("bad status line {line:?}")))?;
        let mut headers = Vec::new();
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((n, v)) = l.split_once(':') {
                headers.push((n.trim().to_ascii_lowercase(), v.trim().to_owned()));
            }
        }
        let find = |n: &str| headers.iter().find(|(h, _)| h == n).map(|(_, v)| v.clone());
        let body = if let Some(len) = find("content-length").and_then(|l| l.parse::<usize>().ok()) {
            let mut b = vec![0; len];
            self.reader.read_exact(&mut b)?;
            b
        } else if find("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
            self.read_chunked()?
        } else {
            let mut b = Vec::new();
            self.reader.read_to_end(&mut b)?;
            b
        };
        Ok(Resp { status, headers, body })
    }

    /// Reads the raw response (status line, headers, chunk framing and body) line by line
    /// until a line contains `needle`; returns what it read. For watching a stream arrive.
    pub fn read_until(&mut self, needle: &str) -> io::Result<String> {
        let mut seen = String::new();
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("no {needle:?} in {seen:?}")));
            }
            seen.push_str(&line);
            if line.contains(needle) {
                return Ok(seen);
            }
        }
    }

    /// After `read_until`, reads the rest of a chunked body up to its last (empty) chunk.
    pub fn read_past_last_chunk(&mut self) -> io::Result<()> {
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "no last chunk"));
            }
            if line == "0\r\n" {
                self.reader.read_line(&mut line)?;
                return Ok(());
            }
        }
    }

    fn read_chunked(&mut self) -> io::Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let mut size = String::new();
            self.reader.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let mut chunk = vec![0; n + 2];
            self.reader.read_exact(&mut chunk)?;
            if n == 0 {
                return Ok(body);
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
}

/// One request on a fresh connection.
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> io::Result<Resp> {
    Conn::open(addr)?.request(method, path, headers, body)
}
