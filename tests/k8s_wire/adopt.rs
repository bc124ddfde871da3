//! Sessions on Kubernetes outlive their server (issue 33; on Docker: docs/design.md D12,
//! `tests/integration/adopt.rs`): `pyberth serve` with `keep_sessions`, stopped by the end of
//! its stdin, by SIGTERM or by `kill -9`, then started again on the same namespace and state dir, finds
//! its sessions' pods by name and label and adopts them from its records: variables, an open
//! file, a thread, workspace files and a background job running across the restart survive;
//! the relay reaches the same interpreter through `pods/exec` (the keeper).
//!
//! The attack view: whoever can make pods in the namespace (not a sandbox: its pod has no
//! service-account token) can label and annotate them as they like. A pod claiming a stopped
//! instance's labels and a recorded session's container name is not taken for that session,
//! and a pod put in the place of a recorded one with another principal's labels is not
//! adopted into the recorded principal's session: the record in the state dir says whose a
//! session is, and a pod that disagrees with it is deleted with the stopped instance's
//! leftovers.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use pyberth::k8s::cluster::{Cluster, Connect};
use serde_json::{Value, json};

use super::apiserver::{Options, Sim};
use super::docker;
use super::serve::{Served, node_containers, pods, text};

/// Over stdio a stop ends the sessions unless asked to leave them.
const KEEP: &str = "keep_sessions = true\n";
/// State that must survive: a variable, an open file, a thread that counts.
const SETUP: &str = "import threading, time\nx = 42\nf = open('/tmp/held.txt', 'w')\nf.write('a')\n\
                     count = [0]\ndef tick():\n    while True:\n        count[0] += 1\n        time.sleep(0.01)\n\
                     t = threading.Thread(target=tick, daemon=True)\nt.start()";
/// Checks it: the thread must still be counting.
const CHECK: &str = "c0 = count[0]\ntime.sleep(0.3)\n(x, f.closed, f.name, t.is_alive(), count[0] > c0)";
const INTACT: &str = "(42, False, '/tmp/held.txt', True, True)";

/// A directory two servers share (config, logs, state dir), removed at the end.
struct Shared(PathBuf);

