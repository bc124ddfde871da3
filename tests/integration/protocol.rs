//! Both MCP generations (issue 31 item 1): one core suite (state, files, jobs, egress,
//! snapshots) driven by a 2026-07-28 client (`server/discover`, per-request `_meta`, no
//! session) and by a 2025-11-25 client (`initialize`), over stdio and over streamable HTTP;
//! over HTTP both at once on one server, as two principals who cannot see each other's
//! sessions, under a per-caller session cap. `protocol/wire.rs` reads the raw messages:
//! `Mcp-Param-Session`, cache hints, log notifications.

use rmcp::model::{CallToolResult, ProtocolVersion, ReadResourceRequestParams, ResourceContents};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientLifecycleMode, ClientServiceExt as _, RoleClient};
use serde_json::{Value, json};

use crate::common::{Heard, Recorder, Server, instance_name, text};
use crate::egress::{SECRET, Upstream, config_file, fetch};
use crate::http::{ALICE, BOB, HttpServer, call};

mod sdk;
mod wire;

/// A connected client of either generation.
pub(crate) type Client = RunningService<RoleClient, Recorder>;

/// The two protocol generations a client may speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gen {
    /// 2025-11-25: `initialize`, then a session.
    Legacy,
    /// 2026-07-28: `server/discover`, every request self-contained.
    Modern,
}

impl Gen {
    fn lifecycle(self) -> ClientLifecycleMode {
        match self {
            Gen::Legacy => ClientLifecycleMode::Initialize,
            Gen::Modern => ClientLifecycleMode::Discover { preferred_versions: vec![ProtocolVersion::V_2026_07_28] },
        }
    }
}

/// A client of `generation` over HTTP with `token`.
pub(crate) async fn http_client(s: &HttpServer, token: &str, generation: Gen) -> Client {
    let config = StreamableHttpClientTransportConfig::with_uri(s.url("/mcp")).auth_header(token);
    let transport = crate::common::http_transport(config);
    let client = Recorder::default()
        .serve_with_lifecycle(transport, generation.lifecycle())
        .await
        .unwrap_or_else(|e| panic!("{generation:?} client over HTTP: {e}"));
    // As clients do before calling: rmcp's HTTP transport learns from the list which
    // arguments travel as `Mcp-Param-*` headers, and the server refuses a call without them.
    let tools = client.list_all_tools().await.expect("tools/list");
    assert!(tools.iter().any(|t| t.name == "run_python"), "{tools:?}");
    client
}

/// The server environment that allows the egress upstream to sessions of environment `net`.
fn egress_env(tag: &str, up: &Upstream) -> Vec<(&'static str, String)> {
    let config = config_file(tag, up);
    vec![
        ("PYBERTH_CONFIG", config.to_str().expect("utf-8 path").to_owned()),
        ("EGRESS_TEST_SECRET", SECRET.to_owned()),
        // Room for the suite's four sessions and one more, then refusal (the cap check).
        ("PYBERTH_MAX_SESSIONS", "5".to_owned()),
    ]
}

fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn ok(r: &CallToolResult, what: &str) {
    assert_eq!(r.is_error, Some(false), "{what}: {}", text(r));
}

/// The core suite, on one connected client: each step is a tool a model uses, checked by what
/// it returns. `label` tells the runs apart in failures and in the file they write.
pub(crate) async fn core_suite(c: &Client, label: &str) {
    // State kept across calls: each 2026 request is served by a fresh handler, the session
    // lives in the registry under the `session` argument.
    let (r, _) = call(c, "run_python", json!({ "session": "st", "code": "x = 41" })).await;
    ok(&r, label);
    let (r, sc) = call(c, "run_python", json!({ "session": "st", "code": "x + 1" })).await;
    assert_eq!(sc["result"], "42", "{label}: state kept: {}", text(&r));

    // Files: write, read, list, and the same file as a resource on the template.
    let content = format!("hello from {label}");
    let (r, _) = call(c, "write_file", json!({ "session": "st", "path": "notes/a.txt", "content": content })).await;
    ok(&r, label);
    let (r, sc) = call(c, "read_file", json!({ "session": "st", "path": "notes/a.txt" })).await;
    assert_eq!(sc["content"], content.as_str(), "{label}: {}", text(&r));
    let (r, sc) = call(c, "list_files", json!({ "session": "st", "recursive": true })).await;
    assert!(sc["entries"].to_string().contains("a.txt"), "{label}: {}", text(&r));
    let read = c
        .read_resource(ReadResourceRequestParams::new("pyberth://sessions/st/files/notes/a.txt"))
        .await
        .unwrap_or_else(|e| panic!("{label}: resources/read: {e}"));
    match read.contents.first() {
        Some(ResourceContents::TextResourceContents { text, .. }) => assert_eq!(text, &content, "{label}"),
        other => panic!("{label}: a text resource, not {other:?}"),
    }

    jobs(c, label).await;
    egress(c, label).await;

    // Snapshots: the state and the file come back in a new session.
    let snap = format!("snap-{label}");
    let (r, _) = call(c, "snapshot_session", json!({ "session": "st", "name": snap })).await;
    ok(&r, label);
    let (r, _) = call(c, "restore_session", json!({ "snapshot": snap, "session": "st2" })).await;
    ok(&r, label);
    let (r, sc) = call(c, "run_python", json!({ "session": "st2", "code": "x" })).await;
    assert_eq!(sc["result"], "41", "{label}: restored state: {}", text(&r));
    let (r, sc) = call(c, "read_file", json!({ "session": "st2", "path": "notes/a.txt" })).await;
    assert_eq!(sc["content"], content.as_str(), "{label}: restored file: {}", text(&r));
}

