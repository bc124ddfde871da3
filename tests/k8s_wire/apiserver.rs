//! A simulated Kubernetes API server on loopback: the REST kube-rs speaks for pods (create, get,
//! list by label, delete, with resourceVersions), watch streams (newline-delimited events from
//! a version on, with a field selector), and the exec websocket (`exec.rs`). Pods "run" as
//! containers of the local Docker engine (`docker_pod.rs`). It is our model of the protocol:
//! what it checks is the wire, not a kubelet's fidelity.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bollard::Docker;
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::docker_pod;

pub(crate) type Body = UnsyncBoxBody<Bytes, Infallible>;

/// How the simulated server behaves.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Every request answered 403, as RBAC without our Role would.
    pub(crate) forbid: bool,
    /// Only creating a pod answered 403 (a Role without `create`).
    pub(crate) forbid_create: bool,
    /// The exec subprotocols the server speaks, best first.
    pub(crate) protocols: Vec<&'static str>,
    /// This many watch streams end right after they open (a watch that drops).
    pub(crate) drop_watches: usize,
    /// How long the node takes before it starts a pod's container.
    pub(crate) start_delay: std::time::Duration,
    /// Every exec stream is cut this long after it opens, without a Status.
    pub(crate) cut_exec_after: Option<std::time::Duration>,
    /// agent-sandbox's controller binds claims (`controller.rs`).
    pub(crate) controller: bool,
    /// Claims after the first are said bound to the first's Sandbox (a forged status).
    pub(crate) bind_to_first: bool,
    /// With `bind_to_first`: the claim's labels are made the first Sandbox's pod's too (whoever
    /// can write a claim can relabel it).
    pub(crate) relabel_claims: bool,
    /// Writing SandboxTemplates and SandboxWarmPools answered 403 (a Role that only reads them).
    pub(crate) forbid_templates: bool,
    /// The controller keeps each warm pool's sandboxes made ahead, and a claim adopts one.
    pub(crate) warm_pool: bool,
    /// How long after binding a warm sandbox the controller puts the claim's labels on its pod.
    pub(crate) label_delay: std::time::Duration,
    /// The controller's pods may escalate privileges (a template loosened after pyberth made it).
    pub(crate) weaken: bool,
    /// The node's model of the NetworkPolicies: this `internal` Docker network (the test's)
    /// holds the pods labelled `pyberth.io/egress=proxy` and the egress proxy pod; every
    /// other pod has no network.
    pub(crate) egress_network: Option<String>,
    /// The executable the proxy pod's image carries at `pod::PROXY_EXE` (bind-mounted: the
    /// simulator's stand-in for the server's image).
    pub(crate) proxy_exe: Option<std::path::PathBuf>,
    /// Run as a pod is deleted, once its container is gone and before the answer (the
    /// deleting client still waits): what happens at once on a cluster after a deletion.
    pub(crate) on_delete: Option<OnDelete>,
    /// The namespace's PersistentVolumeClaims, each bound to a folder of the test's (its
    /// PersistentVolume), which the node bind-mounts (`docker_pod::claim_bind`).
    pub(crate) claims: BTreeMap<String, std::path::PathBuf>,
    /// The addresses Services get (`services.rs`): on the egress network, whose subnet the
    /// test chose; none given: Services get addresses nothing answers at.
    pub(crate) service_ips: Vec<String>,
    /// The claims' volumes apply `fsGroup` (a CSI driver with `fsGroupPolicy: File`); off, as
    /// most ReadWriteMany drivers are by default (`ReadWriteOnceWithFSType`).
    pub(crate) fs_group: bool,
}

/// A hook given the deleted pod's name and address (blocking code: it runs on its own thread).
#[derive(Clone)]
pub(crate) struct OnDelete(pub(crate) Arc<DeleteHook>);

/// Given the pod's name and its address, if it had one.
pub(crate) type DeleteHook = dyn Fn(&str, Option<&str>) + Send + Sync;

impl std::fmt::Debug for OnDelete {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnDelete")
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            forbid: false,
            forbid_create: false,
            protocols: vec!["v5.channel.k8s.io", "v4.channel.k8s.io"],
            drop_watches: 0,
            start_delay: std::time::Duration::ZERO,
            cut_exec_after: None,
            controller: false,
            bind_to_first: false,
            relabel_claims: false,
            forbid_templates: false,
            warm_pool: false,
            label_delay: std::time::Duration::ZERO,
            weaken: false,
            egress_network: None,
            proxy_exe: None,
            on_delete: None,
            claims: BTreeMap::new(),
            service_ips: Vec::new(),
            fs_group: false,
        }
    }
}

