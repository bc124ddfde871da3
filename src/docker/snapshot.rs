//! Snapshot storage (issue 18): one Docker volume per snapshot, labelled ours, and nothing
//! else kept (issue 26: no container per snapshot). The stream way writes and reads it through
//! the engine's archive API on a helper container made for that one copy, created and never
//! started, and removed after. The engine only ever reads and writes inside a volume nothing but this module
//! writes to; what a session's code controls travels as a tar the agent packed as the code's
//! uid, re-packed here as hostile input on the way in and checked again on the way out.
//!
//! A snapshot's volume holds `state/meta.json`, `state/imported.pkl`, `state/values.pkl` and
//! `workspace/...` (see `images/python/agent.py`, `Durable`).
//!
//! The fast way (`pack`, `unpack`): the agent pickles the state into a private directory of
//! the workspace, and a short-lived packer container ([`PACKER`]), running as the session's
//! own unprivileged uid with no network, no capabilities and a read-only root, mounts the
//! workspace volume read-only and the snapshot's volume and copies volume to volume, summing
//! every file (CRC-32); a restore is the reverse, into the new session's empty workspace, with
//! every file's size and sum compared to what was saved. The slow way (the agent's stream,
//! re-packed here) remains for a state that cannot be written into the workspace.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountType, MountVolumeOptions, VolumeCreateRequest};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
    UploadToContainerOptionsBuilder,
};
use bytes::Bytes;
use futures::StreamExt as _;
use tokio::sync::mpsc;

pub use super::chunks::{chunk_reader, chunk_writer};
use super::container::{self, Owner};
use super::{Error, LABEL_OWNER};
use crate::tarcheck::safe_relative;

/// Label naming the snapshot a volume holds.
pub const LABEL_SNAPSHOT: &str = "pyberth.snapshot";
/// Where a helper container mounts the snapshot volume.
const MOUNT: &str = "/snap";
/// Where the agent finds a snapshot's state in the workspace it is restored into.
pub const RESTORE_DIR: &str = ".pyberth-restore";
/// Where the agent saves the state for the packer (`save_state`), deleted after.
pub const SAVE_DIR: &str = ".pyberth-snapshot";
/// The state files a snapshot may hold; anything else under `state/` is refused.
const STATE_FILES: [&str; 3] = ["meta.json", "imported.pkl", "values.pkl"];
/// Largest `meta.json` accepted (names, reasons and the source of definitions).
const MAX_META: u64 = 16 << 20;
/// Deepest path kept, as transfers.
const MAX_DEPTH: usize = 66;

/// What a snapshot's tar held, as checked on its way into the store.
#[derive(Debug, Default, Clone)]
pub struct Summary {
    /// Regular files of the workspace.
    pub files: u64,
    /// Their bytes.
    pub workspace_bytes: u64,
    /// Bytes of the interpreter's state (the pickles and meta.json).
    pub state_bytes: u64,
    /// Links, FIFOs and other entries left out.
    pub skipped: u64,
    /// `meta.json`, when the state was saved.
    pub meta: Option<Vec<u8>>,
    /// Size of every regular file, by its path in the snapshot (`workspace/a`, `state/x`).
    pub sizes: HashMap<String, u64>,
    /// A checksum of every regular file ([`Checksum`], or CRC-32 when `packed`), by the same
    /// path.
    pub digests: HashMap<String, u64>,
    /// Stored by the packer (volume to volume): restored by it too, its sums are CRC-32.
    pub packed: bool,
}

impl Summary {
    /// All bytes stored.
    pub fn bytes(&self) -> u64 {
        self.workspace_bytes + self.state_bytes
    }
}

/// The bounds of one snapshot.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Content bytes (state and files together).
    pub bytes: u64,
    /// Entries of any kind.
    pub entries: u64,
}

fn body(
    rx: mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) })
}

/// A snapshot's storage: its volume. A record written before issue 26 also names a helper
/// container; it is ignored (the sweep removes it with its instance's leftovers).
#[derive(Debug, Clone)]
pub struct Stored {
    /// The volume.
    pub volume: String,
}

