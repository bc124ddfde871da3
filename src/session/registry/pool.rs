//! The warm pool (docs/design.md D1): started, hardened containers of the default
//! environment, each handed out once, as many as recent demand asks for. [`Demand`] turns
//! new sessions into a target (pure); the keeper makes containers up to it, a few at once,
//! and removes the surplus as the target decays.

use std::time::Instant;

use tokio::task::JoinSet;

use super::*;

/// New sessions are counted per interval of this length; the target is the peak count.
pub(crate) const INTERVAL: Duration = Duration::from_secs(10);
/// The peak halves for each such span in which no interval reached it.
pub(crate) const HALF_LIFE: Duration = Duration::from_secs(60);
/// Most containers made at once when the target jumps above the floor: more would crowd out
/// running sessions on a small machine (the engine serialises much of a create anyway).
pub(crate) const AT_ONCE: usize = 4;
/// First pause after a failed make; it doubles up to [`LONGEST_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(10);
const LONGEST_BACKOFF: Duration = Duration::from_secs(600);
/// Longest a new session waits for a pooled container being made before making its own.
const LONGEST_WAIT: Duration = Duration::from_secs(30);

/// Pooled containers being made, and how many of them new sessions already wait for. At
/// start the first call comes while the keeper makes its first container: two creates at once
/// on a small machine each take longer, so the session waits for that one instead.
#[derive(Debug, Default)]
pub(crate) struct Coming {
    making: usize,
    promised: usize,
}

impl Coming {
    /// Promises one container being made to a new session; false when each is promised.
    pub(crate) fn claim(&mut self) -> bool {
        let free = self.making > self.promised;
        self.promised += usize::from(free);
        free
    }

    /// Whether a claim waited on in vain: fewer being made than promised (one failed, or was
    /// taken by a wake or a session that did not wait). Its holder makes its own.
    pub(crate) fn broken(&self) -> bool {
        self.making < self.promised
    }

    /// A claim ends (served or not).
    pub(crate) fn release(&mut self) {
        self.promised = self.promised.saturating_sub(1);
    }
}

/// A session's claim on a container being made; released however the wait ends (a dropped
/// call included), so no promise outlives its waiter.
struct Claim<'a>(&'a Mutex<Coming>);

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).release();
    }
}

/// Recent demand for pooled containers: new sessions per [`INTERVAL`], and the peak count,
/// halving each [`HALF_LIFE`] since an interval last reached it.
#[derive(Debug)]
pub(crate) struct Demand {
    floor: usize,
    max: usize,
    interval_from: Instant,
    count: usize,
    peak: usize,
    peak_at: Instant,
}

impl Demand {
    /// Demand that keeps the pool between `floor` (`--pool-size`; 0: no pool) and `max`
    /// (`--pool-max`, raised to the floor).
    pub(crate) fn new(floor: usize, max: usize, now: Instant) -> Self {
        Self { floor, max: max.max(floor), interval_from: now, count: 0, peak: 0, peak_at: now }
    }

    /// A new session (or a wake) asked for a container at `now`.
    pub(crate) fn note(&mut self, now: Instant) {
        if now.saturating_duration_since(self.interval_from) >= INTERVAL {
            (self.interval_from, self.count) = (now, 0);
        }
        self.count = self.count.saturating_add(1);
        if self.count >= self.decayed(now) {
            (self.peak, self.peak_at) = (self.count, now);
        }
    }

    fn halvings(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.peak_at).as_secs() / HALF_LIFE.as_secs()
    }

    fn decayed(&self, now: Instant) -> usize {
        let halvings = u32::try_from(self.halvings(now)).unwrap_or(u32::MAX);
        self.peak.checked_shr(halvings).unwrap_or(0)
    }

    /// Containers the pool should hold at `now`.
    pub(crate) fn target(&self, now: Instant) -> usize {
        if self.floor == 0 {
            return 0;
        }
        self.decayed(now).clamp(self.floor, self.max)
    }

    /// When the target may fall next (the next halving), while it is above the floor.
    pub(crate) fn next_fall(&self, now: Instant) -> Option<Instant> {
        (self.target(now) > self.floor).then(|| {
            let spans = u32::try_from(self.halvings(now) + 1).unwrap_or(u32::MAX);
            self.peak_at + HALF_LIFE.saturating_mul(spans)
        })
    }
}

