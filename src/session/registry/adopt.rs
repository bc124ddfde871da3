//! Sessions that outlive their server (docs/design.md D12).
//!
//! Each session's container is described by a record in the state dir
//! (`<state dir>/sessions/<container>.json`): whose it is, its name, environment, image,
//! packages, variables set with `set_env`, and its agent's pid. Labels cannot say it all: a
//! container taken from the warm pool keeps the pool's labels, and what changes while a
//! session runs (packages, env) cannot be relabelled. The state dir is private to the server's
//! user, so nothing in a container can write a record.
//!
//! A server that starts finds the containers of dead instances of its state dir (their lock
//! free: [`crate::instance::Instance::claim_adoptable`]) whose heartbeat stopped less than
//! `--adopt-grace-s` ago, re-registers the sessions whose records it has, and removes the
//! rest of those instances' resources. It holds their locks and keeps their heartbeats beating
//! from then on, so no other server sweeps what it adopted; the interpreter is reached again
//! through its keeper on the session's first call.

use std::collections::{BTreeMap, HashSet};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::{Registry, Slot};
use crate::docker::container::{self, Created, short};
use crate::docker::{self, LABEL_HOST, LABEL_INSTANCE};
use crate::session::{Inner, Session};

/// Folder of the records, in the state dir.
const DIR: &str = "sessions";

/// What a server needs to take a running session over.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    #[serde(flatten)]
    about: About,
    /// The agent's pid when the record was written (0: unknown).
    pid: u32,
    /// Its egress, if it has any.
    #[serde(default)]
    egress: Option<Egress>,
}

/// What both records of a session keep: this one of a running session, and
/// `sleepers::Sleeper` of a hibernated one.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct About {
    /// The instance its container is labelled with.
    pub(super) instance: String,
    pub(super) principal: String,
    pub(super) name: String,
    pub(super) environment: String,
    pub(super) image: String,
    pub(super) container: String,
    pub(super) volume: String,
    pub(super) uid: u32,
    /// The sets on its path, attached again to every new interpreter.
    #[serde(default)]
    pub(super) layers: Vec<crate::packages::Layer>,
    pub(super) packages: Vec<String>,
    pub(super) env: BTreeMap<String, String>,
    pub(super) python: String,
}

/// How a session comes back from its record, beyond what [`About`] says.
pub(super) struct Revived {
    /// The agent's pid to reattach to (a running session's).
    pub(super) pid: Option<u32>,
    /// Its snapshot, for a hibernated session: woken on its next call.
    pub(super) sleeping: Option<crate::session::snapshot::Saved>,
    /// Notices for its next call.
    pub(super) pending: Vec<String>,
    /// How long it had been idle.
    pub(super) idle: std::time::Duration,
}

/// A session's egress as its record keeps it: header values are not kept (they come from the
/// adopting server's config, by environment and host), nor the CA (a new one each start).
#[derive(Debug, Serialize, Deserialize)]
struct Egress {
    /// Its own network (labelled with the instance that made it).
    network: String,
    /// The proxy's address there, which the session's proxy variables name.
    proxy_ip: std::net::IpAddr,
    /// The allow-list in force, `set_network` narrowing included.
    allow: Vec<String>,
}

/// The record of `container`: container names are ours (`pyberth-<instance>-<session>-<n>`),
/// anything else never reaches a path.
fn record_path(state_dir: &Path, container: &str) -> Option<PathBuf> {
    let plain = !container.is_empty()
        && container.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !container.starts_with('.');
    plain.then(|| state_dir.join(DIR).join(format!("{container}.json")))
}

fn write_record(path: &Path, record: &Record) -> std::io::Result<()> {
    let dir = path.parent().ok_or_else(|| std::io::Error::other("no parent"))?;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(crate::state_dir::no_follow())
        .open(&tmp)?;
    f.write_all(&serde_json::to_vec(record).map_err(std::io::Error::other)?)?;
    std::fs::rename(&tmp, path)
}

impl Session {
    /// Whether a next server may take this session over, and so its jobs too: only a server
    /// that leaves its sessions for the next one keeps records.
    pub(in crate::session) fn durable_jobs(&self) -> bool {
        self.cfg.keep_sessions && self.cfg.adopt_grace_s != 0
    }

    /// Writes this session's record (a few hundred bytes; called when it changes, its egress
    /// list included).
    pub(crate) fn save_record(&self) {
        if !self.durable_jobs() {
            return;
        }
        let Ok(created) = self.container.lock().map(|c| c.clone()) else { return };
        let Some(path) = record_path(&self.cfg.state_dir(), &created.id) else { return };
        let record = Record {
            about: self.about(created),
            pid: self.agent_pid.load(Ordering::Relaxed),
            egress: self.blueprint.egress.as_ref().map(|a| Egress {
                network: a.network.clone(),
                proxy_ip: a.proxy_ip,
                allow: a.allow(),
            }),
        };
        if let Err(e) = write_record(&path, &record) {
            tracing::warn!(session = %self.name, error = %e, "cannot write the session's record: a restarted server will not adopt it");
        }
    }

