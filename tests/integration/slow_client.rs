//! A client that reads slowly (issue 20): the server's writes to it block, and live output
//! must still never hold up the run it reports on. Spoken over raw stdio JSON-RPC, because an
//! rmcp client always reads.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::common::{assert_cleaned_up, instance_name, state_dir};

/// A server on the other end of a pipe this test reads only when it chooses to.
struct Slow {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    /// Progress notifications read so far.
    progress: usize,
}

impl Slow {
    fn start(instance: &str) -> Slow {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pyberth"))
            .arg("serve")
            .env("PYBERTH_INSTANCE", instance)
            .env("PYBERTH_STATE_DIR", state_dir())
            .env("PYBERTH_POOL_SIZE", "0")
            .env("RUST_LOG", "info")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn pyberth");
        let stdin = child.stdin.take().expect("stdin");
        let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Slow { child, stdin, lines, progress: 0 }
    }

    async fn send(&mut self, msg: Value) {
        let mut line = msg.to_string().into_bytes();
        line.push(b'\n');
        self.stdin.write_all(&line).await.expect("write to the server");
        self.stdin.flush().await.expect("flush");
    }

    /// Reads up to the response carrying `id`, counting progress notifications on the way.
    async fn response(&mut self, id: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = tokio::time::timeout(left, self.lines.next_line())
                .await
                .unwrap_or_else(|_| panic!("no response to request {id} within 60 s"))
                .expect("read from the server")
                .unwrap_or_else(|| panic!("the server closed stdout before answering {id}"));
            let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON from the server: {e}"));
            if v["method"] == "notifications/progress" {
                self.progress += 1;
            }
            if v["id"] == id {
                return v;
            }
        }
    }

    async fn call(&mut self, id: u64, arguments: Value, meta: Value) {
        let params = json!({ "name": "run_python", "arguments": arguments, "_meta": meta });
        self.send(json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params })).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_does_not_delay_the_time_limit() {
    let instance = instance_name("slow-client");
    let mut s = Slow::start(&instance);
    s.send(json!({ "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": { "name": "slow", "version": "0" } } }))
        .await;
    assert!(s.response(1).await["result"]["serverInfo"].is_object());
    s.send(json!({ "jsonrpc": "2.0", "method": "notifications/initialized" })).await;
    // The session starts first, so the timed call measures only the run.
    s.call(2, json!({ "session": "slow", "code": "6 * 7" }), json!({})).await;
    let r = s.response(2).await;
    assert_eq!(r["result"]["structuredContent"]["result"], "42", "{r}");

    // Output without end, sent live because the call carries a progress token, to a client
    // that reads nothing for 8 s: the pipe fills within a few chunks and the server's writes
    // block. The 2 s limit must still end the run at about 2 s.
    let flood = "import sys\nline = 'x' * 4095 + '\\n'\nwhile True:\n    sys.stdout.write(line)";
    s.call(3, json!({ "session": "slow", "code": flood, "timeout_s": 2 }), json!({ "progressToken": "slow-3" })).await;
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
