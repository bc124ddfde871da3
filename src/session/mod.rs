//! A session: one hardened container plus one attached agent exec (DESIGN.md D1).
//!
//! Everything a session does goes through [`Inner`], behind an async mutex, so runs in one
//! session are serialised in arrival order (tokio's mutex is fair). The mutex is held across
//! awaits on purpose: the agent stream has exactly one reader.

pub mod jobs;
pub mod registry;
mod transfer;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bollard::Docker;
use bollard::container::LogOutput;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use crate::config::SandboxConfig;
use crate::docker::container::{self, Created, Owner, short};
use crate::docker::layers;
use crate::docker::{self, exec};
use crate::output::Capture;
use crate::protocol::{self, DoneStatus, Event, LineDecoder, PROTOCOL_VERSION, Package, PyError, Request, Variable};

/// How long a fresh agent may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an agent query (variables, packages, refresh) may take.
const QUERY_TIMEOUT: Duration = Duration::from_secs(20);

/// A session failure that is not the code's own doing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Docker failed.
    #[error(transparent)]
    Docker(#[from] docker::Error),
    /// The agent did not start or spoke out of protocol.
    #[error("the interpreter did not start: {0}")]
    AgentStart(String),
    /// The agent did not answer in time.
    #[error("the interpreter did not answer within {0:?}")]
    AgentTimeout(Duration),
    /// Too many runs are waiting for this session.
    #[error(
        "the session is busy: one run is going and {0} are waiting; wait for them, use job_status, or use another session"
    )]
    Busy(usize),
    /// Packages could not be copied into the session.
    #[error("cannot add packages to the session: {0}")]
    Install(String),
    /// The session was closed while the call was under way.
    #[error("the session was closed")]
    Closed,
    /// The agent died while answering a query.
    #[error("the interpreter stopped while answering; it will be restarted on the next call")]
    AgentGone,
}

/// How a run ended, as reported to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// The code ran to the end.
    Ok,
    /// The code raised an exception (or called `sys.exit` with a non-zero status).
    Error,
    /// The time limit passed and the code was stopped.
    Timeout,
    /// The caller cancelled the call and the code was stopped.
    Cancelled,
    /// The interpreter died during the run (`os._exit`, a fatal signal) and was restarted;
    /// variables are gone, workspace files are kept.
    InterpreterRestarted,
    /// The code ran out of memory and the interpreter was restarted.
    Oom,
    /// The run goes on in the background (a job).
    Running,
}

/// Sees each chunk of output as it arrives, for live streaming.
pub type Observer<'a> = dyn Fn(protocol::Stream, &[u8]) + Send + Sync + 'a;

/// Runs waiting for a busy session beyond the one running; more get a busy error.
const MAX_QUEUED: usize = 4;

struct WaitGuard<'a>(&'a AtomicUsize);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What ends a run early: its time limit and its caller's cancellation.
#[derive(Clone, Copy)]
struct Stop<'a> {
    timeout: Duration,
    ct: &'a CancellationToken,
}

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
}

/// What to run.
#[derive(Debug, Default)]
pub struct RunSpec<'a> {
    /// Python source for the persistent interpreter.
    pub code: &'a str,
    /// A workspace script to run in a fresh interpreter process instead.
    pub file: Option<&'a str>,
    /// Its arguments.
    pub args: &'a [String],
    /// Or a command (argv) run in the workspace, as the code's user.
    pub cmd: &'a [String],
    /// Environment for this run, on top of the session's.
    pub env: BTreeMap<String, String>,
}

/// A file request's answer.
#[derive(Debug, Default)]
pub struct FileReply {
    /// Size of the file.
    pub size: Option<u64>,
    /// Bytes read.
    pub data: Vec<u8>,
    /// Directory entries.
    pub entries: Vec<protocol::FileEntry>,
    /// The listing was cut.
    pub truncated: bool,
}

/// Summary of a session for listings.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct SessionInfo {
    /// Session name.
    pub session: String,
    /// Python version of its interpreter.
    pub python: String,
    /// Environment it runs in.
    pub environment: String,
    /// Runs so far.
    pub runs: u64,
    /// Seconds since the last call.
    pub idle_s: u64,
    /// Seconds since creation.
    pub age_s: u64,
    /// Seconds until it is closed for idleness.
    pub expires_in_s: u64,
}

