//! Sessions outlive their server (docs/design.md D12): a SIGTERM or a `kill -9` of the HTTP
//! server, then a new server with the same state dir and token, finds the same session with
//! its variables, an open file and a running thread; a dropped exec stream loses nothing; a
//! live instance never adopts another's sessions; past the grace, sessions hibernate.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::RoleClient;
use rmcp::ServiceExt as _;
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

use crate::common::{Recorder, assert_cleaned_up, containers_of, instance_name, text};
use crate::http::{ALICE, call};

/// State that must survive: a variable, an open file, a thread that counts.
const SETUP: &str = "import threading, time\nx = 42\nf = open('/tmp/held.txt', 'w')\nf.write('a')\n\
                     count = [0]\ndef tick():\n    while True:\n        count[0] += 1\n        time.sleep(0.01)\n\
                     t = threading.Thread(target=tick, daemon=True)\nt.start()";
/// Checks it: the thread must still be counting.
const CHECK: &str = "c0 = count[0]\ntime.sleep(0.3)\n(x, f.closed, f.name, t.is_alive(), count[0] > c0)";
const INTACT: &str = "(42, False, '/tmp/held.txt', True, True)";

/// A private state dir, removed at the end.
pub(crate) struct StateDir(pub(crate) std::path::PathBuf);

impl StateDir {
    pub(crate) fn new(tag: &str) -> StateDir {
        let dir = std::env::temp_dir().join(format!("pyberth-adopt-{}", instance_name(tag)));
        std::fs::create_dir_all(&dir).expect("state dir");
        StateDir(dir)
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) struct Server {
    child: Child,
    pub(crate) port: u16,
    pub(crate) instance: String,
    log: Arc<Mutex<String>>,
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

impl Server {
    pub(crate) async fn start(tag: &str, state: &StateDir, env: &[(&str, &str)]) -> Server {
        let instance = instance_name(tag);
        let tokens = state.0.join(format!("tokens-{instance}"));
        std::fs::write(&tokens, format!("alice:{ALICE}\n")).expect("tokens");
        let port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pyberth"));
        cmd.args(["serve", "--http", &format!("127.0.0.1:{port}"), "--tokens-file"])
            .arg(&tokens)
            .env("PYBERTH_INSTANCE", &instance)
            .env("PYBERTH_STATE_DIR", &state.0)
            .env("PYBERTH_POOL_SIZE", "0")
            .env("RUST_LOG", "pyberth=debug,info")
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        crate::common::with_test_runtime(&mut cmd);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn pyberth serve --http");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let sink = log.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("{line}");
                let mut log = sink.lock().expect("log lock");
                log.push_str(&line);
                log.push('\n');
            }
        });
        let server = Server { child, port, instance, log };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = crate::common::web().get(format!("http://127.0.0.1:{port}/healthz")).send().await
                && r.status().is_success()
            {
                return server;
            }
            assert!(Instant::now() < deadline, "the HTTP server did not become healthy");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub(crate) async fn client(&self) -> RunningService<RoleClient, Recorder> {
        let uri = format!("http://127.0.0.1:{}/mcp", self.port);
        let config = StreamableHttpClientTransportConfig::with_uri(uri).auth_header(ALICE);
        Recorder::default().serve(crate::common::http_transport(config)).await.expect("MCP initialise")
    }

    /// Sends `signal` and waits for the exit.
    pub(crate) async fn signal(mut self, signal: &str) -> String {
        let pid = self.child.id().expect("pid");
        let _ = std::process::Command::new("kill").args([signal, &pid.to_string()]).status();
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        assert!(status.is_ok(), "the server exits on {signal}");
        self.instance.clone()
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    pub(crate) fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }
}

