//! One run: send it, read its events until it ends, stop it when its time is up or its
//! caller gives up, and tell the caller what happened to the interpreter.
//!
//! Why this file passes 500 lines: one run from send to outcome, read top to bottom (drive,
//! stop, recover); the watchdog and the extras it collects already live apart.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::agent::{Agent, ReadError, Taken};
use super::extras::Extras;
use super::{Error, INTERRUPTED_NOTICE, Inner, STUCK_NOTICE, Session};
use crate::docker::{container, exec};
use crate::output::Capture;
use crate::protocol::{self, DoneStatus, Event, PyError, Request};

pub(crate) use crate::output::RunStatus;

/// Sees each chunk of output as it arrives, for live streaming.
pub(super) type Observer<'a> = dyn Fn(protocol::Stream, &[u8]) + Send + Sync + 'a;

/// The outcome of one run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// How it ended.
    pub status: RunStatus,
    /// Captured stdout.
    pub stdout: Capture,
    /// Captured stderr.
    pub stderr: Capture,
    /// repr of a final expression's value.
    pub result: Option<String>,
    /// The exception.
    pub error: Option<PyError>,
    /// Status passed to `sys.exit`.
    pub exit_code: Option<i64>,
    /// Wall time seen by the server.
    pub duration: Duration,
    /// CPU time of the run (user + system, children included), when the agent lived to say.
    pub cpu_ms: Option<f64>,
    /// True when the interpreter state from before the run is gone.
    pub state_lost: bool,
    /// What the caller should know beyond the status.
    pub notices: Vec<String>,
    /// Images the run produced: (MIME type, base64 bytes).
    pub images: Vec<(String, String)>,
    /// Peak resident memory during the run, KiB.
    pub peak_memory_kb: Option<u64>,
    /// What the run's limits on images and notices kept and dropped (`extras.rs`).
    pub(crate) extras: Extras,
    /// Its code-mode tool calls, made and refused.
    pub tool_calls: crate::bridge::CallCounts,
}

/// What to run: owned, so that one type serves a call and a job that outlives it.
#[derive(Debug, Clone, Default)]
pub struct RunSpec {
    /// Python source for the persistent interpreter.
    pub code: String,
    /// A workspace script to run in a fresh interpreter process instead.
    pub file: Option<String>,
    /// Its arguments.
    pub args: Vec<String>,
    /// Or a command (argv) run in the workspace, as the code's user.
    pub cmd: Vec<String>,
    /// Environment for this run, on top of the session's.
    pub env: BTreeMap<String, String>,
    /// The upstream tools its code may call (code mode); `None`: none.
    pub bridge: Option<std::sync::Arc<crate::bridge::Grant>>,
    /// Called once the run holds its session and its agent is up, before the code goes.
    pub on_start: Option<OnStart>,
}

/// What counts from a run's start (its egress byte budget, its egress totals): called by the
/// run once it holds its session, never by a call that waits behind another run or is refused
/// as busy, which would otherwise give the run under way a fresh budget.
#[derive(Clone)]
pub struct OnStart(pub std::sync::Arc<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>);

impl std::fmt::Debug for OnStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnStart")
    }
}

impl RunSpec {
    /// What kind of run it is and the sha256 of what it runs (the code, the script and its
    /// arguments, or the command): the audit log's record of it, never the text itself.
    fn audit_hash(&self) -> (&'static str, String) {
        let sha = crate::audit::sha256_hex;
        if let Some(file) = &self.file {
            let mut all = vec![file.as_str()];
            all.extend(self.args.iter().map(String::as_str));
            ("file", sha(all.join("\0").as_bytes()))
        } else if !self.cmd.is_empty() {
            ("cmd", sha(self.cmd.join("\0").as_bytes()))
        } else {
            ("code", sha(self.code.as_bytes()))
        }
    }
}

/// Most times one run reattaches after its stream dropped.
const MAX_REATTACH: usize = 3;

/// Runs waiting for a busy session beyond the one running; more get a busy error.
const MAX_QUEUED: usize = 4;

