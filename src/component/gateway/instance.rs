//! What an instance of the component sets up once and keeps between the requests it
//! serves, when its host reuses it (one request at a time): its configuration, key and
//! store, and the requests it parsed that came again (`intake::recall`). On a host that
//! makes an instance per request, each request sets it up.

use crate::component::host::{self, Kv};
use crate::core::api::error::ApiError;
use crate::core::coalesce::engine::Engine;
use crate::core::config::environment::Environment;
use crate::core::config::Config;
use crate::core::intake::recall::{Admitted, Recall};
use crate::core::intake::Head;
use std::cell::RefCell;
use std::rc::Rc;

/// What every part of one request needs: configuration, the operator's key, and the store.
pub(super) struct Gateway {
    pub(super) config: Config,
    pub(super) env: Rc<Environment>,
    pub(super) kv: Kv,
}

/// What an instance keeps between the requests it serves, when its host reuses it (one
/// request at a time): its gateway, read once, and the requests it parsed that came again.
struct Kept {
    gateway: Option<Rc<Gateway>>,
    recall: Option<Recall>,
}

thread_local! {
    static KEPT: RefCell<Kept> = const { RefCell::new(Kept { gateway: None, recall: None }) };
}

/// The instance's gateway: its environment cannot change while it lives, so it is read once.
pub(super) fn gateway() -> Result<Rc<Gateway>, ApiError> {
    if let Some(g) = KEPT.with_borrow(|k| k.gateway.clone()) {
        return Ok(g);
    }
    let gateway = Rc::new(setup()?);
    KEPT.with_borrow_mut(|k| {
        // No answers are kept in an instance's memory: a HIT's parse stands in for its answer.
        k.recall = Some(Recall::new(&gateway.config, host::nonce(), false));
        k.gateway = Some(gateway.clone());
    });
    Ok(gateway)
}

/// A governed request through the door of `intake::recall`, with what this instance
/// remembers.
pub(super) fn admit(engine: &Engine<'_, Kv>, head: Head, body: &[u8]) -> Result<Admitted, ApiError> {
    let now = host::now_ms();
    KEPT.with_borrow_mut(|k| match &mut k.recall {
        Some(recall) => recall.admit(engine, |_| None, head, body, now, host::nonce),
        None => Err(ApiError::server("the gateway is not set up", "invalid_configuration")),
    })
}

/// Reads the configuration (`HOLYSHEEP_CONFIG`), the key and the bucket (once an instance
/// has them, it keeps them).
fn setup() -> Result<Gateway, ApiError> {
    let env = host::Env::read();
    let raw = env.get("HOLYSHEEP_CONFIG").unwrap_or_default();
    let config = Config::parse(raw.as_bytes()).map_err(|e| {
        // The detail (which may quote configuration values) goes to the log only.
        eprintln!("holysheep: {e}");
        let message = format!("the gateway's configuration is invalid at '{}' (details in its log)", e.field());
        ApiError::server(message, "invalid_configuration")
    })?;
    let mut config = config;
    if config.budget_store.tenants {
        // The component reads no etcd: a table kept there would never be served.
        eprintln!(
            "holysheep: budget_store.tenants is not served by the component: list the tenants in its configuration"
        );
        let message = "the gateway's configuration is invalid at 'budget_store.tenants' (details in its log)";
        return Err(ApiError::server(message, "invalid_configuration"));
    }
    if config.budget_store.enabled() {
        // The component keeps spend in its key-value bucket: it does not call etcd.
        eprintln!("holysheep: budget_store is not used by the component: budgets are kept in its wasi:keyvalue bucket");
        config.budget_store.cluster.clear();
    }
    let secrets = Rc::new(Environment::read(&mut config, |name| env.get(name)));
    let bucket = env.get("HOLYSHEEP_KV_BUCKET").unwrap_or_else(|| "default".into());
    let kv = Kv::open(&bucket).map_err(|e| {
        ApiError::server(format!("the wasi:keyvalue bucket '{bucket}' cannot be opened: {e}"), "store_unavailable")
    })?;
    Ok(Gateway { config, env: secrets, kv })
}
