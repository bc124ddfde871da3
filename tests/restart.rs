//! The Docker daemon restarted mid-run (issue 8 §2): the run in flight and calls made while
//! the engine is away fail fast with a clear error, nothing hangs, and once the engine is
//! back the server carries on by itself, telling the session its state is gone.
//!
//! Restarting the daemon stops every container on it (without live-restore), so this test
//! lives in its own binary (cargo runs test binaries one after another, never beside the
//! integration suite) and only runs when `PYBERTH_TEST_RESTART_DOCKERD=1` says the engine may
//! be restarted: `.ci/run` sets it; on a workstation it is your choice.
#![allow(unreachable_pub)] // a test crate: its helpers are shared between its modules

#[allow(dead_code)] // the shared harness; this binary uses part of it
#[path = "integration/common.rs"]
mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;

use common::{Server, assert_cleaned_up, text};

const OPT_IN: &str = "PYBERTH_TEST_RESTART_DOCKERD";

/// The running dockerd: its pid and command line.
fn dockerd() -> Option<(u32, Vec<String>)> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        if std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "dockerd") {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args =
                raw.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned());
            return Some((pid, args.collect()));
        }
    }
    None
}

/// Starts dockerd detached from this process (its own session), so it outlives the test.
fn start_dockerd(cmdline: &[String]) {
    let log = std::env::temp_dir().join("pyberth-test-dockerd.log");
    let out = std::fs::OpenOptions::new().create(true).append(true).open(&log).expect("dockerd log");
    let err = out.try_clone().expect("dockerd log");
    let status = std::process::Command::new("setsid")
        .arg("-f")
        .args(cmdline)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .status()
        .expect("run setsid");
    assert!(status.success(), "cannot start dockerd again: {status}; see {}", log.display());
}

fn engine_answers() -> bool {
    std::process::Command::new("docker")
        .arg("info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn wait_for_engine(up: bool, within: Duration) {
    let deadline = Instant::now() + within;
    while engine_answers() != up {
        assert!(
            Instant::now() < deadline,
            "the engine did not come {} within {within:?}",
            if up { "up" } else { "down" }
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Brings dockerd back however the test ends, so a failure here cannot take the engine away
/// from whatever runs next: waits for the old daemon (pid) to finish stopping, then starts it.
struct Restore(u32, Vec<String>);

impl Drop for Restore {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::path::Path::new(&format!("/proc/{}", self.0)).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
        if dockerd().is_none() {
            start_dockerd(&self.1);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while !engine_answers() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_restart_mid_run_fails_fast_and_the_server_recovers_by_itself() {
    if std::env::var(OPT_IN).as_deref() != Ok("1") {
        // Straight to fd 2, past libtest's capture (which hooks only the print macros): a
        // skip must be seen, not pass as "ok".
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED a_daemon_restart_mid_run…: set {OPT_IN}=1 to let it restart the Docker daemon (it stops every container)"
        );
        return;
    }
    let (pid, cmdline) = dockerd().expect("a dockerd process on this machine (the test restarts it)");
    let s = Server::start("daemon-restart", &[]).await;
    s.ok("r", "x = 1").await;

    let restore = Restore(pid, cmdline.clone());
    let in_flight = s.run_with(json!({ "session": "r", "code": "import time\ntime.sleep(120)", "timeout_s": 300 }));
    let stop = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let t = Instant::now();
        let killed = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().expect("kill");
        assert!(killed.success());
        t
    };
    let ((r, sc), stopped_at) = tokio::join!(in_flight, stop);
    // dockerd's own shutdown stops containers (up to 10 s each, in parallel); the run must end
    // with it, not at its 300 s limit.
    assert!(stopped_at.elapsed() < Duration::from_secs(45), "the run in flight hung for {:?}", stopped_at.elapsed());
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    assert_eq!(sc["state_lost"], true, "{sc}");
    assert!(text(&r).contains("Docker engine is not answering"), "{}", text(&r));
    tokio::task::spawn_blocking(|| wait_for_engine(false, Duration::from_secs(60))).await.expect("wait");
    while dockerd().is_some_and(|(p, _)| p == pid) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // While the engine is away: fast, clear errors, for an old and a new session alike.
    for session in ["r", "new"] {
        let t = Instant::now();
        let (r, _) = s.run(session, "1").await;
        assert!(t.elapsed() < Duration::from_secs(10), "{session}: took {:?} with the engine away", t.elapsed());
        assert_eq!(r.is_error, Some(true), "{session}: {}", text(&r));
        assert!(text(&r).contains("Docker engine is not answering"), "{session}: {}", text(&r));
    }

    start_dockerd(&cmdline);
    tokio::task::spawn_blocking(|| wait_for_engine(true, Duration::from_secs(60))).await.expect("wait");
    drop(restore);

    // Back: the server reconnects on its own; the old session gets a new container and is told.
    let (r, sc) = s.run("r", "x").await;
    let told = format!("{} {}", text(&r), sc["notices"]);
    assert!(told.contains("replaced") || told.contains("gone"), "{told}");
    let (_, sc) = s.run("r", "x").await;
    assert_eq!(sc["error"]["type"], "NameError", "a fresh interpreter: {sc}");
    assert_eq!(s.ok("r", "6 * 7").await["result"], "42");
    assert_eq!(s.ok("new", "1 + 1").await["result"], "2");
    let instance = s.instance.clone();
    s.stop().await;
    assert_cleaned_up(&instance).await;
}
