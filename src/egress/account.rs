//! The server's log of the proxy's connection records (issue 27). A record's host, rule and
//! names come from a sandbox (or carry what it sent), so every such field is cut to a bound
//! and escaped; and a session's refusals, which its code can make as fast as it likes, are
//! logged one by one only up to [`FIRST_REFUSALS`] per [`REFUSAL_INTERVAL`], then counted.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Totals;
use super::proxy::Record;

/// Refusals of one session logged line by line per interval; the rest are counted.
const FIRST_REFUSALS: u32 = 10;
/// The interval: at the first refusal after it, one line says how many were not logged.
const REFUSAL_INTERVAL: Duration = Duration::from_secs(60);
/// A host name is at most 253 characters: more than that is the code's, not a name.
const HOST_SHOWN: usize = 253;
/// A rule names the allow-list, which is the operator's, but may quote the code's host.
const RULE_SHOWN: usize = 1024;

/// How many of a session's refusals are logged in the current interval.
#[derive(Debug, Clone)]
pub(super) struct RefusalLog {
    since: Instant,
    logged: u32,
    unlogged: u64,
}

impl Default for RefusalLog {
    fn default() -> Self {
        Self { since: Instant::now(), logged: 0, unlogged: 0 }
    }
}

impl RefusalLog {
    /// Whether one more refusal is logged in full, and the count an interval that ended left
    /// unlogged (to be said first).
    fn admit(&mut self, now: Instant) -> (bool, Option<u64>) {
        let mut ended = None;
        if now.duration_since(self.since) >= REFUSAL_INTERVAL {
            ended = Some(self.unlogged).filter(|n| *n > 0);
            *self = Self { since: now, logged: 0, unlogged: 0 };
        }
        if self.logged < FIRST_REFUSALS {
            self.logged += 1;
            (true, ended)
        } else {
            self.unlogged += 1;
            (false, ended)
        }
    }

    /// Says what the current interval left unlogged: when the session ends.
    pub(super) fn flush(&self, principal: &str, session: &str) {
        if self.unlogged > 0 {
            unlogged_line(principal, session, self.unlogged);
        }
    }
}

/// Text from a sandbox as a log field: cut to `max` bytes (on a character boundary), quoted,
/// every quote, backslash, control and non-ASCII character escaped, so that nothing in it
/// can pass for another field or another line.
pub(crate) struct Shown<'a>(pub(crate) &'a str, pub(crate) usize);

impl std::fmt::Debug for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Shown(text, max) = *self;
        let mut end = text.len().min(max);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        write!(f, "\"{}\"", text[..end].escape_default())?;
        if end < text.len() { write!(f, " (+{} bytes)", text.len() - end) } else { Ok(()) }
    }
}

fn unlogged_line(principal: &str, session: &str, n: u64) {
    tracing::info!(
        target: "pyberth::egress",
        principal = ?Shown(principal, HOST_SHOWN),
        session = ?Shown(session, HOST_SHOWN),
        refused = n,
        "egress refusals not logged one by one (the first {FIRST_REFUSALS} of each {} s are)",
        REFUSAL_INTERVAL.as_secs()
    );
}

/// Adds `r` to its session's totals and logs it, through the session's refusal gate.
pub(super) fn account(totals: &Mutex<HashMap<IpAddr, Totals>>, r: &Record) {
    let (full, ended) = {
        let mut all = totals.lock().unwrap_or_else(|e| e.into_inner());
        match all.get_mut(&r.local) {
            Some(t) => {
                t.add(r);
                if r.allowed { (true, None) } else { t.log.admit(Instant::now()) }
            }
            // A session already gone: its proxy policy is dropped, so records stop.
            None => (true, None),
        }
    };
    if let Some(n) = ended {
        unlogged_line(&r.principal, &r.session, n);
    }
    if !full {
        return;
    }
    tracing::info!(
        target: "pyberth::egress",
        principal = ?Shown(&r.principal, HOST_SHOWN),
        session = ?Shown(&r.session, HOST_SHOWN),
        host = ?Shown(&r.host, HOST_SHOWN),
        port = r.port,
        bytes_out = r.up,
        bytes_in = r.down,
        ms = r.ms,
        verdict = if r.cut { "cut" } else if r.allowed { "allowed" } else { "denied" },
        rule = ?Shown(&r.rule, RULE_SHOWN),
        "egress connection"
    );
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A tracing writer into a buffer the test reads.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(f: impl FnOnce()) -> String {
        let buf = Buf::default();
        let out = buf.clone();
        let sub = tracing_subscriber::fmt().with_writer(move || out.clone()).with_ansi(false).finish();
        tracing::subscriber::with_default(sub, f);
        String::from_utf8_lossy(&buf.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    fn refusal(local: IpAddr, host: &str) -> Record {
        Record {
            local,
            session: "s".into(),
            principal: "p".into(),
            host: host.into(),
            port: 80,
            allowed: false,
            rule: format!("{host:?} is not a host name"),
            up: 0,
            down: 0,
            ms: 0,
            cut: false,
        }
    }

    /// A host made to look like the end of a denied line and the start of an allowed one:
    /// the quote, the `=`, a newline and a right-to-left override all come out escaped.
    #[test]
    fn sandbox_fields_are_escaped_and_cut() {
        let local: IpAddr = "10.9.9.9".parse().expect("ip");
        let totals = Mutex::new(HashMap::from([(local, Totals::default())]));
        let host = "x\" verdict=\"allowed\u{202e}\né";
        let line = logged(|| account(&totals, &refusal(local, host)));
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(line.contains(r#"host="x\" verdict=\"allowed\u{202e}\n\u{e9}""#), "{line}");
        assert!(!line.contains("verdict=\"allowed\"") && line.contains("verdict=\"denied\""), "{line}");
        let long = "a!".repeat(8192);
        let line = logged(|| account(&totals, &refusal(local, &long)));
        assert!(line.len() < 2000 && line.contains("(+16131 bytes)"), "{} bytes: {line}", line.len());
    }

    /// The first few refusals of a session are logged, then one line counts the rest when
    /// the interval ends; allowed connections are always logged; every one is counted.
    #[test]
    fn a_sessions_refusals_are_logged_first_then_counted() {
        let local: IpAddr = "10.9.9.8".parse().expect("ip");
        let totals = Mutex::new(HashMap::from([(local, Totals::default())]));
        let line = logged(|| {
            for _ in 0..1000 {
                account(&totals, &refusal(local, "nope.example"));
            }
            account(&totals, &Record { allowed: true, ..refusal(local, "ok.example") });
        });
        assert_eq!(line.lines().count(), FIRST_REFUSALS as usize + 1, "{line}");
        assert!(line.lines().last().is_some_and(|l| l.contains("verdict=\"allowed\"")), "{line}");
        let mut all = totals.lock().unwrap_or_else(|e| e.into_inner());
        let t = all.get_mut(&local).expect("totals");
        assert_eq!((t.denied_total, t.connections), (1000, 1));
        // The interval ends: the next refusal is logged after one line counting the rest.
        t.log.since -= REFUSAL_INTERVAL;
        drop(all);
        let line = logged(|| account(&totals, &refusal(local, "nope.example")));
        let lines: Vec<&str> = line.lines().collect();
        assert!(lines.len() == 2 && lines[0].contains("refused=990") && lines[1].contains("denied"), "{line}");
    }
}
