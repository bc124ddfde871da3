//! Controlled egress (issue 17): sessions reach exactly the hosts their environment allows,
//! through our filtering proxy, and nothing else: not DNS, not UDP, not another session, not
//! the host. Upstreams are containers this file starts itself; the only traffic beyond them
//! and loopback goes to the package index, through the proxy.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{Server, assert_cleaned_up, docker, gvisor, instance_name, state_dir, text};

/// The value the server adds as `X-Api-Key: key-<SECRET>` to plain HTTP requests to
/// upstream.test, from its own environment.
pub(crate) const SECRET: &str = "s3cr3t-0123456789";

/// An HTTP upstream of the test's own: a container on the default bridge (where the proxy's
/// outbound side is) answering every GET with its path and the headers it got.
pub(crate) struct Upstream {
    name: String,
    pub(crate) ip: String,
}

const UPSTREAM: &str = r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/big/"):
            n = int(self.path[5:])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            while n > 0:
                self.wfile.write(b"x" * min(n, 65536))
                n -= 65536
            return
        if self.path.startswith("/cut/"):
            # The operator's header echoed and cut short: the answer ends inside the value.
            v = self.headers.get("X-Api-Key", "")[: int(self.path[5:])].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(v)))
            self.end_headers()
            self.wfile.write(v)
            return
        import hashlib
        key = hashlib.sha256(self.headers.get("X-Api-Key", "").encode()).hexdigest()
        # What arrived, where only the test reads it (the container's log).
        print("got", self.path, "key-sha256:", key, "host:", self.headers.get("Host"), flush=True)
        body = ("upstream ok " + self.path + "\n" + "".join("%s: %s\n" % kv for kv in self.headers.items())
                + "key-sha256: " + key + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
import os
if os.environ.get("TLS_CERT"):
    import ssl, tempfile, threading
    d = tempfile.mkdtemp()
    open(d + "/c", "w").write(os.environ["TLS_CERT"])
    open(d + "/k", "w").write(os.environ["TLS_KEY"])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d + "/c", d + "/k")
    tls = http.server.ThreadingHTTPServer(("0.0.0.0", 8443), H)
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
    threading.Thread(target=tls.serve_forever, daemon=True).start()
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"#;

impl Upstream {
    pub(crate) async fn start(tag: &str) -> Upstream {
        Self::start_with(tag, &[]).await
    }

    /// With `TLS_CERT`/`TLS_KEY` (PEM) in `env`, it also answers HTTPS on 8443.
    async fn start_with(tag: &str, env: &[(&str, &str)]) -> Upstream {
        let name = format!("pyberth-test-upstream-{tag}");
        let mut cmd = std::process::Command::new("docker");
        cmd.args(["run", "-d", "--rm", "--name", &name, "--label", "pyberth.test=egress-upstream"]);
        for (k, v) in env {
            cmd.args(["-e", &format!("{k}={v}")]);
        }
        let out = cmd
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
    server_with(tag, up, &[]).await
}

async fn server_with(tag: &str, up: &Upstream, env: &[(&str, &str)]) -> Server {
    let config = config_file(tag, up);
    let mut env = env.to_vec();
    env.push(("PYBERTH_CONFIG", config.to_str().expect("utf-8 path")));
    env.push(("EGRESS_TEST_SECRET", SECRET));
    Server::start_as(tag, &env).await
}

pub(crate) fn config_file(tag: &str, up: &Upstream) -> std::path::PathBuf {
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
             [environments.pypi]\negress = [\"pypi.org\", \"files.pythonhosted.org\"]\n\
             [environments.net.egress_headers.\"upstream.test\"]\nX-Api-Key = \"key-${{EGRESS_TEST_SECRET}}\"\n"
        ),
    )
    .expect("config");
    config
}

