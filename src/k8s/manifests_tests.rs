//! Every document of `deploy/kubernetes/` parses into its type, says nothing the type does not
//! know (a typo would be dropped silently by the API server's own decoder), and keeps the
//! hardening the sandbox pods need.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PersistentVolumeClaim, PodSpec, PodTemplateSpec, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::FILES;

/// agent-sandbox `SandboxTemplate` (extensions.agents.x-k8s.io/v1beta1), the fields we use.
#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct SandboxTemplateSpec {
    pub(crate) pod_template: PodTemplateSpec,
    network_policy_management: String,
    pub(crate) network_policy: SandboxNetworkPolicy,
}

#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SandboxNetworkPolicy {
    pub(crate) ingress: Vec<Value>,
    pub(crate) egress: Vec<Value>,
}

/// agent-sandbox `SandboxWarmPool`, the fields we use.
#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct SandboxWarmPoolSpec {
    pub(crate) replicas: u32,
    pub(crate) sandbox_template_ref: Named,
}

#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Named {
    pub(crate) name: String,
}

/// A custom resource: our spec struct under the usual envelope.
#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct Custom<S> {
    pub(crate) api_version: String,
    kind: String,
    pub(crate) metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    pub(crate) spec: S,
}

fn docs() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for (file, text) in FILES {
        let docs: Vec<Value> = serde_saphyr::from_multiple(text).unwrap_or_else(|e| panic!("{file}: {e}"));
        for d in docs {
            let kind = d["kind"].as_str().unwrap_or_else(|| panic!("{file}: a document without kind")).to_owned();
            out.push((format!("{file}/{kind}"), d));
        }
    }
    out
}

/// Parses `doc` as `T` and checks that serializing it back gives the document: nothing unknown
/// (a misspelt field) was dropped on the way.
pub(crate) fn typed<T: DeserializeOwned + serde::Serialize>(at: &str, doc: &Value) -> T {
    let t: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{at}: {e}"));
    let back = serde_json::to_value(&t).unwrap_or_else(|e| panic!("{at}: {e}"));
    assert_eq!(&back, doc, "{at}: a field the type does not know, or a wrong shape");
    t
}

pub(crate) fn check_sandbox_pod(at: &str, spec: &PodSpec) {
    assert_eq!(spec.automount_service_account_token, Some(false), "{at}");
    assert_eq!(spec.enable_service_links, Some(false), "{at}");
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"), "{at}");
    let ps = spec.security_context.as_ref().unwrap_or_else(|| panic!("{at}: pod securityContext"));
    assert_eq!(ps.run_as_non_root, Some(true), "{at}");
    assert!(ps.run_as_user.is_some_and(|u| u >= 1000), "{at}: a non-root uid from our range");
    assert_eq!(ps.seccomp_profile.as_ref().map(|p| p.type_.as_str()), Some("RuntimeDefault"), "{at}");
    for c in &spec.containers {
        let cs = c.security_context.as_ref().unwrap_or_else(|| panic!("{at}: container securityContext"));
        assert_eq!(cs.allow_privilege_escalation, Some(false), "{at}");
        assert_eq!(cs.read_only_root_filesystem, Some(true), "{at}");
        assert_eq!(cs.capabilities.as_ref().and_then(|c| c.drop.clone()), Some(vec!["ALL".to_owned()]), "{at}");
        let r = c.resources.as_ref().unwrap_or_else(|| panic!("{at}: resources"));
        let limits = r.limits.as_ref().unwrap_or_else(|| panic!("{at}: limits"));
        for k in ["cpu", "memory", "ephemeral-storage"] {
            assert!(limits.contains_key(k), "{at}: limit {k}");
        }
    }
    for v in spec.volumes.iter().flatten() {
        // The layer store: read-only, in the source and in every mount, and only its `sets/`.
        if let Some(claim) = &v.persistent_volume_claim {
            assert_eq!(claim.read_only, Some(true), "{at}: {} is read-only", v.name);
            let mounts = spec.containers.iter().flat_map(|c| c.volume_mounts.iter().flatten());
            for m in mounts.filter(|m| m.name == v.name) {
                assert_eq!((m.read_only, m.sub_path.as_deref()), (Some(true), Some("sets")), "{at}: {}", v.name);
            }
            continue;
        }
        let d = v.empty_dir.as_ref().unwrap_or_else(|| panic!("{at}: volume {} is an emptyDir", v.name));
        assert_eq!(d.medium.as_deref(), Some("Memory"), "{at}: {}", v.name);
        assert!(d.size_limit.is_some(), "{at}: {} has a size limit", v.name);
    }
}

