//! The owners' engine seam over a Kubernetes namespace (plain Pods mode, issue 33).
//!
//! The seam is Docker-shaped; this engine answers each call with its Kubernetes counterpart,
//! and from its own records where Kubernetes has none (docs/kubernetes.md):
//!
//! - a session container is a pod (`translate::session_pod`, made from the same body the
//!   Docker engine would get): create makes it, start waits until it runs, remove deletes it,
//!   list and inspect read pods by label; its name is derived from the container's name, so
//!   every call finds it again without a record;
//! - an exec is a `pods/exec` stream; its id is ours, its exit code read from the closing
//!   status (channel 3);
//! - files move as a tar over exec stdin and stdout;
//! - volumes are records: the workspace is part of the pod (a memory emptyDir of the size its
//!   volume was asked with);
//! - a heartbeat container is a record, alive while its attach is held;
//! - the egress proxy is a pod of its own driven over an exec (`egress.rs`); a session network
//!   is a record, and a pod's address its `podIP`;
//! - every other helper container (package installs, snapshot copies), image builds and pulls
//!   are refused with a "not supported on Kubernetes yet"
//!   error, which reaches the caller as a tool error.

mod beats;
mod claimed;
mod egress;
mod helpers;
mod oom;
mod seam;
mod shelf;
pub mod translate;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::errors::Error as EngineError;
use bollard::exec::StartExecResults;
use bollard::models::{ContainerCreateBody, MountType};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::cluster::{self, Cluster, Connect, ExecEnd};
use super::pod::PodSettings;
use crate::docker::heartbeat::LABEL_HEARTBEAT;
use crate::docker::{LABEL_SESSION, OwnWords, WORKSPACE};

/// How long a new pod may take to run (a cold node pulls nothing: the image is on the nodes).
const START_LIMIT: Duration = Duration::from_secs(120);
/// Bound on a tar read out of a pod.
const DOWNLOAD_CAP: usize = 256 << 20;
/// `ephemeral-storage` of a session pod, MiB: its root is read-only, so little is written.
const EPHEMERAL_MB: u64 = 256;

/// A container that exists only in our records (a heartbeat).
#[derive(Debug)]
struct Virtual {
    labels: HashMap<String, String>,
    image: String,
    running: bool,
    /// Ends its attach stream when it is removed.
    gone: CancellationToken,
}

/// A heartbeat's attach, held: when it is dropped, the heartbeat is gone.
struct Detached {
    records: Arc<Mutex<Records>>,
    name: String,
}

impl Drop for Detached {
    fn drop(&mut self) {
        let mut r = self.records.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = r.virtuals.remove(&self.name) {
            v.gone.cancel();
        }
    }
}

/// A volume, as a record.
#[derive(Debug, Clone)]
struct Vol {
    labels: HashMap<String, String>,
    options: HashMap<String, String>,
    created: String,
}

/// An exec: made by `create_exec`, run by `start_exec`, ended when its status came.
#[derive(Debug)]
struct ExecRec {
    container: String,
    cmd: Vec<String>,
    stdin: bool,
    end: Option<ExecEnd>,
}

#[derive(Debug, Default)]
struct Records {
    virtuals: BTreeMap<String, Virtual>,
    /// Helper containers of snapshot volumes (never run): their volume on the shelf.
    helpers: HashMap<String, String>,
    /// The OOM kill count last seen in each container's cgroup (`oom.rs`).
    oom_seen: HashMap<String, u64>,
    volumes: BTreeMap<String, Vol>,
    execs: HashMap<String, ExecRec>,
    /// Egress proxy containers (pods), with the command their exec runs.
    proxies: HashMap<String, Vec<String>>,
    /// The proxy's Service (`egress.rs`): its name and address, which outlive a proxy pod.
    proxy_service: Option<(String, String)>,
    /// Session networks (records), with their labels.
    networks: BTreeMap<String, HashMap<String, String>>,
    /// Helper containers (installer, marker check, the store's writer and reader): pods.
    helper_pods: HashMap<String, helpers::HelperRec>,
    /// The layer store's volume, when it is the claim (`helpers.rs`).
    store: Option<String>,
    serial: u64,
}

