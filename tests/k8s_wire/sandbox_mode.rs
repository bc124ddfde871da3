//! `k8s_mode = "agent-sandbox"` through the real binary: each session is a SandboxClaim on
//! the warm pool of its environment's SandboxTemplate, bound by the simulated controller
//! (`controller.rs`) to a Sandbox whose pod runs our real sandbox image in the local Docker
//! engine. What it proves is our side of agent-sandbox's contract over our model of it.
//!
//! The attack view: whoever can write a claim's status can name any pod. A claim said bound to
//! another session's Sandbox reaches nothing of it: the pod must carry every label the claim
//! carries.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::apiserver::{Options, Sim};
use super::docker;
use super::serve::{Served, background_job, first_call_fails_saying, node_containers, pods, text};

const MODE: &str = "k8s_mode = \"agent-sandbox\"\nk8s_warm_pool = 3\n";

/// The stored objects of `plural`, by name.
fn objects(sim: &Sim, plural: &str) -> Vec<(String, Value)> {
    let objects = sim.state.objects.lock().expect("objects");
    objects.iter().filter(|((p, _), _)| p == plural).map(|((_, n), v)| (n.clone(), v.clone())).collect()
}

fn names(sim: &Sim, plural: &str) -> Vec<String> {
    objects(sim, plural).into_iter().map(|(n, _)| n).collect()
}

/// `pyberth k8s manifests` with the server's config prints the template the server made
/// (same name, same spec) and its pool: an operator who applies them has the engine reuse them.
fn printed_as_made(s: &Served, template: &str, made: &Value) {
    let (text, docs) = manifests(&s.dir.join("k8s.toml"));
    let named = |kind: &str| docs.iter().find(|d| d["kind"] == kind && d["metadata"]["name"] == template);
    let printed = named("SandboxTemplate").unwrap_or_else(|| panic!("{template} not printed:\n{text}"));
    assert_eq!(printed["spec"], made["spec"], "the printed template is the one the server made");
    assert_eq!(printed["metadata"]["namespace"], "pyberth");
    assert_eq!(named("SandboxWarmPool").map(|p| p["spec"]["replicas"].clone()), Some(json!(3)));
    assert!(text.contains("environment net: no template"), "the egress environment is left out");
    // The ConfigMap's pyberth.toml, read by the binary as `serve` reads its file, gives the
    // same settings: printed again from it, the ConfigMap is the same.
    let toml =
        |docs: &[Value]| docs.iter().find(|d| d["kind"] == "ConfigMap").map(|m| m["data"]["pyberth.toml"].clone());
    let again = s.dir.join("from-configmap.toml");
    std::fs::write(&again, toml(&docs).and_then(|t| t.as_str().map(str::to_owned)).expect("pyberth.toml"))
        .expect("write");
    let (_, docs_again) = manifests(&again);
    assert_eq!(toml(&docs_again), toml(&docs), "pyberth.toml read back gives the same settings");
}

/// `pyberth k8s manifests --config config`: its output and documents.
fn manifests(config: &std::path::Path) -> (String, Vec<Value>) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
        .args(["k8s", "manifests", "--config"])
        .arg(config)
        .output()
        .expect("pyberth k8s manifests");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("YAML");
    (text, docs)
}

