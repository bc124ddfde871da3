//! The sandbox image: built from `images/python`, which is embedded in the binary, under a
//! tag that hashes those files, so server and agent can never drift apart (docs/design.md D2, D7).

use std::collections::HashMap;
use std::process::Stdio;

use crate::docker::Engine;
use bollard::query_parameters::{BuildImageOptionsBuilder, CreateImageOptionsBuilder};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::AsyncBufReadExt;

use super::{Error, LABEL_IMAGE};

/// The agent, as baked into the image.
pub const AGENT_PY: &str = include_str!("../../images/python/agent.py");
/// The keeper that holds the agent across dropped exec streams (docs/design.md D12).
const KEEPER_PY: &str = include_str!("../../images/python/keeper.py");
/// The relay the attach execs into (images/python/relay.rs, compiled static by build.rs;
/// empty for a target it is not built for).
pub(crate) const RELAY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/relay"));
/// Its source: what the image's tag says of it, so the tag does not change with the compiler.
const RELAY_RS: &str = include_str!("../../images/python/relay.rs");
const DOCKERFILE: &str = include_str!("../../images/python/Dockerfile");
const BOOTSTRAP_SH: &str = include_str!("../../images/debootstrap-base.sh");

/// Files of the build context, in a fixed order.
const CONTEXT: [(&str, &[u8]); 4] = [
    ("Dockerfile", DOCKERFILE.as_bytes()),
    ("agent.py", AGENT_PY.as_bytes()),
    ("keeper.py", KEEPER_PY.as_bytes()),
    ("relay", RELAY),
];

/// Repository of the images we build.
pub const SANDBOX_REPO: &str = "pyberth-sandbox";
/// Repository of offline bases made by debootstrap.
pub const BASE_REPO: &str = "pyberth-base";

/// The default base of the sandbox image.
pub const DEFAULT_BASE: &str = "python:3.12-slim";
/// The default Debian release bootstrapped offline.
pub const DEFAULT_RELEASE: &str = "bookworm";

/// What an image is made from, as the operator set it: the settings answer these.
pub trait Recipe {
    /// `--image`: a pinned image used as is.
    fn pinned(&self) -> Option<&str>;
    /// The base image to build on.
    fn base_image(&self) -> &str;
    /// The Debian release bootstrapped offline when no registry answers.
    fn fallback_release(&self) -> &str;
    /// The Debian mirror of that bootstrap.
    fn debian_mirror(&self) -> &str;
    /// Where the machine-wide build lock lives (the state dir).
    fn lock_dir(&self) -> std::path::PathBuf;
}

impl<T: Recipe + ?Sized> Recipe for std::sync::Arc<T> {
    fn pinned(&self) -> Option<&str> {
        (**self).pinned()
    }
    fn base_image(&self) -> &str {
        (**self).base_image()
    }
    fn fallback_release(&self) -> &str {
        (**self).fallback_release()
    }
    fn debian_mirror(&self) -> &str {
        (**self).debian_mirror()
    }
    fn lock_dir(&self) -> std::path::PathBuf {
        (**self).lock_dir()
    }
}

/// Receives human-readable progress lines.
pub type Progress<'a> = &'a (dyn Fn(&str) + Send + Sync);

/// Tag of the sandbox image for this binary: a hash of the embedded build context.
pub fn sandbox_tag() -> String {
    let mut h = Sha256::new();
    for (name, body) in CONTEXT {
        // The relay by its source, and whether this server carries one.
        let body = if name == "relay" && !body.is_empty() { RELAY_RS.as_bytes() } else { body };
        h.update(name.as_bytes());
        h.update([0]);
        h.update((body.len() as u64).to_le_bytes());
        h.update(body);
    }
    let digest = h.finalize();
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{SANDBOX_REPO}:{hex}")
}

/// The sandbox image tag for a config: the content tag, plus a key of the base when it is not
/// the default one (each environment's image is its own).
pub fn tag_for(cfg: &(impl Recipe + ?Sized)) -> String {
    if cfg.base_image() == DEFAULT_BASE && cfg.fallback_release() == DEFAULT_RELEASE {
        return sandbox_tag();
    }
    let mut h = Sha256::new();
    h.update(cfg.base_image().as_bytes());
    h.update([0]);
    h.update(cfg.fallback_release().as_bytes());
    let key: String = h.finalize().iter().take(4).map(|b| format!("{b:02x}")).collect();
    format!("{}-{key}", sandbox_tag())
}