/// Jobs: a background run read while it works, then cancelled; one read to its end.
async fn jobs(c: &Client, label: &str) {
    let code = "import time\nprint('started', flush=True)\ntime.sleep(120)";
    let (r, sc) = call(c, "run_python", json!({ "session": "jb", "code": code, "background": true })).await;
    assert_eq!(sc["status"], "running", "{label}: {}", text(&r));
    let job = sc["job"].as_str().expect("a job handle").to_owned();
    let mut seen = String::new();
    for _ in 0..30 {
        let (r, sc) = call(c, "job_status", json!({ "job": job, "wait_s": 2 })).await;
        assert_eq!(sc["status"], "running", "{label}: {}", text(&r));
        seen.push_str(sc["stdout"].as_str().unwrap_or_default());
        if seen.contains("started") {
            break;
        }
    }
    assert!(seen.contains("started"), "{label}: the job's output so far: {seen:?}");
    let (r, sc) = call(c, "cancel_job", json!({ "job": job })).await;
    assert_eq!(sc["status"], "cancelled", "{label}: {}", text(&r));
    let (r, sc) =
        call(c, "run_python", json!({ "session": "jb", "code": "print('bg done')", "background": true })).await;
    let job = sc["job"].as_str().unwrap_or_else(|| panic!("{label}: a job: {}", text(&r))).to_owned();
    let mut last = Value::Null;
    for _ in 0..10 {
        let (_, sc) = call(c, "job_status", json!({ "job": job, "wait_s": 5 })).await;
        last = sc;
        if last["status"] != "running" {
            break;
        }
    }
    assert_eq!(last["status"], "ok", "{label}: {last}");
    assert_eq!(last["result"]["stdout"], "bg done\n", "{label}: {last}");
}

/// Egress: the allow-listed upstream answers, any other host is refused by the proxy.
async fn egress(c: &Client, label: &str) {
    let run = |url: &str| json!({ "session": "net", "environment": "net", "code": fetch(url), "timeout_s": 60 });
    let (r, sc) = call(c, "run_python", run("http://upstream.test:8000/proto")).await;
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.starts_with("200 upstream ok /proto"), "{label}: allowed host: {out} {}", text(&r));
    let (r, sc) = call(c, "run_python", run("http://example.com/")).await;
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.starts_with("403 pyberth egress:"), "{label}: refused host: {out} {}", text(&r));
}

/// A session's name and secret made by `owner`; `other` (another principal) must not see or
/// reach it by name, through tools or the resource template.
async fn cannot_see(owner: &Client, other: &Client, session: &str, label: &str) {
    let secret = format!("secret-of-{session}");
    let (r, _) = call(owner, "write_file", json!({ "session": session, "path": "s.txt", "content": secret })).await;
    ok(&r, label);
    let (r, sc) = call(other, "list_sessions", json!({})).await;
    assert!(!sc.to_string().contains(session), "{label}: another principal's session listed: {}", text(&r));
    let (r, _) = call(other, "read_file", json!({ "session": session, "path": "s.txt" })).await;
    assert!(!text(&r).contains(&secret), "{label}: read another principal's file: {}", text(&r));
    let uri = format!("pyberth://sessions/{session}/files/s.txt");
    match other.read_resource(ReadResourceRequestParams::new(uri)).await {
        Err(e) => assert!(!e.to_string().contains(&secret), "{label}: {e}"),
        Ok(r) => panic!("{label}: another principal's file read as a resource: {r:?}"),
    }
}

