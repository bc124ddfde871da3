//! The files of a fake volume, and the tars the archive API moves in and out of them.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read as _;
use std::path::{Component, Path};

/// A volume's tree: regular files and directories, by path relative to its root (no leading
/// or trailing `/`).
#[derive(Debug, Default, Clone)]
pub(crate) struct Files {
    /// Regular files.
    pub(crate) files: BTreeMap<String, Vec<u8>>,
    /// Directories (parents of files are implied).
    pub(crate) dirs: BTreeSet<String>,
}

/// `path` as a key: relative, normalised, `None` when it climbs out (`..`) of the root.
pub(crate) fn key(path: &str) -> Option<String> {
    let mut parts = Vec::new();
    for c in Path::new(path).components() {
        match c {
            Component::Normal(p) => parts.push(p.to_str()?.to_owned()),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(parts.join("/"))
}

/// `child` relative to `dir` (both keys), if it lies below it.
fn below<'a>(dir: &str, child: &'a str) -> Option<&'a str> {
    if dir.is_empty() {
        return (!child.is_empty()).then_some(child);
    }
    child.strip_prefix(dir)?.strip_prefix('/')
}

impl Files {
    /// Writes (or appends to) a file, its parents made.
    pub(crate) fn write(&mut self, path: &str, data: &[u8], append: bool) -> u64 {
        let file = self.files.entry(path.to_owned()).or_default();
        if !append {
            file.clear();
        }
        file.extend_from_slice(data);
        file.len() as u64
    }

    /// Whether `key` is a directory (the root, one made, or a file's parent).
    pub(crate) fn is_dir(&self, key: &str) -> bool {
        key.is_empty()
            || self.dirs.contains(key)
            || self.dirs.iter().chain(self.files.keys()).any(|p| below(key, p).is_some())
    }

    /// Removes a file, or a directory with everything below it; false when nothing was there.
    pub(crate) fn delete(&mut self, key: &str) -> bool {
        let before = self.files.len() + self.dirs.len();
        self.files.retain(|p, _| p != key && below(key, p).is_none());
        self.dirs.retain(|p| p != key && below(key, p).is_none());
        before != self.files.len() + self.dirs.len()
    }

    /// Entries below `dir`: (path relative to the root, size, kind), children only unless
    /// `recursive`.
    pub(crate) fn list(&self, dir: &str, recursive: bool) -> Vec<(String, u64, &'static str)> {
        let mut dirs: BTreeSet<String> = BTreeSet::new();
        let mut out = Vec::new();
        let all_dirs = self.dirs.iter().cloned().chain(self.files.keys().flat_map(|p| parents(p)));
        for d in all_dirs {
            if let Some(rest) = below(dir, &d)
                && (recursive || !rest.contains('/'))
            {
                dirs.insert(d);
            }
        }
        out.extend(dirs.into_iter().map(|d| (d, 0, "dir")));
        for (p, data) in &self.files {
            if let Some(rest) = below(dir, p)
                && (recursive || !rest.contains('/'))
            {
                out.push((p.clone(), data.len() as u64, "file"));
            }
        }
        out.sort();
        out
    }

    /// Unpacks a tar under `at` (a key); entries that climb out or are neither files nor
    /// directories are refused, as an engine's extraction would.
    pub(crate) fn unpack(&mut self, at: &str, tar_bytes: &[u8]) -> Result<(), String> {
        let mut ar = tar::Archive::new(tar_bytes);
        for entry in ar.entries().map_err(|e| e.to_string())? {
            let mut entry = entry.map_err(|e| e.to_string())?;
            let raw = entry.path().map_err(|e| e.to_string())?.to_string_lossy().into_owned();
            let rel = key(&raw).ok_or_else(|| format!("{raw}: outside the destination"))?;
            let full = [at, rel.as_str()].iter().filter(|s| !s.is_empty()).copied().collect::<Vec<_>>().join("/");
            match entry.header().entry_type() {
                tar::EntryType::Directory => {
                    if !full.is_empty() {
                        self.dirs.insert(full);
                    }
                }
                tar::EntryType::Regular => {
                    let mut data = Vec::new();
                    entry.read_to_end(&mut data).map_err(|e| e.to_string())?;
                    self.files.insert(full, data);
                }
                other => return Err(format!("{raw}: entry type {other:?} not supported by the fake engine")),
            }
        }
        Ok(())
    }

    /// A tar of `dir` (a key) and everything below it, its entries named `top/...` as the
    /// engine's archive API names them (the last component of the path asked for), or with
    /// an empty `top`, named relative to `dir`.
    pub(crate) fn pack(&self, dir: &str, top: &str) -> Result<Vec<u8>, String> {
        let mut b = tar::Builder::new(Vec::new());
        let io = |e: std::io::Error| e.to_string();
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
        header.set_size(0);
        if !top.is_empty() {
            b.append_data(&mut header.clone(), format!("{top}/"), std::io::empty()).map_err(io)?;
        }
        for (path, _, kind) in self.list(dir, true) {
            let rest = below(dir, &path).unwrap_or(&path);
            let name = if top.is_empty() { rest.to_owned() } else { format!("{top}/{rest}") };
            if kind == "dir" {
                b.append_data(&mut header.clone(), format!("{name}/"), std::io::empty()).map_err(io)?;
            } else {
                let data = self.files.get(&path).map(Vec::as_slice).unwrap_or_default();
                let mut h = tar::Header::new_gnu();
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, name, data).map_err(io)?;
            }
        }
        b.into_inner().map_err(io)
    }
}

/// Every proper parent directory of a key.
fn parents(path: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut at = path;
    while let Some((parent, _)) = at.rsplit_once('/') {
        out.push(parent.to_owned());
        at = parent;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tar_packed_unpacks_to_the_same_tree_and_nothing_climbs_out() {
        let mut f = Files::default();
        f.write("a/b.txt", b"hi", false);
        f.write("a/b.txt", b"!", true);
        f.write("c", b"", false);
        f.dirs.insert("empty".into());
        assert!(f.is_dir("a") && f.is_dir("empty") && !f.is_dir("c"));
        let tar = f.pack("", "snap").expect("pack");
        let mut g = Files::default();
        g.unpack("", &tar).expect("unpack");
        assert_eq!(g.files.get("snap/a/b.txt").map(Vec::as_slice), Some(&b"hi!"[..]));
        assert!(g.is_dir("snap/empty"));
        assert_eq!(key("../x"), None);
        assert_eq!(key("/workspace/./x").as_deref(), Some("workspace/x"));
        assert!(f.delete("a") && !f.delete("a"));
        assert_eq!(f.list("", false), vec![("c".into(), 0, "file"), ("empty".into(), 0, "dir")]);
    }
}
