//! Sessions that outlive their server (docs/design.md D12).
//!
//! Each session's container is described by a record in the state dir
//! (`<state dir>/sessions/<container>.json`, kept by the ledger: `durable/ledger.rs`): whose
//! it is, its name, environment, image, packages, variables set with `set_env`, and its
//! agent's pid. Labels cannot say it all: a
//! container taken from the warm pool keeps the pool's labels, and what changes while a
//! session runs (packages, env) cannot be relabelled. The state dir is private to the server's
//! user, so nothing in a container can write a record.
//!
//! A server that starts finds the containers of dead instances of its state dir (their lock
//! free: [`crate::instance::Instance::claim_adoptable`]) whose heartbeat stopped less than
//! `--adopt-grace-s` ago, re-registers the sessions whose records it has (their container
//! running, or gone with their volumes kept: an orphan that saved itself, woken on a new
//! container by its first call, `session/orphan.rs`), and removes the rest of those
//! instances' resources. It holds their locks and keeps their heartbeats beating
//! from then on, so no other server sweeps what it adopted; the interpreter is reached again
//! through its keeper on the session's first call. The record says whose a session is, never
//! a label: a container labelled with another principal or uid than its record is not taken
//! (on Kubernetes whoever can make pods can label them), and a session not adopted is said to
//! its principal's next call of it. The same code adopts pods (docs/kubernetes.md).

use std::collections::{HashMap, HashSet};

use std::sync::Arc;

use super::{Registry, Slot};
use crate::docker::container::{self, short};
use crate::docker::identity::LABEL_UID;
use crate::docker::{self, LABEL_HOST, LABEL_INSTANCE, LABEL_OWNER};
use crate::durable::ledger::Key;
use crate::durable::records::Running;
use crate::environment::Environment;
use crate::session::Session;
use crate::session::recorded::Revived;

/// A session taken from its record at start.
struct Taken {
    session: Arc<Session>,
    /// Its container, when one is there to keep from the sweep.
    container: Option<String>,
    /// Its workspace volume and keep volume.
    volumes: [String; 2],
    /// Its container runs (else it went, and its volumes wait for its first call).
    running: bool,
    /// Its environment, when its running container's egress is taken over.
    takeover: Option<Arc<Environment>>,
}

/// Why a container that claims the recorded session's instance is not the recorded session's:
/// its labels name another principal or another uid. The record (in the state dir, which no
/// container and no cluster user can write) says whose a session is; labels never do, and one
/// that disagrees with it is not ours to take (made by someone else, or for another session).
/// A pool container's principal is empty (the pool made it for nobody yet).
fn foreign(labels: &HashMap<String, String>, record: &Running) -> Option<String> {
    if let Some(p) = labels.get(LABEL_OWNER).filter(|p| !p.is_empty() && **p != record.about.principal) {
        return Some(format!("its container is labelled as another principal's ({p:?})"));
    }
    let uid = record.about.uid.to_string();
    let other = labels.get(LABEL_UID).filter(|u| **u != uid);
    other.map(|u| format!("its container is labelled with another uid ({u:?}, recorded {uid})"))
}

