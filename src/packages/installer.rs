//! The installer: a short-lived container that alone has network access, installs a
//! requirement set into a volume of its own, and hands the stopped container to whoever
//! stores the tree. Also the marker evaluator, which runs the same image without network.
//! Both run through [`run_job`].
//!
//! Installs use uv where it can be had, pip otherwise (docs/design.md, "The installer"):
//! - **Wheels only by default.** Building an sdist runs the package's own code in a container
//!   with the network; `--allow-sdist` (or an environment's `allow_sdist`) opts a package in.
//! - **A shared volume per base image and index** (`pyberth-installer-<key>`), mounted only by
//!   installers at [`SHARED`]: `uv/` holds the uv fetched from the index (wheel only, no
//!   dependencies) by the first install that needs it; `cache/` (mode 0700) is the download
//!   cache, bounded by `--installer-cache-mb`. Wheels-only installs mount it read-write and run
//!   as the uid recorded on the volume, so its files stay theirs: they run no package code.
//!   Installs that allow sdists run arbitrary build code, so they get a uid of their own, the
//!   volume read-only (uv readable, the cache not: 0700 of another uid) and no cache at all:
//!   build code can neither poison the cache for other sets nor read which packages others
//!   installed.

use std::collections::HashMap;
use std::time::Duration;

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, Mount, MountType, VolumeCreateRequest};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, ListVolumesOptionsBuilder,
    UploadToContainerOptionsBuilder,
};
use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::{Error, IndexSettings, LayerSpec};
use crate::config::SandboxConfig;
use crate::docker::LABEL_MANAGED;
use crate::docker::container::{self, Owner, WORKSPACE};
use crate::docker::identity::{self, LABEL_UID};
use crate::docker::image::Progress;

/// Where installers mount the shared volume. An image path that is mode 1777 in every base
/// (Debian's, the official Python images'): a new volume takes the mode of the path it is
/// first mounted at, so the installers' uid can write to it with no root step.
const SHARED: &str = "/var/tmp";
/// Label on the shared installer volumes.
const LABEL_INSTALLER_VOLUME: &str = "pyberth.installer-volume";
/// Label holding the id of the image a shared installer volume serves.
const LABEL_BASE_ID: &str = "pyberth.base-id";
/// Label holding the image tag an installer volume serves.
const LABEL_BASE: &str = "pyberth.base";

/// The install, as a POSIX shell script: its arguments are the requirements, its settings
/// come in `PB_*` variables (set by [`install_as`]), the index settings in pip's and uv's own.
const INSTALL_SH: &str = r#"set -u
umask 022
py=$(command -v python3) || { echo "pyberth: the image has no python3"; exit 3; }
T=/var/tmp
pipopts="--no-input --disable-pip-version-check --progress-bar off --retries 1 --timeout 30"
uv=""
why=""
if [ "$PB_UV" = none ]; then
  why="uv is turned off (--installer-uv none)"
elif [ "$PB_SHARED" != 1 ]; then
  why="$PB_SHARED_WHY"
elif [ -x "$T/uv/bin/uv" ]; then
  uv="$T/uv/bin/uv"
elif [ "$PB_WRITE" != 1 ]; then
  why="no wheels-only install has fetched uv on this base and index yet"
elif [ ! -w "$T" ]; then
  why="the installer's tool volume is not writable"
elif [ -f "$T/uv-failed" ] && [ -z "$(find "$T/uv-failed" -mmin +60 2>/dev/null)" ]; then
  why="fetching $PB_UV from the index failed less than an hour ago: $(cat "$T/uv-failed")"
else
  echo "pyberth: fetching $PB_UV from the index into the installer's tool volume (once per base image and index)"
  # Unique per installer (each container's shell has the same pid); readable by all uids.
  tmp=$(mktemp -d "$T/uv.tmp.XXXXXXXX") && chmod 755 "$tmp" || tmp="$T/uv.tmp.none"
  if "$py" -m pip install $pipopts --no-cache-dir --only-binary :all: --no-deps --target "$tmp" -- "$PB_UV" >"$tmp.log" 2>&1 \
    && "$tmp/bin/uv" --version >/dev/null 2>&1; then
    # Atomic; another installer may have won the race, and then its uv is there.
    "$py" -c 'import os, sys; os.rename(sys.argv[1], sys.argv[2])' "$tmp" "$T/uv" 2>/dev/null || rm -rf "$tmp"
    rm -f "$T/uv-failed"
  else
    rm -rf "$tmp"
    grep -v '^ *$' "$tmp.log" | tail -n 2 | cut -c 1-200 | tr '\n' ' ' >"$T/uv-failed"
    why="fetching $PB_UV from the index failed: $(cat "$T/uv-failed")"
  fi
  rm -f "$tmp.log"
  if [ -x "$T/uv/bin/uv" ]; then uv="$T/uv/bin/uv"; fi
