//! All sessions of a server: lookup by (principal, name), the session cap, the idle reaper,
//! and cleanup at start and at shutdown (docs/design.md D9).
//!
//! Why this file passes 500 lines: lookup, creation (pool, image, layer), caps, reaping and
//! sweeping share one lock over the sessions map; a split would pass that lock around.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bollard::Docker;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use super::ended::KEPT;
use super::{Error as SessionError, Session, SessionInfo};
use crate::config::SandboxConfig;
use crate::docker::container::Sandboxing;
use crate::docker::image::Progress;
use crate::docker::{self, container, image};
use crate::environment::{Environment, Environments};
use crate::instance::{Instance, Keeper};
use crate::packages::{self, IndexSettings, Layer};
use crate::sandbox::Blueprint;

mod adopt;
mod sleepers;
mod snapshots;

type Key = (String, String);

/// Ended sessions whose reason is kept; past it the record starts over.
const MAX_ENDED: usize = 10_000;
type Slot = Arc<OnceCell<Arc<Session>>>;

/// Why a session could not be had.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller's session cap is reached.
    #[error(
        "you have {0} sessions open (the limit per caller): close one with close_session, or wait for idle ones to expire"
    )]
    Capacity(usize),
    /// The server's session ceiling is reached; says nothing of who holds the sessions.
    #[error("the server has no room for another session right now: try again later, or close one of yours")]
    ServerFull,
    /// A tool that needs an existing session named one that does not exist.
    #[error("no session named {0:?}: run_python creates sessions; list_sessions shows the open ones")]
    NotFound(String),
    /// The session existed and ended: why, as [`Ended`] says it.
    #[error("no session named {name:?}: it {why}; run_python with that name starts a new, empty one")]
    Ended { name: String, why: String },
    /// The sandbox image could not be found or built.
    #[error("the sandbox image is unavailable: {0}")]
    Image(#[source] docker::Error),
    /// Installing packages failed.
    #[error(transparent)]
    Install(#[from] packages::Error),
    /// The session failed to start.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// No such environment.
    #[error("{0}")]
    Environment(String),
    /// The session exists in another environment.
    #[error(
        "session {session:?} runs in environment {has:?}, not {asked:?}: a session keeps its environment for life. \
         Use another session name for {asked:?}, or close_session {session:?} first (its variables and files go)"
    )]
    OtherEnvironment { session: String, has: String, asked: String },
    /// The session's network could not be had, or a caller asked to widen its allow-list.
    #[error("{0}")]
    Egress(String),
}

/// The sessions of one server instance.
pub struct Registry {
    docker: Docker,
    cfg: Arc<SandboxConfig>,
    instance: Instance,
    /// The environments, and each one's image, found or built once.
    pub environments: Environments,
    images: Mutex<HashMap<String, Arc<ImageSlot>>>,
    sessions: Mutex<HashMap<Key, Slot>>,
    index: IndexSettings,
    /// One lock per requirement set, so concurrent asks for one layer install it once.
    /// Entries nobody holds are dropped (`shared`).
    installs: Mutex<HashMap<Vec<String>, Arc<tokio::sync::Mutex<()>>>>,
    /// Background runs.
    pub jobs: super::jobs::Jobs,
    /// Run slots per principal. Entries nobody holds are dropped (`shared`).
    runs: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
    /// The warm pool: started containers of the default environment, each handed out once.
    /// Shared with sessions that wake from hibernation.
    pool: Arc<Mutex<Vec<super::Prepared>>>,
    /// Wakes the pool keeper when a container was taken.
    pool_wake: Arc<tokio::sync::Notify>,
    /// Snapshots of every principal (issue 18).
    pub(crate) snapshots: crate::durable::catalogue::Catalogue,
    /// Why recently ended sessions ended, and when, for a later call that names one and for
    /// `list_sessions`, for an hour (docs/design.md D9).
    ended: Mutex<HashMap<Key, (String, Instant)>>,
    /// Environment markers evaluated, by (image, marker): true when they hold there.
    markers: Mutex<HashMap<(String, String), bool>>,
    /// This instance's heartbeat, and sweeps waiting out a grace (docs/design.md D9).
    keeper: Keeper,
    /// The egress proxy and the networks of sessions that have egress.
    pub egress: crate::egress::Manager,
    /// What the engine found at start that shapes every sandbox (runtime, seccomp).
    sandboxing: Sandboxing,
    /// The state dir's records: adoption reads them, layer use is written there.
    ledger: crate::durable::ledger::Ledger,
    /// The operator's upstream MCP servers, for code mode (issue 30).
    pub bridge: Arc<crate::bridge::Bridge>,
}

/// An environment's image, found or built once, and the latest line of its build.
#[derive(Debug)]
struct ImageSlot {
    tag: OnceCell<String>,
    lines: tokio::sync::watch::Sender<String>,
}