struct WaitGuard<'a>(&'a AtomicUsize);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What ends a run early: its time limit and its caller's cancellation, and how long the
/// code then has to stop after the interrupt before it is killed.
#[derive(Clone, Copy)]
pub(super) struct Stop<'a> {
    pub(super) timeout: Duration,
    pub(super) grace: Duration,
    pub(super) ct: &'a CancellationToken,
    /// The sandbox whose death ends the run, when the engine can tell (`None` in tests
    /// without Docker).
    pub(super) sandbox: Option<&'a Sandbox>,
    /// Cancelled when the server leaves the run to its next server: the stream is closed in
    /// order and read to its end, and the run ends as [`Ending::Left`].
    pub(super) detach: Option<&'a CancellationToken>,
}

/// What a run gathers across the streams it is read from: its outcome, and its code-mode
/// calls. One [`RunCalls`](crate::bridge::RunCalls) for the whole run, so a reattach keeps
/// its budget (code that kills its own relay does not get a new one) and its calls in flight
/// (answered on the new stream).
pub(super) struct Gathered<'g> {
    pub(super) outcome: RunOutcome,
    calls: crate::bridge::RunCalls<'g>,
    /// The latest replies sent, sent again on each new stream: the old relay may have lost them.
    sent: crate::bridge::Recent,
}

impl<'g> Gathered<'g> {
    /// A run's, its code under `grant` (`None`: no upstream tools).
    pub(super) fn new(outcome: RunOutcome, grant: Option<&'g crate::bridge::Grant>) -> Self {
        Self { outcome, calls: crate::bridge::RunCalls::new(grant), sent: crate::bridge::Recent::default() }
    }

    /// The run's outcome with its calls' counts; its calls still in flight are dropped, which
    /// cancels them upstream.
    pub(super) fn finish(self) -> RunOutcome {
        let Gathered { mut outcome, calls, .. } = self;
        outcome.tool_calls = calls.counts();
        outcome
    }
}

/// How long a run goes before the engine is asked to tell of the sandbox's death. Short runs
/// never pay for the subscription; the subscription replays from the run's start, so a death
/// before it is not missed.
const WATCH_AFTER: Duration = Duration::from_millis(500);

/// A session's container, watched during a run: under gVisor, a sandbox killed whole (the
/// memory limit, a removal) can leave the exec stream open, and without the engine's word
/// the run would wait out its time limit.
pub(super) struct Sandbox {
    pub(super) docker: crate::docker::EngineRef,
    pub(super) id: String,
    pub(super) since: std::time::SystemTime,
}

impl Sandbox {
    /// Resolves when the engine reports the container died or was removed; never when the
    /// engine cannot be asked (the time limit still ends the run).
    async fn died(&self) {
        use futures::StreamExt;
        let since = self.since.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let since = since.saturating_sub(1).to_string();
        let filters = std::collections::HashMap::from([
            ("container", vec![self.id.as_str()]),
            ("type", vec!["container"]),
            ("event", vec!["die", "destroy"]),
        ]);
        let opts = bollard::query_parameters::EventsOptionsBuilder::default().since(&since).filters(&filters).build();
        let mut events = self.docker.events(Some(opts));
        match events.next().await {
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                tracing::debug!(error = %e, "cannot watch the sandbox during the run");
                std::future::pending::<()>().await;
            }
            None => std::future::pending::<()>().await,
        }
    }
}

/// How [`drive`] ended.
#[derive(Debug)]
pub(super) enum Ending {
    /// The agent answered with Done.
    Done,
    /// The agent's stream ended; with the reason we were stopping it, if we were.
    Died(Option<RunStatus>),
    /// The code ignored the interrupt; with the reason for stopping it.
    Killed(RunStatus),
    /// The stream failed.
    Broken(String),
    /// The agent's main loop never took the run: code of the previous run still holds the
    /// interpreter and ignored an interrupt.
    Stuck,
    /// A run followed after a restart had ended, but its `done` was lost with the old stream.
    Vanished,
    /// The server left the run to its next server, and its stream ended in order.
    Left,
}

/// A child process of the run was killed for memory; the interpreter lives on.
fn child_oom_notice(memory_mb: u64) -> String {
    format!(
        "out of memory: the program needed more than the session's {memory_mb} MiB and was killed; \
         the session's interpreter and variables are unaffected"
    )
}

