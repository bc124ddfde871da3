//! Dependency layers (docs/design.md D6): a requirement set installed once, by a short-lived
//! installer container that alone has network access, re-packed as hostile input and kept as
//! one directory of the layer store (`store.rs`), a volume every session mounts read-only. A
//! session asking for a set gets that directory put on its `sys.path` by its agent: no image
//! build, no container create, no copy. No container ever starts from a root filesystem that
//! untrusted code shaped (docs/threat-model.md §4).
//!
//! Why this file passes 500 lines: the key, the store listing and `ensure` read together, and
//! their tests take about 160 lines; the installer, the store, the cache and the tree are apart.
//!
//! The installer container lives in `installer.rs`, the hostile-tree re-pack in `tree.rs`, the
//! store volume and its writers in `store.rs`; this file keys, stores, lists and prunes sets.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use crate::docker::{Engine, EngineRef};
use bollard::query_parameters::{ListImagesOptionsBuilder, RemoveImageOptionsBuilder};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

mod cache;
mod explain;
mod installer;
mod job;
mod markers;
mod shared;
pub mod store;
mod tree;

pub use cache::{LayerInfo, list_by_use, over, prune, prune_old_images};
pub use installer::LABEL_INSTALLER;
pub use markers::evaluate_markers;
pub use shared::LABEL_INSTALLER_VOLUME;
pub use store::{STORE_DIR, Store};

use crate::config::SandboxConfig;
use crate::docker::container::Owner;
use crate::docker::image::Progress;
use crate::docker::{Error as DockerError, LABEL_IMAGE};

/// Repository of the layer images of pyberth before the store; `layers prune` removes them.
pub const LAYER_REPO: &str = "pyberth-layer";
/// Largest installed tree accepted from an installer.
const MAX_TREE: u64 = 4 << 30;

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

/// The key a set is stored under: [`layer_key`], and, when the install may build some of
/// its packages from source (`allow_sdist`), which ones. A set built from source is another
/// set: an environment allowing only wheels never gets it from the store.
fn set_key(base_image_id: &str, requirements: &[String], index: &IndexSettings, sdists: &[String]) -> String {
    let key = layer_key(base_image_id, requirements, index);
    if sdists.is_empty() {
        return key;
    }
    let mut h = Sha256::new();
    for part in [key.as_str(), "sdist", &sdists.join("\n")] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().iter().take(10).map(|b| format!("{b:02x}")).collect()
}

/// A set's metadata, kept root-only in its directory (`meta.json`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Meta {
    /// Content key ([`layer_key`]).
    pub key: String,
    /// Canonical requirements.
    pub requirements: Vec<String>,
    /// The image it was installed for.
    pub base: String,
    /// Bytes of its files.
    pub size: u64,
    /// Creation time, seconds since the epoch.
    pub created: i64,
}

/// What a layer is installed from, and where it goes.
struct LayerSpec<'a> {
    /// The image it is installed with.
    base: &'a str,
    /// The canonical requirement set it holds.
    requirements: &'a [String],
    /// Its content key.
    key: &'a str,
    store: &'a Store,
    owner: &'a Owner,
    /// Gives the installer its network: only the index hosts, through the egress proxy.
    egress: &'a crate::egress::Manager,
    /// The hardening of the environment's sandboxes, which the installer's container keeps.
    sandbox: &'a crate::docker::container::Spec,
}

impl crate::egress::IndexHosts for IndexSettings {
    /// The hosts an installer needs: those of the index URLs (PyPI's two when none is set).
    fn index_hosts(&self) -> Vec<String> {
        let urls: Vec<&String> = self.index_url.iter().chain(&self.extra_index_url).collect();
        if self.index_url.is_none() {
            let mut hosts = vec!["pypi.org".to_owned(), "files.pythonhosted.org".to_owned()];
            hosts.extend(urls.iter().filter_map(|u| url_host(u)));
            return hosts;
        }
        urls.iter().filter_map(|u| url_host(u)).collect()
    }
}

