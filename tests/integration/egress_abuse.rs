//! Egress under attack from the code it serves (issue 27): refusals made as fast as the code
//! can make them must not flood the server's log, and are slowed by the proxy; calls made
//! while a run is under way must not renew its byte budget.

use serde_json::json;

use crate::common::{Server, assert_cleaned_up, gvisor, instance_name, state_dir, text};
use crate::egress::{SECRET, Upstream, config_file, fetch, refused_under_gvisor};

/// Python that makes `n` connections to the proxy from `threads` threads, each asking for a
/// 2 KiB non-name (the reviewer's `a!a!…`), and prints: answered, answered late (over the
/// session's refusal rate), anything else, seconds.
fn flood(n: u32, threads: u32) -> String {
    format!(
        r#"
import os, socket, threading, time
p = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
addr = (p[0], int(p[1]))
req = b"GET http://" + b"a!" * 1000 + b"/ HTTP/1.1\r\n\r\n"
lock = threading.Lock()
left, answered, late, other = [{n}], [0], [0], []
t0 = time.monotonic()
deadline = t0 + 150
def worker():
    while True:
        with lock:
            if left[0] <= 0 or time.monotonic() > deadline:
                return
            left[0] -= 1
        try:
            s = socket.create_connection(addr, timeout=30)
            s.sendall(req)
            r = b""
            while True:
                b = s.recv(65536)
                if not b:
                    break
                r += b
            s.close()
        except Exception as e:
            with lock:
                other.append(repr(e))
            continue
        with lock:
            answered[0] += 1
            if b"refused too often" in r:
                late[0] += 1
            elif not r.startswith(b"HTTP/1.1 403"):
                other.append(r[:80])
ts = [threading.Thread(target=worker) for _ in range({threads})]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(answered[0], late[0], len(other), round(time.monotonic() - t0, 1), other[:3])
"#
    )
}

