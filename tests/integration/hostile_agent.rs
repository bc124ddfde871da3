//! Code that speaks as the agent. User code runs inside the agent's process, so it can call the
//! agent's own functions (`display.__self__`), write events into its channel and write to its
//! diagnostic stream: whatever arrives that way is as hostile as the code
//! (docs/threat-model.md §1), and the server bounds it as it arrives.

use std::time::{Duration, Instant};

use rmcp::model::{CallToolResult, ReadResourceRequestParams};
use serde_json::{Value, json};

use crate::common::{Server, text};

/// The largest result the server may send (`server/fit.rs`).
const BUDGET: usize = 12 << 20;

/// Longest a call of these tests may take before it counts as hung.
const CALL: Duration = Duration::from_secs(180);

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(CALL, f).await.unwrap_or_else(|_| panic!("{what} did not answer within {CALL:?}"))
}

fn size_of(r: &CallToolResult) -> usize {
    serde_json::to_vec(r).expect("json").len()
}

/// Forges, through the agent object, 300 image events of 1 MiB of base64, 1000 small ones,
/// and 3000 notices of 8000 characters, all tagged with the current run's id.
const FORGE: &str = r#"import base64, os
agent = display.__self__
run = agent.current
big = base64.b64encode(os.urandom(768 << 10)).decode('ascii')
small = base64.b64encode(os.urandom(3 << 10)).decode('ascii')
for _ in range(300):
    agent.channel.send({"ev": "image", "id": run, "mime": "image/png", "b": big})
for _ in range(1000):
    agent.channel.send({"ev": "image", "id": run, "mime": "image/png", "b": small})
for i in range(3000):
    agent.send_notice(run, "notice %d: " % i + "n" * 8000)
'sent'"#;

