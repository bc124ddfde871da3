//! The cluster side of the Kubernetes engine, through kube-rs: pods made, awaited, exec'd into,
//! listed by label and deleted, in one namespace. Every wait is bounded; every API refusal
//! becomes an error that says what to grant or fix.

use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::api::{
    ApiResource, AttachParams, AttachedProcess, DeleteParams, DynamicObject, ListParams, PostParams, WatchEvent,
    WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::GroupVersionKind;
use kube::{Api, Client, Config};
use tokio::io::{AsyncRead, AsyncWrite};

use super::CONTAINER;

/// Where the cluster is and which namespace is ours.
#[derive(Debug, Clone, Default)]
pub struct Connect {
    /// A kubeconfig file; `None`: in-cluster (the service account), else `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context; `None`: its current one.
    pub context: Option<String>,
    /// The namespace of our pods.
    pub namespace: String,
}

/// A failure on the cluster, said so that the operator knows what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// RBAC said no (403).
    #[error(
        "the Kubernetes API refused to let pyberth {doing} in namespace {namespace} (403 Forbidden): grant its service account the Role of deploy/kubernetes/10-rbac.yaml. The API server said: {message}"
    )]
    Forbidden {
        /// What we tried.
        doing: String,
        /// Our namespace.
        namespace: String,
        /// The API server's words.
        message: String,
    },
    /// The credentials were refused (401).
    #[error(
        "the Kubernetes API did not accept pyberth's credentials when it tried to {doing} (401): check the kubeconfig or the service account token"
    )]
    Unauthorized {
        /// What we tried.
        doing: String,
    },
    /// The pod is not there.
    #[error("pod {0} does not exist (deleted, or evicted by the node)")]
    Gone(String),
    /// The pod did not come up in time.
    #[error(
        "pod {pod} was not running after {secs} s (last phase: {phase}): is the image on the nodes, is there room?"
    )]
    NotRunning {
        /// The pod.
        pod: String,
        /// How long we waited.
        secs: u64,
        /// Its last phase.
        phase: String,
    },
    /// The pod stopped.
    #[error("pod {pod} stopped (phase {phase})")]
    Stopped {
        /// The pod.
        pod: String,
        /// Its phase.
        phase: String,
    },
    /// A SandboxClaim will not be served, or named a pod that is not its session's.
    #[error("sandbox claim {claim}: {reason}")]
    Claim {
        /// The claim.
        claim: String,
        /// What agent-sandbox said, or why we refused its pod.
        reason: String,
    },
    /// The kubeconfig or the in-cluster environment could not be read.
    #[error("cannot find the Kubernetes cluster: {0}")]
    Config(String),
    /// A file could not be moved in or out of a pod.
    #[error("{0}")]
    Transfer(String),
    /// Anything else the API or the transport said.
    #[error("Kubernetes API, while trying to {doing}: {source}")]
    Api {
        /// What we tried.
        doing: String,
        /// kube-rs' error.
        #[source]
        source: Box<kube::Error>,
    },
}

/// How an exec ended, from its status on channel 3.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEnd {
    /// The command exited with this code.
    Exited(i32),
    /// The API server or kubelet ended it with this message (not an exit code).
    Failed(String),
    /// The stream ended without a status: connection lost, the process' fate unknown.
    Lost,
}

/// A running exec: stdin, stdout and stderr apart, and how it ended.
pub struct Exec {
    /// Its stdin; dropping it closes stdin (only `v5.channel.k8s.io` can do that without
    /// closing the whole stream).
    pub stdin: Option<Pin<Box<dyn AsyncWrite + Send>>>,
    /// Its stdout.
    pub stdout: Pin<Box<dyn AsyncRead + Send>>,
    /// Its stderr.
    pub stderr: Pin<Box<dyn AsyncRead + Send>>,
    /// Resolves once the exec ended.
    pub end: BoxFuture<'static, ExecEnd>,
    // Dropping it aborts the stream task (kube ≥ 4).
    process: AttachedProcess,
}

