//! Background jobs across server restarts (issue 26, the lifecycle model's two job findings):
//! a job that woke a hibernated session is followed by the next server, and a finished job's
//! result is still readable after a restart, within its hour.

use std::time::Duration;

use serde_json::{Value, json};

use crate::adopt::{Server, StateDir, run};
use crate::adopt_transitions::until_hibernated;
use crate::common::{Recorder, assert_cleaned_up, text};
use crate::http::call;
use rmcp::RoleClient;
use rmcp::service::RunningService;

type Client = RunningService<RoleClient, Recorder>;

/// Starts `code` as a background job in `session`; its handle.
async fn background(client: &Client, session: &str, code: &str) -> String {
    let args = json!({ "session": session, "code": code, "background": true });
    let (r, sc) = call(client, "run_python", args).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    sc["job"].as_str().expect("job handle").to_owned()
}

/// `job_status` of `job`, waiting up to `wait_s`.
async fn status(client: &Client, job: &str, wait_s: u64) -> Value {
    let (r, sc) = call(client, "job_status", json!({ "job": job, "wait_s": wait_s })).await;
    assert_eq!(r.is_error, Some(false), "{job} is known: {}", text(&r));
    sc
}

/// Closes `session`, stops the server with SIGTERM, and checks nothing of either instance
/// nor any job file is left.
async fn close_and_check(server: Server, client: Client, session: &str, state: &StateDir, old: &[String]) {
    let (r, _) = call(&client, "close_session", json!({ "session": session })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = client.cancel().await;
    let new = server.signal("-TERM").await;
    for inst in old.iter().chain([&new]) {
        assert_cleaned_up(inst).await;
    }
    let left: Vec<_> =
        std::fs::read_dir(state.0.join("jobs")).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "no job record is left once its session is closed and the server stopped: {left:?}");
}

/// Finding 1: the job wakes the sleeping session (a new container), then the server is killed
/// with `kill -9`. Before the fix the record named the container the session had before it
/// slept, and the next server said the job "could not be taken over"; its result was lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_that_woke_its_session_is_followed_after_a_kill_9() {
    let state = StateDir::new("job-wakes");
    let first = Server::start("job-wakes", &state, &[("PYBERTH_HIBERNATE_AFTER_S", "2")]).await;
    let alice = first.client().await;
    run(&alice, "s1", "x = 1").await;
    until_hibernated(&alice, "s1").await;
    let code = "import time\nprint('job-started', flush=True)\ntime.sleep(4)\ny = x + 41\n'job-done'";
    let job = background(&alice, "s1", code).await;
    // Killed once the wake is over and the run is under way (a kill during the wake, before
    // the run is sent, ends the job saying its code did not run).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let sc = status(&alice, &job, 0).await;
        assert_eq!(sc["status"], "running", "woken, the job runs: {sc}");
        if sc["stdout"].as_str().is_some_and(|o| o.contains("job-started")) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the job's run never started: {sc}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = alice.cancel().await;
    let old = first.signal("-KILL").await;

    let second = Server::start("job-wakes", &state, &[]).await;
    let alice = second.client().await;
    let sc = status(&alice, &job, 30).await;
    assert_eq!(sc["status"], "ok", "followed to its end by the next server: {sc}");
    assert_eq!(sc["result"]["result"], "'job-done'", "{sc}");
    assert_eq!(run(&alice, "s1", "y").await["result"], "42", "its effect is in the session");
    close_and_check(second, alice, "s1", &state, &[old]).await;
}