fi
cache=""
if [ "$PB_WRITE" = 1 ] && [ "$PB_CACHE_KB" -gt 0 ] && mkdir -p -m 700 "$T/cache" 2>/dev/null && [ -w "$T/cache" ]; then
  cache="$T/cache"
fi
only=""
if [ "$PB_ONLY_BINARY" = 1 ]; then only="--only-binary :all:"; fi
if [ -n "$uv" ]; then
  echo "pyberth: installing with $("$uv" --version)"
  if [ -n "$cache" ]; then c="--cache-dir $cache/uv"; else c="--no-cache"; fi
  "$uv" pip install --no-config --color never --python "$py" --link-mode copy --compile-bytecode $c $only --target /workspace/site -- "$@"
  rc=$?
  rm -f /workspace/site/.lock
else
  echo "pyberth: installing with pip, not uv: $why"
  if [ -n "$cache" ]; then c="--cache-dir $cache/pip"; else c="--no-cache-dir"; fi
  "$py" -m pip install $pipopts $c $only --target /workspace/site -- "$@"
  rc=$?
fi
if [ "$rc" -eq 0 ] && [ -n "$cache" ]; then
  kb=$(du -sk "$cache" 2>/dev/null | cut -f1)
  if [ "${kb:-0}" -gt "$PB_CACHE_KB" ]; then
    echo "pyberth: the download cache holds $((kb / 1024)) MiB, over its bound of $((PB_CACHE_KB / 1024)) MiB: emptied"
    if [ -n "$uv" ]; then "$uv" cache clean --cache-dir "$cache/uv" >/dev/null 2>&1; fi
    rm -rf "$cache/pip"
  fi
fi
exit "$rc"
"#;

/// The installer's shared volume: its name and the uid wheels-only installs run as.
struct Shared {
    name: String,
    uid: u32,
}

/// The requirements of `requirements` the settings allow to build from source (`:all:`
/// allows every one).
pub(super) fn sdist_allowed(cfg: &SandboxConfig, requirements: &[String]) -> Vec<String> {
    let all = cfg.allow_sdist.iter().any(|p| p == ":all:");
    let allowed: Vec<String> = cfg.allow_sdist.iter().map(|p| crate::deps::normalize_name(p)).collect();
    requirements
        .iter()
        .filter_map(|r| crate::deps::parse(r).ok())
        .filter(|r| all || allowed.contains(&r.name))
        .map(|r| r.name)
        .collect()
}

/// Runs the installer container, then builds the layer from the tree it installed.
pub(super) async fn install(
    docker: &Docker,
    cfg: &SandboxConfig,
    owner: &Owner,
    spec: &LayerSpec<'_>,
    index: &IndexSettings,
    progress: Progress<'_>,
) -> Result<(), Error> {
    let mut t = std::time::Instant::now();
    let name = format!("pyberth-{}-install-{}", owner.instance, next_serial());
    let sdists = sdist_allowed(cfg, spec.requirements);
    let shared = match shared_volume(docker, cfg, spec.base, index, sdists.is_empty()).await {
        Ok(s) => s,
        Err(e) => {
            // Not worth failing the install for: it runs as before, with pip and no cache.
            tracing::warn!(error = %e, "the installer's shared volume is unavailable");
            None
        }
    };
    super::lap("install: shared volume", &mut t);
    let set = spec.requirements.join(" ");
    if sdists.is_empty() {
        progress(&format!("installer for {set}: wheels only"));
    } else {
        progress(&format!(
            "installer for {set}: building from source is allowed for {} (allow_sdist), so without the shared \
             download cache",
            sdists.join(", ")
        ));
    }
    match (&shared, sdists.is_empty()) {
        // Wheels only: pip or uv alone run, as the volume's uid, which owns its files.
        (Some(s), true) => install_as(docker, cfg, owner, spec, index, progress, &name, s.uid, Some(s)).await,
        // Build code may run: a uid of its own, as every sandbox has (per-uid limits shared
        // with no session or host user), and the shared volume only to read uv from.
        _ => {
            let uid = identity::pick(docker, cfg.uid_range).await?;
            let result = install_as(docker, cfg, owner, spec, index, progress, &name, uid, shared.as_ref()).await;
            identity::release(uid);
            result
        }
    }
}