/// Waits until nothing of `plural` is left.
async fn none_left(sim: &Sim, plural: &str, s: Option<&Served>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !names(sim, plural).is_empty() {
        let log = s.map(Served::log).unwrap_or_default();
        assert!(Instant::now() < deadline, "{plural} left: {:?}\n{log}", names(sim, plural));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_lives_on_a_claimed_sandbox() {
    // A layer store's claim, configured: agent-sandbox mode mounts no store (it has no
    // installs, and a warm pool's pods would make `sets/` before any set-up).
    let claim = std::env::temp_dir().join(format!("pyberth-k8s-sb-claim-{}", std::process::id()));
    std::fs::create_dir_all(&claim).expect("claim folder");
    let claims = [("pyberth-layers".to_owned(), claim.clone())].into();
    let opts = Options { controller: true, start_delay: Duration::from_millis(300), claims, ..Default::default() };
    let sim = Sim::start(opts, docker()).await;
    // pool_size 2 is turned off: agent-sandbox's pools keep sandboxes ready, not ours.
    let s = Served::start_cfg(&sim, "sb-life", 2, &format!("{MODE}k8s_layer_claim = \"pyberth-layers\"\n")).await;
    let code = "import os\nx = 41\nprint(os.getuid() > 0, os.path.ismount('/opt/pyberth/layers'))";
    let sc = s.ok("run_python", json!({ "session": "k", "code": code })).await;
    assert_eq!(sc["stdout"], "True False\n", "{sc}");
    let sc = s.ok("run_python", json!({ "session": "k", "code": "print(x + 1)" })).await;
    assert_eq!(sc["stdout"], "42\n", "{sc}");
    assert!(s.whole_log().contains("pool_size is off"), "{}", s.log());
    // Egress is Pods mode's only: a tool error that says so, and nothing made for it.
    let r = s.call("run_python", json!({ "session": "n", "environment": "net", "code": "1" })).await;
    let said = super::serve::text(&r);
    assert!(r.is_error == Some(true) && said.contains("egress in agent-sandbox mode"), "{said}");

    // One claim; its pod is named by the controller, not after the claim.
    let claims = names(&sim, "sandboxclaims");
    let made = pods(&sim);
    assert_eq!((claims.len(), made.len()), (1, 1), "one claim, one pod, no pool of ours: {claims:?} {made:?}");
    assert_ne!(claims[0], made[0], "the pod is the Sandbox's");
    // One template and its pool, named by the spec's hash, with no session's labels in it.
    let templates = objects(&sim, "sandboxtemplates");
    assert_eq!(templates.len(), 1, "{templates:?}");
    let (template, t) = &templates[0];
    assert!(template.starts_with("pyberth-env-") && made[0].starts_with(template.as_str()), "{template} {made:?}");
    let labels = t["spec"]["podTemplate"]["metadata"]["labels"].as_object().cloned().unwrap_or_default();
    assert!(labels.keys().all(|k| k.starts_with("pyberth.io/")), "only fixed labels in the template: {labels:?}");
    assert_eq!(t["spec"]["podTemplate"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"], true);
    let pools = objects(&sim, "sandboxwarmpools");
    assert_eq!(pools.len(), 1, "{pools:?}");
    assert_eq!((pools[0].1["spec"]["replicas"].clone(), &pools[0].0), (json!(3), template));
    printed_as_made(&s, template, t);

    // Files and a job go to the claimed pod.
    s.ok("write_file", json!({ "session": "k", "path": "notes/a.txt", "content": "claimed\n" })).await;
    let sc = s.ok("run_python", json!({ "session": "k", "code": "print(open('notes/a.txt').read(), end='')" })).await;
    assert_eq!(sc["stdout"], "claimed\n", "{sc}");
    background_job(&s).await;

    // A second session: its own claim and pod, the same template.
    let sc = s.ok("run_python", json!({ "session": "m", "code": "print('x' in globals())" })).await;
    assert_eq!(sc["stdout"], "False\n", "a session of its own: {sc}");
    assert_eq!((names(&sim, "sandboxclaims").len(), pods(&sim).len()), (2, 2));
    assert_eq!(names(&sim, "sandboxtemplates").len(), 1, "sessions of one environment share a template");

    // Closing deletes the claim, and with it (agent-sandbox's doing) its Sandbox and pod.
    s.ok("close_session", json!({ "session": "k" })).await;
    assert_eq!(names(&sim, "sandboxclaims").len(), 1);
    assert!(!pods(&sim).contains(&made[0]), "the closed session's pod is gone: {:?}", pods(&sim));
    // The server's stop releases the rest.
    s.stop().await;
    none_left(&sim, "sandboxclaims", None).await;
    assert!(pods(&sim).is_empty() && names(&sim, "sandboxes").is_empty(), "{:?}", pods(&sim));
    assert_eq!(node_containers(&sim).await, 0);
    sim.stop().await;
    let _ = std::fs::remove_dir_all(&claim);
}

/// Session b's claim is said bound to a's Sandbox (`opts` says how): b's call is refused and
/// nothing of b runs in a's pod.
async fn b_reaches_nothing_of_a(opts: Options, tag: &str) {
    let sim = Sim::start(opts, docker()).await;
    let s = Served::start_cfg(&sim, tag, 0, MODE).await;
    s.ok("run_python", json!({ "session": "a", "code": "secret = 'of a'" })).await;
    let r = s.call("run_python", json!({ "session": "b", "code": "secret = 'overwritten by b'" })).await;
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    assert!(text(&r).contains("not this session's"), "{}", text(&r));
    let sc = s.ok("run_python", json!({ "session": "a", "code": "print(secret)" })).await;
    assert_eq!(sc["stdout"], "of a\n", "a's state is a's: {sc}");
    assert_eq!(pods(&sim).len(), 1, "{:?}", pods(&sim));
    s.stop().await;
    none_left(&sim, "sandboxclaims", None).await;
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_claim_status_reaches_no_other_session() {
    b_reaches_nothing_of_a(Options { controller: true, bind_to_first: true, ..Default::default() }, "sb-forged").await;
}

/// Whoever can write a claim can relabel it too: b's claim, labelled as a's pod and said bound
/// to a's Sandbox, still reaches nothing of a. The pod must carry the labels the server asked
/// the claim for, not the ones the claim carries now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relabelled_claim_reaches_no_other_session() {
    let opts = Options { controller: true, bind_to_first: true, relabel_claims: true, ..Default::default() };
    b_reaches_nothing_of_a(opts, "sb-relabel").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_session_is_adopted_after_a_restart() {
    let sim = Sim::start(Options { controller: true, ..Default::default() }, docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-sb-adopt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let keep = format!("{MODE}keep_sessions = true\n");
    let mut first = Served::start_in(&sim, &dir, "sb-a", 0, &keep).await;
    first.ok("run_python", json!({ "session": "k", "code": "x = 42" })).await;
    let (claims, made) = (names(&sim, "sandboxclaims"), pods(&sim));
    first.child.start_kill().expect("SIGKILL");
    let _ = first.child.wait().await;

    let second = Served::start_in(&sim, &dir, "sb-b", 0, &keep).await;
    let sc = second.ok("run_python", json!({ "session": "k", "code": "print(x)" })).await;
    assert_eq!(sc["stdout"], "42\n", "adopted with its state: {sc}\n{}", second.log());
    assert_eq!((names(&sim, "sandboxclaims"), pods(&sim)), (claims, made), "the same claim and pod");
    second.ok("close_session", json!({ "session": "k" })).await;
    none_left(&sim, "sandboxclaims", Some(&second)).await;
    assert!(pods(&sim).is_empty(), "{:?}", pods(&sim));
    second.stop().await;
    drop(first);
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}

/// The Role of an earlier release read templates and pools only: the first session says what
/// to grant, in the cluster's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_cannot_write_templates_says_what_to_grant() {
    let opts = Options { controller: true, forbid_templates: true, ..Default::default() };
    let want = ["403 Forbidden", "create sandboxtemplates", "deploy/kubernetes/10-rbac.yaml"];
    first_call_fails_saying(opts, "sb-rbac", MODE, &want).await;
}

/// A warm sandbox made ahead is bound to the claim and said Ready before the controller puts
/// the claim's labels on its pod: the session waits for them (a pod without them is never
/// exec'd into) and runs in that warm pod; the pool is refilled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_sandbox_serves_once_it_carries_the_claims_labels() {
    let opts =
        Options { controller: true, warm_pool: true, label_delay: Duration::from_millis(1500), ..Default::default() };
    let sim = Sim::start(opts, docker()).await;
    let s = Served::start_cfg(&sim, "sb-warm", 0, "k8s_mode = \"agent-sandbox\"\nk8s_warm_pool = 2\n").await;
    let sc = s.ok("run_python", json!({ "session": "k", "code": "print(6 * 7)" })).await;
    assert_eq!(sc["stdout"], "42\n", "{sc}");
    // The claim took a warm sandbox: it is the claim's, its pod carries the session's label.
    let owned: Vec<(String, Value)> = objects(&sim, "sandboxes")
        .into_iter()
        .filter(|(_, v)| v["metadata"]["labels"].get("sim.agents.x-k8s.io/claim").is_some())
        .collect();
    assert_eq!(owned.len(), 1, "{owned:?}");
    let pod = owned[0].0.clone();
    let labels = sim.state.pods.lock().expect("pods")[&pod].pod.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("pyberth.session").map(String::as_str), Some("k"), "{labels:?}");
    // And the pool is refilled: two warm ones again, beside the claimed one.
    let deadline = Instant::now() + Duration::from_secs(30);
    while pods(&sim).len() < 3 {
        assert!(Instant::now() < deadline, "not refilled: {:?}", pods(&sim));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let sc = s.ok("run_python", json!({ "session": "k", "code": "print('again')" })).await;
    assert_eq!(sc["stdout"], "again\n", "{sc}");
    s.stop().await;
    none_left(&sim, "sandboxclaims", None).await;
    sim.stop().await;
}

/// A template loosened after pyberth made it (anyone who can write templates could): the pod
/// the controller makes from it may escalate privileges, and the session refuses it, saying
/// why, before anything runs there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_from_a_loosened_template_is_refused() {
    let opts = Options { controller: true, weaken: true, ..Default::default() };
    let want = ["not hardened", "may escalate privileges"];
    first_call_fails_saying(opts, "sb-weak", MODE, &want).await;
}

/// A killed server's claims go once its heartbeat Lease has lapsed and the grace has passed:
/// the next server (another state dir, so nothing to adopt) deletes each claim, and with it
/// the Sandbox and its pod; its own session then gets a claim of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_server_deletes_the_claims_of_a_killed_one() {
    let sim = Sim::start(Options { controller: true, ..Default::default() }, docker()).await;
    let mut first = Served::start_cfg(&sim, "sb-killed", 0, MODE).await;
    first.ok("run_python", json!({ "session": "k", "code": "x = 1" })).await;
    let killed = names(&sim, "sandboxclaims");
    assert_eq!(killed.len(), 1, "one claim for the session");
    first.child.start_kill().expect("SIGKILL");
    let _ = first.child.wait().await;
    let next = Served::start_cfg(&sim, "sb-next", 0, &format!("{MODE}leftover_grace_s = 1\n")).await;
    // Its heartbeat Lease lapses 15 s after its last renewal; a sweep every 5 s sees it.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !names(&sim, "sandboxclaims").is_empty() || !pods(&sim).is_empty() || node_containers(&sim).await > 0 {
        let left = (names(&sim, "sandboxclaims"), pods(&sim));
        assert!(Instant::now() < deadline, "the killed server's claim is still there: {left:?}\n{}", next.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(next.whole_log().contains("removed leftovers of dead instances"), "{}", next.log());
    let sc = next.ok("run_python", json!({ "session": "k", "code": "print(2)" })).await;
    assert_eq!(sc["stdout"], "2\n", "{sc}");
    let now = names(&sim, "sandboxclaims");
    assert_eq!(now.len(), 1, "{now:?}");
    next.stop().await;
    none_left(&sim, "sandboxclaims", None).await;
    drop(first);
    sim.stop().await;
}
