//! A session: one hardened container plus one attached agent exec (docs/design.md D1).
//!
//! Everything a session does goes through [`Inner`], behind an async mutex, so runs in one
//! session are serialised in arrival order (tokio's mutex is fair). The mutex is held across
//! awaits on purpose: the agent stream has exactly one reader.
//!
//! This file holds the session's lifecycle (start, restart, reset, close) and its queries;
//! `agent.rs` is the connection to the agent, `run.rs` one run from request to outcome,
//! [`registry`] the sessions of a server and [`jobs`] the runs that outlive their call.
//!
//! Why this file passes 500 lines: the lifecycle of one session (start, greet, restart,
//! replace, close) and the queries that share its lock; the run and the agent connection
//! already live apart (`run.rs`, `agent.rs`, `watch.rs`).

mod agent;
#[cfg(test)]
mod agent_tests;
mod charge;
mod ended;
mod extras;
pub(crate) mod jobs;
mod orphan;
mod recorded;
pub(crate) mod registry;
mod run;
pub(crate) mod snapshot;
pub(crate) mod transfer;
mod watch;

pub(crate) use self::run::{OnStart, RunOutcome, RunSpec, RunStatus};

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use crate::docker::{Engine, EngineRef};

use self::agent::{Agent, greet};
use crate::checks::check_path;
use crate::config::SandboxConfig;
use crate::docker::container::{self, Created, Owner, short};
use crate::docker::{self, exec};
use crate::packages;
use crate::protocol::{self, Event, FileEntry, Package, Request, Variable};
use crate::sandbox::Blueprint;

/// How long an agent query (variables, packages, attach) may take.
const QUERY_TIMEOUT: Duration = Duration::from_secs(20);

/// Told when code of the previous run held the interpreter after the run had reported its
/// end, and an interrupt stopped it.
const INTERRUPTED_NOTICE: &str = "the previous run's code was still running after the run had reported its end \
                                  (code can forge that report), so it was interrupted before this call went on; \
                                  variables are kept";
/// Told when that code ignored the interrupt too.
const STUCK_NOTICE: &str = "the previous run's code was still running after the run had reported its end (code can \
                            forge that report) and ignored an interrupt, so its processes were killed and a new \
                            interpreter was started: variables are gone, workspace files are kept";
/// Largest size a listed entry may claim; nothing in a sandbox's workspace comes near it.
const MAX_ENTRY_SIZE: u64 = 1 << 40;
/// Most variables listed, and the longest name, type name and repr kept, in characters.
const MAX_VARIABLES: usize = 1000;
const MAX_VARIABLE_TEXT: usize = 200;
/// Most distributions listed, and the longest name and version kept, in characters.
const MAX_PACKAGES: usize = 10_000;
const MAX_PACKAGE_TEXT: usize = 200;

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
    /// The agent's main loop did not take a request even after the previous run was
    /// interrupted: code of an earlier run holds the interpreter and ignores interrupts.
    #[error(
        "the interpreter was still busy with code of an earlier run that ignored an interrupt, and was restarted: \
         variables are gone, workspace files are kept; try again"
    )]
    Stuck,
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
    #[error(
        "the interpreter stopped while answering: variables are gone, workspace files are kept; a new one starts on \
         the next call"
    )]
    AgentGone,
    /// A query went unanswered and the agent was killed for it: what happened, said in full.
    #[error("{0}")]
    Restarted(String),
    /// The agent refused a file request (no such file, a path leading outside the
    /// workspace, ...); the message is the agent's.
    #[error("{0}")]
    Refused(String),
    /// The server left the run to its next server (a graceful leave): it goes on, unread here.
    #[error("the server stopped and left the run to the next server of its state dir")]
    Left,
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
    /// Entries the agent reported that no workspace holds (a path out of it, an unknown
    /// kind, an absurd size), left out.
    pub dropped: usize,
}