/// [`install`] with the installer's name, uid and shared volume.
#[allow(clippy::too_many_arguments)] // install's arguments, plus the three it chose
async fn install_as(
    docker: &Docker,
    cfg: &SandboxConfig,
    owner: &Owner,
    spec: &LayerSpec<'_>,
    index: &IndexSettings,
    progress: Progress<'_>,
    name: &str,
    uid: u32,
    shared: Option<&Shared>,
) -> Result<(), Error> {
    let mut t = std::time::Instant::now();
    let wheels_only = sdist_allowed(cfg, spec.requirements).is_empty();
    let mut labels = labels(owner, uid);
    labels.insert("pyberth.installer".to_owned(), "1".to_owned());
    docker
        .create_volume(VolumeCreateRequest {
            name: Some(name.to_owned()),
            labels: Some(labels.clone()),
            ..Default::default()
        })
        .await?;
    super::lap("install: create volume", &mut t);
    let result = async {
        let mut mounts = vec![Mount {
            target: Some(WORKSPACE.into()),
            source: Some(name.to_owned()),
            typ: Some(MountType::VOLUME),
            ..Default::default()
        }];
        if let Some(s) = shared {
            mounts.push(Mount {
                target: Some(SHARED.into()),
                source: Some(s.name.clone()),
                typ: Some(MountType::VOLUME),
                read_only: Some(!wheels_only),
                ..Default::default()
            });
        }
        let flag = |b: bool| if b { "1" } else { "0" };
        let mut env: Vec<String> = vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            "HOME=/tmp".into(),
            "USER=sandbox".into(),
            "LOGNAME=sandbox".into(),
            "LANG=C.UTF-8".into(),
            "PIP_NO_WARN_SCRIPT_LOCATION=1".into(),
            "UV_NO_PROGRESS=1".into(),
            "UV_PYTHON_DOWNLOADS=never".into(),
            "UV_HTTP_TIMEOUT=30".into(),
            "UV_HTTP_RETRIES=1".into(),
            format!("PB_UV={}", cfg.installer_uv),
            format!("PB_SHARED={}", flag(shared.is_some())),
            format!(
                "PB_SHARED_WHY={}",
                if wheels_only {
                    "the installer's tool volume is unavailable (see the server's log)"
                } else {
                    "no wheels-only install has fetched uv on this base and index yet"
                }
            ),
            format!("PB_WRITE={}", flag(shared.is_some() && wheels_only)),
            format!("PB_CACHE_KB={}", cfg.installer_cache_mb.saturating_mul(1024)),
            format!("PB_ONLY_BINARY={}", flag(wheels_only)),
        ];
        // Both tools read the index settings from their own variables: no word splitting.
        if let Some(url) = &index.index_url {
            env.extend([format!("PIP_INDEX_URL={url}"), format!("UV_INDEX_URL={url}")]);
        }
        if let Some(url) = &index.extra_index_url {
            env.extend([format!("PIP_EXTRA_INDEX_URL={url}"), format!("UV_EXTRA_INDEX_URL={url}")]);
        }
        if index.ca_bundle.is_some() {
            env.extend(["PIP_CERT=/workspace/ca.pem".to_owned(), "SSL_CERT_FILE=/workspace/ca.pem".to_owned()]);
        }
        let mut cmd: Vec<String> = vec!["sh".into(), "-c".into(), INSTALL_SH.into(), "pyberth-install".into()];
        cmd.extend(spec.requirements.iter().cloned());
        // No route to the host or to private ranges: only the index hosts, through the proxy.
        let net =
            spec.egress.attach_installer(name, spec.base, index).await.map_err(|e| {
                Error::Failed(format!("install failed: the installer's network could not be set up: {e}"))
            })?;
        super::lap("install: attach_installer", &mut t);
        let job = Job {
            name,
            image: spec.base,
            cmd,
            env,
            uid,
            labels,
            network: Some(&net),
            mounts,
            uploads: index.ca_bundle.as_deref().map(|ca| (WORKSPACE, "ca.pem", ca)).into_iter().collect(),
            timeout: cfg.install_timeout(),
            timeout_error: Error::Timeout(cfg.install_timeout_s),
            on_line: progress,
            wheels_only,
        };
        // The store's writer is created while the installer runs: off the critical path.
        let writer = super::store::Writer::create(docker, spec.store, spec.base, spec.owner, spec.key);
        let (finished, writer) = tokio::join!(run_job(docker, spec.sandbox, job), writer);
        super::lap("install: run_job", &mut t);
        let (finished, writer) = match (finished, writer) {
            (Ok(f), Ok(w)) => (f, w),
            (Err(e), writer) => {
                if let Ok(w) = writer {
                    w.discard(docker).await;
                }
                spec.egress.detach_installer(net).await;
                return Err(e);
            }
            (Ok(f), Err(e)) => {
                container::remove_container(docker, &f.id).await;
                spec.egress.detach_installer(net).await;
                return Err(e);
            }
        };
        let installer_gone = container::remove_container(docker, &finished.id);
        let built = if finished.code != 0 {
            let refused = spec.egress.installer_refused(&net).await;
            installer_gone.await;
            Err(explain(&finished.tail, index, wheels_only, &refused))
        } else {
            // Once the tree is out, the installer goes while the writer stores it.
            super::build_layer(docker, &finished.id, spec, &writer, installer_gone).await
        };
        super::lap("install: build_layer", &mut t);
        // A network where package code ran (an sdist build) is never handed to the next
        // install: connections it left open would hold that install's slots.
        let network = async {
            if wheels_only {
                spec.egress.release_installer(net).await;
            } else {
                spec.egress.detach_installer(net).await;
            }
        };
        tokio::join!(writer.discard(docker), network);
        super::lap("install: writer removed, detach_installer", &mut t);
        built
    }
    .await;
    // Emptying the tree's volume takes seconds for a big set (5.6 s for pandas here): it is
    // done after the answer, by a task `settle` waits for at shutdown.
    super::clean_up_later(docker, name);
    super::lap("install: remove volume (handed off)", &mut t);
    result
}

