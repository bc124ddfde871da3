//! Quotas per principal (issue 32), set in `[principals.NAME]` (or `[principals."*"]` for every
//! principal without an entry of its own) beside the caps every caller has: CPU-seconds and
//! run-seconds per UTC day, egress MiB per UTC day, snapshot MiB kept, sessions open at once.
//!
//! The daily counts renew at the UTC day boundary and persist across restarts in
//! `quotas.json` in the state dir (`book.rs`). A run is checked before it starts and charged
//! when it ends: a run that crosses a quota mid-run finishes (its time limit bounds it), and
//! the next is refused. Run-seconds are the run's wall time; CPU-seconds are the CPU time
//! the engine reads from the session container's cgroup, sampled after its runs by the quota
//! keeper (`Registry::quota_keeper`), or the run's wall time times `--cpus` when the engine
//! does not say.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use crate::audit::time::{day_of, seconds_to_next_day};
use crate::bridge::spec::PrincipalSpec;

mod book;

pub use book::Used;
use book::{Book, Loaded};

/// The key of the entry for every principal without its own.
pub const ANY: &str = "*";

/// Containers waiting for a CPU sample; past it a run is charged its upper bound at once.
const MAX_PENDING: usize = 4096;

/// A principal's limits, as configured (absent: no quota of that kind).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Limits {
    /// CPU-seconds per UTC day.
    pub cpu_seconds_per_day: Option<u64>,
    /// Run-seconds per UTC day.
    pub run_seconds_per_day: Option<u64>,
    /// Snapshot bytes kept.
    pub snapshot_bytes: Option<u64>,
    /// Egress bytes per UTC day.
    pub egress_bytes_per_day: Option<u64>,
    /// Sessions open at once.
    pub sessions: Option<usize>,
}

impl Limits {
    fn of(p: &PrincipalSpec) -> Self {
        Self {
            cpu_seconds_per_day: p.cpu_seconds_per_day,
            run_seconds_per_day: p.run_seconds_per_day,
            snapshot_bytes: p.snapshot_mb.map(|mb| mb.saturating_mul(1 << 20)),
            egress_bytes_per_day: p.egress_mb_per_day.map(|mb| mb.saturating_mul(1 << 20)),
            sessions: p.sessions,
        }
    }

    fn any(&self) -> bool {
        *self != Self::default()
    }
}

/// One principal's use against its limits, for metrics (read-only).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Usage {
    /// The principal.
    pub principal: String,
    /// What it used today (UTC).
    pub used: Used,
    /// Its limits.
    pub limits: Limits,
}

/// A run waiting for its container's CPU to be sampled.
#[derive(Debug)]
struct Pending {
    principal: String,
    /// Wall time of its runs since the last sample: the upper bound charged when the engine
    /// does not say.
    wall: Duration,
}

/// The quotas of every principal and what each used.
#[derive(Debug)]
pub struct Quotas {
    limits: HashMap<String, Limits>,
    book: Mutex<Book>,
    path: Option<PathBuf>,
    dirty: AtomicBool,
    cpus: f64,
    pending: Mutex<HashMap<String, Pending>>,
    /// The last CPU reading of each container, nanoseconds.
    last_cpu: Mutex<HashMap<String, u64>>,
    /// Why the saved counts were not taken, said once an audit log is attached.
    pub(crate) reset: Option<String>,
}

impl Quotas {
    /// The quotas of `cfg`, with today's use read from `quotas.json` in `state_dir` (none:
    /// kept in memory only). A file that cannot be read as ours is replaced by empty counts,
    /// and [`Quotas::reset`] says why.
    pub fn load(cfg: &crate::config::SandboxConfig, state_dir: Option<PathBuf>) -> Self {
        let limits: HashMap<String, Limits> =
            cfg.principals.iter().map(|(who, p)| (who.clone(), Limits::of(p))).filter(|(_, l)| l.any()).collect();
        let path = state_dir.map(|d| d.join(book::FILE));
        let today = day_of(SystemTime::now());
        let (book, reset) = match path.as_deref().map(|p| book::read(p, today)) {
            None | Some(Loaded::Absent) => (Book::new(today), None),
            Some(Loaded::Read(b)) => (b, None),
            Some(Loaded::Bad(why)) => {
                tracing::warn!(reason = %why, "the quota counts in the state dir were unreadable; starting from zero");
                (Book::new(today), Some(why))
            }
        };
        Self {
            limits,
            book: Mutex::new(book),
            path,
            dirty: AtomicBool::new(reset.is_some()),
            cpus: cfg.cpus,
            pending: Mutex::default(),
            last_cpu: Mutex::default(),
            reset,
        }
    }

