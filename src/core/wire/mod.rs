//! Bytes on the wire, the floor everything else stands on: the shared-data record format
//! (`codec`), JSON parsed into serde_json's `Value` (`json`), read in place (`scan`) and
//! written by hand (`write`), SHA-256 (`digest`), base64, byte comparison (`bytes`),
//! proxy-wasm's header-map encoding (`pairs`), and the few orderings and decimals the edge
//! writes (`sort`, `decimal`). Nothing here knows what a request, a tenant or a model is.

pub mod base64;
pub(crate) mod bytes;
pub mod codec;
pub(crate) mod decimal;
pub mod digest;
pub mod float;
pub(crate) mod json;
pub mod pairs;
pub(crate) mod scan;
pub(crate) mod sort;
pub(crate) mod write;