/// `host` or `host:port` of an http(s) URL, as an allow-list entry.
fn url_host(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit('@').next()?;
    let (host, port) = crate::egress::policy::split_host_port(authority).ok()?;
    let default = if scheme.eq_ignore_ascii_case("https") { 443 } else { 80 };
    let rule = match port {
        Some(p) if p != default => format!("{host}:{p}"),
        _ => host,
    };
    crate::egress::policy::Rule::parse(&rule).ok().map(|r| r.text().to_owned())
}

/// A layer ready for use. Serializable, for records of a session's layers (a session adopted
/// by a later server attaches them again to every new interpreter).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Layer {
    /// Content key.
    pub key: String,
    /// Where sessions find its packages (`STORE_DIR/<name>/site`).
    pub site: String,
    /// Whether it already existed (no installer ran).
    pub cached: bool,
}

/// Logs how long one step of a first install took (`RUST_LOG=pyberth::layers=debug`), and
/// starts the next step's clock: the breakdown docs/design.md D14 is measured with.
pub(crate) fn lap(step: &str, t: &mut Instant) {
    tracing::debug!(target: "pyberth::layers", step, ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX), "install step");
    *t = Instant::now();
}

/// Removals handed off by installs, awaited by [`settle`].
static CLEANUPS: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>> = std::sync::Mutex::new(Vec::new());

/// Removes the volume `name` in a task of its own: the install answers without waiting. The
/// engine finishes a removal it started even if this process stops; a volume it never got
/// to is removed by the final sweep of this instance's objects, or the next server's.
fn clean_up_later(docker: &EngineRef, name: &str) {
    let (docker, name) = (docker.clone(), name.to_owned());
    let task = tokio::spawn(async move { crate::docker::container::remove_volume(&docker, &name).await });
    let mut pending = CLEANUPS.lock().unwrap_or_else(|e| e.into_inner());
    pending.retain(|t| !t.is_finished());
    pending.push(task);
}

/// Waits for the removals installs handed off (at shutdown, before the final sweep).
pub async fn settle() {
    let pending: Vec<_> = std::mem::take(&mut *CLEANUPS.lock().unwrap_or_else(|e| e.into_inner()));
    for task in pending {
        let _ = task.await;
    }
}

/// The sets this process knows the store holds, by directory name: read once from the store,
/// then kept as sets are stored and pruned. A set another server stored since is not known
/// here; installing it again ends with the rename finding it there ([`store::Stored::Exists`]).
/// With each set's size, so an install prunes (which reads the store) only when over the cap.
static KNOWN: std::sync::Mutex<Option<(String, HashMap<String, u64>)>> = std::sync::Mutex::new(None);

fn known(store: &Store, dir: &str) -> Option<bool> {
    let k = KNOWN.lock().ok()?;
    let (volume, dirs) = k.as_ref()?;
    (volume == &store.volume).then(|| dirs.contains_key(dir))
}

/// The bytes of the sets this process knows of.
fn known_bytes(store: &Store) -> Option<u64> {
    let k = KNOWN.lock().ok()?;
    let (volume, dirs) = k.as_ref()?;
    (volume == &store.volume).then(|| dirs.values().sum())
}

fn set_known(store: &Store, dirs: HashMap<String, u64>) {
    if let Ok(mut k) = KNOWN.lock() {
        *k = Some((store.volume.clone(), dirs));
    }
}

fn mark_known(store: &Store, dir: &str, present: Option<u64>) {
    if let Ok(mut k) = KNOWN.lock()
        && let Some((volume, dirs)) = k.as_mut()
        && volume == &store.volume
    {
        if let Some(size) = present {
            dirs.insert(dir.to_owned(), size);
        } else {
            dirs.remove(dir);
        }
    }
}

