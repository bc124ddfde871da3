//! The Rust↔Python protocol without Docker: `images/python/agent.py` runs as a local
//! `python3` process whose pipes are wrapped into an [`Agent`], and the server side is the
//! real [`Agent`] and [`drive`] code. A temporary directory stands in for /workspace
//! (`PYBERTH_WORKSPACE`).
//!
//! Why this file passes 500 lines: it is a test file, one test per protocol message.
//!
//! Outside a container the agent behaves as inside: its forwarder is forked from it and
//! holds the real stdout, so the stdout pipe ends only when both have gone, as the exec's
//! stream does; its diagnostics go to the stderr pipe, read as Docker's stderr frames are.
//!
//! The tests keep the server's discipline, nothing before the hello and the next request
//! once the last one is answered (interrupts excepted), except the one that checks that a
//! run queued behind another still gets its own output.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bollard::container::LogOutput;
use bytes::Bytes;
use futures::{StreamExt, stream};
use tokio::process::{Child, Command};
use tokio_util::io::ReaderStream;
use tokio_util::sync::CancellationToken;

use super::agent::{ACK_TIMEOUT, Agent, Greeting, Taken, file_answer};
use super::run::{Ending, Gathered, Stop, drive};
use super::{Error, FileReply, RunOutcome, RunSpec, RunStatus};
use crate::output::Capture;
use crate::protocol::{self, DoneStatus, Event, PROTOCOL_VERSION, Request};

/// Longest any single step may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(10);
/// Time an interrupted run has to answer before it counts as ignoring the interrupt; ample
/// on a loaded machine, where an interrupted run answers within milliseconds.
const GRACE: Duration = Duration::from_secs(1);

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("pyberth-agent-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create a temporary workspace");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An agent running as a local process.
struct Local {
    agent: Agent,
    child: Child,
    workspace: TempDir,
}

fn agent_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("images/python/agent.py")
}

