//! An OTLP/gRPC receiver: the collector's trace, logs and metrics services, from the
//! official OpenTelemetry protocol definitions (`opentelemetry-proto`), keeping what
//! arrives in memory as plain values a test compares and `otlp-receiver` prints.

use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{LogsService, LogsServiceServer};
use opentelemetry_proto::tonic::collector::logs::v1::{ExportLogsServiceRequest, ExportLogsServiceResponse};
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use opentelemetry_proto::tonic::metrics::v1::number_data_point::Value as Number;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status};

/// Attributes by key, every value as text (as Envoy sends them, and as a test compares).
pub type Attributes = BTreeMap<String, String>;

/// One span as it arrived.
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// 16 lowercase hex digits.
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub attributes: Attributes,
    /// (trace id, span id) of each linked span.
    pub links: Vec<(String, String)>,
    /// The span's resource's attributes (`service.name`, ...).
    pub resource: Attributes,
}

/// One log record as it arrived.
#[derive(Debug, Clone)]
pub struct Log {
    pub body: String,
    pub trace_id: String,
    pub attributes: Attributes,
    pub resource: Attributes,
}

/// One data point of a metric as it arrived: a counter's or gauge's value, or a histogram's
/// count and sum.
#[derive(Debug, Clone)]
pub struct Point {
    pub metric: String,
    pub attributes: Attributes,
    pub kind: Kind,
    /// Nanoseconds since the epoch, as the exporter stamped it.
    pub time_unix_nano: u64,
    /// A histogram's buckets: each upper bound and how many values fell at or below it
    /// and above the one before (the last bound is infinity).
    pub buckets: Vec<(f64, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// A sum's point; `monotonic` for a counter.
    Sum {
        value: f64,
        monotonic: bool,
        delta: bool,
    },
    Gauge {
        value: f64,
    },
    Histogram {
        count: u64,
        sum: f64,
        delta: bool,
    },
}

/// Everything received so far, in arrival order.
#[derive(Debug, Default, Clone)]
pub struct Received {
    pub spans: Vec<Span>,
    pub logs: Vec<Log>,
    pub points: Vec<Point>,
    /// Export requests per signal: traces, logs, metrics.
    pub exports: [u64; 3],
    /// Spans, log records and metric points received (also when not kept).
    pub counts: [u64; 3],
}

#[derive(Default)]
struct Inbox {
    got: Mutex<Received>,
    changed: Condvar,
    /// Only count what arrives (a load's millions of spans), keeping none of it.
    counting: bool,
}

impl Inbox {
    fn add(&self, signal: usize, f: impl FnOnce(&mut Received) -> u64) {
        if let Ok(mut got) = self.got.lock() {
            got.exports[signal] += 1;
            let mut kept = Received::default();
            let n = f(if self.counting { &mut kept } else { &mut got });
            got.counts[signal] += n;
        }
        self.changed.notify_all();
    }
}

/// A receiver listening on 127.0.0.1 (a port of its own), on a runtime of its own; stops
/// when dropped.
pub struct Receiver {
    pub addr: SocketAddr,
    inbox: Arc<Inbox>,
    _runtime: tokio::runtime::Runtime,
}

impl Receiver {
    pub fn start() -> std::io::Result<Receiver> {
        Receiver::start_on("127.0.0.1:0".parse().map_err(std::io::Error::other)?)
    }

    /// A receiver that counts what arrives and keeps none of it (for a load).
    pub fn counting() -> std::io::Result<Receiver> {
        Receiver::listen("127.0.0.1:0".parse().map_err(std::io::Error::other)?, true)
    }

    pub fn start_on(at: SocketAddr) -> std::io::Result<Receiver> {
        Receiver::listen(at, false)
    }

    fn listen(at: SocketAddr, counting: bool) -> std::io::Result<Receiver> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind(at))?;
        let addr = listener.local_addr()?;
        let inbox = Arc::new(Inbox { counting, ..Inbox::default() });
        let service = Service(inbox.clone());
        runtime.spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(service.clone()))
                .add_service(LogsServiceServer::new(service.clone()))
                .add_service(MetricsServiceServer::new(service))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok(Receiver { addr, inbox, _runtime: runtime })
    }

    /// A copy of what has arrived.
    pub fn received(&self) -> Received {
        self.inbox.got.lock().map(|g| g.clone()).unwrap_or_default()
    }

    /// Waits (on each arrival, not on time) until `done` holds for what has arrived, for at
    /// most `within`; returns what had arrived then.
    pub fn wait_for(&self, within: Duration, mut done: impl FnMut(&Received) -> bool) -> Received {
        let deadline = Instant::now() + within;
        let Ok(mut got) = self.inbox.got.lock() else { return Received::default() };
        loop {
            if done(&got) {
                return got.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return got.clone();
            }
            got = match self.inbox.changed.wait_timeout(got, left) {
                Ok((g, _)) => g,
                Err(_) => return Received::default(),
            };
        }
    }
}

#[derive(Clone)]
struct Service(Arc<Inbox>);