impl std::fmt::Debug for Exec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exec").finish_non_exhaustive()
    }
}

impl Exec {
    /// Cuts the stream now, as a lost connection would; the process in the pod goes on.
    pub fn abort(&self) {
        self.process.abort();
    }
}

/// Our namespace on one cluster.
#[derive(Clone)]
pub struct Cluster {
    pods: Api<Pod>,
    namespace: String,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("namespace", &self.namespace).finish_non_exhaustive()
    }
}

/// Bytes the exec streams may hold before kube-rs' single message loop blocks (its default
/// is 1 KiB); the same as our Docker exec's output capacity.
const STDOUT_BUF: usize = 256 << 10;
const STDERR_BUF: usize = 64 << 10;

fn exec_end(status: Option<Status>) -> ExecEnd {
    let Some(s) = status else { return ExecEnd::Lost };
    if s.status.as_deref() == Some("Success") {
        return ExecEnd::Exited(0);
    }
    // A non-zero exit: reason NonZeroExitCode, the code in the cause of reason ExitCode.
    let causes = s.details.iter().flat_map(|d| d.causes.iter().flatten());
    let code =
        causes.filter(|c| c.reason.as_deref() == Some("ExitCode")).find_map(|c| c.message.as_deref()?.parse().ok());
    match code {
        Some(code) if s.reason.as_deref() == Some("NonZeroExitCode") => ExecEnd::Exited(code),
        _ => ExecEnd::Failed(s.message.unwrap_or_else(|| "the exec failed without a message".into())),
    }
}

fn phase(pod: &Pod) -> String {
    pod.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_else(|| "Pending".into())
}

impl Cluster {
    /// Connects as `at` says (no request is made yet).
    pub async fn connect(at: &Connect) -> Result<Self, Error> {
        let options = KubeConfigOptions { context: at.context.clone(), ..Default::default() };
        let config = match &at.kubeconfig {
            Some(path) => {
                let file =
                    Kubeconfig::read_from(path).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
                Config::from_custom_kubeconfig(file, &options).await.map_err(|e| Error::Config(e.to_string()))?
            }
            None => Config::infer().await.map_err(|e| Error::Config(e.to_string()))?,
        };
        let client = Client::try_from(config).map_err(|e| Error::Config(e.to_string()))?;
        Ok(Self::with_client(client, &at.namespace))
    }

    /// Our namespace through an existing client.
    pub fn with_client(client: Client, namespace: &str) -> Self {
        Self { pods: Api::namespaced(client, namespace), namespace: namespace.to_owned() }
    }

    /// The Services of our namespace (the egress proxy's).
    pub fn services(&self) -> Api<k8s_openapi::api::core::v1::Service> {
        Api::namespaced(self.pods.clone().into_client(), &self.namespace)
    }

    /// The Leases of our namespace (heartbeats and their marks).
    pub fn leases(&self) -> Api<k8s_openapi::api::coordination::v1::Lease> {
        Api::namespaced(self.pods.clone().into_client(), &self.namespace)
    }

    /// The namespaced API of a custom resource (agent-sandbox's) as dynamic objects.
    pub fn custom(&self, api_version: &str, kind: &str, plural: &str) -> Api<DynamicObject> {
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let resource = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
        Api::namespaced_with(self.pods.clone().into_client(), &self.namespace, &resource)
    }