/// What the interpreter's death during the run was, with exit code `code` if Docker knows it.
fn died_notice(code: Option<i64>, oom: bool, memory_mb: u64) -> String {
    match code {
        Some(137) if oom => {
            format!(
                "out of memory: the code needed more than the session's {memory_mb} MiB, and the interpreter was killed"
            )
        }
        Some(137) => format!(
            "the interpreter was killed (SIGKILL); running out of memory is the usual cause (limit {memory_mb} MiB)"
        ),
        Some(c) => format!("the interpreter exited with status {c} during the run"),
        None => "the interpreter stopped during the run".into(),
    }
}

/// Why the code was killed: it did not stop after an interrupt sent for `status`.
fn killed_notice(status: RunStatus) -> String {
    let why = if status == RunStatus::Cancelled { "the call was cancelled" } else { "the time limit passed" };
    format!("{why} and the code did not stop after an interrupt, so its processes were killed")
}

const BROKEN_NOTICE: &str = "the connection to the interpreter broke";

/// One notice: what happened, then what it cost, as recovery found it. `after` is recovery's
/// own word when it did more than start an interpreter (a replaced container loses the
/// workspace too; no interpreter at all), so the two never contradict each other.
fn lost(what: String, after: Option<String>) -> String {
    match after {
        None => format!("{what}; a new interpreter was started: variables are gone, workspace files are kept"),
        Some(after) => format!("{what}; {after}"),
    }
}

/// Called with a run's request id before it is sent (jobs record it, to find the run again
/// after a restart).
pub(super) type OnId<'a> = dyn Fn(u64) + Send + Sync + 'a;

impl Session {
    /// Runs code in the persistent interpreter.
    pub async fn run(
        &self,
        spec: RunSpec,
        timeout: Duration,
        ct: &CancellationToken,
        observer: &Observer<'_>,
    ) -> Result<RunOutcome, Error> {
        self.run_with(spec, timeout, ct, None, observer, &|_| {}).await
    }

    /// [`Session::run`], telling `on_id` the run's request id before it is sent. Audited
    /// (its start and end, with a hash of what it ran) and charged to its principal's quotas.
    /// Once `detach` is cancelled the run is left to the next server: [`Error::Left`].
    pub(super) async fn run_with(
        &self,
        spec: RunSpec,
        timeout: Duration,
        ct: &CancellationToken,
        detach: Option<&CancellationToken>,
        observer: &Observer<'_>,
        on_id: &OnId<'_>,
    ) -> Result<RunOutcome, Error> {
        let watch = &self.blueprint.oversight;
        let (kind, sha) = spec.audit_hash();
        let event = |name| {
            crate::audit::Event::new(name, &self.principal)
                .session(&self.name)
                .field("kind", kind)
                .field("code_sha256", sha.clone())
        };
        watch.audit.emit(event("run_started"));
        let started = Instant::now();
        let result = self.run_body(spec, timeout, ct, detach, observer, on_id).await;
        if matches!(result, Err(Error::Left)) {
            // Not ended: the next server follows it, and audits its end.
            return result;
        }
        let wall = started.elapsed();
        let outcome = match &result {
            Ok(o) => o.status.to_string(),
            Err(_) => "error".to_owned(),
        };
        self.run_ended(event("run_ended"), outcome, wall);
        result
    }

    /// A run's end (`event`, with what the run was) into the audit log, and its wall time
    /// charged to the principal's quotas.
    fn run_ended(&self, event: crate::audit::Event, outcome: String, wall: Duration) {
        let watch = &self.blueprint.oversight;
        let ms = u64::try_from(wall.as_millis()).unwrap_or(u64::MAX);
        watch.audit.emit(event.outcome(outcome).field("duration_ms", ms));
        if let Some(q) = &watch.quotas {
            q.ran(&self.principal, &self.container_id(), wall);
        }
    }

