//! A close that comes while a session makes itself a new container (a wake, a replacement):
//! the close does not wait for the session, so it reads the container from before. Nothing
//! of the new one may stay on the engine.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::owner_tests::{Bench, hibernate, run};
use crate::session::{RunSpec, Session};

/// Runs `code` in `s` while its new container starts slowly, closes the session once that
/// start is under way, and returns what the run said.
async fn close_while_starting(b: &Bench, s: &std::sync::Arc<Session>, name: &str) -> String {
    close_while_starting_saw(b, s, name).await.0
}

/// As [`close_while_starting`], with what of ours was on the engine when the close returned.
async fn close_while_starting_saw(b: &Bench, s: &std::sync::Arc<Session>, name: &str) -> (String, Vec<String>) {
    b.fake.world().start_takes = Some(Duration::from_millis(300));
    let runner = s.clone();
    let call = tokio::spawn(async move {
        let spec = RunSpec { code: "1".into(), ..RunSpec::default() };
        runner.run(spec, Duration::from_secs(10), &CancellationToken::new(), &|_, _| {}).await
    });
    let mut waited = 0;
    while b.fake.world().starting == 0 {
        assert!(waited < 1000, "no container start was seen");
        tokio::time::sleep(Duration::from_millis(5)).await;
        waited += 1;
    }
    b.reg.close("alice", name).await.expect("closed");
    let at_close = b.ours();
    let said = call.await.expect("the run's task");
    b.fake.world().start_takes = None;
    let said = match said {
        Ok(out) => format!("ran: {:?} {:?}", out.result, out.notices),
        Err(e) => e.to_string(),
    };
    (said, at_close)
}

#[tokio::test]
async fn a_close_during_a_container_replacement_leaves_nothing_running() {
    let b = Bench::new(&["--pool-size", "0"]);
    let (s, _) = b.open("alice", "swap").await.expect("opened");
    run(&s, "x = 1").await;
    let [c] = b.containers_of("alice", "swap").try_into().expect("one container");
    // Behind the registry's back, as `docker rm -f` would: the next call replaces it.
    b.fake.vanish(&c);
    let said = close_while_starting(&b, &s, "swap").await;
    assert!(said.contains("closed"), "the run says the session was closed: {said}");
    assert!(b.ours().is_empty(), "nothing of the closed session stays: {:?}", b.ours());
    assert!(b.reg.ledger.running().is_empty() && b.reg.ledger.sleepers().is_empty());
}

#[tokio::test]
async fn a_close_during_a_wake_leaves_nothing_running() {
    let b = Bench::new(&["--pool-size", "0"]);
    let (s, _) = b.open("alice", "nap").await.expect("opened");
    run(&s, "x = 1").await;
    hibernate(&b, &s).await;
    let said = close_while_starting(&b, &s, "nap").await;
    assert!(said.contains("closed"), "the run says the session was closed: {said}");
    assert!(b.ours().is_empty(), "nothing of the closed session stays: {:?}", b.ours());
    assert!(b.reg.ledger.running().is_empty() && b.reg.ledger.sleepers().is_empty());
}

/// The close waits for the container a wake is making and removes it itself: once it returns,
/// nothing of the session is left on the engine, so its egress network (which the engine
/// refuses to remove while a container is on it) can go too.
#[tokio::test]
async fn a_close_during_a_wake_returns_once_the_new_container_is_gone() {
    let b = Bench::new(&["--pool-size", "0"]);
    let (s, _) = b.open("alice", "nap2").await.expect("opened");
    run(&s, "x = 1").await;
    hibernate(&b, &s).await;
    let (said, at_close) = close_while_starting_saw(&b, &s, "nap2").await;
    assert!(said.contains("closed"), "the run says the session was closed: {said}");
    assert!(at_close.is_empty(), "the woken container was still there when the close returned: {at_close:?}");
    assert!(b.ours().is_empty(), "{:?}", b.ours());
}

/// A replacement whose new container cannot be made leaves the old one removed, its uid given
/// back; the close that follows must not give that uid back again: another session may hold it
/// by then, and two sessions of one uid could read each other's files.
#[tokio::test]
async fn a_close_after_a_failed_replacement_gives_the_old_uid_back_once() {
    let b = Bench::new(&["--pool-size", "0"]);
    let (s, _) = b.open("alice", "twice").await.expect("opened");
    run(&s, "x = 1").await;
    let old = s.container.lock().expect("the container").clone();
    b.fake.vanish(&old.id);
    let images = std::mem::take(&mut b.fake.world().images);
    let spec = RunSpec { code: "1".into(), ..RunSpec::default() };
    let said = s.run(spec, Duration::from_secs(10), &CancellationToken::new(), &|_, _| {}).await;
    b.fake.world().images = images;
    assert!(said.is_err(), "no container could be made, so the run failed");
    assert!(!crate::docker::identity::is_lent(old.uid), "the old container's uid went back with it");
    // Another session of this server takes it meanwhile.
    crate::docker::identity::reserve(old.uid);
    b.reg.close("alice", "twice").await.expect("closed");
    let still = crate::docker::identity::is_lent(old.uid);
    crate::docker::identity::release(old.uid);
    assert!(still, "the close gave back a uid another session holds");
}
