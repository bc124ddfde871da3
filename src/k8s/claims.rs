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
use serde_json::{Value, json};

use super::labels;

/// API group and version of `Sandbox`.
pub const SANDBOX_API: &str = "agents.x-k8s.io/v1beta1";
/// API group and version of `SandboxTemplate`, `SandboxWarmPool` and `SandboxClaim`.
pub const EXTENSIONS_API: &str = "extensions.agents.x-k8s.io/v1beta1";
/// The annotation on a Sandbox that names its pod.
pub const POD_NAME_ANNOTATION: &str = "agents.x-k8s.io/pod-name";
/// Claim condition reasons after which no Sandbox will come.
const TERMINAL: [&str; 4] = ["InvalidMetadata", "EnvVarsInjectionRejected", "ClaimExpired", "SandboxExpired"];

/// The `SandboxTemplate` `name` holding `pod`'s labels and spec. Its network policy is Managed
/// with empty lists (deny all, as `deploy/kubernetes/40-agent-sandbox.yaml`): the Managed
/// default would open the public internet; our own policies (the egress proxy) add to it.
pub fn template(name: &str, pod: &Pod) -> Value {
    json!({
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxTemplate",
        "metadata": { "name": name },
        "spec": {
            "podTemplate": { "metadata": pod.metadata.labels.as_ref().map(|l| json!({ "labels": l })), "spec": pod.spec },
            "networkPolicyManagement": "Managed",
            "networkPolicy": { "ingress": [], "egress": [] },
        },
    })
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
    /// The pod lacks a label the claim asked for, or has another value: not ours.
    #[error("pod {pod} named by the claim's status is not this session's (label {label})")]
    NotOurs { pod: String, label: String },
    /// Ours, but not running yet (a claim can be Ready before its pod runs): wait on.
    #[error("pod {0} is not running yet")]
    NotRunning(String),
}

/// Whether `pod` may serve the claim that asked for `ours`: every one of those labels on it
/// with the same (valid) value, and running.
pub fn check_pod(pod: &Pod, ours: &BTreeMap<String, String>) -> Result<(), Refused> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let have = pod.metadata.labels.clone().unwrap_or_default();
    for (k, v) in ours {
        if have.get(k) != Some(&labels::value(v)) {
            return Err(Refused::NotOurs { pod: name, label: k.clone() });
        }
    }
    let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    if running { Ok(()) } else { Err(Refused::NotRunning(name)) }
}

#[cfg(test)]
#[path = "claims_tests.rs"]
mod tests;