/// A caller past its session cap is refused with a tool error naming the way out.
async fn capped(c: &Client, label: &str) {
    let (r, _) = call(c, "run_python", json!({ "session": "one-too-many", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true), "{label}: a sixth session past a cap of five: {}", text(&r));
    assert!(text(&r).contains("close_session"), "{label}: {}", text(&r));
}

/// Live output as each generation asks for it: progress for the token rmcp's client puts on
/// every request; log messages for the older client after `logging/setLevel`, and never for a
/// 2026-07-28 request that carries no level (rmcp's client sends none).
async fn notifications(s: &Server, generation: Gen) {
    #[allow(deprecated)] // logging/setLevel: how a 2025-11-25 client asks for log messages
    if generation == Gen::Legacy {
        let level = rmcp::model::SetLevelRequestParams::new(rmcp::model::LoggingLevel::Info);
        s.client().set_level(level).await.expect("logging/setLevel");
    }
    s.take_heard();
    s.ok("st", "print('live-line', flush=True)").await;
    // Chunks in the server's order (they may arrive out of it), joined.
    let said = |heard: &[Heard], kind: &str| {
        let mut of: Vec<_> = heard.iter().filter(|h| h.kind == kind).collect();
        of.sort_by(|a, b| a.seq.total_cmp(&b.seq));
        of.iter().map(|h| h.text.as_str()).collect::<String>()
    };
    // rmcp's client handles notifications in tasks of their own: give them time to land (a
    // loaded machine takes seconds), then a moment more for any that should not come.
    let mut heard = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let wanted = |h: &[Heard]| {
        said(h, "progress").contains("live-line") && (generation == Gen::Modern || said(h, "log").contains("live-line"))
    };
    while !wanted(&heard) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        heard.extend(s.take_heard());
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    heard.extend(s.take_heard());
    let said = |kind: &str| said(&heard, kind);
    assert!(said("progress").contains("live-line"), "{generation:?}: no progress: {heard:?}");
    match generation {
        Gen::Legacy => assert!(said("log").contains("live-line"), "after setLevel info: {heard:?}"),
        Gen::Modern => assert_eq!(heard.iter().filter(|h| h.kind == "log").count(), 0, "{heard:?}"),
    }
}

/// One stdio server per generation, the suite on each, then the cap.
async fn over_stdio(generation: Gen) {
    let tag = instance_name(&format!("proto-{generation:?}").to_lowercase());
    let up = Upstream::start(&tag).await;
    let env = egress_env(&tag, &up);
    let s = Server::start_with_lifecycle(&tag, &borrowed(&env), generation.lifecycle()).await;
    let label = format!("stdio-{generation:?}").to_lowercase();
    core_suite(s.client(), &label).await;
    notifications(&s, generation).await;
    let (r, _) = call(s.client(), "run_python", json!({ "session": "fifth", "code": "1" })).await;
    ok(&r, &label);
    capped(s.client(), &label).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_core_suite_passes_over_stdio_for_a_2026_07_28_client() {
    over_stdio(Gen::Modern).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_core_suite_passes_over_stdio_for_a_2025_11_25_client() {
    over_stdio(Gen::Legacy).await;
}

/// One HTTP server: alice on 2026-07-28 and bob on 2025-11-25 run the suite at the same time;
/// then each principal, on either generation, cannot see the other's sessions, and each
/// principal's cap holds on both.
#[tokio::test(flavor = "multi_thread")]
async fn both_generations_drive_one_http_server_as_two_principals_kept_apart() {
    let tag = instance_name("proto-http");
    let up = Upstream::start(&tag).await;
    let env = egress_env(&tag, &up);
    let s = HttpServer::start_with(&tag, &borrowed(&env), None).await;
    let alice = http_client(&s, ALICE, Gen::Modern).await;
    let bob = http_client(&s, BOB, Gen::Legacy).await;
    tokio::join!(core_suite(&alice, "http-modern-alice"), core_suite(&bob, "http-legacy-bob"));

    // The principal comes from each request's token, on both generations and both ways.
    let alice_legacy = http_client(&s, ALICE, Gen::Legacy).await;
    let bob_modern = http_client(&s, BOB, Gen::Modern).await;
    cannot_see(&bob, &alice, "bob-own", "bob legacy -> alice modern").await;
    cannot_see(&alice_legacy, &bob_modern, "alice-own", "alice legacy -> bob modern").await;
    // The same name is two sessions: alice's st holds her file, bob's his.
    let (_, sc) = call(&alice_legacy, "read_file", json!({ "session": "st", "path": "notes/a.txt" })).await;
    assert_eq!(sc["content"], "hello from http-modern-alice", "{sc}");
    let (_, sc) = call(&bob_modern, "read_file", json!({ "session": "st", "path": "notes/a.txt" })).await;
    assert_eq!(sc["content"], "hello from http-legacy-bob", "{sc}");
    // Each has five sessions now: the cap holds whichever generation asks.
    capped(&alice, "alice modern").await;
    capped(&alice_legacy, "alice legacy").await;
    capped(&bob, "bob legacy").await;
    capped(&bob_modern, "bob modern").await;
    for c in [alice, bob, alice_legacy, bob_modern] {
        let _ = c.cancel().await;
    }
    s.stop().await;
}
