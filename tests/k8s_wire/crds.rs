//! agent-sandbox's resources in the simulated API server: a plain store of SandboxTemplates,
//! SandboxWarmPools, SandboxClaims and Sandboxes (create, get, merge-patch of `spec`, delete,
//! with resourceVersions). Its controller (warm pools kept full, claims bound) is not
//! simulated yet: a test writes the statuses agent-sandbox's controller would write, which is
//! also how a forged status is written.

use std::sync::atomic::Ordering;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::{Value, json};

use super::apiserver::{Body, State, full, status};

/// The plurals we serve, under `/apis/<group>/<version>/namespaces/pyberth/`.
const SERVED: [(&str, &str); 4] = [
    ("extensions.agents.x-k8s.io/v1beta1", "sandboxtemplates"),
    ("extensions.agents.x-k8s.io/v1beta1", "sandboxwarmpools"),
    ("extensions.agents.x-k8s.io/v1beta1", "sandboxclaims"),
    ("agents.x-k8s.io/v1beta1", "sandboxes"),
];

/// Answers `parts` (the path split at `/`) when it is one of ours.
pub(crate) async fn handle(state: &State, parts: &[&str], req: Request<Incoming>) -> Option<Response<Body>> {
    let ["apis", group, version, "namespaces", "pyberth", plural, rest @ ..] = parts else { return None };
    let gv = format!("{group}/{version}");
    if !SERVED.contains(&(gv.as_str(), *plural)) {
        return None;
    }
    if state.opts.forbid {
        let message = format!(
            "{plural} is forbidden: User \"system:serviceaccount:pyberth:pyberth\" cannot {} resource \"{plural}\" in API group \"{group}\" in the namespace \"pyberth\"",
            req.method().as_str().to_lowercase()
        );
        return Some(status(StatusCode::FORBIDDEN, "Forbidden", &message));
    }
    let method = req.method().as_str().to_owned();
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
            full(StatusCode::CREATED, put(state, &plural, &name, parsed))
        }
        ("GET", [name]) => match get(state, &plural, name) {
            Some(v) => full(StatusCode::OK, v),
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("{plural} \"{name}\" not found")),
        },
        ("PATCH", [name]) => match get(state, &plural, name) {
            Some(mut v) => {
                v["spec"] = parsed["spec"].clone();
                full(StatusCode::OK, put(state, &plural, name, v))
            }
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("{plural} \"{name}\" not found")),
        },
        ("DELETE", [name]) => {
            match state.objects.lock().expect("objects").remove(&(plural.clone(), name.to_string())) {
                Some(_) => full(StatusCode::OK, json!({"kind": "Status", "apiVersion": "v1", "status": "Success"})),
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

/// Stores `v` as `name` of `plural` under a new resourceVersion; returns it as stored.
pub(crate) fn put(state: &State, plural: &str, name: &str, mut v: Value) -> Value {
    let version = state.version.fetch_add(1, Ordering::SeqCst) + 1;
    v["metadata"]["resourceVersion"] = json!(version.to_string());
    v["metadata"]["namespace"] = json!("pyberth");
    state.objects.lock().expect("objects").insert((plural.to_owned(), name.to_owned()), v.clone());
    v
}