impl Default for ImageSlot {
    fn default() -> Self {
        Self { tag: OnceCell::new(), lines: tokio::sync::watch::channel(String::new()).0 }
    }
}

/// A session opened for a call by [`Registry::open`].
pub struct Opened {
    /// The session.
    pub session: Arc<Session>,
    /// True when this call created it.
    pub created: bool,
    /// What the call's packages needed.
    pub installed: Installed,
}

/// What an install did.
#[derive(Debug, Clone)]
pub struct Installed {
    /// Requirements newly added to the session.
    pub added: Vec<String>,
    /// Requirements it already had.
    pub present: Vec<String>,
    /// The layer used, and whether it came from the cache.
    pub layer: Option<Layer>,
    /// Requirements whose environment marker is false in the session's environment: pip
    /// would ignore them, so they are neither installed nor recorded.
    pub skipped: Vec<String>,
}

impl Registry {
    /// A registry for this instance.
    /// Fails on a bad environment definition or an unreadable CA bundle, saying which.
    pub fn new(
        docker: Docker,
        cfg: Arc<SandboxConfig>,
        instance: Instance,
        sandboxing: Sandboxing,
    ) -> Result<Self, String> {
        let index = IndexSettings::from_config(&cfg).map_err(|e| format!("cannot read the CA bundle: {e}"))?;
        let environments = Environments::from_config(&cfg)?;
        let bridge = Arc::new(crate::bridge::Bridge::from_config(&cfg)?);
        let egress =
            crate::egress::Manager::new(docker.clone(), instance.owner.clone(), cfg.clone(), index.ca_bundle.clone())
                .with_sandboxing(&sandboxing);
        let ledger = crate::durable::ledger::Ledger::of(&cfg);
        let snapshots = crate::durable::catalogue::Catalogue::new(ledger.clone(), instance.owner.instance.clone());
        Ok(Self {
            docker,
            cfg,
            instance,
            environments,
            images: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            index,
            installs: Mutex::new(HashMap::new()),
            jobs: super::jobs::Jobs::default(),
            runs: Mutex::new(HashMap::new()),
            pool: Arc::default(),
            pool_wake: Arc::default(),
            snapshots,
            ended: Mutex::new(HashMap::new()),
            markers: Mutex::new(HashMap::new()),
            keeper: Keeper::default(),
            egress,
            sandboxing,
            ledger,
            bridge,
        })
    }

    /// What runs of `session` may call in code mode: its environment's allow-list, for its
    /// principal; `None` when that allows nothing.
    pub(crate) fn grant(&self, session: &super::Session) -> Option<Arc<crate::bridge::Grant>> {
        let env = self.environments.get(Some(&session.environment)).ok()?;
        self.bridge.grant(&env.bridge, &session.principal, &session.name)
    }

    /// What sessions of `env` (with `egress`, when they have a network) are made from.
    pub(crate) fn blueprint(
        &self,
        env: &Environment,
        egress: Option<Arc<crate::egress::Attachment>>,
    ) -> Arc<Blueprint> {
        Arc::new(Blueprint::new(env.cfg.clone(), &self.sandboxing, &env.mounts, egress))
    }

