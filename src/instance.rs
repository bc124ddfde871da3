//! Identity and liveness of a server instance (docs/design.md D9).
//!
//! Why this file passes 500 lines: the two kinds of evidence of liveness (the lock, the
//! heartbeat kept by [`Keeper`]) and the sweep that judges them are one argument, below.
//!
//! Several servers may share one engine (two desktop clients each start `pyberth serve`, a CI
//! job beside a workstation, servers on other hosts driving one remote engine), so the start-up
//! sweep must tell a dead server's leftovers from a live server's sessions. Two kinds of
//! evidence exist, and only evidence makes an instance dead:
//!
//! - **Its lock.** Each instance holds an exclusive lock on `<state dir>/<instance>.lock` for
//!   its whole life; the kernel drops it when the process dies, even by SIGKILL. A lock file
//!   in *our* state dir, of an instance of this host and boot, that we can take proves that
//!   instance dead; one we cannot take proves it alive. A missing lock file proves nothing:
//!   that instance may use another state dir (`--state-dir`, `TMPDIR`, systemd's
//!   `PrivateTmp`, a CI job's own temp dir).
//! - **Its heartbeat** ([`crate::docker::heartbeat`]): a tiny container that runs exactly as
//!   long as its server holds an attach connection to it, readable by every instance through
//!   the engine, and removed by the engine once it stops; two labelled volumes say that the
//!   instance had one and since when it is stopped. A running heartbeat proves its instance
//!   alive. One stopped for longer than a grace (`--leftover-grace-s`, measured on the
//!   engine's clock) proves it dead; one stopped for less makes the sweep look again once the
//!   grace is over, since a server whose connection to a remote engine broke makes itself a
//!   new heartbeat when it is back.
//!
//! An instance with neither kind of evidence (no lock we can see, no heartbeat: an older
//! pyberth, or a server that never got to start its heartbeat) is of unknown liveness, and
//! unknown is never dead: its resources are left alone.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions, TryLockError};

use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::docker::{Engine, EngineRef};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::SandboxConfig;
use crate::docker::container::{self, Owner};
use crate::docker::heartbeat::{self, Beat, LABEL_HEARTBEAT};
use crate::docker::{self as engine, LABEL_HOST, LABEL_INSTANCE, image};

/// This process's identity, and the lock that proves it is alive.
#[derive(Debug)]
pub struct Instance {
    /// Labels' view of the instance.
    pub owner: Owner,
    dir: PathBuf,
    lock_path: PathBuf,
    /// Held for the life of the process; released by the kernel at exit.
    _lock: File,
    /// Locks of dead instances whose sessions this one adopted (docs/design.md D12), held
    /// like its own: the adopted sessions count as alive to every server sharing the state
    /// dir, and die with this process, for the next server to adopt again.
    claimed: Mutex<Vec<(String, PathBuf, File)>>,
    /// Set by a stop that leaves sessions for the next server: lock files stay, free, as a
    /// killed server's do, so the next server of the state dir knows these instances dead.
    keep_lock_files: AtomicBool,
}

