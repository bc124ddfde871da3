//! The result fitter under a 60 MiB result of many small items: a stress test of a pure function
//! that takes most of a debug build's second (17 s), so it lives here and not in the lib tier,
//! which a developer runs in seconds.

use pyberth::{RESULT_BUDGET, fit_result};
use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::{Value, json};

fn result(text: &str, structured: Value) -> CallToolResult {
    let mut r = CallToolResult::structured(structured);
    r.content = vec![ContentBlock::text(text.to_owned())];
    r
}

#[test]
fn many_small_items_are_cut_too_and_said() {
    // 3000 notices of 8000 characters (text and structured), 2000 small images, and a
    // list of 100 000 tiny entries: no single item is long, together they are 60 MiB.
    let notices: Vec<String> = (0..3000).map(|i| format!("notice {i}: {}", "n".repeat(8000))).collect();
    let entries: Vec<Value> = (0..100_000).map(|i| json!({ "path": format!("f{i}"), "size": i })).collect();
    let mut r = result(
        &notices.join("\n"),
        json!({ "status": "ok", "notices": notices, "entries": entries, "stdout": "x".repeat(10 << 10) }),
    );
    let small = "QUJD".repeat(1 << 10);
    r.content.extend((0..2000).map(|_| ContentBlock::image(small.clone(), "image/png")));
    let fitted = fit_result(r, RESULT_BUDGET);
    let size = serde_json::to_vec(&fitted).expect("json").len();
    assert!(size <= RESULT_BUDGET, "{size}");
    assert!(size > RESULT_BUDGET / 4, "not cut more than needed: {size}");
    let text = fitted.content[0].as_text().expect("text").text.clone();
    assert!(
        text.contains("[left out to fit one MCP message: 2000 images (8192000 bytes)"),
        "{}",
        &text[text.len() - 300..]
    );
    assert!(fitted.content.iter().all(|c| c.as_image().is_none()));
    let sc = fitted.structured_content.expect("structured");
    assert_eq!(sc["status"], "ok");
    assert!(sc["entries"].as_array().is_some_and(|e| !e.is_empty() && e.len() < 100_000));
    assert!(sc["entries"][0]["path"] == "f0", "entries are cut from the end, whole");
}
