//! Every way a session changes its container, then a restart (issue 26, finding 1): a session
//! that hibernated and woke, one woken under an adopting server, a fork, a restore, one whose
//! interpreter an OOM kill restarted and one whose container was replaced are each adopted by
//! the next server with their state, never dropped for a fresh session.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::adopt::{Server, StateDir, run, state_of};
use crate::common::{Recorder, Server as StdioServer, assert_cleaned_up, text};
use crate::http::call;
use rmcp::RoleClient;
use rmcp::service::RunningService;

type Client = RunningService<RoleClient, Recorder>;

/// Waits until `name` is listed as hibernated.
pub(crate) async fn until_hibernated(client: &Client, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(40);
    while state_of(client, name).await != Some(json!("hibernated")) {
        assert!(Instant::now() < deadline, "{name} never hibernated");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// After a restart: `name` is listed, running, and `code` gives `want` with no state lost said.
async fn adopted_with(client: &Client, name: &str, code: &str, want: &str) {
    assert_eq!(state_of(client, name).await, Some(json!("running")), "{name} is adopted, awake");
    let (r, sc) = call(client, "run_python", json!({ "session": name, "code": code })).await;
    assert_eq!(r.is_error, Some(false), "{name}: {}", text(&r));
    assert_eq!(sc["result"], want, "{name} keeps its state across the restart: {sc}");
    let said = text(&r);
    assert!(!said.contains("new session"), "{name} is not a fresh session: {said}");
    assert!(!said.contains("variables are gone"), "{name} lost nothing: {said}");
}

/// Closes `names` and stops the server with SIGTERM (nothing left running).
async fn close_and_stop(server: Server, client: Client, names: &[&str]) -> String {
    for name in names {
        let (r, _) = call(&client, "close_session", json!({ "session": name })).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
    }
    let _ = client.cancel().await;
    server.signal("-TERM").await
}

/// Issue 26, finding 1: set `y`, let the session hibernate, wake it, SIGTERM the server, and
/// start a new one on the same state dir: `h` is listed and `y` is there. Before the fix the
/// woken session had no record, so the new server swept its container and `print(y)` met a
/// NameError in a fresh session.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_that_hibernated_and_woke_is_adopted_after_a_restart() {
    let state = StateDir::new("wake-restart");
    let sleepy = [("PYBERTH_HIBERNATE_AFTER_S", "2")];
    let first = Server::start("wake-restart", &state, &sleepy).await;
    let alice = first.client().await;
    run(&alice, "h", "y = 7").await;
    until_hibernated(&alice, "h").await;
    let sc = run(&alice, "h", "print(y)").await;
    assert_eq!(sc["stdout"], "7\n", "woken with y: {sc}");
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;

    // The next server wakes it again and is restarted in turn: still kept.
    let second = Server::start("wake-restart", &state, &sleepy).await;
    let alice = second.client().await;
    adopted_with(&alice, "h", "y", "7").await;
    run(&alice, "h", "y += 1").await;
    until_hibernated(&alice, "h").await;
    assert_eq!(run(&alice, "h", "y").await["result"], "8", "woken under the adopting server");
    let _ = alice.cancel().await;
    let middle = second.signal("-TERM").await;

    let third = Server::start("wake-restart", &state, &[]).await;
    let alice = third.client().await;
    adopted_with(&alice, "h", "y", "8").await;
    let new = close_and_stop(third, alice, &["h"]).await;
    for inst in [old, middle, new] {
        assert_cleaned_up(&inst).await;
    }
}

/// Kills the container of session `name` of `instance` behind the server's back.
async fn kill_session_container(instance: &str, name: &str) {
    let found = crate::common::containers_of(instance).await;
    let of = |c: &&bollard::models::ContainerSummary| {
        c.labels.as_ref().and_then(|l| l.get("pyberth.session")).is_some_and(|s| s == name)
    };
    let id = found.iter().find(of).and_then(|c| c.id.clone()).expect("the session's container");
    let docker = crate::common::docker().await;
    docker.kill_container(&id, None::<bollard::query_parameters::KillContainerOptions>).await.expect("kill");
}

/// A forked session, a restored one, one whose interpreter was OOM-killed and restarted, and
/// one whose container was killed and replaced (state lost in both, and said) each carry what
/// they hold after the change across a SIGTERM and restart.
#[tokio::test(flavor = "multi_thread")]
async fn forked_restored_oom_restarted_and_replaced_sessions_are_adopted_after_a_restart() {
    let state = StateDir::new("changed-restart");
    let first = Server::start("changed-restart", &state, &[("PYBERTH_MEMORY_MB", "256")]).await;
    let alice = first.client().await;
    run(&alice, "base", "x = 1\nopen('f.txt', 'w').write('base')").await;
    let (r, _) = call(&alice, "fork_session", json!({ "session": "base", "new_session": "forked" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    run(&alice, "forked", "x = 2").await;
    let (r, _) = call(&alice, "snapshot_session", json!({ "session": "base", "name": "s" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, _) = call(&alice, "restore_session", json!({ "snapshot": "s", "session": "restored" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    run(&alice, "restored", "x = 3").await;
    run(&alice, "oom", "x = 0").await;
    let hog = "b = []\nwhile True:\n    b.append(bytearray(16 << 20))";
    let (r, sc) = call(&alice, "run_python", json!({ "session": "oom", "code": hog, "timeout_s": 60 })).await;
    assert_eq!(sc["state_lost"], true, "the OOM kill lost the interpreter, and says so: {} {sc}", text(&r));
    run(&alice, "oom", "x = 4").await;
    run(&alice, "replaced", "x = 0").await;
    kill_session_container(&first.instance, "replaced").await;
    let (r, sc) = call(&alice, "run_python", json!({ "session": "replaced", "code": "x = 5" })).await;
    assert!(text(&r).contains("was replaced") && sc["state_lost"] == true, "{}", text(&r));
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;

    let second = Server::start("changed-restart", &state, &[]).await;
    let alice = second.client().await;
    let code = "x, open('f.txt').read() if __import__('os').path.exists('f.txt') else None";
    for (name, want) in [
        ("base", "(1, 'base')"),
        ("forked", "(2, 'base')"),
        ("restored", "(3, 'base')"),
        ("oom", "(4, None)"),
        ("replaced", "(5, None)"),
    ] {
        adopted_with(&alice, name, code, want).await;
    }
    let (r, _) = call(&alice, "delete_snapshot", json!({ "snapshot": "s" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let new = close_and_stop(second, alice, &["base", "forked", "restored", "oom", "replaced"]).await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
}

/// The same as a desktop user meets it, over stdio with `--keep-sessions`: the client ends
/// after the wake, and the next server started on the state dir has `h` and its `y`.
#[tokio::test(flavor = "multi_thread")]
async fn over_stdio_a_woken_session_is_adopted_by_the_next_server() {
    let state = StateDir::new("wake-restart-stdio");
    let dir = state.0.to_string_lossy().into_owned();
    let keep = [("PYBERTH_STATE_DIR", dir.as_str()), ("PYBERTH_KEEP_SESSIONS", "true")];
    let first = StdioServer::start("wake-restart-stdio", &[keep[0], keep[1], ("PYBERTH_HIBERNATE_AFTER_S", "2")]).await;
    first.ok("h", "y = 7").await;
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let r = first.call("list_sessions", json!({})).await;
        let sc = r.structured_content.clone().unwrap_or_default();
        if sc["sessions"][0]["state"] == "hibernated" {
            break;
        }
        assert!(Instant::now() < deadline, "h never hibernated: {sc}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(first.ok("h", "print(y)").await["stdout"], "7\n");
    let old = first.instance.clone();
    let log = first.stop().await;
    // The stop says what it left, for how long, and how to remove it (issue 26 item 3).
    assert!(log.contains("sessions left for the next server of state dir"), "left for the next server: {log}");
    assert!(
        log.contains("saves its state into its volumes and stops, and the engine removes it"),
        "and when they stop and go: {log}"
    );
    assert!(log.contains("volumes (workspaces") && log.contains("which stay"), "and what stays: {log}");
    assert!(log.contains("pyberth gc --yes"), "and how to remove them: {log}");

    let second = StdioServer::start("wake-restart-stdio", &keep).await;
    let r = second.call("list_sessions", json!({})).await;
    let sc = r.structured_content.clone().unwrap_or_default();
    assert_eq!(sc["sessions"][0]["session"], "h", "h is adopted: {sc}");
    let (r, sc) = second.run("h", "print(y)").await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["stdout"], "7\n", "y survives the restart: {}", text(&r));
    assert!(!text(&r).contains("variables are gone"), "{}", text(&r));
    let r = second.call("close_session", json!({ "session": "h" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let new = second.instance.clone();
    second.stop().await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
}

/// A snapshot outlives a restart when no session is left to carry it: its session closed,
/// the server stopped (SIGTERM), the next one lists it and restores it. Before the fix a stop
/// with no session took itself for a final one and removed every snapshot.
#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_whose_session_closed_survives_a_restart() {
    let state = StateDir::new("snap-alone");
    let first = Server::start("snap-alone", &state, &[]).await;
    let alice = first.client().await;
    run(&alice, "s", "x = 42\nopen('kept.txt', 'w').write('kept')").await;
    let (r, _) = call(&alice, "snapshot_session", json!({ "session": "s", "name": "only" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let old = close_and_stop(first, alice, &["s"]).await;

    let second = Server::start("snap-alone", &state, &[]).await;
    let alice = second.client().await;
    let (_, sc) = call(&alice, "list_snapshots", json!({})).await;
    assert!(sc.to_string().contains("\"only\""), "the snapshot is kept: {sc}");
    let (r, _) = call(&alice, "restore_session", json!({ "snapshot": "only", "session": "back" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = run(&alice, "back", "x, open('kept.txt').read()").await;
    assert_eq!(sc["result"], "(42, 'kept')", "{sc}");
    let (r, _) = call(&alice, "delete_snapshot", json!({ "snapshot": "only" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let new = close_and_stop(second, alice, &["back"]).await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
}
