//! All sessions of a server: lookup by (principal, name), creation, the session and run caps
//! (docs/design.md D9). The rest of the owner sits beside it in `registry/`: `layers.rs`
//! (dependency layers and images), `lifetime.rs` (reaping, hibernation, sweeps, stop),
//! `pool/` (the warm pools, following demand), `adopt.rs` and `sleepers.rs` (sessions of earlier servers), `snapshots.rs`,
//! `front.rs` (what the fronts ask beyond sessions) and `error.rs`.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::docker::EngineRef;
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
#[cfg(test)]
mod close_tests;
mod error;
mod front;
mod layers;
mod lifetime;
mod make;
mod oversight;
#[cfg(test)]
mod owner_tests;
mod pool;
#[cfg(test)]
mod pool_tests;
mod sleepers;
mod snapshots;

pub use error::Error;

type Key = (String, String);

/// Ended sessions whose reason is kept; past it the record starts over.
const MAX_ENDED: usize = 10_000;
type Slot = Arc<OnceCell<Arc<Session>>>;

/// The sessions of one server instance.
pub struct Registry {
    docker: EngineRef,
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
    /// The warm pool of each environment in use, and what it counts (`pool/`). Shared with
    /// sessions that wake from hibernation.
    pool: Arc<Mutex<pool::Pools<super::Prepared>>>,
    /// Wakes the pool keeper when a container was asked for.
    pool_wake: Arc<tokio::sync::Notify>,
    /// Adopted sessions being reattached ahead of their first call (`adopt.rs`); aborted at
    /// shutdown.
    attaching: Mutex<tokio::task::JoinSet<()>>,
    /// The adoption at start and the reattaches it began: heartbeats start once they are done
    /// ([`Registry::after_preattaches`]).
    attached: tokio_util::task::TaskTracker,
    /// Wakes those waiting sessions when the keeper finished making one.
    pool_ready: tokio::sync::Notify,
    /// Turns of new sessions' own containers, [`make::COLD_AT_ONCE`] made at once, and each
    /// principal's share of them (`make.rs`); entries nobody holds are dropped (`shared`).
    cold: tokio::sync::Semaphore,
    colds: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
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
    egress: crate::egress::Manager,
    /// What the engine found at start that shapes every sandbox (runtime, seccomp).
    sandboxing: Sandboxing,
    /// The state dir's records: adoption reads them, layer use is written there.
    ledger: crate::durable::ledger::Ledger,
    /// The operator's upstream MCP servers, for code mode (issue 30).
    pub bridge: Arc<crate::bridge::Bridge>,
    /// The audit log and the quotas per principal (issue 32; `oversight.rs`).
    oversight: crate::audit::Oversight,
    quotas: Arc<crate::quota::Quotas>,
    /// The server's metrics: what it owns adds to them, `/metrics` reads them (issue 32).
    metrics: Arc<crate::metrics::Metrics>,
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
        docker: EngineRef,
        cfg: Arc<SandboxConfig>,
        instance: Instance,
        sandboxing: Sandboxing,
    ) -> Result<Self, String> {
        let index = IndexSettings::from_config(&cfg).map_err(|e| format!("cannot read the CA bundle: {e}"))?;
        let environments = Environments::from_config(&cfg)?;
        let bounds = crate::metrics::Bounds::new(
            environments.all().map(|e| e.name.clone()),
            cfg.upstreams.keys().cloned(),
            cfg.metrics_principal,
        );
        let metrics = Arc::new(crate::metrics::Metrics::new(bounds));
        // Every engine call of every owner, its failures counted: wrapped once, here.
        let docker = crate::docker::Counted::wrap(docker, metrics.clone());
        let bridge = Arc::new(crate::bridge::Bridge::from_config(&cfg)?.with_metrics(metrics.clone()));
        let egress =
            crate::egress::Manager::new(docker.clone(), instance.owner.clone(), cfg.clone(), index.ca_bundle.clone())
                .with_sandboxing(&sandboxing)
                .with_metrics(metrics.clone())
                .keyed_by_peer(cfg.engine == crate::config::EngineKind::Kubernetes);
        let ledger = crate::durable::ledger::Ledger::of(&cfg);
        let budget = cfg.pool_memory_mb.saturating_mul(1 << 20);
        let pools = pool::Pools::new(environments.default_name(), cfg.pool_size, cfg.pool_max, budget, Instant::now());
        let snapshots = crate::durable::catalogue::Catalogue::new(ledger.clone(), instance.owner.instance.clone());
        let quotas = Arc::new(crate::quota::Quotas::load(&cfg, Some(cfg.state_dir())));
        let oversight = crate::audit::Oversight { quotas: Some(quotas.clone()), ..Default::default() };
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
            pool: Arc::new(Mutex::new(pools)),
            pool_wake: Arc::default(),
            attaching: Mutex::default(),
            attached: tokio_util::task::TaskTracker::new(),
            pool_ready: tokio::sync::Notify::new(),
            cold: tokio::sync::Semaphore::new(make::COLD_AT_ONCE),
            colds: Mutex::default(),
            snapshots,
            ended: Mutex::new(HashMap::new()),
            markers: Mutex::new(HashMap::new()),
            keeper: Keeper::default(),
            egress,
            sandboxing,
            ledger,
            bridge,
            oversight,
            quotas,
            metrics,
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
        let mut blueprint =
            Blueprint::new(env.cfg.clone(), &self.sandboxing, &env.mounts, egress).with_metrics(self.metrics.clone());
        blueprint.oversight = self.oversight.clone();
        Arc::new(blueprint)
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
            // A new session starts from the layer holding them all (cached or installed now).
            let layer = if packages.is_empty() { None } else { session.layers().pop() };
            Installed { added: packages, present: Vec::new(), layer, skipped: Vec::new() }
        } else {
            self.install(&session, &packages, progress).await?
        };
        installed.skipped = skipped;
        Ok(Opened { session, created, installed })
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
        let _unfilled = Unfilled { reg: self, key: &key, slot: &slot };
        let result = slot
            .get_or_try_init(|| async {
                created = true;
                self.make(&env, naming, packages, egress, progress).await
            })
            .await
            .cloned();
        if created {
            self.record_layers();
            self.audit_created(principal, name, &env.name, result.as_ref().err());
        }
        result.map(|s| (s, created))
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
        self.session_quota(key, slots.keys().filter(|(p, _)| *p == key.0).count())?;
        let slot: Slot = Arc::default();
        slots.insert(key.clone(), slot.clone());
        Ok(slot)
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
        let (session, at) = {
            let mut slots = self.slots();
            match slots.get(&key).and_then(|s| s.get().cloned()) {
                Some(s) => {
                    slots.remove(&key);
                    (s, std::time::Instant::now())
                }
                None => return Err(self.not_found(principal, name)),
            }
        };
        self.ended(principal, name, "was closed by close_session".into());
        self.audit(
            crate::audit::Event::new("session_closed", principal).session(name).field("reason", "close_session"),
        );
        session.close().await;
        self.jobs.forget_session(principal, name, at);
        if let Some(network) = session.egress_network() {
            self.egress.detach_network(principal, name, network).await;
        }
        self.record_layers();
        Ok(())
    }
}

/// The entry for `key` in a map of shared locks or semaphores, made by `make` if absent. First
/// drops the entries nobody holds, so the map keeps only what is in use: every holder got its
/// clone here, under the map's lock, so an entry whose only reference is the map's has no
/// holder and no waiter, and a fresh one made later is the same.
/// Frees a session's slot that was never filled when its making ends, however it ends (an
/// error, or a caller that went away while it waited its turn), so the caps count only live
/// sessions and a retry starts afresh; not while another call still holds it (and may fill it).
struct Unfilled<'a> {
    reg: &'a Registry,
    key: &'a Key,
    slot: &'a Slot,
}

impl Drop for Unfilled<'_> {
    fn drop(&mut self) {
        let mut slots = self.reg.slots();
        let alone = Arc::strong_count(self.slot) == 2; // the map's and this call's
        if alone && slots.get(self.key).is_some_and(|s| Arc::ptr_eq(s, self.slot) && !s.initialized()) {
            slots.remove(self.key);
        }
    }
}

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
