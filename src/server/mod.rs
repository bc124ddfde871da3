//! The MCP face of pyberth: the tool table. Each tool validates its arguments, calls the
//! session layer and renders the outcome; no Docker code lives here.
//!
//! Every failure a caller can cause or fix is a tool result with `isError: true` (DESIGN.md
//! D8); JSON-RPC errors are left to rmcp for requests it cannot route or parse.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use rmcp::ErrorData;
use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, ContentBlock, Implementation, ListResourceTemplatesResult, PaginatedRequestParams,
    ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, ResourceContents, ResourceTemplate,
    ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler, tool, tool_handler, tool_router};
use serde::{Deserialize, Serialize};

use crate::config::SandboxConfig;
mod envs;
mod files;
mod fit;
mod jobs;
mod live;
mod transfer;

use std::collections::BTreeMap;

use crate::deps;
use crate::protocol::{Package, PyError, Variable};
use crate::session::jobs::JobSpec;
use crate::session::registry::Registry;
use crate::session::{RunOutcome, RunStatus, SessionInfo};
use crate::workspace;
use jobs::check_wait;
use live::{live_channel, relay};

/// The session used when a call names none.
pub const DEFAULT_SESSION: &str = "default";

/// Arguments of `run_python`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunPythonArgs {
    /// Python source to run. Statements run in the session's persistent namespace; if the
    /// last statement is an expression, its repr is returned as `result`, as in a REPL.
    pub code: String,
    /// Session name (1-40 letters, digits, '.', '_', '-'). Omit to use the default session.
    /// A new name creates a new, isolated session.
    #[serde(default)]
    pub session: Option<String>,
    /// Time limit in seconds for this run (default 60). On expiry the code gets a
    /// KeyboardInterrupt; if it does not stop within a second, its processes are killed and
    /// the interpreter restarts (variables lost).
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Packages the code needs, as requirement strings ("numpy", "requests>=2.31"); installed
    /// before the code runs, a no-op when the session already has them. PEP 723 inline
    /// metadata (`# /// script` ... `dependencies = [...]`) in the code is honoured too.
    #[serde(default)]
    pub packages: Option<Vec<String>>,
    /// Also save the code as this workspace file (relative path) before running it.
    #[serde(default)]
    pub save_as: Option<String>,
    /// Environment variables for this run only.
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
    /// Environment variables to set for this and every later run of the session.
    #[serde(default)]
    pub session_env: Option<BTreeMap<String, String>>,
    /// `.env`-format text (KEY=VALUE lines) for this run. Precedence, later wins:
    /// session_env, then env_file, then env.
    #[serde(default)]
    pub env_file: Option<String>,
    /// Wait at most this many seconds; if the run is still going then, return a job handle
    /// with the output so far (status "running") and let it continue. Read it later with
    /// job_status, stop it with cancel_job.
    #[serde(default)]
    pub wait_s: Option<f64>,
    /// Start the run as a background job and return its handle at once.
    #[serde(default)]
    pub background: bool,
    /// Environment (Python version, preinstalled packages, data folders) for a new session;
    /// omit for the default. list_environments shows them. A session keeps its environment.
    #[serde(default)]
    pub environment: Option<String>,
}

/// Arguments of `install_packages`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InstallArgs {
    /// Requirement strings: a name, optional [extras], optional version constraints and an
    /// optional marker ("pandas", "requests[socks]>=2.31,<3"). No URLs, paths or options.
    pub packages: Vec<String>,
    /// Session name. Omit for the default session; a new name creates the session.
    #[serde(default)]
    pub session: Option<String>,
    /// Environment for a new session (list_environments shows them); an existing session
    /// keeps its own.
    #[serde(default)]
    pub environment: Option<String>,
}

/// Arguments of `list_packages`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListPackagesArgs {
    /// Session name. Omit for the default session; a new name creates the session.
    #[serde(default)]
    pub session: Option<String>,
    /// Only say whether these distributions are installed.
    #[serde(default)]
    pub names: Option<Vec<String>>,
}

