//! What a new user meets in the first hour (issue 28, item 10): the CLI's own lines, the HTTP
//! service's front door, and a log that reads plainly from start to a clean stop.

use std::process::Stdio;
use std::time::{Duration, Instant};

use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

use crate::cli::{scratch, streams};
use crate::common::{Recorder, assert_cleaned_up, instance_name, state_dir, with_test_runtime};

/// `pyberth ARGS` as a new user types it: no RUST_LOG, no token in the environment.
fn pyberth(instance: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pyberth"));
    cmd.args(args)
        .env("PYBERTH_INSTANCE", instance)
        .env("PYBERTH_STATE_DIR", state_dir())
        .env_remove("RUST_LOG")
        .env_remove("PYBERTH_TOKEN")
        .env_remove("PYBERTH_TOKENS_FILE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    with_test_runtime(&mut cmd);
    cmd
}

async fn output(mut cmd: Command, input: &str) -> std::process::Output {
    let mut child = cmd.spawn().expect("spawn pyberth");
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input.as_bytes()).await.expect("stdin");
    }
    tokio::time::timeout(Duration::from_secs(300), child.wait_with_output())
        .await
        .expect("pyberth finished in time")
        .expect("pyberth output")
}

/// The seconds after `word` in `line` ("after 2.3 s" → 2.3).
fn seconds_after(line: &str, word: &str) -> f64 {
    let rest = &line[line.find(word).unwrap_or_else(|| panic!("{word:?} in {line:?}")) + word.len()..];
    rest.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("a number in {line:?}"))
}

/// A Rust debug struct or option in a log line (`Limits { max: 1 }`, `Some(3)`, `Foo(Bar {`).
fn debug_struct(line: &str) -> bool {
    let words: Vec<&str> = line.split(' ').collect();
    let capitalised = |w: &str| {
        w.chars().next().is_some_and(|c| c.is_ascii_uppercase())
            && w.chars().all(|c| c.is_ascii_alphanumeric() || c == '(' || c == '=')
    };
    line.contains("Some(")
        || words.windows(2).any(|w| capitalised(w[0].rsplit('=').next().unwrap_or(w[0])) && w[1] == "{")
}

