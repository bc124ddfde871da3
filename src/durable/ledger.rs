//! The ledger: the one writer of the records in the state dir (issue 25, item 2).
//!
//! A session's record follows its state: [`Ledger::session`] is given the state the session is
//! in now (running in a container, hibernated into a snapshot volume, or gone) and the record
//! it had, writes the one and removes the other. Sessions call it from their state changes
//! (`session/recorded.rs`), the snapshot catalogue from its inserts and removals, jobs through
//! [`Ledger::job`], layer use through [`Ledger::layer_used`] and [`Ledger::layers_in_use`]:
//! nothing above has a record to remember to save. Records are written only where a next server
//! may take sessions over (`--keep-sessions` with a grace); removals happen always.
//!
//! Files (names are ours; anything else never reaches a path), each written through
//! [`crate::state_dir::replace`], never through a symlink:
//! - `sessions/<container>.json`: a running session ([`Running`]);
//! - `sleepers/<snapshot volume>.json`: a hibernated one ([`Sleeper`]);
//! - `snapshots/<volume>.json`: a snapshot of the catalogue ([`Snap`]);
//! - `jobs/<instance>/<job>.{json,out,err}`: a background run (`durable/jobs.rs`);
//! - `layers-used.json`, `layers-in-use-<instance>.json`: layer use (`durable/layer_use.rs`).

use std::collections::HashSet;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::jobs;
use super::layer_use;
use super::records::{Running, Sleeper, Snap};

const SESSIONS: &str = "sessions";
const SLEEPERS: &str = "sleepers";
const SNAPSHOTS: &str = "snapshots";
/// Largest record read back (a snapshot's file sizes and digests are listed in it).
const MAX_RECORD: u64 = 64 << 20;

/// The record a session has in the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Key {
    /// `sessions/<container>.json`.
    Running(String),
    /// `sleepers/<snapshot volume>.json`.
    Sleeping(String),
}

/// The state of a session, as its record keeps it.
#[derive(Debug)]
pub(crate) enum SessionRecord {
    /// Running in a container.
    Running(Box<Running>),
    /// Hibernated: its snapshot is its whole state.
    Sleeping(Box<Sleeper>),
    /// Closed, expired: nothing to keep.
    Gone,
}

impl SessionRecord {
    fn key(&self) -> Option<Key> {
        match self {
            SessionRecord::Running(r) => Some(Key::Running(r.about.container.clone())),
            SessionRecord::Sleeping(s) => Some(Key::Sleeping(s.saved.volume.clone())),
            SessionRecord::Gone => None,
        }
    }
}

/// The records of one state dir.
#[derive(Debug, Clone)]
pub(crate) struct Ledger {
    dir: PathBuf,
    /// Whether records are written: only a server that leaves its sessions for the next one
    /// (`--keep-sessions` and a non-zero `--adopt-grace-s`) keeps them.
    keeps: bool,
}

impl Ledger {
    /// The ledger of `dir`; `keeps`: whether a next server may take sessions over.
    pub(crate) fn new(dir: PathBuf, keeps: bool) -> Self {
        Self { dir, keeps }
    }

    /// The ledger a server of these settings keeps.
    pub(crate) fn of(cfg: &crate::config::SandboxConfig) -> Self {
        Self::new(cfg.state_dir(), cfg.keep_sessions && cfg.adopt_grace_s != 0)
    }

    /// Whether records are written (a next server may take sessions over).
    pub(crate) fn keeps(&self) -> bool {
        self.keeps
    }

    /// A session's state changed to `now`: its record is written and the one it had, `was`,
    /// removed when that was another; `was` becomes the record it has now. A ledger that does
    /// not keep records writes none, and removes one (an adopted session's) only once it no
    /// longer describes the session.
    pub(crate) fn session(&self, was: &mut Option<Key>, now: &SessionRecord) {
        let key = now.key();
        if self.keeps {
            match now {
                SessionRecord::Running(r) => self.write(SESSIONS, &r.about.container, r),
                SessionRecord::Sleeping(s) => self.write(SLEEPERS, &s.saved.volume, s),
                SessionRecord::Gone => {}
            }
        }
        match was.take() {
            Some(old) if Some(&old) != key.as_ref() => self.forget(&old),
            // The same record: written again just above, or left as it is.
            same => *was = same,
        }
        if self.keeps {
            *was = key;
        }
    }

    /// Removes a session's record (one found stale at adoption).
    pub(crate) fn forget(&self, key: &Key) {
        let (dir, name) = match key {
            Key::Running(container) => (SESSIONS, container),
            Key::Sleeping(volume) => (SLEEPERS, volume),
        };
        self.remove(dir, name);
    }