/// The shared installer volume of `base` and `index`, created when absent if `create`.
/// `None` when neither uv nor the cache is wanted, when it is absent and not to be created,
/// or when the uid it records is not one of ours (a volume of another configuration).
async fn shared_volume(
    docker: &Docker,
    cfg: &SandboxConfig,
    base: &str,
    index: &IndexSettings,
    create: bool,
) -> Result<Option<Shared>, Error> {
    if cfg.installer_uv == "none" && cfg.installer_cache_mb == 0 {
        return Ok(None);
    }
    let base_id = docker.inspect_image(base).await?.id.unwrap_or_else(|| base.to_owned());
    let name = format!("pyberth-installer-{}", shared_key(&base_id, index, &cfg.installer_uv));
    let found = match docker.inspect_volume(&name).await {
        Ok(v) => Some(v),
        Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => None,
        Err(e) => return Err(e.into()),
    };
    let volume = match found {
        Some(v) => v,
        None if !create => return Ok(None),
        None => {
            prune_stale(docker).await;
            // A uid from the range, recorded on the volume: every wheels-only installer of
            // this volume runs as it, so the files one writes the next can use.
            let uid = identity::pick(docker, cfg.uid_range).await?;
            let labels = HashMap::from([
                (LABEL_MANAGED.to_owned(), "1".to_owned()),
                (LABEL_INSTALLER_VOLUME.to_owned(), "1".to_owned()),
                (LABEL_UID.to_owned(), uid.to_string()),
                (LABEL_BASE_ID.to_owned(), base_id.clone()),
                ("pyberth.installer-uv".to_owned(), cfg.installer_uv.clone()),
                // What else the key holds, for those who look for a volume by its labels (the bench).
                ("pyberth.installer-index".to_owned(), index.index_url.clone().unwrap_or_else(|| "default".into())),
                (
                    "pyberth.installer-extra-index".to_owned(),
                    index.extra_index_url.clone().unwrap_or_else(|| "none".into()),
                ),
                (LABEL_BASE.to_owned(), base.to_owned()),
            ]);
            let request = VolumeCreateRequest { name: Some(name.clone()), labels: Some(labels), ..Default::default() };
            let created = docker.create_volume(request).await;
            identity::release(uid);
            // Two servers creating it at once get the same volume: its labels are the first's.
            created?
        }
    };
    let uid = volume.labels.get(LABEL_UID).and_then(|u| u.parse::<u32>().ok());
    match uid {
        Some(uid) if (cfg.uid_range.first..=cfg.uid_range.last).contains(&uid) => Ok(Some(Shared { name, uid })),
        _ => {
            tracing::warn!(volume = %name, "the installer volume's uid is not in --uid-range; installing without it");
            Ok(None)
        }
    }
}

