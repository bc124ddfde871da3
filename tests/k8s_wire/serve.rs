//! `pyberth serve` with `engine = "kubernetes"`: the real binary, over stdio, driven by the real
//! rmcp client, its sessions pods of the simulated API server (each a container of the local
//! Docker engine running our sandbox image). What it proves is the seam over our model of the
//! API server, not a real cluster.

use std::process::Stdio;
use std::time::{Duration, Instant};

use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::RunningService;
use serde_json::{Value, json};

use super::apiserver::{Options, Sim};
use super::docker;

/// A server of the Kubernetes engine, its client, and the files it was started with.
pub(super) struct Served {
    client: Option<RunningService<rmcp::RoleClient, ()>>,
    pub(super) child: tokio::process::Child,
    pub(super) dir: std::path::PathBuf,
    /// Its directory is its own (removed when it is dropped), not one servers share.
    owns_dir: bool,
    tag: String,
}

impl Served {
    async fn start(sim: &Sim, tag: &str) -> Served {
        Self::start_with(sim, tag, 0).await
    }

    async fn start_with(sim: &Sim, tag: &str, pool: usize) -> Served {
        Self::start_cfg(sim, tag, pool, "").await
    }

    /// With `extra` lines of settings at the top of the config.
    pub(super) async fn start_cfg(sim: &Sim, tag: &str, pool: usize, extra: &str) -> Served {
        let dir = std::env::temp_dir().join(format!("pyberth-k8s-serve-{}-{tag}", std::process::id()));
        let mut s = Self::start_in(sim, &dir, tag, pool, extra).await;
        s.owns_dir = true;
        s
    }

    /// In `dir` (its config, log and state dir, which a next server started there shares),
    /// as instance `tag`, with `extra` lines of settings.
    pub(super) async fn start_in(sim: &Sim, dir: &std::path::Path, tag: &str, pool: usize, extra: &str) -> Served {
        // An environment with egress, whose proxy pod cannot start on this simulator (no
        // egress network, no proxy image): a clear tool error.
        let tail = "[environments.net]\negress = [\"example.com:443\"]\n";
        Self::start_tables(sim, dir, tag, &format!("{extra}pool_size = {pool}\n"), tail).await
    }

    /// In `dir`, with `extra` settings at the top and `tables` (TOML tables) at the end.
    pub(super) async fn start_tables(sim: &Sim, dir: &std::path::Path, tag: &str, extra: &str, tables: &str) -> Served {
        let dir = dir.to_owned();
        std::fs::create_dir_all(&dir).expect("dir");
        let kubeconfig = sim.kubeconfig(&dir);
        let config = dir.join("k8s.toml");
        let text = format!(
            "{extra}engine = \"kubernetes\"\nk8s_namespace = \"pyberth\"\nkubeconfig = {kubeconfig:?}\n{tables}"
        );
        std::fs::write(&config, text).expect("config");
        let log = std::fs::File::create(dir.join(format!("server-{tag}.log"))).expect("log");
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .env("PYBERTH_INSTANCE", format!("k8s{}-{tag}", std::process::id()))
            .env("PYBERTH_STATE_DIR", dir.join("state"))
            .env("RUST_LOG", "pyberth=debug,info")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .expect("spawn pyberth");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take().expect("stdin");
        let client = ().serve((stdout, stdin)).await.expect("MCP initialise");
        Served { client: Some(client), child, dir, owns_dir: false, tag: tag.to_owned() }
    }

    pub(super) async fn call(&self, tool: &'static str, args: Value) -> CallToolResult {
        let args = args.as_object().expect("object arguments").clone();
        let client = self.client.as_ref().expect("connected");
        let call = client.call_tool(CallToolRequestParams::new(tool).with_arguments(args));
        match tokio::time::timeout(Duration::from_secs(120), call).await {
            Ok(r) => r.unwrap_or_else(|e| panic!("{tool} failed at the protocol level: {e}")),
            Err(_) => panic!("{tool} did not answer within 120 s; server log:\n{}", self.log()),
        }
    }

    /// A call that must succeed: its structured content.
    pub(super) async fn ok(&self, tool: &'static str, args: Value) -> Value {
        let r = self.call(tool, args).await;
        assert_eq!(r.is_error, Some(false), "{tool}: {}\nserver log:\n{}", text(&r), self.log());
        r.structured_content.unwrap_or(Value::Null)
    }

