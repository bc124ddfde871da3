//! A client that reads slowly (issue 20): the server's writes to it block, and live output
//! must still never hold up the run it reports on. Spoken over raw stdio JSON-RPC, because an
//! rmcp client always reads.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{Raw, assert_cleaned_up, instance_name};

/// A run_python call carrying `meta`.
async fn call(s: &mut Raw, id: u64, arguments: Value, meta: Value) {
    let params = json!({ "name": "run_python", "arguments": arguments, "_meta": meta });
    s.send(json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params })).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_does_not_delay_the_time_limit() {
    let instance = instance_name("slow-client");
    // The server is on the other end of a pipe this test reads only when it chooses to.
    let mut s = Raw::start(&instance);
    s.initialize().await;
    // The session starts first, so the timed call measures only the run.
    call(&mut s, 2, json!({ "session": "slow", "code": "6 * 7" }), json!({})).await;
    let r = s.response(2).await;
    assert_eq!(r["result"]["structuredContent"]["result"], "42", "{r}");

    // Output without end, sent live because the call carries a progress token, to a client
    // that reads nothing for 8 s: the pipe fills within a few chunks and the server's writes
    // block. The 2 s limit must still end the run at about 2 s.
    let flood = "import sys\nline = 'x' * 4095 + '\\n'\nwhile True:\n    sys.stdout.write(line)";
    call(&mut s, 3, json!({ "session": "slow", "code": flood, "timeout_s": 2 }), json!({ "progressToken": "slow-3" }))
        .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let r = s.response(3).await;
    let sc = &r["result"]["structuredContent"];
    assert_eq!(sc["status"], "timeout", "{}", r["result"]["content"]);
    let ms = sc["duration_ms"].as_f64().expect("duration_ms");
    assert!(ms < 4000.0, "the 2 s limit ended the run after {ms} ms: live output stalled it");
    assert!(s.progress > 0, "the output was sent live, so the writes to this client did block");

    drop(s.stdin);
    let status = tokio::time::timeout(Duration::from_secs(30), s.child.wait()).await;
    assert!(status.is_ok(), "the server exits when its stdin closes");
    assert_cleaned_up(&instance).await;
}