/// The Kubernetes engine: one namespace of one cluster, and our records.
#[derive(Debug, Clone)]
pub struct KubeEngine {
    cluster: Cluster,
    settings: PodSettings,
    records: Arc<Mutex<Records>>,
    /// agent-sandbox mode: sessions are claims (`claimed.rs`); `None`: plain Pods.
    claimed: Option<Arc<claimed::Claimed>>,
    /// Where snapshot volumes are kept (`shelf.rs`); `None`: snapshots are refused.
    shelf: Option<shelf::Shelf>,
    /// The egress proxy pod's image (`k8s_egress_image`); `None`: the session's image.
    egress_image: Option<String>,
    /// The layer claim's set-up, once (`helpers.rs`): its outcome, kept.
    store_ready: Arc<tokio::sync::OnceCell<Result<(), String>>>,
}

/// A Docker-style error (the owners read its status codes).
pub(crate) fn status(status_code: u16, message: impl Into<String>) -> EngineError {
    EngineError::DockerResponseServerError { status_code, message: message.into() }
}

/// What the owners cannot do on this engine yet: an I/O error of kind `Unsupported`, whose
/// text the owners pass on as it is (no "Docker responded with status code" before it).
pub(crate) fn unsupported(what: &str) -> EngineError {
    let text = format!("{what} is not supported on Kubernetes yet (docs/kubernetes.md, \"Not yet\")");
    EngineError::IOError { err: std::io::Error::new(std::io::ErrorKind::Unsupported, text) }
}

/// A cluster failure as the owners read engine errors: 404 (gone) and 409 (taken) keep their
/// Docker-style status, which the owners act on; every other failure is said in the cluster's
/// own words ([`OwnWords`]), which no owner reads a code from.
pub(crate) fn from_cluster(e: cluster::Error) -> EngineError {
    let code = match &e {
        cluster::Error::Gone(_) => 404,
        cluster::Error::Api { source, .. } => match source.as_ref() {
            kube::Error::Api(s) => s.code,
            _ => 500,
        },
        _ => 500,
    };
    match code {
        404 | 409 => status(code, e.to_string()),
        _ => said(e.to_string()),
    }
}

/// A failure in this engine's own words (no Docker status before them).
pub(crate) fn said(text: impl Into<String>) -> EngineError {
    EngineError::IOError { err: std::io::Error::other(OwnWords(text.into())) }
}

/// The pod settings of session pods with `runtime_class` (`pyberth k8s manifests` makes its
/// templates with the same, so they are the engine's).
pub(crate) fn pod_settings(runtime_class: Option<String>) -> PodSettings {
    PodSettings { runtime_class, ephemeral_mb: EPHEMERAL_MB, ..Default::default() }
}

impl KubeEngine {
    /// Reaches the cluster (`at`); session pods get `runtime_class`.
    pub async fn connect(at: &Connect, runtime_class: Option<String>) -> Result<Self, cluster::Error> {
        let cluster = Cluster::connect(at).await?;
        Ok(Self {
            cluster,
            settings: pod_settings(runtime_class),
            records: Arc::default(),
            claimed: None,
            shelf: None,
            egress_image: None,
            store_ready: Arc::default(),
        })
    }

    /// The egress proxy pod runs `image`, which carries the executable (`pod::PROXY_EXE`).
    pub fn with_egress_image(mut self, image: String) -> Self {
        self.egress_image = Some(image);
        self
    }

    /// Keeps the layer store on the PersistentVolumeClaim `claim` (`helpers.rs`).
    pub fn with_layer_claim(mut self, claim: Option<String>) -> Self {
        self.settings.layer_claim = claim;
        self
    }

    /// Keeps snapshot volumes under `dir` (made, mode 0700): on a cluster, a volume claim
    /// mounted into the server's pod.
    pub fn with_snapshots(mut self, dir: std::path::PathBuf) -> std::io::Result<Self> {
        self.shelf = Some(shelf::Shelf::open(dir)?);
        Ok(self)
    }

