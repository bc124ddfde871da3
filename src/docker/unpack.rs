//! The copy back's writing half (`pyberth run --output`), all or nothing (issue 27, Low 5):
//! every file that comes back is first staged in a private directory inside the output
//! directory, every host target is then checked, and only then is each staged file renamed
//! into place. A host symlink or file in the way of one result used to stop the copy after
//! some files were written. Before placing, any directory that is a git directory by what it
//! holds (`HEAD` beside `config`, `objects/` or `refs/`), in the archive or already on the
//! host, holds back everything under it (issue 27, Low 4): a `bare/` with a `core.fsmonitor`
//! command runs it at the host's next `git status` inside it.

use std::collections::HashSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use tokio::sync::mpsc;

use super::copyback::{CACHES, Cap, CopyBack, HeldBack, Moved};
use crate::tarcheck::{MAX_DEPTH, kept_path};

/// Beside `HEAD`, any one of these makes a directory a git directory (git itself wants
/// `objects/` and `refs/`; `config` alone carries the commands).
const GIT_MARKS: &[&str] = &["config", "objects", "refs", "commondir", "packed-refs"];

/// Names of the staging directories, inside the output directory (same file system, so the
/// final renames cannot fail half way for want of space or a cross-device move).
const STAGING: &str = ".pyberth-copyback-";

/// A private directory for the staged files; removed with whatever is left in it.
struct Staging(PathBuf);

