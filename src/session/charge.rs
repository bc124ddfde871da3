//! A restored, forked or woken workspace is charged to its session (issue 26). Workspaces are
//! tmpfs, and a tmpfs page is charged to the memory cgroup of the process that first touches
//! it: files copied in by a packer container or by the engine's archive API are charged to
//! them, not to the session, so a session restored from a 200 MiB snapshot could allocate
//! 420 MiB more under a 512 MiB limit. Rewriting every file by a process of the session's own
//! container (an exec, as the code's uid) moves the charge where it belongs: each new copy is
//! the session's from its first byte, and the old pages are freed as it replaces them.

use std::time::{Duration, Instant};

use super::Session;
use crate::docker::exec;

/// Longest the rewrite may take (it moves the workspace once, in memory).
const CHARGE_TIMEOUT: Duration = Duration::from_secs(120);

/// Rewrites every regular file under the workspace (links are not followed), keeping its mode
/// and times. The workspace's tmpfs is bounded too (half the memory by default), so a file is
/// not copied whole beside itself: its copy is written from the end, a chunk at a time, and the
/// original cut short behind each chunk, so at most one chunk exists twice. `-I -S`: nothing
/// of the workspace or the environment is imported.
const REWRITE: &str = r#"
import os
CH = 1 << 20
def move(path, st, d):
    tmp = os.path.join(d, ".pyberth-charge-%d" % os.getpid())
    os.chmod(path, (st.st_mode & 0o7777) | 0o600)
    src = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        end = os.fstat(src).st_size
        size = end
        while end > 0:
            start = ((end - 1) // CH) * CH
            data = os.pread(src, end - start, start)
            if len(data) != end - start:
                raise OSError("%s changed while it was copied" % path)
            view = memoryview(data)
            at = start
            while view:
                n = os.pwrite(dst, view, at)
                view, at = view[n:], at + n
            os.ftruncate(src, start)
            end = start
        os.ftruncate(dst, size)
    finally:
        os.close(src)
        os.close(dst)
    os.chmod(tmp, st.st_mode & 0o7777)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)
def walk(d):
    with os.scandir(d) as it:
        entries = list(it)
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            walk(e.path)
        elif e.is_file(follow_symlinks=False):
            move(e.path, e.stat(follow_symlinks=False), d)
walk("/workspace")
"#;

impl Session {
    /// Charges the workspace's files to this session's memory (see the module's doc). An
    /// error when they do not fit in it (killed) or cannot be rewritten.
    /// Takes the container's id and the code's uid, not `Inner` (not `Sync`).
    pub(super) async fn charge_workspace(&self, id: String, uid: u32) -> Result<(), String> {
        let started = Instant::now();
        let cmd = ["python3", "-I", "-S", "-B", "-c", REWRITE];
        let run = exec::run_as(&self.docker, &id, uid, &cmd);
        let (code, err) = tokio::time::timeout(CHARGE_TIMEOUT, run)
            .await
            .map_err(|_| "copying the files into the session's memory took too long".to_owned())?
            .map_err(|e| format!("cannot copy the files into the session's memory: {e}"))?;
        tracing::debug!(session = %self.name, ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX), code, "workspace charged");
        match code {
            0 => Ok(()),
            137 => Err("the snapshot's files do not fit in the session's memory (--memory-mb)".to_owned()),
            _ => Err(format!("cannot copy the files into the session's memory (exit status {code}): {err}")),
        }
    }
}