    async fn run_body(
        &self,
        spec: RunSpec,
        timeout: Duration,
        ct: &CancellationToken,
        detach: Option<&CancellationToken>,
        observer: &Observer<'_>,
        on_id: &OnId<'_>,
    ) -> Result<RunOutcome, Error> {
        let waiting = self.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = WaitGuard(&self.waiting);
        if waiting > MAX_QUEUED {
            return Err(Error::Busy(MAX_QUEUED));
        }
        let mut inner = self.inner.lock().await;
        not_left(detach)?;
        self.touch();
        self.runs.fetch_add(1, Ordering::Relaxed);
        let ensured = self.ensure_agent(&mut inner).await?;
        // After the agent: a woken pod is bound to its egress only then (Kubernetes).
        if let Some(start) = &spec.on_start {
            (start.0)().await;
        }
        let (mut notices, state_lost_before) = since_last(&mut inner, ensured);
        let started = Instant::now();
        let outcome = RunOutcome { state_lost: state_lost_before, ..RunOutcome::new(self.cfg.output_cap) };
        let mut env = self.env.lock().map(|e| e.clone()).unwrap_or_default();
        env.extend(spec.env.clone());
        let spec = RunSpec { env, ..spec };
        let run_started = std::time::SystemTime::now();
        let sandbox = Sandbox { docker: self.docker.clone(), id: inner.container.id.clone(), since: run_started };
        let grant = spec.bridge.clone();
        let mut run = Gathered::new(outcome, grant.as_deref());
        let stop = Stop { timeout, grace: self.cfg.grace(), ct, sandbox: Some(&sandbox), detach };
        let mut sent = tokio::time::Instant::now();
        let run_id = std::sync::atomic::AtomicU64::new(0);
        let on_id = |id: u64| {
            run_id.store(id, Ordering::Relaxed);
            on_id(id);
        };
        let on_id: &OnId<'_> = &on_id;
        let mut ending = drive_agent(&mut inner, &spec, stop, &mut run, observer, &self.name, on_id).await;
        if matches!(ending, Ending::Stuck) {
            // The run never started: the previous run's code holds the interpreter. A fresh
            // one takes the run instead.
            tracing::warn!(session = %self.name, "code of an earlier run holds the interpreter; restarting it");
            run.outcome.state_lost = true;
            notices.push(STUCK_NOTICE.into());
            notices.extend(self.recover(&mut inner).await);
            sent = tokio::time::Instant::now();
            ending = drive_agent(&mut inner, &spec, stop, &mut run, observer, &self.name, on_id).await;
        }
        // The stream dropped mid-run, not the interpreter (docs/design.md D12): a new relay
        // reaches the same one under its keeper, which held what it printed meanwhile. The
        // run's calls carry over: their budget, those in flight, the latest replies.
        for _ in 0..MAX_REATTACH {
            let id = run_id.load(Ordering::Relaxed);
            if id == 0 || !matches!(ending, Ending::Died(None) | Ending::Broken(_)) {
                break;
            }
            let Some(probe) = self.reattach_run(&mut inner).await else { break };
            let left = (sent + timeout).saturating_duration_since(tokio::time::Instant::now());
            let stop = Stop { timeout: left, ..stop };
            ending = match inner.agent.as_mut() {
                Some(agent) => follow(agent, id, stop, &mut run, observer, &self.name, Some(probe)).await,
                None => break,
            };
        }
        // Left to the next server (by the first drive, the second or a reattach's follow).
        if matches!(ending, Ending::Left) {
            return Err(Error::Left);
        }
        let mut outcome = run.finish();
        self.conclude(&mut inner, ending, &mut outcome, &mut notices, sent + timeout, run_started).await;
        outcome.duration = started.elapsed();
        self.blueprint.metrics.run_ended(outcome.status, &self.environment, &self.principal, outcome.duration);
        notices.append(&mut outcome.notices);
        outcome.notices = notices;
        self.lost.note(&outcome);
        self.touch();
        Ok(outcome)
    }

