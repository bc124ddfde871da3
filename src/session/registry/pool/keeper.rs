//! The pool's keeper: one task that makes containers up to each environment's target, a few
//! at once, removes the surplus as targets fall, and measures what an idle container of each
//! environment holds (the memory budget's unit).

use std::collections::HashMap;
use std::time::Instant;

use tokio::task::{Id, JoinError, JoinSet};

use super::super::*;
use crate::session::Prepared;

/// Most containers made at once when the targets jump above the floor: more would crowd out
/// running sessions on a small machine (the engine serialises much of a create anyway).
pub(crate) const AT_ONCE: usize = 4;
/// First pause after an environment's failed make; it doubles up to [`LONGEST_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(10);
const LONGEST_BACKOFF: Duration = Duration::from_secs(600);
/// An environment is measured when it holds its first ready container, then again after this
/// many more are made (idle memory changes little, and each measure is an engine call).
const MEASURE_EVERY: u64 = 16;

/// An environment whose last make failed: its next pause, and until when it rests.
struct Failing {
    backoff: Duration,
    until: Instant,
}

/// What the keeper holds while it runs: makes under way (by task, for their environment) and
/// measures, both stopped with it.
#[derive(Default)]
struct Work {
    making: JoinSet<Result<Option<Prepared>, Error>>,
    envs: HashMap<Id, String>,
    /// Measures under way: (container, bytes), by task, for their environment.
    measuring: JoinSet<(String, Option<u64>)>,
    measuring_envs: HashMap<Id, String>,
    failing: HashMap<String, Failing>,
    serial: u64,
}

impl Work {
    /// Makes under way, per environment.
    fn counts(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for env in self.envs.values() {
            *counts.entry(env.clone()).or_default() += 1;
        }
        counts
    }

    fn resting(&self, env: &str, now: Instant) -> bool {
        self.failing.get(env).is_some_and(|f| f.until > now)
    }

    fn failed(&mut self, env: &str) -> Duration {
        let f = self.failing.entry(env.to_owned()).or_insert(Failing { backoff: FIRST_BACKOFF, until: Instant::now() });
        let pause = f.backoff;
        f.until = Instant::now() + pause;
        f.backoff = (f.backoff * 2).min(LONGEST_BACKOFF);
        pause
    }
}

impl Registry {
    /// Keeps each environment's warm pool at its target until `shutdown` fires, making up to
    /// [`AT_ONCE`] containers at a time (the environment furthest below its target first) and
    /// removing the surplus as targets fall; then removes what is left in the pool and what
    /// was being made. `--pool-size 0`: no pool.
    pub async fn pool_keeper(self: Arc<Self>, shutdown: CancellationToken) {
        if self.cfg.pool_size == 0 {
            return;
        }
        let mut work = Work::default();
        let mut preloaded = false;
        while !shutdown.is_cancelled() {
            let now = Instant::now();
            let targets = self.pools().targets(now);
            self.shrink_pool(&targets).await;
            self.start_makes(&mut work, &targets, &shutdown, now);
            let counts = work.counts();
            self.pool_update(None, &counts);
            self.pools().hold(&targets, now);
            self.measure_due(&mut work);
            if !preloaded && work.making.is_empty() && self.default_full(&targets) {
                // Once the pool is full: the layer store's listing, so that the first new
                // session asking for a cached set waits for nothing but its pooled container.
                preloaded = true;
                self.preload(&shutdown).await;
                continue;
            }
            let rests = work.failing.values().map(|f| f.until).filter(|t| *t > now);
            let wake_at = rests.chain(self.pools().next_fall(now)).min();
            let later = async {
                match wake_at {
                    Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                () = self.pool_wake.notified() => {}
                () = later => {}
                Some(done) = work.making.join_next_with_id() => self.made(&mut work, done).await,
                Some(done) = work.measuring.join_next_with_id() => self.measured(&mut work, done),
            }
        }
        work.measuring.abort_all();
        // What is being made is finished (a container dropped half-made is one nobody would
        // remove), then removed with the rest.
        while let Some(done) = work.making.join_next().await {
            if let Ok(Ok(Some(p))) = done {
                p.destroy(&self.docker).await;
            }
        }
        // Sessions still waiting make their own.
        self.pool_update(None, &HashMap::new());
        self.drain_pool().await;
    }

    /// Starts makes while some environment is below its target and fewer than allowed are
    /// under way: at the floor one at a time as ever (refills never crowd out running
    /// sessions), more only as far as demand is above it.
    fn start_makes(
        self: &Arc<Self>,
        work: &mut Work,
        targets: &[(String, usize)],
        shutdown: &CancellationToken,
        now: Instant,
    ) {
        let total: usize = targets.iter().map(|(_, n)| n).sum();
        let at_once = total.saturating_sub(self.cfg.pool_size).clamp(1, AT_ONCE);
        let mut counts = work.counts();
        while work.making.len() < at_once {
            let next = {
                let mut pools = self.pools();
                let short = |(env, target): &(String, usize)| {
                    let held = pools.of(env, now).ready.len() + counts.get(env).copied().unwrap_or(0);
                    (!work.resting(env, now) && held < *target).then(|| (target - held, env.clone()))
                };
                targets.iter().filter_map(short).max_by_key(|(short, _)| *short).map(|(_, env)| env)
            };
            let Some(env_name) = next else { break };
            let env = match self.environments.get(Some(&env_name)) {
                Ok(env) => env,
                Err(e) => {
                    tracing::warn!(error = %e, env = %env_name, "cannot fill the warm pool");
                    work.failed(&env_name);
                    continue;
                }
            };
            work.serial += 1;
            let task = self.clone().make_pooled(env, format!("pool-{}", work.serial), shutdown.clone());
            let handle = work.making.spawn(task);
            work.envs.insert(handle.id(), env_name.clone());
            *counts.entry(env_name).or_default() += 1;
        }
    }

    /// A make ended: its container goes into its environment's pool, or its environment rests
    /// after a failure.
    async fn made(&self, work: &mut Work, done: Result<(Id, Result<Option<Prepared>, Error>), JoinError>) {
        let id = match &done {
            Ok((id, _)) => *id,
            Err(e) => e.id(),
        };
        let env = work.envs.remove(&id);
        let made = match done {
            Ok((_, Ok(made))) => made,
            Ok((_, Err(e))) => {
                if let Some(env) = &env {
                    let pause = work.failed(env);
                    tracing::warn!(error = %e, env = %env, "cannot fill the warm pool; retrying in {} s", pause.as_secs());
                }
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "a warm pool container's making failed");
                None
            }
        };
        match (env, made) {
            (Some(env), made) => {
                if made.is_some() {
                    work.failing.remove(&env);
                }
                self.pool_update(made.map(|p| (env, p)), &work.counts());
            }
            // Every make is recorded with its environment; were one not, its container still
            // goes.
            (None, Some(p)) => p.destroy(&self.docker).await,
            (None, None) => {}
        }
    }

