//! The orderly detach of a relay (docs/design.md D12, a graceful leave), with the real
//! keeper.py and both relays (the relay binary, relay.rs, and keeper.py's own when it is not
//! there) as local processes: a relay whose stdin ends writes out all it was sent, and the next relay gets the
//! rest; nothing lost, nothing twice.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const KEEPER_PY: &str = include_str!("../../images/python/keeper.py");
/// Lines the agent prints, as fast as it can: the keeper and the relays hold many at once.
/// More than every buffer on the way holds (the keeper's 1 MiB, its socket's, the relay's and
/// the pipe's: about 2 MiB), so the agent cannot have ended while the second relay is
/// attached: with 20 000 (160 KB) a slow reader under load got the agent's exit status in
/// place of its orderly leave (a flaky exit code 3).
const LINES: usize = 400_000;

/// A private scratch directory, removed at the end.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The relay binary the image carries, written into `bin`.
fn relay_bin(bin: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = bin.join("relay");
    std::fs::write(&path, crate::docker::image::RELAY).expect("the relay");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("executable");
    path.to_str().unwrap_or_default().to_owned()
}

/// A relay started with `argv`; its stdin and stdout piped.
fn relay(argv: &[&str], dir: &Path) -> Child {
    let agent = format!("import sys\nprint('hello')\nfor i in range({LINES}):\n    print('n', i)\nsys.exit(3)");
    Command::new(argv[0])
        .args(&argv[1..])
        .args(["attach", dir.to_str().unwrap_or_default(), "--", "python3", "-u", "-c", &agent])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 and the relay run")
}

/// Reads `take` lines of the relay after its hello, then closes its stdin (with `None`, it
/// stays open), and reads it to its end: the lines it gave, and its exit code.
fn read(mut child: Child, take: Option<usize>) -> (Vec<String>, Option<i32>) {
    let out = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(out).lines().map_while(Result::ok);
    assert_eq!(lines.next().as_deref(), Some("hello"), "each relay gets the hello first");
    let mut got: Vec<String> = Vec::new();
    if let Some(n) = take {
        got.extend(lines.by_ref().take(n));
        // The server leaves: the exec's stdin ends.
        drop(child.stdin.take());
    }
    got.extend(lines);
    let code = child.wait().expect("the relay ends").code();
    (got, code)
}

#[test]
fn a_relay_whose_stdin_ends_delivers_what_it_was_sent_and_the_next_gets_the_rest() {
    let root = std::env::temp_dir().join(format!("pyberth-relay-{}", std::process::id()));
    let scratch = Scratch(root.clone());
    // keeper.py alone, without the relay beside it: it relays itself (its relay()).
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).expect("scratch");
    let keeper = bin.join("keeper.py");
    std::fs::write(&keeper, KEEPER_PY).expect("keeper.py");
    let keeper = keeper.to_str().unwrap_or_default().to_owned();
    let dir = root.join("k");
    let python = ["python3", "-I", "-S", "-B", keeper.as_str()];

    // The first attach starts the keeper; its relay (Python's) leaves early.
    let (first, code) = read(relay(&python, &dir), Some(100));
    assert_eq!(code, Some(0), "a relay that let go in order exits 0");
    // The relay binary reaches the same keeper, and leaves too.
    let elsewhere = root.join("relay-bin");
    std::fs::create_dir_all(&elsewhere).expect("scratch");
    let (second, code) = read(relay(&[relay_bin(&elsewhere).as_str()], &dir), Some(100));
    assert_eq!(code, Some(0), "a relay that let go in order exits 0");
    // The last reads to the agent's end, and its status.
    let (third, code) = read(relay(&python, &dir), None);
    assert_eq!(code, Some(3), "the agent's status");

    assert!(first.len() >= 100 && second.len() >= 100, "each relay delivered what it read");
    let all: Vec<String> = first.into_iter().chain(second).chain(third).collect();
    let want: Vec<String> = (0..LINES).map(|i| format!("n {i}")).collect();
    let seen: std::collections::HashSet<&String> = all.iter().collect();
    let lost = want.iter().filter(|w| !seen.contains(w)).count();
    assert_eq!(lost, 0, "lines lost across the detaches ({} read)", all.len());
    assert!(all == want, "every line once, in order ({} read)", all.len());
    drop(scratch);
}

const AGENT_PY: &str = include_str!("../../images/python/agent.py");

