//! Directories in and out of a session's workspace as tar. In: through the Docker archive
//! API, streamed. Out: the agent packs the tar as the code's uid (`Request::Pack`), never
//! the engine, which resolves paths as root inside the container and would follow links
//! the code made (`etc_link/shadow`); here are the hostile-input halves of the way out.
//!
//! Archives coming back from a container are hostile: entries must be relative without `..`,
//! only regular files and directories are written, links are skipped, and nothing on the host
//! is written through a symlink.
//!
//! The copy-back policy lives apart, in `copyback.rs`, its writing in `unpack.rs`.

use std::io::{Read, Write};
use std::path::Path;
use std::time::SystemTime;

use crate::docker::Engine;
use bollard::query_parameters::UploadToContainerOptionsBuilder;

use super::container::WORKSPACE;
pub use super::copyback::{Cap, CopyBack, HeldBack, Moved};
use crate::tarcheck::{self, MAX_DEPTH, safe_relative};

/// Uploads the contents of `dir` into the workspace of container `id`, skipping `.git`, every
/// entry owned by `uid` (the container's code). Symlinks travel as symlinks (the container
/// resolves them, inside itself). Refuses a tree over `cap` bytes.
pub async fn upload_dir(docker: &dyn Engine, id: &str, uid: u32, dir: &Path, cap: Cap) -> Result<Moved, String> {
    let meta = std::fs::metadata(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    if !meta.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    let (mut writer, rx) = super::chunks::chunk_writer();
    let root = dir.to_path_buf();
    let packer = tokio::task::spawn_blocking(move || {
        let mut moved = Moved::default();
        let packed = (|| {
            let mut ar = tar::Builder::new(&mut writer);
            ar.follow_symlinks(false);
            pack(&mut ar, &root, Path::new(""), uid, cap, &mut moved)?;
            ar.finish().map_err(|e| format!("cannot pack {}: {e}", root.display()))
        })();
        let packed = packed.and_then(|()| writer.flush().map_err(|e| e.to_string()));
        if let Err(e) = &packed {
            // End the body with an error so Docker discards the partial archive.
            writer.fail(e);
        }
        packed.map(|()| moved)
    });
    let body = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    let opts = UploadToContainerOptionsBuilder::default().path(WORKSPACE).build();
    let sent = docker.upload_to_container(id, Some(opts), crate::docker::body_try_stream(body)).await;
    let packed = packer.await.map_err(|e| format!("the packer stopped: {e}"))?;
    let moved = packed?;
    sent.map_err(|e| format!("cannot upload {}: {e}", dir.display()))?;
    Ok(moved)
}

/// Uploads one file, `name` (no directories), into the workspace, owned by `uid`; returns its
/// (mtime, size).
pub async fn upload_file(
    docker: &dyn Engine,
    id: &str,
    uid: u32,
    name: &str,
    data: &[u8],
) -> Result<(u64, u64), String> {
    let mtime = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut ar = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_uid(u64::from(uid));
    h.set_gid(u64::from(uid));
    h.set_mtime(mtime);
    h.set_cksum();
    ar.append_data(&mut h, name, data).map_err(|e| format!("cannot pack {name}: {e}"))?;
    let buf = ar.into_inner().map_err(|e| format!("cannot pack {name}: {e}"))?;
    let opts = UploadToContainerOptionsBuilder::default().path(WORKSPACE).build();
    docker
        .upload_to_container(id, Some(opts), crate::docker::body_full(buf.into()))
        .await
        .map_err(|e| format!("cannot upload {name}: {e}"))?;
    Ok((mtime, data.len() as u64))
}

fn pack<W: Write>(
    ar: &mut tar::Builder<W>,
    root: &Path,
    rel: &Path,
    uid: u32,
    cap: Cap,
    moved: &mut Moved,
) -> Result<(), String> {
    if rel.components().count() > MAX_DEPTH {
        return Err(format!("{} is nested more than {MAX_DEPTH} directories deep", root.join(rel).display()));
    }
    let here = root.join(rel);
    let mut entries: Vec<_> = std::fs::read_dir(&here)
        .map_err(|e| format!("cannot read {}: {e}", here.display()))?
        .filter_map(Result::ok)
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name();
        if name == ".git" {
            continue;
        }
        let rel = rel.join(&name);
        let path = root.join(&rel);
        let meta = std::fs::symlink_metadata(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut header = tar::Header::new_gnu();
        header.set_metadata(&meta);
        header.set_uid(u64::from(uid));
        header.set_gid(u64::from(uid));
        // No setuid, setgid or sticky bits reach the sandbox.
        header.set_mode(meta_mode(&meta) & 0o777);
        let err = |e: std::io::Error| format!("cannot pack {}: {e}", path.display());
        if meta.is_dir() {
            ar.append_data(&mut header, &rel, std::io::empty()).map_err(err)?;
            pack(ar, root, &rel, uid, cap, moved)?;
        } else if meta.is_file() {
            moved.files += 1;
            moved.bytes += meta.len();
            moved.manifest.insert(rel.clone(), (header.mtime().unwrap_or(0), meta.len()));
            if moved.bytes > cap.bytes {
                return Err(format!(
                    "the directory holds more than {} MiB: make it smaller or raise --transfer-cap-mb",
                    cap.bytes >> 20
                ));
            }
            if moved.files > cap.files {
                return Err(format!(
                    "the directory holds more than {} files: make it smaller or raise --transfer-max-files",
                    cap.files
                ));
            }
            let file = std::fs::File::open(&path).map_err(err)?;
            ar.append_data(&mut header, &rel, file.take(meta.len())).map_err(err)?;
        } else if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&path).map_err(err)?;
            ar.append_link(&mut header, &rel, &target).map_err(err)?;
        }
        // Sockets, fifos and devices are not copied.
    }
    Ok(())
}

