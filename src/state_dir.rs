//! Files in the state dir (liveness locks, the image build lock, the layer use record).
//!
//! The state dir is ours and private (`SandboxConfig::secure_state_dir`), and still every file
//! is opened without following symlinks, and a file is replaced through a fresh temp file of a
//! random name, created exclusively: a name planted in advance (a symlink to a file of ours, or
//! of root's) is never written through (issue 14).

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

/// The state dir when none is given: `$XDG_RUNTIME_DIR/pyberth` (the login manager makes it,
/// the user's own); else under the user's cache directory (`$XDG_CACHE_HOME/pyberth`,
/// `~/.cache/pyberth`), which no other user can make first, as one could `$TMPDIR/pyberth-<uid>`
/// and so stop every default start (issue 27); `$TMPDIR/pyberth-<uid>` only without a home or
/// when the cache directory cannot be made (a system user's `/nonexistent`). Chosen once.
pub(crate) fn default_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(choose_default).clone()
}

fn choose_default() -> PathBuf {
    use std::os::unix::fs::DirBuilderExt as _;
    let absolute = |name: &str| std::env::var_os(name).map(PathBuf::from).filter(|p| p.is_absolute());
    if let Some(run) = absolute("XDG_RUNTIME_DIR") {
        return run.join("pyberth");
    }
    let shared = std::env::temp_dir().join(format!("pyberth-{}", rustix::process::geteuid().as_raw()));
    let Some(cache) = absolute("XDG_CACHE_HOME").or_else(|| absolute("HOME").map(|h| h.join(".cache"))) else {
        tracing::warn!(state_dir = %shared.display(), "neither XDG_RUNTIME_DIR nor HOME: state is kept in the shared temp directory (set --state-dir)");
        return shared;
    };
    let dir = cache.join("pyberth");
    match std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir) {
        Ok(()) => {
            tracing::info!(state_dir = %dir.display(), "no XDG_RUNTIME_DIR: state is kept under the user's cache directory");
            dir
        }
        Err(e) => {
            tracing::warn!(state_dir = %shared.display(), cache = %dir.display(), error = %e,
                "no XDG_RUNTIME_DIR and the cache directory cannot be made: state is kept in the shared temp directory (set --state-dir)");
            shared
        }
    }
}

/// `O_NOFOLLOW`: opening a symlink fails (`ELOOP`) instead of opening its target.
pub(crate) fn no_follow() -> i32 {
    i32::try_from(rustix::fs::OFlags::NOFOLLOW.bits()).unwrap_or(0)
}

/// Opens a lock file for writing, created (0600) when absent, never through a symlink.
pub(crate) fn open_lock(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).custom_flags(no_follow()).open(path)
}

/// Reads a file of at most `max` bytes, never through a symlink.
pub(crate) fn read(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let file = OpenOptions::new().read(true).custom_flags(no_follow()).open(path)?;
    let mut out = Vec::new();
    file.take(max + 1).read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(std::io::Error::other(format!("{} is larger than {max} bytes", path.display())));
    }
    Ok(out)
}

/// Replaces `path` with `bytes`: written to a new file of a random name beside it (created
/// with `O_EXCL | O_NOFOLLOW`, mode 0600), then renamed over it. A rename replaces a symlink
/// at `path` itself, never its target.
pub(crate) fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("state");
    let tmp = path.with_file_name(format!(".{name}.{}.{}.tmp", std::process::id(), random_id()?));
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(no_follow())
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Twelve random hex digits.
pub(crate) fn random_id() -> std::io::Result<String> {
    random_hex(6)
}

/// `n` random bytes from the kernel, as hex.
pub(crate) fn random_hex(n: usize) -> std::io::Result<String> {
    let mut bytes = vec![0u8; n];
    File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlinks_are_never_followed() {
        let dir = std::env::temp_dir().join(format!("pyberth-state-dir-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").expect("victim");
        let link = dir.join("link");
        std::os::unix::fs::symlink(&victim, &link).expect("symlink");
        assert!(open_lock(&link).is_err(), "a lock is not opened through a symlink");
        assert!(read(&link, 100).is_err(), "nor is a file read through one");
        replace(&link, b"new").expect("replace");
        assert_eq!(std::fs::read(&victim).expect("victim"), b"precious");
        assert_eq!(read(&link, 100).expect("replaced"), b"new", "the link itself was replaced by a file");
        assert!(read(&link, 2).is_err(), "over the size bound");
        let left: Vec<_> = std::fs::read_dir(&dir).expect("list").flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 2, "no temp file left behind: {left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
