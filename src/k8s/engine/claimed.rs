//! agent-sandbox mode (`k8s_mode = "agent-sandbox"`): a session container is a `SandboxClaim`.
//!
//! - create: the session's pod spec, less what a claim carries, is its environment's
//!   `SandboxTemplate` (named by its hash, `claims::template_of`), made with its
//!   `SandboxWarmPool` the first time this server needs it; then a claim named as the pod
//!   would be (`pod_name`), carrying our labels and the container name on itself and its pod;
//! - start: the claim resolved to its running pod, which must carry the claim's labels
//!   (`Sandboxes::look`); that pod name is kept, and every exec and file goes there;
//! - list and inspect: our claims by label, each with its pod's state; a claim's container-name
//!   annotation is believed only when the claim is named after it, as a pod's is in Pods mode;
//! - remove: the claim deleted (agent-sandbox deletes its Sandbox and pod).
//!
//! A claim's shutdown time is a day ahead, and moved a day ahead again every hour while this
//! server holds its session (`renewing`): a claim a dead server leaked goes within a day, a
//! session held never.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime};

use bollard::errors::Error as EngineError;
use bollard::models::{ContainerInspectResponse, ContainerSummary};
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::api::DynamicObject;
use serde_json::{Value, json};

use super::translate::{self, ANNOTATION_NAME, pod_name};
use super::{START_LIMIT, from_cluster, said, status};
use crate::k8s::claims;
use crate::k8s::cluster::{self, Cluster};
use crate::k8s::pod::LABEL_SANDBOX;
use crate::k8s::sandboxes::Sandboxes;

/// How far ahead a claim's shutdown time is set.
const LEASE: Duration = Duration::from_secs(24 * 3600);
/// How often the shutdown times of held sessions are moved ahead.
const RENEW: Duration = Duration::from_secs(3600);
/// How long a call on a claim whose pod is not known yet waits for it.
const FIND_LIMIT: Duration = Duration::from_secs(10);

/// What this server knows of one claim of its own.
#[derive(Debug, Clone)]
struct Known {
    pod: String,
    renewed: Instant,
}

/// The agent-sandbox side of a Kubernetes engine.
#[derive(Debug)]
pub(super) struct Claimed {
    cluster: Cluster,
    sandboxes: Sandboxes,
    /// Sandboxes each warm pool keeps ready.
    replicas: u32,
    /// The uid of every template's pods.
    uid: u32,
    /// Templates (and their pools) made or brought up to date by this server.
    ensured: Mutex<HashSet<String>>,
    /// Container name → its checked pod.
    known: Mutex<HashMap<String, Known>>,
    /// Container name → the labels its claim was made with: its pod must carry these, not
    /// whatever the claim carries now (whoever can write a claim can relabel it).
    asked: Mutex<HashMap<String, BTreeMap<String, String>>>,
    /// The task that moves shutdown times ahead (`renewing`), ended with this.
    renewer: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if let Some(t) = lock(&self.renewer).take() {
            t.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every `RENEW / 6`, the due claims of `claimed` renewed, until it is gone.
async fn renewing(claimed: Weak<Claimed>) {
    loop {
        tokio::time::sleep(RENEW / 6).await;
        let Some(c) = claimed.upgrade() else { return };
        c.renew_due().await;
    }
}

/// RFC 3339 time `ahead` from now.
fn from_now(ahead: Duration) -> String {
    crate::audit::time::rfc3339(SystemTime::now() + ahead)
}

/// The container name claim `c` was made for: its annotation when the claim is named after
/// it, else the claim's own name (a claim that lies reaches no other session's name).
fn container_of(c: &DynamicObject) -> String {
    let own = c.metadata.name.clone().unwrap_or_default();
    let kept = c.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_NAME));
    kept.filter(|n| pod_name(n) == own).cloned().unwrap_or(own)
}

/// A claim with no pod to show yet, as a pod of its metadata in `phase`.
fn stand_in(c: &DynamicObject, phase: &str) -> Pod {
    let status = Some(PodStatus { phase: Some(phase.into()), ..Default::default() });
    Pod { metadata: c.metadata.clone(), spec: None, status }
}

impl Claimed {
    /// The agent-sandbox side of `cluster`, with its renewing task (owned by it: it holds only
    /// a weak reference and is aborted when this is dropped). Needs a Tokio runtime.
    pub(super) fn new(cluster: &Cluster, replicas: u32, uid: u32) -> Arc<Self> {
        let me = Arc::new(Self {
            cluster: cluster.clone(),
            sandboxes: Sandboxes::new(cluster),
            replicas: replicas.max(1),
            uid,
            ensured: Mutex::default(),
            known: Mutex::default(),
            asked: Mutex::default(),
            renewer: Mutex::default(),
        });
        let task = tokio::spawn(renewing(Arc::downgrade(&me)));
        *lock(&me.renewer) = Some(task);
        me
    }

    /// Claims a sandbox for container `name` (labels `ours`) from the pool of `pod`'s template.
    pub(super) async fn create(
        &self,
        name: &str,
        ours: &HashMap<String, String>,
        pod: &Pod,
    ) -> Result<(), EngineError> {
        let (template, spec) = claims::template_of(pod, self.uid);
        if !lock(&self.ensured).contains(&template) {
            self.sandboxes.ensure_pool(&template, &spec, self.replicas).await.map_err(from_cluster)?;
            lock(&self.ensured).insert(template.clone());
        }
        let mut ours: BTreeMap<String, String> = ours.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        ours.insert(LABEL_SANDBOX.into(), "true".into());
        let mut c = claims::claim(&pod_name(name), &template, &ours, &from_now(LEASE));
        for at in ["/metadata/annotations", "/spec/additionalPodMetadata/annotations"] {
            if let Some(Value::Object(notes)) = c.pointer_mut(at) {
                notes.insert(ANNOTATION_NAME.into(), json!(name));
            }
        }
        self.sandboxes.create_claim(c).await.map_err(from_cluster)?;
        lock(&self.asked).insert(name.to_owned(), ours);
        Ok(())
    }

