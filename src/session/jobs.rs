//! Background jobs: runs that outlive the call that started them.
//!
//! A job is owned by the [`Jobs`] table, not by the request: it keeps running when its client
//! disconnects, and any later call of the same principal can read its output by offsets,
//! wait for it or cancel it. Finished jobs are kept for a while, then pruned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{RunOutcome, RunSpec, RunStatus, Session};
use crate::protocol::Stream;

use crate::durable::jobs as durable;
use crate::durable::ledger::Ledger;

#[path = "jobs_kept.rs"]
mod kept;
#[path = "jobs_leave.rs"]
mod leaving;

/// Finished jobs kept at most this long.
pub(crate) const KEEP_FINISHED: Duration = Duration::from_secs(3600);
/// Finished jobs kept at most this many per principal.
const MAX_FINISHED: usize = 200;
/// Bytes of images (base64) kept in finished jobs per principal. Each run's images are
/// already bounded as they arrive (`extras.rs`); across 200 kept jobs they would still add
/// up, so older jobs lose theirs first.
const KEPT_IMAGE_BYTES: usize = 32 << 20;

/// Output so far, kept up to the cap per stream.
#[derive(Debug, Default)]
struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// How a finished job ended.
#[derive(Debug)]
pub enum Finished {
    /// The run completed (in any status).
    Outcome(Box<RunOutcome>),
    /// The run could not complete (the session broke or was closed).
    Failed(String),
}

/// Computes a run's egress totals once it has ended (a lazy future: it does nothing until
/// the job's run is over).
pub(crate) type EgressTally =
    std::pin::Pin<Box<dyn std::future::Future<Output = Option<crate::egress::Totals>> + Send>>;

/// One job.
pub struct Job {
    /// Job id.
    pub id: String,
    /// Owner.
    pub principal: String,
    /// Session it runs in.
    pub session: String,
    /// Cancels the run (interrupt, then kill).
    pub cancel: CancellationToken,
    started: Instant,
    cap: usize,
    output: Mutex<Output>,
    finished: Mutex<Option<(Instant, Arc<Finished>)>>,
    /// The run's egress, once finished (sessions with egress only).
    egress: Mutex<Option<crate::egress::Totals>>,
    done: watch::Sender<bool>,
    /// Its files in the state dir, when a restarted server may follow it (`durable.rs`).
    durable: Option<durable::Files>,
}

impl Job {
    /// Whether it has finished.
    pub fn is_finished(&self) -> bool {
        *self.done.borrow()
    }

    /// How it ended, once it has.
    pub fn result(&self) -> Option<Arc<Finished>> {
        self.finished.lock().ok().and_then(|f| f.as_ref().map(|(_, r)| r.clone()))
    }

    /// The run's egress totals, once it has finished in a session with egress.
    pub fn egress(&self) -> Option<crate::egress::Totals> {
        self.egress.lock().ok().and_then(|e| e.clone())
    }

    /// Status for listings.
    pub fn status(&self) -> RunStatus {
        match self.result().as_deref() {
            None => RunStatus::Running,
            Some(Finished::Outcome(o)) => o.status,
            Some(Finished::Failed(_)) => RunStatus::Error,
        }
    }

    /// Seconds since start.
    pub fn age(&self) -> Duration {
        self.started.elapsed()
    }

    /// Waits up to `limit` for the job to finish; true if it has.
    pub async fn wait(&self, limit: Duration) -> bool {
        let mut rx = self.done.subscribe();
        let finished = tokio::time::timeout(limit, rx.wait_for(|d| *d)).await;
        matches!(finished, Ok(Ok(_)))
    }

    /// Output after the given byte offsets of each stream, and the new offsets.
    pub fn output_since(&self, stdout_offset: usize, stderr_offset: usize) -> (Vec<u8>, Vec<u8>, usize, usize) {
        let Ok(out) = self.output.lock() else { return (Vec::new(), Vec::new(), stdout_offset, stderr_offset) };
        let slice = |v: &Vec<u8>, off: usize| v.get(off.min(v.len())..).unwrap_or_default().to_vec();
        (slice(&out.stdout, stdout_offset), slice(&out.stderr, stderr_offset), out.stdout.len(), out.stderr.len())
    }

