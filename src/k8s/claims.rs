//! agent-sandbox mode (issue 33, item 1): the objects we create and how a claim's pod is
//! resolved and checked.
//!
//! Per environment a `SandboxTemplate` (our hardened pod spec) and a `SandboxWarmPool`; per
//! session a `SandboxClaim` naming the pool, with our labels and a shutdown time, and never
//! `env` or volumes (either forces a cold start; the session's settings reach the agent in its
//! first message). The claim's pod is found through `status.sandbox.name`, then that
//! Sandbox's `agents.x-k8s.io/pod-name` annotation, as agent-sandbox defines them
//! (/work/shared/docs/field-notes-2026-11.md §1.2).
//!
//! Whoever can write a claim's or a Sandbox's status can name any pod; so a pod is used only
//! when it carries every label the claim asked for (session, principal, instance): a status
//! that names another session's pod reaches nothing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::labels;

/// API group and version of `Sandbox`.
pub const SANDBOX_API: &str = "agents.x-k8s.io/v1beta1";
/// API group and version of `SandboxTemplate`, `SandboxWarmPool` and `SandboxClaim`.
pub const EXTENSIONS_API: &str = "extensions.agents.x-k8s.io/v1beta1";
/// The annotation on a Sandbox that names its pod.
pub const POD_NAME_ANNOTATION: &str = "agents.x-k8s.io/pod-name";
/// Label on the templates and warm pools we make (a restart finds them; nothing else is ours).
pub const MANAGED: &str = "pyberth.managed";
/// Claim condition reasons after which no Sandbox will come.
const TERMINAL: [&str; 4] = ["InvalidMetadata", "EnvVarsInjectionRejected", "ClaimExpired", "SandboxExpired"];

/// The `SandboxTemplate` `name` holding `pod`'s spec and its fixed `pyberth.io/` labels (a
/// session's own labels come with its claim). Its network policy is Managed with empty lists
/// (deny all, as `deploy/kubernetes/40-agent-sandbox.yaml`): the Managed default would open
/// the public internet; our own policies (the egress proxy) add to it.
pub fn template(name: &str, pod: &Pod) -> Value {
    let fixed: BTreeMap<&String, &String> =
        pod.metadata.labels.iter().flatten().filter(|(k, _)| k.starts_with("pyberth.io/")).collect();
    json!({
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxTemplate",
        "metadata": { "name": name, "labels": { MANAGED: "true" } },
        "spec": {
            "podTemplate": { "metadata": { "labels": fixed }, "spec": pod.spec },
            "networkPolicyManagement": "Managed",
            "networkPolicy": { "ingress": [], "egress": [] },
        },
    })
}

/// The template a session pod belongs to: the pod with what a claim carries taken out (name,
/// annotations, its session's labels) and its uid set to `uid`, and the template's name,
/// `pyberth-env-` and 10 hex digits of the SHA-256 of that. Sessions whose pods differ only
/// in what a claim carries share one template and one warm pool; any other difference
/// (image, limits, workspace size, runtime class) is another template. The uid is the
/// template's, not the session's: a claim cannot carry one without a cold start.
pub fn template_of(pod: &Pod, uid: u32) -> (String, Pod) {
    let mut t = pod.clone();
    let fixed = t.metadata.labels.take().unwrap_or_default().into_iter().filter(|(k, _)| k.starts_with("pyberth.io/"));
    t.metadata = ObjectMeta { labels: Some(fixed.collect()), ..Default::default() };
    let id = Some(i64::from(uid));
    if let Some(spec) = t.spec.as_mut() {
        if let Some(sc) = spec.security_context.as_mut() {
            (sc.run_as_user, sc.run_as_group, sc.fs_group) = (id, id, id);
        }
        for c in &mut spec.containers {
            if let Some(sc) = c.security_context.as_mut() {
                (sc.run_as_user, sc.run_as_group) = (id, id);
            }
        }
    }
    let digest = Sha256::digest(serde_json::to_vec(&t).unwrap_or_default());
    let hex: String = digest.iter().take(5).map(|b| format!("{b:02x}")).collect();
    (format!("pyberth-env-{hex}"), t)
}

/// The `SandboxWarmPool` `name` of `replicas` sandboxes from template `template`.
pub fn warm_pool(name: &str, template: &str, replicas: u32) -> Value {
    json!({
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxWarmPool",
        "metadata": { "name": name },
        "spec": { "replicas": replicas, "sandboxTemplateRef": { "name": template } },
    })
}

