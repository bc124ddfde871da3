//! The HTTP service: MCP over streamable HTTP at `/mcp` behind bearer tokens, and `/healthz`.
//!
//! Each token names a principal; the principal travels in the request's extensions to the
//! tools, which scope every session and job by it. A server reachable beyond loopback must
//! have tokens: anyone who can reach it could otherwise run code.
//!
//! A request to `/mcp` passes, in order: `conn` (a place among the connections, overall and
//! per client address, shared fairly by `admission`; header and idle timeouts), `hosts` (`Host` and `Origin`), `tokens`
//! (the bearer token, to a principal), `sessions` (an MCP session id is honoured only from
//! the principal that opened it; MCP sessions capped per principal), then rmcp.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use clap::Args;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::config::SandboxConfig;
use crate::server::SandboxServer;
use crate::session::registry::Registry;

mod admission;
mod conn;
mod hosts;
mod oauth;
pub mod scrape;
mod sessions;
mod tokens;

pub use tokens::{DEFAULT_PRINCIPAL, Tokens};

/// Marks a response a layer refused before MCP, with why: counted by the outermost layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refused(pub(crate) &'static str);

/// Counts the refusals the layers inside marked.
async fn count_refusals(metrics: Arc<crate::metrics::Metrics>, req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    if let Some(Refused(why)) = resp.extensions().get::<Refused>() {
        metrics.http_refusal(why);
    }
    resp
}

/// Longest wait between keep-alive events on an SSE stream.
const SSE_KEEP_ALIVE: Duration = Duration::from_secs(15);

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
    /// Host headers are refused, against DNS rebinding, and so are browser requests whose Origin
    /// is on another host. Comma-separated in the environment.
    #[arg(long = "allowed-host", env = "PYBERTH_ALLOWED_HOSTS", value_delimiter = ',', value_name = "HOST")]
    pub allowed_hosts: Vec<String>,

    /// Largest MCP request body, MiB (file uploads travel inside requests).
    #[arg(long, env = "PYBERTH_MAX_REQUEST_MB", default_value_t = 16)]
    #[serde(default = "default_max_request_mb")]
    pub max_request_mb: usize,

    /// MCP sessions (HTTP transport sessions, one per connected client) one token may have
    /// open; past it an initialize gets an error naming this flag.
    #[arg(long, env = "PYBERTH_MAX_MCP_SESSIONS_PER_CALLER", default_value_t = 16)]
    #[serde(default = "default_max_mcp_sessions_per_caller")]
    pub max_mcp_sessions_per_caller: usize,

    /// Connections at once; more are closed as they come. Lowered at start if the open-files
    /// limit would not leave room for the server's own files.
    #[arg(long, env = "PYBERTH_MAX_CONNECTIONS", default_value_t = 256)]
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,

    /// Connections at once from one client address (behind a proxy, every client is the
    /// proxy: raise it there).
    #[arg(long, env = "PYBERTH_MAX_CONNECTIONS_PER_CLIENT", default_value_t = 32)]
    #[serde(default = "default_max_connections_per_client")]
    pub max_connections_per_client: usize,

    /// Seconds a client has to send a request's headers, from connecting or from the previous
    /// response; then the connection is closed.
    #[arg(long, env = "PYBERTH_HEADER_TIMEOUT", default_value_t = 10)]
    #[serde(default = "default_header_timeout_s")]
    pub header_timeout_s: u64,

    /// Seconds without a byte moving on a connection before it is closed (streams stay busy
    /// with keep-alive events).
    #[arg(long, env = "PYBERTH_IDLE_TIMEOUT", default_value_t = 60)]
    #[serde(default = "default_idle_timeout_s")]
    pub idle_timeout_s: u64,

    /// OAuth 2.1: the authorization server whose JWT access tokens are accepted, beside any
    /// static tokens (its issuer URL, the `iss` of its tokens). Off when unset.
    #[arg(long, env = "PYBERTH_OAUTH_ISSUER", value_name = "URL")]
    pub oauth_issuer: Option<String>,

    /// OAuth: this server's URL as clients reach it (e.g. https://sandbox.example.com/mcp): the
    /// audience tokens must name (RFC 8707) and the base of its metadata URL.
    #[arg(long, env = "PYBERTH_OAUTH_RESOURCE", value_name = "URL")]
    pub oauth_resource: Option<String>,

    /// OAuth: the issuer's JWKS URL; default: found in the issuer's metadata.
    #[arg(long, env = "PYBERTH_OAUTH_JWKS_URL", value_name = "URL")]
    pub oauth_jwks_url: Option<String>,

    /// OAuth: scopes a token must carry, space-separated (none required when unset).
    #[arg(long, env = "PYBERTH_OAUTH_SCOPE")]
    pub oauth_scope: Option<String>,

    /// OAuth: the claim that names the principal.
    #[arg(long, env = "PYBERTH_OAUTH_PRINCIPAL_CLAIM", default_value = "sub")]
    #[serde(default = "default_oauth_principal_claim")]
    pub oauth_principal_claim: String,

    /// OAuth: signing algorithms accepted (asymmetric only). Comma-separated.
    #[arg(long, env = "PYBERTH_OAUTH_ALGS", value_delimiter = ',', default_values_t = default_oauth_algs())]
    #[serde(default = "default_oauth_algs")]
    pub oauth_algs: Vec<String>,

    /// OAuth: least seconds between two fetches of the issuer's keys, however many tokens
    /// name an unknown key.
    #[arg(long, env = "PYBERTH_OAUTH_JWKS_REFETCH_S", default_value_t = 60)]
    #[serde(default = "default_oauth_jwks_refetch_s")]
    pub oauth_jwks_refetch_s: u64,

    /// OAuth: seconds the issuer's keys are used before they are fetched again (so a removed
    /// key stops working).
    #[arg(long, env = "PYBERTH_OAUTH_JWKS_TTL_S", default_value_t = 600)]
    #[serde(default = "default_oauth_jwks_ttl_s")]
    pub oauth_jwks_ttl_s: u64,

    /// Also serve `/metrics` (Prometheus) on this address, without a token: for stdio servers,
    /// or to keep scrapes off the MCP port. Over HTTP `/metrics` is on the MCP port as well,
    /// behind the bearer tokens (docs/observability.md).
    #[arg(long, env = "PYBERTH_METRICS_ADDR", value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
}