#[test]
fn debug_structs_are_recognised() {
    assert!(debug_struct("INFO x: serving limits=Limits { max_connections: 256 }"));
    assert!(debug_struct("INFO x: peer_info=Some(InitializeRequestParams { meta: None })"));
    assert!(!debug_struct("INFO x: serving max_connections=256 per_client=32"));
    assert!(!debug_struct("INFO x: session created session=default container=54c2fd123ed0"));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_says_the_whole_wall_time_names_no_mcp_tool_and_lists_environments() {
    let dir = scratch("firsthour");
    // The closing line: the whole wall time (sandbox made, script copied in) beside the program's.
    let instance = instance_name("wall");
    let mut cmd = pyberth(&instance, &["run", "-"]);
    cmd.current_dir(&dir);
    let started = Instant::now();
    let o = output(cmd, "import time\ntime.sleep(0.3)\nprint('done')\n").await;
    let outside = started.elapsed().as_secs_f64();
    let (out, err) = streams(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(out, "done\n");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("[pyberth] exit 0 (ok) after "), "{err}");
    let (wall, program) = (seconds_after(last, " after "), seconds_after(last, "the program ran "));
    assert!(program >= 0.3, "the program slept 0.3 s: {last}");
    assert!(wall > program, "a new sandbox costs more than nothing: the wall time is the whole run's: {last}");
    assert!(wall <= outside + 0.05, "no more than the test saw from outside ({outside:.2} s): {last}");
    assert_cleaned_up(&instance).await;

    // An unknown environment: the choices, and the command that describes them, not a tool.
    let instance = instance_name("noenv");
    let mut cmd = pyberth(&instance, &["run", "--environment", "nosuch", "-"]);
    cmd.current_dir(&dir);
    let o = output(cmd, "print(1)\n").await;
    let err = streams(&o).1;
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("python3.11") && err.contains("pyberth envs"), "{err}");
    assert!(!err.contains("list_environments"), "a CLI user is never sent to an MCP tool: {err}");

    let o = output(pyberth(&instance_name("envs"), &["envs"]), "").await;
    let (out, err) = streams(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(out.lines().any(|l| l == "default (the default)"), "{out}");
    for name in ["python3.11", "python3.13", "datascience"] {
        assert!(out.lines().any(|l| l == name), "{name} listed: {out}");
    }
    assert!(out.contains("network: none"), "{out}");

    // A file the run was not given stays; the one line says which, that it was kept, and why.
    std::fs::create_dir_all(dir.join("out")).expect("out");
    std::fs::write(dir.join("out/a.txt"), "host\n").expect("host file");
    let instance = instance_name("kept");
    let mut cmd = pyberth(&instance, &["run", "--output", "out", "-"]);
    cmd.current_dir(&dir);
    let o = output(cmd, "open('a.txt', 'w').write('sandbox')\nopen('b.txt', 'w').write('b')\n").await;
    let err = streams(&o).1;
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(std::fs::read_to_string(dir.join("out/a.txt")).expect("a.txt"), "host\n");
    let line = err.lines().find(|l| l.contains("a.txt")).unwrap_or_else(|| panic!("a.txt is named: {err}"));
    assert!(
        line.contains("not copied back")
            && line.contains("kept")
            && line.contains("not given")
            && line.contains("--output-overwrite"),
        "what was kept and why, in one line: {line}"
    );
    assert_cleaned_up(&instance).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tokenless server on loopback: one warning about it, a front door that says where MCP is,
/// a log of plain fields, and a clean stop that warns about nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_tokenless_loopback_server_warns_once_points_the_way_and_stops_without_warnings() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    let instance = instance_name("frontdoor");
    let mut cmd = pyberth(&instance, &["serve", "--http", &format!("127.0.0.1:{port}")]);
    // Stops leave nothing for a next server: the test checks what is left.
    cmd.env("PYBERTH_ADOPT_GRACE_S", "0").stdin(Stdio::null()).stdout(Stdio::null());
    let child = cmd.spawn().expect("spawn pyberth serve");
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !crate::common::web().get(format!("{base}/healthz")).send().await.is_ok_and(|r| r.status().is_success()) {
        assert!(Instant::now() < deadline, "the server did not become healthy");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let root = crate::common::web().get(format!("{base}/")).send().await.expect("GET /");
    assert_eq!(root.status().as_u16(), 200);
    let body = root.text().await.expect("body");
    assert!(body.contains("/mcp") && body.contains("/healthz"), "{body}");

    let transport = crate::common::http_transport(StreamableHttpClientTransportConfig::with_uri(format!("{base}/mcp")));
    let client = Recorder::default().serve(transport).await.expect("MCP initialise over HTTP");
    let args = serde_json::json!({"code": "print(6 * 7)"}).as_object().cloned().unwrap_or_default();
    let r = client.call_tool(CallToolRequestParams::new("run_python").with_arguments(args)).await.expect("run_python");
    assert_eq!(r.is_error, Some(false));
    let _ = client.cancel().await;

    let pid = child.id().expect("pid");
    let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let o =
        tokio::time::timeout(Duration::from_secs(30), child.wait_with_output()).await.expect("stops").expect("output");
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{log}");
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ")).collect();
    let tokenless: Vec<&&str> = warnings.iter().filter(|l| l.contains("no tokens")).collect();
    assert_eq!(tokenless.len(), 1, "one warning about the missing tokens: {log}");
    let stop =
        log.lines().position(|l| l.contains("signal received")).unwrap_or_else(|| panic!("the stop is logged: {log}"));
    let after: Vec<&str> = log.lines().skip(stop).filter(|l| l.contains(" WARN ") || l.contains(" ERROR ")).collect();
    assert!(after.is_empty(), "a normal stop warns about nothing: {after:?}");
    let structs: Vec<&str> = log.lines().filter(|l| debug_struct(l)).collect();
    assert!(structs.is_empty(), "log lines carry plain fields, no Rust debug structs: {structs:?}");
    assert_cleaned_up(&instance).await;
}

/// A start that is refused says why as its last line, before anything was started.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_start_says_the_reason_last_and_starts_nothing() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    for (tag, addr, token, says) in [
        ("open", "0.0.0.0", None, "without tokens"),
        ("taken", "127.0.0.1", Some("first-hour-token-0123456789"), "cannot listen"),
    ] {
        let instance = instance_name(tag);
        let mut cmd = pyberth(&instance, &["serve", "--http", &format!("{addr}:{port}")]);
        if let Some(t) = token {
            cmd.env("PYBERTH_TOKEN", t);
        }
        let o = output(cmd, "").await;
        let err = streams(&o).1;
        assert!(!o.status.success(), "{tag}: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.contains("ERROR") && last.contains(says), "{tag}: the reason is the last line: {err}");
        assert!(!err.contains("pyberth starting"), "{tag}: refused before anything started: {err}");
        assert!(crate::common::containers_of(&instance).await.is_empty(), "{tag}: no container");
    }
    drop(taken);
}
