//! agent-sandbox mode's client side (`pyberth::k8s::sandboxes`) on the wire: the template,
//! warm pool and claim as the API server receives them, and how a claim's pod is resolved.
//! The statuses agent-sandbox's controller would write are written by the test (the
//! simulator has no controller yet), and so are the forged ones. The pods here are records
//! without a container: what is tested is which pod is resolved, and that none is exec'd.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use pyberth::k8s::cluster::Error;
use pyberth::k8s::labels;
use pyberth::k8s::sandboxes::Sandboxes;
use serde_json::json;

use super::apiserver::{Options, Sim, Stored};
use super::crds;

fn ours(session: &str, owner: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("pyberth.managed".to_owned(), "true".to_owned()),
        ("pyberth.session".to_owned(), session.to_owned()),
        ("pyberth.owner".to_owned(), owner.to_owned()),
    ])
}

/// A pod record labelled `labels`, in `phase`.
fn add_pod(sim: &Sim, name: &str, labels: &BTreeMap<String, String>, phase: &str) {
    let (l, a) = labels::split(labels);
    let pod = Pod {
        metadata: ObjectMeta { name: Some(name.into()), labels: Some(l), annotations: Some(a), ..Default::default() },
        status: Some(PodStatus { phase: Some(phase.into()), ..Default::default() }),
        // Our hardened spec, as a pod of our template has it.
        spec: super::session_pod(name, 9, "pyberth-python:test").spec,
    };
    let pod = sim.state.record("ADDED", pod);
    sim.state.pods.lock().expect("pods").insert(name.into(), Stored { pod, container: None });
}

/// What agent-sandbox's controller writes when it binds claim `claim` to a Sandbox whose pod
/// is `pod` (or what a forger writes).
fn bind(sim: &Sim, claim: &str, pod: &str) {
    let mut c = crds::get(&sim.state, "sandboxclaims", claim).expect("claim stored");
    c["status"] = json!({"sandbox": {"name": format!("sb-{claim}")},
        "conditions": [{"type": "Ready", "status": "True", "reason": "SandboxReady"}]});
    crds::put(&sim.state, "sandboxclaims", claim, c);
    let sandbox = json!({"apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
        "metadata": {"name": format!("sb-{claim}"), "annotations": {"agents.x-k8s.io/pod-name": pod}}});
    crds::put(&sim.state, "sandboxes", &format!("sb-{claim}"), sandbox);
}

fn execs(sim: &Sim) -> usize {
    sim.state.seen.lock().expect("seen").iter().filter(|s| s.contains("/exec")).count()
}

// Attack view, written first: a status naming a pod of another session or principal.
#[tokio::test]
async fn a_forged_status_naming_another_sessions_pod_is_refused() {
    let (sim, cluster, _) = super::start(Options::default()).await;
    let sandboxes = Sandboxes::new(&cluster);
    add_pod(&sim, "victim-s2", &ours("s2", "alice@example.com"), "Running");
    add_pod(&sim, "victim-bob", &ours("s1", "bob@example.com"), "Running");
    let me = ours("s1", "alice@example.com");
    for (claim, victim) in [("c-s1", "victim-s2"), ("c-s1b", "victim-bob")] {
        sandboxes.claim(claim, "pyberth-python", &me, "2026-11-26T23:00:00Z").await.expect("claim");
        bind(&sim, claim, victim);
        let e = sandboxes.resolve(claim, &me, Duration::from_secs(5)).await.expect_err("refused");
        assert!(matches!(e, Error::Claim { .. }), "{e:?}");
        assert!(e.to_string().contains("not this session's"), "{e}");
    }
    assert_eq!(execs(&sim), 0, "nothing was exec'd into");
    sim.stop().await;
}