struct Agent {
    exec_id: String,
    input: exec::Input,
    output: exec::Output,
    decoder: LineDecoder,
}

/// Why reading the agent failed.
enum ReadError {
    /// A line we could not parse: skip it (user code can write into the agent's own fds).
    Skippable(protocol::Error),
    /// The stream broke or a line was too long: the agent is unusable.
    Fatal(String),
}

impl Agent {
    async fn send(&mut self, req: &Request<'_>) -> std::io::Result<()> {
        self.input.write_all(&req.to_line()).await?;
        self.input.flush().await
    }

    /// Next event; `Ok(None)` when the agent's output ended (it exited). Cancel-safe: bytes
    /// already read stay in the decoder.
    async fn next_event(&mut self) -> Result<Option<Event>, ReadError> {
        loop {
            match self.decoder.next_event() {
                Ok(Some(ev)) => return Ok(Some(ev)),
                Ok(None) => {}
                Err(protocol::Error::LineTooLong) => {
                    return Err(ReadError::Fatal("agent line too long".into()));
                }
                Err(e) => return Err(ReadError::Skippable(e)),
            }
            match self.output.next().await {
                Some(Ok(LogOutput::StdOut { message })) => self.decoder.push(&message),
                Some(Ok(LogOutput::StdErr { message })) => {
                    tracing::warn!(agent_stderr = %String::from_utf8_lossy(&message).trim_end(), "agent diagnostics");
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(ReadError::Fatal(e.to_string())),
                None => return Ok(None),
            }
        }
    }
}

struct Inner {
    container: Created,
    agent: Option<Agent>,
    python: String,
    next_id: u64,
}

/// One session.
pub struct Session {
    /// Session name.
    pub name: String,
    /// Owner.
    pub principal: String,
    /// Environment it was created in, for life.
    pub environment: String,
    docker: Docker,
    cfg: Arc<SandboxConfig>,
    image: String,
    owner: Owner,
    inner: tokio::sync::Mutex<Inner>,
    /// Container id, readable without waiting for a run (close kills a busy session).
    container: std::sync::Mutex<Created>,
    last_used: std::sync::Mutex<Instant>,
    created: SystemTime,
    runs: AtomicU64,
    /// Set by close: nothing may recreate the container afterwards.
    closed: AtomicBool,
    /// Requirements of the session's layer (what a recreated container still has).
    layer_packages: BTreeSet<String>,
    /// Requirements installed: the layer's plus those added while running.
    packages: std::sync::Mutex<BTreeSet<String>>,
    /// Environment variables set for every run of the session.
    env: std::sync::Mutex<BTreeMap<String, String>>,
    /// Runs holding or waiting for the session.
    waiting: AtomicUsize,
}

/// Whose a new session is and what it is called.
#[derive(Debug, Clone)]
pub struct Naming {
    /// Session name.
    pub name: String,
    /// Owner.
    pub principal: String,
    /// Environment name.
    pub environment: String,
}

/// Attaches the agent in `inner`'s container and waits for its greeting.
async fn greet(docker: &Docker, inner: &mut Inner, name: &str) -> Result<(), Error> {
    let attached = exec::attach_agent(docker, &inner.container.id).await?;
    let mut agent =
        Agent { exec_id: attached.id, input: attached.input, output: attached.output, decoder: LineDecoder::default() };
    let hello = tokio::time::timeout(HELLO_TIMEOUT, agent.next_event())
        .await
        .map_err(|_| Error::AgentTimeout(HELLO_TIMEOUT))?;
    match hello {
        Ok(Some(Event::Hello { protocol, python, pid })) if protocol == PROTOCOL_VERSION => {
            tracing::debug!(session = %name, %python, pid, "agent ready");
            inner.python = python;
            inner.agent = Some(agent);
            Ok(())
        }
        Ok(Some(Event::Hello { protocol, .. })) => Err(Error::AgentStart(format!(
            "agent protocol {protocol}, server protocol {PROTOCOL_VERSION}: rebuild the image with `pyberth image build`"
        ))),
        Ok(Some(other)) => Err(Error::AgentStart(format!("unexpected first event {other:?}"))),
        Ok(None) => {
            let code = exec::exit_code(docker, &agent.exec_id).await;
            Err(Error::AgentStart(format!("the agent exited at start (exit code {code:?})")))
        }
        Err(ReadError::Skippable(e)) => Err(Error::AgentStart(e.to_string())),
        Err(ReadError::Fatal(e)) => Err(Error::AgentStart(e)),
    }
}

/// A started container whose agent has greeted, not yet anyone's session (the warm pool).
pub struct Prepared {
    inner: Inner,
}

impl Prepared {
    /// Creates a container under `label` and starts its agent.
    pub async fn make(
        docker: &Docker,
        cfg: &SandboxConfig,
        image: &str,
        owner: &Owner,
        label: &str,
        principal: &str,
    ) -> Result<Self, Error> {
        let created = container::create(docker, cfg, image, owner, label, principal).await?;
        let mut inner = Inner { container: created.clone(), agent: None, python: String::new(), next_id: 0 };
        if let Err(e) = greet(docker, &mut inner, label).await {
            container::destroy(docker, &created).await;
            return Err(e);
        }
        Ok(Self { inner })
    }