#[test]
fn every_document_parses_into_its_type_with_nothing_unknown() {
    let docs = docs();
    assert!(docs.len() >= 10, "{} documents", docs.len());
    for (at, d) in &docs {
        check_kind(at, d);
    }
}

/// `d` parses into the type of its kind with nothing unknown.
pub(crate) fn check_kind(at: &str, d: &Value) {
    match d["kind"].as_str().unwrap_or_default() {
        "Namespace" => drop(typed::<Namespace>(at, d)),
        "ServiceAccount" => drop(typed::<ServiceAccount>(at, d)),
        "Role" => drop(typed::<Role>(at, d)),
        "RoleBinding" => drop(typed::<RoleBinding>(at, d)),
        "Deployment" => drop(typed::<Deployment>(at, d)),
        "Service" => drop(typed::<Service>(at, d)),
        "ConfigMap" => drop(typed::<ConfigMap>(at, d)),
        "PersistentVolumeClaim" => drop(typed::<PersistentVolumeClaim>(at, d)),
        "RuntimeClass" => drop(typed::<RuntimeClass>(at, d)),
        "NetworkPolicy" => drop(typed::<NetworkPolicy>(at, d)),
        "SandboxTemplate" => drop(typed::<Custom<SandboxTemplateSpec>>(at, d)),
        "SandboxWarmPool" => drop(typed::<Custom<SandboxWarmPoolSpec>>(at, d)),
        other => panic!("{at}: no test knows kind {other}"),
    }
}

#[test]
fn everything_lives_in_the_pyberth_namespace() {
    for (at, d) in docs() {
        let ns = if d["kind"] == "Namespace" { &d["metadata"]["name"] } else { &d["metadata"]["namespace"] };
        assert_eq!(ns.as_str(), Some("pyberth"), "{at}");
    }
}

#[test]
fn the_role_grants_only_what_we_use() {
    let (at, d) = docs().into_iter().find(|(_, d)| d["kind"] == "Role").expect("a Role");
    check_role(&at, &d);
}

/// The Role `d` grants what the engine needs and nothing more: no wildcard, no secrets, no
/// deletion of templates and pools, Sandboxes only read.
pub(crate) fn check_role(at: &str, d: &Value) {
    let role: Role = typed(at, d);
    let mut granted = Vec::new();
    for rule in role.rules.expect("rules") {
        for r in rule.resources.expect("resources") {
            for v in &rule.verbs {
                assert_ne!(v, "*", "{at}: no wildcard verb");
                granted.push(format!("{r}:{v}"));
            }
            assert_ne!(r, "*", "{at}: no wildcard resource");
            assert!(
                !["secrets", "configmaps", "serviceaccounts", "roles", "rolebindings"].contains(&r.as_str()),
                "{r}"
            );
        }
    }
    let agent_sandbox = [
        "sandboxclaims:create",
        "sandboxclaims:patch",
        "sandboxclaims:delete",
        "sandboxtemplates:create",
        "sandboxtemplates:patch",
        "sandboxwarmpools:create",
        "sandboxwarmpools:patch",
        "sandboxes:get",
        "leases:create",
        "leases:patch",
        "leases:delete",
        "leases:list",
    ];
    let egress = ["services:create", "services:get", "services:delete"];
    let pods = ["pods:create", "pods:delete", "pods:watch", "pods/exec:create"];
    for must in pods.into_iter().chain(egress).chain(agent_sandbox) {
        assert!(granted.iter().any(|g| g == must), "{must} missing from {granted:?}");
    }
    assert!(!granted.iter().any(|g| g.starts_with("pods:update") || g.starts_with("pods:patch")), "{granted:?}");
    // Services: made and deleted (the proxy's), never changed or listed.
    let service_verbs = ["services:create", "services:get", "services:delete"];
    assert!(granted.iter().filter(|g| g.starts_with("services:")).all(|g| service_verbs.contains(&g.as_str())));
    // Templates and pools are ours to make and update, never to delete (another release's
    // sessions may still claim from them); Sandboxes are agent-sandbox's, only read.
    assert!(
        !granted.iter().any(|g| g.starts_with("sandboxtemplates:delete") || g.starts_with("sandboxwarmpools:delete"))
    );
    assert!(!granted.iter().any(|g| g.starts_with("sandboxes:")
        && !g.ends_with(":get")
        && !g.ends_with(":list")
        && !g.ends_with(":watch")));
}