    /// A snapshot was added to the catalogue.
    pub(crate) fn snapshot_kept(&self, snap: &Snap) {
        if self.keeps {
            self.write(SNAPSHOTS, &snap.saved.volume, snap);
        }
    }

    /// A snapshot left the catalogue (deleted, pruned, replaced, or its server stopped
    /// for good).
    pub(crate) fn snapshot_gone(&self, volume: &str) {
        self.remove(SNAPSHOTS, volume);
    }

    /// The running sessions recorded.
    pub(crate) fn running(&self) -> Vec<Running> {
        self.read(SESSIONS, |r: &Running| &r.about.container)
    }

    /// The hibernated sessions recorded.
    pub(crate) fn sleepers(&self) -> Vec<Sleeper> {
        self.read(SLEEPERS, |r: &Sleeper| &r.saved.volume)
    }

    /// The snapshots recorded.
    pub(crate) fn snapshots(&self) -> Vec<Snap> {
        self.read(SNAPSHOTS, |r: &Snap| &r.saved.volume)
    }

    /// Instances named by any session, sleeper or snapshot record: candidates for adoption.
    pub(crate) fn recorded_instances(&self) -> HashSet<String> {
        let mut names: HashSet<String> = self.running().into_iter().map(|r| r.about.instance).collect();
        names.extend(self.sleepers().into_iter().map(|r| r.about.instance));
        names.extend(self.snapshots().into_iter().map(|r| r.instance));
        names.extend(jobs::instances(&self.dir));
        names
    }

    /// The files of a background run: created (`fresh`) or reopened (one taken over).
    pub(crate) fn job(&self, record: jobs::Record, fresh: bool) -> std::io::Result<jobs::Files> {
        jobs::Files::open(&self.dir, record, fresh)
    }

    /// The runs an earlier server of `instance` left.
    pub(crate) fn jobs_left(&self, instance: &str) -> Vec<jobs::Left> {
        jobs::read_left(&self.dir, instance)
    }

    /// Removes a run's files, one left by an earlier server that cannot be followed.
    pub(crate) fn forget_job(&self, instance: &str, id: &str) {
        jobs::forget(&self.dir, instance, id);
    }

    /// A layer was used now (its place in the store's LRU order).
    pub(crate) fn layer_used(&self, key: &str) {
        layer_use::touch(&self.dir, key);
    }

    /// The layers the sessions of `instance` hold now, read by every prune on this host.
    pub(crate) fn layers_in_use(&self, instance: &str, keys: &[String]) {
        layer_use::record_in_use(&self.dir, instance, keys);
    }

    fn write<T: Serialize>(&self, dir: &str, name: &str, record: &T) {
        let Some(path) = path_of(&self.dir, dir, name) else { return };
        let written = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(self.dir.join(dir))
            .and_then(|()| serde_json::to_vec(record).map_err(std::io::Error::other))
            .and_then(|bytes| crate::state_dir::replace(&path, &bytes));
        if let Err(e) = written {
            tracing::warn!(error = %e, path = %path.display(), "cannot write a record: a restarted server will not find it");
        }
    }

    fn remove(&self, dir: &str, name: &str) {
        if let Some(path) = path_of(&self.dir, dir, name) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Every readable record of `dir` filed under its own name; the rest are skipped (and
    /// said).
    fn read<T: for<'de> Deserialize<'de>>(&self, dir: &str, name_of: impl Fn(&T) -> &str) -> Vec<T> {
        let Ok(entries) = std::fs::read_dir(self.dir.join(dir)) else { return Vec::new() };
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
                Ok(r) if path_of(&self.dir, dir, name_of(&r)).as_deref() == Some(path.as_path()) => out.push(r),
                Ok(_) => tracing::warn!(path = %path.display(), "a record under another name; skipped"),
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "unreadable record; skipped"),
            }
        }
        out
    }
}

