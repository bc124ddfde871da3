//! Dependency layers (docs/design.md D6): a requirement set installed once, by a short-lived
//! installer container that alone has network access, and kept as an image built on our own
//! sandbox image that adds only the installed tree under `/opt/pyberth/site`. Session
//! containers are never committed: no container ever starts from a root filesystem that
//! untrusted code shaped (docs/threat-model.md §4).
//!
//! Why this file passes 500 lines: it holds the installer, the hostile-tree repack and the
//! cache of layers together while issue 16 replaces how layers are stored; it splits along
//! those three seams with that rework, not before (one move, not two).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::time::Instant;

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountType, VolumeCreateRequest};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, BuildImageOptionsBuilder, CreateContainerOptionsBuilder,
    DownloadFromContainerOptionsBuilder, ListImagesOptionsBuilder, RemoveImageOptionsBuilder,
    UploadToContainerOptionsBuilder,
};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::container::{self, Owner, WORKSPACE};
use super::identity::{self, LABEL_UID};
use super::{Error as DockerError, LABEL_IMAGE, LABEL_INSTANCE, LABEL_MANAGED};
use crate::config::SandboxConfig;
use crate::docker::image::Progress;

/// Repository of layer images.
pub const LAYER_REPO: &str = "pyberth-layer";
/// Label holding a layer's requirement set, one per line.
pub const LABEL_REQUIREMENTS: &str = "pyberth.requirements";
/// Label holding the image a layer is built on.
pub const LABEL_BASE: &str = "pyberth.base";
/// Where a layer's packages live in its image.
pub const LAYER_SITE: &str = "/opt/pyberth/site";
/// Where a session's live volume is mounted; installs land in `site/` below it.
pub const LIVE_DIR: &str = "/opt/pyberth/live";
/// Largest installed tree accepted from an installer.
const MAX_TREE: u64 = 4 << 30;
/// Chunk size of the build context streamed to the engine.
const CHUNK: usize = 256 << 10;

/// Why an install failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The installer ran and failed; the text says why in the user's terms.
    #[error("{0}")]
    Failed(String),
    /// pip (or uv) itself failed: why in the user's terms, and the end of its output.
    #[error("install failed: {what}. Nothing was installed. Installer output ends with:\n{tail}")]
    Installer {
        /// Why, in the user's terms.
        what: String,
        /// The installer's last lines.
        tail: String,
    },
    /// The installer did not finish in time.
    #[error(
        "the install did not finish within {0} s and was stopped: install fewer packages at once, or raise --install-timeout-s"
    )]
    Timeout(u64),
    /// Docker failed.
    #[error(transparent)]
    Docker(#[from] DockerError),
}

impl From<bollard::errors::Error> for Error {
    fn from(e: bollard::errors::Error) -> Self {
        Error::Docker(e.into())
    }
}

/// The index settings that shape what an install produces.
#[derive(Debug, Clone, Default)]
pub struct IndexSettings {
    /// Index URL (None: PyPI).
    pub index_url: Option<String>,
    /// Extra index URL.
    pub extra_index_url: Option<String>,
    /// CA bundle contents.
    pub ca_bundle: Option<Vec<u8>>,
}

impl IndexSettings {
    /// Reads the settings (and the CA bundle file) from the configuration.
    pub fn from_config(cfg: &SandboxConfig) -> std::io::Result<Self> {
        let ca_bundle = match cfg.ca_bundle() {
            Some(p) => Some(std::fs::read(p)?),
            None => None,
        };
        Ok(Self { index_url: cfg.index_url(), extra_index_url: cfg.extra_index_url(), ca_bundle })
    }
}

/// Content key of a layer: the base image id (which fixes the Python version), the
/// canonical sorted requirements and the index URLs. The CA bundle is left out: it changes
/// how the index is reached, not what it serves.
pub fn layer_key(base_image_id: &str, requirements: &[String], index: &IndexSettings) -> String {
    let mut h = Sha256::new();
    for part in [
        "pyberth-layer-v1",
        base_image_id,
        &requirements.join("\n"),
        index.index_url.as_deref().unwrap_or(""),
        index.extra_index_url.as_deref().unwrap_or(""),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().iter().take(10).map(|b| format!("{b:02x}")).collect()
}

/// What a layer is built from, and its name.
struct LayerSpec<'a> {
    /// The image it is built on.
    base: &'a str,
    /// The canonical requirement set it holds.
    requirements: &'a [String],
    /// Its image tag.
    tag: &'a str,
}

/// A layer ready for use.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Image tag.
    pub tag: String,
    /// Whether it already existed (no installer ran).
    pub cached: bool,
}

/// The layer for `requirements` on `base`, built if absent.
pub async fn ensure(
    docker: &Docker,
    cfg: &SandboxConfig,
    owner: &Owner,
    base: &str,
    requirements: &[String],
    index: &IndexSettings,
    progress: Progress<'_>,
) -> Result<Layer, Error> {
    let base_id = docker.inspect_image(base).await?.id.unwrap_or_else(|| base.to_owned());
    let tag = format!("{LAYER_REPO}:{}", layer_key(&base_id, requirements, index));
    if super::image::exists(docker, &tag).await? {
        return Ok(Layer { tag, cached: true });
    }
    progress(&format!("installing {} into a new layer", requirements.join(" ")));
    let started = Instant::now();
    install(docker, cfg, owner, &LayerSpec { base, requirements, tag: &tag }, index, progress).await?;
    progress(&format!("layer {tag} ready in {:.1} s", started.elapsed().as_secs_f64()));
    Ok(Layer { tag, cached: false })
}

