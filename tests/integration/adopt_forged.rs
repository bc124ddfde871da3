//! Adoption under attack (issue 27, "Also"): code in a sandbox takes over its keeper's socket
//! with a process of its own, which answers the next server's reattach with a forged hello
//! (the recorded pid, or another) and then junk frames. After a SIGTERM restart the next
//! server must stay up, keep the session its principal's, answer with a tool result (never a
//! protocol error), and never present the junk as the old interpreter's answer: the session
//! goes on with a fresh interpreter whose variables are gone.
//!
//! What holds by construction, not by check: a hello with the recorded pid is taken for the
//! old interpreter (the server logs "reattached"); only what the impostor says next tells.
//! An impostor that answered well would be believed, but it is the session's own code lying
//! to its own caller, which code inside the interpreter can do anyway (see `forged.rs`).
//! Records live in the host's state dir, which no container mounts: files planted in the
//! workspace under the records' names change nothing.

use std::time::Duration;

use serde_json::json;

use crate::adopt::{Server, StateDir, run};
use crate::common::{assert_cleaned_up, text};
use crate::http::call;

/// The impostor: unlinks the keeper's socket and binds its own, answers one attach with a
/// hello carrying `pid`, then junk after the first request: lines that are not JSON, a
/// `done` for another id, a long line, a frame of an unknown kind declaring 2 GiB; then it
/// closes and removes its socket so that a later attach starts a real keeper.
const IMPOSTOR: &str = r#"
import json, os, socket, struct, sys
P = "/tmp/.pyberth-keeper/sock"
pid = int(sys.argv[1])
python = sys.argv[2]
H = struct.Struct(">cI")
def fr(k, d):
    return H.pack(k, len(d)) + d
try:
    os.unlink(P)
except FileNotFoundError:
    pass
l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
l.bind(P)
l.listen(4)
open("/tmp/impostor-ready", "w").close()
c, _ = l.accept()
hello = json.dumps({"ev": "hello", "protocol": 2, "python": python, "pid": pid}).encode() + b"\n"
if python == "out-first":
    hello = json.dumps({"ev": "out", "id": None, "s": "stdout", "t": "C" * (4 << 20)}).encode() + b"\n"
# In frames of 64 KiB, as a keeper sends them (a relay refuses longer frames).
c.sendall(b"".join(fr(b"1", hello[i:i + 65536]) for i in range(0, len(hello), 65536)))
c.settimeout(60)
try:
    c.recv(65536)
except OSError:
    pass
junk = b"\xff\xfe{not json\n" + json.dumps({"ev": "done", "id": 999999, "status": "ok", "result": "'forged'"}).encode() + b"\n"
junk += b"A" * 70000 + b"\n"
try:
    c.sendall(fr(b"1", junk) + fr(b"2", b"\x1b[2Jforged stderr\n") + H.pack(b"z", 1 << 31) + b"zz")
except OSError:
    pass
try:
    os.unlink(P)
except OSError:
    pass
c.close()
l.close()
"#;

/// Plants the impostor from inside the session (as the code's own uid), hello pid = `pid`
/// (`None`: the interpreter's own, the one the record holds) and Python version `python`.
fn plant(pid: Option<u32>, python: &str) -> String {
    let pid = pid.map_or_else(|| "os.getpid()".to_string(), |p| p.to_string());
    format!(
        "import os, subprocess, sys, time\nopen('/tmp/impostor.py', 'w').write({IMPOSTOR:?})\n\
         subprocess.Popen([sys.executable, '-I', '/tmp/impostor.py', str({pid}), {python:?}], start_new_session=True,\n\
         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n\
         for _ in range(100):\n    if os.path.exists('/tmp/impostor-ready'):\n        break\n    time.sleep(0.05)\n\
         os.path.exists('/tmp/impostor-ready')"
    )
}