/// Whether an image exists locally.
pub async fn exists(docker: &dyn Engine, name: &str) -> Result<bool, Error> {
    match docker.inspect_image(name).await {
        Ok(_) => Ok(true),
        Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The image sessions run: `--image` as given, or the sandbox image, built when absent.
pub async fn ensure(
    docker: &dyn Engine,
    cfg: &(impl Recipe + ?Sized),
    progress: Progress<'_>,
) -> Result<String, Error> {
    if let Some(image) = cfg.pinned() {
        if exists(docker, image).await? {
            return Ok(image.to_owned());
        }
        return Err(Error::MissingImage(image.to_owned()));
    }
    let tag = tag_for(cfg);
    if exists(docker, &tag).await? {
        return Ok(tag);
    }
    // Several servers (or parallel tests) may start on a fresh machine at once: one builds,
    // the others wait for it and then find the image.
    let _lock = build_lock(&cfg.lock_dir()).await?;
    if !exists(docker, &tag).await? {
        build(docker, cfg, &tag, progress).await?;
    }
    Ok(tag)
}

/// Takes the machine-wide image build lock, waiting for another builder if needed.
async fn build_lock(dir: &std::path::Path) -> Result<std::fs::File, Error> {
    let path = dir.join("image-build.lock");
    let io = |source| Error::Io { context: format!("cannot take the build lock {}", path.display()), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    let file = crate::state_dir::open_lock(&path).map_err(io)?;
    tokio::task::spawn_blocking(move || file.lock().map(|()| file))
        .await
        .map_err(|e| io(std::io::Error::other(e)))?
        .map_err(io)
}

/// Builds the sandbox image under `tag`, finding or making a base first.
pub async fn build(
    docker: &dyn Engine,
    cfg: &(impl Recipe + ?Sized),
    tag: &str,
    progress: Progress<'_>,
) -> Result<(), Error> {
    let base = resolve_base(docker, cfg, progress).await?;
    progress(&format!("building {tag} on {base}"));
    let context =
        context_tar().map_err(|source| Error::Io { context: "cannot pack the build context".into(), source })?;
    let args = HashMap::from([("BASE", base.as_str())]);
    let opts = BuildImageOptionsBuilder::default()
        .dockerfile("Dockerfile")
        .t(tag)
        .buildargs(&args)
        .rm(true)
        .forcerm(true)
        .build();
    let mut stream = docker.build_image(opts, None, Some(crate::docker::body_full(context.into())));
    while let Some(item) = stream.next().await {
        match item {
            Ok(info) => {
                if let Some(line) = info.stream.as_deref().map(str::trim_end).filter(|l| !l.is_empty()) {
                    progress(line);
                }
                if let Some(detail) = info.error_detail.and_then(|d| d.message) {
                    return Err(Error::Build(detail));
                }
            }
            Err(bollard::errors::Error::DockerStreamError { error }) => {
                return Err(Error::Build(error));
            }
            Err(e) => return Err(e.into()),
        }
    }
    if !exists(docker, tag).await? {
        return Err(Error::Build(format!("the engine reported no error but {tag} does not exist")));
    }
    progress(&format!("built {tag}"));
    Ok(())
}

fn context_tar() -> std::io::Result<Vec<u8>> {
    let mut ar = tar::Builder::new(Vec::new());
    for (name, body) in CONTEXT {
        let mut h = tar::Header::new_gnu();
        h.set_size(body.len() as u64);
        h.set_mode(if name == "relay" { 0o755 } else { 0o644 });
        h.set_mtime(0);
        h.set_cksum();
        ar.append_data(&mut h, name, body)?;
    }
    ar.into_inner()
}

/// The base to build on: the configured image if present or pullable, else the offline
/// Debian base, bootstrapped if needed.
async fn resolve_base(
    docker: &dyn Engine,
    cfg: &(impl Recipe + ?Sized),
    progress: Progress<'_>,
) -> Result<String, Error> {
    let base = cfg.base_image();
    if exists(docker, base).await? {
        return Ok(base.to_owned());
    }
    progress(&format!("pulling {base}"));
    let pull_error = match pull(docker, base).await {
        Ok(()) => return Ok(base.to_owned()),
        Err(e) => e,
    };
    let fallback = format!("{BASE_REPO}:{}", cfg.fallback_release());
    progress(&format!("cannot pull {base} ({pull_error}); using the offline base {fallback}"));
    if exists(docker, &fallback).await? {
        return Ok(fallback);
    }
    bootstrap(docker, cfg, &fallback, progress).await.map_err(|e| {
        Error::NoBaseImage(format!(
            "no base image: cannot pull {base} ({pull_error}), and cannot bootstrap {fallback} offline ({e}). \
             Make a registry reachable, or install debootstrap and run `pyberth image build` as root, \
             or load an image with Python 3 and pass it as --base-image"
        ))
    })?;
    Ok(fallback)
}

async fn pull(docker: &dyn Engine, image: &str) -> Result<(), Error> {
    let opts = CreateImageOptionsBuilder::default().from_image(image).build();
    let mut stream = docker.create_image(Some(opts), None, None);
    while let Some(item) = stream.next().await {
        let info = item?;
        if let Some(detail) = info.error_detail.and_then(|d| d.message) {
            return Err(Error::Build(detail));
        }
    }
    Ok(())
}

/// Runs images/debootstrap-base.sh and imports its root filesystem as `tag`.
async fn bootstrap(
    docker: &dyn Engine,
    cfg: &(impl Recipe + ?Sized),
    tag: &str,
    progress: Progress<'_>,
) -> Result<(), Error> {
    let io = |context: &str| {
        let context = context.to_owned();
        move |source| Error::Io { context, source }
    };
    // A new private directory of a random name in a shared temp dir: never one planted there
    // in advance (with a symlink in it to lead the rootfs write elsewhere), never removed if so.
    let suffix = crate::state_dir::random_id().map_err(io("no random name for a temporary directory"))?;
    let dir = std::env::temp_dir().join(format!("pyberth-bootstrap-{}-{suffix}", std::process::id()));
    {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(io("cannot create a temporary directory"))?;
    }
    let rootfs = dir.join("rootfs.tar");
    let result = async {
        use std::os::unix::fs::OpenOptionsExt as _;
        let out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(crate::state_dir::no_follow())
            .open(&rootfs)
            .map_err(io("cannot create the rootfs file"))?;
        progress(&format!(
            "bootstrapping Debian {} from {} (a few minutes)",
            cfg.fallback_release(),
            cfg.debian_mirror()
        ));
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(BOOTSTRAP_SH)
            .arg("debootstrap-base")
            .arg(cfg.fallback_release())
            .arg(cfg.debian_mirror())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(io("cannot run sh"))?;
        let mut last = String::new();
        if let Some(stderr) = child.stderr.take() {
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                progress(&line);
                last = line;
            }
        }
        let status = child.wait().await.map_err(io("cannot wait for the bootstrap script"))?;
        if !status.success() {
            let why = last.trim_start_matches("debootstrap-base: ");
            return Err(Error::Build(format!("debootstrap failed: {why}")));
        }
        progress(&format!("importing {tag}"));
        let file = tokio::fs::File::open(&rootfs).await.map_err(io("cannot reopen the rootfs file"))?;
        let body = crate::docker::body_try_stream(tokio_util::io::ReaderStream::new(file));
        let (repo, release) = tag.split_once(':').unwrap_or((tag, "latest"));
        let opts = CreateImageOptionsBuilder::default()
            .from_src("-")
            .repo(repo)
            .tag(release)
            .changes(vec![format!("LABEL {LABEL_IMAGE}=base")])
            .build();
        let mut stream = docker.create_image(Some(opts), Some(body), None);
        while let Some(item) = stream.next().await {
            item?;
        }
        Ok(())
    }
    .await;
    let _ = tokio::fs::remove_dir_all(&dir).await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_is_stable_and_hashes_the_context() {
        let t = sandbox_tag();
        assert_eq!(t, sandbox_tag());
        assert!(t.starts_with("pyberth-sandbox:"));
        assert_eq!(t.len(), "pyberth-sandbox:".len() + 16);
    }

    #[test]
    fn context_holds_the_dockerfile_and_the_agent() {
        let tar = context_tar().expect("tar");
        let mut ar = tar::Archive::new(&tar[..]);
        let names: Vec<String> = ar
            .entries()
            .expect("entries")
            .map(|e| e.expect("entry").path().expect("path").display().to_string())
            .collect();
        assert_eq!(names, ["Dockerfile", "agent.py", "keeper.py", "relay"]);
    }
}
