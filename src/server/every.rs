//! A SERVER span for every MCP request, not only for the handlers we wrote (issue 32):
//! [`Traced`] is the [`SandboxServer`] as the transports serve it.
//!
//! rmcp's HTTP service takes a `ServerHandler` (not any `Service`), so the wrapper is a
//! handler that forwards every method to the server's own. Requests whose handler traces
//! itself (tools/call with its tool's name, resources, logging/setLevel) are forwarded as they
//! are, so no request gets two spans; every other one (initialize, server/discover, ping,
//! tools/list, tasks/*, and what we answer with rmcp's defaults) is served inside
//! [`traced::serve`]. Notifications are not requests and get no span.

use std::borrow::Cow;

#[allow(deprecated)] // logging/setLevel: still forwarded for pre-2026 clients
use rmcp::model::SetLevelRequestParams;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, CancelledNotificationParam, CompleteRequestParams,
    CompleteResult, CustomNotification, CustomRequest, CustomResult, DiscoverResult, GetPromptRequestParams,
    GetPromptResponse, GetSkillRequestParams, GetSkillResult, GetTaskParams, GetTaskResult, InitializeRequestParams,
    InitializeResult, ListPromptsResult, ListResourceTemplatesResult, ListResourcesResult, ListSkillsResult,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ProtocolVersion,
    ReadResourceDirectoryRequestParams, ReadResourceDirectoryResult, ReadResourceRequestParams, ReadResourceResponse,
    ServerConfig, SubscribeRequestParams, SubscriptionFilter, Tool, UnsubscribeRequestParams, UpdateTaskParams,
};
use rmcp::service::{NotificationContext, RequestContext, SubscriptionContext};
use rmcp::{ErrorData, RoleServer, ServerHandler};

use super::{SandboxServer, traced};

/// The server with a SERVER span for every request: what `serve` hands the transports.
#[derive(Debug, Clone)]
pub struct Traced(SandboxServer);

impl SandboxServer {
    /// This server, every request of it traced.
    pub fn traced(self) -> Traced {
        Traced(self)
    }
}

/// A request's handler, served inside its spans: `$method` is the JSON-RPC method.
macro_rules! traced {
    ($method:literal, $name:ident($($arg:ident: $ty:ty),*) -> $out:ty) => {
        async fn $name(&self, $($arg: $ty,)* context: RequestContext<RoleServer>) -> Result<$out, ErrorData> {
            let cx = context.clone();
            traced::serve($method, None, &cx, |_| false, || self.0.$name($($arg,)* context)).await
        }
    };
}

/// A handler forwarded as it is (it traces itself, or it is not a request).
macro_rules! forward {
    ($name:ident($($arg:ident: $ty:ty),*) -> $out:ty) => {
        async fn $name(&self, $($arg: $ty),*) -> $out {
            self.0.$name($($arg),*).await
        }
    };
}

/// A custom method's name as a span may carry it: the client chose it, so anything odd or long
/// is `other` (span names stay a small set of plain words).
fn custom_method(method: &str) -> &str {
    let plain = |c: char| c.is_ascii_alphanumeric() || "/_.-".contains(c);
    if !method.is_empty() && method.len() <= 64 && method.chars().all(plain) { method } else { "other" }
}

#[allow(deprecated)] // resources/subscribe, unsubscribe: legacy requests, still forwarded
impl ServerHandler for Traced {
    traced!("ping", ping() -> ());
    traced!("initialize", initialize(request: InitializeRequestParams) -> InitializeResult);
    traced!("server/discover", discover() -> DiscoverResult);
    traced!("completion/complete", complete(request: CompleteRequestParams) -> CompleteResult);
    traced!("prompts/get", get_prompt(request: GetPromptRequestParams) -> GetPromptResponse);
    traced!("prompts/list", list_prompts(request: Option<PaginatedRequestParams>) -> ListPromptsResult);
    traced!("resources/list", list_resources(request: Option<PaginatedRequestParams>) -> ListResourcesResult);
    traced!("resources/subscribe", subscribe(request: SubscribeRequestParams) -> ());
    traced!("resources/unsubscribe", unsubscribe(request: UnsubscribeRequestParams) -> ());
    traced!("tools/list", list_tools(request: Option<PaginatedRequestParams>) -> ListToolsResult);
    traced!("tasks/get", get_task(request: GetTaskParams) -> GetTaskResult);
    traced!("tasks/update", update_task(request: UpdateTaskParams) -> ());
    traced!("tasks/cancel", cancel_task(request: CancelTaskParams) -> ());
    traced!("skills/list", list_skills(request: Option<PaginatedRequestParams>) -> ListSkillsResult);
    traced!("skills/get", get_skill(request: GetSkillRequestParams) -> GetSkillResult);
    traced!(
        "resources/directory/read",
        read_resource_directory(request: ReadResourceDirectoryRequestParams) -> ReadResourceDirectoryResult
    );

    async fn on_custom_request(
        &self,
        request: CustomRequest,
        context: RequestContext<RoleServer>,
    ) -> Result<CustomResult, ErrorData> {
        let (cx, method) = (context.clone(), request.method.clone());
        traced::serve(custom_method(&method), None, &cx, |_| false, || self.0.on_custom_request(request, context)).await
    }

    // Traced inside their handlers (src/server/mod.rs).
    forward!(call_tool(request: CallToolRequestParams, context: RequestContext<RoleServer>) -> Result<CallToolResponse, ErrorData>);
    forward!(set_level(request: SetLevelRequestParams, context: RequestContext<RoleServer>) -> Result<(), ErrorData>);
    forward!(list_resource_templates(request: Option<PaginatedRequestParams>, context: RequestContext<RoleServer>) -> Result<ListResourceTemplatesResult, ErrorData>);
    forward!(read_resource(request: ReadResourceRequestParams, context: RequestContext<RoleServer>) -> Result<ReadResourceResponse, ErrorData>);
    // Not requests: a subscription's stream (we accept none) and notifications.
    forward!(listen(context: SubscriptionContext) -> Result<(), ErrorData>);
    forward!(on_cancelled(notification: CancelledNotificationParam, context: NotificationContext<RoleServer>) -> ());
    forward!(on_progress(notification: ProgressNotificationParam, context: NotificationContext<RoleServer>) -> ());
    forward!(on_initialized(context: NotificationContext<RoleServer>) -> ());
    forward!(on_roots_list_changed(context: NotificationContext<RoleServer>) -> ());
    forward!(on_custom_notification(notification: CustomNotification, context: NotificationContext<RoleServer>) -> ());

    fn negotiate_initialize(&self, request: &InitializeRequestParams) -> Result<InitializeResult, ErrorData> {
        self.0.negotiate_initialize(request)
    }
    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        self.0.supported_protocol_versions()
    }
    fn accepted_subscription_filter(&self, requested: &SubscriptionFilter) -> Option<SubscriptionFilter> {
        self.0.accepted_subscription_filter(requested)
    }
    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.0.get_tool(name)
    }
    fn get_info(&self) -> ServerConfig {
        self.0.get_info()
    }
}

#[cfg(test)]
mod tests {
    use super::custom_method;

    #[test]
    fn a_custom_method_is_named_only_when_plain() {
        assert_eq!(custom_method("vendor/thing.do"), "vendor/thing.do");
        assert_eq!(custom_method("evil\nINFO forged"), "other");
        assert_eq!(custom_method(&"a".repeat(65)), "other");
        assert_eq!(custom_method(""), "other");
    }
}
