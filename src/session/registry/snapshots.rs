//! The snapshot owner (issues 18, 25): save, restore, fork, delete and list, with the cache
//! policy (the total bound, least recently used out) in one place. MCP tools call only these;
//! the engine calls and the catalogue's records stay below this line.

use std::sync::Arc;

use super::Registry;
use crate::audit::Event;
use crate::docker::snapshot::{Bounds, remove};
use crate::durable::catalogue::Entry;
use crate::session::Session;
use crate::session::snapshot::{Restored, Saved};

/// Most entries (files, directories) one snapshot holds.
const MAX_ENTRIES: u64 = 100_000;

/// The bytes and the entries of the snapshot cache, as `list_snapshots` shows them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheUse {
    /// Bytes all snapshots of the server take.
    pub(crate) total_bytes: u64,
    /// The bound (--snapshot-cache-mb), bytes.
    pub(crate) cache_bytes: u64,
}

impl Registry {
    /// The bound of the whole cache, bytes (--snapshot-cache-mb).
    fn cache_bytes(&self) -> u64 {
        self.cfg.snapshot_cache_mb << 20
    }

    /// The bounds of one snapshot (hibernation's included).
    pub(crate) fn snapshot_bounds(&self) -> Bounds {
        Bounds { bytes: self.cache_bytes(), entries: MAX_ENTRIES }
    }

    /// Takes a snapshot of `session` into a new volume (not catalogued).
    async fn take_snapshot(&self, session: &Session) -> Result<Saved, String> {
        let id = self.snapshots.next_id();
        session
            .snapshot(&id, self.snapshot_bounds())
            .await
            .map_err(|e| format!("cannot snapshot session {:?}: {e}", session.name))
    }

    /// The count and bytes of `who`'s snapshots, its hibernated sessions included, but its
    /// snapshot `except` (one about to be replaced).
    fn caller_use(&self, who: &str, except: &str) -> (usize, u64) {
        let (count, bytes) = self.snapshots.use_of(who, except);
        let mine: Vec<Arc<Session>> =
            self.slots().iter().filter(|(k, _)| k.0 == who).filter_map(|(_, slot)| slot.get().cloned()).collect();
        mine.iter().filter_map(|s| asleep_bytes(s)).fold((count, bytes), |(n, b), more| (n + 1, b + more))
    }

    /// The caller's caps: most snapshots, most bytes.
    fn caller_caps(&self) -> (usize, u64) {
        (self.cfg.max_snapshots_per_caller, self.cfg.snapshot_mb_per_caller << 20)
    }

    /// Saves session `session` of `who` as snapshot `name` (an existing one of that name is
    /// replaced), then prunes the cache to its bound, least recently used first. Past the
    /// caller's caps the snapshot is refused, and nothing kept is removed for it.
    pub(crate) async fn save_snapshot(&self, who: &str, session: &str, name: &str) -> Result<Arc<Entry>, String> {
        let r = self.save_snapshot_within_caps(who, session, name).await;
        let e = Event::new("snapshot", who).session(session).field("snapshot", name);
        self.audit(match &r {
            Ok(entry) => e.field("bytes", entry.saved.summary.bytes()),
            Err(_) => e.outcome("refused_or_failed"),
        });
        r
    }

    async fn save_snapshot_within_caps(&self, who: &str, session: &str, name: &str) -> Result<Arc<Entry>, String> {
        let s = self.get(who, session).map_err(|e| e.to_string())?;
        // Held until the snapshot is catalogued: the checks below see every earlier one.
        let _turn = self.snapshots.turn(who).await;
        let (count, bytes) = self.caller_use(who, name);
        let (max_count, max_bytes) = self.caller_caps();
        if count >= max_count {
            return Err(format!(
                "snapshot refused: you keep {count} snapshots (hibernated sessions included), the most \
                 --max-snapshots-per-caller allows: delete_snapshot one of list_snapshots, reuse a name, or close a \
                 hibernated session"
            ));
        }
        let saved = self.take_snapshot(&s).await?;
        let cap = self.cache_bytes();
        if saved.summary.bytes() > cap {
            remove(&self.docker, &saved.store).await;
            return Err(format!(
                "the snapshot holds {} MiB, over --snapshot-cache-mb {}: make the workspace smaller",
                saved.summary.bytes() >> 20,
                cap >> 20
            ));
        }
        if bytes.saturating_add(saved.summary.bytes()) > max_bytes {
            remove(&self.docker, &saved.store).await;
            return Err(format!(
                "snapshot refused: it holds {} MiB and yours take {} MiB already (hibernated sessions included), over \
                 --snapshot-mb-per-caller {}: delete_snapshot some of list_snapshots, or make the workspace smaller",
                saved.summary.bytes() >> 20,
                bytes >> 20,
                max_bytes >> 20
            ));
        }
        if let Err(e) = self.snapshot_quota(who, bytes, saved.summary.bytes()) {
            remove(&self.docker, &saved.store).await;
            return Err(e);
        }
        self.metrics.snapshot_taken("save", saved.summary.bytes());
        if let Some(old) = self.snapshots.insert(who, name, session, saved) {
            remove(&self.docker, &old.saved.store).await;
        }
        for gone in self.snapshots.prune(cap, who, name) {
            tracing::info!(snapshot = %gone.name, bytes = gone.saved.summary.bytes(), "snapshot cache over its size; pruned");
            remove(&self.docker, &gone.saved.store).await;
        }
        self.snapshots.get(who, name).ok_or_else(|| no_snapshot(name))
    }

