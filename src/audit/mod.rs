//! The audit log (issue 32): one JSON line per event a security reviewer cares about, with
//! time (RFC 3339, UTC), event, principal, session and outcome, plus a few small fields of
//! the event's own. Never a token, an egress header value, code text or output: events take
//! only names, counts, sizes and hashes.
//!
//! Every record goes through one bounded channel to one owned writer thread (`writer.rs`): an
//! event is never waited for by the run or request that causes it. Past the bound records are
//! dropped and counted, and the count is written as an `audit_dropped` record. Events a caller
//! can repeat at will without a session (token accepted or refused) are coalesced per key and
//! minute: the first is written, the rest as one record with a `count`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

pub mod time;
mod writer;

pub use time::rfc3339;
pub use writer::{Sink, Writer};

/// Records that may wait for the writer; past it they are dropped and counted.
pub const QUEUE: usize = 1024;

/// One event.
#[derive(Debug, Clone)]
pub struct Event {
    pub(crate) time: SystemTime,
    pub(crate) event: &'static str,
    pub(crate) principal: String,
    pub(crate) session: Option<String>,
    pub(crate) outcome: String,
    pub(crate) fields: serde_json::Map<String, serde_json::Value>,
    /// Written once per key and minute, the rest counted (see the module's doc).
    pub(crate) coalesce: bool,
}

impl Event {
    /// An event of `principal` (`"unknown"` when no token named one), outcome `ok`.
    pub fn new(event: &'static str, principal: &str) -> Self {
        Self {
            time: SystemTime::now(),
            event,
            principal: principal.to_owned(),
            session: None,
            outcome: "ok".into(),
            fields: serde_json::Map::new(),
            coalesce: false,
        }
    }

    /// Of session `name`.
    pub fn session(mut self, name: &str) -> Self {
        self.session = Some(name.to_owned());
        self
    }

    /// Its outcome (`ok`, `error`, `refused`, a run's status...).
    pub fn outcome(mut self, outcome: impl Into<String>) -> Self {
        self.outcome = outcome.into();
        self
    }

    /// A small field of its own.
    pub fn field(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.fields.insert(key.to_owned(), value.into());
        self
    }

    /// Coalesced per (event, principal, outcome) and minute.
    pub fn coalesced(mut self) -> Self {
        self.coalesce = true;
        self
    }

    /// The JSON line (without its newline).
    pub(crate) fn line(&self) -> String {
        let mut m = serde_json::Map::new();
        m.insert("time".into(), rfc3339(self.time).into());
        m.insert("event".into(), self.event.into());
        m.insert("principal".into(), self.principal.clone().into());
        m.insert("session".into(), self.session.clone().map_or(serde_json::Value::Null, Into::into));
        m.insert("outcome".into(), self.outcome.clone().into());
        for (k, v) in &self.fields {
            m.entry(k.clone()).or_insert_with(|| v.clone());
        }
        serde_json::Value::Object(m).to_string()
    }
}

/// The sending side, cheap to clone; [`Audit::off`] writes nothing.
#[derive(Debug, Clone, Default)]
pub struct Audit(Option<Arc<Shared>>);

#[derive(Debug)]
struct Shared {
    tx: std::sync::mpsc::SyncSender<Event>,
    dropped: AtomicU64,
}

impl Audit {
    /// No audit log.
    pub fn off() -> Self {
        Self(None)
    }

    /// Whether records are kept.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Queues an event; never waits. Dropped and counted when the queue is full.
    pub fn emit(&self, event: Event) {
        let Some(shared) = &self.0 else { return };
        if let Err(std::sync::mpsc::TrySendError::Full(_)) = shared.tx.try_send(event) {
            shared.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records dropped since the last call (the writer's).
    fn take_dropped(&self) -> u64 {
        self.0.as_ref().map_or(0, |s| s.dropped.swap(0, Ordering::Relaxed))
    }
}

/// What a session's runs report to: the audit log and its principal's quotas.
#[derive(Debug, Clone, Default)]
pub struct Oversight {
    /// The audit log.
    pub audit: Audit,
    /// The quotas (none in `pyberth run`).
    pub quotas: Option<Arc<crate::quota::Quotas>>,
}

/// The sha256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_holds_the_common_fields_first_and_never_overrides_them() {
        let e = Event::new("run_ended", "alice").session("s1").outcome("ok").field("event", "forged").field("ms", 5);
        let v: serde_json::Value = serde_json::from_str(&e.line()).expect("json");
        assert_eq!(v["event"], "run_ended");
        assert_eq!(v["principal"], "alice");
        assert_eq!(v["session"], "s1");
        assert_eq!(v["outcome"], "ok");
        assert_eq!(v["ms"], 5);
        assert!(v["time"].as_str().is_some_and(|t| t.ends_with('Z') && t.len() == 24), "{v}");
    }

    #[test]
    fn emit_never_waits_and_counts_what_it_drops() {
        let (tx, rx) = std::sync::mpsc::sync_channel(2);
        let audit = Audit(Some(Arc::new(Shared { tx, dropped: AtomicU64::new(0) })));
        for _ in 0..5 {
            audit.emit(Event::new("x", "p"));
        }
        assert_eq!(rx.try_iter().count(), 2);
        assert_eq!(audit.take_dropped(), 3);
        assert_eq!(audit.take_dropped(), 0);
    }
}
