//! MCP Tasks (the extension `io.modelcontextprotocol/tasks`, SEP-2663) over our jobs.
//!
//! A client that declares the extension (in the request's `_meta` capabilities on 2026-07-28,
//! or at `initialize` before it; rmcp's `client_capabilities()` reads both) gets a task where
//! any other client gets a running job's handle: when a run outlives its `wait_s`, or asks for
//! the background. The task id IS the job id, so a task lives exactly as long as its job: it
//! survives a server restart (the job is followed or kept, `session/jobs_kept.rs`) and is
//! another principal's no more than the job is. We serve `tasks/get` and `tasks/cancel`
//! from the jobs table rather than rmcp's in-memory `TaskManager`, which a restart empties.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rmcp::ErrorData;
use rmcp::RoleServer;
use rmcp::model::{
    CallToolResult, CancelTaskParams, ContentBlock, CreateTaskResult, DetailedTask, GetTaskParams, GetTaskResult,
    JsonObject, MetaObject, Task, TaskPayload, TaskStatus,
};
use rmcp::service::RequestContext;

use super::{SandboxServer, principal_of};
use crate::session::RunStatus;
use crate::session::jobs::{Finished, Job, KEEP_FINISHED};

/// How often a client should poll `tasks/get` (a hint; output arrives continuously).
const POLL_INTERVAL_MS: u64 = 1000;

/// The `_meta` key of a task's job facts (a prefix of our own, as `_meta` keys allow).
const JOB_META: &str = "pyberth/job";

/// Put in a `tools/call`'s extensions when its request declared the extension: a run that
/// goes to the background leaves its job here, and the call answers with a task for it.
#[derive(Clone, Default)]
pub(super) struct TaskSlot(Arc<Mutex<Option<Handed>>>);

/// A job handed to a call, with the notices its classic answer would have carried.
type Handed = (Arc<Job>, Vec<String>);

impl TaskSlot {
    /// Offers a task to this call if, and only if, its request declared the extension.
    pub(super) fn offer(ctx: &mut RequestContext<RoleServer>) -> Option<TaskSlot> {
        let declared = ctx.client_capabilities().is_some_and(|c| c.supports_tasks());
        declared.then(|| {
            let slot = TaskSlot::default();
            ctx.extensions.insert(slot.clone());
            slot
        })
    }

    /// Called where a classic client is handed a running job's handle.
    pub(super) fn hand(ctx: &RequestContext<RoleServer>, job: &Arc<Job>, notices: &[String]) {
        if let Some(slot) = ctx.extensions.get::<TaskSlot>()
            && let Ok(mut s) = slot.0.lock()
        {
            *s = Some((job.clone(), notices.to_vec()));
        }
    }

    /// The task to answer with, when a job was handed.
    pub(super) fn take(&self) -> Option<CreateTaskResult> {
        let (job, notices) = self.0.lock().ok()?.take()?;
        let mut task = task_of(&job, TaskStatus::Working);
        let mut message = notices.join("\n");
        if !message.is_empty() {
            message.push('\n');
        }
        message.push_str(&format!("{} runs in session {:?}; poll tasks/get", job.id, job.session));
        task.status_message = Some(message);
        Some(CreateTaskResult::new(task))
    }
}

impl std::fmt::Debug for TaskSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskSlot").finish_non_exhaustive()
    }
}

/// A wall-clock time `ago` before now.
fn before_now(ago: Duration) -> SystemTime {
    SystemTime::now().checked_sub(ago).unwrap_or(UNIX_EPOCH)
}

/// The base fields of a job's task. The TTL runs from creation: a finished job is kept an
/// hour after its end, so a running one is kept at least an hour past now.
fn task_of(job: &Job, status: TaskStatus) -> Task {
    let age = job.age();
    let (updated, ttl) = match job.finished_ago() {
        Some(ago) => (before_now(ago), age.saturating_sub(ago) + KEEP_FINISHED),
        None => (SystemTime::now(), age + KEEP_FINISHED),
    };
    let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    Task::new(&job.id, status, iso8601(before_now(age)), iso8601(updated))
        .with_ttl_ms(ttl_ms)
        .with_poll_interval_ms(POLL_INTERVAL_MS)
}

