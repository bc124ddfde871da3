//! The hostile-tar rulebook shared by uploads, downloads, copy-back, dependency layers and
//! snapshots: pure checks on what an archive from a sandbox names, with no I/O (every byte out
//! of a sandbox is hostile). Each reader keeps its own policy (which kinds it takes, its
//! bounds), but names, depth, links and modes are judged here, once.

use std::path::{Component, Path, PathBuf};

/// Deepest path a workspace archive may name (the agent's packer stops at the same depth).
pub(crate) const MAX_DEPTH: usize = 64;

/// A relative path with no `..`, root or prefix components: it stays inside the directory it
/// is unpacked into.
pub(crate) fn safe_relative(p: &Path) -> bool {
    p.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// The path of an entry if it may be written: `.` components dropped, not empty, relative
/// without `..`, at most `depth` components deep. `None`: the entry is left behind.
pub(crate) fn kept_path(raw: &Path, depth: usize) -> Option<PathBuf> {
    let path: PathBuf = raw.components().filter(|c| !matches!(c, Component::CurDir)).collect();
    (!path.as_os_str().is_empty() && safe_relative(&path) && path.components().count() <= depth).then_some(path)
}

/// `p` with `.` dropped and `..` applied lexically; a path that climbs above its start
/// becomes `..` (never inside anything).
pub(crate) fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                if !out.pop() {
                    return PathBuf::from("..");
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Whether `p` is relative, safe and under the top directory `top`.
pub(crate) fn under(p: &Path, top: &str) -> bool {
    safe_relative(p) && p.components().next().and_then(|c| c.as_os_str().to_str()) == Some(top)
}

/// Where a link entry at `path` lands, if it stays under `top`: a symlink's target is
/// relative to the link's directory, a hard link's to the archive's root; absolute targets
/// never stay. `None`: the link is dropped, never followed.
pub(crate) fn link_inside(path: &Path, target: &Path, hard: bool, top: &str) -> Option<PathBuf> {
    if target.is_absolute() {
        return None;
    }
    let resolved =
        if hard { normalize(target) } else { normalize(&path.parent().unwrap_or(Path::new("")).join(target)) };
    under(&resolved, top).then_some(resolved)
}

/// How a kept entry's mode is rewritten.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Modes {
    /// The permission bits as they came (no setuid, setgid or sticky).
    AsIs,
    /// Readable by every uid, writable by root alone, executable as it came (layers: shared
    /// read-only by every session).
    Shared,
}

/// Makes a kept entry root's, with no special bits: whoever reads the archive next writes it
/// as the engine's root, so the sandbox's uid and modes are never trusted.
pub(crate) fn own_by_root(header: &mut tar::Header, modes: Modes) {
    let mode = header.mode().unwrap_or(0o644) & 0o777;
    let mode = match modes {
        Modes::AsIs => mode,
        Modes::Shared if header.entry_type() == tar::EntryType::Directory || mode & 0o111 != 0 => {
            (mode | 0o555) & 0o755
        }
        Modes::Shared => (mode | 0o444) & 0o755,
    };
    header.set_mode(mode);
    header.set_uid(0);
    header.set_gid(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_that_leave_or_go_too_deep_are_left_behind() {
        assert_eq!(kept_path(Path::new("./a/./b"), 4), Some(PathBuf::from("a/b")));
        for bad in ["", ".", "../x", "a/../../x", "/etc/passwd"] {
            assert_eq!(kept_path(Path::new(bad), 4), None, "{bad}");
        }
        assert_eq!(kept_path(Path::new("a/b/c/d/e"), 4), None);
        assert!(kept_path(Path::new("a/b/c/d"), 4).is_some());
    }

    #[test]
    fn links_stay_under_their_top_or_are_dropped() {
        let at = Path::new("site/pkg/link");
        assert_eq!(link_inside(at, Path::new("../other/f"), false, "site"), Some(PathBuf::from("site/other/f")));
        assert_eq!(link_inside(at, Path::new("../../../etc/passwd"), false, "site"), None);
        assert_eq!(link_inside(at, Path::new("/etc/passwd"), false, "site"), None);
        assert_eq!(link_inside(at, Path::new("site/pkg/f"), true, "site"), Some(PathBuf::from("site/pkg/f")));
        assert_eq!(link_inside(at, Path::new("pkg/f"), true, "site"), None);
        assert_eq!(link_inside(at, Path::new("site/../../x"), true, "site"), None);
    }

    #[test]
    fn modes_lose_special_bits_and_owners() {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o4777);
        h.set_uid(1000);
        own_by_root(&mut h, Modes::AsIs);
        assert_eq!((h.mode().ok(), h.uid().ok(), h.gid().ok()), (Some(0o777), Some(0), Some(0)));
        h.set_mode(0o4622);
        own_by_root(&mut h, Modes::Shared);
        assert_eq!(h.mode().ok(), Some(0o644));
        h.set_mode(0o700);
        own_by_root(&mut h, Modes::Shared);
        assert_eq!(h.mode().ok(), Some(0o755));
    }
}