/// The reviewer's flood: 15,000 refused connections grew the server's log by 206 MiB. Now
/// the log grows by less than 1 MiB, and all but the first few refusals are answered late.
#[tokio::test(flavor = "multi_thread")]
async fn refusals_as_fast_as_code_can_make_them_do_not_flood_the_log() {
    let tag = instance_name("egress-flood");
    let dir = state_dir().join(format!("egress-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("pyberth.toml");
    // The allowed name goes nowhere: every connection of the flood is refused by name.
    std::fs::write(&config, "[environments.net]\negress = [\"upstream.test:8000\"]\n").expect("config");
    let env = [("PYBERTH_CONFIG", config.to_str().expect("utf-8 path")), ("PYBERTH_EGRESS_MAX_CONNS", "128")];
    let s = Server::start_as(&tag, &env).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    let log_size = || std::fs::metadata(&s.log.0).map(|m| m.len()).unwrap_or(0);
    s.ok("warm", "1").await;
    let before = log_size();
    let (r, sc) =
        s.run_with(json!({ "session": "f", "environment": "net", "code": flood(15_000, 96), "timeout_s": 200 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = sc["stdout"].as_str().unwrap_or_default().to_owned();
    let grown = log_size() - before;
    eprintln!("flood (answered, late, other, s): {}; the server's log grew by {grown} bytes", out.trim());
    assert!(grown < 1 << 20, "the server's log grew by {grown} bytes: {out}");
    let n: Vec<u64> = out.split_whitespace().take(3).filter_map(|w| w.parse().ok()).collect();
    assert!(n.len() == 3 && n[0] == 15_000 && n[2] == 0, "every connection answered: {out}");
    assert!(n[1] > 14_000, "refusals past the burst are answered late: {out}");
    // Each refusal is still counted for the run, with the host cut to a name's length.
    let denied = sc["egress"]["denied"].as_array().cloned().unwrap_or_default();
    assert!(!denied.is_empty() && denied.iter().all(|d| d.to_string().len() < 1024), "{sc}");
    let log = s.stop().await;
    assert!(log.matches("egress connection").count() <= 12, "refusals logged one by one past the first few");
    assert_cleaned_up(&tag).await;
}

/// An upstream whose answer echoes the operator's header and ends inside it, at every
/// length: what the sandbox gets through the real proxy is masked to the last byte (before,
/// the bytes held back in case the value went on came out as they were).
#[tokio::test(flavor = "multi_thread")]
async fn an_answer_that_ends_inside_a_secret_ends_masked() {
    let tag = instance_name("egress-cut");
    let up = Upstream::start(&tag).await;
    let config = config_file(&tag, &up);
    let env = [("PYBERTH_CONFIG", config.to_str().expect("utf-8 path")), ("EGRESS_TEST_SECRET", SECRET)];
    let s = Server::start_as(&tag, &env).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    let value = format!("key-{SECRET}");
    let code = format!(
        r#"
import os, socket
p = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
out = []
for k in range(1, {n} + 1):
    s = socket.create_connection((p[0], int(p[1])), timeout=20)
    s.sendall(b"GET http://upstream.test:8000/cut/%d HTTP/1.1\r\nHost: upstream.test\r\n\r\n" % k)
    r = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        r += b
    s.close()
    out.append(r.split(b"\r\n\r\n", 1)[-1].decode("latin-1"))
print("|".join(out))
"#,
        n = value.len()
    );
    let (r, sc) = s.run_with(json!({ "session": "c", "environment": "net", "code": code, "timeout_s": 120 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = sc["stdout"].as_str().unwrap_or_default().trim().to_owned();
    let want: Vec<String> = (1..=value.len()).map(|k| "*".repeat(k)).collect();
    assert_eq!(out, want.join("|"), "an echo cut at every length");
    s.stop().await;
    assert_cleaned_up(&tag).await;
}

/// A call on a session that is running must not give the run under way a fresh byte budget:
/// the model's code (or a prompt telling the model to call again) would otherwise move any
/// amount in one run, 1 MiB per extra call. The call waits behind the run; only a run that
/// holds the session begins a budget.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_waiting_behind_a_run_does_not_renew_its_byte_budget() {
    let tag = instance_name("egress-renew");
    let up = Upstream::start(&tag).await;
    let config = config_file(&tag, &up);
    let env = [
        ("PYBERTH_CONFIG", config.to_str().expect("utf-8 path")),
        ("EGRESS_TEST_SECRET", SECRET),
        ("PYBERTH_EGRESS_MAX_MB", "1"),
    ];
    let s = Server::start_as(&tag, &env).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    // The session made first, so the run below starts at once.
    let (r, _) = s.run_with(json!({ "session": "q", "environment": "net", "code": "1" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    // 700 kB, a pause in which the next call comes, 700 kB more: 1.4 MB against 1 MiB.
    let big = fetch("http://upstream.test:8000/big/700000");
    let code = format!("{big}\nimport time\ntime.sleep(4)\n{big}");
    let first = s.run_with(json!({ "session": "q", "environment": "net", "code": code, "timeout_s": 60 }));
    let second = async {
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        s.run_with(json!({ "session": "q", "environment": "net", "code": "1", "timeout_s": 60 })).await
    };
    let ((r, sc), (r2, _)) = tokio::join!(first, second);
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(r2.is_error, Some(false), "the second call ran after the first: {}", text(&r2));
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.starts_with("200 xxxx"), "the first 700 kB came: {}", &out[..out.len().min(200)]);
    let told = format!("notices {}, egress {}", sc["notices"], sc["egress"]);
    assert!(told.contains("byte budget is spent"), "the second 700 kB was cut: {told}");
    let moved = sc["egress"]["bytes_in"].as_u64().unwrap_or(u64::MAX);
    assert!(moved <= 1 << 20, "the run moved {moved} bytes against a 1 MiB budget");
    s.stop().await;
    assert_cleaned_up(&tag).await;
}
