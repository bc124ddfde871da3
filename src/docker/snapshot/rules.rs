//! The hostile-input rules of a snapshot's tars, both ways: pure, no I/O of their own (every
//! byte out of a sandbox is hostile); checked sizes and CRC-32 sums.

use super::*;

/// The path of an entry if it may be kept: relative, without `..`, not too deep.
fn kept_path(raw: &Path) -> Option<PathBuf> {
    crate::tarcheck::kept_path(raw, MAX_DEPTH)
}

/// Re-packs the agent's snapshot tar as hostile input, into `out`: only `state/<known file>`
/// and `workspace[/...]` regular files and directories, with safe relative names, owned by
/// root, mode bits 0o777 at most, within `bounds`. With `files_only`, the tar is a plain
/// `pack` of the workspace (entries relative to it) and is stored under `workspace/`.
/// Synchronous: call it off the runtime.
pub fn check_incoming(input: impl Read, out: impl Write, bounds: Bounds, files_only: bool) -> Result<Summary, String> {
    let mut summary = Summary::default();
    let mut ar = tar::Archive::new(input);
    let mut b = tar::Builder::new(out);
    let mut seen = 0u64;
    for entry in ar.entries().map_err(|e| format!("bad snapshot archive: {e}"))? {
        let mut entry = entry.map_err(|e| format!("bad snapshot archive: {e}"))?;
        seen += 1;
        if seen > bounds.entries {
            return Err(format!("the snapshot holds more than {} entries", bounds.entries));
        }
        let raw = entry.path().map_err(|e| format!("bad snapshot entry: {e}"))?.into_owned();
        let raw = if files_only { Path::new("workspace").join(raw) } else { raw };
        let Some(path) = kept_path(&raw) else {
            summary.skipped += 1;
            continue;
        };
        let kind = entry.header().entry_type();
        let top = path.components().next().map(|c| c.as_os_str().to_string_lossy().into_owned());
        let state_file = path.parent() == Some(Path::new("state"))
            && STATE_FILES.iter().any(|f| path.file_name().is_some_and(|n| n == *f));
        let allowed = match (top.as_deref(), kind) {
            (Some("workspace"), tar::EntryType::Regular | tar::EntryType::Directory) => true,
            (Some("state"), tar::EntryType::Regular) => state_file,
            _ => false,
        };
        if !allowed {
            summary.skipped += 1;
            continue;
        }
        let mut header = entry.header().clone();
        crate::tarcheck::own_by_root(&mut header, crate::tarcheck::Modes::AsIs);
        let key = path.to_string_lossy().into_owned();
        if kind == tar::EntryType::Directory {
            header.set_size(0);
            b.append_data(&mut header, &path, std::io::empty()).map_err(|e| format!("cannot store {key}: {e}"))?;
            continue;
        }
        let size = header.size().unwrap_or(0);
        if summary.bytes().saturating_add(size) > bounds.bytes {
            return Err(format!("the snapshot would hold more than {} MiB", bounds.bytes >> 20));
        }
        if state_file {
            summary.state_bytes += size;
        } else {
            summary.files += 1;
            summary.workspace_bytes += size;
        }
        summary.sizes.insert(key.clone(), size);
        if key == "state/meta.json" {
            // Kept: the server reads what was saved and lost from it.
            if size > MAX_META {
                return Err(format!("the snapshot's meta.json is over {} MiB", MAX_META >> 20));
            }
            let mut data = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
            (&mut entry).take(size).read_to_end(&mut data).map_err(|e| format!("bad snapshot entry {key}: {e}"))?;
            let mut sum = Checksum::default();
            sum.update(&data);
            summary.digests.insert(key.clone(), sum.finish());
            b.append_data(&mut header, &path, &data[..]).map_err(|e| format!("cannot store {key}: {e}"))?;
            summary.meta = Some(data);
            continue;
        }
        let mut reader = Summing { inner: (&mut entry).take(size), sum: Checksum::default() };
        b.append_data(&mut header, &path, &mut reader).map_err(|e| format!("cannot store {key}: {e}"))?;
        summary.digests.insert(key, reader.sum.finish());
    }
    b.into_inner().map_err(|e| format!("cannot store the snapshot: {e}"))?.flush().map_err(|e| e.to_string())?;
    Ok(summary)
}