/// Structured result of `install_packages`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct InstallOutput {
    /// Session.
    pub session: String,
    /// Requirements newly installed.
    pub installed: Vec<String>,
    /// Requirements the session already had.
    pub already_installed: Vec<String>,
    /// True when the packages came from a cached layer (no download).
    pub cached: bool,
    /// Wall time in milliseconds.
    pub duration_ms: f64,
}

/// Structured result of `list_packages`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct PackageList {
    /// Session.
    pub session: String,
    /// Installed distributions (all, or those of `names` that are installed).
    pub packages: Vec<Package>,
    /// Of `names`, those not installed.
    pub missing: Vec<String>,
    /// Requirements installed through pyberth in this session.
    pub requirements: Vec<String>,
}

/// Arguments of the tools that act on one session.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionArgs {
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Arguments of `list_sessions`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

/// Structured result of `run_python`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct RunOutput {
    /// Session the code ran in.
    pub session: String,
    /// ok, error, timeout, cancelled, interpreter_restarted, oom, or running (a job).
    pub status: RunStatus,
    /// Everything written to stdout (file descriptor 1, child processes included).
    pub stdout: String,
    /// Everything written to stderr.
    pub stderr: String,
    /// Exact stdout bytes, base64, present only when stdout was not valid UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout_base64: Option<String>,
    /// Exact stderr bytes, base64, present only when stderr was not valid UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr_base64: Option<String>,
    /// repr of the final expression's value, or null.
    pub result: Option<String>,
    /// The exception raised by the code, or null.
    pub error: Option<PyError>,
    /// The status passed to sys.exit(), when the code called it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
    /// Wall time of the call in milliseconds.
    pub duration_ms: f64,
    /// CPU time of the run (user + system, child processes included) in milliseconds.
    pub cpu_ms: Option<f64>,
    /// True when stdout or stderr went over the output cap and was cut.
    pub truncated: bool,
    /// True when the interpreter state (variables, imports) from before this call is gone.
    pub state_lost: bool,
    /// Things the caller should know: restarts, replaced containers.
    pub notices: Vec<String>,
    /// Images produced by the run (matplotlib figures, display()), returned as image content.
    pub images: usize,
    /// Peak resident memory during the run, KiB (the interpreter, or a child that peaked higher).
    pub peak_memory_kb: Option<u64>,
    /// Job handle, when the run went to the background.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// For a running job: pass as stdout_offset to job_status to get only newer output.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout_offset: Option<usize>,
    /// For a running job: pass as stderr_offset to job_status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr_offset: Option<usize>,
}

/// Structured result of `list_sessions`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct SessionList {
    /// Open sessions of the caller.
    pub sessions: Vec<SessionInfo>,
    /// Most sessions open at once.
    pub max_sessions: usize,
}

/// Structured result of `list_variables`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct VariableList {
    /// Session.
    pub session: String,
    /// User variables (names not starting with '_', modules excluded).
    pub variables: Vec<Variable>,
}

/// The MCP server.
#[derive(Clone)]
pub struct SandboxServer {
    registry: Arc<Registry>,
    cfg: Arc<SandboxConfig>,
    /// Log level a pre-2026 client set with logging/setLevel (2026-07-28 requests carry theirs).
    log_level: live::LevelSlot,
    tool_router: ToolRouter<Self>,
}

/// The principal of a caller over stdio: the one local client.
pub const LOCAL: &str = "local";

/// The principal an HTTP request was authenticated as, put in its extensions by the auth layer.
#[derive(Debug, Clone)]
pub struct Principal(pub Arc<str>);