    /// Follows run `id`, sent by an earlier server of this state dir, to its end: the agent
    /// went on under its keeper, which held what it printed meanwhile (docs/design.md D12).
    /// `timeout` is what is left of the run's time limit.
    pub(super) async fn resume(
        &self,
        id: u64,
        timeout: Duration,
        ct: &CancellationToken,
        detach: Option<&CancellationToken>,
        observer: &Observer<'_>,
    ) -> Result<RunOutcome, Error> {
        let mut inner = self.inner.lock().await;
        not_left(detach)?;
        self.touch();
        let ensured = self.ensure_agent(&mut inner).await?;
        let started = Instant::now();
        let mut outcome = RunOutcome::new(self.cfg.output_cap);
        let mut notices = std::mem::take(&mut inner.pending);
        inner.pending_lost = false;
        if let Some(n) = ensured {
            // Another interpreter answered: the one running the job is gone, and the job with it.
            outcome.status = RunStatus::InterpreterRestarted;
            outcome.state_lost = true;
            notices.push(format!("the run did not survive the server's restart: {n}"));
            outcome.notices = notices;
            self.audit_resumed(id, &outcome);
            return Ok(outcome);
        }
        let run_started = std::time::SystemTime::now();
        let sandbox = Sandbox { docker: self.docker.clone(), id: inner.container.id.clone(), since: run_started };
        let stop = Stop { timeout, grace: self.cfg.grace(), ct, sandbox: Some(&sandbox), detach };
        let sent = tokio::time::Instant::now();
        // A job's run followed after a restart: its code-mode calls went with the old server.
        let mut run = Gathered::new(outcome, None);
        // A probe queued behind the run: its ack, seen before the run's `done`, says the run
        // ended and its `done` was in flight in the stream that dropped.
        let ending = match inner.agent.as_mut() {
            Some(agent) => {
                let probe = agent.next_id();
                match agent.send(&Request::Packages { id: probe }).await {
                    Ok(()) => follow(agent, id, stop, &mut run, observer, &self.name, Some(probe)).await,
                    Err(e) => Ending::Broken(e.to_string()),
                }
            }
            None => Ending::Broken("no agent".into()),
        };
        if matches!(ending, Ending::Left) {
            return Err(Error::Left);
        }
        let mut outcome = run.finish();
        self.conclude(&mut inner, ending, &mut outcome, &mut notices, sent + timeout, run_started).await;
        outcome.duration = started.elapsed();
        self.blueprint.metrics.run_ended(outcome.status, &self.environment, &self.principal, outcome.duration);
        self.audit_resumed(id, &outcome);
        notices.append(&mut outcome.notices);
        outcome.notices = notices;
        self.lost.note(&outcome);
        self.touch();
        Ok(outcome)
    }

    /// The end of a run an earlier server started (and audited the start of): audited, and its
    /// time under this server charged to the principal's quotas.
    fn audit_resumed(&self, id: u64, outcome: &RunOutcome) {
        let event = crate::audit::Event::new("run_ended", &self.principal).session(&self.name);
        self.run_ended(event.field("kind", "resumed").field("run", id), outcome.status.to_string(), outcome.duration);
    }

    /// After a run's stream ended without its `done`: a new relay, if it reaches the same
    /// interpreter, with a probe queued behind the run (see [`follow`]). `None` when the
    /// interpreter is gone (the run died with it) or cannot be reached.
    async fn reattach_run(&self, inner: &mut Inner) -> Option<u64> {
        let old = inner.agent.as_ref()?.pid()?;
        if !container::is_running(&self.docker, &inner.container.id).await.unwrap_or(false) {
            return None;
        }
        let (mut agent, _) = super::agent::greet(&self.docker, &inner.container, &self.name).await.ok()?;
        if agent.pid() != Some(old) {
            // A new interpreter answered: the run's died. Recovery replaces this one too.
            return None;
        }
        let probe = agent.next_id();
        agent.send(&Request::Packages { id: probe }).await.ok()?;
        tracing::info!(session = %self.name, pid = old, "the stream dropped mid-run; reattached to the interpreter");
        inner.agent = Some(agent);
        Some(probe)
    }

