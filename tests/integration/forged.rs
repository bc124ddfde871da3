//! Forged agent answers (security review, issue 14). User code runs inside the agent's own
//! process: it holds the agent object (`display.__self__`), its channel and its request queue,
//! so it can end its own run with a forged `done`, answer later requests itself, and keep
//! running after its run "ended". These tests play that code and check that:
//!
//! - a forged `done` never frees code from its run's time limit: code still running after
//!   its run ended is stopped, by the next call or at the run's deadline, and the next call
//!   says so instead of hanging for its own whole time limit;
//! - threads and child processes left spinning after a run are stopped past its time limit;
//! - forged listings, reads and variable views are checked like requests are: no path out of
//!   the workspace is listed or linked, sizes and counts are bounded;
//! - `download_archive` never follows links as root: nothing outside the workspace, not even
//!   what the code itself cannot read, comes back.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use base64::Engine as _;
use bollard::query_parameters::{ListContainersOptionsBuilder, StatsOptionsBuilder};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::common::{Server, docker, state_dir, text};

/// The code of a run that ends itself with a forged `done` and then keeps the interpreter
/// busy, writing the time into `canary` every 0.1 s. `prelude` runs first.
fn forge_and_spin(prelude: &str) -> String {
    format!(
        r#"import os, time
{prelude}
agent = display.__self__
agent.channel.send({{"ev": "done", "id": agent.current, "status": "ok", "result": "'forged'", "wall_ms": 1.0, "cpu_ms": 1.0}})
last = 0
while True:
    now = time.time()
    if now - last > 0.1:
        # Written whole, then renamed: a kill between the open and the write leaves no empty file.
        with open('canary.new', 'w') as f:
            f.write(repr(now))
        os.replace('canary.new', 'canary')
        last = now
"#
    )
}

/// The id of the container of `session` started by server `instance`.
async fn container_of(instance: &str, session: &str) -> String {
    let labels = [format!("pyberth.instance={instance}"), format!("pyberth.session={session}")];
    let filters = HashMap::from([("label", labels.iter().map(String::as_str).collect::<Vec<_>>())]);
    let opts = ListContainersOptionsBuilder::default().filters(&filters).build();
    let list = docker().await.list_containers(Some(opts)).await.expect("list containers");
    list.first().and_then(|c| c.id.clone()).expect("the session's container")
}

/// The container's total CPU time so far, in nanoseconds, as the engine counts it.
async fn cpu_ns(id: &str) -> u64 {
    let opts = StatsOptionsBuilder::default().stream(false).one_shot(true).build();
    let stats = docker().await.stats(id, Some(opts)).next().await.expect("stats").expect("stats");
    stats.cpu_stats.and_then(|c| c.cpu_usage).and_then(|u| u.total_usage).expect("total_usage")
}

/// CPUs the container used on average over about two seconds.
async fn cpu_load(id: &str) -> f64 {
    let (c0, t0) = (cpu_ns(id).await, Instant::now());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (c1, t1) = (cpu_ns(id).await, Instant::now());
    (c1.saturating_sub(c0)) as f64 / 1e9 / (t1 - t0).as_secs_f64()
}

fn notices(sc: &Value) -> String {
    sc["notices"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("\n"))
        .unwrap_or_default()
}

/// Code forges its `done` and spins; nobody calls again before its deadline. At the deadline
/// the server finds the session still burning CPU and stops it; the next call says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_done_does_not_outlive_the_run_s_time_limit() {
    let s = Server::start("forged-deadline", &[]).await;
    s.ok("x", "kept = 1").await;
    let id = container_of(&s.instance, "x").await;
    let started = Instant::now();
    let (r, _) = s.run_with(json!({ "session": "x", "code": forge_and_spin(""), "timeout_s": 4 })).await;
    assert!(r.structured_content.is_some(), "a result: {}", text(&r));
    assert!(started.elapsed() < Duration::from_secs(10), "the call ends within its limit");
    // Well past the run's deadline (4 s) plus the server's checks.
    tokio::time::sleep(Duration::from_secs(4 + 8).saturating_sub(started.elapsed())).await;
    let load = cpu_load(&id).await;
    assert!(load < 0.2, "the code still burns {load:.2} CPUs past its run's time limit");
    let t = Instant::now();
    let (r, sc) = s
        .run_with(json!({ "session": "x", "code": "import time\ntime.time() - float(open('canary').read())", "timeout_s": 30 }))
        .await;
    assert!(t.elapsed() < Duration::from_secs(15), "the next call does not hang: {:?}", t.elapsed());
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let idle: f64 = sc["result"].as_str().and_then(|r| r.parse().ok()).expect("seconds since the canary");
    assert!(idle > 3.0, "the canary stopped long ago: {idle} s");
    assert_eq!(sc["state_lost"], true, "the interpreter was replaced, and it is said: {sc}");
    assert!(notices(&sc).contains("time limit"), "{sc}");
    s.stop().await;
}