/// Re-packs a stored snapshot (the volume's tar, entries `snap/...`) for the workspace of a
/// fresh session owned by `uid`: `workspace/x` becomes `x`, `state/y` becomes
/// `.pyberth-restore/y`. Checked as hostile input again, and against what was stored: every
/// file of the size it had, the state's digests equal, nothing more and nothing missing; any
/// difference is a corrupted snapshot. Synchronous: call it off the runtime.
pub fn check_outgoing(input: impl Read, out: impl Write, uid: u32, stored: &Summary) -> Result<(), String> {
    let corrupt = |why: String| format!("the snapshot is corrupted: {why}");
    let mut ar = tar::Archive::new(input);
    let mut b = tar::Builder::new(out);
    let mut found = 0usize;
    let mut state_dir = false;
    let entries = ar.entries().map_err(|e| corrupt(format!("its archive is unreadable ({e})")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| corrupt(format!("its archive is unreadable ({e})")))?;
        let raw = entry.path().map_err(|e| corrupt(format!("a bad entry ({e})")))?.into_owned();
        let Ok(inner) = raw.strip_prefix("snap") else {
            return Err(corrupt(format!("{} is out of place", raw.display())));
        };
        if inner.as_os_str().is_empty() {
            continue;
        }
        let Some(path) = kept_path(inner) else { return Err(corrupt(format!("{} is out of place", raw.display()))) };
        let key = path.to_string_lossy().into_owned();
        let kind = entry.header().entry_type();
        let (target, is_state) = if let Ok(rest) = path.strip_prefix("workspace") {
            (rest.to_path_buf(), false)
        } else if let Ok(rest) = path.strip_prefix("state") {
            (Path::new(RESTORE_DIR).join(rest), true)
        } else {
            return Err(corrupt(format!("{key} is out of place")));
        };
        let mut header = tar::Header::new_gnu();
        header.set_uid(u64::from(uid));
        header.set_gid(u64::from(uid));
        header.set_mtime(entry.header().mtime().unwrap_or(0));
        match kind {
            tar::EntryType::Directory => {
                if target.as_os_str().is_empty() {
                    continue; // the workspace itself
                }
                if is_state {
                    state_dir = true;
                    header.set_mode(0o700);
                } else {
                    header.set_mode((entry.header().mode().unwrap_or(0o755) & 0o777) | 0o700);
                }
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                b.append_data(&mut header, &target, std::io::empty())
                    .map_err(|e| format!("cannot restore {key}: {e}"))?;
            }
            tar::EntryType::Regular => {
                let size = entry.header().size().unwrap_or(0);
                if stored.sizes.get(&key) != Some(&size) {
                    return Err(corrupt(format!("{key} is not what was saved")));
                }
                found += 1;
                header.set_mode((entry.header().mode().unwrap_or(0o644) & 0o777) | 0o600);
                header.set_size(size);
                header.set_entry_type(tar::EntryType::Regular);
                if is_state && !state_dir {
                    // A state file before its directory: make the directory first, the code's.
                    let mut dir = tar::Header::new_gnu();
                    dir.set_entry_type(tar::EntryType::Directory);
                    dir.set_uid(u64::from(uid));
                    dir.set_gid(u64::from(uid));
                    dir.set_mode(0o700);
                    dir.set_size(0);
                    b.append_data(&mut dir, RESTORE_DIR, std::io::empty())
                        .map_err(|e| format!("cannot restore: {e}"))?;
                    state_dir = true;
                }
                // Streamed on as it is summed: a mismatch found at the file's end fails the
                // whole upload, and the caller makes the session fresh again.
                let mut reader = Summing { inner: (&mut entry).take(size), sum: Checksum::default() };
                b.append_data(&mut header, &target, &mut reader).map_err(|e| format!("cannot restore {key}: {e}"))?;
                if stored.digests.get(&key) != Some(&reader.sum.finish()) {
                    return Err(corrupt(format!("{key} is not what was saved")));
                }
            }
            _ => return Err(corrupt(format!("{key} is not a regular file or directory"))),
        }
    }
    if found != stored.sizes.len() {
        return Err(corrupt(format!("{} of its {} files are missing", stored.sizes.len() - found, stored.sizes.len())));
    }
    b.into_inner().map_err(|e| format!("cannot restore: {e}"))?.flush().map_err(|e| e.to_string())?;
    Ok(())
}

