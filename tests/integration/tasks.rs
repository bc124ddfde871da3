//! MCP Tasks (`io.modelcontextprotocol/tasks`, SEP-2663): a client that declares the extension
//! gets a task for a run that outlives its `wait_s` (or asks for the background), polls its
//! output with `tasks/get`, stops it with `tasks/cancel`, and reads it across a server
//! restart; a client that does not (or forges the declaration) keeps the job handle; another
//! principal can neither read nor stop it.

use std::process::Stdio;
use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, ClientCapabilities, ClientConfig, GetTaskParams,
    Implementation, ProtocolVersion,
};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, ClientLifecycleMode, ClientServiceExt as _, RoleClient};
use serde_json::{Value, json};
use tokio::process::Command;

use crate::adopt::{Server as HttpStateServer, StateDir};
use crate::common::{Raw, ServerLog, assert_cleaned_up, instance_name, state_dir, with_test_runtime};
use crate::http::{ALICE, BOB, HttpServer};

/// About 30 s of output, a line every 0.2 s.
const LONG: &str =
    "import time\nfor i in range(150):\n    print(f'line {i}', flush=True)\n    time.sleep(0.2)\n'finished'";

/// A client that declares the tasks extension (at `initialize`, and in every request's `_meta`
/// when it speaks 2026-07-28).
#[derive(Clone, Default)]
struct TaskClient;

impl ClientHandler for TaskClient {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(ClientCapabilities::builder().enable_tasks().build(), Implementation::new("tasks-test", "0"))
    }
}

type Client = RunningService<RoleClient, TaskClient>;

fn discover() -> ClientLifecycleMode {
    ClientLifecycleMode::Discover { preferred_versions: vec![ProtocolVersion::V_2026_07_28] }
}

/// `pyberth serve` over stdio with a [`TaskClient`]: 2026-07-28 (`Discover`) or 2025-11-25.
async fn stdio(tag: &str, mode: ClientLifecycleMode) -> (tokio::process::Child, Client, String, ServerLog) {
    let instance = instance_name(tag);
    let (log, stderr) = ServerLog::create(&instance);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pyberth"));
    cmd.arg("serve")
        .env("PYBERTH_INSTANCE", &instance)
        .env("PYBERTH_STATE_DIR", state_dir())
        .env("PYBERTH_POOL_SIZE", "0")
        .env("RUST_LOG", "pyberth=debug,info")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true);
    let mut child = with_test_runtime(&mut cmd).spawn().expect("spawn pyberth");
    let io = (child.stdout.take().expect("stdout"), child.stdin.take().expect("stdin"));
    let client = TaskClient.serve_with_lifecycle(io, mode).await.expect("MCP client starts");
    (child, client, instance, log)
}

/// A [`TaskClient`] over HTTP with `token`.
async fn http(port: u16, token: &str, mode: ClientLifecycleMode) -> Client {
    let config =
        StreamableHttpClientTransportConfig::with_uri(format!("http://127.0.0.1:{port}/mcp")).auth_header(token);
    let transport = crate::common::http_transport(config);
    let client = TaskClient.serve_with_lifecycle(transport, mode).await.expect("MCP client starts over HTTP");
    // As clients do before calling: the list tells rmcp's HTTP transport which arguments
    // travel as `Mcp-Param-*` headers (docs/protocol.md); a 2026 call without them is refused.
    client.list_all_tools().await.expect("tools/list");
    client
}

/// One `tools/call` round, as the client received it.
async fn call(client: &Client, tool: &'static str, args: Value) -> CallToolResponse {
    let args = args.as_object().expect("object").clone();
    let params = CallToolRequestParams::new(tool).with_arguments(args);
    client.call_tool_once(params).await.unwrap_or_else(|e| panic!("{tool} failed at the protocol level: {e}"))
}

/// Starts `args` as run_python, which must answer with a task: its id.
async fn start_task(client: &Client, args: Value) -> String {
    match call(client, "run_python", args).await {
        CallToolResponse::Task(t) => {
            let v = serde_json::to_value(&t).expect("task JSON");
            assert_eq!((&v["resultType"], &v["status"]), (&json!("task"), &json!("working")), "{v}");
            assert!(v["createdAt"].as_str().is_some_and(|c| c.ends_with('Z')) && v["pollIntervalMs"].is_u64(), "{v}");
            t.task.task_id
        }
        other => panic!("a task was declared, so a background run is a task: {other:?}"),
    }
}

/// `tasks/get` as JSON.
async fn get(client: &Client, id: &str) -> Value {
    let r = client.get_task(GetTaskParams::new(id)).await.unwrap_or_else(|e| panic!("tasks/get {id}: {e}"));
    serde_json::to_value(&r).expect("task JSON")
}

