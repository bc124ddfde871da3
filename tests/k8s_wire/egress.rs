//! Egress on the Kubernetes engine, attack view: the real binary over the simulated API
//! server, its proxy a pod, its sessions told apart by their pods' addresses. The simulator
//! models the NetworkPolicies with an `internal` Docker network of this test's: labelled
//! sandbox pods and the proxy pod on it, every other pod on none (the CNI's job on a cluster).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use super::apiserver::{OnDelete, Options, Sim};
use super::docker;
use super::serve::{Served, node_containers, pods, text};

/// Label on what this test makes outside the simulator (its network, its upstream).
const LABEL_TEST: &str = "pyberth-test.k8s-egress";

const UPSTREAM: &str = r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("upstream ok " + self.path + " key=" + str(self.headers.get("X-Api-Key")) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"#;

fn docker_cli(args: &[&str]) -> String {
    let out = std::process::Command::new("docker").args(args).output().expect("docker");
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Makes the test's `internal` egress network `name` (labelled `label`) on a subnet of its
/// own; returns the address its Services get (the proxy's, `services.rs`), which Docker's own
/// allocation, from the subnet's low end, never hands out first.
pub(super) fn egress_network(name: &str, label: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let third = (std::process::id().wrapping_mul(7) + N.fetch_add(1, Ordering::Relaxed)) % 250;
    let subnet = format!("10.231.{third}.0/24");
    docker_cli(&["network", "create", "--internal", "--subnet", &subnet, "--label", label, name]);
    format!("10.231.{third}.250")
}

/// The operator's secret header for `upstream.test`, which the upstream echoes.
const KEY: &str = "k8s-egress-test-0123456789";

/// An HTTP upstream on the default bridge (where the proxy pod's way out is), answering every
/// GET with its path and the `X-Api-Key` it got, and the test's internal network; both removed
/// when dropped.
struct World {
    network: String,
    upstream: String,
    ip: String,
    /// The address of the proxy's Service on the network.
    service_ip: String,
}

impl World {
    async fn start(tag: &str) -> World {
        let network = format!("pyberth-test-k8s-egress-{}-{tag}", std::process::id());
        let service_ip = egress_network(&network, LABEL_TEST);
        let upstream = format!("pyberth-test-k8s-upstream-{}-{tag}", std::process::id());
        let mut world = World { network, upstream: upstream.clone(), ip: String::new(), service_ip };
        let image = pyberth::docker::image::sandbox_tag();
        let run = ["run", "-d", "--rm", "--name", &upstream, "--label", LABEL_TEST, "--cap-drop", "ALL"];
        let args = ["--user", "65534:65534", "--memory", "128m", &image, "python3", "-c", UPSTREAM];
        docker_cli(&[&run[..], &args[..]].concat());
        let format = "{{.NetworkSettings.Networks.bridge.IPAddress}}";
        world.ip = docker_cli(&["inspect", "-f", format, &upstream]);
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = format!("{}:8000", world.ip).parse().expect("addr");
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_err() {
            assert!(Instant::now() < deadline, "the upstream did not listen");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        world
    }
}

impl World {
    /// The simulator's options for this world: its egress network, the proxy's Service address
    /// there, and the test's binary as the proxy pod's executable.
    fn options(&self) -> Options {
        Options {
            egress_network: Some(self.network.clone()),
            service_ips: vec![self.service_ip.clone()],
            proxy_exe: Some(env!("CARGO_BIN_EXE_pyberth").into()),
            ..Default::default()
        }
    }

    /// A server's config with `extra`: environment `net` allows `upstream.test` (pinned to the
    /// upstream), with the operator's secret header; as `Served::start_tables` takes it.
    fn header_config(&self, extra: &str) -> (String, String) {
        let image = pyberth::docker::image::sandbox_tag();
        let extra = format!("pool_size = 0\n{extra}k8s_egress_image = {image:?}\n");
        let tables = format!(
            "[egress_pin]\n\"upstream.test\" = \"{}\"\n[environments.net]\negress = [\"upstream.test:8000\"]\n\
             [environments.net.egress_headers.\"upstream.test\"]\nX-Api-Key = \"{KEY}\"\n",
            self.ip
        );
        (extra, tables)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker").args(["rm", "-f", &self.upstream]).output();
        let _ = std::process::Command::new("docker").args(["network", "rm", &self.network]).output();
    }
}

/// Python that fetches `url` (through the proxy its variables name, if any) and prints the
/// status and body, or the error.
fn fetch(url: &str) -> String {
    format!(
        r#"
import urllib.request, urllib.error
try:
    r = urllib.request.urlopen({url:?}, timeout=8)
    print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
except Exception as e:
    print("ERR", repr(e))
"#
    )
}

/// [`fetch`] through the proxies `proxies` (a Python dict; `{}`: straight), whatever the
/// session's variables say.
fn through(proxies: &str, url: &str) -> String {
    let opener = format!("urllib.request.build_opener(urllib.request.ProxyHandler({proxies})).open(");
    format!("import urllib.request\n{}", fetch(url).replace("urllib.request.urlopen(", &opener))
}

async fn out(s: &Served, session: &str, env: &str, code: &str) -> String {
    let sc = s.ok("run_python", json!({ "session": session, "environment": env, "code": code, "timeout_s": 60 })).await;
    sc["stdout"].as_str().unwrap_or_default().to_owned()
}

fn ok(out: &str) -> bool {
    out.starts_with("200 upstream ok")
}

fn denied(out: &str) -> bool {
    out.starts_with("403 pyberth egress:")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_sessions_reach_their_list_told_apart_by_their_pods_addresses() {
    let world = World::start("e").await;
    let sim = Sim::start(world.options(), docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-egress-{}", std::process::id()));
    let ip = &world.ip;
    // The proxy pod's image: the sandbox image, the executable bind-mounted by the node.
    let extra = format!("pool_size = 0\nk8s_egress_image = {:?}\n", pyberth::docker::image::sandbox_tag());
    let tables = format!(
        "[egress_pin]\n\"upstream.test\" = \"{ip}\"\n\"other.test\" = \"{ip}\"\n\"denied.test\" = \"{ip}\"\n\
         [environments.net]\negress = [\"upstream.test:8000\", \"other.test:8000\"]\n[environments.plain]\n\
         [environments.net.egress_headers.\"upstream.test\"]\nX-Api-Key = \"{KEY}\"\n"
    );
    let s = Served::start_tables(&sim, &dir, "egress", &extra, &tables).await;

    // Allowed names are reached; a name not on the list is refused, naming why.
    let a = out(&s, "a", "net", &fetch("http://upstream.test:8000/a")).await;
    assert!(ok(&a), "{a}\n{}", s.log());
    // The CA bundle (the server's egress CA, for hosts with headers) is where the variables say.
    let code = "import os\np = os.environ['SSL_CERT_FILE']\nprint(p, 'BEGIN CERTIFICATE' in open(p).read())";
    assert_eq!(out(&s, "a", "net", code).await.trim(), "/tmp/.pyberth-egress/ca.pem True");
    let d = out(&s, "a", "net", &fetch("http://denied.test:8000/")).await;
    assert!(denied(&d) && d.contains("denied.test"), "{d}");
    // No way around the proxy: the upstream's address straight, without the proxy.
    let direct = out(&s, "a", "net", &through("{}", &format!("http://{ip}:8000/"))).await;
    assert!(direct.starts_with("ERR"), "{direct}");

    // A second session narrowed to another name: its pod's address keys its own list.
    assert!(ok(&out(&s, "b", "net", &fetch("http://upstream.test:8000/b")).await));
    let r = s.call("set_network", json!({ "session": "b", "allow_hosts": ["other.test:8000"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let b = out(&s, "b", "net", &fetch("http://upstream.test:8000/b")).await;
    assert!(denied(&b), "narrowed: {b}");
    assert!(ok(&out(&s, "b", "net", &fetch("http://other.test:8000/b")).await));
    assert!(ok(&out(&s, "a", "net", &fetch("http://upstream.test:8000/a")).await), "the first keeps its list");

    // A session without egress reaches nothing: not the upstream, not the proxy pod.
    let proxy_ip = proxy_ip(&sim).expect("the proxy pod has an address");
    let c = out(&s, "c", "plain", &fetch(&format!("http://{ip}:8000/"))).await;
    assert!(c.starts_with("ERR"), "{c}");
    let via = format!("{{'http': 'http://{proxy_ip}:3128'}}");
    let c = out(&s, "c", "plain", &through(&via, "http://upstream.test:8000/")).await;
    assert!(c.starts_with("ERR"), "{c}");

    // The stop removes the sessions' pods and the proxy's; nothing is left on the node.
    let before: Vec<String> = pods(&sim);
    assert_eq!(before.len(), 4, "three sessions and the proxy: {before:?}");
    s.stop().await;
    assert!(pods(&sim).is_empty(), "pods left: {:?}", pods(&sim));
    assert_eq!(node_containers(&sim).await, 0, "containers left on the node");
    let attached = docker_cli(&["network", "inspect", "-f", "{{len .Containers}}", &world.network]);
    assert_eq!(attached, "0", "nothing left on the egress network");
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}

/// The proxy pod's address, as its status says.
fn proxy_ip(sim: &Sim) -> Option<String> {
    let pods = sim.state.pods.lock().expect("pods");
    pods.values().find_map(|p| {
        let labels = p.pod.metadata.labels.clone().unwrap_or_default();
        let proxy = labels.get(pyberth::k8s::pod::LABEL_APP).map(String::as_str) == Some(pyberth::k8s::pod::PROXY_APP);
        proxy.then(|| p.pod.status.as_ref().and_then(|s| s.pod_ip.clone())).flatten()
    })
}

/// Another egress-labelled pod of the namespace (a session of another server, say), as the
/// test's container on the egress network: the address Docker gave it, then what the proxy at
/// `proxy` serves it for `upstream.test`.
fn intruder(network: &str, proxy: &str) -> (String, String) {
    let via = format!("{{'http': 'http://{proxy}:3128'}}");
    let code = format!(
        "import socket\nprint(socket.gethostbyname(socket.gethostname()))\n{}",
        through(&via, "http://upstream.test:8000/stolen")
    );
    let image = pyberth::docker::image::sandbox_tag();
    let run = ["run", "--rm", "--network", network, "--label", LABEL_TEST, "--cap-drop", "ALL", "--user", "65534"];
    let out = docker_cli(&[&run[..], &[image.as_str(), "python3", "-c", &code][..]].concat());
    let (ip, served) = out.split_once('\n').unwrap_or((&out, ""));
    (ip.trim().to_owned(), served.trim().to_owned())
}

/// The address of the one session pod.
fn session_ip(sim: &Sim) -> Option<String> {
    let proxy = proxy_ip(sim);
    let pods = sim.state.pods.lock().expect("pods");
    pods.values()
        .find_map(|p| p.pod.status.as_ref().and_then(|s| s.pod_ip.clone()).filter(|ip| Some(ip) != proxy.as_ref()))
}

/// Attack view: a session's policy (its list and the operator's secret header) is keyed by its
/// pod's address only while that pod has it. The next pod the cluster gives that address (here
/// the test's own container on the egress network: Docker hands out the lowest free address,
/// so it gets the one just freed) is not served with it: not while the session sleeps
/// (hibernated, its pod deleted until its next call), nor as its pod is deleted at its close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_policy_never_outlives_its_pods_address() {
    let world = World::start("u").await;
    let network = world.network.clone();
    // Armed with the proxy's address: every pod deletion from then on lets the intruder in at
    // once, while the server still waits for the deletion's answer.
    let armed: Arc<Mutex<Option<String>>> = Arc::default();
    let seen: Arc<Mutex<Vec<(String, String, String)>>> = Arc::default();
    let hook = {
        let (armed, seen) = (armed.clone(), seen.clone());
        OnDelete(Arc::new(move |_: &str, ip: Option<&str>| {
            let proxy = armed.lock().expect("armed").clone();
            if let (Some(proxy), Some(ip)) = (proxy, ip) {
                let (got, served) = intruder(&network, &proxy);
                seen.lock().expect("seen").push((ip.to_owned(), got, served));
            }
        }))
    };
    let sim = Sim::start(Options { on_delete: Some(hook), ..world.options() }, docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-unbind-{}", std::process::id()));
    let (extra, tables) = world.header_config("hibernate_after_s = 3\n");
    let s = Served::start_tables(&sim, &dir, "unbind", &extra, &tables).await;
    let a = out(&s, "a", "net", &fetch("http://upstream.test:8000/a")).await;
    // (The header comes back masked in the session's output.)
    assert!(ok(&a) && !a.contains("key=None"), "the session reaches the upstream, its header added: {a}\n{}", s.log());
    let before = session_ip(&sim).expect("the session's pod has an address");
    let proxy = proxy_ip(&sim).expect("the proxy pod has an address");

    // Hibernated: its pod is gone; the intruder gets its address and nothing from the proxy.
    let deadline = Instant::now() + Duration::from_secs(60);
    let held =
        || docker_cli(&["network", "inspect", "-f", "{{range .Containers}}{{.IPv4Address}} {{end}}", &world.network]);
    while !s.whole_log().contains("session hibernated session=a") || held().contains(&format!("{before}/")) {
        assert!(Instant::now() < deadline, "not hibernated: {:?}\n{}", pods(&sim), s.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (got, served) = intruder(&world.network, &proxy);
    assert_eq!(got, before, "the intruder got another address than the sleeping session's: nothing shown");
    assert!(!served.contains("upstream ok"), "served with the sleeping session's policy: {served}");

    // Woken: its list is in force again for its new pod. Then the pod's deletion (its close,
    // or a hibernation first on a slow machine) lets the intruder in before the server goes on.
    *armed.lock().expect("armed") = Some(proxy.clone());
    let a = out(&s, "a", "net", &fetch("http://upstream.test:8000/again")).await;
    assert!(ok(&a) && !a.contains("key=None"), "woken, it reaches the upstream again: {a}\n{}", s.log());
    s.ok("close_session", json!({ "session": "a" })).await;
    *armed.lock().expect("armed") = None;
    let seen = seen.lock().expect("seen").clone();
    assert!(!seen.is_empty(), "no pod was deleted: {:?}", pods(&sim));
    for (was, got, served) in seen {
        assert_eq!(got, was, "the intruder got another address than the deleted pod's");
        assert!(!served.contains("upstream ok"), "served with the deleted pod's policy: {served}");
    }
    s.stop().await;
    assert_eq!(pods(&sim).len(), 0, "pods left: {:?}", pods(&sim));
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}

/// Attack view: a session's pod that ends on its own (evicted, its node lost: here its node
/// container removed behind the server's back) leaves its address keyed in the proxy until
/// the server notices. The next pod given that address is still not served: it lacks the
/// session's pass, which the session's proxy URL carries. Without the pass it was served,
/// the operator's header added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_given_a_dead_sessions_address_lacks_its_pass() {
    let world = World::start("p").await;
    let sim = Sim::start(world.options(), docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-pass-{}", std::process::id()));
    let (extra, tables) = world.header_config("");
    let s = Served::start_tables(&sim, &dir, "pass", &extra, &tables).await;
    let a = out(&s, "a", "net", &fetch("http://upstream.test:8000/a")).await;
    assert!(ok(&a) && !a.contains("key=None"), "the session reaches the upstream with its pass: {a}\n{}", s.log());
    let proxy_url = out(&s, "a", "net", "import os\nprint(os.environ['HTTP_PROXY'])").await;
    assert!(proxy_url.trim().starts_with("http://pyberth:"), "the pass is in the proxy URL: {proxy_url}");
    let before = session_ip(&sim).expect("the session's pod has an address");
    let proxy = proxy_ip(&sim).expect("the proxy pod has an address");

    // The pod's container goes behind the server's back; the intruder gets its address.
    let node = sim.state.pods.lock().expect("pods").values().find_map(|p| {
        let ip = p.pod.status.as_ref().and_then(|s| s.pod_ip.clone());
        (ip.as_deref() == Some(before.as_str())).then(|| p.container.clone()).flatten()
    });
    docker_cli(&["rm", "-f", &node.expect("the session pod's node container")]);
    let (got, served) = intruder(&world.network, &proxy);
    assert_eq!(got, before, "the intruder got another address than the dead pod's: nothing shown");
    assert!(!served.contains("upstream ok"), "served with the dead pod's policy: {served}");
    assert!(served.starts_with("407 pyberth egress:") && served.contains("pass"), "{served}");
    s.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}

/// The proxy pod dies behind the server's back (its node container removed): the server makes
/// another at a run, behind the same Service address, which the open session's variables
/// name, and puts the session's policy (address and pass) into it: the session reaches its
/// upstream again, header added, without being made again. The stop deletes the Service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_pod_made_again_keeps_the_sessions_egress() {
    let world = World::start("r").await;
    let sim = Sim::start(world.options(), docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-reproxy-{}", std::process::id()));
    let (extra, tables) = world.header_config("");
    let s = Served::start_tables(&sim, &dir, "reproxy", &extra, &tables).await;
    let a = out(&s, "a", "net", &format!("x = 7\n{}", fetch("http://upstream.test:8000/a"))).await;
    assert!(ok(&a), "{a}\n{}", s.log());
    let url = out(&s, "a", "net", "import os\nprint(os.environ['HTTP_PROXY'])").await;
    assert!(url.trim().ends_with(&format!("@{}:3128", world.service_ip)), "the Service's address: {url}");
    let services =
        |sim: &Sim| sim.state.objects.lock().expect("objects").keys().filter(|(p, _)| p == "services").count();
    assert_eq!(services(&sim), 1);

    let proxy_pod = |sim: &Sim| {
        let pods = sim.state.pods.lock().expect("pods");
        pods.iter()
            .filter(|(n, _)| n.contains("-egress-"))
            .find_map(|(n, p)| p.container.clone().map(|c| (n.clone(), c)))
    };
    let (first, container) = proxy_pod(&sim).expect("the proxy pod runs");
    docker_cli(&["rm", "-f", &container]);
    // A run finds the proxy gone and makes another; a run racing its end may miss it.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let again = out(&s, "a", "net", &format!("print(x)\n{}", fetch("http://upstream.test:8000/again"))).await;
        if again.starts_with("7\n200 upstream ok /again") && !again.contains("key=None") {
            break;
        }
        assert!(Instant::now() < deadline, "the session never reached its upstream again: {again}\n{}", s.log());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (second, _) = proxy_pod(&sim).expect("a proxy pod runs");
    assert_ne!(first, second, "another proxy pod");
    assert!(s.whole_log().contains("session back on the new egress proxy"), "{}", s.log());
    s.stop().await;
    assert_eq!(services(&sim), 0, "the stop deleted the Service");
    assert!(pods(&sim).is_empty(), "pods left: {:?}", pods(&sim));
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}

/// A server killed with an egress session open leaves its session pod, its proxy pod and the
/// proxy's Service; the next server's sweep (once the dead server's heartbeat lapsed) deletes
/// the pods, and with the proxy pod its Service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_servers_proxy_service_goes_with_its_leftovers() {
    let world = World::start("k").await;
    let sim = Sim::start(world.options(), docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-killsvc-{}", std::process::id()));
    let (extra, tables) = world.header_config("");
    let mut first = Served::start_tables(&sim, &dir, "killsvc", &extra, &tables).await;
    assert!(ok(&out(&first, "a", "net", &fetch("http://upstream.test:8000/a")).await), "{}", first.log());
    let services =
        |sim: &Sim| sim.state.objects.lock().expect("objects").keys().filter(|(p, _)| p == "services").count();
    assert_eq!((pods(&sim).len(), services(&sim)), (2, 1), "a session pod, the proxy pod, its Service");
    first.child.start_kill().expect("SIGKILL");
    let _ = first.child.wait().await;

    let next_dir = dir.join("next");
    let (extra, tables) = world.header_config("leftover_grace_s = 1\n");
    let next = Served::start_tables(&sim, &next_dir, "killsvc-next", &extra, &tables).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pods(&sim).is_empty() || services(&sim) > 0 {
        assert!(Instant::now() < deadline, "left: {:?}, {} Service(s)\n{}", pods(&sim), services(&sim), next.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(next.whole_log().contains("deleted a stopped server's egress proxy Service"), "{}", next.log());
    next.stop().await;
    drop(first);
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}
