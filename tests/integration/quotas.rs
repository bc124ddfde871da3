//! Quotas per principal (issue 32): past one, a clear tool error naming the quota, the use,
//! the limit and the UTC day boundary, while another principal runs on; the counts survive a
//! restart.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::text;
use crate::http::{ALICE, BOB, HttpServer, call};

const CONFIG: &str = "[principals.alice]\nrun_seconds_per_day = 2\nsnapshot_mb = 1\n\
                      [principals.bob]\nsessions = 1\ncpu_seconds_per_day = 1\n";

/// 2 MiB in the workspace (over alice's snapshot_mb), then past her run-seconds mid-run.
const BIG_THEN_SLEEP: &str = "import os, time\nopen('big', 'wb').write(os.urandom(2 << 20))\ntime.sleep(2.5)\n'done'";

#[tokio::test(flavor = "multi_thread")]
async fn a_principal_over_its_quota_is_refused_while_another_runs_on_and_a_restart_keeps_the_count() {
    // A state dir of its own: the counts of alice and bob are this test's alone.
    let dir = std::env::temp_dir().join(format!("pyberth-quotas-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).expect("private");
    let config = dir.join("pyberth.toml");
    std::fs::write(&config, CONFIG).expect("config");
    let state = dir.join("state");
    let env =
        [("PYBERTH_CONFIG", config.to_str().expect("utf-8")), ("PYBERTH_STATE_DIR", state.to_str().expect("utf-8"))];
    let s = HttpServer::start_with("quotas", &env, None).await;
    let (alice, bob) = (s.client(ALICE).await, s.client(BOB).await);

    // A run that crosses the quota mid-run finishes; the next is refused.
    let (r, sc) = call(&alice, "run_python", json!({ "session": "a", "code": BIG_THEN_SLEEP })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["status"], "ok", "{sc}");
    let (r, _) = call(&alice, "run_python", json!({ "session": "a", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true), "past the quota: {}", text(&r));
    let e = text(&r);
    assert!(e.contains("quota exceeded: run_seconds_per_day"), "which quota: {e}");
    assert!(e.contains("run-seconds of 2"), "the use and the limit: {e}");
    assert!(e.contains("UTC day boundary"), "when it renews: {e}");

    // A snapshot past snapshot_mb is refused, saying so (a snapshot is not a run).
    let r = call(&alice, "snapshot_session", json!({ "session": "a", "name": "big" })).await.0;
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    assert!(text(&r).contains("quota exceeded: snapshot_mb"), "{}", text(&r));

    // Bob runs on, within his own quotas.
    let (r, _) = call(&bob, "run_python", json!({ "session": "b", "code": "2 + 2" })).await;
    assert_eq!(r.is_error, Some(false), "another principal runs on: {}", text(&r));
    let (r, _) = call(&bob, "run_python", json!({ "session": "b2", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true), "a second session past sessions = 1: {}", text(&r));
    assert!(text(&r).contains("quota exceeded: sessions (1 open of 1)"), "{}", text(&r));

    // CPU-seconds come from the container's cgroup, sampled after the run: busy work of 1.5 s
    // is refused within a few seconds; sleeping for long is not CPU.
    let spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5:\n    pass";
    let (r, _) = call(&bob, "run_python", json!({ "session": "b", "code": spin })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let deadline = Instant::now() + Duration::from_secs(20);
    let refused = loop {
        let (r, _) = call(&bob, "run_python", json!({ "session": "b", "code": "1" })).await;
        if r.is_error == Some(true) {
            break text(&r);
        }
        assert!(Instant::now() < deadline, "bob's CPU was never charged");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(refused.contains("quota exceeded: cpu_seconds_per_day"), "{refused}");

    // Metrics show use against quota for the principals the configuration names.
    let scraped = crate::common::scrape(&s.url("/metrics"), Some(ALICE)).await;
    let gauge = |name: &str, who: &str, quota: &str| -> f64 {
        let head = format!("pyberth_{name}{{principal=\"{who}\",quota=\"{quota}\"}} ");
        let line = scraped.lines().find_map(|l| l.strip_prefix(&head));
        line.and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("no {head}in:\n{scraped}"))
    };
    assert_eq!(gauge("quota_limit", "alice", "run_seconds"), 2.0);
    assert!(gauge("quota_used", "alice", "run_seconds") >= 2.0, "alice's run crossed her quota");
    assert_eq!(gauge("quota_limit", "bob", "sessions"), 1.0);
    assert_eq!(gauge("quota_used", "bob", "sessions"), 1.0, "bob has one session open");
    assert!(gauge("quota_used", "bob", "cpu_seconds") >= 1.0, "bob's spin was charged");
    drop((alice, bob));
    s.stop().await;

    let saved = std::fs::metadata(state.join("quotas.json")).expect("the counts are saved in the state dir");
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&saved.permissions()) & 0o777, 0o600, "private");

    // The counts survive a restart.
    let s = HttpServer::start_with("quotas-again", &env, None).await;
    let (alice, bob) = (s.client(ALICE).await, s.client(BOB).await);
    let (r, _) = call(&alice, "run_python", json!({ "session": "a", "code": "1" })).await;
    assert!(text(&r).contains("quota exceeded: run_seconds_per_day"), "after a restart: {}", text(&r));
    let (r, _) = call(&bob, "run_python", json!({ "session": "b", "code": "1" })).await;
    assert!(text(&r).contains("quota exceeded: cpu_seconds_per_day"), "after a restart: {}", text(&r));
    drop((alice, bob));
    s.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
