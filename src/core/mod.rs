//! The host-agnostic core: request keys, cache, lease and the decisions built on them.
//! Nothing here knows proxy-wasm or WASI; time and nonces are passed in.
//!
//! The modules are floors; each uses only the floors below it. Floors, bottom-up: wire,
//! api, store, config, stream, request, limits, observe, cache, upstream, semantic, coalesce,
//! flight, intake, sim.
//!
//! `sim`, the fleet simulator, is built for tests only: it drives the floors below it as the
//! shells do.
//!
//! An arrow up a floor is allowed only with an `// up:` comment on its line (or the line
//! above) saying why; `tools/imports.py` (in `make check` and `make test`) fails on an import
//! circle anywhere in `src/` and on an uncommented arrow up.
//!
//! The face: an item is `pub` only when a shell or a fuzz target uses it (or a `pub` item's
//! signature names it); everything else is `pub(crate)`, and modules no shell names are
//! `pub(crate)`, so the compiler reports a core item nothing uses. The native build has no
//! shell: an item only a shell uses but marked `pub(crate)` is reported there too, which keeps
//! the line where it is (`make check` builds the crate natively and for both shells with
//! warnings denied).

pub mod api;
pub mod cache;
pub mod coalesce;
pub mod config;
pub mod flight;
pub mod intake;
pub mod limits;
pub mod observe;
pub mod request;
pub mod semantic;
#[cfg(test)]
mod sim;
pub mod store;
pub mod stream;
pub mod upstream;
pub mod wire;