fn meta_mode(meta: &std::fs::Metadata) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    meta.permissions().mode()
}

/// Largest tar the agent may send for a download of `cap`: headers and padding besides the
/// content, then checked again entry by entry.
pub fn raw_cap(cap: Cap) -> u64 {
    cap.bytes + cap.bytes / 4 + (1 << 20) + cap.files.saturating_mul(2048)
}

/// Re-packs the agent's tar of `rel` (a checked workspace path, "." for all; entries named
/// relative to the workspace) as hostile input: only regular files and directories at or
/// under `rel`, relative without `..`, at most `cap` bytes of content and `cap.files` files.
/// Synchronous: call it off the runtime.
pub fn repack(raw: &[u8], rel: &str, cap: Cap) -> Result<(Vec<u8>, Moved), String> {
    let base = Path::new(rel);
    let mut out = tar::Builder::new(Vec::new());
    let mut moved = Moved::default();
    let mut ar = tar::Archive::new(raw);
    for entry in ar.entries().map_err(|e| format!("bad archive: {e}"))? {
        let mut entry = entry.map_err(|e| format!("bad archive: {e}"))?;
        let raw = entry.path().map_err(|e| format!("bad archive entry: {e}"))?.into_owned();
        let Some(name) = tarcheck::kept_path(&raw, MAX_DEPTH) else { continue };
        if rel != "." && !name.starts_with(base) {
            continue;
        }
        let kind = entry.header().entry_type();
        if kind != tar::EntryType::Regular && kind != tar::EntryType::Directory {
            continue;
        }
        let mut header = entry.header().clone();
        tarcheck::own_by_root(&mut header, tarcheck::Modes::AsIs);
        if kind == tar::EntryType::Regular {
            moved.files += 1;
            moved.bytes += header.size().unwrap_or(0);
            if moved.bytes > cap.bytes {
                return Err(format!("{rel} holds more than {} MiB: download a smaller directory", cap.bytes >> 20));
            }
            if moved.files > cap.files {
                return Err(format!("{rel} holds more than {} files: download a smaller directory", cap.files));
            }
        }
        let mut data = Vec::new();
        entry.read_to_end(&mut data).map_err(|e| format!("bad archive entry: {e}"))?;
        // As named (a directory keeps its trailing slash); checked above.
        out.append_data(&mut header, &raw, &data[..]).map_err(|e| format!("cannot pack {}: {e}", name.display()))?;
    }
    let tar = out.into_inner().map_err(|e| format!("cannot pack: {e}"))?;
    Ok((tar, moved))
}

