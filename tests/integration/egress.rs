//! Controlled egress (issue 17): sessions reach exactly the hosts their environment allows,
//! through our filtering proxy, and nothing else: not DNS, not UDP, not another session, not
//! the host. Upstreams are containers this file starts itself; the only traffic beyond them
//! and loopback goes to the package index, through the proxy.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{Server, assert_cleaned_up, docker, instance_name, state_dir, text};

/// An HTTP upstream of the test's own: a container on the default bridge (where the proxy's
/// outbound side is) answering every GET with its path and the headers it got.
struct Upstream {
    name: String,
    ip: String,
}

const UPSTREAM: &str = r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("upstream ok " + self.path + "\n" + "".join("%s: %s\n" % kv for kv in self.headers.items())).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"#;

impl Upstream {
    async fn start(tag: &str) -> Upstream {
        let name = format!("pyberth-test-upstream-{tag}");
        let out = std::process::Command::new("docker")
            .args(["run", "-d", "--rm", "--name", &name, "--label", "pyberth.test=egress-upstream"])
            .args(["--cap-drop", "ALL", "--user", "65534:65534", "--memory", "128m"])
            .args([pyberth::docker::image::sandbox_tag().as_str(), "python3", "-c", UPSTREAM])
            .output()
            .expect("docker run");
        assert!(out.status.success(), "upstream: {}", String::from_utf8_lossy(&out.stderr));
        let c = docker().await.inspect_container(&name, None).await.expect("inspect upstream");
        let ip = c
            .network_settings
            .and_then(|s| s.networks)
            .and_then(|mut n| n.remove("bridge"))
            .and_then(|e| e.ip_address)
            .filter(|ip| !ip.is_empty())
            .expect("upstream ip");
        // Listening before any test asks.
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect_timeout(
            &format!("{ip}:8000").parse().expect("addr"),
            Duration::from_millis(300),
        )
        .is_err()
        {
            assert!(Instant::now() < deadline, "upstream did not listen");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Upstream { name, ip }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker").args(["rm", "-f", &self.name]).output();
    }
}

/// A server whose environment `net` allows the upstream (by pinned names, a wildcard and the
/// literal) plus two names the proxy resolves privately, and `pypi` allows the index.
async fn server(tag: &str, up: &Upstream) -> Server {
    let dir = state_dir().join(format!("egress-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("pyberth.toml");
    let ip = &up.ip;
    std::fs::write(
        &config,
        format!(
            "[egress_pin]\n\"upstream.test\" = \"{ip}\"\n\"a.wild.test\" = \"{ip}\"\n\"wild.test\" = \"{ip}\"\n\
             [environments.net]\negress = [\"upstream.test:8000\", \"*.wild.test:8000\", \"{ip}:8000\", \
             \"localhost:8000\", \"pyberth-egress:3128\"]\n\
             [environments.pypi]\negress = [\"pypi.org\", \"files.pythonhosted.org\"]\n"
        ),
    )
    .expect("config");
    Server::start(tag, &[("PYBERTH_CONFIG", config.to_str().expect("utf-8 path"))]).await
}

/// Runs `code` in `session` of environment `env` and returns its structured result.
async fn run(s: &Server, session: &str, env: &str, code: &str) -> Value {
    let (r, sc) = s.run_with(json!({ "session": session, "environment": env, "code": code, "timeout_s": 60 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["status"], "ok", "{sc}");
    sc
}

/// Python that fetches a URL through the proxy and prints status, body and seconds taken.
fn fetch(url: &str) -> String {
    format!(
        r#"
import time, urllib.request, urllib.error
t = time.monotonic()
try:
    r = urllib.request.urlopen({url:?}, timeout=20)
    print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
except Exception as e:
    print("ERR", repr(e))
print("took", time.monotonic() - t)
"#
    )
}

fn took(out: &str) -> f64 {
    out.lines().find_map(|l| l.strip_prefix("took ")).and_then(|t| t.trim().parse().ok()).unwrap_or(f64::MAX)
}

async fn networks_of(instance: &str) -> Vec<String> {
    let label = format!("pyberth.instance={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = bollard::query_parameters::ListNetworksOptionsBuilder::default().filters(&filters).build();
    let nets = docker().await.list_networks(Some(opts)).await.expect("list networks");
    nets.into_iter().filter_map(|n| n.name).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn allowed_names_work_and_everything_else_is_refused_fast() {
    let tag = instance_name("egress");
    let up = Upstream::start(&tag).await;
    let s = server(&tag, &up).await;
    let ip = &up.ip;

    // Allowed by name (pinned), by wildcard and by the operator's literal.
    for url in ["http://upstream.test:8000/a", "http://a.wild.test:8000/b", &format!("http://{ip}:8000/c")] {
        let out = run(&s, "a", "net", &fetch(url)).await["stdout"].as_str().unwrap_or_default().to_owned();
        assert!(out.starts_with("200 upstream ok /"), "{url}: {out}");
        // The proxy forwards origin-form, with no proxy headers.
        assert!(!out.to_ascii_lowercase().contains("proxy-"), "{out}");
    }
    let env = s.call("get_environment", json!({ "session": "a" })).await.structured_content.expect("sc");
    assert_eq!(env["network"], "egress proxy", "{env}");
    assert!(env["egress"].as_array().is_some_and(|l| l.len() == 5), "{env}");

    // Not on the list: a wildcard's apex, another port, another name, the metadata address,
    // a literal the operator did not allow. Each an immediate 403 naming host and rule.
    for (url, why) in [
        ("http://wild.test:8000/", "not on this session's egress allow-list"),
        ("http://upstream.test:8001/", "not on this session's egress allow-list"),
        ("http://example.com/", "not on this session's egress allow-list"),
        ("http://169.254.169.254/latest/meta-data/", "IP literals are refused"),
        ("http://172.17.0.1:8000/", "IP literals are refused"),
        // Allowed names that resolve to loopback and to the proxy's own private address.
        ("http://localhost:8000/", "loopback"),
        ("http://pyberth-egress:3128/", "private"),
    ] {
        let sc = run(&s, "a", "net", &fetch(url)).await;
        let out = sc["stdout"].as_str().unwrap_or_default();
        assert!(out.starts_with("403 pyberth egress:") && out.contains(why), "{url}: {out}");
        let host = url.trim_start_matches("http://").split('/').next().unwrap_or_default();
        assert!(out.contains(host.split(':').next().unwrap_or_default()), "names the host: {out}");
        assert!(took(out) < 1.0, "{url} took {} s", took(out));
        let notices = sc["notices"].to_string();
        assert!(notices.contains("egress denied") && notices.contains(why), "{url}: {notices}");
        assert!(sc["egress"]["denied"].as_array().is_some_and(|d| d.len() == 1), "{sc}");
    }
    // HTTPS to a name not on the list: the tunnel is refused at once.
    let out =
        run(&s, "a", "net", &fetch("https://example.com/")).await["stdout"].as_str().unwrap_or_default().to_owned();
    assert!(out.contains("403") && took(&out) < 1.0, "{out}");

    // Per-run totals: hosts, bytes.
    let sc = run(&s, "a", "net", &fetch("http://upstream.test:8000/count")).await;
    assert_eq!(sc["egress"]["hosts"], json!(["upstream.test:8000"]), "{sc}");
    assert_eq!(sc["egress"]["connections"], 1, "{sc}");
    assert!(sc["egress"]["bytes_in"].as_u64().is_some_and(|b| b > 20), "{sc}");
    assert!(sc["egress"]["bytes_out"].as_u64().is_some_and(|b| b > 20), "{sc}");

    // CONNECT to an allowed host:port opens a tunnel (raw HTTP through it).
    let tunnel = r#"
import os, socket
p = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
s = socket.create_connection((p[0], int(p[1])), timeout=10)
s.sendall(b"CONNECT upstream.test:8000 HTTP/1.1\r\nHost: upstream.test:8000\r\n\r\n")
print(s.recv(100).decode().splitlines()[0])
s.sendall(b"GET /tunnel HTTP/1.0\r\n\r\n")
data = b""
while True:
    b = s.recv(4096)
    if not b: break
    data += b
print(b"upstream ok /tunnel" in data)
"#;
    let out = run(&s, "a", "net", tunnel).await["stdout"].as_str().unwrap_or_default().to_owned();
    assert_eq!(out, "HTTP/1.1 200 Connection established\nTrue\n");

    let log = s.stop().await;
    assert!(
        log.contains("egress connection") && log.contains("verdict=\"denied\"") || log.contains("verdict=denied"),
        "accounting logged"
    );
    assert_cleaned_up(&tag).await;
    assert!(networks_of(&tag).await.is_empty(), "networks left: {:?}", networks_of(&tag).await);
}