    /// After a run's events ended one way or another: its status, and a fresh interpreter
    /// when the run lost it. `lease_until` bounds code that goes on after its `done`.
    async fn conclude(
        &self,
        inner: &mut Inner,
        ending: Ending,
        outcome: &mut RunOutcome,
        notices: &mut Vec<String>,
        lease_until: tokio::time::Instant,
        run_started: std::time::SystemTime,
    ) {
        if matches!(ending, Ending::Done) {
            // Code may go on after a done (forged, or threads and processes left behind), up
            // to the run's time limit and never past it.
            self.lease(inner, lease_until);
        }
        match ending {
            // A child process (run_file, a command, a subprocess) killed by the OOM killer
            // leaves the interpreter alive; its status 137 plus the event tells.
            Ending::Done
                if outcome.status == RunStatus::Error
                    && outcome.exit_code == Some(137)
                    && container::oom_since(&self.docker, &inner.container.id, run_started).await =>
            {
                outcome.status = RunStatus::Oom;
                notices.push(child_oom_notice(self.cfg.memory_mb));
            }
            // The callers return before: the run is the next server's.
            Ending::Done | Ending::Left => {}
            Ending::Vanished => {
                outcome.status = RunStatus::Error;
                notices.push(
                    "the run ended while no server was attached, and its result was lost with the stream that \
                     dropped; its output up to then is kept, and the interpreter is intact"
                        .into(),
                );
            }
            Ending::Died(stopped) => {
                let code = match inner.agent.as_ref().and_then(|a| a.exec_id()) {
                    Some(exec_id) => exec::exit_code(&self.docker, exec_id).await,
                    None => None,
                };
                // No code: the sandbox died whole with its exec stream still open (gVisor), so
                // the engine's OOM event alone tells.
                let oom = matches!(code, Some(137) | None)
                    && container::oom_since(&self.docker, &inner.container.id, run_started).await;
                outcome.status = match (oom, stopped) {
                    (true, _) => RunStatus::Oom,
                    (false, Some(s)) => s,
                    (false, None) => RunStatus::InterpreterRestarted,
                };
                outcome.state_lost = true;
                let after = self.recover(inner).await;
                notices.push(lost(died_notice(code, oom, self.cfg.memory_mb), after));
            }
            Ending::Killed(status) => {
                outcome.status = status;
                outcome.state_lost = true;
                let after = self.recover(inner).await;
                notices.push(lost(killed_notice(status), after));
            }
            Ending::Broken(_) | Ending::Stuck => {
                let why = match ending {
                    Ending::Broken(why) => why,
                    _ => "a fresh interpreter did not take the run".into(),
                };
                tracing::warn!(session = %self.name, %why, "agent stream broken");
                outcome.status = RunStatus::InterpreterRestarted;
                outcome.state_lost = true;
                let after = self.recover(inner).await;
                notices.push(lost(BROKEN_NOTICE.into(), after));
            }
        }
    }
}

/// [`drive`] with the session's agent and a fresh id.
async fn drive_agent(
    inner: &mut Inner,
    spec: &RunSpec,
    stop: Stop<'_>,
    run: &mut Gathered<'_>,
    observer: &Observer<'_>,
    name: &str,
    on_id: &OnId<'_>,
) -> Ending {
    match inner.agent.as_mut() {
        Some(agent) => {
            let id = agent.next_id();
            on_id(id);
            drive(agent, id, spec, stop, run, observer, name).await
        }
        None => Ending::Broken("no agent".into()),
    }
}

/// Sends the run `id` and reads its events into `run` until it ends one way or another.
/// Events of other ids are ignored. `name` is the session's, for logs.
///
/// The time limit starts once the agent's main loop has taken the run ([`Agent::taken`]):
/// code of the previous run that went on after its `done` is interrupted first (and told in
/// a notice), and when it will not stop, the run ends as [`Ending::Stuck`] without starting.
pub(super) async fn drive(
    agent: &mut Agent,
    id: u64,
    spec: &RunSpec,
    stop: Stop<'_>,
    run: &mut Gathered<'_>,
    observer: &Observer<'_>,
    name: &str,
) -> Ending {
    let req = Request::Run {
        id,
        code: &spec.code,
        file: spec.file.as_deref(),
        args: &spec.args,
        cmd: &spec.cmd,
        env: &spec.env,
    };
    if let Err(e) = agent.send(&req).await {
        return Ending::Broken(e.to_string());
    }
    match agent.taken(id).await {
        Taken::Yes => {}
        Taken::AfterInterrupt(_) => run.outcome.notices.push(INTERRUPTED_NOTICE.into()),
        Taken::No => return Ending::Stuck,
        Taken::Gone(None) => return Ending::Died(None),
        Taken::Gone(Some(why)) => return Ending::Broken(why),
    }
    follow(agent, id, stop, run, observer, name, None).await
}