pub(crate) async fn run(client: &RunningService<RoleClient, Recorder>, session: &str, code: &str) -> Value {
    let (r, sc) = call(client, "run_python", json!({ "session": session, "code": code })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    sc
}

/// The running session container of `instance` (pool off: one container per session).
async fn session_container(instance: &str) -> (String, String) {
    let found = containers_of(instance).await;
    let c =
        found.iter().find(|c| c.state.as_ref().is_some_and(|s| format!("{s:?}").to_lowercase().contains("running")));
    let c = c.unwrap_or_else(|| panic!("no running container of {instance}"));
    let uid = c.labels.as_ref().and_then(|l| l.get("pyberth.uid")).cloned().expect("uid label");
    (c.id.clone().expect("id"), uid)
}

/// Left running by a stopped server, then adopted by the next: state intact, and fast.
async fn survives(tag: &str, signal: &str) {
    let state = StateDir::new(tag);
    let first = Server::start(tag, &state, &[]).await;
    let alice = first.client().await;
    run(&alice, "keep", SETUP).await;
    // A snapshot is the next server's too, whether this one stops cleanly or is killed.
    let (r, _) = call(&alice, "snapshot_session", json!({ "session": "keep", "name": "before" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let old = first.signal(signal).await;
    assert!(!containers_of(&old).await.is_empty(), "the session is left running after {signal}");

    let second = Server::start(tag, &state, &[]).await;
    assert!(second.log().contains("adopted"), "the new server says it adopted sessions");
    let alice = second.client().await;
    let (_, sc) = call(&alice, "list_sessions", json!({})).await;
    assert!(sc.to_string().contains("\"keep\""), "the adopted session is listed: {sc}");
    let started = Instant::now();
    let sc = run(&alice, "keep", "x").await;
    eprintln!("first call after the restart (reattach included): {:?}", started.elapsed());
    assert_eq!(sc["result"], "42", "{sc}");
    let sc = run(&alice, "keep", CHECK).await;
    assert_eq!(sc["result"], INTACT, "{sc}");
    let (_, sc) = call(&alice, "list_snapshots", json!({})).await;
    assert!(sc.to_string().contains("\"before\""), "the snapshot survives {signal}: {sc}");
    // Closing it leaves nothing of either server.
    let (r, _) = call(&alice, "close_session", json!({ "session": "keep" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, _) = call(&alice, "delete_snapshot", json!({ "snapshot": "before" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sigterm_then_restart_keeps_variables_files_and_threads() {
    survives("adopt-term", "-TERM").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kill_9_then_restart_reattaches_too() {
    survives("adopt-kill", "-KILL").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_live_instance_never_adopts_anothers_sessions() {
    let state = StateDir::new("adopt-live");
    let first = Server::start("adopt-live", &state, &[]).await;
    let alice = first.client().await;
    run(&alice, "keep", SETUP).await;
    let second = Server::start("adopt-live2", &state, &[("PYBERTH_ADOPT_GRACE_S", "0")]).await;
    assert!(!second.log().contains("adopted"), "a live instance's sessions are not adopted");
    let bob = second.client().await;
    let (_, sc) = call(&bob, "list_sessions", json!({})).await;
    assert_eq!(sc["sessions"], json!([]), "{sc}");
    let _ = bob.cancel().await;
    let other = second.signal("-TERM").await;
    assert_cleaned_up(&other).await;
    // The first still has its session.
    let sc = run(&alice, "keep", CHECK).await;
    assert_eq!(sc["result"], INTACT, "{sc}");
    let (r, _) = call(&alice, "close_session", json!({ "session": "keep" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let inst = first.signal("-TERM").await;
    assert_cleaned_up(&inst).await;
}

/// Kills the relay (the exec the server holds: the relay binary, or `keeper.py attach` before it
/// execs into it) of `instance`'s session from the host, as the
/// code's uid: the exec stream drops, the keeper and the interpreter stay.
async fn kill_relay(instance: &str) {
    let (container, uid) = session_container(instance).await;
    let killer = "import os, signal\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n            \
                  cmd = open('/proc/%s/cmdline' % p, 'rb').read().split(b'\\0')\n        except OSError:\n            \
                  continue\n        if cmd[0] == b'/opt/pyberth/relay' or (b'attach' in cmd and any(c.endswith(b'keeper.py') for c in cmd)):\n            \
                  os.kill(int(p), signal.SIGKILL); print('killed', p)";
    let out = tokio::process::Command::new("docker")
        .args(["exec", "-u", &uid, &container, "python3", "-c", killer])
        .output()
        .await
        .expect("docker exec");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("killed"), "a relay was found and killed: {said} {}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_exec_stream_loses_no_state() {
    let state = StateDir::new("adopt-drop");
    let s = Server::start("adopt-drop", &state, &[("PYBERTH_ADOPT_GRACE_S", "0")]).await;
    let alice = s.client().await;
    run(&alice, "keep", SETUP).await;
    kill_relay(&s.instance).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sc = run(&alice, "keep", CHECK).await;
    assert_eq!(sc["result"], INTACT, "{sc}");
    assert!(sc.to_string().find("variables are gone").is_none(), "no state lost said: {sc}");
    let _ = alice.cancel().await;
    let inst = s.signal("-TERM").await;
    assert_cleaned_up(&inst).await;
}

/// A session nobody adopted within `--adopt-grace-s` is not lost: the server that finds it
/// later puts it to sleep (its container goes, its state is kept) and it wakes on its next call.
#[tokio::test(flavor = "multi_thread")]
async fn sessions_past_the_grace_hibernate_and_wake() {
    let state = StateDir::new("adopt-late");
    let first = Server::start("adopt-late", &state, &[]).await;
    let alice = first.client().await;
    run(&alice, "keep", "x = 42\nopen('kept.txt', 'w').write('kept')").await;
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;
    let left: Vec<String> = containers_of(&old).await.into_iter().filter_map(|c| c.id).collect();
    assert!(!left.is_empty(), "left running");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let second = Server::start("adopt-late", &state, &[("PYBERTH_ADOPT_GRACE_S", "2")]).await;
    assert!(second.log().contains("put to sleep"), "the late session is hibernated at once");
    let now: Vec<String> = containers_of(&old).await.into_iter().filter_map(|c| c.id).collect();
    assert!(left.iter().all(|c| !now.contains(c)), "its containers are gone: {left:?} {now:?}");
    let alice = second.client().await;
    assert_eq!(state_of(&alice, "keep").await, Some(json!("hibernated")));
    let (r, sc) = call(&alice, "run_python", json!({ "session": "keep", "code": "x, open('kept.txt').read()" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "(42, 'kept')", "woken with its variables and files: {sc}");
    let (r, _) = call(&alice, "close_session", json!({ "session": "keep" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
}

/// A job running across a SIGTERM and restart keeps running: the new server lists it under
/// the same id, with the output printed before the restart and what came while no server was
/// attached, and follows it to its result. Another instance's record of the same id, whose
/// container is gone, is neither imported nor removed.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_running_across_a_restart_keeps_running_and_stays_readable() {
    let state = StateDir::new("adopt-job");
    let first = Server::start("adopt-job", &state, &[]).await;
    let alice = first.client().await;
    run(&alice, "keep", "x = 42").await;
    let code = "import time\nfor i in range(10):\n    print('tick', i, flush=True)\n    time.sleep(0.8)\n'done', x";
    let (r, sc) = call(&alice, "run_python", json!({ "session": "keep", "code": code, "background": true })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let job = sc["job"].as_str().expect("job").to_owned();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let (_, sc) = call(&alice, "job_status", json!({ "job": job })).await;
    assert_eq!(sc["status"], "running", "{sc}");
    assert!(sc["stdout"].as_str().is_some_and(|s| s.contains("tick 1")), "{sc}");
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;
    assert!(!containers_of(&old).await.is_empty(), "the session is left running");
    // Printing goes on while no server is attached.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // A live server of the same state dir, its `job-1` recorded under its own instance.
    let other = state.0.join("jobs").join(instance_name("adopt-job-other"));
    std::fs::create_dir_all(&other).expect("other's folder");
    let planted = json!({ "id": job, "instance": other.file_name().and_then(|n| n.to_str()), "principal": "alice",
        "session": "keep", "container": "pyberth-gone-0", "run": 7, "started_ms": 0, "deadline_ms": 0, "cap": 1024 });
    std::fs::write(other.join(format!("{job}.json")), planted.to_string()).expect("plant");
    std::fs::write(other.join(format!("{job}.out")), "another instance's output\n").expect("plant");

    let second = Server::start("adopt-job", &state, &[]).await;
    let alice = second.client().await;
    let (_, sc) = call(&alice, "list_jobs", json!({})).await;
    assert_eq!(sc["jobs"][0]["job"], job.as_str(), "the job is listed under its id: {sc}");
    assert_eq!(sc["jobs"].as_array().map(Vec::len), Some(1), "another instance's record is not imported: {sc}");
    assert_eq!(sc["jobs"][0]["status"], "running", "{sc}");
    let (_, sc) = call(&alice, "job_status", json!({ "job": job })).await;
    assert_eq!(sc["status"], "running", "still running after the restart: {sc}");
    let so_far = sc["stdout"].as_str().unwrap_or_default().to_owned();
    assert!(so_far.contains("tick 0\ntick 1\n"), "the output from before the restart is readable: {sc}");
    assert!(!so_far.contains("another instance"), "{sc}");
    let (_, sc) = call(&alice, "job_status", json!({ "job": job, "wait_s": 30 })).await;
    assert_eq!(sc["status"], "ok", "{sc}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    let ticks: Vec<&str> = out.lines().collect();
    let want: Vec<String> = (0..10).map(|i| format!("tick {i}")).collect();
    assert_eq!(ticks, want, "every line, none lost or doubled across the restart: {sc}");
    assert_eq!(sc["result"]["result"], "('done', 42)", "its result, in the same interpreter: {sc}");
    // A new job gets a fresh id, never the taken-over one's.
    let (_, sc) = call(&alice, "run_python", json!({ "session": "keep", "code": "1", "background": true })).await;
    assert_ne!(sc["job"].as_str(), Some(job.as_str()), "{sc}");
    let (r, _) = call(&alice, "close_session", json!({ "session": "keep" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
    let left: Option<Vec<_>> =
        std::fs::read_dir(state.0.join("jobs")).ok().map(|d| d.flatten().map(|e| e.path()).collect());
    assert_eq!(left, Some(vec![other.clone()]), "no job record of ours is left behind");
    let theirs = std::fs::read_dir(&other).map(|d| d.count()).unwrap_or_default();
    assert_eq!(theirs, 2, "another instance's record and output are not removed");
}

/// The state of `name` in `list_sessions`, if listed.
pub(crate) async fn state_of(client: &RunningService<RoleClient, Recorder>, name: &str) -> Option<Value> {
    let (_, sc) = call(client, "list_sessions", json!({})).await;
    sc["sessions"].as_array().and_then(|a| a.iter().find(|x| x["session"] == name)).map(|x| x["state"].clone())
}

/// Hibernated sessions and snapshots are carried across a restart: the new server lists the
/// sleepers, wakes one transparently with its state, lets another expire at its TTL counted
/// from its last use, and restores a snapshot taken under the old server.
#[tokio::test(flavor = "multi_thread")]
async fn hibernated_sessions_and_snapshots_survive_a_restart() {
    let state = StateDir::new("adopt-sleep");
    let sleepy = [("PYBERTH_HIBERNATE_AFTER_S", "1")];
    let first = Server::start("adopt-sleep", &state, &sleepy).await;
    let alice = first.client().await;
    run(&alice, "nap", "x = 42\nopen('kept.txt', 'w').write('kept')").await;
    run(&alice, "gone", "y = 1").await;
    let (r, _) = call(&alice, "snapshot_session", json!({ "session": "nap", "name": "before" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let deadline = Instant::now() + Duration::from_secs(30);
    while state_of(&alice, "nap").await != Some(json!("hibernated"))
        || state_of(&alice, "gone").await != Some(json!("hibernated"))
    {
        assert!(Instant::now() < deadline, "not hibernated");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let slept = Instant::now();
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;

    let second =
        Server::start("adopt-sleep", &state, &[("PYBERTH_HIBERNATE_AFTER_S", "0"), ("PYBERTH_IDLE_TTL", "25")]).await;
    let alice = second.client().await;
    assert_eq!(state_of(&alice, "nap").await, Some(json!("hibernated")), "the sleeper is carried over");
    assert_eq!(state_of(&alice, "gone").await, Some(json!("hibernated")));
    let (_, sc) = call(&alice, "list_snapshots", json!({})).await;
    assert!(sc.to_string().contains("\"before\""), "the snapshot is still its principal's: {sc}");
    let (r, sc) = call(&alice, "run_python", json!({ "session": "nap", "code": "x, open('kept.txt').read()" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "(42, 'kept')", "woken with its variables and files: {sc}");
    assert!(text(&r).contains("hibernated"), "the wake is told: {}", text(&r));
    let (r, sc) = call(&alice, "restore_session", json!({ "snapshot": "before", "session": "copy" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = sc;
    let sc = run(&alice, "copy", "x").await;
    assert_eq!(sc["result"], "42", "{sc}");
    // "gone" was last used before the restart: its TTL runs from then, not from the adoption.
    while state_of(&alice, "gone").await.is_some() {
        assert!(slept.elapsed() < Duration::from_secs(60), "the sleeper never expired");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(slept.elapsed() < Duration::from_secs(40), "expired at its TTL: {:?}", slept.elapsed());
    for s in ["nap", "copy"] {
        let (r, _) = call(&alice, "close_session", json!({ "session": s })).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
    }
    let (r, _) = call(&alice, "delete_snapshot", json!({ "snapshot": "before" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
}

/// A stream that drops mid-run still ends that run: the server reattaches to the same
/// interpreter and reads the rest of the run's events, its result included.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_dropped_mid_run_still_ends_that_run() {
    let state = StateDir::new("adopt-midrun");
    let s = Server::start("adopt-midrun", &state, &[("PYBERTH_ADOPT_GRACE_S", "0")]).await;
    let alice = s.client().await;
    run(&alice, "keep", SETUP).await;
    let code = "import time\nfor i in range(8):\n    print('tick', i, flush=True)\n    time.sleep(0.5)\n('done', x)";
    let running = call(&alice, "run_python", json!({ "session": "keep", "code": code }));
    let killing = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        kill_relay(&s.instance).await;
    };
    let ((r, sc), ()) = tokio::join!(running, killing);
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["status"], "ok", "{sc}");
    assert_eq!(sc["result"], "('done', 42)", "the run's own result, read after the drop: {sc}");
    assert!(sc["stdout"].as_str().is_some_and(|o| o.contains("tick 7")), "output after the drop: {sc}");
    assert!(!sc.to_string().contains("variables are gone"), "no state lost said: {sc}");
    assert!(s.log().contains("reattached to the interpreter"), "the server says it reattached");
    let sc = run(&alice, "keep", CHECK).await;
    assert_eq!(sc["result"], INTACT, "{sc}");
    let _ = alice.cancel().await;
    let inst = s.signal("-TERM").await;
    assert_cleaned_up(&inst).await;
}

/// Runs `code` in the egress session `e` of environment `net`, narrowed to the upstream's
/// pinned names when it is made (`create`).
async fn run_net(client: &RunningService<RoleClient, Recorder>, code: &str, create: bool) -> Value {
    let mut args = json!({ "session": "e", "environment": "net", "code": code, "timeout_s": 60 });
    if create {
        args["allow_hosts"] = json!(["upstream.test:8000", "*.wild.test:8000"]);
    }
    let (r, sc) = call(client, "run_python", args).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    sc
}

/// A session with egress (narrowed with `allow_hosts`, then `set_network`) left running, then adopted: `tamper`
/// edits its record before the restart; fetches after it give up after `wait_s`. Returns the
/// second run's result after the restart,
/// having closed the session and checked nothing is left of either server.
async fn egress_across_a_restart(tag: &str, wait_s: u32, tamper: impl Fn(&mut Value)) -> (Value, String) {
    use crate::egress::{Upstream, config_file, fetch, fetch_within, networks_of};
    let up = Upstream::start(&instance_name(tag)).await;
    let config = config_file(tag, &up);
    let env = [("PYBERTH_CONFIG", config.to_str().expect("utf-8 path")), ("EGRESS_TEST_SECRET", crate::egress::SECRET)];
    let state = StateDir::new(tag);
    let first = Server::start(tag, &state, &env).await;
    let alice = first.client().await;
    let ca = "open('/tmp/.pyberth-egress/ca.pem').read()";
    let sc =
        run_net(&alice, &format!("{}\nkept = 7\nca0 = {ca}", fetch("http://upstream.test:8000/before")), true).await;
    assert!(sc["stdout"].as_str().unwrap_or_default().starts_with("200 upstream ok /before"), "{sc}");
    // Narrowed again: this list, not the one at creation, is what the next server puts back.
    let (r, _) = call(&alice, "set_network", json!({ "session": "e", "allow_hosts": ["upstream.test:8000"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;
    // The record keeps the narrowed list and the network, never a header value.
    let records: Vec<_> = std::fs::read_dir(state.0.join("sessions")).expect("records").flatten().collect();
    assert_eq!(records.len(), 1);
    let path = records[0].path();
    let raw = std::fs::read_to_string(&path).expect("record");
    assert!(!raw.contains(crate::egress::SECRET), "{raw}");
    let mut record: Value = serde_json::from_str(&raw).expect("json");
    assert_eq!(record["egress"]["allow"], json!(["upstream.test:8000"]), "{record}");
    tamper(&mut record);
    std::fs::write(&path, record.to_string()).expect("record");

    let second = Server::start(tag, &state, &env).await;
    assert!(second.log().contains("adopted"), "the new server says it adopted sessions");
    // Its network, labelled by the stopped server, lives on while the session does.
    assert_eq!(networks_of(&old).await.len(), 1, "the session's network is kept");
    let alice = second.client().await;
    let code = format!(
        "{}\n{}\nprint('kept', kept, 'new ca', {ca} != ca0)",
        fetch_within("http://upstream.test:8000/after", wait_s),
        fetch_within("http://a.wild.test:8000/", wait_s)
    );
    let sc = run_net(&alice, &code, false).await;
    let log = second.log();
    let (r, _) = call(&alice, "close_session", json!({ "session": "e" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
    assert!(networks_of(&old).await.is_empty() && networks_of(&new).await.is_empty(), "networks left");
    (sc, log)
}

/// The adopting server's proxy takes the session's network over at the old proxy's address,
/// with the narrowed list, the operator's header and its own new CA in the session.
#[tokio::test(flavor = "multi_thread")]
async fn an_adopted_session_keeps_its_egress_and_its_narrowed_list() {
    use sha2::Digest as _;
    if crate::common::gvisor() {
        return; // no egress under gVisor: egress::egress_under_gvisor_is_a_clear_error
    }
    let (sc, log) = egress_across_a_restart("adopt-egress", 20, |_| {}).await;
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.starts_with("200 upstream ok /after"), "the allowed upstream is reached: {sc}");
    let sha = format!("{:x}", sha2::Sha256::digest(format!("key-{}", crate::egress::SECRET).as_bytes()));
    assert!(out.contains(&format!("key-sha256: {sha}")), "the operator's header still arrives: {sc}");
    assert!(out.contains("403 pyberth egress: a.wild.test:8000 denied"), "the narrowed list holds: {sc}");
    assert!(out.contains("kept 7 new ca True"), "same variables, the new server's CA: {sc}");
    assert!(log.contains("egress of the adopted session taken over"), "{log}");
}

/// When the proxy cannot be put back where the session expects it (here: the record names
/// another address), the session reaches nothing and each run says why.
#[tokio::test(flavor = "multi_thread")]
async fn an_adopted_session_whose_egress_is_lost_says_so_and_reaches_nothing() {
    if crate::common::gvisor() {
        return;
    }
    let (sc, _) =
        egress_across_a_restart("adopt-egress-lost", 4, |r| r["egress"]["proxy_ip"] = json!("10.255.255.254")).await;
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.starts_with("ERR") && !out.contains("upstream ok"), "nothing is reached: {sc}");
    let notices = sc["notices"].to_string();
    assert!(notices.contains("network access was lost when the server restarted"), "{sc}");
    assert!(out.contains("kept 7"), "the session itself is kept: {sc}");
}

/// A session with egress that hibernated before the restart wakes under the next server on a
/// network of that server's, with the list in force when it slept (never wider), the
/// operator's header, and its variables; the old server's network is gone with it.
#[tokio::test(flavor = "multi_thread")]
async fn a_hibernated_session_with_egress_wakes_with_its_list_after_a_restart() {
    use crate::egress::{Upstream, config_file, fetch, networks_of};
    use sha2::Digest as _;
    if crate::common::gvisor() {
        return; // no egress under gVisor: egress::egress_under_gvisor_is_a_clear_error
    }
    let tag = "adopt-egress-sleep";
    let up = Upstream::start(&instance_name(tag)).await;
    let config = config_file(tag, &up);
    let cfg = config.to_str().expect("utf-8 path");
    let state = StateDir::new(tag);
    let secret = ("EGRESS_TEST_SECRET", crate::egress::SECRET);
    let first =
        Server::start(tag, &state, &[("PYBERTH_CONFIG", cfg), secret, ("PYBERTH_HIBERNATE_AFTER_S", "1")]).await;
    let alice = first.client().await;
    let sc = run_net(&alice, &format!("{}\nkept = 7", fetch("http://upstream.test:8000/before")), true).await;
    assert!(sc["stdout"].as_str().unwrap_or_default().starts_with("200 upstream ok /before"), "{sc}");
    let (r, _) = call(&alice, "set_network", json!({ "session": "e", "allow_hosts": ["upstream.test:8000"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let deadline = Instant::now() + Duration::from_secs(30);
    while state_of(&alice, "e").await != Some(json!("hibernated")) {
        assert!(Instant::now() < deadline, "not hibernated");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;
    let sleepers: Vec<_> = std::fs::read_dir(state.0.join("sleepers")).expect("sleepers").flatten().collect();
    assert_eq!(sleepers.len(), 1, "one sleeper recorded");
    let raw = std::fs::read_to_string(sleepers[0].path()).expect("record");
    assert!(!raw.contains(crate::egress::SECRET), "no header value in the record: {raw}");

    let second = Server::start(tag, &state, &[("PYBERTH_CONFIG", cfg), secret]).await;
    let alice = second.client().await;
    assert_eq!(state_of(&alice, "e").await, Some(json!("hibernated")), "the sleeper is carried over");
    let code = format!(
        "{}\n{}\nprint('kept', kept)",
        fetch("http://upstream.test:8000/after"),
        fetch("http://a.wild.test:8000/")
    );
    let sc = run_net(&alice, &code, false).await;
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.starts_with("200 upstream ok /after"), "the woken session reaches its upstream: {sc}");
    let sha = format!("{:x}", sha2::Sha256::digest(format!("key-{}", crate::egress::SECRET).as_bytes()));
    assert!(out.contains(&format!("key-sha256: {sha}")), "the operator's header still arrives: {sc}");
    assert!(out.contains("403 pyberth egress: a.wild.test:8000 denied"), "the list it slept with holds: {sc}");
    assert!(out.contains("kept 7"), "woken with its variables: {sc}");
    let (r, _) = call(&alice, "close_session", json!({ "session": "e" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
    assert!(networks_of(&old).await.is_empty() && networks_of(&new).await.is_empty(), "networks left");
}
