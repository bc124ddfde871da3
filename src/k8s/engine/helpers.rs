//! Helper containers as pods (the package installer, the marker check, the layer store's
//! writer and reader), and the layer store as a PersistentVolumeClaim (`k8s_layer_claim`).
//!
//! Docker runs a helper's command as its PID 1 and reads files out of it once it stopped; a
//! pod that ended can no longer be exec'd into, and the installer's address must be in the
//! egress proxy before its command runs. So a helper pod's PID 1 idles: `create_container`
//! returns once the pod runs (it has its address), `start_container` runs the command as an
//! exec read by the attach made before it, `wait_container` answers with the exec's exit code,
//! and the pod runs on until it is removed, so its files can still be read out.
//!
//! The store is the claim's `sets/` directory, mode 0711, owned by [`STORE_UID`]: the writer
//! and reader pods run as that uid and mount `sets/` (the writer read-write), sessions mount
//! `sets/` read-only. `sets/` is made once by a set-up pod before any session pod mounts it
//! (a kubelet would make a missing `subPath` itself, root's). The store's secret (which names
//! the sets) is a Lease of the namespace, as heartbeat marks are (`beats.rs`), so every server
//! sharing the claim names a set alike.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, ContainerSummary, ContainerWaitResponse, MountType};
use futures::StreamExt;

use super::translate::pod_name;
use super::{EngineError, ExecRec, KubeEngine, START_LIMIT, from_cluster, said, status, unsupported};
use crate::docker::seam::types::{AttachContainerResults, Items};
use crate::k8s::cluster::ExecEnd;
use crate::k8s::pod::{Helper, LABEL_HELPER, STORE_SETS, STORE_UID, StoreMount};
use crate::packages::store::LABEL_STORE;

/// Label of the installer's own volume, and of its shared one (uv, the download cache): on a
/// cluster each is an emptyDir of the installer's pod.
const SCRATCH_LABELS: [&str; 2] = [crate::packages::LABEL_INSTALLER, crate::packages::LABEL_INSTALLER_VOLUME];
/// The size bound of a helper's emptyDir, MiB: the largest tree an install may make.
const SCRATCH_MB: u64 = 4096;

/// A helper pod: its command, run as an exec at its start.
#[derive(Default)]
pub(super) struct HelperRec {
    cmd: Vec<String>,
    /// The exec of its command, once started.
    exec: Option<String>,
    /// Where the attach made before the start gets the command's output.
    attach: Option<tokio::sync::oneshot::Sender<Items<'static, LogOutput>>>,
}

impl std::fmt::Debug for HelperRec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HelperRec").field("cmd", &self.cmd).field("exec", &self.exec).finish_non_exhaustive()
    }
}

/// The uid a body asks for (`uid` or `uid:gid`).
fn uid_of(body: &ContainerCreateBody) -> Option<u32> {
    body.user.as_deref()?.split(':').next()?.parse().ok()
}

/// `size=64m` of the body's `/tmp` tmpfs, MiB.
fn tmp_mb(body: &ContainerCreateBody) -> u64 {
    let options = body.host_config.as_ref().and_then(|h| h.tmpfs.as_ref()).and_then(|t| t.get("/tmp"));
    let size = options.and_then(|o| o.split(',').find_map(|kv| kv.strip_prefix("size=")));
    size.and_then(|s| s.trim_end_matches(['m', 'M']).parse().ok()).unwrap_or(64)
}

fn no_store() -> EngineError {
    said(
        "package installs on Kubernetes need k8s_mode = \"pods\" and the layer store: set k8s_layer_claim \
         to a ReadWriteMany PersistentVolumeClaim of the namespace (deploy/kubernetes/25-layers.yaml)",
    )
}

impl KubeEngine {
    /// Whether `name` is a helper pod of ours.
    pub(super) fn is_helper(&self, name: &str) -> bool {
        self.records().helper_pods.contains_key(name)
    }