/// The last `keep` bytes of `bytes`, starting at a character's start, as text.
fn tail(bytes: &[u8], keep: usize) -> String {
    let mut start = bytes.len().saturating_sub(keep);
    let mut forward = 0;
    while start < bytes.len() && forward < 3 && (0x80..0xc0).contains(&bytes[start]) {
        start += 1;
        forward += 1;
    }
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

/// What a job printed so far, its newest part within the text budget (half for stdout, a
/// quarter for stderr, as `job_status` pages), and where the rest is.
fn output_so_far(job: &Job, budget: usize) -> String {
    let (stdout, stderr, _, _) = job.output_since(0, 0);
    let mut text = format!(
        "{} in session {:?}, {:.1} s: {} bytes of stdout, {} of stderr so far",
        job.id,
        job.session,
        job.age().as_secs_f64(),
        stdout.len(),
        stderr.len()
    );
    let out = tail(&stdout, budget / 2);
    let err = tail(&stderr, budget / 4);
    if out.len() < stdout.len() || err.len() < stderr.len() {
        text.push_str(&format!(" (the newest shown; job_status job={:?} stdout_offset=0 reads all of it)", job.id));
    }
    text.push('\n');
    text.push_str(&out);
    if !err.is_empty() {
        if !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str("[stderr]\n");
        text.push_str(&err);
    }
    text
}

/// A result as the `result` of a completed task (the `CallToolResult` the call would have had).
fn as_object(result: CallToolResult) -> JsonObject {
    match serde_json::to_value(super::fit::fit(result, super::fit::BUDGET)) {
        Ok(serde_json::Value::Object(o)) => o,
        _ => JsonObject::new(),
    }
}

impl SandboxServer {
    /// `tasks/get`: a running job's output so far, or its result once it has ended. Another
    /// principal's job is answered as a missing one is.
    pub(super) fn task_get(
        &self,
        request: GetTaskParams,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        let who = principal_of(ctx);
        let Some(job) = self.registry.jobs.get(&who, &request.task_id) else {
            return Err(ErrorData::invalid_params(
                format!("no task {:?}: tasks are kept for an hour after they end", request.task_id),
                None,
            ));
        };
        let budget = self.budget_of(&job);
        let (status, payload, message) = match job.result().as_deref() {
            None => (TaskStatus::Working, TaskPayload::Working, output_so_far(&job, budget)),
            Some(Finished::Outcome(o)) if o.status == RunStatus::Cancelled => {
                (TaskStatus::Cancelled, TaskPayload::Cancelled, output_so_far(&job, budget))
            }
            Some(Finished::Outcome(o)) => {
                let result = as_object(super::render::render_job(&job, o, budget));
                (TaskStatus::Completed, TaskPayload::Completed { result }, format!("{} ended: {}", job.id, o.status))
            }
            // As the classic call says it: a tool error the model reads, in a completed task.
            Some(Finished::Failed(e)) => {
                let why = format!("the run could not complete: {e}");
                let result = as_object(CallToolResult::error(vec![ContentBlock::text(why.clone())]));
                (TaskStatus::Completed, TaskPayload::Completed { result }, why)
            }
        };
        let task = task_of(&job, status).with_status_message(message);
        let mut answer = GetTaskResult::new(DetailedTask::new(task, payload));
        let (_, _, stdout_bytes, stderr_bytes) = job.output_since(usize::MAX, usize::MAX);
        let facts = serde_json::json!({
            "job": job.id, "session": job.session, "status": job.status(),
            "stdout_bytes": stdout_bytes, "stderr_bytes": stderr_bytes,
            "elapsed_s": (job.age().as_secs_f64() * 10.0).round() / 10.0,
        });
        let mut meta = MetaObject::new();
        meta.0.insert(JOB_META.into(), facts);
        answer.meta = Some(meta);
        Ok(answer)
    }

    /// `tasks/cancel`: stops the job as `cancel_job` does (an interrupt, then a kill). The ack
    /// is the same for any id (SEP-2663), so it tells no one whether another's task exists.
    pub(super) fn task_cancel(&self, request: &CancelTaskParams, ctx: &RequestContext<RoleServer>) {
        let who = principal_of(ctx);
        if let Some(job) = self.registry.jobs.get(&who, &request.task_id) {
            job.cancel.cancel();
        }
    }
}

/// `t` as an RFC 3339 UTC timestamp with milliseconds: the audit log's clock, one for both.
pub(super) use crate::audit::time::rfc3339 as iso8601;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(iso8601(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        // Values from `date -u -d @N`: the leap day of a century divisible by 400, the day after.
        assert_eq!(iso8601(UNIX_EPOCH + Duration::from_millis(951_782_400_250)), "2000-02-29T00:00:00.250Z");
        assert_eq!(iso8601(UNIX_EPOCH + Duration::from_secs(951_868_800)), "2000-03-01T00:00:00.000Z");
        assert_eq!(iso8601(UNIX_EPOCH + Duration::from_secs(1_795_694_399)), "2026-11-26T11:59:59.000Z");
        assert_eq!(iso8601(UNIX_EPOCH + Duration::from_secs(1_709_164_800)), "2024-02-29T00:00:00.000Z");
    }

    #[test]
    fn the_tail_starts_at_a_character() {
        let text = "ab€cd".as_bytes(); // € is 3 bytes
        assert_eq!(tail(text, 4), "cd", "a cut inside € moves past it, never into it");
        assert_eq!(tail(text, 5), "€cd");
        assert_eq!(tail(text, 100), "ab€cd");
        assert_eq!(tail(b"", 10), "");
    }
}
