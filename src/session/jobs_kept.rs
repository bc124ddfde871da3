//! Finished jobs kept across restarts (issue 26): a job's result is written into its record
//! when it ends, and a next server shows it again under its id for the rest of its hour.
//! Bounded like the in-memory table (`KEEP_FINISHED`, `MAX_FINISHED` per principal): a record
//! goes when its job is pruned, when the server stops with nothing left for a next one, or
//! when the server leaves and the job's session is gone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Finished, Job, KEEP_FINISHED};
use crate::durable::jobs::{Done, Left, now_ms};
use crate::durable::ledger::Ledger;
use crate::output::Capture;
use crate::protocol::PyError;
use crate::session::{RunOutcome, RunStatus};

/// Bytes kept of each text of a result in its record (a result's repr, a traceback, a
/// notice, a failure): a record stays far below what is read back.
const TEXT: usize = 8 << 10;
/// Notices kept in a record.
const NOTICES: usize = 16;

/// `text` cut to `TEXT` bytes, on a character boundary.
fn cut(text: &str) -> String {
    if text.len() <= TEXT {
        return text.to_owned();
    }
    let mut end = TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… (cut: kept across a restart)", &text[..end])
}

/// What a record keeps of how a job ended.
pub(super) fn done_of(result: &Finished) -> Done {
    let mut done = Done {
        finished_ms: now_ms(),
        failed: None,
        status: RunStatus::Error,
        result: None,
        error: None,
        exit_code: None,
        duration_ms: 0,
        cpu_ms: None,
        state_lost: false,
        notices: Vec::new(),
        peak_memory_kb: None,
        images: 0,
        dropped: (0, 0),
    };
    match result {
        Finished::Failed(why) => done.failed = Some(cut(why)),
        Finished::Outcome(o) => {
            done.status = o.status;
            done.result = o.result.as_deref().map(cut);
            done.error = o.error.as_ref().map(|e| PyError {
                kind: cut(&e.kind),
                message: cut(&e.message),
                traceback: cut(&e.traceback),
            });
            done.exit_code = o.exit_code;
            done.duration_ms = u64::try_from(o.duration.as_millis()).unwrap_or(u64::MAX);
            done.cpu_ms = o.cpu_ms;
            done.state_lost = o.state_lost;
            done.notices = o.notices.iter().take(NOTICES).map(|n| cut(n)).collect();
            done.peak_memory_kb = o.peak_memory_kb;
            done.images = o.images.len();
            done.dropped = (o.stdout.dropped(), o.stderr.dropped());
        }
    }
    done
}

/// The result a record kept, with the job's output.
fn finished_of(done: Done, cap: usize, stdout: &[u8], stderr: &[u8]) -> Finished {
    if let Some(why) = done.failed {
        return Finished::Failed(why);
    }
    let capture = |bytes: &[u8]| {
        let mut c = Capture::new(cap);
        c.push(bytes);
        c
    };
    let mut o = RunOutcome::new(cap);
    o.status = done.status;
    o.stdout = capture(stdout);
    o.stderr = capture(stderr);
    o.result = done.result;
    o.error = done.error;
    o.exit_code = done.exit_code;
    o.duration = Duration::from_millis(done.duration_ms);
    o.cpu_ms = done.cpu_ms;
    o.state_lost = done.state_lost;
    o.notices = done.notices;
    o.peak_memory_kb = done.peak_memory_kb;
    if done.images > 0 {
        o.notices.push(format!("its {} images are not kept across a server restart", done.images));
    }
    let (out, err) = done.dropped;
    if out + err > 0 {
        o.notices.push(format!("{out} bytes of stdout and {err} of stderr past the output cap were not kept"));
    }
    Finished::Outcome(Box::new(o))
}

/// A finished job an earlier server left: shown again, finished, under its id, its record
/// kept with it. `None` (its files removed) once past its hour.
pub(super) fn restore(ledger: &Ledger, left: Left) -> Option<Arc<Job>> {
    let r = left.record;
    let done = r.done.clone()?;
    let age = done.age();
    if age >= KEEP_FINISHED {
        ledger.forget_job(&r.instance, &r.id);
        return None;
    }
    let files = ledger
        .job(r.clone(), false)
        .map_err(|e| tracing::warn!(job = %r.id, error = %e, "cannot reopen a finished job's record"))
        .ok();
    let started = Instant::now().checked_sub(r.age()).unwrap_or_else(Instant::now);
    let job = Job::new(r.id.clone(), &r.principal, &r.session, started, r.cap, files);
    if let Ok(mut out) = job.output.lock() {
        out.stdout.clone_from(&left.stdout);
        out.stderr.clone_from(&left.stderr);
    }
    let at = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
    if let Ok(mut f) = job.finished.lock() {
        *f = Some((at, Arc::new(finished_of(done, r.cap, &left.stdout, &left.stderr))));
    }
    job.done.send_replace(true);
    Some(Arc::new(job))
}

