//! Session containers with the hardened defaults of docs/design.md D4, their volumes, and the
//! sweep that removes what dead server instances left behind.

use std::collections::HashMap;

use crate::docker::Engine;
use bollard::models::{
    ContainerCreateBody, HostConfig, HostConfigLogConfig, Mount, MountType, ResourcesUlimits, RestartPolicy,
    RestartPolicyNameEnum, VolumeCreateRequest,
};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, RemoveContainerOptionsBuilder, RemoveVolumeOptionsBuilder,
};

use super::identity::{self, LABEL_UID};
use super::{Error, LABEL_HOST, LABEL_INSTANCE, LABEL_MANAGED, LABEL_OWNER, LABEL_SESSION};

pub use super::{CACHE_ENV, ENV, INIT_USER, WORKSPACE};

/// Who owns a container: this server instance, on this host.
#[derive(Debug, Clone)]
pub struct Owner {
    /// Instance id.
    pub instance: String,
    /// Host id (hostname and boot id).
    pub host: String,
}

impl Owner {
    /// The labels of everything this instance makes (ours, its instance, its host), with
    /// `more` besides: how a sweep finds what a dead instance left.
    pub fn labels_with(&self, more: &[(&str, &str)]) -> HashMap<String, String> {
        let mut labels = HashMap::from([
            (LABEL_MANAGED.to_owned(), "1".to_owned()),
            (LABEL_INSTANCE.to_owned(), self.instance.clone()),
            (LABEL_HOST.to_owned(), self.host.clone()),
        ]);
        labels.extend(more.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        labels
    }

    fn labels(&self, session: &str, principal: &str) -> HashMap<String, String> {
        self.labels_with(&[(LABEL_SESSION, session), (LABEL_OWNER, principal)])
    }
}

/// The fence every container of ours stands in: bounded memory (swap equal to it, so none)
/// and processes, no capabilities, no new privileges (and our seccomp profile where chosen),
/// the network named (`none` unless said). Sessions, utilities, heartbeats, the packer, the
/// installer and the egress proxy all start from [`hardened`], so their fences cannot drift.
#[derive(Debug, Clone)]
pub struct Fence<'a> {
    /// Memory and memory + swap, bytes.
    pub memory: i64,
    /// Processes.
    pub pids: i64,
    /// Our seccomp profile (JSON), or the engine's default.
    pub seccomp: Option<&'a str>,
    /// The OCI runtime; `None`: the engine's default.
    pub runtime: Option<String>,
    /// `none`, or a network the container needs.
    pub network: &'a str,
    /// A read-only root filesystem.
    pub read_only: bool,
}

/// The hardened host configuration of `fence`; each kind of container adds what it needs.
pub fn hardened(fence: Fence<'_>) -> HostConfig {
    HostConfig {
        network_mode: Some(fence.network.to_owned()),
        cap_drop: Some(vec!["ALL".into()]),
        security_opt: Some(
            std::iter::once("no-new-privileges:true".to_owned())
                .chain(fence.seccomp.map(|p| format!("seccomp={p}")))
                .collect(),
        ),
        runtime: fence.runtime,
        readonly_rootfs: Some(fence.read_only),
        memory: Some(fence.memory),
        memory_swap: Some(fence.memory),
        pids_limit: Some(fence.pids),
        ..Default::default()
    }
}

/// No log kept by the engine: output travels over attach, and a log driver would keep what
/// the code prints on the host's disk.
pub fn no_log() -> Option<HostConfigLogConfig> {
    Some(HostConfigLogConfig { typ: Some("none".into()), config: None })
}

/// Never restarted by the engine: a container that stops is ours to judge.
pub fn no_restart() -> Option<RestartPolicy> {
    Some(RestartPolicy { name: Some(RestartPolicyNameEnum::NO), maximum_retry_count: None })
}