/// The entries of a listing that could be real: a path in the canonical form that
/// [`check_path`] gives requests, a known kind, a sane size. The rest are dropped, and
/// counted: the code can answer a listing in the agent's place.
pub(super) fn checked_entries(entries: Vec<FileEntry>) -> (Vec<FileEntry>, usize) {
    let total = entries.len();
    let kept: Vec<FileEntry> = entries
        .into_iter()
        .filter(|e| {
            check_path(&e.path, false).is_ok_and(|p| p == e.path)
                && matches!(e.kind.as_str(), "file" | "dir" | "link")
                && e.size <= MAX_ENTRY_SIZE
                && e.allocated.is_none_or(|a| a <= MAX_ENTRY_SIZE)
        })
        .collect();
    let dropped = total - kept.len();
    (kept, dropped)
}

/// At most `max` characters of `text`.
fn cut(text: String, max: usize) -> String {
    if text.chars().count() > max { text.chars().take(max).collect() } else { text }
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
    /// `running`, or `hibernated`: saved and its container removed; the next call wakes it.
    pub state: String,
    /// Seconds until an idle running session is hibernated (absent when hibernated, or when
    /// hibernation is off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hibernates_in_s: Option<u64>,
    /// Why its variables were last lost (out of memory, its container replaced, a restore
    /// that failed...) and how long ago, within the last hour.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_lost: Option<String>,
}

/// What only the holder of the session's async mutex may touch.
struct Inner {
    container: Created,
    /// `None` once the agent is lost; the next call starts a new one.
    agent: Option<Agent>,
    /// The time limit of the last run, when it ended with `done` and the code's processes
    /// were not killed since: code may go on under it, never past it (`watch.rs`).
    lease: Option<tokio::time::Instant>,
    /// A watchdog task looks after `lease`.
    watched: bool,
    /// What happened between calls, for the next run to tell.
    pending: Vec<String>,
    /// The interpreter's state was lost between calls, for the next run to tell.
    pending_lost: bool,
    /// The pid of the agent a dropped stream reached, when its next attach should reach the
    /// same one (docs/design.md D12): another pid answering means its state is gone.
    reattach_pid: Option<u32>,
    /// Set while the session is hibernated: its snapshot; the container is gone.
    sleeping: Option<snapshot::Saved>,
}

impl Inner {
    fn new(container: Created, agent: Agent) -> Self {
        Self {
            container,
            agent: Some(agent),
            lease: None,
            watched: false,
            pending: Vec::new(),
            pending_lost: false,
            reattach_pid: None,
            sleeping: None,
        }
    }
}

