//! Tool results as a model reads them: text first, structured content beside it, images last.

use rmcp::model::{CallToolResult, ContentBlock};
use serde::Serialize;

use super::types::RunOutput;
use crate::session::jobs::Job;
use crate::session::{RunOutcome, RunStatus};

/// A run's structured content.
pub(super) fn render_run_output(session: &str, outcome: &RunOutcome, job: Option<&str>) -> RunOutput {
    let (stdout, stdout_base64) = outcome.stdout.render();
    let (stderr, stderr_base64) = outcome.stderr.render();
    RunOutput {
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
        images: outcome.images.len(),
        peak_memory_kb: outcome.peak_memory_kb,
        job: job.map(str::to_owned),
        stdout_offset: None,
        stderr_offset: None,
        egress: None,
        tool_calls: Some(outcome.tool_calls).filter(|c| *c != crate::bridge::CallCounts::default()),
    }
}

/// Renders a run as readable text plus structured content.
pub(crate) fn render_run(session: &str, outcome: &RunOutcome, job: Option<&str>) -> CallToolResult {
    let images = outcome.images.clone();
    let out = render_run_output(session, outcome, job);
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
    text.push_str(&outcome_text(&out));
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

/// What a model must read of a finished run besides its output: the final value, the error
/// (its message too when the traceback does not carry it: a missing script, an exit status),
/// the status and the notices.
pub(super) fn outcome_text(out: &RunOutput) -> String {
    let mut text = String::new();
    if let Some(r) = &out.result {
        text.push_str(&format!("[result] {r}\n"));
    }
    if let Some(e) = &out.error {
        text.push_str(&e.traceback);
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        if !e.message.is_empty() && !e.traceback.contains(&e.message) {
            let kind = if e.kind.is_empty() { "error" } else { e.kind.as_str() };
            text.push_str(&format!("[error] {kind}: {}\n", e.message));
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
    if let Some(c) = &out.tool_calls {
        text.push_str(&format!("[tool calls] {} made, {} refused\n", c.made, c.refused));
    }
    text
}

pub(super) fn structured<T: Serialize>(value: &T, text: String) -> CallToolResult {
    let mut result = CallToolResult::structured(serde_json::to_value(value).unwrap_or_default());
    result.content = vec![ContentBlock::text(text)];
    result
}

/// The answer for a job still running when its caller stopped waiting: what it printed so far,
/// and how to read on.
pub(super) fn running_job(job: &Job, notices: Vec<String>) -> CallToolResult {
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
        egress: None,
        tool_calls: None,
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

#[cfg(test)]
mod tests {

    use super::*;

    fn outcome(status: RunStatus) -> RunOutcome {
        let mut stdout = crate::output::Capture::new(1024);
        stdout.push(b"hi\n");
        RunOutcome {
            status,
            stdout,
            result: Some("42".into()),
            cpu_ms: Some(1.0),
            peak_memory_kb: Some(2048),
            ..RunOutcome::new(1024)
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
