//! Job tools: background runs read by offsets, waited for, cancelled and listed.

use std::sync::Arc;
use std::time::Duration;

use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::service::RequestContext;
use rmcp::{RoleServer, tool, tool_router};
use serde::{Deserialize, Serialize};

use super::{Caller, RunOutput, SandboxServer, live_channel, principal_of, relay, render_run, structured, tool_error};
use crate::config::SandboxConfig;
use crate::protocol::Stream;
use crate::session::jobs::{Finished, Job, JobSpec};
use crate::session::{RunSpec, RunStatus, Session};

/// How often a waited-for job's new output is sent to the client.
const LIVE_POLL: Duration = Duration::from_millis(100);

/// How a run call waits: `None` to the end, or up to a limit before answering with a job handle.
pub(super) fn check_wait(
    wait_s: Option<f64>,
    background: bool,
    cfg: &SandboxConfig,
) -> Result<Option<Duration>, String> {
    match (wait_s, background) {
        (Some(_), true) => Err("give wait_s or background, not both (background is wait_s 0)".into()),
        (None, true) => Ok(Some(Duration::ZERO)),
        (None, false) => Ok(None),
        (Some(w), false) if w.is_finite() && (0.0..=cfg.max_timeout_s as f64).contains(&w) => {
            Ok(Some(Duration::from_secs_f64(w)))
        }
        (Some(w), false) => Err(format!("wait_s {w} is out of range: give seconds from 0 to {}", cfg.max_timeout_s)),
    }
}

/// Arguments of `job_status`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobStatusArgs {
    /// Job handle from run_python (wait_s or background).
    pub job: String,
    /// Return stdout from this byte offset on (the stdout_offset of the previous answer).
    #[serde(default)]
    pub stdout_offset: usize,
    /// Return stderr from this byte offset on.
    #[serde(default)]
    pub stderr_offset: usize,
    /// Wait up to this many seconds for the job to finish before answering (default 0).
    #[serde(default)]
    pub wait_s: Option<f64>,
}

/// Arguments of `cancel_job`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobArgs {
    /// Job handle.
    pub job: String,
}

/// Which jobs `list_jobs` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobFilter {
    /// Still running.
    Running,
    /// Finished in any way.
    Finished,
}

/// Arguments of `list_jobs`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListJobsArgs {
    /// Only "running" or only "finished" jobs.
    #[serde(default)]
    pub status: Option<JobFilter>,
}

/// Structured result of `job_status` and `cancel_job`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct JobStatusOutput {
    /// Job handle.
    pub job: String,
    /// Session it runs in.
    pub session: String,
    /// running, or how it ended.
    pub status: RunStatus,
    /// stdout after stdout_offset.
    pub stdout: String,
    /// stderr after stderr_offset.
    pub stderr: String,
    /// Offset to pass next time for newer stdout.
    pub stdout_offset: usize,
    /// Offset to pass next time for newer stderr.
    pub stderr_offset: usize,
    /// Seconds since the job started.
    pub elapsed_s: f64,
    /// The full result, once finished.
    pub result: Option<serde_json::Value>,
}

/// One entry of `list_jobs`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct JobInfo {
    /// Job handle.
    pub job: String,
    /// Session.
    pub session: String,
    /// Status.
    pub status: RunStatus,
    /// Seconds since start.
    pub elapsed_s: f64,
}

/// Structured result of `list_jobs`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct JobList {
    /// Jobs, oldest first.
    pub jobs: Vec<JobInfo>,
}

fn unknown(job: &str) -> CallToolResult {
    tool_error(format!("no job {job:?}: list_jobs shows yours (finished jobs are kept for an hour)"))
}

