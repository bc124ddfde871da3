//! The MCP face of pyberth: the tool table. Each tool validates its arguments, calls the
//! session layer and renders the outcome; no Docker code lives here.
//!
//! Every failure a caller can cause or fix is a tool result with `isError: true` (DESIGN.md
//! D8); JSON-RPC errors are left to rmcp for requests it cannot route or parse.

use std::sync::Arc;
use std::time::Duration;

use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler, tool, tool_handler, tool_router};
use serde::{Deserialize, Serialize};

use crate::config::SandboxConfig;
use crate::protocol::{PyError, Variable};
use crate::session::registry::Registry;
use crate::session::{RunOutcome, RunStatus, SessionInfo};

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
    /// ok, error, timeout, cancelled or interpreter_restarted.
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
    /// Who is calling: over stdio the one local client.
    principal: Arc<str>,
    tool_router: ToolRouter<Self>,
}

fn tool_error(text: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text)])
}

/// Validates a session name, defaulting to [`DEFAULT_SESSION`].
pub fn session_name(arg: Option<&str>) -> Result<String, String> {
    let name = arg.unwrap_or(DEFAULT_SESSION);
    let ok = !name.is_empty()
        && name.len() <= 40
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
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
        return Err(format!(
            "code is {} bytes, over the limit of {cap} bytes: split it into several runs",
            code.len()
        ));
    }
    if let Some(pos) = code.find('\0') {
        return Err(format!(
            "code contains a NUL byte at offset {pos}: remove it"
        ));
    }
    Ok(())
}

/// Checks a requested time limit against the server's maximum.
pub fn check_timeout(timeout_s: Option<f64>, cfg: &SandboxConfig) -> Result<Duration, String> {
    match timeout_s {
        None => Ok(cfg.timeout()),
        Some(t) if t.is_finite() && t > 0.0 && t <= cfg.max_timeout_s as f64 => {
            Ok(Duration::from_secs_f64(t))
        }
        Some(t) => Err(format!(
            "timeout_s {t} is out of range: give a number of seconds above 0 and at most {}",
            cfg.max_timeout_s
        )),
    }
}

/// Renders a run as readable text plus structured content.
pub fn render_run(session: &str, outcome: RunOutcome) -> CallToolResult {
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
        result: outcome.result,
        error: outcome.error,
        exit_code: outcome.exit_code,
        duration_ms: (outcome.duration.as_secs_f64() * 1e6).round() / 1e3,
        cpu_ms: outcome.cpu_ms.map(|c| c.round()),
        state_lost: outcome.state_lost,
        notices: outcome.notices,
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
        RunStatus::Timeout => Some(format!(
            "timeout: stopped after {:.1} s",
            out.duration_ms / 1e3
        )),
        RunStatus::Cancelled => Some("cancelled".to_owned()),
        RunStatus::InterpreterRestarted => Some("interpreter restarted".to_owned()),
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
    let is_error = out.status != RunStatus::Ok;
    let json = serde_json::to_value(&out).unwrap_or_default();
    let mut result = if is_error {
        CallToolResult::structured_error(json)
    } else {
        CallToolResult::structured(json)
    };
    result.content = vec![ContentBlock::text(text)];
    result
}

fn structured<T: Serialize>(value: &T, text: String) -> CallToolResult {
    let mut result = CallToolResult::structured(serde_json::to_value(value).unwrap_or_default());
    result.content = vec![ContentBlock::text(text)];
    result
}

