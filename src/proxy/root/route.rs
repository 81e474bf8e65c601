//! A stream leader's call goes along the route: Envoy's router streams HolySheep's answer
//! back while the leader's http context tees it (`Chat`), and reports how it ended.

use super::Root;
use crate::core::api::call::HttpCall;
use crate::core::coalesce::engine::Call;
use crate::core::upstream::{misroute, Outbound};
use crate::proxy::abi as hostcalls;
use crate::proxy::host::{self, SharedData};
use crate::proxy::runs::Run;
use crate::proxy::types::{BufferType, MapType};
use std::rc::Rc;

/// How a stream leader's request went on along its route.
pub(super) enum Forwarded {
    Sent,
    /// The request is gone (client reset) or could not be rewritten.
    Gone,
    /// Its route leads elsewhere than `upstream.cluster`: it is not sent with the key.
    Misrouted,
}

impl Root {
    /// A stream leader goes along the route (Envoy's router streams the answer back while
    /// the http context tees it), when the route Envoy chose for the client's request
    /// leads to `upstream.cluster`. Envoy routes the request again once the filter changes
    /// its headers, and tells the filter the new route only after it was taken, so the
    /// request that leaves is the core's `call` and nothing of the client's that routing
    /// could look at (`Leader::route_edit`). Envoy's router retries it before the first
    /// byte on the edge's terms and says how many attempts it made
    /// (`host::upstream_attempts`), each counted and charged. The route that answers is
    /// checked again when its answer arrives (`Chat::on_http_response_headers`).
    pub(super) fn forward(&self, run: &Run, call: &HttpCall) -> Forwarded {
        let id = run.context_id;
        let (config, latched) = {
            let w = self.worker.borrow();
            (w.config.clone(), misroute::latched(&SharedData, &w.config))
        };
        if !self.worker.borrow().is_live(id) || hostcalls::set_effective_context(id).is_err() {
            return Forwarded::Gone;
        }
        if latched || !host::routed_to(&config.upstream.cluster) {
            return Forwarded::Misrouted;
        }
        let head = host::headers(MapType::HttpRequestHeaders);
        // Unreadable headers could not be taken off.
        let Some(edit) = run.leader.route_edit(&config, call, &head).filter(|_| !head.is_empty()) else {
            return Forwarded::Gone;
        };
        let trailers = host::headers(MapType::HttpRequestTrailers);
        let done = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, usize::MAX, &call.body).is_ok()
            && edit.remove.iter().all(|n| hostcalls::set_map_value(MapType::HttpRequestHeaders, n, None).is_ok())
            && trailers.iter().all(|(n, _)| hostcalls::set_map_value(MapType::HttpRequestTrailers, n, None).is_ok())
            && edit.set.iter().all(|(n, v)| hostcalls::set_map_value(MapType::HttpRequestHeaders, n, Some(v)).is_ok())
            && self.resume_request(id);
        if done {
            Forwarded::Sent
        } else {
            Forwarded::Gone
        }
    }

    /// Lets the paused request of stream `id` go on (the effective context already `id`'s):
    /// the stream whose request callback is running goes on when the callback returns.
    fn resume_request(&self, id: u32) -> bool {
        if let Some((handing, sent)) = &mut self.worker.borrow_mut().handing {
            if *handing == id {
                *sent = true;
                return true;
            }
        }
        hostcalls::resume_http_request().is_ok()
    }

    /// A forward node's waiter that came to lead (its flight's hop broke off, or it waited
    /// too long) makes its own hop. When its request is gone, the lease goes back at once.
    pub(super) fn hop(&mut self, id: u32, call: Call, outbound: Rc<Outbound>) {
        let live = self.worker.borrow().is_live(id) && hostcalls::set_effective_context(id).is_ok();
        if live {
            self.worker.borrow_mut().hop(id, call, outbound);
            if self.resume_request(id) {
                return;
            }
            let ended = self.worker.borrow_mut().stream_ended_now(id);
            if let Some((key, watched)) = ended {
                self.wake_waiters(&key, watched);
            }
            return;
        }
        let watched = self.worker.borrow().engine().abandon(&call, host::now_ms());
        if let Some(l) = call.lease {
            self.wake_waiters(&l.key, watched);
        }
    }

    /// Lets the waiters of the streams that ended look at their flights.
    pub(super) fn complete_streams(&mut self) {
        self.send_settlements();
        let ended = std::mem::take(&mut self.worker.borrow_mut().runs.ended);
        for (key, watched) in ended {
            self.wake_waiters(&key, watched);
        }
    }
}
