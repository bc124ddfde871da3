//! `pyberth k8s manifests`: the manifests of `deploy/kubernetes/` for one configuration, as
//! one multi-document YAML stream, made without reaching any cluster or engine.
//!
//! The checked-in files stay the source of the server's objects (namespace, RBAC, Deployment,
//! Service, NetworkPolicies); this puts them in the configured namespace, adds the ConfigMap the
//! Deployment reads (the configuration itself, for a server in the cluster), a RuntimeClass
//! example when `k8s_runtime_class` is set and, in agent-sandbox mode, each environment's
//! SandboxTemplate and SandboxWarmPool made by the functions the engine makes them with
//! (`pod::pod` → `claims::template_of` → `claims::template`, `claims::warm_pool`), so their
//! names are the ones the engine looks for and it reuses them. `40-agent-sandbox.yaml` is an
//! example for operators who pre-create by hand and is left out.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Map, Value, json};

use super::manifests::FILES;
use super::{claims, pod};
use crate::config::{EngineKind, K8sMode, SandboxConfig};
use crate::environment::{Environment, Environments};

/// The state dir of a server in the cluster when the configuration names none: under the
/// Deployment's `state` volume (`/var/lib/pyberth`), a dir the server makes as its own.
pub const STATE_DIR: &str = "/var/lib/pyberth/state";
/// The ConfigMap the Deployment mounts at `/etc/pyberth` (`20-pyberth.yaml`).
pub const CONFIG_MAP: &str = "pyberth";
/// The layer store's claim in `25-layers.yaml`, printed (named as configured) when the
/// configuration names one (`k8s_layer_claim`).
pub const LAYER_CLAIM: &str = "pyberth-layers";
/// That file.
const LAYERS: &str = "25-layers.yaml";
/// Its key: the file `serve --config /etc/pyberth/pyberth.toml` reads.
pub const CONFIG_KEY: &str = "pyberth.toml";
/// The checked-in example template, replaced by the generated ones.
const EXAMPLE: &str = "40-agent-sandbox.yaml";

/// One document of the stream, with the comment lines said before it.
struct Doc {
    comment: String,
    body: Value,
}

/// The manifests for `cfg`, a multi-document YAML stream.
pub fn manifests(cfg: &SandboxConfig) -> Result<String, String> {
    cfg.validate().map_err(|e| e.to_string())?;
    let ns = cfg.k8s_namespace.as_str();
    let mut docs = Vec::new();
    for (file, text) in FILES.iter().filter(|(f, _)| *f != EXAMPLE) {
        if *file == LAYERS {
            let Some(claim) = &cfg.k8s_layer_claim else { continue };
            let mut layers = checked_in(file, text, ns)?;
            for d in &mut layers {
                d.body["metadata"]["name"] = json!(claim);
            }
            docs.extend(layers);
            continue;
        }
        if file.starts_with("20-") {
            docs.push(Doc {
                comment: "# The configuration `serve` reads in the cluster.\n".into(),
                body: config_map(cfg)?,
            });
        }
        docs.extend(checked_in(file, text, ns)?);
    }
    if let Some(class) = &cfg.k8s_runtime_class {
        docs.push(runtime_class(class));
    }
    let mut notes = Vec::new();
    if cfg.k8s_mode == K8sMode::AgentSandbox {
        let (made, skipped) = templates(cfg)?;
        docs.extend(made);
        notes = skipped;
    }
    let mode = match cfg.k8s_mode {
        K8sMode::Pods => "pods",
        K8sMode::AgentSandbox => "agent-sandbox",
    };
    let mut out = format!("# pyberth k8s manifests: namespace {ns}, k8s_mode {mode}\n");
    for n in notes {
        out.push_str(&format!("# {n}\n"));
    }
    for d in docs {
        out.push_str("---\n");
        out.push_str(&d.comment);
        out.push_str(&serde_saphyr::to_string(&d.body).map_err(|e| format!("cannot write YAML: {e}"))?);
    }
    Ok(out)
}

/// The documents of checked-in `file`, moved to namespace `ns`; its leading comment before the first.
fn checked_in(file: &str, text: &str, ns: &str) -> Result<Vec<Doc>, String> {
    let bodies: Vec<Value> =
        serde_saphyr::from_multiple(text).map_err(|e| format!("deploy/kubernetes/{file} (built in): {e}"))?;
    let lead: String = text.lines().take_while(|l| l.starts_with('#')).map(|l| format!("{l}\n")).collect();
    let mut comment = format!("# {file}\n{lead}");
    let mut out = Vec::new();
    for mut body in bodies {
        in_namespace(&mut body, ns);
        out.push(Doc { comment: std::mem::take(&mut comment), body });
    }
    Ok(out)
}

/// `doc` moved to namespace `ns`: a Namespace renamed, namespaced objects and the subjects of
/// a RoleBinding (our service account) moved.
fn in_namespace(doc: &mut Value, ns: &str) {
    let namespace = doc["kind"] == "Namespace";
    if let Some(meta) = doc.get_mut("metadata").and_then(Value::as_object_mut) {
        let key = if namespace { "name" } else { "namespace" };
        if meta.contains_key(key) {
            meta.insert(key.into(), json!(ns));
        }
    }
    for s in doc.get_mut("subjects").and_then(Value::as_array_mut).into_iter().flatten() {
        if let Some(m) = s.as_object_mut().filter(|m| m.contains_key("namespace")) {
            m.insert("namespace".into(), json!(ns));
        }
    }
}