/// One session.
pub struct Session {
    /// Session name.
    pub name: String,
    /// Owner.
    pub principal: String,
    /// Environment it was created in, for life.
    pub environment: String,
    /// Itself, for the watchdog it starts.
    me: Weak<Session>,
    /// Wakes the watchdog when the lease changes.
    lease_changed: Arc<tokio::sync::Notify>,
    docker: EngineRef,
    cfg: Arc<SandboxConfig>,
    /// What its containers are made from (the same `cfg`, the engine's spec, its egress).
    blueprint: Arc<Blueprint>,
    image: String,
    owner: Owner,
    inner: tokio::sync::Mutex<Inner>,
    /// Container id, readable without waiting for a run (close kills a busy session).
    container: std::sync::Mutex<Created>,
    last_used: std::sync::Mutex<Instant>,
    created: SystemTime,
    runs: AtomicU64,
    /// Set by close: nothing may recreate the container afterwards. Not a state in [`Inner`],
    /// because close must not wait for a run that holds the mutex.
    closed: AtomicBool,
    /// Held (read) while the session's container changes (a new one made and stored, or
    /// removed for a hibernation); `close` waits for it (write), so it removes the container
    /// that is the session's in the end, once, and detaches the egress network only when no
    /// container of the session is left on it (`recorded.rs`, `may_make`).
    making: tokio::sync::RwLock<()>,
    /// The id of the container last removed ([`Session::remove_once`]).
    removed: std::sync::Mutex<Option<String>>,
    /// The layers on its path, in the order asked for: attached again to every new agent.
    layers: std::sync::Mutex<Vec<packages::Layer>>,
    /// Requirements installed: those of its layers.
    packages: std::sync::Mutex<BTreeSet<String>>,
    /// Environment variables set for every run of the session.
    env: std::sync::Mutex<BTreeMap<String, String>>,
    /// Runs holding or waiting for the session.
    waiting: AtomicUsize,
    /// Python version of the interpreter, set at each greeting. Outside [`Inner`] so that
    /// listings can read it while a run holds the session.
    python: std::sync::Mutex<String>,
    /// Pid of the agent last greeted (0: none yet), for the session's record
    /// (`recorded.rs`).
    agent_pid: AtomicU32,
    /// Why and when its state was last lost (`ended.rs`).
    lost: ended::LastLoss,
    /// Adopted with its container stopped by its tether and gone, its volumes kept
    /// (`orphan.rs`): asleep until its first call makes it a container on them again.
    left_stopped: AtomicBool,
    /// Where a wake takes its container from, when the warm pool holds containers of the
    /// session's image.
    pub(crate) pool: std::sync::OnceLock<snapshot::PoolTake>,
    /// The hibernation snapshot while the session sleeps; readable without the lock.
    asleep: std::sync::Mutex<Option<snapshot::Saved>>,
    /// The snapshot of a hibernation under way, from its record's write until it is listed
    /// asleep: any record written meanwhile (`set_env` does not wait for the session) is the
    /// sleeper's, never a running one for the container being removed.
    hibernating: std::sync::Mutex<Option<crate::durable::records::SavedRecord>>,
    /// The state dir's records, which follow the session's state (`recorded.rs`).
    ledger: crate::durable::ledger::Ledger,
    /// The record the session has there now.
    recorded: std::sync::Mutex<Option<crate::durable::ledger::Key>>,
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

/// Makes a session container from `blueprint`, with every dependency set read-only (a session
/// reaches the sets it asked for by name, docs/design.md D6). The layer store is opened first:
/// a mount of a missing volume would make an unlabelled one, with no secret.
async fn make_container(
    docker: &dyn Engine,
    blueprint: &Blueprint,
    image: &str,
    owner: &Owner,
    label: &str,
    principal: &str,
) -> Result<Created, docker::Error> {
    let store = open_store(docker).await?;
    blueprint.create(docker, store.session_mount(), image, owner, label, principal).await
}

/// The layer store, which every session container mounts read-only.
async fn open_store(docker: &dyn Engine) -> Result<packages::Store, docker::Error> {
    packages::Store::open(docker).await.map_err(|e| match e {
        packages::Error::Docker(e) => e,
        // A plain message (`NoBaseImage` prints its text as is).
        other => docker::Error::NoBaseImage(format!("cannot open the layer store: {other}")),
    })
}

/// A started container whose agent has greeted, not yet anyone's session (the warm pool).
pub struct Prepared {
    inner: Inner,
    python: String,
}

impl Prepared {
    /// Creates a container under `label` and starts its agent.
    pub async fn make(
        docker: &dyn Engine,
        blueprint: &Blueprint,
        image: &str,
        owner: &Owner,
        label: &str,
        principal: &str,
    ) -> Result<Self, Error> {
        let created = make_container(docker, blueprint, image, owner, label, principal).await?;
        match greet(docker, &created, label).await {
            Ok((agent, python)) => Ok(Self { inner: Inner::new(created, agent), python }),
            Err(e) => {
                blueprint.remove(docker, &created).await;
                Err(e)
            }
        }
    }

    /// Its container's id.
    pub(crate) fn container_id(&self) -> &str {
        &self.inner.container.id
    }

    /// Removes its container and volumes.
    pub async fn destroy(self, docker: &dyn Engine) {
        container::destroy(docker, &self.inner.container).await;
    }
}

impl Session {
    /// Creates the container and starts the agent.
    pub async fn start(
        docker: EngineRef,
        blueprint: Arc<Blueprint>,
        image: String,
        owner: Owner,
        naming: Naming,
        packages: Vec<String>,
    ) -> Result<Arc<Self>, Error> {
        let prepared = Prepared::make(&docker, &blueprint, &image, &owner, &naming.name, &naming.principal).await?;
        Ok(Self::adopt(docker, blueprint, image, owner, naming, packages, prepared))
    }

