//! Identity and liveness of a server instance.
//!
//! Several servers may share one engine (two desktop clients each start `pyberth serve`), so
//! the start-up sweep must tell a dead server's leftovers from a live server's sessions. Each
//! instance holds an exclusive lock on `<state dir>/<instance>.lock` for its whole life; the
//! kernel drops the lock when the process dies, even by SIGKILL. A labelled container or
//! volume from this host whose instance lock can be taken (or is missing) is a leftover.
//! Resources from other hosts are left alone: their liveness cannot be checked from here.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions, TryLockError};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::docker::container::Owner;
use crate::docker::{LABEL_HOST, LABEL_INSTANCE};

/// This process's identity, and the lock that proves it is alive.
#[derive(Debug)]
pub struct Instance {
    /// Labels' view of the instance.
    pub owner: Owner,
    dir: PathBuf,
    lock_path: PathBuf,
    /// Held for the life of the process; released by the kernel at exit.
    _lock: File,
}

impl Instance {
    /// Takes an identity (random unless `name` is given) and its lock.
    pub fn acquire(dir: &Path, name: Option<&str>) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let instance = match name {
            Some(n) => n.to_owned(),
            None => random_id()?,
        };
        let lock_path = dir.join(format!("{instance}.lock"));
        let lock = OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(std::io::Error::other(format!("instance {instance} is already running")));
            }
            Err(TryLockError::Error(e)) => return Err(e),
        }
        Ok(Self { owner: Owner { instance, host: host_id() }, dir: dir.to_owned(), lock_path, _lock: lock })
    }

    /// The instance a resource with these labels belongs to, when it is another instance on
    /// this host whose liveness `dead` can probe (a name that is safe in a path).
    pub fn other_here<'a>(&self, labels: &'a HashMap<String, String>) -> Option<&'a str> {
        let (Some(instance), Some(host)) = (labels.get(LABEL_INSTANCE), labels.get(LABEL_HOST)) else {
            return None;
        };
        if *instance == self.owner.instance || *host != self.owner.host {
            return None;
        }
        if instance.is_empty() || !instance.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return None;
        }
        Some(instance)
    }

    /// Which of `instances` (from `other_here`) are dead; a dead one's lock file is removed.
    /// The flock probes are file I/O, so they run on a blocking thread.
    pub async fn dead(&self, instances: HashSet<String>) -> HashSet<String> {
        let dir = self.dir.clone();
        let probe = move || instances.into_iter().filter(|i| lock_is_free(&dir, i)).collect();
        tokio::task::spawn_blocking(probe).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot probe instance locks; nothing is swept");
            HashSet::new()
        })
    }

    /// Whether a resource with these labels is this instance's own.
    pub fn is_own(&self, labels: &HashMap<String, String>) -> bool {
        labels.get(LABEL_INSTANCE) == Some(&self.owner.instance) && labels.get(LABEL_HOST) == Some(&self.owner.host)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.lock_path);
    }
}

/// Whether `instance`'s lock in `dir` is free: no lock file (its owner never lived here or the
/// state dir was wiped at a reboot), or one nobody holds, which is then removed.
fn lock_is_free(dir: &Path, instance: &str) -> bool {
    let path = dir.join(format!("{instance}.lock"));
    let Ok(file) = OpenOptions::new().write(true).open(&path) else {
        return true;
    };
    match file.try_lock() {
        Ok(()) => {
            let _ = std::fs::remove_file(&path);
            true
        }
        Err(_) => false,
    }
}

fn random_id() -> std::io::Result<String> {
    let mut bytes = [0u8; 6];
    File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
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

    fn labels(instance: &str, host: &str) -> HashMap<String, String> {
        HashMap::from([(LABEL_INSTANCE.into(), instance.into()), (LABEL_HOST.into(), host.into())])
    }

    /// What the sweep decides for one resource.
    async fn leftover(me: &Instance, labels: &HashMap<String, String>) -> bool {
        match me.other_here(labels) {
            Some(i) => me.dead(HashSet::from([i.to_owned()])).await.contains(i),
            None => false,
        }
    }

    #[tokio::test]
    async fn live_dead_and_foreign_instances() {
        let dir = std::env::temp_dir().join(format!("pyberth-instance-test-{}", std::process::id()));
        let me = Instance::acquire(&dir, Some("me")).expect("me");
        let other = Instance::acquire(&dir, Some("other")).expect("other");
        let host = me.owner.host.clone();
        assert!(!leftover(&me, &labels("me", &host)).await, "own resources are not leftovers");
        assert!(me.is_own(&labels("me", &host)));
        assert!(!leftover(&me, &labels("other", &host)).await, "a live instance is not dead");
        assert!(Instance::acquire(&dir, Some("other")).is_err(), "the lock is exclusive");
        drop(other);
        assert!(leftover(&me, &labels("other", &host)).await, "a dropped instance is dead");
        assert!(leftover(&me, &labels("never-existed", &host)).await);
        assert!(!leftover(&me, &labels("never-existed", "another-host")).await, "other hosts are left alone");
        assert!(!leftover(&me, &labels("../etc/x", &host)).await, "odd names are never touched");
        drop(me);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