/// Polls `tasks/get` until `done` holds, for up to 60 s.
async fn until(client: &Client, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = get(client, id).await;
        if done(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{id} never {what}: {v}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn message(v: &Value) -> &str {
    v["statusMessage"].as_str().unwrap_or_default()
}

fn stdout_bytes(v: &Value) -> u64 {
    v["_meta"]["pyberth/job"]["stdout_bytes"].as_u64().unwrap_or_default()
}

/// Cancels `id` and waits for the task to say so.
async fn cancel(client: &Client, id: &str) -> Value {
    client.cancel_task(CancelTaskParams::new(id)).await.expect("tasks/cancel is acknowledged");
    until(client, id, "was cancelled", |v| v["status"] == "cancelled").await
}

/// Over stdio on 2026-07-28: a 30 s run outlives its wait_s and is a task; its output so far is
/// polled, it is cancelled; a short background run completes with the call's result; a run
/// that ends within its wait_s is answered as always.
#[tokio::test(flavor = "multi_thread")]
async fn a_tasks_client_polls_a_long_run_and_cancels_it() {
    let (mut child, client, instance, _log) = stdio("tasks-stdio", discover()).await;
    let id = start_task(&client, json!({ "session": "t", "code": LONG, "wait_s": 1 })).await;
    assert!(id.starts_with("job-"), "the task id is the job id: {id}");
    let v = until(&client, &id, "showed its output", |v| message(v).contains("line 3")).await;
    assert_eq!(v["status"], "working", "{v}");
    assert_eq!(v["_meta"]["pyberth/job"]["session"], "t", "{v}");
    let err = client.get_task(GetTaskParams::new("job-999")).await;
    assert!(err.is_err(), "an unknown task is an error: {err:?}");

    let v = cancel(&client, &id).await;
    assert!(message(&v).contains("line"), "a cancelled task keeps its output so far: {v}");
    // The same handle is the job: the job tools see it cancelled too.
    match call(&client, "job_status", json!({ "job": id })).await {
        CallToolResponse::Complete(r) => {
            assert_eq!(r.structured_content.expect("structured")["status"], "cancelled");
        }
        other => panic!("job_status is a tool, never a task: {other:?}"),
    }

    let short = json!({ "session": "t", "code": "import time\ntime.sleep(1)\n6 * 7", "background": true });
    let id = start_task(&client, short).await;
    let v = until(&client, &id, "completed", |v| v["status"] == "completed").await;
    assert_eq!((&v["result"]["isError"], &v["result"]["structuredContent"]["result"]), (&json!(false), &json!("42")));

    match call(&client, "run_python", json!({ "session": "t", "code": "6 * 7", "wait_s": 30 })).await {
        CallToolResponse::Complete(r) => assert_eq!(r.structured_content.expect("structured")["result"], "42"),
        other => panic!("a run that ends within wait_s is no task: {other:?}"),
    }
    let _ = call(&client, "close_session", json!({ "session": "t" })).await;
    let _ = client.cancel().await;
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    assert_cleaned_up(&instance).await;
}

/// A 2025-11-25 client that declared the extension at `initialize` gets a task too.
#[tokio::test(flavor = "multi_thread")]
async fn a_2025_client_that_declared_tasks_at_initialize_gets_one() {
    let (mut child, client, instance, _log) = stdio("tasks-legacy", ClientLifecycleMode::Initialize).await;
    let id = start_task(&client, json!({ "code": "print('hi')\n'done'", "background": true })).await;
    let v = until(&client, &id, "completed", |v| v["status"] == "completed").await;
    assert_eq!(v["result"]["structuredContent"]["stdout"], "hi\n", "{v}");
    // A run that fails is a completed task whose result is the tool error the call would give.
    let id = start_task(&client, json!({ "code": "import time\ntime.sleep(0.5)\n1 / 0", "background": true })).await;
    let v = until(&client, &id, "completed", |v| v["status"] == "completed").await;
    assert_eq!(v["result"]["isError"], true, "{v}");
    assert_eq!(v["result"]["structuredContent"]["error"]["type"], "ZeroDivisionError", "{v}");
    let _ = client.cancel().await;
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    assert_cleaned_up(&instance).await;
}

/// The attack: a client that never declared the extension the 2026 way (the 2025-11-25
/// experimental `capabilities.tasks`, a `task` parameter, the id as a bare `_meta` key, a
/// malformed `extensions`) gets the classic job handle; the same raw client declaring it
/// properly gets a task, so the refusals are not vacuous.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_or_absent_declaration_gets_the_classic_result() {
    let instance = instance_name("tasks-forged");
    let mut raw = Raw::start(&instance);
    let old_style = json!({ "tasks": { "list": {}, "cancel": {}, "requests": { "tools": { "call": {} } } } });
    raw.send(json!({ "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": old_style, "clientInfo": { "name": "raw", "version": "0" } } }))
        .await;
    assert!(raw.response(1).await["result"]["serverInfo"].is_object());
    raw.send(json!({ "jsonrpc": "2.0", "method": "notifications/initialized" })).await;
    let run = |id: u64, meta: Value| {
        json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "run_python", "arguments": { "code": "import time\ntime.sleep(2)", "background": true },
            "task": { "ttl": 60000 }, "_meta": meta } })
    };
    let caps = "io.modelcontextprotocol/clientCapabilities";
    let forged = [
        json!({}),
        json!({ "io.modelcontextprotocol/tasks": {} }),
        json!({ caps: { "extensions": ["io.modelcontextprotocol/tasks"] } }),
        json!({ caps: { "tasks": {} } }),
    ];
    for (id, meta) in (2u64..).zip(forged) {
        raw.send(run(id, meta.clone())).await;
        let r = raw.response(id).await;
        assert_ne!(r["result"]["resultType"], "task", "no task for {meta}: {r}");
        assert!(r["result"]["structuredContent"]["job"].as_str().is_some(), "the classic job handle for {meta}: {r}");
    }
    let declared = json!({ caps: { "extensions": { "io.modelcontextprotocol/tasks": {} } } });
    raw.send(run(10, declared.clone())).await;
    let r = raw.response(10).await;
    assert_eq!(r["result"]["resultType"], "task", "declared per request, a task: {r}");
    let task = r["result"]["taskId"].clone();
    raw.send(json!({ "jsonrpc": "2.0", "id": 11, "method": "tasks/get", "params": { "taskId": task } })).await;
    let r = raw.response(11).await;
    assert!(r["error"].is_object(), "tasks/get without the declaration is refused: {r}");
    raw.send(
        json!({ "jsonrpc": "2.0", "id": 12, "method": "tasks/get", "params": { "taskId": task, "_meta": declared } }),
    )
    .await;
    let r = raw.response(12).await;
    assert!(r["result"]["status"].is_string(), "with it, answered: {r}");
    drop(raw.stdin);
    let _ = tokio::time::timeout(Duration::from_secs(30), raw.child.wait()).await;
    assert_cleaned_up(&instance).await;
}

