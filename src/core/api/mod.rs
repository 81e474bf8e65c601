//! The OpenAI API's vocabulary as the edge speaks it: a call it asks a host to make (`call`), the endpoints it governs
//! (`endpoint`), request paths (`path`), OpenAI-shaped errors (`error`), an answer as the edge keeps it (`response`), what HolySheep
//! billed for it (`usage`) and said of its own limits (`hints`), the priority classes a request may claim (`priority`),
//! every header name the edge reads or writes (`headers`) and a host's edit of a head (`head`), a request's key (`key`), a line for the log (`note`), an answer as the
//! client gets it (`reply`), what happened to a flight
//! (`event`), the response ids it signs for a tenant (`objects`), and the caller's trace context
//! it carries to HolySheep (`trace`). Uses only `wire`.

pub mod call;
pub mod endpoint;
pub mod error;
pub mod event;
pub mod head;
pub mod headers;
pub mod hints;
pub mod key;
pub mod note;
pub mod objects;
pub(crate) mod path;
pub mod priority;
pub mod reply;
pub mod response;
pub mod trace;
pub mod usage;