pub(crate) struct Stored {
    pub(crate) pod: Pod,
    /// The Docker container that "runs" it, once started.
    pub(crate) container: Option<String>,
}

pub(crate) struct State {
    pub(crate) opts: Options,
    pub(crate) docker: Docker,
    /// This simulator's id: its containers' label and names.
    pub(crate) sim: String,
    pub(crate) pods: Mutex<BTreeMap<String, Stored>>,
    pub(crate) version: AtomicU64,
    /// agent-sandbox's objects by (plural, name) (`crds.rs`).
    pub(crate) objects: Mutex<BTreeMap<(String, String), Value>>,
    /// Every event so far (version, type, pod), for watches that start from a version.
    log: Mutex<Vec<(u64, &'static str, Pod)>>,
    events: broadcast::Sender<(u64, &'static str, Pod)>,
    watches_dropped: AtomicUsize,
    /// Requests seen, "METHOD path" (the test reads which calls were made).
    pub(crate) seen: Mutex<Vec<String>>,
}

pub(crate) struct Sim {
    pub(crate) addr: SocketAddr,
    pub(crate) state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
    stopped: bool,
}

impl Sim {
    pub(crate) async fn start(opts: Options, docker: Docker) -> Sim {
        static N: AtomicU64 = AtomicU64::new(0);
        let sim = format!("sim{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let (events, _) = broadcast::channel(256);
        let state = Arc::new(State {
            opts,
            docker,
            sim,
            pods: Mutex::default(),
            version: AtomicU64::new(100),
            objects: Mutex::default(),
            log: Mutex::default(),
            events,
            watches_dropped: AtomicUsize::new(0),
            seen: Mutex::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let serving = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = serving.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| handle(state.clone(), req));
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ =
                        hyper::server::conn::http1::Builder::new().serve_connection(io, service).with_upgrades().await;
                });
            }
        });
        Sim { addr, state, task, stopped: false }
    }

    /// A kubeconfig for this server (plain HTTP on loopback, a bearer token).
    pub(crate) fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: sim\n  cluster:\n    server: http://{}\ncontexts:\n- name: sim\n  context:\n    cluster: sim\n    user: sim\n    namespace: pyberth\ncurrent-context: sim\nusers:\n- name: sim\n  user:\n    token: not-a-secret\n",
            self.addr
        );
        let path = kubeconfig_path(dir, &self.state.sim);
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    /// Stops serving and removes every container it started.
    pub(crate) async fn stop(mut self) {
        self.task.abort();
        docker_pod::remove_all(&self.state.docker, &self.state.sim).await;
        self.stopped = true;
    }
}

fn kubeconfig_path(dir: &std::path::Path, sim: &str) -> std::path::PathBuf {
    dir.join(format!("pyberth-kubeconfig-{sim}"))
}

impl Drop for Sim {
    /// A test that failed before `stop` still leaves no container behind.
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(kubeconfig_path(&std::env::temp_dir(), &self.state.sim));
        if !self.stopped {
            let filter = format!("label={}={}", docker_pod::LABEL_SIM, self.state.sim);
            let ids = std::process::Command::new("docker").args(["ps", "-aq", "--filter", &filter]).output();
            let ids = ids.map(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().map(str::to_owned).collect());
            let ids: Vec<String> = ids.unwrap_or_default();
            if !ids.is_empty() {
                let _ = std::process::Command::new("docker").args(["rm", "-f"]).args(&ids).output();
            }
        }
    }
}

pub(crate) fn full(status: StatusCode, body: Value) -> Response<Body> {
    let bytes = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(bytes).boxed_unsync())
        .unwrap_or_default()
}

/// A `metav1.Status` failure, as the API server writes it.
pub(crate) fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16()});
    full(code, body)
}

fn query(req: &Request<Incoming>) -> Vec<(String, String)> {
    form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes()).into_owned().collect()
}