impl Registry {
    /// At start, before the sweep: adopts the sessions that dead instances of this state dir
    /// left running within `--adopt-grace-s` (see the module doc). Returns how many.
    pub(super) async fn adopt_leftovers(&self) -> Result<usize, docker::Error> {
        let records = self.ledger.running();
        let recorded = self.ledger.recorded_instances();
        if recorded.is_empty() {
            return Ok(0);
        }
        let found = container::inventory(&self.docker).await?;
        let grace = self.cfg.adopt_grace();
        // An instance whose sessions all sleep, or whose orphans went with their containers,
        // has volumes and no container: its volumes name it too.
        let (mut names, mut late) = self.instance.claim_adoptable(&self.docker, &found, &recorded, grace).await;
        names.extend(late.iter().cloned());
        if self.cfg.engine == crate::config::EngineKind::Kubernetes {
            // A heartbeat there is a record of the server that made it: a stopped server's
            // leaves no evidence of when it stopped, so none counts as past the grace. Each
            // pod's keeper keeps the grace itself (it saves and ends; adoption restores it there).
            late.clear();
        }
        let mut asleep_now = Vec::new();
        let host = self.instance.owner.host.clone();
        let of_adopted = |l: &HashMap<String, String>| {
            l.get(LABEL_HOST) == Some(&host) && l.get(LABEL_INSTANCE).is_some_and(|i| names.contains(i))
        };
        // Their heartbeats beat again, under this server, from now on (once the reattaches
        // below are done).
        let adopting = self.attached.token();
        if let Ok(env) = self.environments.get(None) {
            for owner in self.instance.adopted_owners() {
                self.keeper.beat(self.docker.clone(), env.cfg.clone(), owner, self.after_preattaches());
            }
        }
        let mut kept_ids = HashSet::new();
        let mut kept_volumes = HashSet::new();
        let mut adopted = 0;
        let mut with_egress = Vec::new();
        for record in records {
            let late_one = late.contains(&record.about.instance);
            let asked = std::time::Instant::now();
            let Some(taken) = self.adopt_record(record, &of_adopted, &host).await else { continue };
            self.metrics.session_created(crate::metrics::Source::Adopt, &taken.session.principal, asked.elapsed());
            kept_ids.extend(taken.container);
            kept_volumes.extend(taken.volumes);
            if late_one && taken.running {
                asleep_now.push(taken.session.clone());
            } else if taken.running {
                // Off the first call's path: the rest of the start runs meanwhile.
                let (s, held) = (taken.session.clone(), self.attached.token());
                self.attaching.lock().unwrap_or_else(|e| e.into_inner()).spawn(async move {
                    s.preattach().await;
                    drop(held);
                });
            }
            if let Some(env) = taken.takeover {
                with_egress.push((taken.session.clone(), env));
            }
            let s = &taken.session;
            self.audit(crate::audit::Event::new("session_adopted", &s.principal).session(&s.name));
            adopted += 1;
        }
        // Hibernated sessions and snapshots have no running container to find.
        let (kept, sleepers) = self.adopt_sleepers(&names, &host).await;
        kept_ids.extend(kept.containers);
        kept_volumes.extend(kept.volumes);
        adopted += sleepers;
        drop(adopting);
        // The rest of those instances' resources: pool containers, sessions without a record.
        for c in found.containers.iter().filter(|c| of_adopted(&c.labels) && !kept_ids.contains(&c.id)) {
            container::remove_leftover_container(&self.docker, &c.id).await;
        }
        for (name, _) in found.volumes.iter().filter(|(n, l)| of_adopted(l) && !kept_volumes.contains(n)) {
            container::remove_leftover_volume(&self.docker, name).await;
        }
        self.take_over_egress(with_egress, &names).await;
        if adopted > 0 {
            // Their sets are in use: no prune may take them.
            self.record_layers();
        }
        // Their jobs, running on under the keepers, are followed again.
        let find = |principal: &str, name: &str| {
            self.slots().get(&(principal.to_owned(), name.to_owned())).and_then(|slot| slot.get().cloned())
        };
        let jobs = self.jobs.take_over(&self.docker, &self.ledger, &names, &find).await;
        if jobs > 0 {
            tracing::info!(jobs, "following the jobs of stopped servers");
        }
        self.hibernate_late(asleep_now).await;
        Ok(adopted)
    }

    /// With their old proxies gone, this server's proxy takes the networks of the running
    /// sessions adopted; networks of those instances that nothing uses any more go.
    async fn take_over_egress(&self, with_egress: Vec<(Arc<Session>, Arc<Environment>)>, names: &[String]) {
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
    }

    /// Sessions nobody adopted within the grace hibernate now (their server is long gone):
    /// their state is kept, their containers go. A session that cannot be put to sleep
    /// (hibernation off, or the snapshot fails) stays adopted and running.
    async fn hibernate_late(&self, asleep_now: Vec<Arc<Session>>) {
        if self.cfg.hibernate_after().is_some() {
            for s in asleep_now {
                // A running job keeps its session awake, as it does an idle one.
                if self.jobs.list(&s.principal).iter().any(|j| j.session == s.name && !j.is_finished()) {
                    continue;
                }
                match self.hibernate_within_caps(&s).await {
                    Ok(true) => {
                        tracing::info!(session = %s.name, "a session left past the adoption grace was put to sleep");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(session = %s.name, error = %e, "cannot hibernate a session left past the grace; it stays running")
                    }
                }
            }
        }
    }

    /// The recorded session's container as the engine has it: its labels, whether it runs,
    /// its id; gone, its volume's labels (an orphan that saved itself; no id). `None`: nothing
    /// is left of it (its record is then forgotten, and said, when `ours`: of an instance
    /// being adopted), or the engine failed.
    async fn recorded_container(
        &self,
        record: &Running,
        ours: bool,
    ) -> Option<(HashMap<String, String>, bool, Option<String>)> {
        let inspected = self.docker.inspect_container(&record.about.container, None).await;
        match inspected.map_err(docker::Error::from) {
            Ok(info) => {
                let labels = info.config.and_then(|c| c.labels).unwrap_or_default();
                Some((labels, info.state.and_then(|s| s.running).unwrap_or(false), info.id))
            }
            Err(e) if e.is_gone() => {
                match self.docker.inspect_volume(&record.about.volume).await.map_err(docker::Error::from) {
                    // Its volume holds what it saved: its container is made again on it.
                    Ok(v) => Some((v.labels, false, None)),
                    // Its volumes are gone too (swept, closed, removed by hand; on Kubernetes the
                    // workspace was the pod's): so is the record.
                    Err(e) if e.is_gone() => {
                        let noun =
                            if self.cfg.engine == crate::config::EngineKind::Kubernetes { "pod" } else { "container" };
                        if ours {
                            self.not_adopted(record, &format!("its {noun} and its workspace were gone"));
                        } else {
                            self.ledger.forget(&Key::Running(record.about.container.clone()));
                        }
                        None
                    }
                    Err(_) => None,
                }
            }
            Err(_) => None,
        }
    }

