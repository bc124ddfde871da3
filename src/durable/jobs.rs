//! Jobs that outlive their server (docs/design.md D12).
//!
//! A job of a session the server would leave for the next one is recorded in the state dir
//! (`<state dir>/jobs/<instance>/<job>.json`: whose, which session and container, the run's
//! request id, its start and time limit), with its output so far appended beside it
//! (`<job>.out`, `<job>.err`, each at most the output cap). A server that adopts the session
//! finds the record, shows the job again under the same id with that output, and follows the
//! run to its end: the agent went on under its keeper meanwhile, which held what it printed
//! (bounded; past the bound the agent waits). A finished job's record takes its result and
//! stays for the job's hour (`session/jobs_kept.rs`), so a next server still answers for it.
//!
//! Records are kept by the session's owning instance: several servers share a state dir and
//! each counts its job ids from 1, so only the folder tells their `job-1`s apart, and a server
//! reads only the folders of the instances it claimed.

use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::protocol::Stream;

/// Folder of the records, in the state dir.
const DIR: &str = "jobs";
/// Largest record read back.
const MAX_RECORD: u64 = 64 << 10;

/// What a server needs to follow a job it did not start.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Record {
    pub(crate) id: String,
    /// The instance owning the job's session: the folder its files are in.
    pub(crate) instance: String,
    pub(crate) principal: String,
    pub(crate) session: String,
    pub(crate) container: String,
    /// The run's request id (0 until it is sent).
    pub(crate) run: u64,
    /// Unix ms.
    pub(crate) started_ms: u64,
    /// Unix ms past which the run is stopped.
    pub(crate) deadline_ms: u64,
    pub(crate) cap: usize,
    /// How it ended, once it has: the record is then kept for the job's hour, so a next
    /// server still answers for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) done: Option<Done>,
}

/// A finished job's result, as a record keeps it (its output is in `<job>.out`, `.err`).
/// Every text is bounded where it is made (`session/jobs_kept.rs`) so a record stays well
/// under [`MAX_RECORD`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Done {
    /// Unix ms.
    pub(crate) finished_ms: u64,
    /// Why the run could not complete, when it could not.
    pub(crate) failed: Option<String>,
    pub(crate) status: crate::output::RunStatus,
    pub(crate) result: Option<String>,
    pub(crate) error: Option<crate::protocol::PyError>,
    pub(crate) exit_code: Option<i64>,
    pub(crate) duration_ms: u64,
    pub(crate) cpu_ms: Option<f64>,
    pub(crate) state_lost: bool,
    pub(crate) notices: Vec<String>,
    pub(crate) peak_memory_kb: Option<u64>,
    /// Images are not kept past the server that saw them; their count is.
    pub(crate) images: usize,
    /// Output bytes past the cap, per stream.
    pub(crate) dropped: (u64, u64),
}

impl Done {
    /// How long ago it finished.
    pub(crate) fn age(&self) -> Duration {
        Duration::from_millis(unix_ms(SystemTime::now()).saturating_sub(self.finished_ms))
    }
}

/// Now, in unix ms.
pub(crate) fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

fn unix_ms(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()).unwrap_or(u64::MAX)
}

impl Record {
    pub(crate) fn new(
        id: &str,
        instance: &str,
        principal: &str,
        session: &str,
        container: &str,
        timeout: Duration,
        cap: usize,
    ) -> Self {
        let now = SystemTime::now();
        Self {
            id: id.to_owned(),
            instance: instance.to_owned(),
            principal: principal.to_owned(),
            session: session.to_owned(),
            container: container.to_owned(),
            run: 0,
            started_ms: unix_ms(now),
            deadline_ms: unix_ms(now + timeout),
            cap,
            done: None,
        }
    }

    /// How long ago it started.
    pub(crate) fn age(&self) -> Duration {
        Duration::from_millis(unix_ms(SystemTime::now()).saturating_sub(self.started_ms))
    }

    /// What is left of its time limit.
    pub(crate) fn left(&self) -> Duration {
        Duration::from_millis(self.deadline_ms.saturating_sub(unix_ms(SystemTime::now())))
    }

    /// The number in its id (`job-N`), when it has that form.
    pub(crate) fn number(&self) -> Option<u64> {
        self.id.strip_prefix("job-")?.parse().ok()
    }
}

