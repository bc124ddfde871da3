//! The accept loop. `axum::serve` has no header-read or idle timeout and no cap on
//! connections: a few hundred clients that open a request and never finish it took every file
//! descriptor, and with them `/healthz` and the server's Docker calls. Here each connection
//! needs a place (overall and per client address; refused by closing), must send a request
//! head within the header timeout (between keep-alive requests too: hyper times the wait for
//! each head), and is closed once no byte has moved either way for the idle timeout.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::service::Service as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::admission::{Admission, Authenticated, Limits, Place};

/// How long connections may take to finish once the server stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// File descriptors kept for everything but client connections (Docker, files, the runtime).
const FD_RESERVE: u64 = 128;

/// Raises the soft limit on open files to the hard one, and returns the soft limit in force
/// (`None`: unlimited).
pub(super) fn raise_fd_limit() -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let raised = Rlimit { current: limit.maximum, maximum: limit.maximum };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            let shown = |l: Option<u64>| l.map_or_else(|| "unlimited".to_owned(), |n| n.to_string());
            tracing::warn!(error = %e, soft = %shown(limit.current), hard = %shown(limit.maximum), "cannot raise the open-files limit");
        }
    }
    getrlimit(Resource::Nofile).current
}

/// `wanted` connections, or fewer if the open-files limit `fds` would not leave room for the
/// server's own files beside them.
pub(super) fn connection_cap(wanted: usize, fds: Option<u64>) -> usize {
    let Some(fds) = fds else { return wanted };
    let room = fds - FD_RESERVE.min(fds / 2);
    usize::try_from(room).map_or(wanted, |room| wanted.min(room)).max(1)
}

/// Logs at most one warning a minute for a recurring condition (a flood must not flood the log).
#[derive(Default)]
struct Sometimes(Option<Instant>);

impl Sometimes {
    fn now(&mut self) -> bool {
        let due = self.0.is_none_or(|last| last.elapsed() >= Duration::from_secs(60));
        if due {
            self.0 = Some(Instant::now());
        }
        due
    }
}

/// Accepts and serves connections until `shutdown` fires, then gives open ones a few seconds
/// to finish.
pub(super) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    metrics: Arc<crate::metrics::Metrics>,
    shutdown: CancellationToken,
) {
    let admission = Admission::new(limits);
    let tasks = TaskTracker::new();
    let (mut refusals, mut failures) = (Sometimes::default(), Sometimes::default());
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors, most likely: wait instead of spinning.
                if failures.now() {
                    tracing::warn!(error = %e, "cannot accept connections");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let place = match admission.admit(peer.ip()) {
            Ok(place) => place,
            Err(flag) => {
                metrics.http_connection(false);
                if refusals.now() {
                    tracing::warn!(client = %peer.ip(), "refusing connections past {flag}");
                }
                drop(stream);
                continue;
            }
        };
        metrics.http_connection(true);
        let open = OpenGuard::new(metrics.http_open());
        let (app, stop) = (app.clone(), shutdown.clone());
        tasks.spawn(async move {
            connection(stream, peer, app, limits, stop, place).await;
            drop(open);
        });
    }
    tasks.close();
    tasks.wait().await;
}

/// One open connection on the gauge, for as long as it is held.
struct OpenGuard(prometheus_client::metrics::gauge::Gauge);

impl OpenGuard {
    fn new(gauge: prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Serves one connection within its timeouts.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
    place: Place,
) {
    // Progress lines over SSE must not wait for Nagle.
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched { inner: stream, activity: activity.clone() });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    let place = Arc::new(place);
    let displaced = place.displaced().clone();
    let app = TowerToHyperService::new(app);
    // Admission needs to know whether a connection waits for a head, and whether it showed a token.
    let service = hyper::service::service_fn(move |req| {
        place.serving();
        let served = app.call(req);
        let place = place.clone();
        async move {
            let response = served.await;
            place.waiting(response.as_ref().is_ok_and(|r| r.extensions().get::<Authenticated>().is_some()));
            response
        }
    });
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    tokio::select! {
        served = conn.as_mut() => {
            if let Err(e) = served {
                tracing::debug!(client = %peer, error = %e, "connection closed");
            }
        }
        () = activity.quiet_for(limits.idle_timeout) => {
            tracing::debug!(client = %peer, "closing an idle connection");
        }
        () = displaced.cancelled() => {
            tracing::debug!(client = %peer, "closing a waiting connection for a newcomer");
        }
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(SHUTDOWN_GRACE, conn).await;
        }
    }
}

/// When a byte last moved on a connection.
struct Activity {
    opened: tokio::time::Instant,
    /// Milliseconds from `opened` to the last read or write of at least one byte.
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity { opened: tokio::time::Instant::now(), last_ms: AtomicU64::new(0) }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Returns once nothing has moved for `limit`.
    async fn quiet_for(&self, limit: Duration) {
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let quiet = self.opened.elapsed().saturating_sub(last);
            if quiet >= limit {
                return;
            }
            tokio::time::sleep(limit - quiet).await;
        }
    }
}

/// A stream that records in [`Activity`] every read or write that moves bytes.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_cap_leaves_room_for_the_servers_own_files() {
        assert_eq!(connection_cap(256, None), 256);
        assert_eq!(connection_cap(256, Some(1_048_576)), 256);
        assert_eq!(connection_cap(256, Some(1024)), 256);
        assert_eq!(connection_cap(256, Some(256)), 128);
        assert_eq!(connection_cap(256, Some(64)), 32);
        assert_eq!(connection_cap(256, Some(1)), 1);
    }

    #[tokio::test]
    async fn quiet_for_waits_from_the_last_byte() {
        let activity = Arc::new(Activity::new());
        let started = tokio::time::Instant::now();
        let toucher = activity.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            toucher.touch();
        });
        activity.quiet_for(Duration::from_millis(300)).await;
        assert!(started.elapsed() >= Duration::from_millis(440), "{:?}", started.elapsed());
    }
}