/// Who is calling: the principal of the request's token over HTTP, the local client otherwise.
/// Read per request (never per connection), so a session id can't carry one caller's rights
/// to another.
pub fn principal_of(ctx: &RequestContext<RoleServer>) -> Arc<str> {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .and_then(|p| p.extensions.get::<Principal>())
        .map(|p| p.0.clone())
        .unwrap_or_else(|| LOCAL.into())
}

/// Extractor form of [`principal_of`] for tools that need nothing else of the context.
pub struct Caller(pub Arc<str>);

impl<C: rmcp::handler::server::common::AsRequestContext> rmcp::handler::server::common::FromContextPart<C> for Caller {
    fn from_context_part(context: &mut C) -> Result<Self, ErrorData> {
        Ok(Caller(principal_of(context.as_request_context())))
    }
}

fn tool_error(text: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text)])
}

/// Validates a session name, defaulting to [`DEFAULT_SESSION`].
pub fn session_name(arg: Option<&str>) -> Result<String, String> {
    let name = arg.unwrap_or(DEFAULT_SESSION);
    let ok = !name.is_empty()
        && name.len() <= 40
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(name.to_owned())
    } else {
        let shown: String = name.chars().take(60).collect();
        Err(format!(
            "invalid session name {shown:?}: use 1-40 letters, digits, '.', '_' or '-', starting with a letter or digit"
        ))
    }
}

/// Checks code before any container is touched.
pub fn check_code(code: &str, cap: usize) -> Result<(), String> {
    if code.trim().is_empty() {
        return Err("code is empty: pass the Python source to run".into());
    }
    if code.len() > cap {
        return Err(format!("code is {} bytes, over the limit of {cap} bytes: split it into several runs", code.len()));
    }
    if let Some(pos) = code.find('\0') {
        return Err(format!("code contains a NUL byte at offset {pos}: remove it"));
    }
    Ok(())
}

/// Checks a requested time limit against the server's maximum.
pub fn check_timeout(timeout_s: Option<f64>, cfg: &SandboxConfig) -> Result<Duration, String> {
    match timeout_s {
        None => Ok(cfg.timeout()),
        Some(t) if t.is_finite() && t > 0.0 && t <= cfg.max_timeout_s as f64 => Ok(Duration::from_secs_f64(t)),
        Some(t) => Err(format!(
            "timeout_s {t} is out of range: give a number of seconds above 0 and at most {}",
            cfg.max_timeout_s
        )),
    }
}

/// Renders a run as readable text plus structured content.
pub fn render_run(session: &str, outcome: &RunOutcome, job: Option<&str>) -> CallToolResult {
    let images = outcome.images.clone();
    let (stdout, stdout_base64) = outcome.stdout.render();
    let (stderr, stderr_base64) = outcome.stderr.render();
    let out = RunOutput {
        session: session.to_owned(),
        status: outcome.status,
        truncated: outcome.stdout.dropped() > 0 || outcome.stderr.dropped() > 0,
        stdout,
        stderr,
        stdout_base64,
        stderr_base64,
        result: outcome.result.clone(),
        error: outcome.error.clone(),
        exit_code: outcome.exit_code,
        duration_ms: (outcome.duration.as_secs_f64() * 1e6).round() / 1e3,
        cpu_ms: outcome.cpu_ms.map(|c| c.round()),
        state_lost: outcome.state_lost,
        notices: outcome.notices.clone(),
        images: images.len(),
        peak_memory_kb: outcome.peak_memory_kb,
        job: job.map(str::to_owned),
        stdout_offset: None,
        stderr_offset: None,
    };
    let mut text = String::new();
    if !out.stdout.is_empty() {
        text.push_str(&out.stdout);
        if !text.ends_with('\n') {
            text.push('\n');
        }
    }
    if !out.stderr.is_empty() {
        text.push_str("[stderr]\n");
        text.push_str(&out.stderr);
        if !text.ends_with('\n') {
            text.push('\n');
        }
    }
    if let Some(r) = &out.result {
        text.push_str(&format!("[result] {r}\n"));
    }
    if let Some(e) = &out.error {
        text.push_str(&e.traceback);
        if !text.ends_with('\n') {
            text.push('\n');
        }
    }
    let status = match out.status {
        RunStatus::Ok => None,
        RunStatus::Error => Some("error".to_owned()),
        RunStatus::Timeout => Some(format!("timeout: stopped after {:.1} s", out.duration_ms / 1e3)),
        RunStatus::Cancelled => Some("cancelled".to_owned()),
        RunStatus::InterpreterRestarted => Some("interpreter restarted".to_owned()),
        RunStatus::Oom => Some("out of memory".to_owned()),
        RunStatus::Running => Some(format!(
            "running as {}: call job_status to read more output, cancel_job to stop it",
            out.job.as_deref().unwrap_or("a job")
        )),
    };
    if let Some(s) = status {
        text.push_str(&format!("[status] {s}\n"));
    }
    for n in &out.notices {
        text.push_str(&format!("[notice] {n}\n"));
    }
    if text.is_empty() {
        text.push_str("[ok] no output\n");
    }
    let is_error = !matches!(out.status, RunStatus::Ok | RunStatus::Running);
    let json = serde_json::to_value(&out).unwrap_or_default();
    let mut result = if is_error { CallToolResult::structured_error(json) } else { CallToolResult::structured(json) };
    result.content = vec![ContentBlock::text(text)];
    result.content.extend(images.into_iter().map(|(mime, data)| ContentBlock::image(data, mime)));
    result
}

