//! A session's record follows its state (docs/design.md D12; the ledger: `durable/ledger.rs`).
//!
//! Every change of what a next server needs (created, a new agent, a new container, layers,
//! variables, egress narrowed, hibernated, woken, closed) ends in [`Session::write_through`],
//! which hands the ledger the state the session is in now: running, asleep or gone. The ledger
//! writes that record and removes the one the session had before. A session also comes back
//! from its record here ([`Session::revive`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::snapshot::{Grade, Saved};
use super::{Inner, Session};
use crate::docker::container::{self, Created};
use crate::docker::snapshot::{Stored, Summary};
use crate::durable::ledger::{Key, Ledger, SessionRecord};
use crate::durable::records::{About, Egress, Running, SavedRecord, Sleeper};
use crate::protocol::Lost;

/// How a session comes back from its record, beyond what [`About`] says.
pub(crate) struct Revived {
    /// The agent's pid to reattach to (a running session's).
    pub(crate) pid: Option<u32>,
    /// Its snapshot, for a hibernated session: woken on its next call.
    pub(crate) sleeping: Option<Saved>,
    /// Notices for its next call.
    pub(crate) pending: Vec<String>,
    /// How long it had been idle.
    pub(crate) idle: Duration,
    /// Its container was found stopped by its tether (orphan.rs): started again, not replaced.
    pub(crate) stopped: bool,
}

fn unix_ms(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()).unwrap_or(u64::MAX)
}

impl Session {
    /// Writes the record of the state the session is in now, in place of the one it had.
    /// Serialised by the `recorded` lock, so the last state written is the latest.
    pub(crate) fn write_through(&self) {
        let Ok(mut was) = self.recorded.lock() else { return };
        let asleep = self.asleep.lock().ok().and_then(|a| a.as_ref().map(SavedRecord::from));
        let hibernating = || self.hibernating.lock().ok().and_then(|h| h.clone());
        let now = self.record(asleep.or_else(hibernating));
        self.ledger.session(&mut was, &now);
    }

