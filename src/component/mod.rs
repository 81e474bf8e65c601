//! The `wasi:http` component shell (wasm32-wasip2, world `holysheep:edge/gateway` in
//! `wit/`). One call of `incoming-handler.handle` serves one request from start to end:
//! shared state lives in a `wasi:keyvalue` bucket, HolySheep is called through
//! `wasi:http/outgoing-handler`, and waiters poll the store.

mod gateway;
mod host;
mod libc;

wit_bindgen::generate!({
    world: "holysheep:edge/gateway",
    path: "wit",
    generate_all,
    // Only so the parser accepts wasi:cli@0.2.12, which imports the gated interface.
    features: ["clocks-timezone"],
});

use exports::wasi::http::incoming_handler::Guest;
use wasi::http::types::{IncomingRequest, ResponseOutparam};

struct Component;

impl Guest for Component {
    fn handle(request: IncomingRequest, response_out: ResponseOutparam) {
        gateway::handle(request, response_out);
    }
}

export!(Component);