fn default_oauth_principal_claim() -> String {
    "sub".into()
}

fn default_oauth_algs() -> Vec<String> {
    vec!["RS256".into(), "ES256".into()]
}

fn default_oauth_jwks_refetch_s() -> u64 {
    60
}

fn default_oauth_jwks_ttl_s() -> u64 {
    600
}

fn default_max_request_mb() -> usize {
    16
}

fn default_max_mcp_sessions_per_caller() -> usize {
    16
}

fn default_max_connections() -> usize {
    256
}

fn default_max_connections_per_client() -> usize {
    32
}

fn default_header_timeout_s() -> u64 {
    10
}

fn default_idle_timeout_s() -> u64 {
    60
}

/// Why a token or a line of the tokens file is refused.
#[derive(Debug, thiserror::Error)]
pub enum TokenProblem {
    /// Too short, or with spaces or control characters.
    #[error("a token must be at least 16 characters without spaces (try: openssl rand -hex 24)")]
    Weak,
    /// A line without `principal:`.
    #[error("write principal:token")]
    NoColon,
    /// A principal name with characters outside the allowed set.
    #[error("the principal must be 1-64 letters, digits, '.', '_' or '-'")]
    Principal,
    /// The same token twice.
    #[error("this token is already given to another principal")]
    Duplicate,
}

/// Why the HTTP service cannot start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tokens file cannot be read.
    #[error("cannot read the tokens file {}", path.display())]
    ReadTokens {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A line of the tokens file is refused.
    #[error("{} line {line}: {problem}", path.display())]
    TokensLine {
        /// The file.
        path: PathBuf,
        /// Its line, from 1.
        line: usize,
        /// What is wrong with it.
        problem: TokenProblem,
    },
    /// The tokens file has no token.
    #[error("the tokens file {} has no tokens", .0.display())]
    NoTokens(PathBuf),
    /// `PYBERTH_TOKEN` is refused.
    #[error("PYBERTH_TOKEN: {0}")]
    Token(TokenProblem),
    /// No tokens, on an address beyond loopback.
    #[error(
        "refusing to serve on {0} without tokens: anyone who can reach it could run code. \
         Set PYBERTH_TOKEN or --tokens-file, or listen on 127.0.0.1"
    )]
    OpenWithoutTokens(SocketAddr),
    /// An `--allowed-host` that is not `host[:port]`.
    #[error("--allowed-host `{0}` is not a host name or address with an optional :port")]
    AllowedHost(String),
    /// A limit out of its range.
    #[error("--{flag} must be {rule}")]
    Limit {
        /// The flag, without its dashes.
        flag: &'static str,
        /// What it must be.
        rule: &'static str,
    },
    /// An `oauth_*` setting is refused.
    #[error("OAuth: {0}")]
    OAuth(String),
    /// The address cannot be listened on.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// `/healthz`: whether Docker answers and the sandbox image exists.