/// Options of a tmpfs-backed workspace volume of `mb` MiB owned by `uid`: a hard bound on
/// bytes (fallocated blocks included) and inodes (256 per MiB) on any filesystem.
pub fn tmpfs_workspace_options(mb: u64, uid: u32) -> HashMap<String, String> {
    let o =
        format!("size={mb}m,nr_inodes={},uid={uid},gid={uid},mode=0755,nosuid,nodev", mb.saturating_mul(256).max(1024));
    HashMap::from([("type".into(), "tmpfs".into()), ("device".into(), "tmpfs".into()), ("o".into(), o)])
}

/// A created and started session container.
#[derive(Debug, Clone)]
pub struct Created {
    /// Container id.
    pub id: String,
    /// Workspace volume name.
    pub volume: String,
    /// The uid (and gid) the code runs as, its own (`identity::pick`).
    pub uid: u32,
}

/// gVisor's own threads (its Sentry and gofer) count in the sandbox's pids cgroup: 38 idle
/// and 44 after one exec, measured on Docker 20.10 with runsc from Debian. They get room of
/// their own, so the code keeps the budget `--pids` gives it under either runtime.
const GVISOR_PIDS: i64 = 64;

/// What the engine found at start that shapes every sandbox: the runtime chosen (`auto`
/// settled), whether it is gVisor, and the seccomp profile sandboxes get.
#[derive(Debug, Clone, Default)]
pub struct Sandboxing {
    /// The OCI runtime of sandboxes; `None`: the engine's default.
    pub runtime: Option<String>,
    /// The runtime is gVisor.
    pub gvisor: bool,
    /// Our seccomp profile (JSON), when sandboxes get it instead of Docker's.
    pub seccomp_profile: Option<std::sync::Arc<str>>,
}

/// A session's network: the engine puts the container on it with these DNS servers and
/// environment variables (the owner of egress says what they are).
#[derive(Debug, Clone)]
pub struct NetworkJoin {
    /// The network's name.
    pub network: String,
    /// Its DNS servers.
    pub dns: Vec<String>,
    /// Variables added to the container's fixed environment.
    pub env: Vec<String>,
}

/// A session container, as plain data: its limits from the settings of its environment, the
/// engine facts, its extra mounts and its network. The owners build it; the engine asks nobody.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Memory (and memory + swap), MiB.
    pub memory_mb: u64,
    /// CPUs.
    pub cpus: f64,
    /// Processes of the code.
    pub pids: i64,
    /// `/tmp`, MiB.
    pub tmp_mb: u64,
    /// A hard bound on the workspace (a tmpfs volume), MiB; `None`: a plain volume.
    pub workspace_mb: Option<u64>,
    /// Where the code's uid is picked from.
    pub uid_range: identity::UidRange,
    /// Runtime and seccomp.
    pub sandboxing: Sandboxing,
    /// Mounts besides the workspace (the layer store, read-only host folders).
    pub mounts: Vec<Mount>,
    /// The session's network, when it has egress; `None`: no network at all.
    pub network: Option<NetworkJoin>,
    /// How long the sandbox outlives its server (`tether`), told to its keeper.
    pub orphan_after: std::time::Duration,
}