/// Reads the events of run `id`, already taken by the agent, into `run` until it ends; its
/// code-mode calls are answered meanwhile. On a new stream (a reattach), the latest replies
/// go out again first: the old relay may have lost them, and the code would wait for good.
async fn follow(
    agent: &mut Agent,
    id: u64,
    stop: Stop<'_>,
    run: &mut Gathered<'_>,
    observer: &Observer<'_>,
    name: &str,
    probe: Option<u64>,
) -> Ending {
    resend(agent, &run.sent).await;
    let Gathered { outcome, calls, sent } = run;
    let Stop { timeout, grace, ct, sandbox, detach } = stop;
    let detach = cancelled(detach);
    tokio::pin!(detach);
    // Set once the server leaves: the stream is read to its end, which is the run's end here.
    let mut leaving = false;
    let deadline = tokio::time::Instant::now() + timeout;
    let died = died(sandbox);
    tokio::pin!(died);
    // Set once we have asked the code to stop: why, and when to kill it if it has not.
    let mut stopping: Option<(RunStatus, tokio::time::Instant)> = None;
    loop {
        let kill_at = stopping.map(|s| s.1).unwrap_or(deadline);
        tokio::select! {
            ev = agent.next_event() => match ev {
                Ok(Some(Event::Out { id: Some(i), s, t, b })) if i == id => match Event::payload(t, b) {
                    Ok(bytes) => take_output(outcome, observer, s, &bytes),
                    Err(e) => tracing::warn!(session = %name, error = %e, "bad output chunk"),
                },
                Ok(Some(done @ Event::Done { id: i, .. })) if i == id => {
                    take_done(outcome, done, stopping.map(|s| s.0));
                    // Its code may still hold the interpreter: the done may be the code's own.
                    agent.last_run = Some(id);
                    probe_answered(agent, probe).await;
                    return Ending::Done;
                }
                Ok(Some(Event::Image { id: Some(i), mime, b })) if i == id => outcome.add_image(mime, b),
                Ok(Some(Event::Notice { id: Some(i), text })) if i == id => outcome.add_notice(text),
                Ok(Some(Event::Ack { id: i })) if Some(i) == probe => {
                    probe_answered(agent, probe).await;
                    return Ending::Vanished;
                }
                Ok(Some(Event::ToolCall { id: i, call, op, tool, args })) if i == id => {
                    if let Some(reply) = calls.begin(call, op.as_deref(), tool.as_deref(), args) {
                        answer(agent, sent, reply).await;
                    }
                }
                Ok(Some(other)) => tracing::debug!(session = %name, event = ?other, "event outside the run ignored"),
                Ok(None) | Err(ReadError::Fatal(_)) if leaving => return left(name),
                Ok(None) => return Ending::Died(stopping.map(|s| s.0)),
                Err(ReadError::Skippable(e)) => tracing::warn!(session = %name, error = %e, "unreadable agent line skipped"),
                Err(ReadError::Fatal(e)) => return Ending::Broken(e),
            },
            () = &mut detach, if !leaving => {
                leaving = true;
                if !let_go(agent, name).await {
                    return Ending::Left;
                }
            },
            reply = calls.next() => answer(agent, sent, reply).await,
            _ = tokio::time::sleep_until(deadline), if stopping.is_none() && !leaving => {
                calls.close();
                stopping = Some((RunStatus::Timeout, tokio::time::Instant::now() + grace));
                let _ = agent.send(&Request::Interrupt { id }).await;
            }
            _ = ct.cancelled(), if stopping.is_none() && !leaving => {
                calls.close();
                stopping = Some((RunStatus::Cancelled, tokio::time::Instant::now() + grace));
                let _ = agent.send(&Request::Interrupt { id }).await;
            }
            () = &mut died, if !leaving => {
                tracing::info!(session = %name, "the sandbox died during the run");
                return Ending::Died(stopping.map(|s| s.0));
            }
            // Leaving, the next server stops it: its record keeps the time limit.
            _ = tokio::time::sleep_until(kill_at), if stopping.is_some() && !leaving => {
                return Ending::Killed(stopping.map(|s| s.0).unwrap_or(RunStatus::Timeout));
            }
        }
    }
}

/// After a followed run ended: the probe's own answer. The keeper's forwarder tags output
/// with the run it last saw begin, and drains output as it forwards a reply: a probe's reply
/// still unforwarded when the next run prints would carry that output off as nobody's
/// (agent.py). Bounded: an interpreter still held is [`Agent::taken`]'s to interrupt.
async fn probe_answered(agent: &mut Agent, probe: Option<u64>) {
    let Some(probe) = probe else { return };
    let pick = |p: u64, ev: Event| matches!(ev, Event::Packages { id, .. } if id == p).then_some(());
    let _ = agent.answer(probe, pick, super::agent::ACK_TIMEOUT).await;
}