/// A fast checksum of a file's bytes, to find a snapshot damaged at rest (a disk, a hand in
/// the volume). Not a defence against an attacker: nothing of a session can write into a
/// snapshot's volume, and whoever can is on the engine's side already. SHA-256 would cost
/// about 2 s per GiB on each of the way in and the way out.
#[derive(Debug, Clone, Copy)]
pub struct Checksum {
    state: u64,
    tail: [u8; 8],
    held: usize,
    len: u64,
}

impl Default for Checksum {
    fn default() -> Self {
        Self { state: 0x9E37_79B9_7F4A_7C15, tail: [0; 8], held: 0, len: 0 }
    }
}

impl Checksum {
    fn word(&mut self, w: u64) {
        self.state = (self.state ^ w).wrapping_mul(0xFF51_AFD7_ED55_8CCD).rotate_left(29);
    }

    /// Adds bytes.
    pub fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        if self.held > 0 {
            let take = (8 - self.held).min(data.len());
            self.tail[self.held..self.held + take].copy_from_slice(&data[..take]);
            self.held += take;
            data = &data[take..];
            if self.held < 8 {
                return;
            }
            self.word(u64::from_le_bytes(self.tail));
            self.held = 0;
        }
        let mut words = data.chunks_exact(8);
        for w in &mut words {
            let mut b = [0; 8];
            b.copy_from_slice(w);
            self.word(u64::from_le_bytes(b));
        }
        let rest = words.remainder();
        self.tail[..rest.len()].copy_from_slice(rest);
        self.held = rest.len();
    }

    /// The checksum of everything added.
    pub fn finish(mut self) -> u64 {
        if self.held > 0 {
            self.tail[self.held..].fill(0);
            self.word(u64::from_le_bytes(self.tail));
        }
        self.word(self.len);
        self.state ^ (self.state >> 31)
    }
}

/// A reader that sums what passes through it.
struct Summing<R> {
    inner: R,
    sum: Checksum,
}

