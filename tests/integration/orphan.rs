//! Nothing runs forever without an owner (issue 26, item 3; docs/design.md D12, "Orphans"):
//! a sandbox whose server died stops within `--adopt-grace-s` plus the tether's margin and is
//! removed by the engine, keeping its state on disk in its volumes, and the next server of its
//! state dir wakes it with that state. Nothing of the dead server stays on `docker ps -a`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bollard::query_parameters::{ListContainersOptionsBuilder, ListVolumesOptionsBuilder};
use serde_json::json;

use crate::adopt::{Server, StateDir, run, state_of};
use crate::common::{assert_cleaned_up, containers_of, docker, text, volumes_of};
use crate::http::call;

/// The grace the tests give (seconds): short, so the tests stay bounded.
const GRACE: u64 = 3;

/// Whether the engine says the container runs.
async fn running(id: &str) -> bool {
    let info = docker().await.inspect_container(id, None).await;
    info.ok().and_then(|i| i.state).and_then(|s| s.running).unwrap_or(false)
}

/// A `kill -9`ed server's sandbox, busy burning CPU, runs on for the grace (the next server
/// could still adopt it running), then stops within the grace plus the margin; the next
/// server of the state dir takes it as a sleeping session and wakes it with its variables
/// and files, saying so.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_servers_sandbox_stops_within_the_grace_and_wakes_with_its_state() {
    let tag = "orphan-kill";
    let state = StateDir::new(tag);
    let grace = GRACE.to_string();
    let env = [("PYBERTH_ADOPT_GRACE_S", grace.as_str())];
    let first = Server::start(tag, &state, &env).await;
    let alice = first.client().await;
    let spin = "import threading\nx = 42\nopen('kept.txt', 'w').write('kept')\n\
                def spin():\n    while True:\n        pass\n\
                threading.Thread(target=spin, daemon=True).start()";
    run(&alice, "keep", spin).await;
    let _ = alice.cancel().await;
    let old = first.signal("-KILL").await;
    let killed = Instant::now();
    let ids: Vec<String> = containers_of(&old).await.into_iter().filter_map(|c| c.id).collect();
    let sandboxes: Vec<String> = {
        let mut v = Vec::new();
        for id in &ids {
            if running(id).await {
                v.push(id.clone());
            }
        }
        v
    };
    assert!(!sandboxes.is_empty(), "the session's sandbox runs on at first");
    // Within the grace it still runs: a server starting now would adopt it running.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for id in &sandboxes {
        assert!(running(id).await, "still running within the grace");
    }
    let limit = Duration::from_secs(GRACE) + pyberth::docker::tether::MARGIN + Duration::from_secs(5);
    loop {
        let mut any = false;
        for id in &sandboxes {
            any |= running(id).await;
        }
        if !any {
            break;
        }
        assert!(killed.elapsed() < limit, "an orphan still runs {:?} after its server was killed", killed.elapsed());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("orphan stopped {:?} after kill -9 (grace {GRACE} s)", killed.elapsed());
    // Stopped and removed by the engine; its volumes stay for the next server, also from a
    // server of another state dir, whose leftover grace is long over: it keeps them for
    // --idle-ttl-s.
    let volumes = volumes_of(&old).await;
    assert!(!volumes.is_empty(), "its state stays on disk, in its volumes");
    let elsewhere = StateDir::new("orphan-elsewhere");
    let other = Server::start("orphan-elsewhere", &elsewhere, &[("PYBERTH_LEFTOVER_GRACE_S", "2")]).await;
    let bob = other.client().await;
    let _ = call(&bob, "list_sessions", json!({})).await; // served once its start sweep is done
    let _ = bob.cancel().await;
    let mut left = volumes_of(&old).await;
    left.sort();
    let mut volumes = volumes;
    volumes.sort();
    assert_eq!(left, volumes, "kept by a server of another state dir");
    assert_cleaned_up(&other.signal("-TERM").await).await;

    let second = Server::start(tag, &state, &env).await;
    let alice = second.client().await;
    assert_eq!(state_of(&alice, "keep").await, Some(json!("hibernated")), "listed as asleep until its call");
    let (r, sc) = call(&alice, "run_python", json!({ "session": "keep", "code": "x, open('kept.txt').read()" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "(42, 'kept')", "woken with its variables and files: {sc}");
    assert!(sc.to_string().contains("saved its state and stopped"), "the caller is told: {sc}");
    let (r, _) = call(&alice, "close_session", json!({ "session": "keep" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
}

/// Every container labelled as `instance`'s, a session's or its heartbeat, in any state.
async fn all_containers_of(instance: &str) -> Vec<String> {
    let mut out = Vec::new();
    for label in [format!("pyberth.instance={instance}"), format!("pyberth.heartbeat={instance}")] {
        let filters = HashMap::from([("label", vec![label.as_str()])]);
        let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
        let list = docker().await.list_containers(Some(opts)).await.expect("list containers");
        out.extend(list.into_iter().map(|c| format!("{:?} {:?} ({:?})", c.names, c.labels, c.state)));
    }
    out
}

/// The volumes of `instance`'s heartbeat (what says it had one, and since when it stopped).
async fn heartbeat_volumes_of(instance: &str) -> Vec<String> {
    let label = format!("pyberth.heartbeat={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let list = docker().await.list_volumes(Some(opts)).await.expect("list volumes");
    list.volumes.unwrap_or_default().into_iter().map(|v| v.name).collect()
}

/// Issue 26's "done when": after a `kill -9` and the grace, the engine holds no container of
/// that server at all (not its sandbox, not its heartbeat, running or stopped); its session's
/// state is in its volumes, and a new server on the same state dir wakes the session with its
/// variable and its file.
#[tokio::test(flavor = "multi_thread")]
async fn after_a_kill_and_the_grace_no_container_of_the_server_is_left_and_its_session_wakes() {
    let tag = "orphan-gone";
    let state = StateDir::new(tag);
    let grace = GRACE.to_string();
    let env = [("PYBERTH_ADOPT_GRACE_S", grace.as_str())];
    let first = Server::start(tag, &state, &env).await;
    let alice = first.client().await;
    run(
        &alice,
        "kept",
        "v = 'still here'
open('notes.txt', 'w').write('on disk')",
    )
    .await;
    let _ = alice.cancel().await;
    assert!(!all_containers_of(&first.instance).await.is_empty(), "a sandbox and a heartbeat run");
    let old = first.signal("-KILL").await;
    let killed = Instant::now();
    let limit = Duration::from_secs(GRACE) + pyberth::docker::tether::MARGIN + Duration::from_secs(10);
    loop {
        let left = all_containers_of(&old).await;
        if left.is_empty() {
            break;
        }
        assert!(killed.elapsed() < limit, "{:?} after kill -9, containers are left: {left:?}", killed.elapsed());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("no container of the killed server {:?} after kill -9 (grace {GRACE} s)", killed.elapsed());
    assert!(!volumes_of(&old).await.is_empty(), "its state stays on disk, in its volumes");

    let second = Server::start(tag, &state, &env).await;
    let alice = second.client().await;
    assert_eq!(state_of(&alice, "kept").await, Some(json!("hibernated")), "listed as asleep until its call");
    let (r, sc) = call(&alice, "run_python", json!({ "session": "kept", "code": "v, open('notes.txt').read()" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "('still here', 'on disk')", "woken with its variable and file: {sc}");
    assert!(sc.to_string().contains("saved its state and stopped"), "the caller is told: {sc}");
    let (r, _) = call(&alice, "close_session", json!({ "session": "kept" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
    for instance in [&old, &new] {
        assert!(all_containers_of(instance).await.is_empty(), "{instance}: a container is left");
        assert!(heartbeat_volumes_of(instance).await.is_empty(), "{instance}: its heartbeat's volumes are left");
    }
}

/// `pyberth gc` with `PYBERTH_STATE_DIR` at `state`: its stdout.
fn gc(state: &StateDir, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
        .arg("gc")
        .args(args)
        .env("PYBERTH_STATE_DIR", &state.0)
        .output()
        .expect("run pyberth gc");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "gc failed: {said} {}", String::from_utf8_lossy(&out.stderr));
    said
}

/// `pyberth gc` lists a killed server's resources and removes them with `--yes`; it keeps
/// those a record of its own state dir keeps for a next server, and a live server's.
#[tokio::test(flavor = "multi_thread")]
async fn gc_removes_an_orphan_and_keeps_a_live_servers_resources() {
    let live_state = StateDir::new("gc-live");
    let live = Server::start("gc-live", &live_state, &[]).await;
    let mine = live.client().await;
    run(&mine, "mine", "y = 1").await;
    let state = StateDir::new("gc-dead");
    let dead = Server::start("gc-dead", &state, &[]).await;
    let alice = dead.client().await;
    run(&alice, "gone", "x = 1").await;
    let _ = alice.cancel().await;
    // Killed only once its heartbeat runs: a server killed before its heartbeat ever started
    // is of unknown liveness to every other state dir, and unknown is never dead (under load
    // the heartbeat can start after the first session).
    heartbeat_running(&dead.instance).await;
    let old = dead.signal("-KILL").await;
    let now = ["--grace-s", "0", "--only-instance"];
    // From the dead server's own state dir: its records keep them for the next server.
    let said = gc(&state, &[&["--yes"][..], &now, &[old.as_str()]].concat());
    assert!(said.contains("kept"), "{said}");
    assert!(!containers_of(&old).await.is_empty(), "recorded sessions are kept");
    // From elsewhere: listed, then removed.
    let other = StateDir::new("gc-other");
    // Dead to another state dir once its heartbeat has stopped: the engine notices the killed
    // server's attach a moment after the kill.
    let deadline = Instant::now() + Duration::from_secs(20);
    let said = loop {
        let said = gc(&other, &[&now[..], &[old.as_str()]].concat());
        if said.contains("orphan container") || Instant::now() > deadline {
            break said;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(said.contains("orphan container") && said.contains("orphan volume"), "{said}");
    assert!(!containers_of(&old).await.is_empty(), "a listing removes nothing");
    let said = gc(&other, &[&["--yes"][..], &now, &[old.as_str()]].concat());
    assert!(said.contains("removed container"), "{said}");
    assert_cleaned_up(&old).await;
    // A live server's resources stay, and its session works on.
    let said = gc(&other, &[&["--yes"][..], &now, &[live.instance.as_str()]].concat());
    assert!(!said.contains("removed container"), "{said}");
    assert_eq!(containers_of(&live.instance).await.len(), 1, "the live session's container stays");
    assert_eq!(run(&mine, "mine", "y + 1").await["result"], "2");
    let (r, _) = call(&mine, "close_session", json!({ "session": "mine" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = mine.cancel().await;
    let done = live.signal("-TERM").await;
    assert_cleaned_up(&done).await;
}

/// Waits (bounded) until `instance`'s heartbeat container runs.
async fn heartbeat_running(instance: &str) {
    let label = format!("pyberth.heartbeat={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let opts = ListContainersOptionsBuilder::default().filters(&filters).build();
        let running = docker().await.list_containers(Some(opts)).await.expect("list containers");
        if !running.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "the heartbeat of {instance} never ran");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
