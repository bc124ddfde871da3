//! Tool results as a model reads them: text first, structured content beside it, images last.

use rmcp::model::{CallToolResult, ContentBlock};
use serde::Serialize;

use super::budget::{self, StreamText};
use super::types::RunOutput;
use crate::session::jobs::Job;
use crate::session::{RunOutcome, RunStatus};

/// How a run's text is sized for a model: the budget in characters, and where the whole of
/// each stream (stdout, stderr) can be read when its text is cut.
#[derive(Debug, Clone)]
pub(crate) struct View {
    /// Characters of text (the session's `text_budget`).
    pub budget: usize,
    /// For stdout and stderr: how to read the whole stream, said in the top line.
    pub whole: [Option<String>; 2],
}

impl View {
    /// A view whose cut streams are not saved anywhere.
    #[cfg(test)]
    pub(crate) fn new(budget: usize) -> Self {
        Self { budget, whole: [None, None] }
    }
}

/// The streams of a run, and which of them its budget cuts (their share of characters).
pub(crate) fn stream_plan(outcome: &RunOutcome, budget: usize) -> ([StreamText; 2], [Option<usize>; 2]) {
    let streams = [StreamText::of("stdout", &outcome.stdout), StreamText::of("stderr", &outcome.stderr)];
    let out = render_run_output("", outcome, None, budget);
    let fixed = outcome_text(&out, budget).chars().count();
    let shares = budget::plan(&streams, fixed, budget);
    (streams, shares)
}

/// A run's structured content. A final value longer than a fifth of the budget keeps its
/// head and tail (`truncated` says so).
pub(super) fn render_run_output(session: &str, outcome: &RunOutcome, job: Option<&str>, budget: usize) -> RunOutput {
    let (stdout, stdout_base64) = outcome.stdout.render();
    let (stderr, stderr_base64) = outcome.stderr.render();
    let (result, result_cut) = match &outcome.result {
        // The agent cuts a repr past 65536 characters with a note of its own.
        Some(r) => {
            let (r2, cut) = budget::cut_text(r, budget / 5, "the value");
            (Some(r2), cut || r.ends_with(" characters truncated]"))
        }
        None => (None, false),
    };
    RunOutput {
        session: session.to_owned(),
        status: outcome.status,
        truncated: outcome.stdout.dropped() > 0 || outcome.stderr.dropped() > 0 || result_cut,
        stdout,
        stderr,
        stdout_base64,
        stderr_base64,
        result,
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
        stdout_file: None,
        stderr_file: None,
        tool_calls: Some(outcome.tool_calls).filter(|c| *c != crate::bridge::CallCounts::default()),
    }
}