fn structured<T: Serialize>(value: &T, text: String) -> CallToolResult {
    let mut result = CallToolResult::structured(serde_json::to_value(value).unwrap_or_default());
    result.content = vec![ContentBlock::text(text)];
    result
}

/// The per-run and per-session environments of a run_python call, checked.
/// Environment variables by name.
type Env = BTreeMap<String, String>;

fn run_env(args: &RunPythonArgs) -> Result<(Env, Option<Env>), String> {
    let mut env = match &args.env_file {
        Some(text) => workspace::parse_dotenv(text)?,
        None => BTreeMap::new(),
    };
    env.extend(args.env.clone().unwrap_or_default());
    workspace::check_env(&env)?;
    if let Some(s) = &args.session_env {
        workspace::check_env(s)?;
    }
    Ok((env, args.session_env.clone()))
}

/// Validates requested packages plus those declared inline in `code`.
pub fn wanted_packages(packages: Option<&[String]>, code: Option<&str>, max: usize) -> Result<Vec<String>, String> {
    let mut wanted: Vec<String> = packages.map(|p| p.to_vec()).unwrap_or_default();
    if let Some(code) = code {
        wanted.extend(deps::inline_dependencies(code)?);
    }
    deps::parse_set(&wanted, max).map_err(|e| e.to_string())
}

#[tool_router]
impl SandboxServer {
    /// A server over a registry.
    pub fn new(registry: Arc<Registry>, cfg: Arc<SandboxConfig>) -> Self {
        Self {
            registry,
            cfg,
            log_level: Arc::default(),
            tool_router: Self::tool_router()
                + Self::files_router()
                + Self::jobs_router()
                + Self::envs_router()
                + Self::transfer_router(),
        }
    }

