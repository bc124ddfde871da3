//! Hibernated sessions and snapshots outlive their server too (docs/design.md D12).
//!
//! A hibernated session has no container for [`super::adopt`] to find: its snapshot is its
//! whole state. When it hibernates, a record of it (its session record's fields and its
//! snapshot's) is written to `<state dir>/sleepers/<volume>.json`; the snapshots of the
//! catalogue are written to `<state dir>/snapshots/<volume>.json` when the server stops and
//! leaves its sessions. The server that adopts their instance registers the sleeper again
//! (woken on its next call, expiring at its TTL from its last use) and the snapshots again
//! (their principal's, as before), and keeps their volumes from the sweep of that instance's
//! leftovers. A record whose volume is gone (woken, closed, deleted) is stale and dropped.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::Registry;
use super::adopt::{About, Revived};
use crate::docker::container;
use crate::docker::snapshot::{Stored, Summary};
use crate::protocol::Lost;
use crate::session::Session;
use crate::session::snapshot::{Grade, Saved};

const SLEEPERS: &str = "sleepers";
const SNAPSHOTS: &str = "snapshots";
/// Largest record read back (a snapshot's file sizes and digests are listed in it).
const MAX_RECORD: u64 = 64 << 20;

/// A snapshot, as stored in a record.
#[derive(Debug, Serialize, Deserialize)]
struct SavedRecord {
    volume: String,
    helper: String,
    environment: String,
    requirements: Vec<String>,
    env: BTreeMap<String, String>,
    files: u64,
    workspace_bytes: u64,
    state_bytes: u64,
    skipped: u64,
    meta: Option<Vec<u8>>,
    sizes: HashMap<String, u64>,
    digests: HashMap<String, u64>,
    /// Stored by the packer, volume to volume: it must be restored the same way (absent in
    /// records written before the packer: those were streamed).
    #[serde(default)]
    packed: bool,
    /// Whether globals were saved (grade `files+globals`).
    globals: bool,
    saved: Vec<String>,
    lost: Vec<(String, String)>,
    took_ms: u64,
}

impl From<&Saved> for SavedRecord {
    fn from(s: &Saved) -> Self {
        Self {
            volume: s.store.volume.clone(),
            helper: s.store.helper.clone(),
            environment: s.environment.clone(),
            requirements: s.requirements.clone(),
            env: s.env.clone(),
            files: s.summary.files,
            workspace_bytes: s.summary.workspace_bytes,
            state_bytes: s.summary.state_bytes,
            skipped: s.summary.skipped,
            meta: s.summary.meta.clone(),
            sizes: s.summary.sizes.clone(),
            digests: s.summary.digests.clone(),
            packed: s.summary.packed,
            globals: s.grade == Grade::FilesAndGlobals,
            saved: s.saved.clone(),
            lost: s.lost.iter().map(|l| (l.name.clone(), l.why.clone())).collect(),
            took_ms: u64::try_from(s.took.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

impl From<SavedRecord> for Saved {
    fn from(r: SavedRecord) -> Self {
        Saved {
            store: Stored { volume: r.volume, helper: r.helper },
            environment: r.environment,
            requirements: r.requirements,
            env: r.env,
            summary: Summary {
                files: r.files,
                workspace_bytes: r.workspace_bytes,
                state_bytes: r.state_bytes,
                skipped: r.skipped,
                meta: r.meta,
                sizes: r.sizes,
                digests: r.digests,
                packed: r.packed,
            },
            grade: if r.globals { Grade::FilesAndGlobals } else { Grade::Files },
            saved: r.saved,
            lost: r.lost.into_iter().map(|(name, why)| Lost { name, why }).collect(),
            took: Duration::from_millis(r.took_ms),
            // How long the saving's parts took is not kept across a restart.
            state_took: Duration::ZERO,
            copy_took: Duration::ZERO,
        }
    }
}

/// A hibernated session.
#[derive(Debug, Serialize, Deserialize)]
struct Sleeper {
    #[serde(flatten)]
    about: About,
    /// Unix ms of its last use: its TTL runs from there.
    last_used_ms: u64,
    saved: SavedRecord,
    /// The allow-list in force when it slept, if it had egress (header values and the CA are
    /// never kept: they come from the adopting server).
    #[serde(default)]
    egress: Option<Vec<String>>,
}

/// A snapshot of the catalogue.
#[derive(Debug, Serialize, Deserialize)]
struct Snap {
    instance: String,
    principal: String,
    name: String,
    session: String,
    saved: SavedRecord,
}

fn unix_ms(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()).unwrap_or(u64::MAX)
}

/// `<state dir>/<dir>/<volume>.json`; volume names are ours, anything else reaches no path.
fn path_of(state_dir: &Path, dir: &str, volume: &str) -> Option<PathBuf> {
    let plain = !volume.is_empty()
        && volume.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !volume.starts_with('.');
    plain.then(|| state_dir.join(dir).join(format!("{volume}.json")))
}

fn write<T: Serialize>(state_dir: &Path, dir: &str, volume: &str, record: &T) {
    let Some(path) = path_of(state_dir, dir, volume) else { return };
    let written = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir.join(dir))
        .and_then(|()| serde_json::to_vec(record).map_err(std::io::Error::other))
        .and_then(|bytes| crate::state_dir::replace(&path, &bytes));
    if let Err(e) = written {
        tracing::warn!(error = %e, path = %path.display(), "cannot write a record: a restarted server will not find it");
    }
}

fn read<T: for<'de> Deserialize<'de>>(
    state_dir: &Path,
    dir: &str,
    volume_of: impl Fn(&T) -> &str,
) -> Vec<(PathBuf, T)> {
    let Ok(entries) = std::fs::read_dir(state_dir.join(dir)) else { return Vec::new() };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        match crate::state_dir::read(&path, MAX_RECORD)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<T>(&b).map_err(|e| e.to_string()))
        {
            Ok(r) if path_of(state_dir, dir, volume_of(&r)).as_deref() == Some(path.as_path()) => out.push((path, r)),
            Ok(_) => tracing::warn!(path = %path.display(), "a record under another name; skipped"),
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "unreadable record; skipped"),
        }
    }
    out
}

