use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::{Server, assert_cleaned_up, containers_of, instance_name, text, volumes_of};

#[tokio::test(flavor = "multi_thread")]
async fn sessions_are_isolated_from_each_other() {
    let s = Server::start("isolation", &[]).await;
    s.ok(
        "alice",
        "secret = 'a'\nopen('/workspace/alice.txt', 'w').write('mine')\nopen('/tmp/alice-tmp', 'w').write('x')",
    )
    .await;
    let sc = s
        .ok("bob", "import os\n(os.listdir('/workspace'), os.path.exists('/tmp/alice-tmp'), 'secret' in globals())")
        .await;
    assert_eq!(sc["result"], "([], False, False)");
    // Alice starts a process; Bob cannot see it (separate PID namespaces).
    s.ok("alice", "import subprocess\np = subprocess.Popen(['sleep', '777'])").await;
    let find = "import os\nsorted(p for p in os.listdir('/proc') if p.isdigit() and os.path.exists(f'/proc/{p}/cmdline') and open(f'/proc/{p}/cmdline','rb').read().startswith(b'sleep\\x00777'))";
    assert_ne!(s.ok("alice", find).await["result"], "[]", "alice sees her own process");
    assert_eq!(s.ok("bob", find).await["result"], "[]", "bob does not see it");
    let list = s.call("list_sessions", json!({})).await;
    let names: Vec<String> = list.structured_content.expect("sc")["sessions"]
        .as_array()
        .expect("array")
        .iter()
        .map(|v| v["session"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(names, ["alice", "bob"]);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn reset_keeps_files_and_close_removes_everything() {
    let s = Server::start("reset", &[]).await;
    s.ok("w", "v = 1\nopen('kept.txt', 'w').write('data')").await;
    let r = s.call("reset_session", json!({ "session": "w" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, sc) = s.run("w", "v").await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["error"]["type"], "NameError");
    assert_eq!(s.ok("w", "open('kept.txt').read()").await["result"], "'data'");
    assert_eq!(containers_of(&s.instance).await.len(), 1);
    let r = s.call("close_session", json!({ "session": "w" })).await;
    assert_eq!(r.is_error, Some(false));
    assert!(containers_of(&s.instance).await.is_empty());
    assert!(volumes_of(&s.instance).await.is_empty());
    // The name can be used again, for an empty session.
    assert_eq!(s.ok("w", "import os\nos.listdir('.')").await["result"], "[]");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_sessions_are_reaped() {
    let s = Server::start("reap", &[("PYBERTH_IDLE_TTL", "2")]).await;
    s.ok("idle", "1").await;
    assert_eq!(containers_of(&s.instance).await.len(), 1);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(containers_of(&s.instance).await.is_empty(), "idle container reaped");
    assert!(volumes_of(&s.instance).await.is_empty(), "idle volume reaped");
    let list = s.call("list_sessions", json!({})).await;
    assert_eq!(list.structured_content.expect("sc")["sessions"], json!([]));
    // A busy session is not reaped while it runs.
    let (r, _) = s.run_with(json!({ "session": "busy", "code": "import time\ntime.sleep(5)\n'done'" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn closing_stdin_removes_everything_the_server_made() {
    let s = Server::start("shutdown", &[]).await;
    s.ok("a", "1").await;
    s.ok("b", "1").await;
    let instance = s.instance.clone();
    assert_eq!(containers_of(&instance).await.len(), 2);
    s.stop().await;
    assert_cleaned_up(&instance).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_removes_everything_the_server_made() {
    let mut s = Server::start("sigterm", &[]).await;
    s.ok("a", "1").await;
    let instance = s.instance.clone();
    let pid = s.child.id().expect("pid");
    let status = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status().expect("kill");
    assert!(status.success());
    let exited = tokio::time::timeout(Duration::from_secs(30), s.child.wait()).await;
    assert!(exited.is_ok(), "server exits on SIGTERM");
    assert_cleaned_up(&instance).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn leftovers_of_a_killed_server_are_swept_at_the_next_start() {
    let dead = instance_name("killed");
    let mut s = Server::start_as(&dead, &[]).await;
    s.ok("a", "1").await;
    s.ok("b", "1").await;
    s.child.kill().await.expect("SIGKILL");
    assert_eq!(containers_of(&dead).await.len(), 2, "a SIGKILLed server cannot clean up");
    // A live server's sessions must survive another server's start.
    let live = Server::start("live", &[]).await;
    live.ok("mine", "1").await;
    let next = Server::start("next", &[]).await;
    next.ok("x", "1").await; // the sweep runs before serving
    assert_cleaned_up(&dead).await;
    assert_eq!(containers_of(&live.instance).await.len(), 1, "a live instance is left alone");
    live.stop().await;
    next.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_container_is_replaced_and_the_caller_is_told() {
    let s = Server::start("container-killed", &[]).await;
    s.ok("k", "x = 1").await;
    let list = containers_of(&s.instance).await;
    let old = list[0].id.clone().expect("id");
    crate::common::docker()
        .await
        .kill_container(&old, None::<bollard::query_parameters::KillContainerOptions>)
        .await
        .expect("kill");
    let (r, sc) = s.run("k", "1").await;
    assert_eq!(
        r.is_error,
        Some(false),
        "the call runs on the replacement (its death is found before the call): {}",
        text(&r)
    );
    assert_eq!(sc["state_lost"], true);
    assert!(text(&r).contains("was replaced"), "{}", text(&r));
    let (r, sc) = s.run("k", "x").await;
    assert_eq!(r.is_error, Some(true), "state is gone");
    assert_eq!(sc["error"]["type"], "NameError");
    let now = containers_of(&s.instance).await;
    assert_eq!(now.len(), 1, "the old container was removed");
    assert_ne!(now[0].id.as_deref(), Some(old.as_str()));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_warm_pool_hands_each_container_to_one_session_and_refills() {
    let s = Server::start("pool", &[("PYBERTH_POOL_SIZE", "2")]).await;
    let ids = |list: &[bollard::models::ContainerSummary]| -> Vec<String> {
        list.iter().filter_map(|c| c.id.clone()).collect()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let pooled = loop {
        let list = containers_of(&s.instance).await;
        if list.len() == 2 {
            break ids(&list);
        }
        assert!(Instant::now() < deadline, "the pool did not fill: {} containers", list.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut hosts = Vec::new();
    let mut ready = pooled;
    for (n, session) in ["a", "b"].into_iter().enumerate() {
        let sc = s.ok(session, "import socket\nsocket.gethostname()").await;
        let host = sc["result"].as_str().expect("hostname").trim_matches('\'').to_owned();
        assert!(ready.iter().any(|id| id.starts_with(&host)), "session {session} got a container made before it");
        hosts.push(host);
        // The pool refills to two beside the sessions, one container at a time.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let list = containers_of(&s.instance).await;
            if list.len() == n + 3 {
                ready = ids(&list);
                break;
            }
            assert!(Instant::now() < deadline, "the pool did not refill: {} containers", list.len());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert_ne!(hosts[0], hosts[1], "a pooled container goes to one session only");
    // The adopted container is a working session.
    let sc = s.ok("a", "x = 41\nx + 1").await;
    assert_eq!(sc["result"], "42");
    let instance = s.instance.clone();
    s.stop().await;
    assert_cleaned_up(&instance).await;
}

/// A fresh server whose image does not exist yet starts building it at once; the first call
/// waits for that build and must not be silent for its length: it hears the build's progress.
#[tokio::test(flavor = "multi_thread")]
async fn the_first_call_hears_the_image_build_it_waits_for() {
    use sha2::Digest as _;
    // An environment of its own (the local offline base named as the base image): its tag is
    // the sandbox tag plus a hash of base and release, as `image::tag_for` makes it.
    let base = "pyberth-base:bookworm";
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pyberth")).args(["image", "tag"]).output().expect("tag");
    let mut h = sha2::Sha256::new();
    h.update(base.as_bytes());
    h.update([0]);
    h.update(b"bookworm");
    let key: String = h.finalize().iter().take(4).map(|b| format!("{b:02x}")).collect();
    let tag = format!("{}-{key}", String::from_utf8_lossy(&out.stdout).trim());
    let docker = crate::common::docker().await;
    let force = bollard::query_parameters::RemoveImageOptionsBuilder::default().force(true).build();
    let _ = docker.remove_image(&tag, Some(force.clone()), None).await;

    let s = Server::start("first-build", &[("PYBERTH_BASE_IMAGE", base)]).await;
    let sc = s.ok("default", "6 * 7").await;
    assert_eq!(sc["result"], "42");
    let heard = s.take_heard();
    // Progress keeps the latest line only: a fast (cached) build may be heard by its last.
    let of_build = |t: &str| t.contains("Step") || t.contains("building") || t.contains("built");
    let build: Vec<_> = heard.iter().filter(|h| h.kind == "progress" && of_build(&h.text)).collect();
    assert!(!build.is_empty(), "the first call heard the build: {heard:?}");
    assert!(heard.iter().all(|h| !h.text.contains('\u{1b}')), "no escape codes in progress lines");
    s.stop().await;
    let _ = docker.remove_image(&tag, Some(force), None).await;
}

/// A stop that comes while the warm pool is being filled: a container half-made when the
/// signal came must not outlive the server (it is finished, then removed).
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_while_the_pool_fills_leaves_nothing_behind() {
    for delay_ms in [0u64, 150, 300, 450] {
        let s = Server::start("pool-stop", &[("PYBERTH_POOL_SIZE", "2")]).await;
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        let pid = s.child.id().expect("pid");
        let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        let instance = s.instance.clone();
        s.stop().await;
        assert_cleaned_up(&instance).await;
    }
}

/// A test that fails before `stop` drops its server: the harness closes its stdin, as `stop`
/// does, so the server removes its containers, volumes and lock file itself. Killed, it would
/// leave all three (a stale lock in the tests' state dir) until some later sweep.
#[tokio::test(flavor = "multi_thread")]
async fn a_server_a_test_drops_is_stopped_not_killed() {
    let s = Server::start("dropped", &[]).await;
    s.ok("a", "1").await;
    let instance = s.instance.clone();
    drop(s);
    let lock = crate::common::state_dir().join(format!("{instance}.lock"));
    assert!(!lock.exists(), "its lock file was left: {}", lock.display());
    assert_cleaned_up(&instance).await;
}

/// A server's log in a file or a CI log is plain text, and a clean stop says nothing alarming
/// about the removals it does itself (no 409 "removal already in progress" warnings).
#[tokio::test(flavor = "multi_thread")]
async fn the_log_is_plain_text_and_a_clean_stop_warns_of_nothing() {
    let s = Server::start("quiet-stop", &[("PYBERTH_POOL_SIZE", "2")]).await;
    for name in ["a", "b", "c"] {
        s.ok(name, "print('\\x1b[31mred from the code\\x1b[0m')").await;
    }
    let log = s.stop().await;
    assert!(!log.contains('\u{1b}'), "no ANSI colour when stderr is not a terminal");
    let warned: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ") || l.contains(" ERROR ")).collect();
    assert!(warned.iter().all(|l| !l.contains("409") && !l.contains("already in progress")), "{warned:#?}");
}

/// `pyberth serve` started by hand at a terminal says in one line what it is for, and ends
/// cleanly when input ends before any client spoke (Ctrl-D).
#[tokio::test(flavor = "multi_thread")]
async fn serve_at_a_terminal_says_what_it_is_and_ends_cleanly_on_eof() {
    let instance = instance_name("tty");
    // `script` gives the server a terminal as stdin; its own stdin (empty) ends the session.
    let cmd = format!("{} serve", env!("CARGO_BIN_EXE_pyberth"));
    let out = tokio::process::Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .env("PYBERTH_INSTANCE", &instance)
        .env("PYBERTH_STATE_DIR", crate::common::state_dir())
        .env("PYBERTH_POOL_SIZE", "0")
        .stdin(std::process::Stdio::null())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out).await.expect("ends").expect("script");
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(all.contains("speaks MCP on stdin and stdout"), "{all}");
    assert!(out.status.success(), "a clean exit on EOF: {:?} {all}", out.status);
    assert!(!all.contains("ERROR"), "{all}");
    assert_cleaned_up(&instance).await;
}
