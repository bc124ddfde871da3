//! Reports to the server, as JSON lines on stdout, through a bounded queue. A connection's
//! record never waits for the server: when the queue is full it is dropped and counted, and
//! the count goes to stderr (which the server logs) at most every [`DROPS_SAID_EVERY`]. The
//! answers the server waits for (ready, applied) wait for room instead: only the control
//! loop sends them, never a connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt as _;
use tokio::sync::mpsc;

use super::wire::{Record, Report};

/// Reports waiting to be written: a few seconds of the fastest refusals the rate allows.
const QUEUE: usize = 4096;
/// How often at most the count of dropped records is said.
const DROPS_SAID_EVERY: Duration = Duration::from_secs(10);

/// The sending side of the queue, one clone per connection.
#[derive(Debug, Clone)]
pub(super) struct Reports {
    tx: mpsc::Sender<Report>,
    /// Records dropped because the queue was full.
    dropped: Arc<AtomicU64>,
}

impl Reports {
    /// A connection's record; dropped and counted when the queue is full or the writer gone.
    pub(super) fn conn(&self, r: Record) {
        if self.tx.try_send(Report::Conn(r)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An answer the server waits for: waits for room.
    pub(super) async fn control(&self, r: Report) {
        let _ = self.tx.send(r).await;
    }
}

/// The queue and its writer task, which ends when every [`Reports`] is dropped or stdout
/// closes; the caller owns its handle.
pub(super) fn start() -> (Reports, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(QUEUE);
    let dropped = Arc::new(AtomicU64::new(0));
    let writer = tokio::spawn(write(rx, dropped.clone()));
    (Reports { tx, dropped }, writer)
}

async fn write(mut rx: mpsc::Receiver<Report>, dropped: Arc<AtomicU64>) {
    let mut out = tokio::io::stdout();
    let (mut said, mut said_at) = (0u64, None::<Instant>);
    while let Some(r) = rx.recv().await {
        let Ok(mut line) = serde_json::to_vec(&r) else { continue };
        line.push(b'\n');
        if out.write_all(&line).await.is_err() || out.flush().await.is_err() {
            break;
        }
        let now = dropped.load(Ordering::Relaxed);
        if now > said && said_at.is_none_or(|t| t.elapsed() >= DROPS_SAID_EVERY) {
            tracing::warn!(dropped = now, "connection records dropped: the queue to the server was full");
            (said, said_at) = (now, Some(Instant::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full queue never holds a connection up: its record is dropped and counted.
    #[tokio::test]
    async fn records_past_a_full_queue_are_dropped_and_counted() {
        let (tx, mut rx) = mpsc::channel(2);
        let reports = Reports { tx, dropped: Arc::default() };
        let record = Record {
            local: "10.0.0.2".parse().expect("ip"),
            session: "s".into(),
            principal: "p".into(),
            host: "h".into(),
            port: 80,
            allowed: false,
            rule: "r".into(),
            up: 0,
            down: 0,
            ms: 0,
            cut: false,
        };
        let sent = tokio::time::timeout(Duration::from_secs(1), async {
            for _ in 0..5 {
                reports.conn(record.clone());
            }
        })
        .await;
        assert!(sent.is_ok(), "a record waited for room");
        assert_eq!(reports.dropped.load(Ordering::Relaxed), 3);
        assert!(matches!(rx.recv().await, Some(Report::Conn(_))));
    }
}