    /// The layer holding `requirements` (canonical, sorted) on an environment's image,
    /// installed if absent.
    pub async fn layer(
        &self,
        env: &Environment,
        requirements: &[String],
        progress: Progress<'_>,
    ) -> Result<Layer, Error> {
        let base = self.image(env, progress).await?;
        let lock = {
            let mut installs = self.installs.lock().unwrap_or_else(|e| e.into_inner());
            shared(&mut installs, requirements.to_vec(), Default::default)
        };
        let _guard = lock.lock().await;
        let layer = packages::ensure(
            &self.docker,
            &self.blueprint(env, None),
            &self.instance.owner,
            &base,
            requirements,
            &self.index,
            &self.egress,
            progress,
        )
        .await?;
        let state_dir = self.cfg.state_dir();
        // A file read, write and rename: off the runtime's workers.
        let (ledger, key) = (self.ledger.clone(), layer.key.clone());
        if let Err(e) = tokio::task::spawn_blocking(move || ledger.layer_used(&key)).await {
            tracing::debug!(error = %e, "cannot record layer use");
        }
        if !layer.cached && packages::over(&self.docker, self.cfg.layer_cache_mb << 20).await {
            // Never the set just made, nor one a session of ours holds (the record of this
            // instance may lag a session being created).
            let mut protect = self.layers_in_use();
            protect.push(layer.key.clone());
            let (owner, keep) = (&self.instance.owner, self.cfg.layer_cache_mb << 20);
            match packages::prune(&self.docker, &base, owner, &state_dir, keep, &protect).await {
                Ok(removed) if !removed.is_empty() => {
                    let removed: Vec<&str> = removed.iter().map(|l| l.key.as_str()).collect();
                    tracing::info!(?removed, "layer cache over its size; pruned");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot prune layers"),
            }
        }
        Ok(layer)
    }

    /// Keys of the layers this server's sessions hold.
    fn layers_in_use(&self) -> Vec<String> {
        let sessions: Vec<Arc<Session>> = self.slots().values().filter_map(|slot| slot.get().cloned()).collect();
        let mut keys: Vec<String> = sessions.iter().flat_map(|s| s.layer_keys()).collect();
        keys.sort();
        keys.dedup();
        keys
    }

    /// Writes this instance's record of the layers its sessions hold, which every prune on
    /// this host reads (docs/design.md D6): a small file, written in place of the last.
    fn record_layers(&self) {
        self.ledger.layers_in_use(&self.instance.owner.instance, &self.layers_in_use());
    }

    /// Adds requirements to a running session (a no-op for those it has).
    pub async fn install(
        &self,
        session: &Session,
        requirements: &[String],
        progress: Progress<'_>,
    ) -> Result<Installed, Error> {
        let added = session.missing(requirements);
        let present: Vec<String> = requirements.iter().filter(|r| !added.contains(r)).cloned().collect();
        if added.is_empty() {
            return Ok(Installed { added, present, layer: None, skipped: Vec::new() });
        }
        let env = self.environments.get(Some(&session.environment)).map_err(Error::Environment)?;
        let layer = self.layer(&env, &added, progress).await?;
        let attached = session.add_layer(&layer, &added).await;
        self.record_layers();
        attached?;
        Ok(Installed { added, present, layer: Some(layer), skipped: Vec::new() })
    }

    /// Splits `packages` into those to install and those whose environment marker is false
    /// where the session `name` runs (or will run): pip ignores those, so installing them
    /// would install nothing while saying it did. Markers are evaluated by the environment's
    /// own interpreter, once per image and marker. When they cannot be evaluated, nothing is
    /// skipped (pip still decides, as before).
    async fn without_false_markers(
        &self,
        principal: &str,
        name: &str,
        environment: Option<&str>,
        packages: &[String],
        progress: Progress<'_>,
    ) -> (Vec<String>, Vec<String>) {
        let unchanged = || (packages.to_vec(), Vec::new());
        if !packages.iter().any(|p| crate::deps::marker_of(p).is_some()) {
            return unchanged();
        }
        let env_name = self.find(principal, name).map(|s| s.environment.clone());
        let Ok(env) = self.environments.get(env_name.as_deref().or(environment)) else { return unchanged() };
        let Ok(image) = self.image(&env, progress).await else { return unchanged() };
        let known = |m: &str| {
            let cache = self.markers.lock().unwrap_or_else(|e| e.into_inner());
            cache.get(&(image.clone(), m.to_owned())).copied()
        };
        let mut unknown: Vec<String> = packages
            .iter()
            .filter_map(|p| crate::deps::marker_of(p))
            .filter(|m| known(m).is_none())
            .map(str::to_owned)
            .collect();
        unknown.sort();
        unknown.dedup();
        if !unknown.is_empty() {
            match packages::evaluate_markers(
                &self.docker,
                &self.blueprint(&env, None),
                &self.instance.owner,
                &image,
                &unknown,
            )
            .await
            {
                Ok(verdicts) => {
                    let mut cache = self.markers.lock().unwrap_or_else(|e| e.into_inner());
                    for (m, v) in unknown.into_iter().zip(verdicts) {
                        if let Some(v) = v {
                            cache.insert((image.clone(), m), v);
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot evaluate environment markers; pip decides"),
            }
        }
        let (mut keep, mut skipped) = (Vec::new(), Vec::new());
        for p in packages {
            if crate::deps::marker_of(p).is_some_and(|m| known(m) == Some(false)) {
                progress(&format!("{p}: skipped, marker false in this environment"));
                skipped.push(p.clone());
            } else {
                keep.push(p.clone());
            }
        }
        (keep, skipped)
    }

    /// The session `name` of `principal`, created if new, holding `packages`: the one way a
    /// call opens a session and makes sure of its packages.
    pub async fn open(
        &self,
        principal: &str,
        name: &str,
        environment: Option<&str>,
        packages: &[String],
        allow_hosts: Option<&[String]>,
        progress: Progress<'_>,
    ) -> Result<Opened, Error> {
        let (packages, skipped) = self.without_false_markers(principal, name, environment, packages, progress).await;
        let (session, created) =
            self.get_or_create_with(principal, name, environment, &packages, allow_hosts, progress).await?;
        let mut installed = if created {
            // A new session starts from the layer holding them all.
            Installed { added: packages, present: Vec::new(), layer: None, skipped: Vec::new() }
        } else {
            self.install(&session, &packages, progress).await?
        };
        installed.skipped = skipped;
        Ok(Opened { session, created, installed })
    }

    /// The engine.
    pub fn docker(&self) -> &Docker {
        &self.docker
    }

    /// An environment's image, found or built once per server (a build reports progress).
    pub async fn image(&self, env: &Environment, progress: Progress<'_>) -> Result<String, Error> {
        let slot = {
            let mut images = self.images.lock().unwrap_or_else(|e| e.into_inner());
            images.entry(env.name.clone()).or_default().clone()
        };
        if let Some(tag) = slot.tag.get() {
            return Ok(tag.clone());
        }
        // Whoever builds, every caller waiting for the image hears its progress: the first
        // call of a fresh server waits for the build its start-up began.
        let mut lines = slot.lines.subscribe();
        let build = slot.tag.get_or_try_init(|| async {
            let both = |line: &str| {
                let line = crate::output::plain_line(line);
                tracing::info!(target: "pyberth::image", environment = %env.name, "{line}");
                slot.lines.send_replace(line);
            };
            image::ensure(&self.docker, &env.cfg, &both).await
        });
        tokio::pin!(build);
        loop {
            tokio::select! {
                built = &mut build => return built.cloned().map_err(Error::Image),
                Ok(()) = lines.changed() => {
                    let line = lines.borrow_and_update().clone();
                    progress(&line);
                }
            }
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Slot>> {
        // A poisoned map is still a consistent map: every mutation is a single insert/remove.
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An existing session, or `None`.
    pub fn find(&self, principal: &str, name: &str) -> Option<Arc<Session>> {
        let slot = self.slots().get(&(principal.to_owned(), name.to_owned())).cloned()?;
        slot.get().cloned()
    }

    /// An existing session, or an error that says how to get one (and, for one that ended,
    /// why it ended).
    pub fn get(&self, principal: &str, name: &str) -> Result<Arc<Session>, Error> {
        self.find(principal, name).ok_or_else(|| self.not_found(principal, name))
    }

    /// The error for a session that is not there: why it ended, when it did recently.
    pub fn not_found(&self, principal: &str, name: &str) -> Error {
        match self.ended_why(principal, name) {
            Some(why) => Error::Ended { name: name.to_owned(), why },
            None => Error::NotFound(name.to_owned()),
        }
    }

    /// Why the session of that name ended, within the last hour.
    pub fn ended_why(&self, principal: &str, name: &str) -> Option<String> {
        let ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        let (why, at) = ended.get(&(principal.to_owned(), name.to_owned()))?;
        (at.elapsed() < KEPT).then(|| why.clone())
    }

    /// The caller's sessions that ended within the last hour: name, why, seconds ago.
    pub fn ended_of(&self, principal: &str) -> Vec<(String, String, u64)> {
        let ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<(String, String, u64)> = ended
            .iter()
            .filter(|((p, _), (_, at))| p == principal && at.elapsed() < KEPT)
            .map(|((_, n), (why, at))| (n.clone(), why.clone(), at.elapsed().as_secs()))
            .collect();
        all.sort();
        all
    }

    /// Records why a session ended (kept an hour, at most [`MAX_ENDED`] at once).
    fn ended(&self, principal: &str, name: &str, why: String) {
        let mut ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended.retain(|_, (_, at)| at.elapsed() < KEPT);
        if ended.len() >= MAX_ENDED {
            ended.clear();
        }
        ended.insert((principal.to_owned(), name.to_owned()), (why, Instant::now()));
    }

    /// The named session, created on first use in `environment` (the default when `None`),
    /// from the layer of the environment's packages plus `packages`. An existing session asked
    /// for another environment is an error. The bool is true when it was just created.
    pub async fn get_or_create(
        &self,
        principal: &str,
        name: &str,
        environment: Option<&str>,
        packages: &[String],
        progress: Progress<'_>,
    ) -> Result<(Arc<Session>, bool), Error> {
        self.get_or_create_with(principal, name, environment, packages, None, progress).await
    }

    /// [`Self::get_or_create`], a new session's egress allow-list narrowed to `allow_hosts`
    /// (an existing session keeps its own: `set_network` narrows it).
    pub async fn get_or_create_with(
        &self,
        principal: &str,
        name: &str,
        environment: Option<&str>,
        packages: &[String],
        allow_hosts: Option<&[String]>,
        progress: Progress<'_>,
    ) -> Result<(Arc<Session>, bool), Error> {
        if let Some(s) = self.find(principal, name) {
            return self.existing(s, name, environment);
        }
        let env = self.environments.get(environment).map_err(Error::Environment)?;
        // Checked before anything is made: a caller narrows the environment's list, never widens it.
        let egress = match allow_hosts {
            Some(asked) => crate::egress::policy::narrow(&env.egress, asked).map_err(Error::Egress)?,
            None => env.egress.clone(),
        };
        if let Some(why) = crate::environment::runtime_refusal(&env.cfg).filter(|_| !egress.is_empty()) {
            return Err(Error::Egress(why));
        }
        let key = (principal.to_owned(), name.to_owned());
        let slot = self.reserve(&key)?;
        if let Some(s) = slot.get() {
            return Ok((s.clone(), false));
        }
        let mut created = false;
        let naming =
            super::Naming { name: name.to_owned(), principal: principal.to_owned(), environment: env.name.clone() };
        let result = slot
            .get_or_try_init(|| async {
                created = true;
                self.make(&env, naming, packages, egress, progress).await
            })
            .await
            .cloned();
        if created {
            self.record_layers();
        }
        match result {
            Ok(s) => Ok((s, created)),
            Err(e) => {
                // Free the slot so the cap counts only live sessions; a retry starts afresh.
                let mut slots = self.slots();
                if slots.get(&key).is_some_and(|s| Arc::ptr_eq(s, &slot) && !s.initialized()) {
                    slots.remove(&key);
                }
                Err(e)
            }
        }
    }

    /// An existing session, unless the caller asked for another environment than its own.
    fn existing(&self, s: Arc<Session>, name: &str, environment: Option<&str>) -> Result<(Arc<Session>, bool), Error> {
        match environment {
            // A name that does not exist is that, before it is another environment.
            Some(e) if e != s.environment => match self.environments.get(Some(e)) {
                Err(missing) => Err(Error::Environment(missing)),
                Ok(_) => Err(Error::OtherEnvironment {
                    session: name.to_owned(),
                    has: s.environment.clone(),
                    asked: e.to_owned(),
                }),
            },
            _ => Ok((s, false)),
        }
    }

    /// The slot of `key`, reserved within the caps when it is new, so concurrent first calls
    /// make the session once.
    fn reserve(&self, key: &Key) -> Result<Slot, Error> {
        let mut slots = self.slots();
        if let Some(slot) = slots.get(key) {
            return Ok(slot.clone());
        }
        // The caller's own cap first: one caller never learns of another's use.
        if slots.keys().filter(|(p, _)| *p == key.0).count() >= self.cfg.max_sessions {
            return Err(Error::Capacity(self.cfg.max_sessions));
        }
        if slots.len() >= self.cfg.max_sessions_total {
            return Err(Error::ServerFull);
        }
        let slot: Slot = Arc::default();
        slots.insert(key.clone(), slot.clone());
        Ok(slot)
    }

    /// Makes a new session: its image, its layer, a pooled container or a new one (on its own
    /// network when it has egress), the layer attached.
    async fn make(
        &self,
        env: &Environment,
        naming: super::Naming,
        packages: &[String],
        egress: Vec<crate::egress::policy::Rule>,
        progress: Progress<'_>,
    ) -> Result<Arc<Session>, Error> {
        let (principal, name) = (naming.principal.clone(), naming.name.clone());
        let mut all: Vec<String> = env.packages.iter().chain(packages).cloned().collect();
        all.sort();
        all.dedup();
        let image = self.image(env, progress).await?;
        let layer = if all.is_empty() { None } else { Some(self.layer(env, &all, progress).await?) };
        let with_egress = !egress.is_empty();
        // Packages or not: a set is a directory put on the path, so the pool serves all.
        let taken = if env.name == self.environments.default_name() {
            self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop()
        } else {
            None
        };
        let (docker, owner) = (self.docker.clone(), self.instance.owner.clone());
        let session = match taken {
            _ if with_egress => self.start_with_egress(env, image, naming, egress).await?,
            Some(prepared) => {
                self.pool_wake.notify_one();
                Session::adopt(docker, self.blueprint(env, None), image, owner, naming, Vec::new(), prepared)
            }
            None => Session::start(docker, self.blueprint(env, None), image, owner, naming, Vec::new()).await?,
        };
        if let Some(layer) = layer
            && let Err(e) = session.add_layer(&layer, &all).await
        {
            session.close().await;
            if with_egress {
                self.egress.detach(&principal, &name).await;
            }
            return Err(Error::from(e));
        }
        if !with_egress {
            // A hibernated session wakes into a pooled container of its image (one with egress
            // needs its network: it wakes into a container of its own).
            let _ = session.pool.set(self.pool_take());
        }
        Ok(session)
    }

    /// Takes a container from the warm pool (waking its keeper to refill it), for a wake.
    fn pool_take(&self) -> super::snapshot::PoolTake {
        let (pool, wake) = (self.pool.clone(), self.pool_wake.clone());
        Arc::new(move || {
            let taken = pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
            if taken.is_some() {
                wake.notify_one();
            }
            taken
        })
    }

    /// A new session on a network of its own whose only other member is the egress proxy.
    async fn start_with_egress(
        &self,
        env: &Environment,
        image: String,
        naming: super::Naming,
        rules: Vec<crate::egress::policy::Rule>,
    ) -> Result<Arc<Session>, Error> {
        let (principal, name) = (naming.principal.clone(), naming.name.clone());
        let headers = env.egress_headers.0.clone();
        let attachment = self.egress.attach(&principal, &name, &image, rules, headers).await.map_err(Error::Egress)?;
        let blueprint = self.blueprint(env, Some(Arc::new(attachment)));
        let owner = self.instance.owner.clone();
        // Never from the pool: a pooled container has no network to put the proxy on.
        match Session::start(self.docker.clone(), blueprint, image, owner, naming, Vec::new()).await {
            Ok(s) => Ok(s),
            Err(e) => {
                self.egress.detach(&principal, &name).await;
                Err(e.into())
            }
        }
    }

    /// Narrows what `session` may reach (never widens): the list in force after, which its
    /// record keeps for a next server.
    pub async fn narrow(&self, session: &Session, asked: &[String]) -> Result<Vec<String>, String> {
        let now = self.egress.narrow(&session.principal, &session.name, asked).await?;
        session.write_through();
        Ok(now)
    }

    /// Sessions of one principal, sorted by name.
    pub fn list(&self, principal: &str) -> Vec<SessionInfo> {
        let sessions: Vec<Arc<Session>> = self
            .slots()
            .iter()
            .filter(|((p, _), _)| p == principal)
            .filter_map(|(_, slot)| slot.get().cloned())
            .collect();
        let mut infos: Vec<SessionInfo> = sessions.iter().map(|s| s.info()).collect();
        infos.sort_by(|a, b| a.session.cmp(&b.session));
        infos
    }

    /// Closes a session: its container and workspace are removed.
    pub async fn close(&self, principal: &str, name: &str) -> Result<(), Error> {
        let key = (principal.to_owned(), name.to_owned());
        let session = {
            let mut slots = self.slots();
            match slots.get(&key).and_then(|s| s.get().cloned()) {
                Some(s) => {
                    slots.remove(&key);
                    s
                }
                None => return Err(self.not_found(principal, name)),
            }
        };
        self.ended(principal, name, "was closed by close_session".into());
        session.close().await;
        self.egress.detach(principal, name).await;
        self.record_layers();
        Ok(())
    }

    /// Closes sessions idle longer than the TTL. Busy sessions are never reaped.
    pub async fn reap_idle(&self) -> usize {
        let ttl = self.cfg.idle_ttl();
        let expired: Vec<Arc<Session>> = {
            let mut slots = self.slots();
            let keys: Vec<Key> = slots
                .iter()
                .filter(|(_, slot)| slot.get().is_some_and(|s| s.idle() >= ttl && !s.is_busy()))
                .map(|(k, _)| k.clone())
                .collect();
            keys.iter().filter_map(|k| slots.remove(k)).filter_map(|slot| slot.get().cloned()).collect()
        };
        for s in &expired {
            tracing::info!(session = %s.name, idle_s = s.idle().as_secs(), "idle session reaped");
            let state = if s.is_asleep() { "hibernated" } else { "running" };
            let why = format!(
                "expired: idle for {} s, past --idle-ttl-s {} s (it was {state}); its variables and files are gone",
                s.idle().as_secs(),
                ttl.as_secs()
            );
            self.ended(&s.principal, &s.name, why);
            s.close().await;
            self.egress.detach(&s.principal, &s.name).await;
        }
        if !expired.is_empty() {
            self.record_layers();
        }
        if let Some(after) = self.cfg.hibernate_after() {
            self.hibernate_idle(after).await;
        }
        expired.len()
    }

    /// Hibernates running sessions idle for `after` (busy ones, jobs included, stay awake:
    /// a run holds its session). One at a time, so a wave of idle sessions does not crowd out
    /// running ones.
    async fn hibernate_idle(&self, after: Duration) {
        let idle: Vec<Arc<Session>> = self
            .slots()
            .values()
            .filter_map(|slot| slot.get().cloned())
            .filter(|s| s.idle() >= after && !s.is_busy() && !s.is_asleep())
            .collect();
        for s in idle {
            // Its record follows (the session writes it as it falls asleep).
            if let Err(e) = self.hibernate_within_caps(&s).await {
                tracing::warn!(session = %s.name, error = %e, "cannot hibernate; the session stays awake");
            }
        }
    }

    /// Runs the idle reaper until `shutdown` fires.
    pub async fn reaper(self: Arc<Self>, shutdown: CancellationToken) {
        let shortest = self.cfg.hibernate_after().map_or(self.cfg.idle_ttl(), |h| h.min(self.cfg.idle_ttl()));
        let period = (shortest / 4).clamp(Duration::from_millis(500), Duration::from_secs(60));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => { self.reap_idle().await; }
            }
        }
    }

    /// At start: keeps this instance's heartbeat from now on, and removes what dead instances
    /// left behind (docs/design.md D9). When some instance's heartbeat stopped too recently
    /// to call it dead, a sweep runs again once the grace is over.
    pub async fn sweep_leftovers(&self) -> Result<(), docker::Error> {
        match self.environments.get(None) {
            Ok(env) => self.keeper.beat(self.docker.clone(), env.cfg.clone(), self.instance.owner.clone()),
            Err(e) => tracing::warn!(error = %e, "no default environment; this server runs without a heartbeat"),
        }
        match self.adopt_leftovers().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(sessions = n, "adopted the sessions of stopped servers"),
            Err(e) => tracing::warn!(error = %e, "cannot adopt the sessions of stopped servers"),
        }
        let sweeper = self.instance.sweeper(self.cfg.leftover_grace()).keeping(self.cfg.idle_ttl());
        let swept = sweeper.sweep(&self.docker).await?;
        let nets = crate::egress::sweep_orphan_networks(&self.docker, &self.instance.owner.instance).await;
        if nets > 0 {
            tracing::info!(networks = nets, "removed egress networks of instances that have no containers left");
        }
        if let Some(after) = swept.recheck {
            tracing::debug!(after_s = after.as_secs(), "a heartbeat stopped recently; sweeping again after the grace");
            self.keeper.recheck(self.docker.clone(), sweeper, after);
        }
        Ok(())
    }

    /// A run slot for `principal`, held for the run's life; a clear error when all are taken.
    pub fn run_permit(&self, principal: &str) -> Result<tokio::sync::OwnedSemaphorePermit, String> {
        let max = self.cfg.max_runs_per_caller;
        let sem = {
            let mut runs = self.runs.lock().map_err(|_| "run slots unavailable".to_owned())?;
            shared(&mut runs, principal.to_owned(), || tokio::sync::Semaphore::new(max))
        };
        sem.try_acquire_owned().map_err(|_| {
            format!(
                "you have {max} runs going (the limit per caller): wait for one to finish, or cancel a job \
                 (list_jobs shows them)"
            )
        })
    }

    /// Keeps the warm pool full until `shutdown` fires, making one container at a time so
    /// refills never crowd out running sessions; then removes what is left in the pool.
    pub async fn pool_keeper(self: Arc<Self>, shutdown: CancellationToken) {
        let size = self.cfg.pool_size;
        let mut serial = 0u64;
        let mut preloaded = false;
        // Doubles after each failure (a missing image is a whole bootstrap each try), back to
        // the start after a success.
        let mut backoff = Duration::from_secs(10);
        while size > 0 && !shutdown.is_cancelled() {
            let missing = size.saturating_sub(self.pool.lock().unwrap_or_else(|e| e.into_inner()).len());
            if missing == 0 && !preloaded {
                // Once the pool is full: the layer store's listing, so that the first new
                // session asking for a cached set waits for nothing but its pooled container.
                preloaded = true;
                if let (Ok(env), owner) = (self.environments.get(None), &self.instance.owner)
                    && let Ok(image) = self.image(&env, &|_| {}).await
                {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        () = packages::preload(&self.docker, &image, owner) => {}
                    }
                }
                continue;
            }
            if missing == 0 {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = self.pool_wake.notified() => continue,
                }
            }
            serial += 1;
            let label = format!("pool-{serial}");
            // Waiting for the image may be cut short by a stop; making the container may not: a
            // container dropped half-made is one nobody would remove.
            let env = match self.environments.get(None) {
                Ok(env) => env,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot fill the warm pool");
                    break;
                }
            };
            let image = tokio::select! {
                _ = shutdown.cancelled() => break,
                image = self.image(&env, &|_| {}) => image,
            };
            let made = match image {
                Ok(image) => super::Prepared::make(
                    &self.docker,
                    &self.blueprint(&env, None),
                    &image,
                    &self.instance.owner,
                    &label,
                    "",
                )
                .await
                .map_err(Error::from),
                Err(e) => Err(e),
            };
            if shutdown.is_cancelled() {
                if let Ok(p) = made {
                    p.destroy(&self.docker).await;
                }
                break;
            }
            match made {
                Ok(p) => {
                    self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(p);
                    backoff = Duration::from_secs(10);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot fill the warm pool; retrying in {} s", backoff.as_secs());
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(600));
                }
            }
        }
        self.drain_pool().await;
    }