/// A task read across a restart: the 30 s run goes on under the next server (same state dir),
/// whose `tasks/get` shows its output still growing, and whose `tasks/cancel` stops it. Over
/// HTTP, on 2026-07-28.
#[tokio::test(flavor = "multi_thread")]
async fn a_task_is_read_and_cancelled_across_a_server_restart() {
    let state = StateDir::new("task-restart");
    let first = HttpStateServer::start("task-restart", &state, &[]).await;
    let alice = http(first.port, ALICE, discover()).await;
    let id = start_task(&alice, json!({ "session": "s1", "code": LONG, "wait_s": 0.5 })).await;
    let before = until(&alice, &id, "printed", |v| message(v).contains("line 2")).await;
    let _ = alice.cancel().await;
    let first_instance = first.signal("-TERM").await;

    let second = HttpStateServer::start("task-restart", &state, &[]).await;
    let alice = http(second.port, ALICE, discover()).await;
    let seen = stdout_bytes(&before);
    let v =
        until(&alice, &id, "went on after the restart", |v| v["status"] == "working" && stdout_bytes(v) > seen + 20)
            .await;
    assert!(message(&v).contains("line 0"), "the output from before the restart is kept: {v}");
    cancel(&alice, &id).await;
    let _ = call(&alice, "close_session", json!({ "session": "s1" })).await;
    let _ = alice.cancel().await;
    let second_instance = second.signal("-TERM").await;
    for inst in [first_instance, second_instance] {
        assert_cleaned_up(&inst).await;
    }
}

/// Another principal can neither read a task nor stop it: its `tasks/get` says no such task,
/// its `tasks/cancel` is acknowledged (as for any id) and does nothing.
#[tokio::test(flavor = "multi_thread")]
async fn another_principal_cannot_read_or_cancel_a_task() {
    let s = HttpServer::start("tasks-principals").await;
    let alice = http(s.port, ALICE, ClientLifecycleMode::Initialize).await;
    let bob = http(s.port, BOB, discover()).await;
    let id = start_task(&alice, json!({ "session": "s1", "code": LONG, "wait_s": 0.5 })).await;
    let err = bob.get_task(GetTaskParams::new(&id)).await;
    assert!(err.is_err(), "bob reads no task of alice's: {err:?}");
    bob.cancel_task(CancelTaskParams::new(&id)).await.expect("acknowledged as for any id");
    let seen = stdout_bytes(&get(&alice, &id).await);
    let v = until(&alice, &id, "went on", |v| stdout_bytes(v) > seen + 20).await;
    assert_eq!(v["status"], "working", "bob's cancel did nothing: {v}");
    match call(&bob, "job_status", json!({ "job": id })).await {
        CallToolResponse::Complete(r) => assert_eq!(r.is_error, Some(true), "nor as a job"),
        other => panic!("{other:?}"),
    }
    cancel(&alice, &id).await;
    let _ = call(&alice, "close_session", json!({ "session": "s1" })).await;
    let _ = alice.cancel().await;
    let _ = bob.cancel().await;
    s.stop().await;
}