    /// Removes this session's record (closed, or its container replaced).
    pub(in crate::session) fn forget_record(&self) {
        let Ok(id) = self.container.lock().map(|c| c.id.clone()) else { return };
        if let Some(path) = record_path(&self.cfg.state_dir(), &id) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// After an agent answered where a dropped stream's agent was expected: a notice when it
    /// is another one (that one is gone, and its state with it).
    pub(in crate::session) fn reattached(&self, inner: &mut Inner) -> Option<String> {
        let expected = inner.reattach_pid.take()?;
        let now = inner.agent.as_ref().and_then(super::super::agent::Agent::pid);
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

    /// A session from a record, its container running, its agent reached on first use.
    /// What the records of this session keep of it, `created` being its container.
    pub(super) fn about(&self, created: Created) -> About {
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

    /// A session from its record: running (reattached on its first call) or hibernated.
    pub(super) fn revive(
        docker: bollard::Docker,
        blueprint: Arc<crate::sandbox::Blueprint>,
        owner: container::Owner,
        about: About,
        how: Revived,
    ) -> Arc<Self> {
        let created = Created { id: about.container, volume: about.volume, uid: about.uid };
        let asleep = how.sleeping.as_ref().map(|s| s.store.clone());
        let inner = Inner {
            container: created.clone(),
            agent: None,
            lease: None,
            watched: false,
            pending: how.pending,
            pending_lost: false,
            reattach_pid: how.pid,
            sleeping: how.sleeping,
        };
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
            layers: std::sync::Mutex::new(about.layers),
            packages: std::sync::Mutex::new(about.packages.into_iter().collect()),
            env: std::sync::Mutex::new(about.env),
            waiting: AtomicUsize::new(0),
            python: std::sync::Mutex::new(about.python),
            agent_pid: AtomicU32::new(how.pid.unwrap_or(0)),
            pool: std::sync::OnceLock::new(),
            asleep: std::sync::Mutex::new(asleep),
        })
    }
}

impl Registry {
    /// At start, before the sweep: adopts the sessions that dead instances of this state dir
    /// left running within `--adopt-grace-s` (see the module doc). Returns how many.
    pub(super) async fn adopt_leftovers(&self) -> Result<usize, docker::Error> {
        let state_dir = self.cfg.state_dir();
        let records = read_records(&state_dir);
        let mut recorded: HashSet<String> = records.iter().map(|(_, r)| r.about.instance.clone()).collect();
        recorded.extend(super::sleepers::recorded_instances(&state_dir));
        if recorded.is_empty() {
            return Ok(0);
        }
        let found = container::inventory(&self.docker).await?;
        let grace = self.cfg.adopt_grace();
        let (mut names, late) = self.instance.claim_adoptable(&self.docker, &found.containers, &recorded, grace).await;
        names.extend(late.iter().cloned());
        let mut asleep_now = Vec::new();
        let host = self.instance.owner.host.clone();
        let of_adopted = |l: &std::collections::HashMap<String, String>| {
            l.get(LABEL_HOST) == Some(&host) && l.get(LABEL_INSTANCE).is_some_and(|i| names.contains(i))
        };
        // Their heartbeats beat again, under this server, from now on.
        if let Ok(env) = self.environments.get(None) {
            for owner in self.instance.adopted_owners() {
                self.keeper.beat(self.docker.clone(), env.cfg.clone(), owner);
            }
        }
        let mut kept_ids = HashSet::new();
        let mut kept_volumes = HashSet::new();
        let mut adopted = 0;
        let mut with_egress = Vec::new();
        for (path, record) in records {
            let info = match self.docker.inspect_container(&record.about.container, None).await {
                Ok(info) => info,
                Err(e) => {
                    // Its container is gone (swept, or removed by hand): so is the record.
                    if docker::Error::from(e).is_gone() {
                        let _ = std::fs::remove_file(&path);
                    }
                    continue;
                }
            };
            let labels = info.config.as_ref().and_then(|c| c.labels.clone()).unwrap_or_default();
            if !of_adopted(&labels) || labels.get(LABEL_INSTANCE) != Some(&record.about.instance) {
                continue;
            }
            let running = info.state.as_ref().and_then(|s| s.running).unwrap_or(false);
            let Ok(env) = self.environments.get(Some(&record.about.environment)) else {
                tracing::warn!(session = %record.about.name, environment = %record.about.environment, "no such environment now; not adopted");
                let _ = std::fs::remove_file(&path);
                continue;
            };
            let key = (record.about.principal.clone(), record.about.name.clone());
            if !running || self.slots().contains_key(&key) {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if let Some(id) = info.id {
                kept_ids.insert(id);
            }
            kept_volumes.insert(record.about.volume.clone());
            let (name, id) = (record.about.name.clone(), record.about.container.clone());
            // It stays its instance's: a container it is given later carries the same labels,
            // kept alive by the lock and heartbeat this server now holds for that instance.
            let owner = container::Owner { instance: record.about.instance.clone(), host: host.clone() };
            let egress = record
                .egress
                .as_ref()
                .map(|e| Arc::new(self.egress.adopted_attachment(e.network.clone(), e.proxy_ip, e.allow.clone())));
            let blueprint = self.blueprint(&env, egress);
            let late_one = late.contains(&record.about.instance);
            let how = Revived { pid: Some(record.pid), sleeping: None, pending: Vec::new(), idle: Default::default() };
            let session = Session::revive(self.docker.clone(), blueprint, owner, record.about, how);
            if late_one {
                asleep_now.push(session.clone());
            }
            if session.blueprint.egress.is_some() {
                with_egress.push((session.clone(), env.clone()));
            }
            let slot: Slot = Arc::default();
            let _ = slot.set(session);
            self.slots().insert(key, slot);
            adopted += 1;
            tracing::info!(session = %name, container = %short(&id), "session adopted from a stopped server");
        }
        // Hibernated sessions and snapshots have no running container to find.
        let (kept, sleepers) = self.adopt_sleepers(&names, &host).await;
        kept_ids.extend(kept.containers);
        kept_volumes.extend(kept.volumes);
        adopted += sleepers;
        // The rest of those instances' resources: pool containers, sessions without a record.
        for c in found.containers.iter().filter(|c| of_adopted(&c.labels) && !kept_ids.contains(&c.id)) {
            container::remove_leftover_container(&self.docker, &c.id).await;
        }
        for (name, _) in found.volumes.iter().filter(|(n, l)| of_adopted(l) && !kept_volumes.contains(n)) {
            container::remove_leftover_volume(&self.docker, name).await;
        }
        // With their old proxies gone (just above), this server's proxy takes their networks.
        for (session, env) in with_egress {
            let Some(att) = session.blueprint.egress.clone() else { continue };
            let id = session.container.lock().map(|c| c.id.clone()).unwrap_or_default();
            let headers = env.egress_headers.0.clone();
            let (principal, name) = (&session.principal, &session.name);
            if self.egress.adopt(principal, name, &session.image, &id, &att, &env.egress, headers).await.is_ok() {
                tracing::info!(session = %name, "egress of the adopted session taken over");
            }
        }
        // Networks of theirs nothing uses any more (a hibernated session's: it wakes on one of
        // this server's). The engine refuses to remove one a container is still on: those of
        // the running sessions just taken over stay.
        let pick =
            |l: &std::collections::HashMap<String, String>| l.get(LABEL_INSTANCE).is_some_and(|i| names.contains(i));
        let nets = crate::egress::sweep_networks(&self.docker, &pick).await;
        if nets > 0 {
            tracing::info!(networks = nets, "removed egress networks of adopted instances that nothing uses");
        }
        if adopted > 0 {
            // Their sets are in use: no prune may take them.
            self.record_layers();
        }
        // Their jobs, running on under the keepers, are followed again.
        let find = |principal: &str, name: &str| {
            self.slots().get(&(principal.to_owned(), name.to_owned())).and_then(|slot| slot.get().cloned())
        };
        let jobs = self.jobs.take_over(&self.docker, &state_dir, &names, &find).await;
        if jobs > 0 {
            tracing::info!(jobs, "following the jobs of stopped servers");
        }
        // Sessions nobody adopted within the grace hibernate now (their server is long gone):
        // their state is kept, their containers go. A session that cannot be put to sleep
        // (hibernation off, or the snapshot fails) stays adopted and running.
        if self.cfg.hibernate_after().is_some() {
            let bounds = crate::docker::snapshot::Bounds { bytes: self.cfg.snapshot_cache_mb << 20, entries: 100_000 };
            for s in asleep_now {
                // A running job keeps its session awake, as it does an idle one.
                if self.jobs.list(&s.principal).iter().any(|j| j.session == s.name && !j.is_finished()) {
                    continue;
                }
                let id = format!("h{}", self.snapshots.next_id());
                match s.hibernate(&id, bounds).await {
                    Ok(true) => {
                        self.record_sleeper(&s);
                        tracing::info!(session = %s.name, "a session left past the adoption grace was put to sleep");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(session = %s.name, error = %e, "cannot hibernate a session left past the grace; it stays running")
                    }
                }
            }
        }
        Ok(adopted)
    }
}

/// Every readable record in the state dir; unreadable ones are skipped (and said).
fn read_records(state_dir: &Path) -> Vec<(PathBuf, Record)> {
    let Ok(entries) = std::fs::read_dir(state_dir.join(DIR)) else { return Vec::new() };
    let mut records = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<Record>(&b).map_err(|e| e.to_string()))
        {
            Ok(r) if record_path(state_dir, &r.about.container).as_deref() == Some(path.as_path()) => {
                records.push((path, r))
            }
            Ok(_) => tracing::warn!(path = %path.display(), "a session record under another name; skipped"),
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "unreadable session record; skipped"),
        }
    }
    records
}
