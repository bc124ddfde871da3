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
use rmcp::{ClientHandler, ClientLifecycleMode, ClientServiceExt as _, RoleClient};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

/// A notification the client received, with when it arrived.
#[derive(Debug, Clone)]
pub struct Heard {
    pub at: Instant,
    /// "progress" or "log".
    pub kind: &'static str,
    pub text: String,
    /// The server's sequence number (progress value, or the log's `seq`): rmcp's client
    /// handles each notification in a task of its own, so arrival order is not send order.
    pub seq: f64,
}

/// The test client: records progress and log notifications.
#[derive(Clone, Default)]
pub struct Recorder {
    pub heard: Arc<Mutex<Vec<Heard>>>,
}

impl Recorder {
    fn push(&self, kind: &'static str, text: String, seq: f64) {
        self.heard.lock().expect("recorder lock").push(Heard { at: Instant::now(), kind, text, seq });
    }
}

impl ClientHandler for Recorder {
    async fn on_progress(&self, params: ProgressNotificationParam, _: NotificationContext<RoleClient>) {
        self.push("progress", params.message.unwrap_or_default(), params.progress);
    }

    async fn on_logging_message(&self, params: LoggingMessageNotificationParam, _: NotificationContext<RoleClient>) {
        let text = params.data.get("text").and_then(Value::as_str).unwrap_or_default().to_owned();
        let seq = params.data.get("seq").and_then(Value::as_f64).unwrap_or_default();
        self.push("log", text, seq);
    }
}

/// A running server and a client connected to it.
pub struct Server {
    pub client: Option<RunningService<RoleClient, Recorder>>,
    pub heard: Arc<Mutex<Vec<Heard>>>,
    pub child: Child,
    pub instance: String,
    #[allow(dead_code)] // held for its Drop: the log is shown if the test fails
    pub log: ServerLog,
}

/// A child server's stderr, kept in a file: libtest does not capture a child's output, so
/// inherited logs would flood every run. The file's tail is printed only if the test fails.
pub struct ServerLog(pub std::path::PathBuf);

impl ServerLog {
    /// A fresh log file for `instance`, and the handle to give the child as its stderr.
    pub fn create(instance: &str) -> (ServerLog, Stdio) {
        let dir = std::env::temp_dir().join("pyberth-test-logs");
        std::fs::create_dir_all(&dir).expect("log dir");
        let path = dir.join(format!("{instance}.log"));
        let file = std::fs::File::create(&path).expect("log file");
        (ServerLog(path), Stdio::from(file))
    }

    /// The log so far.
    pub fn read(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.0).unwrap_or_default()).into_owned()
    }
}

