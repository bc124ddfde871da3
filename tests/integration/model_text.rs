//! What a text-only client reads (issue 28: most clients show the model only the text of a
//! result): the reason of every failed `run_file`, and the value and traceback of a finished job.

use serde_json::json;

use crate::common::{Server, text};
use crate::jobs::finished;

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_run_file_says_why_in_its_text() {
    let s = Server::start("model-text-file", &[]).await;
    s.ok("default", "open('exit4.py', 'w').write('raise SystemExit(4)\\n')").await;
    let missing = s.call("run_file", json!({ "path": "nothere.py" })).await;
    assert_eq!(missing.is_error, Some(true), "{}", text(&missing));
    let said = text(&missing);
    assert!(said.contains("nothere.py"), "the reason is in the text: {said}");
    let exit = s.call("run_file", json!({ "path": "exit4.py" })).await;
    assert_eq!(exit.is_error, Some(true), "{}", text(&exit));
    let message = exit.structured_content.as_ref().and_then(|sc| sc["error"]["message"].as_str()).unwrap_or_default();
    assert!(!message.is_empty(), "{exit:?}");
    assert!(text(&exit).contains(message), "the error's message is in the text: {}", text(&exit));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_job_reads_as_a_run_in_its_text() {
    let s = Server::start("model-text-job", &[]).await;
    let (_, sc) = s.run_with(json!({ "code": "import time\ntime.sleep(1)\n6 * 7", "background": true })).await;
    let job = sc["job"].as_str().expect("job").to_owned();
    assert_eq!(finished(&s, &job).await["status"], "ok");
    let r = s.call("job_status", json!({ "job": job })).await;
    assert!(text(&r).contains("[result] 42"), "the value is in the text: {}", text(&r));
    let (_, sc) =
        s.run_with(json!({ "code": "import time\ntime.sleep(1)\nraise ValueError('boom')", "background": true })).await;
    let job = sc["job"].as_str().expect("job").to_owned();
    finished(&s, &job).await;
    let r = s.call("job_status", json!({ "job": job })).await;
    let said = text(&r);
    assert!(said.contains("Traceback") && said.contains("ValueError: boom"), "the traceback is in the text: {said}");
    assert!(said.contains("[status] error"), "{said}");
    s.stop().await;
}