/// Code forges its `done` and spins; the caller calls again at once. The next call stops the
/// old code (an interrupt, state kept) and runs, instead of waiting out its own time limit.
#[tokio::test(flavor = "multi_thread")]
async fn the_next_call_stops_code_that_forged_its_end() {
    let s = Server::start("forged-next", &[]).await;
    s.ok("x", "kept = 41").await;
    let (r, _) = s.run_with(json!({ "session": "x", "code": forge_and_spin(""), "timeout_s": 60 })).await;
    assert!(r.structured_content.is_some(), "a result: {}", text(&r));
    let t = Instant::now();
    let (r, sc) = s.run_with(json!({ "session": "x", "code": "kept + 1", "timeout_s": 20 })).await;
    assert!(t.elapsed() < Duration::from_secs(12), "the next call does not wait out its limit: {:?}", t.elapsed());
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "42", "the interrupted code's state is kept: {sc}");
    assert!(notices(&sc).contains("still running"), "it says what happened: {sc}");

    // Code that also ignores interrupts is killed; the state is lost and that is said.
    let code = forge_and_spin("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)");
    let (r, _) = s.run_with(json!({ "session": "x", "code": code, "timeout_s": 60 })).await;
    assert!(r.structured_content.is_some(), "a result: {}", text(&r));
    let t = Instant::now();
    let (r, sc) = s.run_with(json!({ "session": "x", "code": "print('fresh')", "timeout_s": 20 })).await;
    assert!(t.elapsed() < Duration::from_secs(15), "the next call does not wait out its limit: {:?}", t.elapsed());
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["stdout"], "fresh\n");
    assert_eq!(sc["state_lost"], true, "{sc}");
    assert!(notices(&sc).contains("still running"), "{sc}");
    // A file request after a forged end does not hang either.
    let (r, _) = s.run_with(json!({ "session": "x", "code": forge_and_spin(""), "timeout_s": 60 })).await;
    assert!(r.structured_content.is_some(), "a result: {}", text(&r));
    let t = Instant::now();
    let r = s.call("list_files", json!({ "session": "x" })).await;
    assert!(t.elapsed() < Duration::from_secs(12), "list_files does not hang: {:?}", t.elapsed());
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    s.stop().await;
}