impl SandboxServer {
    /// Runs in a session: to the end with live output, or as a job waited for up to `wait`.
    pub(super) async fn execute(
        &self,
        ctx: &RequestContext<RoleServer>,
        session: Arc<Session>,
        spec: JobSpec,
        timeout: Duration,
        wait: Option<Duration>,
        notices: Vec<String>,
    ) -> CallToolResult {
        let who = principal_of(ctx);
        let slot = match self.registry.run_permit(&who) {
            Ok(s) => s,
            Err(e) => return tool_error(e),
        };
        if let Some(wait) = wait {
            let job = self.registry.jobs.start(&who, session, spec, timeout, self.cfg.output_cap, slot);
            return self.await_job(&job, wait, ctx, notices).await;
        }
        let notifier = self.notifier(ctx);
        let mut live = live_channel(notifier.wants_output());
        let run = RunSpec { code: &spec.code, file: spec.file.as_deref(), args: &spec.args, cmd: &[], env: spec.env };
        match relay(notifier, &mut live.rx, session.run(run, timeout, &ctx.ct, &live.observer)).await {
            Ok(mut outcome) => {
                outcome.notices.splice(0..0, notices);
                render_run(&session.name, &outcome, None)
            }
            Err(e) => {
                tracing::warn!(session = %session.name, error = %e, "run failed");
                tool_error(format!("the run could not complete: {e}"))
            }
        }
    }

    /// Waits up to `wait` for a job, then answers with its result or with what it has so far.
    /// A caller that cancels while waiting stops the job too: it was never handed out.
    pub(super) async fn await_job(
        &self,
        job: &Arc<Job>,
        wait: Duration,
        ctx: &RequestContext<RoleServer>,
        notices: Vec<String>,
    ) -> CallToolResult {
        let deadline = tokio::time::Instant::now() + wait;
        let mut notifier = self.notifier(ctx);
        let (mut so, mut se) = (0, 0);
        // The job's output reaches this caller live while it waits, polled from the job's buffer.
        let finished = loop {
            let step = deadline.saturating_duration_since(tokio::time::Instant::now()).min(LIVE_POLL);
            let done = tokio::select! {
                f = job.wait(step) => f,
                _ = ctx.ct.cancelled() => {
                    job.cancel.cancel();
                    break job.wait(self.cfg.grace() + Duration::from_secs(30)).await;
                }
            };
            if done || tokio::time::Instant::now() >= deadline {
                break done;
            }
            let (out, err, nso, nse) = job.output_since(so, se);
            (so, se) = (nso, nse);
            for (stream, bytes) in [(Stream::Stdout, out), (Stream::Stderr, err)] {
                if !bytes.is_empty() {
                    notifier.output(stream, String::from_utf8_lossy(&bytes).into_owned()).await;
                }
            }
        };
        if finished {
            return match job.result().as_deref() {
                Some(Finished::Outcome(o)) => {
                    let mut o = o.as_ref().clone();
                    o.notices.splice(0..0, notices);
                    render_run(&job.session, &o, Some(&job.id))
                }
                Some(Finished::Failed(e)) => tool_error(format!("the run could not complete: {e}")),
                None => tool_error("the job ended without a result"),
            };
        }
        let (stdout, stderr, so, se) = job.output_since(0, 0);
        let out = RunOutput {
            session: job.session.clone(),
            status: RunStatus::Running,
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            stdout_base64: None,
            stderr_base64: None,
            result: None,
            error: None,
            exit_code: None,
            duration_ms: (job.age().as_secs_f64() * 1e3).round(),
            cpu_ms: None,
            truncated: false,
            state_lost: false,
            notices,
            images: 0,
            peak_memory_kb: None,
            job: Some(job.id.clone()),
            stdout_offset: Some(so),
            stderr_offset: Some(se),
        };
        let mut text = out.stdout.clone();
        if !out.stderr.is_empty() {
            text.push_str(&format!("[stderr]\n{}", out.stderr));
        }
        text.push_str(&format!(
            "[status] running as {}: call job_status with stdout_offset {so} and stderr_offset {se} for newer output, \
             cancel_job to stop it\n",
            job.id
        ));
        structured(&out, text)
    }

