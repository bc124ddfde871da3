//! agent-sandbox's controller, simulated: a claim on a warm pool is bound to a new Sandbox
//! (named `<pool>-<5 characters>`, unlike the claim) whose pod is the pool's template with the
//! claim's `additionalPodMetadata`, and the claim is said Ready at once, before its pod runs
//! (the node takes `start_delay`). Deleting a claim deletes the Sandbox and pod it owns.
//! Warm sandboxes are not made ahead of claims: what pyberth sees of a claim is the same.
//!
//! `bind_to_first`: every claim after the first is said bound to the first claim's Sandbox,
//! as whoever can write a claim's status could say; pyberth must refuse that pod. With
//! `relabel_claims`, the claim is also relabelled as that pod is, as whoever can write a claim
//! could do.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use super::apiserver::{State, delete, make_pod};
use super::crds::{get, put};

/// Label on a simulated Sandbox naming the claim that owns it.
const OWNER: &str = "sim.agents.x-k8s.io/claim";

fn suffix() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed) + u64::from(std::process::id());
    (0..5).map(|i| char::from(b'a' + u8::try_from((n >> (i * 4)) % 26).unwrap_or(0))).collect()
}

/// The first Sandbox bound to a claim, if any.
fn first_sandbox(state: &State) -> Option<String> {
    let objects = state.objects.lock().expect("objects");
    objects.iter().filter(|((plural, _), _)| plural == "sandboxes").map(|((_, name), _)| name.clone()).next()
}

/// Binds claim `claim`, as the controller would once it saw it.
pub(crate) fn bind(state: &Arc<State>, claim: &str) {
    let Some(mut c) = get(state, "sandboxclaims", claim) else { return };
    let forged = if state.opts.bind_to_first { first_sandbox(state) } else { None };
    let sandbox = match forged.clone() {
        Some(first) => first,
        None => match cold_sandbox(state, &c, claim) {
            Ok(name) => name,
            Err(why) => {
                c["status"] = json!({"conditions": [{"type": "Ready", "status": "False", "reason": "InvalidMetadata", "message": why}]});
                put(state, "sandboxclaims", claim, c);
                return;
            }
        },
    };
    if forged.is_some() && state.opts.relabel_claims {
        let pods = state.pods.lock().expect("pods");
        if let Some(p) = pods.get(&sandbox) {
            c["metadata"]["labels"] = json!(p.pod.metadata.labels);
        }
    }
    c["status"] =
        json!({"sandbox": {"name": sandbox}, "conditions": [{"type": "Ready", "status": "True", "reason": "Ready"}]});
    put(state, "sandboxclaims", claim, c);
}

/// A new Sandbox for claim `c` from its pool's template, and its pod; its name.
fn cold_sandbox(state: &Arc<State>, c: &Value, claim: &str) -> Result<String, String> {
    let pool_name = c.pointer("/spec/warmPoolRef/name").and_then(Value::as_str).ok_or("no warmPoolRef")?;
    let pool = get(state, "sandboxwarmpools", pool_name).ok_or(format!("no warm pool {pool_name}"))?;
    let template_name =
        pool.pointer("/spec/sandboxTemplateRef/name").and_then(Value::as_str).ok_or("no template ref")?;
    let template = get(state, "sandboxtemplates", template_name).ok_or(format!("no template {template_name}"))?;
    let mut pod: Pod =
        serde_json::from_value(template["spec"]["podTemplate"].clone()).map_err(|e| format!("pod template: {e}"))?;
    let name = format!("{pool_name}-{}", suffix());
    pod.metadata.name = Some(name.clone());
    let extra = &c["spec"]["additionalPodMetadata"];
    for (field, into) in [("labels", &mut pod.metadata.labels), ("annotations", &mut pod.metadata.annotations)] {
        let add: std::collections::BTreeMap<String, String> =
            serde_json::from_value(extra[field].clone()).unwrap_or_default();
        into.get_or_insert_with(Default::default).extend(add);
    }
    make_pod(state, pod).map_err(|_| format!("pod {name} could not be made"))?;
    let sb = json!({
        "apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
        "metadata": {"name": name, "labels": {OWNER: claim}, "annotations": {"agents.x-k8s.io/pod-name": name}},
        "spec": {},
    });
    put(state, "sandboxes", &name, sb);
    Ok(name)
}

/// Deletes what claim `claim` owned: its Sandboxes and their pods.
pub(crate) async fn release(state: Arc<State>, claim: &str) {
    let owned: Vec<String> = {
        let objects = state.objects.lock().expect("objects");
        objects
            .iter()
            .filter(|((plural, _), v)| plural == "sandboxes" && v["metadata"]["labels"][OWNER] == claim)
            .map(|((_, name), _)| name.clone())
            .collect()
    };
    for name in owned {
        state.objects.lock().expect("objects").remove(&("sandboxes".to_owned(), name.clone()));
        let _ = delete(state.clone(), &name).await;
    }
}
