//! The audit log (issue 32): one JSON line per event of a scripted session, with its fields;
//! bounded under a hostile session's flood; never a token, an egress header value, code or
//! output; refused on stdout over stdio.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use sha2::Digest as _;

use crate::common::{Server, gvisor, instance_name, state_dir, text};
use crate::egress::{SECRET, Upstream, config_file};
use crate::http::{ALICE, BOB, HttpServer, call};

/// A fresh directory for one test's audit log.
fn log_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pyberth-audit-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("audit dir");
    d
}

/// Every line of the audit log files in `dir` (rotated ones first), each parsed.
fn records(dir: &Path) -> (String, Vec<Value>) {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir).expect("list").flatten().map(|e| e.path()).collect();
    names.sort_by_key(|p| std::cmp::Reverse(p.to_string_lossy().into_owned()));
    let mut all = String::new();
    for p in names {
        all.push_str(&std::fs::read_to_string(&p).expect("read audit log"));
    }
    let lines =
        all.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect();
    (all, lines)
}

fn of<'a>(lines: &'a [Value], event: &str) -> Vec<&'a Value> {
    lines.iter().filter(|v| v["event"] == event).collect()
}

fn sha256(s: &str) -> String {
    sha2::Sha256::digest(s.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// The common fields of every record.
fn assert_common(v: &Value) {
    let time = v["time"].as_str().unwrap_or_default();
    assert!(time.len() == 24 && time.ends_with('Z') && time.as_bytes()[10] == b'T', "RFC 3339 time: {v}");
    for key in ["event", "principal", "outcome"] {
        assert!(v[key].as_str().is_some_and(|s| !s.is_empty()), "{key} in {v}");
    }
    assert!(v.get("session").is_some(), "session (null when none): {v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_scripted_session_leaves_one_line_per_event_and_no_secret() {
    if gvisor() {
        return; // the egress part runs under runc; the rest is the same code
    }
    let tag = instance_name("audit-script");
    let up = Upstream::start(&tag).await;
    let config = config_file(&tag, &up);
    let dir = log_dir("script");
    let log = dir.join("audit.log");
    let env = [
        ("PYBERTH_CONFIG", config.to_str().expect("utf-8")),
        ("EGRESS_TEST_SECRET", SECRET),
        ("PYBERTH_AUDIT_LOG", log.to_str().expect("utf-8")),
    ];
    let s = Server::start_as(&tag, &env).await;
    let code = "print('canary-output-' + 'b41f')\nsecret_marker_in_code = 'code-canary-77aa'";
    s.ok("a", code).await;
    let fetch = "import urllib.request\n\
                 print(urllib.request.urlopen('http://upstream.test:8000/hi', timeout=20).read()[:20])\n\
                 try:\n    urllib.request.urlopen('http://not-allowed.test:8000/', timeout=20)\nexcept Exception as e:\n    print('refused', type(e).__name__)";
    let (r, _) = s.run_with(json!({ "session": "n", "environment": "net", "code": fetch, "timeout_s": 60 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("install_packages", json!({ "session": "a", "packages": ["pyberth-no-such-package-x9"] })).await;
    assert_eq!(r.is_error, Some(true), "a package that does not exist: {}", text(&r));
    let r = s.call("snapshot_session", json!({ "session": "a", "name": "snap1" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("restore_session", json!({ "snapshot": "snap1", "session": "b" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("fork_session", json!({ "session": "a", "new_session": "c" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("close_session", json!({ "session": "a" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    s.stop().await;

    let (raw, lines) = records(&dir);
    for v in &lines {
        assert_common(v);
    }
    let loaded = of(&lines, "config_loaded");
    assert_eq!(loaded.len(), 1, "{raw}");
    assert_eq!(loaded[0]["config_sha256"].as_str().map(str::len), Some(64), "{raw}");
    let created: Vec<&str> = of(&lines, "session_created").iter().filter_map(|v| v["session"].as_str()).collect();
    for name in ["a", "n", "b", "c"] {
        assert_eq!(created.iter().filter(|n| **n == name).count(), 1, "session {name} created once: {raw}");
    }
    let local = |v: &&Value| v["principal"] == "local";
    assert!(of(&lines, "session_created").iter().all(local), "{raw}");
    let started = of(&lines, "run_started");
    let ended = of(&lines, "run_ended");
    let a_started: Vec<_> = started.iter().filter(|v| v["session"] == "a").collect();
    assert_eq!(a_started.len(), 1, "{raw}");
    assert_eq!(a_started[0]["code_sha256"], sha256(code), "the hash of the code, not the code");
    let a_ended: Vec<_> = ended.iter().filter(|v| v["session"] == "a").collect();
    assert_eq!(a_ended.len(), 1, "{raw}");
    assert_eq!(a_ended[0]["outcome"], "ok");
    assert!(a_ended[0]["duration_ms"].as_u64().is_some(), "{raw}");
    let egress = of(&lines, "egress");
    assert_eq!(egress.len(), 1, "one summary for the run, not one per connection: {raw}");
    assert_eq!(egress[0]["session"], "n");
    assert!(egress[0]["allowed"].as_u64() >= Some(1) && egress[0]["refused"].as_u64() >= Some(1), "{raw}");
    let install = of(&lines, "install");
    assert_eq!(install.len(), 1, "{raw}");
    assert_eq!(install[0]["outcome"], "error");
    assert_eq!(install[0]["packages"], json!(["pyberth-no-such-package-x9"]));
    let snap = of(&lines, "snapshot");
    assert!(snap.len() == 1 && snap[0]["snapshot"] == "snap1" && snap[0]["outcome"] == "ok", "{raw}");
    assert!(snap[0]["bytes"].as_u64().is_some(), "{raw}");
    let restore = of(&lines, "restore");
    assert!(restore.len() == 1 && restore[0]["session"] == "b" && restore[0]["outcome"] == "ok", "{raw}");
    let fork = of(&lines, "fork");
    assert!(fork.len() == 1 && fork[0]["session"] == "c" && fork[0]["from"] == "a", "{raw}");
    let closed = of(&lines, "session_closed");
    assert!(closed.iter().any(|v| v["session"] == "a" && v["reason"] == "close_session"), "{raw}");
    for secret in [SECRET, "canary-output-b41f", "code-canary-77aa", "X-Api-Key"] {
        assert!(!raw.contains(secret), "{secret:?} is in the audit log");
    }
}

/// Python that makes N refused connections through the proxy from 32 threads (past a burst
/// the proxy answers each refusal late), then prints how many were answered.
const REFUSALS: &str = r#"
import os, socket, concurrent.futures
p = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
def one(i):
    try:
        s = socket.create_connection((p[0], int(p[1])), timeout=30)
        s.sendall(b"GET http://nowhere-%d.test:8000/ HTTP/1.1\r\n\r\n" % i)
        s.recv(100)
        s.close()
        return 1
    except Exception:
        return 0
with concurrent.futures.ThreadPoolExecutor(32) as ex:
    print(sum(ex.map(one, range(N))))
"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_flood_keeps_the_audit_log_within_its_bound() {
    let tag = instance_name("audit-flood");
    let dir = log_dir("flood");
    let log = dir.join("audit.log");
    let cfg_dir = state_dir().join(format!("audit-flood-{}", std::process::id()));
    std::fs::create_dir_all(&cfg_dir).expect("dir");
    let config = cfg_dir.join("pyberth.toml");
    std::fs::write(&config, "[environments.net]\negress = [\"upstream.test:8000\"]\n").expect("config");
    let env = [
        ("PYBERTH_CONFIG", config.to_str().expect("utf-8")),
        ("PYBERTH_AUDIT_LOG", log.to_str().expect("utf-8")),
        ("PYBERTH_AUDIT_LOG_MB", "1"),
        ("PYBERTH_AUDIT_LOG_KEEP", "1"),
    ];
    let s = Server::start_as(&tag, &env).await;
    let runs = 200;
    if !gvisor() {
        let code = REFUSALS.replace("range(N)", "range(1200)");
        let (r, sc) = s.run_with(json!({ "session": "f", "environment": "net", "code": code, "timeout_s": 300 })).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        assert!(sc["stdout"].as_str().is_some_and(|o| !o.starts_with('0')), "the flood ran: {sc}");
    }
    // Many runs, each a line at its start and its end: the log grows by records, never by
    // their output.
    for i in 0..runs {
        let (r, _) = s.run("many", &format!("print('x' * 100_000); {i}")).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
    }
    s.stop().await;
    let (raw, lines) = records(&dir);
    let files = std::fs::read_dir(&dir).expect("list").count();
    assert!(files <= 2, "the live file and at most --audit-log-keep 1 rotated one");
    assert!(raw.len() <= 2 << 20, "within 2 x --audit-log-mb: {} bytes", raw.len());
    if !gvisor() {
        let egress = of(&lines, "egress");
        assert_eq!(egress.len(), 1, "one egress summary for the flood run: {}", egress.len());
        assert!(egress[0]["refused"].as_u64() >= Some(1000), "{}", egress[0]);
    }
    let ended = of(&lines, "run_ended").into_iter().filter(|v| v["session"] == "many").count();
    assert_eq!(ended, runs, "every run is recorded once");
    assert!(lines.len() <= 2 * runs + 20, "{} lines for {runs} runs and one flood", lines.len());
    assert!(!raw.contains("xxxxxxxxxx"), "no output in the audit log");
}

#[tokio::test(flavor = "multi_thread")]
async fn over_http_the_audit_log_names_principals_never_tokens_and_coalesces_refusals() {
    let dir = log_dir("http");
    let log = dir.join("audit.log");
    let s = HttpServer::start_with("audit-http", &[("PYBERTH_AUDIT_LOG", log.to_str().expect("utf-8"))], None).await;
    let alice = s.client(ALICE).await;
    let (r, _) = call(&alice, "run_python", json!({ "session": "s", "code": "1 + 1" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let http = crate::common::web();
    let bad = format!("{BOB}-but-not-quite");
    for i in 0..300 {
        let mut req = http.post(s.url("/mcp")).body("{}");
        if i % 2 == 0 {
            req = req.header("Authorization", format!("Bearer {bad}"));
        }
        let resp = req.send().await.expect("request");
        assert_eq!(resp.status(), 401);
    }
    drop(alice);
    tokio::time::sleep(Duration::from_millis(200)).await;
    s.stop().await;
    let (raw, lines) = records(&dir);
    for secret in [ALICE, BOB, bad.as_str()] {
        assert!(!raw.contains(secret), "a token is in the audit log");
    }
    let tokens = of(&lines, "token");
    assert!(tokens.iter().any(|v| v["principal"] == "alice" && v["outcome"] == "accepted"), "{raw}");
    let refused: Vec<_> = tokens.iter().filter(|v| v["outcome"] == "refused").collect();
    let missing: Vec<_> = tokens.iter().filter(|v| v["outcome"] == "missing").collect();
    assert!(refused.iter().chain(&missing).all(|v| v["principal"] == "unknown"), "{raw}");
    assert!(refused.len() <= 2 && missing.len() <= 2, "coalesced: {raw}");
    let counted = |l: &[&&Value]| l.iter().map(|v| v["count"].as_u64().unwrap_or(1)).sum::<u64>();
    assert_eq!(counted(&refused), 150, "every refusal counted: {raw}");
    assert_eq!(counted(&missing), 150, "{raw}");
    let run = of(&lines, "run_ended");
    assert!(run.iter().any(|v| v["principal"] == "alice" && v["session"] == "s"), "{raw}");
}

#[tokio::test(flavor = "multi_thread")]
async fn stdout_as_the_audit_log_is_refused_over_stdio() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
        .args(["serve", "--audit-log", "-"])
        .env("PYBERTH_STATE_DIR", state_dir())
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run pyberth");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--audit-log -") && err.contains("MCP channel") && err.contains("--http"), "{err}");
    assert!(out.stdout.is_empty(), "nothing on the MCP channel");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_idle_session_that_expires_is_recorded() {
    let dir = log_dir("expired");
    let log = dir.join("audit.log");
    let env = [
        ("PYBERTH_IDLE_TTL", "2"),
        ("PYBERTH_HIBERNATE_AFTER_S", "0"),
        ("PYBERTH_AUDIT_LOG", log.to_str().expect("utf-8")),
    ];
    let s = Server::start("audit-expired", &env).await;
    s.ok("idle", "x = 1").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let expired = loop {
        // The writer writes within a quarter second of an event.
        let (_, lines) = records(&dir);
        if let Some(v) = of(&lines, "session_expired").first() {
            break (*v).clone();
        }
        assert!(std::time::Instant::now() < deadline, "no session_expired record");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_common(&expired);
    assert_eq!(expired["session"], "idle");
    assert_eq!(expired["principal"], "local");
    assert!(expired["idle_s"].as_u64() >= Some(2), "{expired}");
    s.stop().await;
    let (raw, lines) = records(&dir);
    assert!(!of(&lines, "session_closed").iter().any(|v| v["session"] == "idle"), "expired, not closed: {raw}");
}