    /// Removes its container and volumes.
    pub async fn destroy(self, docker: &Docker) {
        container::destroy(docker, &self.inner.container).await;
    }
}

impl Session {
    /// Creates the container and starts the agent.
    pub async fn start(
        docker: Docker,
        cfg: Arc<SandboxConfig>,
        image: String,
        owner: Owner,
        naming: Naming,
        packages: Vec<String>,
    ) -> Result<Arc<Self>, Error> {
        let prepared = Prepared::make(&docker, &cfg, &image, &owner, &naming.name, &naming.principal).await?;
        Ok(Self::adopt(docker, cfg, image, owner, naming, packages, prepared))
    }

    /// Makes a prepared container someone's session.
    #[allow(clippy::too_many_arguments)] // the parts of a session, each needed once
    pub fn adopt(
        docker: Docker,
        cfg: Arc<SandboxConfig>,
        image: String,
        owner: Owner,
        naming: Naming,
        packages: Vec<String>,
        prepared: Prepared,
    ) -> Arc<Self> {
        let Naming { name, principal, environment } = naming;
        let created = prepared.inner.container.clone();
        tracing::info!(session = %name, container = %short(&created.id), "session created");
        Arc::new(Self {
            name,
            principal,
            environment,
            docker,
            cfg,
            image,
            owner,
            inner: tokio::sync::Mutex::new(prepared.inner),
            container: std::sync::Mutex::new(created),
            last_used: std::sync::Mutex::new(Instant::now()),
            created: SystemTime::now(),
            runs: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            layer_packages: packages.iter().cloned().collect(),
            packages: std::sync::Mutex::new(packages.into_iter().collect()),
            env: std::sync::Mutex::new(BTreeMap::new()),
            waiting: AtomicUsize::new(0),
        })
    }

    fn touch(&self) {
        if let Ok(mut t) = self.last_used.lock() {
            *t = Instant::now();
        }
    }

    /// The settings the session was made with (its environment's limits and mounts).
    pub fn settings(&self) -> &SandboxConfig {
        &self.cfg
    }

    /// The image its container runs.
    pub fn image(&self) -> &str {
        &self.image
    }

    /// The id of the session's current container.
    pub fn container_id(&self) -> String {
        self.container.lock().map(|c| c.id.clone()).unwrap_or_default()
    }

    /// Time since the last call.
    pub fn idle(&self) -> Duration {
        self.last_used.lock().map(|t| t.elapsed()).unwrap_or_default()
    }

    /// True while a call holds the session.
    pub fn is_busy(&self) -> bool {
        self.inner.try_lock().is_err()
    }

    /// Listing entry.
    pub fn info(&self) -> SessionInfo {
        let idle = self.idle();
        let python = self.inner.try_lock().map(|i| i.python.clone()).unwrap_or_default();
        SessionInfo {
            session: self.name.clone(),
            python,
            environment: self.environment.clone(),
            runs: self.runs.load(Ordering::Relaxed),
            idle_s: idle.as_secs(),
            age_s: self.created.elapsed().map(|d| d.as_secs()).unwrap_or(0),
            expires_in_s: self.cfg.idle_ttl().saturating_sub(idle).as_secs(),
        }
    }

    async fn start_agent(&self, inner: &mut Inner) -> Result<(), Error> {
        greet(&self.docker, inner, &self.name).await
    }

