//! The installer: a short-lived container that alone has network access, installs a
//! requirement set into a volume of its own, and hands the stopped container to whoever
//! stores the tree. Also the marker evaluator, which runs the same image without network.

use std::collections::HashMap;

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, Mount, MountType, VolumeCreateRequest};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use futures::StreamExt;

use super::super::container::{self, Owner, WORKSPACE};
use super::super::identity::{self, LABEL_UID};
use super::super::{LABEL_INSTANCE, LABEL_MANAGED};
use super::{Error, IndexSettings, LayerSpec};
use crate::config::SandboxConfig;
use crate::docker::image::Progress;

/// Runs the installer container, then builds the layer from the tree it installed.
pub(super) async fn install(
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
        (super::super::LABEL_HOST.to_owned(), owner.host.clone()),
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
            super::build_layer(docker, &id, spec).await
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
        (super::super::LABEL_HOST.to_owned(), owner.host.clone()),
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

pub(super) fn next_serial() -> u64 {
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