#[tonic::async_trait]
impl TraceService for Service {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = Vec::new();
        for rs in request.into_inner().resource_spans {
            let resource = rs.resource.map(|r| attributes(&r.attributes)).unwrap_or_default();
            for s in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
                spans.push(Span {
                    name: s.name,
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    attributes: attributes(&s.attributes),
                    links: s.links.iter().map(|l| (hex(&l.trace_id), hex(&l.span_id))).collect(),
                    resource: resource.clone(),
                });
            }
        }
        self.0.add(0, |got| {
            let n = spans.len() as u64;
            got.spans.extend(spans);
            n
        });
        Ok(Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

#[tonic::async_trait]
impl LogsService for Service {
    async fn export(
        &self,
        request: Request<ExportLogsServiceRequest>,
    ) -> Result<Response<ExportLogsServiceResponse>, Status> {
        let mut logs = Vec::new();
        for rl in request.into_inner().resource_logs {
            let resource = rl.resource.map(|r| attributes(&r.attributes)).unwrap_or_default();
            for l in rl.scope_logs.into_iter().flat_map(|sl| sl.log_records) {
                logs.push(Log {
                    body: l.body.as_ref().map(text).unwrap_or_default(),
                    trace_id: hex(&l.trace_id),
                    attributes: attributes(&l.attributes),
                    resource: resource.clone(),
                });
            }
        }
        self.0.add(1, |got| {
            let n = logs.len() as u64;
            got.logs.extend(logs);
            n
        });
        Ok(Response::new(ExportLogsServiceResponse { partial_success: None }))
    }
}

#[tonic::async_trait]
impl MetricsService for Service {
    async fn export(
        &self,
        request: Request<ExportMetricsServiceRequest>,
    ) -> Result<Response<ExportMetricsServiceResponse>, Status> {
        let mut points = Vec::new();
        let metrics = request.into_inner().resource_metrics.into_iter().flat_map(|rm| rm.scope_metrics);
        for m in metrics.flat_map(|sm| sm.metrics) {
            let name = m.name;
            let mut add = |attrs: &[KeyValue], kind: Kind, time_unix_nano: u64, buckets: Vec<(f64, u64)>| {
                let attributes = attributes(attrs);
                points.push(Point { metric: name.clone(), attributes, kind, time_unix_nano, buckets });
            };
            match m.data {
                Some(Data::Sum(s)) => {
                    let delta = s.aggregation_temporality == 1;
                    for p in s.data_points {
                        let kind = Kind::Sum { value: number(p.value), monotonic: s.is_monotonic, delta };
                        add(&p.attributes, kind, p.time_unix_nano, Vec::new());
                    }
                }
                Some(Data::Gauge(g)) => {
                    for p in g.data_points {
                        add(&p.attributes, Kind::Gauge { value: number(p.value) }, p.time_unix_nano, Vec::new());
                    }
                }
                Some(Data::Histogram(h)) => {
                    let delta = h.aggregation_temporality == 1;
                    for p in h.data_points {
                        let kind = Kind::Histogram { count: p.count, sum: p.sum.unwrap_or(0.0), delta };
                        let bounds = p.explicit_bounds.iter().copied().chain([f64::INFINITY]);
                        let buckets = bounds.zip(p.bucket_counts.iter().copied()).collect();
                        add(&p.attributes, kind, p.time_unix_nano, buckets);
                    }
                }
                _ => {}
            }
        }
        self.0.add(2, |got| {
            let n = points.len() as u64;
            got.points.extend(points);
            n
        });
        Ok(Response::new(ExportMetricsServiceResponse { partial_success: None }))
    }
}

fn number(v: Option<Number>) -> f64 {
    match v {
        Some(Number::AsDouble(d)) => d,
        Some(Number::AsInt(i)) => i as f64,
        None => 0.0,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(v: &AnyValue) -> String {
    match &v.value {
        Some(Any::StringValue(s)) => s.clone(),
        Some(Any::IntValue(i)) => i.to_string(),
        Some(Any::DoubleValue(d)) => d.to_string(),
        Some(Any::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn attributes(kvs: &[KeyValue]) -> Attributes {
    kvs.iter().map(|kv| (kv.key.clone(), kv.value.as_ref().map(text).unwrap_or_default())).collect()
}

impl Span {
    pub fn to_json(&self) -> Value {
        json!({"signal": "span", "name": self.name, "trace_id": self.trace_id, "span_id": self.span_id,
               "parent_span_id": self.parent_span_id, "attributes": self.attributes, "links": self.links})
    }
}

impl Log {
    pub fn to_json(&self) -> Value {
        json!({"signal": "log", "body": self.body, "trace_id": self.trace_id, "attributes": self.attributes})
    }
}

impl Point {
    pub fn to_json(&self) -> Value {
        let value = match self.kind {
            Kind::Sum { value, monotonic, delta } => json!({"sum": value, "monotonic": monotonic, "delta": delta}),
            Kind::Gauge { value } => json!({"gauge": value}),
            Kind::Histogram { count, sum, delta } => json!({"count": count, "sum": sum, "delta": delta}),
        };
        json!({"signal": "metric", "name": self.metric, "attributes": self.attributes, "value": value})
    }
}