/// Renders a run as readable text within the view's budget, plus structured content. A cut
/// result starts with one line saying how much was cut and where the whole is.
pub(crate) fn render_run(session: &str, outcome: &RunOutcome, job: Option<&str>, view: &View) -> CallToolResult {
    let images = outcome.images.clone();
    let mut out = render_run_output(session, outcome, job, view.budget);
    let (streams, shares) = stream_plan(outcome, view.budget);
    let mut cuts = Vec::new();
    let mut body = String::new();
    for (i, s) in streams.iter().enumerate() {
        if s.is_empty() {
            continue;
        }
        let (text, cut) = budget::cut_stream(s, shares[i]);
        if i == 1 {
            if !body.is_empty() && !body.ends_with('\n') {
                body.push('\n');
            }
            body.push_str("[stderr]\n");
        }
        body.push_str(&text);
        if let Some(c) = cut {
            cuts.push((s.name, c, view.whole[i].as_deref().unwrap_or("not kept beyond what is shown")));
        }
    }
    if !body.is_empty() && !body.ends_with('\n') {
        body.push('\n');
    }
    let mut text = String::new();
    if !cuts.is_empty() {
        out.truncated = true;
        text.push_str(&budget::top_line(view.budget, &cuts));
    }
    text.push_str(&body);
    text.push_str(&outcome_text(&out, view.budget));
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
/// the status and the notices. The traceback and the notices each keep to a fifth of the
/// budget (a traceback its head and tail: the exception is at its end).
pub(super) fn outcome_text(out: &RunOutput, budget: usize) -> String {
    let mut text = String::new();
    if let Some(r) = &out.result {
        text.push_str(&format!("[result] {r}\n"));
    }
    if let Some(e) = &out.error {
        text.push_str(&budget::cut_text(&e.traceback, budget / 5, "the traceback").0);
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        if !e.message.is_empty() && !e.traceback.contains(&e.message) {
            let kind = if e.kind.is_empty() { "error" } else { e.kind.as_str() };
            let message = budget::cut_text(&e.message, budget / 10, "the message").0;
            text.push_str(&format!("[error] {kind}: {message}\n"));
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
    let mut room = budget / 5;
    for (i, n) in out.notices.iter().enumerate() {
        let line = format!("[notice] {}\n", budget::cut_text(n, budget / 10, "the notice").0);
        if line.chars().count() > room {
            text.push_str(&format!("[{} more notices in structuredContent.notices]\n", out.notices.len() - i));
            break;
        }
        room -= line.chars().count();
        text.push_str(&line);
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

/// A finished job's result as a run's: with its `egress` totals when its session has egress.
/// A stream its text cuts is read whole from the job's record, by offsets.
pub(super) fn render_job(job: &Job, o: &RunOutcome, budget: usize) -> CallToolResult {
    let whole = |name: &str, c: &crate::output::Capture| {
        Some(format!(
            "job_status job={:?} {name}_offset=0 and on (the job keeps its first {} bytes)",
            job.id,
            c.head().len()
        ))
    };
    let view = View { budget, whole: [whole("stdout", &o.stdout), whole("stderr", &o.stderr)] };
    let mut result = render_run(&job.session, o, Some(&job.id), &view);
    if let (Some(e), Some(serde_json::Value::Object(sc))) = (job.egress(), result.structured_content.as_mut()) {
        sc.insert("egress".into(), serde_json::to_value(e).unwrap_or_default());
    }
    result
}

/// The answer for a job still running when its caller stopped waiting: what it printed so far
/// (a page of it within the budget), and how to read on.
pub(super) fn running_job(job: &Job, notices: Vec<String>, budget: usize) -> CallToolResult {
    let (stdout, stderr, _, _) = job.output_since(0, 0);
    let (stdout, so, out_left) = page(stdout, 0, budget / 2);
    let (stderr, se, err_left) = page(stderr, 0, budget / 4);
    let out = RunOutput {
        session: job.session.clone(),
        status: RunStatus::Running,
        stdout,
        stderr,
        stdout_base64: None,
        stderr_base64: None,
        result: None,
        error: None,
        exit_code: None,
        duration_ms: (job.age().as_secs_f64() * 1e3).round(),
        cpu_ms: None,
        truncated: out_left + err_left > 0,
        state_lost: false,
        notices,
        images: 0,
        peak_memory_kb: None,
        job: Some(job.id.clone()),
        stdout_offset: Some(so),
        stderr_offset: Some(se),
        egress: None,
        stdout_file: None,
        stderr_file: None,
        tool_calls: None,
    };
    let mut text = String::new();
    if out.truncated {
        text.push_str(&format!(
            "[output cut to fit {budget} characters: {out_left} more bytes of stdout and {err_left} of stderr so far]\n"
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
    text.push_str(&format!(
        "[status] running as {}: call job_status with stdout_offset {so} and stderr_offset {se} for newer output, \
         cancel_job to stop it\n",
        job.id
    ));
    for n in &out.notices {
        text.push_str(&format!("[notice] {}\n", budget::cut_text(n, budget / 10, "the notice").0));
    }
    structured(&out, text)
}

/// `bytes` past `offset` within `keep` characters' worth, cut at a character's start, and
/// the offset after what is kept.
pub(super) fn page(bytes: Vec<u8>, offset: usize, keep: usize) -> (String, usize, usize) {
    let mut end = bytes.len().min(keep);
    let mut back = 0;
    while end > 0 && end < bytes.len() && back < 3 && (0x80..0xc0).contains(&bytes[end]) {
        end -= 1;
        back += 1;
    }
    (String::from_utf8_lossy(&bytes[..end]).into_owned(), offset + end, bytes.len() - end)
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
        let ok = render_run("s", &outcome(RunStatus::Ok), None, &View::new(20_000));
        assert_eq!(ok.is_error, Some(false));
        let sc = ok.structured_content.expect("structured");
        assert_eq!(sc["stdout"], "hi\n");
        assert_eq!(sc["result"], "42");
        assert_eq!(sc["status"], "ok");
        assert_eq!(sc["truncated"], false);
        assert_eq!(sc["peak_memory_kb"], 2048);
        let running = render_run("s", &outcome(RunStatus::Running), Some("job-1"), &View::new(20_000));
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
            let r = render_run("s", &outcome(s), None, &View::new(20_000));
            assert_eq!(r.is_error, Some(true), "{s:?}");
            assert!(r.structured_content.is_some());
        }
    }
}