/// A relay of our agent: the process, and its stdout as lines.
struct AgentRelay {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl AgentRelay {
    fn start(relay: &str, dir: &Path, agent: &Path, workspace: &Path) -> Self {
        let mut child = Command::new(relay)
            .args(["attach", dir.to_str().unwrap_or_default(), "--", "python3", "-I", "-u", "-B"])
            .arg(agent)
            .env("PYBERTH_WORKSPACE", workspace)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the relay runs");
        let lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        Self { child, lines }
    }

    /// The next event line, parsed.
    #[track_caller]
    fn event(&mut self) -> serde_json::Value {
        let line = self.lines.next().expect("the relay answers").expect("a line");
        serde_json::from_str(&line).expect("an event line")
    }

    /// Runs `code`; its `done` event.
    #[track_caller]
    fn run(&mut self, id: u64, code: &str) -> serde_json::Value {
        use std::io::Write;
        let line = serde_json::json!({"op": "run", "id": id, "code": code}).to_string() + "\n";
        self.child.stdin.as_mut().expect("piped").write_all(line.as_bytes()).expect("the relay reads");
        loop {
            let ev = self.event();
            if ev["ev"] == "done" {
                return ev;
            }
        }
    }
}

/// Kills the agent and its keeper when the test ends, however it ends (they outlive relays).
struct Ends([i64; 2]);

impl Drop for Ends {
    fn drop(&mut self) {
        for pid in self.0 {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).stderr(Stdio::null()).status();
        }
    }
}

/// Field `n` (1-based, as proc(5) counts them) of /proc/PID/stat.
fn stat_field(pid: i64, n: usize) -> i64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process lives");
    let after = stat.rsplit_once(") ").map(|(_, rest)| rest).expect("a stat line");
    after.split(' ').nth(n - 3).and_then(|f| f.parse().ok()).expect("a number")
}

#[test]
fn the_relay_starts_our_agent_as_its_own_detached_keeper_and_the_next_relay_finds_it() {
    let root = std::env::temp_dir().join(format!("pyberth-relay-agent-{}", std::process::id()));
    let scratch = Scratch(root.clone());
    let (bin, workspace) = (root.join("bin"), root.join("ws"));
    for dir in [&bin, &workspace] {
        std::fs::create_dir_all(dir).expect("scratch");
    }
    std::fs::write(bin.join("agent.py"), AGENT_PY).expect("agent.py");
    std::fs::write(bin.join("keeper.py"), KEEPER_PY).expect("keeper.py");
    let (agent, dir) = (bin.join("agent.py"), root.join("k"));
    let relay = relay_bin(&bin);

    // The first attach starts the agent (no keeper listens yet); its hello names the interpreter.
    let mut first = AgentRelay::start(&relay, &dir, &agent, &workspace);
    let hello = first.event();
    assert_eq!(hello["ev"], "hello", "the agent's hello comes first: {hello}");
    let interpreter = hello["pid"].as_i64().expect("the interpreter's pid");
    let keeper = stat_field(interpreter, 4);
    let _ends = Ends([interpreter, keeper]);
    assert_eq!(first.run(1, "x = 41")["status"], "ok");
    drop(first.child.stdin.take());
    assert_eq!(first.child.wait().expect("the relay ends").code(), Some(0), "a relay that let go exits 0");

    // The keeper is the interpreter's parent, leads a session of its own (not the test's),
    // and outlived the relay; the next relay reaches the same interpreter, its state kept.
    assert_eq!(stat_field(keeper, 6), keeper, "the keeper leads a session of its own");
    assert_ne!(stat_field(keeper, 6), stat_field(std::process::id().into(), 6), "not the test's session");
    let mut second = AgentRelay::start(&relay, &dir, &agent, &workspace);
    let hello = second.event();
    assert_eq!(hello["pid"].as_i64(), Some(interpreter), "the same interpreter: {hello}");
    assert_eq!(second.run(2, "x + 1")["result"], "42", "its state kept");
    // The agent ends (and so its keeper): the relay passes its status on.
    {
        use std::io::Write;
        let stdin = second.child.stdin.as_mut().expect("piped");
        stdin.write_all(b"{\"op\":\"shutdown\"}\n").expect("the relay reads");
    }
    assert_eq!(second.child.wait().expect("the relay ends").code(), Some(0), "the agent's status");
    // Gone, or a zombie its reaper (init here) has not collected yet.
    let ended = || std::fs::read_to_string(format!("/proc/{keeper}/stat")).map_or(true, |s| s.contains(") Z "));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !ended() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(ended(), "the keeper went with its agent");
    drop(scratch);
}
