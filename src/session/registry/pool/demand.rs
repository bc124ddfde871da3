//! The warm pool's bookkeeping, pure: per environment, recent demand ([`Demand`]), the
//! containers ready and being made ([`Coming`]), and what one idle container costs; and the
//! share of the server's bounds (`--pool-max`, `--pool-memory-mb`) each environment gets
//! ([`allot`]). Generic over what a pooled container is, so tests hold plain numbers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// New sessions are counted per interval of this length; the target is the peak count.
pub(crate) const INTERVAL: Duration = Duration::from_secs(10);
/// The peak halves for each such span in which no interval reached it, counted from when the
/// pool first held it (the time it takes to make the containers does not eat into the hold).
pub(crate) const HALF_LIFE: Duration = Duration::from_secs(60);
/// What one idle container is taken to hold until one of its environment is measured: a
/// little above the 13 MiB the default's measured on 2026-11-27 (docs/benchmarks.md). A
/// heavier environment's pool may pass the budget by the difference until its first measure
/// (the first container it holds ready).
pub(crate) const UNMEASURED_COST: u64 = 16 << 20;
/// Least a measure counts for: a reading of nothing must not lift the budget.
pub(crate) const LEAST_COST: u64 = 1 << 20;

/// Pooled containers being made, and how many of them new sessions already wait for. At
/// start the first call comes while the keeper makes its first container: two creates at once
/// on a small machine each take longer, so the session waits for that one instead.
#[derive(Debug, Default)]
pub(crate) struct Coming {
    pub(crate) making: usize,
    pub(crate) promised: usize,
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

/// Recent demand for pooled containers: new sessions per [`INTERVAL`], and the peak count,
/// halving each [`HALF_LIFE`] since an interval last reached it.
#[derive(Debug)]
pub(crate) struct Demand {
    pub(crate) floor: usize,
    max: usize,
    interval_from: Instant,
    count: usize,
    peak: usize,
    peak_at: Instant,
    /// Whether the pool has held the peak since it was last raised ([`Demand::held`]).
    held: bool,
}

impl Demand {
    /// Demand that keeps a pool between `floor` (`--pool-size` for the default environment,
    /// 0 for the others) and `max` (`--pool-max`, raised to the floor).
    pub(crate) fn new(floor: usize, max: usize, now: Instant) -> Self {
        Self { floor, max: max.max(floor), interval_from: now, count: 0, peak: 0, peak_at: now, held: true }
    }

    /// A new session (or a wake) asked for a container at `now`.
    pub(crate) fn note(&mut self, now: Instant) {
        if now.saturating_duration_since(self.interval_from) >= INTERVAL {
            (self.interval_from, self.count) = (now, 0);
        }
        self.count = self.count.saturating_add(1);
        if self.count >= self.decayed(now) {
            self.held &= self.count <= self.peak;
            (self.peak, self.peak_at) = (self.count, now);
        }
    }

    /// The pool holds `ready` containers of its `target` (its share of the bounds) at `now`:
    /// the first time since the peak rose that it holds it, the peak's half-life starts over
    /// from now. On a small machine filling a pool of 100 takes 20 to 30 s, which otherwise
    /// left it full for half a minute only.
    pub(crate) fn hold(&mut self, ready: usize, target: usize, now: Instant) {
        if !self.held && ready >= target {
            (self.held, self.peak_at) = (true, now);
        }
    }

    fn halvings(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.peak_at).as_secs() / HALF_LIFE.as_secs()
    }

    fn decayed(&self, now: Instant) -> usize {
        let halvings = u32::try_from(self.halvings(now)).unwrap_or(u32::MAX);
        self.peak.checked_shr(halvings).unwrap_or(0)
    }