impl Instance {
    /// Takes an identity (random unless `name` is given) and its lock.
    pub fn acquire(dir: &Path, name: Option<&str>) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let instance = match name {
            Some(n) => n.to_owned(),
            None => crate::state_dir::random_id()?,
        };
        let lock_path = dir.join(format!("{instance}.lock"));
        let lock = crate::state_dir::open_lock(&lock_path)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(std::io::Error::other(format!("instance {instance} is already running")));
            }
            Err(TryLockError::Error(e)) => return Err(e),
        }
        Ok(Self {
            owner: Owner { instance, host: host_id() },
            dir: dir.to_owned(),
            lock_path,
            _lock: lock,
            claimed: Mutex::new(Vec::new()),
            keep_lock_files: AtomicBool::new(false),
        })
    }

    /// Takes and holds the lock of instance `name` of our state dir if nobody holds it (that
    /// instance is dead): true when it is now ours. No lock file: false (no evidence).
    fn claim(&self, name: &str) -> bool {
        if name == self.owner.instance || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return false;
        }
        let path = self.dir.join(format!("{name}.lock"));
        let Ok(file) = OpenOptions::new().write(true).custom_flags(crate::state_dir::no_follow()).open(&path) else {
            return false;
        };
        if file.try_lock().is_err() {
            return false;
        }
        self.claimed.lock().unwrap_or_else(|e| e.into_inner()).push((name.to_owned(), path, file));
        true
    }

    /// The owners whose sessions this instance adopted, on this host.
    pub fn adopted_owners(&self) -> Vec<Owner> {
        let claimed = self.claimed.lock().unwrap_or_else(|e| e.into_inner());
        claimed.iter().map(|(n, _, _)| Owner { instance: n.clone(), host: self.owner.host.clone() }).collect()
    }

    /// At a stop that leaves the sessions running for the next server: the lock files stay.
    pub fn keep_lock_files(&self) {
        self.keep_lock_files.store(true, Ordering::SeqCst);
    }

    /// Instances whose sessions this server adopts at start (docs/design.md D12), among
    /// `candidates` (those that left session records): dead ones of this host and state dir
    /// (their lock free, now held by us), and this instance's own name when it was given
    /// again. Those whose heartbeat stopped less than `grace` ago, or is stopping now, come
    /// first; those beyond the grace second: nobody adopted their sessions in time, so the
    /// adopting server puts them to sleep (issue 18: they hibernate).
    pub async fn claim_adoptable(
        &self,
        docker: &dyn Engine,
        found: &container::Inventory,
        candidates: &HashSet<String>,
        grace: Duration,
    ) -> (Vec<String>, Vec<String>) {
        let labels = found.containers.iter().map(|c| &c.labels).chain(found.volumes.iter().map(|(_, l)| l));
        let mut names: Vec<&String> = labels
            .filter(|l| l.get(LABEL_HOST) == Some(&self.owner.host))
            .filter_map(|l| l.get(LABEL_INSTANCE))
            .filter(|i| candidates.contains(*i))
            .collect();
        names.sort();
        names.dedup();
        let names: Vec<String> =
            names.into_iter().filter(|n| **n == self.owner.instance || self.claim(n)).cloned().collect();
        let host = self.owner.host.clone();
        let wanted = |k: &Key| k.1 == host && names.contains(&k.0);
        let beats = heartbeat::evidence(docker, &found.containers, &wanted).await;
        let mut adoptable = Vec::new();
        let mut late = Vec::new();
        for name in names {
            // Running: another's (or ours, of the process before this one) is stopping now.
            let within = match beats.get(&(name.clone(), host.clone())) {
                Some(Beat::Running) => true,
                Some(Beat::StoppedFor(d)) => *d < grace,
                Some(Beat::Absent) | None => false,
            };
            if within {
                adoptable.push(name);
            } else {
                late.push(name);
            }
        }
        (adoptable, late)
    }

    /// Whether a resource with these labels is this instance's own.
    pub fn is_own(&self, labels: &HashMap<String, String>) -> bool {
        labels.get(LABEL_INSTANCE) == Some(&self.owner.instance) && labels.get(LABEL_HOST) == Some(&self.owner.host)
    }

    /// A sweeper of other instances' leftovers, judging stopped heartbeats with `grace`.
    pub fn sweeper(&self, grace: Duration) -> Sweeper {
        Sweeper { owner: self.owner.clone(), dir: self.dir.clone(), grace, keep: grace }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if self.keep_lock_files.load(Ordering::SeqCst) {
            return;
        }
        let _ = std::fs::remove_file(&self.lock_path);
        for (_, path, _) in self.claimed.get_mut().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// What our state dir says of an instance of this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lock {
    /// Its lock file is here and nobody holds it: it is dead.
    Free,
    /// Its lock file is here and held: it is alive.
    Held,
    /// No lock file here, another host, or a name we never put in a path: says nothing.
    Unseen,
}

