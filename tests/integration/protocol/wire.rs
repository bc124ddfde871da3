//! The 2026-07-28 rules read on the wire, as raw JSON over HTTP and stdio: the `session`
//! argument marked `x-mcp-header` and honoured as `Mcp-Param-Session` (a header that disagrees
//! with the body is refused before any tool runs), cache hints on lists and reads, and log
//! notifications only for a request that asked for a level.

use serde_json::{Value, json};

use crate::common::{Raw, instance_name};
use crate::http::{ALICE, HttpServer};

const MODERN: &str = "2026-07-28";

/// The `_meta` every 2026-07-28 request carries, plus `extra`.
fn meta(extra: Value) -> Value {
    let mut m = json!({
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": { "name": "raw", "version": "0" },
    });
    if let (Some(m), Some(extra)) = (m.as_object_mut(), extra.as_object()) {
        m.extend(extra.clone());
    }
    m
}

/// A 2026-07-28 request body.
fn request(id: u64, method: &str, mut params: Value, extra_meta: Value) -> Value {
    params["_meta"] = meta(extra_meta);
    json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params })
}

/// POSTs one 2026-07-28 request with its standard headers (`Mcp-Method`, `Mcp-Name` from the
/// body) and `extra` headers; returns the status and every JSON-RPC message of the answer
/// (one JSON body, or each `data:` of an SSE stream, notifications first).
async fn post(s: &HttpServer, body: &Value, extra: &[(&str, &str)]) -> (u16, Vec<Value>) {
    let method = body["method"].as_str().unwrap_or_default();
    let mut req = crate::common::web()
        .post(s.url("/mcp"))
        .bearer_auth(ALICE)
        .header("Accept", "application/json, text/event-stream")
        .header("Content-Type", "application/json")
        .header("MCP-Protocol-Version", MODERN)
        .header("Mcp-Method", method);
    let name = match method {
        "tools/call" => body["params"]["name"].as_str(),
        "resources/read" => body["params"]["uri"].as_str(),
        _ => None,
    };
    if let Some(name) = name {
        req = req.header("Mcp-Name", name);
    }
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let resp = req.body(body.to_string()).send().await.expect("POST /mcp");
    let status = resp.status().as_u16();
    let sse = resp.headers().get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let text = resp.text().await.expect("body");
    let messages = if sse {
        text.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str(d.trim()).ok())
            .collect()
    } else {
        serde_json::from_str(&text).into_iter().collect()
    };
    (status, messages)
}

/// The response (the message with an id) among `messages`.
fn response(messages: &[Value]) -> &Value {
    messages.iter().find(|m| m.get("id").is_some()).unwrap_or_else(|| panic!("no response in {messages:?}"))
}