#[test]
fn sandboxes_are_denied_all_traffic_but_the_proxy() {
    let docs = docs();
    let policies: Vec<NetworkPolicy> =
        docs.iter().filter(|(_, d)| d["kind"] == "NetworkPolicy").map(|(at, d)| typed(at, d)).collect();
    let deny = policies
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("sandbox-default-deny"))
        .and_then(|p| p.spec.clone())
        .expect("the default deny");
    assert_eq!(
        deny.pod_selector.clone().and_then(|s| s.match_labels).unwrap_or_default()["pyberth.io/sandbox"],
        "true"
    );
    assert_eq!(deny.policy_types, Some(vec!["Ingress".to_owned(), "Egress".to_owned()]));
    assert!(deny.ingress.is_none() && deny.egress.is_none(), "no rule: deny all");
    let proxy = policies
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("sandbox-egress-to-proxy"))
        .and_then(|p| p.spec.clone())
        .expect("the proxy rule");
    assert!(proxy.ingress.is_none(), "no ingress to sandboxes");
    let rules = proxy.egress.expect("egress rules");
    assert_eq!(rules.len(), 1);
    let to = rules[0].to.clone().expect("a peer");
    assert_eq!(to.len(), 1);
    assert!(to[0].ip_block.is_none() && to[0].namespace_selector.is_none(), "only pods of this namespace");
    let ports = rules[0].ports.clone().expect("ports");
    assert_eq!(ports.len(), 1, "the proxy port only: no DNS");
    // The proxy pod is reached by those sandboxes only (it keys sessions by their address).
    let inbound = policies
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("egress-proxy-from-sandboxes"))
        .and_then(|p| p.spec.clone())
        .expect("the proxy's ingress rule");
    let selected = inbound.pod_selector.clone().and_then(|s| s.match_labels).unwrap_or_default();
    assert_eq!(selected.get(crate::k8s::pod::LABEL_APP).map(String::as_str), Some(crate::k8s::pod::PROXY_APP));
    assert_eq!(inbound.policy_types, Some(vec!["Ingress".to_owned()]));
    let rules = inbound.ingress.expect("ingress rules");
    assert_eq!(rules.len(), 1);
    let from = rules[0].from.clone().expect("a peer");
    let labels = from[0].pod_selector.clone().and_then(|s| s.match_labels).unwrap_or_default();
    assert_eq!((labels["pyberth.io/sandbox"].as_str(), labels["pyberth.io/egress"].as_str()), ("true", "proxy"));
    assert!(from.len() == 1 && from[0].namespace_selector.is_none() && from[0].ip_block.is_none());
    let ports = rules[0].ports.clone().expect("ports");
    assert_eq!(ports.len(), 1, "the proxy port only");
}