impl Drop for ServerLog {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = self.read();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            eprintln!("--- last {} lines of the server's log ({}) ---", tail.len(), self.0.display());
            for l in tail {
                eprintln!("{}", excerpt(l));
            }
        } else {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A fresh instance name, unique across concurrent tests and test runs.
pub fn instance_name(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("t{}-{}-{tag}", std::process::id(), n)
}

/// The OCI runtime the servers under test give their sandboxes: `PYBERTH_TEST_RUNTIME` (e.g.
/// `runsc`, for `.ci/run`'s gVisor pass), else the engine's default.
pub fn test_runtime() -> Option<String> {
    std::env::var("PYBERTH_TEST_RUNTIME").ok().filter(|r| !r.is_empty())
}

/// Whether sandboxes under test run in gVisor (`PYBERTH_TEST_RUNTIME=runsc`): there gVisor's
/// user-space kernel, not the host's, answers the code's system calls, and a few probes get
/// its answers (each such test says which and why).
pub fn gvisor() -> bool {
    test_runtime().is_some_and(|r| r.starts_with("runsc"))
}

/// Passes [`test_runtime`] to a server about to start, as its `PYBERTH_RUNTIME`.
pub fn with_test_runtime(cmd: &mut Command) -> &mut Command {
    if let Some(runtime) = test_runtime() {
        cmd.env("PYBERTH_RUNTIME", runtime);
    }
    cmd
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
        Self::spawn(instance, env, false).await
    }

    /// Starts a server with the few variables the official MCP Python SDK passes to the
    /// stdio servers it starts (HOME, LOGNAME, PATH, SHELL, TERM, USER), as a desktop client would.
    pub async fn start_like_a_desktop_client(tag: &str, env: &[(&str, &str)]) -> Server {
        Self::spawn(&instance_name(tag), env, true).await
    }

    /// Starts a server whose client opens with `lifecycle`: `Discover` speaks MCP 2026-07-28
    /// (no initialize, per-request `_meta`), `Initialize` the 2025-11-25 handshake.
    pub async fn start_with_lifecycle(tag: &str, env: &[(&str, &str)], lifecycle: ClientLifecycleMode) -> Server {
        Self::spawn_with(&instance_name(tag), env, false, lifecycle).await
    }

    async fn spawn(instance: &str, env: &[(&str, &str)], minimal: bool) -> Server {
        Self::spawn_with(instance, env, minimal, ClientLifecycleMode::Initialize).await
    }

    async fn spawn_with(instance: &str, env: &[(&str, &str)], minimal: bool, lifecycle: ClientLifecycleMode) -> Server {
        let state_dir = state_dir();
        let (log, stderr) = ServerLog::create(instance);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pyberth"));
        if minimal {
            cmd.env_clear();
            for key in ["HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "DOCKER_HOST"] {
                if let Ok(v) = std::env::var(key) {
                    cmd.env(key, v);
                }
            }
        }
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
        with_test_runtime(&mut cmd);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn pyberth");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take().expect("stdin");
        let recorder = Recorder::default();
        let heard = recorder.heard.clone();
        let client = recorder.serve_with_lifecycle((stdout, stdin), lifecycle).await.expect("MCP initialise");
        Server { client: Some(client), heard, child, instance: instance.to_owned(), log }
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
        assert_eq!(r.is_error, Some(false), "expected success for {}: {}", excerpt(code), excerpt(&text(&r)));
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

    /// Closes the client (stdin EOF), waits for the server to exit, and returns its whole log.
    pub async fn stop(mut self) -> String {
        if let Some(c) = self.client.take() {
            let _ = c.cancel().await;
        }
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        assert!(status.is_ok(), "server did not exit within 30 s of its stdin closing");
        self.log.read()
    }
}

impl Drop for Server {
    /// A server the test did not stop (it failed first) is stopped as `stop` does, by closing
    /// its stdin: it removes its containers, volumes and lock file itself. Killing it, as the
    /// child's `kill_on_drop` would, leaves all three until another server sweeps them.
    fn drop(&mut self) {
        let Some(client) = self.client.take() else { return };
        drop(client);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(None) => std::thread::sleep(Duration::from_millis(100)),
                _ => return,
            }
        }
    }
}

/// A layer store volume of one test's own, removed at the end: a test that must see an
/// install run (not the shared store's cached set) gives its server this store.
pub struct PrivateStore(String);

impl PrivateStore {
    pub fn new(tag: &str) -> PrivateStore {
        PrivateStore(format!("pyberth-layers-test-{tag}-{}", std::process::id()))
    }

    /// The server environment that uses it.
    pub fn env(&self) -> (&'static str, &str) {
        ("PYBERTH_LAYER_STORE", self.0.as_str())
    }
}

impl Drop for PrivateStore {
    fn drop(&mut self) {
        let name = self.0.clone();
        // Drop cannot await: the removal runs on a runtime of its own, on a thread of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            runtime.block_on(async {
                let opts = bollard::query_parameters::RemoveVolumeOptionsBuilder::default().force(true).build();
                let _ = docker().await.remove_volume(&name, Some(opts)).await;
            });
        })
        .join();
    }
}

/// The settings a server started by these tests has: the defaults, under the variables of the
/// test's environment (PYBERTH_BASE_IMAGE …), which it inherits.
pub fn server_settings() -> pyberth::config::SandboxConfig {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        cfg: pyberth::config::SandboxConfig,
    }
    <Cli as clap::Parser>::parse_from(["pyberth"]).cfg
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