    /// Measures the oldest ready container of each environment due a measure (none yet, or
    /// [`MEASURE_EVERY`] made since), one at a time per environment. The oldest: new sessions
    /// take the newest, so it is the likeliest to stay idle until the measure is back, and no
    /// container is held back from a session for it.
    fn measure_due(&self, work: &mut Work) {
        let due: Vec<(String, String)> = {
            let pools = self.pools();
            let busy = |env: &str| work.measuring_envs.values().any(|e| e == env);
            pools
                .each()
                .filter(|(env, p)| (p.cost.is_none() || p.unmeasured >= MEASURE_EVERY) && !busy(env))
                .filter_map(|(env, p)| Some((env.to_owned(), p.ready.first()?.container_id().to_owned())))
                .collect()
        };
        for (env, id) in due {
            let docker = self.docker.clone();
            let handle = work.measuring.spawn(async move {
                let bytes = container::memory_bytes(&docker, &id).await;
                (id, bytes)
            });
            work.measuring_envs.insert(handle.id(), env);
        }
    }

    /// A measure came back: it becomes its environment's cost if its container is still
    /// ready in the pool (a session that took it meanwhile may have run code in it).
    fn measured(&self, work: &mut Work, done: Result<(Id, (String, Option<u64>)), JoinError>) {
        let task = match &done {
            Ok((task, _)) => *task,
            Err(e) => e.id(),
        };
        let (Some(env), Ok((_, (id, Some(bytes))))) = (work.measuring_envs.remove(&task), done) else { return };
        let mut pools = self.pools();
        let pool = pools.of(&env, Instant::now());
        if pool.ready.iter().any(|p| p.container_id() == id) {
            tracing::debug!(env, mib = bytes >> 20, "an idle pooled container measured");
            pool.measured(bytes);
        }
    }

    /// The keeper's count: `made` (when one was) goes into its environment's pool, `making`
    /// are under way per environment; the sessions waiting look again.
    fn pool_update(&self, made: Option<(String, Prepared)>, making: &HashMap<String, usize>) {
        {
            let mut pools = self.pools();
            let now = Instant::now();
            if let Some((env, p)) = made {
                let pool = pools.of(&env, now);
                pool.ready.push(p);
                pool.unmeasured += 1;
            }
            let names: Vec<String> = pools.each().map(|(name, _)| name.to_owned()).collect();
            for name in names {
                pools.of(&name, now).coming.making = making.get(&name).copied().unwrap_or(0);
            }
        }
        self.pool_ready.notify_waiters();
    }

    /// Whether the default environment's pool holds its target.
    fn default_full(&self, targets: &[(String, usize)]) -> bool {
        let default = self.environments.default_name();
        let target = targets.iter().find(|(env, _)| env == default).map_or(0, |(_, n)| *n);
        self.pools().of(default, Instant::now()).ready.len() >= target
    }

    /// One container for the pool, labelled `label`; `None` when a stop came while its image
    /// was awaited. Making the container itself is never cut short.
    async fn make_pooled(
        self: Arc<Self>,
        env: Arc<Environment>,
        label: String,
        shutdown: CancellationToken,
    ) -> Result<Option<Prepared>, Error> {
        let image = tokio::select! {
            _ = shutdown.cancelled() => return Ok(None),
            image = self.image(&env, &|_| {}) => image?,
        };
        let (blueprint, owner) = (self.blueprint(&env, None), &self.instance.owner);
        let made = Prepared::make(&self.docker, &blueprint, &image, owner, &label, "").await?;
        Ok(Some(made))
    }

    /// The layer store's listing, read once the default environment's pool is first full.
    async fn preload(&self, shutdown: &CancellationToken) {
        let Ok(env) = self.environments.get(None) else { return };
        if let Ok(image) = self.image(&env, &|_| {}).await {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                () = packages::preload(&self.docker, &image, &self.instance.owner) => {}
            }
        }
    }

    /// Removes each environment's oldest ready containers past its target.
    async fn shrink_pool(&self, targets: &[(String, usize)]) {
        let surplus = self.pools().surplus(targets);
        if !surplus.is_empty() {
            tracing::debug!(removed = surplus.len(), "demand fell: the warm pool shrinks");
            futures::future::join_all(surplus.into_iter().map(|p| p.destroy(&self.docker))).await;
        }
    }
}