/// Runs the installer container, then builds the layer from the tree it installed.
async fn install(
    docker: &Docker,
    cfg: &SandboxConfig,
    owner: &Owner,
    spec: &LayerSpec<'_>,
    index: &IndexSettings,
    progress: Progress<'_>,
) -> Result<(), Error> {
    let name = format!("pyberth-{}-install-{}", owner.instance, next_serial());
    // A uid of its own, as every sandbox has: install hooks share no per-uid limit with a
    // session or a host user.
    let uid = identity::pick(docker, cfg.uid_range).await?;
    let result = install_as(docker, cfg, owner, spec, index, progress, &name, uid).await;
    identity::release(uid);
    result
}

/// [`install`] with the installer's name and uid.
#[allow(clippy::too_many_arguments)] // install's arguments, plus the two it picked
async fn install_as(
    docker: &Docker,
    cfg: &SandboxConfig,
    owner: &Owner,
    spec: &LayerSpec<'_>,
    index: &IndexSettings,
    progress: Progress<'_>,
    name: &str,
    uid: u32,
) -> Result<(), Error> {
    let name = name.to_owned();
    let labels = HashMap::from([
        (LABEL_MANAGED.to_owned(), "1".to_owned()),
        (LABEL_INSTANCE.to_owned(), owner.instance.clone()),
        (super::LABEL_HOST.to_owned(), owner.host.clone()),
        ("pyberth.installer".to_owned(), "1".to_owned()),
        (LABEL_UID.to_owned(), uid.to_string()),
    ]);
    docker
        .create_volume(VolumeCreateRequest {
            name: Some(name.clone()),
            labels: Some(labels.clone()),
            ..Default::default()
        })
        .await?;
    let result = async {
        let mut cmd: Vec<String> = [
            "python3",
            "-m",
            "pip",
            "install",
            "--no-input",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--progress-bar",
            "off",
            "--retries",
            "1",
            "--timeout",
            "30",
            "--target",
            "/workspace/site",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if let Some(url) = &index.index_url {
            cmd.extend(["--index-url".to_owned(), url.clone()]);
        }
        if let Some(url) = &index.extra_index_url {
            cmd.extend(["--extra-index-url".to_owned(), url.clone()]);
        }
        if index.ca_bundle.is_some() {
            cmd.extend(["--cert".to_owned(), "/workspace/ca.pem".to_owned()]);
        }
        cmd.push("--".to_owned());
        cmd.extend(spec.requirements.iter().cloned());
        // The sandbox's hardening, but with the default network and room to build wheels.
        let mut hc = container::host_config(cfg, &name);
        hc.network_mode = None;
        hc.memory = Some(2 << 30);
        hc.memory_swap = Some(2 << 30);
        hc.tmpfs = Some(HashMap::from([("/tmp".into(), "rw,nosuid,nodev,size=1024m".into())]));
        hc.mounts = Some(vec![Mount {
            target: Some(WORKSPACE.into()),
            source: Some(name.clone()),
            typ: Some(MountType::VOLUME),
            ..Default::default()
        }]);
        let body = ContainerCreateBody {
            image: Some(spec.base.into()),
            cmd: Some(cmd),
            user: Some(identity::user(uid)),
            working_dir: Some(WORKSPACE.into()),
            env: Some(vec![
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
                "HOME=/tmp".into(),
                "USER=sandbox".into(),
                "LOGNAME=sandbox".into(),
                "LANG=C.UTF-8".into(),
                "PIP_NO_WARN_SCRIPT_LOCATION=1".into(),
            ]),
            labels: Some(labels),
            host_config: Some(hc),
            ..Default::default()
        };
        let created =
            docker.create_container(Some(CreateContainerOptionsBuilder::default().name(&name).build()), body).await?;
        let id = created.id;
        let run = async {
            if let Some(ca) = &index.ca_bundle {
                upload_file(docker, &id, WORKSPACE, "ca.pem", ca).await?;
            }
            let attach = AttachContainerOptionsBuilder::default().stream(true).stdout(true).stderr(true).build();
            let mut output = docker.attach_container(&id, Some(attach)).await?.output;
            docker.start_container(&id, None).await?;
            let mut tail: Vec<String> = Vec::new();
            let mut partial = String::new();
            let deadline = tokio::time::sleep(cfg.install_timeout());
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    frame = output.next() => match frame {
                        Some(Ok(LogOutput::StdOut { message } | LogOutput::StdErr { message })) => {
                            partial.push_str(&String::from_utf8_lossy(&message));
                            while let Some(pos) = partial.find('\n') {
                                let line: String = partial.drain(..=pos).collect();
                                let line = line.trim_end().to_owned();
                                if !line.is_empty() {
                                    progress(&line);
                                    tail.push(line);
                                    if tail.len() > 30 {
                                        tail.remove(0);
                                    }
                                }
                            }
                        }
                        Some(Ok(_)) => {}
                        Some(Err(e)) => return Err(e.into()),
                        None => break,
                    },
                    _ = &mut deadline => return Err(Error::Timeout(cfg.install_timeout_s)),
                }
            }
            let code = wait_exit(docker, &id).await?;
            if code != 0 {
                return Err(explain(&tail, index));
            }
            build_layer(docker, &id, spec).await
        };
        let result = run.await;
        container::remove_container(docker, &id).await;
        result
    }
    .await;
    container::remove_volume(docker, &name).await;
    result
}

