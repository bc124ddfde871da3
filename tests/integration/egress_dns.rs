//! Live DNS rebinding against the egress proxy (issue 27, "Also"), done as the attacker would:
//! the proxy asks a resolver the test runs (`--egress-dns`), which answers an allowed name
//! with an address that passes the checks and then with a private one (alternating, TTL 0),
//! with both in one answer, with many where only some are private, and with IPv4-mapped IPv6
//! answers. A listener on both the "public" address and the private one records which one
//! each connection reached. Code in a session asks, over plain HTTP and CONNECT, again and
//! again: the private address is never reached, each attempt it was handed out for comes back
//! to the code as a refusal, and each name is resolved once per request (the address checked
//! is the address connected to).

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{Server, assert_cleaned_up, docker, gvisor, instance_name, state_dir, text};
use crate::egress::{networks_of, proxy_of, refused_under_gvisor};

/// The resolver and the listener, in one container: a UDP DNS server on 53 answering names
/// under rebind.test (TTL 0), and a TCP listener on 8000 that says which of its addresses a
/// connection arrived on. Both log to /tmp/log, which only the test reads.
const REBIND: &str = r#"
import os, socket, struct, threading
PUB, PRIV = os.environ["PUB"], os.environ["PRIV"]
lock = threading.Lock()
asked = {}
out = open("/tmp/log", "a")
def log(*a):
    with lock:
        out.write(" ".join(map(str, a)) + "\n")
        out.flush()
def v4(ip):
    return (1, socket.inet_aton(ip))
def v6(ip):
    return (28, socket.inet_pton(socket.AF_INET6, ip))
def records(name, qtype):
    with lock:
        n = asked[(name, qtype)] = asked.get((name, qtype), 0) + 1
    if name == "flip.rebind.test" and qtype == 1:
        return [v4(PUB if n % 2 else PRIV)]
    if name == "both.rebind.test" and qtype == 1:
        r = [v4(PUB), v4(PRIV)]
        return r if n % 2 else r[::-1]
    if name == "many.rebind.test" and qtype == 1:
        r = [v4(PUB), v4("198.51.100.250"), v4("203.0.113.7"), v4(PRIV), v4("127.0.0.1"), v4("169.254.169.254")]
        k = n % len(r)
        return r[k:] + r[:k]
    if name == "mapped.rebind.test":
        return [v4(PUB)] if qtype == 1 else [v6("::ffff:" + PRIV), v6("::ffff:127.0.0.1")]
    if name == "mapped6.rebind.test" and qtype == 28:
        return [v6("::ffff:" + PRIV)]
    if name == "public.rebind.test" and qtype == 1:
        return [v4(PUB)]
    return []
def dns(s):
    while True:
        q, peer = s.recvfrom(512)
        try:
            qid = struct.unpack(">H", q[:2])[0]
            i, labels = 12, []
            while q[i]:
                labels.append(q[i + 1:i + 1 + q[i]].decode("ascii", "replace"))
                i += 1 + q[i]
            qtype = struct.unpack(">H", q[i + 1:i + 3])[0]
            question = q[12:i + 5]
        except Exception:
            continue
        name = ".".join(labels).lower()
        known = name.endswith(".rebind.test")
        rr = records(name, qtype) if known else []
        shown = [socket.inet_ntop(socket.AF_INET if t == 1 else socket.AF_INET6, d) for t, d in rr]
        log("dns", name, qtype, ",".join(shown) or "-")
        head = struct.pack(">HHHHHH", qid, 0x8180 | (0 if known else 3), 1, len(rr), 0, 0)
        body = b"".join(b"\xc0\x0c" + struct.pack(">HHIH", t, 1, 0, len(d)) + d for t, d in rr)
        s.sendto(head + question + body, peer)
def serve(c):
    try:
        local = c.getsockname()[0]
        log("conn", local)
        c.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data:
            b = c.recv(4096)
            if not b:
                break
            data += b
        body = ("reached " + local + "\n").encode()
        c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    except OSError:
        pass
    finally:
        c.close()
def tcp(srv):
    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("0.0.0.0", 53))
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8000))
srv.listen(64)
threading.Thread(target=tcp, args=(srv,), daemon=True).start()
log("ready")
dns(udp)
"#;

/// The names the code asks for, how many times each, alternating two plain HTTP requests and
/// two CONNECTs so that each way meets both of flip's answers.
const ASKS: [(&str, usize); 6] = [("flip", 24), ("both", 6), ("many", 6), ("mapped", 4), ("mapped6", 4), ("public", 2)];