/// A server spoken to line by line over stdio, with no MCP client in between: for malformed
/// messages, and for a client that reads only when it chooses to.
pub struct Raw {
    pub child: Child,
    #[allow(dead_code)] // held for its Drop: the log is shown if the test fails
    pub log: ServerLog,
    pub stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    /// Progress notifications read so far.
    pub progress: usize,
    /// Log notifications (`notifications/message`) read so far.
    pub logs: usize,
}

impl Raw {
    /// Starts `pyberth serve` (no warm pool) for `instance`.
    pub fn start(instance: &str) -> Raw {
        use tokio::io::AsyncBufReadExt as _;
        let (log, stderr) = ServerLog::create(instance);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pyberth"));
        cmd.arg("serve")
            .env("PYBERTH_INSTANCE", instance)
            .env("PYBERTH_STATE_DIR", state_dir())
            .env("PYBERTH_POOL_SIZE", "0")
            .env("RUST_LOG", "info")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        let mut child = with_test_runtime(&mut cmd).spawn().expect("spawn pyberth");
        let stdin = child.stdin.take().expect("stdin");
        let lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        Raw { child, log, stdin, lines, progress: 0, logs: 0 }
    }

    /// Sends one line as it is (with its newline).
    pub async fn send_line(&mut self, line: &[u8]) {
        use tokio::io::AsyncWriteExt as _;
        self.stdin.write_all(line).await.expect("write to the server");
        self.stdin.write_all(b"\n").await.expect("write to the server");
        self.stdin.flush().await.expect("flush");
    }

    /// Sends one JSON-RPC message.
    pub async fn send(&mut self, msg: Value) {
        self.send_line(msg.to_string().as_bytes()).await;
    }

    /// Initializes the MCP connection.
    pub async fn initialize(&mut self) {
        self.send(json!({ "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": { "name": "raw", "version": "0" } } }))
            .await;
        assert!(self.response(1).await["result"]["serverInfo"].is_object());
        self.send(json!({ "jsonrpc": "2.0", "method": "notifications/initialized" })).await;
    }

    /// Reads up to the response carrying `id` within 60 s, counting progress notifications.
    pub async fn response(&mut self, id: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = tokio::time::timeout(left, self.lines.next_line())
                .await
                .unwrap_or_else(|_| panic!("no response to request {id} within 60 s"))
                .expect("read from the server")
                .unwrap_or_else(|| panic!("the server closed stdout before answering {id}"));
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not JSON from the server: {e}: {}", excerpt(&line)));
            if v["method"] == "notifications/progress" {
                self.progress += 1;
            }
            if v["method"] == "notifications/message" {
                self.logs += 1;
            }
            if v["id"] == id {
                return v;
            }
        }
    }
}

/// At most 300 characters of `s`: a failing assertion prints an excerpt, not megabytes.
pub fn excerpt(s: &str) -> String {
    if s.chars().count() <= 300 {
        return s.to_owned();
    }
    let head: String = s.chars().take(300).collect();
    format!("{head}… ({} bytes in all)", s.len())
}

/// An HTTP client for the tests. reqwest is built with rustls and no provider of its own (as
/// the server is), so the process's provider is installed first.
pub fn web() -> reqwest::Client {
    pyberth::https::install_provider();
    reqwest::Client::new()
}

/// rmcp's streamable-HTTP client transport (its reqwest client needs the provider too), over
/// [`ListedAsJson`].
pub fn http_transport(
    config: rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig,
) -> rmcp::transport::StreamableHttpClientTransport<ListedAsJson> {
    pyberth::https::install_provider();
    // As rmcp's own default client: no idle pooling (its note: delayed-ACK stalls).
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().expect("a reqwest client");
    rmcp::transport::StreamableHttpClientTransport::with_client(ListedAsJson(client), config)
}

/// rmcp's reqwest client with one change: a `tools/list` answer that comes as an SSE stream is
/// read to its answer here and handed on as JSON. rmcp 3.9's HTTP worker can pass an SSE answer
/// on without caching the tools' schemas when the stream's end is handled first
/// (`drain_queued_stream_messages` in streamable_http_client.rs skips
/// `cache_tools_from_response`); the client then sends calls without the `Mcp-Param-*` headers
/// the list taught it, and the server refuses them, as it must (seen in CI under load). A JSON
/// answer always goes through that cache. Everything else passes through unchanged.
#[derive(Clone, Debug)]
pub struct ListedAsJson(reqwest::Client);