    /// Makes a prepared container someone's session.
    #[allow(clippy::too_many_arguments)] // the parts of a session, each needed once
    pub fn adopt(
        docker: EngineRef,
        blueprint: Arc<Blueprint>,
        image: String,
        owner: Owner,
        naming: Naming,
        packages: Vec<String>,
        prepared: Prepared,
    ) -> Arc<Self> {
        let Naming { name, principal, environment } = naming;
        let created = prepared.inner.container.clone();
        tracing::info!(session = %name, container = %short(&created.id), "session created");
        let pid = prepared.inner.agent.as_ref().and_then(Agent::pid).unwrap_or(0);
        let ledger = crate::durable::ledger::Ledger::of(&blueprint.cfg);
        let session = Arc::new_cyclic(|me| Self {
            name,
            principal,
            environment,
            me: me.clone(),
            lease_changed: Arc::new(tokio::sync::Notify::new()),
            docker,
            cfg: blueprint.cfg.clone(),
            blueprint,
            image,
            owner,
            inner: tokio::sync::Mutex::new(prepared.inner),
            container: std::sync::Mutex::new(created),
            last_used: std::sync::Mutex::new(Instant::now()),
            created: SystemTime::now(),
            runs: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            making: tokio::sync::RwLock::new(()),
            removed: std::sync::Mutex::new(None),
            layers: std::sync::Mutex::new(Vec::new()),
            packages: std::sync::Mutex::new(packages.into_iter().collect()),
            env: std::sync::Mutex::new(BTreeMap::new()),
            waiting: AtomicUsize::new(0),
            python: std::sync::Mutex::new(prepared.python),
            agent_pid: AtomicU32::new(pid),
            lost: ended::LastLoss::default(),
            left_stopped: AtomicBool::new(false),
            pool: std::sync::OnceLock::new(),
            asleep: std::sync::Mutex::new(None),
            hibernating: std::sync::Mutex::new(None),
            ledger,
            recorded: std::sync::Mutex::new(None),
        });
        session.write_through();
        session
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

    /// Its environment's read-only host folders.
    pub fn mounts(&self) -> &[crate::environment::MountSpec] {
        &self.blueprint.mounts
    }

    /// The image its container runs.
    pub fn image(&self) -> &str {
        &self.image
    }

    /// The id of the session's current container.
    pub fn container_id(&self) -> String {
        self.container.lock().map(|c| c.id.clone()).unwrap_or_default()
    }

    /// The session's current container and the uid its code runs as, read together.
    pub fn container_and_uid(&self) -> (String, u32) {
        self.container.lock().map(|c| (c.id.clone(), c.uid)).unwrap_or_default()
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
        let python = self.python.lock().map(|p| p.clone()).unwrap_or_default();
        SessionInfo {
            session: self.name.clone(),
            python,
            environment: self.environment.clone(),
            runs: self.runs.load(Ordering::Relaxed),
            idle_s: idle.as_secs(),
            age_s: self.created.elapsed().map(|d| d.as_secs()).unwrap_or(0),
            expires_in_s: self.cfg.idle_ttl().saturating_sub(idle).as_secs(),
            state: if self.is_asleep() { "hibernated" } else { "running" }.into(),
            hibernates_in_s: match self.cfg.hibernate_after() {
                Some(after) if !self.is_asleep() => Some(after.saturating_sub(idle).as_secs()),
                _ => None,
            },
            state_lost: self.lost.describe(),
        }
    }

    async fn start_agent(&self, inner: &mut Inner) -> Result<(), Error> {
        let (mut agent, python) = greet(&self.docker, &inner.container, &self.name).await?;
        self.agent_pid.store(agent.pid().unwrap_or(0), Ordering::Relaxed);
        // A new interpreter has the session's layers at once, as the old one had them.
        let sites: Vec<String> =
            self.layers.lock().map(|l| l.iter().map(|l| l.site.clone()).collect()).unwrap_or_default();
        // The interpreter a dropped stream left running has them already, and may be busy
        // with a run (a job) that its main loop will not leave to answer.
        let same = inner.reattach_pid.is_some() && inner.reattach_pid == agent.pid();
        if !sites.is_empty() && !same {
            let id = agent.submit(|id| Request::Attach { id, paths: &sites }).await?;
            let missing = agent.answer(id, attached, QUERY_TIMEOUT).await?;
            if !missing.is_empty() {
                // Prunes keep the sets a session uses; one gone anyway cannot come back here.
                tracing::warn!(session = %self.name, ?missing, "layers missing from the store");
            }
        }
        inner.agent = Some(agent);
        if let Ok(mut p) = self.python.lock() {
            *p = python;
        }
        self.write_through();
        Ok(())
    }

    /// Makes sure an agent is running, restarting it (or the whole container) if needed.
    /// Returns a notice when state was lost on the way.
    async fn ensure_agent(&self, inner: &mut Inner) -> Result<Option<String>, Error> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Closed);
        }
        if inner.sleeping.is_some() {
            // Boxed: a wake restores, and a failed restore starts a fresh agent through here.
            Box::pin(self.wake(inner)).await?;
        }
        if let Some(agent) = inner.agent.as_mut() {
            if !agent.stream_ended() {
                return Ok(None);
            }
            // The exec stream dropped between calls (docs/design.md D12): the agent may live
            // on under its keeper; the next attach tells.
            tracing::info!(session = %self.name, "the stream to the interpreter ended between calls; reattaching");
            inner.reattach_pid = agent.pid();
            inner.agent = None;
        }
        if container::is_running(&self.docker, &inner.container.id).await? {
            match self.start_agent(inner).await {
                Ok(()) => return Ok(self.after_reattach(inner).await),
                // Exhausted pids, a wedged filesystem, an agent that will not greet: a new
                // container is the last resort of docs/design.md D5.
                Err(e) => {
                    tracing::warn!(session = %self.name, error = %e, "cannot restart the agent; replacing the container")
                }
            }
        } else if self.left_stopped.swap(false, Ordering::SeqCst) {
            // Stopped by its tether while no server held it, its volumes kept (orphan.rs).
            match self.restart_stopped(inner).await {
                Ok(notice) => return Ok(Some(notice)),
                Err(Error::Closed) => return Err(Error::Closed),
                Err(e) => {
                    tracing::warn!(session = %self.name, error = %e, "cannot wake a session its server had left; recreating")
                }
            }
        } else {
            tracing::warn!(session = %self.name, container = %short(&inner.container.id), "container gone; recreating");
        }
        inner.reattach_pid = None;
        {
            // Closed during a wake or a restart that failed for it: no container to make.
            let _making = self.may_make().await?;
            // Its egress policy goes too: on Kubernetes, once found gone at the latest.
            self.remove_once(&inner.container).await;
            inner.lease = None;
            let made =
                make_container(&self.docker, &self.blueprint, &self.image, &self.owner, &self.name, &self.principal)
                    .await?;
            self.take_container(inner, made)?;
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
        inner.reattach_pid = None;
        match exec::kill_code_processes(&self.docker, &inner.container.id, inner.container.uid).await {
            Ok(()) => inner.lease = None,
            Err(e) => tracing::warn!(session = %self.name, error = %e, "cannot kill code processes"),
        }
        self.ensure_agent(inner).await
    }

