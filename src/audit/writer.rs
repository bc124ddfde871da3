//! The one owner that writes audit records: a thread (file writes block) reading the bounded
//! channel, appending lines to stdout or to a file rotated by size, and coalescing what a
//! caller can repeat at will.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Audit, Event, QUEUE, Shared};

/// How long a coalesced key's window lasts.
const WINDOW: Duration = Duration::from_secs(60);
/// Coalesced keys held at once; past it such events are dropped and counted.
const MAX_KEYS: usize = 1024;

/// Where records go.
#[derive(Debug, Clone)]
pub enum Sink {
    /// Standard output (HTTP mode only: over stdio it is the MCP transport).
    Stdout,
    /// A file, appended to; past `max_bytes` it becomes `PATH.1` (`PATH.1` becomes `PATH.2`...)
    /// and at most `keep` such files are kept.
    File {
        /// The live file.
        path: PathBuf,
        /// Size past which it is rotated.
        max_bytes: u64,
        /// Rotated files kept.
        keep: usize,
    },
}

/// The running writer; [`Writer::finish`] writes what is queued and stops it.
#[derive(Debug)]
pub struct Writer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    /// Opens the sink (a clear error when the file cannot be) and starts the writer.
    pub fn start(sink: &Sink) -> Result<(Self, Audit), String> {
        let out = Out::open(sink)?;
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let audit = Audit(Some(Arc::new(Shared { tx, dropped: AtomicU64::new(0) })));
        let stop = Arc::new(AtomicBool::new(false));
        let mut state = State { out, audit: audit.clone(), windows: HashMap::new(), dropped: 0, failed_at: None };
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("pyberth-audit".into())
            .spawn(move || state.run(&rx, &flag))
            .map_err(|e| format!("cannot start the audit log writer: {e}"))?;
        Ok((Self { stop, thread: Some(thread) }, audit))
    }

    /// Writes what is queued, the pending summaries, and stops.
    pub async fn finish(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }
}

struct Window {
    start: Instant,
    count: u64,
}

struct State {
    out: Out,
    audit: Audit,
    windows: HashMap<(&'static str, String, String), Window>,
    /// Coalesced events dropped for want of a key.
    dropped: u64,
    /// When a write last failed (said in the server's log at most once a minute).
    failed_at: Option<Instant>,
}

impl State {
    fn run(&mut self, rx: &std::sync::mpsc::Receiver<Event>, stop: &AtomicBool) {
        let mut ticked = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(250)) {
                Ok(e) => self.take(e),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
            if ticked.elapsed() >= Duration::from_secs(1) {
                self.tick(false);
                ticked = Instant::now();
            }
            if stop.load(Ordering::SeqCst) {
                while let Ok(e) = rx.try_recv() {
                    self.take(e);
                }
                break;
            }
        }
        self.tick(true);
        self.out.flush();
    }

    fn take(&mut self, e: Event) {
        if !e.coalesce {
            return self.write(&e);
        }
        let key = (e.event, e.principal.clone(), e.outcome.clone());
        let full = self.windows.len() >= MAX_KEYS;
        match self.windows.get_mut(&key) {
            Some(w) if w.start.elapsed() < WINDOW => w.count += 1,
            Some(w) => {
                let count = std::mem::replace(&mut w.count, 0);
                w.start = Instant::now();
                self.summary(&key, count);
                self.write(&e);
            }
            None if full => self.dropped += 1,
            None => {
                self.windows.insert(key, Window { start: Instant::now(), count: 0 });
                self.write(&e);
            }
        }
    }

    /// Summaries of windows over (all of them at the end), and the count of dropped records.
    fn tick(&mut self, all: bool) {
        let over: Vec<_> =
            self.windows.iter().filter(|(_, w)| all || w.start.elapsed() >= WINDOW).map(|(k, _)| k.clone()).collect();
        for key in over {
            if let Some(w) = self.windows.remove(&key) {
                self.summary(&key, w.count);
            }
        }
        let dropped = self.audit.take_dropped() + std::mem::take(&mut self.dropped);
        if dropped > 0 {
            let e = Event::new("audit_dropped", "server").outcome("dropped").field("count", dropped);
            self.write(&e);
        }
    }

    fn summary(&mut self, key: &(&'static str, String, String), count: u64) {
        if count == 0 {
            return;
        }
        let e = Event::new(key.0, &key.1)
            .outcome(key.2.clone())
            .field("count", count)
            .field("summary", true)
            .field("interval_s", WINDOW.as_secs());
        self.write(&e);
    }

    fn write(&mut self, e: &Event) {
        if let Err(err) = self.out.line(&e.line())
            && self.failed_at.is_none_or(|t| t.elapsed() >= WINDOW)
        {
            tracing::warn!(error = %err, "cannot write the audit log");
            self.failed_at = Some(Instant::now());
        }
    }
}

/// The open sink.
enum Out {
    Stdout,
    File { path: PathBuf, max_bytes: u64, keep: usize, file: File, size: u64 },
}

fn open_append(path: &PathBuf) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).mode(0o600).custom_flags(crate::state_dir::no_follow()).open(path)
}

