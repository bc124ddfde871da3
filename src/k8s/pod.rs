//! The pod of one session: what `container::host_config` gives a Docker container, in
//! Kubernetes terms (docs/kubernetes.md has the table; what has no pod field says so there).
//!
//! One difference shapes the rest: `pods/exec` cannot pick a user (kubernetes#30656), so the
//! whole pod runs as the code's uid, PID 1 included. PID 1 is `sleep infinity` with no signal
//! handlers, which the kernel shields from signals sent inside its own pid namespace, so code
//! still cannot stop it (pid_namespaces(7)).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, EnvVar, PersistentVolumeClaimVolumeSource, Pod, PodSecurityContext,
    PodSpec, ResourceRequirements, SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::docker::container::Spec;
use crate::docker::{CACHE_ENV, ENV, WORKSPACE};

use super::CONTAINER;

/// Label that says whether a sandbox pod may reach the egress proxy: the NetworkPolicies of
/// `deploy/kubernetes/` select on it (`proxy`), everything else is denied all traffic.
pub const LABEL_EGRESS: &str = "pyberth.io/egress";
/// Label on every session pod: the default-deny NetworkPolicy selects on it.
pub const LABEL_SANDBOX: &str = "pyberth.io/sandbox";

/// The seccomp profile of sandbox pods.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Seccomp {
    /// The container runtime's default profile.
    #[default]
    RuntimeDefault,
    /// A profile file already on every node, relative to the kubelet's seccomp directory.
    Localhost(String),
}

/// What a pod needs beyond our container settings: cluster facts from the configuration.
#[derive(Debug, Clone, Default)]
pub struct PodSettings {
    /// `runtimeClassName` (e.g. `gvisor`); `None`: the cluster's default runtime.
    pub runtime_class: Option<String>,
    /// The seccomp profile.
    pub seccomp: Seccomp,
    /// Bound on the pod's disk (image layers' writable part, logs): `ephemeral-storage`, MiB.
    pub ephemeral_mb: u64,
    /// The layer store's PersistentVolumeClaim (`k8s_layer_claim`); `None`: no store, and
    /// package installs are refused.
    pub layer_claim: Option<String>,
}

/// The uid (and gid) of the layer store's writer and reader pods, owner of its `sets/`
/// directory: below every `--uid-range` (which starts at 65536 or above), so no session's code
/// runs as it, and not root (Pod Security `restricted` admits no root pod).
pub const STORE_UID: u32 = 65533;
/// The directory of the store's claim that holds the sets, mode 0711 and the store uid's:
/// sessions mount only it (`subPath`), so none can list the sets.
pub const STORE_SETS: &str = "sets";
/// Label on helper pods (installer, marker check, the store's writer and reader): plain pods in
/// agent-sandbox mode too, where sweeps find them by it.
pub const LABEL_HELPER: &str = "pyberth.io/helper";
/// The pod volume name of the layer store.
const STORE_VOLUME: &str = "layers";

/// Why a spec has no pod.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// Host bind mounts (the layer store, read-only host folders) have no pod equivalent yet.
    #[error(
        "the Kubernetes engine cannot mount host folders (the layer store, `mounts`) yet: remove them from this environment"
    )]
    HostMounts,
}

fn mib(mb: u64) -> Quantity {
    Quantity(format!("{mb}Mi"))
}

/// CPUs as millicores, the unit the API server keeps.
fn cpu(cpus: f64) -> Quantity {
    // Validated to a small positive number of CPUs by the configuration.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let milli = (cpus * 1000.0).round().max(1.0) as u64;
    Quantity(format!("{milli}m"))
}

/// A memory-backed emptyDir: a hard size bound (it counts against the pod's memory limit),
/// unlike a disk emptyDir, whose limit the kubelet only monitors and evicts on.
fn memory_dir(name: &str, mb: u64) -> Volume {
    Volume {
        name: name.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource { medium: Some("Memory".into()), size_limit: Some(mib(mb)) }),
        ..Default::default()
    }
}

