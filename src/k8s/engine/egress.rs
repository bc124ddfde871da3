//! Egress on the Kubernetes engine (Pods mode): the proxy is a pod of its own whose PID 1
//! idles and whose `pyberth egress-proxy` is an exec, its stdin and stdout the server's as the
//! Docker container's attach is; a session "network" is a record (NetworkPolicy, the CNI's,
//! keeps sandbox pods apart and lets labelled ones reach the proxy), and every pod's address
//! is its `podIP`, which the proxy tells sessions apart by (`egress::Binder`).

use std::collections::{BTreeMap, HashMap};

use bollard::models::{ContainerCreateBody, ContainerInspectResponse, EndpointSettings, NetworkSettings};
use bollard::query_parameters::AttachContainerOptions;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{DeleteParams, PostParams};

use super::translate::pod_name;
use super::{EngineError, ExecRec, KubeEngine, START_LIMIT, from_cluster, said, status, unsupported};
use crate::docker::seam::types::{AttachContainerResults, Network, NetworkCreateRequest, NetworkCreateResponse};
use crate::k8s::pod::{LABEL_APP, LABEL_PROXY_OF, PROXY_APP};

/// What agent-sandbox mode cannot do.
pub(super) fn not_claimed() -> EngineError {
    unsupported("egress in agent-sandbox mode (sessions of environments with `egress` need k8s_mode = \"pods\")")
}

impl KubeEngine {
    /// The proxy's pod, from the Docker body the egress owner made: its image is the
    /// configured one (the server's, carrying the executable), else the body's.
    pub(super) async fn create_proxy(&self, name: &str, body: &ContainerCreateBody) -> Result<(), EngineError> {
        if self.claimed.is_some() {
            return Err(not_claimed());
        }
        let image = self.egress_image.clone().or_else(|| body.image.clone()).ok_or_else(|| said("no proxy image"))?;
        // The body names where Docker uploads the executable; the pod's image has it here.
        let mut cmd = body.cmd.clone().unwrap_or_default();
        match cmd.first_mut() {
            Some(exe) => *exe = crate::k8s::pod::PROXY_EXE.to_owned(),
            None => return Err(said("the egress proxy has no command")),
        }
        let mut labels: BTreeMap<String, String> = body.labels.clone().unwrap_or_default().into_iter().collect();
        // This server's proxy pods, whichever is the current one: its Service selects them.
        let of = pod_name(name.rsplit_once("-egress-").map_or(name, |(base, _)| base));
        labels.insert(LABEL_PROXY_OF.into(), of.clone());
        // The Service first: the proxy is reached at its address from the start.
        self.proxy_service(&of, &labels).await?;
        let pod = crate::k8s::pod::proxy_pod(&self.settings, &image, &pod_name(name), &labels);
        self.cluster.create_pod(&pod).await.map_err(from_cluster)?;
        self.records().proxies.insert(name.to_owned(), cmd);
        Ok(())
    }