/// The `SandboxClaim` `name` on `pool`, carrying `ours` (made valid, originals in annotations)
/// on itself and on its pod, deleted at `shutdown` (RFC 3339). No env, no volumes.
pub fn claim(name: &str, pool: &str, ours: &BTreeMap<String, String>, shutdown: &str) -> Value {
    let (l, notes) = labels::split(ours);
    json!({
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxClaim",
        "metadata": { "name": name, "labels": l, "annotations": notes },
        "spec": {
            "warmPoolRef": { "name": pool },
            "lifecycle": { "shutdownTime": shutdown, "shutdownPolicy": "Delete" },
            "additionalPodMetadata": { "labels": l, "annotations": notes },
        },
    })
}

/// Where a claim stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bound {
    /// No Sandbox yet, or not Ready: watch on.
    Waiting,
    /// Ready, bound to this Sandbox.
    Sandbox(String),
    /// Will never be served (a terminal reason, said as agent-sandbox said it).
    Failed(String),
}

fn condition<'a>(obj: &'a Value, kind: &str) -> Option<&'a Value> {
    obj.pointer("/status/conditions")?.as_array()?.iter().find(|c| c["type"] == kind)
}

/// Where `claim` stands, from its status.
pub fn bound(claim: &Value) -> Bound {
    let ready = condition(claim, "Ready");
    if let Some(reason) = ready.and_then(|c| c["reason"].as_str()).filter(|r| TERMINAL.contains(r)) {
        let message = ready.and_then(|c| c["message"].as_str()).unwrap_or("");
        return Bound::Failed(format!("{reason}: {message}").trim_end_matches([':', ' ']).to_owned());
    }
    let sandbox = claim.pointer("/status/sandbox/name").and_then(Value::as_str).filter(|s| !s.is_empty());
    match (ready.map(|c| c["status"] == "True"), sandbox) {
        (Some(true), Some(s)) => Bound::Sandbox(s.to_owned()),
        _ => Bound::Waiting,
    }
}

/// The pod of `sandbox`: its `agents.x-k8s.io/pod-name` annotation, else its own name (a cold
/// Sandbox's pod is named after it).
pub fn sandbox_pod(sandbox: &Value) -> Option<String> {
    let named = sandbox.pointer("/metadata/annotations").and_then(|a| a[POD_NAME_ANNOTATION].as_str());
    named.or_else(|| sandbox.pointer("/metadata/name")?.as_str()).filter(|s| !s.is_empty()).map(str::to_owned)
}

/// Why a resolved pod is not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The pod has another value for a label the claim asked for: not ours, refused at once.
    #[error("pod {pod} named by the claim's status is not this session's (label {label})")]
    NotOurs { pod: String, label: String },
    /// The pod lacks a label the claim asked for: a warm pod the controller has bound but
    /// not yet labelled, or not ours. Waited on, never exec'd into; the wait is bounded.
    #[error("pod {pod} does not carry the claim's label {label} yet")]
    Unlabelled { pod: String, label: String },
    /// Ours, but not running yet (a claim can be Ready before its pod runs): wait on.
    #[error("pod {0} is not running yet")]
    NotRunning(String),
}

/// Whether `pod` may serve the claim that asked for `ours`: every one of those labels on it
/// with the same (valid) value, and running.
pub fn check_pod(pod: &Pod, ours: &BTreeMap<String, String>) -> Result<(), Refused> {
    let want: BTreeMap<String, String> = ours.iter().map(|(k, v)| (k.clone(), labels::value(v))).collect();
    check_labels(pod, &want)
}

/// Whether `pod` may serve a claim labelled `want` (label values as the claim carries them,
/// already valid): each of them on the pod with the same value, and running.
pub fn check_labels(pod: &Pod, want: &BTreeMap<String, String>) -> Result<(), Refused> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let have = pod.metadata.labels.clone().unwrap_or_default();
    for (k, v) in want {
        match have.get(k) {
            Some(h) if h == v => {}
            Some(_) => return Err(Refused::NotOurs { pod: name, label: k.clone() }),
            None => return Err(Refused::Unlabelled { pod: name, label: k.clone() }),
        }
    }
    let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    if running { Ok(()) } else { Err(Refused::NotRunning(name)) }
}

#[cfg(test)]
#[path = "claims_tests.rs"]
mod tests;