/// The settings a server in the cluster runs with: `cfg` on the Kubernetes engine through its
/// service account (no kubeconfig, context or Docker host of this machine), its state under
/// the Deployment's volume unless `cfg` names a state dir.
pub fn served(cfg: &SandboxConfig) -> SandboxConfig {
    let mut c = cfg.clone();
    c.engine = EngineKind::Kubernetes;
    c.kubeconfig = None;
    c.k8s_context = None;
    c.docker_host = None;
    if c.state_dir.is_none() {
        c.state_dir = Some(STATE_DIR.into());
    }
    c
}

/// The ConfigMap holding [`served`]'s settings as `pyberth.toml`.
fn config_map(cfg: &SandboxConfig) -> Result<Value, String> {
    let settings = serde_json::to_value(served(cfg)).map_err(|e| e.to_string())?;
    let Value::Object(table) = settings else { return Err("settings are not a table".into()) };
    Ok(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": { "name": CONFIG_MAP, "namespace": cfg.k8s_namespace },
        "data": { CONFIG_KEY: toml_text(&table) },
    }))
}

/// `table` as TOML: its scalars and arrays as `key = value` lines, then each table-valued key
/// (environments, upstreams, principals) as a `[key]` section of inline tables. Strings are
/// written as JSON strings, whose escapes are all TOML basic-string escapes; nulls (unset
/// options) are left out, TOML has none.
fn toml_text(table: &Map<String, Value>) -> String {
    let mut out = String::new();
    for (k, v) in table.iter().filter(|(_, v)| !v.is_object()) {
        if let Some(v) = toml_value(v) {
            out.push_str(&format!("{} = {v}\n", toml_key(k)));
        }
    }
    for (k, v) in table.iter().filter_map(|(k, v)| Some((k, v.as_object()?))) {
        out.push_str(&format!("\n[{}]\n", toml_key(k)));
        for (name, value) in v {
            if let Some(value) = toml_value(value) {
                out.push_str(&format!("{} = {value}\n", toml_key(name)));
            }
        }
    }
    out
}

fn toml_key(k: &str) -> String {
    let bare = !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare { k.to_owned() } else { Value::String(k.to_owned()).to_string() }
}

fn toml_value(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::Bool(_) | Value::Number(_) | Value::String(_) => Some(v.to_string()),
        Value::Array(a) => Some(format!("[{}]", a.iter().filter_map(toml_value).collect::<Vec<_>>().join(", "))),
        Value::Object(m) => {
            let entries: Vec<String> =
                m.iter().filter_map(|(k, v)| Some(format!("{} = {}", toml_key(k), toml_value(v)?))).collect();
            Some(if entries.is_empty() { "{}".into() } else { format!("{{ {} }}", entries.join(", ")) })
        }
    }
}

/// An example RuntimeClass named as `k8s_runtime_class`: its handler is the node runtime's,
/// which only the operator knows (`runsc` for gVisor is the usual one).
fn runtime_class(class: &str) -> Doc {
    let gvisor = class.contains("gvisor") || class.starts_with("runsc");
    let handler = if gvisor { "runsc" } else { class };
    Doc {
        comment: "# An example: session pods name this RuntimeClass (k8s_runtime_class). Its handler must be a\n\
                  # runtime configured on every node (containerd's runtimes); cluster-wide, not namespaced.\n"
            .into(),
        body: json!({
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": { "name": class },
            "handler": handler,
        }),
    }
}

/// The pod the engine makes for a session of `env`, as `translate::session_pod` makes it from
/// the container that `sandbox::Blueprint` describes (its labels and uid are left out of the
/// template); an environment the engine refuses says why.
pub fn environment_pod(env: &Environment, cfg: &SandboxConfig) -> Result<Pod, String> {
    if !env.egress.is_empty() {
        return Err("its sessions have egress, which agent-sandbox mode does not have yet".into());
    }
    let blueprint = crate::sandbox::Blueprint::new(env.cfg.clone(), &Default::default(), &env.mounts, None);
    let image = env.cfg.image.clone().unwrap_or_else(|| crate::docker::image::tag_for(&*env.cfg));
    // No layer store in agent-sandbox mode (`KubeEngine::agent_sandbox`).
    let settings = super::engine::pod_settings(cfg.k8s_runtime_class.clone());
    pod::pod(&blueprint.spec, &settings, &image, "template", cfg.uid_range.first, &BTreeMap::new())
        .map_err(|e| e.to_string())
}

/// Each environment's template and warm pool, one per distinct template (environments whose
/// pods are alike share one, as they do in the engine); and notes on the environments left out.
fn templates(cfg: &SandboxConfig) -> Result<(Vec<Doc>, Vec<String>), String> {
    let envs = Environments::from_config(cfg)?;
    let mut by_name: BTreeMap<String, (Vec<String>, Value)> = BTreeMap::new();
    let mut skipped = Vec::new();
    for env in envs.all() {
        let pod = match environment_pod(env, cfg) {
            Ok(p) => p,
            Err(why) => {
                skipped.push(format!("environment {}: no template ({why})", env.name));
                continue;
            }
        };
        let (name, spec) = claims::template_of(&pod, cfg.uid_range.first);
        let t = claims::template(&name, &spec);
        by_name.entry(name).or_insert_with(|| (Vec::new(), t)).0.push(env.name.clone());
    }
    let mut docs = Vec::new();
    for (name, (envs, mut template)) in by_name {
        let mut pool = claims::warm_pool(&name, &name, cfg.k8s_warm_pool);
        for body in [&mut template, &mut pool] {
            body["metadata"]["namespace"] = json!(cfg.k8s_namespace);
        }
        let comment =
            format!("# The template of environment(s) {} (the engine makes it at need too).\n", envs.join(", "));
        docs.push(Doc { comment, body: template });
        docs.push(Doc { comment: String::new(), body: pool });
    }
    Ok((docs, skipped))
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;