/// Reads the store's listing now if this process has not yet, so the first ask for a cached
/// set is not the one that waits for it (one reader container, `image` to run it).
pub async fn preload(docker: &dyn Engine, image: &str, owner: &Owner) {
    let read = async {
        let store = Store::get(docker).await?;
        if known(&store, "").is_none() {
            set_known(&store, sizes(store::index(docker, &store, image, owner).await?));
        }
        Ok::<(), Error>(())
    };
    if let Err(e) = read.await {
        tracing::debug!(error = %e, "cannot read the layer store's listing yet");
    }
}

/// Forgets that the set at `site` is in the store (a session found it gone: another server
/// pruned it), so the next ask installs it again.
pub fn forget(site: &str) {
    let dir = site.trim_start_matches(STORE_DIR).trim_start_matches('/').trim_end_matches("/site");
    if let Ok(mut k) = KNOWN.lock()
        && let Some((_, dirs)) = k.as_mut()
    {
        dirs.remove(dir);
    }
}

/// The layer for `requirements` on `base`, installed if absent.
#[allow(clippy::too_many_arguments)] // what a set is, where it goes, and the installer network
pub async fn ensure(
    docker: &EngineRef,
    blueprint: &crate::sandbox::Blueprint,
    owner: &Owner,
    base: &str,
    requirements: &[String],
    index: &IndexSettings,
    egress: &crate::egress::Manager,
    progress: Progress<'_>,
) -> Result<Layer, Error> {
    let cfg = &*blueprint.cfg;
    let mut t = Instant::now();
    let store = Store::get(docker).await?;
    let base_id = docker.inspect_image(base).await?.id.unwrap_or_else(|| base.to_owned());
    let key = set_key(&base_id, requirements, index, &installer::sdist_allowed(cfg, requirements));
    let dir = store.dir_name(&key);
    lap("ensure: store and image", &mut t);
    let present = match known(&store, &dir) {
        Some(p) => p,
        None => {
            let dirs = sizes(store::index(docker, &store, base, owner).await?);
            let p = dirs.contains_key(&dir);
            set_known(&store, dirs);
            p
        }
    };
    let site = store.site_path(&key);
    lap("ensure: store listing", &mut t);
    if present {
        return Ok(Layer { key, site, cached: true });
    }
    progress(&format!("installing {} into a new layer", requirements.join(" ")));
    let started = Instant::now();
    let spec = LayerSpec { base, requirements, key: &key, store: &store, owner, egress, sandbox: &blueprint.spec };
    // `build_layer` records it as known, with its size.
    installer::install(docker, cfg, owner, &spec, index, progress).await?;
    progress(&format!("layer {key} ready in {:.1} s", started.elapsed().as_secs_f64()));
    Ok(Layer { key, site, cached: false })
}