fn param<'a>(q: &'a [(String, String)], key: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    state.seen.lock().expect("seen").push(format!("{} {}", req.method(), req.uri()));
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    if parts.first() == Some(&"apis") {
        let fallback = status(StatusCode::NOT_FOUND, "NotFound", &format!("the server could not find {path}"));
        return Ok(super::crds::handle(&state, &parts, req).await.unwrap_or(fallback));
    }
    if let Some(rest) = parts.strip_prefix(&["api", "v1", "namespaces", "pyberth", "services"]) {
        return Ok(super::services::handle(&state, rest, req).await);
    }
    let Some(rest) = parts.strip_prefix(&["api", "v1", "namespaces", "pyberth", "pods"]) else {
        return Ok(status(StatusCode::NOT_FOUND, "NotFound", &format!("the server could not find {path}")));
    };
    let creating = req.method() == hyper::Method::POST && rest.is_empty();
    if state.opts.forbid || (state.opts.forbid_create && creating) {
        let verb = match (req.method().as_str(), rest) {
            ("POST", []) => "create",
            (_, [_, "exec"]) => "create",
            ("DELETE", _) => "delete",
            ("GET", []) if param(&query(&req), "watch").is_some() => "watch",
            ("GET", []) => "list",
            _ => "get",
        };
        let what = if rest.get(1) == Some(&"exec") { "pods/exec" } else { "pods" };
        let message = format!(
            "{what} is forbidden: User \"system:serviceaccount:pyberth:pyberth\" cannot {verb} resource \"{what}\" in API group \"\" in the namespace \"pyberth\""
        );
        return Ok(status(StatusCode::FORBIDDEN, "Forbidden", &message));
    }
    let method = req.method().as_str().to_owned();
    Ok(match (method.as_str(), rest) {
        ("POST", []) => create(state, req).await,
        ("GET", []) if param(&query(&req), "watch") == Some("true") => watch(state, &query(&req)),
        ("GET", []) => list(&state, &query(&req)),
        ("GET", [name]) => match state.pods.lock().expect("pods").get(*name) {
            Some(s) => full(StatusCode::OK, serde_json::to_value(&s.pod).unwrap_or_default()),
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("pods \"{name}\" not found")),
        },
        ("DELETE", [name]) => delete(state, name).await,
        ("GET" | "POST", [name, "exec"]) => super::exec::upgrade(state.clone(), name, req).await,
        _ => status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not simulated"),
    })
}

impl State {
    /// Stores `pod` under a new resourceVersion and tells the watches.
    pub(crate) fn record(&self, kind: &'static str, mut pod: Pod) -> Pod {
        let version = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        pod.metadata.resource_version = Some(version.to_string());
        self.log.lock().expect("log").push((version, kind, pod.clone()));
        let _ = self.events.send((version, kind, pod.clone()));
        pod
    }

    /// Adds `labels` and `annotations` to pod `name` (a controller's patch), telling the watches.
    pub(crate) fn relabel(&self, name: &str, labels: BTreeMap<String, String>, annotations: BTreeMap<String, String>) {
        let mut pods = self.pods.lock().expect("pods");
        let Some(stored) = pods.get_mut(name) else { return };
        let mut pod = stored.pod.clone();
        pod.metadata.labels.get_or_insert_with(Default::default).extend(labels);
        pod.metadata.annotations.get_or_insert_with(Default::default).extend(annotations);
        stored.pod = self.record("MODIFIED", pod);
    }

    pub(crate) fn set_phase(&self, name: &str, phase: &str, container: Option<String>) {
        self.set_phase_at(name, phase, container, None);
    }

    /// The same, with the pod's address (`podIP`).
    pub(crate) fn set_phase_at(&self, name: &str, phase: &str, container: Option<String>, ip: Option<String>) {
        let mut pods = self.pods.lock().expect("pods");
        let Some(stored) = pods.get_mut(name) else { return };
        let mut pod = stored.pod.clone();
        let status = pod.status.get_or_insert_with(Default::default);
        status.phase = Some(phase.into());
        if ip.is_some() {
            status.pod_ip = ip;
        }
        stored.pod = self.record("MODIFIED", pod);
        if container.is_some() {
            stored.container = container;
        }
    }
}

async fn create(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    // Typed: a body the API server would not decode as a Pod is refused here too.
    let pod: Pod = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &format!("not a Pod: {e}")),
    };
    match make_pod(&state, pod) {
        Ok(stored) => full(StatusCode::CREATED, serde_json::to_value(&stored).unwrap_or_default()),
        Err(refused) => *refused,
    }
}

/// Stores `pod` as Pending and has the node start it (Running, or Failed); the agent-sandbox
/// controller makes its pods so too.
pub(crate) fn make_pod(state: &Arc<State>, mut pod: Pod) -> Result<Pod, Box<Response<Body>>> {
    let Some(name) = pod.metadata.name.clone() else {
        return Err(Box::new(status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "metadata.name: Required value")));
    };
    pod.metadata.namespace = Some("pyberth".into());
    pod.metadata.uid = Some(format!("uid-{name}"));
    pod.status = Some(k8s_openapi::api::core::v1::PodStatus { phase: Some("Pending".into()), ..Default::default() });
    let stored = {
        let mut pods = state.pods.lock().expect("pods");
        if pods.contains_key(&name) {
            return Err(Box::new(status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                &format!("pods \"{name}\" already exists"),
            )));
        }
        let stored = state.record("ADDED", pod);
        pods.insert(name.clone(), Stored { pod: stored.clone(), container: None });
        stored
    };
    // The node: start the container, then say Running (or Failed).
    let node = state.clone();
    let started = stored.clone();
    tokio::spawn(async move {
        tokio::time::sleep(node.opts.start_delay).await;
        let container = format!("{}-{name}", node.sim);
        let service_ip = super::services::address_of(&node, &started);
        match docker_pod::start(&node.docker, &started, &container, &node.sim, &node.opts, service_ip).await {
            Ok((id, ip)) => node.set_phase_at(&name, "Running", Some(id), ip),
            Err(e) => {
                eprintln!("simulated node: pod {name} failed: {e}");
                node.set_phase(&name, "Failed", None);
            }
        }
    });
    Ok(stored)
}