    /// Run Python code in a persistent sandboxed interpreter and return its stdout, stderr,
    /// the repr of the last expression, and any exception with its traceback. Variables,
    /// imports and files persist between calls in the same session, like notebook cells.
    /// Each session is an isolated Docker container with no network access, a read-only
    /// system, a writable working directory /workspace (kept for the session's life), a
    /// small /tmp, and limits on memory, CPU and processes. Output of child processes is
    /// captured too; each stream is capped (1 MiB by default). Runs in one session execute
    /// one at a time, in order.
    #[tool(
        annotations(title = "Run Python", destructive_hint = false, open_world_hint = false),
        output_schema = schema_for_output::<RunOutput>()
    )]
    async fn run_python(
        &self,
        Parameters(args): Parameters<RunPythonArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> CallToolResult {
        let who = principal_of(&ctx);
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        if let Err(e) = check_code(&args.code, self.cfg.code_cap) {
            return tool_error(e);
        }
        let timeout = match check_timeout(args.timeout_s, &self.cfg) {
            Ok(t) => t,
            Err(e) => return tool_error(e),
        };
        let wait = match check_wait(args.wait_s, args.background, &self.cfg) {
            Ok(w) => w,
            Err(e) => return tool_error(e),
        };
        let packages = match wanted_packages(args.packages.as_deref(), Some(&args.code), self.cfg.max_packages) {
            Ok(p) => p,
            Err(e) => return tool_error(e),
        };
        let (env, session_env) = match run_env(&args) {
            Ok(e) => e,
            Err(e) => return tool_error(e),
        };
        let save_as = match args.save_as.as_deref().map(|p| workspace::check_path(p, false)).transpose() {
            Ok(p) => p,
            Err(e) => return tool_error(e),
        };
        let (progress, _, mut rx) = live_channel(false);
        let opened = relay(self.notifier(&ctx), &mut rx, async {
            let progress = &progress;
            let (session, created) =
                self.registry.get_or_create(&who, &name, args.environment.as_deref(), &packages, progress).await?;
            let mut notices = Vec::new();
            if created {
                notices.push(format!("new session {name:?} created"));
                if !packages.is_empty() {
                    notices.push(format!("packages ready: {}", packages.join(", ")));
                }
            } else if !packages.is_empty() {
                let done = self.registry.install(&session, &packages, progress).await?;
                if !done.added.is_empty() {
                    notices.push(format!("packages installed: {}", done.added.join(", ")));
                }
            }
            Ok::<_, crate::session::registry::Error>((session, notices))
        })
        .await;
        let (session, notices) = match opened {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(session = %name, error = %e, "cannot open session");
                return tool_error(e.to_string());
            }
        };
        if let Some(vars) = &session_env {
            session.set_env(vars);
        }
        let mut notices = notices;
        if let Some(path) = &save_as {
            let data = base64::engine::general_purpose::STANDARD.encode(args.code.as_bytes());
            match session.file(|id| crate::protocol::Request::Write { id, path, b: data, append: false }).await {
                Ok(_) => notices.push(format!("code saved as {path}")),
                Err(crate::session::Error::Refused(e)) => {
                    return tool_error(format!("cannot save the code as {path}: {e}"));
                }
                Err(e) => return tool_error(format!("cannot save the code as {path}: {e}")),
            }
        }
        // Without timeout_s, the session's environment sets the limit.
        let timeout = if args.timeout_s.is_none() { session.settings().timeout() } else { timeout };
        let spec = JobSpec { code: args.code, env, ..Default::default() };
        self.execute(&ctx, session, spec, timeout, wait, notices).await
    }

    /// Install Python packages into a session (created if new) from the package index. The
    /// sandbox itself stays offline: a separate installer fetches the packages, and each set
    /// is cached, so asking again (in any session) needs no download. Variables are kept.
    /// Takes requirement strings such as "numpy" or "requests>=2.31"; no URLs, paths or options.
    #[tool(
        annotations(title = "Install packages", destructive_hint = false, open_world_hint = true),
        output_schema = schema_for_output::<InstallOutput>()
    )]
    async fn install_packages(
        &self,
        Parameters(args): Parameters<InstallArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> CallToolResult {
        let who = principal_of(&ctx);
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        if args.packages.is_empty() {
            return tool_error("packages is empty: name at least one package, e.g. [\"numpy\"]");
        }
        let packages = match wanted_packages(Some(&args.packages), None, self.cfg.max_packages) {
            Ok(p) => p,
            Err(e) => return tool_error(e),
        };
        let started = std::time::Instant::now();
        let (progress, _, mut rx) = live_channel(false);
        let done = relay(self.notifier(&ctx), &mut rx, async {
            let progress = &progress;
            let (session, created) =
                self.registry.get_or_create(&who, &name, args.environment.as_deref(), &packages, progress).await?;
            if created {
                return Ok(crate::session::registry::Installed {
                    added: packages.clone(),
                    present: vec![],
                    layer: None,
                });
            }
            self.registry.install(&session, &packages, progress).await
        })
        .await;
        match done {
            Ok(done) => {
                let out = InstallOutput {
                    session: name.clone(),
                    cached: done.layer.as_ref().is_some_and(|l| l.cached),
                    installed: done.added,
                    already_installed: done.present,
                    duration_ms: (started.elapsed().as_secs_f64() * 1e3).round(),
                };
                let mut text = String::new();
                if !out.installed.is_empty() {
                    text.push_str(&format!("installed in session {name:?}: {}\n", out.installed.join(", ")));
                }
                if !out.already_installed.is_empty() {
                    text.push_str(&format!("already installed: {}\n", out.already_installed.join(", ")));
                }
                structured(&out, text)
            }
            Err(e) => {
                tracing::warn!(session = %name, error = %e, "install failed");
                tool_error(e.to_string())
            }
        }
    }

    /// List the Python distributions installed in a session (name and version), or, with
    /// `names`, say which of those are installed and which are missing.
    #[tool(annotations(title = "List packages", read_only_hint = true), output_schema = schema_for_output::<PackageList>())]
    async fn list_packages(
        &self,
        Parameters(args): Parameters<ListPackagesArgs>,
        Caller(who): Caller,
    ) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let session = match self.registry.get_or_create(&who, &name, None, &[], &|_| {}).await {
            Ok((s, _)) => s,
            Err(e) => return tool_error(e.to_string()),
        };
        let installed = match session.installed().await {
            Ok(p) => p,
            Err(e) => return tool_error(format!("cannot list packages of session {name:?}: {e}")),
        };
        let (packages, missing) = match &args.names {
            None => (installed, Vec::new()),
            Some(names) => {
                let mut found = Vec::new();
                let mut missing = Vec::new();
                for n in names {
                    let key = deps::normalize_name(n);
                    match installed.iter().find(|p| deps::normalize_name(&p.name) == key) {
                        Some(p) => found.push(p.clone()),
                        None => missing.push(n.clone()),
                    }
                }
                (found, missing)
            }
        };
        let mut text: String = packages.iter().map(|p| format!("{}=={}\n", p.name, p.version)).collect();
        if !missing.is_empty() {
            text.push_str(&format!("not installed: {}\n", missing.join(", ")));
        }
        let out = PackageList { session: name, packages, missing, requirements: session.requirements() };
        structured(&out, text)
    }

    /// List your open sessions with their Python version, number of runs, idle time and
    /// time until they are closed for idleness.
    #[tool(annotations(title = "List sessions", read_only_hint = true), output_schema = schema_for_output::<SessionList>())]
    async fn list_sessions(&self, Parameters(_): Parameters<NoArgs>, Caller(who): Caller) -> CallToolResult {
        let list = SessionList { sessions: self.registry.list(&who), max_sessions: self.cfg.max_sessions };
        let mut text = format!("{} of at most {} sessions open\n", list.sessions.len(), list.max_sessions);
        for s in &list.sessions {
            text.push_str(&format!(
                "{}: python {}, {} runs, idle {} s, closes in {} s\n",
                s.session, s.python, s.runs, s.idle_s, s.expires_in_s
            ));
        }
        structured(&list, text)
    }

    /// Restart a session's interpreter: all variables, imports and running processes are
    /// discarded; files in /workspace are kept. Use it when the state is broken or to start over.
    #[tool(annotations(title = "Reset session", destructive_hint = true, idempotent_hint = true))]
    async fn reset_session(&self, Parameters(args): Parameters<SessionArgs>, Caller(who): Caller) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let session = match self.registry.get(&who, &name) {
            Ok(s) => s,
            Err(e) => return tool_error(e.to_string()),
        };
        match session.reset().await {
            Ok(notice) => {
                let mut text = format!("session {name:?} reset: fresh interpreter, workspace files kept");
                if let Some(n) = notice {
                    text.push_str(&format!("\n[notice] {n}"));
                }
                CallToolResult::success(vec![ContentBlock::text(text)])
            }
            Err(e) => tool_error(format!("cannot reset session {name:?}: {e}")),
        }
    }

    /// Close a session: its container, interpreter and workspace files are deleted. A later
    /// run_python with the same name starts an empty session.
    #[tool(annotations(title = "Close session", destructive_hint = true, idempotent_hint = false))]
    async fn close_session(&self, Parameters(args): Parameters<SessionArgs>, Caller(who): Caller) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        match self.registry.close(&who, &name).await {
            Ok(()) => CallToolResult::success(vec![ContentBlock::text(format!(
                "session {name:?} closed: its container and workspace were removed"
            ))]),
            Err(e) => tool_error(e.to_string()),
        }
    }

    /// List the variables defined in a session (name, type and a short repr), like a
    /// notebook's variable view. Names starting with '_' and modules are left out.
    #[tool(annotations(title = "List variables", read_only_hint = true), output_schema = schema_for_output::<VariableList>())]
    async fn list_variables(&self, Parameters(args): Parameters<SessionArgs>, Caller(who): Caller) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let session = match self.registry.get(&who, &name) {
            Ok(s) => s,
            Err(e) => return tool_error(e.to_string()),
        };
        match session.variables().await {
            Ok((variables, notice)) => {
                let mut text = String::new();
                if let Some(n) = notice {
                    text.push_str(&format!("[notice] {n}\n"));
                }
                if variables.is_empty() {
                    text.push_str("no variables defined\n");
                }
                for v in &variables {
                    text.push_str(&format!("{}: {} = {}\n", v.name, v.kind, v.repr));
                }
                structured(&VariableList { session: name, variables }, text)
            }
            Err(e) => tool_error(format!("cannot list variables of session {name:?}: {e}")),
        }
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for SandboxServer {
    /// The tool table, with every result kept within one message a client accepts.
    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, ErrorData> {
        let tcc = rmcp::handler::server::tool::ToolCallContext::new(self, request, context);
        Ok(match self.tool_router.call(tcc).await? {
            rmcp::model::CallToolResponse::Complete(r) => {
                rmcp::model::CallToolResponse::Complete(fit::fit(r, fit::BUDGET))
            }
            other => other,
        })
    }

    fn get_info(&self) -> ServerConfig {
        ServerConfig::new({
            #[allow(deprecated)] // logging: still how pre-2026 clients ask for live output as log messages
            let caps = ServerCapabilities::builder().enable_tools().enable_resources().enable_logging().build();
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
        _ctx: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        live::set_level(&self.log_level, request.level);
        Ok(())
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _ctx: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        let template = ResourceTemplate::new("pyberth://sessions/{session}/files/{+path}", "workspace-file")
            .with_description("A file in a session's workspace (/workspace); text or binary, at most 8 MiB per read.");
        Ok(ListResourceTemplatesResult::with_all_items(vec![template]))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let who = principal_of(&ctx);
        let uri = request.uri;
        let not_found = |why: String| ErrorData::resource_not_found(why, None);
        let Some((name, path)) = workspace::parse_resource_uri(&uri) else {
            return Err(not_found(format!("{uri} is not a pyberth workspace file URI")));
        };
        let name = session_name(Some(&name)).map_err(not_found)?;
        let path = workspace::check_path(&path, false).map_err(not_found)?;
        // Another principal's session behaves exactly like a missing one.
        let session = self.registry.get(&who, &name).map_err(|e| not_found(e.to_string()))?;
        let (data, size) = self.read_bytes(&session, &path, 0, self.cfg.file_cap as u64).await.map_err(not_found)?;
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
        Ok(ReadResourceResult::new(vec![contents]).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        c: SandboxConfig,
    }

    #[test]
    fn session_names() {
        assert_eq!(session_name(None).as_deref(), Ok("default"));
        assert_eq!(session_name(Some("a.b_c-1")).as_deref(), Ok("a.b_c-1"));
        for bad in ["", "-x", "a b", "a/b", "é", &"x".repeat(41), "a\nb"] {
            let e = session_name(Some(bad)).expect_err(bad);
            assert!(e.contains("invalid session name"), "{e}");
        }
    }

    #[test]
    fn code_checks() {
        assert!(check_code("print(1)", 100).is_ok());
        assert!(check_code("  \n", 100).expect_err("empty").contains("empty"));
        assert!(check_code("x = 1\0", 100).expect_err("nul").contains("offset 5"));
        assert!(check_code(&"x".repeat(101), 100).expect_err("big").contains("over the limit"));
    }

    #[test]
    fn timeout_checks() {
        let cfg = Cli::parse_from(["x"]).c;
        assert_eq!(check_timeout(None, &cfg), Ok(Duration::from_secs(60)));
        assert_eq!(check_timeout(Some(2.5), &cfg), Ok(Duration::from_millis(2500)));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9] {
            assert!(check_timeout(Some(bad), &cfg).expect_err("bad").contains("out of range"));
        }
        assert_eq!(check_wait(None, false, &cfg), Ok(None));
        assert_eq!(check_wait(None, true, &cfg), Ok(Some(Duration::ZERO)));
        assert_eq!(check_wait(Some(2.5), false, &cfg), Ok(Some(Duration::from_millis(2500))));
        for bad in [-1.0, f64::NAN, f64::INFINITY, 1e12] {
            assert!(check_wait(Some(bad), false, &cfg).expect_err("bad").contains("wait_s"), "{bad}");
        }
        assert!(check_wait(Some(1.0), true, &cfg).is_err(), "wait_s with background");
    }

    fn outcome(status: RunStatus) -> RunOutcome {
        let mut stdout = crate::output::Capture::new(1024);
        stdout.push(b"hi\n");
        RunOutcome {
            status,
            stdout,
            stderr: crate::output::Capture::new(1024),
            result: Some("42".into()),
            error: None,
            exit_code: None,
            duration: Duration::from_millis(5),
            cpu_ms: Some(1.0),
            state_lost: false,
            notices: vec![],
            images: vec![],
            peak_memory_kb: Some(2048),
        }
    }

    #[test]
    fn ok_runs_are_not_errors_and_failures_are() {
        let ok = render_run("s", &outcome(RunStatus::Ok), None);
        assert_eq!(ok.is_error, Some(false));
        let sc = ok.structured_content.expect("structured");
        assert_eq!(sc["stdout"], "hi\n");
        assert_eq!(sc["result"], "42");
        assert_eq!(sc["status"], "ok");
        assert_eq!(sc["truncated"], false);
        assert_eq!(sc["peak_memory_kb"], 2048);
        let running = render_run("s", &outcome(RunStatus::Running), Some("job-1"));
        assert_eq!(running.is_error, Some(false), "a running job is not a failure");
        assert_eq!(running.structured_content.expect("structured")["job"], "job-1");
        let statuses = [
            RunStatus::Error,
            RunStatus::Timeout,
            RunStatus::Cancelled,
            RunStatus::InterpreterRestarted,
            RunStatus::Oom,
        ];
        for s in statuses {
            let r = render_run("s", &outcome(s), None);
            assert_eq!(r.is_error, Some(true), "{s:?}");
            assert!(r.structured_content.is_some());
        }
    }
}