impl Out {
    fn open(sink: &Sink) -> Result<Self, String> {
        match sink {
            Sink::Stdout => Ok(Self::Stdout),
            Sink::File { path, max_bytes, keep } => {
                let file = open_append(path)
                    .map_err(|e| format!("cannot open the audit log {} for appending: {e}", path.display()))?;
                let size = file.metadata().map(|m| m.len()).unwrap_or(0);
                Ok(Self::File { path: path.clone(), max_bytes: *max_bytes, keep: *keep, file, size })
            }
        }
    }

    fn line(&mut self, line: &str) -> std::io::Result<()> {
        match self {
            Self::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(line.as_bytes())?;
                out.write_all(b"\n")?;
                out.flush()
            }
            Self::File { path, max_bytes, keep, file, size } => {
                let len = line.len() as u64 + 1;
                if *size > 0 && *size + len > *max_bytes {
                    rotate(path, *keep)?;
                    *file = open_append(path)?;
                    *size = 0;
                }
                file.write_all(format!("{line}\n").as_bytes())?;
                *size += len;
                Ok(())
            }
        }
    }

    fn flush(&mut self) {
        if let Self::File { file, .. } = self {
            let _ = file.sync_data();
        }
    }
}

/// `PATH.N-1` to `PATH.N` ... `PATH` to `PATH.1`; the oldest past `keep` is removed.
fn rotate(path: &std::path::Path, keep: usize) -> std::io::Result<()> {
    let nth = |n: usize| {
        let mut p = path.as_os_str().to_owned();
        p.push(format!(".{n}"));
        PathBuf::from(p)
    };
    if keep == 0 {
        return std::fs::remove_file(path);
    }
    let _ = std::fs::remove_file(nth(keep));
    for n in (1..keep).rev() {
        let _ = std::fs::rename(nth(n), nth(n + 1));
    }
    std::fs::rename(path, nth(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pyberth-audit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    #[tokio::test]
    async fn the_file_rotates_by_size_and_keeps_n_files() {
        let d = dir("rotate");
        let path = d.join("audit.log");
        let sink = Sink::File { path: path.clone(), max_bytes: 2000, keep: 2 };
        let (writer, audit) = Writer::start(&sink).expect("start");
        for i in 0..100 {
            audit.emit(Event::new("run_ended", "alice").session("s").field("i", i));
            if i % 20 == 19 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        writer.finish().await;
        let mut names: Vec<String> =
            std::fs::read_dir(&d).expect("list").flatten().map(|e| e.file_name().to_string_lossy().into()).collect();
        names.sort();
        assert_eq!(names, ["audit.log", "audit.log.1", "audit.log.2"], "the live file and two rotated ones");
        let mut last = None;
        for name in ["audit.log.2", "audit.log.1", "audit.log"] {
            let text = std::fs::read_to_string(d.join(name)).expect("read");
            assert!(text.len() as u64 <= 2000, "{name} is {} bytes", text.len());
            for line in text.lines() {
                let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
                let i = v["i"].as_u64().expect("i");
                assert!(last.is_none_or(|l| i == l + 1), "in order, none lost inside the kept files");
                last = Some(i);
            }
        }
        assert_eq!(last, Some(99), "the newest record is in the live file");
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).expect("meta").permissions());
        assert_eq!(mode & 0o777, 0o600, "private");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[tokio::test]
    async fn repeated_token_events_are_coalesced_with_a_count() {
        let d = dir("coalesce");
        let path = d.join("audit.log");
        let sink = Sink::File { path: path.clone(), max_bytes: 1 << 20, keep: 1 };
        let (writer, audit) = Writer::start(&sink).expect("start");
        for _ in 0..500 {
            audit.emit(Event::new("token", "unknown").outcome("refused").coalesced());
            std::thread::yield_now();
        }
        audit.emit(Event::new("token", "alice").outcome("accepted").coalesced());
        writer.finish().await;
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
        let refused: Vec<_> = lines.iter().filter(|v| v["outcome"] == "refused").collect();
        assert_eq!(refused.len(), 2, "the first, then one summary: {text}");
        let dropped: u64 =
            lines.iter().filter(|v| v["event"] == "audit_dropped").filter_map(|v| v["count"].as_u64()).sum();
        assert_eq!(refused[1]["count"].as_u64().unwrap_or(0) + dropped, 499, "every repeat counted: {text}");
        assert!(lines.iter().any(|v| v["principal"] == "alice"), "another key is its own line");
        let _ = std::fs::remove_dir_all(&d);
    }
}