fn selected(pod: &Pod, labels: Option<&str>, fields: Option<&str>) -> bool {
    let have = pod.metadata.labels.clone().unwrap_or_default();
    let label_ok =
        labels.unwrap_or_default().split(',').filter(|s| !s.is_empty()).all(|term| match term.split_once('=') {
            Some((k, v)) => have.get(k).map(String::as_str) == Some(v),
            None => have.contains_key(term),
        });
    let field_ok = fields
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .all(|term| term.strip_prefix("metadata.name=").is_some_and(|n| pod.metadata.name.as_deref() == Some(n)));
    label_ok && field_ok
}

fn list(state: &State, q: &[(String, String)]) -> Response<Body> {
    let pods = state.pods.lock().expect("pods");
    let items: Vec<Value> = pods
        .values()
        .filter(|s| selected(&s.pod, param(q, "labelSelector"), param(q, "fieldSelector")))
        .map(|s| serde_json::to_value(&s.pod).unwrap_or_default())
        .collect();
    let version = state.version.load(Ordering::SeqCst).to_string();
    full(
        StatusCode::OK,
        json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": version}, "items": items}),
    )
}

fn watch(state: Arc<State>, q: &[(String, String)]) -> Response<Body> {
    let from: u64 = param(q, "resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let (labels, fields) = (param(q, "labelSelector").map(str::to_owned), param(q, "fieldSelector").map(str::to_owned));
    let dropped = state.watches_dropped.fetch_add(1, Ordering::SeqCst) < state.opts.drop_watches;
    // Subscribed before the replay, so nothing falls between the two.
    let live = state.events.subscribe();
    let past: Vec<_> = state.log.lock().expect("log").iter().filter(|(v, ..)| *v > from).cloned().collect();
    let keep = move |(v, kind, pod): (u64, &'static str, Pod)| {
        (v > from && selected(&pod, labels.as_deref(), fields.as_deref())).then(|| {
            let mut line = serde_json::to_vec(&json!({"type": kind, "object": pod})).unwrap_or_default();
            line.push(b'\n');
            Ok::<_, Infallible>(Frame::data(Bytes::from(line)))
        })
    };
    let live = tokio_stream_from(live);
    let events = futures::stream::iter(past).chain(live).filter_map(move |e| futures::future::ready(keep(e)));
    let body: Body = if dropped {
        // Ends at once, as a connection the load balancer cut.
        StreamBody::new(futures::stream::empty::<Result<Frame<Bytes>, Infallible>>()).boxed_unsync()
    } else {
        StreamBody::new(events).boxed_unsync()
    };
    Response::builder().status(StatusCode::OK).header("content-type", "application/json").body(body).unwrap_or_default()
}

fn tokio_stream_from(
    rx: broadcast::Receiver<(u64, &'static str, Pod)>,
) -> impl futures::Stream<Item = (u64, &'static str, Pod)> + Send {
    futures::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(e) => return Some((e, rx)),
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
}

pub(crate) async fn delete(state: Arc<State>, name: &str) -> Response<Body> {
    let stored = state.pods.lock().expect("pods").remove(name);
    let Some(stored) = stored else {
        return status(StatusCode::NOT_FOUND, "NotFound", &format!("pods \"{name}\" not found"));
    };
    if let Some(id) = &stored.container {
        docker_pod::remove(&state.docker, id).await;
    }
    if let Some(hook) = state.opts.on_delete.clone() {
        let ip = stored.pod.status.as_ref().and_then(|s| s.pod_ip.clone());
        let name = name.to_owned();
        let _ = tokio::task::spawn_blocking(move || (hook.0)(&name, ip.as_deref())).await;
    }
    let pod = state.record("DELETED", stored.pod);
    full(StatusCode::OK, serde_json::to_value(&pod).unwrap_or_default())
}