    async fn drain_pool(&self) {
        let left: Vec<super::Prepared> = std::mem::take(&mut *self.pool.lock().unwrap_or_else(|e| e.into_inner()));
        futures::future::join_all(left.into_iter().map(|p| p.destroy(&self.docker))).await;
    }

    /// Closes every session, then removes anything of ours still labelled (belt and braces).
    /// With `leave`, sessions stay running instead, for the next server of the state dir to
    /// adopt within `--adopt-grace-s` (docs/design.md D12): only the pool and jobs stop.
    pub async fn shutdown(&self, leave: bool) {
        self.drain_pool().await;
        // Nothing to leave: a clean stop, with nothing kept for a next server.
        let leave = leave && self.slots().values().any(|slot| slot.initialized());
        if leave {
            // Finished jobs' records are kept with the sessions the next server adopts.
            let live: std::collections::HashSet<Key> =
                self.slots().iter().filter(|(_, slot)| slot.initialized()).map(|(k, _)| k.clone()).collect();
            self.jobs.leave(&|p, s| live.contains(&(p.to_owned(), s.to_owned()))).await;
        } else {
            self.jobs.shutdown().await;
        }
        if leave {
            // Snapshots and sessions are recorded already, as they changed.
            let left = self.slots().drain().filter(|(_, slot)| slot.initialized()).count();
            self.instance.keep_lock_files();
            self.keeper.stop(&self.docker, &[], false).await;
            packages::settle().await;
            self.egress.drop_idle_installers().await;
            let stop_s = (self.cfg.orphan_after() + crate::docker::tether::MARGIN).as_secs();
            tracing::info!(
                sessions = left,
                adopt_within_s = self.cfg.adopt_grace_s,
                stop_after_s = stop_s,
                "{left} sessions left for the next server of state dir {}: it adopts them running if it starts within \
                 {} s; {stop_s} s after this stop each saves its state and its container stops (no CPU or memory), kept \
                 on disk for that server to wake. To remove them now: pyberth gc --yes --grace-s 0",
                self.cfg.state_dir().display(),
                self.cfg.adopt_grace_s,
            );
            return;
        }
        let all: Vec<Arc<Session>> = self.slots().drain().filter_map(|(_, slot)| slot.get().cloned()).collect();
        futures::future::join_all(all.iter().map(|s| s.close())).await;
        self.record_layers();
        // Installer volumes still being emptied: theirs before the sweep's.
        packages::settle().await;
        let snapshots = self.snapshots.drain();
        futures::future::join_all(
            snapshots.iter().map(|e| crate::docker::snapshot::remove(&self.docker, &e.saved.store)),
        )
        .await;
        if let Err(e) = container::sweep(&self.docker, &|l| self.instance.is_own(l)).await {
            tracing::warn!(error = %e, "final sweep failed");
        }
        self.egress.shutdown().await;
        // Last: until everything else of ours is gone, others see this instance alive.
        let mut owners = self.instance.adopted_owners();
        owners.push(self.instance.owner.clone());
        self.keeper.stop(&self.docker, &owners, true).await;
    }
}