/// Evaluates each marker with pip's own `packaging` (the standalone one when pip has none).
/// Prints one JSON array: true, false, or null where a marker could not be evaluated.
const MARKERS_PY: &str = r#"import json, sys
try:
    from pip._vendor.packaging.markers import Marker
except ImportError:
    from packaging.markers import Marker
out = []
for m in sys.argv[1:]:
    try:
        out.append(bool(Marker(m).evaluate()))
    except Exception:
        out.append(None)
print(json.dumps(out))
"#;

/// Evaluates PEP 508 environment markers (`python_version < '3'`) with the interpreter of
/// `image`, exactly as pip will when it installs on that image: in one short-lived container
/// with the sandbox's hardening, no network and no volume. `Some(false)` is a marker pip
/// would skip its requirement for; `None`, one it could not evaluate (pip then decides).
pub async fn evaluate_markers(
    docker: &Docker,
    cfg: &SandboxConfig,
    owner: &Owner,
    image: &str,
    markers: &[String],
) -> Result<Vec<Option<bool>>, Error> {
    let uid = identity::pick(docker, cfg.uid_range).await?;
    let result = evaluate_markers_as(docker, cfg, owner, image, markers, uid).await;
    identity::release(uid);
    result
}

/// [`evaluate_markers`] as `uid`.
async fn evaluate_markers_as(
    docker: &Docker,
    cfg: &SandboxConfig,
    owner: &Owner,
    image: &str,
    markers: &[String],
    uid: u32,
) -> Result<Vec<Option<bool>>, Error> {
    let name = format!("pyberth-{}-markers-{}", owner.instance, next_serial());
    let labels = HashMap::from([
        (LABEL_MANAGED.to_owned(), "1".to_owned()),
        (LABEL_INSTANCE.to_owned(), owner.instance.clone()),
        (super::LABEL_HOST.to_owned(), owner.host.clone()),
        (LABEL_UID.to_owned(), uid.to_string()),
    ]);
    let mut hc = container::host_config(cfg, &name);
    hc.mounts = None;
    let cmd = ["python3", "-I", "-c", MARKERS_PY].iter().map(|s| (*s).to_owned()).chain(markers.iter().cloned());
    let body = ContainerCreateBody {
        image: Some(image.into()),
        cmd: Some(cmd.collect()),
        user: Some(identity::user(uid)),
        working_dir: Some("/tmp".into()),
        env: Some(vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            "LANG=C.UTF-8".into(),
        ]),
        labels: Some(labels),
        network_disabled: Some(true),
        host_config: Some(hc),
        ..Default::default()
    };
    let created =
        docker.create_container(Some(CreateContainerOptionsBuilder::default().name(&name).build()), body).await?;
    let id = created.id;
    let run = async {
        let attach = AttachContainerOptionsBuilder::default().stream(true).stdout(true).stderr(true).build();
        let mut output = docker.attach_container(&id, Some(attach)).await?.output;
        docker.start_container(&id, None).await?;
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        let read = async {
            while let Some(frame) = output.next().await {
                match frame? {
                    LogOutput::StdOut { message } if stdout.len() < 64 << 10 => stdout.extend_from_slice(&message),
                    LogOutput::StdErr { message } if stderr.len() < 4 << 10 => stderr.extend_from_slice(&message),
                    _ => {}
                }
            }
            Ok::<_, Error>(())
        };
        match tokio::time::timeout(std::time::Duration::from_secs(60), read).await {
            Ok(r) => r?,
            Err(_) => return Err(Error::Failed("the marker check did not finish within 60 s".into())),
        }
        let code = wait_exit(docker, &id).await?;
        let line = String::from_utf8_lossy(&stdout);
        let verdicts: Option<Vec<Option<bool>>> = serde_json::from_str(line.trim()).ok();
        match verdicts {
            Some(v) if code == 0 && v.len() == markers.len() => Ok(v),
            _ => Err(Error::Failed(format!(
                "the marker check failed (exit {code}): {}",
                String::from_utf8_lossy(&stderr).trim()
            ))),
        }
    };
    let result = run.await;
    container::remove_container(docker, &id).await;
    result
}

fn next_serial() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SERIAL: AtomicU64 = AtomicU64::new(0);
    SERIAL.fetch_add(1, Ordering::Relaxed)
}