type PostResponse = rmcp::transport::streamable_http_client::StreamableHttpPostResponse;
type HttpError = rmcp::transport::streamable_http_client::StreamableHttpError<reqwest::Error>;
type SseEvent = sse_stream::Sse;
use rmcp::transport::streamable_http_client::SseError;

impl rmcp::transport::streamable_http_client::StreamableHttpClient for ListedAsJson {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: rmcp::model::ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
    ) -> Result<PostResponse, HttpError> {
        self.post_message_with_max_sse_event_size(uri, message, session_id, auth_header, headers, usize::MAX).await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: rmcp::model::ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
        max: usize,
    ) -> Result<PostResponse, HttpError> {
        use futures::StreamExt as _;
        use rmcp::model::{ClientJsonRpcMessage, ClientRequest, ServerJsonRpcMessage};
        let listing = matches!(&message, ClientJsonRpcMessage::Request(r) if matches!(r.request, ClientRequest::ListToolsRequest(_)));
        let response =
            self.0.post_message_with_max_sse_event_size(uri, message, session_id, auth_header, headers, max).await?;
        let PostResponse::Sse(mut stream, sid) = response else { return Ok(response) };
        if !listing {
            return Ok(PostResponse::Sse(stream, sid));
        }
        while let Some(event) = stream.next().await {
            let Some(data) = event.map_err(HttpError::Sse)?.data else { continue };
            match serde_json::from_str::<ServerJsonRpcMessage>(&data) {
                Ok(m @ (ServerJsonRpcMessage::Response(_) | ServerJsonRpcMessage::Error(_))) => {
                    return Ok(PostResponse::Json(m, sid));
                }
                _ => continue, // a priming event or a notification: not the answer
            }
        }
        Err(HttpError::UnexpectedServerResponse("the tools/list stream ended without an answer".into()))
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
    ) -> Result<(), HttpError> {
        self.0.delete_session(uri, session_id, auth_header, headers).await
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
    ) -> Result<futures::stream::BoxStream<'static, Result<SseEvent, SseError>>, HttpError> {
        self.0.get_stream(uri, session_id, last_event_id, auth_header, headers).await
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
        max: usize,
    ) -> Result<futures::stream::BoxStream<'static, Result<SseEvent, SseError>>, HttpError> {
        self.0.get_stream_with_max_sse_event_size(uri, session_id, last_event_id, auth_header, headers, max).await
    }
}

/// A venv under target/ with `packages` from the package index, made once and kept between
/// runs (pip reaches the index through the host's proxy and its CA bundle). `probe` is Python
/// that imports what the tests need: the venv is ready when it runs. Made under a temporary
/// name and renamed, so a run that stops half-way leaves nothing that looks ready; a venv's
/// python finds its packages from where it lies, so the rename is safe when run as `python -m`.
pub fn venv_with(name: &str, packages: &[&str], probe: &str) -> std::path::PathBuf {
    use std::path::Path;
    use std::process::Command;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target").join(name);
    let ready = |d: &Path| Command::new(d.join("bin/python")).args(["-c", probe]).status().is_ok_and(|s| s.success());
    if ready(&dir) {
        return dir;
    }
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let ok = Command::new("python3").arg("-m").arg("venv").arg(&tmp).status().is_ok_and(|s| s.success());
    assert!(ok, "python3 -m venv failed");
    let mut pip = Command::new(tmp.join("bin/python"));
    pip.args(["-m", "pip", "install", "-q"]).args(packages);
    if Path::new("/etc/ssl/certs/ca-certificates.crt").exists() {
        pip.args(["--cert", "/etc/ssl/certs/ca-certificates.crt"]);
    }
    assert!(pip.status().is_ok_and(|s| s.success()), "pip install {packages:?} failed");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).expect("rename the venv into place");
    assert!(ready(&dir), "the venv {name} does not import what the tests need: {probe}");
    dir
}

/// The text of a `/metrics` scrape at `url` (with `token`, if any).
pub async fn scrape(url: &str, token: Option<&str>) -> String {
    let mut req = web().get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().await.expect("scrape").text().await.expect("metrics text")
}
