//! pyberth: an MCP server that runs Python for AI agents inside hardened Docker containers.
//!
//! # The house
//! Fronts ([`server`]: the MCP tools; [`http`]; [`runner`]: `pyberth run`) call owners only. The
//! runtime ([`app`]) is built once for every command. The owners: [`session`] (the registry,
//! sessions, jobs), [`durable`] (the ledger, the only writer of the state dir's records),
//! [`packages`] (dependency layers), [`egress`] (networks and the proxy). A session's containers
//! are made from a [`sandbox::Blueprint`]: settings ([`config`], [`environment`]) plus what the
//! engine found, as plain data. [`bridge`] is code mode: the operator's upstream MCP servers,
//! which code in a session calls over the agent channel, each call checked on the host.
//! [`docker`] is the engine adapter: the seam
//! ([`docker::Engine`], which `bollard::Docker` implements and the owners hold as an
//! [`docker::EngineRef`]), one hardened fence, and nothing above it; the lib tests run the
//! owners on an in-process fake engine behind the same seam (`docker/fake/`, test-only). The
//! wire ([`protocol`], [`output`], `tarcheck`) is pure.
//!
//! # Where a `run_python` call goes
//! 1. A transport hands the call to [`server::SandboxServer`]: stdio (`main.rs`, `serve`) or
//!    streamable HTTP ([`http`], one server per MCP session, behind bearer tokens).
//! 2. `server/run.rs` checks the arguments ([`checks`]) and opens the session through
//!    [`session::registry::Registry::open`], which finds it or makes it: egress first (a
//!    network), then the container from the session's blueprint ([`docker::container`]), on the
//!    image [`docker::image`] builds or with a dependency layer of [`packages`].
//! 3. [`session::Session`] writes a [`protocol::Request`] line into the agent's attached exec
//!    ([`docker::exec`]) and reads [`protocol::Event`] lines back, reassembled from Docker frames
//!    by [`protocol::LineDecoder`]; output is kept per stream, capped, by [`output::Capture`].
//!    Runaway code is interrupted, then killed, and the agent restarted. Every change of the
//!    session's state is written through to the [`durable`] ledger.
//! 4. `server/render.rs` turns the outcome into text plus structured content, and `server/fit.rs`
//!    keeps every result within one message a client accepts.
//!
//! `pyberth bench` (`src/bench/`) and `pyberth envs` (`src/envs.rs`) belong to the binary, not
//! to this library.
//!
//! `docs/architecture.md` follows the same path in more detail; `docs/agent-protocol.md` is the
//! wire format between the server and `images/python/agent.py`.

/// The runtime every command starts from: engine, instance, owners, background tasks, stop.
pub mod app;
/// The audit log: one JSON line per event a security reviewer cares about (issue 32).
pub mod audit;
/// Code mode: Python in a session calls the operator's upstream MCP tools (issue 30).
pub mod bridge;
/// Checks on caller input, before any Docker call, shared by the MCP tools and `pyberth run`.
pub(crate) mod checks;
/// Every setting: flags, environment variables and the TOML file, in one struct.
pub mod config;
/// Requirement strings: parsing, normalising, PEP 723 inline metadata.
pub(crate) mod deps;
/// The engine adapter: the seam (the [`docker::Engine`] trait, implemented for
/// `bollard::Docker`), the helpers over it (containers, execs, images, archives, volumes), and
/// nothing above it.
pub mod docker;
/// What outlives a server: the ledger, the one writer of the state dir's records.
pub(crate) mod durable;
/// Controlled egress: the filtering proxy and the session networks (issue 17).
pub mod egress;
/// Named sandbox flavours (Python version, packages, mounts, limits) a session is created in.
pub mod environment;
/// `pyberth gc`: orphans of dead servers, listed and removed now.
pub mod gc;
/// The HTTP service: streamable MCP behind bearer tokens, one principal per token.
pub mod http;
/// The outbound HTTPS client: rustls on ring, the operator's CA bundle.
pub mod https;
/// Liveness of server instances, so leftovers of dead ones can be swept at start.
pub mod instance;
/// The Kubernetes engine (issue 33): pod specs, the cluster client, the manifests.
pub mod k8s;
/// Prometheus metrics: the series and their bounded labels (`/metrics` is served by [`http`]).
pub mod metrics;
/// Capped capture of a run's output streams, exact bytes kept.
pub(crate) mod output;
/// Dependency layers as a service: the set's key, the installer (uv or pip, sdist opt-ins),
/// the layer store and its use records (docs/design.md D6, D14).
pub mod packages;
/// The server↔agent wire format: newline-delimited JSON, reassembled from Docker frames.
pub(crate) mod protocol;
/// Quotas per principal: CPU, run time and egress per UTC day, snapshot bytes, sessions (issue 32).
pub mod quota;
/// `pyberth run`: a script or command in a fresh sandbox for CI, exit code passed through.
pub mod runner;
/// What a session's containers are made from: settings, engine facts, mounts, egress.
pub mod sandbox;
/// The MCP tool table.
pub(crate) mod server;
/// Sessions (one container and one agent each), their registry and background jobs.
pub(crate) mod session;
/// Files in the state dir: never through a symlink, replaced through exclusive temp files.
pub(crate) mod state_dir;
/// The hostile-tar rules shared by uploads, layers and snapshots: pure, no I/O.
pub(crate) mod tarcheck;
/// Log lines and, opt-in, OpenTelemetry traces over OTLP/HTTP; W3C trace context.
pub mod telemetry;

/// Every tool result is cut to fit one MCP message a client accepts (public for the
/// integration tier's stress test of it).
pub use server::fit::{BUDGET as RESULT_BUDGET, fit as fit_result};
pub use server::{CORE_TOOLS, SandboxServer, Traced};
pub use session::registry::{Error as RegistryError, Registry};

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