fn mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount { name: name.to_owned(), mount_path: path.to_owned(), ..Default::default() }
}

/// The environment of the sandbox container: our fixed one, the cache variables, the keeper's
/// orphan grace, and what the owner of egress adds when the session has egress.
fn env(spec: &Spec) -> Vec<EnvVar> {
    let orphan = format!("{}={}", crate::docker::tether::ORPHAN_ENV, spec.orphan_after.as_secs());
    let extra = spec.network.iter().flat_map(|n| n.env.iter().cloned());
    ENV.iter()
        .chain(&CACHE_ENV)
        .map(|s| (*s).to_owned())
        .chain([orphan])
        .chain(extra)
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some(EnvVar { name: k.to_owned(), value: Some(v.to_owned()), value_from: None })
        })
        .collect()
}

fn security(uid: u32, seccomp: &Seccomp) -> (PodSecurityContext, SecurityContext) {
    let id = i64::from(uid);
    let profile = match seccomp {
        Seccomp::RuntimeDefault => SeccompProfile { type_: "RuntimeDefault".into(), localhost_profile: None },
        Seccomp::Localhost(p) => SeccompProfile { type_: "Localhost".into(), localhost_profile: Some(p.clone()) },
    };
    let pod = PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(id),
        run_as_group: Some(id),
        fs_group: Some(id),
        seccomp_profile: Some(profile.clone()),
        ..Default::default()
    };
    let container = SecurityContext {
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        run_as_user: Some(id),
        run_as_group: Some(id),
        capabilities: Some(Capabilities { add: None, drop: Some(vec!["ALL".into()]) }),
        seccomp_profile: Some(profile),
        ..Default::default()
    };
    (pod, container)
}

/// The session pod `name` of image `image`, running as `uid`, carrying `labels` (made valid,
/// with the originals of hashed values as annotations).
pub fn pod(
    spec: &Spec,
    settings: &PodSettings,
    image: &str,
    name: &str,
    uid: u32,
    labels: &BTreeMap<String, String>,
) -> Result<Pod, PodError> {
    if !spec.mounts.is_empty() {
        return Err(PodError::HostMounts);
    }
    let (mut labels, annotations) = super::labels::split(labels);
    labels.insert(LABEL_SANDBOX.into(), "true".into());
    labels.insert(LABEL_EGRESS.into(), if spec.network.is_some() { "proxy" } else { "none" }.into());
    // Guaranteed QoS: requests equal limits, so the node never overcommits a sandbox.
    let limits = BTreeMap::from([
        ("cpu".to_owned(), cpu(spec.cpus)),
        ("memory".to_owned(), mib(spec.memory_mb)),
        ("ephemeral-storage".to_owned(), mib(settings.ephemeral_mb.max(1))),
    ]);
    let (pod_security, container_security) = security(uid, &settings.seccomp);
    // Without a size bound of its own the workspace is still bounded by the memory limit.
    let workspace_mb = spec.workspace_mb.unwrap_or(spec.memory_mb);
    let container = Container {
        name: CONTAINER.into(),
        image: Some(image.to_owned()),
        // Never pulled from a registry at session start: the image is the operator's, on the nodes.
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec!["sleep".into(), "infinity".into()]),
        working_dir: Some(WORKSPACE.into()),
        env: Some(env(spec)),
        resources: Some(ResourceRequirements { limits: Some(limits.clone()), requests: Some(limits), claims: None }),
        security_context: Some(container_security),
        volume_mounts: Some(vec![mount("workspace", WORKSPACE), mount("tmp", "/tmp"), mount("shm", "/dev/shm")]),
        stdin: Some(false),
        tty: Some(false),
        ..Default::default()
    };
    let volumes = vec![memory_dir("workspace", workspace_mb), memory_dir("tmp", spec.tmp_mb), memory_dir("shm", 64)];
    let mut pod = one_container(name, labels, annotations, container, pod_security, volumes);
    if let Some(spec) = pod.spec.as_mut() {
        spec.runtime_class_name.clone_from(&settings.runtime_class);
    }
    Ok(pod)
}