    /// Sends the request `make(id)` and waits for the agent's main loop to take it. When code
    /// of an earlier run holds the interpreter, it is interrupted (said by the next run); when
    /// it ignores that too, its processes are killed, the request goes once more to a fresh
    /// agent, and the next run says the state was lost.
    async fn submit<'r>(&self, inner: &mut Inner, make: &impl Fn(u64) -> Request<'r>) -> Result<u64, Error> {
        let mut retried = false;
        loop {
            let Some(agent) = inner.agent.as_mut() else { return Err(Error::AgentGone) };
            let sent = agent.submit(make).await;
            if agent.take_interrupted().is_some() {
                inner.pending.push(INTERRUPTED_NOTICE.into());
            }
            match sent {
                Err(Error::Stuck) if !retried => {
                    retried = true;
                    tracing::warn!(session = %self.name, "code of an earlier run holds the interpreter; restarting it");
                    inner.pending.push(STUCK_NOTICE.into());
                    inner.pending_lost = true;
                    let notes = self.recover(inner).await;
                    inner.pending.extend(notes);
                }
                Err(Error::Stuck) => {
                    // Not even a fresh agent took it: kill what there is; the next call starts anew.
                    let notes = self.recover(inner).await;
                    inner.pending.extend(notes);
                    return sent;
                }
                Err(Error::AgentGone) => {
                    inner.agent = None;
                    return sent;
                }
                other => return other,
            }
        }
    }

    /// Sends the request `make(id)` and waits for the answer `pick` recognises. An agent
    /// that stopped is dropped, to be restarted by the next call; one that does not answer
    /// in time is restarted now, and the error says the state went with it
    /// ([`Error::Restarted`]): a read-only call never wipes a session silently.
    async fn query<'r, T>(
        &self,
        inner: &mut Inner,
        make: impl Fn(u64) -> Request<'r>,
        pick: impl Fn(u64, Event) -> Option<T>,
    ) -> Result<T, Error> {
        let id = self.submit(inner, &make).await?;
        let Some(agent) = inner.agent.as_mut() else { return Err(Error::AgentGone) };
        match agent.answer(id, pick, QUERY_TIMEOUT).await {
            Err(Error::AgentGone) => {
                inner.agent = None;
                Err(Error::AgentGone)
            }
            Err(Error::AgentTimeout(t)) => {
                let why = format!("the interpreter did not answer within {} s", t.as_secs());
                tracing::warn!(session = %self.name, "{why}; restarting it");
                Err(Error::Restarted(match self.restart_agent(inner).await {
                    Ok(None) => format!("{why}, so it was restarted: variables are gone, workspace files are kept"),
                    Ok(Some(notice)) => format!("{why}, so it was restarted; {notice}"),
                    Err(e) => format!(
                        "{why}, so it was stopped: variables are gone; no new one could be started yet ({e}), \
                         the next call tries again"
                    ),
                }))
            }
            answer => answer,
        }
    }

    /// The user's variables, at most [`MAX_VARIABLES`] with their texts cut (the code can
    /// answer in the agent's place), and notices.
    pub async fn variables(&self) -> Result<(Vec<Variable>, Vec<String>), Error> {
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
        let mut notices: Vec<String> = notice.into_iter().collect();
        if vars.len() > MAX_VARIABLES {
            notices.push(format!("{} more variables are not listed", vars.len() - MAX_VARIABLES));
        }
        let vars = vars
            .into_iter()
            .take(MAX_VARIABLES)
            .map(|v| Variable {
                name: cut(v.name, MAX_VARIABLE_TEXT),
                kind: cut(v.kind, MAX_VARIABLE_TEXT),
                repr: cut(v.repr, MAX_VARIABLE_TEXT),
            })
            .collect();
        Ok((vars, notices))
    }

    /// Installed distributions visible to the code.
    pub async fn installed(&self) -> Result<Vec<Package>, Error> {
        let mut inner = self.inner.lock().await;
        self.touch();
        self.ensure_agent(&mut inner).await?;
        let packages = self
            .query(
                &mut inner,
                |id| Request::Packages { id },
                |id, ev| match ev {
                    Event::Packages { id: i, packages } if i == id => Some(packages),
                    _ => None,
                },
            )
            .await?;
        let packages = packages
            .into_iter()
            .take(MAX_PACKAGES)
            .map(|p| Package { name: cut(p.name, MAX_PACKAGE_TEXT), version: cut(p.version, MAX_PACKAGE_TEXT) })
            .collect();
        Ok(packages)
    }

    /// Adds environment variables to every later run of the session.
    pub fn set_env(&self, vars: &BTreeMap<String, String>) {
        if let Ok(mut env) = self.env.lock() {
            env.extend(vars.clone());
        }
        self.write_through();
    }

    /// The session's own environment variables.
    pub fn env(&self) -> BTreeMap<String, String> {
        self.env.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// A workspace file request; [`Error::Refused`] when the agent refused it (no such file,
    /// a path leading outside the workspace, ...).
    pub async fn file<'r>(&self, make: impl Fn(u64) -> Request<'r>) -> Result<FileReply, Error> {
        let mut inner = self.inner.lock().await;
        self.touch();
        self.ensure_agent(&mut inner).await?;
        self.query(&mut inner, make, agent::file_answer).await?.map_err(Error::Refused)
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

    /// Puts a layer of the store on the session's path (its interpreter's and its children's)
    /// and records its requirements; the interpreter state is kept.
    pub async fn add_layer(&self, layer: &packages::Layer, requirements: &[String]) -> Result<(), Error> {
        let mut inner = self.inner.lock().await;
        self.touch();
        self.ensure_agent(&mut inner).await?;
        let paths = [layer.site.clone()];
        let missing = self.query(&mut inner, |id| Request::Attach { id, paths: &paths }, attached).await?;
        if let Some(e) = gone_layers(&missing) {
            return Err(e);
        }
        if let Ok(mut l) = self.layers.lock() {
            l.push(layer.clone());
        }
        if let Ok(mut p) = self.packages.lock() {
            p.extend(requirements.iter().cloned());
        }
        self.write_through();
        Ok(())
    }

    /// The layers on the session's path, in the order asked for.
    pub fn layers(&self) -> Vec<packages::Layer> {
        self.layers.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// The keys of the layers on the session's path.
    pub fn layer_keys(&self) -> Vec<String> {
        self.layers.lock().map(|l| l.iter().map(|l| l.key.clone()).collect()).unwrap_or_default()
    }

    /// Fresh interpreter in the same container: variables and processes gone, files kept.
    pub async fn reset(&self) -> Result<Option<String>, Error> {
        let mut inner = self.inner.lock().await;
        self.touch();
        if inner.sleeping.is_some() {
            // Its files are in the snapshot: woken first, then the interpreter goes.
            self.ensure_agent(&mut inner).await?;
            inner.pending.clear();
            inner.pending_lost = false;
        }
        self.restart_agent(&mut inner).await
    }

    /// Removes the container and its volume. A run in progress ends with its agent gone.
    pub async fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        // A container being made now is stored before this reads it (`may_make`).
        drop(self.making.write().await);
        let created = self.container.lock().map(|c| c.clone()).ok();
        self.write_through();
        if let Some(c) = created {
            self.remove_once(&c).await;
            tracing::info!(session = %self.name, container = %short(&c.id), "session closed");
        }
        if let Some(stored) = self.asleep_store() {
            crate::docker::snapshot::remove(&self.docker, &stored).await;
        }
    }
}

/// Recognises the answer to the attach request `id`: the paths the agent did not find.
fn attached(id: u64, ev: Event) -> Option<Vec<String>> {
    match ev {
        Event::Attached { id: i, missing } if i == id => Some(missing),
        _ => None,
    }
}

/// The error for layers a session was to attach and did not find: another server pruned them
/// since this one looked. Forgotten, so the next ask installs them again.
fn gone_layers(missing: &[String]) -> Option<Error> {
    if missing.is_empty() {
        return None;
    }
    for m in missing {
        packages::forget(m);
    }
    Some(Error::Install(
        "a package set was removed from the layer cache meanwhile (pruned); ask again to install it anew".into(),
    ))
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("name", &self.name)
            .field("principal", &self.principal)
            .field("environment", &self.environment)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared").finish_non_exhaustive()
    }
}