#[tokio::test]
async fn a_claim_ready_before_its_pod_runs_resolves_once_it_runs() {
    let (sim, cluster, _) = super::start(Options::default()).await;
    let sandboxes = Sandboxes::new(&cluster);
    let me = ours("s1", "alice@example.com");
    sandboxes.claim("c1", "pyberth-python", &me, "2026-11-26T23:00:00Z").await.expect("claim");
    let sent = crds::get(&sim.state, "sandboxclaims", "c1").expect("stored");
    assert_eq!(sent["spec"]["warmPoolRef"]["name"], "pyberth-python");
    assert!(sent["spec"].get("env").is_none() && sent["spec"].get("volumeClaimTemplates").is_none());
    add_pod(&sim, "warm-1", &me, "Pending");
    bind(&sim, "c1", "warm-1");
    let state = sim.state.clone();
    let runner = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        state.set_phase("warm-1", "Running", None);
    });
    let t = Instant::now();
    let pod = sandboxes.resolve("c1", &me, Duration::from_secs(10)).await.expect("resolved");
    assert_eq!(pod, "warm-1");
    assert!(t.elapsed() >= Duration::from_millis(700), "waited for Running: {:?}", t.elapsed());
    runner.await.expect("runner");
    sandboxes.release("c1").await.expect("release");
    assert!(crds::get(&sim.state, "sandboxclaims", "c1").is_none(), "close deletes the claim");
    sandboxes.release("c1").await.expect("a claim already gone is fine");
    sim.stop().await;
}

#[tokio::test]
async fn template_and_pool_are_made_then_updated() {
    let (sim, cluster, _) = super::start(Options::default()).await;
    let sandboxes = Sandboxes::new(&cluster);
    let pod = super::session_pod("tpl", 1, "pyberth-python:test");
    sandboxes.ensure_pool("pyberth-python", &pod, 2).await.expect("first start");
    sandboxes.ensure_pool("pyberth-python", &pod, 3).await.expect("a restart updates");
    let pool = crds::get(&sim.state, "sandboxwarmpools", "pyberth-python").expect("pool");
    assert_eq!(pool["spec"]["replicas"], 3);
    assert_eq!(pool["spec"]["sandboxTemplateRef"]["name"], "pyberth-python");
    let t = crds::get(&sim.state, "sandboxtemplates", "pyberth-python").expect("template");
    let sc = &t["spec"]["podTemplate"]["spec"]["containers"][0]["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true, "the hardened spec: {sc}");
    assert_eq!(t["spec"]["podTemplate"]["spec"]["automountServiceAccountToken"], false);
    sim.stop().await;
}

#[tokio::test]
async fn an_expired_claim_fails_fast() {
    let (sim, cluster, _) = super::start(Options::default()).await;
    let sandboxes = Sandboxes::new(&cluster);
    let me = ours("s1", "alice@example.com");
    sandboxes.claim("c-exp", "pyberth-python", &me, "2026-11-26T23:00:00Z").await.expect("claim");
    let mut c = crds::get(&sim.state, "sandboxclaims", "c-exp").expect("stored");
    c["status"] = json!({"conditions": [{"type": "Ready", "status": "False", "reason": "ClaimExpired"}]});
    crds::put(&sim.state, "sandboxclaims", "c-exp", c);
    let t = Instant::now();
    let e = sandboxes.resolve("c-exp", &me, Duration::from_secs(20)).await.expect_err("fails");
    assert!(e.to_string().contains("ClaimExpired") && t.elapsed() < Duration::from_secs(2), "{e}");
    sim.stop().await;
}

#[tokio::test]
async fn a_claim_refused_by_rbac_says_what_to_grant() {
    let (sim, cluster, _) = super::start(Options { forbid: true, ..Options::default() }).await;
    let sandboxes = Sandboxes::new(&cluster);
    let e = sandboxes.claim("c1", "pyberth-python", &ours("s1", "a"), "2026-11-26T23:00:00Z").await.expect_err("403");
    let text = e.to_string();
    assert!(text.contains("create sandboxclaims") && text.contains("10-rbac.yaml"), "{text}");
    sim.stop().await;
}
