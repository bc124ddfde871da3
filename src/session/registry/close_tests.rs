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
    let said = call.await.expect("the run's task");
    b.fake.world().start_takes = None;
    match said {
        Ok(out) => format!("ran: {:?} {:?}", out.result, out.notices),
        Err(e) => e.to_string(),
    }
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