    /// The helper pod of a body: its mounts must be the store or an installer's volumes.
    fn helper_of(&self, name: &str, body: &ContainerCreateBody) -> Result<Helper, EngineError> {
        let hc = body.host_config.clone().unwrap_or_default();
        let (mut store, mut scratch) = (None, Vec::new());
        {
            let r = self.records();
            for m in hc.mounts.iter().flatten() {
                let (source, target) = (m.source.clone().unwrap_or_default(), m.target.clone().unwrap_or_default());
                let scratch_volume =
                    r.volumes.get(&source).is_some_and(|v| SCRATCH_LABELS.iter().any(|l| v.labels.contains_key(*l)));
                if m.typ != Some(MountType::VOLUME) {
                    return Err(unsupported(&format!("a helper container mounting host folder {source}")));
                } else if r.store.as_deref() == Some(source.as_str())
                    || r.volumes.get(&source).is_some_and(|v| v.labels.contains_key(LABEL_STORE))
                {
                    let writable = m.read_only != Some(true);
                    store = Some(StoreMount { path: target, sub_path: Some(STORE_SETS.into()), writable });
                } else if scratch_volume {
                    scratch.push((target, SCRATCH_MB));
                } else {
                    return Err(unsupported(&format!("a helper container mounting volume {source}")));
                }
            }
        }
        if store.is_some() && self.settings.layer_claim.is_none() {
            return Err(no_store());
        }
        // The store's writer runs as root on Docker (its files are root's); here as the
        // store's uid, which owns `sets/`: any pod writing the claim gets that uid as its
        // fsGroup too, so no other uid ever re-groups the store. No helper runs as root.
        let uid = match uid_of(body) {
            _ if store.is_some() => STORE_UID,
            Some(uid) if uid > 0 => uid,
            _ => return Err(said(format!("helper container {name} names no uid, or root: no pod runs as root"))),
        };
        let network = hc.network_mode.as_deref().filter(|n| !n.is_empty() && *n != "none");
        #[allow(clippy::cast_precision_loss)] // nano-CPUs of a few CPUs: exact in an f64
        let cpus = hc.nano_cpus.map(|n| n as f64 / 1e9);
        Ok(Helper {
            name: pod_name(name),
            image: body.image.clone().ok_or_else(|| said("a helper container without an image"))?,
            uid,
            env: body.env.clone().unwrap_or_default(),
            working_dir: body.working_dir.clone(),
            memory_mb: u64::try_from(hc.memory.unwrap_or(512 << 20) >> 20).unwrap_or(512).max(16),
            cpus,
            tmp_mb: tmp_mb(body),
            scratch,
            store,
            egress: network.is_some(),
            labels: body.labels.clone().unwrap_or_default().into_iter().collect(),
        })
    }

    /// Makes helper `name`'s pod and waits until it runs; its command waits for the start.
    pub(super) async fn create_helper(&self, name: &str, body: &ContainerCreateBody) -> Result<(), EngineError> {
        let helper = self.helper_of(name, body)?;
        if self.is_helper(name) {
            return Err(status(409, format!("Conflict. The container name \"/{name}\" is already in use")));
        }
        if helper.store.is_some() {
            self.store_set_up(&helper.image).await?;
        }
        let pod = crate::k8s::pod::helper_pod(&self.settings, &helper);
        self.cluster.create_pod(&pod).await.map_err(from_cluster)?;
        let cmd = body.cmd.clone().unwrap_or_default();
        self.records().helper_pods.insert(name.to_owned(), HelperRec { cmd, ..Default::default() });
        if let Err(e) = self.cluster.wait_running(&helper.name, START_LIMIT).await {
            self.records().helper_pods.remove(name);
            let _ = self.cluster.delete_pod(&helper.name).await;
            return Err(from_cluster(e));
        }
        Ok(())
    }