    /// The right to make the session a new container, for as long as the guard lives; Err
    /// once closed. `close` marks the session closed, then waits for every guard before it
    /// reads the container to remove: what a maker stored ([`Session::take_container`]) is
    /// what the close removes, once (a uid released twice could be lent to two sessions), and
    /// no container of the session is left on its egress network when the close removes it
    /// (the engine refuses while one is, and the network stayed).
    pub(super) async fn may_make(&self) -> Result<tokio::sync::RwLockReadGuard<'_, ()>, super::Error> {
        let guard = self.making.read().await;
        // After the guard: a close that marked the session before is seen here.
        if self.closed.load(Ordering::SeqCst) {
            return Err(super::Error::Closed);
        }
        Ok(guard)
    }

    /// Makes `made` the session's container (a wake, a replacement, a restart on its volumes),
    /// under the guard of [`Session::may_make`]. Err: closed meanwhile; the close, which waits
    /// for that guard, removes `made`.
    pub(super) fn take_container(&self, inner: &mut Inner, made: Created) -> Result<(), super::Error> {
        inner.container = made;
        if let Ok(mut c) = self.container.lock() {
            *c = inner.container.clone();
        }
        if self.closed.load(Ordering::SeqCst) {
            return Err(super::Error::Closed);
        }
        Ok(())
    }

    /// Removes `c` (container, volumes, egress binding, uid) unless it was removed already: a
    /// replacement whose new container failed, or a hibernation, removed it, and the close
    /// comes to it again. Its uid released twice could be lent to two sessions. Marked only
    /// once removed (the uid goes back last, with no wait after it): a removal whose call was
    /// dropped half way is done again by the next. Removers take turns (`may_make`, `close`).
    pub(super) async fn remove_once(&self, c: &Created) {
        let removed = || self.removed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if removed().as_ref() == Some(&c.id) {
            return;
        }
        self.blueprint.remove(&self.docker, c).await;
        *removed() = Some(c.id.clone());
    }

    /// The session's own egress network, if it has egress: what its egress is taken off by.
    pub(crate) fn egress_network(&self) -> Option<&str> {
        self.blueprint.egress.as_ref().map(|a| a.network.as_str())
    }

    /// A hibernation to `saved` begins (`Some`: recorded asleep from now, before its container
    /// goes) or is over (`None`: listed asleep by then). Either way the record is written.
    pub(crate) fn hibernating(&self, saved: Option<&Saved>) {
        if let Ok(mut h) = self.hibernating.lock() {
            *h = saved.map(SavedRecord::from);
        }
        self.write_through();
    }

    /// The record of the session, asleep in `asleep` or else running.
    fn record(&self, asleep: Option<SavedRecord>) -> SessionRecord {
        if self.closed.load(Ordering::SeqCst) {
            return SessionRecord::Gone;
        }
        let Ok(created) = self.container.lock().map(|c| c.clone()) else { return SessionRecord::Gone };
        match asleep {
            Some(saved) => SessionRecord::Sleeping(Box::new(Sleeper {
                about: self.about(created),
                last_used_ms: unix_ms(SystemTime::now().checked_sub(self.idle()).unwrap_or(UNIX_EPOCH)),
                saved,
                egress: self.blueprint.egress.as_ref().map(|a| a.allow()),
            })),
            None => SessionRecord::Running(Box::new(Running {
                about: self.about(created),
                pid: self.agent_pid.load(Ordering::Relaxed),
                egress: self.blueprint.egress.as_ref().map(|a| Egress {
                    network: a.network.clone(),
                    proxy_ip: a.proxy_ip,
                    allow: a.allow(),
                }),
            })),
        }
    }

    /// What the records of this session keep of it, `created` being its container.
    fn about(&self, created: Created) -> About {
        About {
            instance: self.owner.instance.clone(),
            principal: self.principal.clone(),
            name: self.name.clone(),
            environment: self.environment.clone(),
            image: self.image.clone(),
            container: created.id,
            volume: created.volume,
            uid: created.uid,
            layers: self.layers(),
            packages: self.requirements(),
            env: self.env(),
            python: self.python.lock().map(|p| p.clone()).unwrap_or_default(),
        }
    }

    /// After an agent answered where a dropped stream's agent was expected: a notice when it
    /// is another one (that one is gone, and its state with it).
    pub(super) fn reattached(&self, inner: &mut Inner) -> Option<String> {
        let expected = inner.reattach_pid.take()?;
        let now = inner.agent.as_ref().and_then(super::agent::Agent::pid);
        if now == Some(expected) {
            tracing::info!(session = %self.name, pid = expected, "reattached to the running interpreter");
            return None;
        }
        tracing::warn!(session = %self.name, "the interpreter had stopped while no server was attached; a new one started");
        Some(
            "the interpreter had stopped while no server was attached to it, and a new one was started: variables \
             are gone, workspace files are kept"
                .into(),
        )
    }

    /// A session from its record: running (reattached on its first call) or hibernated. Its
    /// record stays as it is until its next change.
    pub(crate) fn revive(
        docker: crate::docker::EngineRef,
        blueprint: Arc<crate::sandbox::Blueprint>,
        owner: container::Owner,
        about: About,
        how: Revived,
    ) -> Arc<Self> {
        let created = Created { id: about.container, volume: about.volume, uid: about.uid };
        let recorded = match &how.sleeping {
            Some(s) => Key::Sleeping(s.store.volume.clone()),
            None => Key::Running(created.id.clone()),
        };
        // A running one's uid is lent to it here as to any container of this server (its
        // removal gives it back); a sleeper's container was removed by the server before,
        // and its uid is not this server's to give back.
        let removed = match how.sleeping {
            Some(_) => Some(created.id.clone()),
            None => {
                crate::docker::identity::reserve(created.uid);
                None
            }
        };
        let inner = Inner {
            container: created.clone(),
            agent: None,
            lease: None,
            watched: false,
            pending: how.pending,
            pending_lost: false,
            reattach_pid: how.pid,
            sleeping: how.sleeping.clone(),
        };
        let ledger = Ledger::of(&blueprint.cfg);
        Arc::new_cyclic(|me| Self {
            name: about.name,
            principal: about.principal,
            environment: about.environment,
            me: me.clone(),
            lease_changed: Arc::new(tokio::sync::Notify::new()),
            docker,
            cfg: blueprint.cfg.clone(),
            blueprint,
            image: about.image,
            owner,
            inner: tokio::sync::Mutex::new(inner),
            container: std::sync::Mutex::new(created),
            last_used: std::sync::Mutex::new(Instant::now().checked_sub(how.idle).unwrap_or_else(Instant::now)),
            created: SystemTime::now(),
            runs: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            making: tokio::sync::RwLock::new(()),
            removed: std::sync::Mutex::new(removed),
            layers: std::sync::Mutex::new(about.layers),
            packages: std::sync::Mutex::new(about.packages.into_iter().collect()),
            env: std::sync::Mutex::new(about.env),
            waiting: AtomicUsize::new(0),
            python: std::sync::Mutex::new(about.python),
            agent_pid: AtomicU32::new(how.pid.unwrap_or(0)),
            lost: super::ended::LastLoss::default(),
            left_stopped: AtomicBool::new(how.stopped),
            pool: std::sync::OnceLock::new(),
            asleep: std::sync::Mutex::new(how.sleeping),
            hibernating: std::sync::Mutex::new(None),
            ledger,
            recorded: std::sync::Mutex::new(Some(recorded)),
        })
    }
}

impl From<&Saved> for SavedRecord {
    fn from(s: &Saved) -> Self {
        Self {
            volume: s.store.volume.clone(),
            environment: s.environment.clone(),
            requirements: s.requirements.clone(),
            env: s.env.clone(),
            files: s.summary.files,
            workspace_bytes: s.summary.workspace_bytes,
            state_bytes: s.summary.state_bytes,
            skipped: s.summary.skipped,
            meta: s.summary.meta.clone(),
            sizes: s.summary.sizes.clone(),
            digests: s.summary.digests.clone(),
            packed: s.summary.packed,
            globals: s.grade == Grade::FilesAndGlobals,
            saved: s.saved.clone(),
            lost: s.lost.iter().map(|l| (l.name.clone(), l.why.clone())).collect(),
            took_ms: u64::try_from(s.took.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

impl From<SavedRecord> for Saved {
    fn from(r: SavedRecord) -> Self {
        Saved {
            store: Stored { volume: r.volume },
            environment: r.environment,
            requirements: r.requirements,
            env: r.env,
            summary: Summary {
                files: r.files,
                workspace_bytes: r.workspace_bytes,
                state_bytes: r.state_bytes,
                skipped: r.skipped,
                meta: r.meta,
                sizes: r.sizes,
                digests: r.digests,
                packed: r.packed,
            },
            grade: if r.globals { Grade::FilesAndGlobals } else { Grade::Files },
            saved: r.saved,
            lost: r.lost.into_iter().map(|(name, why)| Lost { name, why }).collect(),
            took: Duration::from_millis(r.took_ms),
            // How long the saving's parts took is not kept across a restart.
            state_took: Duration::ZERO,
            copy_took: Duration::ZERO,
        }
    }
}