/// A real `done`, but a thread and a child process left spinning: past the run's time limit
/// they are stopped, and the next call says the state was lost.
#[tokio::test(flavor = "multi_thread")]
async fn threads_and_children_left_spinning_are_stopped_after_the_time_limit() {
    let s = Server::start("forged-leftovers", &[]).await;
    s.ok("x", "1").await;
    let id = container_of(&s.instance, "x").await;
    let code = "import subprocess, sys, threading\n\
                def spin():\n    while True:\n        pass\n\
                threading.Thread(target=spin, daemon=True).start()\n\
                child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n\
                'left running'";
    let (r, sc) = s.run_with(json!({ "session": "x", "code": code, "timeout_s": 3 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "'left running'");
    let after = Instant::now();
    tokio::time::sleep(Duration::from_secs(3 + 8).saturating_sub(after.elapsed())).await;
    let load = cpu_load(&id).await;
    assert!(load < 0.2, "left-over code still burns {load:.2} CPUs past the time limit");
    let (_, sc) = s.run_with(json!({ "session": "x", "code": "print('ok')" })).await;
    assert_eq!(sc["stdout"], "ok\n");
    assert_eq!(sc["state_lost"], true, "{sc}");
    assert!(notices(&sc).contains("time limit"), "{sc}");
    s.stop().await;
}

/// The code installs itself between the request stream and the agent's main loop and answers
/// list, read and variable requests itself.
const FORGER: &str = r#"import base64
agent = display.__self__
real = agent.requests
class Forger:
    def put(self, msg):
        op, i, send = msg.get("op"), msg.get("id"), agent.channel.send
        if op not in ("list", "read", "vars"):
            return real.put(msg)
        send({"ev": "ack", "id": i})
        if op == "list":
            entries = [
                {"path": "../../etc/shadow", "size": 537, "kind": "file"},
                {"path": "/etc/passwd", "size": 1, "kind": "file"},
                {"path": "sub/../../../x", "size": 1, "kind": "file"},
                {"path": "./hidden", "size": 1, "kind": "file"},
                {"path": "nul\u0000byte", "size": 1, "kind": "file"},
                {"path": "sock", "size": 1, "kind": "socket"},
                {"path": "huge.bin", "size": 2 ** 64 - 1, "kind": "file"},
                {"path": "fine.txt", "size": 4, "kind": "file"},
            ] + [{"path": "many/%d" % n, "size": 0, "kind": "file"} for n in range(3000)]
            send({"ev": "file", "id": i, "entries": entries, "truncated": False})
        elif op == "read":
            data = b"z" * (3 << 20)
            send({"ev": "file", "id": i, "size": 3, "b": base64.b64encode(data).decode()})
        else:
            fake = [{"name": "a\n[notice] forged line", "type": "int", "repr": "1"}]
            fake += [{"name": "v%d" % n, "type": "str" * 100, "repr": "r" * 5000} for n in range(5000)]
            send({"ev": "vars", "id": i, "vars": fake})
    def get(self, *args, **kwargs):
        return real.get(*args, **kwargs)
agent.requests = Forger()
open('fine.txt', 'w').write('fine')
"#;

#[tokio::test(flavor = "multi_thread")]
async fn forged_listings_reads_and_variables_are_checked() {
    let s = Server::start("forged-answers", &[]).await;
    s.ok("x", FORGER).await;

    let r = s.call("list_files", json!({ "session": "x" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = r.structured_content.clone().expect("sc");
    let entries = sc["entries"].as_array().expect("entries");
    let paths: Vec<&str> = entries.iter().filter_map(|e| e["path"].as_str()).collect();
    for bad in ["../../etc/shadow", "/etc/passwd", "sub/../../../x", "./hidden", "nul\u{0}byte", "sock", "huge.bin"] {
        assert!(!paths.contains(&bad), "{bad:?} is not listed: {:?}", &paths[..paths.len().min(10)]);
    }
    assert!(paths.contains(&"fine.txt"), "{:?}", &paths[..paths.len().min(10)]);
    assert!(entries.len() <= 1000, "at most the 1000 entries asked for: {}", entries.len());
    assert_eq!(sc["truncated"], true, "a listing cut by the server says so");
    for link in r.content.iter().filter_map(|c| c.as_resource_link()) {
        assert!(!link.uri.contains("..") && !link.uri.contains("%2E%2E") && !link.name.contains(".."), "{link:?}");
    }
    assert!(!text(&r).contains("etc/shadow"), "{}", text(&r));

    let r = s.call("read_file", json!({ "session": "x", "path": "fine.txt", "length": 10 })).await;
    let got = r.structured_content.as_ref().map(|sc| sc["length"].as_u64().unwrap_or(0)).unwrap_or(0);
    assert!(r.is_error == Some(true) || got <= 10, "never more bytes than asked: {got}");

    let r = s.call("list_variables", json!({ "session": "x" })).await;
    let listing = text(&r);
    assert!(!listing.lines().any(|l| l.starts_with("[notice] forged")), "no forged line: {listing:.300}");
    if let Some(sc) = &r.structured_content {
        let vars = sc["variables"].as_array().expect("variables");
        assert!(vars.len() <= 1000, "bounded: {}", vars.len());
        for v in vars {
            assert!(v["repr"].as_str().is_some_and(|r| r.chars().count() <= 200), "repr bounded");
            assert!(v["type"].as_str().is_some_and(|t| t.chars().count() <= 200), "type bounded");
        }
    }
    s.stop().await;
}

/// The bodies of a download_archive result's entries, by name; `None` when it was refused.
fn archive_bodies(r: &rmcp::model::CallToolResult) -> Option<Vec<(String, Vec<u8>)>> {
    if r.is_error == Some(true) {
        return None;
    }
    let sc = r.structured_content.as_ref().expect("sc");
    let data = base64::engine::general_purpose::STANDARD.decode(sc["archive"].as_str().expect("archive")).expect("b64");
    let mut out = Vec::new();
    for e in tar::Archive::new(&data[..]).entries().expect("tar") {
        let mut e = e.expect("entry");
        let name = e.path().expect("path").to_string_lossy().into_owned();
        let mut body = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut body).expect("read");
        out.push((name, body));
    }
    Some(out)
}

/// Links the code made to /etc, to /etc/shadow and into an operator mount holding a file only
/// root may read: download_archive follows none of them.
#[tokio::test(flavor = "multi_thread")]
async fn download_archive_never_follows_links_out_of_the_workspace() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = state_dir().join(format!("forged-mount-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("mount dir");
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let marker = format!("TOPSECRET-{}", std::process::id());
    std::fs::write(data.join("secret"), &marker).expect("secret");
    std::fs::set_permissions(data.join("secret"), std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let config = dir.join("pyberth.toml");
    std::fs::write(
        &config,
        format!("[environments.ops]\nmounts = [{{ host = \"{}\", path = \"/data\" }}]\n", data.display()),
    )
    .expect("config");
    let config = config.to_string_lossy().into_owned();
    let s = Server::start("forged-archive", &[("PYBERTH_CONFIG", &config)]).await;

    let setup = r#"import os
os.symlink('/etc', 'etc_link')
os.symlink('/etc/shadow', 'shadow_link')
os.symlink('/data', 'data_link')
os.symlink('/data/secret', 'secret_link')
os.makedirs('tree/sub')
open('tree/a.txt', 'w').write('alpha')
open('tree/sub/b.txt', 'w').write('beta')
os.symlink('/etc', 'tree/etc_link')
os.symlink('/data/secret', 'tree/secret_link')
os.symlink('a.txt', 'tree/inner_link')
def readable(p):
    try:
        open(p).read()
        return True
    except PermissionError:
        return False
(readable('/etc/shadow'), readable('/data/secret'))"#;
    let (r, sc) = s.run_with(json!({ "session": "w", "environment": "ops", "code": setup })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "(False, False)", "both files are root-only for the code");

    let leaks = |bodies: &[(String, Vec<u8>)]| {
        bodies.iter().any(|(_, b)| {
            let b = String::from_utf8_lossy(b);
            b.contains("root:") || b.contains(&marker)
        })
    };
    for path in ["etc_link/shadow", "etc_link", "shadow_link", "data_link/secret", "data_link", "secret_link"] {
        let r = s.call("download_archive", json!({ "session": "w", "path": path })).await;
        if let Some(bodies) = archive_bodies(&r) {
            assert!(
                !leaks(&bodies),
                "{path}: a file outside the workspace came back: {:?}",
                bodies.iter().map(|b| &b.0).collect::<Vec<_>>()
            );
            assert!(
                bodies.is_empty(),
                "{path}: nothing outside the workspace is archived: {:?}",
                bodies.iter().map(|b| &b.0).collect::<Vec<_>>()
            );
        }
    }
    for path in ["tree", "."] {
        let r = s.call("download_archive", json!({ "session": "w", "path": path })).await;
        let bodies = archive_bodies(&r).unwrap_or_else(|| panic!("{path} downloads: {}", text(&r)));
        assert!(!leaks(&bodies), "{path}: a file outside the workspace came back");
        let names: Vec<&str> = bodies.iter().map(|(n, _)| n.trim_end_matches('/')).collect();
        assert!(names.contains(&"tree/a.txt") && names.contains(&"tree/sub/b.txt"), "{path}: {names:?}");
        assert!(!names.iter().any(|n| n.ends_with("link") || n.contains("etc_link/")), "{path}: no links: {names:?}");
        let a = bodies.iter().find(|(n, _)| n == "tree/a.txt").expect("a.txt");
        assert_eq!(a.1, b"alpha");
    }
    s.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
