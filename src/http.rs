//! The HTTP service: MCP over streamable HTTP at `/mcp` behind bearer tokens, and `/healthz`.
//!
//! Each token names a principal; the principal travels in the request's extensions to the
//! tools, which scope every session and job by it. A server reachable beyond loopback must
//! have tokens: anyone who can reach it could otherwise run code.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use clap::Args;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::config::SandboxConfig;
use crate::docker::image;
use crate::server::{Principal, SandboxServer};
use crate::session::registry::Registry;

/// Principal of the single `PYBERTH_TOKEN`, and of callers of a token-less loopback server.
pub const DEFAULT_PRINCIPAL: &str = "default";
/// Shortest token accepted: shorter ones are guessable.
const MIN_TOKEN_LEN: usize = 16;

/// Options of the HTTP service.
#[derive(Debug, Clone, Default, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpArgs {
    /// Serve MCP over streamable HTTP on this address (e.g. 127.0.0.1:8080) instead of stdio.
    #[arg(long, env = "PYBERTH_HTTP", value_name = "ADDR")]
    pub http: Option<SocketAddr>,

    /// File of `principal:token` lines, one per caller.
    #[arg(long, env = "PYBERTH_TOKENS_FILE", value_name = "FILE")]
    pub tokens_file: Option<PathBuf>,

    /// One token for one caller (principal "default"). Prefer the environment to the flag:
    /// command lines are visible to every user of the machine.
    #[arg(long, env = "PYBERTH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Host names (or host:port) clients may use besides localhost, 127.0.0.1 and ::1; other
    /// Host headers are refused, against DNS rebinding. Comma-separated in the environment.
    #[arg(long = "allowed-host", env = "PYBERTH_ALLOWED_HOSTS", value_delimiter = ',', value_name = "HOST")]
    pub allowed_hosts: Vec<String>,

    /// Largest MCP request body, MiB (file uploads travel inside requests).
    #[arg(long, env = "PYBERTH_MAX_REQUEST_MB", default_value_t = 16)]
    #[serde(default = "default_max_request_mb")]
    pub max_request_mb: usize,
}

fn default_max_request_mb() -> usize {
    16
}

/// The accepted tokens.
#[derive(Debug, Default)]
pub struct Tokens(Vec<(Arc<str>, Vec<u8>)>);

impl Tokens {
    /// Reads the tokens file and/or the single token.
    pub fn load(args: &HttpArgs) -> anyhow::Result<Self> {
        let mut tokens = Vec::new();
        if let Some(path) = &args.tokens_file {
            tokens = parse_tokens_file(path)?;
        }
        if let Some(t) = &args.token {
            check_token(t).context("PYBERTH_TOKEN")?;
            tokens.push((Arc::from(DEFAULT_PRINCIPAL), t.as_bytes().to_vec()));
        }
        Ok(Self(tokens))
    }

    /// Whether no tokens are configured.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The principal a presented token belongs to. Compares every token in full, in time
    /// independent of where they differ.
    fn principal(&self, presented: &[u8]) -> Option<Arc<str>> {
        let mut found = None;
        for (principal, token) in &self.0 {
            let same = token.len() == presented.len()
                && token.iter().zip(presented).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
            if same && found.is_none() {
                found = Some(principal.clone());
            }
        }
        found
    }
}

fn check_token(t: &str) -> anyhow::Result<()> {
    if t.len() < MIN_TOKEN_LEN || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
        bail!("a token must be at least {MIN_TOKEN_LEN} characters without spaces (try: openssl rand -hex 24)");
    }
    Ok(())
}

fn parse_tokens_file(path: &Path) -> anyhow::Result<Vec<(Arc<str>, Vec<u8>)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read the tokens file {}", path.display()))?;
    let mut out: Vec<(Arc<str>, Vec<u8>)> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = || format!("{} line {}", path.display(), n + 1);
        let Some((principal, token)) = line.split_once(':') else {
            bail!("{}: write principal:token", at());
        };
        let principal = principal.trim();
        if principal.is_empty()
            || principal.len() > 64
            || !principal.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            bail!("{}: the principal must be 1-64 letters, digits, '.', '_' or '-'", at());
        }
        let token = token.trim();
        check_token(token).with_context(at)?;
        if out.iter().any(|(_, t)| t == token.as_bytes()) {
            bail!("{}: this token is already given to another principal", at());
        }
        out.push((Arc::from(principal), token.as_bytes().to_vec()));
    }
    if out.is_empty() {
        bail!("the tokens file {} has no tokens", path.display());
    }
    Ok(out)
}

