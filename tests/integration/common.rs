//! Test harness: the real `pyberth` binary, spoken to over stdio by the real rmcp client,
//! against the real Docker engine. Each server gets its own instance name, so a test can
//! check exactly what its server left behind.
#![allow(deprecated)] // LoggingMessageNotificationParam: logging is deprecated in MCP 2026-07-28

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bollard::Docker;
use bollard::query_parameters::{ListContainersOptionsBuilder, ListVolumesOptionsBuilder};
use rmcp::model::{CallToolRequestParams, CallToolResult, LoggingMessageNotificationParam, ProgressNotificationParam};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

/// A notification the client received, with when it arrived.
#[derive(Debug, Clone)]
pub struct Heard {
    pub at: Instant,
    /// "progress" or "log".
    pub kind: &'static str,
    pub text: String,
}

/// The test client: records progress and log notifications.
#[derive(Clone, Default)]
pub struct Recorder {
    pub heard: Arc<Mutex<Vec<Heard>>>,
}

impl Recorder {
    fn push(&self, kind: &'static str, text: String) {
        self.heard.lock().expect("recorder lock").push(Heard { at: Instant::now(), kind, text });
    }
}

impl ClientHandler for Recorder {
    async fn on_progress(&self, params: ProgressNotificationParam, _: NotificationContext<RoleClient>) {
        self.push("progress", params.message.unwrap_or_default());
    }

    async fn on_logging_message(&self, params: LoggingMessageNotificationParam, _: NotificationContext<RoleClient>) {
        let text = params.data.get("text").and_then(Value::as_str).unwrap_or_default().to_owned();
        self.push("log", text);
    }
}

/// A running server and a client connected to it.
pub struct Server {
    pub client: Option<RunningService<RoleClient, Recorder>>,
    pub heard: Arc<Mutex<Vec<Heard>>>,
    pub child: Child,
    pub instance: String,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A fresh instance name, unique across concurrent tests and test runs.
pub fn instance_name(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("t{}-{}-{tag}", std::process::id(), n)
}

/// The state dir shared by the test servers (so a server can see another's liveness lock).
pub fn state_dir() -> std::path::PathBuf {
    std::env::temp_dir().join("pyberth-tests")
}

impl Server {
    /// Starts `pyberth serve` with extra environment and connects a client.
    pub async fn start(tag: &str, env: &[(&str, &str)]) -> Server {
        Self::start_as(&instance_name(tag), env).await
    }

    /// Starts a server with a given instance name.
    pub async fn start_as(instance: &str, env: &[(&str, &str)]) -> Server {
        Self::spawn(instance, env, Stdio::inherit()).await
    }

    /// Starts a server whose log (its stderr) goes to `log` instead of the test's stderr, for
    /// tests that read what the server logged.
    pub async fn start_logging_to(tag: &str, env: &[(&str, &str)], log: std::fs::File) -> Server {
        Self::spawn(&instance_name(tag), env, Stdio::from(log)).await
    }

    async fn spawn(instance: &str, env: &[(&str, &str)], stderr: Stdio) -> Server {
        let state_dir = state_dir();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pyberth"));
        cmd.arg("serve")
            .env("PYBERTH_INSTANCE", instance)
            .env("PYBERTH_STATE_DIR", &state_dir)
            .env("RUST_LOG", "pyberth=debug,info")
            // Tests count containers exactly; the pool has its own test and opts in.
            .env("PYBERTH_POOL_SIZE", "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn pyberth");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take().expect("stdin");
        let recorder = Recorder::default();
        let heard = recorder.heard.clone();
        let client = recorder.serve((stdout, stdin)).await.expect("MCP initialise");
        Server { client: Some(client), heard, child, instance: instance.to_owned() }
    }

    /// Notifications heard so far, and forgets them.
    pub fn take_heard(&self) -> Vec<Heard> {
        std::mem::take(&mut *self.heard.lock().expect("recorder lock"))
    }

    pub fn client(&self) -> &RunningService<RoleClient, Recorder> {
        self.client.as_ref().expect("client connected")
    }

    /// Calls a tool; protocol errors fail the test.
    pub async fn call(&self, tool: &'static str, args: Value) -> CallToolResult {
        let args = args.as_object().expect("object arguments").clone();
        self.client()
            .call_tool(CallToolRequestParams::new(tool).with_arguments(args))
            .await
            .unwrap_or_else(|e| panic!("{tool} failed at the protocol level: {e}"))
    }

    /// Runs code in a session and returns the whole result plus its structured content.
    pub async fn run(&self, session: &str, code: &str) -> (CallToolResult, Value) {
        self.run_with(json!({ "session": session, "code": code })).await
    }

    /// run_python with arbitrary arguments.
    pub async fn run_with(&self, args: Value) -> (CallToolResult, Value) {
        let r = self.call("run_python", args).await;
        let sc = r.structured_content.clone().unwrap_or(Value::Null);
        (r, sc)
    }

    /// Runs code that must succeed, returning its structured content.
    pub async fn ok(&self, session: &str, code: &str) -> Value {
        let (r, sc) = self.run(session, code).await;
        assert_eq!(r.is_error, Some(false), "expected success for {code:?}: {}", text(&r));
        sc
    }

    /// Peak and current resident memory of the server process, KiB (`VmHWM`, `VmRSS`).
    pub fn memory_kb(&self) -> (u64, u64) {
        let pid = self.child.id().expect("the server is running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the server's /proc status");
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
        };
        (field("VmHWM:"), field("VmRSS:"))
    }

    /// Closes the client (stdin EOF) and waits for the server to exit.
    pub async fn stop(mut self) {
        if let Some(c) = self.client.take() {
            let _ = c.cancel().await;
        }
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        assert!(status.is_ok(), "server did not exit within 30 s of its stdin closing");
    }
}

/// All text content of a result.
pub fn text(r: &CallToolResult) -> String {
    r.content.iter().filter_map(|c| c.as_text().map(|t| t.text.clone())).collect::<Vec<_>>().join("\n")
}

/// The engine.
pub async fn docker() -> Docker {
    Docker::connect_with_local_defaults().expect("docker").negotiate_version().await.expect("negotiate")
}

/// Containers (including stopped ones) carrying an instance label.
pub async fn containers_of(instance: &str) -> Vec<bollard::models::ContainerSummary> {
    let label = format!("pyberth.instance={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    docker().await.list_containers(Some(opts)).await.expect("list containers")
}

/// Volumes carrying an instance label.
pub async fn volumes_of(instance: &str) -> Vec<String> {
    let label = format!("pyberth.instance={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let list = docker().await.list_volumes(Some(opts)).await.expect("list volumes");
    list.volumes.unwrap_or_default().into_iter().map(|v| v.name).collect()
}

/// Waits until nothing labelled with the instance remains, or fails the test.
pub async fn assert_cleaned_up(instance: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let c = containers_of(instance).await;
        let v = volumes_of(instance).await;
        if c.is_empty() && v.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "left behind by {instance}: {} containers, volumes {v:?}", c.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
