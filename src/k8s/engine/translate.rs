//! Docker-shaped requests and answers in Kubernetes terms: a pod name from a container name, a
//! session pod from a container body, a pod back as a container summary or inspection, and a
//! label filter as a label selector.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bollard::models::{
    ContainerConfig, ContainerCreateBody, ContainerInspectResponse, ContainerState, ContainerStateStatusEnum,
    ContainerSummary, ContainerSummaryStateEnum, MountType,
};
use k8s_openapi::api::core::v1::Pod;
use sha2::{Digest, Sha256};

use crate::docker::container::{Sandboxing, Spec};
use crate::docker::identity::LABEL_UID;
use crate::k8s::labels::{ORIGINAL_PREFIX, value};
use crate::k8s::pod::{LABEL_SANDBOX, PodSettings};
use crate::packages::STORE_DIR;

/// Annotation that keeps the container name a pod was made for (its name had to be made valid).
pub const ANNOTATION_NAME: &str = "pyberth.io/container-name";

/// A pod name (DNS-1123 label: at most 63 of `[a-z0-9-]`, alphanumeric at both ends) for the
/// container name `name`: itself when valid, else a cleaned prefix and 12 hex digits of its
/// SHA-256, so two names that clean alike still get two pods. The same name always maps to
/// the same pod, so no record is needed to find it again.
pub fn pod_name(name: &str) -> String {
    let valid = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    };
    if valid(name) {
        return name.to_owned();
    }
    let mut clean = String::new();
    for c in name.chars().map(|c| c.to_ascii_lowercase()) {
        let c = if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { '-' };
        if !(c == '-' && (clean.is_empty() || clean.ends_with('-'))) {
            clean.push(c);
        }
    }
    clean.truncate(50);
    let clean = clean.trim_end_matches('-');
    let digest = Sha256::digest(name.as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    if clean.is_empty() { format!("p-{hex}") } else { format!("{clean}-{hex}") }
}

/// `size=64m` (or `64M`) of a mount option string, in MiB.
fn size_mb(options: &str) -> Option<u64> {
    options.split(',').find_map(|o| {
        let v = o.strip_prefix("size=")?;
        let digits = v.trim_end_matches(['m', 'M']);
        (digits.len() + 1 == v.len()).then(|| digits.parse().ok()).flatten()
    })
}

/// Why a container body has no session pod.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// A setting the pod cannot carry.
    #[error("{0}")]
    Unsupported(String),
    /// The body lacks what every session container of ours has.
    #[error("not a session container of pyberth: {0}")]
    Malformed(&'static str),
}

/// The session pod for a container body: its limits, uid, labels and environment, as
/// `container::make` wrote them; `workspace_mb` is the size of its workspace volume, when
/// bounded. Host folders are refused (not supported on Kubernetes yet); a session network
/// becomes the `pyberth.io/egress=proxy` label and the egress variables; the layer store the
/// claim's `sets/` (`settings.layer_claim`; without one, no store).
pub fn session_pod(
    name: &str,
    body: &ContainerCreateBody,
    workspace_mb: Option<u64>,
    settings: &PodSettings,
) -> Result<Pod, Refused> {
    let labels = body.labels.clone().unwrap_or_default();
    let uid: u32 = labels.get(LABEL_UID).and_then(|u| u.parse().ok()).ok_or(Refused::Malformed("no uid label"))?;
    let hc = body.host_config.clone().unwrap_or_default();
    // A session network (egress): the pod is labelled to reach the proxy pod (NetworkPolicy),
    // and keeps the proxy and CA variables the egress owner added to the fixed ones.
    let network = hc.network_mode.clone().filter(|n| n != "none").map(|network| {
        let fixed: Vec<&str> = crate::docker::ENV
            .iter()
            .chain(&crate::docker::CACHE_ENV)
            .filter_map(|kv| kv.split_once('=').map(|(k, _)| k))
            .chain([crate::docker::tether::ORPHAN_ENV])
            .collect();
        let env = body.env.iter().flatten().filter(|kv| kv.split_once('=').is_some_and(|(k, _)| !fixed.contains(&k)));
        crate::docker::container::NetworkJoin { network, dns: Vec::new(), env: env.cloned().collect() }
    });
    let mounts = hc.mounts.unwrap_or_default();
    // The layer store, which every session mounts: on a cluster the claim's `sets/`.
    let store = mounts.iter().any(|m| m.typ == Some(MountType::VOLUME) && m.target.as_deref() == Some(STORE_DIR));
    let mounts: Vec<_> = mounts.into_iter().filter(|m| m.typ == Some(MountType::BIND)).collect();
    let tmp = hc.tmpfs.as_ref().and_then(|t| t.get("/tmp")).and_then(|o| size_mb(o));
    let orphan = body
        .env
        .iter()
        .flatten()
        .find_map(|e| e.strip_prefix(&format!("{}=", crate::docker::tether::ORPHAN_ENV))?.parse::<u64>().ok());
    let mb = |bytes: Option<i64>| u64::try_from(bytes.unwrap_or(0) >> 20).unwrap_or(0);
    #[allow(clippy::cast_precision_loss)] // nano-CPUs of a few CPUs: exact in an f64
    let cpus = hc.nano_cpus.unwrap_or(1_000_000_000) as f64 / 1e9;
    let spec = Spec {
        memory_mb: mb(hc.memory).max(16),
        cpus,
        pids: hc.pids_limit.unwrap_or(256),
        tmp_mb: tmp.unwrap_or(64),
        workspace_mb,
        uid_range: Default::default(),
        sandboxing: Sandboxing::default(),
        mounts,
        network,
        orphan_after: Duration::from_secs(orphan.unwrap_or(600)),
    };
    let ours: BTreeMap<String, String> = labels.into_iter().collect();
    let image = body.image.clone().ok_or(Refused::Malformed("no image"))?;
    let mut pod = crate::k8s::pod::pod(&spec, settings, &image, &pod_name(name), uid, &ours)
        .map_err(|e| Refused::Unsupported(e.to_string()))?;
    pod.metadata.annotations.get_or_insert_with(BTreeMap::new).insert(ANNOTATION_NAME.into(), name.to_owned());
    if let (true, Some(claim)) = (store, &settings.layer_claim) {
        crate::k8s::pod::with_store(&mut pod, claim, STORE_DIR);
    }
    Ok(pod)
}

