//! A server's stop: the jobs it leaves to its next server, and those it ends.
//!
//! A graceful leave (docs/design.md D12) reads each left run's stream to its end first: the
//! run closes the exec's stdin, the relay lets go of its keeper in order and writes out all it
//! was sent, and the job's observer records it. What the keeper did not send goes to the next
//! server's relay. The wait is bounded ([`DETACH_WAIT`], every job at once): a stream that
//! does not end (an engine that cannot close an exec's stdin alone, a relay of an old image)
//! is left as it is, and what it held may be lost, as before.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Job, Jobs};

/// How long a left run's stream has to end in order, once the server leaves.
const DETACH_WAIT: Duration = Duration::from_secs(2);

/// Resolves [`DETACH_WAIT`] after `leave` is cancelled: the job's task stops following its
/// run then, whether its stream ended or not.
pub(super) async fn given_up(leave: &CancellationToken) {
    leave.cancelled().await;
    tokio::time::sleep(DETACH_WAIT).await;
}

impl Jobs {
    /// The server stops and leaves its sessions running: jobs that a next server can take
    /// over are left to it (their runs go on), the others are cancelled. Waits for both.
    /// A finished job's record stays while `live(principal, session)` (the next server keeps
    /// that session), and goes with a session that is gone.
    pub async fn leave(&self, live: &(dyn Fn(&str, &str) -> bool + Sync)) {
        self.leave.cancel();
        if let Ok(jobs) = self.jobs.lock() {
            for j in jobs.values().filter(|j| j.durable.is_none()) {
                j.cancel.cancel();
            }
        }
        self.tasks.close();
        self.tasks.wait().await;
        self.drop_records(|j| j.is_finished() && !live(&j.principal, &j.session));
    }

    /// A session closed at `at` (when it left the registry): its jobs' records go. A session
    /// of that name made later is another one: its predecessor's jobs are not its to keep
    /// across a restart, and its own, started after `at`, are not touched.
    pub fn forget_session(&self, principal: &str, session: &str, at: std::time::Instant) {
        self.drop_records(|j| j.principal == principal && j.session == session && j.started <= at);
    }

    /// Removes the state-dir files of the jobs `which` picks.
    fn drop_records(&self, which: impl Fn(&Job) -> bool) {
        let Ok(jobs) = self.jobs.lock() else { return };
        for files in jobs.values().filter(|j| which(j)).filter_map(|j| j.durable.as_ref()) {
            files.remove();
        }
    }

    /// Cancels every job and waits for them to stop; their records go (nothing is left for
    /// a next server).
    pub async fn shutdown(&self) {
        if let Ok(jobs) = self.jobs.lock() {
            for j in jobs.values() {
                j.cancel.cancel();
            }
        }
        self.tasks.close();
        self.tasks.wait().await;
        self.drop_records(|_| true);
    }
}
