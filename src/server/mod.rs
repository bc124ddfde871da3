//! The MCP face of pyberth: the tool table. Each tool checks its arguments ([`crate::checks`]),
//! calls the session layer and renders the outcome ([`render`]); no Docker code lives here.
//!
//! - `run.rs`: `run_python`, `install_packages`, `list_packages`;
//! - `sessions.rs`: `list_sessions`, `reset_session`, `close_session`, `list_variables`;
//! - `files.rs`, `transfer.rs`, `jobs.rs`, `envs.rs`: the workspace, archives, jobs, environments;
//! - `snapshots.rs`: snapshots, restore, fork (issue 18);
//! - `habits.rs`: notebook lines (`%pip install`, `!cmd`) and what offline runs are told;
//! - `traced.rs`: each request in spans (the logs' trace ids; OTLP export when on), `every.rs`
//!   the server as the transports serve it, so that every request gets them;
//! - `bridged.rs`: `list_bridged_tools`, the upstream tools code may call (code mode, issue 30);
//! - `tasks.rs`: MCP Tasks (`tasks/get`, `tasks/cancel`) over jobs, for clients that declare them;
//! - `modern.rs`: what MCP 2026-07-28 adds: `session` as `Mcp-Param-Session`, cache hints;
//! - `types.rs` the tools' arguments and results, `render.rs` the results' text (`budget.rs`
//!   its size in characters), `error.rs` the
//!   one way a tool fails, `live.rs` output while a call works, `fit.rs` the message budget.
//!
//! Every failure a caller can cause or fix is a tool result with `isError: true`
//! (docs/design.md D8); JSON-RPC errors are left to rmcp for requests it cannot route or parse.

use std::sync::Arc;

use base64::Engine as _;
use rmcp::ErrorData;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::model::{
    Implementation, ListResourceTemplatesResult, PaginatedRequestParams, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, ResourceContents, ResourceTemplate, ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler, tool_handler};
use tracing::Instrument as _;

use crate::checks::{self, session_name};
use crate::config::SandboxConfig;
use crate::session::registry::Registry;

mod bridged;
mod budget;
mod envs;
mod error;
mod every;
mod files;
pub(crate) mod fit;
mod habits;
mod jobs;
mod live;
mod modern;
mod render;
mod run;
mod sessions;
mod snapshots;
mod tasks;
mod traced;
mod transfer;
mod types;

pub use every::Traced;
pub(crate) use types::*;

/// The MCP server.
#[derive(Clone)]
pub struct SandboxServer {
    registry: Arc<Registry>,
    cfg: Arc<SandboxConfig>,
    /// Log level a pre-2026 client set with logging/setLevel (2026-07-28 requests carry theirs).
    log_level: live::LevelSlot,
    tool_router: ToolRouter<Self>,
}

impl SandboxServer {
    /// A server over a registry.
    pub fn new(registry: Arc<Registry>, cfg: Arc<SandboxConfig>) -> Self {
        let mut tool_router = Self::run_router()
            + Self::sessions_router()
            + Self::files_router()
            + Self::jobs_router()
            + Self::envs_router()
            + Self::transfer_router()
            + Self::snapshots_router()
            + Self::bridged_router();
        if cfg.tools == crate::config::ToolProfile::Core {
            let others: Vec<String> = tool_router
                .list_all()
                .into_iter()
                .map(|t| t.name.into_owned())
                .filter(|n| !CORE_TOOLS.contains(&n.as_str()))
                .collect();
            for name in others {
                tool_router.remove_route(&name);
            }
        }
        modern::mark_session_headers(&mut tool_router);
        Self { registry, cfg, log_level: Arc::default(), tool_router }
    }
}

/// The tools of `--tools core`: what a model needs to run code, install packages and move
/// files, and to read or stop a run that went to the background.
pub const CORE_TOOLS: [&str; 8] = [
    "run_python",
    "install_packages",
    "list_packages",
    "read_file",
    "write_file",
    "list_files",
    "job_status",
    "cancel_job",
];

/// The principal of a caller over stdio: the one local client.
pub(crate) const LOCAL: &str = "local";

/// The principal an HTTP request was authenticated as, put in its extensions by the auth layer.
#[derive(Debug, Clone)]
pub(crate) struct Principal(pub Arc<str>);

/// Who is calling: the principal of the request's token over HTTP, the local client otherwise.
/// Read per request (never per connection), so a session id can't carry one caller's rights
/// to another.
pub(crate) fn principal_of(ctx: &RequestContext<RoleServer>) -> Arc<str> {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .and_then(|p| p.extensions.get::<Principal>())
        .map(|p| p.0.clone())
        .unwrap_or_else(|| LOCAL.into())
}

/// Extractor form of [`principal_of`] for tools that need nothing else of the context.
#[derive(Debug)]
pub(crate) struct Caller(pub Arc<str>);