/// `<state dir>/<dir>/<name>.json`: container and volume names are ours
/// (`pyberth-<instance>-…`), anything else never reaches a path.
fn path_of(state_dir: &Path, dir: &str, name: &str) -> Option<PathBuf> {
    let plain = !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    plain.then(|| state_dir.join(dir).join(format!("{name}.json")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::records::{About, SavedRecord};

    fn about(container: &str) -> About {
        About {
            instance: "i1".into(),
            principal: "alice".into(),
            name: "h".into(),
            environment: "default".into(),
            image: "img".into(),
            container: container.into(),
            volume: "vol".into(),
            uid: 1000,
            layers: Vec::new(),
            packages: Vec::new(),
            env: Default::default(),
            python: "3.12".into(),
        }
    }

    fn saved(volume: &str) -> SavedRecord {
        SavedRecord {
            volume: volume.into(),
            environment: "default".into(),
            requirements: Vec::new(),
            env: Default::default(),
            files: 0,
            workspace_bytes: 0,
            state_bytes: 0,
            skipped: 0,
            meta: None,
            sizes: Default::default(),
            digests: Default::default(),
            packed: false,
            globals: true,
            saved: Vec::new(),
            lost: Vec::new(),
            took_ms: 0,
        }
    }

    fn ledger(tag: &str, keeps: bool) -> (Ledger, PathBuf) {
        let dir = std::env::temp_dir().join(format!("pyberth-ledger-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        (Ledger::new(dir.clone(), keeps), dir)
    }

    /// Running, hibernated, woken in a new container, closed: at each step the ledger holds
    /// exactly the record of the state the session is in.
    #[test]
    fn a_session_has_exactly_the_record_of_its_state() {
        let (ledger, dir) = ledger("states", true);
        let mut was = None;
        let running = |c: &str| SessionRecord::Running(Box::new(Running { about: about(c), pid: 7, egress: None }));
        ledger.session(&mut was, &running("pyberth-i1-h-1"));
        assert_eq!(ledger.running().len(), 1);
        let asleep = Sleeper { about: about("pyberth-i1-h-1"), last_used_ms: 1, saved: saved("snap-1"), egress: None };
        ledger.session(&mut was, &SessionRecord::Sleeping(Box::new(asleep)));
        assert!(ledger.running().is_empty(), "its running record went as it slept");
        assert_eq!(ledger.sleepers().len(), 1);
        ledger.session(&mut was, &running("pyberth-i1-h-2"));
        assert!(ledger.sleepers().is_empty(), "its sleeper record went as it woke");
        let now: Vec<String> = ledger.running().into_iter().map(|r| r.about.container).collect();
        assert_eq!(now, ["pyberth-i1-h-2"], "the woken session is recorded with its new container");
        assert_eq!(ledger.recorded_instances(), HashSet::from(["i1".to_owned()]));
        ledger.session(&mut was, &SessionRecord::Gone);
        assert!(ledger.running().is_empty() && was.is_none(), "closed: nothing kept");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A server that leaves nothing for a next one writes nothing; names that are not ours
    /// never reach a path.
    #[test]
    fn nothing_is_written_unless_kept_and_foreign_names_reach_no_path() {
        let (ledger, dir) = ledger("off", false);
        let mut was = None;
        let r = Running { about: about("pyberth-i1-h-1"), pid: 7, egress: None };
        ledger.session(&mut was, &SessionRecord::Running(Box::new(r)));
        assert!(!dir.exists() && was.is_none(), "not kept: no file");
        // An adopted session's record (written by the server before) stays while it holds,
        // and goes when the session does.
        std::fs::create_dir_all(dir.join(SESSIONS)).expect("dir");
        let planted = dir.join(SESSIONS).join("pyberth-i1-h-1.json");
        std::fs::write(&planted, b"{}").expect("plant");
        let mut was = Some(Key::Running("pyberth-i1-h-1".into()));
        let r = Running { about: about("pyberth-i1-h-1"), pid: 8, egress: None };
        ledger.session(&mut was, &SessionRecord::Running(Box::new(r)));
        assert!(planted.exists() && was.is_some(), "still its record");
        ledger.session(&mut was, &SessionRecord::Gone);
        assert!(!planted.exists() && was.is_none(), "closed: its record went");
        let ledger = Ledger::new(dir.clone(), true);
        let r = Running { about: about("../escape"), pid: 7, egress: None };
        ledger.session(&mut None, &SessionRecord::Running(Box::new(r)));
        assert!(ledger.running().is_empty() && !dir.join("escape.json").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A record of the previous version's layout (as `sessions/<container>.json` held it)
    /// reads back.
    #[test]
    fn records_of_the_previous_version_read_back() {
        let (ledger, dir) = ledger("compat", true);
        std::fs::create_dir_all(dir.join(SESSIONS)).expect("dir");
        let old = r#"{"instance":"i1","principal":"alice","name":"h","environment":"default","image":"img",
            "container":"pyberth-i1-h-1","volume":"vol","uid":1000,"packages":[],"env":{},"python":"3.12","pid":9}"#;
        std::fs::write(dir.join(SESSIONS).join("pyberth-i1-h-1.json"), old).expect("write");
        let read = ledger.running();
        assert_eq!(read.len(), 1);
        assert_eq!((read[0].pid, read[0].about.name.as_str()), (9, "h"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