/// What happened since the last call, told first: its notices (`ensured`, a new interpreter's,
/// last), and whether the interpreter's state was lost meanwhile.
fn since_last(inner: &mut Inner, ensured: Option<String>) -> (Vec<String>, bool) {
    let mut notices = std::mem::take(&mut inner.pending);
    let lost = std::mem::take(&mut inner.pending_lost) || ensured.is_some();
    notices.extend(ensured);
    (notices, lost)
}

/// The latest code-mode replies, sent again on a new stream. A failed write is seen by the
/// next read.
async fn resend(agent: &mut Agent, sent: &crate::bridge::Recent) {
    for line in sent.lines() {
        if agent.send_line(line).await.is_err() {
            break;
        }
    }
}

/// Resolves once the engine tells the sandbox died ([`WATCH_AFTER`] into the run at the
/// earliest); never without a sandbox.
async fn died(sandbox: Option<&Sandbox>) {
    match sandbox {
        Some(s) => {
            tokio::time::sleep(WATCH_AFTER).await;
            s.died().await;
        }
        None => std::future::pending().await,
    }
}

/// Resolves when `token` is cancelled; never without one.
async fn cancelled(token: Option<&CancellationToken>) {
    match token {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// [`Error::Left`] once the server has left its runs to the next one: a run queued behind a
/// left one is never sent here, the next server says what became of it.
fn not_left(detach: Option<&CancellationToken>) -> Result<(), Error> {
    if detach.is_some_and(CancellationToken::is_cancelled) { Err(Error::Left) } else { Ok(()) }
}

/// The server leaves: the stream's input is closed, so the relay lets go of its keeper in
/// order and writes out all it was sent (docs/design.md D12, a graceful leave); the keeper
/// keeps the rest for the next relay. False when the input cannot be closed.
async fn let_go(agent: &mut Agent, name: &str) -> bool {
    match agent.close_input().await {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(session = %name, error = %e, "cannot close the stream's input; the run is left as it is");
            false
        }
    }
}

/// A left run's stream ended: the run is the next server's.
fn left(name: &str) -> Ending {
    tracing::debug!(session = %name, "the stream ended in order; the run is left to the next server");
    Ending::Left
}

/// A chunk of the run's output: to the observer, and kept in the outcome.
fn take_output(outcome: &mut RunOutcome, observer: &Observer<'_>, s: protocol::Stream, bytes: &[u8]) {
    observer(s, bytes);
    match s {
        protocol::Stream::Stdout => outcome.stdout.push(bytes),
        protocol::Stream::Stderr => outcome.stderr.push(bytes),
    }
}

/// The run's `done` into its outcome; an interrupted run keeps the reason we stopped it for.
fn take_done(outcome: &mut RunOutcome, done: Event, stopping: Option<RunStatus>) {
    let Event::Done { status, result, error, exit_code, cpu_ms, peak_kb, .. } = done else { return };
    outcome.peak_memory_kb = peak_kb;
    outcome.result = result;
    outcome.error = error;
    outcome.exit_code = exit_code;
    outcome.cpu_ms = Some(cpu_ms);
    outcome.status = match (status, stopping) {
        (DoneStatus::Interrupted, Some(why)) => why,
        (DoneStatus::Interrupted, None) | (DoneStatus::Error, _) => RunStatus::Error,
        (DoneStatus::Ok, _) => RunStatus::Ok,
    };
}

/// Sends the agent the answer to a code-mode call, and keeps it among the latest sent. A
/// failed write is seen by the next read (and the answer goes out again on the next stream).
async fn answer(agent: &mut Agent, sent: &mut crate::bridge::Recent, (call, reply): crate::bridge::Reply) {
    let line = match &reply {
        Ok(v) => Request::ToolResult { call, result: Some(v), error: None },
        Err(why) => Request::ToolResult { call, result: None, error: Some(why) },
    }
    .to_line();
    let _ = agent.send_line(&line).await;
    sent.keep(line);
}
