//! Liveness across instances (issue 14, finding 7): a server must never take another live
//! server's sessions for leftovers, whatever state dir either one uses, and a dead server's
//! leftovers must still go, whatever state dir the next server uses (docs/design.md D9).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bollard::models::VolumeCreateRequest;
use bollard::query_parameters::{ListContainersOptionsBuilder, ListVolumesOptionsBuilder, RemoveVolumeOptionsBuilder};

use crate::common::{Server, assert_cleaned_up, containers_of, docker, instance_name, text, volumes_of};

/// A state dir of its own (created 0700 by the server), removed when dropped.
struct StateDir(std::path::PathBuf);

impl StateDir {
    fn new(tag: &str) -> Self {
        Self(std::env::temp_dir().join(format!("pyberth-tests-{tag}-{}", instance_name("dir"))))
    }

    fn env(&self) -> (&'static str, &str) {
        ("PYBERTH_STATE_DIR", self.0.to_str().expect("a UTF-8 temp dir"))
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Heartbeat containers of an instance, running or not.
async fn heartbeats_of(instance: &str) -> Vec<bollard::models::ContainerSummary> {
    let label = format!("pyberth.heartbeat={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    docker().await.list_containers(Some(opts)).await.expect("list containers")
}

/// Waits until the instance has a running heartbeat (`running`), or none that runs (a stopped
/// heartbeat is removed by the engine a moment later), or fails the test.
async fn wait_for_heartbeat(instance: &str, running: bool) {
    let is_running =
        |c: &bollard::models::ContainerSummary| c.state.as_ref().is_some_and(|s| s.to_string() == "running");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let beats = heartbeats_of(instance).await;
        if beats.iter().any(is_running) == running {
            return;
        }
        assert!(Instant::now() < deadline, "{instance} has no heartbeat with running={running}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The volumes of an instance's heartbeat: that it had one, and since when it stopped.
async fn heartbeat_volumes_of(instance: &str) -> Vec<String> {
    let label = format!("pyberth.heartbeat={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let list = docker().await.list_volumes(Some(opts)).await.expect("list volumes");
    list.volumes.unwrap_or_default().into_iter().map(|v| v.name).collect()
}

/// The host id a server on this machine labels its resources with (instance.rs `host_id`).
fn host_id() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_owned()).unwrap_or_default();
    let host = read("/proc/sys/kernel/hostname");
    let boot = read("/proc/sys/kernel/random/boot_id");
    let boot = boot.get(..8).unwrap_or(&boot);
    let id: String = format!("{host}-{boot}")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' })
        .collect();
    id.chars().take(63).collect()
}

fn ids(list: &[bollard::models::ContainerSummary]) -> Vec<String> {
    let mut ids: Vec<String> = list.iter().filter_map(|c| c.id.clone()).collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread")]
async fn a_server_with_another_state_dir_leaves_a_live_servers_sessions_alone() {
    // A keeps the shared test state dir; B has its own, so it cannot see A's lock file.
    let a = Server::start("live-a", &[]).await;
    a.ok("kept", "x = 41").await;
    let before = ids(&containers_of(&a.instance).await);
    assert_eq!(before.len(), 1);
    let volumes = volumes_of(&a.instance).await;

    let y = StateDir::new("other");
    let b = Server::start("other-dir", &[y.env()]).await;
    b.ok("b", "1").await; // B's sweep ran before it served

    let (r, sc) = a.run("kept", "x + 1").await;
    assert_eq!(r.is_error, Some(false), "A's session was swept by B: {}", text(&r));
    assert_eq!(sc["result"], "42", "A's interpreter state survived B's start");
    assert_eq!(ids(&containers_of(&a.instance).await), before, "A's container is the same one");
    let mut after = volumes_of(&a.instance).await;
    after.sort();
    let mut volumes = volumes;
    volumes.sort();
    assert_eq!(after, volumes, "A's volumes are untouched");
    let a_instance = a.instance.clone();
    let b_instance = b.instance.clone();
    a.stop().await;
    b.stop().await;
    assert_cleaned_up(&a_instance).await;
    assert_cleaned_up(&b_instance).await;
    assert!(heartbeats_of(&a_instance).await.is_empty(), "A's heartbeat is removed at shutdown");
    assert!(heartbeats_of(&b_instance).await.is_empty(), "B's heartbeat is removed at shutdown");
    assert!(heartbeat_volumes_of(&a_instance).await.is_empty(), "and its volumes");
    assert!(heartbeat_volumes_of(&b_instance).await.is_empty(), "and its volumes");
}

#[tokio::test(flavor = "multi_thread")]
async fn resources_of_an_instance_with_no_lock_and_no_heartbeat_are_left_alone() {
    // An instance of this host whose lock file is nowhere we can see and that has no
    // heartbeat: it may well be alive (another state dir, an older pyberth). Unknown is not dead.
    let ghost = instance_name("ghost");
    let name = format!("pyberth-{ghost}-vol");
    let labels = HashMap::from([
        ("pyberth.managed".to_owned(), "1".to_owned()),
        ("pyberth.instance".to_owned(), ghost.clone()),
        ("pyberth.host".to_owned(), host_id()),
        ("pyberth.session".to_owned(), "s".to_owned()),
    ]);
    let request = VolumeCreateRequest { name: Some(name.clone()), labels: Some(labels), ..Default::default() };
    docker().await.create_volume(request).await.expect("create volume");

    let s = Server::start("ghost-sweeper", &[]).await;
    s.ok("x", "1").await; // the sweep ran before serving
    let kept = volumes_of(&ghost).await;
    let opts = RemoveVolumeOptionsBuilder::default().force(true).build();
    let _ = docker().await.remove_volume(&name, Some(opts)).await;
    s.stop().await;
    assert_eq!(kept, [name], "an instance of unknown liveness was swept");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_servers_leftovers_are_swept_from_another_state_dir() {
    // K dies by SIGKILL; its lock is in a state dir N cannot see, so only K's heartbeat,
    // stopped (and removed by the engine) since K died, can tell N that K is dead: it had
    // one (its volume says so) and none runs now.
    let (z, w) = (StateDir::new("killed"), StateDir::new("next"));
    let dead = instance_name("killed-elsewhere");
    let mut k = Server::start_as(&dead, &[z.env()]).await;
    k.ok("a", "1").await;
    wait_for_heartbeat(&dead, true).await;
    k.child.kill().await.expect("SIGKILL");
    // The engine stops the heartbeat once K's connection is gone, and removes it.
    wait_for_heartbeat(&dead, false).await;
    assert!(!heartbeat_volumes_of(&dead).await.is_empty(), "K's volume says it had a heartbeat");
    assert_eq!(containers_of(&dead).await.len(), 1, "a SIGKILLed server cannot clean up");
    // K's session still runs: an orphan yet to save itself (after K's --adopt-grace-s, 600 s),
    // holding its state for the next server of K's state dir. A server of another state dir,
    // past its leftover grace, keeps it for its --idle-ttl-s (a day by default) from K's death
    // (until 2026-11-26 it was removed here, before it could save itself).
    let keeper = StateDir::new("keeper");
    let m = Server::start("keeper-elsewhere", &[keeper.env(), ("PYBERTH_LEFTOVER_GRACE_S", "2")]).await;
    m.ok("x", "1").await;
    // Past its grace and the sweep it makes again then (the stop is dated at its first look).
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(containers_of(&dead).await.len(), 1, "a killed server's running session was removed by another");
    assert!(!volumes_of(&dead).await.is_empty(), "and its state with it");
    m.stop().await;
    // With an --idle-ttl-s of 2 s, the next server removes it.
    let n =
        Server::start("next-elsewhere", &[w.env(), ("PYBERTH_LEFTOVER_GRACE_S", "2"), ("PYBERTH_IDLE_TTL", "2")]).await;
    n.ok("x", "1").await;
    assert_cleaned_up(&dead).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !heartbeats_of(&dead).await.is_empty() || !heartbeat_volumes_of(&dead).await.is_empty() {
        assert!(Instant::now() < deadline, "the dead server's heartbeat or its volumes were left behind");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    n.stop().await;
}
