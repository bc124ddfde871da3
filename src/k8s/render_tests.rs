//! `pyberth k8s manifests` for a default configuration and for agent-sandbox mode with two
//! environments, a namespace of its own and a runtime class: every document typed, in that
//! namespace, the Role least-privileged, the templates hardened and named as the engine names
//! them, the ConfigMap's settings the given ones.

use std::collections::HashMap;

use serde_json::Value;

use super::{CONFIG_KEY, environment_pod, manifests, served};
use crate::config::{EngineKind, K8sMode, SandboxConfig, from_flags};
use crate::docker::container::Spec;
use crate::environment::{EnvironmentSpec, Environments};
use crate::k8s::claims;
use crate::k8s::manifests::tests::{
    Custom, SandboxTemplateSpec, SandboxWarmPoolSpec, check_kind, check_role, check_sandbox_pod, typed,
};

fn docs(text: &str) -> Vec<Value> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The checks every stream passes: typed documents, all in `ns`, the Role least-privileged,
/// the ConfigMap's pyberth.toml the served settings of `cfg`.
fn check_stream(cfg: &SandboxConfig, ns: &str) -> Vec<Value> {
    let text = manifests(cfg).expect("manifests");
    let docs = docs(&text);
    for d in &docs {
        let at = format!("{}/{}", d["kind"], d["metadata"]["name"]);
        check_kind(&at, d);
        match d["kind"].as_str() {
            Some("Namespace") => assert_eq!(d["metadata"]["name"], ns, "{at}"),
            Some("RuntimeClass") => assert!(d["metadata"].get("namespace").is_none(), "{at}: cluster-wide"),
            _ => assert_eq!(d["metadata"]["namespace"], ns, "{at}"),
        }
        for s in d["subjects"].as_array().into_iter().flatten() {
            assert_eq!(s["namespace"], ns, "{at}: the binding's service account");
        }
    }
    let roles = of_kind(&docs, "Role");
    assert_eq!(roles.len(), 1);
    check_role("Role", roles[0]);
    for kind in ["Namespace", "ServiceAccount", "RoleBinding", "Deployment", "Service", "ConfigMap"] {
        assert_eq!(of_kind(&docs, kind).len(), 1, "one {kind}");
    }
    assert_eq!(of_kind(&docs, "NetworkPolicy").len(), 3, "sandboxes: deny, to the proxy; the proxy: from them");
    let maps = of_kind(&docs, "ConfigMap");
    let toml = maps[0]["data"][CONFIG_KEY].as_str().expect("pyberth.toml");
    let back: SandboxConfig = toml::from_str(toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let want = serde_json::to_value(served(cfg)).expect("json");
    assert_eq!(serde_json::to_value(&back).expect("json"), want, "{toml}");
    assert_eq!(back.engine, EngineKind::Kubernetes);
    assert!(back.kubeconfig.is_none() && !toml.contains("kubeconfig"), "{toml}");
    docs
}

#[test]
fn the_default_configuration_gives_the_checked_in_objects() {
    let cfg = from_flags(&[]);
    let docs = check_stream(&cfg, "pyberth");
    assert!(of_kind(&docs, "SandboxTemplate").is_empty() && of_kind(&docs, "RuntimeClass").is_empty());
    let deployment = of_kind(&docs, "Deployment")[0];
    let volumes = deployment.pointer("/spec/template/spec/volumes").expect("volumes").to_string();
    assert!(volumes.contains("\"name\":\"pyberth\""), "it reads the ConfigMap: {volumes}");
    let claims = |docs: &[Value]| -> Vec<String> {
        let pvcs = of_kind(docs, "PersistentVolumeClaim");
        pvcs.iter().map(|d| d["metadata"]["name"].as_str().unwrap_or_default().to_owned()).collect()
    };
    assert_eq!(claims(&docs), ["pyberth-snapshots"], "no layer store unless configured");
    // With a layer store named as the operator likes: its claim, so named, in the stream.
    let cfg = from_flags(&["--k8s-layer-claim", "team-store"]);
    let docs = check_stream(&cfg, "pyberth");
    assert_eq!(claims(&docs), ["pyberth-snapshots", "team-store"]);
}

/// Agent-sandbox mode, namespace `team-a`, gVisor, environments `small` and `big` as well as
/// the built-ins; `net` has egress, which the engine refuses.
fn agent_sandbox() -> SandboxConfig {
    let args = ["--k8s-mode", "agent-sandbox", "--k8s-namespace", "team-a", "--k8s-runtime-class", "gvisor"];
    let mut cfg = from_flags(&[&args[..], &["--k8s-warm-pool", "3", "--kubeconfig", "/home/me/.kube/config"]].concat());
    let env = |memory_mb, cpus| EnvironmentSpec { memory_mb: Some(memory_mb), cpus: Some(cpus), ..Default::default() };
    cfg.environments.insert("small".into(), env(512, 0.5));
    cfg.environments.insert("big".into(), env(2048, 2.0));
    let net = EnvironmentSpec { egress: Some(vec!["example.com:443".into()]), ..Default::default() };
    cfg.environments.insert("net".into(), net);
    cfg
}

#[test]
fn agent_sandbox_mode_gives_each_environment_the_engines_template() {
    let cfg = agent_sandbox();
    assert_eq!(cfg.k8s_mode, K8sMode::AgentSandbox);
    let docs = check_stream(&cfg, "team-a");
    let class = of_kind(&docs, "RuntimeClass");
    assert_eq!((class.len(), &class[0]["handler"]), (1, &Value::from("runsc")));
    let templates: HashMap<String, Custom<SandboxTemplateSpec>> = of_kind(&docs, "SandboxTemplate")
        .into_iter()
        .map(|d| (d["metadata"]["name"].as_str().unwrap_or_default().to_owned(), typed("template", d)))
        .collect();
    let pools: Vec<Custom<SandboxWarmPoolSpec>> =
        of_kind(&docs, "SandboxWarmPool").into_iter().map(|d| typed("pool", d)).collect();
    assert_eq!(pools.len(), templates.len(), "a pool per template");
    for p in &pools {
        assert_eq!(p.spec.replicas, 3);
        assert!(templates.contains_key(&p.spec.sandbox_template_ref.name), "{}", p.spec.sandbox_template_ref.name);
    }
    // Every environment but `net` has its template, named by the engine's own hash.
    let envs = Environments::from_config(&cfg).expect("environments");
    let mut wanted = std::collections::BTreeSet::new();
    for env in envs.all() {
        let Ok(pod) = environment_pod(env, &cfg) else {
            assert_eq!(env.name, "net", "only the egress environment has no template");
            continue;
        };
        let (name, _) = claims::template_of(&pod, cfg.uid_range.first);
        let t = templates.get(&name).unwrap_or_else(|| panic!("{}: {name} missing", env.name));
        let spec = t.spec.pod_template.spec.as_ref().expect("pod spec");
        check_sandbox_pod(&name, spec);
        assert_eq!(spec.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(spec.security_context.as_ref().and_then(|s| s.run_as_user), Some(i64::from(cfg.uid_range.first)));
        assert!(t.spec.network_policy.egress.is_empty(), "{name}: deny all");
        wanted.insert(name);
    }
    assert_eq!(wanted.len(), templates.len(), "no template of no environment");
    // small and big differ from the built-ins (and each other) in their limits.
    assert!(wanted.len() >= 3, "{wanted:?}");
    let text = manifests(&cfg).expect("manifests");
    assert!(text.contains("environment net: no template"), "the note on the egress environment");
}

/// The pod the engine makes from the container body `container::make` writes (limits, `/tmp`,
/// the keeper's grace in its environment) is the pod `environment_pod` gives: the template
/// names printed are the ones the engine makes and finds.
#[test]
fn the_engines_pod_from_a_container_body_has_the_same_template() {
    use crate::docker::{CACHE_ENV, ENV, tether::ORPHAN_ENV};
    let cfg = agent_sandbox();
    let envs = Environments::from_config(&cfg).expect("environments");
    for name in ["small", "big", "default"] {
        let env = envs.get(Some(name)).expect("env");
        let spec: Spec = crate::sandbox::Blueprint::new(env.cfg.clone(), &Default::default(), &[], None).spec;
        let orphan = format!("{ORPHAN_ENV}={}", spec.orphan_after.as_secs());
        let uid = cfg.uid_range.first + 7;
        let labels = HashMap::from([(crate::docker::identity::LABEL_UID.to_owned(), uid.to_string())]);
        let image = env.cfg.image.clone().unwrap_or_else(|| crate::docker::image::tag_for(&*env.cfg));
        let mut hc = crate::docker::container::host_config(&spec, "vol");
        // Every session mounts the layer store (`session::create`).
        let store = crate::packages::Store::for_test("pyberth-layers").session_mount();
        hc.mounts.get_or_insert_with(Vec::new).push(store);
        let body = bollard::models::ContainerCreateBody {
            image: Some(image),
            env: Some(ENV.iter().chain(&CACHE_ENV).map(|s| (*s).to_owned()).chain([orphan]).collect()),
            labels: Some(labels),
            host_config: Some(hc),
            ..Default::default()
        };
        // Agent-sandbox mode has no layer store, whatever the claim (`KubeEngine::agent_sandbox`).
        let settings = crate::k8s::engine::pod_settings(cfg.k8s_runtime_class.clone());
        let engine_pod =
            crate::k8s::engine::translate::session_pod("pyberth-x-s-1", &body, spec.workspace_mb, &settings)
                .expect("a pod");
        let printed = environment_pod(&env, &cfg).expect("a pod");
        let (a, b) = (claims::template_of(&engine_pod, 10_000), claims::template_of(&printed, 10_000));
        assert_eq!(a.0, b.0, "{name}: {}", serde_json::to_string(&(a.1, b.1)).unwrap_or_default());
    }
}