/// Checks the bearer token and records the caller's principal for the tools.
async fn authenticate(tokens: Arc<Tokens>, mut req: Request, next: Next) -> Response {
    if tokens.is_empty() {
        // Loopback only (checked at start): the local user, as over stdio.
        req.extensions_mut().insert(Principal(Arc::from(DEFAULT_PRINCIPAL)));
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    match presented.and_then(|t| tokens.principal(t.as_bytes())) {
        Some(principal) => {
            req.extensions_mut().insert(Principal(principal));
            next.run(req).await
        }
        None => {
            let why = if presented.is_some() { "the token is not valid" } else { "a bearer token is required" };
            let body = serde_json::json!({ "error": format!("{why}: send Authorization: Bearer <token>") });
            let mut resp = (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            resp
        }
    }
}

/// `/healthz`: whether Docker answers and the sandbox image exists.
async fn healthz(registry: Arc<Registry>, cfg: Arc<SandboxConfig>) -> Response {
    let docker = registry.docker();
    let engine = tokio::time::timeout(Duration::from_secs(5), docker.ping()).await.is_ok_and(|r| r.is_ok());
    let tag = match registry.environments.get(None) {
        Ok(env) => env.cfg.image.clone().unwrap_or_else(|| image::tag_for(&env.cfg)),
        Err(_) => cfg.image.clone().unwrap_or_else(image::sandbox_tag),
    };
    let image = engine && image::exists(docker, &tag).await.unwrap_or(false);
    let status = if engine && image { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = serde_json::json!({ "ok": engine && image, "docker": engine, "image": image, "image_tag": tag });
    (status, axum::Json(body)).into_response()
}

/// Serves until `shutdown` fires; the caller then shuts the registry down.
pub async fn serve(
    args: &HttpArgs,
    addr: SocketAddr,
    registry: Arc<Registry>,
    cfg: Arc<SandboxConfig>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let tokens = Arc::new(Tokens::load(args)?);
    if tokens.is_empty() && !addr.ip().is_loopback() {
        bail!(
            "refusing to serve on {addr} without tokens: anyone who can reach it could run code. \
             Set PYBERTH_TOKEN or --tokens-file, or listen on 127.0.0.1"
        );
    }
    let mut hosts: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
    hosts.extend(args.allowed_hosts.iter().cloned());
    let config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(hosts)
        .with_max_request_body_bytes(args.max_request_mb << 20)
        .with_sse_keep_alive(Some(Duration::from_secs(15)))
        .with_cancellation_token(shutdown.child_token());
    let factory_registry = registry.clone();
    let factory_cfg = cfg.clone();
    let mcp = StreamableHttpService::new(
        move || Ok(SandboxServer::new(factory_registry.clone(), factory_cfg.clone())),
        LocalSessionManager::default().into(),
        config,
    );
    let auth_tokens = tokens.clone();
    let app = Router::new()
        .nest_service("/mcp", mcp)
        .layer(middleware::from_fn(move |req: Request, next: Next| authenticate(auth_tokens.clone(), req, next)))
        .route("/healthz", axum::routing::get(move || healthz(registry.clone(), cfg.clone())));
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr().unwrap_or(addr);
    tracing::info!(address = %bound, principals = tokens.0.len(), "serving MCP over HTTP at /mcp");
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .context("the HTTP server failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_file_lines_are_checked_and_name_their_line() {
        let dir = std::env::temp_dir().join(format!("pyberth-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("tokens");
        let write = |text: &str| std::fs::write(&file, text).expect("write");
        write("# team\nalice:aaaaaaaaaaaaaaaaaaaa\n\nbob : bbbbbbbbbbbbbbbbbbbb\n");
        let tokens = parse_tokens_file(&file).expect("valid");
        let t = Tokens(tokens);
        assert_eq!(t.principal(b"bbbbbbbbbbbbbbbbbbbb").as_deref(), Some("bob"));
        assert_eq!(t.principal(b"aaaaaaaaaaaaaaaaaaaa").as_deref(), Some("alice"));
        assert!(t.principal(b"aaaaaaaaaaaaaaaaaaab").is_none());
        assert!(t.principal(b"").is_none());
        for (bad, why) in [
            ("alice\n", "line 1"),
            ("alice:short\n", "line 1"),
            ("a b:cccccccccccccccccccc\n", "line 1"),
            ("x:dddddddddddddddddddd\ny:dddddddddddddddddddd\n", "line 2"),
            ("# nothing\n", "no tokens"),
        ] {
            write(bad);
            let e = format!("{:#}", parse_tokens_file(&file).expect_err(bad));
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
