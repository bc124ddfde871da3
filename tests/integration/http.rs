//! The HTTP service: tokens, principals kept apart, progress over HTTP, jobs that outlive a
//! client, /healthz, refusing to serve openly, graceful shutdown.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{RoleClient, ServiceExt as _};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

use crate::common::{Recorder, assert_cleaned_up, instance_name, state_dir, text};

pub(crate) const ALICE: &str = "alice-token-0123456789abcdef";
pub(crate) const BOB: &str = "bob-token-0123456789abcdef0000";

pub(crate) struct HttpServer {
    child: Child,
    pub(crate) port: u16,
    instance: String,
    /// Everything the server wrote to stderr so far (it is also copied to the test's stderr).
    log: Arc<Mutex<String>>,
    _dir: TempDir,
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

impl HttpServer {
    /// Starts `pyberth serve --http` with alice's and bob's tokens and waits for /healthz.
    pub(crate) async fn start(tag: &str) -> HttpServer {
        Self::start_with(tag, &[], None).await
    }

    /// Like [`HttpServer::start`], with extra environment, and under `ulimit -n` if given
    /// (soft and hard, so the server cannot raise it).
    pub(crate) async fn start_with(tag: &str, env: &[(&str, &str)], nofile: Option<u32>) -> HttpServer {
        let instance = instance_name(tag);
        let dir = std::env::temp_dir().join(format!("pyberth-http-{instance}"));
        std::fs::create_dir_all(&dir).expect("dir");
        let tokens = dir.join("tokens");
        std::fs::write(&tokens, format!("alice:{ALICE}\nbob:{BOB}\n")).expect("tokens");
        let port = free_port();
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.args(["-c", &format!("ulimit -n {n} && exec \"$0\" \"$@\""), env!("CARGO_BIN_EXE_pyberth")]);
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_pyberth")),
        };
        cmd.args(["serve", "--http", &format!("127.0.0.1:{port}"), "--tokens-file"])
            .arg(&tokens)
            .env("PYBERTH_INSTANCE", &instance)
            .env("PYBERTH_STATE_DIR", state_dir())
            .env("RUST_LOG", "pyberth=debug,info")
            // These tests check a stop leaves nothing: no sessions left for a next server.
            .env("PYBERTH_ADOPT_GRACE_S", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        crate::common::with_test_runtime(&mut cmd);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn pyberth serve --http");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let sink = log.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("{line}");
                let mut log = sink.lock().expect("log lock");
                log.push_str(&line);
                log.push('\n');
            }
        });
        let server = HttpServer { child, port, instance, log, _dir: TempDir(dir) };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = crate::common::web().get(server.url("/healthz")).send().await
                && r.status().is_success()
            {
                return server;
            }
            assert!(Instant::now() < deadline, "the HTTP server did not become healthy");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// What the server logged so far.
    pub(crate) fn log(&self) -> String {
        self.log.lock().expect("log lock").clone()
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub(crate) async fn client(&self, token: &str) -> RunningService<RoleClient, Recorder> {
        let config = StreamableHttpClientTransportConfig::with_uri(self.url("/mcp")).auth_header(token);
        let transport = crate::common::http_transport(config);
        Recorder::default().serve(transport).await.expect("MCP initialise over HTTP")
    }

    /// SIGTERM, then the server must exit and leave nothing behind.
    pub(crate) async fn stop(mut self) {
        let pid = self.child.id().expect("pid");
        let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        assert!(status.is_ok_and(|s| s.is_ok_and(|s| s.success())), "the server exits cleanly on SIGTERM");
        assert_cleaned_up(&self.instance).await;
    }
}

