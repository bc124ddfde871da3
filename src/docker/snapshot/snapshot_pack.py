"""pyberth's snapshot packer (issue 18): copies a snapshot volume to volume, run by the server
in a short-lived container as the session's own unprivileged uid (no network, no capabilities,
read-only root), so that neither the engine as root nor the server's stream ever touches a path
the code controls. Standard library only; `python3 -I -S`.

  save MAX_BYTES MAX_ENTRIES STATE   /src (the session's workspace, read-only) -> /workspace
                                     (the snapshot's volume): workspace/..., and with STATE=1
                                     state/* from /src/.pyberth-snapshot
  load MAX_BYTES MAX_ENTRIES         /snap (the snapshot's volume, read-only) -> /workspace (the
                                     new session's empty workspace), state/* into
                                     .pyberth-restore

Nothing is followed: every path is opened relative to a directory fd with O_NOFOLLOW, and only
regular files and directories are copied (others are counted as skipped on save, and make a
load fail: a snapshot holds none). Prints one JSON line: every file copied with its size and
CRC-32, or the error."""

import json
import os
import stat
import sys
import zlib

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_IN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
O_OUT = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
STATE_FILES = ("meta.json", "imported.pkl", "values.pkl")
SAVE_DIR = ".pyberth-snapshot"
RESTORE_DIR = ".pyberth-restore"
MAX_DEPTH = 64
BUF = bytearray(1 << 20)


class Refused(Exception):
    """The copy stops: a bound, or (on load) a snapshot that is not what a save makes."""


class Copy:
    def __init__(self, max_bytes, max_entries, strict):
        self.max_bytes, self.max_entries, self.strict = max_bytes, max_entries, strict
        self.files, self.entries, self.bytes, self.skipped = {}, 0, 0, 0

    def entry(self):
        self.entries += 1
        if self.entries > self.max_entries:
            raise Refused("the snapshot holds more than %d entries" % self.max_entries)

    def file(self, sfd, name, dfd, out_name, key, mode=None):
        """Copies one regular file, summing it; False when it is not one."""
        try:
            fd = os.open(name, O_IN, dir_fd=sfd)
        except OSError as exc:
            if self.strict:
                raise Refused("%s cannot be read (%s)" % (key, exc.strerror))
            return False  # a link (ELOOP), or gone since it was listed
        with open(fd, "rb", buffering=0) as src:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                if self.strict:
                    raise Refused("%s is not a regular file" % key)
                return False
            if mode is None:
                mode = (st.st_mode & 0o755) | 0o644  # readable by the uid that restores it
            with open(os.open(out_name, O_OUT, mode, dir_fd=dfd), "wb", buffering=0) as dst:
                crc, size, view = 0, 0, memoryview(BUF)
                while True:
                    n = src.readinto(BUF)
                    if not n:
                        break
                    size += n
                    if self.bytes + size > self.max_bytes:
                        raise Refused("the snapshot would be larger than %d bytes" % self.max_bytes)
                    crc = zlib.crc32(view[:n], crc)
                    done = 0
                    while done < n:
                        done += dst.write(view[done:n])
                os.utime(dst.fileno(), ns=(st.st_mtime_ns, st.st_mtime_ns))
        self.bytes += size
        self.files[key] = [size, crc]
        return True

    def tree(self, sfd, dfd, prefix, depth, top_skip=()):
        """Copies the directory open at `sfd` into the one open at `dfd`."""
        with os.scandir(sfd) as it:
            names = sorted((e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False)) for e in it)
        for name, is_dir, is_file in names:
            if depth == 0 and name in top_skip:
                continue
            key = prefix + "/" + name
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                if self.strict:
                    raise Refused("a name that is not UTF-8 is out of place")
                self.skipped += 1
                continue
            self.entry()
            if is_dir:
                if depth + 1 >= MAX_DEPTH:
                    if self.strict:
                        raise Refused("%s is too deep" % key)
                    self.skipped += 1
                    continue
                try:
                    child = os.open(name, O_DIR, dir_fd=sfd)
                except OSError as exc:
                    if self.strict:
                        raise Refused("%s cannot be read (%s)" % (key, exc.strerror))
                    self.skipped += 1
                    continue
                try:
                    mode = os.fstat(child).st_mode & 0o777
                    os.mkdir(name, (mode | 0o700) if self.strict else 0o755, dir_fd=dfd)
                    out = os.open(name, O_DIR, dir_fd=dfd)
                    try:
                        self.tree(child, out, key, depth + 1)
                        if self.strict:
                            os.chmod(out, mode | 0o700)
                    finally:
                        os.close(out)
                finally:
                    os.close(child)
            elif is_file:
                mode = None
                if self.strict:
                    mode = (os.stat(name, dir_fd=sfd, follow_symlinks=False).st_mode & 0o777) | 0o600
                if not self.file(sfd, name, dfd, name, key, mode):
                    self.skipped += 1
            else:
                if self.strict:
                    raise Refused("%s is not a regular file or directory" % key)
                self.skipped += 1


def save(max_bytes, max_entries, with_state):
    c = Copy(max_bytes, max_entries, strict=False)
    src = os.open("/src", O_DIR)
    dst = os.open("/workspace", O_DIR)
    os.mkdir("state", 0o755, dir_fd=dst)
    os.mkdir("workspace", 0o755, dir_fd=dst)
    state = os.open("state", O_DIR, dir_fd=dst)
    work = os.open("workspace", O_DIR, dir_fd=dst)
    if with_state:
        try:
            saved = os.open(SAVE_DIR, O_DIR, dir_fd=src)
        except OSError as exc:
            raise Refused("the interpreter's state is not there (%s)" % exc.strerror)
        for name in STATE_FILES:
            c.entry()
            if not c.file(saved, name, state, name, "state/" + name, 0o644):
                raise Refused("the interpreter's state file %s is not there" % name)
        os.close(saved)
    c.tree(src, work, "workspace", 0, top_skip=(SAVE_DIR, RESTORE_DIR))
    return c


def load(max_bytes, max_entries):
    c = Copy(max_bytes, max_entries, strict=True)
    src = os.open("/snap", O_DIR)
    dst = os.open("/workspace", O_DIR)
    with os.scandir(src) as it:
        top = sorted(e.name for e in it)
    for name in top:
        if name not in ("state", "workspace"):
            raise Refused("%s is out of place" % name)
    if "workspace" in top:
        work = os.open("workspace", O_DIR, dir_fd=src)
        c.tree(work, dst, "workspace", 0)
    if "state" in top:
        state = os.open("state", O_DIR, dir_fd=src)
        with os.scandir(state) as it:
            names = sorted(e.name for e in it)
        if names:
            os.mkdir(RESTORE_DIR, 0o700, dir_fd=dst)
            out = os.open(RESTORE_DIR, O_DIR, dir_fd=dst)
            for name in names:
                if name not in STATE_FILES:
                    raise Refused("state/%s is out of place" % name)
                c.entry()
                c.file(state, name, out, name, "state/" + name, 0o600)
    return c


def main():
    mode, max_bytes, max_entries = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
        if mode == "save":
            c = save(max_bytes, max_entries, sys.argv[4] == "1")
        else:
            c = load(max_bytes, max_entries)
        out = {"files": c.files, "skipped": c.skipped}
    except Refused as exc:
        out = {"error": str(exc), "corrupt": mode == "load"}
    except OSError as exc:
        out = {"error": "%s: %s" % (exc.strerror or type(exc).__name__, exc.filename or "")}
    sys.stdout.write(json.dumps(out, separators=(",", ":")) + "\n")
    sys.stdout.flush()


main()