/// What the sweep does with an instance's resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Alive,
    Dead,
    /// Its heartbeat stopped, within the grace: look again after this long.
    Dying(Duration),
    /// No evidence either way: left alone.
    Unknown,
}

/// The rule of the module doc: a lock we can see is the kernel's word; otherwise the heartbeat
/// decides; without either, nothing is known and nothing is removed.
fn judge(lock: Lock, beat: Beat, grace: Duration) -> Verdict {
    match (lock, beat) {
        (Lock::Free, _) => Verdict::Dead,
        (Lock::Held, _) | (Lock::Unseen, Beat::Running) => Verdict::Alive,
        (Lock::Unseen, Beat::StoppedFor(d)) if d >= grace => Verdict::Dead,
        (Lock::Unseen, Beat::StoppedFor(d)) => Verdict::Dying(grace - d),
        (Lock::Unseen, Beat::Absent) => Verdict::Unknown,
    }
}

/// An instance as labels name it: (instance, host).
pub type Key = (String, String);

/// Removes what dead instances left behind (see the module doc).
#[derive(Debug, Clone)]
pub struct Sweeper {
    owner: Owner,
    dir: PathBuf,
    grace: Duration,
    /// How long a dead instance's stopped sessions (orphans that saved their state, D12) are
    /// kept for a next server of its state dir, judged by heartbeat: `--idle-ttl-s`.
    keep: Duration,
}

/// What one sweep did.
#[derive(Debug, Default)]
pub struct Swept {
    /// Containers removed (heartbeats included).
    pub containers: usize,
    /// Volumes removed.
    pub volumes: usize,
    /// When to look again, for instances whose heartbeat stopped within the grace.
    pub recheck: Option<Duration>,
}

impl Sweeper {
    /// Keeps dead instances' stopped sessions for `keep` (at least the grace).
    pub fn keeping(mut self, keep: Duration) -> Self {
        self.keep = keep.max(self.grace);
        self
    }

    /// The owner of a resource with these labels, unless it is ours or unlabelled.
    fn key(&self, labels: &HashMap<String, String>) -> Option<Key> {
        let instance = labels.get(LABEL_INSTANCE).or_else(|| labels.get(LABEL_HEARTBEAT))?;
        let host = labels.get(LABEL_HOST)?;
        let own = *instance == self.owner.instance && *host == self.owner.host;
        (!own && !instance.is_empty()).then(|| (instance.clone(), host.clone()))
    }

    /// One sweep: lists our labelled containers and volumes once, reads the heartbeats of the
    /// instances found (an inspect per stopped one), probes the locks we can see, and removes
    /// what the dead instances left.
    pub async fn sweep(&self, docker: &dyn Engine) -> Result<Swept, engine::Error> {
        let found = container::inventory(docker).await?;
        let (dead, recheck) = self.dead(docker, &found).await;
        let mut swept = Swept { recheck: recheck.map(|r| r + Duration::from_secs(1)), ..Swept::default() };
        if dead.is_empty() {
            return Ok(swept);
        }
        let of_dead = |l: &HashMap<String, String>| self.key(l).is_some_and(|k| dead.contains(&k));
        for c in found.containers.iter().filter(|c| of_dead(&c.labels)) {
            swept.containers += usize::from(container::remove_leftover_container(docker, &c.id).await);
        }
        for (name, _) in found.volumes.iter().filter(|(_, l)| of_dead(l)) {
            swept.volumes += usize::from(container::remove_leftover_volume(docker, name).await);
        }
        let names: Vec<&str> = dead.iter().map(|(i, _)| i.as_str()).collect();
        tracing::info!(
            instances = ?names,
            containers = swept.containers,
            volumes = swept.volumes,
            "removed leftovers of dead instances"
        );
        Ok(swept)
    }