    /// The attach of a helper: the output of its command, once started.
    pub(super) fn attach_helper(&self, name: &str) -> Result<AttachContainerResults, EngineError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        match self.records().helper_pods.get_mut(name) {
            Some(h) => h.attach = Some(tx),
            None => return Err(status(404, format!("No such container: {name}"))),
        }
        let output = futures::stream::once(rx).flat_map(|r| r.unwrap_or_else(|_| futures::stream::empty().boxed()));
        Ok(AttachContainerResults { output: output.boxed(), input: Box::pin(tokio::io::sink()) })
    }

    /// Runs a helper's command as an exec; its output goes to the attach made before.
    pub(super) async fn start_helper(&self, name: &str) -> Result<(), EngineError> {
        let (id, attach) = {
            let mut r = self.records();
            r.serial += 1;
            let id = format!("k8s-exec-{}", r.serial);
            let h = r.helper_pods.get_mut(name).ok_or_else(|| status(404, format!("No such container: {name}")))?;
            if h.exec.is_some() {
                return Err(status(304, "Container already started"));
            }
            let attach = h.attach.take().ok_or_else(|| said(format!("helper {name} started with nobody attached")))?;
            h.exec = Some(id.clone());
            let cmd = std::mem::take(&mut h.cmd);
            r.execs.insert(id.clone(), ExecRec { container: name.to_owned(), cmd, stdin: false, end: None });
            (id, attach)
        };
        match self.start(&id).await? {
            bollard::exec::StartExecResults::Attached { output, .. } => {
                // The attach was let go of: its command runs on unread until the pod goes.
                let _ = attach.send(output);
                Ok(())
            }
            bollard::exec::StartExecResults::Detached => Err(said("a helper's exec came back detached")),
        }
    }

    /// How a helper's command ended, once its output was read to the end. Then, as a Docker
    /// container's end would, whatever the command left running (a build's daemon) is killed:
    /// only the idle PID 1 stays, for the files to be read out.
    pub(super) fn wait_helper(&self, name: &str) -> Items<'static, ContainerWaitResponse> {
        let (engine, name) = (self.clone(), name.to_owned());
        futures::stream::once(async move {
            let ended = engine.helper_end(&name).await;
            if ended.is_ok() {
                let pod = pod_name(&name);
                let killed = engine.cluster.exec(&pod, &["sh", "-c", "kill -KILL -1"], false).await;
                if let Ok(exec) = killed {
                    let _ = tokio::time::timeout(Duration::from_secs(10), exec.end).await;
                }
            }
            ended
        })
        .boxed()
    }

    /// How a helper's command ended, once its end is recorded (within 30 s).
    async fn helper_end(&self, name: &str) -> Result<ContainerWaitResponse, EngineError> {
        let (records, name) = (self.records.clone(), name.to_owned());
        {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            loop {
                let end = {
                    let r = records.lock().unwrap_or_else(|e| e.into_inner());
                    let exec = r.helper_pods.get(&name).and_then(|h| h.exec.clone());
                    let exec = exec.ok_or_else(|| status(404, format!("helper {name} was never started")))?;
                    r.execs.get(&exec).and_then(|e| e.end.clone())
                };
                match end {
                    Some(ExecEnd::Exited(code)) => {
                        return Ok(ContainerWaitResponse { status_code: i64::from(code), error: None });
                    }
                    Some(other) => return Err(said(format!("helper {name}'s command: {other:?}"))),
                    None if tokio::time::Instant::now() > deadline => {
                        return Err(said(format!("helper {name}'s command did not end within 30 s of its output")));
                    }
                    None => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        }
    }

    /// Deletes a helper's pod: true when `name` was one.
    pub(super) async fn remove_helper(&self, name: &str) -> Result<bool, EngineError> {
        if self.records().helper_pods.remove(name).is_none() {
            return Ok(false);
        }
        self.cluster.delete_pod(&pod_name(name)).await.map_err(from_cluster)?;
        Ok(true)
    }

    /// Helper pods matching `selector` (agent-sandbox mode lists claims, not pods).
    pub(super) async fn list_helpers(&self, selector: &str) -> Result<Vec<ContainerSummary>, EngineError> {
        let selector = format!("{selector},{LABEL_HELPER}=true");
        let pods = self.cluster.list_pods(&selector).await.map_err(from_cluster)?;
        Ok(pods.iter().map(super::translate::summary).collect())
    }

    /// Deletes the helper pod `name` when this process has no record of it (a sweep of a
    /// stopped server's, in agent-sandbox mode): true when it was one.
    pub(super) async fn remove_stray_helper(&self, name: &str) -> Result<bool, EngineError> {
        let pod = pod_name(name);
        let found = self.cluster.get_pod(&pod).await.map_err(from_cluster)?;
        let helper =
            found.and_then(|p| p.metadata.labels).is_some_and(|l| l.get(LABEL_HELPER).is_some_and(|v| v == "true"));
        if helper {
            self.cluster.delete_pod(&pod).await.map_err(from_cluster)?;
        }
        Ok(helper)
    }

    /// The store volume `name`: its secret in a Lease shared by the namespace's servers, and,
    /// once per process, the claim's `sets/` made before any pod mounts it.
    pub(super) async fn create_store(
        &self,
        name: &str,
        labels: &HashMap<String, String>,
    ) -> Result<bollard::models::Volume, EngineError> {
        if self.settings.layer_claim.is_none() {
            return Err(no_store());
        }
        let volume = self.mark_create(name, labels).await?;
        self.records().store = Some(name.to_owned());
        Ok(volume)
    }

    /// Before the first pod of this process that mounts the store's `sets/` (of `image`): the
    /// claim's `sets/` checked or made, once. Its outcome is kept: a claim that cannot hold the
    /// store (Pending: no ReadWriteMany storage; `sets/` not the store uid's) fails once, and
    /// sessions then run without the store while installs say why.
    pub(super) async fn store_set_up(&self, image: &str) -> Result<(), EngineError> {
        let Some(claim) = self.settings.layer_claim.clone() else { return Err(no_store()) };
        let outcome = self.store_ready.get_or_init(|| self.set_up_store(claim, image.to_owned())).await;
        outcome.clone().map_err(said)
    }

    /// Checks or makes `sets/` of the claim, mode 0711, the store uid's: a pod of that uid
    /// mounting the claim's root, one exec, within [`SET_UP_LIMIT`].
    async fn set_up_store(&self, claim: String, image: String) -> Result<(), String> {
        // Unique in the namespace: several servers' processes may share a pid.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let helper = Helper {
            name: pod_name(&format!("pyberth-store-setup-{}-{nanos}", std::process::id())),
            image,
            uid: STORE_UID,
            env: vec!["PATH=/usr/local/bin:/usr/bin:/bin".into()],
            memory_mb: 64,
            cpus: Some(0.5),
            tmp_mb: 16,
            store: Some(StoreMount { path: "/store".into(), sub_path: None, writable: true }),
            labels: BTreeMap::from([(crate::docker::LABEL_MANAGED.to_owned(), "1".to_owned())]),
            ..Default::default()
        };
        let pod = crate::k8s::pod::helper_pod(&self.settings, &helper);
        self.cluster.create_pod(&pod).await.map_err(|e| e.to_string())?;
        let made = tokio::time::timeout(SET_UP_LIMIT, async {
            self.cluster.wait_running(&helper.name, SET_UP_LIMIT).await?;
            let mut exec = self.cluster.exec(&helper.name, &["sh", "-c", SET_UP_SH], false).await?;
            let err = std::mem::replace(&mut exec.stderr, Box::pin(tokio::io::empty()));
            let mut why = String::new();
            let _ =
                tokio::io::AsyncReadExt::read_to_string(&mut tokio::io::AsyncReadExt::take(err, 4096), &mut why).await;
            Ok::<_, crate::k8s::cluster::Error>((exec.end.await, why))
        })
        .await;
        let _ = self.cluster.delete_pod(&helper.name).await;
        let failed = |what: String| {
            let text = format!(
                "the layer store on claim {claim} is unusable ({what}): package installs are refused and sessions run \
                 without it. Give the claim ReadWriteMany storage and a sets/ directory owned by uid {STORE_UID}, \
                 mode 0711 (or a volume that applies fsGroup), then restart the server (docs/kubernetes.md, \
                 \"Package installs\")"
            );
            tracing::warn!(target: "pyberth::layers", "{text}");
            Err(text)
        };
        match made {
            Ok(Ok((ExecEnd::Exited(0), _))) => Ok(()),
            Ok(Ok((end, why))) => failed(format!("{end:?}: {}", why.trim())),
            Ok(Err(e)) => failed(e.to_string()),
            Err(_) => failed(format!("its set-up pod did not finish within {} s", SET_UP_LIMIT.as_secs())),
        }
    }
}

