//! Code mode over https (issue 30): a streamable-HTTP upstream behind TLS, its certificate from
//! a test CA the server is given as its CA bundle. One trusted upstream answers; one whose
//! certificate comes from another CA is refused (listed as unavailable), never called in clear.

use std::sync::Arc;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::model::{ServerCapabilities, ServerConfig};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ServerHandler, tool, tool_handler, tool_router};
use serde_json::json;

use crate::common::{Server, text};
use crate::oauth::TlsSite;

/// An upstream MCP server with one read-only tool.
#[derive(Debug, Clone)]
struct Greeter {
    tool_router: ToolRouter<Self>,
}

#[tool_router]
impl Greeter {
    fn new() -> Self {
        Self { tool_router: Self::tool_router() }
    }

    /// Says it was reached over TLS.
    #[tool(annotations(read_only_hint = true))]
    async fn hello(&self) -> String {
        "hello over tls".into()
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Greeter {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }
}

async fn upstream(tag: &str) -> TlsSite {
    let service = StreamableHttpService::new(
        || Ok(Greeter::new()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    TlsSite::serve(tag, axum::Router::new().nest_service("/mcp", service)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_https_upstream_is_reached_with_the_configured_ca_and_an_untrusted_one_is_not() {
    let trusted = upstream("tls-up").await;
    let stranger = upstream("tls-stranger").await; // its CA is not in the server's bundle
    let dir = std::env::temp_dir().join(format!("pyberth-tls-upstream-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("pyberth.toml");
    let text_ = format!(
        "[upstreams.tls]\nurl = \"https://127.0.0.1:{}/mcp\"\n\n\
         [upstreams.stranger]\nurl = \"https://127.0.0.1:{}/mcp\"\n\n\
         [environments.default]\ntools = [\"tls:*\", \"stranger:*\"]\n",
        trusted.port, stranger.port
    );
    std::fs::write(&config, text_).expect("config");
    let (config, ca) = (config.display().to_string(), trusted.ca_file.display().to_string());
    let s = Server::start("tls-upstream", &[("PYBERTH_CONFIG", &config), ("PYBERTH_CA_BUNDLE", &ca)]).await;
    let code = "import tools\nprint(tools.tls.hello())\nprint(tools.search('hello'))";
    let (r, sc) = s.run_with(json!({ "session": "w", "code": code })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("hello over tls"), "{out}");
    assert!(out.contains("stranger: unavailable"), "a certificate from another CA is refused: {out}");
    let log = s.stop().await;
    assert!(log.contains("upstream stranger: MCP handshake failed"), "the refusal is logged: {log}");
    assert!(!log.contains("upstream tls: MCP handshake failed"), "the trusted upstream started: {log}");
    let _ = std::fs::remove_dir_all(&dir);
}
