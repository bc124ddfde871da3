//! Traces (issue 32 item 2) and trace context in the logs (issue 31 item 4): the real binary,
//! driven by the real rmcp client over stdio, exports to an OTLP/HTTP receiver of the test's
//! own on loopback, decoded with the official OpenTelemetry protobufs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use prost::Message as _;
use rmcp::ClientLifecycleMode;
use rmcp::model::{
    CallToolRequestParams, ProtocolVersion, ReadResourceRequestParams, RequestMetaObject, RequestParamsMeta as _,
};
use serde_json::{Value, json};

use crate::common::{Server, text};

/// A traceparent a client would send: its trace, its span, sampled.
struct Caller {
    trace: String,
    span: String,
}

impl Caller {
    fn new(seed: u8) -> Caller {
        let n = std::process::id();
        Caller { trace: format!("{n:08x}{seed:02x}c0ffee0000000000000001"), span: format!("{seed:02x}5eed{n:08x}01") }
    }

    fn traceparent(&self) -> String {
        format!("00-{}-{}-01", self.trace, self.span)
    }
}

/// The receiver: every body POSTed to /v1/traces, raw.
#[derive(Clone, Default)]
struct Collector {
    bodies: Arc<Mutex<Vec<Bytes>>>,
}

impl Collector {
    async fn start() -> (Collector, String, tokio::task::JoinHandle<()>) {
        let collector = Collector::default();
        let bodies = collector.bodies.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: Bytes| {
                let bodies = bodies.clone();
                async move {
                    bodies.lock().expect("collector lock").push(body);
                    // An empty ExportTraceServiceResponse.
                    ([(axum::http::header::CONTENT_TYPE, "application/x-protobuf")], Vec::<u8>::new())
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the OTLP receiver");
        let url = format!("http://{}", listener.local_addr().expect("receiver address"));
        let serving = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        (collector, url, serving)
    }

    fn raw(&self) -> Vec<u8> {
        self.bodies.lock().expect("collector lock").iter().flat_map(|b| b.to_vec()).collect()
    }

    fn spans(&self) -> Vec<Span> {
        let bodies = self.bodies.lock().expect("collector lock").clone();
        let mut spans = Vec::new();
        for body in bodies {
            let req = ExportTraceServiceRequest::decode(body).expect("an ExportTraceServiceRequest");
            for rs in req.resource_spans {
                let service = rs
                    .resource
                    .iter()
                    .flat_map(|r| r.attributes.iter())
                    .find(|kv| kv.key == "service.name")
                    .and_then(|kv| kv.value.as_ref())
                    .and_then(|v| v.value.clone());
                assert_eq!(service, Some(Any::StringValue("pyberth".into())), "the resource names the service");
                spans.extend(rs.scope_spans.into_iter().flat_map(|s| s.spans));
            }
        }
        spans
    }
}

fn attrs(span: &Span) -> HashMap<String, String> {
    span.attributes
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.clone()) {
                Some(Any::StringValue(s)) => s,
                Some(Any::IntValue(i)) => i.to_string(),
                Some(Any::BoolValue(b)) => b.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

async fn call_traced(
    server: &Server,
    tool: &'static str,
    args: Value,
    traceparent: &str,
) -> rmcp::model::CallToolResult {
    let mut params = CallToolRequestParams::new(tool).with_arguments(args.as_object().expect("object").clone());
    let mut meta = RequestMetaObject::new();
    meta.set_traceparent(traceparent);
    params.set_meta(meta);
    server.client().call_tool(params).await.expect("no protocol error")
}

/// One span per request, named, kinded and parented as the MCP semantic conventions say,
/// with child spans for the engine work, and nothing of the code or its output in any byte.
#[tokio::test]
async fn spans_follow_the_mcp_conventions_and_carry_no_code_or_output() {
    let (collector, url, receiver) = Collector::start().await;
    let server = Server::start("otel", &[("PYBERTH_OTLP_ENDPOINT", url.as_str())]).await;
    let marker = format!("OTELMARK{}x", std::process::id());
    let (ok, failing) = (Caller::new(1), Caller::new(2));

    // The marker is in the code, its output and its error: none may be exported.
    let code = format!("secret = '{marker}-code'\nprint(secret.replace('code', 'out'))");
    let r = call_traced(&server, "run_python", json!({"session": "o", "code": code}), &ok.traceparent()).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert!(text(&r).contains(&format!("{marker}-out")));
    let bad = format!("raise ValueError('{marker}-err')");
    let r = call_traced(&server, "run_python", json!({"session": "o", "code": bad}), &failing.traceparent()).await;
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    let r = call_traced(&server, "snapshot_session", json!({"session": "o", "name": "s1"}), &ok.traceparent()).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    // A protocol error: error.type is the JSON-RPC code; the URI (an argument) is not exported.
    let uri = format!("pyberth://sessions/o/files/{marker}.txt");
    let read = server.client().read_resource(ReadResourceRequestParams::new(uri)).await;
    assert!(read.is_err(), "a missing file is a resource error");
    // A bad traceparent is ignored: the request gets a trace of its own.
    let _ = call_traced(&server, "list_files", json!({"session": "o"}), "00-ZZ-not-a-trace-01").await;

    let log = server.stop().await;
    let spans = collector.spans();
    receiver.abort();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();

    let servers: Vec<&Span> = spans.iter().filter(|s| s.name == "tools/call run_python").collect();
    assert_eq!(servers.len(), 2, "one server span per tools/call: {names:?}");
    let ran = servers.iter().find(|s| hex(&s.trace_id) == ok.trace).expect("the successful call's span");
    let failed = servers.iter().find(|s| hex(&s.trace_id) == failing.trace).expect("the failed call's span");
    for (span, caller) in [(ran, &ok), (failed, &failing)] {
        assert_eq!(span.kind, SpanKind::Server as i32);
        assert_eq!(hex(&span.parent_span_id), caller.span, "the client's span is the parent");
        let a = attrs(span);
        assert_eq!(a.get("mcp.method.name").map(String::as_str), Some("tools/call"));
        assert_eq!(a.get("gen_ai.tool.name").map(String::as_str), Some("run_python"));
        assert_eq!(a.get("gen_ai.operation.name").map(String::as_str), Some("execute_tool"));
        assert_eq!(a.get("network.transport").map(String::as_str), Some("pipe"));
        assert!(a.get("jsonrpc.request.id").is_some_and(|id| id.parse::<u64>().is_ok()), "{a:?}");
        assert!(a.get("mcp.protocol.version").is_some_and(|v| v.starts_with("20")), "{a:?}");
        assert!(!a.contains_key("mcp.session.id"), "the MCP session id is a bearer secret over HTTP");
    }
    assert_eq!(attrs(ran).get("error.type"), None);
    assert_eq!(attrs(failed).get("error.type").map(String::as_str), Some("tool_error"));
    assert_eq!(failed.status.as_ref().map(|s| s.code), Some(StatusCode::Error as i32));

    // Child spans: opening the session (with the container create under it) and the run.
    let child_of = |parent: &Span, name: &str| {
        spans.iter().find(|s| s.name == name && s.parent_span_id == parent.span_id).cloned()
    };
    let open = child_of(ran, "session open").unwrap_or_else(|| panic!("session open under the call: {names:?}"));
    assert_eq!(open.kind, SpanKind::Internal as i32);
    let run = child_of(ran, "run").unwrap_or_else(|| panic!("run under the call: {names:?}"));
    assert_eq!(run.kind, SpanKind::Internal as i32);
    let in_trace: Vec<&Span> = spans.iter().filter(|s| s.trace_id == ran.trace_id).collect();
    let create = in_trace
        .iter()
        .find(|s| s.name == "docker create_container")
        .unwrap_or_else(|| panic!("the container create in the call's trace: {names:?}"));
    assert_eq!(create.kind, SpanKind::Client as i32);
    assert!(in_trace.iter().any(|s| s.span_id == create.parent_span_id), "the create hangs in the call's tree");

    let snap = spans.iter().find(|s| s.name == "tools/call snapshot_session").expect("the snapshot call");
    assert_eq!(snap.trace_id, ran.trace_id, "same client trace");
    assert!(child_of(snap, "snapshot save").is_some(), "snapshot save under its call: {names:?}");

    let read = spans.iter().find(|s| s.name == "resources/read").expect("the resources/read span");
    let a = attrs(read);
    assert_eq!(a.get("error.type").map(String::as_str), Some("-32002"), "{a:?}");
    assert_eq!(a.get("rpc.response.status_code").map(String::as_str), Some("-32002"));

    let listed = spans.iter().find(|s| s.name == "tools/call list_files").expect("the list_files span");
    assert!(listed.parent_span_id.is_empty(), "a bad traceparent gives no parent");

    let raw = collector.raw();
    let leaked = raw.windows(marker.len()).any(|w| w == marker.as_bytes());
    assert!(!leaked, "the code's, output's or URI's marker reached the collector");
    assert!(!raw.windows(6).any(|w| w == b"ZZ-not"), "a bad traceparent is never exported");
    // The log lines of the call carry the trace the client sent.
    assert!(log.contains(&format!("trace_id={}", ok.trace)), "the log joins the client's trace");
}

/// Every request gets its SERVER span, not only the handlers pyberth wrote: the opening
/// request (`initialize` from a 2025 client, `server/discover` from a 2026 one) and
/// `tools/list`, answered by rmcp's own code; and still one span, not two, per tool call.
#[tokio::test]
async fn every_request_gets_one_server_span_in_both_generations() {
    let modern = ClientLifecycleMode::Discover { preferred_versions: vec![ProtocolVersion::V_2026_07_28] };
    for (lifecycle, opening) in [(ClientLifecycleMode::Initialize, "initialize"), (modern, "server/discover")] {
        let (collector, url, receiver) = Collector::start().await;
        let env = [("PYBERTH_OTLP_ENDPOINT", url.as_str())];
        let server = Server::start_with_lifecycle("otel-every", &env, lifecycle).await;
        let tools = server.client().list_all_tools().await.expect("tools/list");
        assert!(tools.iter().any(|t| t.name == "run_python"));
        let r = server
            .client()
            .call_tool(CallToolRequestParams::new("list_sessions").with_arguments(serde_json::Map::new()));
        let r = r.await.expect("a tool result");
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        server.stop().await;
        let spans = collector.spans();
        receiver.abort();
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        for method in [opening, "tools/list"] {
            let found: Vec<&Span> = spans.iter().filter(|s| s.name == method).collect();
            assert_eq!(found.len(), 1, "one {method} span: {names:?}");
            assert_eq!(found[0].kind, SpanKind::Server as i32, "{method}");
            let a = attrs(found[0]);
            assert_eq!(a.get("mcp.method.name").map(String::as_str), Some(method), "{a:?}");
            assert_eq!(a.get("network.transport").map(String::as_str), Some("pipe"));
            assert_eq!(a.get("error.type"), None, "{method} answered: {a:?}");
        }
        let calls = spans.iter().filter(|s| attrs(s).get("mcp.method.name").map(String::as_str) == Some("tools/call"));
        let calls: Vec<&str> = calls.map(|s| s.name.as_str()).collect();
        assert_eq!(calls, ["tools/call list_sessions"], "one span per tool call, with its tool's name");
    }
}

/// Without export, a valid traceparent still reaches the call's log lines (trace and the
/// caller's span); a forged one (a log line injected through it) reaches nothing.
#[tokio::test]
async fn the_logs_of_a_call_carry_its_trace_context_and_nothing_forged() {
    let server = Server::start("otel-log", &[]).await;
    let caller = Caller::new(3);
    let r =
        call_traced(&server, "run_python", json!({"session": "l", "code": "print(1)"}), &caller.traceparent()).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let forged = format!("00-{}-{}-01\nFORGED-LOG-LINE", caller.trace, caller.span);
    let r = call_traced(&server, "run_python", json!({"session": "l", "code": "print(2)"}), &forged).await;
    assert_eq!(r.is_error, Some(false), "a bad traceparent is ignored, never an error: {}", text(&r));
    let log = server.stop().await;
    let tagged = format!("trace_id={} span_id={}", caller.trace, caller.span);
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(&tagged)).collect();
    assert!(!lines.is_empty(), "no log line of the call carries its trace context");
    assert!(!log.contains("FORGED-LOG-LINE"), "a forged traceparent reached the log");
}

/// Over HTTP: the `traceparent` header is the parent when `_meta` has none; when both come and
/// differ, `_meta`'s is the parent and the header's a link; the spans still queued at SIGTERM
/// reach the collector.
#[tokio::test(flavor = "multi_thread")]
async fn over_http_the_header_is_the_fallback_parent_and_a_link_beside_meta() {
    use crate::http::{ALICE, HttpServer};
    use rmcp::ServiceExt as _;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;

    let (collector, url, receiver) = Collector::start().await;
    let server = HttpServer::start_with("otel-http", &[("PYBERTH_OTLP_ENDPOINT", url.as_str())], None).await;
    let (header, meta) = (Caller::new(4), Caller::new(5));
    let headers = HashMap::from([(
        axum::http::HeaderName::from_static("traceparent"),
        axum::http::HeaderValue::from_str(&header.traceparent()).expect("header value"),
    )]);
    let config =
        StreamableHttpClientTransportConfig::with_uri(server.url("/mcp")).auth_header(ALICE).custom_headers(headers);
    let client = crate::common::Recorder::default()
        .serve(crate::common::http_transport(config))
        .await
        .expect("MCP initialise over HTTP");
    let args = json!({"session": "h"}).as_object().expect("object").clone();
    let r = client.call_tool(CallToolRequestParams::new("list_files").with_arguments(args.clone())).await;
    r.expect("no protocol error");
    let mut params = CallToolRequestParams::new("list_variables").with_arguments(args);
    let mut m = RequestMetaObject::new();
    m.set_traceparent(meta.traceparent());
    params.set_meta(m);
    client.call_tool(params).await.expect("no protocol error");
    drop(client);
    server.stop().await;
    let spans = collector.spans();
    receiver.abort();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();

    let listed = spans.iter().find(|s| s.name == "tools/call list_files").unwrap_or_else(|| panic!("{names:?}"));
    assert_eq!(hex(&listed.trace_id), header.trace, "the header's trace, without _meta");
    assert_eq!(hex(&listed.parent_span_id), header.span);
    assert_eq!(attrs(listed).get("network.transport").map(String::as_str), Some("tcp"));
    let vars = spans.iter().find(|s| s.name == "tools/call list_variables").unwrap_or_else(|| panic!("{names:?}"));
    assert_eq!(hex(&vars.trace_id), meta.trace, "_meta's trace wins");
    assert_eq!(hex(&vars.parent_span_id), meta.span);
    let links: Vec<(String, String)> = vars.links.iter().map(|l| (hex(&l.trace_id), hex(&l.span_id))).collect();
    assert_eq!(links, vec![(header.trace.clone(), header.span.clone())], "the header's context is a link");
}

/// A collector that is down costs spans, never calls: each run succeeds, the loss is counted
/// and logged once (not once per batch or span), and the server stops on time.
#[tokio::test]
async fn a_collector_that_is_down_costs_spans_not_calls() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let url = format!("http://127.0.0.1:{port}");
    let server = Server::start("otel-down", &[("PYBERTH_OTLP_ENDPOINT", url.as_str())]).await;
    let caller = Caller::new(6);
    for i in 0..5 {
        let code = format!("print({i})");
        let r = call_traced(&server, "run_python", json!({"session": "d", "code": code}), &caller.traceparent()).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
    }
    let log = server.stop().await;
    let failures = log.lines().filter(|l| l.contains("OTLP export failed")).count();
    assert_eq!(failures, 1, "one report of the loss, whatever the number of batches");
    assert!(log.contains("dropped_spans="), "the loss is counted");
}