/// An upload read by [`read_upload`]: its files by workspace path, and what was skipped.
pub type Upload = (Vec<(String, Vec<u8>)>, Vec<String>);

/// The regular files of an uploaded tar, read whole before anything is written (a broken
/// archive changes nothing): (workspace path, bytes) under `dest`, each path passed through
/// `check`; and what was skipped, with why. Synchronous: call it off the runtime.
pub fn read_upload(tar: &[u8], dest: &str, check: impl Fn(&str) -> Result<String, String>) -> Result<Upload, String> {
    let mut files = Vec::new();
    let mut skipped = Vec::new();
    let mut ar = tar::Archive::new(tar);
    let entries = ar.entries().map_err(|e| format!("archive is not a tar archive: {e}"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| format!("archive is not a valid tar archive: {e}"))?;
        let shown = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let kind = entry.header().entry_type();
        if kind == tar::EntryType::Directory {
            continue; // directories come with their files
        }
        if kind != tar::EntryType::Regular {
            skipped.push(format!("{shown}: not a regular file"));
            continue;
        }
        let rel = match entry.path() {
            Ok(p) if safe_relative(&p) => p.into_owned(),
            _ => {
                skipped.push(format!("{shown}: unsafe name"));
                continue;
            }
        };
        let joined = if dest == "." { rel } else { Path::new(dest).join(rel) };
        let path = match joined.to_str().map(&check) {
            Some(Ok(p)) => p,
            Some(Err(e)) => {
                skipped.push(format!("{shown}: {e}"));
                continue;
            }
            None => {
                skipped.push(format!("{shown}: not UTF-8"));
                continue;
            }
        };
        let mut data = Vec::new();
        entry.read_to_end(&mut data).map_err(|e| format!("archive entry {shown} is unreadable: {e}"))?;
        files.push((path, data));
    }
    Ok((files, skipped))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::unpack::unpack_changed;
    use super::*;

    const CAP: Cap = Cap { bytes: 1 << 20, files: 1000 };

    fn archive(entries: &[(&str, tar::EntryType, u64, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, mtime, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o644);
            h.set_mtime(*mtime);
            if *kind == tar::EntryType::Symlink {
                h.set_size(0);
                b.append_link(&mut h, path, data).expect("link");
            } else {
                h.set_size(data.len() as u64);
                // Write the raw name so hostile paths ("..", absolute) survive into the archive.
                let name = path.as_bytes();
                h.as_old_mut().name[..name.len()].copy_from_slice(name);
                h.set_cksum();
                b.append(&h, data.as_bytes()).expect("append");
            }
        }
        b.into_inner().expect("tar")
    }

    #[test]
    fn only_new_regular_files_inside_come_back() {
        let dir = std::env::temp_dir().join(format!("pyberth-unpack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("reports")).expect("mkdir");
        let outside = std::env::temp_dir().join(format!("pyberth-outside-{}", std::process::id()));
        std::fs::create_dir_all(&outside).expect("mkdir");
        std::os::unix::fs::symlink(&outside, dir.join("escape")).expect("symlink");
        let tar = archive(&[
            ("reports/", tar::EntryType::Directory, 200, ""),
            ("reports/junit.xml", tar::EntryType::Regular, 200, "<xml/>"),
            ("old.py", tar::EntryType::Regular, 50, "old"),
            ("given.py", tar::EntryType::Regular, 150, "same"),
            ("edited.py", tar::EntryType::Regular, 150, "longer now"),
            ("__pycache__/x.pyc", tar::EntryType::Regular, 200, "pyc"),
            ("link", tar::EntryType::Symlink, 200, "/etc/passwd"),
            ("../evil", tar::EntryType::Regular, 200, "evil"),
            ("escape/owned", tar::EntryType::Regular, 200, "owned"),
        ]);
        let given = HashMap::from([("given.py".into(), (150, 4)), ("edited.py".into(), (150, 4))]);
        let rules = CopyBack { given, ..Default::default() };
        let mut moved = Moved::default();
        let r = unpack_changed(&tar[..], &dir, 100, &rules, CAP, &mut moved);
        assert!(r.is_err_and(|e| e.contains("in the way")), "a symlinked directory on the host stops the copy");
        assert!(!outside.join("owned").exists(), "nothing is written through a host symlink");
        assert!(!dir.join("reports/junit.xml").exists() && !dir.join("edited.py").exists(), "nor anything else");
        let left: Vec<_> = std::fs::read_dir(&dir).expect("dir").flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 2, "reports/ and escape only, no staging left: {left:?}");
        std::fs::remove_file(dir.join("escape")).expect("unlink");
        std::fs::write(dir.join("escape"), "a file in the way").expect("file");
        assert!(unpack_changed(&tar[..], &dir, 100, &rules, CAP, &mut Moved::default()).is_err(), "a file in the way");
        std::fs::remove_file(dir.join("escape")).expect("unlink");
        unpack_changed(&tar[..], &dir, 100, &rules, CAP, &mut moved).expect("nothing in the way");
        assert_eq!(std::fs::read_to_string(dir.join("reports/junit.xml")).expect("junit"), "<xml/>");
        assert!(!dir.join("old.py").exists(), "files older than the run stay behind");
        assert!(!dir.join("given.py").exists(), "files as uploaded stay behind");
        assert!(dir.join("edited.py").exists(), "files the run changed come back");
        assert!(!dir.join("__pycache__").exists(), "caches stay behind");
        assert!(!dir.join("link").exists(), "links are never recreated");
        assert!(!dir.parent().expect("parent").join("evil").exists());

        let mut moved = Moved::default();
        let big = archive(&[("big", tar::EntryType::Regular, 200, "0123456789")]);
        let tight = Cap { bytes: 5, files: 10 };
        assert!(unpack_changed(&big[..], &dir, 100, &rules, tight, &mut moved).is_err_and(|e| e.contains("exceed")));
        let many: Vec<(String, tar::EntryType, u64, &str)> =
            (0..3).map(|i| (format!("f{i}"), tar::EntryType::Regular, 200, "")).collect();
        let many: Vec<_> = many.iter().map(|(p, k, m, d)| (p.as_str(), *k, *m, *d)).collect();
        let mut moved = Moved::default();
        let two = Cap { bytes: 1 << 20, files: 2 };
        let r = unpack_changed(&archive(&many)[..], &dir, 100, &rules, two, &mut moved);
        assert!(r.is_err_and(|e| e.contains("more than 2 output files")), "empty files count too");
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&outside);
    }

    #[test]
    fn vcs_metadata_excluded_paths_and_existing_files_are_held_back() {
        let dir = std::env::temp_dir().join(format!("pyberth-holdback-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("Makefile"), "host").expect("makefile");
        std::fs::write(dir.join("given.txt"), "host").expect("given");
        let tar = archive(&[
            (".git/config", tar::EntryType::Regular, 200, "[core]\nfsmonitor = touch /tmp/pwned"),
            ("sub/.GIT/config", tar::EntryType::Regular, 200, "x"),
            (".hg/hgrc", tar::EntryType::Regular, 200, "x"),
            ("Makefile", tar::EntryType::Regular, 200, "evil"),
            ("given.txt", tar::EntryType::Regular, 200, "changed"),
            (".github/workflows/ci.yml", tar::EntryType::Regular, 200, "x"),
            ("build/a.sh", tar::EntryType::Regular, 200, "x"),
            ("build/deep/b.sh", tar::EntryType::Regular, 200, "x"),
            ("report.txt", tar::EntryType::Regular, 200, "ok"),
        ]);
        let rules = CopyBack {
            given: HashMap::from([("given.txt".into(), (150, 4))]),
            overwrite: false,
            exclude: vec![".github".into(), "build/*.sh".into()],
        };
        let mut moved = Moved::default();
        unpack_changed(&tar[..], &dir, 100, &rules, CAP, &mut moved).expect("copy back");
        assert!(!dir.join(".git").exists() && !dir.join("sub").exists() && !dir.join(".hg").exists());
        assert_eq!(std::fs::read_to_string(dir.join("Makefile")).expect("makefile"), "host", "not replaced");
        assert_eq!(std::fs::read_to_string(dir.join("given.txt")).expect("given"), "changed", "an input may change");
        assert!(!dir.join(".github").exists() && !dir.join("build/a.sh").exists());
        assert!(dir.join("build/deep/b.sh").exists(), "`*` stays within one component");
        let why = |p: &str| moved.held_back.iter().find(|(r, _)| r == Path::new(p)).map(|(_, w)| *w);
        assert_eq!(why(".git/config"), Some(HeldBack::Vcs));
        assert_eq!(why("sub/.GIT/config"), Some(HeldBack::Vcs));
        assert_eq!(why("Makefile"), Some(HeldBack::Exists));
        assert_eq!(why(".github/workflows/ci.yml"), Some(HeldBack::Excluded));
        let copied: Vec<_> = moved.copied.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        assert_eq!(copied, ["given.txt", "build/deep/b.sh", "report.txt"]);

        let rules = CopyBack { overwrite: true, ..Default::default() };
        let mut moved = Moved::default();
        unpack_changed(&tar[..], &dir, 100, &rules, CAP, &mut moved).expect("copy back");
        assert_eq!(std::fs::read_to_string(dir.join("Makefile")).expect("makefile"), "evil", "asked to overwrite");
        assert!(!dir.join(".git").exists(), "never VCS metadata, even with --output-overwrite");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_download_keeps_only_regular_files_and_directories_under_the_path() {
        let raw = archive(&[
            ("d/", tar::EntryType::Directory, 200, ""),
            ("d/a.txt", tar::EntryType::Regular, 200, "alpha"),
            ("d/link", tar::EntryType::Symlink, 200, "/etc/shadow"),
            ("d/../../etc/shadow", tar::EntryType::Regular, 200, "root:x"),
            ("/etc/passwd", tar::EntryType::Regular, 200, "root:x"),
            ("other/b.txt", tar::EntryType::Regular, 200, "beta"),
            ("dd/c.txt", tar::EntryType::Regular, 200, "not under d"),
            ("d/fifo", tar::EntryType::Fifo, 200, ""),
        ]);
        let (tar, moved) = repack(&raw, "d", CAP).expect("repack");
        let mut names = Vec::new();
        for e in tar::Archive::new(&tar[..]).entries().expect("entries") {
            let e = e.expect("entry");
            names.push(e.path().expect("path").to_string_lossy().into_owned());
            assert_eq!(e.header().uid().expect("uid"), 0);
        }
        assert_eq!(names, ["d/", "d/a.txt"]);
        assert_eq!((moved.files, moved.bytes), (1, 5));
        let (tar, _) = repack(&raw, ".", CAP).expect("repack");
        let all = tar::Archive::new(&tar[..]).entries().expect("entries").count();
        assert_eq!(all, 4, "the whole workspace: d/, d/a.txt, other/b.txt, dd/c.txt");
        let tight = Cap { bytes: 4, files: 10 };
        assert!(repack(&raw, "d", tight).is_err_and(|e| e.contains("more than")));
    }
}