/// Job ids are ours (`job-<n>`); anything else never reaches a path.
fn plain(id: &str) -> bool {
    id.strip_prefix("job-").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Instance names are ours (`[A-Za-z0-9-]`, as `crate::instance` checks them).
fn plain_instance(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

/// The folder of `instance`'s records, when its name may reach a path.
fn folder(state_dir: &Path, instance: &str) -> Option<PathBuf> {
    plain_instance(instance).then(|| state_dir.join(DIR).join(instance))
}

/// Opens an output file to append to: a new job's must not exist yet (another's is never
/// truncated nor shared), one taken over must.
fn open_append(path: &Path, fresh: bool) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .create_new(fresh)
        .append(true)
        .mode(0o600)
        .custom_flags(crate::state_dir::no_follow())
        .open(path)
}

/// A running job's files in the state dir.
#[derive(Debug)]
pub(crate) struct Files {
    json: PathBuf,
    record: Mutex<Record>,
    /// stdout, stderr: appended as output arrives.
    out: Mutex<(File, File)>,
    /// Set by [`Files::remove`] (under the record's lock): no save writes the record again.
    removed: std::sync::atomic::AtomicBool,
}

impl Files {
    /// Creates the files of a new job (empty output) or opens those of one taken over.
    pub(crate) fn open(state_dir: &Path, record: Record, fresh: bool) -> std::io::Result<Self> {
        if !plain(&record.id) {
            return Err(std::io::Error::other("not a job id"));
        }
        let dir = folder(state_dir, &record.instance).ok_or_else(|| std::io::Error::other("not an instance name"))?;
        let json = dir.join(format!("{}.json", record.id));
        if fresh && json.symlink_metadata().is_ok() {
            return Err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, "a record of that job id is there"));
        }
        // The output files are the claim on the id: created exclusively, so a collision fails
        // here before the record is written. The folder goes when its last job ends, maybe
        // just now: made again then.
        let mut tries = 0;
        let out = loop {
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
            match open_append(&json.with_extension("out"), fresh) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && fresh && tries < 3 => tries += 1,
                r => break r?,
            }
        };
        let err = match open_append(&json.with_extension("err"), fresh) {
            Ok(f) => f,
            Err(e) => {
                if fresh {
                    let _ = std::fs::remove_file(json.with_extension("out"));
                }
                return Err(e);
            }
        };
        let removed = std::sync::atomic::AtomicBool::new(false);
        let files = Self { json, record: Mutex::new(record), out: Mutex::new((out, err)), removed };
        files.save()?;
        Ok(files)
    }

    fn save(&self) -> std::io::Result<()> {
        // Written under the record's lock, which a removal takes too: a job that ends after
        // its session closed never writes its record back.
        let Ok(r) = self.record.lock() else { return Ok(()) };
        if self.removed.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        let bytes = serde_json::to_vec(&*r).map_err(std::io::Error::other)?;
        crate::state_dir::replace(&self.json, &bytes)
    }

    /// The run's request id and the container it is sent to, known just before it is sent.
    /// The container is the session's at that moment: a run that woke its session (or
    /// replaced its container) runs in another one than the session had when the job began.
    pub(crate) fn set_run(&self, run: u64, container: &str) {
        if let Ok(mut r) = self.record.lock() {
            r.run = run;
            container.clone_into(&mut r.container);
        }
        if let Err(e) = self.save() {
            tracing::warn!(error = %e, "cannot record a job's run: a restarted server will not find it");
        }
    }

    /// The job ended: its result is written into its record, kept with its output until the
    /// job is dropped (its hour, or a count past the per-principal bound).
    pub(crate) fn finish(&self, done: Done) {
        if let Ok(mut r) = self.record.lock() {
            r.done = Some(done);
        }
        if let Err(e) = self.save() {
            tracing::warn!(error = %e, "cannot record a job's result: a restarted server will not know it");
        }
    }

    /// Appends output the job kept (already cut to its cap).
    pub(crate) fn append(&self, stream: Stream, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if let Ok(mut files) = self.out.lock() {
            let f = match stream {
                Stream::Stdout => &mut files.0,
                Stream::Stderr => &mut files.1,
            };
            let _ = f.write_all(bytes);
        }
    }

    /// Removes the files: the job is dropped (or its session closed and no server follows).
    pub(crate) fn remove(&self) {
        let _record = self.record.lock();
        self.removed.store(true, std::sync::atomic::Ordering::SeqCst);
        remove(&self.json);
    }
}

fn remove(json: &Path) {
    for ext in ["json", "out", "err"] {
        let _ = std::fs::remove_file(json.with_extension(ext));
    }
    // The instance's folder, once empty (fails while another job's files are there).
    if let Some(dir) = json.parent() {
        let _ = std::fs::remove_dir(dir);
    }
}

/// A job left by an earlier server: its record and its output so far.
pub(crate) struct Left {
    pub(crate) record: Record,
    pub(crate) stdout: Vec<u8>,
    pub(crate) stderr: Vec<u8>,
}

/// Every job an earlier server of `instance` left. Unreadable records are removed.
pub(crate) fn read_left(state_dir: &Path, instance: &str) -> Vec<Left> {
    let Some(dir) = folder(state_dir, instance) else { return Vec::new() };
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut left = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let record = crate::state_dir::read(&path, MAX_RECORD)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<Record>(&b).map_err(|e| e.to_string()));
        match record {
            Ok(r) if plain(&r.id) && r.instance == instance && path.file_stem().is_some_and(|s| s == r.id.as_str()) => {
                let cap = r.cap as u64;
                let stdout = crate::state_dir::read(&path.with_extension("out"), cap).unwrap_or_default();
                let stderr = crate::state_dir::read(&path.with_extension("err"), cap).unwrap_or_default();
                left.push(Left { record: r, stdout, stderr });
            }
            Ok(_) => {
                tracing::warn!(path = %path.display(), "a job record under another name; removed");
                remove(&path);
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "unreadable job record; removed");
                remove(&path);
            }
        }
    }
    left
}