    /// The snapshot volume a helper body mounts at `/snap`, when it is the never-run helper
    /// the snapshot store makes to reach a volume on the shelf.
    fn snapshot_helper(&self, body: &ContainerCreateBody) -> Option<String> {
        let shelf = self.shelf.as_ref()?;
        let mounts = body.host_config.as_ref()?.mounts.as_ref()?;
        let [m] = mounts.as_slice() else { return None };
        let volume =
            m.source.clone().filter(|_| m.typ == Some(MountType::VOLUME) && m.target.as_deref() == Some("/snap"))?;
        shelf.get(&volume).map(|_| volume)
    }

    /// In agent-sandbox mode: warm pools of `replicas` sandboxes, whose pods run as `uid`.
    pub fn agent_sandbox(mut self, replicas: u32, uid: u32) -> Self {
        self.claimed = Some(claimed::Claimed::new(&self.cluster, replicas, uid));
        // No installs there (their installer needs the egress proxy, which this mode lacks),
        // so no store in the templates: a warm pool's pods would mount `sets/` before any
        // set-up, and the kubelet would make it, root's, with the claim root's mode.
        self.settings.layer_claim = None;
        self
    }

    /// The pod of container `name`: named after it (Pods), or its claim's (agent-sandbox).
    pub async fn pod_of(&self, name: &str) -> Result<String, EngineError> {
        if self.is_helper(name) {
            return Ok(translate::pod_name(name));
        }
        match &self.claimed {
            Some(c) => c.pod_of(name).await,
            None => Ok(translate::pod_name(name)),
        }
    }

    fn records(&self) -> MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes the pod of a session container, or the record of a heartbeat; refuses the rest.
    async fn create(&self, name: Option<String>, body: ContainerCreateBody) -> Result<String, EngineError> {
        let labels = body.labels.clone().unwrap_or_default();
        let name = match name {
            Some(n) => n,
            None => {
                let mut r = self.records();
                r.serial += 1;
                format!("pyberth-k8s-{}", r.serial)
            }
        };
        if labels.contains_key(LABEL_HEARTBEAT) {
            let gone = CancellationToken::new();
            {
                let mut r = self.records();
                if r.virtuals.contains_key(&name) {
                    return Err(status(409, format!("Conflict. The container name \"/{name}\" is already in use")));
                }
                let image = body.image.clone().unwrap_or_default();
                let v = Virtual { labels: labels.clone(), image, running: false, gone: gone.clone() };
                r.virtuals.insert(name.clone(), v);
            }
            // Its Lease is what other servers see of it (`beats.rs`), renewed until it is gone.
            if let Err(e) = self.beat_create(&name, &labels).await {
                self.records().virtuals.remove(&name);
                return Err(e);
            }
            self.beat_renew(&name, gone);
            return Ok(name);
        }
        if let Some(volume) = self.snapshot_helper(&body) {
            self.records().helpers.insert(name.clone(), volume);
            return Ok(name);
        }
        match labels.get(crate::egress::LABEL_EGRESS).map(String::as_str) {
            Some("proxy") => return self.create_proxy(&name, &body).await.map(|()| name),
            Some(_) => return Err(unsupported("an egress helper container (package installs through the proxy)")),
            None => {}
        }
        if !labels.contains_key(LABEL_SESSION) {
            return self.create_helper(&name, &body).await.map(|()| name);
        }
        let mut pod = translate::session_pod(&name, &body, self.workspace_mb(&body), &self.settings)
            .map_err(|e| said(e.to_string()))?;
        // A store that could not be set up is left out: the session runs, installs say why.
        if let (true, Some(image)) = (crate::k8s::pod::uses_store(&pod), body.image.as_deref())
            && self.store_set_up(image).await.is_err()
        {
            crate::k8s::pod::without_store(&mut pod);
        }
        match &self.claimed {
            Some(c) => c.create(&name, &labels, &pod).await?,
            None => drop(self.cluster.create_pod(&pod).await.map_err(from_cluster)?),
        }
        Ok(name)
    }

    /// The size of the workspace volume mounted by `body`, when it was asked with one.
    fn workspace_mb(&self, body: &ContainerCreateBody) -> Option<u64> {
        let mounts = body.host_config.as_ref()?.mounts.as_ref()?;
        let m = mounts.iter().find(|m| m.typ == Some(MountType::VOLUME) && m.target.as_deref() == Some(WORKSPACE))?;
        let volume = m.source.as_deref()?;
        let r = self.records();
        let o = r.volumes.get(volume)?.options.get("o")?.clone();
        o.split(',').find_map(|kv| kv.strip_prefix("size=")?.trim_end_matches(['m', 'M']).parse().ok())
    }

