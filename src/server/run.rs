//! Running code and the packages it needs: `run_python`, `install_packages`, `list_packages`,
//! and the foreground run that `run_file` shares.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::service::RequestContext;
use rmcp::{RoleServer, tool, tool_router};

use super::error::{Context as _, ToolError, ToolResult};
use super::live::{LiveChannel, live_channel, relay};
use super::render::{render_run, structured};
use super::types::{InstallArgs, InstallOutput, ListPackagesArgs, PackageList, RunOutput, RunPythonArgs};
use super::{Caller, SandboxServer, principal_of};
use crate::checks::{self, check_code, check_path, check_timeout, check_wait, session_name, wanted_packages};
use crate::deps;
use crate::protocol::Request;
use crate::session::registry::Opened;
use crate::session::{RunSpec, Session};

/// Environment variables by name.
type Env = BTreeMap<String, String>;

/// The per-run and per-session environments of a run_python call, checked.
fn run_env(args: &RunPythonArgs) -> Result<(Env, Option<Env>), String> {
    let mut env = match &args.env_file {
        Some(text) => checks::parse_dotenv(text)?,
        None => BTreeMap::new(),
    };
    env.extend(args.env.clone().unwrap_or_default());
    checks::check_env(&env)?;
    if let Some(s) = &args.session_env {
        checks::check_env(s)?;
    }
    Ok((env, args.session_env.clone()))
}

impl SandboxServer {
    /// Runs in a session: to the end with live output, or as a job waited for up to `wait`.
    /// `timeout_s` is resolved here, once, against the session's environment.
    pub(super) async fn execute(
        &self,
        ctx: &RequestContext<RoleServer>,
        session: Arc<Session>,
        spec: RunSpec,
        timeout_s: Option<f64>,
        wait: Option<Duration>,
        mut notices: Vec<String>,
    ) -> ToolResult {
        let who = principal_of(ctx);
        // Code mode: what the session's environment lets its code call upstream.
        let spec = RunSpec { bridge: self.registry.grant(&session), ..spec };
        // An adopted session whose egress could not be taken over says so in every run.
        notices.extend(self.registry.egress.notice(&who, &session.name));
        let timeout = check_timeout(timeout_s, session.settings())?;
        let slot = self.registry.run_permit(&who)?;
        if let Some(wait) = wait {
            // A job's egress is counted like a run's: from its start to its end.
            let tally = self.registry.egress.begin_run(&who, &session.name).await.map(|before| {
                let (registry, who, name) = (self.registry.clone(), who.clone(), session.name.clone());
                Box::pin(async move { registry.egress.totals(&who, &name).await.map(|now| now.since(&before)) })
                    as crate::session::jobs::EgressTally
            });
            let job = self.registry.jobs.start(&who, session, spec, timeout, self.cfg.output_cap, slot, tally);
            return self.await_job(&job, wait, ctx, notices).await;
        }
        let notifier = self.notifier(ctx);
        let mut live = live_channel(notifier.wants_output());
        let before = self.registry.egress.begin_run(&who, &session.name).await;
        let mut outcome = relay(notifier, &mut live.rx, session.run(spec, timeout, &ctx.ct, &live.observer))
            .await
            .context("the run could not complete")?;
        outcome.notices.splice(0..0, notices);
        let egress = match (before, self.registry.egress.totals(&who, &session.name).await) {
            (Some(before), Some(now)) => Some(now.since(&before)),
            _ => None,
        };
        if let Some(e) = &egress {
            outcome.notices.extend(e.denied.iter().map(|d| format!("egress denied: {d}")));
        }
        let mut result = render_run(&session.name, &outcome, None);
        if let (Some(e), Some(serde_json::Value::Object(sc))) = (egress, result.structured_content.as_mut()) {
            sc.insert("egress".into(), serde_json::to_value(e).unwrap_or_default());
        }
        Ok(result)
    }

    /// Opens a session for a call that may install packages, with install lines sent live.
    async fn open(
        &self,
        ctx: &RequestContext<RoleServer>,
        name: &str,
        environment: Option<&str>,
        packages: &[String],
        allow_hosts: Option<&[String]>,
    ) -> Result<Opened, ToolError> {
        let who = principal_of(ctx);
        let LiveChannel { progress, mut rx, .. } = live_channel(false);
        let opened = relay(
            self.notifier(ctx),
            &mut rx,
            self.registry.open(&who, name, environment, packages, allow_hosts, &progress),
        );
        Ok(opened.await?)
    }
}

