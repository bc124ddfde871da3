//! agent-sandbox's resources in the simulated API server: a plain store of SandboxTemplates,
//! SandboxWarmPools, SandboxClaims and Sandboxes (create, get, merge-patch of `spec`, delete,
//! with resourceVersions). With `Options::controller`, claims are bound as agent-sandbox's
//! controller would (`controller.rs`); without it, a test writes the statuses itself, which is
//! also how a forged status is written.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::{Value, json};

use super::apiserver::{Body, State, full, status};

/// The plurals we serve, under `/apis/<group>/<version>/namespaces/pyberth/`.
const SERVED: [(&str, &str); 5] = [
    ("coordination.k8s.io/v1", "leases"),
    ("extensions.agents.x-k8s.io/v1beta1", "sandboxtemplates"),
    ("extensions.agents.x-k8s.io/v1beta1", "sandboxwarmpools"),
    ("extensions.agents.x-k8s.io/v1beta1", "sandboxclaims"),
    ("agents.x-k8s.io/v1beta1", "sandboxes"),
];

/// Answers `parts` (the path split at `/`) when it is one of ours.
pub(crate) async fn handle(state: &Arc<State>, parts: &[&str], req: Request<Incoming>) -> Option<Response<Body>> {
    let ["apis", group, version, "namespaces", "pyberth", plural, rest @ ..] = parts else { return None };
    let gv = format!("{group}/{version}");
    if !SERVED.contains(&(gv.as_str(), *plural)) {
        return None;
    }
    let writing = matches!(req.method().as_str(), "POST" | "PATCH");
    if state.opts.forbid || (state.opts.forbid_templates && writing && *plural != "sandboxclaims") {
        let message = format!(
            "{plural} is forbidden: User \"system:serviceaccount:pyberth:pyberth\" cannot {} resource \"{plural}\" in API group \"{group}\" in the namespace \"pyberth\"",
            req.method().as_str().to_lowercase()
        );
        return Some(status(StatusCode::FORBIDDEN, "Forbidden", &message));
    }
    let method = req.method().as_str().to_owned();
    let selector = form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes())
        .find(|(k, _)| k == "labelSelector")
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default();
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let plural = plural.to_string();
    Some(match (method.as_str(), rest) {
        ("POST", []) => {
            let name = parsed.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_owned();
            if state.objects.lock().expect("objects").contains_key(&(plural.clone(), name.clone())) {
                return Some(status(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    &format!("{plural} \"{name}\" already exists"),
                ));
            }
            let made = put(state, &plural, &name, parsed);
            if state.opts.controller && plural == "sandboxclaims" {
                super::controller::bind(state, &name);
            }
            if state.opts.controller && state.opts.warm_pool && plural == "sandboxwarmpools" {
                super::controller::fill(state, &name);
            }
            full(StatusCode::CREATED, made)
        }
        ("GET", []) => full(StatusCode::OK, list(state, &plural, &selector)),
        ("GET", [name]) => match get(state, &plural, name) {
            Some(v) => full(StatusCode::OK, v),
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("{plural} \"{name}\" not found")),
        },
        ("PATCH", [name]) => match get(state, &plural, name) {
            Some(mut v) => {
                merge(&mut v, &parsed);
                full(StatusCode::OK, put(state, &plural, name, v))
            }
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("{plural} \"{name}\" not found")),
        },
        ("DELETE", [name]) => {
            let removed = state.objects.lock().expect("objects").remove(&(plural.clone(), name.to_string()));
            match removed {
                Some(_) => {
                    if state.opts.controller && plural == "sandboxclaims" {
                        super::controller::release(state.clone(), name).await;
                    }
                    full(StatusCode::OK, json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}))
                }
                None => status(StatusCode::NOT_FOUND, "NotFound", &format!("{plural} \"{name}\" not found")),
            }
        }
        _ => status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not simulated"),
    })
}

/// Object `name` of `plural`, as stored.
pub(crate) fn get(state: &State, plural: &str, name: &str) -> Option<Value> {
    state.objects.lock().expect("objects").get(&(plural.to_owned(), name.to_owned())).cloned()
}

/// A JSON merge patch (RFC 7386): objects merged key by key, `null` removes, the rest replaces.
fn merge(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

/// Stores `v` as `name` of `plural` under a new resourceVersion (and a creation time, the
/// first time); returns it as stored.
pub(crate) fn put(state: &State, plural: &str, name: &str, mut v: Value) -> Value {
    if v["metadata"]["creationTimestamp"].is_null() {
        v["metadata"]["creationTimestamp"] = json!(pyberth::audit::time::rfc3339(std::time::SystemTime::now()));
    }
    let version = state.version.fetch_add(1, Ordering::SeqCst) + 1;
    v["metadata"]["resourceVersion"] = json!(version.to_string());
    v["metadata"]["namespace"] = json!("pyberth");
    state.objects.lock().expect("objects").insert((plural.to_owned(), name.to_owned()), v.clone());
    v
}

/// The objects of `plural` whose labels match `selector` (`k=v` and `k` terms), as a list.
fn list(state: &State, plural: &str, selector: &str) -> Value {
    let objects = state.objects.lock().expect("objects");
    let matches = |v: &Value| {
        selector.split(',').filter(|t| !t.is_empty()).all(|term| {
            let labels = &v["metadata"]["labels"];
            match term.split_once('=') {
                Some((k, want)) => labels[k] == want,
                None => labels.get(term).is_some(),
            }
        })
    };
    let items: Vec<Value> =
        objects.iter().filter(|((p, _), v)| p == plural && matches(v)).map(|(_, v)| v.clone()).collect();
    let version = state.version.load(Ordering::SeqCst).to_string();
    json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": version}, "items": items})
}
