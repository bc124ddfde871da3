//! Dependency layers (docs/design.md D6): a requirement set installed once, by a short-lived
//! installer container that alone has network access, and kept as an image built on our own
//! sandbox image that adds only the installed tree under `/opt/pyberth/site`. Session
//! containers are never committed: no container ever starts from a root filesystem that
//! untrusted code shaped (docs/threat-model.md §4).
//!
//! The installer container lives in `installer.rs`, the hostile-tree re-pack in `tree.rs`;
//! this file keys, stores, lists and prunes layers.

use std::collections::HashMap;
use std::time::Instant;

use bollard::Docker;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    BuildImageOptionsBuilder, CreateContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
    ListImagesOptionsBuilder, RemoveImageOptionsBuilder, UploadToContainerOptionsBuilder,
};
use futures::{StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

mod installer;
mod tree;

pub use installer::evaluate_markers;
pub use tree::safe_relative;

use super::container::{self, Owner};
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
    installer::install(docker, cfg, owner, &LayerSpec { base, requirements, tag: &tag }, index, progress).await?;
    progress(&format!("layer {tag} ready in {:.1} s", started.elapsed().as_secs_f64()));
    Ok(Layer { tag, cached: false })
}

/// Builds the layer from the stopped installer `installer`. Its tree streams through a
/// re-packer on a blocking thread (the `tar` crate is synchronous) into the build's request
/// body; bounded channels join the three, so neither memory nor a runtime worker holds it.
async fn build_layer(docker: &Docker, installer: &str, spec: &LayerSpec<'_>) -> Result<(), Error> {
    let (tree_tx, tree_rx) = mpsc::channel(4);
    let (context_tx, context_rx) = mpsc::channel(4);
    let base = spec.base.to_owned();
    // Awaited below; if this future is dropped instead, both its channels close and it ends.
    let repacker = tokio::task::spawn_blocking(move || tree::repack(&base, tree_rx, context_tx));
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
        let body = bollard::body_try_stream(tree::context_body(context_rx));
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
    let (downloaded, built) = tokio::join!(tree::download_tree(docker, installer, tree_tx), build);
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
    let name = format!("pyberth-{}-copy-{}", owner.instance, installer::next_serial());
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
    use super::tree::*;
    use super::*;
    use bytes::Bytes;

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
        let repacker = tokio::task::spawn_blocking(move || tree::repack("base", tree_rx, context_tx));
        let feed = async move {
            for c in chunks {
                if tree_tx.send(c).await.is_err() {
                    break;
                }
            }
        };
        let ((), body) = tokio::join!(feed, tree::context_body(context_rx).collect::<Vec<_>>());
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
