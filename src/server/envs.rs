//! Environment tools: what a caller can choose, and what a session runs in.

use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::{tool, tool_router};
use serde::Serialize;

use super::error::{Context as _, ToolResult};
use super::render::structured;
use super::types::{NoArgs, SessionArgs};
use super::{Caller, SandboxServer};
use crate::checks::session_name;
use crate::config::SandboxConfig;
use crate::environment::{Environment, MountSpec};

/// Limits of a session.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct Limits {
    /// Memory, MiB (swap disabled).
    pub memory_mb: u64,
    /// CPU share.
    pub cpus: f64,
    /// Processes and threads.
    pub pids: i64,
    /// Size of /tmp, MiB.
    pub tmp_mb: u64,
    /// Size of the workspace, MiB, a tmpfs whose pages count against `memory_mb`; 0: on the
    /// engine's volume disk, without a per-session bound.
    pub workspace_mb: u64,
    /// Default time limit of a run, seconds.
    pub timeout_s: u64,
    /// Largest time limit a run may ask for, seconds.
    pub max_timeout_s: u64,
    /// Bytes of stdout and of stderr kept per run.
    pub output_cap: usize,
    /// Characters of output a run's text shows (head and tail, the whole saved apart).
    pub text_budget: usize,
}

impl Limits {
    fn of(cfg: &SandboxConfig) -> Self {
        Self {
            memory_mb: cfg.memory_mb,
            cpus: cfg.cpus,
            pids: cfg.pids,
            tmp_mb: cfg.tmp_mb,
            workspace_mb: cfg.workspace_bound_mb().unwrap_or(0),
            timeout_s: cfg.timeout_s,
            max_timeout_s: cfg.max_timeout_s,
            output_cap: cfg.output_cap,
            text_budget: cfg.text_budget,
        }
    }
}

/// A read-only mount, as the sandbox sees it.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct MountInfo {
    /// Path inside the sandbox.
    pub path: String,
    /// Always true: mounts are read-only.
    pub read_only: bool,
}

fn mounts(m: &[MountSpec]) -> Vec<MountInfo> {
    m.iter().map(|m| MountInfo { path: m.path.clone(), read_only: true }).collect()
}

/// One environment.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct EnvironmentInfo {
    /// Name to pass as `environment`.
    pub name: String,
    /// What it is for.
    pub description: String,
    /// Whether sessions get it when no environment is named.
    pub default: bool,
    /// Base image (offline: the Debian release below).
    pub base: String,
    /// Debian release used when the base cannot be pulled.
    pub debian_fallback: String,
    /// Packages preinstalled.
    pub packages: Vec<String>,
    /// Limits of its sessions.
    pub limits: Limits,
    /// Folders mounted read-only.
    pub mounts: Vec<MountInfo>,
    /// Hosts its sessions may reach through the egress proxy; empty: no network.
    pub egress: Vec<String>,
}

/// Structured result of `list_environments`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct EnvironmentList {
    /// Every environment, by name.
    pub environments: Vec<EnvironmentInfo>,
}

/// Structured result of `get_environment`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct SessionEnvironment {
    /// Session.
    pub session: String,
    /// Its environment.
    pub environment: String,
    /// Python version of its interpreter.
    pub python: String,
    /// Image its container runs.
    pub image: String,
    /// Its limits.
    pub limits: Limits,
    /// Network access of the code: "none", or "egress proxy" (HTTP and HTTPS to `egress`).
    pub network: String,
    /// The hosts the session may reach through the egress proxy, in force now; empty: none.
    pub egress: Vec<String>,
    /// Folders mounted read-only.
    pub mounts: Vec<MountInfo>,
    /// Installed distributions (preinstalled, added, and the interpreter's own).
    pub packages_installed: usize,
    /// The package index installs come from.
    pub package_index: String,
    /// The CA bundle the installer trusts, a path on the server's host (null: the installer's
    /// own, which knows no TLS-intercepting proxy).
    pub ca_bundle: Option<String>,
}

fn describe(env: &Environment, default: &str) -> EnvironmentInfo {
    EnvironmentInfo {
        name: env.name.clone(),
        description: env.description.clone(),
        default: env.name == default,
        base: env.cfg.image.clone().unwrap_or_else(|| env.cfg.base_image.clone()),
        debian_fallback: env.cfg.fallback_release.clone(),
        packages: env.packages.clone(),
        limits: Limits::of(&env.cfg),
        mounts: mounts(&env.mounts),
        egress: env.egress.iter().map(|r| r.text().to_owned()).collect(),
    }
}