/// Runs `code` in `session` of environment `env` and returns its structured result.
async fn run(s: &Server, session: &str, env: &str, code: &str) -> Value {
    let (r, sc) = s.run_with(json!({ "session": session, "environment": env, "code": code, "timeout_s": 60 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["status"], "ok", "{sc}");
    sc
}

/// Python that fetches a URL through the proxy and prints status, body and seconds taken.
pub(crate) fn fetch(url: &str) -> String {
    fetch_within(url, 20)
}

/// `fetch` that gives up after `secs` (a proxy known to be unreachable need not be waited 20 s).
pub(crate) fn fetch_within(url: &str, secs: u32) -> String {
    format!(
        r#"
import time, urllib.request, urllib.error
t = time.monotonic()
try:
    r = urllib.request.urlopen({url:?}, timeout={secs})
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

pub(crate) async fn networks_of(instance: &str) -> Vec<String> {
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
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
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

/// What session code tries from inside: DNS (the resolver, raw UDP to Docker's embedded one,
/// to the host's, to the proxy), UDP and TCP straight out, TCP to another session and to the
/// proxy's address on another session's network; each prints one word.
const PROBES: &str = r#"
import json, os, socket, struct
def dns(server):
    q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"\x04pypi\x03org\x00" + struct.pack(">HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        s.sendto(q, (server, 53))
        data = s.recv(512)
        return "answers" if struct.unpack(">H", data[6:8])[0] else "no-answer"
    except OSError as e:
        return "failed"
def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "connected"
    except OSError:
        return "failed"
def udp(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        s.sendto(b"ping", (host, port))
        return "answered" if s.recv(64) else "failed"
    except OSError:
        return "failed"
def gateway():
    for line in open("/proc/net/route").read().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            return socket.inet_ntoa(struct.pack("<L", int(f[2], 16)))
    return "0.0.0.0"
def resolve(name):
    try:
        socket.getaddrinfo(name, 443)
        return "resolved"
    except OSError:
        return "failed"
proxy = os.environ.get("HTTP_PROXY", "http://0.0.0.0:1").rsplit("/", 1)[-1].split(":")[0]
probes = {
    "getaddrinfo": (resolve, "pypi.org"),
    "getaddrinfo_pinned": (resolve, "upstream.test"),
    "dns_embedded": (dns, "127.0.0.11"),
    "dns_host": (dns, "10.255.255.53"),
    "dns_proxy": (dns, proxy),
    "udp_upstream": (udp, UPSTREAM, 8000),
    "udp_host_gateway": (udp, gateway(), HOST_PORT),
    "udp_host_bridge": (udp, "172.17.0.1", HOST_PORT),
    "udp_host": (udp, HOST_IP, HOST_PORT),
    "tcp_host_gateway": (tcp, gateway(), HOST_PORT),
    "tcp_host_bridge": (tcp, "172.17.0.1", HOST_PORT),
    "tcp_host": (tcp, HOST_IP, HOST_PORT),
    "tcp_upstream": (tcp, UPSTREAM, 8000),
    "tcp_gateway": (tcp, "172.17.0.1", 2375),
    "tcp_other_session": (tcp, OTHER, 9000),
    "tcp_other_proxy": (tcp, OTHER_PROXY, 3128),
    "tcp_own_proxy": (tcp, proxy, 3128),
}
# All at once: each probe that must fail waits out its 3 s timeout, in parallel, not in turn.
from concurrent.futures import ThreadPoolExecutor
with ThreadPoolExecutor(len(probes)) as pool:
    done = {k: pool.submit(f, *a) for k, (f, *a) in probes.items()}
print(json.dumps({"interfaces": sorted(os.listdir("/sys/class/net")), **{k: f.result() for k, f in done.items()}}))
"#;

/// A TCP and a UDP service on every address of the host (as the server's HTTP mode, or any
/// other host service, may be), answering anything: what a session must never reach.
fn host_services() -> u16 {
    let tcp = std::net::TcpListener::bind("0.0.0.0:0").expect("tcp listener");
    let port = tcp.local_addr().expect("addr").port();
    let udp = std::net::UdpSocket::bind(("0.0.0.0", port)).expect("udp on the same port");
    std::thread::spawn(move || {
        for c in tcp.incoming().flatten() {
            let _ = std::io::Write::write_all(&mut &c, b"host\n");
        }
    });
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(b"host", from);
        }
    });
    port
}

/// The host's first address on its own network (not the loopback, not a bridge).
fn host_ip() -> String {
    let out = std::process::Command::new("hostname").arg("-I").output().expect("hostname -I");
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or("127.0.0.1").to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_reaches_nothing_but_the_proxy() {
    let tag = instance_name("egress-apart");
    let up = Upstream::start(&tag).await;
    let s = server(&tag, &up).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    let (port, host) = (host_services(), host_ip());

    // Session b listens on 9000 and tells its address and its proxy's.
    let listen = r#"
import os, socket, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 9000)); srv.listen(8)
threading.Thread(target=lambda: [srv.accept() for _ in iter(int, 1)], daemon=True).start()
me = socket.gethostbyname(socket.gethostname())
socket.create_connection((me, 9000), timeout=3).close()
print(me, os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")[0])
"#;
    let out = run(&s, "b", "net", listen).await["stdout"].as_str().unwrap_or_default().to_owned();
    let (other, other_proxy) = out.trim().split_once(' ').expect("address and proxy");
    let prelude = format!(
        "UPSTREAM = {:?}\nOTHER = {other:?}\nOTHER_PROXY = {other_proxy:?}\nHOST_PORT = {port}\nHOST_IP = {host:?}\n",
        up.ip
    );
    let code = format!("{prelude}{PROBES}");
    let out = run(&s, "a", "net", &code).await["stdout"].as_str().unwrap_or_default().to_owned();
    let p: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(p["interfaces"], json!(["eth0", "lo"]), "{p}");
    assert_eq!(p["getaddrinfo"], "failed", "a name only resolvable outside: {p}");
    assert_eq!(p["getaddrinfo_pinned"], "failed", "pinned names live in the proxy only: {p}");
    for k in ["dns_embedded", "dns_host", "dns_proxy"] {
        assert_ne!(p[k], "answers", "{k}: {p}");
    }
    for k in ["udp_upstream", "udp_host_gateway", "udp_host_bridge", "udp_host"] {
        assert_eq!(p[k], "failed", "{k}: {p}");
    }
    for k in [
        "tcp_upstream",
        "tcp_gateway",
        "tcp_other_session",
        "tcp_other_proxy",
        "tcp_host_gateway",
        "tcp_host_bridge",
        "tcp_host",
    ] {
        assert_eq!(p[k], "failed", "{k}: {p}");
    }
    assert_eq!(p["tcp_own_proxy"], "connected", "the probe can succeed: {p}");
    // Through the proxy, the other session is an IP literal nobody allowed.
    let out = run(&s, "a", "net", &fetch(&format!("http://{other}:9000/"))).await["stdout"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(out.starts_with("403 ") && out.contains("IP literals are refused"), "{out}");

    // A session without egress still has loopback only.
    let plain = format!("{prelude}{PROBES}");
    let out = s.ok("plain", &plain).await["stdout"].as_str().unwrap_or_default().to_owned();
    let p: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(p["interfaces"], json!(["lo"]), "{p}");
    assert_eq!(p["tcp_upstream"], "failed", "{p}");
    let env = s.call("get_environment", json!({ "session": "plain" })).await.structured_content.expect("sc");
    assert_eq!(env["network"], "none", "{env}");

    let networks = networks_of(&tag).await;
    assert_eq!(networks.len(), 2, "one network per session with egress: {networks:?}");
    s.call("close_session", json!({ "session": "b" })).await;
    assert_eq!(networks_of(&tag).await.len(), 1, "closing a session removes its network");
    s.stop().await;
    assert_cleaned_up(&tag).await;
    assert!(networks_of(&tag).await.is_empty(), "networks left: {:?}", networks_of(&tag).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn callers_narrow_the_list_and_never_widen_it() {
    let tag = instance_name("egress-narrow");
    let up = Upstream::start(&tag).await;
    let s = server(&tag, &up).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    let ok = |out: &str| out.starts_with("200 upstream ok");
    let denied = |out: &str| out.starts_with("403 pyberth egress:");
    let out = |sc: Value| sc["stdout"].as_str().unwrap_or_default().to_owned();

    // At creation: a narrower list is taken, a wider one refused before anything is made.
    let (r, _) =
        s.run_with(json!({ "session": "w", "environment": "net", "allow_hosts": ["example.com"], "code": "1" })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("never widen") && text(&r).contains("example.com"), "{}", text(&r));
    let (r, sc) = s
        .run_with(json!({ "session": "c", "environment": "net", "allow_hosts": ["a.wild.test:8000"],
            "code": fetch("http://upstream.test:8000/") }))
        .await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert!(denied(&out(sc)));
    assert!(ok(&out(run(&s, "c", "net", &fetch("http://a.wild.test:8000/")).await)));

    // At run time: narrowed at once, for this session only.
    assert!(ok(&out(run(&s, "a", "net", &fetch("http://upstream.test:8000/")).await)));
    assert!(ok(&out(run(&s, "other", "net", &fetch("http://upstream.test:8000/")).await)));
    let r = s.call("set_network", json!({ "session": "a", "allow_hosts": ["*.wild.test:8000"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(r.structured_content.expect("sc")["allow_hosts"], json!(["*.wild.test:8000"]));
    assert!(denied(&out(run(&s, "a", "net", &fetch("http://upstream.test:8000/")).await)));
    assert!(ok(&out(run(&s, "a", "net", &fetch("http://a.wild.test:8000/")).await)));
    assert!(ok(&out(run(&s, "other", "net", &fetch("http://upstream.test:8000/")).await)), "others keep theirs");
    // Widening back is refused, even to what the environment allows.
    let r = s.call("set_network", json!({ "session": "a", "allow_hosts": ["upstream.test:8000"] })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("never widen"), "{}", text(&r));
    let r = s.call("set_network", json!({ "session": "a", "allow_hosts": ["*"] })).await;
    assert_eq!(r.is_error, Some(true));
    // Offline.
    let r = s.call("set_network", json!({ "session": "a", "allow_hosts": [] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = run(&s, "a", "net", &fetch("http://a.wild.test:8000/")).await;
    assert!(denied(&out(sc.clone())) && out(sc.clone()).contains("offline"), "{sc}");
    let env = s.call("get_environment", json!({ "session": "a" })).await.structured_content.expect("sc");
    assert_eq!(env["egress"], json!([]), "{env}");
    // A session without egress has nothing to narrow (and [] is a no-op).
    s.ok("plain", "1").await;
    let r = s.call("set_network", json!({ "session": "plain", "allow_hosts": ["pypi.org"] })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("no network"), "{}", text(&r));
    let r = s.call("set_network", json!({ "session": "nope", "allow_hosts": [] })).await;
    assert_eq!(r.is_error, Some(true));
    s.stop().await;
    assert_cleaned_up(&tag).await;
    assert!(networks_of(&tag).await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn pip_and_urllib_reach_the_index_and_nothing_else() {
    let tag = instance_name("egress-pypi");
    let up = Upstream::start(&tag).await;
    let s = server(&tag, &up).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    let code = r#"
import subprocess, sys, time, urllib.request, urllib.error
r = urllib.request.urlopen("https://pypi.org/simple/six/", timeout=60)
print("index", r.status)
p = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--target", "/tmp/t", "six"],
                   capture_output=True, text=True, timeout=240)
print("pip", p.returncode, p.stderr[-500:])
sys.path.insert(0, "/tmp/t")
import six
print("six", six.__version__)
t = time.monotonic()
try:
    urllib.request.urlopen("https://example.com", timeout=20)
    print("example reached")
except Exception as e:
    print("example refused", "403" in repr(e), time.monotonic() - t < 1.0)
"#;
    let (r, sc) = s.run_with(json!({ "session": "p", "environment": "pypi", "code": code, "timeout_s": 300 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("index 200\n") && out.contains("pip 0 ") && out.contains("\nsix 1."), "{out}");
    assert!(out.contains("example refused True True"), "{out}");
    let hosts = sc["egress"]["hosts"].to_string();
    assert!(hosts.contains("pypi.org:443") && hosts.contains("files.pythonhosted.org:443"), "{sc}");
    let notices = sc["notices"].to_string();
    assert!(notices.contains("example.com:443 denied: not on this session's egress allow-list"), "{notices}");
    s.stop().await;
    assert_cleaned_up(&tag).await;
}

/// Under gVisor (registered here with --network=none) a session with egress is refused with
/// a clear error, before anything is made.
pub(crate) async fn refused_under_gvisor(s: Server, tag: &str) {
    let (r, _) = s.run_with(json!({ "session": "g", "environment": "net", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("gVisor") && text(&r).contains("no network"), "{}", text(&r));
    s.ok("plain", "1").await;
    s.stop().await;
    assert_cleaned_up(tag).await;
    assert!(networks_of(tag).await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn egress_under_gvisor_is_a_clear_error() {
    let tag = instance_name("egress-gvisor");
    let up = Upstream::start(&tag).await;
    let s = server_with(&tag, &up, &[("PYBERTH_RUNTIME", "runsc")]).await;
    refused_under_gvisor(s, &tag).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_and_bytes_are_limited_with_clear_errors() {
    let tag = instance_name("egress-limits");
    let up = Upstream::start(&tag).await;
    let s = server_with(&tag, &up, &[("PYBERTH_EGRESS_MAX_CONNS", "2"), ("PYBERTH_EGRESS_MAX_MB", "1")]).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    // Three tunnels held open at once: the third is refused at once, saying why.
    let tunnels = r#"
import os, socket
p = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
held = []
for i in range(3):
    s = socket.create_connection((p[0], int(p[1])), timeout=10)
    s.sendall(b"CONNECT upstream.test:8000 HTTP/1.1\r\n\r\n")
    r = s.recv(4096)
    while not r.startswith(b"HTTP/1.1 200"):
        b = s.recv(4096)
        if not b:
            break
        r += b
    print(r.decode(errors="replace").replace("\r\n", " | ").replace("\n", " ").strip())
    held.append(s)
for h in held:
    h.close()
del held
"#;
    let sc = run(&s, "l", "net", tunnels).await;
    let out = sc["stdout"].as_str().unwrap_or_default();
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines.len() == 3 && lines[..2].iter().all(|l| l.starts_with("HTTP/1.1 200")), "{out}");
    assert!(lines[2].starts_with("HTTP/1.1 429") && lines[2].contains("too many connections"), "{out}");
    assert!(sc["notices"].to_string().contains("--egress-max-conns"), "{sc}");
    // Closed tunnels free their slots.
    assert!(
        run(&s, "l", "net", &fetch("http://upstream.test:8000/")).await["stdout"]
            .as_str()
            .is_some_and(|o| o.starts_with("200 upstream ok"))
    );

    // 3 MB against a 1 MiB budget: cut, and said so; the next run has a fresh budget.
    let big = fetch("http://upstream.test:8000/big/3000000");
    let sc = run(&s, "l", "net", &big).await;
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(!out.starts_with("200 ") || out.len() < 2_000_000, "not cut: {} bytes", out.len());
    assert!(sc["notices"].to_string().contains("byte budget is spent"), "{sc}");
    assert!(sc["egress"]["bytes_in"].as_u64().is_some_and(|b| b <= 1 << 20), "{sc}");
    let sc = run(&s, "l", "net", &fetch("http://upstream.test:8000/big/500000")).await;
    assert!(sc["stdout"].as_str().is_some_and(|o| o.starts_with("200 xxxx")), "{sc}");
    s.stop().await;
    assert_cleaned_up(&tag).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn one_callers_set_network_never_touches_anothers() {
    use crate::http::{ALICE, BOB, HttpServer, call};
    if gvisor() {
        return; // refused_under_gvisor covers it
    }
    let tag = instance_name("egress-principals");
    let up = Upstream::start(&tag).await;
    let config = config_file(&tag, &up);
    let env = [("PYBERTH_CONFIG", config.to_str().expect("utf-8")), ("EGRESS_TEST_SECRET", SECRET)];
    let s = HttpServer::start_with(&tag, &env, None).await;
    let (alice, bob) = (s.client(ALICE).await, s.client(BOB).await);
    let get = fetch("http://upstream.test:8000/");
    let run = |code: &str| json!({ "session": "s", "environment": "net", "code": code });
    for c in [&alice, &bob] {
        let (r, sc) = call(c, "run_python", run(&get)).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        assert!(sc["stdout"].as_str().is_some_and(|o| o.starts_with("200 upstream ok")), "{sc}");
    }
    let (r, _) = call(&alice, "set_network", json!({ "session": "s", "allow_hosts": [] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (_, sc) = call(&alice, "run_python", run(&get)).await;
    assert!(sc["stdout"].as_str().is_some_and(|o| o.starts_with("403 ")), "{sc}");
    let (_, sc) = call(&bob, "run_python", run(&get)).await;
    assert!(sc["stdout"].as_str().is_some_and(|o| o.starts_with("200 upstream ok")), "bob's keeps its list: {sc}");
    let (_, env) = call(&bob, "get_environment", json!({ "session": "s" })).await;
    assert_eq!(env["egress"].as_array().map(Vec::len), Some(5), "{env}");
    drop((alice, bob));
    s.stop().await;
}

/// `egress::Manager::attach_installer`: a container made as the installer would be (the
/// sandbox image, the index's CA bundle) on the network it gives reaches the index through the
/// proxy, and nothing else: not another host, not the host itself.
#[tokio::test(flavor = "multi_thread")]
async fn the_installer_network_reaches_the_index_and_nothing_else() {
    use std::sync::Arc;
    let tag = instance_name("egress-installer");
    let cfg = crate::common::server_settings();
    let owner = pyberth::docker::container::Owner { instance: tag.clone(), host: "test".into() };
    let index = pyberth::packages::IndexSettings::from_config(&cfg).expect("index settings");
    let ca = cfg.ca_bundle().expect("a CA bundle on this host");
    let (engine, _) = pyberth::docker::connect(None).await.expect("engine");
    let manager = pyberth::egress::Manager::new(engine, owner, Arc::new(cfg.clone()), None)
        .with_executable(env!("CARGO_BIN_EXE_pyberth").into());
    let image = pyberth::docker::image::sandbox_tag();
    let net = manager.attach_installer("t", &image, &index).await.expect("installer network");
    assert_eq!(net.allow, ["pypi.org", "files.pythonhosted.org"]);
    let (port, host) = (host_services(), host_ip());
    let code = format!(
        r#"
import socket, subprocess, sys, urllib.request
p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-d", "/tmp/d",
                    "--cert", "/ca.pem", "six"], capture_output=True, text=True)
print("pip", p.returncode, p.stderr[-300:].replace("\n", " "))
try:
    urllib.request.urlopen("http://example.com/", timeout=10)
    print("example reached")
except Exception as e:
    print("example refused", "403" in repr(e))
def tcp(h):
    try:
        socket.create_connection((h, {port}), timeout=3).close()
        return "connected"
    except OSError:
        return "failed"
print("host", tcp({host:?}), tcp("172.17.0.1"))
try:
    socket.getaddrinfo("pypi.org", 443)
    print("dns resolved")
except OSError:
    print("dns failed")
"#
    );
    let mut cmd = std::process::Command::new("docker");
    cmd.args(["run", "--rm", "--network", &net.network, "--cap-drop", "ALL", "--user", "65534:65534"])
        .args(["--label", "pyberth.test=egress-installer", "-v", &format!("{}:/ca.pem:ro", ca.display())])
        .args(["-e", "HOME=/tmp"]);
    for d in &net.dns {
        cmd.args(["--dns", d]);
    }
    for e in &net.env {
        cmd.args(["-e", e]);
    }
    let out = cmd.args([image.as_str(), "python3", "-c", &code]).output().expect("docker run");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(stdout.contains("pip 0 "), "{stdout} {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("example refused True"), "{stdout}");
    assert!(stdout.contains("host failed failed"), "{stdout}");
    assert!(stdout.contains("dns failed"), "{stdout}");
    manager.detach_installer(net).await;
    assert!(networks_of(&tag).await.is_empty(), "detach removes the network");
    manager.shutdown().await;
    assert_cleaned_up(&tag).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn headers_are_added_on_the_way_out_and_never_seen_inside() {
    use sha2::Digest as _;
    let tag = instance_name("egress-headers");
    let up = Upstream::start(&tag).await;
    let s = server(&tag, &up).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    let code = r#"
import os, urllib.request
def get(url):
    req = urllib.request.Request(url, headers={"X-Api-Key": "forged"})
    return urllib.request.urlopen(req, timeout=10).read().decode()
print(get("http://upstream.test:8000/h"))
print(get("http://a.wild.test:8000/h"))
print("in env:", any("s3cr3t" in v for v in os.environ.values()))
"#;
    // The attacks on a host that gets the operator's header: a second request smuggled behind
    // a lone LF (a lenient upstream would give it the header), and TRACE, which echoes it.
    let smuggle = r#"
import os, socket
def raw(head):
    p = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
    s = socket.create_connection((p[0], int(p[1])), timeout=10)
    s.sendall(head)
    data = b""
    while True:
        b = s.recv(4096)
        if not b: break
        data += b
    return data.decode(errors="replace").splitlines()[0]
print(raw(b"GET http://upstream.test:8000/a HTTP/1.1\r\nX: y\n\nGET /b HTTP/1.1\nHost: attacker.example\r\n\r\n"))
print(raw(b"TRACE http://upstream.test:8000/t HTTP/1.1\r\n\r\n"))
"#;
    let sc = run(&s, "h", "net", smuggle).await;
    assert_eq!(sc["stdout"], "HTTP/1.1 400 Bad Request\nHTTP/1.1 400 Bad Request\n", "{sc}");
    let sc = run(&s, "h", "net", code).await;
    let out = sc["stdout"].as_str().unwrap_or_default().to_owned();
    let sha = |v: &str| format!("{:x}", sha2::Sha256::digest(v.as_bytes()));
    let (to_upstream, to_wild) =
        out.split_once("upstream ok /h\n").and_then(|(_, r)| r.split_once("upstream ok /h\n")).expect("two answers");
    // The upstream got the operator's value in place of the code's own...
    assert!(to_upstream.contains(&format!("key-sha256: {}", sha(&format!("key-{SECRET}")))), "{out}");
    assert!(!to_upstream.contains("forged"), "the code's header is replaced: {out}");
    // ...and echoed it, masked on the way back; another host gets the code's header only.
    assert!(to_upstream.contains(&format!("X-Api-Key: {}", "*".repeat(4 + SECRET.len()))), "{out}");
    assert!(to_wild.contains(&format!("key-sha256: {}", sha("forged"))), "{out}");
    assert!(!out.contains(SECRET) && out.contains("in env: False"), "{out}");
    for (tool, args) in [("get_environment", json!({ "session": "h" })), ("list_environments", json!({}))] {
        let r = s.call(tool, args).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        assert!(!format!("{r:?}").contains(SECRET), "{tool} shows the secret");
    }
    let log = s.stop().await;
    assert!(!log.contains(SECRET), "the server's log holds the secret");
    assert_cleaned_up(&tag).await;
}

/// The proxy container of instance `tag`, if any.
pub(crate) async fn proxy_of(tag: &str) -> Option<String> {
    let labels = [format!("pyberth.instance={tag}"), "pyberth.egress=proxy".to_owned()];
    let filters = HashMap::from([("label", labels.iter().map(String::as_str).collect::<Vec<_>>())]);
    let opts = bollard::query_parameters::ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    let found = docker().await.list_containers(Some(opts)).await.expect("list containers");
    found.into_iter().find_map(|c| c.id)
}

/// The proxy is removed under an open session (killed, out of memory): the session's next
/// run starts a new one, at the same address on its network, with its policy and headers.
#[tokio::test(flavor = "multi_thread")]
async fn sessions_follow_a_re_created_proxy() {
    use sha2::Digest as _;
    let tag = instance_name("egress-revive");
    let up = Upstream::start(&tag).await;
    let s = server(&tag, &up).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    let out = run(&s, "r", "net", &fetch("http://upstream.test:8000/one")).await;
    assert!(out["stdout"].as_str().unwrap_or_default().starts_with("200 upstream ok /one"), "{out}");
    let old = proxy_of(&tag).await.expect("a proxy");
    let gone = std::process::Command::new("docker").args(["rm", "-f", &old]).output().expect("docker rm");
    assert!(gone.status.success());
    let code = format!("{}\n{}", fetch("http://upstream.test:8000/two"), fetch("http://example.com/"));
    let sc = run(&s, "r", "net", &code).await;
    let out = sc["stdout"].as_str().unwrap_or_default().to_owned();
    let new = proxy_of(&tag).await.expect("a new proxy");
    assert_ne!(new, old, "the proxy was started again");
    // The same session, unchanged variables: served, with the operator's header, and its
    // list still in force.
    assert!(out.starts_with("200 upstream ok /two"), "{out}");
    let sha = format!("{:x}", sha2::Sha256::digest(format!("key-{SECRET}").as_bytes()));
    assert!(out.contains(&format!("key-sha256: {sha}")), "{out}");
    assert!(out.contains("403 pyberth egress: example.com:80 denied"), "{out}");
    assert_eq!(sc["egress"]["hosts"], json!(["upstream.test:8000"]), "{sc}");
    s.stop().await;
    assert_cleaned_up(&tag).await;
    assert!(networks_of(&tag).await.is_empty());
}

/// A test CA, and a certificate from it for the upstream's names: (CA PEM, cert PEM, key PEM).
fn test_pki() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let ca_key = KeyPair::generate().expect("key");
    let mut ca = CertificateParams::default();
    ca.distinguished_name.push(DnType::CommonName, "pyberth test upstream CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let ca = ca.self_signed(&ca_key).expect("test CA");
    let key = KeyPair::generate().expect("key");
    let mut leaf = CertificateParams::new(vec!["upstream.test".into(), "a.wild.test".into()]).expect("params");
    leaf.use_authority_key_identifier_extension = true;
    let leaf = leaf.signed_by(&key, &ca, &ca_key).expect("leaf");
    (ca.pem(), leaf.pem(), key.serialize_pem())
}

/// An upstream answering HTTPS with a certificate of the test's CA, and a server whose
/// `--ca-bundle` holds that CA (and the host's), whose environment `net` allows the upstream
/// by name and by wildcard on 8443, with a header for upstream.test.
async fn https_setup(tag: &str) -> (Upstream, Server) {
    let tag = tag.to_owned();
    let (ca, cert, key) = test_pki();
    let up = Upstream::start_with(&tag, &[("TLS_CERT", &cert), ("TLS_KEY", &key)]).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect_timeout(
        &format!("{}:8443", up.ip).parse().expect("addr"),
        Duration::from_millis(300),
    )
    .is_err()
    {
        assert!(Instant::now() < deadline, "the HTTPS upstream did not listen");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let dir = state_dir().join(format!("egress-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    // The host's bundle (the package index is behind a TLS-intercepting proxy here) and the test CA.
    let mut bundle = std::fs::read_to_string("/etc/ssl/certs/ca-certificates.crt").unwrap_or_default();
    bundle.push_str(&ca);
    let bundle_path = dir.join("ca.pem");
    std::fs::write(&bundle_path, bundle).expect("bundle");
    let ip = &up.ip;
    let config = dir.join("pyberth.toml");
    std::fs::write(
        &config,
        format!(
            "[egress_pin]\n\"upstream.test\" = \"{ip}\"\n\"a.wild.test\" = \"{ip}\"\n\"other.test\" = \"{ip}\"\n\
             [environments.net]\negress = [\"upstream.test:8443\", \"*.wild.test:8443\"]\n\
             [environments.net.egress_headers.\"upstream.test\"]\nX-Api-Key = \"key-${{EGRESS_TEST_SECRET}}\"\n"
        ),
    )
    .expect("config");
    let s = Server::start_as(
        &tag,
        &[
            ("PYBERTH_CONFIG", config.to_str().expect("utf-8")),
            ("PYBERTH_CA_BUNDLE", bundle_path.to_str().expect("utf-8")),
            ("EGRESS_TEST_SECRET", SECRET),
        ],
    )
    .await;
    (up, s)
}

/// Secrets over HTTPS: the proxy terminates TLS for upstream.test only (it has headers), with
/// a leaf of the per-server CA, verifies the upstream against `--ca-bundle` (the test's CA),
/// and sets the header; other hosts keep a tunnel with the upstream's own certificate.
#[tokio::test(flavor = "multi_thread")]
async fn headers_are_added_over_https_and_other_hosts_are_not_intercepted() {
    use sha2::Digest as _;
    let tag = instance_name("egress-https");
    let (up, s) = https_setup(&tag).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    let code = r#"
import os, socket, ssl, subprocess, urllib.request
def get(url, **h):
    req = urllib.request.Request(url, headers={"X-Api-Key": "forged", **h})
    try:
        return urllib.request.urlopen(req, timeout=10).read().decode()
    except Exception as e:
        return "ERR " + repr(e)
def issuer(host):
    # The certificate the sandbox is shown for host:8443, through a CONNECT of its own.
    proxy = os.environ["HTTPS_PROXY"].split("//")[1]
    h, p = proxy.rsplit(":", 1)
    s = socket.create_connection((h, int(p)), timeout=10)
    s.sendall(("CONNECT %s:8443 HTTP/1.1\r\nHost: %s:8443\r\n\r\n" % (host, host)).encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    t = ctx.wrap_socket(s, server_hostname=host)
    c = t.getpeercert()
    t.close()
    return dict(x[0] for x in c["issuer"])["commonName"]
print("A|" + get("https://upstream.test:8443/tls-h", Host="a.wild.test:8443") + "|")
print("B|" + get("https://a.wild.test:8443/tls-w") + "|")
print("C|" + get("https://other.test:8443/tls-o") + "|")
print("issuer upstream.test:", issuer("upstream.test"))
print("issuer a.wild.test:", issuer("a.wild.test"))
print("in env:", any("s3cr3t" in v for v in os.environ.values()))
bundle = open(os.environ["SSL_CERT_FILE"]).read()
print("key in bundle:", "PRIVATE KEY" in bundle)
found = subprocess.run(["grep", "-rls", "s3cr3t", "/tmp", "/workspace", "/home", "/etc", "/proc/self/environ"],
                       capture_output=True, text=True).stdout
print("in files:", repr(found))
for k in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE"]:
    print(k, os.environ.get(k))
"#;
    let (r, sc) = s.run_with(json!({ "session": "t", "environment": "net", "code": code, "timeout_s": 60 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = sc["stdout"].as_str().unwrap_or_default().to_owned();
    let sha = |v: &str| format!("{:x}", sha2::Sha256::digest(v.as_bytes()));
    let part =
        |k: &str| out.split(&format!("{k}|")).nth(1).and_then(|r| r.split('|').next()).unwrap_or_default().to_owned();
    let (a, b, c) = (part("A"), part("B"), part("C"));
    // Over HTTPS, the upstream got the operator's value in place of the code's, and the Host
    // the proxy connected to, not the one the code forged; its echo comes back masked.
    assert!(a.contains("upstream ok /tls-h"), "{out}");
    assert!(a.contains(&format!("key-sha256: {}", sha(&format!("key-{SECRET}")))), "{out}");
    assert!(a.contains(&format!("X-Api-Key: {}", "*".repeat(4 + SECRET.len()))), "{out}");
    assert!(a.contains("Host: upstream.test:8443") && !a.contains("forged"), "{out}");
    // A host without headers: a tunnel, the upstream's own certificate, the code's header.
    assert!(b.contains("upstream ok /tls-w") && b.contains(&format!("key-sha256: {}", sha("forged"))), "{out}");
    assert!(out.contains("issuer upstream.test: pyberth egress proxy CA"), "{out}");
    assert!(out.contains("issuer a.wild.test: pyberth test upstream CA"), "not intercepted: {out}");
    // A name not on the list is refused before any TLS.
    assert!(c.contains("ERR") && c.contains("403"), "{out}");
    // The secret is nowhere the code can look; the CA's key is not in the session.
    assert!(!out.contains(SECRET) && out.contains("in env: False"), "{out}");
    assert!(out.contains("key in bundle: False") && out.contains("in files: ''"), "{out}");
    for k in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE"] {
        assert!(out.contains(&format!("{k} /tmp/.pyberth-egress/ca.pem")), "{k}: {out}");
    }
    // What the upstream itself logged (the test reads it; the sandbox cannot).
    let logs = std::process::Command::new("docker").args(["logs", &up.name]).output().expect("docker logs");
    let logs = String::from_utf8_lossy(&logs.stdout).into_owned();
    assert!(
        logs.contains(&format!("got /tls-h key-sha256: {} host: upstream.test:8443", sha(&format!("key-{SECRET}")))),
        "{logs}"
    );
    assert!(logs.contains(&format!("got /tls-w key-sha256: {}", sha("forged"))), "{logs}");
    assert!(!logs.contains("/tls-o"), "a refused name reached the upstream: {logs}");
    assert!(sc["egress"]["hosts"].to_string().contains("upstream.test:8443"), "{sc}");

    // A background job's result carries its egress like a run's, and only its own.
    let job_code = r#"
import urllib.request
print(urllib.request.urlopen("https://upstream.test:8443/job", timeout=10).read()[:11].decode())
try:
    urllib.request.urlopen("https://other.test:8443/", timeout=10)
except Exception as e:
    print("refused", e)
"#;
    let (r, started) = s.run_with(json!({ "session": "t", "code": job_code, "background": true })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let job = started["job"].as_str().expect("a job handle").to_owned();
    let r = s.call("job_status", json!({ "job": job, "wait_s": 60 })).await;
    let result = &r.structured_content.as_ref().expect("structured")["result"];
    assert_eq!(result["status"], "ok", "{result}");
    assert!(result["stdout"].as_str().unwrap_or_default().contains("upstream ok"), "{result}");
    assert_eq!(result["egress"]["hosts"], json!(["upstream.test:8443"]), "{result}");
    assert_eq!(result["egress"]["connections"], 1, "{result}");
    assert!(result["egress"]["denied"].to_string().contains("other.test:8443"), "{result}");
    assert!(result["notices"].to_string().contains("egress denied: other.test:8443"), "{result}");
    let log = s.stop().await;
    assert!(!log.contains(SECRET), "the server's log holds the secret");
    assert_cleaned_up(&tag).await;
}

/// `requests`, which the image lacks, installed into a session and used over HTTPS: it
/// trusts the session's bundle through REQUESTS_CA_BUNDLE, and the proxy's rules and headers
/// hold for it as for urllib.
#[tokio::test(flavor = "multi_thread")]
async fn requests_installed_in_a_session_works_through_the_proxy() {
    use sha2::Digest as _;
    let tag = instance_name("egress-requests");
    let (up, s) = https_setup(&tag).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    let code = r#"
import requests
r = requests.get("https://upstream.test:8443/req", headers={"X-Api-Key": "forged"}, timeout=10)
print(r.status_code, r.text.splitlines()[0])
print("wild", requests.get("https://a.wild.test:8443/req-w", timeout=10).status_code)
try:
    requests.get("https://other.test:8443/", timeout=10)
    print("other reached")
except requests.exceptions.ProxyError as e:
    print("other refused", "403" in str(e))
"#;
    let (r, sc) = s
        .run_with(
            json!({ "session": "q", "environment": "net", "code": code, "packages": ["requests"], "timeout_s": 60 }),
        )
        .await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = sc["stdout"].as_str().unwrap_or_default().to_owned();
    assert!(out.contains("200 upstream ok /req\n"), "{out}");
    assert!(out.contains("wild 200") && out.contains("other refused True"), "{out}");
    let logs = std::process::Command::new("docker").args(["logs", &up.name]).output().expect("docker logs");
    let logs = String::from_utf8_lossy(&logs.stdout).into_owned();
    let sha = format!("{:x}", sha2::Sha256::digest(format!("key-{SECRET}").as_bytes()));
    assert!(logs.contains(&format!("got /req key-sha256: {sha}")), "{logs}");
    s.stop().await;
    assert_cleaned_up(&tag).await;
}

/// An egress network a dead server left (its containers already gone) is removed when the
/// next server starts; one of a live instance (it has containers) is not touched.
#[tokio::test(flavor = "multi_thread")]
async fn leftover_networks_of_dead_servers_are_swept_at_start() {
    let tag = instance_name("egress-leftover");
    let dead = format!("{tag}-dead");
    let labels = HashMap::from([
        ("pyberth.managed".to_owned(), "1".to_owned()),
        ("pyberth.instance".to_owned(), dead.clone()),
        ("pyberth.host".to_owned(), "gone".to_owned()),
        ("pyberth.egress".to_owned(), "network".to_owned()),
    ]);
    let req = bollard::models::NetworkCreateRequest {
        name: format!("pyberth-{dead}-s-net0"),
        internal: Some(true),
        labels: Some(labels),
        ..Default::default()
    };
    docker().await.create_network(req).await.expect("a leftover network");
    assert_eq!(networks_of(&dead).await.len(), 1);
    let s = Server::start_as(&tag, &[]).await;
    s.ok("x", "1").await; // the start-up sweep has run by the first answer
    let deadline = Instant::now() + Duration::from_secs(20);
    while !networks_of(&dead).await.is_empty() {
        assert!(Instant::now() < deadline, "the leftover network is still there");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.stop().await;
    assert_cleaned_up(&tag).await;
}
