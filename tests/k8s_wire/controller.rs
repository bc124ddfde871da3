//! agent-sandbox's controller, simulated: a claim on a warm pool is bound to a new Sandbox
//! (named `<pool>-<5 characters>`, unlike the claim) whose pod is the pool's template with the
//! claim's `additionalPodMetadata`, and the claim is said Ready at once, before its pod runs
//! (the node takes `start_delay`). Deleting a claim deletes the Sandbox and pod it owns.
//! With `Options::warm_pool`, each warm pool's sandboxes are made ahead (`fill`), their pods
//! from the template alone; a claim adopts one, is said Ready at once, and its pod gets the
//! claim's `additionalPodMetadata` only `label_delay` later (the pool is then refilled).
//! Without it, every claim gets a cold Sandbox.
//!
//! `bind_to_first`: every claim after the first is said bound to the first claim's Sandbox,
//! as whoever can write a claim's status could say; pyberth must refuse that pod. With
//! `relabel_claims`, the claim is also relabelled as that pod is, as whoever can write a claim
//! could do.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use super::apiserver::{State, delete, make_pod};
use super::crds::{get, put};

/// Label on a simulated Sandbox naming the claim that owns it.
const OWNER: &str = "sim.agents.x-k8s.io/claim";
/// Label on a warm Sandbox no claim owns yet, naming its pool.
const POOL: &str = "sim.agents.x-k8s.io/pool";

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
    let warm = if state.opts.warm_pool && forged.is_none() { adopt(state, &c, claim) } else { None };
    let sandbox = match forged.clone().or(warm) {
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

/// The claim's `additionalPodMetadata`: (labels, annotations).
fn extra_of(c: &Value) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let extra = &c["spec"]["additionalPodMetadata"];
    let field = |f: &str| serde_json::from_value(extra[f].clone()).unwrap_or_default();
    (field("labels"), field("annotations"))
}

/// A new Sandbox of pool `pool_name` (labelled `owner`: `OWNER` or `POOL`) and the pod of
/// its template, not made yet; their name.
fn new_sandbox(state: &Arc<State>, pool_name: &str, owner: (&str, &str)) -> Result<(String, Pod), String> {
    let pool = get(state, "sandboxwarmpools", pool_name).ok_or(format!("no warm pool {pool_name}"))?;
    let template_name =
        pool.pointer("/spec/sandboxTemplateRef/name").and_then(Value::as_str).ok_or("no template ref")?;
    let template = get(state, "sandboxtemplates", template_name).ok_or(format!("no template {template_name}"))?;
    let mut pod: Pod =
        serde_json::from_value(template["spec"]["podTemplate"].clone()).map_err(|e| format!("pod template: {e}"))?;
    let name = format!("{pool_name}-{}", suffix());
    pod.metadata.name = Some(name.clone());
    if state.opts.weaken {
        let c = pod.spec.as_mut().and_then(|s| s.containers.first_mut()).ok_or("a pod template without containers")?;
        c.security_context.get_or_insert_default().allow_privilege_escalation = Some(true);
    }
    let sb = json!({
        "apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
        "metadata": {"name": name, "labels": {owner.0: owner.1}, "annotations": {"agents.x-k8s.io/pod-name": name}},
        "spec": {},
    });
    put(state, "sandboxes", &name, sb);
    Ok((name, pod))
}

/// A new Sandbox for claim `c` from its pool's template, its pod carrying the claim's
/// metadata from the start; its name.
fn cold_sandbox(state: &Arc<State>, c: &Value, claim: &str) -> Result<String, String> {
    let pool_name = c.pointer("/spec/warmPoolRef/name").and_then(Value::as_str).ok_or("no warmPoolRef")?;
    let (name, mut pod) = new_sandbox(state, pool_name, (OWNER, claim))?;
    let (labels, notes) = extra_of(c);
    pod.metadata.labels.get_or_insert_with(Default::default).extend(labels);
    pod.metadata.annotations.get_or_insert_with(Default::default).extend(notes);
    make_pod(state, pod).map_err(|_| format!("pod {name} could not be made"))?;
    Ok(name)
}

/// Makes warm sandboxes of pool `pool` until it holds its `replicas` unclaimed ones.
pub(crate) fn fill(state: &Arc<State>, pool: &str) {
    let want = get(state, "sandboxwarmpools", pool).and_then(|p| p["spec"]["replicas"].as_u64()).unwrap_or(0);
    let have = warm_of(state, pool).len() as u64;
    for _ in have..want {
        match new_sandbox(state, pool, (POOL, pool)) {
            Ok((_, pod)) => drop(make_pod(state, pod)),
            Err(why) => eprintln!("simulated controller: pool {pool}: {why}"),
        }
    }
}

/// The Sandboxes labelled `key=value`.
fn sandboxes_labelled(state: &State, key: &str, value: &str) -> Vec<String> {
    let objects = state.objects.lock().expect("objects");
    objects
        .iter()
        .filter(|((plural, _), v)| plural == "sandboxes" && v["metadata"]["labels"][key] == value)
        .map(|((_, name), _)| name.clone())
        .collect()
}

/// The unclaimed warm sandboxes of `pool`.
fn warm_of(state: &State, pool: &str) -> Vec<String> {
    sandboxes_labelled(state, POOL, pool)
}

/// Claim `c` adopts a warm sandbox of its pool, if one is there: it becomes the claim's, its
/// pod gets the claim's metadata `label_delay` later, and the pool is refilled.
fn adopt(state: &Arc<State>, c: &Value, claim: &str) -> Option<String> {
    let pool = c.pointer("/spec/warmPoolRef/name").and_then(Value::as_str)?.to_owned();
    let name = warm_of(state, &pool).into_iter().next()?;
    let mut sb = get(state, "sandboxes", &name)?;
    sb["metadata"]["labels"] = json!({OWNER: claim});
    put(state, "sandboxes", &name, sb);
    let (labels, notes) = extra_of(c);
    let later = state.clone();
    let pod = name.clone();
    tokio::spawn(async move {
        tokio::time::sleep(later.opts.label_delay).await;
        later.relabel(&pod, labels, notes);
        fill(&later, &pool);
    });
    Some(name)
}

/// Deletes what claim `claim` owned: its Sandboxes and their pods.
pub(crate) async fn release(state: Arc<State>, claim: &str) {
    for name in sandboxes_labelled(&state, OWNER, claim) {
        state.objects.lock().expect("objects").remove(&("sandboxes".to_owned(), name.clone()));
        let _ = delete(state.clone(), &name).await;
    }
}
