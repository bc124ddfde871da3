//! Snapshots and hibernation on Kubernetes: volumes on the server's shelf (`k8s_snapshot_dir`,
//! by default in its state dir; on a cluster a volume claim), written and read through the
//! agent's stream; no helper pod.

use std::time::{Duration, Instant};

use serde_json::json;

use super::apiserver::{Options, Sim};
use super::docker;
use super::serve::{Served, node_containers, pods};

/// Snapshots go to the server's shelf (`k8s_snapshot_dir`), through the agent's stream: a
/// snapshot restored into a new session (a new pod), a fork, and an idle session hibernated
/// (its pod deleted) and woken by its next call in a new pod, its state back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_hibernation_go_to_the_shelf() {
    durable_life(Options::default(), "durable", "").await;
}

/// The same life in agent-sandbox mode: each restore, fork and wake is a new claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_hibernation_of_claimed_sessions() {
    let opts = Options { controller: true, ..Default::default() };
    durable_life(opts, "durable-sb", "k8s_mode = \"agent-sandbox\"\n").await;
}

async fn durable_life(opts: Options, tag: &str, extra: &str) {
    let sim = Sim::start(opts, docker()).await;
    let s = Served::start_cfg(&sim, tag, 0, &format!("{extra}hibernate_after_s = 3\n")).await;
    let (s, sim) = (&s, &sim);
    s.ok("run_python", json!({ "session": "k", "code": "x = 41" })).await;
    let before = pods(sim);
    s.ok("write_file", json!({ "session": "k", "path": "notes/a.txt", "content": "over the wire\n" })).await;
    s.ok("run_python", json!({ "session": "k", "code": "snap_me = [1, 2, 3]" })).await;
    let sc = s.ok("snapshot_session", json!({ "session": "k", "name": "first" })).await;
    assert_eq!(sc["grade"], "files+globals", "{sc}");
    let shelf = s.dir.join("state/k8s-snapshots");
    let kept = std::fs::read_dir(&shelf).map(|d| d.count()).unwrap_or(0);
    assert_eq!(kept, 1, "one volume on the shelf at {}", shelf.display());
    s.ok("restore_session", json!({ "snapshot": "first", "session": "r" })).await;
    let sc = s
        .ok("run_python", json!({ "session": "r", "code": "print(snap_me, open('notes/a.txt').read(), end='')" }))
        .await;
    assert_eq!(sc["stdout"], "[1, 2, 3] over the wire\n", "{sc}");
    s.ok("fork_session", json!({ "session": "k", "new_session": "f" })).await;
    let sc = s.ok("run_python", json!({ "session": "f", "code": "print(x + 1)" })).await;
    assert_eq!(sc["stdout"], "42\n", "{sc}");
    for gone in ["r", "f"] {
        s.ok("close_session", json!({ "session": gone })).await;
    }
    s.ok("delete_snapshot", json!({ "snapshot": "first" })).await;
    // Idle past hibernate_after_s (3 s): snapshotted, its pod deleted; woken in a new pod. (It
    // may have slept already, between the calls above, on a loaded machine.)
    let deadline = Instant::now() + Duration::from_secs(60);
    while !s.whole_log().contains("session hibernated session=k") || !pods(sim).is_empty() {
        assert!(Instant::now() < deadline, "not hibernated: {:?}\n{}", pods(sim), s.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(pods(sim).is_empty(), "the hibernated session has no pod: {:?}", pods(sim));
    let sc = s.ok("run_python", json!({ "session": "k", "code": "print(x, snap_me)" })).await;
    assert_eq!(sc["stdout"], "41 [1, 2, 3]\n", "woken with its state: {sc}");
    assert_eq!(pods(sim).len(), 1);
    assert_ne!(pods(sim), before, "in a new pod");
    s.ok("close_session", json!({ "session": "k" })).await;
    let shelf = s.dir.join("state/k8s-snapshots");
    let left = std::fs::read_dir(&shelf).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "the wake's snapshot and the deleted one are gone from the shelf");
    assert!(pods(sim).is_empty());
    assert_eq!(node_containers(sim).await, 0);
    let claims = sim.state.objects.lock().expect("objects").keys().filter(|(p, _)| p == "sandboxclaims").count();
    assert_eq!(claims, 0, "no claim left");
}

/// A hibernated session is its snapshot on the shelf and its record in the state dir: the
/// next server of that state dir adopts it asleep and wakes it at its first call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hibernated_session_wakes_after_a_restart() {
    let sim = Sim::start(Options::default(), docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-sleep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let extra = "keep_sessions = true\nhibernate_after_s = 2\n";
    let first = Served::start_in(&sim, &dir, "sleep-a", 0, extra).await;
    first.ok("run_python", json!({ "session": "k", "code": "x = 7" })).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pods(&sim).is_empty() {
        assert!(Instant::now() < deadline, "not hibernated: {:?}\n{}", pods(&sim), first.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    first.stop().await;
    let shelf = dir.join("state/k8s-snapshots");
    assert_eq!(std::fs::read_dir(&shelf).map(|d| d.count()).unwrap_or(0), 1, "its snapshot stays on the shelf");

    let second = Served::start_in(&sim, &dir, "sleep-b", 0, extra).await;
    let sc = second.ok("run_python", json!({ "session": "k", "code": "print(x)" })).await;
    assert_eq!(sc["stdout"], "7\n", "woken with its state by the next server: {sc}\n{}", second.log());
    second.ok("close_session", json!({ "session": "k" })).await;
    assert_eq!(std::fs::read_dir(&shelf).map(|d| d.count()).unwrap_or(0), 0, "{}", second.log());
    second.stop().await;
    assert!(pods(&sim).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}

/// The server's peak resident memory (`VmHWM`), KiB.
fn peak_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM");
    line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("KiB")
}

/// Attack view: a session's code makes its snapshot as big as `--snapshot-cache-mb` lets it,
/// and every session of every tenant may do so at once. The shelf takes the snapshot as it
/// streams, and gives it back the same way: the server never holds a whole one in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_snapshot_never_sits_whole_in_the_servers_memory() {
    const MIB: u64 = 192;
    let sim = Sim::start(Options::default(), docker()).await;
    let s = Served::start_cfg(&sim, "bigsnap", 0, "memory_mb = 1024\n").await;
    let code =
        format!("with open('big', 'wb') as f:\n    for i in range({MIB}):\n        f.write(bytes([i % 251]) * 2**20)");
    s.ok("run_python", json!({ "session": "k", "code": code })).await;
    let pid = s.child.id().expect("pid");
    let before = peak_kib(pid);
    s.ok("snapshot_session", json!({ "session": "k", "name": "big" })).await;
    let saved = peak_kib(pid);
    s.ok("restore_session", json!({ "snapshot": "big", "session": "r" })).await;
    let sc =
        s.ok("run_python", json!({ "session": "r", "code": "import os\nprint(os.path.getsize('big') >> 20)" })).await;
    assert_eq!(sc["stdout"], format!("{MIB}\n"), "{sc}");
    let restored = peak_kib(pid);
    let (save, restore) = ((saved - before) >> 10, (restored - before) >> 10);
    assert!(save < MIB / 2 && restore < MIB / 2, "peak grew by {save} MiB saving, {restore} MiB restoring {MIB} MiB");
    for gone in ["k", "r"] {
        s.ok("close_session", json!({ "session": gone })).await;
    }
    s.ok("delete_snapshot", json!({ "snapshot": "big" })).await;
    s.stop().await;
    sim.stop().await;
}
