//! `bollard::Docker` behind the engine seam: every method delegates to bollard's own.

use bollard::Docker;
use futures::StreamExt as _;
use tracing::Instrument as _;

use super::Engine;
use super::types::*;
use crate::telemetry::engine_span;

/// Our body as bollard takes it: its type is private to bollard, only its constructors make one.
macro_rules! bollard_body {
    ($body:expr) => {
        match $body {
            Body::Full(b) => bollard::body_full(b),
            Body::Stream(s) => bollard::body_try_stream(s),
        }
    };
}

/// One call of a method: bollard's method of the same name, its future boxed (or its stream).
macro_rules! to_bollard {
    // Our bodies become bollard's.
    ($this:tt, upload_to_container, Fut, ($name:ident, $options:ident, $tar:ident)) => {
        Box::pin(Docker::upload_to_container($this, $name, $options, bollard_body!($tar)))
    };
    ($this:tt, build_image, Items, ($options:ident, $credentials:ident, $tar:ident)) => {
        Docker::build_image($this, $options, $credentials, $tar.map(|t| bollard_body!(t))).boxed()
    };
    ($this:tt, create_image, Items, ($options:ident, $root_fs:ident, $credentials:ident)) => {
        Docker::create_image($this, $options, $root_fs.map(|t| bollard_body!(t)), $credentials).boxed()
    };
    // The calls a trace shows as spans of their own: a sandbox's making, and each exec.
    ($this:tt, create_container, Fut, $args:tt) => { to_bollard!(@span $this, create_container, $args) };
    ($this:tt, create_exec, Fut, $args:tt) => { to_bollard!(@span $this, create_exec, $args) };
    ($this:tt, start_exec, Fut, $args:tt) => { to_bollard!(@span $this, start_exec, $args) };
    (@span $this:tt, $name:ident, ($($arg:ident),*)) => {
        Box::pin(Docker::$name($this, $($arg),*).instrument(engine_span(concat!("docker ", stringify!($name)))))
    };
    // Every other call.
    ($this:tt, $name:ident, Fut, ($($arg:ident),*)) => {
        Box::pin(Docker::$name($this, $($arg),*))
    };
    ($this:tt, $name:ident, Items, ($($arg:ident),*)) => {
        Docker::$name($this, $($arg),*).boxed()
    };
}

// Docker, by delegation to bollard.
forward_engine!(to_bollard => impl Engine for Docker);