/// Finding 2: a job finished (its result read once) before a SIGTERM, then a `kill -9` of the
/// next server: the third server still answers `job_status` with its result and lists it.
/// Before the fix only running jobs were recorded: `no job "job-1"`.
#[tokio::test(flavor = "multi_thread")]
async fn a_finished_job_is_kept_across_restarts() {
    let state = StateDir::new("job-kept");
    let first = Server::start("job-kept", &state, &[]).await;
    let alice = first.client().await;
    let job = background(&alice, "s1", "print('out', flush=True)\nz = 6 * 7\nz").await;
    let sc = status(&alice, &job, 30).await;
    assert_eq!((&sc["status"], &sc["result"]["result"]), (&json!("ok"), &json!("42")), "{sc}");
    let _ = alice.cancel().await;
    let first_instance = first.signal("-TERM").await;

    let second = Server::start("job-kept", &state, &[]).await;
    let alice = second.client().await;
    let sc = status(&alice, &job, 0).await;
    assert_eq!((&sc["status"], &sc["result"]["result"]), (&json!("ok"), &json!("42")), "kept across SIGTERM: {sc}");
    assert_eq!(sc["stdout"], "out\n", "with its output: {sc}");
    let _ = alice.cancel().await;
    let second_instance = second.signal("-KILL").await;

    let third = Server::start("job-kept", &state, &[]).await;
    let alice = third.client().await;
    let sc = status(&alice, &job, 0).await;
    assert_eq!((&sc["status"], &sc["result"]["result"]), (&json!("ok"), &json!("42")), "kept across kill -9: {sc}");
    let (_, sc) = call(&alice, "list_jobs", json!({ "status": "finished" })).await;
    assert_eq!(sc["jobs"][0]["job"], job.as_str(), "listed: {sc}");
    // A new job never reuses a kept one's id.
    let again = background(&alice, "s1", "1").await;
    assert_ne!(again, job);
    status(&alice, &again, 30).await;
    close_and_check(third, alice, "s1", &state, &[first_instance, second_instance]).await;
}

/// A graceful stop while a job prints fast: what the old server's stream held when it left
/// (the relay's buffers, the exec's pipes and sockets) was lost before the orderly detach
/// (docs/design.md D12, "A graceful leave"). The next server reads the job to its end: every
/// line once, in order.
#[tokio::test(flavor = "multi_thread")]
async fn a_graceful_stop_loses_no_line_of_a_job_printing_fast() {
    let state = StateDir::new("job-detach");
    let first = Server::start("job-detach", &state, &[]).await;
    let alice = first.client().await;
    // Lines of ~500 bytes every 5 ms: a stream in flight holds many of them.
    let code =
        "import time\nfor i in range(600):\n    print('n', i, 'x' * 500, flush=True)\n    time.sleep(0.005)\n'end'";
    let job = background(&alice, "s1", code).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        // A few dozen lines in: the stop comes while it prints.
        let (_, sc) = call(&alice, "job_status", json!({ "job": job, "stdout_offset": 20 * 500 })).await;
        assert_eq!(sc["status"], "running", "the job is still running when the server stops: {sc}");
        if sc["stdout"].as_str().is_some_and(|o| !o.is_empty()) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the job never printed: {sc}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;

    let second = Server::start("job-detach", &state, &[]).await;
    let alice = second.client().await;
    let sc = status(&alice, &job, 60).await;
    assert_eq!(sc["status"], "ok", "followed to its end by the next server: {sc}");
    let out = stdout_of(&alice, &job).await;
    let lines: Vec<&str> = out.lines().collect();
    let pad = "x".repeat(500);
    let want: Vec<String> = (0..600).map(|i| format!("n {i} {pad}")).collect();
    let missing: Vec<usize> = (0..600).filter(|&i| !lines.contains(&want[i].as_str())).collect();
    assert!(missing.is_empty(), "lines lost across the stop: {missing:?}");
    assert!(lines == want, "every line once, in order: {} lines", lines.len());
    close_and_check(second, alice, "s1", &state, &[old]).await;
}

/// The whole stdout of a finished `job`, read page by page.
async fn stdout_of(client: &Client, job: &str) -> String {
    let mut out = String::new();
    loop {
        let args = json!({ "job": job, "stdout_offset": out.len() });
        let (r, sc) = call(client, "job_status", args).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        let page = sc["stdout"].as_str().unwrap_or_default();
        if page.is_empty() {
            return out;
        }
        out.push_str(page);
    }
}
