//! Live output: output chunks and install lines sent to the client while a call works.
//!
//! Logging is deprecated in MCP 2026-07-28 but still how clients that asked for a log level
//! see output as it happens, hence the module-wide allowance.
#![allow(deprecated)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rmcp::RoleServer;
use rmcp::model::{LoggingLevel, LoggingMessageNotificationParam, ProgressNotificationParam};
use rmcp::service::RequestContext;

use super::SandboxServer;
use crate::protocol::Stream;

/// The log level a pre-2026 client set with logging/setLevel, per connection.
pub(super) type LevelSlot = Arc<Mutex<Option<LoggingLevel>>>;

/// Records a level set by logging/setLevel.
pub(super) fn set_level(slot: &LevelSlot, level: LoggingLevel) {
    if let Ok(mut l) = slot.lock() {
        *l = Some(level);
    }
}

impl SandboxServer {
    /// A notifier for one request.
    pub(super) fn notifier<'a>(&self, ctx: &'a RequestContext<RoleServer>) -> Notifier<'a> {
        Notifier::new(ctx, self.log_level.lock().ok().and_then(|l| *l))
    }
}

/// A line for the client while a call works.
pub(super) enum Live {
    /// A line of an install or image build.
    Step(String),
    /// A chunk of the code's output.
    Output(Stream, String),
}

/// One call's live lines: a progress callback for long steps (installs, image builds), an
/// output observer for runs, and the receiver of both for `relay`. Bounded, with try_send: a
/// slow client loses live lines, never output in the final result. Output is copied only when
/// the client asked for it (`output`): a plain call costs no copy, and at most `LIVE_QUEUE`
/// chunks (of up to 64 KiB) wait in memory, whatever the code prints.
pub(super) struct LiveChannel<P, O> {
    pub(super) progress: P,
    pub(super) observer: O,
    pub(super) rx: LiveRx,
}

/// A call's live channel; see `LiveChannel`.
pub(super) fn live_channel(
    output: bool,
) -> LiveChannel<impl Fn(&str) + Send + Sync, impl Fn(Stream, &[u8]) + Send + Sync> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Live>(LIVE_QUEUE);
    let tx2 = tx.clone();
    LiveChannel {
        progress: move |line: &str| {
            let _ = tx.try_send(Live::Step(line.to_owned()));
        },
        observer: move |stream, bytes: &[u8]| {
            if output {
                let _ = tx2.try_send(Live::Output(stream, String::from_utf8_lossy(bytes).into_owned()));
            }
        },
        rx,
    }
}

/// Live lines waiting for a client at most: 64 chunks of 64 KiB bound the queue at 4 MiB.
const LIVE_QUEUE: usize = 64;

/// How long lines still queued when the work ends may hold up its result: enough for a
/// client that keeps up to take a full queue, short against any call.
const DRAIN: Duration = Duration::from_millis(100);

pub(super) type LiveRx = tokio::sync::mpsc::Receiver<Live>;

/// Sends live lines to one request's client: as progress notifications when the request
/// carried a progress token, output chunks also as log notifications when it asked for a log
/// level (2026-07-28 `_meta`). Install lines also go to our own log.
pub(super) struct Notifier<'a> {
    ctx: &'a RequestContext<RoleServer>,
    token: Option<rmcp::model::ProgressToken>,
    log: bool,
    n: u32,
}

impl<'a> Notifier<'a> {
    /// Output chunks go out as `info` messages, so only a level of info or debug asks for them.
    /// A 2026-07-28 request is answered by its own `_meta` level alone: without one it gets
    /// no log message (the spec's MUST), whatever a `logging/setLevel` on the line said.
    fn new(ctx: &'a RequestContext<RoleServer>, session_level: Option<LoggingLevel>) -> Self {
        let level = if super::modern::is_modern(ctx) { ctx.meta.log_level() } else { session_level };
        let log = matches!(level, Some(LoggingLevel::Debug | LoggingLevel::Info));
        Self { ctx, token: ctx.meta.get_progress_token(), log, n: 0 }
    }

    /// True when the client will be sent output chunks.
    pub(super) fn wants_output(&self) -> bool {
        self.token.is_some() || self.log
    }

    /// Sends a chunk of output.
    pub(super) async fn output(&mut self, stream: Stream, text: String) {
        self.send(Live::Output(stream, text)).await;
    }

    /// Sends one line. rmcp's send returns once the transport has written it, so this waits
    /// as long as the client takes to read.
    async fn send(&mut self, line: Live) {
        let (stream, text) = match line {
            Live::Step(text) => {
                tracing::info!(target: "pyberth::install", "{text}");
                (None, text)
            }
            Live::Output(stream, text) => (Some(stream), text),
        };
        // One sequence number for both kinds: clients (rmcp's among them) may handle
        // notifications concurrently, and order chunks by it.
        self.n += 1;
        if let (Some(stream), true) = (stream, self.log) {
            let name = if stream == Stream::Stdout { "stdout" } else { "stderr" };
            let param = LoggingMessageNotificationParam::new(
                LoggingLevel::Info,
                serde_json::json!({ "stream": name, "text": text, "seq": self.n }),
            )
            .with_logger(name);
            let _ = self.ctx.peer.notify_logging_message(param).await;
        }
        if let Some(tok) = &self.token {
            let param = ProgressNotificationParam::new(tok.clone(), f64::from(self.n)).with_message(text);
            let _ = self.ctx.peer.notify_progress(param).await;
        }
    }
}

/// Drives `work` while relaying its live lines to the client. Forwarding is its own future,
/// polled beside `work` rather than inside a select arm: a send blocked on a slow client then
/// holds up only the lines behind it (later ones are dropped by try_send), never the work, its
/// reading of the agent or its deadline. When the work ends, the line being sent and those
/// still queued go out before the result for up to `DRAIN`; after that the rest are dropped
/// (the result has all output). The line in flight is never cut at the work's end: a chunk
/// sent as a log message must not lose its progress twin.
pub(super) async fn relay<T>(mut notifier: Notifier<'_>, rx: &mut LiveRx, work: impl Future<Output = T>) -> T {
    let stop = tokio::sync::Notify::new();
    let out = {
        let forward = forward(&mut notifier, rx, &stop);
        tokio::pin!(work, forward);
        let (out, forwarded) = tokio::select! {
            out = &mut work => (out, false),
            // Every sender is gone: nothing more can come, only the work is left.
            () = &mut forward => (work.await, true),
        };
        if !forwarded {
            // A stored permit: forward stops at its first empty queue, after the line in hand.
            stop.notify_one();
            let _ = tokio::time::timeout(DRAIN, &mut forward).await;
        }
        out
    };
    rx.close();
    out
}

/// Sends lines until the channel is closed and empty, or `stop` is signalled and the queue
/// is empty.
async fn forward(notifier: &mut Notifier<'_>, rx: &mut LiveRx, stop: &tokio::sync::Notify) {
    loop {
        let line = tokio::select! {
            biased;
            line = rx.recv() => line,
            () = stop.notified() => None,
        };
        match line {
            Some(line) => notifier.send(line).await,
            None => return,
        }
    }
}
