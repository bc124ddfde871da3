//! Code mode (issue 30): Python in a session calls the operator's upstream MCP servers, real
//! ones from the package index (`mcp-server-time`, `mcp-server-git`) and a hostile one
//! (`codemode/hostile_upstream.py`, on the same venv's `mcp` package), through the real binary,
//! a real MCP client and the real engine.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{Server, state_dir, text};

// Calls across a dropped exec stream (the code killing its own relay).
mod reattach;

/// A secret the hostile upstream gets in its environment from the server's: it must reach
/// neither the sandbox nor a result.
const SECRET: &str = "pyberth-codemode-secret-5f1c9a";

/// The venv with the published upstreams (`common::venv_with`).
fn venv() -> PathBuf {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    let probe = "import mcp_server_time, mcp_server_git, mcp.server.mcpserver";
    VENV.get_or_init(|| crate::common::venv_with("codemode-venv", &["mcp-server-time", "mcp-server-git"], probe))
        .clone()
}

/// A test's own directory: a git repository, the hostile upstream's marks, the config file.
struct Fixture {
    dir: PathBuf,
    config: String,
}

impl Fixture {
    fn new(tag: &str, environments: &str) -> Fixture {
        let venv = venv();
        let dir = state_dir().join(format!("codemode-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let repo = dir.join("repo");
        let marks = dir.join("marks");
        std::fs::create_dir_all(&repo).expect("repo dir");
        std::fs::create_dir_all(&marks).expect("marks dir");
        let git = |args: &[&str]| {
            let ok = Command::new("git").arg("-C").arg(&repo).args(args).status().is_ok_and(|s| s.success());
            assert!(ok, "git {args:?}");
        };
        git(&["init", "-q"]);
        git(&["config", "user.email", "t@example.com"]);
        git(&["config", "user.name", "t"]);
        std::fs::write(repo.join("a.txt"), "one\n").expect("file");
        git(&["add", "a.txt"]);
        git(&["commit", "-q", "-m", "first commit"]);
        let python = venv.join("bin/python");
        let hostile = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/integration/codemode/hostile_upstream.py");
        let config = dir.join("pyberth.toml");
        let text = format!(
            "[upstreams.time]\ncommand = {python:?}\nargs = [\"-m\", \"mcp_server_time\", \"--local-timezone\", \"UTC\"]\n\n\
             [upstreams.git]\ncommand = {python:?}\nargs = [\"-m\", \"mcp_server_git\", \"--repository\", {repo:?}]\n\n\
             [upstreams.bad]\ncommand = {python:?}\nargs = [{hostile:?}]\ntimeout_s = 5\nmax_result_kb = 1024\n\
             env = {{ MARKS = {marks:?}, UPSTREAM_TOKEN = \"env:CODEMODE_TEST_SECRET\" }}\n\n{environments}",
            python = python.display().to_string(),
            repo = repo.display().to_string(),
            hostile = hostile.display().to_string(),
            marks = marks.display().to_string(),
        );
        std::fs::write(&config, text).expect("config");
        Fixture { config: config.display().to_string(), dir }
    }

    async fn server(&self, tag: &str) -> Server {
        Server::start(tag, &[("PYBERTH_CONFIG", &self.config), ("CODEMODE_TEST_SECRET", SECRET)]).await
    }

    fn repo(&self) -> String {
        self.dir.join("repo").display().to_string()
    }

    fn marks(&self, name: &str) -> usize {
        std::fs::read_to_string(self.dir.join("marks").join(name)).map_or(0, |t| t.lines().count())
    }

    /// Waits up to 20 s for the mark `name` to be written `n` times.
    async fn await_mark(&self, name: &str, n: usize) -> bool {
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            if self.marks(name) >= n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `code` in `session` of `environment`: the result, its structured content, its text.
async fn run(s: &Server, session: &str, environment: &str, code: &str) -> (bool, Value, String) {
    let (r, sc) = s.run_with(json!({ "session": session, "environment": environment, "code": code })).await;
    (r.is_error == Some(true), sc, text(&r))
}

const ENVIRONMENTS: &str = "[environments.default]\ntools = [\"time:*\", \"git:*\"]\n\n\
                            [environments.writer]\ntools = [\"git:*\"]\nwrite_tools = [\"git:git_add\", \"git:git_commit\"]\n\n\
                            [environments.timeonly]\ntools = [\"time:get_*\"]\n";

#[tokio::test(flavor = "multi_thread")]
async fn python_calls_time_and_git_and_the_allow_list_holds_against_forged_calls() {
    let f = Fixture::new("allow", ENVIRONMENTS);
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port");
    let metrics = metrics.to_string();
    let env =
        [("PYBERTH_CONFIG", f.config.as_str()), ("CODEMODE_TEST_SECRET", SECRET), ("PYBERTH_METRICS_ADDR", &metrics)];
    let s = Server::start("codemode-allow", &env).await;

    // The model's view: what it may call, and how.
    let listed = s.call("list_bridged_tools", json!({})).await;
    let t = text(&listed);
    assert!(t.contains("tools.time.get_current_time") && t.contains("tools.git.git_log"), "{t}");
    assert!(t.contains("tools.git.git_commit(...) [not allowed"), "write tools are marked: {t}");
    assert!(t.contains("import tools"), "with an example: {t}");

    // Structured data from a published server, with a signature and a docstring.
    let code = "import tools, inspect\nr = tools.time.get_current_time(timezone='UTC')\n\
                print(type(r).__name__, r['timezone'], sorted(r))\n\
                print(inspect.signature(tools.time.get_current_time))\n\
                print('IANA' in tools.time.get_current_time.__doc__)\n\
                print(tools.search('convert'))\n\
                print(tools.describe('time.convert_time').splitlines()[0])";
    let (err, sc, t) = run(&s, "a", "default", code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("dict UTC ['datetime', 'day_of_week', 'is_dst', 'timezone']"), "{out}");
    assert!(out.contains("(*, timezone)"), "{out}");
    assert!(out.contains("True\n['time.convert_time: Convert time between timezones']"), "{out}");
    assert!(out.contains("time.convert_time(*, source_timezone, time, target_timezone)"), "{out}");
    assert_eq!(sc["tool_calls"], json!({ "made": 1, "refused": 0 }), "counted in the result");

    // What a new user asks first: ten time zones in one program, one table back.
    let code = "import tools\nzones = ['UTC', 'Europe/Paris', 'Asia/Tokyo', 'America/New_York', 'Australia/Sydney',\n\
                'Asia/Kolkata', 'Africa/Cairo', 'America/Sao_Paulo', 'Europe/London', 'Pacific/Auckland']\n\
                for z in zones:\n    r = tools.time.get_current_time(timezone=z)\n    print(f\"{z:20} {r['datetime'][11:16]} {r['day_of_week']}\")";
    let (err, sc, t) = run(&s, "a", "default", code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert_eq!(out.lines().count(), 10, "{out}");
    assert!(out.contains("Pacific/Auckland"), "{out}");
    assert_eq!(sc["tool_calls"], json!({ "made": 10, "refused": 0 }));
    assert!(t.contains("[tool calls] 10 made, 0 refused"), "text-only clients read the count too: {t}");

    // git_log reads; git_commit, not read-only, is refused until the operator names it.
    let repo = f.repo();
    let code = format!(
        "import tools\nprint(tools.git.git_log(repo_path={repo:?}, max_count=1))\n\
         try:\n    tools.git.git_commit(repo_path={repo:?}, message='from the sandbox')\n\
         except tools.ToolError as e:\n    print('refused:', e)"
    );
    let (err, sc, t) = run(&s, "a", "default", &code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("first commit"), "{out}");
    assert!(out.contains("refused: git.git_commit is not marked read-only") && out.contains("write_tools"), "{out}");
    assert_eq!(sc["tool_calls"], json!({ "made": 1, "refused": 1 }));
    std::fs::write(Path::new(&repo).join("b.txt"), "two\n").expect("file");
    let code = format!(
        "import tools\nprint(tools.git.git_add(repo_path={repo:?}, files=['b.txt']))\n\
         print(tools.git.git_commit(repo_path={repo:?}, message='from the sandbox'))"
    );
    let (err, _, t) = run(&s, "w", "writer", &code).await;
    assert!(!err, "allowed by name in environment writer: {t}");
    let log = Command::new("git").args(["-C", &repo, "log", "--format=%s"]).output().expect("git log");
    assert!(String::from_utf8_lossy(&log.stdout).contains("from the sandbox"), "the commit is in the repository");

    // Off the list: from Python, and from messages forged on the agent's own channel.
    let code = format!(
        "import tools\nprint(tools.servers())\n\
         try:\n    tools.git\nexcept AttributeError as e:\n    print('attr:', e)\n\
         try:\n    tools.time.convert_time\nexcept AttributeError as e:\n    print('attr:', e)\n\
         b = display.__self__.bridge\n\
         for name in ['git.git_log', 'git.git_commit', 'time.convert_time', 'nope.x', 'time']:\n\
         \x20   try:\n        b.request('call', name, {{'repo_path': {repo:?}}})\n\
         \x20   except tools.ToolError as e:\n        print('forged:', e)"
    );
    let (err, sc, t) = run(&s, "t", "timeonly", &code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("['time']"), "{out}");
    assert!(out.contains("attr: no upstream 'git'"), "{out}");
    assert!(out.contains("attr: tools.time has no tool 'convert_time'"), "{out}");
    for refused in
        ["git.git_log is not on", "git.git_commit is not on", "time.convert_time is not on", "nope.x is not on"]
    {
        assert!(out.contains(&format!("forged: {refused} this session's allow-list")), "{refused}: {out}");
    }
    assert!(out.contains("forged: \"time\" is not server.tool"), "{out}");
    assert_eq!(sc["tool_calls"], json!({ "made": 0, "refused": 5 }), "none went upstream");

    // Counted in the metrics by configured upstream; names the sandbox made up are "other".
    let body = crate::common::scrape(&format!("http://{metrics}/metrics"), None).await;
    let line = |l: &str| body.lines().any(|t| t == l);
    assert!(line(r#"pyberth_bridged_calls_total{upstream="time",outcome="ok"} 11"#), "{body}");
    assert!(line(r#"pyberth_bridged_calls_total{upstream="git",outcome="ok"} 3"#), "{body}");
    assert!(line(r#"pyberth_bridged_calls_total{upstream="git",outcome="refused"} 3"#), "{body}");
    assert!(line(r#"pyberth_bridged_calls_total{upstream="other",outcome="refused"} 2"#), "{body}");
    assert!(line("pyberth_bridged_call_duration_seconds_count 20"), "{body}");

    let log = s.stop().await;
    assert!(log.contains("bridged tool call") && log.contains("upstream=\"time\""), "audited");
    assert!(log.contains("outcome=\"refused\"") || log.contains("outcome=refused"), "refusals audited");
}

#[tokio::test(flavor = "multi_thread")]
async fn budgets_hostile_upstreams_and_interrupts_are_contained_and_secrets_stay_on_the_host() {
    let f = Fixture::new("hostile", "[environments.default]\ntools = [\"bad:*\"]\n");
    let s = f.server("codemode-hostile").await;

    // The 101st call of a run is stopped with a clear exception; the next run has a new budget.
    let code = "import tools\nn = 0\ntry:\n    for i in range(200):\n        tools.bad.echo(text=str(i))\n        n += 1\n\
                except tools.ToolError as e:\n    print(n, e)";
    let (err, sc, t) = run(&s, "h", "default", code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("100 call budget spent: a run may make 100 tool calls"), "{out}");
    assert_eq!(sc["tool_calls"], json!({ "made": 100, "refused": 1 }));

    // Hanging: the call times out (the upstream's 5 s), is cancelled upstream, and the run goes on.
    let code = "import tools\ntry:\n    tools.bad.hang()\nexcept tools.ToolError as e:\n    print('hang:', e)\n\
                print(tools.bad.echo(text='after'))";
    let (err, sc, t) = run(&s, "h", "default", code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("hang: upstream bad did not answer hang within 5 s") && out.contains("after"), "{out}");
    assert!(f.await_mark("hang-cancelled", 1).await, "the timed-out call was cancelled upstream");

    // Interrupting the run (its time limit) mid-call cancels the upstream call.
    let (r, sc) = s.run_with(json!({ "session": "h", "code": "import tools\ntools.bad.hang()", "timeout_s": 2 })).await;
    assert_eq!(sc["status"], "timeout", "{}", text(&r));
    assert!(f.await_mark("hang-started", 2).await);
    assert!(f.await_mark("hang-cancelled", 2).await, "the interrupted run's call was cancelled upstream");
    // The client giving up on the call (notifications/cancelled) cancels the upstream call too.
    let args = json!({ "session": "h", "code": "import tools\ntools.bad.hang()" });
    let abandoned = tokio::time::timeout(Duration::from_secs(2), s.run_with(args)).await;
    assert!(abandoned.is_err(), "the call was still going");
    assert!(f.await_mark("hang-started", 3).await);
    assert!(f.await_mark("hang-cancelled", 3).await, "the abandoned call's upstream call was cancelled");
    let sc = s.ok("h", "x = 1\nx").await;
    assert_eq!(sc["result"], "1", "the interpreter is kept");

    // Crashing: a clear error, then the upstream starts again for the next call.
    let code = "import tools\ntry:\n    tools.bad.crash()\nexcept tools.ToolError as e:\n    print('crash:', e)\n\
                import time\nfor i in range(50):\n    try:\n        print(tools.bad.echo(text='back')); break\n\
                \x20   except tools.ToolError as e:\n        time.sleep(0.2)";
    let (err, sc, t) = run(&s, "h", "default", code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("crash: upstream bad failed") && out.contains("back"), "{out}");
    assert_eq!(f.marks("crashed"), 1);

    // 50 MB: refused whole, the server and the session unharmed.
    let code = "import tools\ntry:\n    tools.bad.huge()\nexcept tools.ToolError as e:\n    print('huge:', str(e)[:200])\n\
                print('echo', 'y' * 1000 in str(tools.bad.echo(text='y' * 1000)))";
    let (err, sc, t) = run(&s, "h", "default", code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("huge: upstream bad sent a message over 1024 KiB") && out.contains("echo True"), "{out}");
    assert!(t.len() < 100_000, "nothing of the 50 MB reaches the result");

    // The upstream's credential: set on the host, nowhere in the sandbox nor in any result.
    let code = format!(
        "import os, gc, subprocess, tools\nprint(tools.bad.secret())\n\
         print('env:', any({SECRET:?} in v for v in os.environ.values()))\n\
         print('objects:', any(isinstance(o, str) and {SECRET:?} in o for o in gc.get_objects()))\n\
         g = subprocess.run(['grep', '-rls', {SECRET:?}, '/workspace', '/tmp', '/opt', '/etc', '/proc/self/environ'], capture_output=True, text=True)\n\
         print('files:', g.stdout.strip() or 'none')"
    );
    let (err, sc, t) = run(&s, "h", "default", &code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("token set: True"), "the upstream has it: {out}");
    assert!(out.contains("env: False") && out.contains("objects: False") && out.contains("files: none"), "{out}");
    let listed = s.call("list_bridged_tools", json!({})).await;
    assert!(!text(&listed).contains(SECRET));
    let log = s.stop().await;
    assert!(!log.contains(SECRET), "nor in the server's log");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_over_streamable_http_gets_its_header_from_the_host() {
    use tokio::io::AsyncBufReadExt as _;
    let hostile = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/integration/codemode/hostile_upstream.py");
    let mut upstream = tokio::process::Command::new(venv().join("bin/python"))
        .arg(&hostile)
        .arg("http")
        .env("EXPECT_TOKEN", SECRET)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the HTTP upstream");
    // It listens before it says its port: no other test can take the port in between.
    let stdout = upstream.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line());
    let port: u16 = first
        .await
        .ok()
        .and_then(|l| l.ok().flatten())
        .and_then(|l| l.trim().parse().ok())
        .expect("the HTTP upstream says its port");
    let envs = format!(
        "[upstreams.web]\nurl = \"http://127.0.0.1:{port}/mcp\"\nheaders = {{ Authorization = \"env:CODEMODE_TEST_AUTH\" }}\n\n\
         [upstreams.nokey]\nurl = \"http://127.0.0.1:{port}/mcp\"\n\n\
         [environments.default]\ntools = [\"web:echo\", \"nokey:echo\"]\n"
    );
    let f = Fixture::new("http", &envs);
    let auth = format!("Bearer {SECRET}");
    let s = Server::start(
        "codemode-http",
        &[("PYBERTH_CONFIG", &f.config), ("CODEMODE_TEST_SECRET", SECRET), ("CODEMODE_TEST_AUTH", &auth)],
    )
    .await;
    let code = "import tools\nprint(tools.web.echo(text='over http'))\nprint(tools.search('echo'))";
    let (err, sc, t) = run(&s, "w", "default", code).await;
    assert!(!err, "{t}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("over http"), "{out}");
    // The upstream without the header is refused by it: listed as unavailable, never a secret.
    assert!(out.contains("nokey: unavailable"), "{out}");
    assert!(!t.contains(SECRET), "the header's value is in no result");
    let log = s.stop().await;
    assert!(!log.contains(SECRET), "nor in the server's log");
    let _ = upstream.kill().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_code_mode_configuration_stops_the_server_naming_the_key_and_never_a_value() {
    let dir = state_dir().join(format!("codemode-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("pyberth.toml");
    for (file, want) in [
        ("[upstreams.x]\ncommand = \"x\"\nenv = { T = \"env:CODEMODE_UNSET_VAR\" }\n", "upstreams.x.env.T"),
        ("[upstreams.x]\nurl = \"ftp://h\"\n", "upstreams.x.url"),
        ("[upstreams.x]\ncommand = \"x\"\n[environments.e]\ntools = [\"y:*\"]\n", "environments.e.tools"),
        ("[upstreams.x]\ncommand = \"x\"\n[environments.e]\ntools = [\"x:*\"]\nwrite_tools = [\"x:*\"]\n", "full name"),
        ("[upstreams.x]\ncommand = \"x\"\n[principals.bob]\ntools = [\"y:*\"]\n", "principals.bob.tools"),
    ] {
        std::fs::write(&config, file).expect("config");
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
            .args(["serve", "--config"])
            .arg(&config)
            .env("PYBERTH_STATE_DIR", state_dir())
            .env_remove("CODEMODE_UNSET_VAR")
            .stdin(std::process::Stdio::null())
            .output();
        let out = tokio::time::timeout(Duration::from_secs(60), out).await.expect("exits").expect("output");
        assert!(!out.status.success(), "{file}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{file}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_principals_own_list_narrows_its_sessions_and_nothing_a_session_sends_widens_it() {
    use crate::http::{ALICE, BOB, HttpServer, call};
    let f = Fixture::new(
        "principals",
        "[environments.default]\ntools = [\"time:*\", \"bad:echo\"]\n\n[principals.bob]\ntools = [\"time:get_*\"]\n",
    );
    let s = HttpServer::start_with(
        "codemode-principals",
        &[("PYBERTH_CONFIG", &f.config), ("CODEMODE_TEST_SECRET", SECRET)],
        None,
    )
    .await;
    let (alice, bob) = (s.client(ALICE).await, s.client(BOB).await);

    let (r, _) = call(&bob, "list_bridged_tools", json!({})).await;
    let t = text(&r);
    assert!(
        t.contains("tools.time.get_current_time") && !t.contains("convert_time") && !t.contains("tools.bad"),
        "{t}"
    );

    // Bob, from Python and forged, in a session he named like alice's.
    let code = "import tools\nprint(tools.servers())\nprint(tools.time.get_current_time(timezone='UTC')['timezone'])\n\
                b = display.__self__.bridge\n\
                for name, args in [('time.convert_time', {'source_timezone': 'UTC', 'time': '12:00', 'target_timezone': 'UTC'}), ('bad.echo', {'text': 'x'})]:\n\
                \x20   try:\n        print(b.request('call', name, args))\n    except tools.ToolError as e:\n        print('refused:', e)";
    let (r, sc) = call(&bob, "run_python", json!({ "session": "shared", "code": code })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("['time']\nUTC\n"), "{out}");
    assert!(out.contains("refused: time.convert_time is not on this session's allow-list"), "{out}");
    assert!(out.contains("refused: bad.echo is not on this session's allow-list"), "{out}");
    assert_eq!(sc["tool_calls"], json!({ "made": 1, "refused": 2 }));

    // Alice, with no list of her own, has the environment's whole list.
    let code = "import tools\nprint(tools.time.convert_time(source_timezone='UTC', time='12:00', target_timezone='UTC')['time_difference'])\n\
                print(tools.bad.echo(text='alice'))";
    let (r, sc) = call(&alice, "run_python", json!({ "session": "shared", "code": code })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("+0.0h") && out.contains("alice"), "{out}");
    drop((alice, bob));
    s.stop().await;
}

/// `pyberth run` of a script in code mode: the same configuration file, the same allow-list,
/// enforced by the same server code; the program's own exit status.
#[tokio::test(flavor = "multi_thread")]
async fn pyberth_run_scripts_call_the_same_upstreams_under_the_same_allow_list() {
    use crate::cli::{pyberth_run_with, scratch, streams};
    let f = Fixture::new("run", ENVIRONMENTS);
    let dir = scratch("codemode-run");
    std::fs::write(
        dir.join("zones.py"),
        "import sys, tools\nr = tools.time.get_current_time(timezone=sys.argv[1])\n\
         print('zone', r['timezone'], sorted(r), sys.argv[2:], __name__)\n\
         try:\n    tools.call('time.convert_time', source_timezone='UTC', time='12:00', target_timezone='Asia/Tokyo')\n\
         except tools.ToolError as e:\n    print('caught:', e)\n",
    )
    .expect("script");
    std::fs::write(
        dir.join("off.py"),
        "import tools\nprint('before')\ntools.call('git.git_log', repo_path='/x')\nprint('after')\n",
    )
    .expect("script");
    let envs = [("PYBERTH_CONFIG", f.config.as_str()), ("CODEMODE_TEST_SECRET", SECRET)];
    let timeonly = ["--environment", "timeonly"];

    let args = [&timeonly[..], &["zones.py", "--", "Europe/Paris", "x y"]].concat();
    let (o, _) = pyberth_run_with("cm-run", &dir, &args, None, &envs).await;
    let (out, err) = streams(&o);
    assert_eq!(o.status.code(), Some(0), "stdout: {out}\nstderr: {err}");
    assert!(
        out.contains("zone Europe/Paris ['datetime', 'day_of_week', 'is_dst', 'timezone'] ['x y'] __main__"),
        "{out}"
    );
    assert!(out.contains("caught: time.convert_time is not on this session's allow-list"), "{out}");
    // The audit, one line per call, and our own count in the closing lines.
    let audit: Vec<&str> = err.lines().filter(|l| l.contains("bridged tool call")).collect();
    assert_eq!(audit.len(), 2, "{err}");
    assert!(audit.iter().any(|l| l.contains("get_current_time") && l.contains("ok") && l.contains("cli")), "{err}");
    assert!(audit.iter().any(|l| l.contains("convert_time") && l.contains("refused")), "{err}");
    assert!(err.contains("[pyberth] tool calls: 1 made, 1 refused"), "{err}");
    assert!(!out.contains(SECRET) && !err.contains(SECRET));

    // A tool off the list, not caught: the script's traceback names the refusal, exit 1.
    let (o, _) = pyberth_run_with("cm-off", &dir, &[&timeonly[..], &["off.py"]].concat(), None, &envs).await;
    let (out, err) = streams(&o);
    assert_eq!(o.status.code(), Some(1), "stdout: {out}\nstderr: {err}");
    assert_eq!(out, "before\n");
    assert!(err.contains("ToolError: git.git_log is not on this session's allow-list"), "{err}");
    assert!(err.contains("off.py\", line 3"), "the traceback starts at the script: {err}");
    assert!(!err.contains("runpy"), "none of the wrapper's frames: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}