async fn wait_exit(docker: &Docker, id: &str) -> Result<i64, Error> {
    let mut wait = docker.wait_container(id, None);
    match wait.next().await {
        Some(Ok(r)) => Ok(r.status_code),
        // bollard reports a non-zero exit as an error carrying the code.
        Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => Ok(code),
        Some(Err(e)) => Err(e.into()),
        None => Ok(-1),
    }
}

/// Turns pip's last lines into a short message a model can act on.
fn explain(tail: &[String], index: &IndexSettings) -> Error {
    let all = tail.join("\n");
    let index_name = index.index_url.as_deref().unwrap_or("https://pypi.org/simple");
    let what = if all.contains("No matching distribution found") || all.contains("Could not find a version") {
        if all.contains("Failed to establish a new connection")
            || all.contains("Network is unreachable")
            || all.contains("Temporary failure in name resolution")
            || all.contains("CERTIFICATE_VERIFY_FAILED")
            || all.contains("SSLError")
            || all.contains("ProxyError")
        {
            format!(
                "the package index {index_name} could not be reached (network, proxy or CA bundle: \
                 see --index-url and --ca-bundle)"
            )
        } else {
            "no such package, or no version matching the constraint, on the index".to_owned()
        }
    } else if all.contains("ResolutionImpossible") || all.contains("conflicting dependencies") {
        "the requested packages have conflicting dependencies".to_owned()
    } else if all.contains("Failed building wheel") || all.contains("subprocess-exited-with-error") {
        "a package failed to build (it may need a compiler or system libraries the sandbox lacks; \
         try a version that ships a wheel)"
            .to_owned()
    } else {
        "the installer failed".to_owned()
    };
    let last: Vec<&String> = tail.iter().rev().take(8).collect::<Vec<_>>().into_iter().rev().collect();
    let tail = last.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n");
    Error::Installer { what, tail }
}

async fn upload_file(docker: &Docker, id: &str, dir: &str, name: &str, data: &[u8]) -> Result<(), Error> {
    let mut ar = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_mtime(0);
    h.set_cksum();
    ar.append_data(&mut h, name, data).map_err(|e| Error::Failed(format!("cannot pack {name}: {e}")))?;
    let buf = ar.into_inner().map_err(|e| Error::Failed(format!("cannot pack {name}: {e}")))?;
    let opts = UploadToContainerOptionsBuilder::default().path(dir).build();
    docker.upload_to_container(id, Some(opts), bollard::body_full(buf.into())).await?;
    Ok(())
}

/// Forwards the installer's `/workspace/site`, a tar, to the re-packer, bounded in size. A
/// failure reaches the re-packer as an error, never as an early end: a tree cut short must
/// not become a layer.
async fn download_tree(docker: &Docker, id: &str, tx: mpsc::Sender<std::io::Result<Bytes>>) -> Result<(), Error> {
    let opts = DownloadFromContainerOptionsBuilder::default().path("/workspace/site").build();
    let mut stream = docker.download_from_container(id, Some(opts));
    let mut total = 0u64;
    let failed = loop {
        let chunk = match stream.try_next().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => return Ok(()),
            Err(e) => break Error::from(e),
        };
        total += chunk.len() as u64;
        if total > MAX_TREE {
            break Error::Failed(format!("install failed: the installed packages exceed {} GiB", MAX_TREE >> 30));
        }
        if tx.send(Ok(chunk)).await.is_err() {
            // The re-packer stopped: at the archive's end, or with an error it reports.
            return Ok(());
        }
    };
    let _ = tx.send(Err(std::io::Error::other("the download of the installed tree failed"))).await;
    Err(failed)
}

/// The installer's tree as a `Read` for the blocking re-packer, from chunks `download_tree`
/// forwards.
struct TreeReader {
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
    cur: Bytes,
}

impl Read for TreeReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.cur = chunk?,
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.cur.len());
        out[..n].copy_from_slice(&self.cur.split_to(n));
        Ok(n)
    }
}

/// The build context as chunks down a channel, from the blocking re-packer. `None` marks the
/// end, sent only by `finish`: a body that stops without it, because the re-packer failed or
/// panicked, ends in an error, so the engine never builds from part of a tree.
struct ContextWriter {
    tx: mpsc::Sender<std::io::Result<Option<Bytes>>>,
    buf: Vec<u8>,
    /// The build stopped reading (it failed on its own).
    gone: bool,
}

impl ContextWriter {
    fn send(&mut self, item: std::io::Result<Option<Bytes>>) -> std::io::Result<()> {
        self.tx.blocking_send(item).map_err(|_| {
            self.gone = true;
            std::io::Error::other("the build stopped reading its context")
        })
    }

    fn finish(&mut self) -> std::io::Result<()> {
        self.flush()?;
        self.send(Ok(None))
    }
}

impl Write for ContextWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.send(Ok(Some(chunk)))
    }
}

