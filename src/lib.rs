//! pyberth: an MCP server that runs Python for AI agents inside hardened Docker containers.
//!
//! Data flow of one `run_python` call:
//! - [`server`] receives the MCP tool call (stdio), validates arguments and picks the session;
//! - [`session::registry`] finds or creates the [`session::Session`]: one container per session,
//!   made by [`docker::container`] from the image that [`docker::image`] builds;
//! - the session writes a [`protocol::Request`] line into the agent's attached exec
//!   ([`docker::exec`]) and reads [`protocol::Event`] lines back, reassembled from Docker
//!   frames by [`protocol::LineDecoder`];
//! - output is kept per stream, capped, by [`output::Capture`]; the session stops runaway
//!   code by interrupt, then kill, and restarts the agent;
//! - [`server`] renders the outcome as text plus structured content.
//!
//! [`instance`] tells live servers from dead ones so leftovers can be swept at start.

pub mod bench;
pub mod checks;
pub mod config;
pub mod deps;
pub mod docker;
pub mod environment;
pub mod http;
pub mod instance;
pub mod output;
pub mod protocol;
pub mod runner;
pub mod server;
pub mod session;

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