impl<C: rmcp::handler::server::common::AsRequestContext> rmcp::handler::server::common::FromContextPart<C> for Caller {
    fn from_context_part(context: &mut C) -> Result<Self, ErrorData> {
        Ok(Caller(principal_of(context.as_request_context())))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for SandboxServer {
    /// The tool table, with every result kept within one message a client accepts.
    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        mut context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, ErrorData> {
        let name = request.name.clone();
        let failed = |r: &rmcp::model::CallToolResponse| matches!(r, rmcp::model::CallToolResponse::Complete(r) if r.is_error == Some(true));
        let tasks = tasks::TaskSlot::offer(&mut context);
        let tcc = rmcp::handler::server::tool::ToolCallContext::new(self, request, context.clone());
        let call = || {
            // Every failure of the tool is logged inside this span (error.rs).
            let span = tracing::info_span!("tool", name = %name);
            self.tool_router.call(tcc).instrument(span)
        };
        let response = traced::serve("tools/call", Some(&name), &context, failed, call).await?;
        // A run that went to the background is a task for a client that declared them.
        if let Some(task) = tasks.and_then(|t| t.take()) {
            return Ok(rmcp::model::CallToolResponse::Task(task));
        }
        Ok(match response {
            rmcp::model::CallToolResponse::Complete(r) => {
                rmcp::model::CallToolResponse::Complete(fit::fit(r, fit::BUDGET))
            }
            other => other,
        })
    }

    async fn get_task(
        &self,
        request: rmcp::model::GetTaskParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::GetTaskResult, ErrorData> {
        self.task_get(request, &ctx)
    }

    async fn cancel_task(
        &self,
        request: rmcp::model::CancelTaskParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        self.task_cancel(&request, &ctx);
        Ok(())
    }

    /// The tool table, with cache hints: the same list for every caller (`--tools` aside).
    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, ErrorData> {
        let mut result = rmcp::model::ListToolsResult::with_all_items(self.tool_router.list_all());
        (result.ttl_ms, result.cache_scope) = modern::static_list_hints(&ctx);
        Ok(result)
    }

    fn get_info(&self) -> ServerConfig {
        ServerConfig::new({
            #[allow(deprecated)] // logging: still how pre-2026 clients ask for live output as log messages
            let caps =
                ServerCapabilities::builder().enable_tools().enable_resources().enable_logging().enable_tasks().build();
            caps
        })
        .with_server_info(Implementation::new("pyberth", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "Runs Python in isolated, offline Docker sandboxes. State persists per session \
                 like notebook cells; pass `session` to keep separate workspaces apart.",
        )
    }

    #[allow(deprecated)] // logging/setLevel: how pre-2026 clients ask for log messages
    async fn set_level(
        &self,
        request: rmcp::model::SetLevelRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        traced::serve(
            "logging/setLevel",
            None,
            &ctx,
            |_| false,
            || async {
                live::set_level(&self.log_level, request.level);
                Ok(())
            },
        )
        .await
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        let hinted = || async {
            let mut result = Self::templates();
            (result.ttl_ms, result.cache_scope) = modern::static_list_hints(&ctx);
            Ok(result)
        };
        traced::serve("resources/templates/list", None, &ctx, |_| false, hinted).await
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        traced::serve("resources/read", None, &ctx, |_| false, || self.read_workspace_file(request, &ctx)).await
    }
}

impl SandboxServer {
    /// The one resource template: workspace files.
    fn templates() -> ListResourceTemplatesResult {
        let template = ResourceTemplate::new("pyberth://sessions/{session}/files/{+path}", "workspace-file")
            .with_description("A file in a session's workspace (/workspace); text or binary, at most 8 MiB per read.");
        ListResourceTemplatesResult::with_all_items(vec![template])
    }

    /// `resources/read` of a workspace file.
    async fn read_workspace_file(
        &self,
        request: ReadResourceRequestParams,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let who = principal_of(ctx);
        let uri = request.uri;
        let not_found = |why: String| ErrorData::resource_not_found(why, None);
        let Some((name, path)) = checks::parse_resource_uri(&uri) else {
            return Err(not_found(format!("{uri} is not a pyberth workspace file URI")));
        };
        let name = session_name(Some(&name)).map_err(not_found)?;
        let path = checks::check_path(&path, false).map_err(not_found)?;
        // Another principal's session behaves exactly like a missing one.
        let session = self.registry.get(&who, &name).map_err(|e| not_found(e.to_string()))?;
        let (data, size) = self
            .read_bytes(&session, &path, 0, self.cfg.file_cap as u64)
            .await
            .map_err(|e| not_found(e.to_string()))?;
        if (data.len() as u64) < size {
            return Err(ErrorData::invalid_params(
                format!(
                    "{path} is {size} bytes, over the {} byte limit of a resource read: use read_file with offset",
                    self.cfg.file_cap
                ),
                None,
            ));
        }
        // Text whose escaping would push the message past the budget travels as a blob (4/3).
        let contents = match String::from_utf8(data) {
            Ok(text) if fit::text_fits(&text) => ResourceContents::text(text, uri),
            Ok(text) => ResourceContents::blob(base64::engine::general_purpose::STANDARD.encode(text), uri)
                .with_mime_type("application/octet-stream"),
            Err(e) => ResourceContents::blob(base64::engine::general_purpose::STANDARD.encode(e.into_bytes()), uri)
                .with_mime_type("application/octet-stream"),
        };
        let mut result = ReadResourceResult::new(vec![contents]);
        (result.ttl_ms, result.cache_scope) = modern::private_read_hints(ctx);
        Ok(result.into())
    }
}

impl std::fmt::Debug for SandboxServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxServer").finish_non_exhaustive()
    }
}