    /// Turns a kube-rs failure while `doing` into ours (403 and 401 said for the operator).
    pub(crate) fn error(&self, doing: impl Into<String>) -> impl FnOnce(kube::Error) -> Error + '_ {
        let doing = doing.into();
        move |e| match e {
            kube::Error::Api(s) if s.code == 403 => {
                Error::Forbidden { doing, namespace: self.namespace.clone(), message: s.message }
            }
            kube::Error::Api(s) if s.code == 401 => Error::Unauthorized { doing },
            e => Error::Api { doing, source: Box::new(e) },
        }
    }

    /// Creates `pod`; returns its name.
    pub async fn create_pod(&self, pod: &Pod) -> Result<String, Error> {
        let made = self.pods.create(&PostParams::default(), pod).await.map_err(self.error("create pods"))?;
        Ok(made.metadata.name.unwrap_or_default())
    }

    /// Waits until pod `name` runs, watching it from the version last read; a watch that ends
    /// (the API server's timeout, a dropped connection) is read again and watched anew.
    pub async fn wait_running(&self, name: &str, limit: Duration) -> Result<(), Error> {
        let mut last = String::from("Pending");
        let watched = async {
            loop {
                let pod = match self.pods.get(name).await {
                    Err(kube::Error::Api(s)) if s.code == 404 => return Err(Error::Gone(name.to_owned())),
                    other => other.map_err(self.error("get pods"))?,
                };
                if settled(name, &pod, &mut last)? {
                    return Ok(());
                }
                let version = pod.metadata.resource_version.clone().unwrap_or_default();
                let wp = WatchParams::default().fields(&format!("metadata.name={name}")).timeout(60);
                let mut events = self.pods.watch(&wp, &version).await.map_err(self.error("watch pods"))?.boxed();
                while let Ok(Some(event)) = events.try_next().await {
                    match event {
                        WatchEvent::Added(p) | WatchEvent::Modified(p) if settled(name, &p, &mut last)? => {
                            return Ok(());
                        }
                        WatchEvent::Deleted(_) => return Err(Error::Gone(name.to_owned())),
                        // 410 Gone (our version is too old) and the rest: read and watch again.
                        WatchEvent::Error(_) => break,
                        _ => {}
                    }
                }
                // Not a busy loop when the API server ends every watch at once.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        match tokio::time::timeout(limit, watched).await {
            Ok(r) => r,
            Err(_) => Err(Error::NotRunning { pod: name.to_owned(), secs: limit.as_secs(), phase: last }),
        }
    }

    /// Runs `cmd` in the sandbox container of pod `name`, stdout and stderr apart.
    pub async fn exec(&self, name: &str, cmd: &[&str], stdin: bool) -> Result<Exec, Error> {
        let ap = AttachParams::default()
            .container(CONTAINER)
            .stdin(stdin)
            .stdout(true)
            .stderr(true)
            .max_stdout_buf_size(STDOUT_BUF)
            .max_stderr_buf_size(STDERR_BUF);
        let mut process = self.pods.exec(name, cmd.iter().copied(), &ap).await.map_err(self.error("exec into pods"))?;
        let (Some(stdout), Some(stderr)) = (process.stdout(), process.stderr()) else {
            return Err(Error::Config("kube-rs gave no stdout/stderr for an exec that asked for both".into()));
        };
        let stdin = process.stdin().map(|w| Box::pin(w) as Pin<Box<dyn AsyncWrite + Send>>);
        let status = process.take_status();
        let end = async move {
            match status {
                Some(s) => exec_end(s.await),
                None => ExecEnd::Lost,
            }
        }
        .boxed();
        Ok(Exec { stdin, stdout: Box::pin(stdout), stderr: Box::pin(stderr), end, process })
    }

    /// Reaches the agent of pod `name` through a relay to its keeper, which starts it when none
    /// runs: the interpreter outlives this exec (docs/design.md D12).
    pub async fn attach_agent(&self, name: &str) -> Result<Exec, Error> {
        self.exec(name, &crate::docker::exec::AGENT_CMD, true).await
    }

    /// Unpacks `tar` into `dir` of pod `name` through `tar -x` on the exec's stdin; needs an API
    /// server that speaks `v5.channel.k8s.io` (v4 cannot close stdin alone).
    pub async fn upload_tar(&self, name: &str, dir: &str, tar: crate::docker::Body) -> Result<ExecEnd, Error> {
        use tokio::io::AsyncWriteExt;
        let mut exec = self.exec(name, &["tar", "-x", "--no-same-owner", "-C", dir, "-f", "-"], true).await?;
        let drain = drain_both(
            std::mem::replace(&mut exec.stdout, Box::pin(tokio::io::empty())),
            std::mem::replace(&mut exec.stderr, Box::pin(tokio::io::empty())),
        );
        let drain = tokio::spawn(drain);
        if let Some(mut stdin) = exec.stdin.take() {
            // Sent as it comes: a restored snapshot is as big as --snapshot-cache-mb, never held whole.
            let wrote = async {
                let mut chunks = tar.into_stream();
                while let Some(chunk) = chunks.next().await {
                    stdin.write_all(&chunk?).await?;
                }
                stdin.shutdown().await
            };
            if let Err(e) = wrote.await {
                // A body that failed half way (its checker refused it) leaves the drain too.
                drain.abort();
                return Ok(ExecEnd::Failed(format!("cannot send the tar: {e}")));
            }
        }
        let end = tokio::time::timeout(Duration::from_secs(60), &mut exec.end).await.unwrap_or(ExecEnd::Lost);
        drain.abort();
        Ok(end)
    }

    /// A tar of `path` (relative to `dir`) in pod `name`, from `tar -c` on the exec's stdout,
    /// at most `cap` bytes: a bigger one is refused, not cut.
    pub async fn download_tar(&self, name: &str, dir: &str, path: &str, cap: usize) -> Result<Vec<u8>, Error> {
        use tokio::io::AsyncReadExt;
        let mut exec = self.exec(name, &["tar", "-c", "-C", dir, "-f", "-", "--", path], false).await?;
        let err = std::mem::replace(&mut exec.stderr, Box::pin(tokio::io::empty()));
        let drain = tokio::spawn(drain_both(Box::pin(tokio::io::empty()), err));
        let mut tar = Vec::new();
        let limit = u64::try_from(cap).unwrap_or(u64::MAX).saturating_add(1);
        let read = (&mut exec.stdout).take(limit).read_to_end(&mut tar).await;
        drain.abort();
        let too_big = || Error::Transfer(format!("{path} is bigger than {cap} bytes as a tar"));
        match read {
            Ok(_) if tar.len() > cap => Err(too_big()),
            Ok(_) => match tokio::time::timeout(Duration::from_secs(60), &mut exec.end).await {
                Ok(ExecEnd::Exited(0)) => Ok(tar),
                Ok(end) => Err(Error::Transfer(format!("cannot read {path} from pod {name}: {end:?}"))),
                Err(_) => Err(Error::Transfer(format!("reading {path} from pod {name} did not end within 60 s"))),
            },
            Err(e) => Err(Error::Transfer(format!("cannot read {path} from pod {name}: {e}"))),
        }
    }

    /// Pods of ours matching `selector` (`key=value,...`).
    pub async fn list_pods(&self, selector: &str) -> Result<Vec<Pod>, Error> {
        let list = self.pods.list(&ListParams::default().labels(selector)).await.map_err(self.error("list pods"))?;
        Ok(list.items)
    }

    /// Pod `name`, or `None` when it does not exist.
    pub async fn get_pod(&self, name: &str) -> Result<Option<Pod>, Error> {
        self.pods.get_opt(name).await.map_err(self.error("get pods"))
    }

    /// Deletes pod `name` at once; one already gone is fine.
    pub async fn delete_pod(&self, name: &str) -> Result<(), Error> {
        match self.pods.delete(name, &DeleteParams::default().grace_period(0)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(self.error("delete pods")(e)),
        }
    }
}