    /// Runs exec `id`: its output (stdout and stderr frames, then its end recorded) and stdin.
    async fn start(&self, id: &str) -> Result<StartExecResults, EngineError> {
        let (container, cmd, stdin) = {
            let r = self.records();
            let e = r.execs.get(id).ok_or_else(|| status(404, format!("No such exec instance: {id}")))?;
            (e.container.clone(), e.cmd.clone(), e.stdin)
        };
        if self.records().virtuals.contains_key(&container) {
            return Err(unsupported("an exec in a heartbeat"));
        }
        let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        let pod = self.pod_of(&container).await?;
        let mut exec = self.cluster.exec(&pod, &args, stdin).await.map_err(from_cluster)?;
        let out = std::mem::replace(&mut exec.stdout, Box::pin(tokio::io::empty()));
        let err = std::mem::replace(&mut exec.stderr, Box::pin(tokio::io::empty()));
        let input: crate::docker::exec::Input = match exec.stdin.take() {
            Some(w) => w,
            None => Box::pin(tokio::io::sink()),
        };
        let end = std::mem::replace(&mut exec.end, Box::pin(std::future::ready(ExecEnd::Lost)));
        let io = |e: std::io::Error| EngineError::IOError { err: e };
        let out = tokio_util::io::ReaderStream::with_capacity(out, 64 << 10)
            .map(move |b| b.map(|message| LogOutput::StdOut { message }).map_err(io));
        let err = tokio_util::io::ReaderStream::with_capacity(err, 16 << 10)
            .map(move |b| b.map(|message| LogOutput::StdErr { message }).map_err(io));
        let records = self.records.clone();
        let id = id.to_owned();
        // After both streams end, the status is read and kept for `inspect_exec`. The exec
        // (its websocket task) lives as long as this stream: dropping the stream cuts it.
        let tail = futures::stream::once(async move {
            let end = tokio::time::timeout(Duration::from_secs(10), end).await.unwrap_or(ExecEnd::Lost);
            if let Some(e) = records.lock().unwrap_or_else(|e| e.into_inner()).execs.get_mut(&id) {
                e.end = Some(end);
            }
            drop(exec);
            None
        })
        .filter_map(std::future::ready);
        let output = futures::stream::select(out, err).chain(tail).boxed();
        Ok(StartExecResults::Attached { output, input })
    }

    /// Removes a heartbeat's record, or deletes a session's pod; 404 when neither is there.
    async fn remove(&self, name: &str) -> Result<(), EngineError> {
        let ours = {
            let mut r = self.records();
            r.execs.retain(|_, e| e.container != name);
            r.oom_seen.remove(name);
            r.proxies.remove(name);
            if r.helpers.remove(name).is_some() {
                return Ok(());
            }
            if r.helper_pods.contains_key(name) {
                None
            } else {
                Some(r.virtuals.remove(name).inspect(|v| v.gone.cancel()).is_some())
            }
        };
        let Some(ours) = ours else {
            return self.remove_helper(name).await.map(|_| ());
        };
        // Our heartbeat's Lease goes now, not only when its renewing task gets to it: a
        // server's stop may end the process first.
        if self.lease_remove(name, LABEL_HEARTBEAT).await? || ours {
            return Ok(());
        }
        if let Some(c) = &self.claimed {
            if self.remove_stray_helper(name).await? {
                return Ok(());
            }
            return c.remove(name).await;
        }
        let pod = translate::pod_name(name);
        let found = self.cluster.get_pod(&pod).await.map_err(from_cluster)?;
        if let Some(p) = &found {
            self.cluster.delete_pod(&pod).await.map_err(from_cluster)?;
            // Another server's proxy (a sweep of a dead one's leftovers): its Service too.
            self.proxy_service_of_dead(p).await;
        }
        let found = found.is_some();
        // A proxy's (gone already or not): its Service goes too when nothing else uses it.
        self.proxy_service_done().await;
        if found { Ok(()) } else { Err(status(404, format!("No such container: {name}"))) }
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