async fn healthz(registry: Arc<Registry>) -> Response {
    let h = registry.health().await;
    let ok = h.engine && h.image;
    let status = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = serde_json::json!({ "ok": ok, "docker": h.engine, "image": h.image, "image_tag": h.image_tag });
    (status, axum::Json(body)).into_response()
}

/// `GET /`: where things are, for a person or a client pointed at the bare address (no token
/// needed: it says nothing a reader of the README would not know).
async fn root() -> &'static str {
    "pyberth: MCP over streamable HTTP is served at /mcp (send Authorization: Bearer <token>); \
     /healthz says whether the Docker engine answers and the sandbox image is there; /metrics has \
     the Prometheus numbers (with the same token).\n"
}

/// What is settled before the server starts anything: tokens read, limits checked, the address
/// bound. So a refused start (an open address without tokens, a bad tokens file, a port in
/// use) is said before any engine call, as the last thing the server says.
pub struct Listening {
    args: HttpArgs,
    tokens: Arc<Tokens>,
    oauth: Option<Arc<oauth::OAuth>>,
    allowed: Arc<hosts::AllowedHosts>,
    listener: tokio::net::TcpListener,
    bound: SocketAddr,
}

// By hand: the tokens stay out of any debug output.
impl std::fmt::Debug for Listening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listening").field("bound", &self.bound).field("principals", &self.tokens.len()).finish()
    }
}

