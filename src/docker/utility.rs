//! Short-lived utility containers of ours (the layer store's writer, the snapshot packer):
//! waited on for their exit status, so never `AutoRemove`; our labels, so a sweep finds one
//! a killed server left.

use super::Engine;
use bollard::models::{ContainerCreateBody, HostConfig, Mount};
use bollard::query_parameters::CreateContainerOptionsBuilder;

use super::container::{Fence, Owner, hardened};

/// What a short-lived utility container of ours runs as, and what it may use.
pub(crate) struct Utility<'a> {
    /// Its name (ours: `pyberth-<instance>-…`).
    pub(crate) name: &'a str,
    pub(crate) owner: &'a Owner,
    pub(crate) image: &'a str,
    /// The Python source it runs (`python3 -I -S -c`), and its arguments.
    pub(crate) script: &'a str,
    pub(crate) args: Vec<String>,
    /// `uid:gid`.
    pub(crate) user: String,
    pub(crate) memory: i64,
    pub(crate) pids: i64,
    pub(crate) runtime: Option<&'a str>,
    pub(crate) mounts: Vec<Mount>,
}

/// Creates (does not start) a utility container: a trusted script from the image, with no
/// network, no capabilities, no new privileges, a read-only root, bounded memory and pids, and
/// our labels, so a sweep finds it if the server dies meanwhile. The layer store's writer and
/// the snapshot packer are both made here, so their fences cannot drift apart.
pub(crate) async fn create_utility(docker: &dyn Engine, u: Utility<'_>) -> Result<String, bollard::errors::Error> {
    let labels = u.owner.labels_with(&[]);
    let cmd = ["python3", "-I", "-S", "-c", u.script].iter().map(|s| (*s).to_owned()).chain(u.args).collect();
    let fence = Fence {
        memory: u.memory,
        pids: u.pids,
        seccomp: None,
        runtime: u.runtime.map(str::to_owned),
        network: "none",
        read_only: true,
    };
    let body = ContainerCreateBody {
        image: Some(u.image.into()),
        cmd: Some(cmd),
        user: Some(u.user),
        env: Some(vec!["PATH=/usr/local/bin:/usr/bin:/bin".into(), "LANG=C.UTF-8".into()]),
        labels: Some(labels),
        network_disabled: Some(true),
        host_config: Some(HostConfig { mounts: Some(u.mounts), ..hardened(fence) }),
        ..Default::default()
    };
    let opts = CreateContainerOptionsBuilder::default().name(u.name).build();
    Ok(docker.create_container(Some(opts), body).await?.id)
}