/// Bound on the store's set-up: a claim that binds to nothing leaves its pod Pending for ever.
const SET_UP_LIMIT: Duration = Duration::from_secs(60);

/// `sets/` made if missing (the root must be the store uid's to write, by fsGroup or by the
/// operator), then it must be the store uid's (`-O`), mode 0711.
const SET_UP_SH: &str = "cd /store || exit 2
[ -d sets ] || mkdir sets || { echo 'cannot make sets/ in the claim root (not writable by this uid)' >&2; exit 3; }
[ -O sets ] || { echo \"sets/ is not this uid's: $(ls -ldn sets)\" >&2; exit 4; }
chmod 0711 sets";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_helper_body_says_its_uid_and_tmp() {
        let body = |user: &str| ContainerCreateBody { user: Some(user.into()), ..Default::default() };
        assert_eq!(uid_of(&body("1879048200:1879048200")), Some(1_879_048_200));
        assert_eq!(uid_of(&body("0:0")), Some(0));
        assert_eq!(uid_of(&body("nobody")), None);
        let mut b = body("1");
        assert_eq!(tmp_mb(&b), 64);
        b.host_config = Some(bollard::models::HostConfig {
            tmpfs: Some(HashMap::from([("/tmp".into(), "rw,nosuid,nodev,size=1024m".into())])),
            ..Default::default()
        });
        assert_eq!(tmp_mb(&b), 1024);
    }
}
