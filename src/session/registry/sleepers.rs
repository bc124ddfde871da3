//! Hibernated sessions and snapshots outlive their server too (docs/design.md D12).
//!
//! A hibernated session has no container for [`super::adopt`] to find: its snapshot is its
//! whole state. When it hibernates, the ledger (`durable/ledger.rs`) writes a record of it (its
//! session record's fields and its snapshot's) to `<state dir>/sleepers/<volume>.json`; the
//! snapshots of the catalogue are in `<state dir>/snapshots/<volume>.json` from when they are
//! made. The server that adopts their instance registers the sleeper again
//! (woken on its next call, expiring at its TTL from its last use) and the snapshots again
//! (their principal's, as before), and keeps their volumes from the sweep of that instance's
//! leftovers. A record whose volume is gone (woken, closed, deleted) is stale and dropped.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::Registry;
use crate::docker::container;
use crate::durable::ledger::Key;
use crate::durable::records::SavedRecord;
use crate::session::Session;
use crate::session::recorded::Revived;
use crate::session::snapshot::Saved;

/// What [`Registry::adopt_sleepers`] kept from the sweep of the adopted instances.
#[derive(Debug, Default)]
pub(super) struct Kept {
    pub(super) containers: HashSet<String>,
    pub(super) volumes: HashSet<String>,
}

fn unix_ms(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()).unwrap_or(u64::MAX)
}

/// Whether a snapshot's volume is still there (a record written before issue 26 also names a
/// helper container: not kept, the sweep removes it).
async fn store_exists(docker: &dyn crate::docker::Engine, saved: &SavedRecord) -> bool {
    docker.inspect_volume(&saved.volume).await.is_ok()
}

impl Registry {
    /// The egress of a session whose network went with the server that made it (a sleeper, an
    /// orphan whose container is gone): a new network of this server's, with the list `allow`
    /// it had (never wider than its environment's now). On failure, none, and the notice.
    pub(super) async fn egress_again(
        &self,
        env: &crate::environment::Environment,
        about: &crate::durable::records::About,
        allow: Option<&[String]>,
    ) -> (Option<Arc<crate::egress::Attachment>>, Vec<String>) {
        let Some(allow) = allow else { return (None, Vec::new()) };
        let attached = match crate::egress::policy::narrow(&env.egress, allow) {
            Ok(rules) => {
                let headers = env.egress_headers.0.clone();
                self.egress.attach(&about.principal, &about.name, &about.image, rules, headers).await
            }
            Err(e) => Err(e),
        };
        match attached {
            Ok(att) => (Some(Arc::new(att)), Vec::new()),
            Err(e) => {
                tracing::warn!(session = %about.name, error = %e, "a left session's egress could not be restored");
                let notice = format!(
                    "this session's network access was lost when the server restarted ({e}): it reaches nothing; \
                     close it and start a new one to get it back"
                );
                (None, vec![notice])
            }
        }
    }

    /// Registers the hibernated sessions and snapshots of the adopted instances `names`;
    /// returns what of theirs the sweep of those instances must keep, and how many sessions.
    pub(super) async fn adopt_sleepers(&self, names: &[String], host: &str) -> (Kept, usize) {
        let mut kept = Kept::default();
        let mut sessions = 0;
        for record in self.ledger.sleepers() {
            if !names.contains(&record.about.instance) {
                continue;
            }
            let key = (record.about.principal.clone(), record.about.name.clone());
            let stale = Key::Sleeping(record.saved.volume.clone());
            // Woken or closed since (its snapshot is gone), or awake under a container record.
            if !store_exists(&self.docker, &record.saved).await || self.slots().contains_key(&key) {
                self.ledger.forget(&stale);
                continue;
            }
            let Ok(env) = self.environments.get(Some(&record.about.environment)) else {
                tracing::warn!(session = %record.about.name, "no such environment now; hibernated session not adopted");
                self.ledger.forget(&stale);
                continue;
            };
            kept.volumes.insert(record.saved.volume.clone());
            let owner = container::Owner { instance: record.about.instance.clone(), host: host.to_owned() };
            let name = record.about.name.clone();
            let (egress, pending) = self.egress_again(&env, &record.about, record.egress.as_deref()).await;
            let idle = Duration::from_millis(unix_ms(SystemTime::now()).saturating_sub(record.last_used_ms));
            let how = Revived { pid: None, sleeping: Some(Saved::from(record.saved)), pending, idle, stopped: false };
            let session = Session::revive(self.docker.clone(), self.blueprint(&env, egress), owner, record.about, how);
            let slot: super::Slot = Arc::default();
            let _ = slot.set(session);
            let who = key.0.clone();
            self.slots().insert(key, slot);
            sessions += 1;
            tracing::info!(session = %name, "hibernated session adopted from a stopped server");
            self.audit(crate::audit::Event::new("session_adopted", &who).session(&name).field("state", "hibernated"));
        }
        for record in self.ledger.snapshots() {
            if !names.contains(&record.instance) {
                continue;
            }
            if !store_exists(&self.docker, &record.saved).await {
                self.ledger.snapshot_gone(&record.saved.volume);
                continue;
            }
            kept.volumes.insert(record.saved.volume.clone());
            if let Some(old) =
                self.snapshots.insert(&record.principal, &record.name, &record.session, record.saved.into())
            {
                // Two records of one name (two stops in a row): one is kept (the catalogue
                // dropped the other's record).
                crate::docker::snapshot::remove(&self.docker, &old.saved.store).await;
            }
        }
        (kept, sessions)
    }
}