/// Re-packs the tree arriving on `tree` into a build context sent down `context` (on a
/// blocking thread). Also says whether the build stopped reading.
fn repack(
    base: &str,
    tree: mpsc::Receiver<std::io::Result<Bytes>>,
    context: mpsc::Sender<std::io::Result<Option<Bytes>>>,
) -> (Result<(), String>, bool) {
    let mut out = ContextWriter { tx: context, buf: Vec::with_capacity(CHUNK), gone: false };
    let tree = TreeReader { rx: tree, cur: Bytes::new() };
    let packed = context_from_tree(base, tree, &mut out).and_then(|w| w.finish().map_err(|e| e.to_string()));
    if let Err(e) = &packed {
        let _ = out.tx.blocking_send(Err(std::io::Error::other(e.clone())));
    }
    (packed, out.gone)
}

/// The request body of a build, from the re-packer's chunks.
fn context_body(
    rx: mpsc::Receiver<std::io::Result<Option<Bytes>>>,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    futures::stream::unfold(Some(rx), |rx| async move {
        let mut rx = rx?;
        match rx.recv().await {
            Some(Ok(Some(chunk))) => Some((Ok(chunk), Some(rx))),
            Some(Ok(None)) => None,
            Some(Err(e)) => Some((Err(e), None)),
            None => Some((Err(std::io::Error::other("the context was cut short")), None)),
        }
    })
}

/// Cuts off a writer after a failure: tar's `Builder` writes an end-of-archive marker when
/// dropped, and that marker would make a refused tree look whole to whoever reads it.
struct Cut<W> {
    inner: W,
    cut: bool,
}

impl<W: Write> Write for Cut<W> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.cut { Ok(data.len()) } else { self.inner.write(data) }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.cut { Ok(()) } else { self.inner.flush() }
    }
}

/// Re-packs the installer's tree into a build context written to `out`. The tree came from a
/// container that ran untrusted install hooks, so it is treated as hostile: entries must stay
/// under `site/`, links may not point out of it, devices and fifos are dropped, and modes are
/// made readable (never setuid) so the code's uid can import what root's COPY wrote. On
/// failure `out` gets no end-of-archive marker.
fn context_from_tree<W: Write>(base: &str, tree: impl Read, out: W) -> Result<W, String> {
    let mut out = tar::Builder::new(Cut { inner: out, cut: false });
    match append_tree(base, tree, &mut out) {
        Ok(()) => out.into_inner().map(|c| c.inner).map_err(|e| e.to_string()),
        Err(e) => {
            out.get_mut().cut = true;
            Err(e)
        }
    }
}

