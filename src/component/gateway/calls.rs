//! The component's calls to HolySheep: a governed call's attempt (its head, then its
//! whole answer, renewing the lease while it waits) and the requests it does not govern,
//! forwarded with the client's own credentials and streamed back.

use super::instance::Gateway;
use crate::component::host;
use crate::component::wasi::http::outgoing_handler;
use crate::component::wasi::http::types::{
    ErrorCode, IncomingBody, IncomingRequest, IncomingResponse, Method, OutgoingBody, OutgoingRequest, RequestOptions,
    ResponseOutparam, Scheme,
};
use crate::core::api::call::HttpCall;
use crate::core::api::error::ApiError;
use crate::core::api::head::HeadEdit;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::reply::Reply;
use crate::core::api::response::Response;
use crate::core::coalesce::engine::Call;
use crate::core::flight::leader::Leader;
use crate::core::intake;
use crate::core::semantic::MAX_EMBEDDING_BYTES;
use crate::core::upstream;

/// The most bytes read from one HolySheep answer.
const MAX_UPSTREAM_BODY: usize = 16 * 1024 * 1024;
/// Request headers never forwarded (hop-by-hop, or set by the gateway).
const NOT_FORWARDED: [&str; 8] = [
    headers::HOST,
    "connection",
    "keep-alive",
    "proxy-connection",
    headers::TRANSFER_ENCODING,
    "upgrade",
    "te",
    headers::CONTENT_LENGTH,
];
/// Response headers not copied from a forwarded answer.
const NOT_RETURNED: [&str; 5] = ["connection", "keep-alive", "proxy-connection", headers::TRANSFER_ENCODING, "upgrade"];

impl Gateway {
    /// One attempt (a call the core made ready), renewing the lease while it waits.
    pub(super) fn attempt(&self, leader: &Leader, call: &HttpCall) -> (Option<Response>, ProviderHints) {
        let deadline = host::now_ms().saturating_add(call.timeout_ms);
        match self.request(call, leader.call(), deadline) {
            Ok(response) => self.read_answer(response, leader, deadline),
            Err(failed) => (None, failed.hints()),
        }
    }

    /// HolySheep's whole answer, read by `deadline_ms` (the call's), renewing the lease
    /// while the body arrives: a slow body must not let a waiter take over and call again.
    pub(super) fn read_answer(
        &self,
        response: IncomingResponse,
        leader: &Leader,
        deadline_ms: u64,
    ) -> (Option<Response>, ProviderHints) {
        let status = response.status();
        let headers = host::header_pairs(&response.headers());
        match self.read_whole(response, leader.call(), deadline_ms, MAX_UPSTREAM_BODY) {
            Some(bytes) => {
                let (r, hints) = upstream::response(status, &headers, bytes, leader.sent());
                (Some(r), hints)
            }
            None => (None, ProviderHints::default()),
        }
    }

    /// A response's whole body, at most `max` bytes, read by `deadline_ms` while renewing
    /// the lease of `call`.
    fn read_whole(&self, response: IncomingResponse, call: &Call, deadline_ms: u64, max: usize) -> Option<Vec<u8>> {
        let body = response.consume().ok()?;
        let read = body.stream().ok().and_then(|from| {
            let mut bytes = Vec::new();
            loop {
                match host::read_chunk(&from, deadline_ms, self.config.tick_ms(), &mut || self.renew(call)) {
                    Ok(Some(chunk)) if bytes.len() + chunk.len() <= max => bytes.extend(chunk),
                    Ok(None) => return Some(bytes),
                    Ok(Some(_)) | Err(_) => return None,
                }
            }
        });
        drop(IncomingBody::finish(body));
        read
    }

    /// A leader's embedding call (`flight::leader::Do::Embed`): its status and its body
    /// (`None`: larger than the edge reads, or cut off).
    pub(super) fn embed(&self, leader: &Call, call: &HttpCall) -> Result<(u16, Option<Vec<u8>>), Failed> {
        let deadline = host::now_ms().saturating_add(call.timeout_ms);
        let response = self.request(call, leader, deadline)?;
        let status = response.status();
        Ok((status, self.read_whole(response, leader, deadline, MAX_EMBEDDING_BYTES)))
    }

    /// Makes a call the core made ready (with its `content-length`) and waits for the head
    /// of its answer until `deadline_ms`, renewing the lease of `leader` meanwhile.
    pub(super) fn request(&self, call: &HttpCall, leader: &Call, deadline_ms: u64) -> Result<IncomingResponse, Failed> {
        let mut headers: Vec<(String, String)> = call.regular().map(|(n, v)| (n.to_owned(), v.to_owned())).collect();
        headers.push((headers::CONTENT_LENGTH.to_owned(), call.body.len().to_string()));
        let (authority, path) = (call.header(":authority").unwrap_or_default(), call.header(":path").unwrap_or("/"));
        let request = self.outgoing(Method::Post, authority, path, &headers).ok_or(Failed::Unsent)?;
        self.send(request, Body::Bytes(&call.body), deadline_ms, &mut || self.renew(leader))
    }

