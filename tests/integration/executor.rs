use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::{Server, text};

#[tokio::test(flavor = "multi_thread")]
async fn state_persists_and_the_last_expression_is_returned() {
    let s = Server::start("state", &[]).await;
    let first = s.ok("default", "x = 41").await;
    assert_eq!(first["result"], serde_json::Value::Null);
    let (r, sc) = s.run_with(json!({ "code": "x + 1" })).await; // no session: the default one
    assert_eq!(r.is_error, Some(false));
    assert_eq!(sc["result"], "42");
    assert_eq!(sc["session"], "default");
    assert!(text(&r).contains("42"));
    let sc = s.ok("default", "def f(a):\n    return a * x\nimport math\nf(2)").await;
    assert_eq!(sc["result"], "82");
    let vars = s.call("list_variables", json!({})).await;
    assert_eq!(vars.is_error, Some(false));
    let list = vars.structured_content.expect("structured")["variables"].clone();
    let names: Vec<&str> = list.as_array().expect("array").iter().filter_map(|v| v["name"].as_str()).collect();
    assert!(names.contains(&"x") && names.contains(&"f"), "{names:?}");
    assert!(!names.contains(&"math"), "modules are left out: {names:?}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stdout_and_stderr_stay_apart_and_child_output_is_captured() {
    let s = Server::start("streams", &[]).await;
    let code = r#"
import os, subprocess, sys
print("one")
print("err-one", file=sys.stderr)
os.system("echo from-shell; echo shell-err >&2")
subprocess.run(["python3", "-c", "print('from-child')"])
print("two")
"#;
    let sc = s.ok("default", code).await;
    assert_eq!(sc["stdout"], "one\nfrom-shell\nfrom-child\ntwo\n");
    assert_eq!(sc["stderr"], "err-one\nshell-err\n");
    assert_eq!(sc["truncated"], false);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bytes_survive_frames_and_invalid_utf8_is_kept_exactly() {
    let s = Server::start("bytes", &[]).await;
    // 200 000 four-byte characters (800 KB, under the 1 MiB cap): many Docker frames and
    // agent chunks, split mid-character.
    let sc = s.ok("default", "import sys\nsys.stdout.write('\\U0001F600' * 200000)").await;
    let out = sc["stdout"].as_str().expect("stdout");
    assert_eq!(out.chars().count(), 200000);
    assert!(out.chars().all(|c| c == '\u{1F600}'));
    assert!(sc.get("stdout_base64").is_none());

    let sc = s.ok("default", "import sys\nsys.stdout.buffer.write(b'a\\xffb\\x00c')").await;
    assert_eq!(sc["stdout"], "a\u{fffd}b\u{0}c");
    assert_eq!(sc["stdout_base64"], "Yf9iAGM=");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn output_over_the_cap_is_cut_with_a_marker() {
    let s = Server::start("cap", &[("PYBERTH_OUTPUT_CAP", "10000")]).await;
    let sc = s.ok("default", "print('x' * 50000)\nimport sys\nprint('e', file=sys.stderr)").await;
    assert_eq!(sc["truncated"], true);
    let out = sc["stdout"].as_str().expect("stdout");
    assert!(out.starts_with(&"x".repeat(10000)), "kept up to the cap");
    assert!(out.contains("[output truncated: 40001 more bytes"), "{}", &out[10000..]);
    assert_eq!(sc["stderr"], "e\n");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn exceptions_are_tool_errors_with_a_traceback() {
    let s = Server::start("exc", &[]).await;
    s.ok("default", "y = 5").await;
    let (r, sc) = s.run("default", "def g():\n    return 1 / 0\ng()").await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["status"], "error");
    assert_eq!(sc["error"]["type"], "ZeroDivisionError");
    let tb = sc["error"]["traceback"].as_str().expect("traceback");
    assert!(tb.contains("line 2, in g") && tb.contains("return 1 / 0"), "{tb}");
    assert!(!tb.contains("agent.py"), "agent frames are hidden: {tb}");
    assert!(text(&r).contains("ZeroDivisionError"));
    let (r, sc) = s.run("default", "def broken(:\n  pass").await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["error"]["type"], "SyntaxError");
    let tb = sc["error"]["traceback"].as_str().expect("traceback");
    assert!(tb.contains("<cell") && !tb.contains("ast.py"), "the user's line, not the parser's frame: {tb}");
    // The session survived both.
    assert_eq!(s.ok("default", "y").await["result"], "5");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sys_exit_ends_the_cell_not_the_session_and_os_exit_restarts_the_interpreter() {
    let s = Server::start("exit", &[]).await;
    s.ok("default", "z = 7").await;
    let sc = s.ok("default", "import sys\nprint('bye')\nsys.exit(0)").await;
    assert_eq!(sc["stdout"], "bye\n");
    let (r, sc) = s.run("default", "import sys\nsys.exit(3)").await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["exit_code"], 3);
    assert_eq!(s.ok("default", "z").await["result"], "7", "state kept after SystemExit");

    let (r, sc) = s.run("default", "import os\nprint('going', flush=True)\nos._exit(5)").await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["status"], "interpreter_restarted");
    assert_eq!(sc["state_lost"], true);
    assert_eq!(sc["stdout"], "going\n");
    assert!(text(&r).contains("exited with status 5"), "{}", text(&r));
    let (r, sc) = s.run("default", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)").await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["status"], "interpreter_restarted");
    // A fresh interpreter answers, without the old variables.
    let (r, sc) = s.run("default", "z").await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["error"]["type"], "NameError");
    assert_eq!(s.ok("default", "1 + 1").await["result"], "2");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_python_loop_is_interrupted_and_state_is_kept() {
    let s = Server::start("interrupt", &[]).await;
    s.ok("default", "kept = 'yes'").await;
    let t = Instant::now();
    let (r, sc) = s.run_with(json!({ "code": "while True:\n    pass", "timeout_s": 2 })).await;
    let took = t.elapsed();
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["status"], "timeout");
    assert_eq!(sc["state_lost"], false);
    assert_eq!(sc["error"], serde_json::Value::Null);
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(4), "took {took:?}");
    assert_eq!(s.ok("default", "kept").await["result"], "'yes'");
    // time.sleep is interrupted too.
    let (_, sc) = s.run_with(json!({ "code": "import time\ntime.sleep(30)", "timeout_s": 1 })).await;
    assert_eq!(sc["status"], "timeout");
    assert_eq!(sc["state_lost"], false);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn code_that_ignores_the_interrupt_is_killed_and_the_session_recovers() {
    let s = Server::start("kill", &[]).await;
    s.ok("default", "before = 1").await;
    // One C-level call: KeyboardInterrupt cannot land until it returns.
    let t = Instant::now();
    let (r, sc) = s.run_with(json!({ "code": "sum(range(10**13))", "timeout_s": 2 })).await;
    let took = t.elapsed();
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["status"], "timeout");
    assert_eq!(sc["state_lost"], true);
    assert!(took < Duration::from_secs(8), "took {took:?}");
    assert!(text(&r).contains("killed"), "{}", text(&r));
    // Code that ignores SIGINT, with a child process that would linger.
    let code = "import signal, subprocess\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\np = subprocess.Popen(['sleep', '1000'])\nwhile True:\n    pass";
    let (_, sc) = s.run_with(json!({ "code": code, "timeout_s": 1 })).await;
    assert_eq!(sc["status"], "timeout");
    let sc = s.ok("default", "import os\nsorted(p for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/cmdline').read().startswith('sleep\\x001000'))").await;
    assert_eq!(sc["result"], "[]", "the lingering child was killed too");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_call_stops_its_code() {
    let s = Server::start("cancel", &[]).await;
    s.ok("default", "state = 3").await;
    // Dropping the call future makes the client send notifications/cancelled.
    let call = s.run_with(json!({ "code": "import time\ntime.sleep(60)" }));
    assert!(tokio::time::timeout(Duration::from_secs(2), call).await.is_err());
    let t = Instant::now();
    let sc = s.ok("default", "state").await;
    assert!(t.elapsed() < Duration::from_secs(5), "session freed in {:?}", t.elapsed());
    assert_eq!(sc["result"], "3", "an interrupt sufficed, so state is kept");
    s.stop().await;
}