impl Staging {
    fn new(dest: &Path) -> Result<Self, String> {
        use std::os::unix::fs::DirBuilderExt as _;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = dest.join(format!("{STAGING}{}-{nanos}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        Ok(Staging(dir))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One result, staged.
struct Staged {
    rel: PathBuf,
    size: u64,
    at: PathBuf,
}

/// Copies the files the run made or changed (modified at or after `since`, not as given)
/// into `dest`, all or nothing; see the module's comment.
pub(super) fn unpack_changed(
    reader: impl Read,
    dest: &Path,
    since: u64,
    rules: &CopyBack,
    cap: Cap,
    moved: &mut Moved,
) -> Result<(), String> {
    let staging = Staging::new(dest)?;
    let mut names = HashSet::new();
    let staged = stage(reader, dest, since, rules, cap, moved, &staging, &mut names)?;
    let mut kept = Vec::new();
    for file in staged {
        if in_git_dir(dest, &file.rel, &names) {
            moved.files -= 1;
            moved.bytes -= file.size;
            moved.held_back.push((file.rel, HeldBack::Vcs));
        } else {
            kept.push(file);
        }
    }
    for file in &kept {
        check_target(dest, &file.rel)?;
    }
    for file in kept {
        let target = host_target(dest, &file.rel)?;
        std::fs::rename(&file.at, &target).map_err(|e| format!("cannot write {}: {e}", target.display()))?;
        moved.copied.push(file.rel);
    }
    Ok(())
}

/// Reads the archive, staging each file that may come back; records in `names` every path
/// the archive holds (and their directories), lowercased, for [`in_git_dir`].
#[allow(clippy::too_many_arguments)] // the unpacker's inputs, passed through
fn stage(
    reader: impl Read,
    dest: &Path,
    since: u64,
    rules: &CopyBack,
    cap: Cap,
    moved: &mut Moved,
    staging: &Staging,
    names: &mut HashSet<String>,
) -> Result<Vec<Staged>, String> {
    let mut ar = tar::Archive::new(reader);
    let mut seen = 0u64;
    let mut staged = Vec::new();
    for entry in ar.entries().map_err(|e| format!("bad archive: {e}"))? {
        // Every entry costs work and a line in the listing, even one that is left behind.
        seen += 1;
        if seen > cap.files.saturating_mul(4) {
            return Err(format!(
                "the workspace holds more than {} entries: raise --transfer-max-files",
                cap.files.saturating_mul(4)
            ));
        }
        let mut entry = entry.map_err(|e| format!("bad archive: {e}"))?;
        let raw = entry.path().map_err(|e| format!("bad archive entry: {e}"))?.into_owned();
        let Some(path) = kept_path(&raw, MAX_DEPTH) else { continue };
        let rel = path.as_path();
        for a in rel.ancestors().filter(|a| !a.as_os_str().is_empty()) {
            names.insert(a.to_string_lossy().to_ascii_lowercase());
        }
        if rel.components().any(|c| CACHES.iter().any(|cache| c.as_os_str() == *cache)) {
            continue;
        }
        let header = entry.header();
        if header.entry_type() != tar::EntryType::Regular || header.mtime().unwrap_or(0) < since {
            continue; // links are never recreated on the host; old files were not made by the run
        }
        let size = header.size().unwrap_or(0);
        if rules.given.get(rel).is_some_and(|&(mtime, len)| (mtime, len) == (header.mtime().unwrap_or(0), size)) {
            continue; // as uploaded: an input, not a result
        }
        let exists = std::fs::symlink_metadata(dest.join(rel)).is_ok();
        if let Some(why) = rules.held_back(rel, exists) {
            moved.held_back.push((rel.to_path_buf(), why));
            continue;
        }
        moved.files += 1;
        moved.bytes += size;
        if moved.bytes > cap.bytes {
            return Err(format!("the run's output files exceed {} MiB: raise --transfer-cap-mb", cap.bytes >> 20));
        }
        if moved.files > cap.files {
            return Err(format!("the run made more than {} output files: raise --transfer-max-files", cap.files));
        }
        let at = staging.0.join(staged.len().to_string());
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&at)
            .map_err(|e| format!("cannot stage {}: {e}", rel.display()))?;
        std::io::copy(&mut (&mut entry).take(size), &mut file)
            .map_err(|e| format!("cannot stage {}: {e}", rel.display()))?;
        staged.push(Staged { rel: rel.to_path_buf(), size, at });
    }
    Ok(staged)
}

/// Whether `rel` lies in a git directory: `dest` itself or a directory above `rel`, as the
/// archive (`names`, lowercased) or the host has it.
fn in_git_dir(dest: &Path, rel: &Path, names: &HashSet<String>) -> bool {
    rel.ancestors().skip(1).any(|dir| {
        let lower = dir.to_string_lossy().to_ascii_lowercase();
        let child = |name: &str| if lower.is_empty() { name.to_owned() } else { format!("{lower}/{name}") };
        let in_archive = names.contains(&child("head")) && GIT_MARKS.iter().any(|m| names.contains(&child(m)));
        let host = dest.join(dir);
        let on_host = |name: &str| std::fs::symlink_metadata(host.join(name)).is_ok();
        // Marks from either side count: a `config` that comes back beside a host `HEAD`.
        let head = names.contains(&child("head")) || on_host("HEAD");
        in_archive || (head && GIT_MARKS.iter().any(|m| names.contains(&child(m)) || on_host(m)))
    })
}

/// Refuses a target that cannot be written without following a link or replacing something
/// that is not a regular file; touches nothing.
fn check_target(dest: &Path, rel: &Path) -> Result<(), String> {
    let mut at = dest.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    for (i, part) in parts.iter().enumerate() {
        at.push(part);
        let last = i + 1 == parts.len();
        match std::fs::symlink_metadata(&at) {
            Err(_) => return Ok(()), // nothing there: made fresh
            Ok(m) if !last && m.is_dir() => {}
            Ok(m) if last && m.is_file() => {}
            Ok(_) if last => return Err(format!("{} exists and is not a regular file", at.display())),
            Ok(_) => return Err(format!("{} is in the way (not a directory)", at.display())),
        }
    }
    Ok(())
}

/// The host path for `rel` under `dest`, creating its directories; refuses any existing
/// component that is a symlink, so a tree cannot lead writes out of `dest`.
fn host_target(dest: &Path, rel: &Path) -> Result<PathBuf, String> {
    let mut at = dest.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    for (i, part) in parts.iter().enumerate() {
        at.push(part);
        if i + 1 == parts.len() {
            break;
        }
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(format!("{} is in the way (not a directory)", at.display())),
            Err(_) => std::fs::create_dir(&at).map_err(|e| format!("cannot create {}: {e}", at.display()))?,
        }
    }
    if std::fs::symlink_metadata(&at).is_ok_and(|m| !m.is_file()) {
        return Err(format!("{} exists and is not a regular file", at.display()));
    }
    Ok(at)
}

/// Where [`download_changed`](crate::session::Session::download_changed) streams the
/// workspace's tar (entries named relative to the workspace): a blocking unpacker that copies
/// the files the run made or changed into `out` (created if missing), keeping their relative
/// paths: files modified at or after `since` (seconds) that are not in `rules.given` as they
/// were sent. Caches are skipped; version-control metadata, excluded paths and (unless asked)
/// existing host files are held back. At most `cap` bytes. Drop the sender at the end of the
/// archive, then await the unpacker; when the sender fails, the unpacker's error says why.
#[allow(clippy::type_complexity)] // a sender and the task it feeds
pub(crate) fn unpacker(
    out: &Path,
    since: u64,
    rules: CopyBack,
    cap: Cap,
) -> Result<(mpsc::Sender<Bytes>, tokio::task::JoinHandle<Result<Moved, String>>), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let (tx, reader) = super::chunks::chunk_reader();
    let dest = out.to_path_buf();
    let unpacker = tokio::task::spawn_blocking(move || {
        let mut moved = Moved::default();
        unpack_changed(reader, &dest, since, &rules, cap, &mut moved).map(|()| moved)
    });
    Ok((tx, unpacker))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_git_directory_is_known_by_what_it_holds_in_the_archive_or_on_the_host() {
        let names: HashSet<String> = ["bare", "bare/head", "bare/config", "x", "x/head", "y", "y/config"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let dest = std::env::temp_dir().join(format!("pyberth-gitdir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::create_dir_all(dest.join("y/objects")).expect("mkdir");
        std::fs::write(dest.join("y/HEAD"), "ref: refs/heads/main\n").expect("head");
        assert!(in_git_dir(&dest, Path::new("bare/config"), &names));
        assert!(in_git_dir(&dest, Path::new("bare/hooks/post-checkout"), &names));
        assert!(!in_git_dir(&dest, Path::new("x/head"), &names), "HEAD alone is not a repository");
        assert!(in_git_dir(&dest, Path::new("y/config"), &names), "a config beside a host HEAD");
        assert!(!in_git_dir(&dest, Path::new("report.txt"), &names));
        std::fs::write(dest.join("HEAD"), "x").expect("head");
        std::fs::create_dir_all(dest.join("refs")).expect("refs");
        assert!(in_git_dir(&dest, Path::new("report.txt"), &names), "the output directory itself");
        let _ = std::fs::remove_dir_all(&dest);
    }
}
