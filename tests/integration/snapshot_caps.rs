//! Per-caller snapshot caps (issue 26, "caps that leak around the side"): one caller cannot
//! fill the engine with snapshot volumes, its hibernated sessions count, and the refusal says
//! which cap and what to delete. And a restored or forked workspace is charged to its session.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bollard::query_parameters::ListVolumesOptionsBuilder;
use serde_json::json;

use crate::common::{Server, containers_of, docker, text};

/// Snapshot volumes of an instance.
async fn snapshot_volumes(instance: &str) -> usize {
    let label = format!("pyberth.instance={instance}");
    let filters = HashMap::from([("label", vec![label.as_str(), "pyberth.snapshot"])]);
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let list = docker().await.list_volumes(Some(opts)).await.expect("list volumes");
    list.volumes.unwrap_or_default().len()
}

/// Containers of an instance that are not sessions (snapshot helpers, packers).
async fn helper_containers(instance: &str) -> usize {
    containers_of(instance)
        .await
        .into_iter()
        .filter(|c| c.labels.as_ref().is_none_or(|l| !l.contains_key("pyberth.session")))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn one_caller_making_many_snapshots_at_once_stays_within_its_cap() {
    let s = Server::start("snapcap-count", &[("PYBERTH_MAX_SNAPSHOTS_PER_CALLER", "10")]).await;
    s.ok("s", "open('a.txt', 'w').write('a' * 1000)").await;
    // Watches the engine while the calls run: never more volumes than the cap.
    let most = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (most, stop, instance) = (most.clone(), stop.clone(), s.instance.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                most.fetch_max(snapshot_volumes(&instance).await, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let started = Instant::now();
    let calls = (0..30).map(|i| s.call("snapshot_session", json!({"session": "s", "name": format!("n{i}")})));
    let results = futures::future::join_all(calls).await;
    stop.store(true, Ordering::SeqCst);
    watcher.await.expect("watcher");
    eprintln!("30 snapshot calls: {} ms", started.elapsed().as_millis());
    let ok = results.iter().filter(|r| r.is_error == Some(false)).count();
    assert_eq!(ok, 10, "exactly the cap's snapshots are made");
    for r in results.iter().filter(|r| r.is_error != Some(false)) {
        let t = text(r);
        assert!(t.contains("--max-snapshots-per-caller") && t.contains("delete_snapshot"), "{t}");
    }
    assert!(most.load(Ordering::SeqCst) <= 10, "the engine held {} snapshot volumes", most.load(Ordering::SeqCst));
    assert_eq!(snapshot_volumes(&s.instance).await, 10);
    assert_eq!(helper_containers(&s.instance).await, 0, "no container is kept per snapshot");
    // Deleting one makes room for one, and replacing a name needs none (a name that was
    // kept: which ten of the thirty calls made theirs is the race's to say).
    let kept = results.iter().position(|r| r.is_error == Some(false)).expect("a snapshot was made");
    let r = s.call("snapshot_session", json!({"session": "s", "name": format!("n{kept}")})).await;
    assert_eq!(r.is_error, Some(false), "a name kept is replaced: {}", text(&r));
    let listed = s.call("list_snapshots", json!({})).await;
    let sc = listed.structured_content.expect("structured");
    let first = sc["snapshots"][0]["snapshot"].as_str().expect("a name").to_owned();
    let r = s.call("delete_snapshot", json!({"snapshot": first})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("snapshot_session", json!({"session": "s", "name": "after"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(snapshot_volumes(&s.instance).await, 10);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn hibernated_sessions_count_against_the_callers_snapshot_caps() {
    let s = Server::start(
        "snapcap-sleep",
        &[("PYBERTH_MAX_SNAPSHOTS_PER_CALLER", "2"), ("PYBERTH_HIBERNATE_AFTER_S", "2"), ("PYBERTH_IDLE_TTL", "600")],
    )
    .await;
    s.ok("kept", "x = 1").await;
    let r = s.call("snapshot_session", json!({"session": "kept", "name": "one"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    s.ok("nap", "y = 2").await;
    // "kept" and "nap" go idle: one of them may hibernate (one snapshot + one sleeper = 2).
    let deadline = Instant::now() + Duration::from_secs(30);
    let sleeping = loop {
        let l = s.call("list_sessions", json!({})).await;
        let t = text(&l);
        let n = t.matches(": hibernated").count();
        if n >= 1 {
            // Give the reaper a few more rounds: the other must stay awake.
            tokio::time::sleep(Duration::from_secs(4)).await;
            break text(&s.call("list_sessions", json!({})).await).matches(": hibernated").count();
        }
        assert!(Instant::now() < deadline, "nothing hibernated: {t}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(sleeping, 1, "a second sleeper would pass the cap of 2");
    assert_eq!(snapshot_volumes(&s.instance).await, 2);
    let r = s.call("snapshot_session", json!({"session": "kept", "name": "two"})).await;
    assert_eq!(r.is_error, Some(true), "one snapshot and one sleeper fill a cap of 2");
    let t = text(&r);
    assert!(t.contains("hibernated sessions included") && t.contains("--max-snapshots-per-caller"), "{t}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_callers_bytes_cap_refuses_a_snapshot_and_keeps_the_others() {
    let s = Server::start("snapcap-bytes", &[("PYBERTH_SNAPSHOT_MB_PER_CALLER", "1")]).await;
    s.ok("s", "open('blob', 'wb').write(b'x' * 600_000)").await;
    let r = s.call("snapshot_session", json!({"session": "s", "name": "one"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("snapshot_session", json!({"session": "s", "name": "two"})).await;
    assert_eq!(r.is_error, Some(true), "two of 0.6 MiB pass 1 MiB");
    let t = text(&r);
    assert!(t.contains("--snapshot-mb-per-caller") && t.contains("delete_snapshot"), "{t}");
    assert_eq!(snapshot_volumes(&s.instance).await, 1, "the refused one left nothing, the kept one stays");
    s.stop().await;
}

/// Allocates (and touches) 420 MiB in one go: under a 512 MiB limit that already holds a
/// 200 MiB workspace, the kernel must kill it.
const HOG: &str = "b = b'\\x01' * (420 << 20)\nlen(b)";

#[tokio::test(flavor = "multi_thread")]
async fn a_restored_workspace_counts_against_the_sessions_memory() {
    let s = Server::start("snapcap-memory", &[("PYBERTH_MEMORY_MB", "512")]).await;
    // The writer itself pays for its 200 MiB: the same allocation is killed there (the
    // baseline the restored session must match).
    s.ok("src", "open('big.bin', 'wb').write(b'\\x02' * (200 << 20))").await;
    let r = s.call("snapshot_session", json!({"session": "src", "name": "big"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("close_session", json!({"session": "src"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let started = Instant::now();
    let r = s.call("restore_session", json!({"snapshot": "big", "session": "dst"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    eprintln!("restore of 200 MiB: {} ms", started.elapsed().as_millis());
    let (r, sc) = s.run_with(json!({"session": "dst", "code": HOG, "timeout_s": 60})).await;
    assert_eq!(sc["status"], "oom", "the restored 200 MiB are the session's own: {} {sc}", text(&r));
    // A fork's copy is the fork's too.
    s.ok("dst", "import os; assert os.path.getsize('big.bin') == 200 << 20").await;
    let r = s.call("fork_session", json!({"session": "dst", "new_session": "fork"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("close_session", json!({"session": "dst"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, sc) = s.run_with(json!({"session": "fork", "code": HOG, "timeout_s": 60})).await;
    assert_eq!(sc["status"], "oom", "the forked 200 MiB are the fork's own: {} {sc}", text(&r));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kept_snapshot_is_a_volume_and_no_container() {
    let s = Server::start("snapcap-nohelper", &[("PYBERTH_HIBERNATE_AFTER_S", "2"), ("PYBERTH_IDLE_TTL", "600")]).await;
    // One small (the agent's stream) and one large (the packer), then a sleeper.
    s.ok("small", "x = 1\nopen('a.txt', 'w').write('a')").await;
    s.ok("large", "y = 2\nopen('b.bin', 'wb').write(b'b' * (20 << 20))").await;
    for (session, name) in [("small", "s"), ("large", "l")] {
        let r = s.call("snapshot_session", json!({"session": session, "name": name})).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
    }
    let r = s.call("close_session", json!({"session": "large"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !text(&s.call("list_sessions", json!({})).await).contains("small: hibernated") {
        assert!(Instant::now() < deadline, "not hibernated");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(snapshot_volumes(&s.instance).await, 3, "two snapshots and a sleeper");
    assert_eq!(helper_containers(&s.instance).await, 0, "no container is kept for a snapshot");
    assert!(containers_of(&s.instance).await.is_empty(), "nothing runs: the only session sleeps");
    // Each still restores, and the sleeper wakes.
    for (snap, session, check) in [
        ("s", "rs", "assert x == 1 and open('a.txt').read() == 'a'"),
        ("l", "rl", "assert y == 2 and len(open('b.bin', 'rb').read()) == 20 << 20"),
    ] {
        let r = s.call("restore_session", json!({"snapshot": snap, "session": session})).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        s.ok(session, check).await;
    }
    s.ok("small", "assert x == 1").await;
    // Sessions idle for 2 s hibernate meanwhile, each through a short-lived helper: none stays.
    let deadline = Instant::now() + Duration::from_secs(30);
    while helper_containers(&s.instance).await != 0 {
        assert!(Instant::now() < deadline, "a helper container stayed after restores and a wake");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_woken_workspace_counts_against_the_sessions_memory() {
    let s = Server::start(
        "snapcap-wake",
        &[("PYBERTH_MEMORY_MB", "512"), ("PYBERTH_HIBERNATE_AFTER_S", "2"), ("PYBERTH_IDLE_TTL", "600")],
    )
    .await;
    s.ok("w", "open('big.bin', 'wb').write(b'\\x03' * (200 << 20))").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !text(&s.call("list_sessions", json!({})).await).contains("w: hibernated") {
        assert!(Instant::now() < deadline, "not hibernated");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The call wakes it (a new container, the files copied in), then allocates.
    let (r, sc) = s.run_with(json!({"session": "w", "code": HOG, "timeout_s": 60})).await;
    assert_eq!(sc["status"], "oom", "the woken 200 MiB are the session's own: {} {sc}", text(&r));
    s.stop().await;
}