/// The instances that have job files here: candidates for a next server's adoption. A
/// closed or expired session's jobs lose their files with it (`Jobs::forget_session`): an
/// instance that owns nothing on the engine any more is never claimed, and files of its
/// would stay for good.
pub(crate) fn instances(state_dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(state_dir.join(DIR)) else { return Vec::new() };
    entries.flatten().filter_map(|e| e.file_name().to_str().map(str::to_owned)).filter(|n| plain_instance(n)).collect()
}

/// Removes the files of a job left by an earlier server that cannot be followed.
pub(crate) fn forget(state_dir: &Path, instance: &str, id: &str) {
    if let Some(dir) = folder(state_dir, instance).filter(|_| plain(id)) {
        remove(&dir.join(format!("{id}.json")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_s_record_and_output_come_back_and_go_when_it_ends() {
        let dir = std::env::temp_dir().join(format!("pyberth-jobs-durable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let record = Record::new("job-7", "inst-a", "alice", "s", "c", Duration::from_secs(60), 1024);
        let files = Files::open(&dir, record, true).expect("files");
        files.set_run(42, "c2");
        files.append(Stream::Stdout, b"one ");
        files.append(Stream::Stdout, b"two");
        files.append(Stream::Stderr, b"oops");
        let left = read_left(&dir, "inst-a");
        assert_eq!(left.len(), 1);
        assert_eq!((left[0].record.run, left[0].record.number()), (42, Some(7)));
        assert_eq!(left[0].record.container, "c2", "the container the run went to");
        assert_eq!((left[0].stdout.as_slice(), left[0].stderr.as_slice()), (&b"one two"[..], &b"oops"[..]));
        assert!(left[0].record.left() > Duration::from_secs(50));
        files.remove();
        assert!(read_left(&dir, "inst-a").is_empty());
        assert!(
            Files::open(&dir, Record::new("../x", "inst-a", "a", "s", "c", Duration::ZERO, 1), true).is_err(),
            "no path"
        );
        assert!(
            Files::open(&dir, Record::new("job-1", "../x", "a", "s", "c", Duration::ZERO, 1), true).is_err(),
            "no path"
        );
        assert!(read_left(&dir, "..").is_empty() && read_left(&dir, "").is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Two servers of one state dir both count from `job-1`: neither touches the other's.
    #[test]
    fn two_instances_jobs_of_one_id_are_kept_apart() {
        let dir = std::env::temp_dir().join(format!("pyberth-jobs-durable-two-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let record = |instance: &str, principal: &str| {
            Record::new("job-1", instance, principal, "s", "c", Duration::from_secs(60), 1024)
        };
        let a = Files::open(&dir, record("inst-a", "alice"), true).expect("a");
        a.append(Stream::Stdout, b"from a");
        let b = Files::open(&dir, record("inst-b", "bob"), true).expect("b");
        b.append(Stream::Stdout, b"from b");
        a.append(Stream::Stdout, b", more");
        let only = |instance: &str| {
            let left = read_left(&dir, instance);
            assert_eq!(left.len(), 1, "{instance}");
            (left[0].record.principal.clone(), left[0].record.instance.clone(), left[0].stdout.clone())
        };
        assert_eq!(only("inst-a"), ("alice".into(), "inst-a".into(), b"from a, more".to_vec()));
        assert_eq!(only("inst-b"), ("bob".into(), "inst-b".into(), b"from b".to_vec()));
        // A second fresh job-1 of one instance fails rather than clobbers.
        let again = Files::open(&dir, record("inst-a", "mallory"), true);
        assert_eq!(again.map(|_| ()).map_err(|e| e.kind()), Err(std::io::ErrorKind::AlreadyExists));
        assert_eq!(only("inst-a"), ("alice".into(), "inst-a".into(), b"from a, more".to_vec()));
        // A record planted in one folder naming another instance is not that folder's.
        let planted = dir.join(DIR).join("inst-a").join("job-9.json");
        let mut bob = record("inst-b", "bob");
        bob.id = "job-9".into();
        std::fs::write(&planted, serde_json::to_vec(&bob).expect("json")).expect("plant");
        assert_eq!(only("inst-a").0, "alice");
        assert!(!planted.exists(), "removed as not the folder's");
        // One instance's end removes its files only.
        a.remove();
        assert!(read_left(&dir, "inst-a").is_empty());
        assert_eq!(only("inst-b"), ("bob".into(), "inst-b".into(), b"from b".to_vec()));
        forget(&dir, "inst-a", "job-1");
        assert_eq!(only("inst-b").2, b"from b".to_vec());
        b.remove();
        assert_eq!(std::fs::read_dir(dir.join(DIR)).map(Iterator::count).ok(), Some(0), "no empty folders left");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