    /// The limits of `principal` (its own entry, else `"*"`'s); none when no quota applies.
    pub fn limits(&self, principal: &str) -> Option<Limits> {
        self.limits.get(principal).or_else(|| self.limits.get(ANY)).copied()
    }

    /// Whether the configuration names `principal` itself (not through the `"*"` default).
    pub fn is_named(&self, principal: &str) -> bool {
        principal != ANY && self.limits.contains_key(principal)
    }

    /// What `principal` used today.
    pub fn used(&self, principal: &str) -> Used {
        self.with_book(|b| b.used.get(principal).copied().unwrap_or_default())
    }

    /// Every principal's use and limits today: a snapshot for metrics.
    pub fn usage(&self) -> Vec<Usage> {
        let used: BTreeMap<String, Used> = self.with_book(|b| b.used.clone());
        let mut names: Vec<&String> = used.keys().collect();
        names.extend(self.limits.keys().filter(|k| k.as_str() != ANY && !used.contains_key(*k)));
        names
            .into_iter()
            .map(|p| Usage {
                principal: p.clone(),
                used: used.get(p).copied().unwrap_or_default(),
                limits: self.limits(p).unwrap_or_default(),
            })
            .collect()
    }

    /// Whether `principal` may start a run: its daily quotas (CPU, run time, egress) are
    /// not used up. The error says which quota, the use, the limit and when it renews.
    pub fn check_run(&self, principal: &str) -> Result<(), String> {
        let Some(l) = self.limits(principal) else { return Ok(()) };
        let u = self.used(principal);
        let secs = |ms: u64| ms as f64 / 1000.0;
        if let Some(max) = l.cpu_seconds_per_day
            && u.cpu_ms >= max.saturating_mul(1000)
        {
            return Err(exceeded("cpu_seconds_per_day", format!("{:.1} CPU-seconds of {max}", secs(u.cpu_ms))));
        }
        if let Some(max) = l.run_seconds_per_day
            && u.run_ms >= max.saturating_mul(1000)
        {
            return Err(exceeded("run_seconds_per_day", format!("{:.1} run-seconds of {max}", secs(u.run_ms))));
        }
        if let Some(max) = l.egress_bytes_per_day
            && u.egress_bytes >= max
        {
            let mib = |b: u64| b as f64 / f64::from(1 << 20);
            return Err(exceeded(
                "egress_mb_per_day",
                format!("{:.1} MiB of egress of {:.0}", mib(u.egress_bytes), mib(max)),
            ));
        }
        Ok(())
    }

    /// Charges a run that ended: its wall time now, its CPU once the container is sampled.
    pub fn ran(&self, principal: &str, container: &str, wall: Duration) {
        let ms = u64::try_from(wall.as_millis()).unwrap_or(u64::MAX);
        self.charge(principal, |u| u.run_ms = u.run_ms.saturating_add(ms));
        let Ok(mut pending) = self.pending.lock() else { return };
        if pending.len() >= MAX_PENDING && !pending.contains_key(container) {
            drop(pending);
            self.charge_cpu_bound(principal, wall);
            return;
        }
        let p = pending
            .entry(container.to_owned())
            .or_insert_with(|| Pending { principal: principal.to_owned(), wall: Duration::ZERO });
        p.wall += wall;
    }

    /// Charges egress bytes of a run.
    pub fn egress(&self, principal: &str, bytes: u64) {
        if bytes > 0 {
            self.charge(principal, |u| u.egress_bytes = u.egress_bytes.saturating_add(bytes));
        }
    }

    /// Samples the CPU of containers that ran since the last call and charges it.
    pub async fn sample(&self, docker: &dyn crate::docker::Engine) {
        let taken: Vec<(String, Pending)> = match self.pending.lock() {
            Ok(mut p) => p.drain().collect(),
            Err(_) => return,
        };
        for (container, p) in taken {
            let now = crate::docker::container::cpu_ns(docker, &container).await;
            let Some(now) = now else {
                self.charge_cpu_bound(&p.principal, p.wall);
                continue;
            };
            let before = self.last_cpu.lock().ok().and_then(|mut l| l.insert(container.clone(), now)).unwrap_or(0);
            // A counter that went back is a new cgroup: all of it is new.
            let ns = if now >= before { now - before } else { now };
            self.charge(&p.principal, |u| u.cpu_ms = u.cpu_ms.saturating_add(ns / 1_000_000));
        }
    }

    /// Forgets a removed container's last reading.
    pub fn forget(&self, container: &str) {
        if let Ok(mut l) = self.last_cpu.lock() {
            l.remove(container);
        }
    }

    fn charge_cpu_bound(&self, principal: &str, wall: Duration) {
        let bound = Duration::try_from_secs_f64(wall.as_secs_f64() * self.cpus).unwrap_or(Duration::MAX);
        let ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        self.charge(principal, |u| u.cpu_ms = u.cpu_ms.saturating_add(ms));
    }

