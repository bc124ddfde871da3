//! Out of memory on Kubernetes: the kernel kills the interpreter inside the pod's memory
//! limit; the result says so (status `oom`, the limit named, state lost), and the session goes
//! on in the same pod. No engine event says it there: the engine reads the pod's own records
//! (the kubelet's `OOMKilled`, the cgroup's `oom_kill` count).

use serde_json::{Value, json};

use super::apiserver::{Options, Sim};
use super::docker;
use super::serve::{Served, pods, text};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_is_said_and_the_session_goes_on() {
    let sim = Sim::start(Options::default(), docker()).await;
    let s = Served::start_cfg(&sim, "oom", 0, "memory_mb = 200\n").await;
    s.ok("run_python", json!({ "session": "k", "code": "gone = 1" })).await;
    let pod = pods(&sim);
    let r = s.call("run_python", json!({ "session": "k", "code": "hog = ' ' * (400 << 20)" })).await;
    let sc = r.structured_content.clone().unwrap_or(Value::Null);
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    assert_eq!(sc["status"], "oom", "{} {sc}\n{}", text(&r), s.log());
    assert_eq!(sc["state_lost"], true, "{sc}");
    assert!(text(&r).contains("200 MiB"), "the limit is named: {}", text(&r));
    let r = s.call("run_python", json!({ "session": "k", "code": "gone" })).await;
    assert!(text(&r).contains("NameError"), "variables are gone: {}", text(&r));
    // A kill that is not the OOM killer's is not called one.
    let r = s
        .call(
            "run_python",
            json!({ "session": "k", "code": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)" }),
        )
        .await;
    let sc = r.structured_content.clone().unwrap_or(Value::Null);
    assert_ne!(sc["status"], "oom", "a SIGKILL of its own is not out of memory: {sc}");
    let sc = s.ok("run_python", json!({ "session": "k", "code": "print(sum(range(10)))" })).await;
    assert_eq!(sc["stdout"], "45\n", "the next call works: {sc}");
    assert_eq!(pods(&sim), pod, "in the same pod");
    s.stop().await;
    sim.stop().await;
}