/// A refused case: what it shows, the request, its extra headers.
type Refused = (&'static str, Value, Vec<(&'static str, &'static str)>);

fn count(messages: &[Value], method: &str) -> usize {
    messages.iter().filter(|m| m["method"] == method).count()
}

fn run(id: u64, session: &str, code: &str, extra_meta: Value) -> Value {
    request(
        id,
        "tools/call",
        json!({ "name": "run_python", "arguments": { "session": session, "code": code } }),
        extra_meta,
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn session_is_an_mcp_param_header_and_a_mismatch_is_refused_before_any_tool_runs() {
    let s = HttpServer::start(&instance_name("proto-hdr")).await;
    // Every tool that takes `session` marks it, as a plain string a router can read.
    let (status, msgs) = post(&s, &request(1, "tools/list", json!({}), json!({})), &[]).await;
    assert_eq!(status, 200, "{msgs:?}");
    let list = &response(&msgs)["result"];
    let tools = list["tools"].as_array().expect("tools");
    let with_session: Vec<&Value> =
        tools.iter().filter(|t| t["inputSchema"]["properties"].get("session").is_some()).collect();
    assert!(with_session.len() >= 10, "{} tools take a session", with_session.len());
    for t in &with_session {
        let p = &t["inputSchema"]["properties"]["session"];
        assert_eq!(p["x-mcp-header"], "Session", "{}: {p}", t["name"]);
        assert_eq!(p["type"], "string", "{}: {p}", t["name"]);
    }
    // Cache hints on the tool list: the same for every caller, and long-lived.
    assert_eq!(list["cacheScope"], "public", "{list}");
    assert_eq!(list["ttlMs"], 3_600_000, "{list}");
    assert_eq!(list["resultType"], "complete", "{list}");

    // Header and body agree: the call runs in that session.
    let (status, msgs) =
        post(&s, &run(2, "routed", "import os; os.getpid() > 0", json!({})), &[("Mcp-Param-Session", "routed")]).await;
    assert_eq!(status, 200, "{msgs:?}");
    let r = &response(&msgs)["result"];
    assert_eq!(r["structuredContent"]["session"], "routed", "{r}");
    assert_eq!(r["structuredContent"]["result"], "True", "{r}");

    // A router routes on the header; a body naming another session is refused (SEP-2243:
    // HTTP 400, JSON-RPC -32020), and so are a missing header and one without a body value.
    let cases: [Refused; 3] = [
        ("header says another session", run(3, "victim", "x = 1", json!({})), vec![("Mcp-Param-Session", "routed")]),
        ("no header for a session in the body", run(4, "victim", "x = 1", json!({})), vec![]),
        (
            "a header with no session in the body",
            request(5, "tools/call", json!({ "name": "run_python", "arguments": { "code": "x = 1" } }), json!({})),
            vec![("Mcp-Param-Session", "victim")],
        ),
    ];
    for (what, body, headers) in cases {
        let (status, msgs) = post(&s, &body, &headers).await;
        assert_eq!(status, 400, "{what}: {msgs:?}");
        assert_eq!(response(&msgs)["error"]["code"], -32020, "{what}: {msgs:?}");
    }
    // None of the refused calls ran: only the one agreed session exists.
    let (_, msgs) =
        post(&s, &request(6, "tools/call", json!({ "name": "list_sessions", "arguments": {} }), json!({})), &[]).await;
    let sessions = response(&msgs)["result"]["structuredContent"]["sessions"].clone();
    let names: Vec<&str> = sessions.as_array().into_iter().flatten().filter_map(|s| s["session"].as_str()).collect();
    assert_eq!(names, ["routed"], "{sessions}");

    // Every tool answers a 2026-07-28 call with a tool result (an error for missing
    // arguments is one), never a protocol error.
    for (i, t) in tools.iter().enumerate() {
        let name = t["name"].as_str().expect("tool name");
        let body = request(100 + i as u64, "tools/call", json!({ "name": name, "arguments": {} }), json!({}));
        let (status, msgs) = post(&s, &body, &[]).await;
        assert_eq!(status, 200, "{name}: {msgs:?}");
        assert!(response(&msgs)["result"]["content"].is_array(), "{name}: {msgs:?}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn reads_are_private_and_uncached_and_logs_go_only_to_a_request_that_asked_a_level() {
    let s = HttpServer::start(&instance_name("proto-hints")).await;
    let hdr = [("Mcp-Param-Session", "h")];
    let code = "open('out.txt', 'w').write('cached?')\nprint('live-line', flush=True)";
    // Neither a level nor a progress token: no notification of any kind, output in the result.
    let (_, msgs) = post(&s, &run(1, "h", code, json!({})), &hdr).await;
    assert_eq!(count(&msgs, "notifications/message"), 0, "{msgs:?}");
    assert_eq!(count(&msgs, "notifications/progress"), 0, "{msgs:?}");
    assert_eq!(response(&msgs)["result"]["structuredContent"]["stdout"], "live-line\n", "{msgs:?}");
    // A progress token alone: progress, still no log message.
    let (_, msgs) = post(&s, &run(2, "h", code, json!({ "progressToken": "p1" })), &hdr).await;
    assert_eq!(count(&msgs, "notifications/message"), 0, "{msgs:?}");
    assert!(count(&msgs, "notifications/progress") >= 1, "{msgs:?}");
    // A level of info asks for output as log messages.
    let (_, msgs) = post(&s, &run(3, "h", code, json!({ "io.modelcontextprotocol/logLevel": "info" })), &hdr).await;
    let logs: Vec<&Value> = msgs.iter().filter(|m| m["method"] == "notifications/message").collect();
    // Output may come in several chunks (the text, then its newline): their texts in order.
    let said: String = logs.iter().filter_map(|m| m["params"]["data"]["text"].as_str()).collect();
    assert_eq!(said, "live-line\n", "{msgs:?}");
    // A level above info (what output is sent at) asks for none of it.
    let (_, msgs) = post(&s, &run(4, "h", code, json!({ "io.modelcontextprotocol/logLevel": "error" })), &hdr).await;
    assert_eq!(count(&msgs, "notifications/message"), 0, "{msgs:?}");

    // The templates are the same for everyone; a file's contents are one caller's and change.
    let (_, msgs) = post(&s, &request(5, "resources/templates/list", json!({}), json!({})), &[]).await;
    let list = &response(&msgs)["result"];
    assert_eq!((list["cacheScope"].as_str(), list["ttlMs"].as_u64()), (Some("public"), Some(3_600_000)), "{list}");
    let uri = "pyberth://sessions/h/files/out.txt";
    let (_, msgs) = post(&s, &request(6, "resources/read", json!({ "uri": uri }), json!({})), &[]).await;
    let read = &response(&msgs)["result"];
    assert_eq!(read["contents"][0]["text"], "cached?", "{read}");
    assert_eq!((read["cacheScope"].as_str(), read["ttlMs"].as_u64()), (Some("private"), Some(0)), "{read}");
    assert_eq!(read["resultType"], "complete", "{read}");
    // A missing file is the 2026 not-found code.
    let gone = "pyberth://sessions/h/files/none.txt";
    let (_, msgs) = post(&s, &request(7, "resources/read", json!({ "uri": gone }), json!({})), &[]).await;
    assert_eq!(response(&msgs)["error"]["code"], -32602, "{msgs:?}");
    // A 2025-11-25 client gets no hints: they are not in its revision.
    let legacy = super::http_client(&s, ALICE, super::Gen::Legacy).await;
    let tools = legacy.list_tools(None).await.expect("tools/list");
    assert_eq!((tools.ttl_ms, tools.cache_scope), (None, None));
    let read = legacy.read_resource(rmcp::model::ReadResourceRequestParams::new(uri)).await.expect("read");
    assert_eq!((read.ttl_ms, read.cache_scope), (None, None));
    let _ = legacy.cancel().await;
    s.stop().await;
}

/// Over stdio a client that initialized and set a level with `logging/setLevel` (2025) and then
/// sends a 2026-07-28 request without a level gets no log message for it; the old request
/// still gets its messages.
#[tokio::test(flavor = "multi_thread")]
async fn over_stdio_a_2026_request_without_a_level_gets_no_log_message_whatever_was_set_before() {
    let mut raw = Raw::start(&instance_name("proto-stdio-log"));
    raw.initialize().await;
    raw.send(json!({ "jsonrpc": "2.0", "id": 2, "method": "logging/setLevel", "params": { "level": "info" } })).await;
    assert!(raw.response(2).await.get("result").is_some());
    let code = "print('live-line', flush=True)";
    raw.send(run(3, "s", code, json!({}))).await;
    let r = raw.response(3).await;
    assert_eq!(r["result"]["structuredContent"]["stdout"], "live-line\n", "{r}");
    assert_eq!(raw.logs, 0, "a 2026-07-28 request without a level got log messages");
    raw.send(run(4, "s", code, json!({ "io.modelcontextprotocol/logLevel": "debug" }))).await;
    raw.response(4).await;
    assert!(raw.logs >= 1, "a 2026-07-28 request asking debug got no log message");
    let before = raw.logs;
    // Output then a pause: the line goes out live, not only with the run's end (under load a
    // short run's output can arrive with its `done`, and then no live message is due).
    let slow = "import time\nprint('live-line', flush=True)\ntime.sleep(1)";
    let legacy = json!({ "jsonrpc": "2.0", "id": 5, "method": "tools/call",
        "params": { "name": "run_python", "arguments": { "session": "s", "code": slow } } });
    raw.send(legacy).await;
    raw.response(5).await;
    assert!(raw.logs > before, "the initialized client's own level still gets its messages");
    drop(raw.stdin);
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), raw.child.wait()).await;
    assert!(status.is_ok(), "the server exits when its stdin closes");
}
