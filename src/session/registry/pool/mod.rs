//! The warm pool (docs/design.md D1): started, hardened containers of each environment in
//! use, each handed out once, as many as recent demand asks for within the server's bounds
//! (`--pool-max` containers, `--pool-memory-mb` bytes) shared fairly between environments.
//! `demand.rs` turns asks into targets (pure); `keeper.rs` makes containers up to them and
//! removes the surplus; here, what new sessions and wakes take.

use std::time::Instant;

use super::*;

mod demand;
mod keeper;

pub(crate) use demand::Pools;

/// Longest a new session waits for a pooled container being made before making its own.
const LONGEST_WAIT: Duration = Duration::from_secs(30);

/// A session's claim on a container of `env` being made; released however the wait ends (a
/// dropped call included), so no promise outlives its waiter. Served, it is released under the
/// lock that took the container (`spent`): another waiter looking between the two would see
/// more promised than coming, and give up on a container still coming for it.
struct Claim<'a> {
    pools: &'a Mutex<Pools<crate::session::Prepared>>,
    env: &'a str,
    spent: std::sync::atomic::AtomicBool,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.spent.load(std::sync::atomic::Ordering::Relaxed) {
            let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
            pools.of(self.env, Instant::now()).coming.release();
        }
    }
}

impl Registry {
    pub(super) fn pools(&self) -> std::sync::MutexGuard<'_, Pools<crate::session::Prepared>> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The containers the pool aims for now, in every environment.
    pub(super) fn pool_target(&self) -> usize {
        self.pools().targets(Instant::now()).iter().map(|(_, n)| n).sum()
    }

    /// The containers ready, in every environment.
    pub(super) fn pool_len(&self) -> usize {
        self.pools().held()
    }

    /// Bytes the ready containers hold (each environment's measured idle container).
    pub(super) fn pool_bytes(&self) -> u64 {
        self.pools().held_bytes()
    }

    /// A pooled container of `env` if one is ready, without counting an ask (the session
    /// asked already); wakes the keeper to refill.
    /// Not one promised to a session waiting for it (`Coming`).
    pub(super) fn pool_pop_quiet(&self, env: &str) -> Option<crate::session::Prepared> {
        let taken = self.pools().take_unpromised(env);
        if taken.is_some() {
            self.pool_wake.notify_one();
        }
        taken
    }

    /// A ready container of `env` (the ask counts as demand either way, and wakes the
    /// keeper), or else the one the keeper is making that no other new session waits for yet
    /// (see `Coming`); `None` when there is none, it went elsewhere, or it took longer than
    /// [`LONGEST_WAIT`].
    pub(super) async fn pool_pop_or_wait(&self, env: &str) -> Option<crate::session::Prepared> {
        let asked = {
            let (mut pools, now) = (self.pools(), Instant::now());
            pools.ask(env, now).ok_or_else(|| pools.of(env, now).coming.claim())
        };
        self.pool_wake.notify_one();
        let claimed = match asked {
            Ok(p) => return Some(p),
            Err(claimed) => claimed,
        };
        if !claimed {
            return None;
        }
        let claim = Claim { pools: &self.pool, env, spent: false.into() };
        let wait = async {
            loop {
                let ready = self.pool_ready.notified();
                tokio::pin!(ready);
                ready.as_mut().enable();
                {
                    // The keeper pushes and counts under this lock: both read together.
                    let mut pools = self.pools();
                    let pool = pools.of(env, Instant::now());
                    let taken = pool.ready.pop();
                    if taken.is_some() {
                        pool.coming.release();
                        claim.spent.store(true, std::sync::atomic::Ordering::Relaxed);
                        return taken;
                    }
                    if pool.coming.broken() {
                        return None;
                    }
                }
                ready.await;
            }
        };
        let taken = tokio::time::timeout(LONGEST_WAIT, wait).await.ok().flatten();
        tracing::debug!(served = taken.is_some(), env, "waited for the pooled container being made");
        self.pool_wake.notify_one();
        taken
    }

    /// Removes every ready container.
    pub(super) async fn drain_pool(&self) {
        let left = self.pools().drain();
        futures::future::join_all(left.into_iter().map(|p| p.destroy(&self.docker))).await;
    }

    /// Takes a container of `env` from the warm pool (waking its keeper to refill it), for a
    /// wake: a session wakes into a container of its own environment, never another's (its
    /// image, limits and runtime).
    pub(super) fn pool_take(&self, env: &str) -> crate::session::snapshot::PoolTake {
        let (pool, wake, metrics, env) =
            (self.pool.clone(), self.pool_wake.clone(), self.metrics.clone(), env.to_owned());
        Arc::new(move || {
            let taken = pool.lock().unwrap_or_else(|e| e.into_inner()).ask(&env, Instant::now());
            wake.notify_one();
            metrics.pool_take(taken.is_some());
            taken
        })
    }
}
