//! The host side of code mode: one MCP client per configured upstream, started on the first
//! call that needs it and started again after it fails. Its tool list is read once per start
//! and kept. Everything an upstream sends is untrusted: a message longer than the cap closes
//! its connection (stdio, [`LineCap`]; HTTP, the client's SSE event cap), tool lists are
//! bounded, and each call has a time limit. A call's future dropped (the run interrupted or
//! timed out) sends the upstream `notifications/cancelled`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rmcp::model::{CallToolRequestParams, CallToolResponse, PaginatedRequestParams};
use rmcp::service::{Peer, RunningService};
use rmcp::{RoleClient, ServiceExt as _};
use serde_json::Value;
use tokio::io::{AsyncRead, ReadBuf};

use super::spec::{Transport, Upstream};

/// Time an upstream has to start and list its tools.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// After a failed start, calls fail at once for this long rather than start it again.
const RESTART_PAUSE: Duration = Duration::from_secs(2);
/// Most tools kept of one upstream, and most pages of its list read.
const MAX_TOOLS: usize = 1000;
const MAX_PAGES: usize = 20;
/// Longest description kept, bytes; a longer input schema is replaced by an empty one.
const MAX_DESCRIPTION: usize = 4096;
const MAX_SCHEMA: usize = 64 << 10;
/// Room for the envelope of a message beyond the result cap (twice: content and structure).
const ENVELOPE: usize = 64 << 10;

/// One tool of an upstream, as kept.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ToolInfo {
    /// Upstream name.
    pub server: String,
    /// Tool name.
    pub tool: String,
    /// Its description, cut.
    pub description: String,
    /// Its input schema (an object), or `{}`.
    pub input_schema: Value,
    /// Whether its server marks it read-only.
    pub read_only: bool,
}

/// A live connection.
struct Live {
    /// Dropped with the connection; kills a stdio child (`kill_on_drop`).
    service: RunningService<RoleClient, ()>,
    _child: Option<tokio::process::Child>,
    tools: Arc<Vec<ToolInfo>>,
    /// Set when a message over the cap closed the stream.
    oversized: Arc<AtomicBool>,
}

/// The client for streamable-HTTP upstreams: https verified against `ca_bundle` (the system's
/// CAs when `None`), and no redirects: the operator's headers (credentials) go to the URL
/// configured and nowhere a redirect names.
pub fn http_client(ca_bundle: Option<&std::path::Path>) -> Result<reqwest::Client, String> {
    crate::https::builder(ca_bundle)?
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| format!("the HTTPS client for upstreams: {e}"))
}

/// One upstream and its connection, if started.
pub struct Link {
    /// Its settings.
    pub spec: Upstream,
    live: tokio::sync::Mutex<Option<Live>>,
    failed: std::sync::Mutex<Option<(Instant, String)>>,
    /// The HTTP(S) client of a streamable-HTTP upstream.
    client: Option<reqwest::Client>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("spec", &self.spec).finish_non_exhaustive()
    }
}

/// What failed talking to an upstream, in words for the code.
pub type Failure = String;

impl Link {
    /// A link not started yet; `client` reaches a streamable-HTTP upstream (see [`http_client`]).
    pub fn new(spec: Upstream, client: Option<reqwest::Client>) -> Self {
        Self { spec, live: tokio::sync::Mutex::new(None), failed: std::sync::Mutex::new(None), client }
    }

