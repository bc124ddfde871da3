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

/// The first line of a text.
fn first_line(t: &str) -> &str {
    t.lines().next().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_megabytes_of_prints_read_as_head_tail_and_where_the_rest_is() {
    let s = Server::start("model-text-budget", &[]).await;
    // 2.5 million numbered lines of 20 bytes: 50 MB.
    let code = "import sys\nfor b in range(2500):\n    \
                sys.stdout.write(''.join('line %09d ....\\n' % i for i in range(b * 1000, b * 1000 + 1000)))\n\
                print('the end', file=sys.stderr)";
    let (r, sc) = s.run_with(json!({ "code": code, "timeout_s": 300 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let said = text(&r);
    assert!(said.chars().count() <= 20_000, "within the default budget: {} characters", said.chars().count());
    let top = first_line(&said);
    assert!(top.starts_with("[output cut to fit 20000 characters"), "the notice is at the top: {top}");
    assert!(top.contains("stdout 50000000 bytes") && top.contains(".pyberth-output/stdout.txt"), "{top}");
    assert!(said.contains("line 000000000 ....\n"), "the head is kept");
    assert!(said.contains("line 002499999 ....\n"), "the tail is kept");
    assert!(said.contains("bytes of stdout cut here"), "a marker between them");
    assert!(said.contains("[stderr]\nthe end\n"), "a short stream stays whole: {said:.300}");
    assert_eq!(sc["truncated"], true);
    assert_eq!(sc["stdout_file"], ".pyberth-output/stdout.txt");
    assert!(sc.get("stderr_file").is_none(), "{sc:.300}");
    // The whole stream, up to its bound (1 MiB of head, 256 KiB of tail), reads back.
    let head = s.call("read_file", json!({ "path": ".pyberth-output/stdout.txt", "length": 1 << 20 })).await;
    let hsc = head.structured_content.expect("structured");
    let size = hsc["size"].as_u64().expect("size");
    assert!(size > (1 << 20) + (256 << 10) && size < (1 << 20) + (257 << 10), "{size}");
    assert!(hsc["content"].as_str().is_some_and(|c| c.starts_with("line 000000000 ....\nline 000000001")));
    let tail = s.call("read_file", json!({ "path": ".pyberth-output/stdout.txt", "offset": size - 40 })).await;
    let tail = tail.structured_content.expect("structured")["content"].as_str().unwrap_or_default().to_owned();
    assert!(tail.ends_with("line 002499999 ....\n"), "{tail}");

    // A huge value's repr keeps its head and tail, and says it was cut.
    let (r, sc) = s.run("default", "list(range(300000))").await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["truncated"], true);
    let value = sc["result"].as_str().expect("result");
    assert!(value.starts_with("[0, 1, 2") && value.chars().count() < 5000, "{value:.200}");
    assert!(text(&r).chars().count() <= 20_000);

    // A job's text is cut the same way, and names the job's own record for the rest.
    let (_, sc) = s
        .run_with(json!({
            "code": "for i in range(400000):\n    print('job line %07d' % i)\n'done'",
            "background": true
        }))
        .await;
    let job = sc["job"].as_str().expect("job").to_owned();
    crate::jobs::finished(&s, &job).await;
    let r = s.call("job_status", json!({ "job": job })).await;
    let said = text(&r);
    assert!(said.chars().count() <= 20_000, "{} characters", said.chars().count());
    assert!(first_line(&said).contains("stdout_offset"), "{}", first_line(&said));
    assert!(said.contains("job line 0000000") && said.contains("[result] 'done'"), "{said:.300}");
    let sc = r.structured_content.expect("structured");
    let next = sc["stdout_offset"].as_u64().expect("offset");
    assert!(next > 0 && next < 20_000, "the next page starts where this one ends: {next}");
    s.stop().await;
}
