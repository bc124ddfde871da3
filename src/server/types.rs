//! Arguments and structured results of the session and run tools. Every `///` line here is
//! also the JSON-schema description a model reads.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::protocol::{Package, PyError, Variable};
use crate::session::{RunStatus, SessionInfo};

/// Arguments of `run_python`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RunPythonArgs {
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
    /// For a new session in an environment that allows egress: narrow its allow-list to these
    /// hosts ("pypi.org", "*.example.com", "api.example.com:8443"); [] = offline. Each entry
    /// must be within the environment's list: a caller narrows, never widens.
    #[serde(default)]
    pub allow_hosts: Option<Vec<String>>,
}

/// Arguments of `install_packages`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct InstallArgs {
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
pub(crate) struct ListPackagesArgs {
    /// Session name. Omit for the default session; a new name creates the session.
    #[serde(default)]
    pub session: Option<String>,
    /// Only say whether these distributions are installed.
    #[serde(default)]
    pub names: Option<Vec<String>>,
}

/// Structured result of `install_packages`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(crate) struct InstallOutput {
    /// Session.
    pub session: String,
    /// Requirements newly installed.
    pub installed: Vec<String>,
    /// Requirements the session already had.
    pub already_installed: Vec<String>,
    /// Requirements skipped, not installed: their environment marker is false in the
    /// session's environment (pip ignores them there).
    pub skipped: Vec<String>,
    /// True when the packages came from a cached layer (no download).
    pub cached: bool,
    /// Wall time in milliseconds.
    pub duration_ms: f64,
}

/// Structured result of `list_packages`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(crate) struct PackageList {
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
pub(crate) struct SessionArgs {
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Arguments of `list_sessions`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NoArgs {}

/// Structured result of `run_python`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(crate) struct RunOutput {
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
    /// True when stdout or stderr went over the output cap, or the text over its budget of
    /// characters, or the final value's repr over its share of it, and was cut.
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
    /// For a session with egress: what this run reached through the proxy, and what it was
    /// refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<crate::egress::Totals>,
    /// When the text cut stdout: the workspace file (for read_file) holding the whole of it,
    /// up to the output cap and the last quarter-cap; replaced by the next run that is cut.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout_file: Option<String>,
    /// The same for stderr.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr_file: Option<String>,
    /// Code mode: the upstream tool calls this run made, and those the server refused
    /// (absent when it made none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<crate::bridge::CallCounts>,
}

/// Arguments of `set_network`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct SetNetworkArgs {
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
    /// The hosts the session may reach from now on, each within its current list
    /// ("pypi.org", "*.example.com", "host:8443"); [] = offline.
    pub allow_hosts: Vec<String>,
}

/// Structured result of `set_network`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(crate) struct NetworkPolicy {
    /// Session.
    pub session: String,
    /// The hosts it may reach now; empty: offline.
    pub allow_hosts: Vec<String>,
}

/// Structured result of `list_sessions`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(crate) struct SessionList {
    /// Open sessions of the caller.
    pub sessions: Vec<SessionInfo>,
    /// Most sessions open at once.
    pub max_sessions: usize,
    /// Sessions of the caller that ended within the last hour, and why.
    pub ended: Vec<EndedSession>,
}

/// A session that ended, in `list_sessions`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(crate) struct EndedSession {
    /// Session name.
    pub session: String,
    /// Why it ended (closed by close_session, expired...).
    pub why: String,
    /// Seconds since it ended.
    pub ended_s_ago: u64,
}

/// Structured result of `list_variables`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(crate) struct VariableList {
    /// Session.
    pub session: String,
    /// User variables (names not starting with '_', modules excluded).
    pub variables: Vec<Variable>,
}
