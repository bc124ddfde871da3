//! Snapshot volumes on Kubernetes: directories of the server's own filesystem (issue 33, item
//! 4). On a cluster that filesystem is a PersistentVolumeClaim mounted into the server's pod
//! (`k8s_snapshot_dir`; `deploy/kubernetes/20-pyberth.yaml`), so snapshots and hibernated
//! sessions outlive the server's pod; no helper pod and no `docker commit` is involved.
//!
//! A volume `v` is `<dir>/v/labels.json` (its labels and creation time) and `<dir>/v/data/`
//! (what was written into it). The owners reach a Docker volume's files through a helper
//! container that mounts it at `/snap`; here that helper is a record, and its upload unpacks
//! the tar into `data/` and its download packs `data/` as `snap/...`. The tar written is the
//! server's own re-pack of the agent's stream (`docker::snapshot::check_incoming`), and is
//! still unpacked as hostile input: regular files and directories only, no path out of
//! `data/`, nothing written through a link, bounded in bytes and entries.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Most bytes a volume takes (a snapshot is bounded far below by `--snapshot-cache-mb`).
const MAX_BYTES: u64 = 16 << 30;
/// Most entries a volume takes.
const MAX_ENTRIES: u64 = 2_000_000;

/// What `labels.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Meta {
    pub(super) labels: HashMap<String, String>,
    pub(super) options: HashMap<String, String>,
    pub(super) created: String,
}

/// The snapshot volumes under one directory.
#[derive(Debug, Clone)]
pub(super) struct Shelf {
    dir: PathBuf,
}

/// A volume name that can only ever be one directory below ours.
fn plain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn mkdir(path: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path)
}

impl Shelf {
    /// The shelf at `dir`, made (mode 0700) if it is not there.
    pub(super) fn open(dir: PathBuf) -> std::io::Result<Self> {
        mkdir(&dir)?;
        Ok(Self { dir })
    }

    fn at(&self, name: &str) -> Option<PathBuf> {
        plain(name).then(|| self.dir.join(name))
    }

    /// Makes volume `name` (or finds it, as Docker does for a name that exists).
    pub(super) fn create(&self, name: &str, meta: &Meta) -> std::io::Result<Meta> {
        let at = self.at(name).ok_or_else(|| std::io::Error::other(format!("not a volume name: {name:?}")))?;
        if let Some(found) = self.get(name) {
            return Ok(found);
        }
        mkdir(&at.join("data"))?;
        let text = serde_json::to_vec(meta).map_err(std::io::Error::other)?;
        crate::state_dir::replace(&at.join("labels.json"), &text)?;
        Ok(meta.clone())
    }

    /// Volume `name`, if it is there.
    pub(super) fn get(&self, name: &str) -> Option<Meta> {
        let at = self.at(name)?;
        let text = std::fs::read(at.join("labels.json")).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// Every volume, by name.
    pub(super) fn list(&self) -> BTreeMap<String, Meta> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return BTreeMap::new() };
        entries
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter_map(|n| self.get(&n).map(|m| (n, m)))
            .collect()
    }

    /// Removes volume `name`; false when it was not there.
    pub(super) fn remove(&self, name: &str) -> bool {
        match self.at(name) {
            Some(at) if at.join("labels.json").exists() => std::fs::remove_dir_all(at).is_ok(),
            _ => false,
        }
    }

    /// Unpacks `tar` into volume `name`'s files, as it is read (never held whole).
    pub(super) fn unpack(&self, name: &str, tar: impl std::io::Read) -> Result<(), String> {
        let at = self.at(name).filter(|a| a.join("labels.json").exists()).ok_or(format!("no volume {name}"))?;
        let data = at.join("data");
        let mut archive = tar::Archive::new(tar);
        let (mut bytes, mut count) = (0u64, 0u64);
        for entry in archive.entries().map_err(|e| e.to_string())? {
            let mut entry = entry.map_err(|e| e.to_string())?;
            count += 1;
            bytes = bytes.saturating_add(entry.size());
            if count > MAX_ENTRIES || bytes > MAX_BYTES {
                return Err(format!("more than {MAX_ENTRIES} entries or {MAX_BYTES} bytes"));
            }
            let path = entry.path().map_err(|e| e.to_string())?.into_owned();
            let Some(rel) = relative(&path) else { return Err(format!("refused path {}", path.display())) };
            match entry.header().entry_type() {
                tar::EntryType::Directory => dirs(&data, &rel)?,
                tar::EntryType::Regular => write_file(&data, &rel, &mut entry)?,
                other => return Err(format!("refused entry {} of type {other:?}", path.display())),
            }
        }
        Ok(())
    }

    /// Writes volume `name`'s files into `out` as a tar, entries named `snap/...` (as Docker's
    /// archive of the helper's `/snap`). Links are not followed (none is ever written).
    pub(super) fn pack(&self, name: &str, out: impl std::io::Write) -> Result<(), String> {
        let at = self.at(name).filter(|a| a.join("labels.json").exists()).ok_or(format!("no volume {name}"))?;
        let mut b = tar::Builder::new(out);
        b.follow_symlinks(false);
        b.append_dir_all("snap", at.join("data")).map_err(|e| e.to_string())?;
        b.into_inner().and_then(|mut w| w.flush()).map_err(|e| e.to_string())
    }
}

/// `path` as normal components only (no root, no `..`), or `None`.
fn relative(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            _ => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

/// Makes directory `data/rel` and every one on the way, one at a time, each checked to be a
/// real directory: never a link followed (a recursive mkdir would make them through one).
fn dirs(data: &Path, rel: &Path) -> Result<(), String> {
    let mut dir = data.to_owned();
    for c in rel.components() {
        dir.push(c);
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(format!("{} is not a directory", dir.display())),
            Err(_) => std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(|e| e.to_string())?,
        }
    }
    Ok(())
}

/// Writes `entry` at `data/rel`: every directory on the way made (`dirs`), the file created
/// new, not through a link.
fn write_file(data: &Path, rel: &Path, entry: &mut impl std::io::Read) -> Result<(), String> {
    dirs(data, rel.parent().unwrap_or(Path::new("")))?;
    let target = data.join(rel);
    let _ = std::fs::remove_file(&target);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits().cast_signed())
        .open(&target)
        .map_err(|e| format!("{}: {e}", target.display()))?;
    std::io::copy(entry, &mut file).map(drop).map_err(|e| e.to_string())
}

#[cfg(test)]
#[path = "shelf_tests.rs"]
mod tests;
