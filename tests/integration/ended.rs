//! Terminal states are honest (issue 26 item 4): each way a session ends or loses its state
//! has a reason the caller reads in the next result and in `list_sessions`, for an hour.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{Server, containers_of, docker, text};

/// `list_sessions`' structured answer.
async fn listed(s: &Server) -> Value {
    let r = s.call("list_sessions", json!({})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    r.structured_content.clone().unwrap_or_default()
}

/// The `why` of an ended session in `list_sessions`, if listed.
fn ended_why(list: &Value, name: &str) -> Option<String> {
    let all = list["ended"].as_array()?;
    all.iter().find(|e| e["session"] == name).and_then(|e| e["why"].as_str().map(str::to_owned))
}

/// Why an open session's state was last lost, if `list_sessions` says.
fn lost_why(list: &Value, name: &str) -> Option<String> {
    let all = list["sessions"].as_array()?;
    all.iter().find(|e| e["session"] == name).and_then(|e| e["state_lost"].as_str().map(str::to_owned))
}

#[tokio::test(flavor = "multi_thread")]
async fn every_end_and_loss_is_listed_with_its_reason() {
    let env = [("PYBERTH_IDLE_TTL", "5"), ("PYBERTH_HIBERNATE_AFTER_S", "0"), ("PYBERTH_MEMORY_MB", "256")];
    let s = Server::start("ended-why", &env).await;
    // Closed.
    s.ok("closed", "1").await;
    assert_eq!(s.call("close_session", json!({"session": "closed"})).await.is_error, Some(false));
    let why = ended_why(&listed(&s).await, "closed");
    assert!(why.as_deref().is_some_and(|w| w.contains("closed by close_session")), "{why:?}");
    // A new session of that name says what became of the one before it.
    let (r, _) = s.run("closed", "2").await;
    assert!(text(&r).contains("the one before it was closed by close_session"), "{}", text(&r));
    // Out of memory: the interpreter restarted, its variables gone.
    s.ok("oom", "x = 1").await;
    let (r, sc) = s.run("oom", "b = []\nwhile True:\n    b.append(bytearray(16 << 20))").await;
    assert_eq!(sc["state_lost"], true, "{}", text(&r));
    let why = lost_why(&listed(&s).await, "oom");
    assert!(why.as_deref().is_some_and(|w| w.contains("memory")), "{why:?}");
    // Lost with its container.
    s.ok("gone", "x = 1").await;
    let c = containers_of(&s.instance).await;
    let id =
        c.iter().find(|c| c.labels.as_ref().is_some_and(|l| l.get("pyberth.session").is_some_and(|n| n == "gone")));
    let id = id.and_then(|c| c.id.clone()).expect("gone's container");
    docker().await.kill_container(&id, None::<bollard::query_parameters::KillContainerOptions>).await.expect("kill");
    let (r, sc) = s.run("gone", "1").await;
    assert_eq!(sc["state_lost"], true, "{}", text(&r));
    let why = lost_why(&listed(&s).await, "gone");
    assert!(why.as_deref().is_some_and(|w| w.contains("replaced")), "{why:?}");
    // Expired: polled through list_sessions, which does not count as using a session.
    s.ok("idle", "1").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let why = loop {
        let list = listed(&s).await;
        if let Some(why) = ended_why(&list, "idle") {
            break why;
        }
        assert!(Instant::now() < deadline, "never reaped: {list}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(why.contains("expired") && why.contains("--idle-ttl-s"), "{why}");
    let r = s.call("list_sessions", json!({})).await;
    assert!(text(&r).contains("ended") && text(&r).contains("\"idle\" expired"), "{}", text(&r));
    s.stop().await;
}
