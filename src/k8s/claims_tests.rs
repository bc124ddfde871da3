use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::json;

use super::*;

fn ours(session: &str, owner: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("pyberth.managed".to_owned(), "true".to_owned()),
        ("pyberth.session".to_owned(), session.to_owned()),
        ("pyberth.owner".to_owned(), owner.to_owned()),
    ])
}

fn pod(name: &str, labels: &BTreeMap<String, String>, phase: &str) -> Pod {
    let (l, a) = labels::split(labels);
    Pod {
        metadata: ObjectMeta { name: Some(name.into()), labels: Some(l), annotations: Some(a), ..Default::default() },
        status: Some(PodStatus { phase: Some(phase.into()), ..Default::default() }),
        ..Default::default()
    }
}

// Attack view: a claim (or Sandbox) status naming a pod of another session or principal.
#[test]
fn a_status_naming_another_sessions_pod_is_refused() {
    let want = ours("s1", "alice@example.com");
    let other_session = pod("victim", &ours("s2", "alice@example.com"), "Running");
    let other_principal = pod("victim", &ours("s1", "bob@example.com"), "Running");
    let unlabelled = pod("victim", &BTreeMap::new(), "Running");
    for p in [other_session, other_principal, unlabelled] {
        assert!(matches!(check_pod(&p, &want), Err(Refused::NotOurs { .. })), "{p:?}");
    }
    // An annotation claiming the original value does not stand in for the label.
    let mut forged = pod("victim", &ours("s2", "alice@example.com"), "Running");
    let notes = forged.metadata.annotations.get_or_insert_default();
    notes.insert("pyberth.io/original-pyberth.session".into(), "s1".into());
    assert!(matches!(check_pod(&forged, &want), Err(Refused::NotOurs { .. })));
}

#[test]
fn our_pod_serves_once_it_runs() {
    let want = ours("s1", "alice@example.com");
    assert_eq!(check_pod(&pod("p", &want, "Pending"), &want), Err(Refused::NotRunning("p".into())));
    assert_eq!(check_pod(&pod("p", &want, "Running"), &want), Ok(()));
}

#[test]
fn a_claim_is_bound_only_when_ready_and_named() {
    assert_eq!(bound(&json!({})), Bound::Waiting);
    let named = json!({"status": {"sandbox": {"name": "sb-1"}}});
    assert_eq!(bound(&named), Bound::Waiting, "named but not Ready");
    let ready = json!({"status": {"sandbox": {"name": "sb-1"}, "conditions": [{"type": "Ready", "status": "True"}]}});
    assert_eq!(bound(&ready), Bound::Sandbox("sb-1".into()));
    let expired = json!({"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "ClaimExpired", "message": "past shutdownTime"}]}});
    assert_eq!(bound(&expired), Bound::Failed("ClaimExpired: past shutdownTime".into()));
}

#[test]
fn a_sandbox_names_its_pod_by_annotation_else_by_itself() {
    let warm = json!({"metadata": {"name": "sb-1", "annotations": {POD_NAME_ANNOTATION: "pool-abc"}}});
    assert_eq!(sandbox_pod(&warm).as_deref(), Some("pool-abc"));
    assert_eq!(sandbox_pod(&json!({"metadata": {"name": "sb-2"}})).as_deref(), Some("sb-2"));
    assert_eq!(sandbox_pod(&json!({})), None);
}

#[test]
fn a_claim_names_the_pool_and_carries_no_env_or_volumes() {
    let c = claim("s1-claim", "pyberth-python", &ours("s1", "alice@example.com"), "2026-11-26T20:00:00Z");
    assert_eq!(c["apiVersion"], EXTENSIONS_API);
    assert_eq!(c["spec"]["warmPoolRef"]["name"], "pyberth-python");
    assert_eq!(c["spec"]["lifecycle"]["shutdownTime"], "2026-11-26T20:00:00Z");
    assert_eq!(c["spec"]["additionalPodMetadata"]["labels"]["pyberth.session"], "s1");
    let owner = c["spec"]["additionalPodMetadata"]["labels"]["pyberth.owner"].as_str().unwrap_or("");
    assert!(owner.starts_with("h-"), "an email becomes a valid label value: {owner}");
    let spec = c["spec"].as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    assert!(!spec.iter().any(|k| k == "env" || k == "volumeClaimTemplates"), "{spec:?}");
}

#[test]
fn template_and_pool_reference_each_other() {
    let t = template("pyberth-python", &pod("x", &BTreeMap::new(), "Pending"));
    assert_eq!(t["kind"], "SandboxTemplate");
    assert_eq!(t["spec"]["networkPolicyManagement"], "Managed");
    assert_eq!(t["spec"]["networkPolicy"]["egress"], json!([]), "the Managed default would open the internet");
    let p = warm_pool("pyberth-python", "pyberth-python", 3);
    assert_eq!(p["spec"]["replicas"], 3);
    assert_eq!(p["spec"]["sandboxTemplateRef"]["name"], "pyberth-python");
}