    /// Waits until container `name`'s claim is served by a running pod of its own.
    pub(super) async fn start(&self, name: &str) -> Result<(), EngineError> {
        self.find(name, START_LIMIT).await.map(|_| ())
    }

    /// The pod serving container `name`: the one found before, else its claim resolved.
    pub(super) async fn pod_of(&self, name: &str) -> Result<String, EngineError> {
        let known = lock(&self.known).get(name).map(|k| k.pod.clone());
        match known {
            Some(pod) => Ok(pod),
            None => self.find(name, FIND_LIMIT).await,
        }
    }

    async fn find(&self, name: &str, limit: Duration) -> Result<String, EngineError> {
        let claim = pod_name(name);
        // Without a record (a claim of a server before a restart), the claim's own labels; the
        // adoption then checks the pod's against the session's record.
        let asked = lock(&self.asked).get(name).cloned();
        let found = match &asked {
            Some(ours) => self.sandboxes.resolve(&claim, ours, limit).await,
            None => self.sandboxes.resolve_own(&claim, limit).await.map(|p| p.metadata.name.unwrap_or_default()),
        };
        let pod = match found {
            Ok(p) => p,
            Err(cluster::Error::Claim { reason, .. }) if reason == "it was deleted" => {
                return Err(status(404, format!("No such container: {name}")));
            }
            Err(e) => return Err(said(e.to_string())),
        };
        lock(&self.known).insert(name.to_owned(), Known { pod: pod.clone(), renewed: Instant::now() });
        Ok(pod)
    }

    /// Moves the shutdown time of each held claim last moved over `RENEW` ago a day ahead.
    async fn renew_due(&self) {
        let due: Vec<String> =
            lock(&self.known).iter().filter(|(_, k)| k.renewed.elapsed() >= RENEW).map(|(n, _)| n.clone()).collect();
        for name in due {
            self.renew(&name).await;
        }
    }

    /// Moves container `name`'s claim's shutdown time a day ahead; a failure is only logged
    /// (the claim still has the rest of its day, and the next round tries again).
    async fn renew(&self, name: &str) {
        let patch = json!({ "spec": { "lifecycle": { "shutdownTime": from_now(LEASE), "shutdownPolicy": "Delete" } } });
        match self.sandboxes.patch_claim(&pod_name(name), patch).await {
            Ok(()) => {
                if let Some(k) = lock(&self.known).get_mut(name) {
                    k.renewed = Instant::now();
                }
            }
            Err(e) => tracing::warn!(container = name, error = %e, "cannot move a sandbox claim's shutdown time ahead"),
        }
    }

    /// Deletes container `name`'s claim; 404 when there is none.
    pub(super) async fn remove(&self, name: &str) -> Result<(), EngineError> {
        lock(&self.known).remove(name);
        lock(&self.asked).remove(name);
        let claim = pod_name(name);
        if self.sandboxes.get_claim(&claim).await.map_err(from_cluster)?.is_none() {
            return Err(status(404, format!("No such container: {name}")));
        }
        self.sandboxes.release(&claim).await.map_err(from_cluster)
    }

    /// Claim `c` as its pod, or a stand-in: `Pending` while it is not served, `Failed` when
    /// it never will be or names a pod that is not its own.
    async fn pod_or_stand_in(&self, c: &DynamicObject, pods: &HashMap<String, Pod>) -> Result<Pod, EngineError> {
        let name = c.metadata.name.clone().unwrap_or_default();
        let want = c.metadata.labels.clone().unwrap_or_default();
        let known = lock(&self.known).get(&container_of(c)).map(|k| k.pod.clone());
        if let Some(p) = known.and_then(|k| pods.get(&k)).filter(|p| claims::check_labels(p, &want).is_ok()) {
            return Ok(p.clone());
        }
        match self.sandboxes.look(&name, None).await {
            Ok(Ok(pod)) => Ok(pod),
            Ok(Err(_)) => Ok(stand_in(c, "Pending")),
            Err(cluster::Error::Claim { .. }) => Ok(stand_in(c, "Failed")),
            Err(e) => Err(from_cluster(e)),
        }
    }

    /// Our claims matching `selector`, each as the container it stands for.
    pub(super) async fn list(&self, selector: &str) -> Result<Vec<ContainerSummary>, EngineError> {
        let claims = self.sandboxes.list_claims(selector).await.map_err(from_cluster)?;
        let pods = self.cluster.list_pods(selector).await.map_err(from_cluster)?;
        let pods: HashMap<String, Pod> =
            pods.into_iter().map(|p| (p.metadata.name.clone().unwrap_or_default(), p)).collect();
        let mut found = Vec::with_capacity(claims.len());
        for c in &claims {
            let pod = self.pod_or_stand_in(c, &pods).await?;
            found.push(translate::summary_as(&pod, &container_of(c)));
        }
        Ok(found)
    }

    /// Container `name` as its claim and pod show it; 404 without a claim.
    pub(super) async fn inspect(&self, name: &str) -> Result<ContainerInspectResponse, EngineError> {
        let claim = self.sandboxes.get_claim(&pod_name(name)).await.map_err(from_cluster)?;
        let c = claim.ok_or_else(|| status(404, format!("No such container: {name}")))?;
        let pod = self.pod_or_stand_in(&c, &HashMap::new()).await?;
        Ok(translate::inspect_as(&pod, &container_of(&c)))
    }
}
