//! Job tools: background runs read by offsets, waited for, cancelled and listed.

use std::sync::Arc;
use std::time::Duration;

use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::service::RequestContext;
use rmcp::{RoleServer, tool, tool_router};
use serde::{Deserialize, Serialize};

use super::error::{ToolError, ToolResult};
use super::render::{outcome_text, page, render_job, render_run_output, running_job, structured};
use super::{Caller, SandboxServer};
use crate::checks::check_wait;
use crate::protocol::Stream;
use crate::session::RunStatus;
use crate::session::jobs::{Finished, Job};

/// How often a waited-for job's new output is sent to the client.
const LIVE_POLL: Duration = Duration::from_millis(100);

/// Arguments of `job_status`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct JobStatusArgs {
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
pub(super) struct JobArgs {
    /// Job handle.
    pub job: String,
}

/// Which jobs `list_jobs` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub(super) enum JobFilter {
    /// Still running.
    Running,
    /// Finished in any way.
    Finished,
}

/// Arguments of `list_jobs`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct ListJobsArgs {
    /// Only "running" or only "finished" jobs.
    #[serde(default)]
    pub status: Option<JobFilter>,
}

/// Structured result of `job_status` and `cancel_job`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct JobStatusOutput {
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
pub(super) struct JobInfo {
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
pub(super) struct JobList {
    /// Jobs, oldest first.
    pub jobs: Vec<JobInfo>,
}

fn unknown(job: &str) -> ToolError {
    ToolError::new(format!("no job {job:?}: list_jobs shows yours (finished jobs are kept for an hour)"))
}

impl SandboxServer {
    /// The text budget of a job's session (its environment's), or the server's once the
    /// session is gone.
    pub(super) fn budget_of(&self, job: &Job) -> usize {
        self.registry.find(&job.principal, &job.session).map_or(self.cfg.text_budget, |s| s.settings().text_budget)
    }

    /// Waits up to `wait` for a job, then answers with its result or with what it has so far.
    /// A caller that cancels while waiting stops the job too: it was never handed out.
    pub(super) async fn await_job(
        &self,
        job: &Arc<Job>,
        wait: Duration,
        ctx: &RequestContext<RoleServer>,
        notices: Vec<String>,
    ) -> ToolResult {
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
        if !finished {
            // A client that declared the tasks extension gets a task for it instead (tasks.rs).
            super::tasks::TaskSlot::hand(ctx, job, &notices);
            return Ok(running_job(job, notices, self.budget_of(job)));
        }
        match job.result().as_deref() {
            Some(Finished::Outcome(o)) => {
                let mut o = o.as_ref().clone();
                o.notices.splice(0..0, notices);
                Ok(render_job(job, &o, self.budget_of(job)))
            }
            Some(Finished::Failed(e)) => Err(format!("the run could not complete: {e}").into()),
            None => Err("the job ended without a result".into()),
        }
    }

    /// A job's output since the offsets, a page of it within the budget (the offsets returned
    /// go on from where the page ends), its status, and once finished its result.
    fn job_status_of(&self, job: &Job, stdout_offset: usize, stderr_offset: usize) -> CallToolResult {
        let budget = self.budget_of(job);
        let (stdout, stderr, _, _) = job.output_since(stdout_offset, stderr_offset);
        let (stdout, so, out_left) = page(stdout, stdout_offset, budget / 2);
        let (stderr, se, err_left) = page(stderr, stderr_offset, budget / 4);
        let finished = job.result();
        let rendered = match finished.as_deref() {
            Some(Finished::Outcome(o)) => Some(render_job(job, o, budget)),
            _ => None,
        };
        let out = JobStatusOutput {
            job: job.id.clone(),
            session: job.session.clone(),
            status: job.status(),
            stdout,
            stderr,
            stdout_offset: so,
            stderr_offset: se,
            elapsed_s: (job.age().as_secs_f64() * 10.0).round() / 10.0,
            result: rendered.as_ref().and_then(|r| r.structured_content.clone()),
        };
        let mut text = String::new();
        if out_left + err_left > 0 {
            text.push_str(&format!(
                "[output cut to fit {budget} characters: {out_left} more bytes of stdout and {err_left} of stderr; \
                 call job_status with stdout_offset {so} and stderr_offset {se} to read on]\n"
            ));
        }
        text.push_str(&out.stdout);
        if !out.stderr.is_empty() {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&format!("[stderr]\n{}", out.stderr));
        }
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        match finished.as_deref() {
            None => text.push_str(&format!(
                "[status] {} still running after {:.1} s; next offsets: stdout {so}, stderr {se}\n",
                job.id, out.elapsed_s
            )),
            Some(Finished::Failed(e)) => text.push_str(&format!("[status] the run could not complete: {e}\n")),
            // Rendered as a run's result is: the value, the traceback, the status, the notices.
            Some(Finished::Outcome(o)) => {
                let run = render_run_output(&job.session, o, Some(&job.id), budget);
                let tail = outcome_text(&run, budget);
                text.push_str(if tail.is_empty() { "[status] ok\n" } else { &tail });
            }
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
    async fn job_status(&self, Parameters(args): Parameters<JobStatusArgs>, Caller(who): Caller) -> ToolResult {
        let job = self.registry.jobs.get(&who, &args.job).ok_or_else(|| unknown(&args.job))?;
        if let Some(w) = check_wait(args.wait_s, false, &self.cfg)? {
            job.wait(w).await;
        }
        Ok(self.job_status_of(&job, args.stdout_offset, args.stderr_offset))
    }

    /// Stop a background job: its code gets KeyboardInterrupt, and is killed if it does not
    /// stop within a second (then the session's variables are lost). Returns its final status.
    #[tool(annotations(title = "Cancel job", destructive_hint = true), output_schema = schema_for_output::<JobStatusOutput>())]
    async fn cancel_job(&self, Parameters(args): Parameters<JobArgs>, Caller(who): Caller) -> ToolResult {
        let job = self.registry.jobs.get(&who, &args.job).ok_or_else(|| unknown(&args.job))?;
        job.cancel.cancel();
        let limit = self.cfg.grace() + Duration::from_secs(30);
        if !job.wait(limit).await {
            return Err(format!("{} did not stop within {} s", job.id, limit.as_secs()).into());
        }
        Ok(self.job_status_of(&job, 0, 0))
    }

    /// List your background jobs (running and recently finished) with their status.
    #[tool(annotations(title = "List jobs", read_only_hint = true), output_schema = schema_for_output::<JobList>())]
    async fn list_jobs(&self, Parameters(args): Parameters<ListJobsArgs>, Caller(who): Caller) -> ToolResult {
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
            jobs.iter().map(|j| format!("{}\t{}\t{}\t{:.1} s\n", j.job, j.session, j.status, j.elapsed_s)).collect();
        if jobs.is_empty() {
            text.push_str("no jobs\n");
        }
        Ok(structured(&JobList { jobs }, text))
    }
}
