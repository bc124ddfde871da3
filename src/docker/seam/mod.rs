//! The engine seam: every call the owners make on a container engine, as one object-safe trait.
//!
//! The methods mirror bollard's own (names, option and model types: plain data), so a call
//! site reads as it did on `bollard::Docker`, and Docker implements it by delegation. Another
//! engine (Kubernetes pods through their exec API, docs/design.md D10) or the in-process fake
//! of the lib tests (`docker::fake`) sits behind the same trait. Owners hold an [`EngineRef`];
//! helpers take `&dyn Engine` (a `&bollard::Docker` coerces).
//!
//! The trait's methods are listed once, in `methods.rs`, and the wrappers that only forward
//! are generated from that list: the delegation to Docker (`by_docker.rs`), the counting of any
//! engine's failed calls (`counted.rs`) and a shared engine (below).
//!
//! Errors stay bollard's: the owners already read its 404s and 409s, and a fake engine says
//! "no such container" the way Docker does.

#[macro_use]
mod methods;
mod by_docker;
mod counted;
pub(crate) mod types;

pub use counted::Counted;
pub use methods::Engine;
pub use types::{Body, Fut, Items, body_full, body_try_stream};

use std::sync::Arc;

use bollard::Docker;
use futures::StreamExt as _;

use types::*;

/// The engine as the owners hold it.
pub type EngineRef = Arc<dyn Engine>;

/// The events of an engine to which nothing happens on its own (the fake; Kubernetes, whose
/// pods send no OOM events yet): a question about the past ends at once, a watch of the
/// future waits for ever.
pub fn no_events(options: Option<&q::EventsOptions>) -> Items<'static, EventMessage> {
    if options.is_some_and(|o| o.until.is_some()) {
        futures::stream::empty().boxed()
    } else {
        futures::stream::pending().boxed()
    }
}

/// An answer known at once, as a call's future: for the engines that answer from their own
/// records (the fake; Kubernetes, for what it keeps itself).
pub(crate) fn ready<'a, T: Send + 'a>(r: Result<T, Error>) -> Fut<'a, T> {
    Box::pin(std::future::ready(r))
}

/// An answer known at once, as a call's stream of one item.
pub(crate) fn once<T: Send + 'static>(r: Result<T, Error>) -> Items<'static, T> {
    futures::stream::once(std::future::ready(r)).boxed()
}

/// Whether `labels` carry every `label` filter (`key` or `key=value`), as Docker filters: for
/// the engines that filter their own records.
pub(crate) fn matches_labels(labels: &HashMap<String, String>, filters: Option<&HashMap<String, Vec<String>>>) -> bool {
    let wanted = filters.and_then(|f| f.get("label")).map(Vec::as_slice).unwrap_or_default();
    wanted.iter().all(|w| match w.split_once('=') {
        Some((k, v)) => labels.get(k).is_some_and(|x| x == v),
        None => labels.contains_key(w),
    })
}

/// `(**self).method(args)`: a shared engine forwards every call to the engine it shares.
macro_rules! to_shared {
    ($this:tt, $name:ident, $kind:ident, ($($arg:ident),*)) => {
        (**$this).$name($($arg),*)
    };
}

// A shared engine is an engine: `&Arc<dyn Engine>` passes where `&dyn Engine` is asked.
forward_engine!(to_shared => impl<T: Engine + ?Sized> Engine for Arc<T>);

/// What an owner accepts as its engine: a shared one, or a Docker client (wrapped).
pub trait IntoEngine {
    /// The engine, shared.
    fn into_engine(self) -> EngineRef;
}

impl IntoEngine for Docker {
    fn into_engine(self) -> EngineRef {
        Arc::new(self)
    }
}

impl IntoEngine for EngineRef {
    fn into_engine(self) -> EngineRef {
        self
    }
}