    /// The proxy's Service `<of>-svc`, made once: a ClusterIP that stays when a
    /// proxy pod is made again, so the sessions' variables (which name it) keep reaching one.
    /// Connections keep their source address through it (kube-proxy translates only the
    /// destination), which the proxy tells sessions apart by, with their pass.
    async fn proxy_service(&self, of: &str, labels: &BTreeMap<String, String>) -> Result<(), EngineError> {
        if self.records().proxy_service.is_some() {
            return Ok(());
        }
        let name = pod_name(&format!("{of}-svc"));
        let (ours, _) = crate::k8s::labels::split(labels);
        let svc: Service = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": { "name": name, "labels": ours },
            "spec": {
                "type": "ClusterIP",
                "selector": { LABEL_APP: PROXY_APP, LABEL_PROXY_OF: of },
                "ports": [{ "name": "proxy", "port": crate::egress::proxy::PORT, "targetPort": crate::egress::proxy::PORT, "protocol": "TCP" }],
            },
        }))
        .map_err(|e| said(format!("the proxy's Service did not serialize: {e}")))?;
        let api = self.cluster.services();
        let made = match api.create(&PostParams::default(), &svc).await {
            Ok(s) => s,
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let found = api.get(&name).await.map_err(|e| from_cluster(self.cluster.error("get services")(e)))?;
                // Whoever may make Services could have made this one first, sending the
                // sessions' traffic (their passes with it) to pods of theirs.
                let selector = found.spec.as_ref().and_then(|s| s.selector.clone()).unwrap_or_default();
                let ours = BTreeMap::from([
                    (LABEL_APP.to_owned(), PROXY_APP.to_owned()),
                    (LABEL_PROXY_OF.to_owned(), of.to_owned()),
                ]);
                if selector != ours {
                    return Err(said(format!(
                        "Service {name} exists and selects other pods than this server's egress proxy: delete it"
                    )));
                }
                found
            }
            Err(e) => return Err(from_cluster(self.cluster.error("create services")(e))),
        };
        let ip = made.spec.and_then(|s| s.cluster_ip).filter(|ip| !ip.is_empty() && ip != "None");
        let ip = ip.ok_or_else(|| said(format!("the proxy's Service {name} got no cluster address")))?;
        self.records().proxy_service = Some((name, ip));
        Ok(())
    }

    /// After another server's proxy pod `pod` was deleted (a sweep of a dead server's
    /// leftovers): its Service, which only that server's proxy pods used.
    pub(super) async fn proxy_service_of_dead(&self, pod: &Pod) {
        let of = pod.metadata.labels.as_ref().and_then(|l| l.get(LABEL_PROXY_OF)).cloned();
        // Believed only when it names the pod's own server (its name's), as a container name is.
        let own = pod.metadata.name.as_deref().and_then(|n| n.rsplit_once("-egress-")).map(|(base, _)| pod_name(base));
        let Some(of) = of.filter(|of| own.as_ref() == Some(of)) else { return };
        let name = pod_name(&format!("{of}-svc"));
        if self.records().proxy_service.as_ref().is_some_and(|(own, _)| *own == name) {
            return;
        }
        match self.cluster.services().delete(&name, &DeleteParams::default()).await {
            Ok(_) => tracing::info!(service = %name, "deleted a stopped server's egress proxy Service"),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                tracing::warn!(service = %name, error = %e, "cannot delete a stopped server's egress proxy Service")
            }
        }
    }

    /// Deletes the proxy's Service once nothing uses it: no proxy pod and no session network
    /// (a proxy made again while sessions are open keeps it, and so its address).
    pub(super) async fn proxy_service_done(&self) {
        let done = {
            let mut r = self.records();
            if r.proxies.is_empty() && r.networks.is_empty() { r.proxy_service.take() } else { None }
        };
        if let Some((name, _)) = done
            && let Err(e) = self.cluster.services().delete(&name, &DeleteParams::default()).await
        {
            tracing::warn!(service = %name, error = %e, "cannot delete the egress proxy's Service");
        }
    }

    /// The proxy's exec, once its pod runs: its stdout and stderr as an attach's output.
    pub(super) async fn attach_proxy(
        &self,
        name: &str,
        cmd: Vec<String>,
    ) -> Result<AttachContainerResults, EngineError> {
        self.cluster.wait_running(&pod_name(name), START_LIMIT).await.map_err(from_cluster)?;
        let id = {
            let mut r = self.records();
            r.serial += 1;
            let id = format!("k8s-exec-{}", r.serial);
            r.execs.insert(id.clone(), ExecRec { container: name.to_owned(), cmd, stdin: true, end: None });
            id
        };
        match self.start(&id).await? {
            bollard::exec::StartExecResults::Attached { output, input } => Ok(AttachContainerResults { output, input }),
            bollard::exec::StartExecResults::Detached => Err(said("the egress proxy's exec came back detached")),
        }
    }

    /// An attach the engine serves: the proxy's, or `None`.
    pub(super) fn proxy_cmd(&self, name: &str, _: &Option<AttachContainerOptions>) -> Option<Vec<String>> {
        self.records().proxies.get(name).cloned()
    }

    /// A pod's address as Docker shows a container's: the proxy has it on every session
    /// network (all reach the one pod), a session pod on its own.
    pub(super) fn with_address(
        &self,
        name: &str,
        pod: &Pod,
        mut c: ContainerInspectResponse,
    ) -> ContainerInspectResponse {
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()).filter(|ip| !ip.is_empty()) else {
            return c;
        };
        let r = self.records();
        let at = |ip: String| EndpointSettings { ip_address: Some(ip), ..Default::default() };
        // Every pod on "pod" at its own address; the proxy also on each session network, at
        // its Service's address, where sessions reach it (both are its own, which it refuses
        // to connect to).
        let mut networks: HashMap<String, EndpointSettings> = HashMap::from([("pod".to_owned(), at(ip.clone()))]);
        if r.proxies.contains_key(name) {
            let reached = r.proxy_service.as_ref().map_or(ip, |(_, service)| service.clone());
            networks.extend(r.networks.keys().map(|n| (n.clone(), at(reached.clone()))));
        }
        c.network_settings = Some(NetworkSettings { networks: Some(networks), ..Default::default() });
        c
    }

    pub(super) fn network_create(&self, req: NetworkCreateRequest) -> Result<NetworkCreateResponse, EngineError> {
        if self.claimed.is_some() {
            return Err(not_claimed());
        }
        let mut r = self.records();
        if r.networks.contains_key(&req.name) {
            return Err(status(409, format!("network with name {} already exists", req.name)));
        }
        r.networks.insert(req.name.clone(), req.labels.unwrap_or_default());
        Ok(NetworkCreateResponse { id: req.name, warning: String::new() })
    }

    /// Whether network `name` is a record of ours, else a 404 as Docker says it.
    pub(super) fn network_known(&self, name: &str, remove: bool) -> Result<(), EngineError> {
        let mut r = self.records();
        let known = if remove { r.networks.remove(name).is_some() } else { r.networks.contains_key(name) };
        if known { Ok(()) } else { Err(status(404, format!("No such network: {name}"))) }
    }

    pub(super) fn network_list(&self, filters: Option<&HashMap<String, Vec<String>>>) -> Vec<Network> {
        let r = self.records();
        r.networks
            .iter()
            .filter(|(_, l)| crate::docker::seam::matches_labels(l, filters))
            .map(|(n, l)| Network { name: Some(n.clone()), labels: Some(l.clone()), ..Default::default() })
            .collect()
    }
}