    fn charge(&self, principal: &str, f: impl FnOnce(&mut Used)) {
        self.with_book(|b| f(b.used.entry(principal.to_owned()).or_default()));
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// The book, on today's day: a new UTC day starts from zero.
    fn with_book<T>(&self, f: impl FnOnce(&mut Book) -> T) -> T {
        let today = day_of(SystemTime::now());
        let mut fresh = Book::new(today);
        let mut guard = self.book.lock();
        let book = match guard.as_mut() {
            Ok(b) => &mut **b,
            Err(_) => &mut fresh,
        };
        if book.day != today {
            *book = Book::new(today);
            self.dirty.store(true, Ordering::Relaxed);
        }
        f(book)
    }

    /// Writes the counts when they changed (atomically, 0600); failures are logged.
    pub fn save(&self) {
        let Some(path) = &self.path else { return };
        if !self.dirty.swap(false, Ordering::Relaxed) {
            return;
        }
        let bytes = self.with_book(|b| book::encode(b));
        if let Err(e) = crate::state_dir::replace(path, &bytes) {
            self.dirty.store(true, Ordering::Relaxed);
            tracing::warn!(error = %e, path = %path.display(), "cannot save the quota counts");
        }
    }
}

/// The error of a quota used up.
fn exceeded(quota: &str, usage: String) -> String {
    let left = seconds_to_next_day(SystemTime::now()).as_secs();
    format!(
        "quota exceeded: {quota} (used {usage} today). It renews at the UTC day boundary (00:00 UTC), in {} h {} min; \
         ask the operator for a larger quota if you need more",
        left / 3600,
        left / 60 % 60
    )
}

/// The error of a quota a new session or a snapshot would pass.
pub fn over_stock(quota: &str, usage: String) -> String {
    format!(
        "quota exceeded: {quota} ({usage}). It does not renew by day: it frees as you close sessions or delete \
         snapshots"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas(file: &str) -> Quotas {
        let mut cfg = crate::config::from_flags(&[]);
        let table: toml::Table = file.parse().expect("toml");
        cfg.principals = table["principals"].clone().try_into().expect("principals");
        Quotas::load(&cfg, None)
    }

    #[test]
    fn a_run_past_a_daily_quota_is_refused_and_says_which_and_when() {
        let q = quotas("[principals.alice]\nrun_seconds_per_day = 2\n[principals.\"*\"]\ncpu_seconds_per_day = 1\n");
        q.check_run("alice").expect("nothing used yet");
        q.ran("alice", "c1", Duration::from_millis(1500));
        q.check_run("alice").expect("1.5 s of 2");
        q.ran("alice", "c1", Duration::from_millis(600));
        let e = q.check_run("alice").expect_err("2.1 s of 2");
        assert!(e.contains("run_seconds_per_day") && e.contains("2.1 run-seconds of 2"), "{e}");
        assert!(e.contains("UTC day boundary"), "{e}");
        q.check_run("bob").expect("bob under the default");
        q.charge_cpu_bound("bob", Duration::from_secs(1));
        let e = q.check_run("bob").expect_err("the default's CPU quota");
        assert!(e.contains("cpu_seconds_per_day"), "{e}");
        assert!(q.limits("carol").is_some_and(|l| l.cpu_seconds_per_day == Some(1)));
    }

    #[test]
    fn egress_past_its_daily_quota_refuses_the_next_run() {
        let q = quotas("[principals.alice]\negress_mb_per_day = 1\n");
        q.egress("alice", 1 << 19);
        q.check_run("alice").expect("half a MiB of one");
        q.egress("alice", 1 << 19);
        let e = q.check_run("alice").expect_err("a MiB of one");
        assert!(e.contains("egress_mb_per_day") && e.contains("1.0 MiB of egress of 1"), "{e}");
        assert_eq!(q.used("alice").egress_bytes, 1 << 20);
    }

    #[test]
    fn a_new_utc_day_starts_from_zero() {
        let q = quotas("[principals.alice]\nrun_seconds_per_day = 1\n");
        q.ran("alice", "c1", Duration::from_secs(5));
        assert!(q.check_run("alice").is_err());
        if let Ok(mut b) = q.book.lock() {
            b.day -= 1; // as if the counts were yesterday's
        }
        q.check_run("alice").expect("a new day");
        assert_eq!(q.used("alice"), Used::default());
    }

    #[test]
    fn principals_without_quotas_are_counted_but_never_refused() {
        let q = quotas("[principals.alice]\ntools = []\n");
        assert!(q.limits("alice").is_none());
        q.ran("alice", "c", Duration::from_secs(100_000));
        q.check_run("alice").expect("no quota");
        assert_eq!(q.usage().len(), 1);
    }
}