/// The session's code: each ask through the proxy, one at a time, bounded in count and time;
/// prints `{name: ["reached <ip>" | "refused <body>" | "other <what>", ...]}`.
fn attack() -> String {
    let asks: Vec<String> = ASKS.iter().map(|(n, k)| format!("({n:?}, {k})")).collect();
    format!(
        r#"
import json, os, socket, time
p = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
PROXY = (p[0], int(p[1]))
deadline = time.monotonic() + 60
def read_all(s, data=b""):
    while True:
        b = s.recv(4096)
        if not b:
            return data
        data += b
def verdict(data):
    if data.startswith(b"HTTP/1.1 403"):
        return "refused " + data.split(b"\r\n\r\n", 1)[-1].decode("utf-8", "replace").strip()
    if b"reached " in data:
        return "reached " + data.split(b"reached ", 1)[1].decode().strip()
    return "other " + repr(data[:200])
def ask(name, connect):
    host = b"%s.rebind.test:8000" % name.encode()
    s = socket.create_connection(PROXY, timeout=20)
    try:
        if not connect:
            s.sendall(b"GET http://%s/ HTTP/1.1\r\nHost: %s\r\n\r\n" % (host, host))
            return verdict(read_all(s))
        s.sendall(b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (host, host))
        head = b""
        while b"\r\n\r\n" not in head:
            b = s.recv(1)
            if not b:
                break
            head += b
        if not head.startswith(b"HTTP/1.1 200"):
            return verdict(read_all(s, head))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return verdict(read_all(s))
    except OSError as e:
        return "other " + repr(e)
    finally:
        s.close()
seen = {{}}
for name, count in [{asks}]:
    seen[name] = [ask(name, i % 4 >= 2) for i in range(count) if time.monotonic() < deadline]
print(json.dumps(seen))
"#,
        asks = asks.join(", ")
    )
}

/// The test's own network, a documentation range (which the proxy does not refuse), standing
/// for the public internet; and the container of [`REBIND`] on it and on the default bridge,
/// where the proxy's outbound side is. Removed on drop, with anything the test joined to it.
struct Rebind {
    network: String,
    container: String,
    /// Its address on the test's network: passes the proxy's checks.
    public: String,
    /// Its address on the default bridge: a Docker network's, refused as private.
    private: String,
    joined: Vec<String>,
}

fn docker_cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new("docker").args(args).output().expect("docker")
}

