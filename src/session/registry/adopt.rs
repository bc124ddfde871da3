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
//! `--adopt-grace-s` ago, re-registers the sessions whose records it has, and removes the
//! rest of those instances' resources. It holds their locks and keeps their heartbeats beating
//! from then on, so no other server sweeps what it adopted; the interpreter is reached again
//! through its keeper on the session's first call.

use std::collections::HashSet;

use bollard::models::ContainerStateStatusEnum;
use std::sync::Arc;

use super::{Registry, Slot};
use crate::docker::container::{self, short};
use crate::docker::{self, LABEL_HOST, LABEL_INSTANCE};
use crate::durable::ledger::Key;
use crate::session::Session;
use crate::session::recorded::Revived;

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
        // An instance whose sessions all sleep has volumes and no container (issue 26: none
        // per snapshot): its volumes name it too.
        let mut seen = found.containers.clone();
        seen.extend(found.volumes.iter().map(|(name, labels)| container::Found {
            id: name.clone(),
            labels: labels.clone(),
            running: false,
            created: None,
        }));
        let (mut names, late) = self.instance.claim_adoptable(&self.docker, &seen, &recorded, grace).await;
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
        for record in records {
            let stale = Key::Running(record.about.container.clone());
            let info = match self.docker.inspect_container(&record.about.container, None).await {
                Ok(info) => info,
                Err(e) => {
                    // Its container is gone (swept, or removed by hand): so is the record.
                    if docker::Error::from(e).is_gone() {
                        self.ledger.forget(&stale);
                    }
                    continue;
                }
            };
            let labels = info.config.as_ref().and_then(|c| c.labels.clone()).unwrap_or_default();
            if !of_adopted(&labels) || labels.get(LABEL_INSTANCE) != Some(&record.about.instance) {
                continue;
            }
            let running = info.state.as_ref().and_then(|s| s.running).unwrap_or(false);
            // Stopped by its tether after the grace, its state saved in its workspace: taken
            // like a hibernated session, started again by its first call (orphan.rs).
            let stopped = info.state.as_ref().and_then(|s| s.status) == Some(ContainerStateStatusEnum::EXITED);
            let Ok(env) = self.environments.get(Some(&record.about.environment)) else {
                tracing::warn!(session = %record.about.name, environment = %record.about.environment, "no such environment now; not adopted");
                self.ledger.forget(&stale);
                continue;
            };
            let key = (record.about.principal.clone(), record.about.name.clone());
            if !(running || stopped) || self.slots().contains_key(&key) {
                self.ledger.forget(&stale);
                continue;
            }
            if let Some(id) = info.id {
                kept_ids.insert(id);
            }
            kept_volumes.insert(docker::tether::keep_volume(&record.about.volume));
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
            let mut pid = Some(record.pid);
            if stopped && blueprint.egress.is_some() {
                // Its network is taken over below, which wants it running; its agent starts
                // at its first call, where pid 0 (none's) says the old one is gone.
                pid = Some(0);
                let c = &record.about.container;
                let started = match self.docker.start_container(c, None).await {
                    Ok(()) => {
                        docker::exec::run_as_code(&self.docker, c, record.about.uid, docker::tether::COPY_BACK).await
                    }
                    Err(e) => Err(e.into()),
                };
                if let Err(e) = started {
                    tracing::warn!(session = %record.about.name, error = %e, "cannot start a stopped session's container");
                }
            }
            if (running || pid == Some(0))
                && let Err(e) =
                    docker::tether::hold(&self.docker, &record.about.container, self.cfg.orphan_after()).await
            {
                tracing::warn!(session = %record.about.name, error = %e, "cannot tether an adopted session's container");
            }
            let how = Revived {
                pid,
                sleeping: None,
                pending: Vec::new(),
                idle: Default::default(),
                stopped: stopped && pid != Some(0),
            };
            let session = Session::revive(self.docker.clone(), blueprint, owner, record.about, how);
            if late_one && running {
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
        let jobs = self.jobs.take_over(&self.docker, &self.ledger, &names, &find).await;
        if jobs > 0 {
            tracing::info!(jobs, "following the jobs of stopped servers");
        }
        // Sessions nobody adopted within the grace hibernate now (their server is long gone):
        // their state is kept, their containers go. A session that cannot be put to sleep
        // (hibernation off, or the snapshot fails) stays adopted and running.
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
        Ok(adopted)
    }
}