/// A pod of one container, with what every pod of ours carries: no restart, no service
/// account token or service links, no namespace of the node shared, `pod_security`, and
/// no grace at deletion (nothing in it needs a graceful stop).
fn one_container(
    name: &str,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    container: Container,
    pod_security: PodSecurityContext,
    volumes: Vec<Volume>,
) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(labels),
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![container],
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            host_network: Some(false),
            host_pid: Some(false),
            host_ipc: Some(false),
            share_process_namespace: Some(false),
            security_context: Some(pod_security),
            volumes: Some(volumes),
            termination_grace_period_seconds: Some(0),
            ..Default::default()
        }),
        status: None,
    }
}

/// The layer store's claim as a pod volume, read-only in the volume source where `read_only`:
/// the kubelet then applies no fsGroup to it, so a session's start never re-groups the store.
pub fn store_volume(claim: &str, read_only: bool) -> Volume {
    let source = PersistentVolumeClaimVolumeSource { claim_name: claim.to_owned(), read_only: Some(read_only) };
    Volume { name: STORE_VOLUME.into(), persistent_volume_claim: Some(source), ..Default::default() }
}

/// The store's `sets/` read-only at `path` in a session pod (a sandbox pod mounts nothing else
/// of the claim, so it cannot list the sets: `sets/` is 0711).
pub fn with_store(pod: &mut Pod, claim: &str, path: &str) {
    let Some(spec) = pod.spec.as_mut() else { return };
    spec.volumes.get_or_insert_with(Vec::new).push(store_volume(claim, true));
    let m = VolumeMount { sub_path: Some(STORE_SETS.into()), read_only: Some(true), ..mount(STORE_VOLUME, path) };
    for c in &mut spec.containers {
        c.volume_mounts.get_or_insert_with(Vec::new).push(m.clone());
    }
}

/// Whether `pod` mounts the layer store's claim.
pub fn uses_store(pod: &Pod) -> bool {
    pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()).any(|v| v.name == STORE_VOLUME)
}

/// `pod` without the layer store (its claim could not be set up).
pub fn without_store(pod: &mut Pod) {
    let Some(spec) = pod.spec.as_mut() else { return };
    spec.volumes.iter_mut().for_each(|v| v.retain(|v| v.name != STORE_VOLUME));
    for c in &mut spec.containers {
        c.volume_mounts.iter_mut().for_each(|m| m.retain(|m| m.name != STORE_VOLUME));
    }
}

/// How a helper pod mounts the layer store's claim.
#[derive(Debug, Clone)]
pub struct StoreMount {
    /// Where.
    pub path: String,
    /// `Some("sets")` (writers and readers) or `None`, the claim's root (its one-time set-up).
    pub sub_path: Option<String>,
    /// Read-write (the claim's source too, so fsGroup applies and the store uid may write).
    pub writable: bool,
}

/// A short-lived helper pod of ours: the package installer, the marker check, the layer
/// store's writer and reader. It carries the sandbox pod's hardening; its PID 1 idles and its
/// command is an exec (`engine/helpers.rs`), so it still runs when its files are read out.
#[derive(Debug, Clone, Default)]
pub struct Helper {
    pub name: String,
    pub image: String,
    pub uid: u32,
    /// `KEY=value` strings.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub memory_mb: u64,
    /// `None`: no CPU limit (a wheels-only install uses every core, as on Docker).
    pub cpus: Option<f64>,
    pub tmp_mb: u64,
    /// Its own volumes: disk emptyDirs of a size, MiB, at a path.
    pub scratch: Vec<(String, u64)>,
    pub store: Option<StoreMount>,
    /// May reach the egress proxy (the installer).
    pub egress: bool,
    pub labels: BTreeMap<String, String>,
}