/// The entry for `key` in a map of shared locks or semaphores, made by `make` if absent. First
/// drops the entries nobody holds, so the map keeps only what is in use: every holder got its
/// clone here, under the map's lock, so an entry whose only reference is the map's has no
/// holder and no waiter, and a fresh one made later is the same.
fn shared<K: Eq + Hash, V>(map: &mut HashMap<K, Arc<V>>, key: K, make: impl FnOnce() -> V) -> Arc<V> {
    map.retain(|_, v| Arc::strong_count(v) > 1);
    map.entry(key).or_insert_with(|| Arc::new(make())).clone()
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened").field("session", &self.session.name).field("created", &self.created).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    #[test]
    fn shared_entries_last_while_held_and_go_when_idle() {
        let mut map = HashMap::new();
        let a = shared(&mut map, "a", || Semaphore::new(1));
        let permit = a.clone().try_acquire_owned().expect("a permit");
        drop(a);
        drop(shared(&mut map, "b", || Semaphore::new(1)));
        assert_eq!(map.len(), 2, "pruned on the next call, not on release");
        // "b" is idle and goes; "a" is held by its permit and stays, the same semaphore.
        let again = shared(&mut map, "a", || Semaphore::new(1));
        assert!(!map.contains_key("b"));
        assert_eq!(again.available_permits(), 0, "the held semaphore, not a fresh one");
        drop((again, permit));
        drop(shared(&mut map, "c", || Semaphore::new(1)));
        assert_eq!(map.keys().collect::<Vec<_>>(), [&"c"], "released, \"a\" went too");
    }
}