#[tool_router(router = envs_router, vis = "pub(super)")]
impl SandboxServer {
    /// List the environments a session can be created in: Python version and base, the
    /// packages preinstalled, limits, and read-only data folders. Pass a name as `environment`
    /// to run_python (with a new session name) to use one.
    #[tool(annotations(title = "List environments", read_only_hint = true), output_schema = schema_for_output::<EnvironmentList>())]
    async fn list_environments(&self, Parameters(_): Parameters<NoArgs>) -> ToolResult {
        let envs = &self.registry.environments;
        let default = envs.default_name();
        let mut environments = Vec::new();
        for e in envs.all() {
            // What the built image actually runs (the registry's base or the offline one).
            let mut info = describe(e, default);
            info.description = self.registry.environment_as_built(e).await;
            environments.push(info);
        }
        let mut text = String::new();
        for e in &environments {
            let mark = if e.default { " (default)" } else { "" };
            text.push_str(&format!("{}{mark}: {}\n", e.name, e.description));
            if !e.packages.is_empty() {
                text.push_str(&format!("  packages: {}\n", e.packages.join(", ")));
            }
            for m in &e.mounts {
                text.push_str(&format!("  read-only folder: {}\n", m.path));
            }
            if !e.egress.is_empty() {
                text.push_str(&format!("  egress: {}\n", e.egress.join(", ")));
            }
        }
        Ok(structured(&EnvironmentList { environments }, text))
    }

    /// Report what a session runs in: environment, Python version, image, limits (memory, CPU,
    /// processes, time, output), network policy, read-only mounts, and how many packages are
    /// installed. Creates the session (in the default environment) if it does not exist.
    #[tool(annotations(title = "Get environment", read_only_hint = true), output_schema = schema_for_output::<SessionEnvironment>())]
    async fn get_environment(&self, Parameters(args): Parameters<SessionArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let (session, _) = self
            .registry
            .get_or_create(&who, &name, None, &[], &|_| {})
            .await
            .context(format!("cannot open session {name:?}"))?;
        let packages =
            session.installed().await.context(format!("cannot list the packages of session {name:?}"))?.len();
        let cfg = session.settings();
        let egress = self.registry.egress_rules(&who, &name);
        let network = if egress.is_empty() { "none" } else { "egress proxy" }.to_owned();
        let out = SessionEnvironment {
            session: name,
            environment: session.environment.clone(),
            python: session.info().python,
            image: session.image().to_owned(),
            limits: Limits::of(cfg),
            network,
            egress,
            mounts: mounts(session.mounts()),
            packages_installed: packages,
            package_index: cfg.index_url().unwrap_or_else(|| "https://pypi.org/simple".into()),
            ca_bundle: cfg.ca_bundle().map(|p| p.display().to_string()),
        };
        let text = format!(
            "session {}: environment {}, Python {}, image {}\nlimits: {} MiB memory, {} CPU, {} processes, {} s per run \
             (at most {} s), {} bytes of output per stream ({} characters shown), workspace {}\nnetwork: {}\nread-only folders: {}\npackages installed: {}\npackage index: {} (CA bundle: {})\n",
            out.session,
            out.environment,
            out.python,
            out.image,
            out.limits.memory_mb,
            out.limits.cpus,
            out.limits.pids,
            out.limits.timeout_s,
            out.limits.max_timeout_s,
            out.limits.output_cap,
            out.limits.text_budget,
            match out.limits.workspace_mb {
                0 => "on disk".to_owned(),
                mb => format!("{mb} MiB (counts against memory)"),
            },
            if out.egress.is_empty() {
                "none".to_owned()
            } else {
                format!("HTTP(S) through the egress proxy to {}", out.egress.join(", "))
            },
            if out.mounts.is_empty() {
                "none".to_owned()
            } else {
                out.mounts.iter().map(|m| m.path.as_str()).collect::<Vec<_>>().join(", ")
            },
            out.packages_installed,
            out.package_index,
            out.ca_bundle.as_deref().unwrap_or("the installer's own"),
        );
        Ok(structured(&out, text))
    }
}
