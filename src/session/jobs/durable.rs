//! Jobs that outlive their server (docs/design.md D12).
//!
//! A job of a session the server would leave for the next one is recorded in the state dir
//! (`<state dir>/jobs/<job>.json`: whose, which session and container, the run's request id,
//! its start and time limit), with its output so far appended beside it (`<job>.out`,
//! `<job>.err`, each at most the output cap). A server that adopts the session finds the
//! record, shows the job again under the same id with that output, and follows the run to
//! its end: the agent went on under its keeper meanwhile, which held what it printed
//! (bounded; past the bound the agent waits). A finished job's files go with it.

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
}

fn unix_ms(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()).unwrap_or(u64::MAX)
}

impl Record {
    pub(crate) fn new(
        id: &str,
        principal: &str,
        session: &str,
        container: &str,
        timeout: Duration,
        cap: usize,
    ) -> Self {
        let now = SystemTime::now();
        Self {
            id: id.to_owned(),
            principal: principal.to_owned(),
            session: session.to_owned(),
            container: container.to_owned(),
            run: 0,
            started_ms: unix_ms(now),
            deadline_ms: unix_ms(now + timeout),
            cap,
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

fn open_append(path: &Path, truncate: bool) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(!truncate)
        .write(true)
        .truncate(truncate)
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
}

impl Files {
    /// Creates the files of a new job (empty output) or opens those of one taken over.
    pub(crate) fn open(state_dir: &Path, record: Record, fresh: bool) -> std::io::Result<Self> {
        if !plain(&record.id) {
            return Err(std::io::Error::other("not a job id"));
        }
        let dir = state_dir.join(DIR);
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
        let json = dir.join(format!("{}.json", record.id));
        let out = open_append(&json.with_extension("out"), fresh)?;
        let err = open_append(&json.with_extension("err"), fresh)?;
        let files = Self { json, record: Mutex::new(record), out: Mutex::new((out, err)) };
        files.save()?;
        Ok(files)
    }

    fn save(&self) -> std::io::Result<()> {
        let bytes = match self.record.lock() {
            Ok(r) => serde_json::to_vec(&*r).map_err(std::io::Error::other)?,
            Err(_) => return Ok(()),
        };
        crate::state_dir::replace(&self.json, &bytes)
    }

    /// The run's request id, known just before it is sent.
    pub(crate) fn set_run(&self, run: u64) {
        if let Ok(mut r) = self.record.lock() {
            r.run = run;
        }
        if let Err(e) = self.save() {
            tracing::warn!(error = %e, "cannot record a job's run: a restarted server will not find it");
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

    /// Removes the files: the job ended under this server.
    pub(crate) fn remove(&self) {
        remove(&self.json);
    }
}

fn remove(json: &Path) {
    for ext in ["json", "out", "err"] {
        let _ = std::fs::remove_file(json.with_extension(ext));
    }
}

/// A job left by an earlier server: its record and its output so far.
pub(crate) struct Left {
    pub(crate) record: Record,
    pub(crate) stdout: Vec<u8>,
    pub(crate) stderr: Vec<u8>,
}

/// Every job an earlier server of this state dir left. Unreadable records are removed.
pub(crate) fn read_left(state_dir: &Path) -> Vec<Left> {
    let Ok(entries) = std::fs::read_dir(state_dir.join(DIR)) else { return Vec::new() };
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
            Ok(r) if plain(&r.id) && path.file_stem().is_some_and(|s| s == r.id.as_str()) => {
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

/// Removes the files of a job left by an earlier server that cannot be followed.
pub(crate) fn forget(state_dir: &Path, id: &str) {
    if plain(id) {
        remove(&state_dir.join(DIR).join(format!("{id}.json")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_s_record_and_output_come_back_and_go_when_it_ends() {
        let dir = std::env::temp_dir().join(format!("pyberth-jobs-durable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let record = Record::new("job-7", "alice", "s", "c", Duration::from_secs(60), 1024);
        let files = Files::open(&dir, record, true).expect("files");
        files.set_run(42);
        files.append(Stream::Stdout, b"one ");
        files.append(Stream::Stdout, b"two");
        files.append(Stream::Stderr, b"oops");
        let left = read_left(&dir);
        assert_eq!(left.len(), 1);
        assert_eq!((left[0].record.run, left[0].record.number()), (42, Some(7)));
        assert_eq!((left[0].stdout.as_slice(), left[0].stderr.as_slice()), (&b"one two"[..], &b"oops"[..]));
        assert!(left[0].record.left() > Duration::from_secs(50));
        files.remove();
        assert!(read_left(&dir).is_empty());
        assert!(Files::open(&dir, Record::new("../x", "a", "s", "c", Duration::ZERO, 1), true).is_err(), "no path");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