#[tool_router(router = run_router, vis = "pub(super)")]
impl SandboxServer {
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
    ) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        check_code(&args.code, self.cfg.code_cap)?;
        // Checked against the server before any container is touched; resolved in `execute`.
        check_timeout(args.timeout_s, &self.cfg)?;
        let wait = check_wait(args.wait_s, args.background, &self.cfg)?;
        let packages = wanted_packages(args.packages.as_deref(), Some(&args.code), self.cfg.max_packages)?;
        let (env, session_env) = run_env(&args)?;
        let save_as = args.save_as.as_deref().map(|p| check_path(p, false)).transpose()?;
        let opened =
            self.open(&ctx, &name, args.environment.as_deref(), &packages, args.allow_hosts.as_deref()).await?;
        let session = opened.session;
        let mut notices = Vec::new();
        if let (false, Some(asked)) = (opened.created, &args.allow_hosts) {
            // An existing session: the same narrowing as set_network.
            let now = self.registry.narrow(&session, asked).await?;
            notices.push(format!(
                "egress narrowed to: {}",
                if now.is_empty() { "none (offline)".into() } else { now.join(", ") }
            ));
        }
        if opened.created {
            match self.registry.ended_why(&session.principal, &name) {
                Some(why) => notices.push(format!("new session {name:?} created (the one before it {why})")),
                None => notices.push(format!("new session {name:?} created")),
            }
            if !opened.installed.added.is_empty() {
                notices.push(format!("packages ready: {}", opened.installed.added.join(", ")));
            }
        } else if !opened.installed.added.is_empty() {
            notices.push(format!("packages installed: {}", opened.installed.added.join(", ")));
        }
        if !opened.installed.skipped.is_empty() {
            notices.push(format!(
                "packages skipped (marker false in this environment): {}",
                opened.installed.skipped.join(", ")
            ));
        }
        if let Some(vars) = &session_env {
            session.set_env(vars);
        }
        if let Some(path) = &save_as {
            let b = base64::engine::general_purpose::STANDARD.encode(args.code.as_bytes());
            super::files::agent_file(&session, format!("cannot save the code as {path}"), |id| Request::Write {
                id,
                path,
                b: &b,
                append: false,
            })
            .await?;
            notices.push(format!("code saved as {path}"));
        }
        let spec = RunSpec { code: args.code, env, ..Default::default() };
        self.execute(&ctx, session, spec, args.timeout_s, wait, notices).await
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
    ) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        if args.packages.is_empty() {
            return Err("packages is empty: name at least one package, e.g. [\"numpy\"]".into());
        }
        let packages = wanted_packages(Some(&args.packages), None, self.cfg.max_packages)?;
        let started = Instant::now();
        let done = self.open(&ctx, &name, args.environment.as_deref(), &packages, None).await?.installed;
        let out = InstallOutput {
            session: name.clone(),
            cached: done.layer.as_ref().is_some_and(|l| l.cached),
            installed: done.added,
            already_installed: done.present,
            skipped: done.skipped,
            duration_ms: (started.elapsed().as_secs_f64() * 1e3).round(),
        };
        let mut text = String::new();
        if !out.installed.is_empty() {
            text.push_str(&format!("installed in session {name:?}: {}\n", out.installed.join(", ")));
        }
        if !out.already_installed.is_empty() {
            text.push_str(&format!("already installed: {}\n", out.already_installed.join(", ")));
        }
        if !out.skipped.is_empty() {
            text.push_str(&format!("skipped (marker false in this environment): {}\n", out.skipped.join(", ")));
        }
        Ok(structured(&out, text))
    }

    /// List the Python distributions installed in a session (name and version), or, with
    /// `names`, say which of those are installed and which are missing.
    #[tool(annotations(title = "List packages", read_only_hint = true), output_schema = schema_for_output::<PackageList>())]
    async fn list_packages(&self, Parameters(args): Parameters<ListPackagesArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let (session, _) = self.registry.get_or_create(&who, &name, None, &[], &|_| {}).await?;
        let installed = session.installed().await.context(format!("cannot list packages of session {name:?}"))?;
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
        Ok(structured(&out, text))
    }
}
