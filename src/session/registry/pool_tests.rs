//! The warm pools as an owner, through the in-process fake engine (`owner_tests.rs`'s bench):
//! refilled, grown by a burst, one per environment in use, within the memory budget, and
//! never anything of ours left after a stop.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Registry;
use super::owner_tests::{Bench, hibernate, run};

/// Waits (bounded) until `done` holds of the registry.
async fn until(reg: &Arc<Registry>, what: &str, done: impl Fn(&Registry) -> bool) {
    let wait = async {
        while !done(reg) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait).await.unwrap_or_else(|_| panic!("{what}"));
}

/// The image the container `id` runs.
fn image_of(b: &Bench, id: &str) -> String {
    b.fake.world().containers.get(id).map(|c| c.image.clone()).unwrap_or_default()
}

/// The images of the pooled containers ready now (a session's container taken from the
/// pool keeps its `pool-` label, so the registry says which are ready).
fn pooled_images(b: &Bench) -> Vec<String> {
    let ids: Vec<String> = {
        let pools = b.reg.pools();
        pools.each().flat_map(|(_, p)| p.ready.iter().map(|r| r.container_id().to_owned())).collect()
    };
    let mut images: Vec<String> = ids.iter().map(|id| image_of(b, id)).collect();
    images.sort();
    images
}

