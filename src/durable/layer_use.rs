//! Layer use, as the state dir records it (docs/design.md D6): when each set of the store was
//! last used (`layers-used.json`, the prune's LRU order) and which sets each instance's
//! sessions hold (`layers-in-use-<instance>.json`, never pruned). Written through the ledger
//! only; read by the layer store's prune.

use std::collections::{HashMap, HashSet};

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn uses_path(state_dir: &std::path::Path) -> std::path::PathBuf {
    state_dir.join("layers-used.json")
}

/// Largest use record read: tens of thousands of layers.
const MAX_USES: u64 = 4 << 20;

pub(crate) fn read_uses(state_dir: &std::path::Path) -> HashMap<String, i64> {
    crate::state_dir::read(&uses_path(state_dir), MAX_USES)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Records that a layer was used now. A lost update between two servers only blurs the
/// LRU order, so a write to a fresh temp file and a rename is enough; never through a
/// symlink planted in the state dir (`state_dir::replace`).
pub(super) fn touch(state_dir: &std::path::Path, key: &str) {
    let mut used = read_uses(state_dir);
    used.insert(key.to_owned(), now_s());
    let written = serde_json::to_vec(&used)
        .map_err(std::io::Error::other)
        .and_then(|b| crate::state_dir::replace(&uses_path(state_dir), &b));
    if let Err(e) = written {
        tracing::debug!(error = %e, "cannot record layer use");
    }
}

/// The file where instance `instance` records the sets its sessions use.
fn in_use_path(state_dir: &std::path::Path, instance: &str) -> std::path::PathBuf {
    state_dir.join(format!("layers-in-use-{instance}.json"))
}

/// Records the sets (keys) the sessions of `instance` use now, for prunes by any server or
/// `pyberth layers prune` on this host: a set removed under a session breaks its imports.
pub(super) fn record_in_use(state_dir: &std::path::Path, instance: &str, keys: &[String]) {
    let path = in_use_path(state_dir, instance);
    let written = if keys.is_empty() {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    } else {
        serde_json::to_vec(keys).map_err(std::io::Error::other).and_then(|b| crate::state_dir::replace(&path, &b))
    };
    if let Err(e) = written {
        tracing::warn!(error = %e, "cannot record the layers in use");
    }
}

/// The sets the records of the instances in `alive` name; the records of other instances
/// (none of their containers is left: no session of theirs holds a set) are left from a crash
/// and removed.
pub(crate) fn in_use_of(state_dir: &std::path::Path, alive: &HashSet<&str>) -> HashSet<String> {
    let mut keys = HashSet::new();
    let Ok(entries) = std::fs::read_dir(state_dir) else { return keys };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(instance) = name.strip_prefix("layers-in-use-").and_then(|n| n.strip_suffix(".json")) else {
            continue;
        };
        if !alive.contains(instance) {
            let _ = std::fs::remove_file(entry.path());
            continue;
        }
        let listed: Vec<String> = crate::state_dir::read(&entry.path(), MAX_USES)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        keys.extend(listed);
    }
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_use_record_never_writes_through_a_planted_symlink() {
        let dir = std::env::temp_dir().join(format!("pyberth-touch-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").expect("victim");
        // The old temp name, and the record itself, both planted as links to the victim.
        for name in [format!("layers-used.json.{}", std::process::id()), "layers-used.json".to_owned()] {
            std::os::unix::fs::symlink(&victim, dir.join(name)).expect("symlink");
        }
        touch(&dir, "pyberth-layer:abc");
        assert_eq!(std::fs::read(&victim).expect("victim"), b"precious", "written through a symlink");
        let record = std::fs::symlink_metadata(uses_path(&dir)).expect("record");
        assert!(record.is_file(), "the record is a file of ours, not the planted link");
        assert!(read_uses(&dir).contains_key("pyberth-layer:abc"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
