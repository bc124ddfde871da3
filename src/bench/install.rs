//! The installer: first installs beside the same command in a plain container.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::RemoveContainerOptionsBuilder;
use futures::StreamExt;
use pyberth::docker::Engine;

use pyberth::config::SandboxConfig;

use super::drive::Server;
use super::floors::bench_labels;
use super::table::Table;

/// First installs of a small package (idna) and of pandas by pyberth (a new session asking for
/// it, its layer removed first), each beside its floor measured in the same run: the same uv
/// command in a plain container of the sandbox image (default network, a fresh volume for the
/// target, no hardening, no layer), and pip's for pandas. Both sides download cold: the bench
/// server runs with no shared download cache, the floors with `--no-cache`; both take uv from
/// the installer's tool volume, fetched beforehand by a warm-up install.
pub(super) async fn installer_rows(
    cfg: &SandboxConfig,
    docker: &dyn Engine,
    img: &str,
    table: &mut Table,
) -> anyhow::Result<()> {
    let instance = format!("bench-{}-installer", std::process::id());
    // The pool as configured, as a new user has it: the session that asks comes from it.
    let env = [("PYBERTH_INSTALLER_CACHE_MB", "0".to_owned()), ("PYBERTH_POOL_SIZE", cfg.pool_size.to_string())];
    let server = Server::start(cfg, &instance, &env).await?;
    let result = async {
        // Warm-up: the sandbox image's first session, and uv in the tool volume. Not tomli:
        // the layer rows after this time tomli's first install in the same store.
        server.run("warm", "import iniconfig", &["iniconfig"]).await?;
        let uv = tool_volume(docker, img, cfg).await;
        let mut rows = Vec::new();
        for (package, code) in [("idna", "import idna"), ("pandas", "import pandas")] {
            // pyberth first: whatever a proxy between here and the index caches then favours
            // the floor, never pyberth.
            let t = Instant::now();
            server.run(&format!("first-{package}"), code, &[package]).await?;
            let ours = t.elapsed();
            let floor = floor_install(docker, img, cfg, uv.as_deref(), package, true).await?;
            rows.push((package, floor, ours));
        }
        for (package, floor, ours) in rows {
            let mut f = [floor];
            table.add(&format!("floor: uv pip install {package} in a plain container"), &mut f, "cold download".into());
            let mut o = [ours];
            table.add(&format!("new session with packages=[{package}], first install"), &mut o, String::new());
            let (o, f) = (ours.as_secs_f64(), floor.as_secs_f64());
            table.note(format!("floor + {:.2} s, {:.2}x the floor", o - f, o / f));
        }
        let pip = floor_install(docker, img, cfg, None, "pandas", false).await?;
        let mut p = [pip];
        table.add("floor: pip install pandas in a plain container", &mut p, "uv vs pip, same image".into());
        Ok::<_, anyhow::Error>(())
    }
    .await;
    server.stop().await;
    if tool_volume(docker, img, cfg).await.is_none() {
        table.text("installer floors", "pip".into(), "no uv in the tool volume: the uv floors ran pip".into());
    }
    result
}

/// The installer's shared volume the bench server uses on `img` (base image, index and uv
/// requirement, as its labels record them), if there is one.
pub(super) async fn tool_volume(docker: &dyn Engine, img: &str, cfg: &SandboxConfig) -> Option<String> {
    let id = docker.inspect_image(img).await.ok()?.id?;
    let labels = [
        format!("pyberth.base-id={id}"),
        format!("pyberth.installer-uv={}", cfg.installer_uv),
        format!("pyberth.installer-index={}", cfg.index_url().unwrap_or_else(|| "default".into())),
        format!("pyberth.installer-extra-index={}", cfg.extra_index_url().unwrap_or_else(|| "none".into())),
    ];
    let mut wanted = vec!["pyberth.installer-volume"];
    wanted.extend(labels.iter().map(String::as_str));
    let filters = HashMap::from([("label", wanted)]);
    let opts = bollard::query_parameters::ListVolumesOptionsBuilder::default().filters(&filters).build();
    docker.list_volumes(Some(opts)).await.ok()?.volumes?.into_iter().next().map(|v| v.name)
}

/// One install of `package` in a plain container of `img`, timed from create to exit: uv from
/// the tool volume `uv` (read-only) when given and `with_uv`, else pip.
pub(super) async fn floor_install(
    docker: &dyn Engine,
    img: &str,
    cfg: &SandboxConfig,
    uv: Option<&str>,
    package: &str,
    with_uv: bool,
) -> anyhow::Result<Duration> {
    use bollard::models::{Mount, MountType};
    let script = match (uv, with_uv) {
        (Some(_), true) => {
            "/var/tmp/uv/bin/uv pip install --no-config --python \"$(command -v python3)\" --link-mode copy \
             --compile-bytecode --no-cache --only-binary :all: --target /workspace/site -- \"$1\""
        }
        _ => {
            "python3 -m pip install --no-input --disable-pip-version-check --progress-bar off --no-cache-dir \
             --only-binary :all: --target /workspace/site -- \"$1\""
        }
    };
    let mut mounts =
        vec![Mount { target: Some("/workspace".into()), typ: Some(MountType::VOLUME), ..Default::default() }];
    if let Some(v) = uv {
        let read_only = Some(true);
        mounts.push(Mount {
            target: Some("/var/tmp".into()),
            source: Some(v.into()),
            typ: Some(MountType::VOLUME),
            read_only,
            ..Default::default()
        });
    }
    let mut env = vec!["UV_NO_PROGRESS=1".to_owned(), "UV_PYTHON_DOWNLOADS=never".to_owned(), "HOME=/tmp".to_owned()];
    if let Some(ca) = cfg.ca_bundle() {
        mounts.push(Mount {
            target: Some("/ca.pem".into()),
            source: Some(ca.display().to_string()),
            typ: Some(MountType::BIND),
            read_only: Some(true),
            ..Default::default()
        });
        env.extend(["SSL_CERT_FILE=/ca.pem".to_owned(), "PIP_CERT=/ca.pem".to_owned()]);
    }
    let body = ContainerCreateBody {
        image: Some(img.into()),
        cmd: Some(vec!["sh".into(), "-c".into(), script.into(), "floor".into(), package.into()]),
        env: Some(env),
        labels: Some(bench_labels()),
        host_config: Some(HostConfig { mounts: Some(mounts), runtime: cfg.runtime.clone(), ..Default::default() }),
        ..Default::default()
    };
    let t = Instant::now();
    let c = docker.create_container(None::<bollard::query_parameters::CreateContainerOptions>, body).await?;
    let run = async {
        docker.start_container(&c.id, None).await?;
        let mut wait = docker.wait_container(&c.id, None);
        match wait.next().await {
            Some(Ok(_)) => Ok(t.elapsed()),
            Some(Err(e)) => Err(anyhow::anyhow!("the floor install of {package} failed: {e}")),
            None => Err(anyhow::anyhow!("the floor install of {package} did not report its exit")),
        }
    }
    .await;
    let opts = RemoveContainerOptionsBuilder::default().force(true).v(true).build();
    let _ = docker.remove_container(&c.id, Some(opts)).await;
    run
}