#[tool_router]
impl SandboxServer {
    /// A server over a registry, acting for `principal`.
    pub fn new(registry: Arc<Registry>, cfg: Arc<SandboxConfig>, principal: &str) -> Self {
        Self {
            registry,
            cfg,
            principal: principal.into(),
            tool_router: Self::tool_router(),
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
        let (session, created) = match self.registry.get_or_create(&self.principal, &name).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(session = %name, error = %e, "cannot open session");
                return tool_error(e.to_string());
            }
        };
        match session.run(&args.code, timeout, &ctx.ct).await {
            Ok(mut outcome) => {
                if created {
                    outcome
                        .notices
                        .insert(0, format!("new session {name:?} created"));
                }
                render_run(&name, outcome)
            }
            Err(e) => {
                tracing::warn!(session = %name, error = %e, "run failed");
                tool_error(format!("the run could not complete: {e}"))
            }
        }
    }

    /// List your open sessions with their Python version, number of runs, idle time and
    /// time until they are closed for idleness.
    #[tool(annotations(title = "List sessions", read_only_hint = true), output_schema = schema_for_output::<SessionList>())]
    async fn list_sessions(&self, Parameters(_): Parameters<NoArgs>) -> CallToolResult {
        let list = SessionList {
            sessions: self.registry.list(&self.principal),
            max_sessions: self.cfg.max_sessions,
        };
        let mut text = format!(
            "{} of at most {} sessions open\n",
            list.sessions.len(),
            list.max_sessions
        );
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
    #[tool(annotations(
        title = "Reset session",
        destructive_hint = true,
        idempotent_hint = true
    ))]
    async fn reset_session(&self, Parameters(args): Parameters<SessionArgs>) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let session = match self.registry.get(&self.principal, &name) {
            Ok(s) => s,
            Err(e) => return tool_error(e.to_string()),
        };
        match session.reset().await {
            Ok(notice) => {
                let mut text =
                    format!("session {name:?} reset: fresh interpreter, workspace files kept");
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
    #[tool(annotations(
        title = "Close session",
        destructive_hint = true,
        idempotent_hint = false
    ))]
    async fn close_session(&self, Parameters(args): Parameters<SessionArgs>) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        match self.registry.close(&self.principal, &name).await {
            Ok(()) => CallToolResult::success(vec![ContentBlock::text(format!(
                "session {name:?} closed: its container and workspace were removed"
            ))]),
            Err(e) => tool_error(e.to_string()),
        }
    }

    /// List the variables defined in a session (name, type and a short repr), like a
    /// notebook's variable view. Names starting with '_' and modules are left out.
    #[tool(annotations(title = "List variables", read_only_hint = true), output_schema = schema_for_output::<VariableList>())]
    async fn list_variables(&self, Parameters(args): Parameters<SessionArgs>) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let session = match self.registry.get(&self.principal, &name) {
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
                structured(
                    &VariableList {
                        session: name,
                        variables,
                    },
                    text,
                )
            }
            Err(e) => tool_error(format!("cannot list variables of session {name:?}: {e}")),
        }
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for SandboxServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("pyberth", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Runs Python in isolated, offline Docker sandboxes. State persists per session \
                 like notebook cells; pass `session` to keep separate workspaces apart.",
            )
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
        assert!(
            check_code("  \n", 100)
                .expect_err("empty")
                .contains("empty")
        );
        assert!(
            check_code("x = 1\0", 100)
                .expect_err("nul")
                .contains("offset 5")
        );
        assert!(
            check_code(&"x".repeat(101), 100)
                .expect_err("big")
                .contains("over the limit")
        );
    }

    #[test]
    fn timeout_checks() {
        let cfg = Cli::parse_from(["x"]).c;
        assert_eq!(check_timeout(None, &cfg), Ok(Duration::from_secs(60)));
        assert_eq!(
            check_timeout(Some(2.5), &cfg),
            Ok(Duration::from_millis(2500))
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9] {
            assert!(
                check_timeout(Some(bad), &cfg)
                    .expect_err("bad")
                    .contains("out of range")
            );
        }
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
        }
    }

    #[test]
    fn ok_runs_are_not_errors_and_failures_are() {
        let ok = render_run("s", outcome(RunStatus::Ok));
        assert_eq!(ok.is_error, Some(false));
        let sc = ok.structured_content.expect("structured");
        assert_eq!(sc["stdout"], "hi\n");
        assert_eq!(sc["result"], "42");
        assert_eq!(sc["status"], "ok");
        assert_eq!(sc["truncated"], false);
        for s in [
            RunStatus::Error,
            RunStatus::Timeout,
            RunStatus::Cancelled,
            RunStatus::InterpreterRestarted,
        ] {
            let r = render_run("s", outcome(s));
            assert_eq!(r.is_error, Some(true), "{s:?}");
            assert!(r.structured_content.is_some());
        }
    }
}