/// What [`Registry::adopt_sleepers`] kept from the sweep of the adopted instances.
#[derive(Debug, Default)]
pub(super) struct Kept {
    pub(super) containers: HashSet<String>,
    pub(super) volumes: HashSet<String>,
}

/// Instances named by sleeper and snapshot records: candidates for adoption.
pub(super) fn recorded_instances(state_dir: &Path) -> HashSet<String> {
    let mut names: HashSet<String> =
        read::<Sleeper>(state_dir, SLEEPERS, |r| &r.saved.volume).into_iter().map(|(_, r)| r.about.instance).collect();
    names.extend(read::<Snap>(state_dir, SNAPSHOTS, |r| &r.saved.volume).into_iter().map(|(_, r)| r.instance));
    names
}

impl Session {
    /// Records this hibernated session (called right after it hibernated).
    fn save_sleeper(&self, state_dir: &Path) {
        let Ok(inner) = self.inner.try_lock() else { return };
        let Some(saved) = inner.sleeping.as_ref() else { return };
        let created = inner.container.clone();
        let idle = self.idle();
        let record = Sleeper {
            about: self.about(created),
            last_used_ms: unix_ms(SystemTime::now().checked_sub(idle).unwrap_or(UNIX_EPOCH)),
            saved: SavedRecord::from(saved),
            egress: self.blueprint.egress.as_ref().map(|a| a.allow()),
        };
        write(state_dir, SLEEPERS, &saved.store.volume, &record);
    }
}

/// Whether a snapshot's volume and helper container are both still there.
async fn store_exists(docker: &bollard::Docker, saved: &SavedRecord) -> bool {
    docker.inspect_volume(&saved.volume).await.is_ok() && docker.inspect_container(&saved.helper, None).await.is_ok()
}

impl Registry {
    /// After a session hibernated: its record, for a next server.
    pub(super) fn record_sleeper(&self, session: &Session) {
        if session.durable_jobs() {
            session.save_sleeper(&self.cfg.state_dir());
        }
    }

    /// At a stop that leaves the sessions: the catalogue's snapshots, for the next server.
    pub(super) fn record_snapshots(&self) {
        for e in self.snapshots.drain() {
            self.write_snapshot(&e.principal, &e.name, &e.session, &e.saved);
        }
    }

    /// A snapshot recorded as it is made, so that a server killed with -9 leaves it to the
    /// next one as a clean stop does (only where a next server may take sessions over).
    pub(crate) fn record_snapshot(&self, principal: &str, name: &str, session: &str, saved: &Saved) {
        if self.cfg.keep_sessions && self.cfg.adopt_grace_s != 0 {
            self.write_snapshot(principal, name, session, saved);
        }
    }

