//! What bounds and records a principal's use beyond a session: its run slots, its quotas
//! (issue 32) and the audit log's records of the registry's own events.

use super::*;
use crate::audit::{Audit, Event};
use crate::quota::{Usage, over_stock};

/// How often the quota keeper samples the CPU of sessions that ran and saves the counts.
const KEEPER_TICK: Duration = Duration::from_secs(2);

impl Registry {
    /// The registry with an audit log: its sessions' runs and its own events go there.
    #[must_use]
    pub fn with_audit(mut self, audit: Audit) -> Self {
        if let Some(why) = &self.quotas.reset {
            audit.emit(Event::new("quota_counts_reset", "server").outcome("reset").field("reason", why.clone()));
        }
        self.oversight.audit = audit;
        self
    }

    /// The audit log, for the fronts' own events (tokens).
    pub fn audit_log(&self) -> Audit {
        self.oversight.audit.clone()
    }

    /// Records an event.
    pub(crate) fn audit(&self, event: Event) {
        self.oversight.audit.emit(event);
    }

    /// A session made (or not) by a call.
    pub(super) fn audit_created(&self, principal: &str, name: &str, environment: &str, failed: Option<&Error>) {
        let e = Event::new("session_created", principal).session(name).field("environment", environment);
        self.audit(if failed.is_some() { e.outcome("error") } else { e });
    }

    /// Every principal's use today against its quotas: a read-only snapshot (for metrics).
    pub fn quota_usage(&self) -> Vec<Usage> {
        self.quotas.usage()
    }

    /// Whether `principal` may start a run now (its daily quotas); the error says which.
    pub fn quota_check(&self, principal: &str) -> Result<(), String> {
        self.quotas.check_run(principal).inspect_err(|_| {
            self.audit(Event::new("quota_refused", principal).outcome("refused").field("what", "run").coalesced());
        })
    }

    /// A new session of `key`'s principal, which has `open` already, within its quota.
    pub(super) fn session_quota(&self, key: &Key, open: usize) -> Result<(), Error> {
        match self.quotas.limits(&key.0).and_then(|l| l.sessions) {
            Some(max) if open >= max => {
                self.audit(Event::new("quota_refused", &key.0).outcome("refused").field("what", "session").coalesced());
                Err(Error::Quota(over_stock("sessions", format!("{open} open of {max}"))))
            }
            _ => Ok(()),
        }
    }

    /// A snapshot of `bytes` more for `who`, which keeps `kept` bytes, within its quota.
    pub(super) fn snapshot_quota(&self, who: &str, kept: u64, bytes: u64) -> Result<(), String> {
        match self.quotas.limits(who).and_then(|l| l.snapshot_bytes) {
            Some(max) if kept.saturating_add(bytes) > max => Err(over_stock(
                "snapshot_mb",
                format!("{} MiB kept, {} MiB more, of {} MiB", kept >> 20, bytes.div_ceil(1 << 20), max >> 20),
            )),
            _ => Ok(()),
        }
    }

    /// A run's egress: charged to its principal's quota and summed up in the audit log (one
    /// record per run, never one per connection).
    pub fn charge_egress(&self, principal: &str, session: &str, used: Option<&crate::egress::Totals>) {
        let Some(t) = used else { return };
        self.quotas.egress(principal, t.bytes_in.saturating_add(t.bytes_out));
        let refused = t.refused_total();
        self.audit(
            Event::new("egress", principal)
                .session(session)
                .outcome(if refused > 0 { "refused_some" } else { "ok" })
                .field("allowed", t.connections)
                .field("refused", refused)
                .field("bytes_out", t.bytes_out)
                .field("bytes_in", t.bytes_in)
                .field("hosts", t.hosts.len()),
        );
    }

    /// A run slot for `principal`, held for the run's life; a clear error when all are taken.
    pub fn run_permit(&self, principal: &str) -> Result<tokio::sync::OwnedSemaphorePermit, String> {
        let max = self.cfg.max_runs_per_caller;
        let sem = {
            let mut runs = self.runs.lock().map_err(|_| "run slots unavailable".to_owned())?;
            shared(&mut runs, principal.to_owned(), || tokio::sync::Semaphore::new(max))
        };
        sem.try_acquire_owned().map_err(|_| {
            format!(
                "you have {max} runs going (the limit per caller): wait for one to finish, or cancel a job \
                 (list_jobs shows them)"
            )
        })
    }

    /// Samples the CPU of sessions that ran and saves the quota counts, until `shutdown`;
    /// then once more.
    pub async fn quota_keeper(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(KEEPER_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = shutdown.cancelled() => break,
            }
            self.quotas.sample(&*self.docker).await;
            self.quotas.save();
        }
        self.quotas.sample(&*self.docker).await;
        self.quotas.save();
    }

    /// Saves the counts (at the stop, after the last runs).
    pub(super) fn save_quotas(&self) {
        self.quotas.save();
    }
}
