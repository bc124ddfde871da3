//! The simulated node: a pod becomes a container of the local Docker engine, with the pod's
//! own security context, limits and memory-backed emptyDirs, so that what pyberth asks of a
//! pod is what the agent inside gets.

use std::collections::HashMap;

use bollard::Docker;
use bollard::models::{ContainerCreateBody, HostConfig, NetworkConnectRequest};
use bollard::query_parameters::{CreateContainerOptionsBuilder, RemoveContainerOptionsBuilder};
use k8s_openapi::api::core::v1::Pod;
use pyberth::k8s::pod::{LABEL_APP, LABEL_EGRESS, PROXY_APP, PROXY_EXE};

use super::apiserver::Options;

/// Label on every container the simulator starts, with the simulator's own id: its cleanup
/// (and nobody else's) removes them.
pub(crate) const LABEL_SIM: &str = "pyberth-test.k8s-sim";

/// "512Mi", "64Mi", "1Gi" as bytes; what our pod spec and manifests write.
pub(crate) fn bytes(q: &str) -> Option<i64> {
    let (n, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let n: i64 = n.parse().ok()?;
    Some(match unit {
        "" => n,
        "Ki" => n << 10,
        "Mi" => n << 20,
        "Gi" => n << 30,
        _ => return None,
    })
}

/// "1500m" or "2" as nano-CPUs.
pub(crate) fn nano_cpus(q: &str) -> Option<i64> {
    match q.strip_suffix('m') {
        Some(milli) => milli.parse::<i64>().ok().map(|m| m * 1_000_000),
        None => q.parse::<i64>().ok().map(|c| c * 1_000_000_000),
    }
}

/// Where a pod's container is attached, as the NetworkPolicies of deploy/kubernetes/ allow
/// (the CNI's enforcement, modelled): the egress proxy on the default bridge (its way out),
/// joined to the egress network after create; a sandbox labelled `egress=proxy` on the
/// egress network only; everything else on none (default deny).
fn network_of(pod: &Pod, opts: &Options) -> (String, bool) {
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let proxy = labels.get(LABEL_APP).is_some_and(|v| v == PROXY_APP);
    match &opts.egress_network {
        Some(_) if proxy => ("bridge".into(), true),
        Some(net) if labels.get(LABEL_EGRESS).is_some_and(|v| v == "proxy") => (net.clone(), false),
        _ => ("none".into(), false),
    }
}

/// The container of `pod`: its first container's image, command, uid, environment and
/// security context; each memory emptyDir a tmpfs of its size limit; its network as
/// [`network_of`] says.
pub(crate) fn container(pod: &Pod, sim: &str, opts: &Options) -> Result<ContainerCreateBody, String> {
    let spec = pod.spec.as_ref().ok_or("a pod without spec")?;
    let c = spec.containers.first().ok_or("a pod without containers")?;
    let psc = spec.security_context.clone().unwrap_or_default();
    let sc = c.security_context.clone().unwrap_or_default();
    let uid = sc.run_as_user.or(psc.run_as_user).ok_or("the simulated node runs no pod as root")?;
    let gid = sc.run_as_group.or(psc.run_as_group).unwrap_or(uid);
    let limits = c.resources.as_ref().and_then(|r| r.limits.clone()).unwrap_or_default();
    let mut tmpfs = HashMap::new();
    let mut binds = Vec::new();
    for m in c.volume_mounts.iter().flatten() {
        let v = spec.volumes.iter().flatten().find(|v| v.name == m.name).ok_or("a mount of no volume")?;
        if let Some(claim) = &v.persistent_volume_claim {
            binds.push(claim_bind(claim, m, psc.fs_group, opts)?);
            continue;
        }
        let dir = v.empty_dir.as_ref().ok_or("the simulated node has emptyDir and claim volumes only")?;
        let size = dir.size_limit.as_ref().and_then(|q| bytes(&q.0)).ok_or("an emptyDir without a size")?;
        // Kubernetes makes emptyDirs world-writable, group fsGroup; the tmpfs mode says the same.
        tmpfs.insert(m.mount_path.clone(), format!("rw,nosuid,nodev,size={size},mode=1777"));
    }
    let mut security_opt = Vec::new();
    if sc.allow_privilege_escalation == Some(false) {
        security_opt.push("no-new-privileges:true".to_owned());
    }
    let drop = sc.capabilities.and_then(|c| c.drop).unwrap_or_default();
    let env = c.env.iter().flatten().map(|e| format!("{}={}", e.name, e.value.clone().unwrap_or_default())).collect();
    let memory = limits.get("memory").and_then(|q| bytes(&q.0));
    let (network, proxy) = network_of(pod, opts);
    if let (Some(exe), true) = (&opts.proxy_exe, proxy) {
        binds.push(format!("{}:{PROXY_EXE}:ro", exe.display()));
    }
    Ok(ContainerCreateBody {
        image: c.image.clone(),
        cmd: c.command.clone(),
        user: Some(format!("{uid}:{gid}")),
        working_dir: c.working_dir.clone(),
        env: Some(env),
        labels: Some(HashMap::from([(LABEL_SIM.to_owned(), sim.to_owned())])),
        network_disabled: Some(network == "none"),
        host_config: Some(HostConfig {
            network_mode: Some(network),
            binds: Some(binds),
            readonly_rootfs: sc.read_only_root_filesystem,
            cap_drop: Some(drop),
            security_opt: Some(security_opt),
            memory,
            memory_swap: memory,
            nano_cpus: limits.get("cpu").and_then(|q| nano_cpus(&q.0)),
            tmpfs: Some(tmpfs),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The bind of a claim's volume (`Options::claims`: its PersistentVolume is a folder of the
/// test's), as the kubelet mounts one: read-only when the source or the mount says so; a
/// `subPath` made when missing, root's, with the claim root's mode (the kubelet's
/// `SafeMakeDir(subPath, root, GetMode(root))`); and, when the volume applies fsGroup
/// (`Options::fs_group`), on a writable source with `fsGroup` whose root is not yet that
/// group's (`OnRootMismatch`), every file given to the group, group-writable, directories
/// setgid.
fn claim_bind(
    claim: &k8s_openapi::api::core::v1::PersistentVolumeClaimVolumeSource,
    m: &k8s_openapi::api::core::v1::VolumeMount,
    fs_group: Option<i64>,
    opts: &Options,
) -> Result<String, String> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let root = opts.claims.get(&claim.claim_name).ok_or(format!(
        "persistentvolumeclaim \"{}\" not found (a real node keeps the pod Pending)",
        claim.claim_name
    ))?;
    let read_only = claim.read_only == Some(true) || m.read_only == Some(true);
    let applies = opts.fs_group && claim.read_only != Some(true);
    if let Some(gid) = fs_group.filter(|_| applies).and_then(|g| u32::try_from(g).ok()) {
        let meta = std::fs::metadata(root).map_err(|e| e.to_string())?;
        if meta.gid() != gid {
            regroup(root, gid).map_err(|e| format!("fsGroup on {}: {e}", root.display()))?;
        }
    }
    let path = match &m.sub_path {
        Some(sub) if !sub.is_empty() => {
            let p = root.join(sub);
            if !p.exists() {
                let mode = std::fs::metadata(root).map_err(|e| e.to_string())?.permissions().mode() & 0o7777;
                std::fs::create_dir(&p).map_err(|e| e.to_string())?;
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).map_err(|e| e.to_string())?;
            }
            p
        }
        _ => root.clone(),
    };
    Ok(format!("{}:{}{}", path.display(), m.mount_path, if read_only { ":ro" } else { "" }))
}

/// The kubelet's fsGroup ownership change: group `gid`, group read-write (and search on
/// directories, which are setgid), recursively.
fn regroup(path: &std::path::Path, gid: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::symlink_metadata(path)?;
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    std::os::unix::fs::lchown(path, None, Some(gid))?;
    let mode = meta.permissions().mode() & 0o7777;
    let add = if meta.is_dir() { 0o2070 } else { 0o060 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode | add))?;
    if meta.is_dir() {
        for entry in std::fs::read_dir(path)? {
            regroup(&entry?.path(), gid)?;
        }
    }
    Ok(())
}

/// Starts the container of `pod` under `name`; returns its id and, on the egress network,
/// its address there (the pod's `podIP`).
pub(crate) async fn start(
    docker: &Docker,
    pod: &Pod,
    name: &str,
    sim: &str,
    opts: &Options,
    service_ip: Option<String>,
) -> Result<(String, Option<String>), String> {
    let body = container(pod, sim, opts)?;
    let (network, proxy) = network_of(pod, opts);
    let create = CreateContainerOptionsBuilder::default().name(name).build();
    let id = docker.create_container(Some(create), body).await.map_err(|e| e.to_string())?.id;
    let net = opts.egress_network.clone().filter(|n| proxy || *n == network);
    if let Some(n) = net.as_ref().filter(|_| proxy) {
        // A Service selecting the pod: its address is the pod's on the egress network (the
        // model of kube-proxy: the same address for the pods it selects, one after another).
        let endpoint_config = service_ip.map(|ip| bollard::models::EndpointSettings {
            ipam_config: Some(bollard::models::EndpointIpamConfig { ipv4_address: Some(ip), ..Default::default() }),
            ..Default::default()
        });
        let req = NetworkConnectRequest { container: id.clone(), endpoint_config };
        docker.connect_network(n, req).await.map_err(|e| e.to_string())?;
    }
    docker.start_container(&id, None).await.map_err(|e| e.to_string())?;
    let Some(net) = net else { return Ok((id, None)) };
    let c = docker.inspect_container(&id, None).await.map_err(|e| e.to_string())?;
    let ip = c.network_settings.and_then(|s| s.networks).and_then(|mut n| n.remove(&net)).and_then(|e| e.ip_address);
    Ok((id, ip.filter(|ip| !ip.is_empty())))
}

/// Removes a container, killing it; gone already is fine.
pub(crate) async fn remove(docker: &Docker, id: &str) {
    let opts = RemoveContainerOptionsBuilder::default().force(true).v(true).build();
    let _ = docker.remove_container(id, Some(opts)).await;
}

/// Removes every container simulator `sim` started.
pub(crate) async fn remove_all(docker: &Docker, sim: &str) {
    let filter = format!("{LABEL_SIM}={sim}");
    let filters = HashMap::from([("label", vec![filter.as_str()])]);
    let opts = bollard::query_parameters::ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    for c in docker.list_containers(Some(opts)).await.unwrap_or_default() {
        if let Some(id) = c.id {
            remove(docker, &id).await;
        }
    }
}

#[test]
fn quantities_as_the_pod_spec_writes_them() {
    assert_eq!(bytes("64Mi"), Some(64 << 20));
    assert_eq!(bytes("1Gi"), Some(1 << 30));
    assert_eq!(bytes("12"), Some(12));
    assert_eq!(bytes("1.5Gi"), None);
    assert_eq!(nano_cpus("1500m"), Some(1_500_000_000));
    assert_eq!(nano_cpus("2"), Some(2_000_000_000));
}
