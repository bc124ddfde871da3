//! The installer: a short-lived container that alone has network access, installs a
//! requirement set into a volume of its own, and hands the stopped container to whoever
//! stores the tree. The marker evaluator (`markers.rs`) runs the same image without network;
//! both run through `job.rs`; `shared.rs` keeps the shared volume, `explain.rs` says failures.
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

use crate::docker::{Engine, EngineRef};
use bollard::models::{Mount, MountType, VolumeCreateRequest};

use super::explain::explain;
use super::job::{Job, labels, run_job};
use super::shared::{Shared, shared_volume};
use super::{Error, IndexSettings, LayerSpec};
use crate::config::SandboxConfig;
use crate::docker::container::{self, Owner, WORKSPACE};
use crate::docker::identity::{self};
use crate::docker::image::Progress;
use crate::docker::next_serial;

/// Label on an installer's own volume (and its container).
pub const LABEL_INSTALLER: &str = "pyberth.installer";

/// Where installers mount the shared volume. An image path that is mode 1777 in every base
/// (Debian's, the official Python images'): a new volume takes the mode of the path it is
/// first mounted at, so the installers' uid can write to it with no root step.
const SHARED: &str = "/var/tmp";

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
    docker: &EngineRef,
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
    docker: &EngineRef,
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
    labels.insert(LABEL_INSTALLER.to_owned(), "1".to_owned());
    docker
        .create_volume(VolumeCreateRequest {
            name: Some(name.to_owned()),
            labels: Some(labels.clone()),
            ..Default::default()
        })
        .await?;
    super::lap("install: create volume", &mut t);
    let result = async {
        let mounts = installer_mounts(name, shared, wheels_only);
        let env = installer_env(cfg, index, shared.is_some(), wheels_only);
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
                net.unbind().await;
                container::remove_container(docker, &f.id).await;
                spec.egress.detach_installer(net).await;
                return Err(e);
            }
        };
        // Its policy leaves the proxy before its pod does (Kubernetes: `InstallerNet::unbind`).
        let installer_gone = async {
            net.unbind().await;
            container::remove_container(docker, &finished.id).await;
        };
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
            if wheels_only { spec.egress.release_installer(net).await } else { spec.egress.detach_installer(net).await }
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

/// The installer's mounts: its own volume as the workspace, and the shared volume (read-only
/// when package code may run).
fn installer_mounts(name: &str, shared: Option<&Shared>, wheels_only: bool) -> Vec<Mount> {
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
    mounts
}

/// The installer's environment: a fixed one, what `INSTALL_SH` is told, and the index settings
/// in both tools' own variables (no word splitting).
fn installer_env(cfg: &SandboxConfig, index: &IndexSettings, shared: bool, wheels_only: bool) -> Vec<String> {
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
        format!("PB_SHARED={}", flag(shared)),
        format!(
            "PB_SHARED_WHY={}",
            if wheels_only {
                "the installer's tool volume is unavailable (see the server's log)"
            } else {
                "no wheels-only install has fetched uv on this base and index yet"
            }
        ),
        format!("PB_WRITE={}", flag(shared && wheels_only)),
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
    env
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
