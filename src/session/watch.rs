//! Code that outlives its run (docs/threat-model.md §1).
//!
//! A `done` proves nothing: the code can send one in the agent's place and go on, and a real
//! one can leave threads and child processes running. So after a run ends with `done`, the
//! session holds a lease: the run's time limit. Code may go on under it, never past it, and a
//! later run's lease replaces it (what an earlier run left behind is bounded by the later
//! run's limit: nothing can tell whose code a CPU second was). Once
//! it has passed, a watchdog samples the container's CPU time, as the engine reads it from
//! the cgroup (outside the sandbox, where no code can forge it), whenever no call holds the
//! session. When the code used more than a small share of a CPU between two samples with no
//! call in between, something of an earlier run is still running: every process of the
//! code's uid is killed, a fresh interpreter started, and the next run says so.
//!
//! Idle sessions cost the engine nothing: once the code has stayed quiet for `QUIET_FOR`
//! past its lease (about eight samples), the watchdog ends. The next run's lease starts it
//! again, and a hibernation or a close removes the container (docs/threat-model.md, gaps).

use std::time::Duration;

use tokio::time::Instant;

use super::{Inner, Session};
use crate::docker::container;

use timing::{FIRST, LONGEST, QUIET_FOR};
/// CPU a session may use between calls once its lease has passed: this share of one CPU...
const IDLE_SHARE: f64 = 0.2;
/// ... plus this much per sample, for the agent's own bookkeeping.
const IDLE_SLACK: Duration = Duration::from_millis(100);

#[cfg(not(test))]
mod timing {
    use std::time::Duration;
    /// First pause between two samples once the lease has passed; it doubles up to [`LONGEST`].
    pub(super) const FIRST: Duration = Duration::from_secs(1);
    pub(super) const LONGEST: Duration = Duration::from_secs(30);
    /// Quiet this long past the lease (no call, no CPU over the share), the watchdog ends.
    pub(super) const QUIET_FOR: Duration = Duration::from_secs(120);
}

/// The same steps, some hundred times shorter, so owner tests see a watchdog end in real time.
#[cfg(test)]
mod timing {
    use std::time::Duration;
    pub(super) const FIRST: Duration = Duration::from_millis(10);
    pub(super) const LONGEST: Duration = Duration::from_millis(100);
    pub(super) const QUIET_FOR: Duration = Duration::from_millis(500);
}

/// The container's CPU time at a moment when no call held the session.
#[derive(Debug, Clone, Copy)]
struct Sample {
    cpu: Duration,
    at: Instant,
    /// The session's last use then: a call in between makes two samples incomparable.
    used: std::time::Instant,
}

impl Session {
    /// Code of a run that ended with `done` may go on until `until`; a watchdog sees to the
    /// rest.
    pub(super) fn lease(&self, inner: &mut Inner, until: Instant) {
        inner.lease = Some(until);
        if inner.watched {
            self.lease_changed.notify_one();
        } else {
            inner.watched = true;
            tokio::spawn(watch(self.me.clone(), self.lease_changed.clone()));
        }
    }

    fn last_used_at(&self) -> Option<std::time::Instant> {
        self.last_used.lock().ok().map(|t| *t)
    }

    /// The CPU time of the container, if no call holds the session before and after it is
    /// read.
    async fn sample(&self) -> Option<Sample> {
        let used = self.last_used_at()?;
        if self.is_busy() {
            return None;
        }
        let cpu = container::cpu_ns(&self.docker, &self.container_id()).await?;
        let at = Instant::now();
        let quiet = !self.is_busy() && self.last_used_at() == Some(used);
        quiet.then_some(Sample { cpu: Duration::from_nanos(cpu), at, used })
    }

    /// Ends the watchdog of an idle session whose code stayed quiet past `lease`, unless a
    /// call or another lease came meanwhile; true when it did. The lease is kept: the next run's lease starts a new one.
    async fn stop_watching(&self, used: std::time::Instant, lease: Instant) -> bool {
        let mut inner = self.inner.lock().await;
        if self.last_used_at() != Some(used) || inner.lease != Some(lease) {
            return false;
        }
        tracing::debug!(session = %self.name, "code quiet past its lease: the watchdog stops sampling");
        inner.watched = false;
        true
    }

    /// Kills what still runs past the lease, unless a call came meanwhile; true when it did.
    async fn stop_leftovers(&self, used: std::time::Instant, share: f64) -> bool {
        let mut inner = self.inner.lock().await;
        let passed = inner.lease.is_some_and(|l| l <= Instant::now());
        if !passed || self.last_used_at() != Some(used) || self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return false;
        }
        tracing::warn!(session = %self.name, cpu_share = share, "code runs past its run's time limit; killing it");
        inner.pending.push(format!(
            "code of an earlier run was still using the CPU (about {:.0}% of one) after that run's time limit had \
             passed: a thread or a process left running, or a run that reported its end and went on. Its processes \
             were killed and a new interpreter was started: variables are gone, workspace files are kept",
            share * 100.0
        ));
        inner.pending_lost = true;
        let notes = self.recover(&mut inner).await;
        inner.pending.extend(notes);
        // Nothing of the code runs any more: no lease is left to watch.
        inner.lease = None;
        inner.watched = false;
        true
    }
}

/// The watchdog of one session, until its lease is gone (the code's processes were killed)
/// or the session is.
async fn watch(me: std::sync::Weak<Session>, lease_changed: std::sync::Arc<tokio::sync::Notify>) {
    let mut last: Option<Sample> = None;
    let mut pause = FIRST;
    // Since when samples found the code quiet, with no call in between.
    let mut quiet_since: Option<Instant> = None;
    loop {
        let Some(session) = me.upgrade() else { return };
        let lease = {
            let mut inner = session.inner.lock().await;
            match inner.lease {
                Some(l) if !session.closed.load(std::sync::atomic::Ordering::SeqCst) => l,
                _ => {
                    inner.watched = false;
                    return;
                }
            }
        };
        if lease > Instant::now() {
            drop(session);
            (last, pause, quiet_since) = (None, FIRST, None);
            tokio::select! {
                () = tokio::time::sleep_until(lease) => {}
                () = lease_changed.notified() => {}
            }
            continue;
        }
        let sample = session.sample().await;
        tracing::trace!(session = %session.name, ?sample, ?last, "watchdog sample");
        if let (Some(now), Some(before)) = (sample, last)
            && now.used == before.used
        {
            let spent = now.cpu.saturating_sub(before.cpu);
            let span = now.at.saturating_duration_since(before.at);
            if spent > span.mul_f64(IDLE_SHARE) + IDLE_SLACK {
                let share = spent.as_secs_f64() / span.as_secs_f64().max(0.001);
                if session.stop_leftovers(now.used, share).await {
                    return;
                }
                (last, pause, quiet_since) = (None, FIRST, None);
                continue;
            }
            let since = *quiet_since.get_or_insert(before.at);
            if now.at.saturating_duration_since(since) >= QUIET_FOR && session.stop_watching(now.used, lease).await {
                return;
            }
        }
        if last.is_some_and(|l| sample.is_some_and(|s| s.used != l.used)) {
            // A call came: start again from a short pause.
            (pause, quiet_since) = (FIRST, None);
        }
        last = sample;
        drop(session);
        tokio::select! {
            () = tokio::time::sleep(pause) => pause = (pause * 2).min(LONGEST),
            // A new run: its own lease, from the start.
            () = lease_changed.notified() => (last, pause, quiet_since) = (None, FIRST, None),
        }
    }
}