/// The pod of helper `h`: labelled a sandbox (the default-deny policy holds it), with the
/// egress label only for the installer; the store only with a layer claim (the engine refuses
/// a helper that mounts the store without one).
pub fn helper_pod(settings: &PodSettings, h: &Helper) -> Pod {
    let (mut labels, annotations) = super::labels::split(&h.labels);
    labels.insert(LABEL_SANDBOX.into(), "true".into());
    labels.insert(LABEL_EGRESS.into(), if h.egress { "proxy" } else { "none" }.into());
    labels.insert(LABEL_HELPER.into(), "true".into());
    let scratch_mb: u64 = h.scratch.iter().map(|(_, mb)| mb).sum();
    let mut limits = BTreeMap::from([
        ("memory".to_owned(), mib(h.memory_mb)),
        ("ephemeral-storage".to_owned(), mib(settings.ephemeral_mb.max(1) + scratch_mb)),
    ]);
    if let Some(cpus) = h.cpus {
        limits.insert("cpu".to_owned(), cpu(cpus));
    }
    let (mut pod_security, container_security) = security(h.uid, &settings.seccomp);
    pod_security.fs_group_change_policy = Some("OnRootMismatch".into());
    let env = h.env.iter().filter_map(|kv| kv.split_once('='));
    let env = env.map(|(k, v)| EnvVar { name: k.to_owned(), value: Some(v.to_owned()), value_from: None });
    let mut mounts = vec![mount("tmp", "/tmp")];
    let mut volumes = vec![memory_dir("tmp", h.tmp_mb)];
    for (i, (path, mb)) in h.scratch.iter().enumerate() {
        let name = format!("scratch-{i}");
        mounts.push(mount(&name, path));
        let dir = EmptyDirVolumeSource { medium: None, size_limit: Some(mib(*mb)) };
        volumes.push(Volume { name, empty_dir: Some(dir), ..Default::default() });
    }
    if let (Some(s), Some(claim)) = (&h.store, &settings.layer_claim) {
        volumes.push(store_volume(claim, !s.writable));
        mounts.push(VolumeMount {
            sub_path: s.sub_path.clone(),
            read_only: Some(!s.writable),
            ..mount(STORE_VOLUME, &s.path)
        });
    }
    let container = Container {
        name: CONTAINER.into(),
        image: Some(h.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec!["sleep".into(), "infinity".into()]),
        working_dir: h.working_dir.clone(),
        env: Some(env.collect()),
        resources: Some(ResourceRequirements { limits: Some(limits.clone()), requests: Some(limits), claims: None }),
        security_context: Some(container_security),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    let mut pod = one_container(&h.name, labels, annotations, container, pod_security, volumes);
    if let Some(spec) = pod.spec.as_mut() {
        spec.runtime_class_name.clone_from(&settings.runtime_class);
    }
    pod
}

/// Label (the NetworkPolicy `sandbox-egress-to-proxy` selects on it) and value of the egress
/// proxy's pod.
pub const LABEL_APP: &str = "app.kubernetes.io/name";
/// Its value on the proxy pod.
pub const PROXY_APP: &str = "pyberth-egress-proxy";
/// Label on a server's proxy pods, which its proxy Service selects (`engine/egress.rs`).
pub const LABEL_PROXY_OF: &str = "pyberth.io/proxy-of";
/// Where the proxy pod's image carries the pyberth executable (the server's image does).
pub const PROXY_EXE: &str = "/usr/local/bin/pyberth";
/// The proxy's uid: nobody.
const PROXY_UID: u32 = 65534;

/// The egress proxy's pod `name` of image `image` (carrying [`PROXY_EXE`]): hardened like a
/// sandbox pod (non-root, read-only root, no capabilities, no token), labelled [`PROXY_APP`],
/// not `pyberth.io/sandbox` (the default-deny policy would cut it off). PID 1 idles; the
/// proxy is an exec whose stdin and stdout the server holds, as on Docker its attach.
pub fn proxy_pod(settings: &PodSettings, image: &str, name: &str, labels: &BTreeMap<String, String>) -> Pod {
    let (mut labels, annotations) = super::labels::split(labels);
    labels.insert(LABEL_APP.into(), PROXY_APP.into());
    let limits = BTreeMap::from([
        ("cpu".to_owned(), cpu(1.0)),
        ("memory".to_owned(), mib(256)),
        ("ephemeral-storage".to_owned(), mib(64)),
    ]);
    let (pod_security, container_security) = security(PROXY_UID, &settings.seccomp);
    let container = Container {
        name: CONTAINER.into(),
        image: Some(image.to_owned()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec!["sleep".into(), "infinity".into()]),
        env: Some(vec![EnvVar {
            name: "PATH".into(),
            value: Some("/usr/local/bin:/usr/bin:/bin".into()),
            value_from: None,
        }]),
        ports: Some(vec![k8s_openapi::api::core::v1::ContainerPort {
            container_port: i32::from(crate::egress::proxy::PORT),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        resources: Some(ResourceRequirements { limits: Some(limits.clone()), requests: Some(limits), claims: None }),
        security_context: Some(container_security),
        volume_mounts: Some(vec![mount("tmp", "/tmp")]),
        ..Default::default()
    };
    one_container(name, labels, annotations, container, pod_security, vec![memory_dir("tmp", 16)])
}

/// Whether a pod spec someone else made (agent-sandbox's controller, from a template anyone
/// with write access to templates could have changed) still carries the hardening of ours,
/// field by field; the first field that does not, said. A pod that fails is never exec'd into.
pub fn hardened(spec: &k8s_openapi::api::core::v1::PodSpec) -> Result<(), String> {
    let yes = |b: Option<bool>| b == Some(true);
    if spec.automount_service_account_token != Some(false) {
        return Err("it may mount a service account token".into());
    }
    if yes(spec.host_network) || yes(spec.host_pid) || yes(spec.host_ipc) {
        return Err("it shares a namespace of the node".into());
    }
    if let Some(v) = spec.volumes.iter().flatten().find(|v| v.host_path.is_some()) {
        return Err(format!("volume {} is a folder of the node", v.name));
    }
    let ps = spec.security_context.as_ref().ok_or("it has no pod securityContext")?;
    if !yes(ps.run_as_non_root) || ps.run_as_user.is_none_or(|u| u <= 0) {
        return Err("it may run as root".into());
    }
    let unconfined = |p: Option<&SeccompProfile>| p.is_some_and(|p| p.type_ == "Unconfined");
    if unconfined(ps.seccomp_profile.as_ref()) {
        return Err("its seccomp profile is Unconfined".into());
    }
    let all = spec.containers.iter().chain(spec.init_containers.iter().flatten());
    for c in all {
        let cs = c.security_context.as_ref().ok_or(format!("container {} has no securityContext", c.name))?;
        let caps = cs.capabilities.as_ref();
        let dropped = caps.and_then(|c| c.drop.as_ref()).is_some_and(|d| d.iter().any(|x| x == "ALL"));
        let added = caps.and_then(|c| c.add.as_ref()).is_some_and(|a| !a.is_empty());
        let weak = [
            (cs.allow_privilege_escalation != Some(false), "may escalate privileges"),
            (yes(cs.privileged), "is privileged"),
            (cs.read_only_root_filesystem != Some(true), "has a writable root"),
            (!dropped || added, "keeps or adds capabilities"),
            (cs.run_as_user == Some(0) || cs.run_as_non_root == Some(false), "may run as root"),
            (unconfined(cs.seccomp_profile.as_ref()), "has an Unconfined seccomp profile"),
        ];
        if let Some((_, why)) = weak.iter().find(|(w, _)| *w) {
            return Err(format!("container {} {why}", c.name));
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "pod_tests.rs"]
mod tests;