/// The shared volume's key: what fixes the uv wheel it holds (the base image's platform and
/// the index it came from, and the requirement it was fetched by).
fn shared_key(base_id: &str, index: &IndexSettings, uv: &str) -> String {
    let mut h = Sha256::new();
    for part in [
        "pyberth-installer-v1",
        base_id,
        index.index_url.as_deref().unwrap_or(""),
        index.extra_index_url.as_deref().unwrap_or(""),
        uv,
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Removes shared installer volumes whose base image is gone (a rebuilt sandbox image): no
/// install can use them again. The engine refuses to remove one an installer is using.
async fn prune_stale(docker: &Docker) {
    let filters = HashMap::from([("label", vec![LABEL_INSTALLER_VOLUME])]);
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let Ok(list) = docker.list_volumes(Some(opts)).await else { return };
    for v in list.volumes.unwrap_or_default() {
        let Some(id) = v.labels.get(LABEL_BASE_ID) else { continue };
        if let Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) =
            docker.inspect_image(id).await
        {
            container::remove_volume(docker, &v.name).await;
        }
    }
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
    blueprint: &crate::sandbox::Blueprint,
    owner: &Owner,
    image: &str,
    markers: &[String],
) -> Result<Vec<Option<bool>>, Error> {
    let cfg = &*blueprint.cfg;
    let uid = identity::pick(docker, cfg.uid_range).await?;
    let name = format!("pyberth-{}-markers-{}", owner.instance, next_serial());
    let cmd = ["python3", "-I", "-c", MARKERS_PY].iter().map(|s| (*s).to_owned()).chain(markers.iter().cloned());
    let job = Job {
        name: &name,
        image,
        cmd: cmd.collect(),
        env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(), "LANG=C.UTF-8".into()],
        uid,
        labels: labels(owner, uid),
        network: None,
        mounts: Vec::new(),
        uploads: Vec::new(),
        timeout: Duration::from_secs(60),
        timeout_error: Error::Failed("the marker check did not finish within 60 s".into()),
        on_line: &|_| {},
        wheels_only: false,
    };
    let result = async {
        let finished = run_job(docker, &blueprint.spec, job).await?;
        container::remove_container(docker, &finished.id).await;
        let line = String::from_utf8_lossy(&finished.stdout);
        let verdicts: Option<Vec<Option<bool>>> = serde_json::from_str(line.trim()).ok();
        match verdicts {
            Some(v) if finished.code == 0 && v.len() == markers.len() => Ok(v),
            _ => Err(Error::Failed(format!(
                "the marker check failed (exit {}): {}",
                finished.code,
                finished.tail.join("\n").trim()
            ))),
        }
    }
    .await;
    identity::release(uid);
    result
}

/// The labels of a short-lived container of `owner` running as `uid`.
fn labels(owner: &Owner, uid: u32) -> HashMap<String, String> {
    owner.labels_with(&[(LABEL_UID, &uid.to_string())])
}

/// One short-lived container with the sandbox's hardening: the installer or the marker check.
struct Job<'a> {
    /// Container name.
    name: &'a str,
    image: &'a str,
    cmd: Vec<String>,
    env: Vec<String>,
    /// The uid (and gid) it runs as.
    uid: u32,
    labels: HashMap<String, String>,
    /// The installer's network (only the index, through the egress proxy), else none; with it
    /// come the installer's room to unpack and build: 2 GiB of memory, 1 GiB of /tmp.
    network: Option<&'a crate::egress::InstallerNet>,
    /// Volumes; the first, if any, at the working directory /workspace.
    mounts: Vec<Mount>,
    /// Files put in place before it starts: directory, name, contents.
    uploads: Vec<(&'a str, &'a str, &'a [u8])>,
    timeout: Duration,
    /// What a timeout returns.
    timeout_error: Error,
    /// Each line of its output, as it comes.
    on_line: Progress<'a>,
    /// It runs no package code (an install allowing no sdist): it may use every CPU.
    wheels_only: bool,
}

/// How a [`Job`] ended. Its container is stopped, not removed: the caller removes it.
struct Finished {
    id: String,
    code: i64,
    /// Its standard output, the first 64 KiB.
    stdout: Vec<u8>,
    /// Its last 30 lines, both streams.
    tail: Vec<String>,
}