impl<R: Read> Read for Summing<R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(out)?;
        self.sum.update(&out[..n]);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(entries: &[(&str, tar::EntryType, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o4755);
            h.set_size(data.len() as u64);
            if *kind == tar::EntryType::Symlink {
                h.set_size(0);
                b.append_link(&mut h, path, std::str::from_utf8(data).expect("utf-8")).expect("link");
                continue;
            }
            let name = path.as_bytes();
            h.as_old_mut().name[..name.len()].copy_from_slice(name);
            h.set_cksum();
            b.append(&h, *data).expect("append");
        }
        b.into_inner().expect("tar")
    }

    const WIDE: Bounds = Bounds { bytes: 1 << 20, entries: 100 };

    #[test]
    fn incoming_keeps_only_the_state_and_workspace_files() {
        let raw = archive(&[
            ("state/meta.json", tar::EntryType::Regular, b"{}"),
            ("state/values.pkl", tar::EntryType::Regular, b"pickle"),
            ("state/evil.sh", tar::EntryType::Regular, b"x"),
            ("workspace", tar::EntryType::Directory, b""),
            ("workspace/a.txt", tar::EntryType::Regular, b"alpha"),
            ("workspace/link", tar::EntryType::Symlink, b"/etc/shadow"),
            ("workspace/../../x", tar::EntryType::Regular, b"x"),
            ("/etc/passwd", tar::EntryType::Regular, b"x"),
            ("elsewhere", tar::EntryType::Regular, b"x"),
            ("workspace/fifo", tar::EntryType::Fifo, b""),
        ]);
        let mut out = Vec::new();
        let s = check_incoming(&raw[..], &mut out, WIDE, false).expect("checked");
        assert_eq!((s.files, s.workspace_bytes, s.state_bytes, s.skipped), (1, 5, 8, 6));
        assert_eq!(s.meta.as_deref(), Some(&b"{}"[..]));
        let names: Vec<String> = tar::Archive::new(&out[..])
            .entries()
            .expect("entries")
            .map(|e| {
                let e = e.expect("entry");
                assert_eq!(e.header().uid().expect("uid"), 0);
                assert_eq!(e.header().mode().expect("mode") & 0o7000, 0, "no setuid bits stored");
                e.path().expect("path").to_string_lossy().into_owned()
            })
            .collect();
        assert_eq!(names, ["state/meta.json", "state/values.pkl", "workspace", "workspace/a.txt"]);
        let tight = Bounds { bytes: 10, entries: 100 };
        assert!(check_incoming(&raw[..], Vec::new(), tight, false).is_err_and(|e| e.contains("more than")));
        let few = Bounds { bytes: 1 << 20, entries: 3 };
        assert!(check_incoming(&raw[..], Vec::new(), few, false).is_err_and(|e| e.contains("entries")));
    }

    #[test]
    fn the_checksum_does_not_depend_on_how_the_bytes_are_cut() {
        let data: Vec<u8> = (0..1000u32).map(|i| i.to_le_bytes()[0] ^ 0x5a).collect();
        let mut whole = Checksum::default();
        whole.update(&data);
        for cut in [1, 3, 7, 8, 9, 500] {
            let mut pieces = Checksum::default();
            for piece in data.chunks(cut) {
                pieces.update(piece);
            }
            assert_eq!(pieces.finish(), whole.finish(), "cut every {cut}");
        }
        let mut flipped = data.clone();
        flipped[999] ^= 1;
        let mut other = Checksum::default();
        other.update(&flipped);
        assert_ne!(other.finish(), whole.finish());
        let (mut a, mut b) = (Checksum::default(), Checksum::default());
        a.update(&[0]);
        b.update(&[0, 0]);
        assert_ne!(a.finish(), b.finish(), "the length counts");
    }

    #[test]
    fn outgoing_maps_into_the_workspace_and_finds_corruption() {
        let raw = archive(&[
            ("state/meta.json", tar::EntryType::Regular, b"{}"),
            ("workspace", tar::EntryType::Directory, b""),
            ("workspace/d", tar::EntryType::Directory, b""),
            ("workspace/d/a.txt", tar::EntryType::Regular, b"alpha"),
        ]);
        let mut stored_tar = Vec::new();
        let stored = check_incoming(&raw[..], &mut stored_tar, WIDE, false).expect("in");
        // The engine's tar of the volume names entries under snap/.
        let mut snap = tar::Builder::new(Vec::new());
        for e in tar::Archive::new(&stored_tar[..]).entries().expect("entries") {
            let mut e = e.expect("entry");
            let mut h = e.header().clone();
            let p = Path::new("snap").join(e.path().expect("path"));
            let mut data = Vec::new();
            e.read_to_end(&mut data).expect("read");
            snap.append_data(&mut h, p, &data[..]).expect("append");
        }
        let snap = snap.into_inner().expect("tar");
        let mut out = Vec::new();
        check_outgoing(&snap[..], &mut out, 4242, &stored).expect("restorable");
        let names: Vec<(String, u64)> = tar::Archive::new(&out[..])
            .entries()
            .expect("entries")
            .map(|e| {
                let e = e.expect("entry");
                (e.path().expect("path").to_string_lossy().into_owned(), e.header().uid().expect("uid"))
            })
            .collect();
        assert_eq!(
            names,
            [
                (".pyberth-restore".into(), 4242),
                (".pyberth-restore/meta.json".into(), 4242),
                ("d".into(), 4242),
                ("d/a.txt".into(), 4242)
            ]
        );
        // Same size, other bytes: the digest tells.
        let mut bad = stored.clone();
        bad.digests.insert("state/meta.json".into(), 0);
        assert!(check_outgoing(&snap[..], Vec::new(), 1, &bad).is_err_and(|e| e.contains("corrupted")));
        let mut missing = stored.clone();
        missing.sizes.insert("workspace/gone".into(), 1);
        assert!(check_outgoing(&snap[..], Vec::new(), 1, &missing).is_err_and(|e| e.contains("missing")));
        assert!(check_outgoing(&b"garbage"[..], Vec::new(), 1, &stored).is_err());
    }
}