impl Rebind {
    async fn start(tag: &str) -> Rebind {
        // A /28 of 198.51.100.0/24 no other network on the engine has (another run's).
        let network = format!("pyberth-test-dns-{tag}");
        let label = "pyberth.test=egress-dns";
        let base = std::process::id() as usize % 14;
        let block = (0..14)
            .map(|k| (base + k) % 14 + 1)
            .find(|k| {
                let subnet = format!("198.51.100.{}/28", k * 16);
                docker_cli(&["network", "create", "--label", label, "--subnet", &subnet, &network]).status.success()
            })
            .expect("a free /28 of 198.51.100.0/24 for the test's network");
        let public = format!("198.51.100.{}", block * 16 + 10);
        let container = format!("pyberth-test-dns-{tag}");
        let mut r = Rebind { network, container, public, private: String::new(), joined: Vec::new() };
        let made = docker_cli(&[
            "create",
            "--name",
            &r.container,
            "--label",
            label,
            "--cap-drop",
            "ALL",
            "--user",
            "65534:65534",
            "--memory",
            "128m",
            "--sysctl",
            "net.ipv4.ip_unprivileged_port_start=0",
            "--network",
            &r.network,
            "--ip",
            &r.public,
            pyberth::docker::image::sandbox_tag().as_str(),
            "sleep",
            "600",
        ]);
        assert!(made.status.success(), "rebind container: {}", String::from_utf8_lossy(&made.stderr));
        let joined = docker_cli(&["network", "connect", "bridge", &r.container]);
        assert!(joined.status.success(), "{}", String::from_utf8_lossy(&joined.stderr));
        let started = docker_cli(&["start", &r.container]);
        assert!(started.status.success(), "{}", String::from_utf8_lossy(&started.stderr));
        let c = docker().await.inspect_container(&r.container, None).await.expect("inspect");
        r.private = c
            .network_settings
            .and_then(|s| s.networks)
            .and_then(|mut n| n.remove("bridge"))
            .and_then(|e| e.ip_address)
            .filter(|ip| !ip.is_empty())
            .expect("an address on the default bridge");
        let env = [format!("PUB={}", r.public), format!("PRIV={}", r.private)];
        let run = docker_cli(&["exec", "-d", "-e", &env[0], "-e", &env[1], &r.container, "python3", "-c", REBIND]);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !r.log().contains("ready") {
            assert!(Instant::now() < deadline, "the resolver did not start: {}", r.log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        r
    }

    /// What the resolver answered and the listener saw.
    fn log(&self) -> String {
        String::from_utf8_lossy(&docker_cli(&["exec", &self.container, "cat", "/tmp/log"]).stdout).into_owned()
    }

    /// Puts `container` on the test's network: its way to the "public" address.
    fn join(&mut self, container: &str) {
        let out = docker_cli(&["network", "connect", &self.network, container]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        self.joined.push(container.to_owned());
    }
}

impl Drop for Rebind {
    fn drop(&mut self) {
        for c in &self.joined {
            let _ = docker_cli(&["network", "disconnect", "-f", &self.network, c]);
        }
        let _ = docker_cli(&["rm", "-f", &self.container]);
        let _ = docker_cli(&["network", "rm", &self.network]);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rebinding_resolver_never_gets_the_proxy_to_a_private_address() {
    let tag = instance_name("egress-dns");
    let mut rebind = Rebind::start(&tag).await;
    let dir = state_dir().join(format!("egress-dns-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("pyberth.toml");
    std::fs::write(&config, "[environments.net]\negress = [\"*.rebind.test:8000\"]\n").expect("config");
    let env = [("PYBERTH_CONFIG", config.to_str().expect("utf-8 path")), ("PYBERTH_EGRESS_DNS", &rebind.private)];
    let s = Server::start_as(&tag, &env).await;
    if gvisor() {
        return refused_under_gvisor(s, &tag).await;
    }
    // The session's first run starts the proxy; then the "internet" is joined to it.
    let (r, _) = s.run_with(json!({ "session": "r", "environment": "net", "code": "1" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    rebind.join(&proxy_of(&tag).await.expect("the proxy"));

    let (r, sc) = s.run_with(json!({ "session": "r", "environment": "net", "code": attack(), "timeout_s": 90 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let out = sc["stdout"].as_str().unwrap_or_default().to_owned();
    let seen: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    judge(&seen, &rebind.log(), &rebind.public, &rebind.private);
    // The run says so too.
    assert!(sc["notices"].to_string().contains("egress denied"), "{sc}");
    assert!(sc["egress"]["denied"].to_string().contains("rebind.test:8000"), "{sc}");

    s.stop().await;
    assert_cleaned_up(&tag).await;
    assert!(networks_of(&tag).await.is_empty());
    let (network, container) = (rebind.network.clone(), rebind.container.clone());
    drop(rebind);
    assert!(!docker_cli(&["network", "inspect", &network]).status.success(), "the test's network is left");
    assert!(!docker_cli(&["inspect", &container]).status.success(), "the resolver's container is left");
}

/// What the code saw (`seen`) against what the resolver answered and the listener recorded
/// (`log`): nothing reached `private`, every request handed it was refused, one lookup each.
fn judge(seen: &Value, log: &str, public: &str, private: &str) {
    let answers = |name: &str| seen[name].as_array().cloned().unwrap_or_default();
    let said = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    for (name, count) in ASKS {
        assert_eq!(answers(name).len(), count, "{name}: every ask answered in time: {seen}");
    }

    // The resolver really handed the proxy the private address, in each shape.
    let dns: Vec<&str> = log.lines().filter(|l| l.starts_with("dns ")).collect();
    let handed = |name: &str, addr: &str| {
        dns.iter().filter(|l| l.starts_with(&format!("dns {name}.rebind.test ")) && l.contains(addr)).count()
    };
    for name in ["flip", "both", "many"] {
        assert!(handed(name, private) > 0, "{name} never answered {private}: {log}");
    }
    assert!(handed("mapped", &format!("::ffff:{private}")) > 0 && handed("mapped6", "::ffff:") > 0, "{log}");

    // What reached the listener: only ever its public address, once per "reached".
    let conns: Vec<&str> = log.lines().filter_map(|l| l.strip_prefix("conn ")).collect();
    let reached = ASKS.iter().flat_map(|(n, _)| answers(n)).filter(|v| said(v).starts_with("reached ")).count();
    assert!(conns.iter().all(|c| *c == public), "a connection reached {conns:?}, not only {public}: {log}");
    assert_eq!(conns.len(), reached, "{log}");
    // flip: one lookup per request (its A queries are its requests), so each request got the
    // one answer it was checked against: the public one reached, the private one refused.
    let flip_a: Vec<&&str> = dns.iter().filter(|l| l.starts_with("dns flip.rebind.test 1 ")).collect();
    assert_eq!(flip_a.len(), 24, "flip resolved once per request: {log}");
    for (i, (asked, got)) in flip_a.iter().zip(answers("flip")).enumerate() {
        let got = said(&got);
        if asked.ends_with(&format!(" {public}")) {
            assert_eq!(got, format!("reached {public}"), "flip #{i}: answered {asked}");
        } else {
            assert!(got.starts_with("refused ") && got.contains(private), "flip #{i}: answered {asked}: {got}");
        }
    }
    // Any private address in an answer refuses the name, however it is mixed in.
    for name in ["both", "many", "mapped", "mapped6"] {
        for got in answers(name) {
            let got = said(&got);
            assert!(got.starts_with("refused ") && got.contains("which the sandbox may never reach"), "{name}: {got}");
        }
    }
    for got in answers("public") {
        assert_eq!(said(&got), format!("reached {public}"), "the control name is served");
    }

    let refused = ASKS.iter().flat_map(|(n, _)| answers(n)).filter(|v| said(v).starts_with("refused ")).count();
    assert_eq!(refused, 12 + 6 + 6 + 4 + 4, "{seen}");
}