/// Starts the agent with the sandbox's interpreter flags (`exec::AGENT_CMD`). `strays` are
/// fed to the server side right after the agent's first line (its hello), as if the agent
/// had written them.
fn spawn_with(strays: &[&str]) -> Local {
    let workspace = TempDir::new();
    let mut child = Command::new("python3")
        .args(["-I", "-u", "-B"])
        .arg(agent_script())
        .current_dir(&workspace.0)
        .env("PYBERTH_WORKSPACE", &workspace.0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("cannot start python3: the agent protocol tests need python3 on PATH");
    let stdin = child.stdin.take().expect("piped stdin");
    let mut strays =
        (!strays.is_empty()).then(|| Bytes::from(strays.iter().map(|l| format!("{l}\n")).collect::<String>()));
    let stdout = ReaderStream::new(child.stdout.take().expect("piped stdout"))
        .map(move |read| {
            let frames: Vec<std::io::Result<Bytes>> = match (read, strays.is_some()) {
                (Ok(mut chunk), true) if chunk.contains(&b'\n') => {
                    let end = chunk.iter().position(|&b| b == b'\n').expect("a newline") + 1;
                    let rest = chunk.split_off(end);
                    vec![Ok(chunk), Ok(strays.take().expect("strays")), Ok(rest)]
                }
                (read, _) => vec![read],
            };
            stream::iter(frames)
        })
        .flatten()
        .map(|r| r.map(|message| LogOutput::StdOut { message }).map_err(bollard::errors::Error::from));
    let stderr = ReaderStream::new(child.stderr.take().expect("piped stderr"))
        .map(|r| r.map(|message| LogOutput::StdErr { message }).map_err(bollard::errors::Error::from));
    let output = stream::select(stdout, stderr);
    Local { agent: Agent::new(Box::pin(stdin), Box::pin(output)), child, workspace }
}

/// A started agent that has said hello.
async fn spawn() -> Local {
    let mut local = spawn_with(&[]);
    match local.agent.hello(STEP).await {
        Ok(Greeting::Ready { .. }) => local,
        other => panic!("the agent did not greet: {other:?}"),
    }
}

/// An agent over canned output, for what no real agent would say.
fn canned(lines: &[&str]) -> Agent {
    let frames: Vec<Result<LogOutput, bollard::errors::Error>> =
        lines.iter().map(|l| Ok(LogOutput::StdOut { message: Bytes::from(format!("{l}\n")) })).collect();
    Agent::new(Box::pin(tokio::io::sink()), Box::pin(stream::iter(frames)))
}

/// An agent over canned output whose stream stays open after it, as a live agent's does.
fn canned_open(lines: &[&str]) -> Agent {
    let frames: Vec<Result<LogOutput, bollard::errors::Error>> =
        lines.iter().map(|l| Ok(LogOutput::StdOut { message: Bytes::from(format!("{l}\n")) })).collect();
    Agent::new(Box::pin(tokio::io::sink()), Box::pin(stream::iter(frames).chain(stream::pending())))
}

fn empty_outcome() -> RunOutcome {
    RunOutcome::new(1 << 20)
}

/// Drives `code` as [`Session::run`](super::Session::run) would, with the given stop.
async fn run_code(
    agent: &mut Agent,
    code: &str,
    timeout: Duration,
    ct: &CancellationToken,
    observer: &super::run::Observer<'_>,
) -> (Ending, RunOutcome) {
    let mut run = Gathered::new(empty_outcome(), None);
    let id = agent.next_id();
    let spec = RunSpec { code: code.to_owned(), ..Default::default() };
    let stop = Stop { timeout, grace: GRACE, ct, sandbox: None, detach: None };
    let ending = tokio::time::timeout(STEP + timeout, drive(agent, id, &spec, stop, &mut run, observer, "test"))
        .await
        .expect("the run neither ended nor was stopped");
    (ending, run.finish())
}

/// Runs `code` to its end, with no time limit that matters.
async fn run(agent: &mut Agent, code: &str) -> (Ending, RunOutcome) {
    run_code(agent, code, STEP, &CancellationToken::new(), &|_, _| {}).await
}

fn text(c: &Capture) -> String {
    c.render().0
}

async fn next(agent: &mut Agent) -> Event {
    match tokio::time::timeout(STEP, agent.next_event()).await.expect("an event in time") {
        Ok(Some(ev)) => ev,
        Ok(None) => panic!("the agent's output ended"),
        Err(_) => panic!("unreadable agent output"),
    }
}

#[tokio::test]
async fn hello_states_the_protocol_version_the_interpreter_and_its_pid() {
    let mut local = spawn_with(&[]);
    let version = "import sys; print('%d.%d.%d' % sys.version_info[:3])";
    let expected = std::process::Command::new("python3").args(["-c", version]).output().expect("python3 runs");
    let expected = String::from_utf8_lossy(&expected.stdout).trim().to_owned();
    match next(&mut local.agent).await {
        Event::Hello { protocol, python, pid } => {
            assert_eq!(protocol, PROTOCOL_VERSION);
            assert_eq!(python, expected);
            assert_eq!(Some(pid), local.child.id());
        }
        other => panic!("first event {other:?}"),
    }
}

#[tokio::test]
async fn a_hello_in_another_protocol_or_none_at_all_is_refused() {
    let mut other = canned(&[r#"{"ev":"hello","protocol":99,"python":"3.12.0","pid":1}"#]);
    match other.hello(STEP).await {
        Err(Error::AgentStart(m)) => assert!(m.contains("agent protocol 99"), "{m}"),
        r => panic!("{r:?}"),
    }
    let mut early = canned(&[r#"{"ev":"vars","id":1,"vars":[]}"#]);
    assert!(matches!(early.hello(STEP).await, Err(Error::AgentStart(_))));
    let mut silent = canned(&[]);
    assert!(matches!(silent.hello(STEP).await, Ok(Greeting::Exited)));
}

#[tokio::test]
async fn a_run_returns_stdout_stderr_and_the_last_value() {
    let mut local = spawn().await;
    let (ending, out) = run(&mut local.agent, "import sys\nprint('out')\nprint('err', file=sys.stderr)\n6 * 7").await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    assert_eq!(out.status, RunStatus::Ok);
    assert_eq!(text(&out.stdout), "out\n");
    assert_eq!(text(&out.stderr), "err\n");
    assert_eq!(out.result.as_deref(), Some("42"));
    assert!(out.cpu_ms.is_some());

    let (ending, out) = run(&mut local.agent, "def f():\n    return 1 / 0\nf()").await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    assert_eq!(out.status, RunStatus::Error);
    let error = out.error.expect("the exception");
    assert_eq!(error.kind, "ZeroDivisionError");
    assert!(error.traceback.contains("<cell 2>"), "{}", error.traceback);
    assert!(!error.traceback.contains("agent.py"), "agent frames leak: {}", error.traceback);
}

/// The agent loads `traceback` (and `queue`) only when first needed: workspace files named
/// like them, imported first by the code, stay the code's, and the agent still formats
/// errors with the standard one.
#[tokio::test]
async fn workspace_modules_named_like_the_agents_lazy_ones_stay_the_codes() {
    let mut local = spawn().await;
    let plant = "for m in ('traceback', 'queue'):\n    open(m + '.py', 'w').write('MINE = 1\\n')\n\
                 import traceback, queue\n(traceback.MINE, queue.MINE)";
    let (ending, out) = run(&mut local.agent, plant).await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    assert_eq!(out.result.as_deref(), Some("(1, 1)"), "the code's own modules: {:?}", out.error);
    let (_, out) = run(&mut local.agent, "def g():\n    return 1 / 0\ng()").await;
    let error = out.error.expect("the exception");
    assert_eq!(error.kind, "ZeroDivisionError");
    assert!(error.traceback.contains("line 2, in g"), "formatted by the standard traceback: {}", error.traceback);
    let (_, out) = run(&mut local.agent, "import traceback; traceback.MINE").await;
    assert_eq!(out.result.as_deref(), Some("1"), "still the code's after the agent's: {:?}", out.error);
    drop(local.child);
}

/// Python that stops the agent's forwarder (the agent's only child) as `f`, so that the
/// forwarder later finds what the code wrote waiting together with what followed it.
const STOP_FORWARDER: &str = "import os, signal, subprocess, threading\n\
    def forwarder():\n\
    \x20   for p in filter(str.isdigit, os.listdir('/proc')):\n\
    \x20       try:\n\
    \x20           if open('/proc/%s/stat' % p).read().rsplit(')', 1)[1].split()[1] == str(os.getpid()):\n\
    \x20               return int(p)\n\
    \x20       except OSError:\n\
    \x20           pass\n\
    f = forwarder()\n\
    os.kill(f, signal.SIGSTOP)\n";

/// Sends `code` as a run and waits for the agent to take it, reading nothing else back;
/// returns the run's id.
async fn start(agent: &mut Agent, code: &str) -> u64 {
    let id = agent.next_id();
    let env = Default::default();
    agent.send(&Request::Run { id, code, file: None, args: &[], cmd: &[], env: &env }).await.expect("send the run");
    let taken = agent.taken(id).await;
    assert!(matches!(taken, Taken::Yes), "{taken:?}");
    id
}

/// Sends `code` as a run and reads the raw events up to its done: the stdout bytes and
/// the number of chunks they came in. Any other event fails the test.
async fn stdout_until_done(agent: &mut Agent, code: &str) -> (Vec<u8>, usize) {
    let id = start(agent, code).await;
    let mut stdout = Vec::new();
    let mut chunks = 0;
    loop {
        match next(agent).await {
            Event::Out { id: got, s: protocol::Stream::Stdout, t, b } => {
                assert_eq!(got, Some(id));
                stdout.extend(Event::payload(t, b).expect("payload"));
                chunks += 1;
            }
            Event::Done { id: got, status, error, .. } => {
                assert_eq!(got, id);
                assert_eq!(status, DoneStatus::Ok, "{error:?}");
                return (stdout, chunks);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn all_output_of_a_run_arrives_before_its_done() {
    let mut local = spawn().await;
    // More than one 64 KiB chunk, from the interpreter and from a child process.
    let code = "import subprocess, sys\nfor i in range(3000):\n    print('line %04d ' % i + 'x' * 90)\n\
                subprocess.run([sys.executable, '-c', 'print(\"from a child\")'])";
    let (stdout, chunks) = stdout_until_done(&mut local.agent, code).await;
    let mut expected: String = (0..3000).map(|i| format!("line {i:04} {}\n", "x".repeat(90))).collect();
    expected.push_str("from a child\n");
    assert!(chunks > 1, "{chunks} chunks");
    assert_eq!(stdout.len(), expected.len());
    assert!(stdout == expected.as_bytes(), "output out of order");
}

#[tokio::test]
async fn output_still_unread_when_the_run_ends_goes_out_before_done() {
    let mut local = spawn().await;
    // The forwarder resumes after the run: it finds the output and the done together.
    let code = format!(
        "{STOP_FORWARDER}threading.Timer(0.3, os.kill, (f, signal.SIGCONT)).start()\nos.write(1, b'last words\\n')"
    );
    let (stdout, _) = stdout_until_done(&mut local.agent, &code).await;
    assert_eq!(String::from_utf8_lossy(&stdout), "last words\n");
}

/// Sends `code` as a run without waiting for anything back; returns its id.
async fn send_run(agent: &mut Agent, code: &str) -> u64 {
    let id = agent.next_id();
    let env = Default::default();
    agent.send(&Request::Run { id, code, file: None, args: &[], cmd: &[], env: &env }).await.expect("send the run");
    id
}

#[tokio::test]
async fn a_run_queued_behind_another_gets_all_its_output_under_its_own_id() {
    let mut local = spawn().await;
    // The first run ends while the forwarder is stopped, with the second already queued: the
    // agent starts the second only once the forwarder has taken the first's done, so the
    // drain at that done cannot tag the second run's output with the first run's id.
    let first = format!("{STOP_FORWARDER}threading.Timer(0.3, os.kill, (f, signal.SIGCONT)).start()");
    let one = send_run(&mut local.agent, &first).await;
    let two = send_run(&mut local.agent, "print('two')").await;
    // `print` may write "two" and the line end apart: the chunks are joined per id.
    let mut tagged: Vec<(Option<u64>, Vec<u8>)> = Vec::new();
    loop {
        match next(&mut local.agent).await {
            Event::Out { id, t, b, .. } => {
                let payload = Event::payload(t, b).expect("payload");
                match tagged.last_mut() {
                    Some((last, bytes)) if *last == id => bytes.extend(payload),
                    _ => tagged.push((id, payload)),
                }
            }
            Event::Done { id, .. } if id == two => break,
            Event::Done { id, status, .. } => assert!(id == one && status == DoneStatus::Ok, "{id} {status:?}"),
            _ => {}
        }
    }
    assert_eq!(tagged, vec![(Some(two), b"two\n".to_vec())]);
}

#[tokio::test]
async fn a_cancelled_run_is_interrupted_and_the_state_is_kept() {
    let mut local = spawn().await;
    let (_, out) = run(&mut local.agent, "x = 41").await;
    assert_eq!(out.status, RunStatus::Ok);

    // Cancel once the code is surely inside its sleep.
    let ct = CancellationToken::new();
    let trigger = ct.clone();
    let observer = move |_: protocol::Stream, bytes: &[u8]| {
        if bytes.windows(5).any(|w| w == b"ready") {
            trigger.cancel();
        }
    };
    let started = Instant::now();
    // One write, so that the interrupt cannot land between the text and its newline.
    let code = "import os, time\nos.write(1, b'ready\\n')\ntime.sleep(30)";
    let (ending, out) = run_code(&mut local.agent, code, STEP, &ct, &observer).await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    assert_eq!(out.status, RunStatus::Cancelled);
    assert_eq!(text(&out.stdout), "ready\n");
    assert!(started.elapsed() < Duration::from_secs(5), "the interrupt took {:?}", started.elapsed());

    // The time limit interrupts the same way (the run has long started when it passes).
    let (ending, out) = run_code(
        &mut local.agent,
        "import time\ntime.sleep(30)",
        Duration::from_millis(500),
        &CancellationToken::new(),
        &|_, _| {},
    )
    .await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    assert_eq!(out.status, RunStatus::Timeout);

    let (_, out) = run(&mut local.agent, "x + 1").await;
    assert_eq!(out.status, RunStatus::Ok);
    assert_eq!(out.result.as_deref(), Some("42"));
}

#[tokio::test]
async fn code_that_ignores_the_interrupt_is_given_up_after_the_grace() {
    let mut local = spawn().await;
    let code = "import os, time\nwhile True:\n    try:\n        time.sleep(5)\n    except KeyboardInterrupt:\n        \
                os.write(1, b'caught\\n')";
    let started = Instant::now();
    let (ending, out) =
        run_code(&mut local.agent, code, Duration::from_millis(500), &CancellationToken::new(), &|_, _| {}).await;
    assert!(matches!(ending, Ending::Killed(RunStatus::Timeout)), "{ending:?}");
    // The interrupt did arrive; the code chose to ignore it.
    assert_eq!(text(&out.stdout), "caught\n");
    // The time limit plus the grace, not the code's own pace.
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
}

#[tokio::test]
async fn the_agent_ignores_an_interrupt_for_another_run() {
    let mut local = spawn().await;
    let (_, out) = run(&mut local.agent, "pass").await;
    assert_eq!(out.status, RunStatus::Ok);
    let id = start(&mut local.agent, "import os, time\nos.write(1, b'a\\n')\ntime.sleep(0.3)\nprint('b')").await;
    match next(&mut local.agent).await {
        Event::Out { id: Some(got), t: Some(t), .. } if got == id => assert_eq!(t, "a\n"),
        other => panic!("unexpected {other:?}"),
    }
    // The run is in its sleep now: neither the previous run's id nor a made-up one may stop it.
    local.agent.send(&Request::Interrupt { id: id - 1 }).await.expect("send");
    local.agent.send(&Request::Interrupt { id: id + 100 }).await.expect("send");
    let mut rest = String::new();
    loop {
        match next(&mut local.agent).await {
            Event::Out { t: Some(t), .. } => rest.push_str(&t),
            Event::Done { id: got, status, .. } => {
                assert_eq!(got, id);
                assert_eq!(status, DoneStatus::Ok);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(rest, "b\n");
}

#[tokio::test]
async fn a_run_ignores_events_of_other_ids_and_unreadable_lines() {
    // What a confused agent or a leftover could put on the stream.
    let mut local = spawn_with(&[
        r#"{"ev":"out","id":1000,"s":"stdout","t":"stray\n"}"#,
        r#"{"ev":"out","id":null,"s":"stdout","t":"background\n"}"#,
        "not json at all",
        r#"{"ev":"notice","id":1000,"text":"not ours"}"#,
        r#"{"ev":"done","id":1000,"status":"ok","wall_ms":0,"cpu_ms":0}"#,
    ]);
    assert!(matches!(local.agent.hello(STEP).await, Ok(Greeting::Ready { .. })));
    let (ending, out) = run(&mut local.agent, "print('mine')\n'done'").await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    assert_eq!(out.status, RunStatus::Ok);
    assert_eq!(text(&out.stdout), "mine\n");
    assert_eq!(out.result.as_deref(), Some("'done'"));
    assert!(out.notices.is_empty(), "{:?}", out.notices);
}

#[tokio::test]
async fn os_exit_mid_run_ends_the_stream_after_the_output_before_it() {
    let mut local = spawn().await;
    // The forwarder resumes once the interpreter is gone (a process outlives it to resume
    // it): it finds the last output and the end of the message pipe together.
    let code = format!(
        "{STOP_FORWARDER}subprocess.Popen(['sh', '-c', 'sleep 0.3; kill -CONT %d' % f])\n\
         os.write(1, b'bye\\n')\nos._exit(3)"
    );
    let (ending, out) = run(&mut local.agent, &code).await;
    assert!(matches!(ending, Ending::Died(None)), "{ending:?}");
    assert_eq!(text(&out.stdout), "bye\n");
    let status = tokio::time::timeout(STEP, local.child.wait()).await.expect("the agent exits").expect("wait");
    assert_eq!(status.code(), Some(3));
}

#[tokio::test]
async fn queries_are_answered_by_id() {
    let mut local = spawn().await;
    let (_, out) = run(&mut local.agent, "import math\na = [1, 2]\nb = 'x'\n_hidden = 1").await;
    assert_eq!(out.status, RunStatus::Ok);

    let vars = local
        .agent
        .request(
            |id| Request::Vars { id },
            |id, ev| match ev {
                Event::Vars { id: i, vars } if i == id => Some(vars),
                _ => None,
            },
            STEP,
        )
        .await
        .expect("vars");
    let listed: Vec<(&str, &str, &str)> =
        vars.iter().map(|v| (v.name.as_str(), v.kind.as_str(), v.repr.as_str())).collect();
    assert_eq!(listed, [("a", "list", "[1, 2]"), ("b", "str", "'x'")]);

    // Only set directories of the layer store are attached; nothing else, nothing absent.
    let paths =
        ["/opt/pyberth/layers/0123abcd/site".to_owned(), "/etc".to_owned(), "/opt/pyberth/layers/../site".to_owned()];
    let attached = |id, ev| match ev {
        Event::Attached { id: i, missing } if i == id => Some(missing),
        _ => None,
    };
    let missing = local.agent.request(|id| Request::Attach { id, paths: &paths }, attached, STEP).await;
    assert_eq!(missing.expect("attached"), paths, "none of them is a set there");
}

/// A file request through the same answer-picking as [`Session::file`](super::Session::file).
async fn file<'r>(agent: &mut Agent, make: impl FnOnce(u64) -> Request<'r>) -> Result<FileReply, String> {
    agent.request(make, file_answer, STEP).await.expect("an answer")
}

#[tokio::test]
async fn file_requests_write_read_list_and_refuse_paths_outside() {
    let mut local = spawn().await;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);

    let (hello, world) = (b64("hello"), b64(" world"));
    let wrote = file(&mut local.agent, |id| Request::Write { id, path: "sub/f.txt", b: &hello, append: false }).await;
    assert_eq!(wrote.expect("write").size, Some(5));
    let appended = file(&mut local.agent, |id| Request::Write { id, path: "sub/f.txt", b: &world, append: true }).await;
    assert_eq!(appended.expect("append").size, Some(11));
    let on_disk = std::fs::read(local.workspace.0.join("sub/f.txt")).expect("the file is in the workspace");
    assert_eq!(on_disk, b"hello world");

    let read = file(&mut local.agent, |id| Request::Read { id, path: "sub/f.txt", offset: 6, length: 100 })
        .await
        .expect("read");
    assert_eq!(read.data, b"world");
    assert_eq!(read.size, Some(11));

    let listing =
        file(&mut local.agent, |id| Request::List { id, path: "", recursive: true, limit: 1000 }).await.expect("list");
    let entries: Vec<(&str, &str, u64)> =
        listing.entries.iter().map(|e| (e.path.as_str(), e.kind.as_str(), e.size)).filter(|e| e.1 != "dir").collect();
    assert_eq!(entries, [("sub/f.txt", "file", 11)]);
    let file_entry = listing.entries.iter().find(|e| e.path == "sub/f.txt").expect("listed");
    assert!(file_entry.allocated.is_some(), "the storage taken, beside the size: {file_entry:?}");
    assert!(listing.entries.iter().any(|e| e.path == "sub" && e.kind == "dir"));
    assert!(!listing.truncated);

    let outside = file(&mut local.agent, |id| Request::Read { id, path: "../x", offset: 0, length: 10 }).await;
    assert!(outside.as_ref().is_err_and(|m| m.contains("outside the workspace")), "{outside:?}");
    let missing = file(&mut local.agent, |id| Request::Read { id, path: "nope.txt", offset: 0, length: 10 }).await;
    assert!(missing.as_ref().is_err_and(|m| m.contains("does not exist")), "{missing:?}");

    // Code sees the same workspace as its working directory.
    let (_, out) = run(&mut local.agent, "open('sub/f.txt').read()").await;
    assert_eq!(out.result.as_deref(), Some("'hello world'"));
}

#[tokio::test]
async fn a_query_not_taken_unanswered_in_time_or_cut_off_fails() {
    let mut local = spawn().await;
    start(&mut local.agent, "import time\ntime.sleep(30)").await;
    // The agent serves one request at a time: the run holds it, and the query is not taken.
    let started = Instant::now();
    let busy = local
        .agent
        .request(
            |id| Request::Vars { id },
            |id, ev| matches!(ev, Event::Vars { id: i, .. } if i == id).then_some(()),
            Duration::from_millis(200),
        )
        .await;
    assert!(matches!(busy, Err(Error::Stuck)), "{busy:?}");
    assert!(started.elapsed() < ACK_TIMEOUT + STEP, "{:?}", started.elapsed());

    // Taken, but never answered.
    let mut mute = canned_open(&[r#"{"ev":"ack","id":1}"#]);
    let slow = mute
        .request(
            |id| Request::Vars { id },
            |_, ev| matches!(ev, Event::Vars { .. }).then_some(()),
            Duration::from_millis(200),
        )
        .await;
    assert!(matches!(slow, Err(Error::AgentTimeout(_))), "{slow:?}");

    let mut cut = canned(&[r#"{"ev":"out","id":1,"s":"stdout","t":"x"}"#]);
    let gone =
        cut.request(|id| Request::Vars { id }, |_, ev| matches!(ev, Event::Vars { .. }).then_some(()), STEP).await;
    assert!(matches!(gone, Err(Error::AgentGone)), "{gone:?}");
}

/// A request for a fresh id.
type MakeRequest = Box<dyn FnOnce(u64) -> Request<'static>>;

#[tokio::test]
async fn a_fifo_or_other_special_file_is_refused_at_once() {
    let mut local = spawn().await;
    let made = "import os\nos.mkfifo('pipe')\nos.symlink('pipe', 'link')\nos.mkdir('d')\n\
                os.makedirs('x-1.0.dist-info')\nos.mkfifo('x-1.0.dist-info/METADATA')\nkept = 1";
    let (_, out) = run(&mut local.agent, made).await;
    assert_eq!(out.status, RunStatus::Ok, "{:?}", out.error);
    let requests: [(&str, MakeRequest); 5] = [
        ("read", Box::new(|id| Request::Read { id, path: "pipe", offset: 0, length: 10 })),
        ("read through a link", Box::new(|id| Request::Read { id, path: "link", offset: 0, length: 10 })),
        ("read a directory", Box::new(|id| Request::Read { id, path: "d", offset: 0, length: 10 })),
        ("write", Box::new(move |id| Request::Write { id, path: "pipe", b: "eA==", append: false })),
        ("append", Box::new(move |id| Request::Write { id, path: "pipe", b: "eA==", append: true })),
    ];
    for (what, make) in requests {
        let t = Instant::now();
        let answer = local.agent.request(make, file_answer, STEP).await;
        assert!(t.elapsed() < Duration::from_secs(2), "{what} took {:?}", t.elapsed());
        match answer {
            Ok(Err(m)) => assert!(m.contains("is not a regular file"), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    // Metadata-like names in the workspace are not installed packages, nor a way to hang.
    let listed = |id, ev| match ev {
        Event::Packages { id: i, packages } if i == id => Some(packages),
        _ => None,
    };
    let packages = local.agent.request(|id| Request::Packages { id }, listed, STEP).await.expect("packages");
    assert!(packages.iter().all(|p| p.name != "x"), "{packages:?}");
    let (_, out) = run(&mut local.agent, "kept").await;
    assert_eq!(out.result.as_deref(), Some("1"), "the agent lives on with its state");
}

#[tokio::test]
async fn a_slow_repr_is_shown_unavailable_and_the_listing_answers() {
    let mut local = spawn().await;
    let code = "import time\nclass Slow:\n    def __repr__(self):\n        time.sleep(60)\n        return 'slow'\n\
                class Picky:\n    def __repr__(self):\n        try:\n            time.sleep(60)\n        except Exception:\n            \
                return 'caught'\nslow = Slow()\npicky = Picky()\nbig = list(range(10 ** 6))\nglobals()[1] = 'odd key'\nkeep = 7";
    let (_, out) = run(&mut local.agent, code).await;
    assert_eq!(out.status, RunStatus::Ok, "{:?}", out.error);
    let t = Instant::now();
    let vars = local
        .agent
        .request(
            |id| Request::Vars { id },
            |id, ev| match ev {
                Event::Vars { id: i, vars } if i == id => Some(vars),
                _ => None,
            },
            STEP,
        )
        .await
        .expect("vars");
    assert!(t.elapsed() < Duration::from_secs(4), "the listing took {:?}", t.elapsed());
    let repr = |name: &str| vars.iter().find(|v| v.name == name).map(|v| v.repr.clone());
    assert_eq!(repr("slow").as_deref(), Some("<unavailable: its repr took over 0.5 s>"));
    assert_eq!(repr("picky").as_deref(), Some("<unavailable: its repr took over 0.5 s>"), "not an Exception");
    assert!(repr("big").is_some_and(|r| r.starts_with("[0, 1, 2") && r.len() < 100), "{:?}", repr("big"));
    assert_eq!(repr("keep").as_deref(), Some("7"));
    let (_, out) = run(&mut local.agent, "keep + 1").await;
    assert_eq!(out.result.as_deref(), Some("8"), "the state is kept");
}

#[tokio::test]
async fn images_and_notices_forged_through_the_agent_are_bounded_by_the_server() {
    let mut local = spawn().await;
    let code = "a = display.__self__\nfor i in range(100):\n    a.channel.send({'ev': 'image', 'id': a.current, \
                'mime': 'image/png', 'b': 'QUJD' * 1000})\nfor i in range(100):\n    a.send_notice(a.current, 'n%d\\n' % i)\n\
                class P:\n    def _repr_png_(self):\n        return b'png'\nfor i in range(40):\n    display(P())";
    let (ending, out) = run(&mut local.agent, code).await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    assert_eq!(out.status, RunStatus::Ok, "{:?}", out.error);
    assert_eq!(out.images.len(), super::extras::MAX_IMAGES);
    assert_eq!(out.notices.len(), super::extras::MAX_NOTICES + 1, "{:?}", out.notices);
    assert_eq!(out.notices[1], "n0\\n", "one line each");
    // The agent itself sends 16 of the 40 displayed images; the server keeps 16 of the 116
    // it receives, and 16 of the 101 notices (100 forged, one of the agent's own).
    let ours = &out.notices[0];
    assert!(ours.contains("100 images (336064 bytes) were dropped"), "{ours}");
    assert!(ours.contains("85 notices were dropped"), "{ours}");
}

#[test]
fn the_agent_s_stderr_is_escaped_budgeted_and_counted() {
    use super::agent::StderrGate;
    let mut gate = StderrGate::default();
    let forged = b"ok\n2026-01-01T00:00:00Z  INFO pyberth: forged\r\x1b[31mred\xff\n";
    assert_eq!(
        gate.admit(forged).as_deref(),
        Some("ok\\n2026-01-01T00:00:00Z  INFO pyberth: forged\\r\\u{1b}[31mred\\xff")
    );
    let mut logged = 0;
    for _ in 0..1000 {
        logged += gate.admit(&[b'\x1b'; 4096]).map_or(0, |t| t.len());
    }
    assert!(logged <= 64 << 10, "{logged}");
    let more = gate.admit(b"more than the few bytes an escape left over");
    assert!(more.as_ref().is_none_or(|t| t.len() < 6), "the request's budget is spent: {more:?}");
    let dropped = gate.next_request().expect("a count");
    assert!(dropped > 4_000_000, "{dropped}");
    assert_eq!(gate.next_request(), None, "counted once");
    // A new request has a new budget, but after a burst the rate (4 KiB/s) holds.
    let after = gate.admit(&[b'a'; 60_000]).map_or(0, |t| t.len());
    assert!(after < 32 << 10, "{after}");
}

/// Code that holds the agent object: it ends its run with a forged `done` and keeps the
/// interpreter busy. `prelude` runs first.
fn forge_and_spin(prelude: &str) -> String {
    format!(
        "{prelude}\nagent = display.__self__\n\
         agent.channel.send({{'ev': 'done', 'id': agent.current, 'status': 'ok', 'result': \"'forged'\", \
         'wall_ms': 1.0, 'cpu_ms': 1.0}})\nwhile True:\n    pass\n"
    )
}

#[tokio::test]
async fn the_next_run_interrupts_code_that_forged_its_done() {
    let mut local = spawn().await;
    run(&mut local.agent, "kept = 41").await;
    let (ending, out) = run(&mut local.agent, &forge_and_spin("")).await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    assert_eq!(out.result.as_deref(), Some("'forged'"), "a forged done is taken for the end of the run");
    assert!(local.agent.last_run.is_some(), "but its code may still hold the interpreter");
    let started = Instant::now();
    let (ending, out) = run(&mut local.agent, "kept + 1").await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    assert_eq!(out.result.as_deref(), Some("42"), "the interrupt kept the state");
    assert!(out.notices.iter().any(|n| n.contains("still running")), "{:?}", out.notices);
    assert!(started.elapsed() < ACK_TIMEOUT * 2 + GRACE, "{:?}", started.elapsed());
    // A query after a forged done goes through the same: interrupted, then answered.
    run(&mut local.agent, &forge_and_spin("")).await;
    let vars = local
        .agent
        .request(
            |id| Request::Vars { id },
            |id, ev| matches!(ev, Event::Vars { id: i, .. } if i == id).then_some(()),
            STEP,
        )
        .await;
    assert!(vars.is_ok(), "{vars:?}");
    assert!(local.agent.take_interrupted().is_some());
}

#[tokio::test]
async fn a_run_after_forged_done_code_that_ignores_interrupts_never_starts() {
    let mut local = spawn().await;
    let code = forge_and_spin("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)");
    let (ending, _) = run(&mut local.agent, &code).await;
    assert!(matches!(ending, Ending::Done), "{ending:?}");
    let started = Instant::now();
    let (ending, out) = run(&mut local.agent, "print('never')").await;
    assert!(matches!(ending, Ending::Stuck), "{ending:?}");
    assert!(out.stdout.render().0.is_empty());
    assert!(started.elapsed() < ACK_TIMEOUT * 2 + GRACE, "{:?}", started.elapsed());
}

#[tokio::test]
async fn listed_entries_out_of_the_workspace_or_of_no_kind_are_dropped() {
    let entries = r#"[{"path":"../../etc/shadow","size":1,"kind":"file"},{"path":"/etc/passwd","size":1,"kind":"file"},
        {"path":"a/./b","size":1,"kind":"file"},{"path":"a//b","size":1,"kind":"file"},{"path":"s","size":1,"kind":"socket"},
        {"path":"big","size":18446744073709551615,"kind":"file"},{"path":"","size":1,"kind":"dir"},
        {"path":"held","size":0,"allocated":18446744073709551615,"kind":"file"},
        {"path":"odd\nname","size":3,"kind":"file"},{"path":"a/b","size":2,"kind":"file"}]"#
        .replace('\n', "");
    let answer = format!(r#"{{"ev":"file","id":1,"entries":{entries},"truncated":false}}"#);
    let mut forged = canned_open(&[r#"{"ev":"ack","id":1}"#, &answer]);
    let reply =
        file(&mut forged, |id| Request::List { id, path: ".", recursive: true, limit: 1000 }).await.expect("list");
    let paths: Vec<&str> = reply.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["odd\nname", "a/b"]);
    assert_eq!(reply.dropped, 8);
}

#[tokio::test]
async fn pack_archives_the_workspace_as_the_code_sees_it_and_follows_no_link() {
    let mut local = spawn().await;
    let setup = "import os\nos.makedirs('tree/sub')\nopen('tree/a.txt', 'w').write('alpha')\n\
                 open('tree/sub/b.txt', 'w').write('beta')\nos.symlink('/etc', 'tree/etc_link')\n\
                 os.symlink('/etc', 'etc_link')\nos.mkfifo('tree/fifo')";
    let (_, out) = run(&mut local.agent, setup).await;
    assert_eq!(out.status, RunStatus::Ok, "{:?}", out.error);
    async fn pack(agent: &mut Agent, path: &str) -> Result<Vec<(String, tar::EntryType, Vec<u8>)>, Error> {
        let id = agent.submit(|id| Request::Pack { id, path, max_bytes: None, max_entries: 100, newer: None }).await?;
        let mut raw = Vec::new();
        while let Some(piece) = agent.piece(id, STEP).await? {
            raw.extend(piece);
        }
        let mut entries = Vec::new();
        for e in tar::Archive::new(&raw[..]).entries().expect("a tar") {
            let mut e = e.expect("an entry");
            let name = e.path().expect("a name").to_string_lossy().into_owned();
            let kind = e.header().entry_type();
            let mut body = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut body).expect("a body");
            entries.push((name, kind, body));
        }
        Ok(entries)
    }
    let tree = pack(&mut local.agent, "tree").await.expect("tree");
    let names: Vec<(&str, tar::EntryType)> = tree.iter().map(|(n, k, _)| (n.trim_end_matches('/'), *k)).collect();
    assert_eq!(
        names,
        [
            ("tree", tar::EntryType::Directory),
            ("tree/a.txt", tar::EntryType::Regular),
            ("tree/etc_link", tar::EntryType::Symlink),
            ("tree/sub", tar::EntryType::Directory),
            ("tree/sub/b.txt", tar::EntryType::Regular),
        ],
        "links stay links, FIFOs are left out"
    );
    assert_eq!(tree[1].2, b"alpha");
    for outside in ["etc_link", "etc_link/passwd", "tree/etc_link/passwd", "../x", "missing"] {
        let refused = pack(&mut local.agent, outside).await;
        assert!(matches!(refused, Err(Error::Refused(_))), "{outside}: {refused:?}");
    }
    let all = pack(&mut local.agent, ".").await.expect("the workspace");
    assert!(all.iter().all(|(n, _, _)| !n.starts_with("etc_link/")), "never followed");
    let capped = local
        .agent
        .submit(|id| Request::Pack { id, path: ".", max_bytes: None, max_entries: 2, newer: None })
        .await
        .expect("taken");
    let mut over = local.agent.piece(capped, STEP).await;
    while let Ok(Some(_)) = over {
        over = local.agent.piece(capped, STEP).await;
    }
    assert!(over.as_ref().is_err_and(|e| e.to_string().contains("more than 2 entries")), "{over:?}");
}

#[tokio::test]
async fn a_snapshot_restores_into_a_new_agent_and_names_what_it_could_not_keep() {
    let mut local = spawn().await;
    let setup = "import os, threading\nn = 5\nclass K:\n    def __init__(self, v):\n        self.v = v\n\
                 def twice(x):\n    return 2 * x\nk = K(3)\nlam = lambda: 0\nlock = threading.Lock()\n\
                 open('w.txt', 'w').write('w')";
    let (_, out) = run(&mut local.agent, setup).await;
    assert_eq!(out.status, RunStatus::Ok, "{:?}", out.error);
    let id =
        local.agent.submit(|id| Request::Snapshot { id, max_bytes: 1 << 20, max_entries: 100 }).await.expect("taken");
    let mut raw = Vec::new();
    while let Some(piece) = local.agent.piece(id, STEP).await.expect("a piece") {
        raw.extend(piece);
    }
    let mut state = Vec::new();
    let mut names = Vec::new();
    for e in tar::Archive::new(&raw[..]).entries().expect("a tar") {
        let mut e = e.expect("an entry");
        let name = e.path().expect("a name").to_string_lossy().into_owned();
        let mut body = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut body).expect("a body");
        if let Some(file) = name.strip_prefix("state/") {
            state.push((file.to_owned(), body));
        }
        names.push(name);
    }
    assert_eq!(&names[..3], ["state/meta.json", "state/imported.pkl", "state/values.pkl"], "the state comes first");
    assert!(names.iter().any(|n| n == "workspace/w.txt"), "{names:?}");
    let meta: serde_json::Value = serde_json::from_slice(&state[0].1).expect("meta.json");
    let lost: Vec<&str> = meta["lost"].as_array().expect("lost").iter().filter_map(|l| l["name"].as_str()).collect();
    assert_eq!(lost, ["lam", "lock"], "{meta}");

    // A new agent over the same workspace, the state where the server puts it.
    let mut fresh = spawn().await;
    let dir = fresh.workspace.0.join(crate::docker::snapshot::RESTORE_DIR);
    std::fs::create_dir_all(&dir).expect("restore dir");
    for (file, body) in &state {
        std::fs::write(dir.join(file), body).expect("state file");
    }
    let restored = fresh
        .agent
        .request(
            |id| Request::Restore { id, if_saved: false },
            |id, ev| match ev {
                Event::Restored { id: i, restored, lost } if i == id => Some((restored, lost)),
                _ => None,
            },
            STEP,
        )
        .await
        .expect("restored");
    assert!(restored.0.iter().any(|n| n == "k") && restored.0.iter().any(|n| n == "twice"), "{restored:?}");
    assert_eq!(restored.1.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(), ["lam", "lock"]);
    assert!(!dir.exists(), "the state is removed once read");
    let (_, out) = run(&mut fresh.agent, "(n, twice(k.v), isinstance(k, K), 'lam' in globals())").await;
    assert_eq!(out.result.as_deref(), Some("(5, 6, True, False)"), "{:?}", out.error);

    // Damaged state: a clear failure, and the agent lives on.
    std::fs::create_dir_all(&dir).expect("restore dir");
    std::fs::write(dir.join("meta.json"), b"not json").expect("meta");
    let failed = fresh
        .agent
        .request(
            |id| Request::Restore { id, if_saved: false },
            |id, ev| match ev {
                Event::Failed { id: Some(i), message } if i == id => Some(message),
                _ => None,
            },
            STEP,
        )
        .await
        .expect("failed");
    assert!(!failed.is_empty());
    let (_, out) = run(&mut fresh.agent, "n").await;
    assert_eq!(out.result.as_deref(), Some("5"));
}