/// Creates the storage of a new snapshot: a volume labelled with its owner (this instance,
/// so that it goes with the instance's other leftovers) and the principal it belongs to.
pub async fn create(docker: &Docker, owner: &Owner, principal: &str, id: &str) -> Result<Stored, Error> {
    let name = format!("pyberth-{}-snap-{id}", owner.instance);
    let labels = owner.labels_with(&[(LABEL_OWNER, principal), (LABEL_SNAPSHOT, id)]);
    let request = VolumeCreateRequest { name: Some(name.clone()), labels: Some(labels), ..Default::default() };
    docker.create_volume(request).await?;
    Ok(Stored { volume: name })
}

/// Removes a snapshot's volume.
pub async fn remove(docker: &Docker, stored: &Stored) {
    container::remove_volume(docker, &stored.volume).await;
}

/// Where a copy's helper container comes from: the engine, this instance (its labels), and
/// an image that exists (nothing of it runs).
#[derive(Debug, Clone, Copy)]
pub struct Via<'a> {
    /// The engine.
    pub docker: &'a Docker,
    /// This instance.
    pub owner: &'a Owner,
    /// The session's image.
    pub image: &'a str,
}

/// A created, never started container of `image` with the volume at [`MOUNT`]: what the
/// archive API needs to reach a volume, for one copy. No network, no capabilities, nothing
/// runs in it; our labels, so a sweep finds it if the server dies meanwhile. The name is
/// unique per copy: two restores of one snapshot may run at once.
async fn helper(via: Via<'_>, volume: &str) -> Result<String, Error> {
    let name = format!("{volume}-io-{}", super::next_serial());
    let labels = via.owner.labels_with(&[]);
    let body = ContainerCreateBody {
        image: Some(via.image.into()),
        cmd: Some(vec!["true".into()]),
        user: Some(container::INIT_USER.into()),
        labels: Some(labels),
        network_disabled: Some(true),
        host_config: Some(HostConfig {
            network_mode: Some("none".into()),
            cap_drop: Some(vec!["ALL".into()]),
            readonly_rootfs: Some(true),
            mounts: Some(vec![Mount {
                target: Some(MOUNT.into()),
                source: Some(volume.into()),
                typ: Some(MountType::VOLUME),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let opts = CreateContainerOptionsBuilder::default().name(&name).build();
    Ok(via.docker.create_container(Some(opts), body).await?.id)
}

/// Writes a tar (streamed from `rx`) into the snapshot's volume.
pub async fn write(
    via: Via<'_>,
    stored: &Stored,
    rx: mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> Result<(), Error> {
    let id = helper(via, &stored.volume).await?;
    let opts = UploadToContainerOptionsBuilder::default().path(MOUNT).build();
    let written = via.docker.upload_to_container(&id, Some(opts), bollard::body_try_stream(body(rx))).await;
    container::remove_container(via.docker, &id).await;
    Ok(written?)
}

/// Streams the snapshot volume's tar (entries named `snap/...`) into `tx`.
pub async fn read(via: Via<'_>, stored: &Stored, tx: mpsc::Sender<Bytes>) -> Result<(), Error> {
    let id = helper(via, &stored.volume).await?;
    let opts = DownloadFromContainerOptionsBuilder::default().path(MOUNT).build();
    let mut stream = via.docker.download_from_container(&id, Some(opts));
    let mut read = Ok(());
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(c) => {
                if tx.send(c).await.is_err() {
                    break; // the reader stopped; its error says why
                }
            }
            Err(e) => {
                read = Err(e.into());
                break;
            }
        }
    }
    drop(stream);
    container::remove_container(via.docker, &id).await;
    read
}

/// Uploads a tar (streamed from `rx`) into the workspace of a session container.
pub async fn upload_workspace(
    docker: &Docker,
    id: &str,
    rx: mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> Result<(), Error> {
    let opts = UploadToContainerOptionsBuilder::default().path(container::WORKSPACE).build();
    Ok(docker.upload_to_container(id, Some(opts), bollard::body_try_stream(body(rx))).await?)
}

/// The packer's script (`python3 -I -S -c`): see its docstring.
const PACKER: &str = include_str!("snapshot_pack.py");
/// Most bytes of the packer's answer (a name, a size and a sum per file).
const MAX_ANSWER: usize = 64 << 20;
/// How long a packer may take.
const PACKER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// What the packer answers.
#[derive(Debug, serde::Deserialize)]
struct Answer {
    #[serde(default)]
    files: HashMap<String, (u64, u64)>,
    #[serde(default)]
    skipped: u64,
    #[serde(default)]
    error: Option<String>,
    /// On a load: the snapshot is not what a save makes.
    #[serde(default)]
    corrupt: bool,
}

/// Where and as whom a packer runs.
#[derive(Debug, Clone, Copy)]
pub struct Packer<'a> {
    /// The engine.
    pub docker: &'a Docker,
    /// This instance (the packer's labels).
    pub owner: &'a Owner,
    /// The session's image.
    pub image: &'a str,
    /// The sessions' runtime (`--runtime`).
    pub runtime: Option<&'a str>,
    /// The session's own uid.
    pub uid: u32,
}

/// Runs the packer with `args` and `mounts` as the session's uid, in a container of its image
/// made for it and removed after: no network, no capabilities, no new privileges, a read-only
/// root, and our labels (a sweep finds it if the server dies meanwhile).
async fn run_packer(p: &Packer<'_>, mounts: Vec<Mount>, args: Vec<String>, writes_mib: u64) -> Result<Answer, String> {
    let Packer { docker, owner, image, runtime, uid } = *p;
    // What it writes into a tmpfs-backed workspace is charged to its own memory.
    let memory = i64::try_from((256 + writes_mib) << 20).unwrap_or(i64::MAX);
    use std::sync::atomic::{AtomicU64, Ordering};
    static SERIAL: AtomicU64 = AtomicU64::new(0);
    let name = format!("pyberth-{}-pack-{}", owner.instance, SERIAL.fetch_add(1, Ordering::Relaxed));
    let utility = container::Utility {
        name: &name,
        owner,
        image,
        script: PACKER,
        args,
        user: format!("{uid}:{uid}"),
        memory,
        pids: 32,
        runtime,
        mounts,
    };
    let id = container::create_utility(docker, utility).await.map_err(|e| format!("cannot create the packer: {e}"))?;
    let run = async {
        let attach = AttachContainerOptionsBuilder::default().stream(true).stdout(true).stderr(true).build();
        let mut output = docker.attach_container(&id, Some(attach)).await.map_err(|e| e.to_string())?.output;
        docker.start_container(&id, None).await.map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        let mut err = Vec::new();
        while let Some(frame) = output.next().await {
            match frame.map_err(|e| e.to_string())? {
                LogOutput::StdOut { message } if out.len() < MAX_ANSWER => out.extend_from_slice(&message),
                LogOutput::StdErr { message } if err.len() < 4096 => err.extend_from_slice(&message),
                _ => {}
            }
        }
        if out.len() >= MAX_ANSWER {
            return Err("the packer's answer is too long".to_owned());
        }
        if out.is_empty() {
            let code = match docker.wait_container(&id, None).next().await {
                Some(Ok(r)) => r.status_code,
                Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => code,
                _ => -1,
            };
            let why = String::from_utf8_lossy(&err).chars().take(300).collect::<String>();
            return Err(format!("the packer stopped without an answer (exit status {code}) {why}"));
        }
        serde_json::from_slice::<Answer>(&out).map_err(|e| {
            let why = String::from_utf8_lossy(&err);
            format!(
                "the packer failed ({e}): {}",
                why.chars().rev().take(300).collect::<String>().chars().rev().collect::<String>()
            )
        })
    };
    let answer =
        tokio::time::timeout(PACKER_TIMEOUT, run).await.unwrap_or_else(|_| Err("the packer took too long".into()));
    container::remove_container(docker, &id).await;
    answer
}

fn volume_mount(source: &str, target: &str, read_only: bool, copy: bool) -> Mount {
    Mount {
        target: Some(target.into()),
        source: Some(source.into()),
        typ: Some(MountType::VOLUME),
        read_only: Some(read_only),
        volume_options: (!copy).then(|| MountVolumeOptions { no_copy: Some(true), ..Default::default() }),
        ..Default::default()
    }
}

/// Copies a session's workspace volume (as its `uid`), and with `with_state` the state the
/// agent saved into it, into the snapshot's volume; checked against `bounds`.
pub async fn pack(
    p: &Packer<'_>,
    workspace: &str,
    stored: &Stored,
    bounds: Bounds,
    with_state: bool,
) -> Result<Summary, String> {
    // The snapshot's volume, new and empty, at the image's /workspace (1777): the engine
    // copies that mode up, so the packer's uid can write into its root.
    let mounts = vec![
        volume_mount(workspace, "/src", true, false),
        volume_mount(&stored.volume, container::WORKSPACE, false, true),
    ];
    let args = vec![
        "save".to_owned(),
        bounds.bytes.to_string(),
        bounds.entries.to_string(),
        if with_state { "1" } else { "0" }.to_owned(),
    ];
    let answer = run_packer(p, mounts, args, 256).await?;
    if let Some(e) = answer.error {
        return Err(e);
    }
    let mut summary = Summary { packed: true, skipped: answer.skipped, ..Summary::default() };
    for (key, (size, sum)) in answer.files {
        if key.starts_with("state/") {
            summary.state_bytes += size;
        } else {
            summary.files += 1;
            summary.workspace_bytes += size;
        }
        summary.sizes.insert(key.clone(), size);
        summary.digests.insert(key, sum);
    }
    if summary.bytes() > bounds.bytes {
        return Err(format!("the snapshot would be larger than {} bytes", bounds.bytes));
    }
    Ok(summary)
}

/// Copies a packed snapshot into the empty workspace volume of a new session, as its `uid`,
/// the state into `.pyberth-restore`; every file must be there with the size and sum it was
/// saved with, and nothing more (otherwise "the snapshot is corrupted: ...").
pub async fn unpack(p: &Packer<'_>, stored: &Stored, workspace: &str, expected: &Summary) -> Result<(), String> {
    let corrupt = |why: String| format!("the snapshot is corrupted: {why}");
    let mounts = vec![
        volume_mount(&stored.volume, MOUNT, true, false),
        volume_mount(workspace, container::WORKSPACE, false, false),
    ];
    let entries = (expected.sizes.len() as u64).saturating_mul(2).saturating_add(100_000);
    let args = vec!["load".to_owned(), expected.bytes().to_string(), entries.to_string()];
    let answer = run_packer(p, mounts, args, expected.bytes() >> 20).await?;
    match answer.error {
        Some(e) if answer.corrupt => return Err(corrupt(e)),
        Some(e) => return Err(format!("cannot copy the snapshot's files: {e}")),
        None => {}
    }
    for (key, (size, sum)) in &answer.files {
        if expected.sizes.get(key) != Some(size) || expected.digests.get(key) != Some(sum) {
            return Err(corrupt(format!("{key} is not what was saved")));
        }
    }
    let found = answer.files.len();
    if found != expected.sizes.len() {
        return Err(corrupt(format!(
            "{} of its {} files are missing",
            expected.sizes.len() - found,
            expected.sizes.len()
        )));
    }
    Ok(())
}

/// The path of an entry if it may be kept: relative, without `..`, not too deep.
fn kept_path(raw: &Path) -> Option<PathBuf> {
    let path: PathBuf = raw.components().filter(|c| !matches!(c, Component::CurDir)).collect();
    (!path.as_os_str().is_empty() && safe_relative(&path) && path.components().count() <= MAX_DEPTH).then_some(path)
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
        header.set_uid(0);
        header.set_gid(0);
        header.set_mode(header.mode().unwrap_or(0o644) & 0o777);
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