    fn job_status_of(&self, job: &Job, stdout_offset: usize, stderr_offset: usize) -> CallToolResult {
        let (stdout, stderr, so, se) = job.output_since(stdout_offset, stderr_offset);
        let finished = job.result();
        let rendered = match finished.as_deref() {
            Some(Finished::Outcome(o)) => Some(render_run(&job.session, o, Some(&job.id))),
            _ => None,
        };
        let out = JobStatusOutput {
            job: job.id.clone(),
            session: job.session.clone(),
            status: job.status(),
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            stdout_offset: so,
            stderr_offset: se,
            elapsed_s: (job.age().as_secs_f64() * 10.0).round() / 10.0,
            result: rendered.as_ref().and_then(|r| r.structured_content.clone()),
        };
        let mut text = out.stdout.clone();
        if !out.stderr.is_empty() {
            text.push_str(&format!("[stderr]\n{}", out.stderr));
        }
        match finished.as_deref() {
            None => text.push_str(&format!(
                "[status] {} still running after {:.1} s; next offsets: stdout {so}, stderr {se}\n",
                job.id, out.elapsed_s
            )),
            Some(Finished::Failed(e)) => text.push_str(&format!("[status] the run could not complete: {e}\n")),
            Some(Finished::Outcome(_)) => text.push_str(&format!("[status] {:?}; full result in result\n", out.status)),
        }
        let mut result = structured(&out, text);
        if let Some(r) = rendered {
            result.content.extend(r.content.into_iter().filter(|c| c.as_image().is_some()));
        }
        result
    }
}

#[tool_router(router = jobs_router, vis = "pub(super)")]
impl SandboxServer {
    /// Read a background job: the output since the given offsets, its status and, once it has
    /// finished, its full result. Optionally wait up to wait_s for it to finish first.
    #[tool(annotations(title = "Job status", read_only_hint = true), output_schema = schema_for_output::<JobStatusOutput>())]
    async fn job_status(&self, Parameters(args): Parameters<JobStatusArgs>, Caller(who): Caller) -> CallToolResult {
        let Some(job) = self.registry.jobs.get(&who, &args.job) else { return unknown(&args.job) };
        match check_wait(args.wait_s, false, &self.cfg) {
            Ok(Some(w)) => _ = job.wait(w).await,
            Ok(None) => {}
            Err(e) => return tool_error(e),
        }
        self.job_status_of(&job, args.stdout_offset, args.stderr_offset)
    }

    /// Stop a background job: its code gets KeyboardInterrupt, and is killed if it does not
    /// stop within a second (then the session's variables are lost). Returns its final status.
    #[tool(annotations(title = "Cancel job", destructive_hint = true), output_schema = schema_for_output::<JobStatusOutput>())]
    async fn cancel_job(&self, Parameters(args): Parameters<JobArgs>, Caller(who): Caller) -> CallToolResult {
        let Some(job) = self.registry.jobs.get(&who, &args.job) else { return unknown(&args.job) };
        job.cancel.cancel();
        let limit = self.cfg.grace() + Duration::from_secs(30);
        if !job.wait(limit).await {
            return tool_error(format!("{} did not stop within {} s", job.id, limit.as_secs()));
        }
        self.job_status_of(&job, 0, 0)
    }

    /// List your background jobs (running and recently finished) with their status.
    #[tool(annotations(title = "List jobs", read_only_hint = true), output_schema = schema_for_output::<JobList>())]
    async fn list_jobs(&self, Parameters(args): Parameters<ListJobsArgs>, Caller(who): Caller) -> CallToolResult {
        let jobs: Vec<JobInfo> = self
            .registry
            .jobs
            .list(&who)
            .iter()
            .filter(|j| match args.status {
                None => true,
                Some(JobFilter::Running) => !j.is_finished(),
                Some(JobFilter::Finished) => j.is_finished(),
            })
            .map(|j| JobInfo {
                job: j.id.clone(),
                session: j.session.clone(),
                status: j.status(),
                elapsed_s: (j.age().as_secs_f64() * 10.0).round() / 10.0,
            })
            .collect();
        let mut text: String =
            jobs.iter().map(|j| format!("{}\t{}\t{:?}\t{:.1} s\n", j.job, j.session, j.status, j.elapsed_s)).collect();
        if jobs.is_empty() {
            text.push_str("no jobs\n");
        }
        structured(&JobList { jobs }, text)
    }
}