    pub(super) fn log(&self) -> String {
        let text = self.whole_log();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Its whole log.
    pub(super) fn whole_log(&self) -> String {
        std::fs::read_to_string(self.dir.join(format!("server-{}.log", self.tag))).unwrap_or_default()
    }

    /// Closes stdin and waits for the server to stop (it removes its sessions' pods, unless
    /// it keeps sessions).
    pub(super) async fn stop(mut self) {
        if let Some(c) = self.client.take() {
            let _ = c.cancel().await;
        }
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        assert!(status.is_ok(), "the server did not exit within 30 s of its stdin closing");
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        // The child is killed on drop (`kill_on_drop`); the simulator removes the pods'
        // containers when it is dropped.
        if self.owns_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

pub(crate) fn text(r: &CallToolResult) -> String {
    r.content.iter().filter_map(|c| c.as_text().map(|t| t.text.clone())).collect::<Vec<_>>().join("\n")
}

/// Containers the simulated node runs for `sim`'s pods.
pub(super) async fn node_containers(sim: &Sim) -> usize {
    let filter = format!("{}={}", super::docker_pod::LABEL_SIM, sim.state.sim);
    let filters = std::collections::HashMap::from([("label", vec![filter.as_str()])]);
    let opts = bollard::query_parameters::ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    docker().list_containers(Some(opts)).await.expect("list").len()
}

/// The Leases the simulator holds (heartbeats and their marks).
fn leases(sim: &Sim) -> Vec<Value> {
    let objects = sim.state.objects.lock().expect("objects");
    objects.iter().filter(|((p, _), _)| p == "leases").map(|(_, v)| v.clone()).collect()
}

pub(super) fn pods(sim: &Sim) -> Vec<String> {
    sim.state.pods.lock().expect("pods").keys().cloned().collect()
}

/// A background job, read with the job tools; it ran in the same interpreter (`x` is 41).
pub(super) async fn background_job(s: &Served) {
    let code = "import time\ntime.sleep(1)\ny = x * 2\nprint('job', y)";
    let sc = s.ok("run_python", json!({ "session": "k", "code": code, "background": true })).await;
    let job = sc["job"].as_str().unwrap_or_else(|| panic!("a job handle: {sc}")).to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    let done = loop {
        let sc = s.ok("job_status", json!({ "job": job, "wait_s": 5 })).await;
        if sc["status"] != "running" {
            break sc;
        }
        assert!(Instant::now() < deadline, "job {job} still running");
    };
    assert_eq!(done["status"], "ok", "{done}");
    assert_eq!(done["stdout"], "job 82\n", "{done}");
}

/// Features the engine does not have yet are tool errors that say so, not crashes.
async fn refusals(s: &Served) {
    let r = s.call("run_python", json!({ "session": "n", "environment": "net", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    let said = text(&r);
    assert!(said.contains("egress proxy"), "{said}");
    assert!(!said.contains("Docker responded"), "the engine's own words, not Docker's: {said}");
    // Installs need the layer store's claim, which this server was not given: said so.
    let r = s.call("install_packages", json!({ "session": "k", "packages": ["six"] })).await;
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    assert!(
        text(&r).contains(
            "package installs on Kubernetes need k8s_mode = \"pods\" and the layer store: set k8s_layer_claim"
        ),
        "{}",
        text(&r)
    );
}

/// A run over its time limit is interrupted (a sleep, and a loop that only a signal stops);
/// the interpreter and its state stay.
async fn timeouts_keep_the_state(s: &Served) {
    for code in ["import time\ntime.sleep(30)", "while True: pass"] {
        let r = s.call("run_python", json!({ "session": "k", "code": code, "timeout_s": 2 })).await;
        let sc = r.structured_content.clone().unwrap_or(Value::Null);
        assert_eq!(
            (r.is_error, &sc["status"], &sc["state_lost"]),
            (Some(true), &json!("timeout"), &json!(false)),
            "{sc}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_sessions_as_pods_of_the_cluster() {
    let sim = Sim::start(Options::default(), docker()).await;
    let s = Served::start(&sim, "life").await;

    // State is kept between calls: the interpreter lives in the pod.
    let sc = s.ok("run_python", json!({ "session": "k", "code": "import os\nx = 41\nprint(os.getuid() > 0)" })).await;
    assert_eq!(sc["stdout"], "True\n", "{sc}");
    let sc = s.ok("run_python", json!({ "session": "k", "code": "print(x + 1)" })).await;
    assert_eq!(sc["stdout"], "42\n", "{sc}");
    let made = pods(&sim);
    assert_eq!(made.len(), 1, "one pod for the session: {made:?}");
    let pod = made[0].clone();
    assert!(pod.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'), "{pod}");

    // Files: written and read back through the agent in the pod, and seen by the code.
    s.ok("write_file", json!({ "session": "k", "path": "notes/a.txt", "content": "over the wire\n" })).await;
    let sc = s.ok("read_file", json!({ "session": "k", "path": "notes/a.txt" })).await;
    assert_eq!(sc["content"], "over the wire\n", "{sc}");
    let sc = s
        .ok("run_python", json!({ "session": "k", "code": "print(open('notes/a.txt').read().upper(), end='')" }))
        .await;
    assert_eq!(sc["stdout"], "OVER THE WIRE\n", "{sc}");

    background_job(&s).await;
    refusals(&s).await;
    timeouts_keep_the_state(&s).await;
    assert_eq!(pods(&sim), vec![pod.clone()], "the refused session left no pod");

    // Closing the session deletes its pod, and the node's container with it.
    s.ok("close_session", json!({ "session": "k" })).await;
    assert!(pods(&sim).is_empty(), "the pod is deleted: {:?}", pods(&sim));
    assert_eq!(node_containers(&sim).await, 0, "the pod's container is gone");

    // A session made after that, left open: the server's stop removes its pod (over stdio,
    // without `keep_sessions`, nothing is left for a next server).
    s.ok("run_python", json!({ "session": "late", "code": "1" })).await;
    assert_eq!(pods(&sim).len(), 1);
    s.stop().await;
    assert!(pods(&sim).is_empty(), "the server's stop deleted its pods: {:?}", pods(&sim));
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_warm_pool_keeps_pods_ready_and_a_session_takes_one() {
    let sim = Sim::start(Options::default(), docker()).await;
    let s = Served::start_with(&sim, "warm", 2).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while pods(&sim).len() < 2 {
        assert!(Instant::now() < deadline, "the pool made no pods: {:?}\n{}", pods(&sim), s.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let sc = s.ok("run_python", json!({ "session": "a", "code": "print(6 * 7)" })).await;
    assert_eq!(sc["stdout"], "42\n", "{sc}");
    // The session runs in a pod the pool made before it was asked for (named for the pool).
    let all = pods(&sim);
    assert!(all.iter().all(|p| p.contains("-pool-")), "the session took a pool pod: {all:?}");
    s.stop().await;
    assert!(pods(&sim).is_empty(), "the server's stop deleted the pool's pods too: {:?}", pods(&sim));
    assert_eq!(node_containers(&sim).await, 0);
    sim.stop().await;
}

/// `pyberth run` moves a project in and the run's files out through the engine's own file
/// calls (a tar over exec stdin, and back through the agent), where `serve`'s tools use the
/// agent only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyberth_run_uploads_a_project_and_copies_back_over_exec() {
    let sim = Sim::start(Options::default(), docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (project, out) = (dir.join("project"), dir.join("out"));
    std::fs::create_dir_all(project.join("sub")).expect("project");
    std::fs::create_dir_all(&out).expect("out");
    std::fs::write(project.join("sub/given.txt"), "from the host\n").expect("given");
    let kubeconfig = sim.kubeconfig(&dir);
    let config = dir.join("k8s.toml");
    let text = format!("engine = \"kubernetes\"\nkubeconfig = {kubeconfig:?}\npool_size = 0\n");
    std::fs::write(&config, text).expect("config");
    let code = "import os\nt = open('sub/given.txt').read()\nopen('made.txt', 'w').write(t.upper())\nprint(os.getuid() > 0, t.strip())";
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
        .args(["run", "--config"])
        .arg(&config)
        .arg("--project")
        .arg(&project)
        .arg("--output")
        .arg(&out)
        .args(["-", "--"])
        .env("PYBERTH_STATE_DIR", dir.join("state"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn pyberth run");
    let mut run = run;
    {
        use tokio::io::AsyncWriteExt as _;
        let mut stdin = run.stdin.take().expect("stdin");
        stdin.write_all(code.as_bytes()).await.expect("script");
    }
    let done = tokio::time::timeout(Duration::from_secs(120), run.wait_with_output()).await.expect("run ends");
    let done = done.expect("run");
    let (stdout, stderr) = (String::from_utf8_lossy(&done.stdout), String::from_utf8_lossy(&done.stderr));
    assert_eq!(done.status.code(), Some(0), "stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(stdout, "True from the host\n", "{stderr}");
    let made = std::fs::read_to_string(out.join("made.txt")).unwrap_or_else(|e| panic!("{e}; stderr: {stderr}"));
    assert_eq!(made, "FROM THE HOST\n");
    assert!(pods(&sim).is_empty(), "the run's pod is deleted: {:?}", pods(&sim));
    assert_eq!(node_containers(&sim).await, 0);
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}

/// A session's first call on a simulator of `opts` and settings `extra`: a tool error whose
/// text has all of `want` and none of Docker's words.
pub(super) async fn first_call_fails_saying(opts: Options, tag: &str, extra: &str, want: &[&str]) {
    let sim = Sim::start(opts, docker()).await;
    let s = Served::start_cfg(&sim, tag, 0, extra).await;
    let r = s.call("run_python", json!({ "session": "k", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    let said = text(&r);
    assert!(want.iter().all(|w| said.contains(w)), "the cluster's words {want:?}: {said}\n{}", s.log());
    assert!(!said.contains("Docker responded"), "not Docker's words: {said}");
    s.stop().await;
    sim.stop().await;
}

/// A refusal by RBAC and a pod that never runs (its image is on no node) are tool errors in
/// the cluster's terms, not "Docker responded with status code …".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failures_are_tool_errors_in_the_clusters_words() {
    let refuse = Options { forbid_create: true, ..Options::default() };
    let want = ["403 Forbidden", "deploy/kubernetes/10-rbac.yaml", "cannot create resource \"pods\""];
    first_call_fails_saying(refuse, "refused", "", &want).await;
    let no_image = "image = \"pyberth-no-such-image:0\"\n";
    first_call_fails_saying(Options::default(), "noimg", no_image, &["pod ", "(phase Failed)"]).await;
}

/// A server killed outright leaves its pods running (their tether cannot stop `sleep
/// infinity` as PID 1). Its heartbeat Lease is no longer renewed: once it lapsed and the grace
/// (`leftover_grace_s`, 1 s here) passed, another server's sweep deletes them. The case: a next
/// server with its own state dir (as a new server pod has), which holds no record of them to
/// adopt; one of the same state dir adopts them instead (`adopt.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_server_deletes_the_pods_of_a_killed_one() {
    let sim = Sim::start(Options::default(), docker()).await;
    let mut first = Served::start(&sim, "killed").await;
    first.ok("run_python", json!({ "session": "k", "code": "x = 1" })).await;
    assert_eq!(pods(&sim).len(), 1, "one pod for the session");
    first.child.start_kill().expect("SIGKILL");
    let _ = first.child.wait().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(pods(&sim).len(), 1, "nothing of the killed server deleted its pod");
    let next = Served::start_cfg(&sim, "next", 0, "leftover_grace_s = 1\n").await;
    // Its heartbeat Lease lapses 15 s after its last renewal; a sweep every 5 s sees it.
    let deadline = Instant::now() + Duration::from_secs(60);
    // The sweep logs once it has removed them all, after the last deletion's answer.
    let swept = |next: &Served| next.whole_log().contains("removed leftovers of dead instances");
    while !pods(&sim).is_empty() || node_containers(&sim).await > 0 || !swept(&next) {
        let leases = leases(&sim);
        assert!(
            Instant::now() < deadline,
            "the killed server's pod is still there, or the sweep did not say it removed it: {:?}\n{leases:?}\n{}",
            pods(&sim),
            next.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The next server serves, and its own session's pod is its own.
    let sc = next.ok("run_python", json!({ "session": "k", "code": "print(2)" })).await;
    assert_eq!(sc["stdout"], "2\n", "{sc}");
    assert_eq!(pods(&sim).len(), 1);
    next.stop().await;
    assert!(pods(&sim).is_empty(), "{:?}", pods(&sim));
    drop(first);
    sim.stop().await;
}

/// Two live servers share a namespace: each sees the other's heartbeat Lease renewed, so
/// neither's start or sweeps delete the other's pods; a clean stop takes its Lease with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_live_servers_share_a_namespace() {
    let sim = Sim::start(Options::default(), docker()).await;
    let a = Served::start_cfg(&sim, "share-a", 0, "leftover_grace_s = 1\n").await;
    a.ok("run_python", json!({ "session": "k", "code": "x = 'of a'" })).await;
    let b = Served::start_cfg(&sim, "share-b", 0, "leftover_grace_s = 1\n").await;
    b.ok("run_python", json!({ "session": "k", "code": "x = 'of b'" })).await;
    assert_eq!(pods(&sim).len(), 2, "{:?}", pods(&sim));
    // Past a Lease's duration and several sweeps of each.
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(pods(&sim).len(), 2, "neither deleted the other's pod: {:?}", pods(&sim));
    for (s, want) in [(&a, "of a"), (&b, "of b")] {
        let sc = s.ok("run_python", json!({ "session": "k", "code": "print(x)" })).await;
        assert_eq!(sc["stdout"], format!("{want}\n"), "{sc}");
    }
    assert!(leases(&sim).len() >= 2, "a heartbeat Lease each");
    a.stop().await;
    assert_eq!(pods(&sim).len(), 1, "a's stop deleted its own pod only: {:?}", pods(&sim));
    let sc = b.ok("run_python", json!({ "session": "k", "code": "print(x)" })).await;
    assert_eq!(sc["stdout"], "of b\n", "{sc}");
    b.stop().await;
    assert!(pods(&sim).is_empty(), "{:?}", pods(&sim));
    let left = leases(&sim);
    assert!(left.is_empty(), "each clean stop deleted its Lease: {left:?}");
    sim.stop().await;
}