/// Why a pending container will not start by itself: the kubelet's waiting reasons that
/// need the operator (a real node keeps such a pod `Pending`, retrying for ever).
const STUCK: [&str; 5] =
    ["ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"];

/// Whether pod `name` runs; an error when it never will (stopped, or stuck waiting).
fn settled(name: &str, pod: &Pod, last: &mut String) -> Result<bool, Error> {
    *last = phase(pod);
    match last.as_str() {
        "Running" => return Ok(true),
        "Succeeded" | "Failed" => return Err(Error::Stopped { pod: name.to_owned(), phase: last.clone() }),
        _ => {}
    }
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    let waiting = statuses.into_iter().flatten().filter_map(|c| c.state.as_ref()?.waiting.as_ref());
    for w in waiting {
        let reason = w.reason.as_deref().unwrap_or_default();
        if STUCK.contains(&reason) {
            let message = w.message.clone().unwrap_or_default();
            return Err(Error::Stopped { pod: name.to_owned(), phase: format!("Pending, {reason}: {message}") });
        }
    }
    Ok(false)
}

/// Reads both streams to their end (a full one would stall kube-rs' message loop).
async fn drain_both(mut out: Pin<Box<dyn AsyncRead + Send>>, mut err: Pin<Box<dyn AsyncRead + Send>>) {
    let mut sink = tokio::io::sink();
    let mut sink2 = tokio::io::sink();
    let _ = tokio::join!(tokio::io::copy(&mut out, &mut sink), tokio::io::copy(&mut err, &mut sink2));
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{StatusCause, StatusDetails};

    fn status(state: &str, reason: &str, causes: Vec<StatusCause>) -> Status {
        Status {
            status: Some(state.into()),
            reason: Some(reason.into()),
            message: Some("command terminated with non-zero exit code".into()),
            details: Some(StatusDetails { causes: Some(causes), ..Default::default() }),
            ..Default::default()
        }
    }

    fn failure(reason: &str, causes: Vec<StatusCause>) -> Status {
        status("Failure", reason, causes)
    }

    fn cause(reason: &str, message: &str) -> StatusCause {
        StatusCause { reason: Some(reason.into()), message: Some(message.into()), field: None }
    }

    #[test]
    fn a_pod_stuck_pulling_its_image_is_said_not_waited_out() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting, ContainerStatus, PodStatus};
        let pod = |phase: &str, reason: &str| Pod {
            status: Some(PodStatus {
                phase: Some(phase.into()),
                container_statuses: Some(vec![ContainerStatus {
                    name: "sandbox".into(),
                    state: Some(ContainerState {
                        waiting: Some(ContainerStateWaiting {
                            reason: Some(reason.into()),
                            message: Some("pull access denied".into()),
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut last = String::new();
        let e = settled("p", &pod("Pending", "ImagePullBackOff"), &mut last).expect_err("stuck");
        assert!(e.to_string().contains("ImagePullBackOff: pull access denied"), "{e}");
        assert!(!settled("p", &pod("Pending", "ContainerCreating"), &mut last).expect("still coming"));
        assert!(settled("p", &pod("Running", ""), &mut last).expect("runs"));
        assert!(settled("p", &pod("Failed", ""), &mut last).is_err());
    }

    #[test]
    fn exit_codes_from_the_status_channel() {
        assert_eq!(exec_end(Some(status("Success", "", vec![]))), ExecEnd::Exited(0));
        assert_eq!(exec_end(Some(failure("NonZeroExitCode", vec![cause("ExitCode", "3")]))), ExecEnd::Exited(3));
        assert_eq!(exec_end(None), ExecEnd::Lost, "no status: the connection was lost");
        let other = exec_end(Some(failure("InternalError", vec![])));
        assert!(matches!(other, ExecEnd::Failed(m) if m.contains("non-zero")), "not an exit code");
        // A cause that is no number is no exit code.
        assert!(matches!(exec_end(Some(failure("NonZeroExitCode", vec![cause("ExitCode", "x")]))), ExecEnd::Failed(_)));
    }
}
