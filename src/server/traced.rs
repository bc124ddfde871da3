//! Every MCP request in a span: an exported SERVER span named and attributed by the OpenTelemetry
//! semantic conventions for MCP (`{mcp.method.name} {target}`), and a log span whose
//! `trace_id`/`span_id` join our log lines to the caller's trace (issues 31 and 32).
//!
//! What an attribute may carry is fixed here: the method, the tool's name, the request id, the
//! protocol version, the transport and the outcome. Never arguments, code, output, resource
//! URIs (they hold workspace paths) or the MCP session id (a bearer secret over HTTP).

use std::future::Future;

use opentelemetry::trace::TraceContextExt as _;
use rmcp::ErrorData;
use rmcp::service::{RequestContext, RoleServer};
use tracing::Instrument as _;
use tracing::field::{Empty, display};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::telemetry::{self, TraceParent};

/// Serves one request (`method`, and `tool` for tools/call) inside its spans: `serve` is
/// called inside them, so the spans its work makes are their children. `failed_tool` tells a
/// tool result with `isError: true` (`error.type = tool_error`).
///
/// rmcp's HTTP service takes a `ServerHandler`, whose requests have no common hook: the
/// handlers that do work call this (tools, resources, logging), and `every.rs` calls it for
/// every other request.
pub(super) async fn serve<T, F>(
    method: &str,
    tool: Option<&str>,
    context: &RequestContext<RoleServer>,
    failed_tool: impl Fn(&T) -> bool,
    serve: impl FnOnce() -> F,
) -> Result<T, ErrorData>
where
    F: Future<Output = Result<T, ErrorData>>,
{
    let (span, log) = spans(method, tool, context);
    let served = log.in_scope(serve);
    let result = telemetry::in_request(served.instrument(log)).instrument(span.clone()).await;
    match &result {
        Err(e) => {
            let code = e.code.0.to_string();
            span.record("error.type", code.as_str());
            span.record("rpc.response.status_code", code.as_str());
            span.record("otel.status_code", "error");
        }
        Ok(r) if failed_tool(r) => {
            span.record("error.type", "tool_error");
            span.record("otel.status_code", "error");
        }
        Ok(_) => {}
    }
    result
}

/// The caller's trace context: `params._meta.traceparent` (the MCP way), else the HTTP
/// `traceparent` header. Values that do not validate are ignored, and never logged.
fn caller_context(context: &RequestContext<RoleServer>) -> (Option<TraceParent>, Option<TraceParent>) {
    let from_meta = context.meta.get_traceparent().and_then(TraceParent::parse);
    let from_header = context
        .extensions
        .get::<axum::http::request::Parts>()
        .and_then(|p| p.headers.get("traceparent"))
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    (from_meta, from_header)
}

/// The exported span (target [`telemetry::TARGET`]) and the log span of one request.
fn spans(method: &str, tool: Option<&str>, context: &RequestContext<RoleServer>) -> (tracing::Span, tracing::Span) {
    let name = match tool {
        Some(tool) => format!("{method} {tool}"),
        None => method.to_owned(),
    };
    let over_http = context.extensions.get::<axum::http::request::Parts>().is_some();
    let version = context.protocol_version().map(|v| v.as_str().to_owned());
    let span = tracing::info_span!(
        target: telemetry::TARGET,
        "mcp",
        otel.name = %name,
        otel.kind = "server",
        otel.status_code = Empty,
        mcp.method.name = %method,
        gen_ai.tool.name = tool,
        gen_ai.operation.name = tool.map(|_| "execute_tool"),
        jsonrpc.request.id = %context.id,
        mcp.protocol.version = version,
        network.transport = if over_http { "tcp" } else { "pipe" },
        error.type = Empty,
        rpc.response.status_code = Empty,
    );
    let (from_meta, from_header) = caller_context(context);
    if let Some(parent) = from_meta.or(from_header) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote(&parent)));
    }
    // Per the conventions, an HTTP context other than the _meta one is a link, not the parent.
    if let (Some(_), Some(header)) = (from_meta, from_header)
        && from_meta != Some(header)
    {
        span.add_link(remote(&header));
    }
    // The log span is the exported span's child, so spans made under it find that one.
    // Entering starts the exported span: its parent and link are set by now.
    let log = span.in_scope(|| tracing::info_span!("mcp", method = %method, trace_id = Empty, span_id = Empty));
    // Our span's ids when exporting (the span the logs belong to); else the caller's.
    let ours = span.context().span().span_context().clone();
    if ours.is_valid() {
        log.record("trace_id", display(ours.trace_id()));
        log.record("span_id", display(ours.span_id()));
    } else if let Some(parent) = from_meta.or(from_header) {
        log.record("trace_id", display(parent.trace_hex()));
        log.record("span_id", display(parent.span_hex()));
    }
    (span, log)
}

fn remote(tp: &TraceParent) -> opentelemetry::trace::SpanContext {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    SpanContext::new(
        TraceId::from_bytes(tp.trace_id),
        SpanId::from_bytes(tp.span_id),
        TraceFlags::new(tp.flags),
        true,
        TraceState::NONE,
    )
}
