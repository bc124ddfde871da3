//! Services in the simulated API server (the egress proxy's): create, get, delete. A Service's
//! address comes from `Options::service_ips` (addresses of the test's egress network); the
//! node gives it to the pod the Service selects there (`docker_pod::start`), the model of
//! kube-proxy's translation: one address, whichever pod it selects now.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{Pod, Service};
use serde_json::Value;

use super::apiserver::{Body, State, full, status};

/// Answers a request under `/api/v1/namespaces/pyberth/services`.
pub(crate) async fn handle(state: &Arc<State>, rest: &[&str], req: Request<Incoming>) -> Response<Body> {
    if state.opts.forbid {
        let message = "services is forbidden: User \"system:serviceaccount:pyberth:pyberth\" cannot access services";
        return status(StatusCode::FORBIDDEN, "Forbidden", message);
    }
    let key = |name: &str| ("services".to_owned(), name.to_owned());
    match (req.method().as_str(), rest) {
        ("POST", []) => {
            let body = match req.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
            };
            let mut svc: Service = match serde_json::from_slice(&body) {
                Ok(s) => s,
                Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
            };
            let name = svc.metadata.name.clone().unwrap_or_default();
            let mut objects = state.objects.lock().expect("objects");
            if objects.contains_key(&key(&name)) {
                return status(StatusCode::CONFLICT, "AlreadyExists", &format!("services \"{name}\" already exists"));
            }
            let taken = objects.keys().filter(|(p, _)| p == "services").count();
            let ip = state.opts.service_ips.get(taken).cloned().unwrap_or_else(|| format!("10.96.0.{}", taken + 10));
            svc.spec.get_or_insert_with(Default::default).cluster_ip = Some(ip);
            svc.metadata.resource_version = Some((state.version.fetch_add(1, Ordering::SeqCst) + 1).to_string());
            let value = serde_json::to_value(&svc).unwrap_or(Value::Null);
            objects.insert(key(&name), value.clone());
            full(StatusCode::CREATED, value)
        }
        ("GET", [name]) => match state.objects.lock().expect("objects").get(&key(name)) {
            Some(v) => full(StatusCode::OK, v.clone()),
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("services \"{name}\" not found")),
        },
        ("DELETE", [name]) => match state.objects.lock().expect("objects").remove(&key(name)) {
            Some(v) => full(StatusCode::OK, v),
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("services \"{name}\" not found")),
        },
        _ => status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not simulated"),
    }
}

/// The address of the Service that selects `pod`, if one does.
pub(crate) fn address_of(state: &State, pod: &Pod) -> Option<String> {
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let objects = state.objects.lock().expect("objects");
    objects.iter().filter(|((p, _), _)| p == "services").find_map(|(_, v)| {
        let svc: Service = serde_json::from_value(v.clone()).ok()?;
        let spec = svc.spec?;
        let selector = spec.selector?;
        let selects = !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v));
        selects.then_some(spec.cluster_ip).flatten()
    })
}