    /// The instances of `found`'s resources that are dead by the rule, and when to look again
    /// for those in doubt.
    pub async fn dead(&self, docker: &dyn Engine, found: &container::Inventory) -> (HashSet<Key>, Option<Duration>) {
        let owners: HashSet<Key> = found
            .containers
            .iter()
            .map(|c| &c.labels)
            .chain(found.volumes.iter().map(|(_, l)| l))
            .filter_map(|l| self.key(l))
            .collect();
        if owners.is_empty() {
            return (HashSet::new(), None);
        }
        let wanted = |k: &Key| owners.contains(k);
        let beats = heartbeat::evidence(docker, &found.containers, &wanted).await;
        let locks = self.locks(owners.iter().filter(|(_, host)| *host == self.owner.host).cloned().collect()).await;
        let mut dead = HashSet::new();
        let mut recheck: Option<Duration> = None;
        let mut unknown = Vec::new();
        // Instances that left stopped sessions: orphans holding their state for a next server.
        let holding: HashSet<Key> = holding(found).iter().filter_map(|l| self.key(l)).collect();
        for key in &owners {
            let lock = locks.get(key).copied().unwrap_or(Lock::Unseen);
            let beat = beats.get(key).copied().unwrap_or(Beat::Absent);
            let verdict = match (judge(lock, beat, self.grace), beat) {
                (Verdict::Dead, Beat::StoppedFor(d))
                    if lock != Lock::Free && holding.contains(key) && d < self.keep =>
                {
                    Verdict::Dying(self.keep - d)
                }
                (v, _) => v,
            };
            match verdict {
                Verdict::Dead => {
                    dead.insert(key.clone());
                }
                Verdict::Dying(left) => recheck = Some(recheck.map_or(left, |r| r.min(left))),
                Verdict::Unknown => unknown.push(key.0.as_str()),
                Verdict::Alive => {}
            }
        }
        if !unknown.is_empty() {
            tracing::info!(
                instances = ?unknown,
                "resources of instances of unknown liveness left alone (no lock or heartbeat says they are dead)"
            );
        }
        (dead, recheck)
    }

    /// The (instance, host) a resource with these labels belongs to, unless it is ours.
    pub fn owner_of(&self, labels: &HashMap<String, String>) -> Option<Key> {
        self.key(labels)
    }

    /// The lock evidence of instances of this host, probed on a blocking thread (file I/O).
    async fn locks(&self, keys: Vec<Key>) -> HashMap<Key, Lock> {
        let dir = self.dir.clone();
        let probe = move || keys.into_iter().map(|k| (probe_lock(&dir, &k.0), k)).map(|(l, k)| (k, l)).collect();
        tokio::task::spawn_blocking(probe).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot probe instance locks; going by heartbeats alone");
            HashMap::new()
        })
    }
}

/// The labels of sessions that hold state for a next server (docs/design.md D12): a workspace
/// volume whose container (of its name) is gone, or a session container, stopped (an older
/// pyberth's, or one being removed) or still running: an orphan that has yet to save itself,
/// which it does only after its server's `--adopt-grace-s` (default 600), longer than the
/// default `--leftover-grace-s` (300) after which a server of another state dir judges by.
fn holding(found: &container::Inventory) -> Vec<&HashMap<String, String>> {
    let named: HashSet<&str> = found.containers.iter().map(|c| c.name.as_str()).collect();
    let stopped = found.containers.iter().filter(|c| c.labels.contains_key(engine::LABEL_SESSION));
    let left = found.volumes.iter().filter(|(name, l)| {
        l.contains_key(engine::LABEL_SESSION)
            && !l.contains_key(engine::snapshot::LABEL_SNAPSHOT)
            && !named.contains(name.strip_suffix(engine::tether::KEEP_SUFFIX).unwrap_or(name))
    });
    stopped.map(|c| &c.labels).chain(left.map(|(_, l)| l)).collect()
}

