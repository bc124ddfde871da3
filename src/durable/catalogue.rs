//! The catalogue of a server's snapshots (issue 18): by (principal, name), bounded in total
//! bytes, least recently used first out, each recorded in the ledger from the moment it is
//! added until it leaves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use super::ledger::Ledger;
use super::records::{SavedRecord, Snap};
use crate::session::snapshot::Saved;

/// One snapshot of the catalogue.
#[derive(Debug)]
pub(crate) struct Entry {
    /// Its name, unique per principal.
    pub(crate) name: String,
    /// Whose it is.
    pub(crate) principal: String,
    /// The session it was taken from.
    pub(crate) session: String,
    /// When it was taken.
    pub(crate) created: SystemTime,
    last_used: Mutex<Instant>,
    /// What the store holds.
    pub(crate) saved: Saved,
}

impl Entry {
    fn touch(&self) {
        if let Ok(mut t) = self.last_used.lock() {
            *t = Instant::now();
        }
    }

    fn used(&self) -> Instant {
        self.last_used.lock().map(|t| *t).unwrap_or_else(|_| Instant::now())
    }
}

/// The snapshots of a server: by (principal, name), bounded in total bytes, least recently
/// used first out. Another principal's snapshot behaves exactly as a missing one.
#[derive(Debug)]
pub(crate) struct Catalogue {
    entries: Mutex<HashMap<(String, String), Arc<Entry>>>,
    serial: AtomicU64,
    /// Where each snapshot's record is written as it comes and removed as it goes.
    ledger: Ledger,
    /// This server's instance: the one a snapshot's volume is labelled with, unless it was
    /// carried over from an adopted instance.
    instance: String,
    /// One lock per principal, held while its snapshot is checked against its caps, taken
    /// and kept: many calls at once cannot all pass a check made before any of them landed.
    /// Entries nobody holds are dropped.
    turns: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Catalogue {
    /// An empty catalogue of instance `instance`, recorded in `ledger`.
    pub(crate) fn new(ledger: Ledger, instance: String) -> Self {
        Self { entries: Mutex::default(), serial: AtomicU64::new(0), ledger, instance, turns: Mutex::default() }
    }

    /// The record of `entry`, for a next server.
    fn record(&self, entry: &Entry) -> Snap {
        // The instance its volume is labelled with (`pyberth-<instance>-snap-<id>`): one
        // carried over from an adopted instance stays that instance's.
        let instance = entry
            .saved
            .store
            .volume
            .strip_prefix("pyberth-")
            .and_then(|v| v.rsplit_once("-snap-"))
            .map_or_else(|| self.instance.clone(), |(i, _)| i.to_owned());
        Snap {
            instance,
            principal: entry.principal.clone(),
            name: entry.name.clone(),
            session: entry.session.clone(),
            saved: SavedRecord::from(&entry.saved),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Arc<Entry>>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for `principal`'s turn to add a snapshot (see `turns`).
    pub(crate) async fn turn(&self, principal: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut turns = self.turns.lock().unwrap_or_else(|e| e.into_inner());
            turns.retain(|_, l| Arc::strong_count(l) > 1);
            turns.entry(principal.to_owned()).or_default().clone()
        };
        lock.lock_owned().await
    }

    /// The count and bytes of `principal`'s snapshots, but `except` (one about to be replaced).
    pub(crate) fn use_of(&self, principal: &str, except: &str) -> (usize, u64) {
        self.map()
            .values()
            .filter(|e| e.principal == principal && e.name != except)
            .fold((0, 0), |(n, b), e| (n + 1, b + e.saved.summary.bytes()))
    }

    /// A fresh id for a snapshot volume (unique within the instance).
    pub(crate) fn next_id(&self) -> String {
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        format!("{}-{nanos:08x}", self.serial.fetch_add(1, Ordering::Relaxed))
    }

    /// A name for a snapshot the caller did not name.
    pub(crate) fn default_name(&self, session: &str) -> String {
        let n = self.serial.fetch_add(1, Ordering::Relaxed);
        let base: String = session.chars().take(30).collect();
        format!("{base}-{n}")
    }

    /// Adds a snapshot, recorded as it is made (so a server killed with -9 leaves it to the
    /// next one as a clean stop does); returns the one it replaced (same principal and name),
    /// its record gone, for its store to be removed.
    pub(crate) fn insert(&self, principal: &str, name: &str, session: &str, saved: Saved) -> Option<Arc<Entry>> {
        let saved_volume = saved.store.volume.clone();
        let entry = Arc::new(Entry {
            name: name.to_owned(),
            principal: principal.to_owned(),
            session: session.to_owned(),
            created: SystemTime::now(),
            last_used: Mutex::new(Instant::now()),
            saved,
        });
        self.ledger.snapshot_kept(&self.record(&entry));
        let old = self.map().insert((principal.to_owned(), name.to_owned()), entry);
        self.forget(old.as_ref().filter(|o| o.saved.store.volume != saved_volume));
        old
    }

    fn forget(&self, entry: Option<&Arc<Entry>>) {
        if let Some(e) = entry {
            self.ledger.snapshot_gone(&e.saved.store.volume);
        }
    }

    /// A snapshot of `principal`, marked used.
    pub(crate) fn get(&self, principal: &str, name: &str) -> Option<Arc<Entry>> {
        let e = self.map().get(&(principal.to_owned(), name.to_owned())).cloned()?;
        e.touch();
        Some(e)
    }

    /// The snapshots of `principal`, newest first.
    pub(crate) fn list(&self, principal: &str) -> Vec<Arc<Entry>> {
        let mut all: Vec<Arc<Entry>> = self.map().values().filter(|e| e.principal == principal).cloned().collect();
        all.sort_by_key(|e| std::cmp::Reverse(e.created));
        all
    }

    /// Takes a snapshot of `principal` out of the catalogue, its record with it.
    pub(crate) fn remove(&self, principal: &str, name: &str) -> Option<Arc<Entry>> {
        let gone = self.map().remove(&(principal.to_owned(), name.to_owned()));
        self.forget(gone.as_ref());
        gone
    }

    /// Snapshots kept.
    pub(crate) fn count(&self) -> usize {
        self.map().len()
    }

    /// Bytes of every snapshot.
    pub(crate) fn total(&self) -> u64 {
        self.map().values().map(|e| e.saved.summary.bytes()).sum()
    }

    /// Takes out least recently used snapshots until all fit in `cap` bytes, `principal`'s
    /// own first, then anyone's; never `keep`. Returns them, their records gone, for their
    /// volumes to be removed.
    pub(crate) fn prune(&self, cap: u64, principal: &str, keep: &str) -> Vec<Arc<Entry>> {
        let mut map = self.map();
        let mut total: u64 = map.values().map(|e| e.saved.summary.bytes()).sum();
        let mut order: Vec<Arc<Entry>> =
            map.values().filter(|e| !(e.principal == principal && e.name == keep)).cloned().collect();
        order.sort_by_key(|e| (e.principal != principal, e.used()));
        let mut out = Vec::new();
        for e in order {
            if total <= cap {
                break;
            }
            total = total.saturating_sub(e.saved.summary.bytes());
            map.remove(&(e.principal.clone(), e.name.clone()));
            self.forget(Some(&e));
            out.push(e);
        }
        out
    }

    /// Everything, their records with them, for a shutdown that leaves nothing behind.
    pub(crate) fn drain(&self) -> Vec<Arc<Entry>> {
        let all: Vec<Arc<Entry>> = self.map().drain().map(|(_, e)| e).collect();
        all.iter().for_each(|e| self.forget(Some(e)));
        all
    }
}
