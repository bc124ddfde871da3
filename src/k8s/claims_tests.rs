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
    for p in [other_session, other_principal] {
        assert!(matches!(check_pod(&p, &want), Err(Refused::NotOurs { .. })), "{p:?}");
    }
    // An unlabelled pod (a warm pod bound but not yet labelled, or not ours) is not used:
    // waited on, within the resolve's limit, as one not yet running.
    let unlabelled = pod("victim", &BTreeMap::new(), "Running");
    assert!(matches!(check_pod(&unlabelled, &want), Err(Refused::Unlabelled { .. })));
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

fn session_pod(name: &str, uid: u32, session: &str, owner: &str, memory_mb: u64) -> Pod {
    let spec = crate::docker::container::Spec {
        memory_mb,
        cpus: 1.0,
        pids: 256,
        tmp_mb: 64,
        workspace_mb: Some(64),
        uid_range: Default::default(),
        sandboxing: Default::default(),
        mounts: Vec::new(),
        network: None,
        orphan_after: std::time::Duration::from_secs(600),
    };
    let settings = crate::k8s::pod::PodSettings { ephemeral_mb: 256, ..Default::default() };
    crate::k8s::pod::pod(&spec, &settings, "pyberth-python:t", name, uid, &ours(session, owner)).expect("a pod")
}

#[test]
fn sessions_that_differ_only_in_what_a_claim_carries_share_a_template() {
    let a = session_pod("pyberth-a", 100_001, "s1", "alice@example.com", 512);
    let b = session_pod("pyberth-b", 100_002, "s2", "bob@example.com", 512);
    let (name_a, t) = template_of(&a, 100_000);
    let (name_b, _) = template_of(&b, 100_000);
    assert_eq!(name_a, name_b, "name, uid, session and principal are not the environment");
    assert!(name_a.starts_with("pyberth-env-") && name_a.len() == "pyberth-env-".len() + 10, "{name_a}");
    // Anything else is another environment: another template and pool.
    let (bigger, _) = template_of(&session_pod("pyberth-c", 100_003, "s3", "alice@example.com", 1024), 100_000);
    assert_ne!(name_a, bigger);
    let (other_uid, _) = template_of(&a, 100_500);
    assert_ne!(name_a, other_uid, "the template's uid is part of it");
    // The template runs as the uid given, carries no session's labels, no name, no notes.
    let spec = t.spec.as_ref().expect("spec");
    let psc = spec.security_context.as_ref().expect("pod security");
    assert_eq!((psc.run_as_user, psc.run_as_group, psc.fs_group), (Some(100_000), Some(100_000), Some(100_000)));
    let sc = spec.containers[0].security_context.as_ref().expect("container security");
    assert_eq!(
        (sc.run_as_user, sc.run_as_non_root, sc.read_only_root_filesystem),
        (Some(100_000), Some(true), Some(true))
    );
    assert!(t.metadata.name.is_none() && t.metadata.annotations.is_none(), "{:?}", t.metadata);
    let labels = t.metadata.labels.clone().unwrap_or_default();
    assert!(!labels.is_empty() && labels.keys().all(|k| k.starts_with("pyberth.io/")), "{labels:?}");
    let v = template(&name_a, &t);
    assert_eq!(v["spec"]["podTemplate"]["metadata"]["labels"], json!(labels));
    assert_eq!(v["metadata"]["labels"][MANAGED], "true");
}

#[test]
fn labels_are_checked_as_the_claim_carries_them() {
    let want = labels::split(&ours("s1", "alice@example.com")).0;
    assert!(want["pyberth.owner"].starts_with("h-"));
    let p = pod("p", &ours("s1", "alice@example.com"), "Running");
    assert_eq!(check_labels(&p, &want), Ok(()), "a hashed value is compared as it is, not hashed again");
    let other = pod("p", &ours("s1", "bob@example.com"), "Running");
    assert!(matches!(check_labels(&other, &want), Err(Refused::NotOurs { .. })));
}
