//! `/metrics`: the scrape handler (also mounted on the MCP port, behind the tokens), and
//! `--metrics-addr`, a listener of its own, for stdio servers and for operators who keep
//! scrapes off the MCP port. No token: it is meant for loopback or a private network
//! (a warning says so otherwise); the numbers carry no code, output, session names or hosts.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use tokio_util::sync::CancellationToken;

use crate::session::registry::Registry;

/// A bound metrics listener, not serving yet (so a port in use is said before anything starts).
#[derive(Debug)]
pub struct Listening {
    listener: tokio::net::TcpListener,
    bound: SocketAddr,
}

impl Listening {
    /// Binds `addr`.
    pub async fn bind(addr: SocketAddr) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bound = listener.local_addr().unwrap_or(addr);
        if !bound.ip().is_loopback() {
            tracing::warn!(
                address = %bound,
                "metrics are served without a token on a non-loopback address: keep it on a private network"
            );
        }
        Ok(Self { listener, bound })
    }

    /// The address bound.
    pub fn address(&self) -> SocketAddr {
        self.bound
    }

    /// Serves `/metrics` until `shutdown` fires.
    pub async fn serve(self, registry: Arc<Registry>, shutdown: CancellationToken) {
        let app = Router::new().route("/metrics", axum::routing::get(move || scrape(registry.clone())));
        tracing::info!(address = %self.bound, "serving metrics at /metrics");
        let stop = async move { shutdown.cancelled().await };
        if let Err(e) = axum::serve(self.listener, app).with_graceful_shutdown(stop).await {
            tracing::warn!(error = %e, "the metrics listener stopped");
        }
    }
}

/// One scrape: the registry's numbers in the OpenMetrics text format.
pub async fn scrape(registry: Arc<Registry>) -> Response {
    // Encoding walks every series under locks the owners take too: off the async workers.
    let text = tokio::task::spawn_blocking(move || registry.metrics_text()).await.unwrap_or_default();
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response()
}
