//! Faults a test plans for the next calls (`/mock/plan`, `Mock::plan`), and the answers
//! they make: a planned status or body, a slow body.

use crate::reply::error;
use crate::Body;
use http_body_util::channel::Channel;
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Bytes;
use hyper::{Response, StatusCode};
use serde_json::Value;
use std::time::Duration;

/// One planned answer for the next chat-completion call.
#[derive(Debug, Clone, Default)]
pub struct Fault {
    pub status: Option<u16>,
    pub retry_after: Option<String>,
    /// Close the connection without answering.
    pub reset: bool,
    /// Work out the answer and bill it, then close the connection without sending it (a
    /// connection that drops on the way back: HolySheep billed what the edge never saw).
    pub reset_after_billing: bool,
    /// Wait this long before answering.
    pub delay_ms: u64,
    /// Send headers, then wait this long before the body.
    pub slow_body_ms: u64,
    /// Streams: after this many events, wait until `Mock::release` before the rest.
    pub hold_after_events: Option<usize>,
    /// Wait until `Mock::release` before answering at all.
    pub hold: bool,
    /// Streams: after this many events, reset the connection (the stream is cut off).
    pub cut_after_events: Option<usize>,
    /// Streams of `/v1/completions` and `/v1/responses`: end cleanly without this many of
    /// the last events (1: no `[DONE]`, no `response.completed`).
    pub drop_last_events: Option<usize>,
    /// Answer with this body (and `content_type`, `status` or 200) instead of a completion.
    pub body: Option<String>,
    pub content_type: Option<String>,
}

impl Fault {
    pub(crate) fn from_json(v: &Value) -> Fault {
        Fault {
            status: v["status"].as_u64().map(|s| s as u16),
            retry_after: v["retry_after"]
                .as_str()
                .map(str::to_owned)
                .or_else(|| v["retry_after"].as_u64().map(|n| n.to_string())),
            reset: v["reset"].as_bool().unwrap_or(false),
            reset_after_billing: v["reset_after_billing"].as_bool().unwrap_or(false),
            delay_ms: v["delay_ms"].as_u64().unwrap_or(0),
            slow_body_ms: v["slow_body_ms"].as_u64().unwrap_or(0),
            hold_after_events: v["hold_after_events"].as_u64().map(|n| n as usize),
            hold: v["hold"].as_bool().unwrap_or(false),
            cut_after_events: v["cut_after_events"].as_u64().map(|n| n as usize),
            drop_last_events: v["drop_last_events"].as_u64().map(|n| n as usize),
            body: v["body"].as_str().map(str::to_owned),
            content_type: v["content_type"].as_str().map(str::to_owned),
        }
    }
}

pub(crate) fn planned_body(status: u16, body: &str, content_type: Option<&str>) -> Response<Body> {
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(body.to_owned()))));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    if let Some(v) = content_type.and_then(|t| hyper::header::HeaderValue::from_str(t).ok()) {
        r.headers_mut().insert("content-type", v);
    }
    r
}

pub(crate) fn planned_error(status: u16) -> Response<Body> {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let (kind, c) = match status {
        429 => ("requests", "rate_limit_exceeded"),
        400..=499 => ("invalid_request_error", "mock_error"),
        _ => ("server_error", "mock_error"),
    };
    error(code, &format!("The mock was told to answer {status}"), kind, c, None)
}

pub(crate) fn slow(resp: Response<Body>, ms: u64) -> Response<Body> {
    let (parts, body) = resp.into_parts();
    let Either::Left(full) = body else { return Response::from_parts(parts, body) };
    let (mut tx, channel) = Channel::<Bytes, std::io::Error>::new(1);
    tokio::spawn(async move {
        let bytes = full.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let _ = tx.send_data(bytes).await;
    });
    Response::from_parts(parts, Either::Right(channel))
}