    /// Forgets the record of a session that cannot be adopted, and says why: in the log, and
    /// to its principal's next call of that name ("the one before it ended …").
    fn not_adopted(&self, record: &Running, why: &str) {
        let (principal, name) = (&record.about.principal, &record.about.name);
        tracing::warn!(session = %name, container = %record.about.container, "not adopted: {why}");
        self.ledger.forget(&Key::Running(record.about.container.clone()));
        self.ended(principal, name, format!("ended while its server was stopped: {why}; its variables are gone"));
    }

    /// Takes one session record of an adopted instance (`of_adopted` says which): its
    /// container running, or gone with its volumes kept (an orphan its tether stopped, which
    /// the engine removed, docs/design.md D12). `None`: not ours, or stale (then forgotten).
    async fn adopt_record(
        &self,
        record: Running,
        of_adopted: &(dyn Fn(&HashMap<String, String>) -> bool + Sync),
        host: &str,
    ) -> Option<Taken> {
        let stale = Key::Running(record.about.container.clone());
        let of_record = HashMap::from([
            (LABEL_INSTANCE.to_owned(), record.about.instance.clone()),
            (LABEL_HOST.to_owned(), host.to_owned()),
        ]);
        // Said only of the instances being adopted: another's records are its own business.
        let ours = of_adopted(&of_record);
        let (labels, mut running, id) = self.recorded_container(&record, ours).await?;
        if !of_adopted(&labels) || labels.get(LABEL_INSTANCE) != Some(&record.about.instance) {
            return None;
        }
        if let Some(why) = foreign(&labels, &record) {
            self.not_adopted(&record, &why);
            return None;
        }
        let key = (record.about.principal.clone(), record.about.name.clone());
        let Ok(env) = self.environments.get(Some(&record.about.environment)) else {
            tracing::warn!(session = %record.about.name, environment = %record.about.environment, "no such environment now; not adopted");
            self.ledger.forget(&stale);
            return None;
        };
        if self.slots().contains_key(&key) {
            self.ledger.forget(&stale);
            return None;
        }
        if running
            && let Err(e) = docker::tether::hold(&self.docker, &record.about.container, self.cfg.orphan_after()).await
        {
            tracing::warn!(session = %record.about.name, error = %e, "cannot tether an adopted session's container");
            // Stopping this very moment (its tether's time was up): taken as gone, then.
            running = container::is_running(&self.docker, &record.about.container).await.unwrap_or(true);
        }
        let volumes = [record.about.volume.clone(), docker::tether::keep_volume(&record.about.volume)];
        let (name, cid) = (record.about.name.clone(), record.about.container.clone());
        // It stays its instance's: a container it is given later carries the same labels,
        // kept alive by the lock and heartbeat this server now holds for that instance.
        let owner = container::Owner { instance: record.about.instance.clone(), host: host.to_owned() };
        let (egress, pending) = match &record.egress {
            Some(e) if running => {
                let att = self.egress.adopted_attachment(e.network.clone(), e.proxy_ip, e.allow.clone());
                (Some(Arc::new(att)), Vec::new())
            }
            // Its network goes with its old instance's (below): it wakes on one of this server's.
            e => self.egress_again(&env, &record.about, e.as_ref().map(|e| e.allow.as_slice())).await,
        };
        let blueprint = self.blueprint(&env, egress);
        let takeover = (running && blueprint.egress.is_some()).then(|| env.clone());
        let how = Revived {
            pid: running.then_some(record.pid),
            sleeping: None,
            pending,
            idle: Default::default(),
            stopped: !running,
        };
        let session = Session::revive(self.docker.clone(), blueprint, owner, record.about, how);
        let slot: Slot = Arc::default();
        let _ = slot.set(session.clone());
        self.slots().insert(key, slot);
        if running {
            tracing::info!(session = %name, container = %short(&cid), "session adopted from a stopped server");
        } else {
            tracing::info!(session = %name, "session adopted from a stopped server, its container gone and its volumes kept: it wakes on its first call");
        }
        Some(Taken { session, container: id.filter(|_| running), volumes, running, takeover })
    }
}
