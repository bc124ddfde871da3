//! The Kubernetes engine on the wire: pyberth's kube-rs client against a simulated API server
//! on loopback (this folder) that speaks the REST, watch and exec-websocket protocols and runs
//! each pod as a container of the local Docker engine, with our real sandbox image, so every
//! exec reaches the real agent. No real cluster is involved (none can run on these machines).

mod adopt;
mod apiserver;
mod claims;
mod controller;
mod crds;
mod docker_pod;
mod durable;
mod egress;
mod exec;
mod oom;
mod packages;
mod sandbox_mode;
mod serve;
mod services;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::time::Duration;

use apiserver::{Options, Sim};
use bollard::Docker;
use pyberth::docker::container::{Sandboxing, Spec};
use pyberth::k8s::cluster::{Cluster, Connect, Error, Exec, ExecEnd};
use pyberth::k8s::labels::selector;
use pyberth::k8s::pod::{PodSettings, pod};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader, Lines};

const WAIT: Duration = Duration::from_secs(60);

fn docker() -> Docker {
    Docker::connect_with_local_defaults().expect("docker")
}

/// A code uid of our default range, different for each test process and pod.
fn uid(n: u32) -> u32 {
    0x7000_0000 + (std::process::id() % 50_000) * 16 + n
}

fn spec() -> Spec {
    Spec {
        memory_mb: 512,
        cpus: 1.0,
        pids: 256,
        tmp_mb: 64,
        workspace_mb: Some(64),
        uid_range: Default::default(),
        sandboxing: Sandboxing::default(),
        mounts: Vec::new(),
        network: None,
        orphan_after: Duration::from_secs(600),
    }
}

async fn start(opts: Options) -> (Sim, Cluster, std::path::PathBuf) {
    let sim = Sim::start(opts, docker()).await;
    let dir = std::env::temp_dir();
    let kubeconfig = sim.kubeconfig(&dir);
    let at = Connect { kubeconfig: Some(kubeconfig.clone()), context: None, namespace: "pyberth".into() };
    let cluster = Cluster::connect(&at).await.expect("connect");
    (sim, cluster, kubeconfig)
}

fn session_pod(name: &str, n: u32, image: &str) -> k8s_openapi::api::core::v1::Pod {
    let labels = BTreeMap::from([
        ("pyberth.managed".to_owned(), "true".to_owned()),
        ("pyberth.session".to_owned(), name.to_owned()),
        ("pyberth.owner".to_owned(), "alice@example.com".to_owned()),
    ]);
    let settings = PodSettings { ephemeral_mb: 256, ..Default::default() };
    pod(&spec(), &settings, image, name, uid(n), &labels).expect("a pod")
}

/// The agent behind one exec: requests in, events out; stderr drained aside.
struct Agent {
    exec: Exec,
    stdin: Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    lines: Lines<BufReader<Pin<Box<dyn AsyncRead + Send>>>>,
}

impl Agent {
    async fn attach(cluster: &Cluster, name: &str) -> Agent {
        let mut exec = cluster.attach_agent(name).await.expect("attach");
        let stdin = exec.stdin.take().expect("stdin");
        let stdout = std::mem::replace(&mut exec.stdout, Box::pin(tokio::io::empty()));
        let mut stderr = std::mem::replace(&mut exec.stderr, Box::pin(tokio::io::empty()));
        tokio::spawn(async move {
            let mut sink = Vec::new();
            let _ = stderr.read_to_end(&mut sink).await;
        });
        Agent { exec, stdin, lines: BufReader::new(stdout).lines() }
    }

    /// Reads events until the done of run `id`; returns it.
    async fn done_of(&mut self, id: u64) -> Value {
        loop {
            let next = tokio::time::timeout(WAIT, self.lines.next_line()).await.expect("an event within 60 s");
            let line = next.expect("read").expect("the agent's stream ended");
            let ev: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
            if ev["ev"] == "done" && ev["id"] == id {
                return ev;
            }
        }
    }