async fn impostor_answers_the_reattach(tag: &str, pid: Option<u32>, python: &str) -> String {
    let state = StateDir::new(tag);
    let first = Server::start(tag, &state, &[]).await;
    let alice = first.client().await;
    run(&alice, "victim", "x = 42").await;
    let sc = run(&alice, "victim", &plant(pid, python)).await;
    assert_eq!(sc["result"], "True", "the impostor listens: {sc}");
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;

    let second = Server::start(tag, &state, &[]).await;
    let alice = second.client().await;
    let (_, sc) = call(&alice, "list_sessions", json!({})).await;
    assert!(sc.to_string().contains("\"victim\""), "the session is still alice's: {sc}");
    // The reattach meets the impostor: a tool result, never the junk as an answer.
    let (r, sc) = call(&alice, "run_python", json!({ "session": "victim", "code": "x" })).await;
    let said = format!("{} {sc}", text(&r));
    eprintln!("first call after the restart, impostor answering: {said}");
    assert_ne!(sc["result"], "'forged'", "a forged done is not the answer: {said}");
    assert_ne!(sc["result"], "42", "the impostor cannot have answered with the old state: {said}");
    assert!(
        r.is_error == Some(true) || said.contains("variables are gone"),
        "the call says that the interpreter it reached is not the recorded one: {said}"
    );
    assert!(second.log().contains("victim"), "the server logged the session");
    assert!(!second.log().contains(FORGED_LOG_LINE), "the impostor wrote no line of the server's log");
    // The server stays up, and the session goes on with a fresh interpreter.
    let health = crate::common::web().get(format!("http://127.0.0.1:{}/healthz", second.port())).send().await;
    assert!(health.is_ok_and(|h| h.status().is_success()), "the server stays up");
    let mut last = String::new();
    for _ in 0..3 {
        let (r, sc) = call(&alice, "run_python", json!({ "session": "victim", "code": "1 + 1" })).await;
        if r.is_error == Some(false) && sc["result"] == "2" {
            last.clear();
            break;
        }
        last = format!("{} {sc}", text(&r));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(last.is_empty(), "the session works again with a fresh interpreter: {last}");
    let (r, sc) = call(&alice, "run_python", json!({ "session": "victim", "code": "x" })).await;
    assert_eq!(r.is_error, Some(true), "the variables are gone: {sc}");
    let (r, _) = call(&alice, "close_session", json!({ "session": "victim" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let log = second.log();
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
    log
}

#[tokio::test(flavor = "multi_thread")]
async fn an_impostor_keeper_with_the_recorded_pid_and_junk_costs_only_the_interpreter() {
    impostor_answers_the_reattach("adopt-forged-pid", None, "3.99.0").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_impostor_keeper_with_another_pid_and_junk_costs_only_the_interpreter() {
    impostor_answers_the_reattach("adopt-forged-other", Some(1), "3.99.0").await;
}

/// A line the impostor tries to add to the server's log through its hello's `python`.
const FORGED_LOG_LINE: &str = "2020-01-01T00:00:00.000000Z  INFO pyberth::egress: allowed host=\"forged\"";

#[tokio::test(flavor = "multi_thread")]
async fn an_impostor_hello_cannot_write_the_servers_log_or_the_sessions_record() {
    // The version is the code's to say: a new line with a log line of its own, then 64 KiB.
    let python = format!("3.11.2\n{FORGED_LOG_LINE}\n{}", "B".repeat(64 << 10));
    let log = impostor_answers_the_reattach("adopt-forged-hello", None, &python).await;
    assert!(!log.contains(&"B".repeat(1024)), "a forged version is not written to the log at length");
}

#[tokio::test(flavor = "multi_thread")]
async fn records_planted_in_the_workspace_change_nothing_after_a_restart() {
    let tag = "adopt-forged-records";
    let state = StateDir::new(tag);
    let first = Server::start(tag, &state, &[]).await;
    let alice = first.client().await;
    // Forged records under every name the state dir uses, saying another principal, a wide
    // egress list and another environment, in the workspace and under /tmp.
    let plant = r#"import json, os
x = 42
forged = {"instance": "x", "principal": "bob", "name": "stolen", "environment": "datascience",
          "egress": {"network": "host", "proxy_ip": "127.0.0.1", "allow": ["*", "0.0.0.0/0"]}, "pid": 1}
for d in ("sessions", "snapshots", "jobs", ".pyberth/sessions", "/tmp/sessions"):
    os.makedirs(d, exist_ok=True)
    for n in ("forged.json", "victim.json", "stolen.json"):
        json.dump(forged, open(os.path.join(d, n), "w"))
len(os.listdir("sessions"))"#;
    let sc = run(&alice, "victim", plant).await;
    assert_eq!(sc["result"], "3", "{sc}");
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;
    let second = Server::start(tag, &state, &[]).await;
    let alice = second.client().await;
    let (_, sc) = call(&alice, "list_sessions", json!({})).await;
    let names: Vec<&str> =
        sc["sessions"].as_array().map_or_else(Vec::new, |a| a.iter().filter_map(|s| s["session"].as_str()).collect());
    assert_eq!(names, vec!["victim"], "only the recorded session comes back: {sc}");
    assert_ne!(sc["sessions"][0]["environment"], "datascience", "its environment is the recorded one: {sc}");
    let sc = run(&alice, "victim", "x").await;
    assert_eq!(sc["result"], "42", "the real interpreter is reattached: {sc}");
    let (r, _) = call(&alice, "close_session", json!({ "session": "victim" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_impostor_whose_first_line_is_4_mib_of_output_does_not_flood_the_log() {
    let log = impostor_answers_the_reattach("adopt-forged-first", None, "out-first").await;
    assert!(!log.contains(&"C".repeat(1024)), "the first event is not written to the log at length");
    assert!(log.len() < 1 << 20, "the server log stays small: {} bytes", log.len());
}

/// What code with egress can reach of its own egress before a restart: the CA directory the
/// server writes into as root (on the sticky /tmp: not the code's to move or replace), its
/// own environment variables, the keeper's socket. None of it widens the next server's list.
#[tokio::test(flavor = "multi_thread")]
async fn code_cannot_widen_its_egress_across_a_restart() {
    use crate::common::instance_name;
    use crate::egress::{Upstream, config_file, fetch};
    if crate::common::gvisor() {
        return; // no egress under gVisor: egress::egress_under_gvisor_is_a_clear_error
    }
    let tag = "adopt-forged-egress";
    let up = Upstream::start(&instance_name(tag)).await;
    let config = config_file(tag, &up);
    let env = [("PYBERTH_CONFIG", config.to_str().expect("utf-8 path")), ("EGRESS_TEST_SECRET", crate::egress::SECRET)];
    let state = StateDir::new(tag);
    let first = Server::start(tag, &state, &env).await;
    let alice = first.client().await;
    let args = json!({ "session": "e", "environment": "net", "allow_hosts": ["upstream.test:8000"],
                       "code": fetch("http://upstream.test:8000/before"), "timeout_s": 60 });
    let (r, sc) = call(&alice, "run_python", args).await;
    assert!(text(&r).contains("200 upstream ok /before"), "{sc}");
    let tamper = r#"import os
tried = []
for what, f in [("rename", lambda: os.rename("/tmp/.pyberth-egress", "/tmp/moved")),
                ("plant", lambda: open("/tmp/.pyberth-egress/.ca.tmp", "w")),
                ("symlink", lambda: os.symlink("/tmp/mine", "/tmp/.pyberth-egress/ca.pem.new"))]:
    try:
        f()
        tried.append(what + " done")
    except OSError as e:
        tried.append(what + " refused")
saved = {k: os.environ.get(k) for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy")}
for k in saved:
    os.environ[k] = "*"
print(tried)"#;
    let (r, _) = call(&alice, "run_python", json!({ "session": "e", "code": tamper })).await;
    assert!(text(&r).contains("['rename refused', 'plant refused', 'symlink refused']"), "{}", text(&r));
    let _ = alice.cancel().await;
    let old = first.signal("-TERM").await;

    let second = Server::start(tag, &state, &env).await;
    let alice = second.client().await;
    // First with the proxy bypassed (the variables the code set are still its own), then
    // through the proxy again.
    let restore = "for k, v in saved.items():\n    if v is None:\n        os.environ.pop(k, None)\n    else:\n        os.environ[k] = v";
    let code = format!(
        "{}\n{restore}\n{}\n{}",
        fetch("http://a.wild.test:8000/direct"),
        fetch("http://upstream.test:8000/after"),
        fetch("http://a.wild.test:8000/")
    );
    let (r, sc) = call(&alice, "run_python", json!({ "session": "e", "code": code, "timeout_s": 60 })).await;
    let out = text(&r);
    assert!(out.starts_with("ERR"), "bypassing the proxy reaches nothing: {sc}");
    assert!(!out.contains("upstream ok /direct"), "bypassing the proxy reaches nothing: {sc}");
    assert!(out.contains("200 upstream ok /after"), "the allowed upstream is reached: {sc}");
    assert!(out.contains("403 pyberth egress: a.wild.test:8000 denied"), "the narrowed list holds: {sc}");
    let (r, _) = call(&alice, "close_session", json!({ "session": "e" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    let new = second.signal("-TERM").await;
    assert_cleaned_up(&old).await;
    assert_cleaned_up(&new).await;
}