pub(crate) async fn call(
    client: &RunningService<RoleClient, Recorder>,
    tool: &'static str,
    args: Value,
) -> (CallToolResult, Value) {
    let args = args.as_object().expect("object").clone();
    let params = CallToolRequestParams::new(tool).with_arguments(args);
    let r = client.call_tool(params).await.unwrap_or_else(|e| panic!("{tool} failed at the protocol level: {e}"));
    let sc = r.structured_content.clone().unwrap_or(Value::Null);
    (r, sc)
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_are_required_and_healthz_reports() {
    let s = HttpServer::start("http-auth").await;
    let http = crate::common::web();
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#;
    let none = http.post(s.url("/mcp")).body(body).send().await.expect("post");
    assert_eq!(none.status().as_u16(), 401);
    let challenge = none.headers().get("www-authenticate").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    assert!(challenge.is_some_and(|c| c.starts_with("Bearer ") && c.contains("token is required")));
    let wrong = http.post(s.url("/mcp")).bearer_auth("not-a-real-token-at-all").body(body).send().await.expect("post");
    assert_eq!(wrong.status().as_u16(), 401);
    // A Host header from elsewhere (DNS rebinding) is refused even with a valid token.
    let rebound = http
        .post(s.url("/mcp"))
        .bearer_auth(ALICE)
        .header("host", "evil.example")
        .body(body)
        .send()
        .await
        .expect("post");
    assert_eq!(rebound.status().as_u16(), 403);
    // The bare address points the way instead of asking for a token.
    let root = http.get(s.url("/")).send().await.expect("get /");
    assert_eq!(root.status().as_u16(), 200);
    let body = root.text().await.expect("body");
    assert!(body.contains("/mcp") && body.contains("/healthz"), "{body}");
    let health: Value = http.get(s.url("/healthz")).send().await.expect("get").json().await.expect("json");
    assert_eq!(health["docker"], true);
    assert_eq!(health["image"], true);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn principals_never_see_each_others_sessions_or_jobs() {
    let s = HttpServer::start("http-principals").await;
    let alice = s.client(ALICE).await;
    let bob = s.client(BOB).await;
    let (r, _) = call(
        &alice,
        "run_python",
        json!({ "session": "work", "code": "secret = 'a'\nopen('notes.txt', 'w').write('hi')" }),
    )
    .await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (_, sc) = call(
        &alice,
        "run_python",
        json!({ "session": "work", "code": "import time\ntime.sleep(1)", "background": true }),
    )
    .await;
    let job = sc["job"].as_str().expect("job").to_owned();

    let (_, sc) = call(&bob, "list_sessions", json!({})).await;
    assert_eq!(sc["sessions"], json!([]), "bob sees none of alice's sessions");
    let (_, sc) = call(&bob, "list_jobs", json!({})).await;
    assert_eq!(sc["jobs"], json!([]), "bob sees none of alice's jobs");
    let (r, _) = call(&bob, "job_status", json!({ "job": job })).await;
    assert_eq!(r.is_error, Some(true));
    let (r, _) = call(&bob, "cancel_job", json!({ "job": job })).await;
    assert_eq!(r.is_error, Some(true), "bob cannot cancel alice's job");
    let (r, _) = call(&bob, "read_file", json!({ "session": "work", "path": "notes.txt" })).await;
    assert_eq!(r.is_error, Some(true), "a foreign session is like a missing one: {}", text(&r));
    let (r, _) = call(&bob, "close_session", json!({ "session": "work" })).await;
    assert_eq!(r.is_error, Some(true), "bob cannot close alice's session: {}", text(&r));
    // Bob's own "work" is another container: alice's variable is not there.
    let (r, _) = call(&bob, "run_python", json!({ "session": "work", "code": "secret" })).await;
    assert!(text(&r).contains("NameError"), "{}", text(&r));

    let (_, sc) = call(&alice, "job_status", json!({ "job": job, "wait_s": 10 })).await;
    assert_eq!(sc["status"], "ok");
    let (_, sc) = call(&alice, "run_python", json!({ "session": "work", "code": "secret" })).await;
    assert_eq!(sc["result"], "'a'");
    let (_, sc) = call(&alice, "list_sessions", json!({})).await;
    assert_eq!(sc["sessions"].as_array().map(Vec::len), Some(1), "alice has one session: {sc}");
    let _ = alice.cancel().await;
    let _ = bob.cancel().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn output_streams_over_http_and_a_job_outlives_its_client() {
    let s = HttpServer::start("http-stream").await;
    let alice = s.client(ALICE).await;
    let code = "import time\nfor i in range(3):\n    print(f'step {i}', flush=True)\n    time.sleep(0.6)";
    let (r, _) = call(&alice, "run_python", json!({ "code": code })).await;
    let ended = Instant::now();
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let heard = std::mem::take(&mut *alice.service().heard.lock().expect("lock"));
    let first = heard.iter().find(|h| h.kind == "progress" && h.text.contains("step 0"));
    let first = first.unwrap_or_else(|| panic!("no progress with step 0 over HTTP: {heard:?}"));
    assert!(ended.duration_since(first.at) > Duration::from_millis(800), "step 0 arrived only at the end");

    let (_, sc) = call(
        &alice,
        "run_python",
        json!({ "code": "import time\ntime.sleep(2)\nprint('still here')", "background": true }),
    )
    .await;
    let job = sc["job"].as_str().expect("job").to_owned();
    let _ = alice.cancel().await; // the client goes away mid-run
    let again = s.client(ALICE).await;
    let (_, sc) = call(&again, "job_status", json!({ "job": job, "wait_s": 15 })).await;
    assert_eq!(sc["status"], "ok", "{sc}");
    assert_eq!(sc["stdout"], "still here\n");
    let _ = again.cancel().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_open_address_without_tokens_is_refused() {
    let port = free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_pyberth"))
        .args(["serve", "--http", &format!("0.0.0.0:{port}")])
        .env("PYBERTH_INSTANCE", instance_name("http-open"))
        .env("PYBERTH_STATE_DIR", state_dir())
        .env_remove("PYBERTH_TOKEN")
        .stdin(Stdio::null())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out).await.expect("exits").expect("output");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("without tokens") && err.contains("PYBERTH_TOKEN"), "{err}");
}