impl Registry {
    fn demand(&self) -> std::sync::MutexGuard<'_, Demand> {
        self.demand.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The containers the pool aims for now.
    pub(super) fn pool_target(&self) -> usize {
        self.demand().target(Instant::now())
    }

    pub(super) fn pool_len(&self) -> usize {
        self.pool.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// A pooled container for a new session of the default environment, if one is ready;
    /// the ask counts as demand either way, and wakes the keeper.
    pub(super) fn pool_pop(&self) -> Option<crate::session::Prepared> {
        self.demand().note(Instant::now());
        let taken = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        self.pool_wake.notify_one();
        taken
    }

    /// A pooled container if one is ready, without counting an ask (the session asked
    /// already); wakes the keeper to refill.
    /// Not one promised to a session waiting for it (`Coming`).
    pub(super) fn pool_pop_quiet(&self) -> Option<crate::session::Prepared> {
        let taken = {
            let coming = self.coming();
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            (pool.len() > coming.promised).then(|| pool.pop()).flatten()
        };
        if taken.is_some() {
            self.pool_wake.notify_one();
        }
        taken
    }

    /// [`Registry::pool_pop`], or else the container the keeper is making that no other new
    /// session waits for yet (see [`Coming`]); `None` when there is none, it went elsewhere,
    /// or it took longer than [`LONGEST_WAIT`].
    pub(super) async fn pool_pop_or_wait(&self) -> Option<crate::session::Prepared> {
        if let Some(p) = self.pool_pop() {
            return Some(p);
        }
        if !self.coming().claim() {
            return None;
        }
        let _claim = Claim(&self.pool_coming);
        let wait = async {
            loop {
                let ready = self.pool_ready.notified();
                tokio::pin!(ready);
                ready.as_mut().enable();
                {
                    // The keeper pushes and counts under this lock: both read together.
                    let coming = self.coming();
                    let taken = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
                    if taken.is_some() || coming.broken() {
                        return taken;
                    }
                }
                ready.await;
            }
        };
        let taken = tokio::time::timeout(LONGEST_WAIT, wait).await.ok().flatten();
        tracing::debug!(served = taken.is_some(), "waited for the pooled container being made");
        self.pool_wake.notify_one();
        taken
    }

    fn coming(&self) -> std::sync::MutexGuard<'_, Coming> {
        self.pool_coming.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The keeper's count: `made` (when one was) goes into the pool, `making` are under way;
    /// the sessions waiting look again.
    fn pool_update(&self, made: Option<crate::session::Prepared>, making: usize) {
        {
            let mut coming = self.coming();
            if let Some(p) = made {
                self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(p);
            }
            coming.making = making;
        }
        self.pool_ready.notify_waiters();
    }

    /// Keeps the warm pool at the demand's target until `shutdown` fires, making up to
    /// [`AT_ONCE`] containers at a time and removing the surplus as the target falls; then
    /// removes what is left in the pool and what was being made.
    pub async fn pool_keeper(self: Arc<Self>, shutdown: CancellationToken) {
        if self.cfg.pool_size == 0 {
            return;
        }
        let env = match self.environments.get(None) {
            Ok(env) => env,
            Err(e) => {
                tracing::warn!(error = %e, "cannot fill the warm pool");
                return;
            }
        };
        let mut making: JoinSet<Result<Option<crate::session::Prepared>, Error>> = JoinSet::new();
        let (mut serial, mut preloaded) = (0u64, false);
        let (mut backoff, mut retry_at) = (FIRST_BACKOFF, None::<Instant>);
        while !shutdown.is_cancelled() {
            let now = Instant::now();
            // A pause after a failure that is over (kept, it would wake this loop at once).
            retry_at = retry_at.filter(|t| *t > now);
            let target = self.demand().target(now);
            self.shrink_pool(target).await;
            let held = self.pool_len();
            // At the floor, one at a time as ever (refills never crowd out running sessions);
            // more at once only as far as demand is above it.
            let at_once = target.saturating_sub(self.cfg.pool_size).clamp(1, AT_ONCE);
            while retry_at.is_none() && held + making.len() < target && making.len() < at_once {
                serial += 1;
                making.spawn(self.clone().make_pooled(env.clone(), format!("pool-{serial}"), shutdown.clone()));
            }
            self.pool_update(None, making.len());
            if !preloaded && making.is_empty() && held >= target {
                // Once the pool is full: the layer store's listing, so that the first new
                // session asking for a cached set waits for nothing but its pooled container.
                preloaded = true;
                self.preload(&env, &shutdown).await;
                continue;
            }
            let wake_at = [retry_at, self.demand().next_fall(now)].into_iter().flatten().min();
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
                Some(done) = making.join_next() => {
                    let made = match done {
                        Ok(Ok(made)) => {
                            (backoff, retry_at) = (FIRST_BACKOFF, None);
                            made
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "cannot fill the warm pool; retrying in {} s", backoff.as_secs());
                            retry_at = Some(Instant::now() + backoff);
                            backoff = (backoff * 2).min(LONGEST_BACKOFF);
                            None
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "a warm pool container's making failed");
                            None
                        }
                    };
                    self.pool_update(made, making.len());
                }
            }
        }
        // What is being made is finished (a container dropped half-made is one nobody would
        // remove), then removed with the rest.
        while let Some(done) = making.join_next().await {
            if let Ok(Ok(Some(p))) = done {
                p.destroy(&self.docker).await;
            }
        }
        // Sessions still waiting make their own.
        self.pool_update(None, 0);
        self.drain_pool().await;
    }

    /// One container for the pool, labelled `label`; `None` when a stop came while its image
    /// was awaited. Making the container itself is never cut short.
    async fn make_pooled(
        self: Arc<Self>,
        env: Arc<Environment>,
        label: String,
        shutdown: CancellationToken,
    ) -> Result<Option<crate::session::Prepared>, Error> {
        let image = tokio::select! {
            _ = shutdown.cancelled() => return Ok(None),
            image = self.image(&env, &|_| {}) => image?,
        };
        let (blueprint, owner) = (self.blueprint(&env, None), &self.instance.owner);
        let made = crate::session::Prepared::make(&self.docker, &blueprint, &image, owner, &label, "").await?;
        Ok(Some(made))
    }

    /// The layer store's listing, read once the pool is first full.
    async fn preload(&self, env: &Environment, shutdown: &CancellationToken) {
        if let Ok(image) = self.image(env, &|_| {}).await {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                () = packages::preload(&self.docker, &image, &self.instance.owner) => {}
            }
        }
    }

    /// Removes the pool's oldest containers past `target`.
    async fn shrink_pool(&self, target: usize) {
        let surplus: Vec<crate::session::Prepared> = {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            let n = pool.len().saturating_sub(target);
            pool.drain(..n).collect()
        };
        if !surplus.is_empty() {
            tracing::debug!(removed = surplus.len(), target, "demand fell: the warm pool shrinks");
            futures::future::join_all(surplus.into_iter().map(|p| p.destroy(&self.docker))).await;
        }
    }

    pub(super) async fn drain_pool(&self) {
        let left: Vec<crate::session::Prepared> =
            std::mem::take(&mut *self.pool.lock().unwrap_or_else(|e| e.into_inner()));
        futures::future::join_all(left.into_iter().map(|p| p.destroy(&self.docker))).await;
    }

    /// Takes a container from the warm pool (waking its keeper to refill it), for a wake.
    pub(super) fn pool_take(&self) -> crate::session::snapshot::PoolTake {
        let (pool, wake, demand) = (self.pool.clone(), self.pool_wake.clone(), self.demand.clone());
        let metrics = self.metrics.clone();
        Arc::new(move || {
            demand.lock().unwrap_or_else(|e| e.into_inner()).note(Instant::now());
            let taken = pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
            wake.notify_one();
            metrics.pool_take(taken.is_some());
            taken
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_container_being_made_is_promised_to_one_session_at_most() {
        let mut c = Coming { making: 2, promised: 0 };
        assert!(c.claim() && c.claim());
        assert!(!c.claim(), "two being made, two promised: a third session makes its own");
        assert!(!c.broken());
        // One is made and taken by its waiter (pushed, counted, popped, released).
        c.making = 1;
        c.release();
        assert!(!c.broken(), "the other is still coming for the other waiter");
        // The last one fails: its waiter stops waiting.
        c.making = 0;
        assert!(c.broken());
        c.release();
        assert!(!c.broken() && !c.claim(), "nothing being made: nothing to claim");
    }

    fn at(start: Instant, secs: u64) -> Instant {
        start + Duration::from_secs(secs)
    }

    #[test]
    fn the_target_is_the_floor_until_demand_passes_it() {
        let t0 = Instant::now();
        let mut d = Demand::new(2, 16, t0);
        assert_eq!(d.target(t0), 2);
        d.note(t0);
        assert_eq!(d.target(t0), 2, "one session a interval is below the floor");
        assert_eq!(d.next_fall(t0), None, "at the floor nothing falls");
    }

    #[test]
    fn a_burst_raises_the_target_to_its_peak_bounded_by_the_max() {
        let t0 = Instant::now();
        let mut d = Demand::new(2, 16, t0);
        for _ in 0..9 {
            d.note(at(t0, 1));
        }
        assert_eq!(d.target(at(t0, 1)), 9);
        for _ in 0..30 {
            d.note(at(t0, 2));
        }
        assert_eq!(d.target(at(t0, 2)), 16, "bounded by --pool-max");
        // The next interval's smaller count does not lower the peak.
        d.note(at(t0, 15));
        assert_eq!(d.target(at(t0, 15)), 16);
    }

    #[test]
    fn the_peak_halves_each_idle_minute_down_to_the_floor() {
        let t0 = Instant::now();
        let mut d = Demand::new(2, 100, t0);
        for _ in 0..40 {
            d.note(t0);
        }
        assert_eq!(d.target(at(t0, 59)), 40);
        assert_eq!(d.next_fall(at(t0, 59)), Some(at(t0, 60)));
        assert_eq!(d.target(at(t0, 60)), 20);
        assert_eq!(d.target(at(t0, 150)), 10);
        assert_eq!(d.next_fall(at(t0, 150)), Some(at(t0, 180)));
        assert_eq!(d.target(at(t0, 240)), 2, "40 >> 4 is 2");
        assert_eq!(d.target(at(t0, 10_000_000)), 2, "never below the floor");
        assert_eq!(d.next_fall(at(t0, 10_000)), None);
    }

    #[test]
    fn demand_at_the_decayed_level_holds_the_peak_there() {
        let t0 = Instant::now();
        let mut d = Demand::new(1, 100, t0);
        for _ in 0..32 {
            d.note(t0);
        }
        // Two minutes on, the peak reads 8: eight new sessions in one interval hold it at 8.
        for _ in 0..8 {
            d.note(at(t0, 120));
        }
        assert_eq!(d.target(at(t0, 179)), 8);
        assert_eq!(d.target(at(t0, 180)), 4, "then it halves from there");
    }

    #[test]
    fn a_pool_size_of_zero_is_no_pool_whatever_the_demand() {
        let t0 = Instant::now();
        let mut d = Demand::new(0, 16, t0);
        for _ in 0..10 {
            d.note(t0);
        }
        assert_eq!(d.target(t0), 0);
        assert_eq!(d.next_fall(t0), None);
    }

    #[test]
    fn a_max_below_the_floor_is_the_floor() {
        let t0 = Instant::now();
        let mut d = Demand::new(4, 1, t0);
        for _ in 0..10 {
            d.note(t0);
        }
        assert_eq!(d.target(t0), 4);
    }
}
