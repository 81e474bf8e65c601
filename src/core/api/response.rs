//! An answer as the edge keeps, replays and renders it: status, content type, the headers
//! that travel with it and its body.

use crate::core::api::headers;
use crate::core::api::priority::Class;

/// An upstream answer as the edge keeps and replays it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: String,
    /// Headers replayed with the answer (`retry-after`, `x-holysheep-model`, ...).
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(status: u16, body: Vec<u8>) -> Response {
        Response { status, content_type: "application/json".into(), headers: Vec::new(), body }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        super::headers::value(&self.headers, name)
    }

    pub fn with_header(mut self, name: &str, value: String) -> Response {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        self.headers.push((name.to_owned(), value));
        self
    }

    /// A 429 refused for priority (`why`: `priority` or `queue-full`), marked with the class
    /// it was refused at: waiters of a higher class do not take it as their answer.
    pub(crate) fn shed(self, why: &str, class: Class) -> Response {
        self.with_header(headers::SHED, why.to_owned()).with_header(headers::PRIORITY, class.as_str().to_owned())
    }

    /// Whether a waiter of `class` may take this as its answer: not a 429 the edge gave a
    /// flight of a lower class (which a call of its own class might not get).
    pub(crate) fn may_share(&self, class: Class) -> bool {
        if self.status != 429 {
            return true;
        }
        match self.header(headers::PRIORITY).map(Class::parse) {
            Some(Some(refused)) => refused <= class,
            Some(None) => false,
            None => true,
        }
    }
}
