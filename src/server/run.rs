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

use super::budget::{SAVED_DIR, saved_bytes};
use super::error::{Context as _, ToolError, ToolResult};
use super::live::{LiveChannel, live_channel, relay};
use super::render::{View, render_run, stream_plan, structured};
use super::types::{InstallArgs, InstallOutput, ListPackagesArgs, PackageList, RunOutput, RunPythonArgs};
use super::{Caller, SandboxServer, principal_of};
use crate::checks::{self, check_code, check_path, check_timeout, check_wait, session_name, wanted_packages};
use crate::deps;
use crate::protocol::Request;
use crate::session::registry::Opened;
use crate::session::{RunSpec, Session};
use crate::telemetry;
use tracing::Instrument as _;

/// For each stream whose text the budget cuts: the whole of it (up to the output cap and its
/// last quarter-cap) written to `.pyberth-output/<stream>.txt` in the workspace, replacing the
/// last cut run's, and how the top line tells a model to read it. A write that fails (a full
/// workspace, a broken session) is said in its place.
async fn save_whole(
    session: &Session,
    outcome: &crate::session::RunOutcome,
    budget: usize,
) -> ([Option<String>; 2], [Option<String>; 2]) {
    let (_, shares) = stream_plan(outcome, budget);
    let mut whole = [None, None];
    let mut files = [None, None];
    for (i, (name, capture)) in [("stdout", &outcome.stdout), ("stderr", &outcome.stderr)].into_iter().enumerate() {
        if shares[i].is_none() {
            continue;
        }
        let path = format!("{SAVED_DIR}/{name}.txt");
        let bytes = saved_bytes(capture);
        let b = base64::engine::general_purpose::STANDARD.encode(&bytes);
        let p = path.as_str();
        let write = |id| Request::Write { id, path: p, b: &b, append: false };
        whole[i] = Some(match super::files::agent_file(session, "", write).await {
            Ok(_) if capture.dropped() > capture.tail().len() as u64 => format!(
                "read_file path={path:?} ({} bytes: the first {} and the last {} of them; the server keeps no more)",
                bytes.len(),
                capture.head().len(),
                capture.tail().len()
            ),
            Ok(_) => format!("read_file path={path:?} ({} bytes, all of it)", bytes.len()),
            Err(e) => format!("could not be saved in the workspace ({})", e.to_string().trim_start_matches(": ")),
        });
        if whole[i].as_deref().is_some_and(|w| w.starts_with("read_file")) {
            files[i] = Some(path);
        }
    }
    (whole, files)
}

/// What a failed run should be told about a notebook habit the sandbox does not serve: the
/// network in an offline session, `input()` without a stdin.
fn habit_notices(outcome: &crate::session::RunOutcome, offline: bool) -> Vec<String> {
    let mut notices = Vec::new();
    if outcome.status != crate::session::RunStatus::Error {
        return notices;
    }
    let (stderr, _) = outcome.stderr.render();
    let error = outcome.error.as_ref().map(|e| format!("{}\n{}", e.traceback, e.message)).unwrap_or_default();
    let said = format!("{stderr}\n{error}");
    notices.extend(super::habits::pip_notice(&said));
    if offline {
        notices.extend(super::habits::offline_notice(&said));
    }
    if let Some(e) = &outcome.error {
        notices.extend(super::habits::stdin_notice(&e.kind, &e.message));
    }
    notices
}

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
        notices.extend(self.registry.egress_notice(&who, &session.name));
        let timeout = check_timeout(timeout_s, session.settings())?;
        self.registry.quota_check(&who)?;
        let slot = self.registry.run_permit(&who)?;
        // A run's egress (its byte budget, its totals) counts from when it holds the session.
        let meter = self.registry.egress_meter(&who, &session.name);
        let spec = RunSpec { on_start: Some(meter.on_start()), ..spec };
        if let Some(wait) = wait {
            // A job's egress is counted like a run's: from its start to its end.
            let (registry, owner, name) = (self.registry.clone(), who.clone(), session.name.clone());
            let tally = Box::pin(async move {
                let used = meter.used().await;
                registry.charge_egress(&owner, &name, used.as_ref());
                used
            }) as crate::session::jobs::EgressTally;
            let job = self.registry.jobs.start(&who, session, spec, timeout, self.cfg.output_cap, slot, Some(tally));
            return self.await_job(&job, wait, ctx, notices).await;
        }
        let notifier = self.notifier(ctx);
        let mut live = live_channel(notifier.wants_output());
        let mut outcome = relay(
            notifier,
            &mut live.rx,
            session.run(spec, timeout, &ctx.ct, &live.observer).instrument(telemetry::step_span("run")),
        )
        .await
        .context("the run could not complete")?;
        outcome.notices.splice(0..0, notices);
        let egress = meter.used().await;
        self.registry.charge_egress(&who, &session.name, egress.as_ref());
        if let Some(e) = &egress {
            outcome.notices.extend(e.denied.iter().map(|d| format!("egress denied: {d}")));
        }
        let offline = self.registry.egress_rules(&who, &session.name).is_empty();
        outcome.notices.extend(habit_notices(&outcome, offline));
        let budget = session.settings().text_budget;
        let (whole, files) = save_whole(&session, &outcome, budget).await;
        let mut result = render_run(&session.name, &outcome, None, &View { budget, whole });
        if let Some(serde_json::Value::Object(sc)) = result.structured_content.as_mut() {
            if let Some(e) = egress {
                sc.insert("egress".into(), serde_json::to_value(e).unwrap_or_default());
            }
            for (key, path) in ["stdout_file", "stderr_file"].into_iter().zip(files) {
                if let Some(path) = path {
                    sc.insert(key.into(), path.into());
                }
            }
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
            self.registry
                .open(&who, name, environment, packages, allow_hosts, &progress)
                .instrument(telemetry::step_span("session open")),
        )
        .await;
        if !packages.is_empty() {
            self.audit_install(&who, name, packages, &opened);
        }
        Ok(opened?)
    }

    /// The audit record of an install: the requirements asked for and what came of them.
    fn audit_install(
        &self,
        who: &str,
        name: &str,
        packages: &[String],
        opened: &Result<Opened, crate::session::registry::Error>,
    ) {
        let e = crate::audit::Event::new("install", who).session(name).field("packages", packages.to_vec());
        self.registry.audit(match opened {
            Ok(o) => e
                .field("added", o.installed.added.clone())
                .field("cached", o.installed.layer.as_ref().is_some_and(|l| l.cached)),
            Err(_) => e.outcome("error"),
        });
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
    /// captured too; each stream is capped (1 MiB by default), and the text shows its head and
    /// tail within a budget, naming a file with the rest. Figures (matplotlib, display())
    /// come back as images. Notebook lines work: `%pip install x` installs x first,
    /// `%matplotlib inline` does nothing, `!cmd` runs a shell command. Runs in one session
    /// execute one at a time, in order.
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
        let habits = super::habits::rewrite(&args.code)?;
        let mut asked = args.packages.clone().unwrap_or_default();
        asked.extend(habits.packages);
        let asked = (!asked.is_empty()).then_some(asked);
        let packages = wanted_packages(asked.as_deref(), Some(&args.code), self.cfg.max_packages)?;
        let (env, session_env) = run_env(&args)?;
        let save_as = args.save_as.as_deref().map(|p| check_path(p, false)).transpose()?;
        let opened =
            self.open(&ctx, &name, args.environment.as_deref(), &packages, args.allow_hosts.as_deref()).await?;
        let session = opened.session;
        let mut notices = habits.notices;
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
        let spec = RunSpec { code: habits.code, env, ..Default::default() };
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