    fn observe(&self, stream: Stream, bytes: &[u8]) {
        if let Ok(mut out) = self.output.lock() {
            let buf = match stream {
                Stream::Stdout => &mut out.stdout,
                Stream::Stderr => &mut out.stderr,
            };
            let room = self.cap.saturating_sub(buf.len());
            let kept = &bytes[..room.min(bytes.len())];
            buf.extend_from_slice(kept);
            if let Some(files) = &self.durable {
                files.append(stream, kept);
            }
        }
    }

    /// Drops the images of a finished job's result unless they fit in `room` bytes, saying so
    /// in its notices. Returns the bytes of images it keeps.
    fn drop_images_past(&self, room: usize) -> usize {
        let Ok(mut finished) = self.finished.lock() else { return 0 };
        let Some((_, result)) = finished.as_mut() else { return 0 };
        let Finished::Outcome(outcome) = result.as_ref() else { return 0 };
        let bytes: usize = outcome.images.iter().map(|(_, b)| b.len()).sum();
        if bytes <= room {
            return bytes;
        }
        let mut lighter = outcome.as_ref().clone();
        lighter.notices.push(format!(
            "its {} images were dropped from the kept result: the server keeps at most {} MiB of images of \
             finished jobs per caller, newest first",
            lighter.images.len(),
            KEPT_IMAGE_BYTES >> 20
        ));
        lighter.images = Vec::new();
        *result = Arc::new(Finished::Outcome(Box::new(lighter)));
        0
    }

    fn new(
        id: String,
        principal: &str,
        session: &str,
        started: Instant,
        cap: usize,
        durable: Option<durable::Files>,
    ) -> Self {
        let (done, _) = watch::channel(false);
        Self {
            id,
            principal: principal.to_owned(),
            session: session.to_owned(),
            cancel: CancellationToken::new(),
            started,
            cap,
            output: Mutex::new(Output::default()),
            finished: Mutex::new(None),
            egress: Mutex::new(None),
            done,
            durable,
        }
    }

    fn finish(&self, result: Finished) {
        // Kept for the job's hour, across restarts too (`jobs_kept.rs`).
        if let Some(files) = &self.durable {
            files.finish(kept::done_of(&result));
        }
        if let Ok(mut f) = self.finished.lock() {
            *f = Some((Instant::now(), Arc::new(result)));
        }
        // `send` stores nothing while no one waits: the flag must hold for later readers too.
        self.done.send_replace(true);
    }
}

/// The jobs of a server.
pub struct Jobs {
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    tasks: TaskTracker,
    next: AtomicU64,
    /// Stops following the jobs that a next server takes over, without stopping their runs.
    leave: CancellationToken,
}

impl Default for Jobs {
    fn default() -> Self {
        Self {
            jobs: Mutex::new(HashMap::new()),
            tasks: TaskTracker::new(),
            next: AtomicU64::new(1),
            leave: CancellationToken::new(),
        }
    }
}