/// The container name a pod was made for. Its annotation is believed only when it names this
/// very pod (`pod_name` of it is the pod's name): whoever can make pods could annotate one
/// with a session's container name, and the owners act on that name (a sweep removes it,
/// adoption keeps it), so a pod that lies is listed under its own name and reaches no other.
pub fn container_name(pod: &Pod) -> String {
    let own = pod.metadata.name.clone().unwrap_or_default();
    let kept = pod.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_NAME));
    kept.filter(|n| pod_name(n) == own).cloned().unwrap_or(own)
}

/// Our labels of a pod, as the owners gave them: hashed values back from their annotations,
/// the pod's own `pyberth.io/` labels left out. An original is believed only when it hashes
/// to the label's value: an annotation cannot make a pod another principal's or instance's.
pub fn our_labels(pod: &Pod) -> HashMap<String, String> {
    let notes = pod.metadata.annotations.clone().unwrap_or_default();
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    labels
        .into_iter()
        .filter(|(k, _)| !k.starts_with("pyberth.io/"))
        .map(|(k, v)| {
            let original = notes.get(&format!("{ORIGINAL_PREFIX}{k}")).filter(|o| value(o) == v).cloned();
            (k, original.unwrap_or(v))
        })
        .collect()
}

fn phase(pod: &Pod) -> &str {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("Pending")
}

fn image(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.containers.first()).and_then(|c| c.image.clone())
}

/// A pod as `docker ps` lists a container.
pub fn summary(pod: &Pod) -> ContainerSummary {
    summary_as(pod, &container_name(pod))
}

/// A pod as `docker ps` lists container `name`.
pub fn summary_as(pod: &Pod, name: &str) -> ContainerSummary {
    let name = name.to_owned();
    let state = match phase(pod) {
        "Running" => ContainerSummaryStateEnum::RUNNING,
        "Pending" => ContainerSummaryStateEnum::CREATED,
        _ => ContainerSummaryStateEnum::EXITED,
    };
    ContainerSummary {
        id: Some(name.clone()),
        names: Some(vec![format!("/{name}")]),
        image: image(pod),
        labels: Some(our_labels(pod)),
        state: Some(state),
        ..Default::default()
    }
}

/// A pod as `docker inspect` shows a container.
pub fn inspect(pod: &Pod) -> ContainerInspectResponse {
    inspect_as(pod, &container_name(pod))
}

/// A pod as `docker inspect` shows container `name`.
pub fn inspect_as(pod: &Pod, name: &str) -> ContainerInspectResponse {
    let name = name.to_owned();
    let running = phase(pod) == "Running";
    let status = match phase(pod) {
        "Running" => ContainerStateStatusEnum::RUNNING,
        "Pending" => ContainerStateStatusEnum::CREATED,
        _ => ContainerStateStatusEnum::EXITED,
    };
    ContainerInspectResponse {
        id: Some(name.clone()),
        name: Some(format!("/{name}")),
        image: image(pod),
        state: Some(ContainerState { running: Some(running), status: Some(status), ..Default::default() }),
        config: Some(ContainerConfig { labels: Some(our_labels(pod)), image: image(pod), ..Default::default() }),
        ..Default::default()
    }
}

/// Docker's `label` filters (`key` or `key=value`) as a label selector over our session pods;
/// values made valid as the pods' labels were, so a hashed principal is still found.
pub fn selector(filters: Option<&HashMap<String, Vec<String>>>) -> String {
    selector_of(&format!("{LABEL_SANDBOX}=true"), filters)
}

/// The same over our egress proxy pods.
pub fn proxy_selector(filters: Option<&HashMap<String, Vec<String>>>) -> String {
    use crate::k8s::pod::{LABEL_APP, PROXY_APP};
    selector_of(&format!("{LABEL_APP}={PROXY_APP}"), filters)
}

fn selector_of(kind: &str, filters: Option<&HashMap<String, Vec<String>>>) -> String {
    let wanted = filters.and_then(|f| f.get("label")).map(Vec::as_slice).unwrap_or_default();
    let mut terms = vec![kind.to_owned()];
    for w in wanted {
        terms.push(match w.split_once('=') {
            Some((k, v)) => format!("{k}={}", value(v)),
            None => w.clone(),
        });
    }
    terms.join(",")
}
