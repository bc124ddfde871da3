//! Warm pools per environment (issue 29): an operator's environment in use gets warm
//! containers of its own, made with its own limits, beside the default's floor.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::json;

use crate::common::{Server, containers_of, docker, instance_name, state_dir, text};

/// The container a session's code runs in, by its hostname (Docker's short container id).
async fn hostname(s: &Server, session: &str) -> String {
    let args = json!({ "session": session, "environment": "small", "code": "import socket\nsocket.gethostname()" });
    let (r, sc) = s.run_with(args).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    sc["result"].as_str().expect("a hostname").trim_matches('\'').to_owned()
}

/// Pooled containers of the instance made for `small` (200 MiB), by id.
async fn small_pooled(instance: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for c in containers_of(instance).await {
        let pooled = c.labels.as_ref().and_then(|l| l.get("pyberth.session")).is_some_and(|s| s.starts_with("pool-"));
        let Some(id) = c.id.filter(|_| pooled) else { continue };
        let inspected = docker().await.inspect_container(&id, None).await.expect("inspect");
        if inspected.host_config.and_then(|h| h.memory) == Some(200 << 20) {
            ids.push(id);
        }
    }
    ids
}

#[tokio::test(flavor = "multi_thread")]
async fn an_environment_in_use_gets_warm_containers_of_its_own_with_its_limits() {
    let tag = instance_name("pools-env");
    let dir = state_dir().join(format!("pools-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("pyberth.toml");
    std::fs::write(&config, "[environments.small]\nmemory_mb = 200\n").expect("config");
    let env =
        [("PYBERTH_CONFIG", config.to_str().expect("utf-8")), ("PYBERTH_POOL_SIZE", "1"), ("PYBERTH_POOL_MAX", "6")];
    let s = Server::start_as(&tag, &env).await;
    // Three sessions of `small` at once: its pool learns them.
    let names: Vec<String> = (0..3).map(|i| format!("s{i}")).collect();
    let first: HashSet<String> =
        futures::future::join_all(names.iter().map(|n| hostname(&s, n))).await.into_iter().collect();
    // Bounded: the keeper makes the pool's containers in the background.
    let mut ready = Vec::new();
    for _ in 0..240 {
        ready = small_pooled(&tag).await.into_iter().filter(|id| !first.iter().any(|h| id.starts_with(h))).collect();
        if !ready.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(!ready.is_empty(), "no warm container of `small` was made");
    // The next session of `small` is served from its pool, with its limits.
    let next = hostname(&s, "next").await;
    let own: Vec<String> = small_pooled(&tag).await.into_iter().filter(|id| id.starts_with(&next)).collect();
    assert_eq!(own.len(), 1, "the session's container {next} is a pooled one of `small` (200 MiB): {ready:?}");
    assert!(!first.contains(&next));
    s.stop().await;
    crate::common::assert_cleaned_up(&tag).await;
}