    /// Containers the pool should hold at `now`, before the server's bounds ([`allot`]).
    pub(crate) fn target(&self, now: Instant) -> usize {
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

/// Each environment's share of at most `max` containers and `budget` bytes, from `wants` in
/// order (the default environment first) as (target, cost of one, floor): first each floor,
/// as far as it fits; then one container at a time to each environment in turn, as long as it
/// wants more and its next container fits. A burst in one environment cannot take the
/// default's floor, nor starve another of its first containers (max-min fair).
pub(crate) fn allot(wants: &[(usize, u64, usize)], max: usize, budget: u64) -> Vec<usize> {
    let mut given = vec![0; wants.len()];
    let (mut count, mut bytes) = (0usize, 0u64);
    let mut give = |i: usize, cost: u64, given: &mut Vec<usize>| {
        let fits = count < max && bytes.checked_add(cost).is_some_and(|b| b <= budget);
        if fits {
            given[i] += 1;
            count += 1;
            bytes += cost;
        }
        fits
    };
    for (i, &(want, cost, floor)) in wants.iter().enumerate() {
        while given[i] < floor.min(want) && give(i, cost, &mut given) {}
    }
    loop {
        let mut grew = false;
        for (i, &(want, cost, _)) in wants.iter().enumerate() {
            grew |= given[i] < want && give(i, cost, &mut given);
        }
        if !grew {
            return given;
        }
    }
}

/// One environment's pool.
#[derive(Debug)]
pub(crate) struct Pool<T> {
    /// Containers ready, oldest first.
    pub(crate) ready: Vec<T>,
    pub(crate) demand: Demand,
    pub(crate) coming: Coming,
    /// Bytes one idle container of this environment held when last measured.
    pub(crate) cost: Option<u64>,
    /// Containers made for it since it was last measured.
    pub(crate) unmeasured: u64,
}

impl<T> Pool<T> {
    /// What one more container is taken to cost.
    pub(crate) fn cost(&self) -> u64 {
        self.cost.unwrap_or(UNMEASURED_COST)
    }

    /// A measure of one of its idle containers.
    pub(crate) fn measured(&mut self, bytes: u64) {
        self.cost = Some(bytes.max(LEAST_COST));
        self.unmeasured = 0;
    }
}

/// The pools of every environment asked for, and the server's bounds on them all.
#[derive(Debug)]
pub(crate) struct Pools<T> {
    default: String,
    floor: usize,
    max: usize,
    budget: u64,
    /// By environment name; only configured environments are ever asked for, so this stays
    /// as small as the configuration.
    envs: BTreeMap<String, Pool<T>>,
}

impl<T> Pools<T> {
    /// The default environment's pool between `floor` and `max`; other environments' pools
    /// appear when asked for (with no floor). All of them together hold at most `max`
    /// containers and `budget` bytes.
    pub(crate) fn new(default: &str, floor: usize, max: usize, budget: u64, now: Instant) -> Self {
        let mut pools = Self { default: default.to_owned(), floor, max: max.max(floor), budget, envs: BTreeMap::new() };
        pools.of(default, now);
        pools
    }

    /// `env`'s pool, made when first asked for.
    pub(crate) fn of(&mut self, env: &str, now: Instant) -> &mut Pool<T> {
        let floor = if env == self.default { self.floor } else { 0 };
        let max = self.max;
        self.envs.entry(env.to_owned()).or_insert_with(|| Pool {
            ready: Vec::new(),
            demand: Demand::new(floor, max, now),
            coming: Coming::default(),
            cost: None,
            unmeasured: 0,
        })
    }

    /// Every environment's pool, the default's first.
    pub(crate) fn each(&self) -> impl Iterator<Item = (&str, &Pool<T>)> {
        let first = self.envs.get_key_value(&self.default);
        let rest = self.envs.iter().filter(|(name, _)| **name != self.default);
        first.into_iter().chain(rest).map(|(name, pool)| (name.as_str(), pool))
    }

    /// A new session (or a wake) of `env` asks at `now`: counted as demand either way, and
    /// the newest ready container if there is one.
    pub(crate) fn ask(&mut self, env: &str, now: Instant) -> Option<T> {
        let pool = self.of(env, now);
        pool.demand.note(now);
        pool.ready.pop()
    }

    /// A ready container of `env` not promised to a session waiting for one.
    pub(crate) fn take_unpromised(&mut self, env: &str) -> Option<T> {
        let pool = self.envs.get_mut(env)?;
        (pool.ready.len() > pool.coming.promised).then(|| pool.ready.pop()).flatten()
    }

    /// Containers ready, in every environment.
    pub(crate) fn held(&self) -> usize {
        self.envs.values().map(|p| p.ready.len()).sum()
    }

    /// Bytes the ready containers hold, as measured per environment.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.envs.values().map(|p| p.cost().saturating_mul(p.ready.len() as u64)).sum()
    }

    /// Each environment's target at `now`: its demand, within its share of the bounds; none
    /// at all when the pools are off (`--pool-size 0`).
    pub(crate) fn targets(&self, now: Instant) -> Vec<(String, usize)> {
        let wants: Vec<(usize, u64, usize)> =
            self.each().map(|(_, p)| (p.demand.target(now), p.cost(), p.demand.floor)).collect();
        let given = if self.floor == 0 { vec![0; wants.len()] } else { allot(&wants, self.max, self.budget) };
        self.each().map(|(name, _)| name.to_owned()).zip(given).collect()
    }

    /// Tells each environment's demand what its pool holds of its target now.
    pub(crate) fn hold(&mut self, targets: &[(String, usize)], now: Instant) {
        for (env, target) in targets {
            if let Some(pool) = self.envs.get_mut(env) {
                pool.demand.hold(pool.ready.len(), *target, now);
            }
        }
    }

    /// When a target may fall next.
    pub(crate) fn next_fall(&self, now: Instant) -> Option<Instant> {
        self.envs.values().filter_map(|p| p.demand.next_fall(now)).min()
    }

    /// The oldest ready containers past each environment's target.
    pub(crate) fn surplus(&mut self, targets: &[(String, usize)]) -> Vec<T> {
        let mut out = Vec::new();
        for (env, target) in targets {
            if let Some(pool) = self.envs.get_mut(env) {
                let n = pool.ready.len().saturating_sub(*target);
                out.extend(pool.ready.drain(..n));
            }
        }
        out
    }

    /// Every ready container.
    pub(crate) fn drain(&mut self) -> Vec<T> {
        self.envs.values_mut().flat_map(|p| std::mem::take(&mut p.ready)).collect()
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
    fn with_no_floor_the_target_follows_demand_down_to_nothing() {
        let t0 = Instant::now();
        let mut d = Demand::new(0, 16, t0);
        assert_eq!(d.target(t0), 0, "nothing asked, nothing held");
        for _ in 0..3 {
            d.note(t0);
        }
        assert_eq!(d.target(t0), 3);
        assert_eq!(d.target(at(t0, 60)), 1);
        assert_eq!(d.target(at(t0, 120)), 0, "an environment out of use holds nothing");
        assert_eq!(d.next_fall(at(t0, 120)), None);
    }

    #[test]
    fn a_peak_is_held_a_half_life_from_when_the_pool_first_holds_it() {
        let t0 = Instant::now();
        let mut d = Demand::new(2, 100, t0);
        for _ in 0..40 {
            d.note(t0);
        }
        d.hold(12, 40, at(t0, 20));
        assert_eq!(d.target(at(t0, 59)), 40, "not held yet");
        d.hold(40, 40, at(t0, 45));
        assert_eq!(d.target(at(t0, 100)), 40, "a minute from when the pool held it, not from the burst");
        assert_eq!(d.target(at(t0, 105)), 20);
        d.hold(40, 40, at(t0, 200));
        assert_eq!(d.target(at(t0, 200)), 10, "once held, holding again restarts nothing");
        // A higher peak is held afresh; a lower count that resets the peak needs no new hold.
        for _ in 0..50 {
            d.note(at(t0, 300));
        }
        d.hold(50, 50, at(t0, 330));
        assert_eq!(d.target(at(t0, 389)), 50);
        assert_eq!(d.target(at(t0, 390)), 25);
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

    #[test]
    fn shares_are_given_in_turn_so_a_burst_leaves_the_others_theirs() {
        const MB: u64 = 1 << 20;
        // Under both bounds: everyone gets what they want.
        assert_eq!(allot(&[(2, MB, 2), (3, MB, 0)], 16, 100 * MB), [2, 3]);
        // A burst of 50 in the second beside 4 in the first and 2 in the third, at most 16.
        assert_eq!(allot(&[(4, MB, 2), (50, MB, 0), (2, MB, 0)], 16, 100 * MB), [4, 10, 2]);
        // Equal wants past the max split evenly, the first (the default) ahead by one.
        assert_eq!(allot(&[(10, MB, 0), (10, MB, 0)], 5, 100 * MB), [3, 2]);
        // The budget binds before the count: 13 MiB each in 64 MiB is four.
        assert_eq!(allot(&[(10, 13 * MB, 2)], 100, 64 * MB), [4]);
        // A dear environment takes what still fits; a cheap one goes on after it stops.
        assert_eq!(allot(&[(10, 40 * MB, 0), (10, 10 * MB, 0)], 100, 100 * MB), [2, 2]);
        assert_eq!(allot(&[(1, 40 * MB, 0), (10, 10 * MB, 0)], 100, 100 * MB), [1, 6]);
        // The default's floor comes first: two dear environments asked for cannot take it,
        // by bytes or by count.
        assert_eq!(allot(&[(2, 13 * MB, 2), (9, 500 * MB, 0), (9, 500 * MB, 0)], 16, 1024 * MB), [2, 1, 0]);
        assert_eq!(allot(&[(2, MB, 2), (9, MB, 0), (9, MB, 0), (9, MB, 0)], 3, 1024 * MB), [2, 1, 0, 0]);
        // Nothing fits: nothing held, whatever the floor asked (the budget binds the floor too).
        assert_eq!(allot(&[(2, 20 * MB, 2)], 16, 10 * MB), [0]);
        assert_eq!(allot(&[], 16, 10 * MB), Vec::<usize>::new());
    }

    #[test]
    fn pools_of_other_environments_follow_their_own_demand_within_the_shared_bounds() {
        const MB: u64 = 1 << 20;
        let t0 = Instant::now();
        let mut pools: Pools<u32> = Pools::new("default", 2, 8, 1024 * MB, t0);
        assert_eq!(pools.targets(t0), [("default".to_owned(), 2)], "only the default's floor at first");
        for _ in 0..20 {
            assert_eq!(pools.ask("data", t0), None);
        }
        let targets = pools.targets(t0);
        assert_eq!(targets, [("default".to_owned(), 2), ("data".to_owned(), 6)], "the default keeps its floor");
        // Ready containers: the oldest past a falling target go first; asks take the newest.
        pools.of("data", t0).ready.extend([1, 2, 3, 4, 5, 6]);
        pools.of("default", t0).ready.extend([10, 11]);
        assert_eq!(pools.held(), 8);
        assert_eq!(pools.held_bytes(), 8 * UNMEASURED_COST);
        let later = at(t0, 130);
        assert_eq!(pools.targets(later), [("default".to_owned(), 2), ("data".to_owned(), 5)], "20 >> 2");
        assert_eq!(pools.surplus(&pools.targets(later)), [1]);
        assert_eq!(pools.ask("data", later), Some(6));
        // A measured cost lowers what the budget allows; a reading of nothing counts as 1 MiB.
        pools.of("data", t0).measured(0);
        assert_eq!(pools.of("data", t0).cost(), LEAST_COST);
        pools.of("data", t0).measured(200 * MB);
        pools.budget = 1000 * MB;
        assert_eq!(pools.targets(later), [("default".to_owned(), 2), ("data".to_owned(), 4)]);
        assert_eq!(pools.drain().len(), 6);
        assert_eq!(pools.held(), 0);
    }

    #[test]
    fn with_the_pools_off_no_environment_has_a_target_whatever_its_demand() {
        let t0 = Instant::now();
        let mut pools: Pools<u32> = Pools::new("default", 0, 16, u64::MAX, t0);
        for _ in 0..5 {
            pools.ask("default", t0);
            pools.ask("data", t0);
        }
        assert_eq!(pools.targets(t0), [("default".to_owned(), 0), ("data".to_owned(), 0)]);
    }

    #[test]
    fn a_ready_container_promised_to_a_waiting_session_is_not_taken_by_another() {
        let t0 = Instant::now();
        let mut pools: Pools<u32> = Pools::new("default", 1, 4, u64::MAX, t0);
        pools.of("default", t0).coming = Coming { making: 1, promised: 1 };
        pools.of("default", t0).ready.push(7);
        assert_eq!(pools.take_unpromised("default"), None, "the one ready is its waiter's");
        assert_eq!(pools.take_unpromised("elsewhere"), None);
        pools.of("default", t0).ready.push(8);
        assert_eq!(pools.take_unpromised("default"), Some(8));
    }
}
