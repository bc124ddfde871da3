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
use std::path::{Path, PathBuf};

use crate::docker::Engine;
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
pub use rules::{Checksum, check_incoming, check_outgoing};

mod rules;

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
pub async fn create(docker: &dyn Engine, owner: &Owner, principal: &str, id: &str) -> Result<Stored, Error> {
    let name = format!("pyberth-{}-snap-{id}", owner.instance);
    let labels = owner.labels_with(&[(LABEL_OWNER, principal), (LABEL_SNAPSHOT, id)]);
    let request = VolumeCreateRequest { name: Some(name.clone()), labels: Some(labels), ..Default::default() };
    docker.create_volume(request).await?;
    Ok(Stored { volume: name })
}

/// Removes a snapshot's volume.
pub async fn remove(docker: &dyn Engine, stored: &Stored) {
    container::remove_volume(docker, &stored.volume).await;
}

/// Where a copy's helper container comes from: the engine, this instance (its labels), and
/// an image that exists (nothing of it runs).
#[derive(Debug, Clone, Copy)]
pub struct Via<'a> {
    /// The engine.
    pub docker: &'a dyn Engine,
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
    let written = via.docker.upload_to_container(&id, Some(opts), crate::docker::body_try_stream(body(rx))).await;
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
    docker: &dyn Engine,
    id: &str,
    rx: mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> Result<(), Error> {
    let opts = UploadToContainerOptionsBuilder::default().path(container::WORKSPACE).build();
    Ok(docker.upload_to_container(id, Some(opts), crate::docker::body_try_stream(body(rx))).await?)
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
    pub docker: &'a dyn Engine,
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
    let utility = crate::docker::utility::Utility {
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
    let id = crate::docker::utility::create_utility(docker, utility)
        .await
        .map_err(|e| format!("cannot create the packer: {e}"))?;
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