/// What `dir` says of `instance`'s lock; a free one is removed.
fn probe_lock(dir: &Path, instance: &str) -> Lock {
    // Only names we could have written ourselves ever reach a path.
    if instance.is_empty() || !instance.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Lock::Unseen;
    }
    let path = dir.join(format!("{instance}.lock"));
    let Ok(file) = OpenOptions::new().write(true).custom_flags(crate::state_dir::no_follow()).open(&path) else {
        return Lock::Unseen;
    };
    match file.try_lock() {
        Ok(()) => {
            let _ = std::fs::remove_file(&path);
            Lock::Free
        }
        Err(TryLockError::WouldBlock) => Lock::Held,
        Err(TryLockError::Error(_)) => Lock::Unseen,
    }
}

/// This instance's heartbeat, and the sweeps that wait out a grace, until [`Keeper::stop`].
#[derive(Debug, Default)]
pub struct Keeper {
    stop: CancellationToken,
    tasks: TaskTracker,
    /// Set by a stop that leaves sessions: heartbeats then stop and their stop is marked,
    /// saying when the sessions were left (docs/design.md D12).
    leave: Arc<AtomicBool>,
}

impl Keeper {
    /// Keeps a heartbeat of `owner` running on the image of `cfg` (once that image exists and
    /// `after` is done), making a new one whenever it stops while this server runs.
    pub fn beat(
        &self,
        docker: EngineRef,
        cfg: Arc<SandboxConfig>,
        owner: Owner,
        after: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let (stop, leave) = (self.stop.clone(), self.leave.clone());
        self.tasks.spawn(async move {
            // A stop that leaves the sessions goes on to the beat all the same: it starts and
            // leaves at once, marking when they were left (a stop mark kept from an earlier stop
            // would make the next server count its grace from then). `leave` is set first.
            tokio::select! {
                () = stop.cancelled() => {
                    if !leave.load(Ordering::SeqCst) {
                        return;
                    }
                }
                () = after => {}
            }
            keep_beating(docker, cfg, owner, stop, leave).await;
        });
    }

    /// Sweeps again after `after`, and again while some heartbeat is within its grace.
    pub fn recheck(&self, docker: EngineRef, sweeper: Sweeper, after: Duration) {
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            let mut after = after;
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(after) => {}
                }
                match sweeper.sweep(&docker).await {
                    Ok(Swept { recheck: Some(next), .. }) => after = next,
                    Ok(_) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot sweep leftovers of dead instances");
                        return;
                    }
                }
            }
        });
    }

    /// Sweeps every `every` until the server stops: where a dead server's heartbeat is known
    /// dead only some time after it died (a Kubernetes Lease lapses after its duration), a
    /// sweep at start alone would leave its resources until the next server starts.
    pub fn repeat(&self, docker: EngineRef, sweeper: Sweeper, every: Duration) {
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                if let Err(e) = sweeper.sweep(&docker).await {
                    tracing::warn!(error = %e, "cannot sweep leftovers of dead instances");
                }
            }
        });
    }

    /// Stops the heartbeats and the waiting sweeps. With `remove`, removes the heartbeats of
    /// `owners` (this instance's, and those it adopted) and their marks; without, each stops
    /// and its stop is marked, saying when this server left its sessions (docs/design.md D12).
    pub async fn stop(&self, docker: &dyn Engine, owners: &[Owner], remove: bool) {
        self.leave.store(!remove, Ordering::SeqCst);
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        for owner in owners.iter().filter(|_| remove) {
            if let Err(e) = heartbeat::remove_all(docker, owner).await {
                tracing::warn!(error = %e, "cannot remove the heartbeat");
            }
        }
    }
}

