//! One short-lived container with the sandbox's hardening: the installer or the marker check.

use std::collections::HashMap;
use std::time::Duration;

use crate::docker::Engine;
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, Mount};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use futures::StreamExt;

use super::Error;
use crate::docker::container::{self, Owner, WORKSPACE};
use crate::docker::identity::{self, LABEL_UID};
use crate::docker::image::Progress;

/// The labels of a short-lived container of `owner` running as `uid`.
pub(super) fn labels(owner: &Owner, uid: u32) -> HashMap<String, String> {
    owner.labels_with(&[(LABEL_UID, &uid.to_string())])
}

/// One short-lived container with the sandbox's hardening: the installer or the marker check.
pub(super) struct Job<'a> {
    /// Container name.
    pub(super) name: &'a str,
    pub(super) image: &'a str,
    pub(super) cmd: Vec<String>,
    pub(super) env: Vec<String>,
    /// The uid (and gid) it runs as.
    pub(super) uid: u32,
    pub(super) labels: HashMap<String, String>,
    /// The installer's network (only the index, through the egress proxy), else none; with it
    /// come the installer's room to unpack and build: 2 GiB of memory, 1 GiB of /tmp.
    pub(super) network: Option<&'a crate::egress::InstallerNet>,
    /// Volumes; the first, if any, at the working directory /workspace.
    pub(super) mounts: Vec<Mount>,
    /// Files put in place before it starts: directory, name, contents.
    pub(super) uploads: Vec<(&'a str, &'a str, &'a [u8])>,
    pub(super) timeout: Duration,
    /// What a timeout returns.
    pub(super) timeout_error: Error,
    /// Each line of its output, as it comes.
    pub(super) on_line: Progress<'a>,
    /// It runs no package code (an install allowing no sdist): it may use every CPU.
    pub(super) wheels_only: bool,
}

/// How a [`Job`] ended. Its container is stopped, not removed: the caller removes it.
pub(super) struct Finished {
    pub(super) id: String,
    pub(super) code: i64,
    /// Its standard output, the first 64 KiB.
    pub(super) stdout: Vec<u8>,
    /// Its last 30 lines, both streams.
    pub(super) tail: Vec<String>,
}

/// Creates, starts and waits for `job`'s container. On any failure the container is removed.
pub(super) async fn run_job(docker: &dyn Engine, sandbox: &container::Spec, job: Job<'_>) -> Result<Finished, Error> {
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
    let network = job.network;
    // Keyed by its own address (Kubernetes), the installer's policy goes into the proxy now:
    // its pod runs and has one, and its command has not started.
    let bound = match network {
        Some(net) => net
            .bind(docker, &id)
            .await
            .map_err(|e| Error::Failed(format!("install failed: the installer's network could not be set up: {e}"))),
        None => Ok(()),
    };
    let watched = match bound {
        Ok(()) => watch(docker, &id, job).await,
        Err(e) => Err(e),
    };
    match watched {
        Ok((code, stdout, tail)) => Ok(Finished { id, code, stdout, tail }),
        Err(e) => {
            if let Some(net) = network {
                net.unbind().await;
            }
            container::remove_container(docker, &id).await;
            Err(e)
        }
    }
}

/// Uploads, starts and follows the created container `id` to its exit.
pub(super) async fn watch(docker: &dyn Engine, id: &str, job: Job<'_>) -> Result<(i64, Vec<u8>, Vec<String>), Error> {
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

pub(super) async fn wait_exit(docker: &dyn Engine, id: &str) -> Result<i64, Error> {
    let mut wait = docker.wait_container(id, None);
    match wait.next().await {
        Some(Ok(r)) => Ok(r.status_code),
        // bollard reports a non-zero exit as an error carrying the code.
        Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => Ok(code),
        Some(Err(e)) => Err(e.into()),
        None => Ok(-1),
    }
}

pub(super) async fn upload_file(
    docker: &dyn Engine,
    id: &str,
    dir: &str,
    name: &str,
    data: &[u8],
) -> Result<(), Error> {
    let mut ar = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_mtime(0);
    h.set_cksum();
    ar.append_data(&mut h, name, data).map_err(|e| Error::Failed(format!("cannot pack {name}: {e}")))?;
    let buf = ar.into_inner().map_err(|e| Error::Failed(format!("cannot pack {name}: {e}")))?;
    let opts = UploadToContainerOptionsBuilder::default().path(dir).build();
    docker.upload_to_container(id, Some(opts), crate::docker::body_full(buf.into())).await?;
    Ok(())
}