/// Creates, starts and waits for `job`'s container. On any failure the container is removed.
async fn run_job(docker: &Docker, sandbox: &container::Spec, job: Job<'_>) -> Result<Finished, Error> {
    let mut hc = container::host_config(sandbox, job.name);
    hc.mounts = if job.mounts.is_empty() { None } else { Some(job.mounts.clone()) };
    if job.network.is_some() && job.wheels_only {
        // Wheels only: no package code runs, only uv or pip, which decompress and compile
        // bytecode on every core the machine has, as the same command outside pyberth does.
        hc.nano_cpus = None;
    }
    if job.network.is_some() {
        // The engine's default runtime: gVisor registered with --network=none would leave the
        // installer no network. Wheels-only installs run no package code; builds allowed by
        // allow_sdist do, fenced by runc and a network that reaches only the index.
        hc.runtime = None;
        hc.memory = Some(2 << 30);
        hc.memory_swap = Some(2 << 30);
        hc.tmpfs = Some(HashMap::from([("/tmp".into(), "rw,nosuid,nodev,size=1024m".into())]));
    }
    let body = ContainerCreateBody {
        image: Some(job.image.into()),
        cmd: Some(job.cmd.clone()),
        user: Some(identity::user(job.uid)),
        working_dir: Some(if job.mounts.is_empty() { "/tmp" } else { WORKSPACE }.into()),
        env: Some(job.env.clone()),
        labels: Some(job.labels.clone()),
        network_disabled: Some(true),
        host_config: Some(hc),
        ..Default::default()
    };
    let mut body = body;
    if let Some(net) = job.network {
        net.apply(&mut body);
    }
    let mut t = std::time::Instant::now();
    let created =
        docker.create_container(Some(CreateContainerOptionsBuilder::default().name(job.name).build()), body).await?;
    let id = created.id;
    super::lap("run_job: create", &mut t);
    match watch(docker, &id, job).await {
        Ok((code, stdout, tail)) => Ok(Finished { id, code, stdout, tail }),
        Err(e) => {
            container::remove_container(docker, &id).await;
            Err(e)
        }
    }
}

/// Uploads, starts and follows the created container `id` to its exit.
async fn watch(docker: &Docker, id: &str, job: Job<'_>) -> Result<(i64, Vec<u8>, Vec<String>), Error> {
    let mut t = std::time::Instant::now();
    let uploads = async {
        for (dir, name, data) in &job.uploads {
            upload_file(docker, id, dir, name, data).await?;
        }
        Ok::<(), Error>(())
    };
    let attach = AttachContainerOptionsBuilder::default().stream(true).stdout(true).stderr(true).build();
    // Independent calls on the created container: at once.
    let (uploaded, attached) = tokio::join!(uploads, docker.attach_container(id, Some(attach)));
    uploaded?;
    let mut output = attached?.output;
    docker.start_container(id, None).await?;
    super::lap("run_job: uploads, attach, start", &mut t);
    let mut stdout = Vec::new();
    let mut tail: Vec<String> = Vec::new();
    let mut partial = String::new();
    let mut line = |text: &str| {
        partial.push_str(text);
        while let Some(pos) = partial.find('\n') {
            let line: String = partial.drain(..=pos).collect();
            let line = line.trim_end();
            if !line.is_empty() {
                (job.on_line)(line);
                tail.push(line.to_owned());
                if tail.len() > 30 {
                    tail.remove(0);
                }
            }
        }
    };
    let deadline = tokio::time::sleep(job.timeout);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            frame = output.next() => match frame {
                Some(Ok(LogOutput::StdOut { message })) => {
                    if stdout.len() < 64 << 10 {
                        stdout.extend_from_slice(&message);
                    }
                    line(&String::from_utf8_lossy(&message));
                }
                Some(Ok(LogOutput::StdErr { message })) => line(&String::from_utf8_lossy(&message)),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.into()),
                None => break,
            },
            _ = &mut deadline => return Err(job.timeout_error),
        }
    }
    line("\n");
    super::lap("run_job: script", &mut t);
    let code = wait_exit(docker, id).await?;
    super::lap("run_job: wait", &mut t);
    Ok((code, stdout, tail))
}

pub(super) use crate::docker::next_serial;

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

/// The text of `all` between `start` and the first `end` after it.
fn between<'a>(all: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let from = all.find(start)? + start.len();
    let len = all[from..].find(end)?;
    Some(&all[from..from + len]).filter(|s| !s.is_empty() && s.len() <= 120)
}

/// The package a uv "no usable wheels" resolution names (`docopt`, from `docopt==0.6.2`).
fn no_wheel_package(all: &str) -> Option<String> {
    let named = between(all, "Wheels are required for `", "`")
        .or_else(|| between(all, "all versions of ", " have no usable wheels"))
        .or_else(|| {
            let at = all.find(" has no usable wheels")?;
            all[..at].rsplit(|c: char| c.is_whitespace()).next()
        })?;
    let name = named.split(|c: char| "=<>!~;[ ".contains(c)).next()?;
    Some(crate::deps::normalize_name(name)).filter(|n| !n.is_empty())
}

/// How to allow building `package` from source, in the words of each place it can be said.
fn opt_in(package: &str) -> String {
    format!(
        "building from source is off by default because it runs the package's own code in the installer. \
         If you trust {package}, ask the operator to allow it: `--allow-sdist {package}` \
         (PYBERTH_ALLOW_SDIST={package}), or `allow_sdist = [\"{package}\"]` at the top of the config file or in \
         an `[environments.NAME]` table. Otherwise pick a version of {package} that ships a wheel for this \
         Python, or a package that does"
    )
}