fn append_tree<W: Write>(base: &str, tree: impl Read, out: &mut tar::Builder<W>) -> Result<(), String> {
    let dockerfile = format!("FROM {base}\nCOPY site {LAYER_SITE}\n");
    let mut h = tar::Header::new_gnu();
    h.set_size(dockerfile.len() as u64);
    h.set_mode(0o644);
    h.set_mtime(0);
    h.set_cksum();
    out.append_data(&mut h, "Dockerfile", dockerfile.as_bytes()).map_err(|e| e.to_string())?;
    let mut ar = tar::Archive::new(tree);
    for entry in ar.entries().map_err(|e| e.to_string())? {
        let mut entry = entry.map_err(|e| e.to_string())?;
        let path = entry.path().map_err(|e| e.to_string())?.into_owned();
        if !safe_relative(&path) || path.components().next().and_then(|c| c.as_os_str().to_str()) != Some("site") {
            return Err(format!("installer produced an unsafe path {}", path.display()));
        }
        let kind = entry.header().entry_type();
        let mut header = entry.header().clone();
        match kind {
            tar::EntryType::Regular | tar::EntryType::Directory => {}
            tar::EntryType::Symlink | tar::EntryType::Link => {
                let target = entry.link_name().map_err(|e| e.to_string())?.unwrap_or_default().into_owned();
                let resolved = path.parent().unwrap_or(std::path::Path::new("")).join(&target);
                if target.is_absolute() || !safe_relative(&normalize(&resolved)) {
                    continue; // a link out of the tree is dropped, never followed
                }
            }
            _ => continue,
        }
        let mode = header.mode().unwrap_or(0o644) & 0o777;
        let mode = if kind == tar::EntryType::Directory || mode & 0o111 != 0 { mode | 0o555 } else { mode | 0o444 };
        header.set_mode(mode & 0o755);
        header.set_uid(0);
        header.set_gid(0);
        header.set_cksum();
        // Streamed, not read whole: one file of a tree may be gigabytes.
        out.append_data(&mut header, &path, &mut entry).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn normalize(p: &std::path::Path) -> std::path::PathBuf {
    let mut out = std::path::PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                if !out.pop() {
                    return std::path::PathBuf::from("..");
                }
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// A relative path with no `..`, root or prefix components.
pub fn safe_relative(p: &std::path::Path) -> bool {
    p.components().all(|c| matches!(c, std::path::Component::Normal(_) | std::path::Component::CurDir))
}

/// Builds the layer from the stopped installer `installer`. Its tree streams through a
/// re-packer on a blocking thread (the `tar` crate is synchronous) into the build's request
/// body; bounded channels join the three, so neither memory nor a runtime worker holds it.
async fn build_layer(docker: &Docker, installer: &str, spec: &LayerSpec<'_>) -> Result<(), Error> {
    let (tree_tx, tree_rx) = mpsc::channel(4);
    let (context_tx, context_rx) = mpsc::channel(4);
    let base = spec.base.to_owned();
    // Awaited below; if this future is dropped instead, both its channels close and it ends.
    let repacker = tokio::task::spawn_blocking(move || repack(&base, tree_rx, context_tx));
    let labels = HashMap::from([
        (LABEL_IMAGE, "layer".to_owned()),
        (LABEL_REQUIREMENTS, spec.requirements.join("\n")),
        (LABEL_BASE, spec.base.to_owned()),
    ]);
    let opts = BuildImageOptionsBuilder::default()
        .dockerfile("Dockerfile")
        .t(spec.tag)
        .labels(&labels)
        .rm(true)
        .forcerm(true)
        .build();
    let build = async {
        let body = bollard::body_try_stream(context_body(context_rx));
        let mut stream = docker.build_image(opts, None, Some(body));
        while let Some(item) = stream.next().await {
            match item {
                Ok(info) => {
                    if let Some(detail) = info.error_detail.and_then(|d| d.message) {
                        return Err(DockerError::Build(detail).into());
                    }
                }
                Err(bollard::errors::Error::DockerStreamError { error }) => {
                    return Err(DockerError::Build(error).into());
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    };
    let (downloaded, built) = tokio::join!(download_tree(docker, installer, tree_tx), build);
    let (packed, build_gone) =
        repacker.await.map_err(|e| Error::Failed(format!("install failed: the re-packer stopped: {e}")))?;
    // The first failure is the cause; the others follow from the channels it closed.
    downloaded?;
    match packed {
        Ok(()) => built,
        Err(_) if build_gone && built.is_err() => built,
        Err(e) => Err(Error::Failed(format!("install failed: {e}"))),
    }
}

/// Copies a layer's packages into a running session's live volume, streamed from a stopped
/// container of the layer image straight into the session (no network, no installer).
pub async fn copy_into(docker: &Docker, layer_tag: &str, session_container: &str, owner: &Owner) -> Result<(), Error> {
    let name = format!("pyberth-{}-copy-{}", owner.instance, next_serial());
    let labels = HashMap::from([
        (LABEL_MANAGED.to_owned(), "1".to_owned()),
        (LABEL_INSTANCE.to_owned(), owner.instance.clone()),
        (super::LABEL_HOST.to_owned(), owner.host.clone()),
    ]);
    let body = ContainerCreateBody {
        image: Some(layer_tag.into()),
        cmd: Some(vec!["true".into()]),
        labels: Some(labels),
        network_disabled: Some(true),
        host_config: Some(HostConfig { network_mode: Some("none".into()), ..Default::default() }),
        ..Default::default()
    };
    let holder =
        docker.create_container(Some(CreateContainerOptionsBuilder::default().name(&name).build()), body).await?;
    let result = async {
        let opts = DownloadFromContainerOptionsBuilder::default().path(LAYER_SITE).build();
        let tree = docker.download_from_container(&holder.id, Some(opts)).map_err(std::io::Error::other);
        let opts = UploadToContainerOptionsBuilder::default().path(LIVE_DIR).build();
        docker.upload_to_container(session_container, Some(opts), bollard::body_try_stream(tree)).await?;
        Ok(())
    }
    .await;
    container::remove_container(docker, &holder.id).await;
    result
}

/// A layer image, for listings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LayerInfo {
    /// Tag; the image id when it has none (`dangling`).
    pub tag: String,
    /// Requirements it holds.
    pub requirements: Vec<String>,
    /// Size in bytes (including the shared base).
    pub size: i64,
    /// Its own bytes: what it adds to the image it is built on (None: that image is not in
    /// its history, so it cannot be told apart).
    pub own_size: Option<i64>,
    /// Creation time, seconds since the epoch.
    pub created: i64,
    /// The image it is built on.
    pub base: String,
    /// It has no tag: a later build of the same key took it (two servers building the same
    /// set at once), so nothing will ever use it again.
    pub dangling: bool,
}

/// All layer images, newest first, dangling ones included (with their id as tag).
pub async fn list(docker: &Docker) -> Result<Vec<LayerInfo>, DockerError> {
    let label = format!("{LABEL_IMAGE}=layer");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListImagesOptionsBuilder::default().filters(&filters).build();
    let mut base_ids: HashMap<String, Option<String>> = HashMap::new();
    let mut out = Vec::new();
    for i in docker.list_images(Some(opts)).await? {
        let base = i.labels.get(LABEL_BASE).cloned().unwrap_or_default();
        if !base_ids.contains_key(&base) {
            let id = docker.inspect_image(&base).await.ok().and_then(|b| b.id);
            base_ids.insert(base.clone(), id);
        }
        let base_id = base_ids.get(&base).cloned().flatten();
        // Docker before 25 lists an untagged image as `<none>:<none>`; later ones with no tag.
        let tag = i.repo_tags.iter().find(|t| t.as_str() != "<none>:<none>").cloned();
        out.push(LayerInfo {
            dangling: tag.is_none(),
            own_size: own_size(docker, &i.id, base_id.as_deref()).await,
            tag: tag.unwrap_or_else(|| i.id.clone()),
            requirements: i
                .labels
                .get(LABEL_REQUIREMENTS)
                .map(|r| r.lines().map(str::to_owned).collect())
                .unwrap_or_default(),
            size: i.size,
            created: i.created,
            base,
        });
    }
    Ok(out)
}

/// The bytes an image adds to the image it was built on: the sizes in its history down to
/// that image, found by id (`base_id`) or, when the base tag has moved on since (a rebuilt
/// sandbox image), as the first tagged ancestor.
async fn own_size(docker: &Docker, id: &str, base_id: Option<&str>) -> Option<i64> {
    let history = docker.image_history(id).await.ok()?;
    let mut own = 0;
    for (n, step) in history.iter().enumerate() {
        if n > 0 && (Some(step.id.as_str()) == base_id || !step.tags.is_empty()) {
            return Some(own);
        }
        own += step.size;
    }
    None
}

/// Layers ordered most recently used first, by the use record in `state_dir` (falling back
/// to creation time for layers never used since the record began).
pub async fn list_by_use(docker: &Docker, state_dir: &std::path::Path) -> Result<Vec<LayerInfo>, DockerError> {
    let used = read_uses(state_dir);
    let mut out = list(docker).await?;
    out.sort_by_key(|l| std::cmp::Reverse(used.get(&l.tag).copied().unwrap_or(l.created)));
    Ok(out)
}

fn uses_path(state_dir: &std::path::Path) -> std::path::PathBuf {
    state_dir.join("layers-used.json")
}

/// Largest use record read: tens of thousands of layers.
const MAX_USES: u64 = 4 << 20;

fn read_uses(state_dir: &std::path::Path) -> HashMap<String, i64> {
    crate::state_dir::read(&uses_path(state_dir), MAX_USES)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Records that a layer was used now. A lost update between two servers only blurs the
/// LRU order, so a write to a fresh temp file and a rename is enough; never through a
/// symlink planted in the state dir (`state_dir::replace`).
pub fn touch(state_dir: &std::path::Path, tag: &str) {
    let mut used = read_uses(state_dir);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    used.insert(tag.to_owned(), now.unwrap_or(0));
    let written = serde_json::to_vec(&used)
        .map_err(std::io::Error::other)
        .and_then(|b| crate::state_dir::replace(&uses_path(state_dir), &b));
    if let Err(e) = written {
        tracing::debug!(error = %e, "cannot record layer use");
    }
}

/// Removes layers, least recently used first, until the layers' own bytes (size beyond their base) are at
/// most `keep_bytes`; 0 removes all. Layers a container still uses are kept by the engine.
/// Returns the removed tags.
pub async fn prune(docker: &Docker, state_dir: &std::path::Path, keep_bytes: u64) -> Result<Vec<String>, DockerError> {
    let layers = list_by_use(docker, state_dir).await?;
    let mut own = Vec::with_capacity(layers.len());
    let mut base_sizes: HashMap<String, i64> = HashMap::new();
    for l in &layers {
        if !base_sizes.contains_key(&l.base) {
            let size = docker.inspect_image(&l.base).await.ok().and_then(|i| i.size).unwrap_or(0);
            base_sizes.insert(l.base.clone(), size);
        }
        own.push(u64::try_from(l.size - base_sizes[&l.base]).unwrap_or(0));
    }
    let mut total: u64 = own.iter().sum();
    let mut removed = Vec::new();
    for (l, bytes) in layers.iter().zip(own).rev() {
        if keep_bytes > 0 && total <= keep_bytes {
            break;
        }
        match docker.remove_image(&l.tag, Some(RemoveImageOptionsBuilder::default().build()), None).await {
            Ok(_) => {
                total = total.saturating_sub(bytes);
                removed.push(l.tag.clone());
            }
            Err(e) => tracing::info!(layer = %l.tag, error = %e, "layer kept"),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(entries: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, link) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o600);
            h.set_size(0);
            if !link.is_empty() {
                h.set_link_name(link).expect("link");
            }
            if h.set_path(path).is_err() {
                // tar refuses to write `..`; hostile archives have it anyway.
                let raw = path.as_bytes();
                h.as_old_mut().name[..raw.len()].copy_from_slice(raw);
            }
            h.set_cksum();
            b.append(&h, &[][..]).expect("append");
        }
        b.into_inner().expect("tar")
    }

    fn names(ctx: &[u8]) -> Vec<(String, u32)> {
        let mut ar = tar::Archive::new(ctx);
        ar.entries()
            .expect("entries")
            .map(|e| {
                let e = e.expect("entry");
                (e.path().expect("path").display().to_string(), e.header().mode().expect("mode"))
            })
            .collect()
    }

    #[test]
    fn the_use_record_never_writes_through_a_planted_symlink() {
        let dir = std::env::temp_dir().join(format!("pyberth-touch-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").expect("victim");
        // The old temp name, and the record itself, both planted as links to the victim.
        for name in [format!("layers-used.json.{}", std::process::id()), "layers-used.json".to_owned()] {
            std::os::unix::fs::symlink(&victim, dir.join(name)).expect("symlink");
        }
        touch(&dir, "pyberth-layer:abc");
        assert_eq!(std::fs::read(&victim).expect("victim"), b"precious", "written through a symlink");
        let record = std::fs::symlink_metadata(uses_path(&dir)).expect("record");
        assert!(record.is_file(), "the record is a file of ours, not the planted link");
        assert!(read_uses(&dir).contains_key("pyberth-layer:abc"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn keys_depend_on_every_input() {
        let idx = IndexSettings::default();
        let reqs = vec!["six".to_owned()];
        let k = layer_key("sha256:a", &reqs, &idx);
        assert_eq!(k.len(), 20);
        assert_eq!(k, layer_key("sha256:a", &reqs, &idx));
        assert_ne!(k, layer_key("sha256:b", &reqs, &idx));
        assert_ne!(k, layer_key("sha256:a", &["attrs".to_owned()], &idx));
        let other = IndexSettings { index_url: Some("https://mirror/simple".into()), ..Default::default() };
        assert_ne!(k, layer_key("sha256:a", &reqs, &other));
    }

    /// A tree of `site/` plus one file of `size` bytes.
    fn tree_with_file(size: usize) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o700);
        h.set_size(0);
        b.append_data(&mut h, "site/", &[][..]).expect("dir");
        let data: Vec<u8> = (0..size).map(|i| u8::try_from(i % 251).unwrap_or(0)).collect();
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o600);
        h.set_size(size as u64);
        b.append_data(&mut h, "site/big.so", &data[..]).expect("file");
        b.into_inner().expect("tar")
    }

    /// Streams `chunks` through `repack` as `build_layer` does; returns the body's items and
    /// the re-packer's result.
    async fn stream(chunks: Vec<std::io::Result<Bytes>>) -> (Vec<std::io::Result<Bytes>>, Result<(), String>) {
        let (tree_tx, tree_rx) = mpsc::channel(4);
        let (context_tx, context_rx) = mpsc::channel(4);
        let repacker = tokio::task::spawn_blocking(move || repack("base", tree_rx, context_tx));
        let feed = async move {
            for c in chunks {
                if tree_tx.send(c).await.is_err() {
                    break;
                }
            }
        };
        let ((), body) = tokio::join!(feed, context_body(context_rx).collect::<Vec<_>>());
        let (packed, _) = repacker.await.expect("re-packer");
        (body, packed)
    }

    #[tokio::test]
    async fn the_streamed_context_is_the_whole_context_and_a_cut_tree_never_ends_cleanly() {
        // Bigger than a chunk both ways, fed in odd-sized pieces.
        let tree = tree_with_file(CHUNK + 12345);
        let whole = context_from_tree("base", &tree[..], Vec::new()).expect("context");
        let pieces = |t: &[u8]| t.chunks(7000).map(|c| Ok(Bytes::copy_from_slice(c))).collect::<Vec<_>>();
        let (body, packed) = stream(pieces(&tree)).await;
        assert_eq!(packed, Ok(()));
        let got: Vec<u8> = body.into_iter().flat_map(|c| c.expect("chunk").to_vec()).collect();
        assert!(got == whole, "the streamed context differs from the whole one");

        // A download that fails between two entries, where a tar could end: the body still
        // ends in an error.
        let mut cut = pieces(&tree[..512]);
        cut.push(Err(std::io::Error::other("download failed")));
        let (body, packed) = stream(cut).await;
        assert!(packed.is_err());
        assert!(body.last().is_some_and(Result::is_err), "a cut tree must not end the body cleanly");
    }

    #[test]
    fn a_refused_tree_leaves_no_end_of_archive_marker() {
        let bad = tree(&[("site/", tar::EntryType::Directory, ""), ("other/x.py", tar::EntryType::Regular, "")]);
        let mut sink = Vec::new();
        assert!(context_from_tree("base", &bad[..], &mut sink).is_err());
        assert!(!sink.is_empty(), "what came before was written");
        assert!(!sink.ends_with(&[0u8; 1024]), "a refused tree must not look whole to the engine");
    }

    #[test]
    fn hostile_trees_are_refused_or_defanged() {
        let ok = tree(&[
            ("site/", tar::EntryType::Directory, ""),
            ("site/six.py", tar::EntryType::Regular, ""),
            ("site/link.py", tar::EntryType::Symlink, "six.py"),
            ("site/escape", tar::EntryType::Symlink, "../../etc/passwd"),
            ("site/abs", tar::EntryType::Symlink, "/etc/passwd"),
            ("site/fifo", tar::EntryType::Fifo, ""),
        ]);
        let ctx = context_from_tree("base", &ok[..], Vec::new()).expect("context");
        let got = names(&ctx);
        let paths: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(paths, ["Dockerfile", "site/", "site/six.py", "site/link.py"]);
        assert_eq!(got[2].1, 0o644, "readable by the code's uid");
        assert_eq!(got[1].1, 0o755);
        for bad in ["site/../../etc/x", "other/x.py"] {
            let t = tree(&[(bad, tar::EntryType::Regular, "")]);
            assert!(context_from_tree("base", &t[..], Vec::new()).is_err(), "{bad}");
        }
    }
}