    /// The peer to call and the tool list, starting the upstream if it is not running.
    async fn ensure(&self) -> Result<(Peer<RoleClient>, Arc<Vec<ToolInfo>>, Arc<AtomicBool>), Failure> {
        let mut live = self.live.lock().await;
        if let Some(l) = live.as_ref() {
            if !l.service.is_closed() {
                return Ok((l.service.peer().clone(), l.tools.clone(), l.oversized.clone()));
            }
            tracing::info!(upstream = %self.spec.name, "upstream connection closed; starting it again");
            *live = None;
        }
        if let Some((at, why)) = self.failed.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
            && at.elapsed() < RESTART_PAUSE
        {
            return Err(why.clone());
        }
        match tokio::time::timeout(START_TIMEOUT, self.start()).await {
            Ok(Ok(l)) => {
                let out = (l.service.peer().clone(), l.tools.clone(), l.oversized.clone());
                *live = Some(l);
                Ok(out)
            }
            other => {
                let why = match other {
                    Ok(Err(why)) => why,
                    _ => format!("upstream {} did not start within {} s", self.spec.name, START_TIMEOUT.as_secs()),
                };
                tracing::warn!(upstream = %self.spec.name, %why, "upstream start failed");
                *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), why.clone()));
                Err(why)
            }
        }
    }

    async fn start(&self) -> Result<Live, Failure> {
        let name = &self.spec.name;
        let oversized = Arc::new(AtomicBool::new(false));
        let cap = self.spec.max_result.saturating_mul(2).saturating_add(ENVELOPE);
        let (service, child) = match &self.spec.transport {
            Transport::Stdio { command, args, env } => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(args).env_clear();
                for key in ["PATH", "HOME", "LANG"] {
                    if let Ok(v) = std::env::var(key) {
                        cmd.env(key, v);
                    }
                }
                cmd.envs(env.iter().map(|(k, v)| (k, v)))
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .kill_on_drop(true);
                let mut child = cmd.spawn().map_err(|e| format!("upstream {name}: cannot start {command}: {e}"))?;
                let (Some(stdout), Some(stdin), stderr) =
                    (child.stdout.take(), child.stdin.take(), child.stderr.take())
                else {
                    return Err(format!("upstream {name}: no pipes"));
                };
                if let Some(stderr) = stderr {
                    // Owned by the child: it ends when the child's stderr closes.
                    tokio::spawn(log_stderr(name.clone(), stderr));
                }
                let stdout = LineCap { inner: stdout, cap, line: 0, tripped: oversized.clone() };
                let service =
                    ().serve((stdout, stdin))
                        .await
                        .map_err(|e| format!("upstream {name}: MCP handshake failed: {e}"))?;
                (service, Some(child))
            }
            Transport::Http { url, headers } => {
                use rmcp::transport::StreamableHttpClientTransport;
                use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
                let mut config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
                config.max_sse_event_size = cap;
                for (k, v) in headers {
                    let k = axum::http::HeaderName::try_from(k.as_str())
                        .map_err(|_| format!("upstream {name}: header {k} is not a header name"))?;
                    let v = axum::http::HeaderValue::try_from(v.as_str())
                        .map_err(|_| format!("upstream {name}: header {k} has a value no header may have"))?;
                    config.custom_headers.insert(k, v);
                }
                let Some(client) = self.client.clone() else {
                    return Err(format!("upstream {name}: no HTTP client"));
                };
                let transport = StreamableHttpClientTransport::with_client(client, config);
                let service =
                    ().serve(transport).await.map_err(|e| format!("upstream {name}: MCP handshake failed: {e}"))?;
                (service, None)
            }
        };
        let tools = list_tools(name, service.peer()).await?;
        tracing::info!(upstream = %name, tools = tools.len(), "upstream started");
        Ok(Live { service, _child: child, tools: Arc::new(tools), oversized })
    }

    /// The upstream's tools, starting it if needed.
    pub async fn tools(&self) -> Result<Arc<Vec<ToolInfo>>, Failure> {
        self.ensure().await.map(|(_, t, _)| t)
    }

    /// Calls `tool` with `args`, within the upstream's time limit: the tool's result, or why
    /// there is none. A tool error is `Ok` with `is_error`.
    pub async fn call(&self, tool: &str, args: serde_json::Map<String, Value>) -> Result<Answer, Failure> {
        let (peer, _, oversized) = self.ensure().await?;
        let name = &self.spec.name;
        let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(args);
        let answer = match tokio::time::timeout(self.spec.timeout, peer.call_tool_once(params)).await {
            Err(_) => {
                return Err(format!(
                    "upstream {name} did not answer {tool} within {} s (the call was cancelled)",
                    self.spec.timeout.as_secs()
                ));
            }
            Ok(Err(e)) => {
                if oversized.load(Ordering::Relaxed) {
                    self.drop_live().await;
                    return Err(format!(
                        "upstream {name} sent a message over {} KiB; its connection was closed and starts again on \
                         the next call",
                        self.spec.max_result >> 10
                    ));
                }
                if matches!(e, rmcp::service::ServiceError::McpError(_)) {
                    return Err(format!("upstream {name} refused {tool}: {}", cut(&e.to_string(), 1000)));
                }
                self.drop_live().await;
                return Err(format!(
                    "upstream {name} failed ({}); it starts again on the next call",
                    cut(&e.to_string(), 300)
                ));
            }
            Ok(Ok(CallToolResponse::Complete(r))) => r,
            Ok(Ok(_)) => {
                return Err(format!(
                    "upstream {name} asked for input or a task for {tool}, which code mode does not support"
                ));
            }
        };
        let is_error = answer.is_error.unwrap_or(false);
        let value = match answer.structured_content {
            Some(v) if !is_error => v,
            _ => Value::String(
                answer
                    .content
                    .iter()
                    .filter_map(|c| c.as_text().map(|t| t.text.as_str()))
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
        };
        Ok(Answer { value, is_error })
    }

    async fn drop_live(&self) {
        *self.live.lock().await = None;
    }
}

/// A tool's answer: its structured content, else its text; with its error flag.
#[derive(Debug)]
pub struct Answer {
    /// The value.
    pub value: Value,
    /// The tool reported an error.
    pub is_error: bool,
}