fn notices(sc: &Value) -> Vec<String> {
    sc["notices"]
        .as_array()
        .map(|a| a.iter().filter_map(|n| n.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn forged_images_and_notices_are_bounded_as_they_arrive() {
    let s = Server::start("forged-images", &[]).await;
    s.ok("x", "print(1)").await;
    let (before, _) = s.memory_kb();

    let (r, sc) =
        within("the forging run", s.run_with(json!({ "session": "x", "code": FORGE, "timeout_s": 120 }))).await;
    let (peak, now) = s.memory_kb();
    eprintln!("server memory: peak {before} KiB before, peak {peak} KiB and current {now} KiB after");
    let size = size_of(&r);
    eprintln!("result: {size} bytes, {} content blocks", r.content.len());
    assert!(size <= BUDGET, "the result is {size} bytes, over the {BUDGET} byte budget");
    assert_eq!(sc["result"], "'sent'", "{}", text(&r));
    assert!(sc["images"].as_u64().is_some_and(|n| n <= 16), "images kept: {}", sc["images"]);
    let said = notices(&sc);
    assert!(
        said.iter().any(|n| n.contains("images") && n.contains("dropped")),
        "the result says images were dropped: {said:?}"
    );
    assert!(said.len() <= 20, "{} notices", said.len());
    assert!(said.iter().all(|n| n.len() <= 2048), "notices are bounded in length");
    assert!(peak < before + (192 << 10), "the server's peak memory grew from {before} KiB to {peak} KiB");

    // The same as a job: its kept result is bounded too.
    let (_, started) =
        within("the job start", s.run_with(json!({ "session": "x", "code": FORGE, "background": true }))).await;
    let job = started["job"].as_str().expect("a job handle").to_owned();
    let r = within("job_status", s.call("job_status", json!({ "job": job, "wait_s": 150 }))).await;
    let size = size_of(&r);
    assert!(size <= BUDGET, "the job's result is {size} bytes");
    let result = &r.structured_content.as_ref().expect("structured")["result"];
    assert_eq!(result["result"], "'sent'", "{}", text(&r));
    assert!(notices(result).iter().any(|n| n.contains("images") && n.contains("dropped")), "{result}");
    let (peak_job, _) = s.memory_kb();
    eprintln!("server memory: peak {peak_job} KiB after the job");
    assert!(peak_job < before + (192 << 10), "the server's peak memory grew from {before} KiB to {peak_job} KiB");

    assert_eq!(s.ok("x", "21 * 2").await["result"], "42");
    s.stop().await;
}

/// Writes 50 MiB to the agent's diagnostic stream (the exec's stderr): lines forged to look
/// like the server's own log, ANSI escapes and carriage returns.
const STDERR_FLOOD: &str = r#"import os
fd = display.__self__.diag.fileno()
forged = (b'1999-01-01T00:00:00.000000Z  INFO pyberth: FORGED session created session=x\n'
          b'\x1b[2J\x1b[31mFORGED red\x1b[0m\r\n'
          b'1999-01-01T00:00:00.000000Z ERROR pyberth::session: FORGED agent stream broken\n')
chunk = forged * ((1 << 20) // len(forged))
for _ in range(50):
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view):]
'written'"#;

#[tokio::test(flavor = "multi_thread")]
async fn the_agent_s_stderr_is_untrusted_output_in_the_server_log() {
    let s = Server::start("agent-stderr", &[]).await;
    s.ok("x", "print(1)").await;
    let start = s.log.read().len() as u64;

    let (r, sc) =
        within("the stderr flood", s.run_with(json!({ "session": "x", "code": STDERR_FLOOD, "timeout_s": 120 }))).await;
    assert_eq!(sc["result"], "'written'", "{}", text(&r));
    assert_eq!(s.ok("x", "print('after')").await["stdout"], "after\n");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let logged = s.stop().await.into_bytes();
    let grown = logged.len() as u64 - start;
    eprintln!("the server's log grew by {grown} bytes");
    assert!(grown < 1 << 20, "the server's log grew by {grown} bytes for 50 MiB of agent stderr");
    assert!(!logged.contains(&0x1b), "a raw ESC byte reached the server's log");
    let logged = String::from_utf8_lossy(&logged);
    let mut shown = 0;
    for line in logged.lines() {
        assert!(!line.starts_with("1999-"), "a forged line passes for the server's own: {line:?}");
        if let Some(at) = line.find("FORGED") {
            let field = line.find("agent_stderr=").unwrap_or_else(|| panic!("unlabelled agent text: {line:?}"));
            assert!(field < at, "agent text outside its field: {line:?}");
            assert!(!line.contains('\r'), "a raw carriage return: {line:?}");
            if shown == 0 {
                eprintln!("logged: {}", line.chars().take(400).collect::<String>());
            }
            shown += 1;
        }
    }
    assert!(shown > 0, "the agent's stderr is still logged, labelled");
    assert!(logged.contains("agent_stderr_dropped="), "what was dropped is counted");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fifo_never_hangs_a_file_call_nor_costs_the_session_its_state() {
    let s = Server::start("fifo", &[]).await;
    s.ok("f", "import os\nos.mkfifo('pipe')\nx = 42").await;
    for (tool, args) in [
        ("read_file", json!({ "session": "f", "path": "pipe" })),
        ("write_file", json!({ "session": "f", "path": "pipe", "content": "hello" })),
        ("write_file", json!({ "session": "f", "path": "pipe", "content": "hello", "append": true })),
    ] {
        let t = Instant::now();
        let r = within(tool, s.call(tool, args)).await;
        assert!(t.elapsed() < Duration::from_secs(5), "{tool} on a FIFO took {:?}", t.elapsed());
        assert_eq!(r.is_error, Some(true), "{tool}: {}", text(&r));
        assert!(text(&r).contains("not a regular file"), "{tool}: {}", text(&r));
    }
    let t = Instant::now();
    let read = within(
        "resources/read",
        s.client().read_resource(ReadResourceRequestParams::new("pyberth://sessions/f/files/pipe")),
    )
    .await;
    assert!(t.elapsed() < Duration::from_secs(5), "resources/read on a FIFO took {:?}", t.elapsed());
    let e = read.expect_err("a FIFO is no resource");
    assert!(e.to_string().contains("not a regular file"), "{e}");
    let sc = s.ok("f", "x").await;
    assert_eq!(sc["result"], "42", "the session's variables survive: {sc}");
    assert_eq!(sc["state_lost"], false);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_repr_never_costs_the_session_its_variables() {
    let s = Server::start("slow-repr", &[]).await;
    let slow = "import time\nclass Slow:\n    def __repr__(self):\n        time.sleep(60)\n        return 'slow'\n\
                slow = Slow()\nkeep = 7";
    s.ok("v", slow).await;
    let t = Instant::now();
    let r = within("list_variables", s.call("list_variables", json!({ "session": "v" }))).await;
    let took = t.elapsed();
    assert!(took < Duration::from_secs(5), "list_variables took {took:?}");
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = r.structured_content.expect("structured");
    let vars = sc["variables"].as_array().expect("variables");
    let repr =
        |name: &str| vars.iter().find(|v| v["name"] == name).map(|v| v["repr"].as_str().unwrap_or("").to_owned());
    assert!(repr("slow").is_some_and(|r| r.contains("unavailable")), "{vars:?}");
    assert_eq!(repr("keep").as_deref(), Some("7"));
    let sc = s.ok("v", "keep").await;
    assert_eq!(sc["result"], "7", "state kept: {sc}");

    // A repr that swallows every interruption can only be stopped by a restart: the call says so.
    let stubborn = "import time\nclass Stubborn:\n    def __repr__(self):\n        while True:\n            try:\n                \
                    time.sleep(60)\n            except BaseException:\n                pass\nstubborn = Stubborn()";
    s.ok("v", stubborn).await;
    let r = within("list_variables", s.call("list_variables", json!({ "session": "v" }))).await;
    let said = text(&r);
    assert!(said.contains("restarted") && said.contains("variables are gone"), "the restart is said: {said}");
    let sc = s.ok("v", "'keep' in globals()").await;
    assert_eq!(sc["result"], "False", "{sc}");
    s.stop().await;
}

/// Kills the session's keeper and serves its socket instead: every relay that connects gets a
/// frame header claiming 4 GiB, then junk, on a connection held open (docs/design.md D12).
const FORGED_KEEPER: &str = r#"import os, socket, struct, time
d = '/tmp/.pyberth-keeper'
keeper = [p for p in os.listdir('/proc') if p.isdigit() and b'keep' in open('/proc/%s/cmdline' % p, 'rb').read().split(b'\0')]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.unlink(d + '/sock')
        s = socket.socket(socket.AF_UNIX)
        s.bind(d + '/sock')
        s.listen(8)
        for p in keeper:
            os.kill(int(p), 9)
        held = []
        while True:
            c, _ = s.accept()
            open('/workspace/accepted', 'a').write('1')
            try:
                c.sendall(struct.pack('>cI', b'1', 0xFFFFFFFF) + b'FORGED' * 1000)
            except OSError:
                pass
            held.append(c)
    os._exit(0)
time.sleep(2)
'planted'"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_keeper_is_dropped_and_the_session_recovers() {
    let s = Server::start("forged-keeper", &[]).await;
    s.ok("k", "x = 42").await;
    let (r, sc) = within("the forging run", s.run_with(json!({ "session": "k", "code": FORGED_KEEPER }))).await;
    assert!(!text(&r).contains("FORGED") && !sc.to_string().contains("FORGED"), "junk frames passed: {}", text(&r));
    // The server attached to the forged keeper at least once and still answers.
    let code = "print(len(open('/workspace/accepted').read()))";
    let sc = within("the call after", s.run("k", code)).await.1;
    let accepted: u32 = sc["stdout"].as_str().and_then(|o| o.trim().parse().ok()).unwrap_or(0);
    assert!(accepted >= 1, "no relay reached the forged keeper: {sc}");
    assert!(!sc.to_string().contains("FORGED"), "{sc}");
    assert_eq!(s.ok("k", "print('after')").await["stdout"], "after\n");
    s.stop().await;
}

/// The session's processes as the code sees them: each Python process's command line and
/// parent, the code's own pid and its `sys.argv`.
const LAYOUT: &str = r#"import json, os, sys
procs = {}
for p in os.listdir('/proc'):
    if not p.isdigit():
        continue
    try:
        cmd = open('/proc/%s/cmdline' % p, 'rb').read().decode().split('\0')
        ppid = int(open('/proc/%s/stat' % p).read().rsplit(')', 1)[1].split()[1])
    except (OSError, ValueError):
        continue
    if cmd[0].startswith('python') or '/python' in cmd[0]:
        procs[int(p)] = {'cmd': ' '.join(c for c in cmd if c), 'ppid': ppid}
print(json.dumps({'me': os.getpid(), 'parent': os.getppid(), 'argv': sys.argv, 'procs': procs}))"#;

/// Issue 29: the keeper is the agent's own forwarder, the interpreter its fork: one Python
/// process beside the interpreter, the code sees an agent's command line, and code that kills
/// its keeper (its parent now) costs only its own interpreter; the session goes on.
#[tokio::test(flavor = "multi_thread")]
async fn the_keeper_is_the_interpreters_parent_and_killing_it_costs_only_the_state() {
    let s = Server::start("keeper-parent", &[]).await;
    s.ok("k", "x = 42").await;
    let sc = within("the layout", s.run("k", LAYOUT)).await.1;
    let out = sc["stdout"].as_str().unwrap_or_default();
    let layout: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {sc}"));
    assert_eq!(layout["argv"], json!(["/opt/pyberth/agent.py"]), "the code sees the agent's argv: {layout}");
    let procs = layout["procs"].as_object().expect("processes");
    let parent = &procs[&layout["parent"].to_string()];
    let keeper = parent["cmd"].as_str().unwrap_or_default();
    assert!(keeper.contains("agent.main(sys.argv[1:]) keep "), "the keeper is the parent: {layout}");
    let pythons: Vec<&Value> =
        procs.values().filter(|p| !p["cmd"].as_str().unwrap_or_default().contains("keeper.py attach")).collect();
    assert_eq!(pythons.len(), 2, "one keeper and one interpreter, no third Python: {layout}");
    assert!(!out.contains("keeper.py keep"), "no keeper interpreter of its own: {layout}");

    // The attack: the code kills its keeper, output printed first.
    let kill = "import os, time\nprint('last words', flush=True)\nos.kill(os.getppid(), 9)\ntime.sleep(3)";
    let (r, sc) = within("the keeper's killing", s.run_with(json!({ "session": "k", "code": kill }))).await;
    assert_eq!(r.is_error, Some(true), "the run did not survive its keeper: {sc}");
    let sc = within("the call after", s.run("k", "print('after')\n'x' in globals()")).await.1;
    assert_eq!(sc["stdout"], "after\n", "{sc}");
    assert_eq!(sc["result"], "False", "a new interpreter answers: {sc}");
    s.stop().await;
}
