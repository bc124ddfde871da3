//! Long-running work: live output, background jobs read by offsets, cancellation, the busy
//! queue, and the figures on every result (wall, CPU, peak memory, out-of-memory).

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{Server, text};

/// Polls job_status (waiting server-side) until the job has finished.
pub(crate) async fn finished(s: &Server, job: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = s.call("job_status", json!({ "job": job, "wait_s": 5 })).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        let sc = r.structured_content.clone().expect("structured");
        if sc["status"] != "running" {
            return sc;
        }
        assert!(Instant::now() < deadline, "job {job} still running");
    }
}

#[tokio::test(flavor = "multi_thread")]
#[allow(deprecated)] // LoggingLevel: logging is deprecated in MCP 2026-07-28, still served
async fn output_reaches_the_client_while_the_code_runs() {
    let s = Server::start("live", &[]).await;
    s.client()
        .set_level(rmcp::model::SetLevelRequestParams::new(rmcp::model::LoggingLevel::Info))
        .await
        .expect("set level");
    s.ok("default", "import time").await;
    s.take_heard();
    let code = "for i in range(4):\n    print(f'tick {i}', flush=True)\n    time.sleep(0.6)\n'end'";
    let sc = s.ok("default", code).await;
    let ended = Instant::now();
    assert_eq!(sc["stdout"], "tick 0\ntick 1\ntick 2\ntick 3\n", "the result still carries all output");
    let heard = s.take_heard();
    for kind in ["progress", "log"] {
        let first = heard.iter().find(|h| h.kind == kind && h.text.contains("tick 0"));
        let first = first.unwrap_or_else(|| panic!("no {kind} notification with tick 0: {heard:?}"));
        // tick 0 is printed about 1.8 s before the run ends: it must not wait for the end.
        let early = ended.duration_since(first.at);
        assert!(early > Duration::from_millis(1000), "{kind}: tick 0 came only {early:?} before the result");
        let mut chunks: Vec<&crate::common::Heard> = heard.iter().filter(|h| h.kind == kind).collect();
        chunks.sort_by(|a, b| a.seq.total_cmp(&b.seq));
        let all: String = chunks.iter().map(|h| h.text.as_str()).collect();
        assert_eq!(all, "tick 0\ntick 1\ntick 2\ntick 3\n", "{kind} notifications carry the chunks in order");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn wait_s_hands_back_a_job_that_is_read_by_offsets() {
    let s = Server::start("wait", &[]).await;
    // The session made first, so the clock below times the run alone, not a container start.
    s.ok("default", "1").await;
    let code =
        "import sys, time\nprint('first')\nsys.stderr.write('warn\\n')\ntime.sleep(4)\nprint('second')\nv = 41\nv + 1";
    let t = Instant::now();
    let (r, sc) = s.run_with(json!({ "code": code, "wait_s": 1 })).await;
    assert!(t.elapsed() < Duration::from_millis(3500), "wait_s 1 answered after {:?}", t.elapsed());
    assert_eq!(r.is_error, Some(false), "a running job is not an error: {}", text(&r));
    assert_eq!(sc["status"], "running");
    assert_eq!(sc["stdout"], "first\n");
    assert_eq!(sc["stderr"], "warn\n");
    assert_eq!(sc["stdout_offset"], 6);
    assert_eq!(sc["stderr_offset"], 5);
    let job = sc["job"].as_str().expect("job handle").to_owned();
    assert!(text(&r).contains(&job), "the text names the job: {}", text(&r));

    let listed = s.call("list_jobs", json!({ "status": "running" })).await;
    assert_eq!(listed.structured_content.expect("sc")["jobs"][0]["job"], job.as_str());

    // Read only what came after the offsets.
    let sc = s.call("job_status", json!({ "job": job, "stdout_offset": 6, "stderr_offset": 5, "wait_s": 10 })).await;
    let sc = sc.structured_content.expect("sc");
    assert_eq!(sc["status"], "ok");
    assert_eq!(sc["stdout"], "second\n");
    assert_eq!(sc["stderr"], "");
    assert_eq!(sc["stdout_offset"], 13);
    assert_eq!(sc["result"]["result"], "42");
    assert_eq!(sc["result"]["stdout"], "first\nsecond\n", "the full result has all output");
    // The job ran in the session: its variables are there.
    assert_eq!(s.ok("default", "v").await["result"], "41");
    let none = s.call("list_jobs", json!({ "status": "running" })).await;
    assert_eq!(none.structured_content.expect("sc")["jobs"], json!([]));
    let unknown = s.call("job_status", json!({ "job": "job-999" })).await;
    assert_eq!(unknown.is_error, Some(true));
    assert!(text(&unknown).contains("list_jobs"), "{}", text(&unknown));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_background_job_runs_on_while_other_calls_are_served() {
    let s = Server::start("bg", &[]).await;
    // Both sessions exist first: making a container can itself take seconds on a loaded
    // machine, and what is checked is that one session's job does not hold up another's call.
    s.ok("slow", "0").await;
    s.ok("other", "0").await;
    let t = Instant::now();
    let (_, sc) = s
        .run_with(json!({ "code": "import time\ntime.sleep(3)\nprint('done')", "session": "slow", "background": true }))
        .await;
    assert_eq!(sc["status"], "running");
    let job = sc["job"].as_str().expect("job").to_owned();
    // Another session answers meanwhile, and the job's own session queues behind it.
    assert_eq!(s.ok("other", "1 + 1").await["result"], "2");
    let meanwhile = s.call("job_status", json!({ "job": job })).await;
    let meanwhile = meanwhile.structured_content.expect("structured");
    assert_eq!(meanwhile["status"], "running", "the other session waited for the job: {meanwhile}");
    let queued = s.ok("slow", "'after'").await;
    assert_eq!(queued["result"], "'after'");
    assert!(t.elapsed() >= Duration::from_secs(3), "a run in a busy session waits its turn");
    let sc = finished(&s, &job).await;
    assert_eq!(sc["status"], "ok");
    assert_eq!(sc["stdout"], "done\n");
    let bad = s.run_with(json!({ "code": "1", "background": true, "wait_s": 1 })).await.0;
    assert_eq!(bad.is_error, Some(true));
    let bad = s.run_with(json!({ "code": "1", "wait_s": -1 })).await.0;
    assert!(text(&bad).contains("wait_s"), "{}", text(&bad));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_job_stops_sleeping_and_c_level_code() {
    let s = Server::start("canceljob", &[]).await;
    s.ok("default", "kept = 'yes'").await;
    // A sleep: the interrupt lands, variables survive.
    let (_, sc) = s.run_with(json!({ "code": "import time\ntime.sleep(60)", "background": true })).await;
    let job = sc["job"].as_str().expect("job").to_owned();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let r = s.call("cancel_job", json!({ "job": job })).await;
    let sc = r.structured_content.expect("sc");
    assert_eq!(sc["status"], "cancelled");
    assert!(t.elapsed() < Duration::from_secs(3), "cancel took {:?}", t.elapsed());
    assert_eq!(s.ok("default", "kept").await["result"], "'yes'");
    // One C call that cannot see KeyboardInterrupt: killed after the grace, state lost.
    let (_, sc) = s.run_with(json!({ "code": "sum(range(10**13))", "background": true })).await;
    let job = sc["job"].as_str().expect("job").to_owned();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let sc = s.call("cancel_job", json!({ "job": job })).await.structured_content.expect("sc");
    assert_eq!(sc["status"], "cancelled");
    assert_eq!(sc["result"]["state_lost"], true);
    assert!(t.elapsed() < Duration::from_secs(6), "cancel took {:?}", t.elapsed());
    let sc = s.ok("default", "import time\nt = time.process_time()\nsum(range(10**6))\n'ok'").await;
    assert_eq!(sc["result"], "'ok'", "the session works right after");
    let listed = s.call("list_jobs", json!({ "status": "finished" })).await.structured_content.expect("sc");
    assert_eq!(listed["jobs"].as_array().map(Vec::len), Some(2));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_wait_stops_the_job() {
    let s = Server::start("cancelwait", &[]).await;
    let call = s.run_with(json!({ "code": "import time\ntime.sleep(60)", "wait_s": 30 }));
    assert!(tokio::time::timeout(Duration::from_secs(2), call).await.is_err());
    // The caller gave up before it had the handle: the job is stopped, not orphaned.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let sc = s.call("list_jobs", json!({})).await.structured_content.expect("sc");
        if sc["jobs"][0]["status"] == "cancelled" {
            break;
        }
        assert!(Instant::now() < deadline, "job not cancelled: {sc}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(s.ok("default", "2 * 3").await["result"], "6");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_busy_session_queues_four_runs_and_refuses_more() {
    let s = Server::start("busy", &[]).await;
    let (_, sc) = s.run_with(json!({ "code": "import time\ntime.sleep(4)", "background": true })).await;
    assert_eq!(sc["status"], "running");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let calls = (0..6).map(|i| s.run_with(json!({ "code": format!("{i}") })));
    let results = futures::future::join_all(calls).await;
    let busy: Vec<String> = results.iter().filter(|(r, _)| r.is_error == Some(true)).map(|(r, _)| text(r)).collect();
    let ok = results.iter().filter(|(r, _)| r.is_error == Some(false)).count();
    assert_eq!((ok, busy.len()), (4, 2), "four wait their turn, the rest are refused: {busy:?}");
    assert!(busy.iter().all(|t| t.contains("busy")), "{busy:?}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_result_carries_wall_cpu_and_peak_memory() {
    let s = Server::start("figures", &[]).await;
    // Spin until the process clock says 0.4 s: a loaded machine stretches the wall time, never
    // the CPU time, so the figure must read at least that and at most the wall time.
    let busy =
        s.ok("default", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4:\n    pass").await;
    let (wall, cpu) = (busy["duration_ms"].as_f64().expect("wall"), busy["cpu_ms"].as_f64().expect("cpu"));
    assert!(cpu >= 390.0 && cpu <= wall + 20.0, "busy loop: cpu {cpu} ms vs wall {wall} ms");
    let idle = s.ok("default", "time.sleep(0.5)").await;
    let (wall, cpu) = (idle["duration_ms"].as_f64().expect("wall"), idle["cpu_ms"].as_f64().expect("cpu"));
    assert!(wall >= 500.0 && cpu < 100.0, "sleep: cpu {cpu} ms vs wall {wall} ms");

    let kib = |sc: &Value| sc["peak_memory_kb"].as_u64().expect("peak_memory_kb");
    let big = s.ok("default", "b = b'x' * (120 << 20)\ndel b").await;
    assert!(kib(&big) > 120 << 10, "120 MiB allocated, peak {} KiB", kib(&big));
    let small = s.ok("default", "1").await;
    assert!(kib(&small) < 100 << 10, "each run has its own peak: {} KiB", kib(&small));
    let child = s
        .ok("default", "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'b = b\"x\" * (150 << 20)'])")
        .await;
    assert!(kib(&child) > 150 << 10, "a child's peak counts: {} KiB", kib(&child));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn out_of_memory_is_reported_and_the_interpreter_restarts() {
    let s = Server::start("oom", &[("PYBERTH_MEMORY_MB", "200")]).await;
    s.ok("default", "gone = 1").await;
    let (r, sc) = s.run("default", "hog = ' ' * (400 << 20)").await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["status"], "oom", "{}", text(&r));
    assert_eq!(sc["state_lost"], true);
    assert!(text(&r).contains("200 MiB"), "the limit is named: {}", text(&r));
    let (r, _) = s.run("default", "gone").await;
    assert!(text(&r).contains("NameError"), "variables are gone: {}", text(&r));
    assert_eq!(s.ok("default", "sum(range(10))").await["result"], "45", "the next call works");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_caller_has_a_bounded_number_of_runs_going() {
    let s = Server::start("runlimit", &[("PYBERTH_MAX_RUNS_PER_CALLER", "2")]).await;
    // Long enough to outlast making the other sessions on a loaded machine; cancelled below.
    let sleep = "import time\ntime.sleep(60)";
    for session in ["a", "b"] {
        let (_, sc) = s.run_with(json!({ "code": sleep, "session": session, "background": true })).await;
        assert_eq!(sc["status"], "running");
    }
    let (r, _) = s.run("c", "1").await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("2 runs going"), "{}", text(&r));
    let sc = s.call("list_jobs", json!({})).await.structured_content.expect("sc");
    for job in sc["jobs"].as_array().expect("jobs") {
        s.call("cancel_job", json!({ "job": job["job"] })).await;
    }
    assert_eq!(s.ok("c", "1 + 1").await["result"], "2", "slots come back when jobs end");
    s.stop().await;
}
