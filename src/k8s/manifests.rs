//! The manifests of `deploy/kubernetes/`, built in: the tests parse every document into the
//! k8s-openapi types (and the agent-sandbox CRDs into the structs below) and check the
//! hardening fields, so a manifest that drifts from the pod spec of `pod.rs` fails CI.

/// Every file of `deploy/kubernetes/`, in apply order: (file name, YAML text).
pub const FILES: [(&str, &str); 6] = [
    ("00-namespace.yaml", include_str!("../../deploy/kubernetes/00-namespace.yaml")),
    ("10-rbac.yaml", include_str!("../../deploy/kubernetes/10-rbac.yaml")),
    ("20-pyberth.yaml", include_str!("../../deploy/kubernetes/20-pyberth.yaml")),
    ("25-layers.yaml", include_str!("../../deploy/kubernetes/25-layers.yaml")),
    ("30-network.yaml", include_str!("../../deploy/kubernetes/30-network.yaml")),
    ("40-agent-sandbox.yaml", include_str!("../../deploy/kubernetes/40-agent-sandbox.yaml")),
];

#[cfg(test)]
#[path = "manifests_tests.rs"]
pub(super) mod tests;
