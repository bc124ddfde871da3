//! The registry over time: idle sessions reaped or hibernated, leftovers of dead servers
//! swept, and the stop that ends or leaves every session (the warm pools: `pool/`).

use super::*;

impl Registry {
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
        // When they left the registry: jobs of new sessions of those names start after.
        let at = std::time::Instant::now();
        for s in &expired {
            tracing::info!(session = %s.name, idle_s = s.idle().as_secs(), "idle session reaped");
            let state = if s.is_asleep() { "hibernated" } else { "running" };
            let why = format!(
                "expired: idle for {} s, past --idle-ttl-s {} s (it was {state}); its variables and files are gone",
                s.idle().as_secs(),
                ttl.as_secs()
            );
            self.ended(&s.principal, &s.name, why);
            let e = crate::audit::Event::new("session_expired", &s.principal).session(&s.name);
            self.audit(e.field("idle_s", s.idle().as_secs()).field("state", state));
            s.close().await;
            self.jobs.forget_session(&s.principal, &s.name, at);
            if let Some(network) = s.egress_network() {
                self.egress.detach_network(&s.principal, &s.name, network).await;
            }
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
    pub(super) async fn hibernate_idle(&self, after: Duration) {
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

    /// Done once the adoption at start and the reattaches it began are (at most 2 s): a
    /// heartbeat's container made meanwhile slowed each reattach by about one exec on a small
    /// machine (issue 29).
    pub(super) fn after_preattaches(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let attached = self.attached.clone();
        attached.close();
        async move {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), attached.wait()).await;
        }
    }

    /// At start: keeps this instance's heartbeat from now on, and removes what dead instances
    /// left behind (docs/design.md D9). When some instance's heartbeat stopped too recently
    /// to call it dead, a sweep runs again once the grace is over; with `again`, one runs
    /// every `again` besides (Kubernetes, where a dead server's Lease lapses only later).
    pub async fn sweep_leftovers(&self, again: Option<std::time::Duration>) -> Result<(), docker::Error> {
        match self.adopt_leftovers().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(sessions = n, "adopted the sessions of stopped servers"),
            Err(e) => tracing::warn!(error = %e, "cannot adopt the sessions of stopped servers"),
        }
        // After the adoption, which reads when this instance's name (given again) last beat:
        // a new heartbeat removes that mark (docker/heartbeat.rs).
        match self.environments.get(None) {
            Ok(env) => {
                let owner = self.instance.owner.clone();
                self.keeper.beat(self.docker.clone(), env.cfg.clone(), owner, self.after_preattaches());
            }
            Err(e) => tracing::warn!(error = %e, "no default environment; this server runs without a heartbeat"),
        }
        // A dead server's sessions are kept for a next server of its state dir: stopped
        // containers, for `--idle-ttl-s`; on Kubernetes running pods (nothing stops a pod),
        // holding their requests, so only for the grace.
        let keep = match self.cfg.engine {
            crate::config::EngineKind::Kubernetes => self.cfg.leftover_grace(),
            crate::config::EngineKind::Docker => self.cfg.idle_ttl(),
        };
        let sweeper = self.instance.sweeper(self.cfg.leftover_grace()).keeping(keep);
        if let Some(every) = again {
            self.keeper.repeat(self.docker.clone(), sweeper.clone(), every);
        }
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