    /// Hibernates `s` if its caller's caps leave room for the snapshot; otherwise it stays
    /// awake (the error says which cap) and nothing kept is removed for it.
    pub(crate) async fn hibernate_within_caps(&self, s: &Session) -> Result<bool, String> {
        let _turn = self.snapshots.turn(&s.principal).await;
        let (count, bytes) = self.caller_use(&s.principal, "");
        let (max_count, max_bytes) = self.caller_caps();
        if count >= max_count || bytes >= max_bytes {
            return Err(format!(
                "its caller keeps {count} snapshots of {} MiB (--max-snapshots-per-caller {max_count}, \
                 --snapshot-mb-per-caller {})",
                bytes >> 20,
                max_bytes >> 20
            ));
        }
        let quota = self.quotas.limits(&s.principal).and_then(|l| l.snapshot_bytes).unwrap_or(u64::MAX);
        if bytes >= quota {
            return Err(format!("its caller keeps {} MiB of snapshots, its snapshot_mb quota", bytes >> 20));
        }
        let room = (max_bytes - bytes).min(quota - bytes);
        let bounds = Bounds { bytes: self.cache_bytes().min(room), entries: MAX_ENTRIES };
        let id = format!("h{}", self.snapshots.next_id());
        let slept = s.hibernate(&id, bounds).await?;
        if let Some(bytes) = asleep_bytes(s).filter(|_| slept) {
            self.metrics.snapshot_taken("hibernate", bytes);
        }
        Ok(slept)
    }

    /// Makes session `name` of `who` from its snapshot `snapshot`.
    pub(crate) async fn restore_snapshot(
        &self,
        who: &str,
        snapshot: &str,
        name: &str,
    ) -> Result<(Arc<Entry>, Restored), String> {
        let entry = self.snapshots.get(who, snapshot).ok_or_else(|| no_snapshot(snapshot))?;
        let r = self.restore_into(who, name, &entry.saved).await;
        let e = Event::new("restore", who).session(name).field("snapshot", snapshot);
        self.audit(if r.is_ok() { e } else { e.outcome("error") });
        let (_, r) = r?;
        Ok((entry, r))
    }

    /// Copies session `from` of `who` into a new session `name`: a snapshot, restored, then
    /// removed. Returns the snapshot (its store gone) and what the restore brought back.
    pub(crate) async fn fork_session(&self, who: &str, from: &str, name: &str) -> Result<(Saved, Restored), String> {
        if self.find(who, name).is_some() {
            return Err(format!("session {name:?} exists: fork into a new name"));
        }
        let session = self.get(who, from).map_err(|e| e.to_string())?;
        let saved = self.take_snapshot(&session).await?;
        self.metrics.snapshot_taken("fork", saved.summary.bytes());
        let restored = self.restore_into(who, name, &saved).await;
        remove(&self.docker, &saved.store).await;
        let e = Event::new("fork", who).session(name).field("from", from).field("bytes", saved.summary.bytes());
        self.audit(if restored.is_ok() { e } else { e.outcome("error") });
        let (_, r) = restored?;
        Ok((saved, r))
    }

    /// Deletes snapshot `name` of `who`, its store with it.
    pub(crate) async fn delete_snapshot(&self, who: &str, name: &str) -> Result<Arc<Entry>, String> {
        let entry = self.snapshots.remove(who, name).ok_or_else(|| no_snapshot(name))?;
        self.audit(Event::new("snapshot_deleted", who).field("snapshot", name));
        remove(&self.docker, &entry.saved.store).await;
        Ok(entry)
    }

    /// The snapshots of `who`, newest first, and the cache's use.
    pub(crate) fn list_snapshots(&self, who: &str) -> (Vec<Arc<Entry>>, CacheUse) {
        let cache = CacheUse { total_bytes: self.snapshots.total(), cache_bytes: self.cache_bytes() };
        (self.snapshots.list(who), cache)
    }

    /// A name for a snapshot of `session` the caller did not name.
    pub(crate) fn default_snapshot_name(&self, session: &str) -> String {
        self.snapshots.default_name(session)
    }

    /// Makes session `name` of `who` from `saved`. The session must not exist. A failed
    /// restore leaves the new session fresh, and the error says so.
    async fn restore_into(&self, who: &str, name: &str, saved: &Saved) -> Result<(Arc<Session>, Restored), String> {
        let exists = || {
            format!(
                "session {name:?} exists: restore into a new name, or close_session {name:?} first (its variables and \
                 files go)"
            )
        };
        if self.find(who, name).is_some() {
            return Err(exists());
        }
        let (session, created) = self
            .get_or_create(who, name, Some(&saved.environment), &saved.requirements, &|_| {})
            .await
            .map_err(|e| e.to_string())?;
        if !created {
            return Err(exists());
        }
        let restored = session.restore(saved).await.map_err(|e| format!("cannot restore into {name:?}: {e}"))?;
        Ok((session, restored))
    }
}

/// Bytes of a session's hibernation snapshot, if it sleeps.
fn asleep_bytes(s: &Session) -> Option<u64> {
    s.asleep.lock().ok().and_then(|a| a.as_ref().map(|saved| saved.summary.bytes()))
}

fn no_snapshot(name: &str) -> String {
    format!("no snapshot named {name:?}: list_snapshots shows yours")
}