    /// Makes sure an agent is running, restarting it (or the whole container) if needed.
    /// Returns a notice when state was lost on the way.
    async fn ensure_agent(&self, inner: &mut Inner) -> Result<Option<String>, Error> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Closed);
        }
        if inner.agent.is_some() {
            return Ok(None);
        }
        if container::is_running(&self.docker, &inner.container.id).await? {
            match self.start_agent(inner).await {
                Ok(()) => return Ok(None),
                // Exhausted pids, a wedged filesystem, an agent that will not greet: a new
                // container is the last resort of DESIGN.md D5.
                Err(e) => {
                    tracing::warn!(session = %self.name, error = %e, "cannot restart the agent; replacing the container")
                }
            }
        } else {
            tracing::warn!(session = %self.name, container = %short(&inner.container.id), "container gone; recreating");
        }
        container::destroy(&self.docker, &inner.container).await;
        inner.container =
            container::create(&self.docker, &self.cfg, &self.image, &self.owner, &self.name, &self.principal).await?;
        if let Ok(mut c) = self.container.lock() {
            *c = inner.container.clone();
        }
        if let Ok(mut p) = self.packages.lock() {
            *p = self.layer_packages.clone();
        }
        self.start_agent(inner).await?;
        Ok(Some(
            "the session's container had stopped or could not start a new interpreter, and was replaced: \
             variables and workspace files from before are gone"
                .into(),
        ))
    }

    /// After a run lost its interpreter: a fresh one now if possible, else a notice saying why
    /// not. The run's own result is kept either way; the next call tries again.
    async fn recover(&self, inner: &mut Inner) -> Option<String> {
        match self.restart_agent(inner).await {
            Ok(notice) => notice,
            Err(e) => {
                tracing::warn!(session = %self.name, error = %e, "cannot start a new interpreter");
                Some(format!("no new interpreter could be started yet: {e}; the next call tries again"))
            }
        }
    }

    /// Kills the agent and everything the code started, then starts a fresh agent.
    /// Returns a notice if the container itself had to be replaced.
    async fn restart_agent(&self, inner: &mut Inner) -> Result<Option<String>, Error> {
        inner.agent = None;
        if let Err(e) = exec::kill_code_processes(&self.docker, &inner.container.id).await {
            tracing::warn!(session = %self.name, error = %e, "cannot kill code processes");
        }
        self.ensure_agent(inner).await
    }

    /// Runs code in the persistent interpreter.
    pub async fn run(
        &self,
        spec: RunSpec<'_>,
        timeout: Duration,
        ct: &CancellationToken,
        observer: &Observer<'_>,
    ) -> Result<RunOutcome, Error> {
        let waiting = self.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = WaitGuard(&self.waiting);
        if waiting > MAX_QUEUED {
            return Err(Error::Busy(MAX_QUEUED));
        }
        let mut inner = self.inner.lock().await;
        self.touch();
        self.runs.fetch_add(1, Ordering::Relaxed);
        let mut notices: Vec<String> = self.ensure_agent(&mut inner).await?.into_iter().collect();
        let state_lost_before = !notices.is_empty();
        inner.next_id += 1;
        let id = inner.next_id;
        let started = Instant::now();
        let mut outcome = RunOutcome {
            status: RunStatus::Ok,
            stdout: Capture::new(self.cfg.output_cap),
            stderr: Capture::new(self.cfg.output_cap),
            result: None,
            error: None,
            exit_code: None,
            duration: Duration::ZERO,
            cpu_ms: None,
            state_lost: state_lost_before,
            notices: Vec::new(),
            images: Vec::new(),
            peak_memory_kb: None,
        };
        let mut env = self.env.lock().map(|e| e.clone()).unwrap_or_default();
        env.extend(spec.env.clone());
        let spec = RunSpec { env, ..spec };
        let run_started = std::time::SystemTime::now();
        let ending = self.drive(&mut inner, id, &spec, Stop { timeout, ct }, &mut outcome, observer).await;
        match ending {
            // A child process (run_file, a command, a subprocess) killed by the OOM killer
            // leaves the interpreter alive; its status 137 plus the event tells.
            Ending::Done
                if outcome.status == RunStatus::Error
                    && outcome.exit_code == Some(137)
                    && container::oom_since(&self.docker, &inner.container.id, run_started).await =>
            {
                outcome.status = RunStatus::Oom;
                notices.push(format!(
                    "out of memory: the program needed more than the session's {} MiB and was killed; \
                     the session's interpreter and variables are unaffected",
                    self.cfg.memory_mb
                ));
            }
            Ending::Done => {}
            Ending::Died(stopped) => {
                let code = match inner.agent.as_ref() {
                    Some(a) => exec::exit_code(&self.docker, &a.exec_id).await,
                    None => None,
                };
                let oom =
                    code == Some(137) && container::oom_since(&self.docker, &inner.container.id, run_started).await;
                outcome.status = match (oom, stopped) {
                    (true, _) => RunStatus::Oom,
                    (false, Some(s)) => s,
                    (false, None) => RunStatus::InterpreterRestarted,
                };
                outcome.state_lost = true;
                notices.push(match code {
                    Some(137) if oom => format!(
                        "out of memory: the code needed more than the session's {} MiB, and the interpreter was \
                         killed. A new interpreter was started: variables are gone, workspace files are kept",
                        self.cfg.memory_mb
                    ),
                    Some(137) => format!(
                        "the interpreter was killed (SIGKILL); running out of memory is the usual cause \
                         (limit {} MiB). A new interpreter was started: variables are gone, workspace files are kept",
                        self.cfg.memory_mb
                    ),
                    Some(c) => format!(
                        "the interpreter exited with status {c} during the run; a new one was started: \
                         variables are gone, workspace files are kept"
                    ),
                    None => "the interpreter stopped during the run; a new one was started: variables are gone, \
                             workspace files are kept"
                        .into(),
                });
                notices.extend(self.recover(&mut inner).await);
            }
            Ending::Killed(status) => {
                outcome.status = status;
                outcome.state_lost = true;
                let why =
                    if status == RunStatus::Cancelled { "the call was cancelled" } else { "the time limit passed" };
                notices.push(format!(
                    "{why} and the code did not stop after an interrupt, so its processes were killed and a new \
                     interpreter was started: variables are gone, workspace files are kept"
                ));
                notices.extend(self.recover(&mut inner).await);
            }
            Ending::Broken(why) => {
                tracing::warn!(session = %self.name, %why, "agent stream broken");
                outcome.status = RunStatus::InterpreterRestarted;
                outcome.state_lost = true;
                notices.push(
                    "the connection to the interpreter broke; a new one was started: variables are gone, \
                              workspace files are kept"
                        .into(),
                );
                notices.extend(self.recover(&mut inner).await);
            }
        }
        outcome.duration = started.elapsed();
        notices.append(&mut outcome.notices);
        outcome.notices = notices;
        self.touch();
        Ok(outcome)
    }

    /// Sends the run and reads its events until it ends one way or another.
    async fn drive(
        &self,
        inner: &mut Inner,
        id: u64,
        spec: &RunSpec<'_>,
        stop: Stop<'_>,
        outcome: &mut RunOutcome,
        observer: &Observer<'_>,
    ) -> Ending {
        let Stop { timeout, ct } = stop;
        let Some(agent) = inner.agent.as_mut() else {
            return Ending::Broken("no agent".into());
        };
        let req = Request::Run { id, code: spec.code, file: spec.file, args: spec.args, cmd: spec.cmd, env: &spec.env };
        if let Err(e) = agent.send(&req).await {
            return Ending::Broken(e.to_string());
        }
        let deadline = tokio::time::Instant::now() + timeout;
        // Set once we have asked the code to stop: why, and when to kill it if it has not.
        let mut stopping: Option<(RunStatus, tokio::time::Instant)> = None;
        loop {
            let kill_at = stopping.map(|s| s.1).unwrap_or(deadline);
            tokio::select! {
                ev = agent.next_event() => match ev {
                    Ok(Some(Event::Out { id: Some(i), s, t, b })) if i == id => match Event::payload(t, b) {
                        Ok(bytes) => {
                            observer(s, &bytes);
                            match s {
                                protocol::Stream::Stdout => outcome.stdout.push(&bytes),
                                protocol::Stream::Stderr => outcome.stderr.push(&bytes),
                            }
                        }
                        Err(e) => tracing::warn!(session = %self.name, error = %e, "bad output chunk"),
                    },
                    Ok(Some(Event::Done { id: i, status, result, error, exit_code, cpu_ms, peak_kb, .. })) if i == id => {
                        outcome.peak_memory_kb = peak_kb;
                        outcome.result = result;
                        outcome.error = error;
                        outcome.exit_code = exit_code;
                        outcome.cpu_ms = Some(cpu_ms);
                        outcome.status = match (status, stopping) {
                            (DoneStatus::Interrupted, Some((why, _))) => why,
                            (DoneStatus::Interrupted, None) => RunStatus::Error,
                            (DoneStatus::Error, _) => RunStatus::Error,
                            (DoneStatus::Ok, _) => RunStatus::Ok,
                        };
                        return Ending::Done;
                    }
                    Ok(Some(Event::Image { id: Some(i), mime, b })) if i == id => outcome.images.push((mime, b)),
                    Ok(Some(Event::Notice { id: Some(i), text })) if i == id => outcome.notices.push(text),
                    Ok(Some(other)) => tracing::debug!(session = %self.name, event = ?other, "event outside the run ignored"),
                    Ok(None) => return Ending::Died(stopping.map(|s| s.0)),
                    Err(ReadError::Skippable(e)) => tracing::warn!(session = %self.name, error = %e, "unreadable agent line skipped"),
                    Err(ReadError::Fatal(e)) => return Ending::Broken(e),
                },
                _ = tokio::time::sleep_until(deadline), if stopping.is_none() => {
                    stopping = Some((RunStatus::Timeout, tokio::time::Instant::now() + self.cfg.grace()));
                    let _ = agent.send(&Request::Interrupt { id }).await;
                }
                _ = ct.cancelled(), if stopping.is_none() => {
                    stopping = Some((RunStatus::Cancelled, tokio::time::Instant::now() + self.cfg.grace()));
                    let _ = agent.send(&Request::Interrupt { id }).await;
                }
                _ = tokio::time::sleep_until(kill_at), if stopping.is_some() => {
                    return Ending::Killed(stopping.map(|s| s.0).unwrap_or(RunStatus::Timeout));
                }
            }
        }
    }

    /// Sends a query to the agent and waits for the answer `pick` recognises.
    async fn query<T>(
        &self,
        inner: &mut Inner,
        make: impl FnOnce(u64) -> Request<'static>,
        pick: impl Fn(u64, Event) -> Option<T>,
    ) -> Result<T, Error> {
        inner.next_id += 1;
        let id = inner.next_id;
        let Some(agent) = inner.agent.as_mut() else { return Err(Error::AgentGone) };
        if agent.send(&make(id)).await.is_err() {
            inner.agent = None;
            return Err(Error::AgentGone);
        }
        let answer = tokio::time::timeout(QUERY_TIMEOUT, async {
            loop {
                match agent.next_event().await {
                    Ok(Some(ev)) => {
                        if let Some(v) = pick(id, ev) {
                            return Some(v);
                        }
                    }
                    Err(ReadError::Skippable(_)) => {}
                    Ok(None) | Err(ReadError::Fatal(_)) => return None,
                }
            }
        })
        .await;
        match answer {
            Ok(Some(v)) => Ok(v),
            Ok(None) => {
                inner.agent = None;
                Err(Error::AgentGone)
            }
            Err(_) => {
                self.restart_agent(inner).await?;
                Err(Error::AgentTimeout(QUERY_TIMEOUT))
            }
        }
    }

    /// The user's variables.
    pub async fn variables(&self) -> Result<(Vec<Variable>, Option<String>), Error> {
        let mut inner = self.inner.lock().await;
        self.touch();
        let notice = self.ensure_agent(&mut inner).await?;
        let vars = self
            .query(
                &mut inner,
                |id| Request::Vars { id },
                |id, ev| match ev {
                    Event::Vars { id: i, vars } if i == id => Some(vars),
                    _ => None,
                },
            )
            .await?;
        Ok((vars, notice))
    }

    /// Installed distributions visible to the code.
    pub async fn installed(&self) -> Result<Vec<Package>, Error> {
        let mut inner = self.inner.lock().await;
        self.touch();
        self.ensure_agent(&mut inner).await?;
        self.query(
            &mut inner,
            |id| Request::Packages { id },
            |id, ev| match ev {
                Event::Packages { id: i, packages } if i == id => Some(packages),
                _ => None,
            },
        )
        .await
    }

    /// Adds environment variables to every later run of the session.
    pub fn set_env(&self, vars: &BTreeMap<String, String>) {
        if let Ok(mut env) = self.env.lock() {
            env.extend(vars.clone());
        }
    }

    /// The session's own environment variables.
    pub fn env(&self) -> BTreeMap<String, String> {
        self.env.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// A workspace file request; `Ok(Err(message))` when the agent refused it (no such file,
    /// a path leading outside the workspace, ...).
    pub async fn file<'r>(&self, make: impl FnOnce(u64) -> Request<'r>) -> Result<Result<FileReply, String>, Error> {
        let mut inner = self.inner.lock().await;
        self.touch();
        self.ensure_agent(&mut inner).await?;
        inner.next_id += 1;
        let id = inner.next_id;
        let req = make(id);
        let Some(agent) = inner.agent.as_mut() else { return Err(Error::AgentGone) };
        if agent.send(&req).await.is_err() {
            inner.agent = None;
            return Err(Error::AgentGone);
        }
        drop(req);
        let answer = tokio::time::timeout(QUERY_TIMEOUT, async {
            loop {
                match agent.next_event().await {
                    Ok(Some(Event::File { id: i, size, b, entries, truncated })) if i == id => {
                        let data = match b {
                            Some(b) => match Event::payload(None, Some(b)) {
                                Ok(d) => d,
                                Err(_) => return Some(Err("the file could not be decoded".to_owned())),
                            },
                            None => Vec::new(),
                        };
                        let entries = entries.unwrap_or_default();
                        return Some(Ok(FileReply { size, data, entries, truncated: truncated.unwrap_or(false) }));
                    }
                    Ok(Some(Event::Failed { id: Some(i), message })) if i == id => return Some(Err(message)),
                    Ok(Some(_)) | Err(ReadError::Skippable(_)) => {}
                    Ok(None) | Err(ReadError::Fatal(_)) => return None,
                }
            }
        })
        .await;
        match answer {
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => {
                inner.agent = None;
                Err(Error::AgentGone)
            }
            Err(_) => {
                self.restart_agent(&mut inner).await?;
                Err(Error::AgentTimeout(QUERY_TIMEOUT))
            }
        }
    }

    /// Requirements of `wanted` this session does not have yet (by canonical string).
    pub fn missing(&self, wanted: &[String]) -> Vec<String> {
        let have = self.packages.lock().map(|p| p.clone()).unwrap_or_default();
        wanted.iter().filter(|w| !have.contains(*w)).cloned().collect()
    }

    /// Requirements installed in this session.
    pub fn requirements(&self) -> Vec<String> {
        self.packages.lock().map(|p| p.iter().cloned().collect()).unwrap_or_default()
    }

    /// Streams a layer's packages into the running session and makes them importable at
    /// once; the interpreter state is kept.
    pub async fn add_layer(&self, layer_tag: &str, requirements: &[String]) -> Result<(), Error> {
        let mut inner = self.inner.lock().await;
        self.touch();
        self.ensure_agent(&mut inner).await?;
        layers::copy_into(&self.docker, layer_tag, &inner.container.id, &self.owner)
            .await
            .map_err(|e| Error::Install(e.to_string()))?;
        self.query(
            &mut inner,
            |id| Request::Refresh { id },
            |id, ev| match ev {
                Event::Refreshed { id: i } if i == id => Some(()),
                _ => None,
            },
        )
        .await?;
        if let Ok(mut p) = self.packages.lock() {
            p.extend(requirements.iter().cloned());
        }
        Ok(())
    }

    /// Fresh interpreter in the same container: variables and processes gone, files kept.
    pub async fn reset(&self) -> Result<Option<String>, Error> {
        let mut inner = self.inner.lock().await;
        self.touch();
        self.restart_agent(&mut inner).await
    }

    /// Removes the container and its volume. A run in progress ends with its agent gone.
    pub async fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let created = self.container.lock().map(|c| c.clone()).ok();
        if let Some(c) = created {
            container::destroy(&self.docker, &c).await;
            tracing::info!(session = %self.name, container = %short(&c.id), "session closed");
        }
    }
}

enum Ending {
    /// The agent answered with Done.
    Done,
    /// The agent's stream ended; with the reason we were stopping it, if we were.
    Died(Option<RunStatus>),
    /// The code ignored the interrupt; with the reason for stopping it.
    Killed(RunStatus),
    /// The stream failed.
    Broken(String),
}