/// Each set's size, from the store's listing.
fn sizes(index: HashMap<String, Option<serde_json::Value>>) -> HashMap<String, u64> {
    index
        .into_iter()
        .map(|(dir, meta)| (dir, meta.and_then(|m| m.get("size").and_then(serde_json::Value::as_u64)).unwrap_or(0)))
        .collect()
}

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Stores the tree of the stopped installer `installer` as the set of `spec`. The tree
/// streams through a re-packer on a blocking thread (the `tar` crate is synchronous) into the
/// store's upload; bounded channels join the three, so neither memory nor a runtime worker
/// holds it. Two servers storing one set at once: the first rename wins, the other copy goes.
async fn build_layer(
    docker: &dyn Engine,
    installer: &str,
    spec: &LayerSpec<'_>,
    writer: &store::Writer,
    after_download: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    let (tree_tx, tree_rx) = mpsc::channel(4);
    let (context_tx, context_rx) = mpsc::channel(4);
    let meta = Meta {
        key: spec.key.to_owned(),
        requirements: spec.requirements.to_vec(),
        base: spec.base.to_owned(),
        size: 0,
        created: now_s(),
    };
    let tmp_name = writer.tmp.clone();
    // Awaited below; if this future is dropped instead, both its channels close and it ends.
    let repacker = tokio::task::spawn_blocking(move || tree::repack(&tmp_name, meta, tree_rx, context_tx));
    let body = tree::context_body(context_rx).boxed();
    let mut t = Instant::now();
    let download = async {
        let downloaded = tree::download_tree(docker, installer, tree_tx).await;
        after_download.await;
        downloaded
    };
    let (downloaded, stored) = tokio::join!(download, writer.put(docker, body));
    lap("build_layer: download, re-pack, store", &mut t);
    let (packed, upload_gone) =
        repacker.await.map_err(|e| Error::Failed(format!("install failed: the re-packer stopped: {e}")))?;
    // The first failure is the cause; the others follow from the channels it closed.
    downloaded?;
    match packed {
        Ok(size) => {
            stored?;
            mark_known(spec.store, &spec.store.dir_name(spec.key), Some(size));
            Ok(())
        }
        Err(_) if upload_gone && stored.is_err() => stored.map(|_| ()),
        Err(e) => Err(Error::Failed(format!("install failed: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::tree::*;
    use super::*;
    use crate::egress::IndexHosts as _;

    #[test]
    fn installer_hosts_come_from_the_index_urls() {
        let pypi = IndexSettings::default();
        assert_eq!(pypi.index_hosts(), ["pypi.org", "files.pythonhosted.org"]);
        let own = IndexSettings {
            index_url: Some("https://user:pw@Index.Example.com:8443/simple/".into()),
            extra_index_url: Some("http://mirror.example.org/simple".into()),
            ca_bundle: None,
        };
        assert_eq!(own.index_hosts(), ["index.example.com:8443", "mirror.example.org"]);
    }

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

    fn meta() -> Meta {
        Meta { key: "k".into(), requirements: vec!["six".into()], base: "b".into(), size: 0, created: 1 }
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
        assert_eq!(set_key("sha256:a", &reqs, &idx, &[]), k, "wheels only: the key as before");
        assert_ne!(set_key("sha256:a", &reqs, &idx, &["attrs".to_owned()]), k, "built from source: another set");
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
        let repacker = tokio::task::spawn_blocking(move || tree::repack(".tmp-x", meta(), tree_rx, context_tx));
        let feed = async move {
            for c in chunks {
                if tree_tx.send(c).await.is_err() {
                    break;
                }
            }
        };
        let ((), body) = tokio::join!(feed, tree::context_body(context_rx).collect::<Vec<_>>());
        let (packed, _) = repacker.await.expect("re-packer");
        (body, packed.map(|_| ()))
    }

    #[tokio::test]
    async fn the_streamed_context_is_the_whole_context_and_a_cut_tree_never_ends_cleanly() {
        // Bigger than a chunk both ways, fed in odd-sized pieces.
        let tree = tree_with_file(crate::docker::chunks::CHUNK + 12345);
        let whole = context_from_tree(".tmp-x", &mut meta(), &tree[..], Vec::new()).expect("context");
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
        assert!(context_from_tree(".tmp-x", &mut meta(), &bad[..], &mut sink).is_err());
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
            // A hard link names its target from the archive's root: into another set, dropped.
            ("site/hard", tar::EntryType::Link, "site/../other/site/x.py"),
        ]);
        let ctx = context_from_tree(".tmp-x", &mut meta(), &ok[..], Vec::new()).expect("context");
        let got = names(&ctx);
        let paths: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(paths, [".tmp-x", ".tmp-x/site/", ".tmp-x/site/six.py", ".tmp-x/site/link.py", ".tmp-x/meta.json"]);
        assert_eq!(got[2].1, 0o644, "readable by the code's uid");
        assert_eq!(got[1].1, 0o755);
        assert_eq!(got[4].1, 0o600, "the metadata is root's alone");
        for bad in ["site/../../etc/x", "other/x.py"] {
            let t = tree(&[(bad, tar::EntryType::Regular, "")]);
            assert!(context_from_tree(".tmp-x", &mut meta(), &t[..], Vec::new()).is_err(), "{bad}");
        }
    }
}