/// Turns pip's or uv's last lines into a short message a model can act on, naming the
/// requirement at fault where the installer does.
/// `refused`: what the installer's proxy refused or could not reach, in its words: an
/// installer that reaches the index only through the proxy never sees a connection error of
/// its own, pip least of all (an HTTP error on the index page reads to it as "no versions").
fn explain(tail: &[String], index: &IndexSettings, wheels_only: bool, refused: &[String]) -> Error {
    // Our own notices (the pip fallback's reason quotes pip's words about uv) are not the
    // installer's verdict on the requirements.
    let all = tail.iter().filter(|l| !l.starts_with("pyberth:")).cloned().collect::<Vec<_>>().join("\n");
    let index_name = index.index_url.as_deref().unwrap_or("https://pypi.org/simple");
    let unreachable = || {
        format!(
            "the package index {index_name} could not be reached (network, proxy or CA bundle: \
             see --index-url and --ca-bundle)"
        )
    };
    let network = [
        // pip
        "Failed to establish a new connection",
        "Network is unreachable",
        "Temporary failure in name resolution",
        "CERTIFICATE_VERIFY_FAILED",
        "SSLError",
        "ProxyError",
        // uv
        "tcp connect error",
        "dns error",
        "invalid peer certificate",
        "Request failed after",
        "error sending request for url",
    ];
    let what = if !refused.is_empty() {
        let shown: Vec<&str> = refused.iter().take(3).map(String::as_str).collect();
        format!(
            "the package index {index_name} could not be reached through the installer's proxy ({}): check \
             --index-url, and pin an index on a private address with egress_pin",
            shown.join("; ")
        )
    } else if network.iter().any(|n| all.contains(n)) {
        unreachable()
    } else if let Some(p) = no_wheel_package(&all) {
        format!("{p} ships no wheel for this Python and platform, only source; {}", opt_in(&p))
    } else if let Some(p) = between(&all, "Because ", " was not found in the package registry") {
        format!("no such package on the index {index_name}: {p} (check the name)")
    } else if let Some(r) = between(&all, "there is no version of ", " and ") {
        format!("no version of {r} on the index {index_name}: relax the version constraint")
    } else if let Some(r) = between(&all, "satisfies the requirement ", " (from versions: none)") {
        // pip says the same of a package that is not there and of one with no usable file.
        if wheels_only {
            let name = r.split(|c: char| "=<>!~;[ ".contains(c)).next().unwrap_or(r);
            let name = crate::deps::normalize_name(name);
            format!(
                "no such package on the index {index_name}: {name} (check the name), or none of its versions \
                 ships a wheel for this Python and platform. If it ships only source, {}",
                opt_in(&name)
            )
        } else {
            format!("no such package on the index {index_name}: {r} (check the name)")
        }
    } else if let Some(r) = between(&all, "satisfies the requirement ", " (from versions:") {
        format!("no version of {r} on the index {index_name}: relax the version constraint")
    } else if all.contains("No solution found when resolving")
        || all.contains("ResolutionImpossible")
        || all.contains("conflicting dependencies")
    {
        "the requested packages have conflicting dependencies (see the installer's output below)".to_owned()
    } else if all.contains("No matching distribution found") || all.contains("Could not find a version") {
        "no such package, or no version matching the constraint, on the index".to_owned()
    } else if all.contains("Failed building wheel")
        || all.contains("subprocess-exited-with-error")
        || all.contains("Failed to build")
    {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Real output of uv 0.13.9 and pip 23.0.1 (Debian bookworm's), captured from the
    /// installer's command against PyPI through this machine's proxy.
    fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::to_owned).collect()
    }

    fn what(tail: &str, wheels_only: bool) -> String {
        match explain(&lines(tail), &IndexSettings::default(), wheels_only, &[]) {
            Error::Installer { what, .. } => what,
            e => panic!("not an installer error: {e}"),
        }
    }

    const UV_NO_WHEEL: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: No solution found when resolving dependencies
  cause: Because all versions of docopt have no usable wheels and you require docopt, we can conclude that your requirements are unsatisfiable.

hint: Wheels are required for `docopt` because building from source is disabled for all packages (i.e., with `--no-build`)";

    const UV_NOT_FOUND: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: No solution found when resolving dependencies
  cause: Because no-such-package-pyberth-xyz was not found in the package registry and you require no-such-package-pyberth-xyz, we can conclude that your requirements are unsatisfiable.";

    const UV_NO_VERSION: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: No solution found when resolving dependencies
  cause: Because there is no version of idna==999.0 and you require idna==999.0, we can conclude that your requirements are unsatisfiable.";

    const UV_CONFLICT: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: No solution found when resolving dependencies
  cause: Because requests==2.31.0 depends on urllib3>=1.21.1,<3 and you require requests==2.31.0, we can conclude that you require urllib3>=1.21.1,<3.
         And because you require urllib3==1.0, we can conclude that your requirements are unsatisfiable.";

    const UV_REFUSED: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: Request failed after 3 retries in 6.5s
  cause: Failed to fetch: https://127.0.0.1:9/simple/idna/
  cause: error sending request for url (https://127.0.0.1:9/simple/idna/)
  cause: client error (Connect)
  cause: tcp connect error
  cause: Connection refused (os error 111)";

    const UV_BAD_CA: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: Failed to fetch: https://pypi.org/simple/idna/
  cause: error sending request for url (https://pypi.org/simple/idna/)
  cause: client error (Connect)
  cause: invalid peer certificate: UnknownIssuer

hint: Consider enabling use of system TLS certificates with the `--system-certs` command-line flag";

    const PIP_NO_WHEEL: &str =
        "ERROR: Could not find a version that satisfies the requirement docopt (from versions: none)
ERROR: No matching distribution found for docopt";

    const PIP_NO_VERSION: &str = "ERROR: Could not find a version that satisfies the requirement idna==999.0 (from versions: 2.0, 2.1, 3.19, 3.20)
ERROR: No matching distribution found for idna==999.0";

    #[test]
    fn uv_failures_name_the_requirement_and_what_to_do() {
        let w = what(UV_NO_WHEEL, true);
        assert!(w.starts_with("docopt ships no wheel"), "{w}");
        assert!(w.contains("--allow-sdist docopt") && w.contains("allow_sdist = [\"docopt\"]"), "{w}");
        let w = what(UV_NOT_FOUND, true);
        assert!(w.contains("no such package on the index https://pypi.org/simple: no-such-package-pyberth-xyz"), "{w}");
        let w = what(UV_NO_VERSION, true);
        assert!(w.contains("no version of idna==999.0"), "{w}");
        let w = what(UV_CONFLICT, true);
        assert!(w.contains("conflicting dependencies"), "{w}");
        for unreachable in [UV_REFUSED, UV_BAD_CA] {
            let w = what(unreachable, true);
            assert!(w.contains("could not be reached") && w.contains("--ca-bundle"), "{w}");
        }
    }

    #[test]
    fn pip_failures_name_the_requirement_and_the_opt_in_when_wheels_only() {
        let w = what(PIP_NO_WHEEL, true);
        assert!(w.contains("no such package on the index https://pypi.org/simple: docopt"), "{w}");
        assert!(w.contains("--allow-sdist docopt"), "{w}");
        let w = what(PIP_NO_WHEEL, false);
        assert!(w.contains("no such package on the index https://pypi.org/simple: docopt"), "{w}");
        assert!(!w.contains("allow-sdist"), "{w}");
        let w = what(PIP_NO_VERSION, true);
        assert!(w.contains("no version of idna==999.0"), "{w}");
        assert_eq!(no_wheel_package("Because docopt==0.6.2 has no usable wheels and"), Some("docopt".into()));
    }

    #[test]
    fn sdists_are_allowed_only_for_the_named_packages() {
        let reqs = vec!["docopt==0.6.2".to_owned(), "six".to_owned()];
        let cfg = crate::config::from_flags(&[]);
        assert!(sdist_allowed(&cfg, &reqs).is_empty(), "wheels only by default");
        let cfg = crate::config::from_flags(&["--allow-sdist", "DocOpt,other"]);
        assert_eq!(sdist_allowed(&cfg, &reqs), ["docopt"]);
        let cfg = crate::config::from_flags(&["--allow-sdist", ":all:"]);
        assert_eq!(sdist_allowed(&cfg, &reqs), ["docopt", "six"]);
    }

    #[test]
    fn the_shared_volume_key_follows_the_base_the_index_and_the_uv_requirement() {
        let idx = IndexSettings::default();
        let k = shared_key("sha256:a", &idx, "uv");
        assert_eq!(k.len(), 16);
        assert_ne!(k, shared_key("sha256:b", &idx, "uv"));
        assert_ne!(k, shared_key("sha256:a", &idx, "uv==0.13.9"));
        let other = IndexSettings { index_url: Some("https://mirror/simple".into()), ..Default::default() };
        assert_ne!(k, shared_key("sha256:a", &other, "uv"));
        let ca = IndexSettings { ca_bundle: Some(b"pem".to_vec()), ..Default::default() };
        assert_eq!(k, shared_key("sha256:a", &ca, "uv"), "the CA bundle changes how, not what");
    }
}