    /// Runs `code`; returns its stdout and its done event.
    async fn run(&mut self, id: u64, code: &str) -> (String, Value) {
        let mut line = serde_json::to_vec(&json!({"op": "run", "id": id, "code": code})).expect("json");
        line.push(b'\n');
        self.stdin.write_all(&line).await.expect("send");
        self.stdin.flush().await.expect("flush");
        let mut out = String::new();
        loop {
            let next = tokio::time::timeout(WAIT, self.lines.next_line()).await.expect("an event within 60 s");
            let line = next.expect("read").expect("the agent's stream ended");
            let ev: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
            match ev["ev"].as_str() {
                Some("out") if ev["id"] == id && ev["s"] == "stdout" => out.push_str(ev["t"].as_str().unwrap_or("")),
                Some("done") if ev["id"] == id => return (out, ev),
                _ => {}
            }
        }
    }
}

fn tar_of(path: &str, body: &[u8]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(body.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    b.append_data(&mut h, path, body).expect("tar");
    b.into_inner().expect("tar")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_lives_over_the_simulated_api_server() {
    let (sim, cluster, _) = start(Options { start_delay: Duration::from_millis(300), ..Default::default() }).await;
    let image = pyberth::docker::image::sandbox_tag();
    let name = format!("pyberth-life-{}", std::process::id());
    cluster.create_pod(&session_pod(&name, 1, &image)).await.expect("create");
    cluster.wait_running(&name, WAIT).await.expect("running");
    let found = cluster.list_pods(&selector(&[("pyberth.session", &name)])).await.expect("list");
    assert_eq!(found.len(), 1, "found by label");
    let labels = found[0].metadata.labels.clone().unwrap_or_default();
    assert!(labels["pyberth.owner"].starts_with("h-"), "the principal is hashed: {labels:?}");
    let by_owner = cluster.list_pods(&selector(&[("pyberth.owner", "alice@example.com")])).await.expect("list");
    assert_eq!(by_owner.len(), 1, "found by the hashed principal");
    let other = cluster.list_pods(&selector(&[("pyberth.owner", "bob@example.com")])).await.expect("list");
    assert!(other.is_empty(), "another principal's selector finds nothing");

    let mut agent = Agent::attach(&cluster, &name).await;
    let (out, done) = agent.run(1, "import os\nx = 41\nprint(x + 1, os.getuid())").await;
    assert_eq!(done["status"], "ok", "{done}");
    assert_eq!(out.trim(), format!("42 {}", uid(1)), "runs as the pod's code uid");

    // The hardening of the pod spec reaches the process (the simulated node applies it).
    let probe = "s = open('/proc/self/status').read()\n\
        caps = [l.split()[1] for l in s.splitlines() if l.startswith('CapEff')]\n\
        nnp = [l.split()[1] for l in s.splitlines() if l.startswith('NoNewPrivs')]\n\
        try:\n    open('/etc/pwned', 'w')\n    ro = 'writable'\nexcept OSError:\n    ro = 'read-only'\n\
        print(caps[0], nnp[0], ro)";
    let (out, _) = agent.run(2, probe).await;
    assert_eq!(out.trim(), "0000000000000000 1 read-only");

    // Files: a tar over the exec's stdin, closed on v5; the agent reads it back.
    let end = cluster
        .upload_tar(&name, "/workspace", pyberth::docker::body_full(tar_of("hello.txt", b"from the wire").into()))
        .await
        .expect("upload");
    assert_eq!(end, ExecEnd::Exited(0));
    let (out, _) = agent.run(3, "print(open('/workspace/hello.txt').read())").await;
    assert_eq!(out.trim(), "from the wire");
    // And back: a tar of it from the exec's stdout; a cap below its size refuses it.
    let tar = cluster.download_tar(&name, "/workspace", "hello.txt", 1 << 20).await.expect("download");
    let mut archive = tar::Archive::new(tar.as_slice());
    let mut entry = archive.entries().expect("entries").next().expect("one entry").expect("entry");
    assert_eq!(entry.path().expect("path").to_string_lossy(), "hello.txt");
    let mut body = String::new();
    std::io::Read::read_to_string(&mut entry, &mut body).expect("read");
    assert_eq!(body, "from the wire");
    let e = cluster.download_tar(&name, "/workspace", "hello.txt", 100).await.expect_err("over the cap");
    assert!(e.to_string().contains("bigger than 100 bytes"), "{e}");

    // The exec websocket cut mid-run: the interpreter lives on in the keeper; a new relay
    // reaches the same state, and the cut run's effect is there.
    let mut line = serde_json::to_vec(&json!({"op": "run", "id": 4, "code": "import time\ntime.sleep(1.5)\nx = 7"}))
        .expect("json");
    line.push(b'\n');
    agent.stdin.write_all(&line).await.expect("send");
    agent.stdin.flush().await.expect("flush");
    tokio::time::sleep(Duration::from_millis(300)).await;
    agent.exec.abort();
    drop(agent);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut again = Agent::attach(&cluster, &name).await;
    let (out, done) = again.run(5, "print(x, os.getpid() > 0)").await;
    assert_eq!(done["status"], "ok", "{done}");
    assert_eq!(out.trim(), "7 True", "state kept across the cut");
    drop(again);

    cluster.delete_pod(&name).await.expect("delete");
    assert!(cluster.list_pods(&selector(&[("pyberth.session", &name)])).await.expect("list").is_empty());
    let container = format!("{}-{name}", sim.state.sim);
    assert!(docker().inspect_container(&container, None).await.is_err(), "the pod's container is gone");
    cluster.delete_pod(&name).await.expect("a second delete is fine");
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_refusals_say_what_to_grant() {
    let (sim, cluster, _) = start(Options { forbid: true, ..Default::default() }).await;
    let image = pyberth::docker::image::sandbox_tag();
    let e = cluster.create_pod(&session_pod("denied", 2, &image)).await.expect_err("403");
    let text = e.to_string();
    assert!(matches!(e, Error::Forbidden { .. }), "{e:?}");
    assert!(
        text.contains("create pods") && text.contains("10-rbac.yaml") && text.contains("namespace pyberth"),
        "{text}"
    );
    assert!(text.contains("cannot create resource \"pods\""), "the API server's own words: {text}");
    let e = cluster.exec("denied", &["true"], false).await.expect_err("403");
    assert!(matches!(e, Error::Forbidden { .. }) && e.to_string().contains("exec into pods"), "{e}");
    let e = cluster.list_pods("pyberth.managed=true").await.expect_err("403");
    assert!(e.to_string().contains("list pods"), "{e}");
    let e = cluster.wait_running("denied", WAIT).await.expect_err("403");
    assert!(matches!(e, Error::Forbidden { .. }), "a refusal is not waited out: {e:?}");
    sim.stop().await;
}

async fn collect(mut exec: Exec) -> (String, String, ExecEnd) {
    let mut out = String::new();
    let mut err = String::new();
    let (a, b) = tokio::join!(exec.stdout.read_to_string(&mut out), exec.stderr.read_to_string(&mut err));
    a.expect("stdout");
    b.expect("stderr");
    let end = tokio::time::timeout(WAIT, exec.end).await.expect("an end");
    (out, err, end)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_on_v4_and_v5_keeps_streams_apart_and_reads_the_exit_code() {
    for protocols in [vec!["v4.channel.k8s.io"], vec!["v5.channel.k8s.io"]] {
        let label = protocols[0];
        let (sim, cluster, _) = start(Options { protocols, ..Default::default() }).await;
        let name = format!("pyberth-exec-{}", std::process::id());
        cluster.create_pod(&session_pod(&name, 3, &pyberth::docker::image::sandbox_tag())).await.expect("create");
        cluster.wait_running(&name, WAIT).await.expect("running");
        let exec = cluster.exec(&name, &["sh", "-c", "echo out; echo err >&2; exit 3"], false).await.expect("exec");
        let (out, err, end) = collect(exec).await;
        assert_eq!((out.as_str(), err.as_str()), ("out\n", "err\n"), "{label}");
        assert_eq!(end, ExecEnd::Exited(3), "{label}");
        let (_, _, end) = collect(cluster.exec(&name, &["true"], false).await.expect("exec")).await;
        assert_eq!(end, ExecEnd::Exited(0), "{label}");
        cluster.delete_pod(&name).await.expect("delete");
        sim.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_watch_is_watched_again_and_a_failed_pod_is_said() {
    let opts = Options { drop_watches: 2, start_delay: Duration::from_millis(500), ..Default::default() };
    let (sim, cluster, _) = start(opts).await;
    let name = format!("pyberth-watch-{}", std::process::id());
    cluster.create_pod(&session_pod(&name, 4, &pyberth::docker::image::sandbox_tag())).await.expect("create");
    cluster.wait_running(&name, WAIT).await.expect("running despite two dropped watches");
    let watches = sim.state.seen.lock().expect("seen").iter().filter(|r| r.contains("watch=true")).count();
    assert!(watches >= 3, "{watches} watches: the dropped ones were watched again");
    cluster.delete_pod(&name).await.expect("delete");
    // An image no node has: the pod fails, and the wait says so instead of waiting out.
    let bad = format!("{name}-bad");
    cluster.create_pod(&session_pod(&bad, 5, "pyberth-no-such-image:0")).await.expect("create");
    let e = cluster.wait_running(&bad, WAIT).await.expect_err("failed");
    assert!(matches!(&e, Error::Stopped { phase, .. } if phase == "Failed"), "{e:?}");
    let e = cluster.wait_running("pyberth-never-made", WAIT).await.expect_err("gone");
    assert!(matches!(e, Error::Gone(_)), "{e:?}");
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_the_server_cuts_is_lost_and_a_new_relay_finds_the_state() {
    // Every exec stream ends 10 s after it opens, with no Status: the kubelet's stream limit,
    // an API server restart or a load balancer's reset look like this.
    let opts = Options { cut_exec_after: Some(Duration::from_secs(10)), ..Default::default() };
    let (sim, cluster, _) = start(opts).await;
    let name = format!("pyberth-cut-{}", std::process::id());
    cluster.create_pod(&session_pod(&name, 6, &pyberth::docker::image::sandbox_tag())).await.expect("create");
    cluster.wait_running(&name, WAIT).await.expect("running");
    let mut agent = Agent::attach(&cluster, &name).await;
    let (out, _) = agent.run(1, "y = 1\nprint(y)").await;
    assert_eq!(out.trim(), "1");
    // A run that outlasts the stream.
    let mut line =
        serde_json::to_vec(&json!({"op": "run", "id": 2, "code": "import time\ntime.sleep(15)\ny = 2"})).expect("json");
    line.push(b'\n');
    agent.stdin.write_all(&line).await.expect("send");
    agent.stdin.flush().await.expect("flush");
    let end = tokio::time::timeout(WAIT, &mut agent.exec.end).await.expect("the stream ends");
    assert_eq!(end, ExecEnd::Lost, "no Status: lost, not an exit");
    drop(agent);
    // The new relay gets the end of the cut run, which went on in the agent. The next run is
    // sent after it: a run queued behind another can have its first output tagged with the
    // previous run's id (the agent's forwarder drains the output pipes at that run's done;
    // an open bug of the agent, docs/agent-protocol.md), which this test is not about.
    let mut again = Agent::attach(&cluster, &name).await;
    let done = again.done_of(2).await;
    assert_eq!(done["status"], "ok", "the cut run ended in the agent: {done}");
    let (out, done) = again.run(3, "print(y)").await;
    assert_eq!(done["status"], "ok", "{done}");
    assert_eq!(out.trim(), "2", "the run the cut stream carried finished in the agent");
    drop(again);
    cluster.delete_pod(&name).await.expect("delete");
    sim.stop().await;
}
