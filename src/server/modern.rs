//! What MCP 2026-07-28 asks of the tool table beyond what rmcp does for us: the `session`
//! argument lifted into an `Mcp-Param-Session` header (`x-mcp-header`), so a router can send
//! a session's calls to the replica that holds it, and cache hints on lists and reads.
//!
//! rmcp checks an `Mcp-Param-*` header against the body itself (a mismatch is a 400 with
//! JSON-RPC error -32020) once the tool's schema carries the annotation, and fills absent
//! cache hints with `ttlMs: 0, cacheScope: private` for 2026 requests.

use std::sync::Arc;

use rmcp::RoleServer;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::model::{CacheScope, ProtocolVersion};
use rmcp::service::RequestContext;
use serde_json::Value;

/// The header name (after `Mcp-Param-`) the `session` argument travels in.
pub(crate) const SESSION_HEADER: &str = "Session";

/// How long a client or intermediary may keep the tool list and the resource templates:
/// they change only when the server restarts with another configuration or version, and a
/// stale list costs a client one "tool not found".
pub(crate) const STATIC_LIST_TTL_MS: u64 = 3_600_000;

/// Whether this request speaks MCP 2026-07-28 or later (per-request `_meta`, no session).
pub(crate) fn is_modern(ctx: &RequestContext<RoleServer>) -> bool {
    ctx.protocol_version().is_some_and(|v| v.as_str() >= ProtocolVersion::V_2026_07_28.as_str())
}

/// Cache hints for a list the same for every caller (tools, templates): public, long-lived.
/// Older peers get none (the fields are not in their revision).
pub(crate) fn static_list_hints(ctx: &RequestContext<RoleServer>) -> (Option<u64>, Option<CacheScope>) {
    if is_modern(ctx) { (Some(STATIC_LIST_TTL_MS), Some(CacheScope::Public)) } else { (None, None) }
}

/// Cache hints for a read of a session's file: one caller's data that changes with every run.
pub(crate) fn private_read_hints(ctx: &RequestContext<RoleServer>) -> (Option<u64>, Option<CacheScope>) {
    if is_modern(ctx) { (Some(0), Some(CacheScope::Private)) } else { (None, None) }
}

/// Marks every tool's `session` argument with `x-mcp-header`. The annotation must sit on a
/// property of a primitive `type` (rmcp's client drops a tool whose annotation is on
/// `["string", "null"]`), so the property becomes a plain string: omitting it still selects
/// the default session, and serde still takes a null.
pub(crate) fn mark_session_headers<S>(router: &mut ToolRouter<S>) {
    for route in router.map.values_mut() {
        let mut schema = (*route.attr.input_schema).clone();
        let Some(Value::Object(session)) = schema.get_mut("properties").and_then(|p| p.get_mut("session")) else {
            continue;
        };
        session.insert("type".into(), Value::String("string".into()));
        session.insert("x-mcp-header".into(), Value::String(SESSION_HEADER.into()));
        route.attr.input_schema = Arc::new(schema);
    }
}
