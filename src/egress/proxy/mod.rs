//! The filtering proxy itself: `pyberth egress-proxy`, run inside its own container. It takes
//! policies as JSON lines on stdin and reports every connection as a JSON line on stdout, so
//! it needs no control port a sandbox could reach.
//!
//! A connection is told apart by the proxy's own address it arrived on: each session has an
//! `internal` network holding only itself and the proxy, so that address names the session,
//! and no session can reach another's (it has no route off its network, and no capability to
//! forge one). On Kubernetes (`Config.by_peer`) every session reaches the one proxy pod at
//! one address, so a connection is told apart by its source, the session pod's address, which
//! a pod without NET_RAW/NET_ADMIN cannot forge either.
//!
//! Its parts: [`wire`] what it and the server say, [`state`] the policies in force, [`conn`]
//! one connection from its head to its record, [`head`] request heads, [`mitm`] TLS
//! termination for hosts with headers, [`scrub`] masking their values in answers,
//! [`splice`] copying both ways under the budget, [`report`] the bounded queue of reports.

mod conn;
mod head;
mod mitm;
mod report;
mod scrub;
mod splice;
mod state;
mod wire;

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::io::AsyncBufReadExt as _;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

pub use self::mitm::{ca_params, new_ca};
use self::report::Reports;
use self::state::{Shared, State, apply};
pub use self::wire::{Command, Record, Report, SecretPem};

/// The port the proxy listens on, on every network it is attached to.
pub const PORT: u16 = 3128;
/// Time a client has to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Time an upstream has to accept (and, intercepted, to finish its TLS handshake).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The wait after a failed accept (out of file descriptors, most likely) before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How often at most a failing accept is said.
const ACCEPT_FAILURE_SAID_EVERY: Duration = Duration::from_secs(60);

/// Why the proxy could not run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Its port could not be bound.
    #[error("cannot listen on port {PORT}")]
    Listen(#[source] std::io::Error),
}

/// Runs the proxy until stdin closes (the server went away): then it exits, and the
/// container with it.
pub async fn run() -> Result<(), Error> {
    let listener = TcpListener::bind(("0.0.0.0", PORT)).await.map_err(Error::Listen)?;
    let state: Shared = Arc::new(RwLock::new(State { max_conns: 32, ..Default::default() }));
    let (reports, writer) = report::start();
    reports.control(Report::Ready { passes: true }).await;
    tokio::select! {
        () = accept(listener, state.clone(), reports.clone()) => {}
        () = control(&state, &reports) => {}
    }
    drop(reports);
    writer.abort();
    Ok(())
}

/// Accepts connections and serves each in a task of its own, until dropped (which ends them
/// all: the set owns them).
async fn accept(listener: TcpListener, state: Shared, reports: Reports) {
    let mut conns = JoinSet::new();
    let mut failing_since: Option<Instant> = None;
    loop {
        // Ended connections leave the set as new ones come.
        while conns.try_join_next().is_some() {}
        let (sock, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors, most likely: wait for connections to end instead
                // of spinning on the error.
                if failing_since.is_none_or(|t| t.elapsed() >= ACCEPT_FAILURE_SAID_EVERY) {
                    tracing::warn!(error = %e, "cannot accept connections");
                    failing_since = Some(Instant::now());
                }
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        // Each connection ends on its own: bounded head time, then a splice that ends when
        // either side closes.
        conns.spawn(conn::handle(sock, peer, state.clone(), reports.clone()));
    }
}

/// Applies the server's commands from stdin until it closes.
async fn control(state: &Shared, reports: &Reports) {
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        match serde_json::from_str::<Command>(&line) {
            Ok(Command::Sync { seq }) => reports.control(Report::Applied { seq }).await,
            Ok(c) => apply(state, c),
            Err(e) => tracing::warn!(error = %e, "bad command"),
        }
    }
}