#[tokio::test]
async fn the_warm_pool_hands_out_a_ready_container_and_a_stop_leaves_nothing_of_ours() {
    let b = Bench::new(&["--pool-size", "1"]);
    let stop = CancellationToken::new();
    let keeper = tokio::spawn(b.reg.clone().pool_keeper(stop.clone()));
    // The keeper fills the pool in the background: wait (bounded) for its container.
    let pooled = async {
        loop {
            if let Some(p) = b.containers_of("", "pool-1").first() {
                return p.clone();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let pooled = tokio::time::timeout(Duration::from_secs(10), pooled).await.expect("the pool filled");
    let (s, created) = b.open("alice", "warm").await.expect("opened");
    assert!(created);
    assert_eq!(s.container_id(), pooled, "the session took the pooled container");
    stop.cancel();
    keeper.await.expect("the keeper stopped");
    b.reg.shutdown(false).await;
    assert_eq!(b.ours(), Vec::<String>::new(), "a clean stop removes every container and volume of ours");
    assert!(b.reg.ledger.running().is_empty());
}

#[tokio::test]
async fn a_burst_of_new_sessions_grows_the_pool_to_its_max_and_a_stop_leaves_nothing() {
    let b = Bench::new(&["--pool-size", "1", "--pool-max", "4"]);
    let stop = CancellationToken::new();
    let keeper = tokio::spawn(b.reg.clone().pool_keeper(stop.clone()));
    let reg = b.reg.clone();
    let holds = |n: usize| {
        let reg = reg.clone();
        async move {
            loop {
                if reg.pool_len() == n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), holds(1)).await.expect("the pool filled to its floor");
    // Six new sessions at once: more than --pool-max asked for within one interval.
    let names: Vec<String> = (0..6).map(|i| format!("burst{i}")).collect();
    let opened = futures::future::join_all(names.iter().map(|n| b.open("alice", n))).await;
    let mut ids: Vec<String> = opened.into_iter().map(|o| o.expect("opened").0.container_id()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 6, "each session has a container of its own");
    tokio::time::timeout(Duration::from_secs(10), holds(4)).await.expect("the pool grew to --pool-max");
    stop.cancel();
    keeper.await.expect("the keeper stopped");
    assert_eq!(b.reg.pool_len(), 0, "a stopped keeper leaves no pooled container");
    b.reg.shutdown(false).await;
    assert_eq!(b.ours(), Vec::<String>::new(), "a clean stop removes every container and volume of ours");
}

#[tokio::test]
async fn sessions_of_another_environment_get_a_pool_of_their_own_and_the_defaults_keeps_its_floor() {
    let b = Bench::new(&["--pool-size", "1", "--pool-max", "8"]);
    let stop = CancellationToken::new();
    let keeper = tokio::spawn(b.reg.clone().pool_keeper(stop.clone()));
    until(&b.reg, "the default pool filled", |r| r.pool_len() == 1).await;
    let default_image = pooled_images(&b).pop().expect("one pooled");
    // Four sessions of python3.13 at once: its pool learns them.
    let names: Vec<String> = (0..4).map(|i| format!("p13-{i}")).collect();
    let opened = futures::future::join_all(names.iter().map(|n| b.open_in("alice", n, Some("python3.13")))).await;
    let first = opened.into_iter().next().expect("four").expect("opened").0;
    let image13 = image_of(&b, &first.container_id());
    assert_ne!(image13, default_image, "python3.13 runs an image of its own");
    until(&b.reg, "python3.13's pool grew", |r| r.pool_len() == 5).await;
    let mut want = vec![default_image.clone(), image13.clone(), image13.clone(), image13.clone(), image13.clone()];
    want.sort();
    assert_eq!(pooled_images(&b), want, "the default's floor beside python3.13's four");
    // The next python3.13 session takes one of its pool, not the default's.
    let (s, _) = b.open_in("bob", "p13-next", Some("python3.13")).await.expect("opened");
    assert_eq!(image_of(&b, &s.container_id()), image13);
    assert!(pooled_images(&b).contains(&default_image), "the default's pooled container stays");
    stop.cancel();
    keeper.await.expect("the keeper stopped");
    b.reg.shutdown(false).await;
    assert_eq!(b.ours(), Vec::<String>::new(), "a clean stop removes every container and volume of ours");
}

#[tokio::test]
async fn a_hibernated_session_wakes_into_a_container_of_its_own_environment() {
    let b = Bench::new(&["--pool-size", "2"]);
    let stop = CancellationToken::new();
    let keeper = tokio::spawn(b.reg.clone().pool_keeper(stop.clone()));
    until(&b.reg, "the default pool filled", |r| r.pool_len() == 2).await;
    let (s, _) = b.open_in("alice", "sleepy13", Some("python3.13")).await.expect("opened");
    let image13 = image_of(&b, &s.container_id());
    run(&s, "x = 13").await;
    hibernate(&b, &s).await;
    // Only the default's containers are ready (its own pool learnt one session, and its
    // container may be coming): whichever it wakes into runs python3.13.
    let out = run(&s, "x").await;
    assert_eq!(out.result.as_deref(), Some("13"));
    assert_eq!(image_of(&b, &s.container_id()), image13, "never a container of another environment");
    stop.cancel();
    keeper.await.expect("the keeper stopped");
    b.reg.shutdown(false).await;
    assert_eq!(b.ours(), Vec::<String>::new());
}

#[tokio::test]
async fn the_pools_hold_no_more_than_their_memory_budget_at_the_measured_cost() {
    const MIB: u64 = 1 << 20;
    let b = Bench::new(&["--pool-size", "1", "--pool-max", "20", "--pool-memory-mb", "64"]);
    b.fake.world().idle_bytes = Some(10 * MIB);
    let stop = CancellationToken::new();
    let keeper = tokio::spawn(b.reg.clone().pool_keeper(stop.clone()));
    until(&b.reg, "the pool filled and its container measured", |r| r.pool_bytes() == 10 * MIB).await;
    // A burst of twelve asks for twelve; 64 MiB hold six of 10 MiB.
    let names: Vec<String> = (0..12).map(|i| format!("b{i}")).collect();
    for o in futures::future::join_all(names.iter().map(|n| b.open("alice", n))).await {
        o.expect("opened");
    }
    until(&b.reg, "the pool grew to its budget", |r| r.pool_len() == 6).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(b.reg.pool_len(), 6, "never past the budget");
    assert_eq!(b.reg.pool_target(), 6);
    let text = b.reg.metrics_text();
    assert!(text.lines().any(|l| l == format!("pyberth_pool_memory_bytes {}", 60 * MIB)), "{text}");
    stop.cancel();
    keeper.await.expect("the keeper stopped");
    b.reg.shutdown(false).await;
    assert_eq!(b.ours(), Vec::<String>::new());
}
