//! The HTTP service under attack (issue 14): one principal presenting another's MCP session id,
//! MCP sessions opened without end, Host and Origin tricks, and slow clients before
//! authentication. Every attack is sent raw, to 127.0.0.1 only, in bounded numbers.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rmcp::ServiceExt as _;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

use crate::common::{Recorder, text};
use crate::http::{ALICE, BOB, HttpServer, call};

const ACCEPT: &str = "application/json, text/event-stream";
const VERSION: &str = "2025-06-18";

fn initialize_request() -> Value {
    json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": { "protocolVersion": VERSION, "capabilities": {}, "clientInfo": { "name": "attack", "version": "0" } }
    })
}

/// POSTs one JSON-RPC message to /mcp with `token`, in `session` if given.
async fn post(s: &HttpServer, token: &str, session: Option<&str>, body: &Value) -> reqwest::Response {
    post_with(s, token, session, body, &[]).await
}

async fn post_with(
    s: &HttpServer,
    token: &str,
    session: Option<&str>,
    body: &Value,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut req = crate::common::web()
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

/// Everything a client can learn from a response: status, content type, body.
async fn seen(r: reqwest::Response) -> (u16, Option<String>, String) {
    let status = r.status().as_u16();
    let ctype = r.headers().get("content-type").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    (status, ctype, body_within(r, Duration::from_secs(8)).await)
}

fn session_header(r: &reqwest::Response) -> Option<String> {
    r.headers().get("mcp-session-id").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// A raw initialize and the `initialized` notification; returns the MCP session id.
async fn initialize(s: &HttpServer, token: &str) -> String {
    let r = post(s, token, None, &initialize_request()).await;
    assert_eq!(r.status().as_u16(), 200, "initialize");
    let sid = session_header(&r).expect("initialize answers with an Mcp-Session-Id");
    let body = body_within(r, Duration::from_secs(10)).await;
    assert!(body.contains("\"result\""), "{body}");
    let note = json!({ "jsonrpc": "2.0", "method": "notifications/initialized" });
    let r = post(s, token, Some(&sid), &note).await;
    assert_eq!(r.status().as_u16(), 202, "initialized");
    sid
}

fn delete(s: &HttpServer, token: &str, sid: &str) -> reqwest::RequestBuilder {
    crate::common::web()
        .delete(s.url("/mcp"))
        .bearer_auth(token)
        .header("mcp-session-id", sid)
        .header("mcp-protocol-version", VERSION)
}

fn get(s: &HttpServer, token: &str, sid: &str) -> reqwest::RequestBuilder {
    crate::common::web()
        .get(s.url("/mcp"))
        .bearer_auth(token)
        .header("accept", "text/event-stream")
        .header("mcp-session-id", sid)
        .header("mcp-protocol-version", VERSION)
}

async fn send(r: reqwest::RequestBuilder) -> reqwest::Response {
    tokio::time::timeout(Duration::from_secs(30), r.send()).await.expect("answered in time").expect("request")
}

#[tokio::test(flavor = "multi_thread")]
async fn an_mcp_session_belongs_to_the_principal_that_opened_it() {
    let s = HttpServer::start("http-bind").await;
    let alice = initialize(&s, ALICE).await;
    let secret = format!("alice-secret-{}", std::process::id());
    let code = format!("import time\ntime.sleep(2)\nprint('{secret}')");
    let run = json!({
        "jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": { "name": "run_python", "arguments": { "code": code } }
    });
    let mut r = post(&s, ALICE, Some(&alice), &run).await;
    assert_eq!(r.status().as_u16(), 200);
    // The stream's first event (the priming one) names it for resumption.
    let mut head = String::new();
    let first_event = loop {
        let chunk = tokio::time::timeout(Duration::from_secs(30), r.chunk()).await;
        let chunk = chunk.expect("an event in time").expect("read").expect("an event before the end");
        head.push_str(&String::from_utf8_lossy(&chunk));
        if let Some(id) = head.lines().find_map(|l| l.strip_prefix("id:")) {
            break id.trim().to_owned();
        }
    };
    // While alice's code runs, bob asks to resume her stream from that event.
    let (status, _, stolen) = seen(send(get(&s, BOB, &alice).header("last-event-id", &first_event)).await).await;
    assert!(!stolen.contains(&secret), "bob resumed alice's stream and read her output ({status}): {stolen}");
    let rest = body_within(r, Duration::from_secs(60)).await;
    assert!(rest.contains(&secret), "alice's output reaches alice: {head}{rest}");

    // Bob, with his own valid token, presents alice's session id on every method. What he
    // gets must be exactly what an id nobody ever had gets: 404 and nothing more.
    let unknown = "00000000-0000-4000-8000-000000000000";
    let list = json!({ "jsonrpc": "2.0", "id": 3, "method": "tools/call",
        "params": { "name": "list_sessions", "arguments": {} } });
    for (what, sid) in [("alice's", alice.as_str()), ("unknown", unknown)] {
        let resumed = seen(send(get(&s, BOB, sid).header("last-event-id", &first_event)).await).await;
        let standalone = seen(send(get(&s, BOB, sid)).await).await;
        let posted = seen(post(&s, BOB, Some(sid), &list).await).await;
        let deleted = seen(send(delete(&s, BOB, sid)).await).await;
        for (method, got) in [("GET resume", &resumed), ("GET", &standalone), ("POST", &posted), ("DELETE", &deleted)] {
            assert_eq!(got.0, 404, "bob's {method} with {what} session id: {got:?}");
            assert_eq!(
                (got.1.as_deref(), got.2.as_str()),
                (None, "Not Found: Session not found"),
                "bob's {method} with {what} session id answers as for an unknown session"
            );
        }
    }

    // Bob's DELETE did not end alice's session.
    let ping = json!({ "jsonrpc": "2.0", "id": 4, "method": "ping" });
    let r = post(&s, ALICE, Some(&alice), &ping).await;
    assert_eq!(r.status().as_u16(), 200, "alice's session survived bob's DELETE");
    // Her own DELETE ends it, answered 200 (clients warn on 202), and the id is forgotten.
    let r = send(delete(&s, ALICE, &alice)).await;
    assert_eq!(r.status().as_u16(), 200, "DELETE of one's own session");
    let r = post(&s, ALICE, Some(&alice), &ping).await;
    assert_eq!(r.status().as_u16(), 404, "a deleted session is gone");

    // Session ids are bearer secrets: the log must not carry them.
    assert!(!s.log().contains(&alice), "the server logged alice's MCP session id");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn mcp_sessions_per_principal_are_capped() {
    let s = HttpServer::start_with("http-mcp-cap", &[("PYBERTH_MAX_MCP_SESSIONS_PER_CALLER", "2")], None).await;
    let first = initialize(&s, ALICE).await;
    let _second = initialize(&s, ALICE).await;

    let r = post(&s, ALICE, None, &initialize_request()).await;
    assert_eq!(session_header(&r), None, "a third MCP session was opened past the cap of 2");
    let body = body_within(r, Duration::from_secs(5)).await;
    assert!(body.contains("--max-mcp-sessions-per-caller") && body.contains('2'), "{body}");
    assert!(!body.to_lowercase().contains("bob"), "{body}");
    // A real client shows the reason.
    let config = StreamableHttpClientTransportConfig::with_uri(s.url("/mcp")).auth_header(ALICE);
    let refused = Recorder::default().serve(crate::common::http_transport(config)).await;
    let why = format!("{:#}", refused.err().expect("the client is refused"));
    assert!(why.contains("MCP sessions"), "{why}");

    // The cap is per principal: bob is not affected by alice's sessions.
    let bob = s.client(BOB).await;
    let (r, _) = call(&bob, "list_sessions", json!({})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = bob.cancel().await;

    // Ending a session gives its place back.
    let r = send(delete(&s, ALICE, &first)).await;
    assert!(r.status().is_success(), "DELETE: {}", r.status());
    let _third = initialize(&s, ALICE).await;
    s.stop().await;
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

/// Whether the server closed the connection (EOF or reset) rather than leaving it open.
fn closed_now(stream: &TcpStream) -> bool {
    let mut buf = [0u8; 256];
    match stream.try_read(&mut buf) {
        Ok(_) => true, // EOF, or a response (a refusal) before closing
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn slow_clients_cannot_starve_the_server() {
    // As in the review: 256 file descriptors, and more half-open requests than that.
    let env =
        [("PYBERTH_HEADER_TIMEOUT", "2"), ("PYBERTH_IDLE_TIMEOUT", "5"), ("PYBERTH_MAX_CONNECTIONS_PER_CLIENT", "32")];
    let s = HttpServer::start_with("http-slow", &env, Some(256)).await;
    let target: SocketAddr = format!("127.0.0.1:{}", s.port).parse().expect("addr");

    // 3 attacking addresses (all loopback) × 80 connections, each an unfinished request line.
    let opened = Instant::now();
    let mut attack: Vec<(u8, TcpStream)> = Vec::new();
    'open: for source in 2u8..=4 {
        for _ in 0..80 {
            if opened.elapsed() >= Duration::from_secs(30) {
                break 'open;
            }
            let sock = TcpSocket::new_v4().expect("socket");
            sock.bind(SocketAddr::from(([127, 0, 0, source], 0))).expect("bind a loopback source");
            // 3 s: a busy machine's server may fall behind its accept queue, and a SYN the full
            // queue dropped is sent again after 1 s (seen once in CI under load).
            if let Ok(Ok(mut stream)) = tokio::time::timeout(Duration::from_secs(3), sock.connect(target)).await {
                let _ = stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ").await;
                attack.push((source, stream));
            }
        }
    }
    assert_eq!(attack.len(), 240, "connections opened in {:?}", opened.elapsed());
    // Those past the cap are closed as they are accepted: give a busy server a moment to get
    // to them, less than the header timeout (which would close the rest too).
    let mut open_per_source = [0usize; 5];
    for _ in 0..15 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        open_per_source = [0; 5];
        for (source, stream) in &attack {
            if !closed_now(stream) {
                open_per_source[usize::from(*source)] += 1;
            }
        }
        if open_per_source.iter().all(|&n| n <= 32) {
            break;
        }
    }

    // Meanwhile the server answers everyone else.
    let health =
        tokio::time::timeout(Duration::from_secs(10), crate::common::web().get(s.url("/healthz")).send()).await;
    let health = health.map(|r| r.map(|r| r.status().as_u16()));
    assert!(matches!(health, Ok(Ok(200))), "/healthz under attack: {health:?}");
    let alice = tokio::time::timeout(Duration::from_secs(20), s.client(ALICE)).await.expect("MCP initialize in time");
    let (r, _) = call(&alice, "list_sessions", json!({})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;

    // Past 32 connections from one address the server closed them at once.
    for (source, open) in open_per_source.iter().enumerate().skip(2) {
        assert!(*open <= 32, "127.0.0.{source} holds {open} connections open");
    }
    // The rest are closed once the 2 s header timeout passes.
    let mut still_open = 0;
    for (_, stream) in &mut attack {
        if !closed_within(stream, Duration::from_secs(4)).await {
            still_open += 1;
        }
    }
    assert_eq!(still_open, 0, "half-open requests outlived the header timeout");

    // A request whose body never comes is closed by the idle timeout (5 s).
    let mut stalled = TcpStream::connect(target).await.expect("connect");
    let head = format!(
        "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ALICE}\r\nAccept: {ACCEPT}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
    );
    stalled.write_all(head.as_bytes()).await.expect("write");
    let since = Instant::now();
    assert!(closed_within(&mut stalled, Duration::from_secs(12)).await, "a stalled body held its connection");
    assert!(since.elapsed() >= Duration::from_secs(3), "closed before the idle timeout: {:?}", since.elapsed());

    let health =
        tokio::time::timeout(Duration::from_secs(10), crate::common::web().get(s.url("/healthz")).send()).await;
    assert!(matches!(health, Ok(Ok(ref r)) if r.status().is_success()), "/healthz after the attack");
    s.stop().await;
}

/// One tenant fills its share of sessions: another tenant still opens its own, and the first
/// learns nothing of the second's use. The server-wide ceiling says nothing of who holds it.
#[tokio::test(flavor = "multi_thread")]
async fn one_principal_cannot_use_up_the_sessions_of_another() {
    let env = [("PYBERTH_MAX_SESSIONS", "2"), ("PYBERTH_MAX_SESSIONS_TOTAL", "3")];
    let s = HttpServer::start_with("http-tenants", &env, None).await;
    let alice = s.client(ALICE).await;
    let bob = s.client(BOB).await;
    for name in ["a1", "a2"] {
        let (r, _) = call(&alice, "run_python", json!({ "session": name, "code": "1" })).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
    }
    let (r, _) = call(&alice, "run_python", json!({ "session": "a3", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("you have 2 sessions open"), "{}", text(&r));
    let (r, _) = call(&bob, "run_python", json!({ "session": "b1", "code": "1" })).await;
    assert_eq!(r.is_error, Some(false), "alice's full share leaves bob his: {}", text(&r));
    // The server is now full (3): bob's next is refused without a word about alice.
    let (r, _) = call(&bob, "run_python", json!({ "session": "b2", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true));
    let t = text(&r);
    assert!(t.contains("no room for another session") && !t.contains("alice") && !t.contains('2'), "{t}");
    drop(alice);
    drop(bob);
    s.stop().await;
}

/// A client with a wrong token hears why, through the error its MCP library surfaces, not only
/// in an HTTP body it may never show.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_token_is_explained_in_the_error_a_client_surfaces() {
    let s = HttpServer::start("http-badtoken").await;
    let config =
        StreamableHttpClientTransportConfig::with_uri(s.url("/mcp")).auth_header("wrong-token-0123456789abcdef");
    let transport = crate::common::http_transport(config);
    let refused = Recorder::default().serve(transport).await;
    let e = refused.err().map(|e| format!("{e:#} {e:?}")).unwrap_or_default();
    assert!(e.contains("the token is not valid"), "the reason reaches the client's error: {e}");
    s.stop().await;
}