    /// A snapshot deleted or pruned: its record goes with it.
    pub(crate) fn forget_snapshot(&self, saved: &Saved) {
        if let Some(path) = path_of(&self.cfg.state_dir(), SNAPSHOTS, &saved.store.volume) {
            let _ = std::fs::remove_file(path);
        }
    }

    fn write_snapshot(&self, principal: &str, name: &str, session: &str, saved: &Saved) {
        // The instance its volume is labelled with (`pyberth-<instance>-snap-<id>`): one
        // carried over from an adopted instance stays that instance's.
        let instance = saved
            .store
            .volume
            .strip_prefix("pyberth-")
            .and_then(|v| v.rsplit_once("-snap-"))
            .map_or_else(|| self.instance.owner.instance.clone(), |(i, _)| i.to_owned());
        let record = Snap {
            instance,
            principal: principal.to_owned(),
            name: name.to_owned(),
            session: session.to_owned(),
            saved: SavedRecord::from(saved),
        };
        write(&self.cfg.state_dir(), SNAPSHOTS, &saved.store.volume, &record);
    }

    /// Registers the hibernated sessions and snapshots of the adopted instances `names`;
    /// returns what of theirs the sweep of those instances must keep, and how many sessions.
    pub(super) async fn adopt_sleepers(&self, names: &[String], host: &str) -> (Kept, usize) {
        let state_dir = self.cfg.state_dir();
        let mut kept = Kept::default();
        let mut sessions = 0;
        for (path, record) in read::<Sleeper>(&state_dir, SLEEPERS, |r| &r.saved.volume) {
            if !names.contains(&record.about.instance) {
                continue;
            }
            let key = (record.about.principal.clone(), record.about.name.clone());
            // Woken or closed since (its snapshot is gone), or awake under a container record.
            if !store_exists(&self.docker, &record.saved).await || self.slots().contains_key(&key) {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let Ok(env) = self.environments.get(Some(&record.about.environment)) else {
                tracing::warn!(session = %record.about.name, "no such environment now; hibernated session not adopted");
                let _ = std::fs::remove_file(&path);
                continue;
            };
            kept.containers.insert(record.saved.helper.clone());
            kept.volumes.insert(record.saved.volume.clone());
            let owner = container::Owner { instance: record.about.instance.clone(), host: host.to_owned() };
            let name = record.about.name.clone();
            // Its network went with the server that made it: it wakes on a new one of this
            // server's, with the list it had (never wider than its environment's now).
            let mut egress = None;
            let mut pending = Vec::new();
            if let Some(allow) = record.egress.clone() {
                let attached = match crate::egress::policy::narrow(&env.egress, &allow) {
                    Ok(rules) => {
                        let headers = env.egress_headers.0.clone();
                        self.egress.attach(&record.about.principal, &name, &record.about.image, rules, headers).await
                    }
                    Err(e) => Err(e),
                };
                match attached {
                    Ok(att) => egress = Some(Arc::new(att)),
                    Err(e) => {
                        tracing::warn!(session = %name, error = %e, "a hibernated session's egress could not be restored");
                        pending.push(format!(
                            "this session's network access was lost when the server restarted ({e}): it reaches \
                             nothing; close it and start a new one to get it back"
                        ));
                    }
                }
            }
            let idle = Duration::from_millis(unix_ms(SystemTime::now()).saturating_sub(record.last_used_ms));
            let how = Revived { pid: None, sleeping: Some(Saved::from(record.saved)), pending, idle };
            let session = Session::revive(self.docker.clone(), self.blueprint(&env, egress), owner, record.about, how);
            let slot: super::Slot = Arc::default();
            let _ = slot.set(session);
            self.slots().insert(key, slot);
            sessions += 1;
            tracing::info!(session = %name, "hibernated session adopted from a stopped server");
        }
        for (path, record) in read::<Snap>(&state_dir, SNAPSHOTS, |r| &r.saved.volume) {
            if !names.contains(&record.instance) {
                continue;
            }
            if !store_exists(&self.docker, &record.saved).await {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            kept.containers.insert(record.saved.helper.clone());
            kept.volumes.insert(record.saved.volume.clone());
            if let Some(old) =
                self.snapshots.insert(&record.principal, &record.name, &record.session, record.saved.into())
            {
                // Two records of one name (two stops in a row): one is kept.
                self.forget_snapshot(&old.saved);
                crate::docker::snapshot::remove(&self.docker, &old.saved.store).await;
            }
        }
        (kept, sessions)
    }
}