async fn keep_beating(
    docker: EngineRef,
    cfg: Arc<SandboxConfig>,
    owner: Owner,
    stop: CancellationToken,
    leave: Arc<AtomicBool>,
) {
    // The sandbox image: `--image`, or ours, which the server builds when absent. The
    // heartbeat waits for it rather than build it beside the server's own build.
    let tag = cfg.image.clone().unwrap_or_else(|| image::tag_for(&cfg));
    let mut pause = Duration::from_secs(1);
    loop {
        let started = match image::exists(&docker, &tag).await {
            Ok(true) => match crate::state_dir::random_id() {
                Ok(suffix) => heartbeat::start(&docker, &tag, &owner, &suffix).await.map(Some),
                Err(e) => Err(engine::Error::Io { context: "no random heartbeat name".into(), source: e }),
            },
            Ok(false) => Ok(None),
            Err(e) => Err(e),
        };
        match started {
            Ok(Some(mut live)) => {
                tracing::debug!(container = %container::short(&live.id), "heartbeat started");
                pause = Duration::from_secs(1);
                // After it runs, never before (see `heartbeat::mark_beating`).
                if let Err(e) = heartbeat::mark_beating(&docker, &owner).await {
                    tracing::warn!(error = %e, "cannot mark the heartbeat running (a stale stop mark may stay)");
                }
                tokio::select! {
                    _ = stop.cancelled() => {
                        if leave.load(Ordering::SeqCst) {
                            leave_stopped(&docker, live, &owner).await;
                        } else {
                            container::remove_container(&docker, &live.id).await;
                        }
                        return;
                    }
                    () = live.stopped() => {}
                }
                if stop.is_cancelled() {
                    return;
                }
                tracing::warn!(
                    "the heartbeat stopped while this server runs (engine restarted, or its connection lost); starting another"
                );
                container::remove_container(&docker, &live.id).await;
            }
            // The image is not there yet (the server is building it): look again, less often.
            Ok(None) => pause = (pause * 2).min(Duration::from_secs(10)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the heartbeat (until it runs, servers using another state dir cannot tell this one is alive, and leave it alone); retrying");
                pause = (pause * 2).min(Duration::from_secs(30));
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// A stop that leaves the sessions: dropping the connection stops the heartbeat (and the engine
/// removes it), then the moment is marked (`heartbeat::mark_stopped`). Not marked before it
/// has stopped: a next server started at once would see it running, as if it were its own,
/// and find no time of leaving.
async fn leave_stopped(docker: &dyn Engine, live: heartbeat::Live, owner: &Owner) {
    let id = live.id.clone();
    drop(live);
    let stopped = async {
        while container::is_running(docker, &id).await.unwrap_or(false) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), stopped).await;
    if let Err(e) = heartbeat::mark_stopped(docker, owner).await {
        tracing::warn!(error = %e, "cannot mark when the heartbeat stopped; the next server to look marks it then");
    }
}

/// Hostname plus boot id: a new boot is a new host, whose old instances are all dead.
fn host_id() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_owned()).unwrap_or_default();
    let host = read("/proc/sys/kernel/hostname");
    let boot = read("/proc/sys/kernel/random/boot_id");
    let boot = boot.get(..8).unwrap_or(&boot);
    let id: String = format!("{host}-{boot}")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' })
        .collect();
    id.chars().take(63).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::docker::container::Found;

    fn labels(instance: &str, host: &str) -> HashMap<String, String> {
        HashMap::from([(LABEL_INSTANCE.into(), instance.into()), (LABEL_HOST.into(), host.into())])
    }

    #[test]
    fn locks_alive_dead_unseen_and_odd_names() {
        let dir = std::env::temp_dir().join(format!("pyberth-instance-test-{}", std::process::id()));
        let me = Instance::acquire(&dir, Some("me")).expect("me");
        let other = Instance::acquire(&dir, Some("other")).expect("other");
        assert!(me.is_own(&labels("me", &me.owner.host)));
        assert!(!me.is_own(&labels("me", "another-host")));
        assert_eq!(probe_lock(&dir, "other"), Lock::Held, "a live instance");
        assert!(Instance::acquire(&dir, Some("other")).is_err(), "the lock is exclusive");
        drop(other);
        // Drop removes the file; a SIGKILLed server leaves it, unlocked.
        std::fs::write(dir.join("killed.lock"), b"").expect("lock file");
        assert_eq!(probe_lock(&dir, "killed"), Lock::Free, "a lock nobody holds");
        assert!(!dir.join("killed.lock").exists(), "a free lock is removed");
        assert_eq!(probe_lock(&dir, "other"), Lock::Unseen, "no lock file is no evidence");
        assert_eq!(probe_lock(&dir, "never-existed"), Lock::Unseen);
        assert_eq!(probe_lock(&dir, "../etc/x"), Lock::Unseen, "odd names never reach a path");
        // A planted symlink is not followed.
        std::os::unix::fs::symlink(dir.join("me.lock"), dir.join("planted.lock")).expect("symlink");
        assert_eq!(probe_lock(&dir, "planted"), Lock::Unseen);
        drop(me);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_evidence_makes_an_instance_dead() {
        let g = Duration::from_secs(300);
        let s = Duration::from_secs;
        assert_eq!(judge(Lock::Free, Beat::Running, g), Verdict::Dead, "the kernel's word wins");
        assert_eq!(judge(Lock::Held, Beat::StoppedFor(s(9999)), g), Verdict::Alive);
        assert_eq!(judge(Lock::Held, Beat::Absent, g), Verdict::Alive);
        assert_eq!(judge(Lock::Unseen, Beat::Running, g), Verdict::Alive);
        assert_eq!(judge(Lock::Unseen, Beat::StoppedFor(s(300)), g), Verdict::Dead);
        assert_eq!(judge(Lock::Unseen, Beat::StoppedFor(s(100)), g), Verdict::Dying(s(200)));
        assert_eq!(judge(Lock::Unseen, Beat::Absent, g), Verdict::Unknown, "a missing lock is not death");
    }

    #[test]
    fn orphans_holding_their_state_are_session_containers_and_volumes_without_theirs() {
        let session = |i: &str| {
            let mut l = labels(i, "h");
            l.insert(engine::LABEL_SESSION.into(), "s".into());
            l
        };
        let found = |name: &str, i: &str, running: bool| Found {
            id: format!("id-{name}"),
            name: name.into(),
            labels: session(i),
            running,
            created: None,
        };
        let mut snapshot = session("c");
        snapshot.insert(engine::snapshot::LABEL_SNAPSHOT.into(), "snap".into());
        let inventory = container::Inventory {
            containers: vec![found("pyberth-a-s-0", "a", true), found("pyberth-d-s-3", "d", false)],
            volumes: vec![
                ("pyberth-a-s-0".into(), session("a")),
                ("pyberth-a-s-0-keep".into(), session("a")),
                ("pyberth-b-s-1".into(), session("b")),
                ("pyberth-b-s-1-keep".into(), session("b")),
                ("pyberth-c-snap".into(), snapshot),
                ("pyberth-e-x".into(), labels("e", "h")),
            ],
        };
        let mut who: Vec<&str> =
            holding(&inventory).iter().filter_map(|l| l.get(LABEL_INSTANCE)).map(String::as_str).collect();
        who.sort_unstable();
        who.dedup();
        // a runs (an orphan yet to save itself); b left its volumes; c is a snapshot; d's
        // container stopped; e is no session's.
        assert_eq!(who, ["a", "b", "d"]);
    }

    #[test]
    fn resources_are_keyed_by_instance_and_host_and_ours_are_skipped() {
        let sweeper = Sweeper {
            owner: Owner { instance: "me".into(), host: "h".into() },
            dir: PathBuf::new(),
            grace: Duration::ZERO,
            keep: Duration::ZERO,
        };
        assert_eq!(sweeper.key(&labels("me", "h")), None);
        assert_eq!(sweeper.key(&labels("me", "other-host")), Some(("me".into(), "other-host".into())));
        assert_eq!(sweeper.key(&labels("x", "h")), Some(("x".into(), "h".into())));
        let beat = HashMap::from([(LABEL_HEARTBEAT.into(), "x".into()), (LABEL_HOST.into(), "h".into())]);
        assert_eq!(sweeper.key(&beat), Some(("x".into(), "h".into())), "a heartbeat belongs to its instance");
        assert_eq!(
            sweeper.key(&HashMap::from([(LABEL_INSTANCE.into(), "x".into())])),
            None,
            "no host: not ours to judge"
        );
    }
}