impl Listening {
    /// Checks `args` and binds `addr`; warns once when a loopback address has no tokens.
    /// `ca_bundle` is what the OAuth key fetches trust (the system's when `None`).
    pub async fn bind(args: &HttpArgs, addr: SocketAddr, ca_bundle: Option<&std::path::Path>) -> Result<Self, Error> {
        let tokens = Arc::new(Tokens::load(args)?);
        let oauth = oauth::OAuth::from_args(args, ca_bundle)?.map(Arc::new);
        if tokens.is_empty() && oauth.is_none() && !addr.ip().is_loopback() {
            return Err(Error::OpenWithoutTokens(addr));
        }
        for (flag, value) in [
            ("max-mcp-sessions-per-caller", args.max_mcp_sessions_per_caller as u64),
            ("max-connections", args.max_connections as u64),
            ("max-connections-per-client", args.max_connections_per_client as u64),
            ("header-timeout-s", args.header_timeout_s),
            ("idle-timeout-s", args.idle_timeout_s),
        ] {
            if value == 0 {
                return Err(Error::Limit { flag, rule: "at least 1" });
            }
        }
        let allowed = Arc::new(hosts::AllowedHosts::new(&args.allowed_hosts)?);
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Listen { addr, source })?;
        let bound = listener.local_addr().unwrap_or(addr);
        if tokens.is_empty() && oauth.is_none() {
            tracing::warn!(
                "no tokens: every local user and process can run code through http://{bound}/mcp; \
                 set PYBERTH_TOKEN or --tokens-file to require one"
            );
        }
        Ok(Self { args: args.clone(), tokens, oauth, allowed, listener, bound })
    }

    /// Serves until `shutdown` fires; the caller then shuts the registry down.
    pub async fn serve(self, registry: Arc<Registry>, cfg: Arc<SandboxConfig>, shutdown: CancellationToken) {
        let args = &self.args;
        let fds = conn::raise_fd_limit();
        let max_connections = conn::connection_cap(args.max_connections, fds);
        if max_connections < args.max_connections {
            tracing::warn!(
                open_files = fds.unwrap_or(u64::MAX),
                "the open-files limit leaves room for {max_connections} connections, not --max-connections {}: \
                 raise the hard limit (ulimit -Hn, LimitNOFILE=)",
                args.max_connections
            );
        }
        let limits = admission::Limits {
            max_connections,
            per_client: args.max_connections_per_client,
            header_timeout: Duration::from_secs(args.header_timeout_s),
            idle_timeout: Duration::from_secs(args.idle_timeout_s),
        };
        let metrics = registry.metrics();
        let app = self.router(registry, cfg, &shutdown);
        tracing::info!(
            address = %self.bound,
            principals = self.tokens.len(),
            oauth = self.oauth.is_some(),
            max_connections,
            per_client = limits.per_client,
            header_timeout_s = args.header_timeout_s,
            idle_timeout_s = args.idle_timeout_s,
            "serving MCP over HTTP at /mcp"
        );
        conn::serve(self.listener, app, limits, metrics, shutdown).await;
    }

    /// `/mcp` behind its checks, `/healthz` and `/` beside them.
    fn router(&self, registry: Arc<Registry>, cfg: Arc<SandboxConfig>, shutdown: &CancellationToken) -> Router {
        let args = &self.args;
        let idle_timeout = Duration::from_secs(args.idle_timeout_s);
        let max_body = args.max_request_mb << 20;
        // rmcp's own Host check stays behind ours, with the same names.
        let mut hosts: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
        hosts.extend(args.allowed_hosts.iter().cloned());
        let config = StreamableHttpServerConfig::default()
            .with_allowed_hosts(hosts)
            .with_max_request_body_bytes(max_body)
            // Keep-alive events keep a quiet stream from looking idle.
            .with_sse_keep_alive(Some(SSE_KEEP_ALIVE.min(idle_timeout / 3)))
            .with_cancellation_token(shutdown.child_token());
        let (factory_registry, factory_cfg) = (registry.clone(), cfg.clone());
        let owners = Arc::new(sessions::Owners::new(args.max_mcp_sessions_per_caller));
        let manager = Arc::new(sessions::Bound::new(owners.clone()));
        let mcp = StreamableHttpService::new(
            move || Ok(SandboxServer::new(factory_registry.clone(), factory_cfg.clone()).traced()),
            manager.clone(),
            config,
        );
        let auth = Arc::new(tokens::Auth { tokens: self.tokens.clone(), oauth: self.oauth.clone() });
        let allowed = self.allowed.clone();
        let audit = registry.audit_log();
        let (scraped, metrics) = (registry.clone(), registry.metrics());
        let router = Router::new()
            .nest_service("/mcp", mcp)
            // Behind the tokens, as /mcp: any principal's token reads the server's numbers.
            .route("/metrics", axum::routing::get(move || scrape::scrape(scraped.clone())))
            // Innermost: needs the principal the token layer found.
            .layer(middleware::from_fn(move |req: Request, next: Next| {
                sessions::bind(owners.clone(), manager.clone(), max_body, req, next)
            }))
            .layer(middleware::from_fn(move |req: Request, next: Next| {
                tokens::authenticate(auth.clone(), audit.clone(), req, next)
            }))
            // Outermost: a request from elsewhere is refused before its token is looked at.
            .layer(middleware::from_fn(move |req: Request, next: Next| hosts::check(allowed.clone(), req, next)))
            .layer(middleware::from_fn(move |req: Request, next: Next| count_refusals(metrics.clone(), req, next)))
            .route("/healthz", axum::routing::get(move || healthz(registry.clone())))
            .route("/", axum::routing::get(root));
        self.with_metadata(router)
    }

    /// The Protected Resource Metadata (RFC 9728), when OAuth is on: at the well-known path
    /// and at it followed by the resource's path, without a token (clients read it to learn
    /// where to get one).
    fn with_metadata(&self, router: Router) -> Router {
        let Some(oauth) = &self.oauth else { return router };
        let doc = oauth.metadata();
        let serve = move || {
            let doc = doc.clone();
            async move {
                // Public data, read by browser-based clients from other origins too.
                ([(axum::http::header::ACCESS_CONTROL_ALLOW_ORIGIN, "*")], axum::Json(doc))
            }
        };
        let mut router = router.route(oauth::PRM_PATH, axum::routing::get(serve.clone()));
        if let Some(path) = oauth.metadata_path() {
            router = router.route(&path, axum::routing::get(serve));
        }
        router
    }
}