    /// Sends a request to HolySheep with `body` and waits for its head until `deadline_ms`,
    /// calling `between` while it waits.
    fn send(
        &self,
        request: OutgoingRequest,
        body: Body<'_>,
        deadline_ms: u64,
        between: &mut dyn FnMut(),
    ) -> Result<IncomingResponse, Failed> {
        let outgoing = request.body().map_err(|()| Failed::Unsent)?;
        let future = outgoing_handler::handle(request, Some(options(deadline_ms))).map_err(|_| Failed::Unsent)?;
        if let Ok(to) = outgoing.write() {
            match body {
                Body::Bytes(b) => {
                    host::write_all(&to, b);
                }
                Body::From(client) => {
                    if let Ok(incoming) = client.consume() {
                        if let Ok(from) = incoming.stream() {
                            host::pipe(&from, &to);
                        }
                    }
                }
            }
        }
        OutgoingBody::finish(outgoing, None).map_err(|_| Failed::Unknown)?;
        let ready = future.subscribe();
        if !host::wait_for(&ready, deadline_ms, self.config.tick_ms(), between) {
            return Err(Failed::Unknown);
        }
        drop(ready);
        match future.get() {
            Some(Ok(Ok(response))) => Ok(response),
            Some(Ok(Err(e))) if never_sent(&e) => Err(Failed::Unsent),
            _ => Err(Failed::Unknown),
        }
    }

    fn outgoing(
        &self,
        method: Method,
        authority: &str,
        path: &str,
        headers: &[(String, String)],
    ) -> Option<OutgoingRequest> {
        let request = OutgoingRequest::new(host::fields(headers));
        let scheme = if self.config.upstream.scheme == "http" { Scheme::Http } else { Scheme::Https };
        request.set_method(&method).ok()?;
        request.set_scheme(Some(&scheme)).ok()?;
        request.set_authority(Some(authority)).ok()?;
        request.set_path_with_query(Some(path)).ok()?;
        Some(request)
    }

    /// Passes a request the gateway does not govern to HolySheep and streams the answer
    /// back. Without `operator_key` it carries the client's own credentials; with it (a
    /// verified tenant on a path `passthrough_paths` lists) the operator's key in place of
    /// the tenant's, which is the edge's own and never passes on.
    pub(super) fn forward(&self, request: IncomingRequest, operator_key: bool, out: ResponseOutparam) {
        let received = host::header_pairs(&request.headers());
        let edit =
            if operator_key { intake::with_operator_key(self.env.bearer.as_deref()) } else { HeadEdit::default() };
        let kept = |n: &String| !(NOT_FORWARDED.contains(&n.as_str()) || edit.remove.contains(n));
        let mut headers: Vec<(String, String)> = received.into_iter().filter(|(n, _)| kept(n)).collect();
        headers.extend(edit.set);
        let path = request.path_with_query().unwrap_or_else(|| "/".into());
        let deadline = host::now_ms().saturating_add(self.config.upstream.timeout_ms);
        let answer = self
            .outgoing(request.method(), &self.config.upstream.authority, &path, &headers)
            .and_then(|outgoing| self.send(outgoing, Body::From(&request), deadline, &mut || {}).ok());
        let Some(answer) = answer else {
            let e = ApiError::upstream(502, "HolySheep could not be reached", "upstream_unavailable");
            return host::reply(out, &Reply::error(&e), &[]);
        };
        // HolySheep refusing the operator's key: its body may quote part of the key.
        let sent = crate::core::upstream::Sent { operator_key, ..Default::default() };
        if let Some(e) = crate::core::upstream::refused(answer.status(), "application/json", sent) {
            drop(answer);
            return host::reply(out, &Reply::error(&e), &[]);
        }
        let headers: Vec<(String, String)> = host::header_pairs(&answer.headers())
            .into_iter()
            .filter(|(n, _)| !NOT_RETURNED.contains(&n.as_str()))
            .collect();
        let Some(client_body) = host::start_response(out, answer.status(), &headers) else { return };
        if let (Ok(from_body), Ok(to)) = (answer.consume(), client_body.write()) {
            if let Ok(from) = from_body.stream() {
                host::pipe(&from, &to);
            }
        }
        let _ = OutgoingBody::finish(client_body, None);
    }
}

fn options(deadline_ms: u64) -> RequestOptions {
    let options = RequestOptions::new();
    let ns = deadline_ms.saturating_sub(host::now_ms()).max(1).saturating_mul(1_000_000);
    let _ = options.set_connect_timeout(Some(ns));
    let _ = options.set_first_byte_timeout(Some(ns));
    options
}

/// Why a call to HolySheep brought no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failed {
    /// It never reached HolySheep: the host would not send it, or no connection was made.
    Unsent,
    /// It may have: a timeout, or the connection lost after the request went out.
    Unknown,
}

impl Failed {
    /// What the attempt's flight is told: an attempt that never left was billed nothing.
    pub(super) fn hints(self) -> ProviderHints {
        match self {
            Failed::Unsent => ProviderHints::unsent(),
            Failed::Unknown => ProviderHints::default(),
        }
    }
}

/// The `wasi:http` errors that come before a request leaves: no address, no connection, a
/// certificate refused in the handshake, or the host's own refusal.
fn never_sent(e: &ErrorCode) -> bool {
    matches!(
        e,
        ErrorCode::DnsTimeout
            | ErrorCode::DnsError(_)
            | ErrorCode::DestinationNotFound
            | ErrorCode::DestinationUnavailable
            | ErrorCode::DestinationIpProhibited
            | ErrorCode::DestinationIpUnroutable
            | ErrorCode::ConnectionRefused
            | ErrorCode::ConnectionTimeout
            | ErrorCode::ConnectionLimitReached
            | ErrorCode::TlsCertificateError
            | ErrorCode::HttpRequestDenied
    )
}

/// The body of a request to HolySheep: bytes in hand, or the client's body streamed through.
enum Body<'a> {
    Bytes(&'a [u8]),
    From(&'a IncomingRequest),
}
