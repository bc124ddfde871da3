//! The HTTP service under attack (issue 14): one principal presenting another's MCP session id,
//! MCP sessions opened without end, Host and Origin tricks, and slow clients before
//! authentication. Every attack is sent raw, to 127.0.0.1 only, in bounded numbers.

use std::time::Duration;

use serde_json::{Value, json};

use crate::http::{ALICE, HttpServer};

const ACCEPT: &str = "application/json, text/event-stream";

const VERSION: &str = "2025-06-18";

fn initialize_request() -> Value {
    json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": { "protocolVersion": VERSION, "capabilities": {}, "clientInfo": { "name": "attack", "version": "0" } }
    })
}

async fn post_with(
    s: &HttpServer,
    token: &str,
    session: Option<&str>,
    body: &Value,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(s.url("/mcp"))
        .bearer_auth(token)
        .header("accept", ACCEPT)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(sid) = session {
        req = req.header("mcp-session-id", sid).header("mcp-protocol-version", VERSION);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    tokio::time::timeout(Duration::from_secs(60), req.send()).await.expect("answered in time").expect("post")
}

/// The body as far as it arrives within `limit` (an SSE stream may stay open).
async fn body_within(mut r: reqwest::Response, limit: Duration) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, async {
        while let Ok(Some(chunk)) = r.chunk().await {
            out.extend_from_slice(&chunk);
        }
    })
    .await;
    String::from_utf8_lossy(&out).into_owned()
}

fn session_header(r: &reqwest::Response) -> Option<String> {
    r.headers().get("mcp-session-id").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn host_and_origin_are_parsed_and_checked() {
    let s = HttpServer::start_with("http-hosts", &[("PYBERTH_ALLOWED_HOSTS", "pyberth.internal:8443")], None).await;
    let init = initialize_request();
    // Hosts that only look like an allowed one.
    for host in [
        "localhost:evil.example",
        "localhost:99999",
        "localhost:80:81",
        "evil.example@localhost",
        "127.0.0.1:1@evil.example",
        "[::1]:evil",
        "pyberth.internal:9999",
        "pyberth.internal",
    ] {
        let r = post_with(&s, ALICE, None, &init, &[("host", host)]).await;
        let status = r.status().as_u16();
        let has_session = session_header(&r).is_some();
        let body = body_within(r, Duration::from_secs(3)).await;
        assert!(matches!(status, 400 | 403) && !has_session, "Host {host:?} was accepted: {status} {body}");
        assert!(body.contains(host), "the refusal names the Host {host:?}: {body}");
    }
    // Origins of pages elsewhere (DNS rebinding, cross-site requests from a browser).
    let here = format!("127.0.0.1:{}", s.port);
    for (origin, named) in [
        ("http://evil.example", "evil.example"),
        ("https://evil.example:443", "evil.example"),
        ("http://localhost.evil.example", "localhost.evil.example"),
        ("null", "null"),
        ("https://pyberth.internal", "pyberth.internal"),
    ] {
        let r = post_with(&s, ALICE, None, &init, &[("origin", origin)]).await;
        let status = r.status().as_u16();
        let has_session = session_header(&r).is_some();
        let body = body_within(r, Duration::from_secs(3)).await;
        assert!(status == 403 && !has_session, "Origin {origin:?} was accepted: {status} {body}");
        assert!(body.contains(named) && body.contains("--allowed-host"), "{origin:?}: {body}");
    }
    // What is allowed still works.
    for (host, origin) in [
        (here.as_str(), Some(format!("http://{here}"))),
        ("localhost", Some("http://localhost:5173".to_owned())),
        ("pyberth.internal:8443", Some("https://pyberth.internal:8443".to_owned())),
        ("[::1]", None),
    ] {
        let mut headers = vec![("host", host)];
        if let Some(o) = &origin {
            headers.push(("origin", o.as_str()));
        }
        let r = post_with(&s, ALICE, None, &init, &headers).await;
        assert_eq!(r.status().as_u16(), 200, "Host {host:?}, Origin {origin:?}");
        assert!(session_header(&r).is_some());
    }
    s.stop().await;
}