/// A read-only bind mount of a host folder that never propagates mounts either way.
pub fn read_only_bind(host: &std::path::Path, path: &str) -> Mount {
    Mount {
        target: Some(path.to_owned()),
        source: Some(host.to_string_lossy().into_owned()),
        typ: Some(MountType::BIND),
        read_only: Some(true),
        bind_options: Some(bollard::models::MountBindOptions {
            propagation: Some(bollard::models::MountBindOptionsPropagationEnum::RPRIVATE),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The hardened host configuration of a session container.
pub fn host_config(spec: &Spec, volume: &str) -> HostConfig {
    let memory = i64::try_from(spec.memory_mb << 20).unwrap_or(i64::MAX);
    let ulimit = |name: &str, soft: i64, hard: i64| ResourcesUlimits {
        name: Some(name.into()),
        soft: Some(soft),
        hard: Some(hard),
    };
    let sandboxing = &spec.sandboxing;
    let fence = Fence {
        memory,
        pids: if sandboxing.gvisor { spec.pids + GVISOR_PIDS } else { spec.pids },
        seccomp: sandboxing.seccomp_profile.as_deref(),
        runtime: sandboxing.runtime.clone(),
        network: "none",
        read_only: true,
    };
    HostConfig {
        tmpfs: Some(HashMap::from([(
            "/tmp".into(),
            format!("rw,nosuid,nodev,size={}m,nr_inodes=16384,mode=1777", spec.tmp_mb),
        )])),
        mounts: Some(vec![Mount {
            target: Some(WORKSPACE.into()),
            source: Some(volume.into()),
            typ: Some(MountType::VOLUME),
            ..Default::default()
        }]),
        // Validated to a small positive number of CPUs: the product fits.
        #[allow(clippy::cast_possible_truncation)]
        nano_cpus: Some((spec.cpus * 1e9) as i64),
        ulimits: Some(vec![ulimit("nofile", 1024, 1024), ulimit("fsize", 1 << 30, 1 << 30), ulimit("core", 0, 0)]),
        init: Some(true),
        ipc_mode: Some("private".into()),
        shm_size: Some(64 << 20),
        oom_score_adj: Some(500),
        privileged: Some(false),
        log_config: no_log(),
        restart_policy: no_restart(),
        auto_remove: Some(false),
        ..hardened(fence)
    }
}

/// Creates the workspace volume and the container of one session, and starts it.
pub async fn create(
    docker: &dyn Engine,
    spec: &Spec,
    image: &str,
    owner: &Owner,
    session: &str,
    principal: &str,
) -> Result<Created, Error> {
    // A serial keeps names unique when a session is recreated after its container died.
    let serial = next_serial();
    let name = format!("pyberth-{}-{}-{serial}", owner.instance, session);
    let uid = identity::pick(docker, spec.uid_range).await?;
    let mut labels = owner.labels(session, principal);
    labels.insert(LABEL_UID.to_owned(), uid.to_string());
    let mut request =
        VolumeCreateRequest { name: Some(name.clone()), labels: Some(labels.clone()), ..Default::default() };
    if let Some(mb) = spec.workspace_mb {
        // A hard size and inode bound on any filesystem: tmpfs through the local driver,
        // owned by the code's uid (a tmpfs has no copy-up from the image).
        request.driver = Some("local".into());
        request.driver_opts = Some(tmpfs_workspace_options(mb, uid));
    }
    if let Err(e) = new_volume(docker, request).await {
        identity::release(uid);
        return Err(e);
    }
    let made = Created { id: name.clone(), volume: name, uid };
    match make(docker, spec, image, &made, labels).await {
        Ok(id) => Ok(Created { id, ..made }),
        Err(e) => {
            destroy(docker, &made).await;
            Err(e)
        }
    }
}

/// A new container, started, for a session whose container is gone but whose workspace
/// volume `volume` (and keep volume) stayed: an orphan its tether stopped, which the engine
/// then removed (docs/design.md D12). Same uid (its files are that uid's, its tmpfs is made
/// for it), same name as the volume. Nothing is copied back and no tether held yet: the caller
/// does both, in that order ([`super::tether::COPY_BACK`]). On failure the volumes stay.
#[allow(clippy::too_many_arguments)] // a session's parts, as `create` takes them, and its volume
pub async fn recreate(
    docker: &dyn Engine,
    spec: &Spec,
    image: &str,
    owner: &Owner,
    session: &str,
    principal: &str,
    volume: &str,
    uid: u32,
) -> Result<Created, Error> {
    // Never an empty, unlabelled volume made by a mount in its place: gone is gone.
    docker.inspect_volume(volume).await?;
    identity::reserve(uid);
    let mut labels = owner.labels(session, principal);
    labels.insert(LABEL_UID.to_owned(), uid.to_string());
    // The name is the volume's, as it was the old container's: gone by now, or going.
    let opts = RemoveContainerOptionsBuilder::default().force(true).build();
    for _ in 0..50 {
        match docker.remove_container(volume, Some(opts.clone())).await {
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => break,
            Ok(()) => {}
            Err(e) if removal_under_way(&e) => {}
            Err(e) => return Err(e.into()),
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let made = Created { id: volume.to_owned(), volume: volume.to_owned(), uid };
    let id = make(docker, spec, image, &made, labels).await?;
    Ok(Created { id, ..made })
}

/// Creates and starts the container named `made.id` on the workspace volume `made.volume`
/// (and, for a tmpfs workspace, its keep volume); returns its id. On failure what it made of
/// the container is removed; the volumes are the caller's.
async fn make(
    docker: &dyn Engine,
    spec: &Spec,
    image: &str,
    made: &Created,
    labels: HashMap<String, String>,
) -> Result<String, Error> {
    let mut hc = host_config(spec, &made.volume);
    // Removed by the engine once it stops: a sandbox its tether stopped leaves its volumes
    // only, nothing on `docker ps -a` (issue 26); a server recreates it on them.
    hc.auto_remove = Some(true);
    if let Some(mounts) = hc.mounts.as_mut() {
        mounts.extend(spec.mounts.iter().cloned());
        // Where an orphan's tmpfs workspace is kept on disk (`tether`).
        if spec.workspace_mb.is_some() {
            super::tether::add_keep(docker, &made.volume, &labels, mounts).await?;
        }
    }
    let mut body = ContainerCreateBody {
        image: Some(image.into()),
        cmd: Some(vec!["sleep".into(), "infinity".into()]),
        user: Some(INIT_USER.into()),
        working_dir: Some(WORKSPACE.into()),
        env: Some(ENV.iter().chain(&CACHE_ENV).map(|s| (*s).to_owned()).chain([orphan_env(spec)]).collect()),
        labels: Some(labels),
        network_disabled: Some(true),
        host_config: Some(hc),
        ..Default::default()
    };
    if let Some(join) = &spec.network {
        // Its own network instead of none; DNS points where the owner of the network says.
        body.network_disabled = Some(false);
        body.env.get_or_insert_with(Vec::new).extend(join.env.iter().cloned());
        let hc = body.host_config.get_or_insert_with(HostConfig::default);
        hc.network_mode = Some(join.network.clone());
        hc.dns = Some(join.dns.clone());
        hc.dns_search = Some(Vec::new());
        hc.dns_options = Some(Vec::new());
    }
    let opts = CreateContainerOptionsBuilder::default().name(&made.id).build();
    let id = docker.create_container(Some(opts), body).await?.id;
    if let Err(e) = docker.start_container(&id, None).await {
        remove_container(docker, &id).await;
        return Err(e.into());
    }
    Ok(id)
}

fn orphan_env(spec: &Spec) -> String {
    format!("{}={}", super::tether::ORPHAN_ENV, spec.orphan_after.as_secs())
}

/// Removes a session's container (killing it) and its volumes. Failures are logged, not
/// returned: cleanup must go on for the other resources, and the sweep catches what is left.
pub async fn destroy(docker: &dyn Engine, c: &Created) {
    remove_container(docker, &c.id).await;
    for volume in [c.volume.clone(), super::tether::keep_volume(&c.volume)] {
        remove_volume_once_free(docker, &volume).await;
    }
    identity::release(c.uid);
}

/// Removes a volume, waiting (up to 10 s) while the engine still counts it in use: a
/// container that stopped by itself is removed by the engine (`AutoRemove`) a moment later,
/// and its volumes are free only then.
async fn remove_volume_once_free(docker: &dyn Engine, name: &str) {
    let opts = RemoveVolumeOptionsBuilder::default().force(true).build();
    for _ in 0..50 {
        match docker.remove_volume(name, Some(opts.clone())).await {
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 409, .. }) => {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Ok(()) | Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => return,
            Err(e) => {
                tracing::warn!(volume = %name, error = %e, "cannot remove volume");
                return;
            }
        }
    }
    tracing::warn!(volume = %name, "cannot remove volume: still in use after 10 s");
}

use super::next_serial;

/// Whether Docker reported an out-of-memory kill in the container since `since`. An exec
/// killed by the OOM killer exits 137 but leaves `State.OOMKilled` false; the event is the
/// only sign (docs/threat-model.md §5).
pub async fn oom_since(docker: &dyn Engine, id: &str, since: std::time::SystemTime) -> bool {
    use futures::StreamExt;
    let secs = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let since = secs(since).saturating_sub(1).to_string();
    let until = (secs(std::time::SystemTime::now()) + 1).to_string();
    let filters = HashMap::from([("container", vec![id]), ("event", vec!["oom"])]);
    let opts = bollard::query_parameters::EventsOptionsBuilder::default()
        .since(&since)
        .until(&until)
        .filters(&filters)
        .build();
    let found = async {
        let mut events = Box::pin(docker.events(Some(opts)).filter(|e| futures::future::ready(e.is_ok())));
        events.next().await.is_some()
    };
    matches!(tokio::time::timeout(std::time::Duration::from_secs(5), found).await, Ok(true))
}

/// Whether the container is running.
pub async fn is_running(docker: &dyn Engine, id: &str) -> Result<bool, Error> {
    match docker.inspect_container(id, None).await {
        Ok(c) => Ok(c.state.and_then(|s| s.running).unwrap_or(false)),
        Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The CPU time every process of the container has used so far, in nanoseconds, as the
/// engine reads it from the container's cgroup: outside the sandbox, so no code in it can
/// forge it. `None` when the engine does not say. Can take a second (the engine samples its
/// containers once a second).
pub async fn cpu_ns(docker: &dyn Engine, id: &str) -> Option<u64> {
    use futures::StreamExt as _;
    let opts = bollard::query_parameters::StatsOptionsBuilder::default().stream(false).one_shot(true).build();
    let stats = docker.stats(id, Some(opts)).next().await?.ok()?;
    stats.cpu_stats?.cpu_usage?.total_usage
}

/// The memory a container's cgroup is charged now, bytes, less its inactive file pages (page
/// cache the kernel takes back first; the bench's idle-memory row counts the same). `None`
/// when the engine does not say.
pub async fn memory_bytes(docker: &dyn Engine, id: &str) -> Option<u64> {
    use futures::StreamExt as _;
    let opts = bollard::query_parameters::StatsOptionsBuilder::default().stream(false).one_shot(true).build();
    let m = docker.stats(id, Some(opts)).next().await?.ok()?.memory_stats?;
    let stats = m.stats.unwrap_or_default();
    let inactive = ["total_inactive_file", "inactive_file"].iter().find_map(|n| stats.get(*n).copied());
    Some(m.usage?.saturating_sub(inactive.unwrap_or(0)))
}

/// Removes (killing) a container; failures are logged.
pub async fn remove_container(docker: &dyn Engine, id: &str) {
    super::tether::release(id);
    let opts = RemoveContainerOptionsBuilder::default().force(true).v(true).build();
    match docker.remove_container(id, Some(opts)).await {
        Ok(()) => {}
        Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => {}
        Err(e) if removal_under_way(&e) => {}
        Err(e) => tracing::warn!(container = %short(id), error = %e, "cannot remove container"),
    }
}

/// Docker's 409 for a container another of our own calls is already removing (a close and the
/// final sweep of a shutdown meet): the container goes either way, nothing to warn about.
pub(crate) fn removal_under_way(e: &bollard::errors::Error) -> bool {
    matches!(e, bollard::errors::Error::DockerResponseServerError { status_code: 409, message }
        if message.contains("already in progress"))
}

/// A short container id for logs.
pub fn short(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

pub use super::inventory::{Found, Inventory, inventory, remove_leftover_container, remove_leftover_volume, sweep};
pub use super::volume::{new_volume, remove_volume};

#[cfg(test)]
#[path = "container_tests.rs"]
mod tests;