    /// Closes every session, then removes anything of ours still labelled (belt and braces).
    /// With `leave`, sessions stay running instead, for the next server of the state dir to
    /// adopt within `--adopt-grace-s` (docs/design.md D12): only the pool and jobs stop.
    pub async fn shutdown(&self, leave: bool) {
        // Sessions waiting for a turn to make a container make none now.
        self.cold.close();
        self.attaching.lock().unwrap_or_else(|e| e.into_inner()).abort_all();
        self.drain_pool().await;
        // Nothing to leave (no session, no snapshot): a clean stop, nothing kept for a next
        // server. Snapshots alone are left too: their sessions may be closed, they are not.
        let leave = leave && (self.slots().values().any(|slot| slot.initialized()) || self.snapshots.count() > 0);
        if leave {
            // Finished jobs' records are kept with the sessions the next server adopts.
            let live: std::collections::HashSet<Key> =
                self.slots().iter().filter(|(_, slot)| slot.initialized()).map(|(k, _)| k.clone()).collect();
            self.jobs.leave(&|p, s| live.contains(&(p.to_owned(), s.to_owned()))).await;
        } else {
            self.jobs.shutdown().await;
        }
        if leave {
            // Their pods outlive this server, whose proxy goes with it; a next server does not
            // take their egress over on Kubernetes. Out of the proxy now all the same.
            let keys: Vec<Key> = self.slots().keys().cloned().collect();
            for (principal, name) in &keys {
                self.egress.unbind(principal, name).await;
            }
            // Snapshots and sessions are recorded already, as they changed.
            let left = self.slots().drain().filter(|(_, slot)| slot.initialized()).count();
            self.instance.keep_lock_files();
            self.keeper.stop(&self.docker, &[], false).await;
            packages::settle().await;
            self.egress.drop_idle_installers().await;
            self.say_left(left).await;
            self.save_quotas();
            return;
        }
        let all: Vec<Arc<Session>> = self.slots().drain().filter_map(|(_, slot)| slot.get().cloned()).collect();
        for s in &all {
            let e = crate::audit::Event::new("session_closed", &s.principal).session(&s.name);
            self.audit(e.field("reason", "server_stopped"));
        }
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
        self.save_quotas();
        // Last: until everything else of ours is gone, others see this instance alive.
        let mut owners = self.instance.adopted_owners();
        owners.push(self.instance.owner.clone());
        self.keeper.stop(&self.docker, &owners, true).await;
    }

    /// The stop's last word when it leaves sessions: what stays, for how long, how to remove it.
    pub(super) async fn say_left(&self, left: usize) {
        let mut instances: Vec<String> = self.instance.adopted_owners().into_iter().map(|o| o.instance).collect();
        instances.push(self.instance.owner.instance.clone());
        let (containers, volumes) = crate::gc::left_by(&self.docker, &instances).await.unwrap_or_default();
        if self.cfg.engine == crate::config::EngineKind::Kubernetes {
            // No tether stops a pod (PID 1 ignores it in its own namespace): pods stay.
            tracing::info!(
                sessions = left,
                pods = containers,
                instances = ?instances,
                "{left} sessions left for the next server of state dir {}: it adopts them, running, whenever it starts. \
                 Their {containers} pods keep running; --adopt-grace-s after this stop each agent saves its state into its \
                 workspace and ends, and the next server restores it there. A server of another state dir deletes \
                 them at its start (one server per namespace); by hand: kubectl delete pod -l pyberth.instance=I, \
                 for I in {}",
                self.cfg.state_dir().display(),
                instances.join(", "),
            );
            return;
        }
        let stop_s = (self.cfg.orphan_after() + crate::docker::tether::MARGIN).as_secs();
        tracing::info!(
            sessions = left,
            containers,
            volumes,
            instances = ?instances,
            adopt_within_s = self.cfg.adopt_grace_s,
            stop_after_s = stop_s,
            "{left} sessions left for the next server of state dir {}: it adopts them running if it starts within {} s. \
             Left on the engine: {containers} containers, running until {stop_s} s after this stop, when each saves its \
             state into its volumes and stops, and the engine removes it (no process, nothing in docker ps -a); and \
             {volumes} volumes (workspaces, their on-disk copies, snapshots, heartbeat marks), which stay: a server of \
             this state dir wakes those sessions from them whenever it starts; a server of another state dir removes \
             them once this stop is --idle-ttl-s ({} s) old. To remove it all now: pyberth gc --yes --grace-s 0 \
             --only-instance I, for I in {}, with another state dir than this one (whose records keep them for its \
             next server)",
            self.cfg.state_dir().display(),
            self.cfg.adopt_grace_s,
            self.cfg.idle_ttl_s,
            instances.join(", "),
        );
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
    pub(super) fn ended(&self, principal: &str, name: &str, why: String) {
        let mut ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended.retain(|_, (_, at)| at.elapsed() < KEPT);
        if ended.len() >= MAX_ENDED {
            ended.clear();
        }
        ended.insert((principal.to_owned(), name.to_owned()), (why, Instant::now()));
    }
}