#[test]
fn the_sandbox_template_is_as_hardened_as_our_pods() {
    let (at, d) = docs().into_iter().find(|(_, d)| d["kind"] == "SandboxTemplate").expect("a template");
    let t: Custom<SandboxTemplateSpec> = typed(&at, &d);
    assert_eq!(t.api_version, "extensions.agents.x-k8s.io/v1beta1");
    assert!(t.spec.network_policy.egress.is_empty(), "{at}: egress: [] (the Managed default is the internet)");
    assert!(t.spec.network_policy.ingress.is_empty(), "{at}");
    check_sandbox_pod(&at, t.spec.pod_template.spec.as_ref().expect("pod spec"));
    let (at, d) = docs().into_iter().find(|(_, d)| d["kind"] == "SandboxWarmPool").expect("a pool");
    let p: Custom<SandboxWarmPoolSpec> = typed(&at, &d);
    assert_eq!(p.spec.sandbox_template_ref.name, t.metadata.name.expect("template name"));
}

#[test]
fn our_generated_pod_passes_the_same_checks() {
    use crate::docker::container::{Sandboxing, Spec};
    let spec = Spec {
        memory_mb: 1024,
        cpus: 1.0,
        pids: 256,
        tmp_mb: 64,
        workspace_mb: Some(512),
        uid_range: crate::docker::identity::UidRange::default(),
        sandboxing: Sandboxing::default(),
        mounts: Vec::new(),
        network: None,
        orphan_after: std::time::Duration::from_secs(60),
    };
    let settings = crate::k8s::pod::PodSettings { ephemeral_mb: 1024, ..Default::default() };
    let p = crate::k8s::pod::pod(&spec, &settings, "img", "n", 10_000, &Default::default()).expect("a pod");
    check_sandbox_pod("pod.rs", p.spec.as_ref().expect("spec"));
}

#[test]
fn the_check_catches_a_weakened_pod() {
    let (at, mut d) = docs().into_iter().find(|(_, d)| d["kind"] == "SandboxTemplate").expect("a template");
    d["spec"]["podTemplate"]["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] =
        Value::Bool(true);
    let t: Custom<SandboxTemplateSpec> = typed(&at, &d);
    let weakened =
        std::panic::catch_unwind(|| check_sandbox_pod(&at, t.spec.pod_template.spec.as_ref().expect("spec")));
    assert!(weakened.is_err(), "a pod that may escalate privileges must fail the check");
}

#[test]
fn snapshots_go_to_a_volume_claim_of_the_server() {
    let docs = docs();
    let (at, d) = docs.iter().find(|(_, d)| d["kind"] == "Deployment").expect("a Deployment");
    let deployment: Deployment = typed(at, d);
    let pod = deployment.spec.and_then(|s| s.template.spec).expect("a pod spec");
    let c = &pod.containers[0];
    let args = c.args.clone().unwrap_or_default();
    let at_arg = args.iter().position(|a| a == "--k8s-snapshot-dir").expect("--k8s-snapshot-dir");
    let dir = &args[at_arg + 1];
    let mount = c.volume_mounts.iter().flatten().find(|m| &m.mount_path == dir).expect("a mount at the snapshot dir");
    let volume = pod.volumes.iter().flatten().find(|v| v.name == mount.name).expect("its volume");
    let claim = volume.persistent_volume_claim.as_ref().expect("a volume claim, not an emptyDir").claim_name.clone();
    let pvc =
        docs.iter().find(|(_, d)| d["kind"] == "PersistentVolumeClaim" && d["metadata"]["name"] == claim.as_str());
    assert!(pvc.is_some(), "the claim {claim} is in deploy/kubernetes/");
}

/// The layer store the served configuration names (`render::served`) is a claim of the
/// manifests that every node can mount: ReadWriteMany.
#[test]
fn the_layer_store_is_a_claim_every_node_mounts() {
    let docs = docs();
    let pvc = docs.iter().find(|(_, d)| {
        d["kind"] == "PersistentVolumeClaim" && d["metadata"]["name"] == crate::k8s::render::LAYER_CLAIM
    });
    let (at, d) = pvc.expect("the layer store's claim is in deploy/kubernetes/");
    let pvc: PersistentVolumeClaim = typed(at, d);
    let modes = pvc.spec.and_then(|s| s.access_modes).unwrap_or_default();
    assert_eq!(modes, ["ReadWriteMany"], "{at}");
}