fn cut(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

/// A tool name kept: 1 to 128 ASCII letters, digits, `_` or `-` (a Python attribute, or a
/// name for `tools.call`); nothing that could pass for `server.tool` or a pattern.
fn tool_name(name: &str) -> bool {
    (1..=128).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b))
}

/// An upstream's tool list, bounded.
async fn list_tools(name: &str, peer: &Peer<RoleClient>) -> Result<Vec<ToolInfo>, Failure> {
    let mut tools = Vec::new();
    let mut cursor = None;
    for _ in 0..MAX_PAGES {
        let page = peer
            .list_tools(Some(PaginatedRequestParams::default().with_cursor(cursor)))
            .await
            .map_err(|e| format!("upstream {name}: cannot list its tools: {}", cut(&e.to_string(), 300)))?;
        for t in page.tools {
            if tools.len() >= MAX_TOOLS {
                break;
            }
            if !tool_name(&t.name) {
                tracing::debug!(upstream = %name, "a tool whose name is not a plain name left out");
                continue;
            }
            let schema = Value::Object((*t.input_schema).clone());
            let schema = if serde_json::to_vec(&schema).map_or(usize::MAX, |v| v.len()) <= MAX_SCHEMA {
                schema
            } else {
                Value::Object(serde_json::Map::new())
            };
            let mut description = t.description.as_deref().unwrap_or_default().to_owned();
            if description.len() > MAX_DESCRIPTION {
                let mut end = MAX_DESCRIPTION;
                while !description.is_char_boundary(end) {
                    end -= 1;
                }
                description.truncate(end);
            }
            tools.push(ToolInfo {
                server: name.to_owned(),
                tool: t.name.to_string(),
                description,
                input_schema: schema,
                read_only: t.annotations.as_ref().and_then(|a| a.read_only_hint).unwrap_or(false),
            });
        }
        cursor = page.next_cursor;
        if cursor.is_none() || tools.len() >= MAX_TOOLS {
            break;
        }
    }
    Ok(tools)
}

/// An upstream's stderr, logged at debug, escaped, each line cut, at most 1000 lines.
async fn log_stderr(name: String, stderr: tokio::process::ChildStderr) {
    use tokio::io::AsyncBufReadExt as _;
    let mut lines = tokio::io::BufReader::new(stderr).split(b'\n');
    let mut n = 0u32;
    while let Ok(Some(line)) = lines.next_segment().await {
        n += 1;
        if n <= 1000 {
            let text = String::from_utf8_lossy(&line[..line.len().min(1024)]).into_owned();
            tracing::debug!(upstream = %name, stderr = %text.escape_default(), "upstream stderr");
        }
    }
}

/// A reader that fails once a line passes `cap` bytes: an upstream's message over the cap
/// closes its connection before it is buffered whole.
struct LineCap<R> {
    inner: R,
    cap: usize,
    line: usize,
    tripped: Arc<AtomicBool>,
}

impl<R: AsyncRead + Unpin> AsyncRead for LineCap<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                for &b in &buf.filled()[before..] {
                    if b == b'\n' {
                        this.line = 0;
                    } else {
                        this.line += 1;
                    }
                }
                if this.line > this.cap {
                    this.tripped.store(true, Ordering::Relaxed);
                    // An error read delivers nothing.
                    buf.set_filled(before);
                    return Poll::Ready(Err(std::io::Error::other("upstream message over the cap")));
                }
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

/// Every configured upstream, by name.
#[derive(Debug, Default)]
pub struct Upstreams {
    map: HashMap<String, Arc<Link>>,
}

impl Upstreams {
    /// Links to `upstreams`, none started; `client` reaches those over HTTP(S).
    pub fn new(upstreams: Vec<Upstream>, client: Option<reqwest::Client>) -> Self {
        let link = |u: Upstream| (u.name.clone(), Arc::new(Link::new(u, client.clone())));
        Self { map: upstreams.into_iter().map(link).collect() }
    }

    /// The named upstream.
    pub fn get(&self, name: &str) -> Option<&Arc<Link>> {
        self.map.get(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt as _;

    #[tokio::test]
    async fn a_line_over_the_cap_fails_the_read_and_says_so() {
        let data = b"{\"a\":1}\n".repeat(10);
        let tripped = Arc::new(AtomicBool::new(false));
        let mut ok = LineCap { inner: &data[..], cap: 16, line: 0, tripped: tripped.clone() };
        let mut out = Vec::new();
        ok.read_to_end(&mut out).await.expect("short lines pass");
        assert_eq!(out, data);
        let long = [b'x'; 100];
        let mut bad = LineCap { inner: &long[..], cap: 16, line: 0, tripped: tripped.clone() };
        assert!(bad.read_to_end(&mut Vec::new()).await.is_err());
        assert!(tripped.load(Ordering::Relaxed));
    }
}