impl Jobs {
    /// Starts a run as a job.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &self,
        principal: &str,
        session: Arc<Session>,
        spec: RunSpec,
        timeout: Duration,
        cap: usize,
        slot: impl Send + 'static,
        egress: Option<EgressTally>,
    ) -> Arc<Job> {
        self.prune();
        let id = format!("job-{}", self.next.fetch_add(1, Ordering::Relaxed));
        let durable = session.ledger.keeps().then(|| {
            let container = session.container.lock().map(|c| c.id.clone()).unwrap_or_default();
            let instance = &session.owner.instance;
            let record = durable::Record::new(&id, instance, principal, &session.name, &container, timeout, cap);
            session
                .ledger
                .job(record, true)
                .map_err(|e| tracing::warn!(error = %e, "cannot record a job: a restarted server will not find it"))
                .ok()
        });
        let job = Arc::new(Job::new(id, principal, &session.name, Instant::now(), cap, durable.flatten()));
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.insert(job.id.clone(), job.clone());
        }
        let task_job = job.clone();
        let leave = self.leave.clone();
        self.tasks.spawn(async move {
            let job = task_job;
            let observer = |s: Stream, b: &[u8]| job.observe(s, b);
            // Called once the session is awake: its container now is the one the run goes to.
            let on_id = |id: u64| {
                if let Some(files) = &job.durable {
                    files.set_run(id, &session.container_id());
                }
            };
            let detach = job.durable.is_some().then_some(&leave);
            let run = session.run_with(spec, timeout, &job.cancel, detach, &observer, &on_id);
            let result = tokio::select! {
                r = run => r,
                // The server stops and leaves the session (and this run) to the next one,
                // which follows the job from its record: its stream is first read to its end
                // (`jobs_leave.rs`), within a bound.
                () = leaving::given_up(&leave), if detach.is_some() => return,
            };
            if matches!(result, Err(super::Error::Left)) {
                return;
            }
            drop(slot); // the caller's run slot is free before anyone can see the job ended
            let egress = match egress {
                Some(tally) => tally.await,
                None => None,
            };
            let result = result.map(|mut outcome| {
                if let Some(e) = &egress {
                    outcome.notices.extend(e.denied.iter().map(|d| format!("egress denied: {d}")));
                }
                outcome
            });
            if let Ok(mut slot) = job.egress.lock() {
                *slot = egress;
            }
            job.finish(match result {
                Ok(outcome) => Finished::Outcome(Box::new(outcome)),
                Err(e) => Finished::Failed(e.to_string()),
            });
        });
        job
    }

    /// At start, after adopting sessions: the jobs the earlier servers of `instances` (those
    /// this server claimed) left; other instances' records are not read. Those of an adopted
    /// session are shown again under their ids and followed to their end; those whose
    /// container is gone end, saying so; the rest are not ours.
    pub(crate) async fn take_over(
        &self,
        docker: &dyn crate::docker::Engine,
        ledger: &Ledger,
        instances: &[String],
        adopted: &dyn Fn(&str, &str) -> Option<Arc<Session>>,
    ) -> usize {
        let mut taken = 0;
        for left in instances.iter().flat_map(|i| ledger.jobs_left(i)) {
            let r = &left.record;
            if r.done.is_some() {
                self.show_finished(ledger, left);
                continue;
            }
            // Two claimed instances may each have left a `job-1`: the first keeps the id, the
            // other's record is left as it is (its run goes on unread) rather than clobbered.
            if self.jobs.lock().is_ok_and(|j| j.contains_key(&r.id)) {
                tracing::warn!(job = %r.id, instance = %r.instance, "another taken-over job has this id; not followed");
                continue;
            }
            let session =
                adopted(&r.principal, &r.session).filter(|s| s.container.lock().is_ok_and(|c| c.id == r.container));
            let gone = session.is_none()
                && docker
                    .inspect_container(&r.container, None)
                    .await
                    .is_err_and(|e| crate::docker::Error::from(e).is_gone());
            if session.is_none() && !gone {
                continue;
            }
            if let Some(n) = r.number() {
                self.next.fetch_max(n + 1, Ordering::Relaxed);
            }
            let started = Instant::now().checked_sub(r.age()).unwrap_or_else(Instant::now);
            let files = match &session {
                Some(_) => ledger
                    .job(r.clone(), false)
                    .map_err(|e| tracing::warn!(job = %r.id, error = %e, "cannot reopen a job's record"))
                    .ok(),
                None => None,
            };
            let job = Arc::new(Job::new(r.id.clone(), &r.principal, &r.session, started, r.cap, files));
            if let Ok(mut out) = job.output.lock() {
                out.stdout = left.stdout;
                out.stderr = left.stderr;
            }
            if let Ok(mut jobs) = self.jobs.lock() {
                jobs.insert(job.id.clone(), job.clone());
            }
            let found = session.is_some();
            let Some(session) = session.filter(|_| r.run != 0) else {
                ledger.forget_job(&r.instance, &r.id);
                // Said precisely: a run never sent never ran (its id is recorded just before
                // it is sent), so the caller knows to start it again.
                let why = if found {
                    "the server stopped before the job's run was sent to the interpreter (its session was still being \
                     woken or given a container): its code did not run; start it again"
                } else {
                    "the server restarted, and the job's session could not be taken over: its container is gone"
                };
                job.finish(Finished::Failed(why.into()));
                continue;
            };
            taken += 1;
            self.follow(job, session, r.run, r.left());
        }
        self.prune();
        taken
    }

    /// A job an earlier server finished: shown again, unless another has its id.
    fn show_finished(&self, ledger: &Ledger, left: durable::Left) {
        if self.jobs.lock().is_ok_and(|j| j.contains_key(&left.record.id)) {
            return;
        }
        let n = left.record.number();
        if let (Some(job), Ok(mut jobs)) = (kept::restore(ledger, left), self.jobs.lock()) {
            self.next.fetch_max(n.map_or(0, |n| n + 1), Ordering::Relaxed);
            jobs.insert(job.id.clone(), job);
        }
    }

    /// Follows the run `id` of an adopted session to its end, for `job`.
    fn follow(&self, job: Arc<Job>, session: Arc<Session>, id: u64, timeout: Duration) {
        tracing::info!(job = %job.id, session = %session.name, "following a job an earlier server started");
        let leave = self.leave.clone();
        self.tasks.spawn(async move {
            let observer = |s: Stream, b: &[u8]| job.observe(s, b);
            let detach = job.durable.is_some().then_some(&leave);
            let result = tokio::select! {
                r = session.resume(id, timeout, &job.cancel, detach, &observer) => r,
                () = leaving::given_up(&leave), if detach.is_some() => return,
            };
            if matches!(result, Err(super::Error::Left)) {
                return;
            }
            job.finish(match result {
                Ok(outcome) => Finished::Outcome(Box::new(outcome)),
                Err(e) => Finished::Failed(e.to_string()),
            });
        });
    }

    /// A job of this principal; another principal's job behaves as a missing one.
    pub fn get(&self, principal: &str, id: &str) -> Option<Arc<Job>> {
        let jobs = self.jobs.lock().ok()?;
        jobs.get(id).filter(|j| j.principal == principal).cloned()
    }

    /// Jobs of this principal, oldest first.
    pub fn list(&self, principal: &str) -> Vec<Arc<Job>> {
        let Ok(jobs) = self.jobs.lock() else { return Vec::new() };
        let mut list: Vec<Arc<Job>> = jobs.values().filter(|j| j.principal == principal).cloned().collect();
        // By the start itself: an elapsed time changes while the sort runs (an inconsistent order
        // panics in std's sort).
        list.sort_by_key(|j| j.started);
        list
    }

    /// Drops finished jobs past their keep time or beyond the count.
    fn prune(&self) {
        let Ok(mut jobs) = self.jobs.lock() else { return };
        let finished_at = |j: &Job| j.finished.lock().ok().and_then(|f| f.as_ref().map(|(t, _)| *t));
        jobs.retain(|_, j| {
            let keep = finished_at(j).is_none_or(|t| t.elapsed() < KEEP_FINISHED);
            if let Some(files) = j.durable.as_ref().filter(|_| !keep) {
                files.remove();
            }
            keep
        });
        // Counted per principal: one caller's many jobs never evict another's results.
        let mut done: HashMap<&str, Vec<(Instant, String)>> = HashMap::new();
        for (id, j) in jobs.iter() {
            if let Some(t) = finished_at(j) {
                done.entry(j.principal.as_str()).or_default().push((t, id.clone()));
            }
        }
        let evict: Vec<String> = done
            .into_values()
            .filter(|d| d.len() > MAX_FINISHED)
            .flat_map(|mut d| {
                d.sort();
                let extra = d.len() - MAX_FINISHED;
                d.into_iter().take(extra).map(|(_, id)| id)
            })
            .collect();
        for id in evict {
            if let Some(files) = jobs.remove(&id).as_ref().and_then(|j| j.durable.as_ref()) {
                files.remove();
            }
        }
        let mut by_principal: HashMap<&str, Vec<&Job>> = HashMap::new();
        for j in jobs.values() {
            by_principal.entry(j.principal.as_str()).or_default().push(j);
        }
        for mut list in by_principal.into_values() {
            list.sort_by_key(|j| std::cmp::Reverse(finished_at(j)));
            let mut kept = 0;
            for j in &list {
                kept += j.drop_images_past(KEPT_IMAGE_BYTES.saturating_sub(kept));
            }
            kept::bound_records(&list);
        }
    }
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("id", &self.id).field("session", &self.session).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Jobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jobs").finish_non_exhaustive()
    }
}

#[cfg(test)]
#[path = "jobs_tests.rs"]
mod tests;