/// Bytes of output the records of one principal's finished jobs keep in the state dir.
const KEPT_OUTPUT_BYTES: usize = 32 << 20;

/// One principal's jobs, newest finished first: the records of finished jobs past
/// [`KEPT_OUTPUT_BYTES`] of output go (their results stay in memory for this server's hour,
/// and are not known after a restart). Running jobs' files are the take-over's, never cut.
pub(super) fn bound_records(newest_first: &[&Job]) {
    let mut kept = 0;
    for j in newest_first.iter().filter(|j| j.is_finished()) {
        let Some(files) = &j.durable else { continue };
        kept += j.output.lock().map(|o| o.stdout.len() + o.stderr.len()).unwrap_or_default();
        if kept > KEPT_OUTPUT_BYTES {
            files.remove();
        }
    }
}

impl Job {
    /// How long ago it finished, once it has (a task's last update, `server/tasks.rs`).
    pub fn finished_ago(&self) -> Option<Duration> {
        self.finished.lock().ok().and_then(|f| f.as_ref().map(|(t, _)| t.elapsed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_result_comes_back_bounded() {
        let mut o = RunOutcome::new(16);
        o.status = RunStatus::Ok;
        o.result = Some("x".repeat(100_000));
        o.notices = (0..100).map(|i| format!("n{i}")).collect();
        o.stdout.push(&[b'a'; 40]);
        let done = done_of(&Finished::Outcome(Box::new(o)));
        let bytes = serde_json::to_vec(&done).expect("json");
        assert!(bytes.len() < 16 << 10, "bounded: {}", bytes.len());
        assert_eq!((done.notices.len(), done.dropped), (NOTICES, (24, 0)));
        let back: Done = serde_json::from_slice(&bytes).expect("back");
        let Finished::Outcome(o) = finished_of(back, 16, &[b'a'; 16], b"") else { panic!("an outcome") };
        assert_eq!(o.status, RunStatus::Ok);
        assert!(o.result.is_some_and(|r| r.ends_with("(cut: kept across a restart)")));
        assert!(o.notices.iter().any(|n| n.contains("24 bytes of stdout")), "{:?}", o.notices);
        let failed = done_of(&Finished::Failed("gone".into()));
        assert!(matches!(finished_of(failed, 16, b"", b""), Finished::Failed(w) if w == "gone"));
    }

    /// Finished jobs' records are bounded in bytes per principal, newest kept: 40 jobs of
    /// 1 MiB output each leave 32 records; another principal's is untouched.
    #[test]
    fn finished_jobs_records_are_bounded_in_bytes_per_principal() {
        let dir = std::env::temp_dir().join(format!("pyberth-jobs-kept-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let jobs = super::super::Jobs::default();
        let job = |id: &str, principal: &str| {
            let record =
                crate::durable::jobs::Record::new(id, "inst-a", principal, "s", "c", Duration::from_secs(60), 1 << 20);
            let files = crate::durable::jobs::Files::open(&dir, record, true).expect("files");
            let job = Arc::new(Job::new(id.to_owned(), principal, "s", Instant::now(), 1 << 20, Some(files)));
            job.observe(crate::protocol::Stream::Stdout, &vec![b'x'; 1 << 20]);
            job.finish(Finished::Failed("x".into()));
            job
        };
        {
            let mut map = jobs.jobs.lock().expect("jobs");
            map.insert("job-1000".into(), job("job-1000", "alice"));
            for i in 0..40 {
                let id = format!("job-{i}");
                map.insert(id.clone(), job(&id, "mallory"));
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        jobs.prune();
        let left = |p: &str| {
            crate::durable::jobs::read_left(&dir, "inst-a").iter().filter(|l| l.record.principal == p).count()
        };
        assert_eq!((left("mallory"), left("alice")), (32, 1));
        let kept: Vec<bool> = (0..40).map(|i| dir.join(format!("jobs/inst-a/job-{i}.json")).exists()).collect();
        assert!(kept[8..].iter().all(|k| *k) && !kept[..8].iter().any(|k| *k), "the newest are kept: {kept:?}");
        assert_eq!(jobs.list("mallory").len(), 40, "in memory all stay, for this server");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