impl Shared {
    fn new(tag: &str) -> Shared {
        let dir = std::env::temp_dir().join(format!("pyberth-k8s-adopt-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Shared(dir)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How the first server goes.
enum Stop {
    /// Its client leaves: stdin ends, the server stops and leaves its sessions.
    Eof,
    /// SIGTERM: the same stop, from a signal.
    Term,
    /// `kill -9`: nothing of it runs after; its records are on disk already.
    Kill,
}

/// The status of `job` once it is no longer running.
async fn job_end(s: &Served, job: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let sc = s.ok("job_status", json!({ "job": job, "wait_s": 5 })).await;
        if sc["status"] != "running" {
            return sc;
        }
        assert!(Instant::now() < deadline, "job {job} still running: {sc}\n{}", s.log());
    }
}

async fn survives(tag: &str, how: Stop) {
    let sim = Sim::start(Options::default(), docker()).await;
    let dir = Shared::new(tag);
    let mut first = Served::start_in(&sim, &dir.0, &format!("{tag}-a"), 0, KEEP).await;
    first.ok("run_python", json!({ "session": "k", "code": SETUP })).await;
    first.ok("write_file", json!({ "session": "k", "path": "notes/a.txt", "content": "kept\n" })).await;
    // A job that runs across the restart, in the same interpreter.
    let code = "import time\nprint('job-started', flush=True)\ntime.sleep(8)\nprint('job', x + 1)";
    let sc = first.ok("run_python", json!({ "session": "k", "code": code, "background": true })).await;
    let job = sc["job"].as_str().unwrap_or_else(|| panic!("a job handle: {sc}")).to_owned();
    let sc = first.ok("job_status", json!({ "job": job, "wait_s": 1 })).await;
    assert_eq!(sc["status"], "running", "{sc}");
    let made = pods(&sim);
    assert_eq!(made.len(), 1, "one pod for the session: {made:?}");
    match how {
        Stop::Eof => {
            let log = dir.0.join(format!("server-{tag}-a.log"));
            first.stop().await;
            let said = std::fs::read_to_string(log).unwrap_or_default();
            assert!(said.contains("sessions left for the next server"), "{said}");
            // The running job's exec was detached in order: its stdin closed (v5), its end read.
            assert!(said.contains("the stream ended in order"), "{said}");
        }
        Stop::Term => {
            let pid = first.child.id().expect("a pid").to_string();
            let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
            assert!(sent.success());
            let ended = tokio::time::timeout(Duration::from_secs(30), first.child.wait()).await;
            assert!(ended.is_ok(), "the server did not stop within 30 s of SIGTERM");
            assert!(first.whole_log().contains("sessions left for the next server"), "{}", first.log());
            assert!(first.whole_log().contains("the stream ended in order"), "{}", first.log());
        }
        Stop::Kill => {
            first.child.start_kill().expect("SIGKILL");
            let _ = first.child.wait().await;
        }
    }
    assert_eq!(pods(&sim), made, "the stopped server's pod is left running");

    let second = Served::start_in(&sim, &dir.0, &format!("{tag}-b"), 0, KEEP).await;
    let log = second.whole_log();
    assert!(log.contains("session adopted from a stopped server"), "{}", second.log());
    let sc = second.ok("list_sessions", json!({})).await;
    assert!(sc.to_string().contains("\"k\""), "the adopted session is listed: {sc}");
    let sc = second.ok("run_python", json!({ "session": "k", "code": "x" })).await;
    assert_eq!(sc["result"], "42", "{sc}");
    let sc = second.ok("run_python", json!({ "session": "k", "code": CHECK })).await;
    assert_eq!(sc["result"], INTACT, "{sc}");
    let sc = second.ok("read_file", json!({ "session": "k", "path": "notes/a.txt" })).await;
    assert_eq!(sc["content"], "kept\n", "{sc}");
    // The job started under the first server is found, and ends in the same interpreter.
    let done = job_end(&second, &job).await;
    assert_eq!(done["status"], "ok", "{done}\n{}", second.log());
    assert!(done["stdout"].as_str().is_some_and(|o| o.contains("job 43")), "{done}");
    assert_eq!(pods(&sim), made, "the same pod, adopted; no new one");

    second.ok("close_session", json!({ "session": "k" })).await;
    assert!(pods(&sim).is_empty(), "closing the adopted session deletes its pod: {:?}", pods(&sim));
    second.stop().await;
    assert_eq!(node_containers(&sim).await, 0);
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_and_its_job_survive_a_restart_by_the_end_of_stdin() {
    survives("eof", Stop::Eof).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_and_its_job_survive_a_sigterm_and_restart() {
    survives("term", Stop::Term).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_and_its_job_survive_a_kill_9_and_restart() {
    survives("kill", Stop::Kill).await;
}

/// The pod of session `session` among the simulator's.
fn pod_of(sim: &Sim, session: &str) -> Pod {
    let all = sim.state.pods.lock().expect("pods");
    let found = all.values().find(|s| {
        s.pod.metadata.labels.as_ref().is_some_and(|l| l.get("pyberth.session").is_some_and(|v| v == session))
    });
    found.map(|s| s.pod.clone()).unwrap_or_else(|| panic!("no pod of session {session}"))
}

/// `pod` as a new pod to create: named `name`, its owner label `owner`, its session label
/// `session`; everything else (the stopped instance's labels, the container-name annotation)
/// as it was.
fn forged(pod: &Pod, name: &str, owner: &str, session: &str) -> Pod {
    let mut p = pod.clone();
    p.metadata.name = Some(name.into());
    p.metadata.resource_version = None;
    p.metadata.uid = None;
    p.metadata.creation_timestamp = None;
    p.status = None;
    let labels = p.metadata.labels.get_or_insert_with(Default::default);
    labels.insert("pyberth.owner".into(), owner.into());
    labels.insert("pyberth.session".into(), session.into());
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_with_forged_labels_are_not_adopted_into_a_session() {
    let sim = Sim::start(Options::default(), docker()).await;
    let dir = Shared::new("forged");
    let first = Served::start_in(&sim, &dir.0, "forged-a", 0, KEEP).await;
    for (session, code) in [("k", "x = 1"), ("v", "v = 2"), ("g", "g = 3")] {
        first.ok("run_python", json!({ "session": session, "code": code })).await;
    }
    let (k, v, g) = (pod_of(&sim, "k"), pod_of(&sim, "v"), pod_of(&sim, "g"));
    let name = |p: &Pod| p.metadata.name.clone().expect("a name");
    let principal = k.metadata.labels.as_ref().and_then(|l| l.get("pyberth.owner")).cloned().expect("owner");
    first.stop().await;

    let at = Connect { kubeconfig: Some(sim.kubeconfig(&dir.0)), context: None, namespace: "pyberth".into() };
    let cluster = Cluster::connect(&at).await.expect("connect");
    // A pod no server made: the stopped instance's labels, this principal, a session no
    // record has, and annotated with k's container name (so that, believed, it would stand
    // for k's pod: kept by the adoption, and k's own pod deleted in its place).
    cluster.create_pod(&forged(&k, "planted", &principal, "stolen")).await.expect("planted");
    // v's pod replaced by one of the same name labelled as another principal's.
    cluster.delete_pod(&name(&v)).await.expect("delete v");
    cluster.create_pod(&forged(&v, &name(&v), "mallory", "v")).await.expect("v forged");
    // g's pod gone, and nothing in its place.
    cluster.delete_pod(&name(&g)).await.expect("delete g");

    let second = Served::start_in(&sim, &dir.0, "forged-b", 0, KEEP).await;
    let log = second.whole_log();
    assert!(log.contains("not adopted") && log.contains("another principal's"), "{}", second.log());
    let sc = second.ok("list_sessions", json!({})).await;
    let listed: Vec<&str> =
        sc["sessions"].as_array().into_iter().flatten().filter_map(|s| s["session"].as_str()).collect();
    assert_eq!(listed, ["k"], "only k is adopted: {sc}");
    // Those not adopted are listed as ended, with why.
    let ended = sc["ended"].to_string();
    assert!(ended.contains("another principal's") && ended.contains("were gone"), "{sc}");
    assert!(!ended.contains("stolen"), "a pod no record has is no session of anyone's: {sc}");
    // k's own pod, not the planted one, holds k.
    let sc = second.ok("run_python", json!({ "session": "k", "code": "x" })).await;
    assert_eq!(sc["result"], "1", "{sc}");
    // v and g start again, and their first call says why.
    for (session, why) in [("v", "another principal's (\"mallory\")"), ("g", "its pod and its workspace were gone")] {
        let r = second.call("run_python", json!({ "session": session, "code": session })).await;
        let said = format!("{} {}", text(&r), r.structured_content.clone().unwrap_or(Value::Null));
        assert_eq!(r.is_error, Some(true), "its variables are gone: {said}");
        assert!(said.contains("ended while its server was stopped") && said.contains(why), "{why}: {said}");
    }
    // The forged pods went with the stopped instance's leftovers; k's stayed.
    let now = pods(&sim);
    assert!(now.contains(&name(&k)), "{now:?}");
    assert!(!now.contains(&"planted".to_owned()) && !now.contains(&name(&v)), "forged pods deleted: {now:?}");
    assert_eq!(now.len(), 3, "k's pod, and new pods for v and g: {now:?}");
    for session in ["k", "v", "g"] {
        second.ok("close_session", json!({ "session": session })).await;
    }
    second.stop().await;
    assert!(pods(&sim).is_empty(), "{:?}", pods(&sim));
    assert_eq!(node_containers(&sim).await, 0);
    sim.stop().await;
}
